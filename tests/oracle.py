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


def per_document_attention_fp64(q, k, v, cu_seqlens):
    """Each document of each row separately through :func:`full_attention_fp64` (causal).

    q (B, S, Hq, D), k/v (B, S, Hkv, D), ``cu_seqlens`` one list of global offsets per row ->
    out (B, S, Hq, D) fp64, lse (B, Hq, S) fp64. Differentiable.
    """
    outs, lses = [], []
    for b, cu in enumerate(cu_seqlens):
        pieces = [
            full_attention_fp64(q[b : b + 1, x:y], k[b : b + 1, x:y], v[b : b + 1, x:y], True)
            for x, y in zip(cu, cu[1:])
        ]
        outs.append(torch.cat([p[0] for p in pieces], dim=1))
        lses.append(torch.cat([p[1] for p in pieces], dim=2))
    return torch.cat(outs), torch.cat(lses)


def windowed_attention_fp64(q, k, v, window: int, cu_seqlens=None, scale: float | None = None):
    """Sliding-window causal attention in fp64 by one explicit mask over the global sequence.

    Query ``i`` sees key ``j`` iff ``j <= i``, ``i - j < window`` and, with ``cu_seqlens`` (global
    document offsets per row, or one row for all), both lie in the same document. q (B, S, Hq, D),
    k/v (B, S, Hkv, D) -> out (B, S, Hq, D) fp64, lse (B, Hq, S) fp64. Differentiable.
    """
    q, k, v = q.double(), k.double(), v.double()
    batch, seq = q.shape[:2]
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    i = torch.arange(seq, device=q.device)[:, None]
    j = torch.arange(seq, device=q.device)[None, :]
    masks = []
    for b in range(batch):
        keep = (j <= i) & (i - j < window)
        if cu_seqlens is not None:
            cu = cu_seqlens[b] if len(cu_seqlens) > 1 else cu_seqlens[0]
            doc = torch.zeros(seq, dtype=torch.long, device=q.device)
            for start in cu[1:-1]:
                doc[start:] += 1
            keep &= doc[:, None] == doc[None, :]
        masks.append(keep)
    mask = torch.stack(masks)[:, None]  # (B, 1, S, S)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)
    return out, lse


def sink_attention_fp64(q, k, v, sinks, window: int | None = None, cu_seqlens=None, scale=None):
    """Causal attention with an attention sink per query head (gpt-oss's eager form: the sink's
    logit is one more column of each row's softmax, dropped before the values), optionally within a
    sliding ``window`` and documents (as :func:`windowed_attention_fp64`). q (B, S, Hq, D), k/v
    (B, S, Hkv, D), sinks (Hq,) -> out (B, S, Hq, D) fp64. Differentiable."""
    q, k, v, sinks = q.double(), k.double(), v.double(), sinks.double()
    batch, seq, heads = q.shape[:3]
    groups = heads // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    keep = (j <= i) & (i - j < (window or seq))
    masks = []
    for b in range(batch):
        doc = torch.zeros(seq, dtype=torch.long)
        for start in (cu_seqlens[b] if cu_seqlens is not None else [0, seq])[1:-1]:
            doc[start:] += 1
        masks.append(keep & (doc[:, None] == doc[None, :]))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~torch.stack(masks)[:, None], float("-inf"))
    column = sinks.view(1, heads, 1, 1).expand(batch, heads, seq, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)
