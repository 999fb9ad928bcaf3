"""Block attention in tiles of a bounded number of tokens, exact, around any backend.

``tiled(backend, tokens)`` wraps a :class:`~ringft.ops.backends.BlockAttention` so that every call
on a block of ``seq_q`` queries and ``seq_k`` keys runs as kernel calls on tiles of at most
``tokens`` queries and ``tokens`` keys: query tile ``[a, b)`` attends to key tiles ``[c, d)`` on
the same grid (multiples of ``tokens``), and the tiles' results are merged by log-sum-exp in the
accumulator dtype (:func:`ringft.ops.merge.merge_attention_`, as the ring merges blocks). For the
causal diagonal block (``causal`` is only used with ``seq_q == seq_k``) query tile ``[a, b)`` meets
the key tiles before ``a`` unmasked and the square ``[a, b)`` causally; key tiles after it are
never computed.

Backward, per query tile, against the externally merged ``out``/``lse`` rows (exact for any
partition of the keys): the tile's dq is summed over its key tiles in the accumulator dtype and
written once in q's dtype; dk/dv are summed over the query tiles in the accumulator dtype and
returned in it (fp32; fp64 for fp64 inputs), which the ring adds into its own accumulators.

So a kernel never sees more than ``tokens`` queries or keys, and the transient memory of one call
is the backend's transient at ``tokens x tokens`` plus the wrapper's own buffers: one query tile's
fp32 output (forward) or dq (backward), ``tokens * Hq * D * 4`` bytes, and the fp32 dk/dv of the
whole key block, ``2 * seq_k * Hkv * D * 4`` bytes (the untiled kernel returns them in the input
dtype). A block no larger than one tile is passed to the backend unchanged (bit for bit).

Optional capabilities (:mod:`ringft.ops.backends`) follow the inner backend:

- ``WindowAttention`` (flash-attn, reference): tiled too: query tile ``[a, b)`` takes one native
  window call on the keys its rows can see (at most ``tokens + window - 1`` of them);
- ``MaskedTileAttention`` (torch on CPU): passed through; its callers already cut the work into
  masked tiles of 64 rows (``causal_tile`` / ``band_tile``) and unmasked pieces, which come back
  to this wrapper's tiled ``forward``/``backward``;
- ``VarlenAttention`` (flash-attn's varlen, the reference's mask) is *not* offered: packed
  documents then run as one causal call per document plus rectangles
  (:mod:`ringft.ops.document_blocks`), each tiled here. Exact; for flash-attn that means one call
  per document instead of one varlen call per block, as cuDNN always does.
"""

from __future__ import annotations

import functools

import torch

from ringft.ops.backends import BlockAttention, MaskedTileAttention, WindowAttention
from ringft.ops.dtypes import accumulator_dtype
from ringft.ops.merge import merge_attention_

Tensor = torch.Tensor

__all__ = ["TiledAttention", "key_tiles", "tiled"]


def tile_tokens_problem(tokens: object) -> str | None:
    """Why ``attention_tile_tokens`` is unusable (an integer >= 1, or None for no tiling), or None."""
    if tokens is None or (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1):
        return None
    return f"attention_tile_tokens must be an integer >= 1 or null, got {tokens!r}"


def key_tiles(a: int, b: int, seq_k: int, tokens: int, causal: bool) -> list[tuple[int, int, bool]]:
    """The key tiles ``(c, d, causal)`` that query rows ``[a, b)`` meet: the grid tiles of
    ``[0, seq_k)``, or with ``causal`` (``a`` on the grid, square block) those before ``a``
    unmasked and then the square ``[a, b)`` causally."""
    if causal:
        return [(c, c + tokens, False) for c in range(0, a, tokens)] + [(a, b, True)]
    return [(c, min(c + tokens, seq_k), False) for c in range(0, seq_k, tokens)]


class TiledAttention:
    """A backend's block attention over tiles of at most ``tokens`` queries and keys (see the
    module docstring); layouts and results as in :mod:`ringft.ops.backends`, except that a tiled
    ``backward`` returns dk/dv in the accumulator dtype."""

    def __init__(self, inner: BlockAttention, tokens: int) -> None:
        self.inner = inner
        self.tokens = tokens
        self.name = inner.name

    def check(self, q: Tensor) -> str | None:
        """The inner backend's check."""
        return self.inner.check(q)

    def _whole(self, q: Tensor, k: Tensor) -> bool:
        return q.shape[1] <= self.tokens and k.shape[1] <= self.tokens

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float
    ) -> tuple[Tensor, Tensor]:
        """``(out (B, Sq, Hq, D) in q's dtype, lse (B, Hq, Sq))``, tile by tile."""
        if self._whole(q, k):
            return self.inner.forward(q, k, v, causal, softmax_scale)
        acc = accumulator_dtype(q.dtype)
        out = torch.empty_like(q)
        lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=acc, device=q.device)
        for a in range(0, q.shape[1], self.tokens):
            b = min(a + self.tokens, q.shape[1])
            o_tile = l_tile = None
            for c, d, diag in key_tiles(a, b, k.shape[1], self.tokens, causal):
                o, l_ = self.inner.forward(q[:, a:b], k[:, c:d], v[:, c:d], diag, softmax_scale)
                if o_tile is None:
                    o_tile, l_tile = o.to(acc), l_.to(acc)
                else:
                    merge_attention_(o_tile, l_tile, o, l_)
            out[:, a:b] = o_tile
            lse[:, :, a:b] = l_tile
        return out, lse

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
        """``(dq (B, Sq, Hq, D) in q's dtype, dk, dv (B, Sk, Hkv, D) in the accumulator dtype)``
        against the merged ``out``/``lse``, tile by tile."""
        if self._whole(q, k):
            return self.inner.backward(dout, q, k, v, out, lse, causal, softmax_scale)
        acc = accumulator_dtype(q.dtype)
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for a in range(0, q.shape[1], self.tokens):
            b = min(a + self.tokens, q.shape[1])
            rows = (dout[:, a:b], q[:, a:b])
            dq_tile = None
            for c, d, diag in key_tiles(a, b, k.shape[1], self.tokens, causal):
                gq, gk, gv = self.inner.backward(
                    *rows, k[:, c:d], v[:, c:d], out[:, a:b], lse[:, :, a:b], diag, softmax_scale
                )
                dq_tile = gq.to(acc) if dq_tile is None else dq_tile.add_(gq)
                dk[:, c:d] += gk
                dv[:, c:d] += gv
            dq[:, a:b] = dq_tile
        return dq, dk, dv


