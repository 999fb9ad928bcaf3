"""Per-token quantities through the output head in token chunks, never the full ``(tokens, vocab)``
logits: each target's negative log-likelihood, and the comparison of two models' next-token
distributions (KL divergence, top-1 agreement).

The evaluations use them (``ringft eval-ppl``, ``ringft eval-short``): at 512K tokens with CP = 8 a
rank holds 64K positions, whose fp32 logits over a 128K vocabulary would take 32 GiB. The numerics
are :func:`ringft.loss.chunked_lm_loss`'s (:func:`ringft.loss.chunked.chunk_logits`: logits in the
hidden dtype, upcast to fp32, log-sum-exp in fp32), so the NLL of a token here is exactly the term
that loss sums. Extra memory: :func:`token_nll` ``~8 * chunk_size * V`` bytes (fp32 logits and one
temporary), :func:`compare_next_token` ``~16 * chunk_size * V`` (two models' log-probabilities and
two temporaries); the results are ``(tokens,)`` vectors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ringft.loss.chunked import chunk_logits
from ringft.loss.head import output_projection
from ringft.ops.dtypes import accumulator_dtype
from ringft.utils.values import as_integer

__all__ = ["TokenComparison", "compare_next_token", "head_parameters", "token_nll"]


def head_parameters(model: nn.Module) -> tuple[Tensor, Tensor | None]:
    """``(weight (V, H), bias (V,) or None)`` of a causal LM's output head, checked to be a plain
    readable projection (a LoRA adapter on ``lm_head`` must be merged first; see
    :func:`ringft.loss.output_projection`)."""
    head = output_projection(model)
    return head.weight, getattr(head, "bias", None)


def _check(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_size: int) -> None:
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be (tokens, H) and targets (tokens,), got {tuple(hidden.shape)} and "
            f"{tuple(targets.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be (vocab, {hidden.shape[1]}), got {tuple(weight.shape)}")
    as_integer("chunk_size", chunk_size, 1)
    if targets.numel() and not (0 <= int(targets.min()) and int(targets.max()) < weight.shape[0]):
        raise ValueError(f"targets must be token ids in [0, {weight.shape[0]})")


@torch.no_grad()
def token_nll(
    hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None, chunk_size: int = 4096
) -> Tensor:
    """``-log p(targets[t] | hidden[t])`` for each token: ``hidden (tokens, H)`` final hidden states,
    ``targets (tokens,)`` the next token ids; returns ``(tokens,)`` fp32 (fp64 for fp64 input)."""
    _check(hidden, weight, targets, chunk_size)
    targets = targets.to(device=hidden.device, dtype=torch.long)
    w, b = weight.to(hidden.dtype), bias.to(hidden.dtype) if bias is not None else None
    out = torch.empty(hidden.shape[0], dtype=accumulator_dtype(hidden.dtype), device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_size):
        stop = start + chunk_size
        logits = chunk_logits(hidden[start:stop], w, b)  # (c, V) fp32
        target_logit = logits.gather(1, targets[start:stop, None]).squeeze(1)
        out[start:stop] = torch.logsumexp(logits, dim=-1) - target_logit
        del logits
    return out


@dataclass(frozen=True)
class TokenComparison:
    """Per-token comparison of model ``a`` (the reference, e.g. the base model) with model ``b``,
    each ``(tokens,)``: ``nll_a`` / ``nll_b`` the NLL of the target, ``kl`` = KL(p_a || p_b) in
    nats, ``agree`` whether both models' most likely next token is the same."""

    nll_a: Tensor
    nll_b: Tensor
    kl: Tensor
    agree: Tensor


@torch.no_grad()
def compare_next_token(
    hidden_a: Tensor,
    weight_a: Tensor,
    hidden_b: Tensor,
    weight_b: Tensor,
    targets: Tensor,
    *,
    bias_a: Tensor | None = None,
    bias_b: Tensor | None = None,
    chunk_size: int = 1024,
) -> TokenComparison:
    """Two models' next-token distributions at the same positions, ``chunk_size`` tokens at a time.

    ``hidden_a``/``hidden_b`` ``(tokens, H_a)``/``(tokens, H_b)`` are each model's final hidden
    states over the same token ids, ``weight_*`` its head ``(V, H_*)`` (one vocabulary),
    ``targets (tokens,)`` the next ids. KL(p_a || p_b) = sum_v p_a(v) (log p_a(v) - log p_b(v)),
    computed from fp32 log-softmax (fp64 for fp64 input) and clamped at 0 (round-off can make a
    near-zero sum slightly negative).
    """
    _check(hidden_a, weight_a, targets, chunk_size)
    _check(hidden_b, weight_b, targets, chunk_size)
    if weight_a.shape[0] != weight_b.shape[0]:
        raise ValueError(f"the models' vocabularies differ: {weight_a.shape[0]} vs {weight_b.shape[0]}")
    targets = targets.to(device=hidden_a.device, dtype=torch.long)
    wa, ba = weight_a.to(hidden_a.dtype), bias_a.to(hidden_a.dtype) if bias_a is not None else None
    wb, bb = weight_b.to(hidden_b.dtype), bias_b.to(hidden_b.dtype) if bias_b is not None else None
    parts: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []
    for start in range(0, targets.numel(), chunk_size):
        stop = start + chunk_size
        logp_a = torch.log_softmax(chunk_logits(hidden_a[start:stop], wa, ba), dim=-1)
        logp_b = torch.log_softmax(chunk_logits(hidden_b[start:stop], wb, bb).to(logp_a.dtype), dim=-1)
        y = targets[start:stop, None]
        kl = (logp_a.exp() * (logp_a - logp_b)).sum(-1).clamp_min(0)
        agree = logp_a.argmax(-1) == logp_b.argmax(-1)
        parts.append((-logp_a.gather(1, y).squeeze(1), -logp_b.gather(1, y).squeeze(1), kl, agree))
        del logp_a, logp_b
    if not parts:
        empty = hidden_a.new_zeros(0, dtype=accumulator_dtype(hidden_a.dtype))
        return TokenComparison(empty, empty, empty, empty.bool())
    return TokenComparison(*(torch.cat(column) for column in zip(*parts, strict=True)))
