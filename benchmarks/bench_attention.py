"""Benchmarks of the zigzag ring attention operator: overhead, balance, memory and overlap.

Sections (``--section``, comma-separated):

- ``overhead``: fwd+bwd time of the ring schedule vs ONE fused causal attention call over the same
  global sequence (same backend). N = 1 is the real autograd operator without a process group;
  N > 1 is the N-rank schedule emulated in one process (``run_schedule``, no communication).
- ``balance``: per-rank compute time (max/min) at N ranks, zigzag vs contiguous sharding.
- ``memory``: per-rank peak memory of the real operator's fwd+bwd in gloo processes (CPU), N x peak
  relative to N = 1. On CUDA only N = 1 is measured (one process, one GPU).
- ``overlap``: real operator fwd+bwd with 2 gloo processes vs the same rank's schedule with the
  communication removed (CPU only).

Every section prints a Markdown table headed by the command, machine, torch version and date;
``--markdown-out PATH`` appends them to a file as well.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import describe_machine  # noqa: E402
from ringft.ops import DTYPES as _ALL_DTYPES  # noqa: E402
from ringft.ops import accumulator_dtype, default_softmax_scale  # noqa: E402
from ringft.ops.backends import BlockAttention, get_backend  # noqa: E402
from ringft.ops.emulate import run_schedule  # noqa: E402
from ringft.ops.merge import merge_attention_  # noqa: E402
from ringft.ops.sharding import zigzag_shard  # noqa: E402
from ringft.ops.spawn import run_distributed  # noqa: E402
from ringft.ops.zigzag import zigzag_ring_attention  # noqa: E402

Tensor = torch.Tensor
DTYPES = {name: _ALL_DTYPES[name] for name in ("bf16", "fp32", "fp16")}
SECTIONS = ("overhead", "balance", "memory", "overlap")
MIB = 1024 * 1024


# ----------------------------------------------------------------------------------------------
# helpers


def _int_list(text: str) -> list[int]:
    """Parse ``"2K,4096,16k"`` into ``[2048, 4096, 16384]``."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if item:
            out.append(int(item[:-1]) * 1024 if item.endswith("k") else int(item))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of ``fn()`` (device-synchronised on both ends)."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _make(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def _inputs(
    seed: int,
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Seeded global ``q, k, v, dout`` in layout ``(batch, seq, heads, dim)`` (CPU RNG, same everywhere)."""
    gen = torch.Generator().manual_seed(seed)
    q = _make((batch, seq, heads, dim), gen, dtype, device)
    k = _make((batch, seq, kv_heads, dim), gen, dtype, device)
    v = _make((batch, seq, kv_heads, dim), gen, dtype, device)
    dout = _make((batch, seq, heads, dim), gen, dtype, device)
    return q, k, v, dout


def _shards(t: Tensor, n: int) -> list[Tensor]:
    return [zigzag_shard(t, r, n).contiguous() for r in range(n)]


def _seq_label(seq: int) -> str:
    return f"{seq // 1024}K" if seq % 1024 == 0 else str(seq)


def _ms(seconds: float) -> str:
    """Milliseconds with about three significant digits."""
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def _ratio_stats(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"


def _header(args: argparse.Namespace, title: str, device: torch.device) -> list[str]:
    """Markdown heading lines: command, machine, torch version, threads, date."""
    machine = describe_machine()  # CPU model and instruction set: CPU figures depend on both
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%a %b %d %H:%M:%S UTC %Y")
    cmd = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    return [
        f"### {title}",
        "",
        f"- command: `{cmd}`",
        f"- machine: {machine}; device {device.type}",
        f"- torch {torch.__version__}; torch.set_num_threads({args.threads}); backend `{args.backend}`; "
        f"batch {args.batch}, heads {args.heads}, kv_heads {args.kv_heads}, head_dim {args.head_dim}",
        f"- date: {date}",
        "",
    ]


def _table(columns: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _emit(args: argparse.Namespace, lines: list[str]) -> None:
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if args.markdown_out:
        with open(args.markdown_out, "a", encoding="utf-8") as fh:
            fh.write(text + "\n")


# ----------------------------------------------------------------------------------------------
# work units


def _fused(kernel: BlockAttention, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, scale: float) -> None:
    """One fused causal attention fwd+bwd over the whole sequence."""
    out, lse = kernel.forward(q, k, v, True, scale)
    kernel.backward(dout, q, k, v, out, lse, True, scale)


def _operator_fwd_bwd(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, backend: str) -> None:
    """The real autograd operator (world group, or none), fwd+bwd; leaves' grads are reset."""
    for t in (q, k, v):
        t.grad = None
    out = zigzag_ring_attention(q, k, v, causal=True, backend=backend)
    out.backward(dout)


