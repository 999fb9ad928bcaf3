"""The ring operator's input checks: what is wrong with one rank's q, k, v and options, and the
one exchange that makes every rank of the CP group raise the same error before any ring traffic."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ringft.ops.backends import BACKENDS
from ringft.ops.documents import DocumentLayout, check_cu_seqlens
from ringft.ops.latent import block_kernel
from ringft.ops.sharding import local_length_problem
from ringft.ops.sinks import sink_problems
from ringft.ops.tiles import tile_tokens_problem
from ringft.ops.validate import DTYPE_CODES, checksum, exchange_facts, raise_if_facts_differ, raise_problems
from ringft.ops.windows import window_problems

Tensor = torch.Tensor

__all__ = [
    "local_input_problems",
    "offsets_checksum",
    "rank_problems",
    "validate_inputs",
]


def local_input_problems(q: Tensor, k: Tensor, v: Tensor, backend: str, cp_size: int = 1) -> list[str]:
    """What is wrong with this rank's q ``(B, S_local, Hq, D)`` and k/v ``(B, S_local, Hkv, D)``
    (one of ``cp_size`` ranks) on their own (no communication, no host sync): one message per
    problem, each naming the fix."""
    problems = []
    if backend not in BACKENDS:
        return [f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}"]
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return [
            "q, k and v must be 4-D (batch, seq_local, heads, head_dim); got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        ]
    if k.shape[:3] != v.shape[:3]:  # (v's head dim may differ: latent attention)
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
    if q.dtype not in DTYPE_CODES:
        problems.append(f"unsupported dtype {q.dtype}: use fp32, bf16, fp16 or fp64")
    length = local_length_problem(sq, cp_size)
    if length:
        problems.append(length)
    if not problems:
        reason = block_kernel(backend, q, v, None).check(q)
        if reason:
            problems.append(reason)
    return problems


def _window_problems(sliding_window, causal: bool, tile_tokens=None) -> list[str]:
    problems = window_problems(sliding_window)
    if sliding_window is not None and not causal:
        problems.append("sliding_window needs causal=True (a window looks back only): drop one of them")
    tile = tile_tokens_problem(tile_tokens)
    return problems + ([tile] if tile else [])


def _document_problems(q: Tensor, cu_seqlens, causal: bool, rank: int, size: int) -> list[str]:
    if cu_seqlens is None:
        return []
    if not causal:
        return ["cu_seqlens (packed documents) needs causal=True"]
    if q.dim() != 4:
        return []
    if isinstance(cu_seqlens, DocumentLayout):
        layout = cu_seqlens
        built = (layout.rank, layout.cp_size, len(layout.rows), layout.rows[0].diagonal[-1])
        if built != (rank, size, *q.shape[:2]):
            return [
                f"the DocumentLayout was built for rank {layout.rank} of {layout.cp_size} and another shape"
            ]
        return []
    return check_cu_seqlens(cu_seqlens, q.shape[1] * size, q.shape[0])


def offsets_checksum(cu_seqlens) -> int:
    """A fingerprint of per-row global document offsets for the ranks' agreement check (0 for none
    or a prebuilt DocumentLayout, which is checked against this rank instead)."""
    if cu_seqlens is None or isinstance(cu_seqlens, DocumentLayout):
        return 0
    return checksum([list(map(int, row)) for row in cu_seqlens])


def rank_problems(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    backend: str,
    rank: int,
    size: int,
    *,
    cu_seqlens: Sequence[Sequence[int]] | DocumentLayout | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    attention_tile_tokens: int | None = None,
    sinks: Tensor | None = None,
) -> list[str]:
    """Every problem of rank ``rank``'s (of ``size``) inputs and options, found without communication."""
    problems = local_input_problems(q, k, v, backend, size)
    problems += _document_problems(q, cu_seqlens, causal, rank, size)
    problems += _window_problems(sliding_window, causal, attention_tile_tokens)
    return problems + sink_problems(sinks, q)


def validate_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    backend: str,
    group,
    rank: int,
    size: int,
    *,
    cu_seqlens: Sequence[Sequence[int]] | DocumentLayout | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    attention_tile_tokens: int | None = None,
    sinks: Tensor | None = None,
) -> None:
    """Raise the same ``ValueError`` on every rank when any rank's inputs are unusable.

    Local problems and every rank's shape/dtype (document offsets' checksum, sliding window) are
    exchanged in one small all_gather before any ring traffic, so a bad input on one rank never
    leaves the others waiting in a send/recv.
    """
    problems = rank_problems(
        q, k, v, backend, rank, size, cu_seqlens=cu_seqlens, causal=causal, sliding_window=sliding_window,
        attention_tile_tokens=attention_tile_tokens, sinks=sinks,
    )  # fmt: skip
    shape = (*q.shape, k.shape[2]) if q.dim() == 4 and k.dim() == 4 else (-1,) * 5
    window = sliding_window if isinstance(sliding_window, int) and not problems else 0
    facts = (*shape, DTYPE_CODES.get(q.dtype, 0), offsets_checksum(cu_seqlens), window)
    rows = exchange_facts((int(bool(problems)),), facts, group=group, device=q.device)
    where = "zigzag_ring_attention"
    raise_problems(where, problems, [bool(bad) for (bad,), _ in rows], rank)
    raise_if_facts_differ(
        where,
        [theirs for _, theirs in rows],
        "(batch, seq_local, heads, dim, kv_heads, dtype, cu_seqlens checksum, sliding_window)",
        "all CP ranks must pass the same batch, seq_local (S / cp_size), heads, head_dim, dtype, "
        "cu_seqlens and sliding_window. Shard every sequence with cp_shard / RingDataCollator",
    )
