"""Latent attention (v head dim != q/k head dim) through the operator, against the fp64 oracle.

fp64, one rank (the padding happens before the ring, so every CP size runs the same padded ring;
the model-level comparison at CP 1-4 is DeepSeek-V3 in tests/model/test_families.py). Bound:
64 eps64 relative, as tests/ops/test_sinks.py (the same sums in another order).
"""

from __future__ import annotations

import torch

from ringft.ops import zigzag_ring_attention
from tests.oracle import full_attention_fp64

BOUND = 64 * torch.finfo(torch.float64).eps


def test_v_narrower_or_wider_than_q_and_k_is_exact():
    gen = torch.Generator().manual_seed(0)
    for dqk, dv in ((24, 12), (8, 20)):
        q = torch.randn(2, 16, 4, dqk, generator=gen, dtype=torch.float64, requires_grad=True)
        k = torch.randn(2, 16, 2, dqk, generator=gen, dtype=torch.float64, requires_grad=True)
        v = torch.randn(2, 16, 2, dv, generator=gen, dtype=torch.float64, requires_grad=True)
        dout = torch.randn(2, 16, 4, dv, generator=gen, dtype=torch.float64)
        out = zigzag_ring_attention(q, k, v, backend="torch", sliding_window=5)
        assert out.shape == (2, 16, 4, dv)
        got = [out, *torch.autograd.grad(out, (q, k, v), dout)]
        from tests.oracle import windowed_attention_fp64

        ref = windowed_attention_fp64(q, k, v, 5)[0]
        want = [ref, *torch.autograd.grad(ref, (q, k, v), dout)]
        for a, b in zip(got, want):
            assert (a - b).abs().max() <= BOUND * b.abs().max(), (dqk, dv)
        full = zigzag_ring_attention(q, k, v, backend="reference")
        assert (full - full_attention_fp64(q, k, v, True)[0]).abs().max() <= BOUND * full.abs().max()
