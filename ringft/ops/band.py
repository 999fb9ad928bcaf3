"""Sliding-window (band) attention between one query block and one key block, by any backend.

Geometry, one frame for both: query row ``i`` of the q block sits at position ``i + delta``, key ``j``
of the k block at position ``j``; a row sees key ``j`` iff ``0 <= (i + delta) - j <= window - 1``
(transformers' sliding window: the ``window`` most recent positions, itself included). A
:class:`Band` names rows ``[r0, r1)`` and keys ``[k0, k1)``; :func:`trim_band` drops the rows that
see none of those keys and the keys no row sees, so no kernel ever gets a fully masked row.

How a backend computes a band (:func:`band_forward` / :func:`band_backward`): the rows fall into
regions by which edges cut them -- none (a rectangle), the causal edge only (a causal triangle
beside a rectangle), the window's lower edge only (an anti-causal triangle beside a rectangle),
both (a narrow band: each row sees exactly ``window`` keys) -- and

- a :class:`~ringft.ops.backends.WindowAttention` (flash-attn's ``window_size``, the reference's
  mask) takes the band in one native call;
- a :class:`~ringft.ops.backends.MaskedTileAttention` with a ``band_tile`` (torch on CPU, whose
  fused kernel computes a masked block in full) gets :func:`strip_runs`: triangles halved into
  large unmasked rectangles down to masked tiles of ``tile`` rows, narrow bands as masked strips
  of ``tile`` rows against the ``window + tile - 1`` keys they see; pieces of one shape run as
  one batched call over strided (uncopied) views, so time follows FLOPs up to ``tile`` wasted keys
  per row (about half a tile at each edge);
- anything else (torch on CUDA) gets :func:`square_pieces`: unmasked rectangles, causal squares,
  and anti-causal squares, which are causal squares on rows and keys in reverse order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ringft.ops.backends import BlockAttention, MaskedTileAttention, WindowAttention
from ringft.ops.dtypes import accumulator_dtype
from ringft.ops.merge import merge_attention_

Tensor = torch.Tensor

__all__ = [
    "Band",
    "Strip",
    "band_backward",
    "band_forward",
    "band_pairs",
    "square_pieces",
    "strip_runs",
    "trim_band",
]


@dataclass(frozen=True)
class Band:
    """Rows ``[r0, r1)`` of a q block and keys ``[k0, k1)`` of a k block (local indices); row ``i``
    is at position ``i + delta``, key ``j`` at ``j``; ``window >= 1``."""

    r0: int
    r1: int
    k0: int
    k1: int
    delta: int
    window: int


@dataclass(frozen=True)
class Strip:
    """One kernel call over ``count`` same-shaped pieces: piece ``t`` is query rows ``[r0 + t * step,
    + rows)`` against keys ``[k0 + t * step, + keys)``; in piece coordinates row ``i`` sees key ``j``
    iff ``0 <= i + offset - j <= window - 1``. ``masked``: some pair of a piece is not visible;
    ``primary``: the primary pieces of a band hold every row exactly once (they run first, so they
    can create a row's result; the others merge into it)."""

    r0: int
    count: int
    rows: int
    step: int
    k0: int
    keys: int
    offset: int
    window: int
    masked: bool
    primary: bool


def trim_band(band: Band) -> Band | None:
    """The band without rows that see no key and keys that no row sees (None if nothing is left).
    Every row of the result sees at least one key."""
    w = band.window
    p0 = max(band.r0 + band.delta, band.k0)
    p1 = min(band.r1 + band.delta, band.k1 + w - 1)
    if p0 >= p1:
        return None
    k0, k1 = max(band.k0, p0 - w + 1), min(band.k1, p1)
    return Band(p0 - band.delta, p1 - band.delta, k0, k1, band.delta, w)


def band_pairs(band: Band) -> int:
    """The (query, key) pairs of ``band`` that are visible (the FLOP count / (4 * heads * dim))."""
    band = trim_band(band)
    if band is None:
        return 0
    total = 0
    for i in range(band.r0, band.r1):
        p = i + band.delta
        total += min(band.k1 - 1, p) - max(band.k0, p - band.window + 1) + 1
    return total


def _band_pieces(band: Band, tile: int) -> list[tuple[int, int, int, int, bool]]:
    """``(row position, rows, first key, keys, primary)`` covering a trimmed band exactly, by
    regions between the rows where an edge starts or stops cutting: no edge -> one rectangle; the
    causal edge only -> a rectangle and a causal triangle; the window's lower edge only -> a
    rectangle and an anti-causal triangle; both (a narrow band) -> strips of ``tile`` rows over the
    ``window + tile - 1`` keys they see. Triangles are halved recursively into rectangles down to
    ``tile``-row tiles (masked), so most of their work runs as large unmasked calls."""
    w, k0, k1 = band.window, band.k0, band.k1
    p0, p1 = band.r0 + band.delta, band.r1 + band.delta
    pieces = []

    def triangle(a: int, b: int, anti: bool) -> None:
        if b - a <= tile:  # one masked tile: key <= row (causal) or key >= row - w + 1 (anti)
            pieces.append((a, b - a, a - w + 1 if anti else a, b - a, True))
            return
        mid = a + tile * -(-(b - a) // (2 * tile))
        if anti:  # the first rows see every key of the second half's window start
            pieces.append((a, mid - a, mid - w + 1, b - mid, False))
        else:  # the last rows see every key before them
            pieces.append((mid, b - mid, a, mid - a, False))
        triangle(a, mid, anti)
        triangle(mid, b, anti)

    cuts = sorted({p0, p1} | {x for x in (k1, k0 + w - 1) if p0 < x < p1})
    for s, e in zip(cuts, cuts[1:]):
        causal, lower = s < k1, s >= k0 + w - 1  # which edges cut these rows
        if not (causal or lower):
            pieces.append((s, e - s, k0, k1 - k0, True))
        elif not lower:  # keys [k0, row]
            if s > k0:
                pieces.append((s, e - s, k0, s - k0, False))
            triangle(s, e, anti=False)
        elif not causal:  # keys [row - w + 1, k1)
            if e - w + 1 < k1:
                pieces.append((s, e - s, e - w + 1, k1 - (e - w + 1), False))
            triangle(s, e, anti=True)
        else:  # keys [row - w + 1, row]
            for a in range(s, e, tile):
                rows = min(a + tile, e) - a
                pieces.append((a, rows, a - w + 1, rows + w - 1, True))
    return pieces


@lru_cache(maxsize=256)
def strip_runs(band: Band, tile: int) -> tuple[Strip, ...]:
    """:func:`_band_pieces` of a trimmed ``band`` as kernel calls: pieces of one shape whose rows
    and keys move on by the same step become one batched :class:`Strip`. Primary calls come first.
    Cached (every layer, the recomputation and the backward ask again)."""
    w, d = band.window, band.delta
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for p, rows, k, keys, primary in _band_pieces(band, tile):
        offset = p - k
        masked = not (offset >= keys - 1 and rows - 1 + offset <= w - 1)
        groups.setdefault((not primary, rows, keys, offset, masked), []).append((p - d, k))
    runs = []
    for (secondary, rows, keys, offset, masked), items in sorted(groups.items()):
        items.sort()
        i = 0
        while i < len(items):
            j, step = i + 1, 0
            while j < len(items):
                gap = items[j][0] - items[j - 1][0]
                if gap < rows or (step and gap != step):
                    break
                step, j = gap, j + 1
            first = items[i]
            runs.append(Strip(first[0], j - i, rows, step, first[1], keys, offset, w, masked, not secondary))
            i = j
    return tuple(runs)


@lru_cache(maxsize=256)
def square_pieces(band: Band, tile: int) -> tuple[tuple[int, int, int, int, str], ...]:
    """Cover a trimmed ``band`` exactly by pieces ``(q0, q1, k0, k1, kind)`` (local indices) with
    ``kind`` ``"full"`` (every pair visible), ``"causal"`` (a square, key <= query) or ``"anti"``
    (a square, key >= query: the window's lower edge), for kernels that skip masked tiles
    themselves: where one edge cuts, one square and one rectangle; where both cut (a narrow band),
    rows in tiles of at most ``min(tile, window - 1)``, each a causal and an anti square and the
    rectangle between them."""
    w, d = band.window, band.delta
    p0, p1, k0, k1 = band.r0 + d, band.r1 + d, band.k0, band.k1
    step = 1 if w == 1 else max(1, min(tile, w - 1))
    cuts = sorted({p0, p1} | {x for x in (k1, k0 + w - 1) if p0 < x < p1})
    pieces = []
    for s, e in zip(cuts, cuts[1:]):
        causal, lower = s < k1, s >= k0 + w - 1  # rows before k1 see keys up to themselves;
        if not (causal or lower):  # rows from k0 + w - 1 on see keys from p - w + 1 on
            pieces.append((s - d, e - d, k0, k1, "full"))
        elif not lower:
            pieces.append((s - d, e - d, s, e, "causal"))
            if s > k0:
                pieces.append((s - d, e - d, k0, s, "full"))
        elif not causal:
            pieces.append((s - d, e - d, s - w + 1, e - w + 1, "anti"))
            if e - w + 1 < k1:
                pieces.append((s - d, e - d, e - w + 1, k1, "full"))
        else:
            for a in range(s, e, step):
                b = min(a + step, e)
                pieces.append((a - d, b - d, a, b, "causal"))
                if w > 1:  # w == 1: the 1x1 causal square is all
                    pieces.append((a - d, b - d, a - w + 1, b - w + 1, "anti"))
                if b - w + 1 < a:
                    pieces.append((a - d, b - d, b - w + 1, a, "full"))
    return tuple(pieces)


@lru_cache(maxsize=64)
def _strip_mask(rows: int, keys: int, offset: int, window: int, dtype: torch.dtype, device) -> Tensor:
    """Additive mask ``(1, 1, rows, keys)``: 0 where ``0 <= i + offset - j <= window - 1``, else -inf."""
    gap = torch.arange(rows, device=device)[:, None] + offset - torch.arange(keys, device=device)[None, :]
    keep = (gap >= 0) & (gap <= window - 1)
    return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))[None, None]


