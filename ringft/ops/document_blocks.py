"""One ring step of zigzag attention over packed documents (see :mod:`ringft.ops.documents`).

Step 0 is a varlen causal attention over the local document ranges: a backend's own
``forward_varlen`` / ``backward_varlen`` when it has one (flash-attn, the reference's mask),
otherwise fused calls per document (long documents in causal tiles plus rectangles where the
backend asks for it: ``causal_tile``, torch on CPU). Later steps are one unmasked rectangle per row
(or none).
Batch rows with the same plan share each call.
"""

from __future__ import annotations

import torch

from ringft.ops.documents import DocumentPlan, RowPlan
from ringft.ops.dtypes import accumulator_dtype
from ringft.ops.kernels import BlockAttention
from ringft.ops.merge import merge_attention_

Tensor = torch.Tensor
Piece = tuple[slice, slice, Tensor, Tensor]  # (batch rows, kv positions, dk, dv)

__all__ = [
    "Piece",
    "backward_block_documents",
    "causal_pieces",
    "forward_block_documents",
    "varlen_backward",
    "varlen_forward",
]


def _row_groups(plan: DocumentPlan) -> list[tuple[slice, RowPlan]]:
    if plan.uniform:
        return [(slice(None), plan.rows[0])]
    return [(slice(b, b + 1), row) for b, row in enumerate(plan.rows)]


def causal_pieces(bounds: tuple[int, ...], tile: int | None) -> list[tuple[int, int, int, int, bool]]:
    """The calls that cover the causal triangle of every segment ``[bounds[i], bounds[i+1])``:
    ``(q0, q1, k0, k1, causal)``. With ``tile``, a longer segment is cut into causal diagonal tiles
    of ``tile`` queries, each followed by the unmasked rectangle of its queries against the
    segment's earlier keys (so a diagonal tile comes before the rectangle of the same rows)."""
    pieces = []
    for x, y in zip(bounds, bounds[1:]):
        step = y - x if tile is None or y - x <= tile else tile
        for a in range(x, y, step):
            b = min(a + step, y)
            pieces.append((a, b, a, b, True))
            if a > x:
                pieces.append((a, b, x, a, False))
    return pieces


def _tile(kernel: BlockAttention, q: Tensor) -> int | None:
    tile = getattr(kernel, "causal_tile", None)
    return tile(q) if tile is not None else None


def varlen_forward(
    kernel: BlockAttention, q: Tensor, k: Tensor, v: Tensor, bounds: tuple[int, ...], softmax_scale: float
) -> tuple[Tensor, Tensor]:
    """Causal attention inside each segment ``[bounds[i], bounds[i+1])`` of q ``(B, S, Hq, D)`` and
    k/v ``(B, S, Hkv, D)``: ``(out (B, S, Hq, D) in the accumulator dtype, lse (B, Hq, S))``.

    A backend's own ``forward_varlen`` when it has one, else the fused op per
    :func:`causal_pieces` (tiles of the backend's ``causal_tile``), merged by log-sum-exp."""
    acc = accumulator_dtype(q.dtype)
    if hasattr(kernel, "forward_varlen"):
        out, lse = kernel.forward_varlen(q, k, v, bounds, softmax_scale)
        return out.to(acc), lse.to(acc)
    out = torch.empty(q.shape, dtype=acc, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=acc, device=q.device)
    for q0, q1, k0, k1, causal in causal_pieces(bounds, _tile(kernel, q)):
        o, l_ = kernel.forward(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], causal, softmax_scale)
        if causal:  # the first result for these rows
            out[:, q0:q1], lse[:, :, q0:q1] = o, l_
        else:
            merge_attention_(out[:, q0:q1], lse[:, :, q0:q1], o, l_)
    return out, lse