def _contiguous_rank(
    kernel: BlockAttention,
    qs: list[Tensor],
    ks: list[Tensor],
    vs: list[Tensor],
    douts: list[Tensor],
    dkvs: list[Tensor],
    rank: int,
    scale: float,
) -> None:
    """Causal fwd+bwd of ``rank`` under contiguous sharding (chunk ``rank`` of N).

    Diagonal block causal, then full blocks against every earlier rank's chunk, merged in fp32 like
    the ring operator; the backward recomputes each block against the merged out/lse.
    """
    q, dout = qs[rank], douts[rank]
    acc = accumulator_dtype(q.dtype)
    out, lse = kernel.forward(q, ks[rank], vs[rank], True, scale)
    out, lse = out.to(acc), lse.to(acc).clone()
    for j in range(rank):
        merge_attention_(out, lse, *kernel.forward(q, ks[j], vs[j], False, scale))
    out = out.to(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    for j in [rank, *range(rank)]:
        dq_b, dk_b, dv_b = kernel.backward(dout, q, ks[j], vs[j], out, lse, j == rank, scale)
        dq.add_(dq_b)
        dkvs[j][0].add_(dk_b)
        dkvs[j][1].add_(dv_b)


# ----------------------------------------------------------------------------------------------
# sections


def _overhead_one(
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    seq: int,
    worlds: list[int],
) -> tuple[list[float], dict[int, list[float]], dict[int, list[float]]]:
    """Times of one global size: fused list, ring times and ring/fused ratios per N."""
    kernel = get_backend(args.backend, device)
    scale = default_softmax_scale(args.head_dim)
    q, k, v, dout = _inputs(seq, args.batch, seq, args.heads, args.kv_heads, args.head_dim, dtype, device)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sharded = {n: [_shards(t, n) for t in (q, k, v, dout)] for n in worlds if n > 1}

    def ring_fn(n: int) -> Callable[[], object]:
        if n == 1:
            return lambda: _operator_fwd_bwd(*leaves, dout, args.backend)
        qs, ks, vs, ds = sharded[n]
        return lambda: run_schedule(kernel, qs, ks, vs, ds, causal=True, softmax_scale=scale)

    def fused() -> None:
        _fused(kernel, q, k, v, dout, scale)

    for _ in range(args.warmup):
        fused()
        for n in worlds:
            ring_fn(n)()
    fused_t: list[float] = []
    ring_t: dict[int, list[float]] = {n: [] for n in worlds}
    ratios: dict[int, list[float]] = {n: [] for n in worlds}
    for rep in range(args.repeats):
        # fused at both ends of the repeat; the ring rows in alternating order in between
        before = _timed(fused, device)
        this = {n: _timed(ring_fn(n), device) for n in (worlds if rep % 2 == 0 else worlds[::-1])}
        after = _timed(fused, device)
        fused_t += [before, after]
        for n, t in this.items():
            ring_t[n].append(t)
            ratios[n].append(t / (0.5 * (before + after)))
    return fused_t, ring_t, ratios


def section_overhead(args: argparse.Namespace, device: torch.device, dtype_name: str) -> None:
    """Ring schedule (N = 1 real op, N > 1 emulated) vs one fused call, time ratio per repeat."""
    worlds = [1, *[n for n in args.worlds if n > 1]]
    rows = []
    for seq in args.seq:
        fused_t, ring_t, ratios = _overhead_one(args, device, DTYPES[dtype_name], seq, worlds)
        gc.collect()
        for n in worlds:
            kind = "real op, no group" if n == 1 else "emulated schedule"
            rows.append(
                [
                    dtype_name,
                    _seq_label(seq),
                    f"{n} ({kind})",
                    _ms(statistics.median(fused_t)),
                    _ms(statistics.median(ring_t[n])),
                    _ratio_stats(ratios[n]),
                    f"{min(ring_t[n]) / min(fused_t):.3f}",
                ]
            )
    lines = _header(args, f"overhead ({dtype_name}): ring schedule vs one fused causal call, fwd+bwd", device)
    lines += _table(
        [
            "dtype",
            "S (global)",
            "N",
            "fused ms",
            "ring ms",
            "ring/fused: median (min-max)",
            "min ring / min fused",
        ],
        rows,
    )
    lines += [
        "",
        f"Medians of {args.repeats} repeats after {args.warmup} warm-up; each repeat times the fused call "
        "before and after the ring rows and takes the ratio against their mean; the median of those "
        "per-repeat ratios is reported (range in brackets). The ratio of the fastest runs is a second, "
        "burst-noise-robust estimate. Target: <= 1.10x at N=4, 8K.",
    ]
    _emit(args, lines)


def _balance_one(
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    seq: int,
    n: int,
) -> dict[str, list[list[float]]]:
    """Per-rank fwd+bwd times ``[rank][repeat]`` of one global size for both shardings."""
    kernel = get_backend(args.backend, device)
    scale = default_softmax_scale(args.head_dim)
    acc = accumulator_dtype(dtype)
    glob = _inputs(seq, args.batch, seq, args.heads, args.kv_heads, args.head_dim, dtype, device)
    zz = [_shards(t, n) for t in glob]
    cont = [[c.contiguous() for c in t.chunk(n, dim=1)] for t in glob]
    del glob

    def zigzag_rank(rank: int) -> float:
        spent = [0.0]

        def timer(_rank: int, fn: Callable[[], None]) -> None:
            spent[0] += _timed(fn, device)

        run_schedule(kernel, *zz, causal=True, softmax_scale=scale, ranks=[rank], timer=timer)
        return spent[0]

    def contiguous_rank(rank: int) -> float:
        dkvs = [torch.zeros((2, *t.shape), dtype=acc, device=device) for t in cont[1]]
        return _timed(lambda: _contiguous_rank(kernel, *cont, dkvs, rank, scale), device)

    times: dict[str, list[list[float]]] = {name: [[] for _ in range(n)] for name in ("zigzag", "contiguous")}
    order = [("zigzag", zigzag_rank), ("contiguous", contiguous_rank)]
    for rep in range(args.warmup + args.repeats):
        for name, fn in order if rep % 2 == 0 else order[::-1]:
            for rank in range(n):
                t = fn(rank)
                if rep >= args.warmup:
                    times[name][rank].append(t)
    return times


def section_balance(args: argparse.Namespace, device: torch.device, dtype_name: str) -> None:
    """Per-rank fwd+bwd compute time at N = ``--balance-world``, zigzag vs contiguous sharding."""
    n = args.balance_world
    rows = []
    for seq in args.seq:
        times = _balance_one(args, device, DTYPES[dtype_name], seq, n)
        gc.collect()
        for name in ("zigzag", "contiguous"):
            med = [statistics.median(ts) for ts in times[name]]
            per_rep = [
                max(ts[i] for ts in times[name]) / min(ts[i] for ts in times[name])
                for i in range(args.repeats)
            ]
            rows.append(
                [
                    dtype_name,
                    _seq_label(seq),
                    name,
                    " / ".join(_ms(m) for m in med),
                    f"{max(med) / min(med):.3f}",
                    _ratio_stats(per_rep),
                ]
            )
    lines = _header(args, f"balance ({dtype_name}): per-rank fwd+bwd compute at N={n}", device)
    lines += _table(
        [
            "dtype",
            "S (global)",
            "sharding",
            "rank 0..N-1 ms (median)",
            "max/min of medians",
            "max/min per repeat: median (min-max)",
        ],
        rows,
    )
    lines += [
        "",
        f"Ranks timed one after the other in one process (no communication), {args.repeats} repeats after "
        f"{args.warmup} warm-up, zigzag and contiguous interleaved. Zigzag: `run_schedule(ranks=[r])` with "
        "the timer hook; contiguous: rank r = chunk r of N (diagonal causal + full blocks vs earlier "
        "chunks, LSE-merged). Target: zigzag <= 1.05.",
    ]
    _emit(args, lines)


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
        q = _make((batch, sl, heads, dim), gen, dtype, cpu).requires_grad_()
        k = _make((batch, sl, kv_heads, dim), gen, dtype, cpu).requires_grad_()
        v = _make((batch, sl, kv_heads, dim), gen, dtype, cpu).requires_grad_()
        return [q, k, v, _make((batch, sl, heads, dim), gen, dtype, cpu)]

    # Warm-up: pages in the kernels' code and sets up gloo's buffers, so neither counts below.
    _operator_fwd_bwd(*shards(64), backend)
    q, k, v, dout = shards(seq // world)
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v, dout))
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    base = _PeakRss.current()
    with _PeakRss() as sampler:
        _operator_fwd_bwd(q, k, v, dout, backend)
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (q, k, v))
    return {"inputs": inputs, "grads": grads, "peak": sampler.peak - base, "after": _PeakRss.current() - base}


