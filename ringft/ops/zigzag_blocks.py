"""One ring step of zigzag attention: which part of the query block meets which part of the K/V block.

Rank ``r`` of ``N`` holds global chunks ``r`` and ``2N-1-r`` (``seq_local = 2 * half``); at ring
step ``s`` it holds the K/V of rank ``j = (r - s) mod N``:

- ``s == 0``: the local block, causal (local positions are increasing, so plain lower-triangular);
- ``j < r``:  every local query sees chunk ``j`` in full and nothing of chunk ``2N-1-j``
              -> all queries x first half of the K/V block, unmasked;
- ``j > r``:  only the local second half (chunk ``2N-1-r``) sees anything, and it sees both chunks
              -> second half of the queries x all of the K/V block, unmasked.

Fully masked work is never computed. :class:`ZigzagSteps` is this schedule for the ring loop
(:mod:`ringft.ops.ring_loop`); the block functions are shared with the one-process emulator
(:mod:`ringft.ops.emulate`).
"""

from __future__ import annotations

import torch

from ringft.ops.backends import BlockAttention
from ringft.ops.comm import Exchange, Moves, kv_buffer, kv_views
from ringft.ops.document_blocks import Piece, backward_block_documents, forward_block_documents
from ringft.ops.documents import DocumentLayout
from ringft.ops.dtypes import accumulator_dtype
from ringft.ops.merge import merge_attention_

Tensor = torch.Tensor

__all__ = ["Piece", "RelayGradients", "ZigzagSteps", "backward_block", "forward_block"]


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
    documents: DocumentLayout | None = None,
) -> tuple[Tensor, Tensor]:
    """Attend the local ``q`` ``(B, seq_local, Hq, D)`` to the K/V block ``kb``/``vb``
    ``(B, seq_local, Hkv, D)`` of rank ``source`` (only within documents, when given).

    Returns the accumulators ``out`` ``(B, seq_local, Hq, D)`` and ``lse`` ``(B, Hq, seq_local)`` in
    the accumulator dtype: created at step 0, merged in place after.
    """
    if documents is not None and not documents.single:
        return forward_block_documents(
            kernel, q, kb, vb, out, lse, step=step, layout=documents, softmax_scale=softmax_scale
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
    documents: DocumentLayout | None = None,
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
            kernel, dout, q, kb, vb, out, lse, dq, step=step, layout=documents, softmax_scale=softmax_scale
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


class ZigzagSteps:
    """The full ring for rank ``rank`` of ``size``: at step ``s`` the K/V block of rank
    ``(rank - s) mod size`` is at hand, passed on from the previous rank (K and V in one buffer,
    each at its own size: :func:`~ringft.ops.comm.kv_buffer`); the block work is
    :func:`forward_block` / :func:`backward_block` (restricted to ``documents``, if given)."""

    def __init__(
        self, rank: int, size: int, causal: bool, softmax_scale: float, documents: DocumentLayout | None
    ) -> None:
        self.rank, self.size, self.causal, self.softmax_scale = rank, size, causal, softmax_scale
        self.documents = documents
        self.steps = size - 1
        self.one_call = size == 1 and (documents is None or documents.single)

    def pack(self, k: Tensor, v: Tensor) -> Tensor:
        """K and V in one flat buffer (:func:`~ringft.ops.comm.kv_buffer`)."""
        return kv_buffer(k, v)

    def kv_moves(self, step: int, payload: Tensor, held: list[Tensor], spare: list[Tensor]) -> Moves:
        """Pass the block at hand (our own at first) to the next rank; receive the previous rank's
        into the buffer of the step before (two buffers in turn)."""
        send = held[0] if held else payload
        recv = spare[0] if spare else (payload if held else torch.empty_like(payload))
        return [((self.rank + 1) % self.size, send)], [((self.rank - 1) % self.size, recv)]

    def _kv(self, k: Tensor, v: Tensor, step: int, held: list[Tensor]) -> tuple[Tensor, Tensor]:
        return (k, v) if step == 0 else kv_views(held[0], k, v)

    def _where(self, step: int) -> dict:
        return dict(
            step=step, source=(self.rank - step) % self.size, rank=self.rank, causal=self.causal,
            softmax_scale=self.softmax_scale, documents=self.documents,
        )  # fmt: skip

    def forward(self, kernel, q, k, v, step: int, held: list[Tensor], out, lse) -> tuple[Tensor, Tensor]:
        """:func:`forward_block` against this step's block."""
        return forward_block(kernel, q, *self._kv(k, v, step, held), out, lse, **self._where(step))

    def backward(self, kernel, dout, q, k, v, step: int, held: list[Tensor], out, lse, dq) -> list[Piece]:
        """:func:`backward_block` against this step's block: its dK/dV pieces."""
        kb, vb = self._kv(k, v, step, held)
        return backward_block(kernel, dout, q, kb, vb, out, lse, dq, **self._where(step))

    def gradients(self, k: Tensor, v: Tensor, dtype: torch.dtype) -> RelayGradients:
        """dK/dV ride the ring behind their block (:class:`RelayGradients`)."""
        return RelayGradients(k, v, dtype, self.rank, self.size)


class RelayGradients:
    """The dK/dV accumulator of each block rides the ring one hop behind its K/V (laid out like
    :func:`~ringft.ops.comm.kv_buffer`), every rank adding its pieces; after ``size`` hops this
    rank's own block's gradient is back.

    In fp32, not q's dtype: in bf16 each of the N - 1 additions on the way would round the partial
    sum (u = 2^-8), a worst case of (N - 1) u times the sum of the blocks' magnitudes instead of u
    once at the end (N = 8: 2.7 % instead of 0.4 %), beyond the ring's tested bound (2x one call's
    error + 4e-3)."""

    def __init__(self, k: Tensor, v: Tensor, dtype: torch.dtype, rank: int, size: int) -> None:
        self.k, self.v, self.rank, self.size = k, v, rank, size
        self.grad = torch.zeros(k.numel() + v.numel(), dtype=dtype, device=k.device)
        self.spare = torch.empty_like(self.grad) if size > 1 else None
        self.pending = None

    def add(self, ex: Exchange, step: int, grads: list[Piece]) -> None:
        """Add this step's pieces to the accumulator that arrived with the block, pass it on."""
        if self.pending is not None:
            (arrived,) = self.pending.wait()
            self.grad, self.spare = arrived, self.grad
        gk, gv = kv_views(self.grad, self.k, self.v)
        for rows, part, dk_b, dv_b in grads:
            gk[rows, part].add_(dk_b)
            gv[rows, part].add_(dv_b)
        if self.size > 1:
            moves = [((self.rank + 1) % self.size, self.grad)], [((self.rank - 1) % self.size, self.spare)]
            self.pending = ex.start(*moves)

    def home(self) -> tuple[Tensor, Tensor]:
        """This rank's ``(dk, dv)``, back after the last hop."""
        if self.pending is not None:
            (self.grad,) = self.pending.wait()
        return kv_views(self.grad, self.k, self.v)
