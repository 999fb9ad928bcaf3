"""The ``reference`` block backend: plain matmul + softmax in fp32 (fp64 for fp64 inputs).

For tests and debugging only: it materialises the ``(batch, heads, seq_q, seq_k)`` score matrix.
"""

from __future__ import annotations

import torch

from ringft.ops.dtypes import accumulator_dtype
from ringft.ops.gqa import expand_kv_heads, reduce_kv_head_grads

Tensor = torch.Tensor

__all__ = ["ReferenceBackend"]


class ReferenceBackend:
    """Block attention by explicit scores; layouts as in :mod:`ringft.ops.backends`.

    ``forward(q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D), causal, softmax_scale)`` -> ``(out (B, Sq, Hq,
    D) in q's dtype, lse (B, Hq, Sq) fp32/fp64)``; ``backward`` takes the merged ``out``/``lse``.
    """

    name = "reference"

    def check(self, q: Tensor) -> str | None:
        """Always usable (any device, any float dtype)."""
        return None

    @staticmethod
    def _scores(q: Tensor, k: Tensor, causal: bool, softmax_scale: float, bounds=None, band=None) -> Tensor:
        acc = accumulator_dtype(q.dtype)
        groups = q.shape[2] // k.shape[2]
        kx = expand_kv_heads(k, groups).to(acc)
        s = torch.einsum("bqhd,bkhd->bhqk", q.to(acc), kx) * softmax_scale
        if band is not None:  # (offset, window): row i sees key j iff 0 <= i + offset - j < window
            offset, window = band
            gap = torch.arange(q.shape[1], device=q.device)[:, None] + offset
            gap = gap - torch.arange(k.shape[1], device=q.device)[None, :]
            s = s.masked_fill(~((gap >= 0) & (gap < window)), float("-inf"))
        if causal:
            sq, sk = q.shape[1], k.shape[1]
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
            if bounds is not None:  # and only inside each segment [bounds[i], bounds[i+1])
                lengths = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])], device=q.device)
                segment = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths)
                mask &= segment[:, None] == segment[None, :]
            s = s.masked_fill(~mask, float("-inf"))
        return s

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float, bounds=None, band=None
    ) -> tuple[Tensor, Tensor]:
        """``(out (B, Sq, Hq, D), lse (B, Hq, Sq))`` of ``q`` against ``k``/``v`` (causal only
        inside the segments ``bounds`` when given; only the ``band = (offset, window)`` when given)."""
        acc = accumulator_dtype(q.dtype)
        groups = q.shape[2] // k.shape[2]
        s = self._scores(q, k, causal, softmax_scale, bounds, band)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.einsum("bhqk,bkhd->bqhd", p, expand_kv_heads(v, groups).to(acc))
        return out.to(q.dtype), lse

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
        bounds=None,
        band=None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq (B, Sq, Hq, D), dk, dv (B, Sk, Hkv, D))`` w.r.t. the merged ``out``/``lse``."""
        acc = accumulator_dtype(q.dtype)
        groups = q.shape[2] // k.shape[2]
        s = self._scores(q, k, causal, softmax_scale, bounds, band)
        p = torch.exp(s - lse.to(acc).unsqueeze(-1))  # probabilities w.r.t. the merged lse
        do, o = dout.to(acc), out.to(acc)
        kx, vx = expand_kv_heads(k, groups).to(acc), expand_kv_heads(v, groups).to(acc)
        dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
        dp = torch.einsum("bqhd,bkhd->bhqk", do, vx)
        delta = (do * o).sum(-1).transpose(1, 2).unsqueeze(-1)  # (B, H, Sq, 1)
        ds = p * (dp - delta) * softmax_scale
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, kx)
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(acc))
        return (
            dq.to(q.dtype),
            reduce_kv_head_grads(dk, groups).to(k.dtype),
            reduce_kv_head_grads(dv, groups).to(v.dtype),
        )

    def forward_varlen(
        self, q: Tensor, k: Tensor, v: Tensor, bounds: tuple[int, ...], softmax_scale: float
    ) -> tuple[Tensor, Tensor]:
        """Causal attention inside each segment ``[bounds[i], bounds[i+1])`` (one masked call):
        q ``(B, S, Hq, D)``, k/v ``(B, S, Hkv, D)`` -> ``(out (B, S, Hq, D), lse (B, Hq, S))``."""
        return self.forward(q, k, v, True, softmax_scale, bounds)

    def backward_varlen(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        bounds: tuple[int, ...],
        softmax_scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Backward of :meth:`forward_varlen`: ``(dq, dk, dv)`` shaped like q, k, v."""
        return self.backward(dout, q, k, v, out, lse, True, softmax_scale, bounds)

    def forward_window(
        self, q: Tensor, k: Tensor, v: Tensor, offset: int, window: int, softmax_scale: float
    ) -> tuple[Tensor, Tensor]:
        """Sliding-window band (row ``i`` sees key ``j`` iff ``0 <= i + offset - j < window``), one
        masked call: q ``(B, Sq, Hq, D)``, k/v ``(B, Sk, Hkv, D)`` -> ``(out, lse (B, Hq, Sq))``."""
        return self.forward(q, k, v, False, softmax_scale, band=(offset, window))

    def backward_window(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        offset: int,
        window: int,
        softmax_scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Backward of :meth:`forward_window`: ``(dq, dk, dv)`` shaped like q, k, v."""
        return self.backward(dout, q, k, v, out, lse, False, softmax_scale, band=(offset, window))