def section_memory(args: argparse.Namespace, device: torch.device, dtype_name: str) -> None:
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
                _seq_label(seq),
                str(n),
                f"{res[0]['inputs'] / MIB:.1f}",
                f"{res[0]['grads'] / MIB:.1f}",
                " / ".join(f"{r['peak'] / MIB:.1f}" for r in res),
                f"{peak / MIB:.1f}",
                scaled,
            ]
        )
    lines = _header(args, f"memory ({dtype_name}): per-rank peak RSS rise during fwd+bwd, S={seq}", device)
    lines += _table(
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
    _emit(args, lines)


def _memory_cuda(args: argparse.Namespace, device: torch.device, dtype_name: str, seq: int) -> None:
    """CUDA: N = 1 only (one GPU, one process), peak of ``max_memory_allocated`` over the inputs."""
    dtype = DTYPES[dtype_name]
    q, k, v, dout = _inputs(seq, args.batch, seq, args.heads, args.kv_heads, args.head_dim, dtype, device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v, dout))
    _operator_fwd_bwd(q, k, v, dout, args.backend)  # warm-up (workspace, kernels)
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    _operator_fwd_bwd(q, k, v, dout, args.backend)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    lines = _header(args, f"memory ({dtype_name}): peak CUDA memory rise during fwd+bwd, S={seq}", device)
    lines += _table(
        ["dtype", "S (global)", "N", "inputs MiB", "peak rise MiB (max_memory_allocated)"],
        [[dtype_name, _seq_label(seq), "1", f"{inputs / MIB:.1f}", f"{peak / MIB:.1f}"]],
    )
    lines += ["", "N > 1 needs one process per GPU (NCCL) and is skipped in this single-GPU benchmark."]
    _emit(args, lines)


