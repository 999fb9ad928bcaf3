"""What tests that start ``accelerate launch`` subprocesses need: their environment, and DeepSpeed's
CPU ops built beforehand.

DeepSpeed JIT-compiles its CPU ops (the shared-memory all-reduce, CPU Adam) into
``TORCH_EXTENSIONS_DIR`` under torch's FileBaton: a lock file every other process waits on forever.
A build killed mid-way leaves it behind and every later launch hangs at start-up. So the builds go
to a folder of this clone (a clean clone starts clean), locks older than any build are cleared, and
the ops are built once, in one process, under a timeout, before any launch (as
tests/train/test_deepspeed.py does for the trainer's own launches).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXTENSIONS_DIR = REPO / ".cache" / "torch_extensions"
STALE_LOCK_S = 900  # one op builds in ~30-90 s on 2 cores
BUILD_TIMEOUT = 600


def launch_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with one thread per process, this clone on ``PYTHONPATH`` and the clone's
    extension folder, plus ``extra``."""
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
        TORCH_EXTENSIONS_DIR=str(EXTENSIONS_DIR),
        **extra,
    )


def build_deepspeed_ops(ops: tuple[str, ...] = ("ShareMemCommBuilder",)) -> None:
    """Clear stale build locks, then build ``ops`` in one process (``RuntimeError`` on failure,
    ``subprocess.TimeoutExpired`` past :data:`BUILD_TIMEOUT`)."""
    for lock in EXTENSIONS_DIR.rglob("lock"):
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    code = (
        "from deepspeed.accelerator import get_accelerator\n"
        f"for name in {ops!r}:\n"
        "    get_accelerator().create_op_builder(name).load()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=launch_env(), capture_output=True, text=True, timeout=BUILD_TIMEOUT
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-6000:])
