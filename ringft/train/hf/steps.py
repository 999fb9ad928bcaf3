"""One optimizer step's denominator, loss scale and token counters, with refused batches raised
on every rank: one int64 all-reduce over the world per optimizer step.

Each rank holds the zigzag shards of its replica's micro-batches, so its count of valid targets
is a share: summed over a CP group it is the replica's count, summed over the world the step's.
transformers' semantics, kept exactly (with ``world = dp x cp`` in place of ``dp``):

- ``average_tokens_across_devices=True``: every rank divides by the step's count over the world
  and multiplies its loss by the world size, which DDP / DeepSpeed / FSDP average away again; the
  update is the one-process update on the step's global batch (``ringft.loss.loss_normalization``);
- ``False``: each replica divides by its own count (over its CP group) and the loss is multiplied by
  ``cp``, so that averaging the gradients over the world averages the replicas' mean losses, as DDP
  does for ``dp`` processes.

The same all-reduce carries a flag per refused batch (so a bad batch on one replica stops every
rank before the ring or DDP can wait on it) and the batches' token counts (``num_input_tokens_seen``,
TRL's ``num_tokens``), contributed once per replica by CP rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ringft.data.hf_batch import RING_COUNTS
from ringft.ops.parallel import ParallelLayout
from ringft.train.hf.data import RING_PROBLEM

__all__ = ["StepCounts", "exchange_step_counts", "loss_scale"]

IGNORE_INDEX = -100


@dataclass
class StepCounts:
    """What one exchange found: the denominator (int64 0-d tensor, at least 1) and, per batch, the
    tokens of the whole DP group ``(all, non-padding, TRL's)``."""

    num_items: torch.Tensor
    tokens: list[tuple[int, int, int]]


def loss_scale(layout: ParallelLayout, average_tokens_across_devices: bool) -> int:
    """The factor each rank's loss share is multiplied by (see the module docstring)."""
    return layout.world_size if average_tokens_across_devices else layout.cp_size


def _problem_message(batches: list[dict[str, Any]], need_labels: bool) -> str | None:
    for batch in batches:
        if RING_PROBLEM in batch:
            return batch[RING_PROBLEM]
        if need_labels and batch.get("shift_labels") is None:
            return (
                "the batch has no labels: training needs labels (e.g. DataCollatorForLanguageModeling("
                "tokenizer, mlm=False)) or shift_labels"
            )
    return None


def exchange_step_counts(
    batches: list[dict[str, Any]],
    layout: ParallelLayout,
    average_tokens_across_devices: bool,
    device: torch.device,
    where: str = "ring trainer",
    need_labels: bool = True,
) -> StepCounts:
    """Count this rank's valid targets in ``batches`` (its micro-batches of one step), exchange the
    counts, token counters and refusals over the world, and return the step's :class:`StepCounts`.

    Raises ``ValueError`` on every rank when any rank's batch was refused (or, with ``need_labels``,
    has no labels). Every rank must call this with the same number of batches.
    """
    dp = layout.dp_size
    problem = _problem_message(batches, need_labels)
    vec = torch.zeros(dp + 1 + 3 * len(batches), dtype=torch.int64)
    vec[dp] = 1 if problem else 0
    if problem is None:
        vec[layout.dp_rank] = sum(
            int((b["shift_labels"] != IGNORE_INDEX).sum())
            for b in batches
            if b.get("shift_labels") is not None
        )
        if layout.cp_rank == 0:
            for i, batch in enumerate(batches):
                vec[dp + 1 + 3 * i : dp + 4 + 3 * i] = torch.as_tensor(batch[RING_COUNTS]).cpu()
    if layout.world_size > 1:
        on = vec.to(device) if dist.get_backend() == "nccl" else vec
        dist.all_reduce(on)
        vec = on.cpu()
    if int(vec[dp]):
        mine = (
            f"this rank's batch: {problem}"
            if problem
            else "a batch on another rank was refused (see its error)"
        )
        raise ValueError(f"{where}: {mine}")
    count = vec[:dp].sum() if average_tokens_across_devices else vec[layout.dp_rank]
    tokens = [tuple(int(x) for x in vec[dp + 1 + 3 * i : dp + 4 + 3 * i]) for i in range(len(batches))]
    return StepCounts(count.clamp_min(1).to(device), tokens)
