"""Run the zigzag ring schedule of N ranks inside one process (no communication).

Same block kernels, same per-step work and merges as the distributed operator (the plain ring, or
with a sliding window the exchange of :mod:`ringft.ops.windows`), so it serves to check a backend
inside the real schedule on one device (e.g. one GPU) and to measure the cost of decomposing one
attention call into the ring's blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ringft.ops.backends import BlockAttention, default_softmax_scale, get_backend
from ringft.ops.documents import DocumentLayout, document_layout
from ringft.ops.dtypes import accumulator_dtype
from ringft.ops.sharding import cp_shard, cp_unshard
from ringft.ops.window_blocks import backward_window_step, forward_window_step, local_blocks, row_groups
from ringft.ops.windows import window_schedule
from ringft.ops.zigzag_blocks import backward_block, forward_block

Tensor = torch.Tensor


def run_schedule(
    kernel: BlockAttention,
    qs: list[Tensor],
    ks: list[Tensor],
    vs: list[Tensor],
    douts: list[Tensor] | None,
    *,
    causal: bool,
    softmax_scale: float,
    ranks: list[int] | None = None,
    timer: Callable[[int, Callable[[], None]], None] | None = None,
    layouts: list[DocumentLayout] | None = None,
    sliding_window: int | None = None,
    cu_seqlens: list[list[int]] | None = None,
):
    """The ring schedule of every rank on per-rank shards ``(batch, seq_local, heads, dim)``.

    Returns per-rank ``outs``, ``lses`` and (when ``douts``) ``dqs`` and ``dkvs`` (dK/dV of each
    rank's own block, summed over all ranks). ``timer(rank, fn)`` may wrap each rank's forward and
    backward work (used by the benchmarks to time ranks one by one). ``layouts[r]``: rank ``r``'s
    packed-document layout (:func:`ringft.ops.documents.document_layout`), if any. ``sliding_window``
    (causal, below the sequence length): the windowed schedule instead, with the packed documents
    of ``cu_seqlens`` (global offsets per row) if any.
    """
    if sliding_window is not None:
        return _run_window_schedule(
            kernel, qs, ks, vs, douts, softmax_scale, ranks, timer, sliding_window, cu_seqlens
        )
    n = len(qs)
    ranks = list(range(n)) if ranks is None else ranks
    timer = timer or (lambda rank, fn: fn())
    outs: dict[int, Tensor] = {}
    lses: dict[int, Tensor] = {}

    def forward(rank: int) -> None:
        out = lse = None
        for step in range(n):
            src = (rank - step) % n
            out, lse = forward_block(
                kernel,
                qs[rank],
                ks[src],
                vs[src],
                out,
                lse,
                step=step,
                source=src,
                rank=rank,
                causal=causal,
                softmax_scale=softmax_scale,
                documents=None if layouts is None else layouts[rank],
            )
        outs[rank], lses[rank] = out.to(qs[rank].dtype), lse

    for rank in ranks:
        timer(rank, lambda rank=rank: forward(rank))
    if douts is None:
        return outs, lses, None, None
    acc = accumulator_dtype(qs[0].dtype)
    dqs = {r: torch.zeros(qs[r].shape, dtype=acc, device=qs[r].device) for r in ranks}
    dkvs = [torch.zeros((2, *t.shape), dtype=acc, device=t.device) for t in ks]

    def backward(rank: int) -> None:
        for step in range(n):
            src = (rank - step) % n
            pieces = backward_block(
                kernel,
                douts[rank],
                qs[rank],
                ks[src],
                vs[src],
                outs[rank],
                lses[rank],
                dqs[rank],
                step=step,
                source=src,
                rank=rank,
                causal=causal,
                softmax_scale=softmax_scale,
                documents=None if layouts is None else layouts[rank],
            )
            for rows, part, dk_b, dv_b in pieces:
                dkvs[src][0][rows, part].add_(dk_b)
                dkvs[src][1][rows, part].add_(dv_b)

    for rank in ranks:
        timer(rank, lambda rank=rank: backward(rank))
    return outs, lses, dqs, dkvs


def _run_window_schedule(kernel, qs, ks, vs, douts, softmax_scale, ranks, timer, window, cu_seqlens):
    """:func:`run_schedule` for the sliding-window exchange: rank ``r`` at step ``s`` uses the
    chunks its :class:`~ringft.ops.windows.WindowSchedule` receives from ranks ``r - s`` and ``r + s``."""
    n = len(qs)
    ranks = list(range(n)) if ranks is None else ranks
    timer = timer or (lambda rank, fn: fn())
    schedule = window_schedule(qs[0].shape[1] * n, n, window)
    groups = row_groups(cu_seqlens, qs[0].shape[0])
    kw = dict(schedule=schedule, groups=groups, softmax_scale=softmax_scale)
    chunks = [local_blocks(ks[r], vs[r], r, n) for r in range(n)]  # (chunk index, k, v) per slot

    def received(rank: int, step: int) -> list[tuple[int, int]]:
        return [(src, slot) for src, slots in schedule.receives(rank, step) for slot in slots]

    outs: dict[int, Tensor] = {}
    lses: dict[int, Tensor] = {}

    def forward(rank: int) -> None:
        out, lse = forward_window_step(kernel, qs[rank], chunks[rank], None, None, rank=rank, **kw)
        for step in range(1, schedule.steps + 1):
            blocks = [chunks[src][slot] for src, slot in received(rank, step)]
            out, lse = forward_window_step(kernel, qs[rank], blocks, out, lse, rank=rank, **kw)
        outs[rank], lses[rank] = out.to(qs[rank].dtype), lse

    for rank in ranks:
        timer(rank, lambda rank=rank: forward(rank))
    if douts is None:
        return outs, lses, None, None
    acc = accumulator_dtype(qs[0].dtype)
    dqs = {r: torch.zeros(qs[r].shape, dtype=acc, device=qs[r].device) for r in ranks}
    c = ks[0].shape[1] // 2
    grads = [torch.zeros((2, 2, *ks[r][:, :c].shape), dtype=acc, device=ks[r].device) for r in range(n)]

    def backward(rank: int) -> None:
        for step in range(schedule.steps + 1):
            sources = [(rank, 0), (rank, 1)] if step == 0 else received(rank, step)
            blocks = [(*chunks[src][slot], grads[src][slot, 0], grads[src][slot, 1]) for src, slot in sources]
            backward_window_step(
                kernel, douts[rank], qs[rank], blocks, outs[rank], lses[rank], dqs[rank], rank=rank, **kw
            )

    for rank in ranks:
        timer(rank, lambda rank=rank: backward(rank))
    dkvs = [g.permute(1, 2, 0, 3, 4, 5).reshape(2, *ks[r].shape) for r, g in enumerate(grads)]
    return outs, lses, dqs, dkvs


def emulate_zigzag_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cp_size: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    dout: Tensor | None = None,
    cu_seqlens: list[list[int]] | None = None,
    sliding_window: int | None = None,
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor] | None]:
    """Emulate ``cp_size`` ranks on the *global* ``q``/``k``/``v`` ``(batch, seq, heads, dim)``.

    Returns ``(out, lse, grads)`` in global order; ``grads = (dq, dk, dv)`` when ``dout`` is given.
    ``cu_seqlens`` (packed documents) and ``sliding_window``: as for
    :func:`ringft.ops.zigzag_ring_attention` (a window >= the sequence is no window).
    """
    kernel = get_backend(backend, q.device, q.dtype, q.shape[-1])
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    n = cp_size
    qs, ks, vs = ([cp_shard(t, r, n) for r in range(n)] for t in (q, k, v))
    douts = None if dout is None else [cp_shard(dout, r, n) for r in range(n)]
    layouts = None
    window = sliding_window if sliding_window is not None and sliding_window < q.shape[1] else None
    if window is not None and not causal:
        raise ValueError("sliding_window needs causal=True")
    if cu_seqlens is not None and window is None:
        layouts = [document_layout(cu_seqlens, q.shape[1], r, n, batch=q.shape[0]) for r in range(n)]
    outs, lses, dqs, dkvs = run_schedule(
        kernel, qs, ks, vs, douts, causal=causal, softmax_scale=scale, layouts=layouts, sliding_window=window,
        cu_seqlens=cu_seqlens,
    )  # fmt: skip
    out = cp_unshard([outs[r] for r in range(n)])
    lse = cp_unshard([lses[r] for r in range(n)], dim=2)
    grads = None
    if dout is not None:
        grads = (
            cp_unshard([dqs[r] for r in range(n)]).to(q.dtype),
            cp_unshard([g[0] for g in dkvs]).to(k.dtype),
            cp_unshard([g[1] for g in dkvs]).to(v.dtype),
        )
    return out, lse, grads
