"""Messages and bytes of Ulysses x ring attention per layer, N = 8 emulated on CPU, vs the time model.

Eight gloo processes run one forward and one backward of ``ulysses_ring_attention`` (the real
operator, ``validate=False`` as inside the model, where inputs are checked once per forward) for
every split of 8: ulysses 8 x ring 1 (pure Ulysses), 4 x 2, 2 x 4 and 1 x 8 (the ring). Every call of
``torch.distributed.all_to_all_single`` and every point-to-point send inside
``batch_isend_irecv`` is counted per rank: an all-to-all over ``U`` ranks counts ``U - 1``
messages and the bytes leaving the rank; a ring send counts one message. The counts must equal
:func:`ringft.planner.timing.layer_traffic` exactly (the bytes the step-time model charges), on
every rank.

Shapes: LLaMA-3-8B / Mistral attention (32 heads, 8 K/V heads, dim 128) and a 2-K/V-head variant
(K/V heads replicated 2x at U = 4 and 4x at U = 8), bf16, batch 1, ``--seq`` tokens (bytes scale
linearly with it; the model's formula is the same at 512K).

Usage: ``python benchmarks/bench_ulysses.py [--seq 1024] [--markdown-out FILE]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import describe_machine  # noqa: E402
from ringft.ops.ulysses import kv_replication  # noqa: E402
from ringft.planner.shapes import load_model_shape  # noqa: E402
from ringft.planner.timing import H100_ATTENTION, attention_seconds, layer_traffic  # noqa: E402
from ringft.utils.spawn import run_distributed  # noqa: E402

WORLD = 8
LLAMA = load_model_shape("llama-3-8b")
SHAPES = {"32 q / 8 kv heads": LLAMA, "32 q / 2 kv heads": dataclasses.replace(LLAMA, kv_heads=2)}


def _counting(counts: dict) -> None:
    """Wrap the two collectives the operator uses so that every call is counted per phase."""
    import torch.distributed as dist

    a2a, batch = dist.all_to_all_single, dist.batch_isend_irecv

    def all_to_all_single(output, input, *args, group=None, **kwargs):  # noqa: A002 - torch's name
        n = dist.get_world_size(group)
        c = counts[counts["phase"]]
        c["a2a_calls"] += 1
        c["a2a_messages"] += n - 1
        c["a2a_bytes"] += input.numel() * input.element_size() * (n - 1) // n
        return a2a(output, input, *args, group=group, **kwargs)

    def batch_isend_irecv(ops):
        c = counts[counts["phase"]]
        for op in ops:
            if op.op is dist.isend:
                c["ring_messages"] += 1
                c["ring_bytes"] += op.tensor.numel() * op.tensor.element_size()
        return batch(ops)

    dist.all_to_all_single, dist.batch_isend_irecv = all_to_all_single, batch_isend_irecv


def _inputs(shape, seq: int) -> list[torch.Tensor]:
    """Global q, k, v, dout ``(1, seq, heads, head_dim)`` in bf16 (same on every rank)."""
    gen = torch.Generator().manual_seed(0)
    heads = (shape.heads, shape.kv_heads, shape.kv_heads, shape.heads)
    return [torch.randn(1, seq, h, shape.head_dim, generator=gen).to(torch.bfloat16) for h in heads]


def worker(rank: int, world: int, seq: int) -> list[dict]:
    """Per layout and shape: this rank's counts in the forward and in the backward."""
    from ringft.ops.parallel import build_layout
    from ringft.ops.sharding import cp_shard
    from ringft.ops.ulysses import ulysses_ring_attention

    counts: dict = {}
    _counting(counts)
    rows = []
    for u in (8, 4, 2, 1):
        layout = build_layout(world, u)
        for name, shape in SHAPES.items():
            q, k, v, dout = (cp_shard(t, rank, world, u) for t in _inputs(shape, seq))
            q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
            zero = dict.fromkeys(("a2a_calls", "a2a_messages", "a2a_bytes", "ring_messages", "ring_bytes"), 0)
            counts.update(fwd=dict(zero), bwd=dict(zero), phase="fwd")
            out = ulysses_ring_attention(q, k, v, groups=layout, backend="torch", validate=False)
            counts["phase"] = "bwd"
            out.backward(dout)
            rows.append({"u": u, "shape": name, "fwd": counts["fwd"], "bwd": counts["bwd"]})
    return rows


def _predicted(shape, seq: int, u: int) -> dict:
    t = layer_traffic(shape, seq, u, WORLD // u, batch=1, dtype_bytes=2)
    keys = ("a2a_calls", "a2a_messages", "a2a_bytes", "ring_messages", "ring_bytes")
    return {phase: {k: getattr(t, k)[i] for k in keys} for i, phase in enumerate(("fwd", "bwd"))}


def _kib(n: int) -> str:
    return f"{n / 1024:g}"


def model_vs_h100() -> str:
    """The time model's attention compute against every recorded H100 figure (a markdown table)."""
    rows = [
        "| S | N | recorded ms per rank (fwd+bwd) | model ms | model / recorded |",
        "|---|---|---|---|---|",
    ]
    for seq, n, ms in H100_ATTENTION:
        model = sum(attention_seconds(LLAMA, seq, 1, n)) * 1e3
        rows.append(f"| {seq // 1024}K | {n} | {ms:.1f} | {model:.1f} | {model / ms:.3f} |")
    fused, ring = (sum(attention_seconds(LLAMA, 128 * 1024, 1, n)) for n in (1, 8))
    efficiency = 100 * fused / (8 * ring)
    rows.append(f"\nring step efficiency at N = 8, 128K: model {efficiency:.1f}% (recorded 93.5%)")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Run the 8-process emulation and print the table (exit 1 if any count differs)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=1024, help="global sequence length (a multiple of 16)")
    p.add_argument("--markdown-out", help="also write the tables here")
    p.add_argument("--model-only", action="store_true", help="only the model vs the recorded H100 figures")
    args = p.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    print(model_vs_h100() + "\n")
    if args.model_only:
        return 0
    results = run_distributed(worker, WORLD, args.seq, timeout=600)
    lines = [
        f"- command: `python benchmarks/bench_ulysses.py {shlex.join(given)}`",
        f"- machine: {describe_machine()}; {WORLD} gloo processes; S = {args.seq}, bf16, batch 1",
        f"- date: {time.strftime('%Y-%m-%d')}",
        "",
        "| K/V heads (copies sent) | ulysses x ring | phase | all-to-all calls | all-to-all messages "
        "| all-to-all KiB | ring messages | ring KiB | vs the model's counts and bytes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ok = True
    for i, row in enumerate(results[0]):
        shape = SHAPES[row["shape"]]
        predicted = _predicted(shape, args.seq, row["u"])
        for phase in ("fwd", "bwd"):
            measured = [results[r][i][phase] for r in range(WORLD)]
            same = all(m == predicted[phase] for m in measured)
            ok &= same
            m = measured[0]
            copies = kv_replication(shape.kv_heads, row["u"])
            verdict = "equal on all 8 ranks" if same else f"DIFFERS: {predicted[phase]}"
            lines.append(
                f"| {shape.kv_heads} ({copies}x) | {row['u']} x {WORLD // row['u']} | {phase} | "
                f"{m['a2a_calls']} | {m['a2a_messages']} | {_kib(m['a2a_bytes'])} | {m['ring_messages']} | "
                f"{_kib(m['ring_bytes'])} | {verdict} |"
            )
    text = "\n".join(lines)
    print(text)
    if args.markdown_out:
        Path(args.markdown_out).write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
