"""Small CPU checks of the block backends' helpers: dtype names, the efficient-attention lse padding,
and autocast on the operator itself."""

from __future__ import annotations

import pytest
import torch

from ringft.ops import DTYPES, accumulator_dtype, dtype_from_name, dtype_name, zigzag_ring_attention
from ringft.ops.torch_backend import EFFICIENT_LSE_ALIGN, pad_lse_for_efficient_backward
from tests.oracle import full_attention_fp64


def test_dtype_names():
    assert {n: dtype_name(d) for n, d in DTYPES.items()} == {n: n for n in DTYPES}
    assert dtype_from_name("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'float8'.*fp32, bf16"):
        dtype_from_name("float8")
    with pytest.raises(ValueError, match="choose one of bf16, fp32"):
        dtype_from_name("fp16", allowed=("bf16", "fp32"))
    assert accumulator_dtype(torch.bfloat16) is torch.float32
    assert accumulator_dtype(torch.float64) is torch.float64


@pytest.mark.parametrize("seq", [1, 31, 32, 33, 70])
def test_efficient_lse_padding(seq):
    lse = torch.randn(2, 3, seq, dtype=torch.bfloat16)
    padded = pad_lse_for_efficient_backward(lse)
    rounded = -(-seq // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN
    assert padded.shape == (2, 3, rounded) and padded.dtype == torch.float32 and padded.is_contiguous()
    assert torch.equal(padded[..., :seq], lse.float())
    assert bool(torch.isposinf(padded[..., seq:]).all())
    # A view with non-unit strides (a slice of the merged lse) comes out contiguous too.
    view = torch.randn(2, 3, 2 * seq).float()[..., seq:]
    assert torch.equal(pad_lse_for_efficient_backward(view)[..., :seq], view)


@pytest.mark.numerics
def test_operator_follows_autocast():
    """Under CPU bf16 autocast, fp32 q/k and bf16 v (what RoPE leaves behind) run as bf16, like SDPA.

    Oracle: fp64 attention on the bf16-rounded inputs. Tolerance: the fused CPU kernel may round
    the probabilities to bf16 before the PV product (2^-8 relative) and stores out in bf16 (another
    2^-8); 1.6e-2 of max|out| is twice those two roundings. A wrong dtype path fails by raising.
    """
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 16, 4, 32, generator=gen) for _ in range(2))
    v = torch.randn(1, 16, 2, 32, generator=gen).bfloat16()
    k = k[:, :, :2]
    q.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = zigzag_ring_attention(q, k, v, backend="torch")
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32  # the gradient flows back to the fp32 input
    ref, _ = full_attention_fp64(q.detach().bfloat16(), k.bfloat16(), v, causal=True)
    assert (out.double() - ref).abs().max() <= 1.6e-2 * ref.abs().max()


def test_backends_declare_what_they_can_do():
    """The interface names every capability document_blocks uses: each backend is a BlockAttention,
    and the optional Protocols are exactly the ones whose methods it defines."""
    from ringft.ops.backends import (
        BlockAttention,
        CudnnBackend,
        FlashAttnBackend,
        MaskedTileAttention,
        ReferenceBackend,
        TorchBackend,
        VarlenAttention,
    )

    required = [m for m in ("check", "forward", "backward") if m in BlockAttention.__dict__]
    assert required == ["check", "forward", "backward"]
    expected = {
        TorchBackend: (False, True),
        FlashAttnBackend: (True, False),
        ReferenceBackend: (True, False),
        CudnnBackend: (False, False),
    }
    for cls, (varlen, tiles) in expected.items():
        backend = cls()
        assert all(callable(getattr(backend, m)) for m in required), cls
        assert isinstance(backend, VarlenAttention) is varlen, cls
        assert isinstance(backend, MaskedTileAttention) is tiles, cls
