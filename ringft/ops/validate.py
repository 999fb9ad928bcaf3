"""Make every rank fail together: one small exchange of integer facts, then the checks that read it.

Every rank calls :func:`exchange_facts` at the same point of its normal path (never inside
``except`` / ``finally``): one all_gather of a few int64 per rank. What each rank then raises is
decided from the same gathered rows, so no rank is left waiting in a later collective.

- The ring's input checks: :func:`raise_problems` (each rank raises its own problems, or a pointer
  to the ranks that have some) and :func:`raise_if_facts_differ` (facts that must agree: shapes,
  dtype codes, a checksum of the document offsets).
- A failure anywhere stops everyone: :func:`fail_together` / :func:`run_together` (the lowest
  failing rank raises its own error, every other rank :class:`PeerFailed`), as ``ringft train``
  and ``ringft eval-lines`` use between their steps.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "DTYPE_CODES",
    "PeerFailed",
    "checksum",
    "exchange_facts",
    "fail_together",
    "raise_if_facts_differ",
    "raise_problems",
    "run_together",
]

T = TypeVar("T")
Facts = tuple[tuple[int, ...], ...]

# Integer codes for exchanging dtypes in an int64 all_gather (0: anything else).
DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}


def checksum(value: Any) -> int:
    """A deterministic 32-bit fingerprint of plain data (e.g. per-row document offsets) for
    :func:`raise_if_facts_differ`; 0 for None."""
    return 0 if value is None else zlib.crc32(repr(value).encode())


def _group_rank_size(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def exchange_facts(*parts: Sequence[int], group=None, device: torch.device | None = None) -> list[Facts]:
    """Every rank's ``parts`` (tuples of ints), in rank order of ``group``.

    One all_gather of ``sum(len(p) for p in parts)`` int64 per rank and one host copy; nothing
    without a process group or with one rank. The parts must have the same lengths on every
    rank. Under NCCL the buffer sits on ``device`` (default: the current CUDA device).
    """
    flat = [int(x) for part in parts for x in part]
    _, size = _group_rank_size(group)
    if size == 1:
        rows = [flat]
    else:
        on = torch.device("cpu")
        if dist.get_backend(group) == "nccl":  # NCCL gathers CUDA tensors only
            on = device if device is not None and device.type == "cuda" else torch.device("cuda")
        mine = torch.tensor(flat, dtype=torch.int64, device=on)
        gathered = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(gathered, mine, group=group)
        rows = torch.stack(gathered).tolist()
    out = []
    for row in rows:
        split, at = [], 0
        for part in parts:
            split.append(tuple(row[at : at + len(part)]))
            at += len(part)
        out.append(tuple(split))
    return out


def raise_problems(where: str, problems: list[str], bad: Sequence[bool], rank: int) -> None:
    """``ValueError("<where>: ...")`` on every rank when any rank (``bad``, in rank order) has
    problems: a rank names its own ``problems`` and points at the other ranks that have some."""
    if len(bad) == 1:
        if problems:
            raise ValueError(f"{where}: " + "; ".join(problems))
        return
    messages = [f"rank {rank}: " + "; ".join(problems)] if problems else []
    others = [i for i, b in enumerate(bad) if b and i != rank]
    if others:
        messages.append(f"bad inputs on CP rank(s) {others} (see their error)")
    if messages:
        raise ValueError(f"{where}: " + " | ".join(messages))


def raise_if_facts_differ(where: str, facts: Sequence[tuple[int, ...]], names: str, hint: str) -> None:
    """``ValueError("<where>: <hint>; got rank 0: <names>=(...), ...")`` when the ranks' ``facts``
    (in rank order) are not all equal; ``names`` describes them, e.g. ``"(batch, seq_local)"``."""
    if len(set(facts)) > 1:
        desc = ", ".join(f"rank {i}: {names}={tuple(f)}" for i, f in enumerate(facts))
        raise ValueError(f"{where}: {hint}; got {desc}")


class PeerFailed(Exception):
    """Raised by :func:`fail_together` on every rank but the lowest failing one, which raises its
    own error: ``rank`` failed with ``exit_code`` (and ``message``, when it was shared)."""

    def __init__(self, rank: int, exit_code: int, message: str | None = None) -> None:
        super().__init__(message or f"another rank failed (rank {rank}, exit code {exit_code})")
        self.rank, self.exit_code, self.message = rank, exit_code, message


def _shared_text(text: str, src: int, group) -> str:
    box = [text]
    dist.broadcast_object_list(
        box, src=src if group is None else dist.get_global_rank(group, src), group=group
    )
    return box[0]


def fail_together(failure: BaseException | None, *, group=None, share_message: bool = False) -> None:
    """Stop every rank of ``group`` when any of them failed; call it on every rank at the same point.

    Each rank says whether it failed (``failure``; its exit code is ``failure.exit_code`` when the
    exception has one, else 1) in one :func:`exchange_facts`. If any did, the lowest failing rank
    raises its own ``failure`` and every other rank raises :class:`PeerFailed`, so the error is
    named once and nobody waits. ``share_message``: the peers' :class:`PeerFailed` also carries the
    failing rank's message (one more broadcast, on the failure path only).
    """
    code = 0 if failure is None else int(getattr(failure, "exit_code", 1) or 1)
    rows = exchange_facts((code,), group=group)
    failed = [i for i, ((c,),) in enumerate(rows) if c]
    if not failed:
        return
    first = failed[0]
    message = _shared_text(str(failure or ""), first, group) if share_message and len(rows) > 1 else None
    if failure is not None and _group_rank_size(group)[0] == first:
        raise failure
    raise PeerFailed(first, rows[first][0][0], message)


def run_together(
    action: Callable[[], T], *, here: bool = True, group=None, share_message: bool = False
) -> T | None:
    """Run ``action()`` on this rank (when ``here``), then :func:`fail_together` on every rank of
    ``group`` with what it raised; returns its value (None where it did not run)."""
    value, failure = None, None
    if here:
        try:
            value = action()
        except Exception as exc:  # noqa: BLE001 - raised again on this rank by fail_together
            failure = exc
    fail_together(failure, group=group, share_message=share_message)
    return value