def _overlap_one(
    rank: int,
    world: int,
    seq: int,
    batch: int,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    backend: str,
    repeats: int,
    warmup: int,
) -> dict[str, list[float]]:
    """Ring vs compute-only times of one global size on this rank."""
    import torch.distributed as dist

    cpu = torch.device("cpu")
    kernel = get_backend(backend, cpu)
    scale = default_softmax_scale(dim)
    qs, ks, vs, ds = (_shards(t, world) for t in _inputs(seq, batch, seq, heads, kv_heads, dim, dtype, cpu))
    leaves = [t[rank].detach().clone().requires_grad_() for t in (qs, ks, vs)]
    measures = {
        "ring": lambda: _operator_fwd_bwd(*leaves, ds[rank], backend),
        "compute": lambda: run_schedule(
            kernel, qs, ks, vs, ds, causal=True, softmax_scale=scale, ranks=[rank]
        ),
    }
    times: dict[str, list[float]] = {"ring": [], "compute": []}
    for rep in range(warmup + repeats):
        for name in ["ring", "compute"] if rep % 2 == 0 else ["compute", "ring"]:
            dist.barrier()  # both ranks run the same measurement at the same time
            t = _timed(measures[name], cpu)
            if rep >= warmup:
                times[name].append(t)
    return times


def overlap_worker(
    rank: int,
    world: int,
    seqs: list[int],
    batch: int,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype_name: str,
    backend: str,
    repeats: int,
    warmup: int,
) -> list[dict[str, list[float]]]:
    """One rank: time the real operator vs its own schedule without communication, interleaved."""
    torch.set_num_threads(1)
    dtype = DTYPES[dtype_name]
    return [
        _overlap_one(rank, world, seq, batch, heads, kv_heads, dim, dtype, backend, repeats, warmup)
        for seq in seqs
    ]


