"""Zigzag ring attention: exact (causal) attention over a sequence split across a CP group.

Layout: the global sequence of length ``S`` is cut into ``2N`` equal chunks; CP rank ``r`` holds
chunks ``r`` and ``2N-1-r`` concatenated (``seq_local = S / N``), so every rank does the same amount
of causal work. Each rank keeps its queries; the ring loop (:mod:`ringft.ops.ring_loop`) brings it
the K/V it attends to, step by step, as a schedule says: the full ring
(:class:`~ringft.ops.zigzag_blocks.ZigzagSteps`, with packed documents skipping blocks) or, with a
sliding window, only the chunks the window reaches (:class:`~ringft.ops.window_blocks.WindowSteps`).
This module checks the inputs and picks the schedule.

Autocast: like ``scaled_dot_product_attention``, the operator runs in the autocast dtype when
autocast is on for the inputs' device (q, k and v are cast to it), and its own math (fp32
accumulators, merges) never runs under autocast.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ringft.ops.backends import default_softmax_scale
from ringft.ops.comm import ChunkLayout, group_rank_and_size
from ringft.ops.documents import DocumentLayout, document_layout
from ringft.ops.dtypes import follow_autocast, no_autocast
from ringft.ops.latent import block_kernel
from ringft.ops.ring_checks import rank_problems, validate_inputs
from ringft.ops.ring_loop import RingSteps, ring_attention
from ringft.ops.saved_attention import AttentionStore
from ringft.ops.window_blocks import WindowSteps, row_groups
from ringft.ops.windows import window_schedule
from ringft.ops.zigzag_blocks import ZigzagSteps

Tensor = torch.Tensor

__all__ = ["zigzag_ring_attention"]


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
    cu_seqlens: Sequence[Sequence[int]] | DocumentLayout | None = None,
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
            offsets. Or a :class:`~ringft.ops.documents.DocumentLayout` built for this rank.
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
        steps: RingSteps = _window_steps(q, k, v, scale, rank, size, sliding_window, cu_seqlens)
    else:
        documents = cu_seqlens
        if cu_seqlens is not None and not isinstance(cu_seqlens, DocumentLayout):
            documents = document_layout(cu_seqlens, q.shape[1] * size, rank, size, batch=q.shape[0])
        steps = ZigzagSteps(rank, size, causal, scale, documents)
    kernel = block_kernel(backend, q, v, attention_tile_tokens)
    with no_autocast(q.device.type):
        out, lse = ring_attention(q, k, v, steps, kernel, group, kept, sinks)
    if store is not None and kept is None:
        store.record(out, lse)
    return (out, lse) if return_lse else out


def _window_steps(q, k, v, scale, rank, size, window, cu_seqlens) -> WindowSteps:
    """The sliding-window schedule (:class:`~ringft.ops.window_blocks.WindowSteps`) of this rank."""
    cu_rows = cu_seqlens
    if isinstance(cu_seqlens, DocumentLayout):
        if not cu_seqlens.single and cu_seqlens.offsets is None:
            raise ValueError(
                "sliding_window needs the DocumentLayout's offsets: build it with document_layout()"
            )
        cu_rows = None if cu_seqlens.single else cu_seqlens.offsets
    schedule = window_schedule(q.shape[1] * size, size, window)
    return WindowSteps(schedule, rank, row_groups(cu_rows, q.shape[0]), scale, ChunkLayout.of(k, v))