class _TiledWindow:
    """``WindowAttention`` in query tiles: rows ``[a, b)`` see keys ``[a + offset - window + 1,
    b + offset - 1]`` (clipped to the block), one native call each."""

    def _visible(self, a: int, b: int, seq_k: int, offset: int, window: int) -> tuple[int, int]:
        return max(0, a + offset - window + 1), min(seq_k, b + offset)

    def forward_window(
        self, q: Tensor, k: Tensor, v: Tensor, offset: int, window: int, softmax_scale: float
    ) -> tuple[Tensor, Tensor]:
        """``(out (B, Sq, Hq, D), lse (B, Hq, Sq))`` of the band, tile by tile."""
        if self._whole(q, k):
            return self.inner.forward_window(q, k, v, offset, window, softmax_scale)
        out = torch.empty_like(q)
        acc = accumulator_dtype(q.dtype)
        lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=acc, device=q.device)
        for a in range(0, q.shape[1], self.tokens):
            b = min(a + self.tokens, q.shape[1])
            c, d = self._visible(a, b, k.shape[1], offset, window)
            o, l_ = self.inner.forward_window(
                q[:, a:b], k[:, c:d], v[:, c:d], a + offset - c, window, softmax_scale
            )
            out[:, a:b], lse[:, :, a:b] = o, l_
        return out, lse

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
        """Backward of :meth:`forward_window`: dq in q's dtype, dk/dv in the accumulator dtype."""
        if self._whole(q, k):
            return self.inner.backward_window(dout, q, k, v, out, lse, offset, window, softmax_scale)
        acc = accumulator_dtype(q.dtype)
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for a in range(0, q.shape[1], self.tokens):
            b = min(a + self.tokens, q.shape[1])
            c, d = self._visible(a, b, k.shape[1], offset, window)
            r = slice(a, b)
            gq, gk, gv = self.inner.backward_window(
                dout[:, r], q[:, r], k[:, c:d], v[:, c:d], out[:, r], lse[:, :, r], a + offset - c, window,
                softmax_scale,
            )  # fmt: skip
            dq[:, r] = gq
            dk[:, c:d] += gk
            dv[:, c:d] += gv
        return dq, dk, dv


class _PassMasked:
    """``MaskedTileAttention`` passed through to the inner backend (its calls are tiles already)."""

    def causal_tile(self, q: Tensor) -> int | None:
        """The inner backend's tile for causal blocks of documents."""
        return self.inner.causal_tile(q)

    def band_tile(self, q: Tensor, window: int) -> int | None:
        """The inner backend's rows per band strip."""
        return self.inner.band_tile(q, window)

    def forward_masked(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, softmax_scale: float):
        """The inner backend's batched masked call."""
        return self.inner.forward_masked(q, k, v, mask, softmax_scale)

    def backward_masked(self, dout, q, k, v, out, lse, mask, softmax_scale):
        """The inner backend's batched masked backward."""
        return self.inner.backward_masked(dout, q, k, v, out, lse, mask, softmax_scale)


@functools.cache
def _tiled_class(window: bool, masked: bool) -> type:
    bases = ((_TiledWindow,) if window else ()) + ((_PassMasked,) if masked else ()) + (TiledAttention,)
    return bases[0] if len(bases) == 1 else type("TiledAttention", bases, {})


def tiled(backend: BlockAttention, tokens: int | None) -> BlockAttention:
    """``backend`` in tiles of at most ``tokens`` queries and keys (an int >= 1), or ``backend``
    itself for ``None``. The result offers ``WindowAttention`` / ``MaskedTileAttention`` where
    ``backend`` does, never ``VarlenAttention`` (see the module docstring)."""
    if tokens is None:
        return backend
    problem = tile_tokens_problem(tokens)
    if problem:
        raise ValueError(problem)
    inner = backend.inner if isinstance(backend, TiledAttention) else backend
    cls = _tiled_class(isinstance(inner, WindowAttention), isinstance(inner, MaskedTileAttention))
    return cls(inner, tokens)
