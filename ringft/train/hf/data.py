"""Data for a ring trainer: dataloaders over the DP group, batches sharded per CP rank, metrics
gathered across DP only.

``Trainer`` prepares its dataloaders with ``accelerator.prepare``, which shards the batches over
*every* process. With ``world = dp x cp`` the CP ranks of a replica must instead read the same
batches: :func:`shard_loader_over_dp` re-points accelerate's ``BatchSamplerShard`` at the DP group
(``num_processes = dp``, ``process_index = dp_rank``: rank ``dp_rank * cp + cp_rank`` reads what
process ``dp_rank`` of a ``dp``-process run reads; with ``dp = 1``, what one process reads, whose
last batch accelerate does not fill up with repeated samples) and
wraps the loader's ``collate_fn`` in :class:`RingCollate`, which shards each collated batch for
this CP rank. accelerate's epoch lengths, ``even_batches`` padding, ``skip_first_batches`` (resume)
and ``gather_for_metrics`` remainder all read the patched sampler, so they count DP replicas.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ringft.data.hf_batch import BatchRefused, shard_collated_batch
from ringft.ops.parallel import ParallelLayout

__all__ = ["RING_PROBLEM", "RingCollate", "gather_over_dp", "shard_loader_over_dp"]

RING_PROBLEM = "ring_problem"  # a refused batch: the message, raised on every rank by the step


class RingCollate:
    """``collate_fn`` wrapper: the user's collator, then :func:`shard_collated_batch` for this rank
    (zigzag, or with ``ulysses_size`` the Ulysses x ring layout).

    A refused batch becomes ``{RING_PROBLEM: message}`` instead of raising here (a dataloader
    worker, one DP replica): the trainer exchanges the verdict with every rank before any collective
    of the step and raises everywhere. Picklable (dataloader workers), no process group inside.
    """

    def __init__(
        self,
        inner: Any,
        cp_rank: int,
        cp_size: int,
        pad_token_id: int,
        keep_labels: bool,
        count_pad_token_id: int | None,
        ulysses_size: int = 1,
    ):
        self.inner, self.cp_rank, self.cp_size = inner, cp_rank, cp_size
        self.ulysses_size = ulysses_size
        self.pad_token_id, self.keep_labels = pad_token_id, keep_labels
        self.count_pad_token_id = count_pad_token_id

    def __call__(self, examples: list[Any]) -> dict[str, Any]:
        """This CP rank's shard of ``inner(examples)`` (or the refusal)."""
        batch = self.inner(examples)
        try:
            return shard_collated_batch(
                batch,
                self.cp_rank,
                self.cp_size,
                self.pad_token_id,
                keep_labels=self.keep_labels,
                count_pad_token_id=self.count_pad_token_id,
                ulysses_size=self.ulysses_size,
            )
        except BatchRefused as exc:
            return {RING_PROBLEM: str(exc)}


def _batch_sampler_shards(loader: Any) -> list[Any]:
    from accelerate.data_loader import BatchSamplerShard

    found = [getattr(loader, name, None) for name in ("batch_sampler", "sampler")]
    return [s for s in found if isinstance(s, BatchSamplerShard)]


def shard_loader_over_dp(loader: Any, layout: ParallelLayout, collate: RingCollate, what: str) -> Any:
    """Make a prepared dataloader read per DP replica and shard per CP rank (idempotent).

    Raises ``ValueError`` for what the re-pointing cannot cover: an ``IterableDataset`` (accelerate
    dispatches its batches over every process) or a loader accelerate did not shard.
    """
    if getattr(loader, "_ringft_sharded", False):
        return loader
    if isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset):
        raise ValueError(
            f"{what} dataset is an IterableDataset: with cp_size > 1 the ring trainer needs a map-style "
            "dataset (with __len__; e.g. datasets.Dataset, not a streaming one) so that the CP ranks of a "
            "replica read the same batches"
        )
    shards = _batch_sampler_shards(loader)
    if layout.world_size > 1:
        if not shards:
            raise ValueError(
                f"the {what} dataloader was not sharded by accelerate (its batch sampler is a "
                f"{type(getattr(loader, 'batch_sampler', None)).__name__}, not a BatchSamplerShard; "
                f"{type(loader).__name__}, world {layout.world_size}): the ring "
                "trainer cannot place its batches on the DP replicas; use the Trainer's own dataloaders"
            )
        for shard in shards:
            if shard.split_batches:
                raise ValueError("accelerator_config.split_batches=True is not supported with cp_size > 1")
            shard.num_processes, shard.process_index = layout.dp_size, layout.dp_rank
            if layout.dp_size == 1:  # read exactly what one process reads: no duplicated last batch
                shard.even_batches = False
    # accelerate's DataLoaderShard wraps a torch DataLoader (``base_dataloader``) whose collate_fn the
    # iterator reads; the wrapper delegates attribute reads (skip_first_batches copies it) to it.
    getattr(loader, "base_dataloader", loader).collate_fn = collate
    loader._ringft_sharded = True
    return loader


def _gather_tensor(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    x = x.contiguous()
    if x.dim() == 0:
        x = x[None]
    on = x if dist.get_backend(group) == "nccl" or x.device.type == "cpu" else x.cpu()
    pieces = [torch.empty_like(on) for _ in range(size)]
    dist.all_gather(pieces, on, group=group)
    return torch.cat(pieces).to(x.device)


def _apply(fn, data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, (list, tuple)):
        return type(data)(_apply(fn, d) for d in data)
    if isinstance(data, dict):
        return type(data)({k: _apply(fn, v) for k, v in data.items()})
    return data


def gather_over_dp(data: Any, layout: ParallelLayout, gradient_state: Any) -> Any:
    """``accelerator.gather_for_metrics`` over the DP group only (each CP group holds one copy).

    Tensors (nested in lists / tuples / dicts) are concatenated along dim 0 in DP-rank order; at the
    end of a dataloader the duplicated samples of accelerate's ``even_batches`` are dropped with the
    same remainder accelerate computes (from the DP-sharded sampler).
    """
    if layout.dp_size > 1:
        data = _apply(lambda t: _gather_tensor(t, layout.dp_group, layout.dp_size), data)
    remainder = getattr(gradient_state, "remainder", -1)
    if getattr(gradient_state, "end_of_dataloader", False) and remainder > 0:
        data = _apply(lambda t: t[:remainder], data)
    return data
