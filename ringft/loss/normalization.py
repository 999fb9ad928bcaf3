"""Loss normalisation over data parallelism, context parallelism and gradient accumulation.

One optimizer step of the one-process computation minimises ``sum of token losses / N`` with ``N``
the valid targets of the *whole* step: every DP replica, every CP rank, every micro-step. Each rank
therefore computes its share ``sum of its token losses / N`` on every micro-step; the shares of the
whole step add up to the mean token loss. Gradients:

- CP ranks of a replica hold partial gradients of the same replica: they are *summed*;
- DDP (and DeepSpeed) *average* gradients over the world, so each share is multiplied by the world
  size before ``backward`` to turn that average back into the sum;
- micro-steps accumulate (sum) into ``.grad``.

So the update equals the one-process update on the same global batch, whatever the layout.
:func:`loss_normalization` gives both numbers; ringft's trainer and a hand-written loop use it the
same way (README, "Use it in your own loop").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["LossNormalization", "count_valid_targets", "loss_normalization"]


def count_valid_targets(shift_labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Number of targets that are not ``ignore_index`` in ``shift_labels`` (any shape, e.g. a
    rank's zigzag shard ``(batch, seq_local)``), as an int64 0-d tensor on the labels' device.

    Zero for a micro-batch without any valid target (never rounded up to 1).
    """
    return (shift_labels != ignore_index).sum(dtype=torch.int64)


class LossNormalization(NamedTuple):
    """The two numbers of one optimizer step (see the module docstring).

    ``num_items_in_batch``: int64 0-d tensor, the valid targets of the whole step over every rank
    of ``group`` and every micro-step (at least 1: a step without any target has loss 0, not NaN);
    pass it to the loss of every micro-step. ``loss_scale``: multiply each micro-step's loss by it
    before ``backward`` (the world size when gradients are averaged over it, else 1).
    """

    num_items_in_batch: Tensor
    loss_scale: int


def loss_normalization(
    shift_labels: Tensor | Sequence[Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    gradients_averaged: bool = True,
    ignore_index: int = -100,
) -> LossNormalization:
    """Denominator and loss scale of one optimizer step (one collective: an int64 all-reduce).

    Args:
        shift_labels: this rank's pre-shifted labels, one ``(batch, seq_local)`` tensor per
            micro-step of the step (or one tensor). With CP these are the rank's zigzag shards:
            the shards of a replica add up to the replica's count, so summing over every rank
            counts each target exactly once.
        group: the ranks whose targets make up the step (every DP and CP rank; default: the whole
            world). Every rank of it must call this with its own labels. Without an initialised
            process group the local count is returned.
        gradients_averaged: True when the gradient reduction averages over ``group`` (DDP,
            DeepSpeed); False when the caller sums the gradients itself (e.g. an all-reduce SUM
            over a CP group, as in README's own loop).
        ignore_index: label value that carries no target.

    Returns:
        :class:`LossNormalization` ``(num_items_in_batch, loss_scale)``.
    """
    tensors = [shift_labels] if isinstance(shift_labels, Tensor) else list(shift_labels)
    if not tensors:
        raise ValueError("loss_normalization needs the labels of at least one micro-step")
    count = sum(
        (count_valid_targets(t, ignore_index) for t in tensors),
        torch.zeros((), dtype=torch.int64, device=tensors[0].device),
    )
    world = 1
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size(group)
        if world > 1:
            count = count.clone()
            dist.all_reduce(count, group=group)
    return LossNormalization(count.clamp_min(1), world if gradients_averaged else 1)
