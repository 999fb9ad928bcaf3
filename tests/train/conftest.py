"""Session fixtures of the RingTrainerMixin tests: every 2-rank run in one spawn and every 4-rank
run in another (importing torch, transformers and TRL costs a process tens of seconds on 2 cores;
a trainer in a warm process, a few). The runs are described in tests/train/hf_runs.py; the tests
that read them: test_hf_trainer.py, test_hf_fsdp.py, test_hf_launch.py (whose launched runs are
compared with one-process references computed here); TRL's DPO and GRPO trainers' runs
(test_hf_dpo.py, test_hf_grpo.py) share a third."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from ringft.utils.spawn import run_distributed
from tests.train.hf_runs import (
    NEW_USER_SFT,
    NEW_USER_SFT_TRL_DEFAULTS,
    phased_worker,
    spec,
    tiny_model_dir,
    zero3_argv,
)

REPO = Path(__file__).resolve().parents[2]
SPAWN_TIMEOUT = 600.0


@pytest.fixture(scope="module")
def short_data(tmp_path_factory) -> str:
    """16 rows of 60 random token ids (a saved ``datasets`` folder) for in-process trainer runs."""
    import datasets
    import torch

    gen = torch.Generator().manual_seed(7)
    rows = [torch.randint(3, 200, (60,), generator=gen).tolist() for _ in range(16)]
    path = tmp_path_factory.mktemp("data") / "rows"
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(path))
    return str(path)


@pytest.fixture(scope="session")
def trl_runs_4(tmp_path_factory, hf_root) -> dict[str, dict]:
    """test_hf_dpo.py's and test_hf_grpo.py's runs, in one 4-rank spawn (tests/train/trl_runs.py);
    the DPO recipe's one-process reference on ``hf_root``'s tiny model."""
    from tests.train.trl_runs import dpo_plan, grpo_plan, spawn_plans

    root = tmp_path_factory.mktemp("trl")
    dpo = dpo_plan(str(root / "dpo"), str(hf_root / "tiny"))
    return spawn_plans(root, dpo, grpo_plan(str(root / "grpo")), timeout=SPAWN_TIMEOUT)


def _collect(names: list[str], results: list[list[dict]]) -> dict[str, dict]:
    """``name`` -> rank 0's result, ``name@r`` -> rank r's."""
    out = {}
    for rank, per_rank in enumerate(results):
        for name, res in zip(names, per_rank):
            out[name if rank == 0 else f"{name}@{rank}"] = res
    return out


def run_cpu_oracle_argv(model: Path, out: Path) -> list[str]:
    """recipes/trl_sft/run_cpu.sh's one-process command (``ONE_PROCESS=1 DRY_RUN=1``): its
    sft.py arguments, as shipped."""
    env = dict(os.environ, ONE_PROCESS="1", DRY_RUN="1", MODEL=str(model), OUTPUT_DIR=str(out))
    line = subprocess.run(
        ["bash", str(REPO / "recipes" / "trl_sft" / "run_cpu.sh")], env=env, capture_output=True, text=True
    ).stdout.strip()
    words = shlex.split(line)
    return words[words.index("recipes/trl_sft/sft.py") + 1 :]


@pytest.fixture(scope="session")
def deepspeed_ops() -> None:
    """DeepSpeed's CPU all-reduce op built (tests/train/launch_env.py) before a DeepSpeed launch."""
    pytest.importorskip("deepspeed")
    from tests.train.launch_env import BUILD_TIMEOUT, EXTENSIONS_DIR, build_deepspeed_ops

    try:
        build_deepspeed_ops()
    except subprocess.TimeoutExpired:
        pytest.fail(f"DeepSpeed CPU op build took over {BUILD_TIMEOUT} s (held lock in {EXTENSIONS_DIR}?)")


@pytest.fixture(scope="session")
def hf_root(tmp_path_factory) -> Path:
    """Scratch folder of the mixin runs, with the tiny model saved (``tiny``)."""
    root = tmp_path_factory.mktemp("hf")
    tiny_model_dir(root / "tiny")
    return root


