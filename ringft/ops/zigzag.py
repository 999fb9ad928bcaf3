"""Zigzag ring attention: exact (causal) attention over a sequence split across a CP group.

Layout: the global sequence of length ``S`` is cut into ``2N`` equal chunks; CP rank ``r`` holds
chunks ``r`` and ``2N-1-r`` concatenated (``seq_local = S / N``), so every rank does the same amount
of causal work. Each rank keeps its queries and passes its K/V block around the ring; at step ``s``
it holds the K/V of rank ``j = (r - s) mod N``:

- ``s == 0``: the local block, causal (local positions are increasing, so plain lower-triangular);
- ``j < r``:  every local query sees chunk ``j`` in full and nothing of chunk ``2N-1-j``
              -> all queries x first half of the K/V block, unmasked;
- ``j > r``:  only the local second half (chunk ``2N-1-r``) sees anything, and it sees both chunks
              -> second half of the queries x all of the K/V block, unmasked.

Fully masked work is never computed. Partial results are merged by log-sum-exp in fp32.
Backward recomputes each block from the merged out/lse; dq accumulates locally, dk/dv ride the ring
with their K/V and arrive home after ``N`` hops.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringft.ops.comm import RingExchange, group_rank_and_size
from ringft.ops.kernels import BACKENDS, BlockAttention, accumulator_dtype, default_scale, get_backend
from ringft.ops.merge import merge_attention_

Tensor = torch.Tensor

_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}


def _local_problems(q: Tensor, k: Tensor, v: Tensor, backend: str) -> list[str]:
    problems = []
    if backend not in BACKENDS:
        return [f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}"]
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return [
            "q, k and v must be 4-D (batch, seq_local, heads, head_dim); got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        ]
    if k.shape != v.shape:
        problems.append(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    bq, sq, hq, dq = q.shape
    bk, sk, hk, dk = k.shape
    if (bq, sq, dq) != (bk, sk, dk):
        problems.append(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree in batch, seq_local and head_dim"
        )
    if hk == 0 or hq % hk != 0:
        problems.append(
            f"query heads ({hq}) must be a multiple of key/value heads ({hk}) for GQA: "
            "check num_attention_heads / num_key_value_heads"
        )
    if not (q.dtype == k.dtype == v.dtype):
        problems.append(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}: cast them")
    if not (q.device == k.device == v.device):
        problems.append("q, k and v must be on the same device")
    if q.dtype not in _DTYPE_CODES:
        problems.append(f"unsupported dtype {q.dtype}: use fp32, bf16, fp16 or fp64")
    if sq % 2 != 0:
        problems.append(
            f"seq_local ({sq}) must be even (two zigzag chunks per rank): pad the global sequence to a "
            "multiple of 2 * cp_size (RingDataCollator does this)"
        )
    if not problems:
        reason = get_backend(backend, q.device).check(q)
        if reason:
            problems.append(reason)
    return problems


def validate_inputs(q: Tensor, k: Tensor, v: Tensor, backend: str, group, rank: int, size: int) -> None:
    """Raise the same ``ValueError`` on every rank when any rank's inputs are unusable.

    Local problems and every rank's shape/dtype are exchanged in one small all_gather before any
    ring traffic, so a bad input on one rank never leaves the others waiting in a send/recv.
    """
    problems = _local_problems(q, k, v, backend)
    if size == 1:
        if problems:
            raise ValueError("zigzag_ring_attention: " + "; ".join(problems))
        return
    shape = (*q.shape, k.shape[2]) if q.dim() == 4 and k.dim() == 4 else (-1,) * 5
    meta = [1 if problems else 0, *shape, _DTYPE_CODES.get(q.dtype, 0)]
    device = q.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor(meta, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    rows = [t.tolist() for t in gathered]
    bad = [i for i, row in enumerate(rows) if row[0]]
    messages = []
    if problems:
        messages.append(f"rank {rank}: " + "; ".join(problems))
    others = [i for i in bad if i != rank]
    if others:
        messages.append(f"bad inputs on CP rank(s) {others} (see their error)")
    if not bad and len({tuple(row[1:]) for row in rows}) > 1:
        desc = ", ".join(
            f"rank {i}: (batch, seq_local, heads, dim, kv_heads, dtype)={tuple(row[1:])}"
            for i, row in enumerate(rows)
        )
        messages.append(
            "all CP ranks must pass the same batch, seq_local (S / cp_size), heads, head_dim and dtype; "
            f"got {desc}. Shard every sequence with zigzag_shard / RingDataCollator"
        )
    if messages:
        raise ValueError("zigzag_ring_attention: " + " | ".join(messages))


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
    scale: float,
) -> tuple[Tensor, Tensor]:
    """One ring step of the forward: attend the local ``q`` to the K/V block of rank ``source``.

    Returns the updated fp32 accumulators ``(out, lse)`` (created at step 0, merged in place after).
    """
    half = q.shape[1] // 2
    if step == 0:
        blk_out, blk_lse = kernel.forward(q, kb, vb, causal, scale)
        acc = accumulator_dtype(q.dtype)
        return blk_out.to(acc), blk_lse.to(acc).clone()
    if not causal:
        merge_attention_(out, lse, *kernel.forward(q, kb, vb, False, scale))
    elif source < rank:
        merge_attention_(out, lse, *kernel.forward(q, kb[:, :half], vb[:, :half], False, scale))
    else:
        blk_out, blk_lse = kernel.forward(q[:, half:], kb, vb, False, scale)
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
    scale: float,
) -> tuple[Tensor, Tensor, slice]:
    """One ring step of the backward against the K/V block of rank ``source``.

    Adds the query gradient into the local fp32 accumulator ``dq`` in place and returns
    ``(dk, dv, kv_part)``: the block's K/V gradients and the slice of the block they belong to
    (they are added to the travelling accumulator once it has arrived, so its transfer overlaps
    with this compute).
    """
    half = q.shape[1] // 2
    if step == 0 or not causal:
        dq_b, dk_b, dv_b = kernel.backward(dout, q, kb, vb, out, lse, causal and step == 0, scale)
        dq.add_(dq_b)
        kv_part = slice(None)
    elif source < rank:
        dq_b, dk_b, dv_b = kernel.backward(dout, q, kb[:, :half], vb[:, :half], out, lse, False, scale)
        dq.add_(dq_b)
        kv_part = slice(None, half)
    else:
        dq_b, dk_b, dv_b = kernel.backward(
            dout[:, half:], q[:, half:], kb, vb, out[:, half:], lse[:, :, half:], False, scale
        )
        dq[:, half:].add_(dq_b)
        kv_part = slice(None)
    return dk_b, dv_b, kv_part


class _ZigzagRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, kernel: BlockAttention, rank: int, size: int):
        ring = RingExchange(group) if size > 1 else None
        current = torch.stack([k, v]) if size > 1 else None  # K and V travel in one buffer
        spare = torch.empty_like(current) if size > 1 else None
        out = lse = None
        for step in range(size):
            pending = ring.start(current, spare) if step + 1 < size else None  # next block in flight
            kb, vb = (k, v) if step == 0 else (current[0], current[1])
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
                scale=scale,
            )
            if pending is not None:
                current, spare = pending.wait(), current
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.group, ctx.kernel, ctx.rank, ctx.size = (
            causal,
            scale,
            group,
            kernel,
            rank,
            size,
        )
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, kernel, rank, size = ctx.causal, ctx.scale, ctx.kernel, ctx.rank, ctx.size
        dout = dout.contiguous()
        if size == 1:
            dq_b, dk_b, dv_b = kernel.backward(dout, q, k, v, out, lse, causal, scale)
            return dq_b, dk_b, dv_b, None, None, None, None, None, None

        acc = accumulator_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        ring = RingExchange(ctx.group)
        current = torch.stack([k, v])
        spare = torch.empty_like(current)
        # dK/dV accumulators ride the ring in fp32, one hop behind their K/V block.
        grad = torch.zeros((2, *k.shape), dtype=acc, device=k.device)
        grad_spare = torch.empty_like(grad)
        grad_pending = None
        for step in range(size):
            kv_pending = ring.start(current, spare) if step + 1 < size else None
            dk_b, dv_b, kv_part = backward_block(
                kernel,
                dout,
                q,
                current[0],
                current[1],
                out,
                lse,
                dq,
                step=step,
                source=(rank - step) % size,
                rank=rank,
                causal=causal,
                scale=scale,
            )
            if step > 0:
                grad, grad_spare = grad_pending.wait(), grad  # accumulator of this block so far
            grad[0][:, kv_part].add_(dk_b)
            grad[1][:, kv_part].add_(dv_b)
            grad_pending = ring.start(grad, grad_spare)
            if kv_pending is not None:
                current, spare = kv_pending.wait(), current
        home = grad_pending.wait()  # after N hops the dK/dV of our own block are back
        return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype), None, None, None, None, None, None


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
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention over a sequence zigzag-sharded across the ranks of ``group``.

    Args:
        q: ``(batch, seq_local, heads_q, head_dim)``, this rank's chunks ``r`` and ``2N-1-r``.
        k, v: ``(batch, seq_local, heads_kv, head_dim)``, ``heads_q % heads_kv == 0`` (GQA/MQA).
        causal: causal (True) or bidirectional (False) attention over the global sequence.
        softmax_scale: defaults to ``1/sqrt(head_dim)``.
        group: the context-parallel process group (default: the world group; N = 1 needs no
            torch.distributed at all).
        backend: ``auto`` | ``torch`` | ``flash_attn`` | ``reference`` (see ``ringft.ops.kernels``).
        return_lse: also return the log-sum-exp ``(batch, heads_q, seq_local)`` in fp32.

    Returns:
        ``out`` ``(batch, seq_local, heads_q, head_dim)`` in q's dtype (and ``lse`` if asked).
    """
    rank, size = group_rank_and_size(group)
    validate_inputs(q, k, v, backend, group, rank, size)
    kernel = get_backend(backend, q.device)
    scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, lse = _ZigzagRingAttention.apply(q, k, v, causal, scale, group, kernel, rank, size)
    return (out, lse) if return_lse else out
