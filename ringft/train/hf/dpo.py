"""``RingDPOTrainer``: TRL's ``DPOTrainer`` with exact zigzag ring attention (CP) x DP.

::

    trainer = RingDPOTrainer(model=model, args=DPOConfig(...), train_dataset=pairs, cp_size=4)

Each pair's ``prompt + chosen`` and ``prompt + rejected`` rows (TRL's ``DataCollatorForPreference``:
right padding) are scored on the ring by the policy and the reference model
(:mod:`ringft.train.hf.fused`); TRL's ``_compute_loss`` then runs unchanged on the whole per-token
log-probabilities, so every loss type, ``loss_weights``, ``f_divergence_type``, ``ld_alpha``,
``use_weighting`` and the logged metrics (``rewards/*``, ``logps/*``, ``logits/*``, ``entropy``,
``mean_token_accuracy``, ``num_tokens``) are the one-process ones. ``precompute_ref_log_probs``
runs on the ring too, once the ring is set up (TRL computes it inside its ``__init__``: it is
deferred to the end of the construction).

Refused at construction (one line each): ``compute_metrics`` (the logits), vision datasets,
MoE router auxiliary losses, prompt-learning PEFT (virtual tokens prepended to every shard).
"""

from __future__ import annotations

from typing import Any

from trl import DPOTrainer

from ringft.train.hf.checks import WHERE, scoring_problems
from ringft.train.hf.data import shard_loader_over_dp
from ringft.train.hf.trl_ring import RingScoringMixin

__all__ = ["RingDPOTrainer"]


def _dpo_problems(trainer: Any) -> list[str]:
    problems = []
    if trainer.compute_metrics is not None:
        problems.append("compute_metrics needs the full logits, which the ring never builds: drop it")
    if getattr(trainer, "_is_vision_dataset", False):
        problems.append("vision datasets (images) cannot be sharded for the ring: use text pairs")
    return problems + scoring_problems(trainer)


class RingDPOTrainer(RingScoringMixin, DPOTrainer):
    """TRL's ``DPOTrainer`` on the ring: the keywords of :class:`ringft.RingTrainerMixin`
    (``cp_size``, ``ulysses_size``, ``attn_backend``, ...), every other argument TRL's."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._ring_deferred: list[tuple[str, int]] | None = []
        super().__init__(*args, **kwargs)
        deferred, self._ring_deferred = self._ring_deferred, None
        if self._ring is not None:
            problems = _dpo_problems(self)
            if problems:
                raise ValueError(f"{WHERE}: " + "; ".join(problems))
        for name, batch_size in deferred:
            self._ring_precompute_split(name, batch_size)
        if deferred and self.is_fsdp_enabled and kwargs.get("ref_model") is None:
            self.ref_model = None  # TRL's own order: the precompute's reference model is freed

    def _ring_precompute_split(self, name: str, batch_size: int) -> None:
        if name == "train":
            self.train_dataset = self._precompute_ref_logps(self.train_dataset, name, batch_size)
        elif isinstance(self.eval_dataset, dict):
            self.eval_dataset[name] = self._precompute_ref_logps(self.eval_dataset[name], name, batch_size)
        else:
            self.eval_dataset = self._precompute_ref_logps(self.eval_dataset, name, batch_size)

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        """TRL's reference log-prob precompute, on the ring: batches per DP replica (whole on each
        CP rank), the reference forwards on the ring, the results gathered over DP."""
        if self._ring_deferred is not None:  # inside TRL's __init__: the ring is not set up yet
            self._ring_deferred.append((name, batch_size))
            return dataset
        if self._ring is None:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        accelerator, layout = self.accelerator, self._ring.layout

        def prepare_per_replica(loader: Any) -> Any:
            prepared = type(accelerator).prepare(accelerator, loader)
            collate = getattr(prepared, "base_dataloader", prepared).collate_fn
            return shard_loader_over_dp(prepared, layout, collate, f"{name} (reference log-probs)")

        accelerator.prepare = prepare_per_replica
        try:
            with self._ring_gathers():
                out = super()._precompute_ref_logps(dataset, name, batch_size)
        finally:
            del accelerator.prepare
        return out
