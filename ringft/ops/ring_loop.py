"""The ring loop of zigzag attention: one autograd Function, one forward loop and one backward loop,
over the schedule of one rank (:class:`RingSteps`).

A schedule says what each step exchanges and computes: step 0 attends to the rank's own K/V, step
``s = 1..steps`` to the K/V that arrived for it. The loop posts step ``s + 1``'s exchange
(:class:`~ringft.ops.comm.Exchange`) before computing step ``s`` and waits for it after, so every
transfer overlaps with compute. Partial results merge by log-sum-exp in the accumulator dtype. The
backward runs the same steps again, recomputing each block from the merged out/lse: dq accumulates
locally, and the schedule's :class:`GradientRoute` takes every block's dK/dV (fp32) home.

Schedules: the full ring (:class:`~ringft.ops.zigzag_blocks.ZigzagSteps`: K/V blocks pass from rank
to rank, packed documents skip blocks and rows, dK/dV ride behind them) and the sliding window
(:class:`~ringft.ops.window_blocks.WindowSteps`: only the chunks a window reaches travel, straight
to the ranks that need them, and their dK/dV straight back).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from ringft.ops.backends import BlockAttention
from ringft.ops.comm import Exchange, Moves
from ringft.ops.dtypes import accumulator_dtype, no_autocast
from ringft.ops.sinks import sink_gradient, sink_rescale

Tensor = torch.Tensor

__all__ = ["GradientRoute", "RingSteps", "ring_attention"]


class GradientRoute(Protocol):
    """How the dK/dV of every step's blocks reach their owners, for one backward."""

    def add(self, ex: Exchange, step: int, grads: list) -> None:
        """Take step ``step``'s gradients (as the schedule's ``backward`` returned them) on their way."""

    def home(self) -> tuple[Tensor, Tensor]:
        """This rank's own ``(dk, dv)`` once everything has arrived, in the accumulator dtype."""


class RingSteps(Protocol):
    """The ring schedule of one rank: what each step exchanges and computes."""

    steps: int  # exchange steps after the local step 0
    one_call: bool  # one kernel call covers the rank's whole attention (no exchange, no documents)
    causal: bool
    softmax_scale: float

    def pack(self, k: Tensor, v: Tensor) -> Tensor:
        """This rank's K/V as the one contiguous buffer its sends are cut from."""

    def kv_moves(self, step: int, payload: Tensor, held: list[Tensor], spare: list[Tensor]) -> Moves:
        """The sends and receives that bring step ``step``'s K/V (``held``: what arrived for the step
        before; ``spare``: buffers done with, to receive into)."""

    def forward(self, kernel, q, k, v, step: int, held: list[Tensor], out, lse) -> tuple[Tensor, Tensor]:
        """Step ``step``'s attention merged into ``out``/``lse`` (created at step 0)."""

    def backward(self, kernel, dout, q, k, v, step: int, held: list[Tensor], out, lse, dq) -> list:
        """Step ``step``'s backward: adds into ``dq``; the K/V gradients for :meth:`gradients`' route."""

    def gradients(self, k: Tensor, v: Tensor, dtype: torch.dtype) -> GradientRoute:
        """A fresh route for one backward."""


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, steps: RingSteps, kernel: BlockAttention, group, kept, sinks):
        if kept is not None:  # a checkpoint's recompute: the forward's own out/lse (saved_attention)
            out, lse = kept
        else:
            out, lse = _ring_forward(q, k, v, steps, kernel, group)
            if sinks is not None:  # after the merge: the sink needs nothing from other ranks
                out, lse = sink_rescale(out, lse, sinks)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *(() if sinks is None else (sinks,)))
        ctx.steps, ctx.kernel, ctx.group = steps, kernel, group
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        with no_autocast(q.device.type):
            dq, dk, dv = _ring_backward(ctx, dout.contiguous(), q, k, v, out, lse)
            dsinks = sink_gradient(dout, out, lse, sinks[0]) if sinks else None
        return dq, dk, dv, None, None, None, None, dsinks


def _ring_forward(q, k, v, steps: RingSteps, kernel, group) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` in the accumulator dtype: every step, the next step's K/V in flight."""
    ex = Exchange(group)
    payload = steps.pack(k, v) if steps.steps else None
    held: list[Tensor] = []
    spare: list[Tensor] = []
    out = lse = None
    for step in range(steps.steps + 1):
        pending = ex.start(*steps.kv_moves(step + 1, payload, held, spare)) if step < steps.steps else None
        out, lse = steps.forward(kernel, q, k, v, step, held, out, lse)
        if pending is not None:
            held, spare = pending.wait(), held
    return out, lse


def _ring_backward(ctx, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor):
    steps, kernel = ctx.steps, ctx.kernel
    if steps.one_call:
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, steps.causal, steps.softmax_scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)  # a tiled kernel's dk/dv are fp32
    acc = accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    ex = Exchange(ctx.group)
    route = steps.gradients(k, v, acc)
    payload = steps.pack(k, v) if steps.steps else None
    held: list[Tensor] = []
    spare: list[Tensor] = []
    for step in range(steps.steps + 1):
        pending = ex.start(*steps.kv_moves(step + 1, payload, held, spare)) if step < steps.steps else None
        grads = steps.backward(kernel, dout, q, k, v, step, held, out, lse, dq)
        route.add(ex, step, grads)  # sends this step's dK/dV on while the next K/V is in flight
        if pending is not None:
            held, spare = pending.wait(), held
    dk, dv = route.home()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    steps: RingSteps,
    kernel: BlockAttention,
    group: dist.ProcessGroup | None,
    kept: tuple[Tensor, Tensor] | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out (B, seq_local, Hq, Dv) in q's dtype, lse (B, Hq, seq_local))`` of this rank's zigzag
    shard ``q`` ``(B, seq_local, Hq, D)`` against every rank's ``k``/``v`` ``(B, seq_local, Hkv, D|Dv)``
    as ``steps`` schedules it, with attention ``sinks`` ``(Hq,)`` if given (:mod:`ringft.ops.sinks`);
    differentiable in q, k, v and sinks. Inputs already validated; autocast off. ``kept``: this
    call's out/lse from the forward (a checkpoint's recompute): the ring forward is skipped and
    they are saved for the backward as they are."""
    return _RingAttention.apply(q, k, v, steps, kernel, group, kept, sinks)
