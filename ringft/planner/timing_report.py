"""Step time as text and on the command line: every Ulysses x ring split of a CP size, the
recommended one and why (which term dominates). The model is :mod:`ringft.planner.timing`."""

from __future__ import annotations

import argparse
from typing import Any

from ringft.planner.shapes import ModelShape
from ringft.planner.timing import Hardware, StepTime, layouts_of, step_time
from ringft.utils.options import add_flag

__all__ = [
    "add_time_arguments",
    "compare_layouts",
    "explain",
    "format_times",
    "hardware_from_args",
    "recommend_layout",
    "time_section",
]

_HW = Hardware()


def add_time_arguments(p: argparse.ArgumentParser) -> None:
    """``ringft plan``'s step-time flags (defaults: H100 SXM nodes, see :class:`Hardware`)."""
    g = p.add_argument_group("step time (ring / Ulysses / hybrid)")
    g.add_argument("--time", action="store_true", help="predict the step time of every ulysses x ring split")
    add_flag(
        g,
        "--time-ulysses-size",
        old=("--ulysses",),
        append=True,
        type=int,
        help="with --time: compare only the splits of this Ulysses size (repeat for more; default: all)",
    )
    g.add_argument("--gpus-per-node", type=int, default=_HW.gpus_per_node)
    g.add_argument(
        "--attn-tflops",
        type=float,
        default=_HW.attn_tflops,
        help="fused causal attention fwd+bwd TFLOP/s for large blocks (H100: cudnn 541, torch 320)",
    )
    g.add_argument("--matmul-tflops", type=float, default=_HW.matmul_tflops, help="GEMM TFLOP/s (H100: 500)")
    g.add_argument(
        "--token-layer-us",
        type=float,
        default=_HW.token_layer_us,
        help="memory-bound kernels per token and layer, microseconds per step (H100 fit: 1.78)",
    )
    g.add_argument("--nvlink-gbps", type=float, default=_HW.nvlink_gbps, help="intra-node GB/s per GPU")
    g.add_argument("--ib-gbps", type=float, default=_HW.ib_gbps, help="inter-node GB/s per GPU (its NIC)")
    g.add_argument("--nvlink-latency-us", type=float, default=_HW.nvlink_latency * 1e6)
    g.add_argument("--ib-latency-us", type=float, default=_HW.ib_latency * 1e6)


def hardware_from_args(args: argparse.Namespace) -> Hardware:
    """A :class:`Hardware` from the parsed flags (``ValueError`` naming a non-positive one)."""
    values = {
        "--gpus-per-node": args.gpus_per_node,
        "--attn-tflops": args.attn_tflops,
        "--matmul-tflops": args.matmul_tflops,
        "--token-layer-us": args.token_layer_us,
        "--nvlink-gbps": args.nvlink_gbps,
        "--ib-gbps": args.ib_gbps,
    }
    bad = [f"{k} {v:g} must be > 0" for k, v in values.items() if not v > 0]
    latencies = {"--nvlink-latency-us": args.nvlink_latency_us, "--ib-latency-us": args.ib_latency_us}
    bad += [f"{k} {v:g} must be >= 0" for k, v in latencies.items() if not v >= 0]
    if bad:
        raise ValueError("; ".join(bad))
    return Hardware(
        gpus_per_node=args.gpus_per_node,
        attn_tflops=args.attn_tflops,
        matmul_tflops=args.matmul_tflops,
        token_layer_us=args.token_layer_us,
        nvlink_gbps=args.nvlink_gbps,
        ib_gbps=args.ib_gbps,
        nvlink_latency=args.nvlink_latency_us * 1e-6,
        ib_latency=args.ib_latency_us * 1e-6,
    )


def compare_layouts(
    shape: ModelShape,
    seq_len: int,
    num_gpus: int,
    cp: int,
    *,
    ulysses_sizes: list[int] | None = None,
    hw: Hardware | None = None,
    **options: Any,
) -> list[StepTime]:
    """:func:`step_time` of every ``ulysses x ring = cp`` split whose Ulysses size divides the query
    heads (restricted to ``ulysses_sizes`` when given), by Ulysses size."""
    pairs = [(u, r) for u, r in layouts_of(shape, cp) if not ulysses_sizes or u in ulysses_sizes]
    return [step_time(shape, seq_len, num_gpus, u, r, hw=hw, **options) for u, r in pairs]


def recommend_layout(times: list[StepTime]) -> StepTime:
    """The fastest predicted layout."""
    return min(times, key=lambda t: t.seconds)


def _name(t: StepTime) -> str:
    kind = "ring" if t.ulysses == 1 else "Ulysses" if t.ring == 1 else "hybrid"
    return f"ulysses {t.ulysses} x ring {t.ring} ({kind})"


def _s(x: float) -> str:
    return f"{x * 1e3:.3g} ms" if abs(x) < 1 else f"{x:.3g} s"


def _mib(n: float) -> str:
    return f"{n / 2**20:.3g} MiB" if n < 2**30 else f"{n / 2**30:.3g} GiB"


