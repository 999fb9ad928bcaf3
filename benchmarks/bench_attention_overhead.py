"""Ring attention overhead: fwd+bwd time of the ring schedule vs ONE fused causal attention call
over the same global sequence (same backend). N = 1 is the real autograd operator without a process
group; N > 1 is the N-rank schedule emulated in one process (``run_schedule``, no communication).

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
    operator_fwd_bwd,
    parse,
    ratio_stats,
    run,
    seq_label,
    shards,
    table,
    timed,
)
from ringft.ops import default_softmax_scale  # noqa: E402
from ringft.ops.backends import BlockAttention, get_backend  # noqa: E402
from ringft.ops.emulate import run_schedule  # noqa: E402

Tensor = torch.Tensor


def _fused(kernel: BlockAttention, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, scale: float) -> None:
    """One fused causal attention fwd+bwd over the whole sequence."""
    out, lse = kernel.forward(q, k, v, True, scale)
    kernel.backward(dout, q, k, v, out, lse, True, scale)


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
    q, k, v, dout = make_inputs(seq, args.batch, seq, args.heads, args.kv_heads, args.head_dim, dtype, device)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sharded = {n: [shards(t, n) for t in (q, k, v, dout)] for n in worlds if n > 1}

    def ring_fn(n: int) -> Callable[[], object]:
        if n == 1:
            return lambda: operator_fwd_bwd(*leaves, dout, args.backend)
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
        before = timed(fused, device)
        this = {n: timed(ring_fn(n), device) for n in (worlds if rep % 2 == 0 else worlds[::-1])}
        after = timed(fused, device)
        fused_t += [before, after]
        for n, t in this.items():
            ring_t[n].append(t)
            ratios[n].append(t / (0.5 * (before + after)))
    return fused_t, ring_t, ratios


def report(args: argparse.Namespace, device: torch.device, dtype_name: str) -> None:
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
                    seq_label(seq),
                    f"{n} ({kind})",
                    ms(statistics.median(fused_t)),
                    ms(statistics.median(ring_t[n])),
                    ratio_stats(ratios[n]),
                    f"{min(ring_t[n]) / min(fused_t):.3f}",
                ]
            )
    lines = header(args, f"overhead ({dtype_name}): ring schedule vs one fused causal call, fwd+bwd", device)
    lines += table(
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
    p.add_argument("--worlds", type=int_list, default=[2, 4, 8], help="emulated N")
    p.add_argument("--repeats", type=int, default=3)
    return parse(p, argv)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark for every selected dtype."""
    run("overhead", report, parse_args(argv))


if __name__ == "__main__":
    main()
