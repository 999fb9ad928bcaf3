"""One ring step of zigzag attention: which part of the query block meets which part of the K/V block.

Rank ``r`` of ``N`` holds global chunks ``r`` and ``2N-1-r`` (``seq_local = 2 * half``); at ring
step ``s`` it holds the K/V of rank ``j = (r - s) mod N``:

- ``s == 0``: the local block, causal (local positions are increasing, so plain lower-triangular);
- ``j < r``:  every local query sees chunk ``j`` in full and nothing of chunk ``2N-1-j``
              -> all queries x first half of the K/V block, unmasked;
- ``j > r``:  only the local second half (chunk ``2N-1-r``) sees anything, and it sees both chunks
              -> second half of the queries x all of the K/V block, unmasked.

Fully masked work is never computed. Shared by the distributed operator (:mod:`ringft.ops.zigzag`)
and the one-process emulator (:mod:`ringft.ops.emulate`).
"""

from __future__ import annotations

import torch

from ringft.ops.backends import BlockAttention
from ringft.ops.document_blocks import Piece, backward_block_documents, forward_block_documents
from ringft.ops.documents import DocumentPlan
from ringft.ops.dtypes import accumulator_dtype
from ringft.ops.merge import merge_attention_

Tensor = torch.Tensor

__all__ = ["Piece", "backward_block", "forward_block"]


def forward_block(
    kernel: BlockAttention,
    q: Tensor,
    kb: Tensor,
    vb: Tensor,
    out: Tensor | None,
    lse: Tensor | None,
    *,
    step: int,
    source: int,
    rank: int,
    causal: bool,
    softmax_scale: float,
    documents: DocumentPlan | None = None,
) -> tuple[Tensor, Tensor]:
    """Attend the local ``q`` ``(B, seq_local, Hq, D)`` to the K/V block ``kb``/``vb``
    ``(B, seq_local, Hkv, D)`` of rank ``source`` (only within documents, when given).

    Returns the accumulators ``out`` ``(B, seq_local, Hq, D)`` and ``lse`` ``(B, Hq, seq_local)`` in
    the accumulator dtype: created at step 0, merged in place after.
    """
    if documents is not None and not documents.single:
        return forward_block_documents(
            kernel, q, kb, vb, out, lse, step=step, plan=documents, softmax_scale=softmax_scale
        )
    half = q.shape[1] // 2
    if step == 0:
        blk_out, blk_lse = kernel.forward(q, kb, vb, causal, softmax_scale)
        acc = accumulator_dtype(q.dtype)
        return blk_out.to(acc), blk_lse.to(acc).clone()
    if not causal:
        merge_attention_(out, lse, *kernel.forward(q, kb, vb, False, softmax_scale))
    elif source < rank:
        merge_attention_(out, lse, *kernel.forward(q, kb[:, :half], vb[:, :half], False, softmax_scale))
    else:
        blk_out, blk_lse = kernel.forward(q[:, half:], kb, vb, False, softmax_scale)
        merge_attention_(out[:, half:], lse[:, :, half:], blk_out, blk_lse)
    return out, lse


def backward_block(
    kernel: BlockAttention,
    dout: Tensor,
    q: Tensor,
    kb: Tensor,
    vb: Tensor,
    out: Tensor,
    lse: Tensor,
    dq: Tensor,
    *,
    step: int,
    source: int,
    rank: int,
    causal: bool,
    softmax_scale: float,
    documents: DocumentPlan | None = None,
) -> list[Piece]:
    """One ring step of the backward against the K/V block of rank ``source``.

    ``dout``/``q``/``out`` ``(B, seq_local, Hq, D)``, ``lse`` ``(B, Hq, seq_local)`` (merged),
    ``kb``/``vb`` ``(B, seq_local, Hkv, D)``. Adds the query gradient into the local accumulator
    ``dq`` in place and returns the block's K/V gradients as pieces ``(batch rows, kv positions,
    dk, dv)`` (they are added to the travelling accumulator once it has arrived, so its transfer
    overlaps with this compute).
    """
    if documents is not None and not documents.single:
        return backward_block_documents(
            kernel, dout, q, kb, vb, out, lse, dq, step=step, plan=documents, softmax_scale=softmax_scale
        )
    half = q.shape[1] // 2
    if step == 0 or not causal:
        dq_b, dk_b, dv_b = kernel.backward(dout, q, kb, vb, out, lse, causal and step == 0, softmax_scale)
        dq.add_(dq_b)
        kv_part = slice(None)
    elif source < rank:
        dq_b, dk_b, dv_b = kernel.backward(
            dout, q, kb[:, :half], vb[:, :half], out, lse, False, softmax_scale
        )
        dq.add_(dq_b)
        kv_part = slice(None, half)
    else:
        dq_b, dk_b, dv_b = kernel.backward(
            dout[:, half:], q[:, half:], kb, vb, out[:, half:], lse[:, :, half:], False, softmax_scale
        )
        dq[:, half:].add_(dq_b)
        kv_part = slice(None)
    return [(slice(None), kv_part, dk_b, dv_b)]
