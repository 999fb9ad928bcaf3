"""The sliding-window zigzag ring: the distance-s exchange of :mod:`ringft.ops.windows`, as one
autograd Function.

Forward: step 0 attends to the rank's own two chunks while step 1's exchange is in flight; step
``s`` attends to the chunks received from ranks ``r - s`` and ``r + s`` while step ``s + 1``'s is in
flight. Every rank sends only chunks that the receiver's window reaches, from one contiguous copy
of its K/V laid out ``(chunk, k|v, batch, c, heads_kv, head_dim)`` (a chunk or both are contiguous
slices of it). Backward: the same exchange again (recomputation from the merged out/lse), and after
each step the dK/dV (fp32) of every received chunk go straight back to its owner, which adds them
into its own gradient; that exchange is waited for one step later, so it overlaps too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringft.ops.backends import BlockAttention
from ringft.ops.dtypes import accumulator_dtype, no_autocast
from ringft.ops.sinks import sink_gradient, sink_rescale
from ringft.ops.window_blocks import RowGroups, backward_window_step, forward_window_step, local_blocks
from ringft.ops.windows import WindowPlan

Tensor = torch.Tensor

__all__ = ["windowed_ring_attention"]


class _Exchange:
    """Posts one step's sends and receives (one ``batch_isend_irecv``) and hands back what arrived."""

    def __init__(self, group, plan: WindowPlan, rank: int):
        self.group, self.plan, self.rank = group, plan, rank

    def _peer(self, p: int) -> int:
        return dist.get_global_rank(self.group, p) if self.group is not None else p

    def start(self, sends: list[tuple[int, Tensor]], recvs: list[tuple[int, Tensor]]):
        """Send each ``(rank, tensor)`` of ``sends``, receive into each ``(rank, buffer)``."""
        ops = [dist.P2POp(dist.isend, t, self._peer(p), self.group) for p, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self._peer(p), self.group) for p, t in recvs]
        works = dist.batch_isend_irecv(ops) if ops else []
        return works, sends, recvs  # the send tensors stay referenced until the wait

    @staticmethod
    def wait(pending) -> None:
        for work in pending[0]:
            work.wait()


def _slots(t: Tensor, slots: tuple[int, ...]) -> Tensor:
    """Chunks ``slots`` (consecutive) of a ``(chunk, ...)`` tensor: a contiguous slice."""
    return t[slots[0] : slots[-1] + 1]


def _kv_step(ex: _Exchange, payload: Tensor, step: int, like: Tensor):
    """Post step ``step``'s K/V exchange: ``(pending, [(source, slots, buffer)])``."""
    plan, rank = ex.plan, ex.rank
    received = [
        (src, slots, like.new_empty((len(slots), *payload.shape[1:])))
        for src, slots in plan.receives(rank, step)
    ]
    sends = [(dst, _slots(payload, slots)) for dst, slots in plan.sends(rank, step)]
    return ex.start(sends, [(src, buf) for src, _, buf in received]), received


def _blocks(received, n: int, grads: list[Tensor] | None = None) -> list[tuple]:
    """Blocks ``(chunk index, k, v[, dk, dv])`` of the received ``(source, slots, buffer)`` (with
    the matching slices of ``grads``, shaped like the buffers)."""
    blocks = []
    for j, (src, slots, buf) in enumerate(received):
        for i, slot in enumerate(slots):
            extra = () if grads is None else (grads[j][i, 0], grads[j][i, 1])
            blocks.append((src if slot == 0 else 2 * n - 1 - src, buf[i, 0], buf[i, 1], *extra))
    return blocks


def _payload(k: Tensor, v: Tensor) -> Tensor:
    """``(2 chunks, 2 (k, v), B, c, Hkv, D)`` contiguous: what the exchange sends from."""
    return torch.stack([k.unflatten(1, (2, -1)), v.unflatten(1, (2, -1))]).transpose(0, 2).transpose(1, 2)


class _WindowedRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        softmax_scale,
        group,
        kernel: BlockAttention,
        rank,
        plan: WindowPlan,
        groups,
        kept,
        sinks,
    ):
        if kept is not None:  # a checkpoint's recompute: the forward's own out/lse (saved_attention)
            out, lse = kept
        else:
            out, lse = _ring_forward(q, k, v, softmax_scale, group, kernel, rank, plan, groups)
            if sinks is not None:  # after the merge (ringft.ops.sinks)
                out, lse = sink_rescale(out, lse, sinks)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *(() if sinks is None else (sinks,)))
        ctx.softmax_scale, ctx.group, ctx.kernel, ctx.rank, ctx.plan, ctx.groups = (
            softmax_scale, group, kernel, rank, plan, groups,
        )  # fmt: skip
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        with no_autocast(q.device.type):
            dq, dk, dv = _ring_backward(ctx, dout.contiguous(), q, k, v, out, lse)
            dsinks = sink_gradient(dout, out, lse, sinks[0]) if sinks else None
        return dq, dk, dv, None, None, None, None, None, None, None, dsinks


