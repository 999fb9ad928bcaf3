"""The GPU session script (tools/gpu_session.sh) dry-run on a CPU: every stage it runs on a lent GPU
(env, tiles, the two capacity traces, attnckpt, the ZeRO-3-offload launch, ringeff, profile, train)
runs with ``RINGFT_GPU_TINY=1`` (tiny model, lengths / 256, the CPU device) and finishes without a
failure or a skip. It takes minutes on 2 cores (one DeepSpeed launch, several fresh processes), so
it runs only when asked: ``RINGFT_GPU_SESSION_DRY_RUN=1 python -m pytest tests/test_gpu_session.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
STAGES = ("env", "tiles", "trace", "attnckpt", "sharded", "ringeff", "profile", "train")

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("RINGFT_GPU_SESSION_DRY_RUN") != "1",
        reason="minutes on 2 cores: set RINGFT_GPU_SESSION_DRY_RUN=1 to run the GPU session dry",
    ),
    pytest.mark.skipif(torch.cuda.is_available(), reason="a dry run is for a machine without CUDA"),
]


@pytest.mark.timeout(1200)
def test_gpu_session_runs_every_stage_on_cpu(tmp_path):
    env = dict(
        os.environ,
        RINGFT_GPU_TINY="1",
        DEADLINE_S="1000",
        OUT=str(tmp_path / "out"),
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
    )
    run = subprocess.run(
        ["bash", "tools/gpu_session.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=1100
    )
    log = (tmp_path / "out" / "session.log").read_text()
    assert run.returncode == 0, run.stderr[-3000:]
    done = re.findall(r"^=== (\w+) .*took (\d+) s$", log, flags=re.M)
    assert sorted({name for name, _ in done}) == sorted(STAGES), log[-3000:]
    assert len(done) == 9  # the trace stage runs twice (384K and 512K on a GPU)
    for bad in ("SKIP", "FAILED", "Traceback", "unknown stage"):
        assert bad not in log, log[-3000:]
    assert {"logs.tgz", "session.log"} <= {p.name for p in (tmp_path / "out").iterdir()}  # no traces on CPU