def format_times(times: list[StepTime], seq_len: int, batch: int = 1) -> str:
    """One row per layout: step time, tokens/s per GPU, the terms (seconds per step) and the links."""
    head = (
        f"{'ulysses x ring':>14} {'step':>9} {'tok/s/GPU':>10} {'attn ideal':>10} {'kernel':>8} "
        f"{'ring exp.':>9} {'all2all':>8} {'linear':>8} {'kv copies':>9}  links (ring / ulysses)"
    )
    rows = [head, "-" * len(head)]
    for t in times:
        tokens = batch * seq_len / (t.ulysses * t.ring)
        rows.append(
            f"{f'{t.ulysses} x {t.ring}':>14} {_s(t.seconds):>9} {tokens / t.seconds:>10.0f} "
            f"{_s(t.attention_ideal):>10} {_s(t.attention_inefficiency):>8} {_s(t.ring_exposed):>9} "
            f"{_s(t.all_to_all):>8} {_s(t.linear):>8} {t.kv_copies:>9}  "
            f"{t.links['ring']} / {t.links['ulysses']}"
        )
    return "\n".join(rows)


def _dominant(t: StepTime) -> tuple[str, float]:
    return max(t.overheads.items(), key=lambda kv: kv[1])


def _detail(t: StepTime) -> list[str]:
    """What the recommended layout's communication costs, per layer."""
    lines, tr = [], t.traffic
    if t.ring > 1:
        lines.append(
            f"  ring over {t.links['ring']}, per layer: forward {t.ring - 1} x K/V "
            f"({_mib(tr.kv_block_bytes)}), backward {t.ring - 1} x K/V + {t.ring} x dK/dV "
            f"({_mib(tr.grad_block_bytes)}, fp32), each hop "
            f"overlapped with one step's compute; exposed: {_s(t.ring_exposed)} per step"
        )
    if t.ulysses > 1:
        copies = f", K/V heads replicated {t.kv_copies}x" if t.kv_copies > 1 else ""
        lines.append(
            f"  all-to-alls over {t.links['ulysses']}: 2 per layer forward, 2 backward, "
            f"{_mib(sum(tr.a2a_bytes))} leaving each rank per layer{copies}; {_s(t.all_to_all)} per step"
        )
    return lines


def explain(times: list[StepTime]) -> str:
    """Which layout to pick and why: the step times and each layout's dominant extra term."""
    best = recommend_layout(times)
    useful = best.attention_ideal + best.linear
    term, value = _dominant(best)
    lines = [
        f"recommended: {_name(best)}: {_s(best.seconds)} per step, {100 * (best.seconds / useful - 1):.1f}% "
        f"over its ideal compute ({_s(useful)}); its largest extra term: {term} ({_s(value)})",
        *_detail(best),
    ]
    for t in times:
        if t is best:
            continue
        term, value = _dominant(t)
        lines.append(
            f"  vs {_name(t)}: {_s(t.seconds)} ({100 * (t.seconds / best.seconds - 1):+.1f}%), "
            f"dominated by {term} ({_s(value)})"
            + (f", K/V heads replicated {t.kv_copies}x" if t.kv_copies > 1 else "")
        )
    spread = max(t.seconds for t in times) / best.seconds - 1
    if spread < 0.03:
        lines.append(
            f"  all splits are within {100 * spread:.1f}% of each other: the step is compute-bound "
            f"(ideal attention {_s(best.attention_ideal)} of {_s(best.seconds)}), so the split matters "
            "little and the pick rests on the unvalidated communication terms"
        )
    lines.append(
        "(model: attention compute fitted to H100 measurements; communication terms and U > 1 kernel "
        "efficiency are unvalidated until a multi-GPU run; the memory plan above is for --ulysses-size, "
        "default 1: the ring)"
    )
    return "\n".join(lines)


def time_section(shape: ModelShape, seq_len: int, num_gpus: int, cps: list[int], args) -> tuple[str, list]:
    """``ringft plan --time``'s text and JSON rows for each CP size in ``cps``."""
    hw = hardware_from_args(args)
    texts, rows = [], []
    options = dict(
        batch=args.micro_batch_size,
        gradient_checkpointing=args.gradient_checkpointing,
        lora=args.lora,
        tiled_mlp=bool(args.tiled_mlp or args.tiled_mlp_tokens),
        attention_checkpoint=args.attention_checkpoint,
    )
    options["dtype_bytes"] = 4 if args.dtype == "fp32" else 2
    for cp in cps:
        times = compare_layouts(
            shape, seq_len, num_gpus, cp, ulysses_sizes=args.time_ulysses_size, hw=hw, **options
        )
        if not times:
            texts.append(
                f"cp {cp}: no Ulysses size in {args.time_ulysses_size} splits cp {cp} and {shape.heads} heads"
            )
            continue
        texts.append(
            f"step time, cp {cp} x dp {num_gpus // cp}, {num_gpus // hw.gpus_per_node or 1} node(s) of "
            f"{hw.gpus_per_node} GPUs, S={seq_len}:\n{format_times(times, seq_len, args.micro_batch_size)}\n"
            + explain(times)
        )
        rows += [
            {
                "cp": cp,
                "ulysses": t.ulysses,
                "ring": t.ring,
                "seconds": t.seconds,
                **{k.replace(" ", "_"): v for k, v in t.overheads.items()},
                "recommended": t is recommend_layout(times),
            }
            for t in times
        ]
    return "\n\n".join(texts), rows
