"""The Gated DeltaNet state exchange and conv halo (ringft.ops.linear_scan) of N ranks, emulated in
one process, against transformers' token-by-token recurrence over the whole sequence.

Oracle: ``torch_recurrent_gated_delta_rule`` (transformers' reference loop), run in fp64 through
tests/model/hybrid_models.py's ``fp64_linear_kernels`` (its ``torch.float32`` casts made fp64), per
document for packed rows. The ring runs transformers' chunked kernel on each chunk from the widened
state ``[0 | I]`` and composes the chunks' affine maps. Bound: both sides sum the same terms in
other orders through at most S = 48 steps of k_dim = 4 products each (and the kernel's 64-token
triangular solve), so the error is a few hundred eps64 relative to the largest value: 1e-10 leaves
a wide margin while any wrong state, orientation or boundary is O(1e-1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringft.ops.linear_scan import chunk_halos, conv_reach, conv_tails, emulate_gated_delta_rule, halo_conv
from ringft.ops.sharding import cp_shard, cp_unshard
from tests.model.hybrid_models import fp64_linear_kernels, kernels

SEQ, KH, VH, KD, VD = 48, 2, 4, 4, 3
TOL64, TOL32 = 1e-10, 1e-5  # fp32: the kernels' own rounding over 48 steps (eps32 * 48 * 4 ~ 2e-5 worst)
DOCS = [[0, 5, 17, 18, 30, 48], [0, 24, 48]]  # inside chunks, on chunk edges (CP 4: chunks of 6)


def _inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, SEQ, KH, KD, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(2, SEQ, VH, VD, generator=gen, dtype=dtype)
    g = -torch.rand(2, SEQ, VH, generator=gen, dtype=dtype) * 0.5  # decay exp(g) in (0.6, 1]
    beta = torch.rand(2, SEQ, VH, generator=gen, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _reference(recurrent, inputs, offsets=None):
    if offsets is None:
        return recurrent(*inputs[:3], g=inputs[3], beta=inputs[4], use_qk_l2norm_in_kernel=True)[0]
    rows = []
    for b, cuts in enumerate(offsets):
        pieces = [
            recurrent(
                *(t[b : b + 1, lo:hi] for t in inputs[:3]),
                g=inputs[3][b : b + 1, lo:hi],
                beta=inputs[4][b : b + 1, lo:hi],
                use_qk_l2norm_in_kernel=True,
            )[0]  # fmt: skip
            for lo, hi in zip(cuts, cuts[1:])
        ]
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows)


def _with_grads(fn, inputs, dout, *args, **kwargs):
    out = fn(*args, **kwargs)
    grads = torch.autograd.grad(out, inputs, dout)
    return [out.detach(), *grads]


def _rel(got, want) -> float:
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want))


def _check(dtype, tol):
    chunk, recurrent = kernels()
    inputs = _inputs(dtype)
    dout = torch.randn(2, SEQ, VH, VD, dtype=dtype, generator=torch.Generator().manual_seed(1))
    for offsets in (None, DOCS):
        want = _with_grads(_reference, inputs, dout, recurrent, inputs, offsets)
        for size in (1, 2, 3, 4):
            ring = emulate_gated_delta_rule
            got = _with_grads(ring, inputs, dout, chunk, *inputs, size, offsets, use_qk_l2norm_in_kernel=True)
            err = _rel(got, want)
            assert err < tol, f"cp {size}, documents {offsets is not None}: {err:.1e}"


def test_chunk_composition_matches_the_recurrence_fp64():
    with fp64_linear_kernels():
        _check(torch.float64, TOL64)


def test_chunk_composition_with_transformers_fp32_kernels():
    _check(torch.float32, TOL32)


def test_halo_conv_matches_one_convolution():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, SEQ, dtype=torch.float64, generator=gen)
    weight, bias = torch.randn(5, 4, dtype=torch.float64, generator=gen), torch.randn(5, dtype=torch.float64)
    whole = F.conv1d(x, weight.unsqueeze(1), bias, padding=3, groups=5)[..., :SEQ]

    def conv(piece):
        return F.conv1d(piece, weight.unsqueeze(1), bias, padding=3, groups=5)[..., : piece.shape[-1]]

    alone = torch.cat(
        [
            torch.cat([conv(x[b : b + 1, :, lo:hi]) for lo, hi in zip(cuts, cuts[1:])], -1)
            for b, cuts in enumerate(DOCS)
        ]
    )
    for offsets, want in ((None, whole), (DOCS, alone)):
        for size in (1, 2, 3, 4):
            shards = [cp_shard(x, r, size, dim=2) for r in range(size)]
            tails = torch.stack([conv_tails(s, 4) for s in shards])
            outs = [
                halo_conv(s, chunk_halos(tails, r), weight, bias, conv_reach(offsets, SEQ, r, size, 4))
                for r, s in enumerate(shards)
            ]
            got = cp_unshard(outs, dim=2)
            assert (got - want).abs().max() < 1e-13, (size, offsets is not None)
