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


def start_deepspeed_build(ops: tuple[str, ...] = ("ShareMemCommBuilder",)) -> subprocess.Popen:
    """Clear stale build locks, then start building ``ops`` in one background process (so that a
    test can do one-process work on the other core meanwhile); :func:`finish_deepspeed_build`
    waits for it."""
    for lock in EXTENSIONS_DIR.rglob("lock"):
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    code = (
        "from deepspeed.accelerator import get_accelerator\n"
        f"for name in {ops!r}:\n"
        "    get_accelerator().create_op_builder(name).load()\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=launch_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish_deepspeed_build(proc: subprocess.Popen, timeout: float = BUILD_TIMEOUT) -> None:
    """Wait for a build started by :func:`start_deepspeed_build`: ``RuntimeError`` on failure,
    ``subprocess.TimeoutExpired`` (the build killed) past ``timeout`` seconds."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(out[-3000:] + err[-6000:])


def build_deepspeed_ops(ops: tuple[str, ...] = ("ShareMemCommBuilder",)) -> None:
    """Clear stale build locks, then build ``ops`` in one process (``RuntimeError`` on failure,
    ``subprocess.TimeoutExpired`` past :data:`BUILD_TIMEOUT`)."""
    finish_deepspeed_build(start_deepspeed_build(ops))
