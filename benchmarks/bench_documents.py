"""Packed-document (per-document causal) zigzag attention vs unmasked causal, emulated on one CPU.

The N-rank ring schedule runs in one process (``ringft.ops.emulate.run_schedule``, no communication),
forward + backward, with and without a document layout, on one global sequence of ``--seq`` tokens
cut into 1, 16 and 256 documents (seeded uniform cut points; any lengths). For each layout:

- step time: the sum over ranks of each rank's forward + backward compute, and the slowest rank's,
  both relative to the unmasked run. Times are this process's CPU time (one thread:
  ``time.process_time``), so other load on the machine does not count; layouts are interleaved
  within each repeat and the minimum over repeats is kept;
- FLOPs: attention (query, key) pairs computed, relative to unmasked causal (``DocumentLayout``);
- overhead vs ideal: (time ratio) / (FLOP ratio); 1.0 = time proportional to FLOPs. Target
  <= 1.10 at 16 documents;
- per-rank imbalance: max / min over ranks of compute time and of pairs; "balanced" rows reorder
  the same documents inside the row as ``RingDataCollator(packing=True)`` does.

The default head shape is that of LLaMA-3 and Mistral attention (GQA 4, head_dim 128; 8 query
heads); ``--heads 4 --kv-heads 1 --head-dim 64`` runs a small shape ~4x faster, where torch's CPU
kernel weighs more on small blocks.

Usage: ``python benchmarks/bench_documents.py [--seq 16K] [--world 4] [--docs 1,16,256]``.
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import describe_machine  # noqa: E402
from ringft.data.packer import balanced_order  # noqa: E402
from ringft.ops import DTYPES, default_softmax_scale, get_backend  # noqa: E402
from ringft.ops.documents import document_layout  # noqa: E402
from ringft.ops.emulate import run_schedule  # noqa: E402
from ringft.ops.sharding import cp_shard  # noqa: E402


def _int_list(text: str) -> list[int]:
    return [int(x[:-1]) * 1024 if x.lower().endswith("k") else int(x) for x in text.split(",") if x]


def cut_points(seq: int, docs: int, seed: int, world: int, balanced: bool) -> list[int]:
    """Global document offsets: ``docs`` documents with seeded uniform random boundaries, in the
    order cut or reordered as the packing collator does (``balanced_order``)."""
    cuts = sorted(random.Random(seed).sample(range(1, seq), docs - 1)) if docs > 1 else []
    cu = [0, *cuts, seq]
    if not balanced:
        return cu
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    out = [0]
    for i in balanced_order(lengths, seq, world):
        out.append(out[-1] + lengths[i])
    return out


def layout_pairs(args, cu: list[int] | None) -> list[int]:
    """Attention (query, key) pairs per rank for offsets ``cu`` (None: unmasked causal)."""
    n, seq = args.world, args.seq
    return [document_layout([cu or [0, seq]], seq, r, n).attention_pairs() for r in range(n)]


def time_layout(args, shards, cu: list[int] | None) -> list[float]:
    """CPU seconds of each rank's forward + backward for offsets ``cu`` (None: no documents at all)."""
    n, seq = args.world, args.seq
    kernel = get_backend(args.backend, torch.device("cpu"), DTYPES[args.dtype])
    layouts = None if cu is None else [document_layout([cu], seq, r, n) for r in range(n)]
    spent = [0.0] * n

    def timer(r, fn):
        t0 = time.process_time()
        fn()
        spent[r] += time.process_time() - t0

    scale = default_softmax_scale(args.head_dim)
    for rank in range(n):
        run_schedule(
            kernel, *shards, causal=True, softmax_scale=scale, ranks=[rank], timer=timer, layouts=layouts
        )
    return spent


def main(argv: list[str] | None = None) -> None:
    """Run the layouts and print one Markdown table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=lambda t: _int_list(t)[0], default=16384)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--docs", type=_int_list, default=[1, 16, 256])
    # LLaMA-3 / Mistral attention: GQA 4, head_dim 128 (8 of their 32 query heads, one thread)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--backend", default="torch")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    shape = (1, args.seq)
    q, dout = (torch.randn(*shape, args.heads, args.head_dim, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(*shape, args.kv_heads, args.head_dim, generator=gen).to(dtype) for _ in range(2))
    shards = [[cp_shard(t, r, args.world).contiguous() for r in range(args.world)] for t in (q, k, v, dout)]
    layouts = {(0, False): None}
    for docs in args.docs:
        for balanced in (False, True) if docs > 1 else (False,):
            layouts[docs, balanced] = cut_points(args.seq, docs, args.seed, args.world, balanced)
    best: dict[int, list[float]] = {}
    for repeat in range(args.warmup + args.repeats):
        for key, cu in layouts.items():  # interleaved: every repeat times every layout once
            t = time_layout(args, shards, cu)
            if repeat >= args.warmup:
                best[key] = t if key not in best else [min(a, b) for a, b in zip(best[key], t)]
    base_t, base_pairs = best[0, False], layout_pairs(args, None)
    rows = []
    for (docs, balanced), cu in layouts.items():
        if not docs:
            continue
        t, pairs = best[docs, balanced], layout_pairs(args, cu)
        time_ratio, flop_ratio = sum(t) / sum(base_t), sum(pairs) / sum(base_pairs)
        rows.append(
            f"| {docs}{' balanced' if balanced else ''} | {sum(t) * 1e3:.0f} | {time_ratio:.3f} "
            f"| {max(t) / max(base_t):.3f} "
            f"| {flop_ratio:.3f} | {time_ratio / flop_ratio:.2f} | {max(t) / min(t):.2f} "
            f"| {max(pairs) / min(pairs):.2f} |"
        )
    cmd = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    print(
        f"### packed documents: S={args.seq}, N={args.world} emulated, {args.dtype}, backend {args.backend}\n"
    )
    print(f"- command: `{cmd}`\n- machine: {describe_machine()}")
    print(
        f"- heads {args.heads}, kv_heads {args.kv_heads}, head_dim {args.head_dim}, "
        f"torch.set_num_threads({args.threads}); unmasked causal: {sum(base_t) * 1e3:.0f} ms "
        f"(sum over ranks, fwd+bwd), per-rank max/min {max(base_t) / min(base_t):.2f}; "
        f"CPU time, minimum of {args.repeats} interleaved repeats after {args.warmup} warm-up\n"
    )
    print("| docs | ms (sum of ranks) | time / unmasked | slowest rank / unmasked | FLOPs / unmasked "
          "| overhead vs FLOP-ideal | rank time max/min | rank FLOPs max/min |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
