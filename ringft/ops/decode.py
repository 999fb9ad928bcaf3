"""Exact attention of new tokens against a KV cache that is split across a CP group.

Each rank holds the K/V of its own shard of the prompt (any subset of positions; order does not
matter without a mask, since every cached key precedes the new query). Every rank computes the
partial attention of the (replicated) new queries against its part, the partial results are
all-gathered and merged by log-sum-exp, so every rank ends with the same, exact output.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringft.ops.comm import group_rank_and_size
from ringft.ops.kernels import accumulator_dtype, default_scale, get_backend
from ringft.ops.merge import merge_attention_

Tensor = torch.Tensor


def sharded_cache_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    softmax_scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    backend: str = "auto",
) -> Tensor:
    """q ``(batch, new, heads_q, dim)`` against every rank's ``k/v_cache`` ``(batch, cached, heads_kv, dim)``.

    The new queries see every cached key (the cache holds only earlier positions); causality among
    the ``new`` tokens themselves is the caller's job (decode one token at a time). Returns
    ``(batch, new, heads_q, dim)`` in q's dtype, identical on every rank. A rank may hold an empty
    cache (``cached == 0``).
    """
    scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    acc = accumulator_dtype(q.dtype)
    b, n, h, _ = q.shape
    if k_cache.shape[1] > 0:
        out, lse = get_backend(backend, q.device).forward(q, k_cache, v_cache, False, scale)
        out, lse = out.to(acc), lse.to(acc)
    else:
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full((b, h, n), float("-inf"), dtype=acc, device=q.device)
    _, size = group_rank_and_size(group)
    if size == 1:
        return out.to(q.dtype)
    packed = torch.cat([out.reshape(-1), lse.reshape(-1)]).contiguous()
    parts = [torch.empty_like(packed) for _ in range(size)]
    dist.all_gather(parts, packed, group=group)
    split = out.numel()
    outs = [p[:split].view(out.shape) for p in parts]
    lses = [p[split:].view(lse.shape) for p in parts]
    # Start from a rank whose cache is not empty (its lse is finite), then merge the others in
    # rank order so that every rank performs the identical sequence of operations.
    first = next(i for i, x in enumerate(lses) if torch.isfinite(x).all())
    total_out, total_lse = outs[first].clone(), lses[first].clone()
    for i in range(size):
        if i != first:
            merge_attention_(total_out, total_lse, outs[i], lses[i])
    return total_out.to(q.dtype)