def _ring_forward(q, k, v, softmax_scale, group, kernel, rank, plan: WindowPlan, groups):
    """``(out fp32, lse)``: the local chunks, then each step's received chunks."""
    kw = dict(plan=plan, rank=rank, groups=groups, softmax_scale=softmax_scale)
    ex = _Exchange(group, plan, rank)
    payload = _payload(k, v).contiguous() if plan.steps else None
    pending = _kv_step(ex, payload, 1, k) if plan.steps else None
    out, lse = forward_window_step(kernel, q, local_blocks(k, v, rank, plan.cp_size), None, None, **kw)
    for step in range(1, plan.steps + 1):
        posted, received = pending
        _Exchange.wait(posted)
        pending = _kv_step(ex, payload, step + 1, k) if step < plan.steps else None
        out, lse = forward_window_step(kernel, q, _blocks(received, plan.cp_size), out, lse, **kw)
    return out, lse


def _ring_backward(ctx, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor):
    plan, rank, kernel = ctx.plan, ctx.rank, ctx.kernel
    kw = dict(plan=plan, rank=rank, groups=ctx.groups, softmax_scale=ctx.softmax_scale)
    acc = accumulator_dtype(q.dtype)
    b, c = k.shape[0], k.shape[1] // 2
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    home = torch.zeros((2, 2, b, c, *k.shape[2:]), dtype=acc, device=k.device)  # (chunk, k|v, ...)
    ex = _Exchange(ctx.group, plan, rank)
    payload = _payload(k, v).contiguous() if plan.steps else None
    pending = _kv_step(ex, payload, 1, k) if plan.steps else None
    local = [
        (*block, home[i, 0], home[i, 1]) for i, block in enumerate(local_blocks(k, v, rank, plan.cp_size))
    ]
    backward_window_step(kernel, dout, q, local, out, lse, dq, **kw)
    grads_pending = None
    for step in range(1, plan.steps + 1):
        posted, received = pending
        _Exchange.wait(posted)
        pending = _kv_step(ex, payload, step + 1, k) if step < plan.steps else None
        grads = [torch.zeros(buf.shape, dtype=acc, device=buf.device) for _, _, buf in received]
        blocks = _blocks(received, plan.cp_size, grads)
        backward_window_step(kernel, dout, q, blocks, out, lse, dq, **kw)
        # The dK/dV of what we received go back to its owners; ours come back from where we sent.
        back = [
            (dst, slots, home.new_empty((len(slots), *home.shape[1:])))
            for dst, slots in plan.sends(rank, step)
        ]
        posted = ex.start([(src, g) for (src, _, _), g in zip(received, grads)], [(d, t) for d, _, t in back])
        if grads_pending is not None:
            _add_home(home, grads_pending)
        grads_pending = (posted, back)
    if grads_pending is not None:
        _add_home(home, grads_pending)
    dk = home[:, 0].transpose(0, 1).reshape(k.shape)
    dv = home[:, 1].transpose(0, 1).reshape(v.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _add_home(home: Tensor, grads_pending) -> None:
    posted, back = grads_pending
    _Exchange.wait(posted)
    for _, slots, buf in back:
        _slots(home, slots).add_(buf)


def windowed_ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float,
    group,
    kernel: BlockAttention,
    rank: int,
    plan: WindowPlan,
    groups: RowGroups,
    kept: tuple[Tensor, Tensor] | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out (B, 2c, Hq, D) in q's dtype, lse (B, Hq, 2c))`` of this rank's zigzag shard ``q``
    ``(B, 2c, Hq, D)`` against every rank's ``k``/``v`` ``(B, 2c, Hkv, D)`` within ``plan.window``
    (and the documents of ``groups``), with attention ``sinks`` ``(Hq,)`` if given
    (:mod:`ringft.ops.sinks`); differentiable in q, k, v and sinks. Inputs already validated.
    ``kept``: this call's out/lse from the forward (a checkpoint's recompute): the ring forward is
    skipped and they are saved for the backward as they are."""
    return _WindowedRingAttention.apply(
        q, k, v, softmax_scale, group, kernel, rank, plan, groups, kept, sinks
    )
