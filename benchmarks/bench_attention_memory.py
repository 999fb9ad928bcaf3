"""Ring attention memory: per-rank peak memory of the real operator's fwd+bwd in N gloo processes
(CPU), N x peak relative to N = 1. On CUDA only N = 1 is measured (one process, one GPU).

Prints one Markdown table per dtype (see benchmarks/attention_common.py for the shared options).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_common import (  # noqa: E402
    DTYPES,
    MIB,
    common_parser,
    emit,
    header,
    int_list,
    make,
    make_inputs,
    operator_fwd_bwd,
    parse,
    run,
    seq_label,
    table,
)
from ringft.utils.spawn import run_distributed  # noqa: E402

Tensor = torch.Tensor


class _PeakRss:
    """Background thread sampling the resident set size from ``/proc/self/statm``."""

    def __init__(self, interval: float = 5e-4):
        self.interval = interval
        self.peak = self.current()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def current() -> int:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.current())
            time.sleep(self.interval)

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.current())


def memory_worker(
    rank: int,
    world: int,
    seq: int,
    batch: int,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype_name: str,
    backend: str,
) -> dict[str, float]:
    """One rank: warm up on a tiny input, allocate its shards, then measure the RSS rise (bytes)."""
    torch.set_num_threads(1)
    dtype = DTYPES[dtype_name]
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(100 + rank)

    def shards(sl: int) -> list[Tensor]:
        q = make((batch, sl, heads, dim), gen, dtype, cpu).requires_grad_()
        k = make((batch, sl, kv_heads, dim), gen, dtype, cpu).requires_grad_()
        v = make((batch, sl, kv_heads, dim), gen, dtype, cpu).requires_grad_()
        return [q, k, v, make((batch, sl, heads, dim), gen, dtype, cpu)]

    # Warm-up: pages in the kernels' code and sets up gloo's buffers, so neither counts below.
    operator_fwd_bwd(*shards(64), backend)
    q, k, v, dout = shards(seq // world)
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v, dout))
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    base = _PeakRss.current()
    with _PeakRss() as sampler:
        operator_fwd_bwd(q, k, v, dout, backend)
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (q, k, v))
    return {"inputs": inputs, "grads": grads, "peak": sampler.peak - base, "after": _PeakRss.current() - base}


def report(args: argparse.Namespace, device: torch.device, dtype_name: str) -> None:
    """Per-rank peak memory of the real operator's fwd+bwd at fixed global S, N = ``--memory-worlds``."""
    seq = args.memory_seq
    if device.type == "cuda":
        _memory_cuda(args, device, dtype_name, seq)
        return
    # A fixed mmap threshold makes glibc return freed large blocks to the OS at once, so the RSS
    # follows the live tensors (set before the spawned ranks start; they inherit it).
    previous = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        results = [
            run_distributed(
                memory_worker,
                n,
                seq,
                args.batch,
                args.heads,
                args.kv_heads,
                args.head_dim,
                dtype_name,
                args.backend,
                timeout=900.0,
            )
            for n in args.memory_worlds
        ]
    finally:  # the timing sections must not run with it
        if previous is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_")
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = previous
    rows = []
    peak1 = None
    for n, res in zip(args.memory_worlds, results):
        peak = max(r["peak"] for r in res)
        peak1 = peak if n == 1 else peak1
        scaled = f"{n * peak / peak1:.2f}" if peak1 else "n/a"
        rows.append(
            [
                dtype_name,
                seq_label(seq),
                str(n),
                f"{res[0]['inputs'] / MIB:.1f}",
                f"{res[0]['grads'] / MIB:.1f}",
                " / ".join(f"{r['peak'] / MIB:.1f}" for r in res),
                f"{peak / MIB:.1f}",
                scaled,
            ]
        )
    lines = header(args, f"memory ({dtype_name}): per-rank peak RSS rise during fwd+bwd, S={seq}", device)
    lines += table(
        [
            "dtype",
            "S (global)",
            "N",
            "inputs/rank MiB",
            "q/k/v grads/rank MiB",
            "peak rise per rank MiB",
            "max peak MiB",
            "N x peak / peak(N=1)",
        ],
        rows,
    )
    lines += [
        "",
        "Real operator in N gloo processes (1 thread each). Each rank first runs one fwd+bwd on a 64-token "
        "shard (pages in kernel code, sets up gloo), allocates its shards (q, k, v, dout), then the peak "
        "RSS rise over that baseline during one fwd+bwd is taken by a thread sampling `/proc/self/statm` "
        "every 0.5 ms (`ru_maxrss` is useless here: start-up already set a higher high-water mark). Ranks "
        "run with `MALLOC_MMAP_THRESHOLD_=65536` so freed tensors leave the RSS at once. The q/k/v grads "
        "left at the end count in the peak. Target: N x peak / peak(N=1) <= 1.3.",
    ]
    emit(args, lines)


def _memory_cuda(args: argparse.Namespace, device: torch.device, dtype_name: str, seq: int) -> None:
    """CUDA: N = 1 only (one GPU, one process), peak of ``max_memory_allocated`` over the inputs."""
    dtype = DTYPES[dtype_name]
    q, k, v, dout = make_inputs(seq, args.batch, seq, args.heads, args.kv_heads, args.head_dim, dtype, device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v, dout))
    operator_fwd_bwd(q, k, v, dout, args.backend)  # warm-up (workspace, kernels)
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    operator_fwd_bwd(q, k, v, dout, args.backend)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    lines = header(args, f"memory ({dtype_name}): peak CUDA memory rise during fwd+bwd, S={seq}", device)
    lines += table(
        ["dtype", "S (global)", "N", "inputs MiB", "peak rise MiB (max_memory_allocated)"],
        [[dtype_name, seq_label(seq), "1", f"{inputs / MIB:.1f}", f"{peak / MIB:.1f}"]],
    )
    lines += ["", "N > 1 needs one process per GPU (NCCL) and is skipped in this single-GPU benchmark."]
    emit(args, lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = common_parser(__doc__)
    p.add_argument("--memory-seq", type=int_list, default=[16384], help="global S (one value)")
    p.add_argument("--memory-worlds", type=int_list, default=[1, 2, 4])
    args = parse(p, argv)
    args.memory_seq = args.memory_seq[0]
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark for every selected dtype."""
    run("memory", report, parse_args(argv))


if __name__ == "__main__":
    main()
