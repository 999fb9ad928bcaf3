"""Per-token NLL on the CP ring, through the chunked LM head (never ``model(...).logits``).

:func:`ring_token_nll`: one ring forward (:meth:`ringft.model.inference.RingInference.hidden_states`,
no KV cache) gives each rank the final hidden states of its zigzag shard; each rank takes the NLL of
its own targets with :func:`ringft.loss.token_nll` (``--chunk-size`` tokens of logits at a time)
and one all-reduce of a ``(tokens - 1,)`` fp64 vector puts every token's NLL on every rank.
:func:`sliding_token_nll` is the same limited to a window (a model's native context), and
:func:`ring_compare` two models' next-token distributions on the same ids (KL, top-1 agreement).
:func:`log_bins` / :func:`binned_sums` / :func:`prefix_sums` reduce the per-token vector for the
records.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringft.loss import compare_next_token, head_parameters, token_nll


def _sum_over_group(x: torch.Tensor, engine: Any) -> torch.Tensor:
    if engine.size > 1:
        dist.all_reduce(x, group=engine.group)
    return x


def _local_targets(ids: Sequence[int], pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's positions that have a next token ``(k,)`` and those next tokens ``(k,)``."""
    where = pos < len(ids) - 1  # the last token and the padding predict nothing
    local = pos[where]
    targets = torch.as_tensor(ids, dtype=torch.long, device=pos.device)[local + 1]
    return where, targets


def ring_token_nll(engine: Any, ids: Sequence[int], chunk_size: int = 1024) -> torch.Tensor:
    """``-log p(ids[t + 1] | ids[: t + 1])`` for ``t = 0 .. len(ids) - 2``: ``(len(ids) - 1,)``
    fp64 on the CPU, the same on every rank of ``engine``'s CP group (every rank must call it)."""
    if len(ids) < 2:
        raise ValueError("a document needs at least 2 tokens for a next-token NLL")
    hidden, pos = engine.hidden_states(list(ids))
    where, targets = _local_targets(ids, pos)
    weight, bias = head_parameters(engine.model)
    nll = token_nll(hidden[where], weight, targets, bias=bias, chunk_size=chunk_size)
    out = torch.zeros(len(ids) - 1, dtype=torch.float64, device=hidden.device)
    out[pos[where]] = nll.double()
    return _sum_over_group(out, engine).cpu()


def window_starts(length: int, window: int, stride: int) -> list[int]:
    """First token of each window of a sliding evaluation of ``length`` tokens (the last window
    ends at ``length``)."""
    starts = [0]
    while starts[-1] + window < length:
        starts.append(starts[-1] + stride)
    return starts


def sliding_token_nll(
    engine: Any, ids: Sequence[int], window: int, stride: int, chunk_size: int = 1024
) -> torch.Tensor:
    """Per-token NLL as :func:`ring_token_nll`, the model seeing at most ``window`` tokens: windows
    ``[s, s + window)`` for ``s = 0, stride, 2 stride, ...``, each one ring forward with positions
    from 0; the first window scores all its tokens, each later one only the tokens past the previous
    window's end, so a token after the first window has ``window - stride`` to ``window - 1`` tokens
    of context (``stride < window``). One window (the full evaluation) when ``window >= len(ids)``."""
    if not 0 < stride < window:
        raise ValueError(f"stride must be in [1, window), got stride {stride} and window {window}")
    out = torch.zeros(len(ids) - 1, dtype=torch.float64)
    scored = 0  # tokens 1 .. scored - 1 have their NLL
    for begin in window_starts(len(ids), window, stride):
        end = min(begin + window, len(ids))
        part = ring_token_nll(engine, ids[begin:end], chunk_size)  # tokens begin + 1 .. end - 1
        first = max(scored, begin + 1)
        out[first - 1 : end - 1] = part[first - begin - 1 :]
        scored = end
    return out


def ring_compare(reference: Any, other: Any, ids: Sequence[int], chunk_size: int = 1024) -> dict[str, float]:
    """Two models on the same ids (one ring forward each): sums over the ``len(ids) - 1`` targets
    of the reference's and the other model's NLL, KL(p_reference || p_other) and top-1 agreements,
    and the count; the same on every rank."""
    hidden_a, pos = reference.hidden_states(list(ids))
    hidden_b, pos_b = other.hidden_states(list(ids))
    if not torch.equal(pos, pos_b):
        raise RuntimeError("the two models' ring shards differ")
    where, targets = _local_targets(ids, pos)
    (wa, ba), (wb, bb) = head_parameters(reference.model), head_parameters(other.model)
    cmp = compare_next_token(
        hidden_a[where], wa, hidden_b[where], wb, targets, bias_a=ba, bias_b=bb, chunk_size=chunk_size
    )
    sums = torch.stack(
        [
            cmp.nll_a.double().sum(),
            cmp.nll_b.double().sum(),
            cmp.kl.double().sum(),
            cmp.agree.double().sum(),
            torch.tensor(float(targets.numel()), dtype=torch.float64, device=targets.device),
        ]
    )
    values = _sum_over_group(sums, reference).tolist()
    return dict(zip(("nll_reference", "nll_model", "kl", "top1_agree", "targets"), values, strict=True))


def log_bins(length: int, per_octave: int = 2) -> list[tuple[int, int]]:
    """Half-open bins ``[start, end)`` of predicted-token positions ``1 .. length - 1``, log-spaced
    (``per_octave`` edges per doubling, rounded and de-duplicated)."""
    top = max(1, math.ceil(per_octave * math.log2(max(length, 2))))
    edges = sorted({min(length, max(1, round(2 ** (k / per_octave)))) for k in range(top + 1)} | {length})
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]


def binned_sums(nll: torch.Tensor, bins: Sequence[tuple[int, int]]) -> list[list[float]]:
    """``[start, end, sum of NLL, tokens]`` per bin; ``nll[t]`` is the NLL of token ``t + 1``."""
    return [[a, b, float(nll[a - 1 : b - 1].sum()), b - a] for a, b in bins]


def prefix_sums(nll: torch.Tensor, lengths: Sequence[int]) -> dict[str, float]:
    """``{str(L): sum of the NLL of tokens 1 .. L - 1}``: the first L tokens' ``L - 1`` targets."""
    return {str(n): float(nll[: n - 1].sum()) for n in lengths}
