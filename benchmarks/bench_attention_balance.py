"""Ring attention balance: per-rank fwd+bwd compute time at N = ``--balance-world`` ranks, zigzag vs
contiguous sharding (ranks timed one after the other in one process, no communication).

Prints one Markdown table per dtype (see benchmarks/attention_common.py for the shared options).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_common import (  # noqa: E402
    DTYPES,
    common_parser,
    emit,
    header,
    int_list,
    make_inputs,
    ms,
    parse,
    ratio_stats,
    run,
    seq_label,
    shards,
    table,
    timed,
)
from ringft.ops import accumulator_dtype, default_softmax_scale  # noqa: E402
from ringft.ops.backends import BlockAttention, get_backend  # noqa: E402
from ringft.ops.emulate import run_schedule  # noqa: E402
from ringft.ops.merge import merge_attention_  # noqa: E402

Tensor = torch.Tensor


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
    glob = make_inputs(seq, args.batch, seq, args.heads, args.kv_heads, args.head_dim, dtype, device)
    zz = [shards(t, n) for t in glob]
    cont = [[c.contiguous() for c in t.chunk(n, dim=1)] for t in glob]
    del glob

    def zigzag_rank(rank: int) -> float:
        spent = [0.0]

        def timer(_rank: int, fn: Callable[[], None]) -> None:
            spent[0] += timed(fn, device)

        run_schedule(kernel, *zz, causal=True, softmax_scale=scale, ranks=[rank], timer=timer)
        return spent[0]

    def contiguous_rank(rank: int) -> float:
        dkvs = [torch.zeros((2, *t.shape), dtype=acc, device=device) for t in cont[1]]
        return timed(lambda: _contiguous_rank(kernel, *cont, dkvs, rank, scale), device)

    times: dict[str, list[list[float]]] = {name: [[] for _ in range(n)] for name in ("zigzag", "contiguous")}
    order = [("zigzag", zigzag_rank), ("contiguous", contiguous_rank)]
    for rep in range(args.warmup + args.repeats):
        for name, fn in order if rep % 2 == 0 else order[::-1]:
            for rank in range(n):
                t = fn(rank)
                if rep >= args.warmup:
                    times[name][rank].append(t)
    return times


def report(args: argparse.Namespace, device: torch.device, dtype_name: str) -> None:
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
                    seq_label(seq),
                    name,
                    " / ".join(ms(m) for m in med),
                    f"{max(med) / min(med):.3f}",
                    ratio_stats(per_rep),
                ]
            )
    lines = header(args, f"balance ({dtype_name}): per-rank fwd+bwd compute at N={n}", device)
    lines += table(
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
    emit(args, lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = common_parser(__doc__)
    p.add_argument(
        "--seq",
        type=int_list,
        default=int_list("2K,4K,8K"),
        help="global sequence lengths (e.g. 2K,4K,8K)",
    )
    p.add_argument("--balance-world", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    return parse(p, argv)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark for every selected dtype."""
    run("balance", report, parse_args(argv))


if __name__ == "__main__":
    main()
