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
import signal
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
        start_new_session=True,  # its own session: a timeout stops the compilers too
    )


def _kill_session(session: int) -> None:
    """SIGKILL every process of ``session`` (Linux ``/proc``): ninja starts each compiler in a
    process group of its own, but they stay in the build's session."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
            if int(fields[3]) == session:
                os.kill(int(stat.parent.name), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            continue


def finish_deepspeed_build(proc: subprocess.Popen, timeout: float = BUILD_TIMEOUT) -> None:
    """Wait for a build started by :func:`start_deepspeed_build`: ``RuntimeError`` on failure,
    ``subprocess.TimeoutExpired`` (the build killed) past ``timeout`` seconds: the whole build (its
    ninja and compiler processes too, which would otherwise run on orphaned) and the locks it held."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        proc.communicate()
        for lock in EXTENSIONS_DIR.rglob("lock"):
            lock.unlink()
        raise
    if proc.returncode != 0:
        raise RuntimeError(out[-3000:] + err[-6000:])


def build_deepspeed_ops(ops: tuple[str, ...] = ("ShareMemCommBuilder",)) -> None:
    """Clear stale build locks, then build ``ops`` in one process (``RuntimeError`` on failure,
    ``subprocess.TimeoutExpired`` past :data:`BUILD_TIMEOUT`)."""
    finish_deepspeed_build(start_deepspeed_build(ops))
