"""The tiny training the trainer tests run, importable by spawned ranks (plain functions).

Every training is a tiny fp32 LLaMA built from config (hidden 32, 1 layer, the shipped "demo"
tokenizer) on a saved random-token dataset with seq_len 64 (:func:`save_random_tokens`; the
synthetic line-retrieval data needs at least ~128 tokens). Examples have ragged lengths and masked
prefixes, so replicas hold different numbers of valid targets: a wrong loss normalisation across
DP / CP / micro-steps changes the step loss by >= 1 / (valid targets of a step, ~125) = 8e-3
relative, and a wrong data order or a skipped optimizer step changes the weights' update by whole
per cents.

Tolerances (derived, not fitted; issue 18). The runs compared compute the same math with the fp32
sums in another order (ring vs full attention, sharded vs whole batch, chunked vs full logits).
Recursive summation of n terms is off by at most (n - 1) * eps relative, so:
- a step's loss, a mean over the step's TOKENS_PER_STEP tokens of a log-sum-exp over VOCAB logits:
  LOSS_RTOL = (TOKENS_PER_STEP + VOCAB) * eps = 2.3e-4 (35x below the 8e-3 of a wrong denominator);
- the weights after STEPS AdamW steps, compared as updates (final - initial, per tensor, relative to
  the norm of the reference update): AdamW's update is scale-free, so the gradients' relative
  error (the same reductions) passes into it 1:1 and adds up over the steps:
  UPDATE_RTOL = STEPS * LOSS_RTOL = 9e-4 (a skipped step changes the update by ~25 %).
Resuming from a checkpoint replays the same operations in the same order: bit-exact.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ringft.train.recipe import recipe_from_dict

EPS32 = torch.finfo(torch.float32).eps
VOCAB = 1658  # len() of the shipped demo tokenizer: the log-sum-exp's reduction length
TOKENS_PER_STEP = 4 * 64  # tiny_recipe: a global batch of 4 sequences of data.seq_len 64
STEPS = 4  # tiny_recipe's train.max_steps
LOSS_RTOL = (TOKENS_PER_STEP + VOCAB) * EPS32  # worst-case reordered fp32 sums of one step's loss
UPDATE_RTOL = STEPS * LOSS_RTOL  # the gradients' relative error, passed 1:1 by AdamW, over STEPS steps
RUN_TIMEOUT = 240.0  # run_distributed's own timeout (a hang fails instead of blocking the suite)


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def tiny_recipe(output_dir, data_path, **sections) -> dict:
    """A raw recipe mapping (what a YAML file parses to); ``sections`` override per section."""
    raw = {
        "model": {
            "config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 128,
            },
            "model_type": "llama",
            "tokenizer": "demo",
            "dtype": "fp32",
            "attn_backend": "torch",
        },
        "data": {"path": str(data_path), "seq_len": 64},
        "parallel": {"cp_size": 1},
        "train": {
            "micro_batch_size": 2,
            "grad_accum": 1,
            "max_steps": 4,
            "lr": 1e-3,
            "warmup_steps": 1,
            "schedule": "cosine",
            "min_lr_ratio": 0.1,
            "grad_clip": 1.0,
            "gradient_checkpointing": False,
            "chunked_loss": False,
            "loss_chunk_size": 16,
            "seed": 0,
        },
        "checkpoint": {"output_dir": str(output_dir), "save_every": 0, "keep": 2},
        "logging": {"tracker": "none"},
    }
    return _merge(raw, sections)


def save_random_tokens(path: Path) -> str:
    """48 random-token examples of 20..64 tokens saved at ``path``; labels mask a random prefix (a
    "prompt"). Returns ``str(path)``."""
    import datasets

    gen = torch.Generator().manual_seed(1234)
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
    for _ in range(48):
        n = int(torch.randint(20, 65, (1,), generator=gen))
        ids = torch.randint(3, 200, (n,), generator=gen).tolist()  # 0..2 are the demo specials
        labels = list(ids)
        k = int(torch.randint(0, n // 2, (1,), generator=gen))
        labels[:k] = [-100] * k
        rows["input_ids"].append(ids)
        rows["labels"].append(labels)
    datasets.Dataset.from_dict(rows).save_to_disk(str(path))
    return str(path)


def final_weights(output_dir) -> dict[str, torch.Tensor]:
    """The exported weights of a run (``output_dir/final/*.safetensors``)."""
    from safetensors.torch import load_file

    files = sorted((Path(output_dir) / "final").glob("*.safetensors"))
    assert files, f"no safetensors in {output_dir}/final"
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def initial_weights(raw: dict) -> dict[str, torch.Tensor]:
    """The weights a run of ``raw`` (a model built from config, seeded) starts from."""
    from ringft.train.build import build_model

    return build_model(recipe_from_dict(raw), vocab_size=VOCAB).state_dict()


def update_errors(final: dict, reference: dict, initial: dict) -> dict[str, float]:
    """Per tensor: ||(final - initial) - (reference - initial)|| / ||reference - initial||.

    A tensor the reference did not move must not move (error 0 or inf)."""
    assert sorted(final) == sorted(reference), (sorted(final), sorted(reference))
    errors = {}
    for name, ref in reference.items():
        start = initial[name].to(ref.dtype)
        moved = (ref - start).double().norm().item()
        diff = (final[name] - ref).double().norm().item()
        errors[name] = diff / moved if moved else (0.0 if diff == 0 else float("inf"))
    return errors


def assert_updates_close(final: dict, reference: dict, initial: dict, rtol: float) -> None:
    """The runs' updates agree within ``rtol`` (relative, per tensor), and the reference trained."""
    total = sum(
        (reference[k] - initial[k].to(reference[k].dtype)).double().norm().item() ** 2 for k in reference
    )
    assert total > 0, "the reference run did not change any weight"
    errors = update_errors(final, reference, initial)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= rtol, (
        f"update of {worst} differs by {errors[worst]:.3e} of its norm (rtol {rtol:.1e})"
    )


def assert_weights_equal(a: dict, b: dict) -> None:
    """Bit-exact (for runs that replay the same operations, e.g. a resume)."""
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


class FrontRun:
    """A one-process ``ringft train`` (:mod:`ringft.train.front`) built and not
    yet run: ``model`` (the trainer's, LoRA-wrapped if the recipe asks), :meth:`run`."""

    def __init__(self, raw: dict):
        from ringft.train import front

        self.recipe = recipe_from_dict(raw)
        self.trainer, self.folder = front.build_trainer(self.recipe, progress=False)
        self.model = self.trainer.model

    def run(self) -> Any:
        from ringft.train import front

        try:
            return front._run(self.trainer, self.folder, self.recipe)
        finally:
            self.folder.release()


@contextlib.contextmanager
def in_process_front(raw: dict) -> Iterator[FrontRun]:
    """:class:`FrontRun` for ``raw``; on exit its run-folder lock is released and accelerate's
    process-global state reset, so the next trainer of the test process starts clean."""
    from accelerate.state import AcceleratorState, GradientState

    run = None
    try:
        run = FrontRun(raw)
        yield run
    finally:
        if run is not None:
            run.folder.release()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
