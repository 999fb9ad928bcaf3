"""Zigzag ring attention: exact (causal) attention over a sequence split across a CP group.

Layout: the global sequence of length ``S`` is cut into ``2N`` equal chunks; CP rank ``r`` holds
chunks ``r`` and ``2N-1-r`` concatenated (``seq_local = S / N``), so every rank does the same amount
of causal work. Each rank keeps its queries and passes its K/V block around the ring; the work of
one step is in :mod:`ringft.ops.zigzag_blocks`. Partial results are merged by log-sum-exp in fp32.
Backward recomputes each block from the merged out/lse; dq accumulates locally, dk/dv ride the ring
with their K/V and arrive home after ``N`` hops.

Autocast: like ``scaled_dot_product_attention``, the operator runs in the autocast dtype when
autocast is on for the inputs' device (q, k and v are cast to it), and its own math (fp32
accumulators, merges) never runs under autocast.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ringft.ops.backends import BlockAttention, default_softmax_scale, get_backend
from ringft.ops.comm import RingExchange, group_rank_and_size, kv_buffer, kv_views
from ringft.ops.documents import DocumentPlan, document_plan
from ringft.ops.dtypes import accumulator_dtype, follow_autocast, no_autocast
from ringft.ops.latent import block_kernel, pad_head_dims
from ringft.ops.ring_checks import rank_problems, validate_inputs
from ringft.ops.saved_attention import AttentionStore
from ringft.ops.sinks import sink_gradient, sink_rescale
from ringft.ops.tiles import tiled
from ringft.ops.window_blocks import row_groups
from ringft.ops.window_ring import windowed_ring_attention
from ringft.ops.windows import window_plan
from ringft.ops.zigzag_blocks import backward_block, forward_block

Tensor = torch.Tensor

__all__ = ["zigzag_ring_attention"]


class _ZigzagRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, causal, softmax_scale, group, kernel: BlockAttention, rank, size, documents, kept, sinks
    ):
        if kept is not None:  # a checkpoint's recompute: the forward's own out/lse (saved_attention)
            out, lse = kept
        else:
            out, lse = _ring_forward(q, k, v, causal, softmax_scale, group, kernel, rank, size, documents)
            if sinks is not None:  # after the merge: the sink needs nothing from other ranks
                out, lse = sink_rescale(out, lse, sinks)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *(() if sinks is None else (sinks,)))
        ctx.causal, ctx.softmax_scale, ctx.group, ctx.kernel = causal, softmax_scale, group, kernel
        ctx.rank, ctx.size, ctx.documents = rank, size, documents
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        with no_autocast(q.device.type):
            dq, dk, dv = _ring_backward(ctx, dout.contiguous(), q, k, v, out, lse)
            dsinks = sink_gradient(dout, out, lse, sinks[0]) if sinks else None
        return dq, dk, dv, None, None, None, None, None, None, None, None, dsinks


def _ring_forward(q, k, v, causal, softmax_scale, group, kernel, rank, size, documents):
    """``(out fp32, lse fp32)``: N steps of block attention while the next K/V is in flight."""
    ring = RingExchange(group) if size > 1 else None
    current = kv_buffer(k, v) if size > 1 else None  # K and V travel in one buffer
    spare = torch.empty_like(current) if size > 1 else None
    out = lse = None
    for step in range(size):
        pending = ring.start(current, spare) if step + 1 < size else None  # next block in flight
        kb, vb = (k, v) if step == 0 else kv_views(current, k, v)
        out, lse = forward_block(
            kernel,
            q,
            kb,
            vb,
            out,
            lse,
            step=step,
            source=(rank - step) % size,
            rank=rank,
            causal=causal,
            softmax_scale=softmax_scale,
            documents=documents,
        )
        if pending is not None:
            current, spare = pending.wait(), current
    return out, lse


def _ring_backward(ctx, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor):
    causal, softmax_scale, kernel, rank, size = ctx.causal, ctx.softmax_scale, ctx.kernel, ctx.rank, ctx.size
    documents = ctx.documents
    if size == 1 and (documents is None or documents.single):
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal, softmax_scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)  # a tiled kernel's dk/dv are fp32
    acc = accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    if size == 1:  # one rank, several documents: the local block only
        gk, gv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (k, v))
        for rows, part, dk_b, dv_b in backward_block(
            kernel, dout, q, k, v, out, lse, dq, step=0, source=0, rank=0, causal=causal,
            softmax_scale=softmax_scale, documents=documents,
        ):  # fmt: skip
            gk[rows, part].add_(dk_b)
            gv[rows, part].add_(dv_b)
        return dq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)
    ring = RingExchange(ctx.group)
    current = kv_buffer(k, v)
    spare = torch.empty_like(current)
    # dK/dV accumulators ride the ring in fp32, one hop behind their K/V block. Not in q's dtype:
    # in bf16 each of the N - 1 additions on the way would round the partial sum (u = 2^-8), a
    # worst case of (N - 1) u times the sum of the blocks' magnitudes instead of u once at the end
    # (N = 8: 2.7 % instead of 0.4 %), beyond the ring's tested bound (2x one call's error + 4e-3).
    grad = torch.zeros(current.shape, dtype=acc, device=k.device)  # flat: dK then dV, own sizes
    grad_spare = torch.empty_like(grad)
    grad_pending = None
    for step in range(size):
        kv_pending = ring.start(current, spare) if step + 1 < size else None
        pieces = backward_block(
            kernel,
            dout,
            q,
            *kv_views(current, k, v),
            out,
            lse,
            dq,
            step=step,
            source=(rank - step) % size,
            rank=rank,
            causal=causal,
            softmax_scale=softmax_scale,
            documents=documents,
        )
        if step > 0:
            grad, grad_spare = grad_pending.wait(), grad  # accumulator of this block so far
        gk, gv = kv_views(grad, k, v)
        for rows, part, dk_b, dv_b in pieces:
            gk[rows, part].add_(dk_b)
            gv[rows, part].add_(dv_b)
        grad_pending = ring.start(grad, grad_spare)
        if kv_pending is not None:
            current, spare = kv_pending.wait(), current
    home_k, home_v = kv_views(grad_pending.wait(), k, v)  # after N hops our own block's dK/dV are back
    return dq.to(q.dtype), home_k.to(k.dtype), home_v.to(v.dtype)


def zigzag_ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    validate: bool = True,
    cu_seqlens: Sequence[Sequence[int]] | DocumentPlan | None = None,
    sliding_window: int | None = None,
    attention_tile_tokens: int | None = None,
    store: AttentionStore | None = None,
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention over a sequence zigzag-sharded across the ranks of ``group``.

    Args:
        q: ``(batch, seq_local, heads_q, head_dim)``, this rank's chunks ``r`` and ``2N-1-r``.
        k, v: ``(batch, seq_local, heads_kv, head_dim)``, ``heads_q % heads_kv == 0`` (GQA/MQA); v's
            head dim may differ from q/k's (latent attention, :mod:`ringft.ops.latent`: K and V
            travel the ring at their own sizes; each block call pads locally).
        causal: causal (True) or bidirectional (False) attention over the global sequence.
        softmax_scale: defaults to ``1/sqrt(head_dim)``.
        group: the context-parallel process group (default: the world group; N = 1 needs no
            torch.distributed at all).
        backend: one of ``ringft.ops.backends.BACKENDS`` (``auto`` picks; see that module).
        return_lse: also return the log-sum-exp ``(batch, heads_q, seq_local)`` in fp32.
        validate: check that every rank's inputs are usable and agree (one small all_gather and a
            host sync) before any ring traffic. ``False`` keeps only this rank's own checks, with
            no communication: for callers that already validated the batch on every rank (the
            transformers integration does it once per forward, not once per layer).
        cu_seqlens: packed documents: per batch row (or one row for all), the global document
            offsets ``0 = cu[0] < ... < cu[m] = S`` (any lengths); attention stays causal inside each
            document and blocks without a shared document are skipped. Every rank passes the same
            offsets. Or a :class:`~ringft.ops.documents.DocumentPlan` built for this rank.
        sliding_window: transformers' ``sliding_window``: query position ``i`` sees only keys
            ``j`` with ``i - sliding_window < j <= i`` (an int >= 1; causal only; together with
            ``cu_seqlens`` a key must be in the window and the document). Blocks outside the window
            are never computed and K/V travel only to ranks whose window reaches them (see
            :mod:`ringft.ops.windows`). ``None``, or a window >= S, is plain causal attention.
        attention_tile_tokens: run every kernel call (the local block and each ring step's) over
            tiles of at most this many queries and keys, merged by log-sum-exp
            (:mod:`ringft.ops.tiles`): exact, and the kernels' transient memory follows the tile
            instead of ``seq_local``. ``None``: untiled. A tile >= ``seq_local`` is one tile.
        store: under activation checkpointing, the checkpointed call's
            :class:`~ringft.ops.saved_attention.AttentionStore` (:func:`active_store`): the forward
            keeps its out/lse there and the recompute takes them back instead of running the ring.
        sinks: attention sinks ``(heads_q,)`` (gpt-oss): one learned logit per query head in every
            row's softmax denominator, differentiable (:mod:`ringft.ops.sinks`); the returned lse
            then includes it.

    Returns:
        ``out`` ``(batch, seq_local, heads_q, head_dim)`` in q's dtype (the autocast dtype under
        autocast), and ``lse`` if asked.
    """
    rank, size = group_rank_and_size(group)
    q, k, v = follow_autocast(q, k, v)  # like scaled_dot_product_attention
    windowed = sliding_window is not None and q.dim() == 4 and sliding_window < q.shape[1] * size
    if windowed and v.dim() == k.dim() == 4 and v.shape[-1] != k.shape[-1] and k.shape[:3] == v.shape[:3]:
        # the window ring's exchange sends chunk slots of one shape: pad the tensors (latent.py)
        scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
        q, k, v, dv = pad_head_dims(q, k, v)  # latent attention (ringft.ops.latent)
        res = zigzag_ring_attention(
            q, k, v, causal=causal, softmax_scale=scale, group=group, backend=backend, return_lse=True,
            validate=validate, cu_seqlens=cu_seqlens, sliding_window=sliding_window, sinks=sinks,
            attention_tile_tokens=attention_tile_tokens, store=store,
        )  # fmt: skip
        return (res[0][..., :dv], res[1]) if return_lse else res[0][..., :dv]
    if validate:
        validate_inputs(
            q, k, v, backend, group, rank, size, cu_seqlens=cu_seqlens, causal=causal,
            sliding_window=sliding_window, attention_tile_tokens=attention_tile_tokens, sinks=sinks,
        )  # fmt: skip
    else:
        problems = rank_problems(
            q, k, v, backend, rank, size, cu_seqlens=cu_seqlens, causal=causal,
            sliding_window=sliding_window, attention_tile_tokens=attention_tile_tokens, sinks=sinks,
        )  # fmt: skip
        if problems:
            raise ValueError(f"zigzag_ring_attention: rank {rank}: " + "; ".join(problems))
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    kept = store.replay(q) if store is not None else None
    if sliding_window is not None and sliding_window < q.shape[1] * size:  # else: every key is in it
        window, tile = sliding_window, attention_tile_tokens
        out, lse = _windowed(
            q, k, v, scale, group, backend, rank, size, window, cu_seqlens, tile, kept, sinks
        )
    else:
        documents = cu_seqlens
        if cu_seqlens is not None and not isinstance(cu_seqlens, DocumentPlan):
            documents = document_plan(cu_seqlens, q.shape[1] * size, rank, size, batch=q.shape[0])
        kernel = block_kernel(backend, q, v, attention_tile_tokens)
        with no_autocast(q.device.type):
            out, lse = _ZigzagRingAttention.apply(
                q, k, v, causal, scale, group, kernel, rank, size, documents, kept, sinks
            )
    if store is not None and kept is None:
        store.record(out, lse)
    return (out, lse) if return_lse else out


def _windowed(
    q, k, v, scale, group, backend, rank, size, window, cu_seqlens, tile, kept, sinks
) -> tuple[Tensor, Tensor]:
    """The sliding-window schedule (:mod:`ringft.ops.window_ring`) on validated inputs."""
    cu_rows = cu_seqlens
    if isinstance(cu_seqlens, DocumentPlan):
        if not cu_seqlens.single and cu_seqlens.offsets is None:
            raise ValueError("sliding_window needs the DocumentPlan's offsets: build it with document_plan()")
        cu_rows = None if cu_seqlens.single else cu_seqlens.offsets
    plan = window_plan(q.shape[1] * size, size, window)
    kernel = tiled(get_backend(backend, q.device, q.dtype, q.shape[-1]), tile)
    with no_autocast(q.device.type):
        return windowed_ring_attention(
            q, k, v, scale, group, kernel, rank, plan, row_groups(cu_rows, q.shape[0]), kept, sinks
        )
