"""The ``torch`` block backend: PyTorch's fused attention ops that return the log-sum-exp.

CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), GQA native.
CUDA: ``aten._scaled_dot_product_flash_attention`` for fp16/bf16 with ``head_dim % 8 == 0`` and
``<= 256``, ``aten._scaled_dot_product_efficient_attention`` otherwise; K/V heads are expanded
locally (after communication) because these CUDA ops need equal head counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringft.ops.dtypes import accumulator_dtype
from ringft.ops.gqa import expand_kv_heads, reduce_kv_head_grads

Tensor = torch.Tensor

__all__ = [
    "CPU_BAND_TILE",
    "CPU_CAUSAL_TILE",
    "EFFICIENT_LSE_ALIGN",
    "TorchBackend",
    "pad_lse_for_efficient_backward",
]

# On CPU the causal blocks of packed documents run as aligned tiles of this many tokens (one batched
# masked call) plus rectangles (see TorchBackend.causal_tile).
CPU_CAUSAL_TILE = 64

# Sliding-window bands on CPU run as masked strips and tiles of this many query rows plus unmasked
# rectangles (see TorchBackend.band_tile).
CPU_BAND_TILE = 64

# The efficient-attention kernel stores its lse with the sequence dim rounded up to this multiple
# (kAlignLSE in aten/src/ATen/native/transformers/cuda/mem_eff_attention) and its backward reads
# that many rows with no bounds check.
EFFICIENT_LSE_ALIGN = 32


def pad_lse_for_efficient_backward(lse: Tensor, align: int = EFFICIENT_LSE_ALIGN) -> Tensor:
    """``lse (B, H, S)`` -> fp32 ``(B, H, ceil(S / align) * align)`` contiguous, padded with +inf.

    The layout the efficient-attention forward returns and its backward reads: +inf in the padding
    makes ``exp(score - lse)`` zero for the padded rows (the forward pads the same way).
    """
    pad = (-lse.shape[-1]) % align
    lse = lse.float()
    return (F.pad(lse, (0, pad), value=float("inf")) if pad else lse).contiguous()


class TorchBackend:
    """Block attention with torch's fused kernels; layouts as in :mod:`ringft.ops.backends`.

    ``forward(q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D), causal, softmax_scale)`` -> ``(out (B, Sq, Hq,
    D) in q's dtype, lse (B, Hq, Sq) fp32/fp64)``; ``backward`` takes the merged ``out``/``lse``.
    """

    name = "torch"

    def check(self, q: Tensor) -> str | None:
        """Why these kernels cannot run on ``q`` (CPU and CUDA only), or None."""
        if q.device.type not in ("cpu", "cuda"):
            return f"backend 'torch' supports CPU and CUDA tensors, got device {q.device.type!r}"
        return None

    @staticmethod
    def causal_tile(q: Tensor) -> int | None:
        """Tile size for the causal blocks of packed documents (``ringft.ops.document_blocks``), or
        None to run each document's causal block in one call.

        CPU: the fused kernel computes a causal block in key tiles of 512 (query tiles of 32 to 256)
        and masks inside them, so a short causal block costs its full square: measured forward +
        backward (4 heads, head_dim 64, one thread) 120 ns per causal pair at 512 tokens, 88 at
        1024, against 59-63 for rectangles of >= 256 keys. So on CPU the block is cut into aligned
        tiles of 64 tokens, all in one batched masked call (:meth:`forward_masked`), plus rectangles
        by recursive halving: about 32 wasted keys per query. Tiles of 128 measured the same at 16
        documents of 16K tokens and 6 % slower at 256 (benchmarks/history.md, packed documents).
        CUDA kernels skip masked tiles at a finer grain: one call per document.
        """
        return CPU_CAUSAL_TILE if q.device.type == "cpu" else None

    @staticmethod
    def band_tile(q: Tensor, window: int) -> int | None:
        """Rows per strip / triangle tile of a sliding-window band (:mod:`ringft.ops.band`), or None.

        CPU: the fused kernel computes a masked block in full and runs small query blocks slower
        (its backward most), so a band is cut into masked strips and tiles of ``CPU_BAND_TILE``
        rows (``tile - 1`` wasted keys per row, about ``tile / 2`` at each edge) and large unmasked
        rectangles; 32 and 128 measured no better than 64 at windows 512 and 4096
        (benchmarks/bench_windows.py). CUDA: None (unmasked and causal calls; the CUDA kernels skip
        masked tiles themselves).
        """
        return CPU_BAND_TILE if q.device.type == "cpu" else None

    @staticmethod
    def forward_masked(
        q: Tensor, k: Tensor, v: Tensor, mask: Tensor, softmax_scale: float
    ) -> tuple[Tensor, Tensor]:
        """CPU only: ``(out (B, Sq, Hq, D), lse (B, Hq, Sq))`` of q ``(B, Sq, Hq, D)`` against k/v
        ``(B, Sk, Hkv, D)`` with the additive ``mask (B, 1, Sq, Sk)`` (0 or -inf, q's dtype; no row
        fully masked)."""
        return _cpu_forward(q, k, v, False, softmax_scale, mask)

    @staticmethod
    def backward_masked(
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        mask: Tensor,
        softmax_scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """CPU only: the backward of :meth:`forward_masked`, ``(dq, dk, dv)`` shaped like q, k, v."""
        return _cpu_backward(dout, q, k, v, out, lse, False, softmax_scale, mask)

    @staticmethod
    def _use_cuda_flash(q: Tensor) -> bool:
        d = q.shape[-1]
        return q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float
    ) -> tuple[Tensor, Tensor]:
        """``(out (B, Sq, Hq, D), lse (B, Hq, Sq))`` of ``q`` against ``k``/``v``."""
        if q.device.type == "cpu":
            return _cpu_forward(q, k, v, causal, softmax_scale)
        groups = q.shape[2] // k.shape[2]
        qt = q.transpose(1, 2)
        kt = expand_kv_heads(k, groups).transpose(1, 2)
        vt = expand_kv_heads(v, groups).transpose(1, 2)
        if self._use_cuda_flash(q):
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                qt, kt, vt, 0.0, causal, False, scale=softmax_scale
            )
            out, lse = res[0], res[1]
        else:
            res = torch.ops.aten._scaled_dot_product_efficient_attention(
                qt, kt, vt, None, True, 0.0, causal, scale=softmax_scale
            )
            # The kernel pads lse's seq dim (EFFICIENT_LSE_ALIGN); the merge wants (B, H, Sq).
            out, lse = res[0], res[1][..., : q.shape[1]]
        return out.transpose(1, 2), lse.float()

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        softmax_scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq (B, Sq, Hq, D), dk, dv (B, Sk, Hkv, D))`` w.r.t. the merged ``out``/``lse``."""
        if q.device.type == "cpu":
            return _cpu_backward(dout, q, k, v, out, lse, causal, softmax_scale)
        groups = q.shape[2] // k.shape[2]
        qt, dot, ot = q.transpose(1, 2), dout.transpose(1, 2), out.transpose(1, 2)
        kt = expand_kv_heads(k, groups).transpose(1, 2)
        vt = expand_kv_heads(v, groups).transpose(1, 2)
        # None passes an undefined tensor: no varlen offsets, no dropout RNG state, no bias.
        if self._use_cuda_flash(q):
            sq, sk = q.shape[1], k.shape[1]
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dot,
                qt,
                kt,
                vt,
                ot,
                lse.float().contiguous(),
                None,
                None,
                sq,
                sk,
                0.0,
                causal,
                None,
                None,
                scale=softmax_scale,
            )
        else:
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                dot,
                qt,
                kt,
                vt,
                None,
                ot,
                pad_lse_for_efficient_backward(lse),
                None,
                None,
                0.0,
                [True, True, True, False],
                causal,
                scale=softmax_scale,
            )
        return (
            dq.transpose(1, 2),
            reduce_kv_head_grads(dk.transpose(1, 2), groups),
            reduce_kv_head_grads(dv.transpose(1, 2), groups),
        )


def _cpu_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """torch's fused CPU attention (GQA native) in the (B, S, H, D) layout: ``(out, lse (B, Hq, Sq))``."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2), lse.to(accumulator_dtype(q.dtype))


def _cpu_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of :func:`_cpu_forward` w.r.t. the merged ``out``/``lse``: ``(dq, dk, dv)``."""
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *(t.transpose(1, 2) for t in (dout, q, k, v, out)),
        lse.to(accumulator_dtype(q.dtype)).contiguous(),
        0.0,
        causal,
        attn_mask=mask,
        scale=scale,
    )
    return tuple(g.transpose(1, 2) for g in grads)
