"""Cost per (query, key) pair of torch's fused CPU attention kernel, by block shape.

Forward + backward of ``TorchBackend`` (``aten._scaled_dot_product_flash_attention_for_cpu``) on
rectangles ``q (1, Sq, heads, dim)`` x ``k/v (1, Sk, kv_heads, dim)`` and on causal squares
(column ``causal``: time per *computed* causal pair, ``Sq (Sq + 1) / 2``). One thread, CPU time,
minimum of ``--repeats``. This is the table behind the packed-document tiling on CPU
(``TorchBackend.causal_tile``): small blocks and short causal blocks cost more per pair.

Usage: ``python benchmarks/bench_cpu_shapes.py [--sizes 64,128,256,512,1024,2048]``.
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
from ringft.ops import default_softmax_scale, get_backend  # noqa: E402


def ns_per_pair(kernel, sq: int, sk: int, causal: bool, args) -> float:
    """Best CPU time of one forward + backward, divided by the pairs it computes, in ns."""
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, sq, args.heads, args.head_dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, sk, args.kv_heads, args.head_dim, generator=gen) for _ in range(2))
    scale = default_softmax_scale(args.head_dim)
    calls = max(1, int(args.pairs // (sq * sk)))  # enough calls per timing to be measurable
    best = float("inf")
    for _ in range(args.repeats):
        t0 = time.process_time()
        for _ in range(calls):
            out, lse = kernel.forward(q, k, v, causal, scale)
            kernel.backward(dout, q, k, v, out, lse, causal, scale)
        best = min(best, (time.process_time() - t0) / calls)
    pairs = sq * (sq + 1) / 2 if causal else sq * sk
    return best / pairs * 1e9


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64,128,256,512,1024,2048")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--pairs", type=float, default=2e6, help="pairs per timing (calls are repeated up to it)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    kernel = get_backend("torch", torch.device("cpu"), torch.float32)
    print(f"- command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`")
    print(f"- machine: {describe_machine()}")
    shape = f"heads {args.heads}, kv_heads {args.kv_heads}, head_dim {args.head_dim}"
    print(f"- fp32, {shape}, one thread; ns per pair, forward + backward\n")
    print("| queries \\ keys | " + " | ".join(map(str, sizes)) + " | causal |")
    print("|---:" * (len(sizes) + 2) + "|")
    for sq in sizes:
        cells = [ns_per_pair(kernel, sq, sk, False, args) for sk in sizes]
        cells.append(ns_per_pair(kernel, sq, sq, True, args))
        print(f"| {sq} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