def _pieces(t: Tensor, start: int, length: int, s: Strip, dim: int = 1) -> Tensor:
    """The ``count`` pieces ``[start + i * step, + length)`` of one batch row ``t`` (``(1, n, H, D)``,
    or ``(1, H, n)`` with ``dim=2``) as a view ``(count, length, H, D)`` (``(count, H, length)``)."""
    if s.count == 1:
        return t.narrow(dim, start, length)
    part = t.narrow(dim, start, (s.count - 1) * s.step + length).unfold(dim, length, s.step)[0]
    return part.movedim(-1, 1) if dim == 1 else part.movedim(1, 0)


def _put(out: Tensor, lse: Tensor, rows: slice, o: Tensor, l_: Tensor, fresh: bool) -> None:
    if fresh:
        out[:, rows], lse[:, :, rows] = o, l_
    else:
        merge_attention_(out[:, rows], lse[:, :, rows], o, l_)


def _flip(*ts: Tensor) -> list[Tensor]:
    return [t.flip(-1 if t.dim() == 3 else 1) for t in ts]  # lse (B, H, n) along n, others along seq


def _kind(kernel: BlockAttention, q: Tensor) -> str:
    if isinstance(kernel, WindowAttention):
        return "window"
    if isinstance(kernel, MaskedTileAttention) and kernel.band_tile(q, 1) is not None:
        return "strips"
    return "squares"


