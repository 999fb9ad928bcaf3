"""One step of sliding-window zigzag attention: the local queries against the K/V chunks at hand.

Rank ``r`` of ``N`` holds query chunks ``r`` (local rows ``[0, c)``) and ``2N-1-r`` (rows
``[c, 2c)``). A *block* is one K/V chunk ``(global chunk index, k, v)`` of ``c`` tokens: at step 0
the rank's own two chunks, later the chunks its :class:`~ringft.ops.windows.WindowSchedule`
delivers. Each (query chunk, key chunk) pair that meets within the window is one band per shared
document (:func:`~ringft.ops.windows.chunk_bands`), computed by :mod:`ringft.ops.band`; pairs that
do not meet are never touched. :class:`WindowSteps` is this schedule for the ring loop
(:mod:`ringft.ops.ring_loop`); the step functions are shared with the one-process emulator
(:mod:`ringft.ops.emulate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

from ringft.ops.backends import BlockAttention
from ringft.ops.band import Band, band_backward, band_forward
from ringft.ops.comm import ChunkLayout, Exchange, Moves
from ringft.ops.dtypes import accumulator_dtype
from ringft.ops.windows import WindowSchedule, chunk_bands, chunks_meet

Tensor = torch.Tensor
Block = tuple[int, Tensor, Tensor]  # (global chunk index, k (B, c, Hkv, D), v (B, c, Hkv, Dv))
GradBlock = tuple[int, Tensor, Tensor, Tensor, Tensor]  # + dk, dv accumulators shaped like k, v
RowGroups = list[tuple[slice, tuple[int, ...] | None]]  # batch rows sharing one document layout

__all__ = [
    "Block",
    "GradBlock",
    "ReturnGradients",
    "RowGroups",
    "WindowSteps",
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


def _work(schedule: WindowSchedule, rank: int, ys: list[int], groups: RowGroups):
    """``(block index, rows, band, fresh)`` for every band of this step; first the diagonal pairs
    (their bands cover every row of the chunk: they create the results), then the rest."""
    n, c, w = schedule.cp_size, schedule.chunk, schedule.window
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
    schedule: WindowSchedule,
    rank: int,
    groups: RowGroups,
    softmax_scale: float,
) -> tuple[Tensor, Tensor]:
    """Attend the local ``q`` ``(B, 2c, Hq, D)`` to ``blocks`` within the window (and documents).

    Step 0 (``out is None``; ``blocks`` = :func:`local_blocks`) creates the accumulators ``out``
    ``(B, 2c, Hq, Dv)`` and ``lse`` ``(B, Hq, 2c)`` in the accumulator dtype; later steps merge.
    """
    if out is None:
        acc = accumulator_dtype(q.dtype)
        out = torch.empty((*q.shape[:-1], blocks[0][2].shape[-1]), dtype=acc, device=q.device)
        lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=acc, device=q.device)
    for i, rows, band, fresh in _work(schedule, rank, [b[0] for b in blocks], groups):
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
    schedule: WindowSchedule,
    rank: int,
    groups: RowGroups,
    softmax_scale: float,
) -> None:
    """Backward of :func:`forward_window_step` against the merged ``out``/``lse``: adds into the
    local ``dq`` ``(B, 2c, Hq, D)`` and each block's ``dk``/``dv`` (contiguous, accumulator dtype)."""
    for i, rows, band, _ in _work(schedule, rank, [b[0] for b in blocks], groups):
        _, kb, vb, dkb, dvb = blocks[i]
        band_backward(
            kernel, dout[rows], q[rows], kb[rows], vb[rows], out[rows], lse[rows], dq[rows], dkb[rows],
            dvb[rows], band, softmax_scale,
        )  # fmt: skip


