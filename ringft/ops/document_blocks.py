"""One ring step of zigzag attention over packed documents (see :mod:`ringft.ops.documents`).

Step 0 is a varlen causal attention over the local document ranges: a backend's own
``forward_varlen`` / ``backward_varlen`` when it has one (flash-attn, the reference's mask),
otherwise fused calls per document, or, where the backend is a ``MaskedTileAttention`` whose
``causal_tile`` asks for it (torch on CPU), aligned tiles in one batched masked call plus
rectangles. Later steps are one unmasked rectangle per row (or none).
Batch rows with the same layout share each call.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ringft.ops.backends import BlockAttention, MaskedTileAttention, VarlenAttention
from ringft.ops.documents import DocumentLayout, RowLayout
from ringft.ops.dtypes import accumulator_dtype
from ringft.ops.merge import merge_attention_

Tensor = torch.Tensor
Piece = tuple[slice, slice, Tensor, Tensor]  # (batch rows, kv positions, dk, dv)

__all__ = [
    "Piece",
    "backward_block_documents",
    "causal_pieces",
    "forward_block_documents",
    "tile_mask",
    "varlen_backward",
    "varlen_forward",
]


def _row_groups(layout: DocumentLayout) -> list[tuple[slice, RowLayout]]:
    if layout.uniform:
        return [(slice(None), layout.rows[0])]
    return [(slice(b, b + 1), row) for b, row in enumerate(layout.rows)]


@lru_cache(maxsize=64)
def causal_pieces(
    bounds: tuple[int, ...], tile: int | None
) -> tuple[int, tuple[tuple[int, int, int, int, bool], ...]]:
    """How to cover the causal triangle of every segment ``[bounds[i], bounds[i+1])`` of
    ``[0, bounds[-1])``: ``(aligned, pieces)``.

    Without ``tile``: ``aligned = 0`` and one causal call ``(q0, q1, k0, k1, True)`` per segment.
    With ``tile``, ``[0, aligned)`` (``aligned`` = the largest multiple of ``tile``) is cut into
    aligned tiles of ``tile`` tokens that run in one batched call masked to "same segment, key <=
    query" (:func:`tile_mask`); the pieces are then the causal calls of the segments' parts in the
    tail ``[aligned, end)``, followed by unmasked rectangles covering each segment's remaining pairs
    (key in an earlier tile than the query): the staircase of its tile-aligned units, by recursive
    halving, so few and large calls. A row's diagonal result comes before its rectangles.
    Cached: every layer of a step asks for the same bounds.
    """
    if tile is None:
        return 0, tuple((x, y, x, y, True) for x, y in zip(bounds, bounds[1:]))
    end = bounds[-1]
    aligned = end - end % tile
    tail = [(max(x, aligned), y) for x, y in zip(bounds, bounds[1:]) if y > aligned]
    pieces = [(x, y, x, y, True) for x, y in tail]
    for x, y in zip(bounds, bounds[1:]):
        cuts = [x, *range((x // tile + 1) * tile, y, tile), y]
        halves = [(0, len(cuts) - 1)]
        while halves:
            lo, hi = halves.pop()
            if hi - lo >= 2:
                mid = (lo + hi) // 2
                pieces.append((cuts[mid], cuts[hi], cuts[lo], cuts[mid], False))
                halves += [(lo, mid), (mid, hi)]
    return aligned, tuple(pieces)


@lru_cache(maxsize=4)
def tile_mask(
    bounds: tuple[int, ...], aligned: int, tile: int, batch: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """Additive mask ``(batch * aligned / tile, 1, tile, tile)`` of the aligned tiles of
    :func:`causal_pieces`: 0 where key and query share a segment and key <= query, else -inf.
    Cached: every layer (forward, recomputation, backward) of a step reuses it."""
    cuts = torch.tensor(bounds[1:-1], dtype=torch.long, device=device)
    segment = torch.searchsorted(cuts, torch.arange(aligned, device=device), right=True).view(-1, tile)
    keep = segment[:, :, None] == segment[:, None, :]
    keep &= torch.ones(tile, tile, dtype=torch.bool, device=device).tril()
    mask = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))
    return mask.unsqueeze(1).repeat(batch, 1, 1, 1)


def _tiles(t: Tensor, aligned: int, tile: int) -> Tensor:
    """``t[:, :aligned] (B, aligned, H, D)`` -> ``(B * aligned / tile, tile, H, D)`` (a view when
    contiguous)."""
    return t[:, :aligned].reshape(-1, tile, *t.shape[2:])


def _untile_lse(lse: Tensor, batch: int, aligned: int) -> Tensor:
    """Tiled lse ``(B * n, H, tile)`` -> ``(B, H, n * tile)``."""
    n, heads, tile = lse.shape[0] // batch, lse.shape[1], lse.shape[2]
    return lse.view(batch, n, heads, tile).permute(0, 2, 1, 3).reshape(batch, heads, aligned)


def _tile_lse(lse: Tensor, aligned: int, tile: int) -> Tensor:
    """``lse[..., :aligned] (B, H, aligned)`` -> ``(B * aligned / tile, H, tile)``."""
    batch, heads = lse.shape[:2]
    return lse[..., :aligned].reshape(batch, heads, -1, tile).permute(0, 2, 1, 3).reshape(-1, heads, tile)


def _tile(kernel: BlockAttention, q: Tensor) -> int | None:
    return kernel.causal_tile(q) if isinstance(kernel, MaskedTileAttention) else None


def varlen_forward(
    kernel: BlockAttention, q: Tensor, k: Tensor, v: Tensor, bounds: tuple[int, ...], softmax_scale: float
) -> tuple[Tensor, Tensor]:
    """Causal attention inside each segment ``[bounds[i], bounds[i+1])`` of q ``(B, S, Hq, D)`` and
    k/v ``(B, S, Hkv, D)``: ``(out (B, S, Hq, D) in the accumulator dtype, lse (B, Hq, S))``.

    A backend's own ``forward_varlen`` when it has one, else the fused op per
    :func:`causal_pieces` (aligned tiles of the backend's ``causal_tile``), merged by log-sum-exp."""
    acc = accumulator_dtype(q.dtype)
    if isinstance(kernel, VarlenAttention):
        out, lse = kernel.forward_varlen(q, k, v, bounds, softmax_scale)
        return out.to(acc), lse.to(acc)
    batch, seq = q.shape[:2]
    tile = _tile(kernel, q)
    aligned, pieces = causal_pieces(bounds, tile)
    tiles = None
    if aligned:
        mask = tile_mask(bounds, aligned, tile, batch, q.dtype, q.device)
        o, l_ = kernel.forward_masked(*(_tiles(t, aligned, tile) for t in (q, k, v)), mask, softmax_scale)
        tiles = o.reshape(batch, aligned, q.shape[2], v.shape[-1]), _untile_lse(l_, batch, aligned)
    if tiles is not None and aligned == seq and tiles[0].dtype == acc:
        out, lse = tiles  # fresh tensors, no copy
    else:
        out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=acc, device=q.device)  # v's head dim
        lse = torch.empty((batch, q.shape[2], seq), dtype=acc, device=q.device)
        if tiles is not None:
            out[:, :aligned], lse[:, :, :aligned] = tiles
    for q0, q1, k0, k1, causal in pieces:
        o, l_ = kernel.forward(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], causal, softmax_scale)
        if causal:  # the first result for these rows
            out[:, q0:q1], lse[:, :, q0:q1] = o, l_
        else:
            merge_attention_(out[:, q0:q1], lse[:, :, q0:q1], o, l_)
    return out, lse