def band_forward(
    kernel: BlockAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    band: Band,
    softmax_scale: float,
    *,
    fresh: bool,
    square_tile: int = 128,
) -> None:
    """Attention of the rows of ``band`` (q ``(B, n, Hq, D)``) to its keys (k/v ``(B, m, Hkv, D)``),
    written into (``fresh``: the rows have no result yet) or merged into the accumulators ``out``
    ``(B, n, Hq, D)`` / ``lse`` ``(B, Hq, n)`` (accumulator dtype). ``band`` must be trimmed."""
    kind = _kind(kernel, q)
    if kind == "window":
        r, c = slice(band.r0, band.r1), slice(band.k0, band.k1)
        offset = band.r0 + band.delta - band.k0
        o, l_ = kernel.forward_window(q[:, r], k[:, c], v[:, c], offset, band.window, softmax_scale)
        _put(out, lse, r, o, l_, fresh)
        return
    if kind == "strips":
        for row in range(q.shape[0]):  # one batch row at a time: the pieces are views of it
            b = slice(row, row + 1)
            _strips_forward(kernel, q[b], k[b], v[b], out[b], lse[b], band, softmax_scale, fresh)
        return
    written = set()
    for q0, q1, k0, k1, piece in square_pieces(band, square_tile):
        qs, ks, vs = q[:, q0:q1], k[:, k0:k1], v[:, k0:k1]
        if piece == "anti":
            o, l_ = kernel.forward(*_flip(qs, ks, vs), True, softmax_scale)
            o, l_ = _flip(o, l_)
        else:
            o, l_ = kernel.forward(qs, ks, vs, piece == "causal", softmax_scale)
        _put(out, lse, slice(q0, q1), o, l_, fresh and q0 not in written)
        written.add(q0)


