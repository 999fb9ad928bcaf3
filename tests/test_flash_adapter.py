"""Contract test of the flash_attn adapter, with a stand-in for flash-attn (CUDA-only, not here).

The stand-in enforces flash-attn 2's calling contract: q/k/v/out (batch, seq, heads, head_dim)
contiguous, head_dim a multiple of 8, GQA heads native, softmax_lse (batch, heads, seq) fp32, and
the >= 2.6 keyword signature (or the 2.4-2.5 one). It computes with plain fp64 math, so the test
also checks that the adapter maps its arguments and the lse layout back correctly.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from ringft.ops.kernels import FlashAttnBackend, get_backend
from tests.oracle import full_attention_fp64


def _check_layout(*tensors):
    for t in tensors:
        assert t.dim() == 4 and t.is_contiguous() and t.shape[-1] % 8 == 0, t.shape


def _reference(q, k, v, causal, scale):
    # Padded trailing head-dim entries are zero, so they change neither scores nor values.
    return full_attention_fp64(q, k, v, causal, scale)


def make_stub(new_signature: bool):
    calls = []

    def fwd_new(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        return_softmax,
    ):
        _check_layout(q, k, v)
        assert (window_size_left, window_size_right, softcap, dropout_p) == (-1, -1, 0.0, 0.0)
        out, lse = _reference(q, k, v, causal, softmax_scale)
        calls.append(("fwd", q.shape, k.shape))
        return out.to(q.dtype), lse.float(), None, None

    def fwd_old(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
        assert tuple(window_size) == (-1, -1)
        out, lse, _, _ = fwd_new(q, k, v, dropout_p, softmax_scale, causal, -1, -1, 0.0, None, False)
        return out, q, k, v, out, lse, None, None

    def bwd_new(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):
        _check_layout(dout, q, k, v, out, dq, dk, dv)
        assert softmax_lse.dtype == torch.float32 and softmax_lse.shape == q.shape[:1] + (
            q.shape[2],
            q.shape[1],
        )
        qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
        o, _ = _reference(qd, kd, vd, causal, softmax_scale)
        gq, gk, gv = torch.autograd.grad(o, (qd, kd, vd), dout.double())
        dq.copy_(gq), dk.copy_(gk), dv.copy_(gv)
        calls.append(("bwd", q.shape, k.shape))

    def bwd_old(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):
        bwd_new(
            dout,
            q,
            k,
            v,
            out,
            softmax_lse,
            dq,
            dk,
            dv,
            dropout_p,
            softmax_scale,
            causal,
            -1,
            -1,
            0.0,
            alibi_slopes,
            deterministic,
            rng_state,
        )

    module = types.SimpleNamespace(
        _flash_attn_forward=fwd_new if new_signature else fwd_old,
        _flash_attn_backward=bwd_new if new_signature else bwd_old,
        calls=calls,
    )
    return module


@pytest.mark.parametrize("new_signature", [True, False])
@pytest.mark.parametrize("head_dim", [64, 20])  # 20 exercises zero-padding to a multiple of 8
@pytest.mark.parametrize("causal", [True, False])
def test_flash_adapter_contract(new_signature, head_dim, causal):
    stub = make_stub(new_signature)
    backend = FlashAttnBackend(module=stub)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 12, 4, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 12, 2, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 12, 2, head_dim, generator=gen, dtype=torch.float64)
    scale = head_dim**-0.5
    out, lse = backend.forward(q, k, v, causal, scale)
    ref_out, ref_lse = full_attention_fp64(q, k, v, causal)
    assert out.shape == q.shape and lse.shape == (2, 4, 12) and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    dout = torch.randn_like(q)
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, causal, scale)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    ro, _ = full_attention_fp64(qd, kd, vd, causal)
    for got, want in zip((dq, dk, dv), torch.autograd.grad(ro, (qd, kd, vd), dout)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # K/V reach the kernel with their own (fewer) heads: never expanded.
    assert [c[2][2] for c in stub.calls] == [2, 2]


def test_flash_adapter_checks():
    backend = FlashAttnBackend(module=make_stub(True))
    assert "CUDA" in backend.check(torch.zeros(1, 2, 1, 8))
    if not FlashAttnBackend.is_available():
        assert "not installed" in FlashAttnBackend().check(torch.zeros(1, 2, 1, 8))
    assert get_backend("auto", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("xformers", torch.device("cpu"))


def test_flash_adapter_is_lazy():
    # Building the backend must not import flash_attn (it is optional and CUDA-only).
    src = inspect.getsource(FlashAttnBackend.__init__)
    assert "import" not in src
    FlashAttnBackend()