def section_overlap(args: argparse.Namespace, device: torch.device, dtype_name: str) -> None:
    """Real 2-rank operator vs communication-free schedule of the same rank (CPU, gloo)."""
    if device.type == "cuda":
        _emit(
            args,
            [
                f"### overlap ({dtype_name})",
                "",
                "Skipped on CUDA: it needs 2 processes on 2 GPUs (NCCL); this benchmark runs on one GPU.",
            ],
        )
        return
    n = 2
    res = run_distributed(
        overlap_worker,
        n,
        args.overlap_seq,
        args.batch,
        args.heads,
        args.kv_heads,
        args.head_dim,
        dtype_name,
        args.backend,
        args.overlap_repeats,
        args.warmup,
        timeout=1800.0,
    )
    rows = []
    for i, seq in enumerate(args.overlap_seq):
        worst = 0.0
        for rank in range(n):
            ring, comp = res[rank][i]["ring"], res[rank][i]["compute"]
            ratios = [a / b for a, b in zip(ring, comp)]
            worst = max(worst, statistics.median(ratios))
            rows.append(
                [
                    dtype_name,
                    _seq_label(seq),
                    str(rank),
                    _ms(statistics.median(ring)),
                    _ms(statistics.median(comp)),
                    _ratio_stats(ratios),
                    f"{min(ring) / min(comp):.3f}",
                    f"{worst:.3f}" if rank == n - 1 else "",
                ]
            )
    lines = _header(args, f"overlap ({dtype_name}): real operator (N=2, gloo) vs compute only", device)
    lines += _table(
        [
            "dtype",
            "S (global)",
            "rank",
            "ring ms",
            "compute-only ms",
            "ring/compute: median (min-max)",
            "min ring / min compute",
            "worst rank (median)",
        ],
        rows,
    )
    lines += [
        "",
        f"2 gloo processes, torch.set_num_threads(1) each (one core each). Compute-only = "
        f"`run_schedule(ranks=[rank])` on shards built locally from the same seeded global tensors. "
        f"{args.overlap_repeats} repeats after {args.warmup} warm-up, both measurements interleaved (order "
        "alternating), a barrier before each; median of the per-repeat ratios. Target: <= 1.15x at the "
        "largest size.",
    ]
    _emit(args, lines)


# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bf16,fp32", help="comma-separated: bf16, fp32, fp16")
    p.add_argument("--section", default=",".join(SECTIONS), help="comma-separated: " + ", ".join(SECTIONS))
    p.add_argument(
        "--seq",
        type=_int_list,
        default=_int_list("2K,4K,8K"),
        help="global sequence lengths for overhead and balance (e.g. 2K,4K,8K)",
    )
    p.add_argument("--worlds", type=_int_list, default=[2, 4, 8], help="emulated N for overhead")
    p.add_argument("--balance-world", type=int, default=4)
    p.add_argument("--memory-seq", type=_int_list, default=[16384], help="global S for memory (one value)")
    p.add_argument("--memory-worlds", type=_int_list, default=[1, 2, 4])
    p.add_argument("--overlap-seq", type=_int_list, default=_int_list("4K,8K,16K"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--backend", default="torch", help="ring and fused backend")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--overlap-repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in this process")
    p.add_argument("--markdown-out", default=None, help="append the tables to this Markdown file")
    args = p.parse_args(argv)
    args.memory_seq = args.memory_seq[0]
    args.sections = [s.strip() for s in args.section.split(",") if s.strip()]
    args.dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    bad = [s for s in args.sections if s not in SECTIONS] + [d for d in args.dtypes if d not in DTYPES]
    if bad:
        p.error(f"unknown section/dtype: {bad}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the selected sections for every selected dtype."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    runners = {
        "overhead": section_overhead,
        "balance": section_balance,
        "memory": section_memory,
        "overlap": section_overlap,
    }
    for section in args.sections:
        for dtype_name in args.dtypes:
            t0 = time.perf_counter()
            runners[section](args, device, dtype_name)
            print(f"[{section} {dtype_name}: {time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