def band_backward(
    kernel: BlockAttention,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    band: Band,
    softmax_scale: float,
    *,
    square_tile: int = 128,
) -> None:
    """Backward of :func:`band_forward` against the merged ``out``/``lse``: adds into ``dq``
    ``(B, n, Hq, D)`` and ``dk``/``dv`` ``(B, m, Hkv, D)`` (accumulator dtype) in place."""
    kind = _kind(kernel, q)
    if kind == "window":
        r, c = slice(band.r0, band.r1), slice(band.k0, band.k1)
        offset = band.r0 + band.delta - band.k0
        gq, gk, gv = kernel.backward_window(
            dout[:, r], q[:, r], k[:, c], v[:, c], out[:, r], lse[:, :, r], offset, band.window, softmax_scale
        )
        dq[:, r] += gq
        dk[:, c] += gk
        dv[:, c] += gv
        return
    if kind == "strips":
        for row in range(q.shape[0]):
            b = slice(row, row + 1)
            _strips_backward(
                kernel, dout[b], q[b], k[b], v[b], out[b], lse[b], dq[b], dk[b], dv[b], band, softmax_scale
            )
        return
    for q0, q1, k0, k1, piece in square_pieces(band, square_tile):
        args = (dout[:, q0:q1], q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], out[:, q0:q1], lse[:, :, q0:q1])
        if piece == "anti":
            gq, gk, gv = _flip(*kernel.backward(*_flip(*args), True, softmax_scale))
        else:
            gq, gk, gv = kernel.backward(*args, piece == "causal", softmax_scale)
        dq[:, q0:q1] += gq
        dk[:, k0:k1] += gk
        dv[:, k0:k1] += gv


def _strips_forward(kernel, q, k, v, out, lse, band: Band, softmax_scale: float, fresh: bool) -> None:
    """:func:`band_forward` of one batch row by :func:`strip_runs` (masked calls where needed)."""
    for s in strip_runs(band, kernel.band_tile(q, band.window)):
        qs = _pieces(q, s.r0, s.rows, s).reshape(-1, s.rows, *q.shape[2:])
        ks, vs = (_pieces(t, s.k0, s.keys, s).reshape(-1, s.keys, *t.shape[2:]) for t in (k, v))
        if s.masked:
            mask = _strip_mask(s.rows, s.keys, s.offset, s.window, q.dtype, q.device)
            o, l_ = kernel.forward_masked(qs, ks, vs, mask, softmax_scale)
        else:
            o, l_ = kernel.forward(qs, ks, vs, False, softmax_scale)
        out_view, lse_view = _pieces(out, s.r0, s.rows, s), _pieces(lse, s.r0, s.rows, s, dim=2)
        if fresh and s.primary:  # (count, rows, H, D) and (count, H, rows) views of the accumulators
            out_view.copy_(o)
            lse_view.copy_(l_)
        else:
            merge_attention_(out_view, lse_view, o, l_)


def _strips_backward(kernel, dout, q, k, v, out, lse, dq, dk, dv, band: Band, softmax_scale: float) -> None:
    """:func:`band_backward` of one batch row by :func:`strip_runs`."""
    acc = accumulator_dtype(q.dtype)
    for s in strip_runs(band, kernel.band_tile(q, band.window)):
        rows = [_pieces(t, s.r0, s.rows, s).reshape(-1, s.rows, *t.shape[2:]) for t in (dout, q)]
        ks, vs = (_pieces(t, s.k0, s.keys, s).reshape(-1, s.keys, *t.shape[2:]) for t in (k, v))
        os_ = _pieces(out, s.r0, s.rows, s).reshape(-1, s.rows, *out.shape[2:])
        ls = _pieces(lse, s.r0, s.rows, s, dim=2).reshape(-1, lse.shape[1], s.rows)
        if s.masked:
            mask = _strip_mask(s.rows, s.keys, s.offset, s.window, q.dtype, q.device)
            gq, gk, gv = kernel.backward_masked(*rows, ks, vs, os_, ls, mask, softmax_scale)
        else:
            gq, gk, gv = kernel.backward(*rows, ks, vs, os_, ls, False, softmax_scale)
        dq_view = _pieces(dq, s.r0, s.rows, s)
        dq_view += gq.reshape(dq_view.shape)
        if s.count == 1:
            dk[:, s.k0 : s.k0 + s.keys] += gk
            dv[:, s.k0 : s.k0 + s.keys] += gv
            continue
        # Key windows may overlap: add each piece's gradient back into place.
        index = s.k0 + torch.arange(s.count)[:, None] * s.step + torch.arange(s.keys)
        index = index.flatten().to(dk.device)
        for grad, g in ((dk, gk), (dv, gv)):
            grad.view(grad.shape[1], -1).index_add_(0, index, g.to(acc).reshape(-1, g.shape[2] * g.shape[3]))