def varlen_backward(
    kernel: BlockAttention,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    bounds: tuple[int, ...],
    softmax_scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of :func:`varlen_forward` w.r.t. the merged ``out``/``lse``: ``(dq, dk, dv)`` shaped
    like q and k/v (the accumulator dtype when the block was cut into tiles)."""
    if isinstance(kernel, VarlenAttention):
        return kernel.backward_varlen(dout, q, k, v, out, lse, bounds, softmax_scale)
    tile = _tile(kernel, q)
    aligned, pieces = causal_pieces(bounds, tile)
    acc = accumulator_dtype(q.dtype)
    disjoint = not aligned and all(p[4] for p in pieces)  # one piece per segment: each entry written once
    tiles = None
    if aligned:
        mask = tile_mask(bounds, aligned, tile, q.shape[0], q.dtype, q.device)
        grads = kernel.backward_masked(
            *(_tiles(t, aligned, tile) for t in (dout, q, k, v, out)),
            _tile_lse(lse, aligned, tile),
            mask,
            softmax_scale,
        )
        tiles = [g.reshape(t.shape[0], aligned, *t.shape[2:]) for g, t in zip(grads, (q, k, v))]
    if disjoint:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    elif tiles is not None and aligned == q.shape[1] and q.dtype == acc:
        dq, dk, dv = tiles  # fresh tensors: the rectangles add into them
    else:  # tiles and rectangles add up, in the accumulator dtype
        dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
        if tiles is not None:
            for grad, g in zip((dq, dk, dv), tiles):
                grad[:, :aligned] = g
    for q0, q1, k0, k1, causal in pieces:
        gq, gk, gv = kernel.backward(
            dout[:, q0:q1], q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], out[:, q0:q1], lse[:, :, q0:q1],
            causal, softmax_scale,
        )  # fmt: skip
        if disjoint:
            dq[:, q0:q1], dk[:, k0:k1], dv[:, k0:k1] = gq, gk, gv
        else:
            dq[:, q0:q1] += gq
            dk[:, k0:k1] += gk
            dv[:, k0:k1] += gv
    return dq, dk, dv


def forward_block_documents(
    kernel: BlockAttention,
    q: Tensor,
    kb: Tensor,
    vb: Tensor,
    out: Tensor | None,
    lse: Tensor | None,
    *,
    step: int,
    layout: DocumentLayout,
    softmax_scale: float,
) -> tuple[Tensor, Tensor]:
    """:func:`ringft.ops.zigzag_blocks.forward_block` restricted to the documents of ``layout``.

    q ``(B, seq_local, Hq, D)``, kb/vb ``(B, seq_local, Hkv, D)``; accumulators ``out``
    ``(B, seq_local, Hq, D)`` and ``lse`` ``(B, Hq, seq_local)`` are created at step 0.
    """
    groups = _row_groups(layout)
    if step == 0:
        if len(groups) == 1:
            return varlen_forward(kernel, q, kb, vb, groups[0][1].diagonal, softmax_scale)
        parts = [
            varlen_forward(kernel, q[rs], kb[rs], vb[rs], row.diagonal, softmax_scale) for rs, row in groups
        ]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    for rs, row in groups:
        rect = row.blocks[step]
        if rect is not None:
            q0, q1, k0, k1 = rect
            blk_out, blk_lse = kernel.forward(
                q[rs, q0:q1], kb[rs, k0:k1], vb[rs, k0:k1], False, softmax_scale
            )
            merge_attention_(out[rs, q0:q1], lse[rs, :, q0:q1], blk_out, blk_lse)
    return out, lse


def backward_block_documents(
    kernel: BlockAttention,
    dout: Tensor,
    q: Tensor,
    kb: Tensor,
    vb: Tensor,
    out: Tensor,
    lse: Tensor,
    dq: Tensor,
    *,
    step: int,
    layout: DocumentLayout,
    softmax_scale: float,
) -> list[Piece]:
    """:func:`ringft.ops.zigzag_blocks.backward_block` restricted to the documents of ``layout``:
    adds into ``dq`` in place and returns the K/V gradient pieces ``(rows, positions, dk, dv)``."""
    pieces: list[Piece] = []
    for rs, row in _row_groups(layout):
        if step == 0:
            gq, gk, gv = varlen_backward(
                kernel, dout[rs], q[rs], kb[rs], vb[rs], out[rs], lse[rs], row.diagonal, softmax_scale
            )
            dq[rs].add_(gq)
            pieces.append((rs, slice(None), gk, gv))
            continue
        rect = row.blocks[step]
        if rect is None:
            continue
        q0, q1, k0, k1 = rect
        gq, gk, gv = kernel.backward(
            dout[rs, q0:q1],
            q[rs, q0:q1],
            kb[rs, k0:k1],
            vb[rs, k0:k1],
            out[rs, q0:q1],
            lse[rs, :, q0:q1],
            False,
            softmax_scale,
        )
        dq[rs, q0:q1].add_(gq)
        pieces.append((rs, slice(k0, k1), gk, gv))
    return pieces
