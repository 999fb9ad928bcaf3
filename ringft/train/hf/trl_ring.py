"""What TRL's sequence-scoring trainers (``DPOTrainer``, ``GRPOTrainer``) need from the ring on top of
:class:`~ringft.train.hf.RingTrainerMixin`: :class:`RingScoringMixin`.

The SFT mixin shards every batch in the collator and computes the loss itself. The DPO / GRPO
trainers keep TRL's loss code instead: their batches stay whole on every CP rank of a replica
(dataloaders read per DP replica, nothing is sharded in the collator), the model call with
``fused_lm_head=True`` runs on the ring and returns whole per-token fields
(:mod:`ringft.train.hf.fused`), and TRL computes its loss and metrics from them as one process
does. TRL gathers its metrics with ``accelerator.gather`` / ``gather_for_metrics``, over every
process: the CP ranks of a replica hold the same values, so during the trainer's own calls those
gather over the DP group only (:func:`dp_gathers`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ringft.ops.parallel import ParallelLayout
from ringft.train.hf.data import _apply, gather_over_dp
from ringft.train.hf.fused import install_ring_fused_head, unwrap_engine
from ringft.train.hf.mixin import RingTrainerMixin

__all__ = ["RingScoringMixin", "dp_gathers", "reduce_over_dp"]


def _gather_dp(data: Any, layout: ParallelLayout) -> Any:
    return gather_over_dp(data, layout, gradient_state=None)


def reduce_over_dp(data: Any, layout: ParallelLayout, reduction: str = "sum", scale: float = 1.0) -> Any:
    """``accelerator.reduce`` over the DP group only (tensors, nested in lists / tuples / dicts)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        on = (
            t.detach().clone()
            if t.device.type == "cpu" or dist.get_backend(layout.dp_group) == "nccl"
            else t.cpu()
        )
        if layout.dp_size > 1:
            dist.all_reduce(on, group=layout.dp_group)
        if reduction == "mean":
            on = on / layout.dp_size
        return (on * scale).to(t.device)

    return _apply(one, data)


@contextlib.contextmanager
def dp_gathers(accelerator: Any, layout: ParallelLayout) -> Iterator[None]:
    """``accelerator.gather`` / ``gather_for_metrics`` / ``reduce`` over the DP group only, for the
    duration (instance attributes shadowing the methods; removed after; re-entrant)."""
    if "gather_for_metrics" in vars(accelerator):
        yield
        return
    accelerator.gather = functools.partial(_gather_dp, layout=layout)
    accelerator.reduce = functools.partial(reduce_over_dp, layout=layout)
    accelerator.gather_for_metrics = lambda data, *a, **k: gather_over_dp(
        data, layout, accelerator.gradient_state
    )
    try:
        yield
    finally:
        del accelerator.gather, accelerator.gather_for_metrics, accelerator.reduce


class RingScoringMixin(RingTrainerMixin):
    """:class:`RingTrainerMixin` for trainers whose loss TRL computes from the fused LM head's
    per-token fields (DPO, GRPO): the same keywords (``cp_size``, ``ulysses_size``,
    ``attn_backend``, ...); see the module docstring for what differs from SFT."""

    _ring_keeps_trl_loss = True  # checks.py: TRL's loss_type is TRL's to run

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self._ring is None:
            return
        # TRL divides its per-micro-batch mean loss by the accumulation steps (the class default)
        self.__dict__.pop("loss_is_scaled_for_ga", None)
        for model in self._ring_models():
            self._ring_install(model)

    # -- models ----------------------------------------------------------------------------------
    def _ring_models(self) -> list[torch.nn.Module]:
        """The models TRL scores with (the policy, and the reference model when there is one)."""
        return [m for m in (self.model, getattr(self, "ref_model", None)) if m is not None]

    def _ring_install(self, model: torch.nn.Module) -> None:
        from ringft.model.patch import apply_ring_attention

        ring = self._ring
        apply_ring_attention(unwrap_engine(model), ring.layout, self._attn_backend)
        install_ring_fused_head(model, ring.layout, ring.pad_token_id)

    # -- data ------------------------------------------------------------------------------------
    def _ring_collate(self, loader: Any, is_training: bool) -> Any:
        """The Trainer's own collate function: whole batches on every CP rank, nothing sharded."""
        return getattr(loader, "base_dataloader", loader).collate_fn

    def _ring_gathers(self) -> Any:
        return (
            contextlib.nullcontext()
            if self._ring is None
            else dp_gathers(self.accelerator, self._ring.layout)
        )

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        with self._ring_gathers():
            return super(RingTrainerMixin, self)._get_num_items_in_batch(batch_samples, device)

    def _track_num_input_tokens(self, inputs: dict) -> None:
        with self._ring_gathers():
            return super(RingTrainerMixin, self)._track_num_input_tokens(inputs)

    # -- loss and evaluation -----------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss, its model calls on the ring, its metrics gathered over DP."""
        if self._ring is not None and return_outputs:
            raise NotImplementedError(
                "ringft.RingTrainerMixin: compute_loss(return_outputs=True) would need the full logits "
                "(compute_metrics): drop compute_metrics"
            )
        with self._ring_gathers():
            return super(RingTrainerMixin, self).compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if self._ring is not None and not prediction_loss_only:
            raise ValueError(
                "ringft.RingTrainerMixin: evaluation with logits (compute_metrics or prediction_loss_only="
                "False) needs the full logits: evaluate the loss only"
            )
        with self._ring_gathers():
            return super(RingTrainerMixin, self).prediction_step(
                model, inputs, prediction_loss_only, ignore_keys=ignore_keys
            )
