"""One step of sliding-window zigzag attention: the local queries against the K/V chunks at hand.

Rank ``r`` of ``N`` holds query chunks ``r`` (local rows ``[0, c)``) and ``2N-1-r`` (rows
``[c, 2c)``). A *block* is one K/V chunk ``(global chunk index, k, v)`` of ``c`` tokens: at step 0
the rank's own two chunks, later the chunks its :class:`~ringft.ops.windows.WindowPlan` delivers.
Each (query chunk, key chunk) pair that meets within the window is one band per shared document
(:func:`~ringft.ops.windows.chunk_bands`), computed by :mod:`ringft.ops.band`; pairs that do not
meet are never touched. Shared by the distributed operator (:mod:`ringft.ops.window_ring`) and the
one-process emulator (:mod:`ringft.ops.emulate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

from ringft.ops.backends import BlockAttention
from ringft.ops.band import Band, band_backward, band_forward
from ringft.ops.dtypes import accumulator_dtype
from ringft.ops.windows import WindowPlan, chunk_bands, chunks_meet

Tensor = torch.Tensor
Block = tuple[int, Tensor, Tensor]  # (global chunk index, k (B, c, Hkv, D), v)
GradBlock = tuple[int, Tensor, Tensor, Tensor, Tensor]  # + dk, dv accumulators (B, c, Hkv, D)
RowGroups = list[tuple[slice, tuple[int, ...] | None]]  # batch rows sharing one document layout

__all__ = [
    "Block",
    "GradBlock",
    "RowGroups",
    "backward_window_step",
    "forward_window_step",
    "local_blocks",
    "row_groups",
]


def row_groups(cu_rows: Sequence[Sequence[int]] | None, batch: int) -> RowGroups:
    """Batch rows grouped by document layout: one group for all rows when they share it (or have
    none), one group per row otherwise. ``cu_rows``: global offsets per row (or one row for all)."""
    if cu_rows is None:
        return [(slice(None), None)]
    rows = [tuple(map(int, r)) for r in cu_rows]
    rows = rows * batch if len(rows) == 1 else rows
    if len(set(rows)) == 1:
        return [(slice(None), rows[0] if len(rows[0]) > 2 else None)]
    return [(slice(b, b + 1), row if len(row) > 2 else None) for b, row in enumerate(rows)]


def local_blocks(k: Tensor, v: Tensor, rank: int, cp_size: int) -> list[Block]:
    """This rank's own two K/V chunks as blocks (``k``/``v`` ``(B, 2c, Hkv, D)``)."""
    c = k.shape[1] // 2
    return [(rank, k[:, :c], v[:, :c]), (2 * cp_size - 1 - rank, k[:, c:], v[:, c:])]


@lru_cache(maxsize=1024)
def _bands(
    x: int, y: int, chunk: int, window: int, cu: tuple[int, ...] | None, base: int
) -> tuple[Band, ...]:
    return tuple(chunk_bands(x, y, chunk, window, cu, base))


def _work(plan: WindowPlan, rank: int, ys: list[int], groups: RowGroups):
    """``(block index, rows, band, fresh)`` for every band of this step; first the diagonal pairs
    (their bands cover every row of the chunk: they create the results), then the rest."""
    n, c, w = plan.cp_size, plan.chunk, plan.window
    items = []
    for i, y in enumerate(ys):
        for x, base in ((rank, 0), (2 * n - 1 - rank, c)):
            if chunks_meet(x, y, c, w):
                for rows, cu in groups:
                    items += [(x != y, i, rows, band) for band in _bands(x, y, c, w, cu, base)]
    return [(i, rows, band, not later) for later, i, rows, band in sorted(items, key=lambda t: t[0])]


def forward_window_step(
    kernel: BlockAttention,
    q: Tensor,
    blocks: list[Block],
    out: Tensor | None,
    lse: Tensor | None,
    *,
    plan: WindowPlan,
    rank: int,
    groups: RowGroups,
    softmax_scale: float,
) -> tuple[Tensor, Tensor]:
    """Attend the local ``q`` ``(B, 2c, Hq, D)`` to ``blocks`` within the window (and documents).

    Step 0 (``out is None``; ``blocks`` = :func:`local_blocks`) creates the accumulators ``out``
    ``(B, 2c, Hq, D)`` and ``lse`` ``(B, Hq, 2c)`` in the accumulator dtype; later steps merge.
    """
    if out is None:
        acc = accumulator_dtype(q.dtype)
        out = torch.empty(q.shape, dtype=acc, device=q.device)
        lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=acc, device=q.device)
    for i, rows, band, fresh in _work(plan, rank, [b[0] for b in blocks], groups):
        _, kb, vb = blocks[i]
        band_forward(
            kernel, q[rows], kb[rows], vb[rows], out[rows], lse[rows], band, softmax_scale, fresh=fresh
        )
    return out, lse


def backward_window_step(
    kernel: BlockAttention,
    dout: Tensor,
    q: Tensor,
    blocks: list[GradBlock],
    out: Tensor,
    lse: Tensor,
    dq: Tensor,
    *,
    plan: WindowPlan,
    rank: int,
    groups: RowGroups,
    softmax_scale: float,
) -> None:
    """Backward of :func:`forward_window_step` against the merged ``out``/``lse``: adds into the
    local ``dq`` ``(B, 2c, Hq, D)`` and each block's ``dk``/``dv`` (contiguous, accumulator dtype)."""
    for i, rows, band, _ in _work(plan, rank, [b[0] for b in blocks], groups):
        _, kb, vb, dkb, dvb = blocks[i]
        band_backward(
            kernel, dout[rows], q[rows], kb[rows], vb[rows], out[rows], lse[rows], dq[rows], dkb[rows],
            dvb[rows], band, softmax_scale,
        )  # fmt: skip
