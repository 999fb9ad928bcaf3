"""Sliding-window zigzag attention vs the unwindowed ring, emulated on one CPU: time, FLOPs, K/V bytes.

The N-rank schedules run in one process (``ringft.ops.emulate.run_schedule``, no communication),
forward + backward, on one global sequence of ``--seq`` tokens: the plain causal ring, then the
windowed exchange of ``ringft.ops.windows`` for each ``--windows`` value. For each window:

- time: the sum over ranks of each rank's forward + backward compute, and the slowest rank's,
  relative to the unwindowed ring. CPU time of this process (one thread, ``time.process_time``),
  so other load on a shared machine does not count; runs are interleaved within each repeat and the
  minimum over repeats is kept;
- FLOPs: (query, key) pairs computed by an exact kernel, i.e. the visible pairs
  (``WindowSchedule.attention_pairs``), relative to causal;
- overhead vs ideal: (time ratio) / (FLOP ratio); 1.0 = time proportional to FLOPs. A window
  does not balance the ranks as zigzag balances causal work (rank 0 holds the sequence's start,
  where windows are short): compare the slowest rank's time with the busiest rank's FLOPs;
- K/V bytes sent per rank and layer (the busiest rank), forward and forward + backward, from the
  schedule (``WindowSchedule``): the ring sends N - 1 full K/V blocks forward, and in the backward
  N - 1 again plus N hops of fp32 dK/dV; the windowed exchange sends only the chunks in reach,
  and in the backward those again plus the fp32 dK/dV of the chunks it received.

Default head shape: LLaMA-3 / Mistral attention (GQA 4, head_dim 128; 8 of their 32 query heads).

Usage: ``python benchmarks/bench_windows.py [--seq 16K] [--world 4] [--windows 512,4096]``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import describe_machine  # noqa: E402
from ringft.ops import DTYPES, default_softmax_scale, get_backend, torch_backend  # noqa: E402
from ringft.ops.emulate import run_schedule  # noqa: E402
from ringft.ops.sharding import cp_shard  # noqa: E402
from ringft.ops.windows import window_chunks, window_schedule  # noqa: E402


def _int_list(text: str) -> list[int]:
    return [int(x[:-1]) * 1024 if x.lower().endswith("k") else int(x) for x in text.split(",") if x]


def time_run(args, shards, window: int | None) -> list[float]:
    """CPU seconds of each rank's forward + backward (``window`` None: the unwindowed ring)."""
    n = args.world
    device = torch.device(args.device)
    kernel = get_backend(args.backend, device, DTYPES[args.dtype], args.head_dim)
    spent = [0.0] * n
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time  # GPU: wall time around synchronized calls

    def timer(r, fn):
        if cuda:
            torch.cuda.synchronize()
        t0 = clock()
        fn()
        if cuda:
            torch.cuda.synchronize()
        spent[r] += clock() - t0

    scale = default_softmax_scale(args.head_dim)
    for rank in range(n):
        run_schedule(
            kernel, *shards, causal=True, softmax_scale=scale, ranks=[rank], timer=timer,
            sliding_window=window,
        )  # fmt: skip
    return spent


def traffic(args, window: int | None) -> tuple[float, float]:
    """MiB of K/V (and dK/dV) the busiest rank sends per layer: (forward, forward + backward)."""
    n, c = args.world, args.seq // (2 * args.world)
    item = DTYPES[args.dtype].itemsize
    per_chunk = 2 * c * args.kv_heads * args.head_dim  # K and V of one chunk, elements
    if window is None:
        fwd = (n - 1) * 2 * per_chunk * item
        return fwd / 2**20, (2 * fwd + n * 2 * per_chunk * 4) / 2**20
    schedule = window_schedule(args.seq, n, window)
    best = (0.0, 0.0)
    for r in range(n):
        fwd = schedule.chunks_sent(r) * per_chunk * item
        received = sum(map(len, schedule.needs[r]))
        best = max(best, (fwd / 2**20, (2 * fwd + received * per_chunk * 4) / 2**20))
    return best


def main(argv: list[str] | None = None) -> None:
    """Run the ring and the windows and print one Markdown table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=lambda t: _int_list(t)[0], default=16384)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--windows", type=_int_list, default=[512, 4096])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--backend", default="torch")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: wall time, synchronized")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--band-tile", type=int, default=None, help="override torch_backend.CPU_BAND_TILE")
    p.add_argument("--no-ring", action="store_true", help="time the windows only (tile tuning)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.band_tile:
        torch_backend.CPU_BAND_TILE = args.band_tile
    gen = torch.Generator().manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    shape = (1, args.seq)
    q, dout = (torch.randn(*shape, args.heads, args.head_dim, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(*shape, args.kv_heads, args.head_dim, generator=gen).to(dtype) for _ in range(2))
    shards = [
        [cp_shard(t, r, args.world).contiguous().to(args.device) for r in range(args.world)]
        for t in (q, k, v, dout)
    ]
    runs = ([] if args.no_ring else [None]) + list(args.windows)
    best: dict[int | None, list[float]] = {}
    for repeat in range(args.warmup + args.repeats):
        for window in runs:  # interleaved: every repeat times every run once
            t = time_run(args, shards, window)
            if repeat >= args.warmup:
                best[window] = t if window not in best else [min(a, b) for a, b in zip(best[window], t)]
    causal = args.seq * (args.seq + 1) // 2
    ring_t = best.get(None)
    ring_mib = traffic(args, None)
    cmd = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    head = f"S={args.seq}, N={args.world} emulated, {args.dtype}, backend {args.backend}"
    print(f"### sliding windows: {head}\n")
    print(f"- command: `{cmd}`\n- machine: {describe_machine()}")
    print(
        f"- heads {args.heads}, kv_heads {args.kv_heads}, head_dim {args.head_dim}, "
        f"torch.set_num_threads({args.threads}), CPU_BAND_TILE {torch_backend.CPU_BAND_TILE}; "
        + (f"unwindowed ring: {sum(ring_t) * 1e3:.0f} ms (sum over ranks, fwd+bwd); " if ring_t else "")
        + f"CPU time, minimum of {args.repeats} interleaved repeats after {args.warmup} warm-up\n"
    )
    print(
        "| window | chunks reached (k) | exchange steps | ms (sum of ranks) | time / ring "
        "| slowest rank / ring | FLOPs / ring | busiest rank's FLOPs / ring's | overhead vs FLOP-ideal "
        "| K/V MiB sent fwd (ring) | fwd+bwd MiB (ring) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for window in args.windows:
        t = best[window]
        schedule = window_schedule(args.seq, args.world, window)
        pairs = [schedule.attention_pairs(r) for r in range(args.world)]
        flops, busiest = sum(pairs) / causal, max(pairs) / (causal / args.world)
        fwd, both = traffic(args, window)
        if ring_t:
            ratio = sum(t) / sum(ring_t)
            cells = (
                f"{ratio:.4f} | {max(t) / max(ring_t):.4f} | {flops:.4f} | {busiest:.4f} "
                f"| **{ratio / flops:.2f}**"
            )
        else:
            cells = f"- | - | {flops:.4f} | {busiest:.4f} | -"
        print(
            f"| {window} | {window_chunks(args.seq, args.world, window)} | {schedule.steps} "
            f"| {sum(t) * 1e3:.0f} "
            f"| {cells} | {fwd:.1f} ({ring_mib[0]:.1f}) | {both:.1f} ({ring_mib[1]:.1f}) |"
        )


if __name__ == "__main__":
    main()
