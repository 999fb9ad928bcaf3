"""Gated DeltaNet (linear attention) on the zigzag ring: bytes exchanged per layer and CPU time.

- bytes: what :mod:`ringft.ops.linear_scan` sends per linear-attention layer and rank, for the
  shapes of real configs (transformers' defaults of Qwen3.5 / Qwen3-Next: 16 key heads, 32 value
  heads, head dims 128, conv kernel 4): the forward all-gathers each rank's two chunks' ``[b | A]``
  (fp32, ``2 * v_heads * k_dim * (v_dim + k_dim)`` values per row) and conv tails
  (``2 * (kernel - 1) * conv_dim`` values in the model dtype, bf16 here); the backward all-reduces
  the gathered gradients (``cp_size`` times that). Independent of the sequence length.
- time: the recurrence of one layer (transformers' torch chunk kernel, fp32, q/k L2-normalised in
  the kernel), forward + backward, on the whole sequence in one process vs the ring of ``--world``
  ranks emulated in one process (:func:`ringft.ops.linear_scan.emulate_gated_delta_rule`: every
  rank's widened chunk run, the composition, the output correction; no communication). CPU time of
  this process (one thread, ``time.process_time``), minimum over ``--repeats``; the ring's total is
  the sum over ranks, so a balanced rank takes total / world. The convolution (4 taps) and the
  projections are per token and cost the same sharded or not.

Usage: ``python benchmarks/bench_linear_ring.py [--seq 4096] [--world 4] [--k-heads 4] [--v-heads 8]
[--dim 64]``.
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
from ringft.ops.linear_scan import emulate_gated_delta_rule  # noqa: E402

REAL = {  # linear-attention shapes of transformers' default configs (Qwen3.5 and Qwen3-Next agree)
    "Qwen3.5 / Qwen3-Next": dict(k_heads=16, v_heads=32, k_dim=128, v_dim=128, kernel=4),
}


def exchange_bytes(
    k_heads: int, v_heads: int, k_dim: int, v_dim: int, kernel: int, world: int, batch: int = 1
):
    """(forward bytes sent per rank, forward bytes received per rank, backward all-reduce bytes per
    rank) of one linear-attention layer: state in fp32, conv tails in bf16."""
    state = batch * 2 * v_heads * k_dim * (v_dim + k_dim) * 4
    halo = batch * 2 * (kernel - 1) * (2 * k_heads * k_dim + v_heads * v_dim) * 2
    return state + halo, (world - 1) * (state + halo), world * (state + halo)


def _inputs(seq: int, k_heads: int, v_heads: int, dim: int):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, seq, k_heads, dim, generator=gen) for _ in range(2))
    v = torch.randn(1, seq, v_heads, dim, generator=gen)
    g = -torch.rand(1, seq, v_heads, generator=gen) * 0.1
    beta = torch.rand(1, seq, v_heads, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _cpu(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--k-heads", type=int, default=4)
    parser.add_argument("--v-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    rule = torch_chunk_gated_delta_rule.__wrapped__  # the torch path (flash-linear-attention not used)
    print("command: python " + " ".join(map(shlex.quote, sys.argv)))
    print("machine:", describe_machine())
    print("\n| shapes | N | forward sent / rank | forward received / rank | backward all-reduce payload |")
    print("|---|---|---|---|---|")
    for name, shape in REAL.items():
        for world in (2, 4, 8):
            sent, got, back = exchange_bytes(**shape, world=world)
            mib = [f"{x / 2**20:.2f} MiB" for x in (sent, got, back)]
            print(f"| {name} | {world} | " + " | ".join(mib) + " |")
    inputs = _inputs(args.seq, args.k_heads, args.v_heads, args.dim)
    dout = torch.randn(1, args.seq, args.v_heads, args.dim)

    def one():
        out = rule(*inputs[:3], g=inputs[3], beta=inputs[4], use_qk_l2norm_in_kernel=True)[0]
        torch.autograd.grad(out, inputs, dout)

    def ring():
        out = emulate_gated_delta_rule(rule, *inputs, args.world, use_qk_l2norm_in_kernel=True)
        torch.autograd.grad(out, inputs, dout)

    times = {"one": [], "ring": []}
    for _ in range(args.repeats):  # interleaved
        times["one"].append(_cpu(one))
        times["ring"].append(_cpu(ring))
    t_one, t_ring = min(times["one"]), min(times["ring"])
    shape = f"seq {args.seq}, {args.k_heads} key / {args.v_heads} value heads, head dims {args.dim}, fp32"
    print(f"\nrecurrence forward + backward ({shape}), CPU seconds, min of {args.repeats}:")
    print("| run | total | per rank (total / N) | total vs one process |")
    print("|---|---|---|---|")
    print(f"| one process | {t_one:.2f} | {t_one:.2f} | 1.00 |")
    ratio = t_ring / t_one
    print(f"| ring N = {args.world} (emulated) | {t_ring:.2f} | {t_ring / args.world:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
