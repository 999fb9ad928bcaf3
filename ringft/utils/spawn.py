"""Spawn N gloo processes on CPU and run a function in each, with a hard timeout.

Used by the test-suite (and handy for checking a setup): a deadlock or a crash in one rank fails
loudly instead of hanging. ``fn`` must be importable (defined at module level).

Ranks start as forks of a fork server (``multiprocessing``'s ``forkserver``; ``spawn`` where the
platform has none) that imported torch, and the modules named in ``RINGFT_SPAWN_PRELOAD``
(comma-separated), once per parent process: a rank then costs no import time (seconds each for
torch and transformers). The server forks clean processes (it never computes), and each rank gets
the parent's environment as it is at the call.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

PRELOAD_ENV = "RINGFT_SPAWN_PRELOAD"


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _context():
    """The fork-server context (its server preloading torch and ``RINGFT_SPAWN_PRELOAD``'s modules;
    a module that fails to import is skipped), or ``spawn`` where there is no fork server."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    extra = [name.strip() for name in os.environ.get(PRELOAD_ENV, "").split(",") if name.strip()]
    ctx.set_forkserver_preload(["torch", "torch.distributed", __name__, *extra])  # used at its first start
    return ctx


def start_fork_server() -> None:
    """Start the fork server now, so that its imports run in the background and the first
    :func:`run_distributed` waits less; nothing where there is no fork server or it runs already."""
    if _context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _worker(fn, rank: int, world_size: int, port: int, timeout: float, args, queue, env) -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()  # the fork server's environment is the parent's at the server's start
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        # every rank's connections made before any runs ``fn``: a rank that leaves the group at once
        # (a worker that forms its own) would otherwise take rank 0's store away from a slower rank
        dist.barrier()
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - the traceback is sent to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; return results by rank.

    Raises ``TimeoutError`` (after killing every process) when the ranks do not all finish within
    ``timeout`` seconds, and ``RuntimeError`` with the failing ranks' tracebacks when any raised.
    """
    import queue as queue_mod
    import time

    ctx = _context()
    results: mp.Queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, timeout, args, results, env), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outcome: dict[int, tuple[bool, Any]] = {}
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"distributed run of {fn.__name__} with {world_size} ranks did not finish in "
                    f"{timeout:.0f} s (ranks done: {sorted(outcome)}): deadlock or hang"
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
                outcome[rank] = (ok, payload)
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in outcome]
                if dead and all(p.exitcode not in (0, None) for p in (procs[i] for i in dead)):
                    # A rank died without reporting (e.g. killed); give stragglers a moment.
                    time.sleep(0.5)
                    if results.empty():
                        raise RuntimeError(
                            f"rank(s) {dead} of {fn.__name__} died with exit codes "
                            f"{[procs[i].exitcode for i in dead]}"
                        ) from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    failures = {r: msg for r, (ok, msg) in sorted(outcome.items()) if not ok}
    if failures:
        raise RuntimeError(
            "\n".join(f"--- rank {r} of {world_size} failed:\n{msg}" for r, msg in failures.items())
        )
    return [outcome[r][1] for r in range(world_size)]
