"""Sliding-window (band) attention between one query block and one key block, by any backend.

Geometry, one frame for both: query row ``i`` of the q block sits at position ``i + delta``, key ``j``
of the k block at position ``j``; a row sees key ``j`` iff ``0 <= (i + delta) - j <= window - 1``
(transformers' sliding window: the ``window`` most recent positions, itself included). A
:class:`Band` names rows ``[r0, r1)`` and keys ``[k0, k1)``; :func:`trim_band` drops the rows that
see none of those keys and the keys no row sees, so no kernel ever gets a fully masked row.

How a backend computes a band (:func:`band_forward` / :func:`band_backward`):

- :class:`~ringft.ops.backends.WindowAttention` (flash-attn's ``window_size``, the reference's
  mask): one native call;
- a :class:`~ringft.ops.backends.MaskedTileAttention` with a ``band_tile`` (torch on CPU, whose
  fused kernel computes a masked block in full): *strips* of ``tile`` query rows, each against
  only the keys its rows can see, masked only at the band's edges; strips with the same geometry
  run as one batched call over overlapping (strided, uncopied) key windows, so time follows FLOPs:
  ``tile`` wasted keys per row next to ``window`` useful ones;
- anything else (torch on CUDA): unmasked rectangles, causal squares, and *anti-causal* squares
  (the window's lower edge), which are causal squares on rows and keys taken in reverse order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    """``count`` strips of ``rows`` query rows from row ``r0`` on; strip ``t`` sees keys
    ``[k0 + t * step, k0 + t * step + keys)``; in strip coordinates row ``i`` sees key ``j`` iff
    ``0 <= i + offset - j <= window - 1``. ``masked``: some pair of a strip is not visible."""

    r0: int
    count: int
    rows: int
    k0: int
    step: int
    keys: int
    offset: int
    window: int
    masked: bool


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


@lru_cache(maxsize=256)
def strip_runs(band: Band, tile: int) -> tuple[Strip, ...]:
    """Cover a trimmed ``band`` by strips of ``tile`` rows (the last may be shorter), each against
    the keys its rows see; consecutive strips of one geometry become one batched :class:`Strip`,
    and unmasked strips over the same keys one taller strip. Cached (every layer asks again)."""
    w, d = band.window, band.delta
    plain: list[Strip] = []
    for a in range(band.r0, band.r1, tile):
        b = min(a + tile, band.r1)
        lo, hi = max(band.k0, a + d - w + 1), min(band.k1, b + d)
        rows, keys, offset = b - a, hi - lo, a + d - lo
        masked = not (offset >= keys - 1 and rows - 1 + offset <= w - 1)
        plain.append(Strip(a, 1, rows, lo, 0, keys, offset, w, masked))
    runs: list[Strip] = []
    for s in plain:
        last = runs[-1] if runs else None
        if last is None:
            runs.append(s)
        elif not (s.masked or last.masked) and last.count == 1 and (last.k0, last.keys) == (s.k0, s.keys):
            runs[-1] = replace(last, rows=last.rows + s.rows)  # one taller unmasked rectangle
        elif (last.rows, last.keys, last.offset, last.masked) == (s.rows, s.keys, s.offset, s.masked) and (
            s.r0 == last.r0 + last.count * s.rows  # same geometry one strip further on: keys move along
        ):
            runs[-1] = replace(last, count=last.count + 1, step=s.rows)
        else:
            runs.append(s)
    return tuple(runs)


@lru_cache(maxsize=256)
def square_pieces(band: Band, tile: int) -> tuple[tuple[int, int, int, int, str], ...]:
    """Cover a trimmed ``band`` exactly by pieces ``(q0, q1, k0, k1, kind)`` (local indices) with
    ``kind`` ``"full"`` (every pair visible), ``"causal"`` (a square, key <= query) or ``"anti"``
    (a square, key >= query: the window's lower edge). Rows are cut into tiles of at most
    ``min(tile, window - 1)`` where an edge crosses them; rows no edge crosses form one rectangle."""
    w, d = band.window, band.delta
    p0, p1, k0, k1 = band.r0 + d, band.r1 + d, band.k0, band.k1
    step = 1 if w == 1 else max(1, min(tile, w - 1))
    cuts = sorted({p0, p1} | {x for x in (k1, k0 + w - 1) if p0 < x < p1})
    pieces = []
    for s, e in zip(cuts, cuts[1:]):
        causal_cut = s < k1  # rows before k1 see keys up to themselves
        lower_cut = s >= k0 + w - 1  # rows from k0 + w - 1 on see keys from p - w + 1 on
        if not (causal_cut or lower_cut):
            pieces.append((s - d, e - d, k0, k1, "full"))
            continue
        for a in range(s, e, step):
            b = min(a + step, e)
            if causal_cut:
                pieces.append((a - d, b - d, a, b, "causal"))
            if lower_cut and not (causal_cut and w == 1):  # w == 1: the 1x1 causal square is all
                pieces.append((a - d, b - d, a - w + 1, b - w + 1, "anti"))
            x0, x1 = (b - w + 1 if lower_cut else k0), (a if causal_cut else k1)
            if x0 < x1:
                pieces.append((a - d, b - d, x0, x1, "full"))
    return tuple(pieces)


@lru_cache(maxsize=64)
def _strip_mask(rows: int, keys: int, offset: int, window: int, dtype: torch.dtype, device) -> Tensor:
    """Additive mask ``(1, 1, rows, keys)``: 0 where ``0 <= i + offset - j <= window - 1``, else -inf."""
    gap = torch.arange(rows, device=device)[:, None] + offset - torch.arange(keys, device=device)[None, :]
    keep = (gap >= 0) & (gap <= window - 1)
    return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))[None, None]


def _rows(t: Tensor, s: Strip) -> Tensor:
    """Query-side rows of a strip run: ``(B, n, H, D)`` -> ``(B * count, rows, H, D)``."""
    part = t[:, s.r0 : s.r0 + s.count * s.rows]
    return part if s.count == 1 else part.reshape(-1, s.rows, *t.shape[2:])


def _keys(t: Tensor, s: Strip) -> Tensor:
    """Key windows of a strip run ``(B * count, keys, H, D)``: overlapping strided views (no copy
    for one batch row)."""
    if s.count == 1:
        return t[:, s.k0 : s.k0 + s.keys]
    part = t[:, s.k0 : s.k0 + (s.count - 1) * s.step + s.keys]
    return part.unfold(1, s.keys, s.step).permute(0, 1, 4, 2, 3).reshape(-1, s.keys, *t.shape[2:])


def _lse_rows(lse: Tensor, s: Strip) -> Tensor:
    """``lse (B, H, n)`` rows of a strip run -> ``(B * count, H, rows)``."""
    part = lse[..., s.r0 : s.r0 + s.count * s.rows]
    if s.count == 1:
        return part
    b, h = lse.shape[:2]
    return part.reshape(b, h, s.count, s.rows).transpose(1, 2).reshape(-1, h, s.rows)


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
        for s in strip_runs(band, kernel.band_tile(q, band.window)):
            qs, ks, vs = _rows(q, s), _keys(k, s), _keys(v, s)
            if s.masked:
                mask = _strip_mask(s.rows, s.keys, s.offset, s.window, q.dtype, q.device)
                o, l_ = kernel.forward_masked(qs, ks, vs, mask, softmax_scale)
            else:
                o, l_ = kernel.forward(qs, ks, vs, False, softmax_scale)
            b = q.shape[0]
            o = o.reshape(b, s.count * s.rows, *o.shape[2:])
            l_ = l_.reshape(b, s.count, l_.shape[1], s.rows).transpose(1, 2).reshape(b, l_.shape[1], -1)
            _put(out, lse, slice(s.r0, s.r0 + s.count * s.rows), o, l_, fresh)
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
        acc = accumulator_dtype(q.dtype)
        for s in strip_runs(band, kernel.band_tile(q, band.window)):
            args = (_rows(dout, s), _rows(q, s), _keys(k, s), _keys(v, s), _rows(out, s), _lse_rows(lse, s))
            if s.masked:
                mask = _strip_mask(s.rows, s.keys, s.offset, s.window, q.dtype, q.device)
                gq, gk, gv = kernel.backward_masked(*args, mask, softmax_scale)
            else:
                gq, gk, gv = kernel.backward(*args, False, softmax_scale)
            b = q.shape[0]
            dq[:, s.r0 : s.r0 + s.count * s.rows] += gq.reshape(b, -1, *gq.shape[2:])
            if s.count == 1:
                dk[:, s.k0 : s.k0 + s.keys] += gk
                dv[:, s.k0 : s.k0 + s.keys] += gv
                continue
            # Overlapping key windows: sum each window's gradient back into place.
            index = (s.k0 + torch.arange(s.count)[:, None] * s.step + torch.arange(s.keys)).flatten()
            index = index.to(dk.device)
            for grad, g in ((dk, gk), (dv, gv)):
                flat = g.to(acc).reshape(b, -1, g.shape[2] * g.shape[3])
                grad.view(b, grad.shape[1], -1).index_add_(1, index, flat)
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
