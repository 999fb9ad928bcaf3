"""Ulysses all-to-alls with their own backward: sequence shards <-> head shards in a group of ``U``.

``seq_to_heads``: every rank holds ``(B, s, H_i, D)`` tensors (its ``s`` tokens, all heads) and
gets ``(B, U*s, H_i/U, D)`` back: the tokens of all ``U`` ranks in group-rank order, for head
group ``u`` (heads ``u*H_i/U .. (u+1)*H_i/U - 1``). ``heads_to_seq`` is its inverse. Several tensors
(q, k and v, with different head counts) travel in one ``all_to_all_single``; each function's
backward is the other one, so gradients take the same route back.

Not built from ``torch.distributed.nn`` (on gloo its collectives give silently wrong gradients for
non-contiguous grads): every buffer handed to the collective is a fresh contiguous tensor. gloo's
``all_to_all_single`` was checked on CPU for fp32, fp64, bf16, fp16 and int64, group sizes 2 and 3,
including empty and size-1 dims, so no fallback is needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Tensor = torch.Tensor

__all__ = ["heads_to_seq", "seq_to_heads"]


def _exchange(send: Tensor, group) -> Tensor:
    """``all_to_all_single`` over dim 0 (one slice per group rank) of a contiguous buffer."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def _to_heads(xs: tuple[Tensor, ...], group, size: int) -> list[Tensor]:
    b, s, _, d = xs[0].shape
    heads = [x.shape[2] // size for x in xs]
    # (U, B, s, sum(H_i/U), D): slice u is what rank u receives (its head group of every tensor).
    send = torch.cat([x.reshape(b, s, size, h, d).permute(2, 0, 1, 3, 4) for x, h in zip(xs, heads)], dim=3)
    recv = _exchange(send.contiguous(), group)  # recv[j]: rank j's tokens, our head group
    outs, start = [], 0
    for h in heads:
        part = recv[:, :, :, start : start + h]  # (U, B, s, h, D)
        outs.append(part.permute(1, 0, 2, 3, 4).reshape(b, size * s, h, d))
        start += h
    return outs


def _to_seq(xs: tuple[Tensor, ...], group, size: int) -> list[Tensor]:
    b, total, _, d = xs[0].shape
    s = total // size
    heads = [x.shape[2] for x in xs]
    # (U, B, s, sum(h_i), D): slice j is rank j's tokens of our head group.
    send = torch.cat([x.reshape(b, size, s, h, d).transpose(0, 1) for x, h in zip(xs, heads)], dim=3)
    recv = _exchange(send.contiguous(), group)  # recv[u]: head group u of our tokens
    outs, start = [], 0
    for h in heads:
        part = recv[:, :, :, start : start + h]  # (U, B, s, h, D)
        outs.append(part.permute(1, 2, 0, 3, 4).reshape(b, s, size * h, d))
        start += h
    return outs


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, size, *xs):
        ctx.group, ctx.size = group, size
        outs = _to_heads(xs, group, size)
        ctx.shapes = [o.shape for o in outs]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_to_seq(_fill(grads, ctx.shapes), ctx.group, ctx.size))


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, size, *xs):
        ctx.group, ctx.size = group, size
        outs = _to_seq(xs, group, size)
        ctx.shapes = [o.shape for o in outs]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_to_heads(_fill(grads, ctx.shapes), ctx.group, ctx.size))


def _fill(grads: tuple[Tensor | None, ...], shapes) -> tuple[Tensor, ...]:
    """Zeros for the outputs that got no gradient (same dtype/device as one that did)."""
    ref = next(g for g in grads if g is not None)
    return tuple(
        torch.zeros(shape, dtype=ref.dtype, device=ref.device) if g is None else g
        for g, shape in zip(grads, shapes)
    )


def _check(xs: tuple[Tensor, ...], size: int, dim: int) -> None:
    if not xs:
        raise ValueError("nothing to exchange")
    b, s, _, d = xs[0].shape
    for x in xs:
        if x.dim() != 4 or (x.shape[0], x.shape[1], x.shape[3]) != (b, s, d) or x.dtype != xs[0].dtype:
            raise ValueError("all tensors of one all-to-all must be (B, S, H_i, D) with one B, S, D, dtype")
        if x.shape[dim] % size:
            raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {size} ranks")


def seq_to_heads(*xs: Tensor, group=None, size: int | None = None) -> tuple[Tensor, ...]:
    """Sequence shards ``(B, s, H_i, D)`` -> head shards ``(B, U*s, H_i/U, D)`` over ``group``
    (``U`` ranks; every ``H_i % U == 0``). Differentiable; identity when ``U == 1``."""
    size = dist.get_world_size(group) if size is None else size
    if size == 1:
        return xs
    _check(xs, size, 2)
    return _SeqToHeads.apply(group, size, *xs)


def heads_to_seq(*xs: Tensor, group=None, size: int | None = None) -> tuple[Tensor, ...]:
    """Head shards ``(B, U*s, h_i, D)`` -> sequence shards ``(B, s, U*h_i, D)`` over ``group``:
    the inverse of :func:`seq_to_heads`. Differentiable; identity when ``U == 1``."""
    size = dist.get_world_size(group) if size is None else size
    if size == 1:
        return xs
    _check(xs, size, 1)
    return _HeadsToSeq.apply(group, size, *xs)
