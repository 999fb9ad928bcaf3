"""Ring attention overlap: the real operator's fwd+bwd with 2 gloo processes vs the same rank's
schedule with the communication removed (CPU only).

Prints one Markdown table per dtype (see benchmarks/attention_common.py for the shared options).
"""

from __future__ import annotations

import argparse
import statistics
import sys
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
from ringft.ops.backends import get_backend  # noqa: E402
from ringft.ops.emulate import run_schedule  # noqa: E402
from ringft.utils.spawn import run_distributed  # noqa: E402


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
    qs, ks, vs, ds = (
        shards(t, world) for t in make_inputs(seq, batch, seq, heads, kv_heads, dim, dtype, cpu)
    )
    leaves = [t[rank].detach().clone().requires_grad_() for t in (qs, ks, vs)]
    measures = {
        "ring": lambda: operator_fwd_bwd(*leaves, ds[rank], backend),
        "compute": lambda: run_schedule(
            kernel, qs, ks, vs, ds, causal=True, softmax_scale=scale, ranks=[rank]
        ),
    }
    times: dict[str, list[float]] = {"ring": [], "compute": []}
    for rep in range(warmup + repeats):
        for name in ["ring", "compute"] if rep % 2 == 0 else ["compute", "ring"]:
            dist.barrier()  # both ranks run the same measurement at the same time
            t = timed(measures[name], cpu)
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


def report(args: argparse.Namespace, device: torch.device, dtype_name: str) -> None:
    """Real 2-rank operator vs communication-free schedule of the same rank (CPU, gloo)."""
    if device.type == "cuda":
        emit(
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
                    seq_label(seq),
                    str(rank),
                    ms(statistics.median(ring)),
                    ms(statistics.median(comp)),
                    ratio_stats(ratios),
                    f"{min(ring) / min(comp):.3f}",
                    f"{worst:.3f}" if rank == n - 1 else "",
                ]
            )
    lines = header(args, f"overlap ({dtype_name}): real operator (N=2, gloo) vs compute only", device)
    lines += table(
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
    emit(args, lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = common_parser(__doc__)
    p.add_argument("--overlap-seq", type=int_list, default=int_list("4K,8K,16K"))
    p.add_argument("--overlap-repeats", type=int, default=5)
    return parse(p, argv)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark for every selected dtype."""
    run("overlap", report, parse_args(argv))


if __name__ == "__main__":
    main()
