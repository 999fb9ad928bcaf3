"""Attention in tiles (:mod:`ringft.ops.tiles`): the wrapper against the untiled call and the fp64
oracle, on the ``reference`` and ``torch`` backends, one process (the ring with tiles is checked in
tests/ops/test_zigzag_ring.py, the model in tests/model/test_patch.py).

Tolerances (max-abs error relative to the max-abs of the oracle tensor):
- fp64: tiles only reorder sums of <= 13 keys and the log-sum-exp merge: 1e-12 against both the
  untiled call and the oracle.
- fp32 / bf16: at most 2x the untiled call's error against fp64 (on the rounded inputs) plus one
  rounding of the dtype (fp32 1e-6, bf16 4e-3 = 2^-8): a tile's output is rounded once to the input
  dtype before the fp32 merge and once after it, the untiled output once.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ringft.ops.backends import MaskedTileAttention, VarlenAttention, WindowAttention, get_backend
from ringft.ops.tiles import key_tiles, tiled
from ringft.ops.zigzag import zigzag_ring_attention
from tests.oracle import full_attention_fp64, per_document_attention_fp64, windowed_attention_fp64

SCALE = 0.3


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _inputs(sq: int, sk: int, dtype: torch.dtype, hq: int = 4, hkv: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(2, sq, hq, 8, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(2, sk, hkv, 8, generator=gen).to(dtype) for _ in range(2))
    return q, k, v, dout


def _oracle(q, k, v, dout, causal):
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    out, lse = full_attention_fp64(qd, kd, vd, causal, SCALE)
    return (out.detach(), lse.detach(), *torch.autograd.grad(out, (qd, kd, vd), dout.double()))


def _run(kernel, q, k, v, dout, causal):
    out, lse = kernel.forward(q, k, v, causal, SCALE)
    return (out, lse, *kernel.backward(dout, q, k, v, out, lse, causal, SCALE))


def test_key_tiles():
    assert key_tiles(0, 3, 7, 3, False) == [(0, 3, False), (3, 6, False), (6, 7, False)]
    assert key_tiles(6, 7, 7, 3, True) == [(0, 3, False), (3, 6, False), (6, 7, True)]
    assert key_tiles(0, 3, 7, 3, True) == [(0, 3, True)]


@pytest.mark.numerics
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_tiles_exact_in_fp64(backend):
    """Tiles of 1, 3 (odd), 5 (not dividing 13) and 64 (> the block): causal square blocks and
    rectangles (13 queries x 11 keys), GQA 4/2 and MQA 4/1."""
    inner = get_backend(backend, torch.device("cpu"))
    for causal, tokens, hkv in itertools.product([True, False], [1, 3, 5, 64], [2, 1]):
        q, k, v, dout = _inputs(13, 13 if causal else 11, torch.float64, hkv=hkv)
        got = _run(tiled(inner, tokens), q, k, v, dout, causal)
        untiled = _run(inner, q, k, v, dout, causal)
        for name, g, u, r in zip(
            ("out", "lse", "dq", "dk", "dv"), got, untiled, _oracle(q, k, v, dout, causal)
        ):
            where = f"{backend} causal={causal} tokens={tokens} kv={hkv} {name}"
            assert g.shape == u.shape, where
            assert _rel(g, u) < 1e-12 and _rel(g, r) < 1e-12, where
        if tokens == 64:  # one tile: the inner backend's own call
            assert all(torch.equal(g, u) for g, u in zip(got, untiled))


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_within_the_dtype_bound(dtype):
    inner = get_backend("torch", torch.device("cpu"))
    rounding = 1e-6 if dtype == torch.float32 else 4e-3
    for causal in (True, False):
        q, k, v, dout = _inputs(40, 40 if causal else 33, dtype, seed=1)
        ref = _oracle(q, k, v, dout, causal)
        got = _run(tiled(inner, 7), q, k, v, dout, causal)
        base = _run(inner, q, k, v, dout, causal)
        assert got[0].dtype == dtype and got[1].dtype == torch.float32
        for name, g, b, r in zip(("out", "lse", "dq", "dk", "dv"), got, base, ref):
            assert _rel(g, r) <= 2 * _rel(b, r) + rounding, f"{dtype} causal={causal} {name}"


@pytest.mark.numerics
def test_window_tiles_exact_in_fp64():
    """A native window call cut into query tiles, each on the keys its rows see."""
    inner = get_backend("reference", torch.device("cpu"))
    for (sq, sk, offset, window), tokens in itertools.product([(13, 13, 0, 4), (9, 20, 8, 6)], [1, 4, 5]):
        q, k, v, dout = _inputs(sq, sk, torch.float64, seed=2)
        kernel = tiled(inner, tokens)
        out, lse = kernel.forward_window(q, k, v, offset, window, SCALE)
        ref_out, ref_lse = inner.forward_window(q, k, v, offset, window, SCALE)
        grads = kernel.backward_window(dout, q, k, v, ref_out, ref_lse, offset, window, SCALE)
        refs = inner.backward_window(dout, q, k, v, ref_out, ref_lse, offset, window, SCALE)
        for g, r in zip((out, lse, *grads), (ref_out, ref_lse, *refs)):
            assert _rel(g, r) < 1e-12, (sq, sk, offset, window, tokens)


@pytest.mark.numerics
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_operator_with_documents_and_windows(backend):
    """One rank: packed documents and a sliding window through the tiled kernel, against fp64."""
    cu = [[0, 9, 30, 48], [0, 48]]
    q, k, v, dout = _inputs(48, 48, torch.float64, seed=3)
    for extra, oracle in [
        ({"cu_seqlens": cu}, lambda a, b, c: per_document_attention_fp64(a, b, c, cu)),
        ({"sliding_window": 10}, lambda a, b, c: windowed_attention_fp64(a, b, c, 10)),
    ]:
        qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
        ro, rl = oracle(qd, kd, vd)
        ref = (ro, rl, *torch.autograd.grad(ro, (qd, kd, vd), dout))
        for tokens in (1, 7):
            qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
            out, lse = zigzag_ring_attention(
                qt, kt, vt, backend=backend, return_lse=True, attention_tile_tokens=tokens, **extra
            )
            got = (out, lse, *torch.autograd.grad(out, (qt, kt, vt), dout))
            for g, r in zip(got, ref):
                assert _rel(g, r) < 1e-12, (backend, extra, tokens)


def test_capabilities_and_refusals():
    reference, torch_cpu = (get_backend(n, torch.device("cpu")) for n in ("reference", "torch"))
    assert tiled(reference, None) is reference
    ref_tiled = tiled(reference, 8)
    assert isinstance(ref_tiled, WindowAttention) and not isinstance(ref_tiled, VarlenAttention)
    assert isinstance(tiled(torch_cpu, 8), MaskedTileAttention)
    assert not isinstance(tiled(torch_cpu, 8), WindowAttention)
    again = tiled(ref_tiled, 3)
    assert again.inner is reference and again.tokens == 3 and again.name == "reference"
    for bad in (0, 2.5, True, "64"):
        with pytest.raises(ValueError, match="attention_tile_tokens must be an integer >= 1"):
            tiled(reference, bad)
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"zigzag_ring_attention: attention_tile_tokens must be .*got 0"):
        zigzag_ring_attention(q, q, q, backend="torch", attention_tile_tokens=0)