class WindowSteps:
    """The sliding-window ring for rank ``rank``: step ``s`` exchanges with ranks ``rank - s`` and
    ``rank + s`` exactly the chunks ``schedule`` says they need from each other (cut from one
    :class:`~ringft.ops.comm.ChunkLayout` buffer: K and V at their own sizes), and attends
    to what arrived, band by band (documents of ``groups``)."""

    one_call = False
    causal = True

    def __init__(
        self,
        schedule: WindowSchedule,
        rank: int,
        groups: RowGroups,
        softmax_scale: float,
        layout: ChunkLayout,
    ) -> None:
        self.schedule, self.rank, self.groups, self.softmax_scale = schedule, rank, groups, softmax_scale
        self.layout, self.steps = layout, schedule.steps
        self._kw = dict(schedule=schedule, rank=rank, groups=groups, softmax_scale=softmax_scale)

    def pack(self, k: Tensor, v: Tensor) -> Tensor:
        """This rank's two chunks, laid out by chunk (:meth:`ChunkLayout.pack`)."""
        return self.layout.pack(k, v)

    def kv_moves(self, step: int, payload: Tensor, held: list[Tensor], spare: list[Tensor]) -> Moves:
        """Send every peer of ``step`` the chunks it needs; receive what we need from it."""
        lay, sched = self.layout, self.schedule
        sends = [(dst, lay.slots(payload, slots)) for dst, slots in sched.sends(self.rank, step)]
        recvs = [
            (src, payload.new_empty(len(slots) * lay.numel)) for src, slots in sched.receives(self.rank, step)
        ]
        return sends, recvs

    def _blocks(self, k: Tensor, v: Tensor, step: int, held: list[Tensor], grads=None) -> list:
        """This step's blocks, with the matching views of ``grads`` (laid out like the buffers at
        hand; step 0: like our own two chunks) when given."""
        n = self.schedule.cp_size
        if step == 0:
            blocks, where = local_blocks(k, v, self.rank, n), [(0, 0), (0, 1)]
        else:
            blocks, where = [], []
            for b, (src, slots) in enumerate(self.schedule.receives(self.rank, step)):
                for i, slot in enumerate(slots):
                    blocks.append((src if slot == 0 else 2 * n - 1 - src, *self.layout.chunk(held[b], i)))
                    where.append((b, i))
        if grads is None:
            return blocks
        return [(*block, *self.layout.chunk(grads[b], i)) for block, (b, i) in zip(blocks, where)]

    def forward(self, kernel, q, k, v, step: int, held: list[Tensor], out, lse) -> tuple[Tensor, Tensor]:
        """:func:`forward_window_step` against this step's chunks."""
        return forward_window_step(kernel, q, self._blocks(k, v, step, held), out, lse, **self._kw)

    def backward(self, kernel, dout, q, k, v, step: int, held: list[Tensor], out, lse, dq) -> list[Tensor]:
        """:func:`backward_window_step` against this step's chunks: the dK/dV of each buffer at hand
        (step 0: of our own two chunks), laid out like it, in the accumulator dtype."""
        acc = accumulator_dtype(q.dtype)
        sizes = [2 * self.layout.numel] if step == 0 else [buf.numel() for buf in held]
        grads = [torch.zeros(n, dtype=acc, device=q.device) for n in sizes]
        blocks = self._blocks(k, v, step, held, grads)
        backward_window_step(kernel, dout, q, blocks, out, lse, dq, **self._kw)
        return grads

    def gradients(self, k: Tensor, v: Tensor, dtype: torch.dtype) -> ReturnGradients:
        """dK/dV go straight back to their owners (:class:`ReturnGradients`)."""
        return ReturnGradients(self)


class ReturnGradients:
    """The dK/dV (fp32) of every received chunk go straight back to its owner (the same pairs as the
    K/V, reversed; a relay would send the same bytes over more hops), which adds them into its own
    gradient; each step's return is waited for one step later, so it overlaps too."""

    def __init__(self, steps: WindowSteps) -> None:
        self.steps = steps
        self.own: Tensor | None = None
        self.pending = None

    def add(self, ex: Exchange, step: int, grads: list[Tensor]) -> None:
        """Step 0: our own chunks' gradient; later: return the received chunks' to their owners and
        receive ours from the ranks we sent chunks to."""
        if step == 0:
            self.own = grads[0]
            return
        sched, rank, lay = self.steps.schedule, self.steps.rank, self.steps.layout
        back = [
            (dst, slots, self.own.new_empty(len(slots) * lay.numel)) for dst, slots in sched.sends(rank, step)
        ]
        sends = [(src, g) for (src, _), g in zip(sched.receives(rank, step), grads)]
        posted = ex.start(sends, [(dst, buf) for dst, _, buf in back])
        self._settle()
        self.pending = posted, back

    def _settle(self) -> None:
        if self.pending is not None:
            posted, back = self.pending
            posted.wait()
            for _, slots, buf in back:
                self.steps.layout.slots(self.own, slots).add_(buf)
            self.pending = None

    def home(self) -> tuple[Tensor, Tensor]:
        """Our ``(dk, dv)`` ``(B, 2c, Hkv, D|Dv)``, once the last returns are in."""
        self._settle()
        return self.steps.layout.unpack(self.own)
