"""Shared fixtures of the test suite, and where the shared helpers live.

Tests spawn gloo ranks with ``ringft.utils.spawn.run_distributed``; a spawned rank imports its worker
by module path, so every helper a worker may call is a plain function in a plain module (never in a
test module: no test module imports another one, tests/test_architecture.py checks it):

- tests/tiny_models.py: ``tiny_model`` (2-layer LLaMA / Mistral, vocabulary ``VOCAB`` = 96, eager),
  ``ragged_examples``, ``save_tiny_model`` (1-layer LLaMA + demo tokenizer, saved),
  ``compare_with_reference`` (a CP rank's run vs one process), ``document_examples`` /
  ``documents_reference`` (packed documents, each alone through the model);
- tests/model/family_models.py: a tiny model of every supported family; tests/ops/window_checks.py:
  the windowed ring operator's inputs, fp64 oracle and distributed check;
- tests/tiny_training.py: ``tiny_recipe`` (the raw recipe of the trainer tests), its tolerances
  ``LOSS_RTOL`` / ``UPDATE_RTOL`` (derived there), ``save_random_tokens``, and the weight comparisons
  ``final_weights`` / ``initial_weights`` / ``assert_updates_close`` / ``assert_weights_equal``;
- tests/workers.py: the ranks' side: ``one_thread``, ``fresh_group`` (a fresh process group after a
  Trainer ended its own), ``inject_kill``, ``train_runs``;
- tests/oracle.py: fp64 attention oracles; tests/real_model.py: the SmolLM2-135M and Gemma 3 270M weights.

The fixtures below are built once per session, and only for the tests that ask for them (no
per-test cost for the others).

Tests of tests/ops, tests/loss, tests/data and tests/model (but the real-weights files) run with
one torch thread, fixtures included: their tensors are tiny, and a second thread only adds
barriers (3-10x the wall time on a busy 2-core machine). Spawned ranks run one thread each.

Spawned ranks start as forks of one fork server per pytest process (``ringft.utils.spawn``), which
imports torch and the modules below once: a rank then costs a fork, not 5-10 s of imports on a busy
2-core machine (transformers' modeling code is most of it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_MODELS = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "olmo2")
_MODELS += ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # the Gated DeltaNet hybrids
os.environ.setdefault(
    "RINGFT_SPAWN_PRELOAD",
    ",".join(
        [
            "transformers.modeling_utils",
            *(f"transformers.models.{m}.modeling_{m}" for m in _MODELS),
            "peft",
            "datasets",
            "trl.trainer.dpo_trainer",  # the TRL trainers' ranks (tests/train/trl_runs.py)
            "trl.trainer.grpo_trainer",
            "ringft.model",
            "ringft.train",
            "tests.tiny_models",
            "pytest",  # a rank re-runs pytest's __main__ (multiprocessing's main-module fix-up)
        ]
    ),
)

# Helpers are imported inside the fixtures: collecting a test that needs none of them (the
# architecture test) does not import torch.


@pytest.fixture(scope="session")
def data_path(tmp_path_factory) -> str:
    """tiny_recipe's training data: 48 random-token examples of 20..64 tokens, labels masking a
    random prefix (a "prompt"); a saved ``datasets`` folder, read-only."""
    from tests.tiny_training import save_random_tokens

    return save_random_tokens(tmp_path_factory.mktemp("data") / "random_tokens")


@pytest.fixture(scope="session")
def saved_tiny_model(tmp_path_factory) -> Path:
    """``save_tiny_model``'s folder (1-layer random LLaMA + the demo tokenizer), read-only."""
    from tests.tiny_models import save_tiny_model

    path = tmp_path_factory.mktemp("tiny") / "model"
    save_tiny_model(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def _fork_server(request) -> None:
    """Start the fork server while the first tests run (its imports take one core for a few seconds)
    when a collected test module spawns ranks. Started here, inside the first test's output capture,
    it hands the ranks that capture's files (not the terminal)."""
    items = request.session.items
    if any("run_distributed" in vars(getattr(item, "module", None) or object) for item in items):
        from ringft.utils.spawn import start_fork_server

        start_fork_server()


_ONE_THREAD_DIRS = {"ops", "loss", "data", "model"}
_REAL_WEIGHTS = {"test_real_model.py", "test_gemma3_real.py"}  # matmuls big enough for 2 threads


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """One torch thread around a tiny-tensor test's whole protocol (module fixtures included)."""
    parts = item.path.relative_to(Path(__file__).parent).parts
    if parts[0] not in _ONE_THREAD_DIRS or item.path.name in _REAL_WEIGHTS:
        return (yield)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return (yield)
    finally:
        torch.set_num_threads(threads)
