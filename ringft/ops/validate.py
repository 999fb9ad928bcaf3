"""Raise one input error on every rank of a group, before any ring traffic can hang.

Each rank contributes whether its own inputs are unusable and a few integer facts (shapes, dtype
codes) that must agree across the group; one small all_gather exchanges them, and every rank raises
the same kind of ``ValueError`` (its own problems, or a pointer to the ranks that have them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["DTYPE_CODES", "raise_on_every_rank"]

# Integer codes for exchanging dtypes in an int64 all_gather (0: anything else).
DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}


def raise_on_every_rank(
    where: str,
    problems: list[str],
    facts: tuple[int, ...],
    fact_names: str,
    hint: str,
    *,
    group: dist.ProcessGroup | None,
    rank: int,
    size: int,
    device: torch.device,
    extra: tuple[int, ...] = (),
) -> list[tuple[int, ...]]:
    """Raise ``ValueError("<where>: ...")`` on every rank when any rank has ``problems`` or the
    ranks' ``facts`` differ; otherwise return every rank's ``extra`` values (in rank order).

    ``facts`` and ``extra`` must have the same length on every rank; ``fact_names`` describes the
    facts in the message (e.g. ``"(batch, seq_local)"``) and ``hint`` says how to make them agree;
    ``extra`` rides along without having to agree. One all_gather of ``1 + len(facts) + len(extra)``
    int64 per rank, and one host sync, when ``size > 1``; none otherwise.
    """
    if size == 1:
        if problems:
            raise ValueError(f"{where}: " + "; ".join(problems))
        return [tuple(extra)]
    split = 1 + len(facts)
    meta = [1 if problems else 0, *facts, *extra]
    on_device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor(meta, dtype=torch.int64, device=on_device)
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
    if not bad and len({tuple(row[1:split]) for row in rows}) > 1:
        desc = ", ".join(f"rank {i}: {fact_names}={tuple(row[1:split])}" for i, row in enumerate(rows))
        messages.append(f"{hint}; got {desc}")
    if messages:
        raise ValueError(f"{where}: " + " | ".join(messages))
    return [tuple(row[split:]) for row in rows]
