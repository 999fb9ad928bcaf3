"""Attention whose value head dim differs from the query/key head dim (latent attention: DeepSeek-V3's
``qk_head_dim`` 192 and ``v_head_dim`` 128).

On the ring K and V travel at their own sizes (one flat buffer of k's and v's elements, split into
views on receipt), and so do their dK/dV accumulators. Every block backend takes one head dim for q,
k and v (torch's CPU and CUDA flash kernels refuse different ones; flash-attn too), so each block
call pads locally, after receipt (:class:`LatentAttention`): V up to the q/k dim (the padded output
columns are exactly zero and sliced off; ``dout``'s padded columns are zero, so no gradient reaches
them), or q and k up to V's dim (zero columns add nothing to any score; the softmax scale is fixed
from the real q/k dim first). Exact; no padded byte crosses the ring, with or without a sliding
window.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ringft.ops.backends import get_backend
from ringft.ops.tiles import tiled

Tensor = torch.Tensor

__all__ = ["LatentAttention", "block_kernel"]


def _pad(x: Tensor, dim: int) -> Tensor:
    return x if x.shape[-1] == dim else F.pad(x, (0, dim - x.shape[-1]))


_CALLS = (
    "forward", "backward", "forward_varlen", "backward_varlen", "forward_masked", "backward_masked",
    "forward_window", "backward_window", "causal_tile", "band_tile",
)  # fmt: skip


def _method(name: str):
    if name.startswith("forward"):

        def forward(self, q, k, v, *rest, **kw):
            d = self.dim
            out, lse = getattr(self.inner, name)(_pad(q, d), _pad(k, d), _pad(v, d), *rest, **kw)
            return out[..., : self.dv], lse

        return forward
    if name.startswith("backward"):

        def backward(self, dout, q, k, v, out, lse, *rest, **kw):
            d, call = self.dim, getattr(self.inner, name)
            padded = (_pad(x, d) for x in (dout, q, k, v, out))
            dq, dk, dv = call(*padded, lse, *rest, **kw)
            return dq[..., : self.dqk], dk[..., : self.dqk], dv[..., : self.dv]

        return backward
    return lambda self, *args, **kw: getattr(self.inner, name)(*args, **kw)


class LatentAttention:
    """A block backend taking q/k of head dim ``dqk`` and v of ``dv``: each call pads to
    ``max(dqk, dv)``, runs ``inner`` and slices out, dq, dk and dv back to their own dims. Build it
    with :meth:`wrap`: its class has exactly the optional capabilities of ``inner``
    (:class:`~ringft.ops.backends.VarlenAttention`, ...), so the ``isinstance`` checks still choose."""

    def __init__(self, inner: Any, dqk: int, dv: int) -> None:
        self.inner, self.dqk, self.dv, self.dim = inner, dqk, dv, max(dqk, dv)
        self.name = inner.name

    @classmethod
    def wrap(cls, inner: Any, dqk: int, dv: int) -> Any:
        """``inner`` itself when ``dqk == dv``, else a :class:`LatentAttention` around it."""
        if dqk == dv:
            return inner
        calls = {name: _method(name) for name in _CALLS if hasattr(inner, name)}
        return type(f"Latent{type(inner).__name__}", (cls,), calls)(inner, dqk, dv)

    def check(self, q: Tensor) -> str | None:
        """The inner backend's check, on q as the kernel gets it (padded)."""
        return self.inner.check(q[..., :1].expand(*q.shape[:-1], self.dim))


def block_kernel(backend: str, q: Tensor, v: Tensor, tile: int | None):
    """The block backend for q ``(..., dqk)`` and v ``(..., dv)``, in tiles of ``tile`` tokens
    (:func:`ringft.ops.tiles.tiled`), padding each call to one head dim where they differ
    (:class:`LatentAttention`)."""
    dqk, dv = q.shape[-1], v.shape[-1]
    inner = tiled(get_backend(backend, q.device, q.dtype, max(dqk, dv)), tile)
    return LatentAttention.wrap(inner, dqk, dv)