def varlen_backward(
    kernel: BlockAttention,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    bounds: tuple[int, ...],
    softmax_scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of :func:`varlen_forward` w.r.t. the merged ``out``/``lse``: ``(dq, dk, dv)`` shaped
    like q and k/v (the accumulator dtype when a segment was cut into tiles)."""
    if hasattr(kernel, "backward_varlen"):
        return kernel.backward_varlen(dout, q, k, v, out, lse, bounds, softmax_scale)
    pieces = causal_pieces(bounds, _tile(kernel, q))
    disjoint = all(p[4] for p in pieces)  # one piece per segment: each gradient entry written once
    if disjoint:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    else:  # tiles and rectangles add up, in the accumulator dtype
        acc = accumulator_dtype(q.dtype)
        dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
    for q0, q1, k0, k1, causal in pieces:
        gq, gk, gv = kernel.backward(
            dout[:, q0:q1], q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], out[:, q0:q1], lse[:, :, q0:q1],
            causal, softmax_scale,
        )  # fmt: skip
        if disjoint:
            dq[:, q0:q1], dk[:, k0:k1], dv[:, k0:k1] = gq, gk, gv
        else:
            dq[:, q0:q1] += gq
            dk[:, k0:k1] += gk
            dv[:, k0:k1] += gv
    return dq, dk, dv


def forward_block_documents(
    kernel: BlockAttention,
    q: Tensor,
    kb: Tensor,
    vb: Tensor,
    out: Tensor | None,
    lse: Tensor | None,
    *,
    step: int,
    plan: DocumentPlan,
    softmax_scale: float,
) -> tuple[Tensor, Tensor]:
    """:func:`ringft.ops.zigzag_blocks.forward_block` restricted to the documents of ``plan``.

    q ``(B, seq_local, Hq, D)``, kb/vb ``(B, seq_local, Hkv, D)``; accumulators ``out``
    ``(B, seq_local, Hq, D)`` and ``lse`` ``(B, Hq, seq_local)`` are created at step 0.
    """
    groups = _row_groups(plan)
    if step == 0:
        if len(groups) == 1:
            return varlen_forward(kernel, q, kb, vb, groups[0][1].diagonal, softmax_scale)
        parts = [
            varlen_forward(kernel, q[rs], kb[rs], vb[rs], row.diagonal, softmax_scale) for rs, row in groups
        ]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    for rs, row in groups:
        rect = row.blocks[step]
        if rect is not None:
            q0, q1, k0, k1 = rect
            blk_out, blk_lse = kernel.forward(
                q[rs, q0:q1], kb[rs, k0:k1], vb[rs, k0:k1], False, softmax_scale
            )
            merge_attention_(out[rs, q0:q1], lse[rs, :, q0:q1], blk_out, blk_lse)
    return out, lse


def backward_block_documents(
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
    plan: DocumentPlan,
    softmax_scale: float,
) -> list[Piece]:
    """:func:`ringft.ops.zigzag_blocks.backward_block` restricted to the documents of ``plan``:
    adds into ``dq`` in place and returns the K/V gradient pieces ``(rows, positions, dk, dv)``."""
    pieces: list[Piece] = []
    for rs, row in _row_groups(plan):
        if step == 0:
            gq, gk, gv = varlen_backward(
                kernel, dout[rs], q[rs], kb[rs], vb[rs], out[rs], lse[rs], row.diagonal, softmax_scale
            )
            dq[rs].add_(gq)
            pieces.append((rs, slice(None), gk, gv))
            continue
        rect = row.blocks[step]
        if rect is None:
            continue
        q0, q1, k0, k1 = rect
        gq, gk, gv = kernel.backward(
            dout[rs, q0:q1],
            q[rs, q0:q1],
            kb[rs, k0:k1],
            vb[rs, k0:k1],
            out[rs, q0:q1],
            lse[rs, :, q0:q1],
            False,
            softmax_scale,
        )
        dq[rs, q0:q1].add_(gq)
        pieces.append((rs, slice(k0, k1), gk, gv))
    return pieces
