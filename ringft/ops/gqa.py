"""Grouped-query attention helpers for backends that need equal query and key/value head counts.

K/V always travel the ring with their own (fewer) heads; a backend that cannot do GQA natively
expands them locally, after receipt, and folds the gradients back before they travel home.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

__all__ = ["expand_kv_heads", "reduce_kv_head_grads"]


def expand_kv_heads(x: Tensor, groups: int) -> Tensor:
    """``(batch, seq, heads_kv, dim)`` -> ``(batch, seq, heads_kv * groups, dim)``: each K/V head
    repeated for the ``groups`` query heads that share it (no copy when ``groups == 1``)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def reduce_kv_head_grads(dx: Tensor, groups: int) -> Tensor:
    """``(batch, seq, heads_kv * groups, dim)`` -> ``(batch, seq, heads_kv, dim)``: the gradient of
    :func:`expand_kv_heads`, summing over the query heads of one group."""
    if groups == 1:
        return dx
    b, s, h, d = dx.shape
    return dx.view(b, s, h // groups, groups, d).sum(dim=3)
