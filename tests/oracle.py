"""Oracle: plain full attention in fp64 on the global sequence (not written with ringft code)."""

from __future__ import annotations

import math

import torch


def full_attention_fp64(q, k, v, causal: bool, scale: float | None = None):
    """q (B, S, Hq, D), k/v (B, S, Hkv, D) -> out (B, S, Hq, D) fp64, lse (B, Hq, S) fp64."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2)
    v = v.repeat_interleave(groups, dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s = q.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)
    return out, lse