@pytest.fixture(scope="session")
def hf_two(hf_root) -> dict[str, dict]:
    """The 2-process spawn: one-process references (each rank runs its own list, no group), then
    dp2 DDP references, the dp1 x cp2 ring runs and the FSDP steps."""
    from tests.real_model import smollm2_path

    r = hf_root
    alone = [
        {
            "one": spec(f"{r}/one", evaluate=True, predict=True),
            "one-ga": spec(f"{r}/one-ga", mb=1, ga=2, gc=True),
            "one-epoch": spec(f"{r}/one-epoch", steps=0, rows=21),
            "smollm2-one": spec(
                f"{r}/s1", kind="script", argv=run_cpu_oracle_argv(smollm2_path(), r / "smollm2-one")
            ),
        },
        {
            "one-sft": spec(f"{r}/one-sft", kind="sft", evaluate=True),
            "one-lora": spec(f"{r}/one-lora", lora=True),
            "one-moe": spec(f"{r}/one-moe", moe=True, evaluate=True),
            "inert": spec(f"{r}/inert", mixin=True, cp=1),
            "one-sft-user": spec(f"{r}/one-sft-user", **NEW_USER_SFT),
            "one-sft-user-bf16": spec(f"{r}/one-sft-user-bf16", **NEW_USER_SFT_TRL_DEFAULTS),
            "zero3-one": spec(
                f"{r}/z1", kind="script", argv=zero3_argv(str(r / "tiny"), str(r / "zero3-one"))
            ),
        },
    ]
    ring = dict(mixin=True, cp=2)
    together = {
        "ddp": spec(f"{r}/ddp", evaluate=True, predict=True),
        "ddp-off": spec(f"{r}/ddp-off", avg=False),
        "ddp-epoch": spec(f"{r}/ddp-epoch", steps=0, rows=21),
        "cp": spec(f"{r}/cp", **ring, evaluate=True, predict=True, save=2),
        "cp-resumed": spec(f"{r}/cp", **ring, resume=f"{r}/cp/checkpoint-2"),
        "cp-ga": spec(f"{r}/cp-ga", **ring, mb=1, ga=2, gc=True, attn="save"),
        "cp-epoch": spec(f"{r}/cp-epoch", **ring, steps=0, rows=21),
        "cp-sft": spec(f"{r}/cp-sft", kind="sft", **ring, evaluate=True),
        "cp-sft-user": spec(f"{r}/cp-sft-user", **ring, **NEW_USER_SFT),
        "cp-sft-user-bf16": spec(f"{r}/cp-sft-user-bf16", **ring, **NEW_USER_SFT_TRL_DEFAULTS),
        "cp-lora": spec(f"{r}/cp-lora", **ring, lora=True),
        "cp-moe": spec(f"{r}/cp-moe", **ring, moe=True, evaluate=True),
        "cp-left-padded": spec(f"{r}/cp-left", **ring, collate="left"),
        "fsdp": spec(f"{r}/fsdp", kind="fsdp"),
    }
    lists = [list(a.values()) for a in alone]
    results = run_distributed(
        phased_worker, 2, lists, list(together.values()), str(r / "store2"), timeout=SPAWN_TIMEOUT
    )
    out = _collect(list(together), [res["together"] for res in results])
    for rank, names in enumerate(alone):
        out.update(zip(names, results[rank]["alone"]))
    return out


@pytest.fixture(scope="session")
def hf_four(hf_root) -> dict[str, dict]:
    """The 4-process spawn: the dp2 x cp2 ring runs, cp 4 = ulysses 2 x ring 2 (dp 1) and a ring of 4."""
    r, ring, hybrid = hf_root, dict(mixin=True, cp=2), dict(mixin=True, cp=4, ulysses=2)
    runs = {
        "dp-cp": spec(f"{r}/dp-cp", **ring, evaluate=True, predict=True),
        "dp-cp-off": spec(f"{r}/dp-cp-off", **ring, avg=False),
        "dp-cp-epoch": spec(f"{r}/dp-cp-epoch", **ring, steps=0, rows=21),
        "ulysses": spec(f"{r}/ulysses", **hybrid, evaluate=True, predict=True),
        "ulysses-sft": spec(f"{r}/ulysses-sft", kind="sft", **hybrid, evaluate=True),
        "cp4-sft-user": spec(f"{r}/cp4-sft-user", mixin=True, cp=4, **NEW_USER_SFT),
    }
    results = run_distributed(
        phased_worker, 4, [], list(runs.values()), str(r / "store4"), timeout=SPAWN_TIMEOUT
    )
    return _collect(list(runs), [res["together"] for res in results])
