"""``RingTrainerMixin``: exact zigzag ring attention (CP) x DP inside ``transformers.Trainer`` and
TRL's ``SFTTrainer``.

::

    class RingSFTTrainer(RingTrainerMixin, SFTTrainer): pass
    trainer = RingSFTTrainer(model=model, args=SFTConfig(packing=True, ...), train_dataset=ds, cp_size=4)
    trainer.train()  # under `accelerate launch`: world = dp x cp, CP groups contiguous

What it changes in the base trainer (each override delegates to the base class when the ring is
off, so ``cp_size=1`` without memory options is the base class unchanged):

- ``__init__``: checks versions and options, builds ringft's DP x CP layout, CP = Ulysses x ring
  with ``ulysses_size`` (:func:`ringft.ops.build_layout`, as ``ringft train`` does),
  switches the model to the ring (:func:`ringft.apply_ring_attention`), installs the chunked-loss forward
  (:mod:`ringft.train.hf.forward`), the fused RMSNorm backward and, if asked, the tiled MLP;
- ``_get_dataloader``: every dataloader reads per DP replica and shards per CP rank
  (:mod:`ringft.train.hf.data`);
- ``get_cp_size``: the CP size, so the Trainer's total batch size counts DP replicas;
- ``_get_num_items_in_batch``: the step's denominator and loss scale, refused batches raised on
  every rank, token counters (:mod:`ringft.train.hf.steps`); ``_track_num_input_tokens`` reads them;
- ``training_step``: under DDP in one process (CPU), gradients reduced once per optimizer step;
- ``compute_loss``: ringft's chunked loss through the wrapped model, times the loss scale;
- ``_load_optimizer_and_scheduler``: under FSDP, the optimizer's state exists before a sharded
  checkpoint is loaded into it (:mod:`ringft.train.hf.fsdp_resume`);
- ``floating_point_ops``: the base class's estimate, the parameters counted once per run;
- ``prediction_step`` / ``evaluation_loop``: eval loss over the CP group, logits gathered within CP
  and put back in sequence order (:func:`ringft.ops.sharding.cp_gather`), metrics gathered
  across DP only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ringft.data.hf_batch import RING_LABELS, RING_LENGTH
from ringft.ops.parallel import ParallelLayout, build_layout
from ringft.ops.sharding import ulysses_size_problem
from ringft.ops.ulysses import heads_problem
from ringft.train.hf.checks import (
    WHERE,
    attention_checkpoint_problem,
    check_no_accelerate_cp,
    check_tiled_norm,
    check_trainer_options,
)
from ringft.train.hf.data import RingCollate, gather_over_dp, shard_loader_over_dp
from ringft.train.hf.forward import eval_loss_sum, install_ring_loss_forward, predict_logits, ring_loss
from ringft.train.hf.precision import configure_fsdp_precision
from ringft.train.hf.steps import exchange_step_counts, loss_scale
from ringft.train.hf.versions import check_versions
from ringft.utils.options import renamed_keyword
from ringft.utils.values import as_bool, as_integer, problems

__all__ = ["RingTrainerMixin"]

_TOKENS = (
    "ring_tokens_seen"  # per batch, set by the step's exchange: (all, non-padding, TRL's) of the DP group
)


@dataclass
class _Ring:
    """The ring settings of one trainer."""

    layout: ParallelLayout
    pad_token_id: int
    count_pad_token_id: int | None


def _uses_trl(cls: type) -> bool:
    return any(c.__module__.split(".")[0] == "trl" for c in cls.__mro__)


def _training_args(args: tuple, kwargs: dict) -> Any:
    return kwargs["args"] if "args" in kwargs else (args[1] if len(args) > 1 else None)


def _ulysses_problem(cp_size: int, ulysses_size: Any, args: tuple, kwargs: dict) -> str | None:
    """Why ``ulysses_size`` cannot split this trainer's CP group or its model's query heads."""
    bad = problems(functools.partial(as_integer, "ulysses_size", ulysses_size, 1))
    if bad:
        return bad[0]
    if ulysses_size == 1:
        return None
    problem = ulysses_size_problem(cp_size, ulysses_size)
    model = kwargs["model"] if "model" in kwargs else (args[0] if args else None)
    if problem is None and model is not None:
        from ringft.model.unwrap import pretrained_model

        heads = getattr(getattr(pretrained_model(model), "config", None), "num_attention_heads", None)
        problem = heads_problem(heads, ulysses_size, cp_size) if isinstance(heads, int) else None
    return problem


def _pad_ids(tokenizer: Any) -> tuple[int, int | None]:
    pad = getattr(tokenizer, "pad_token_id", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    fill = pad if pad is not None else (eos if isinstance(eos, int) else 0)
    return fill, pad


class RingTrainerMixin:
    """Mix in before ``transformers.Trainer`` or ``trl.SFTTrainer``:
    ``class RingTrainer(RingTrainerMixin, Trainer): pass``.

    Keyword arguments (all other arguments go to the base trainer):

    - ``cp_size``: ranks per CP group (context parallelism); the world size must be a multiple of
      it (``dp = world // cp_size`` replicas; ranks ``d * cp_size .. (d + 1) * cp_size - 1`` form
      CP group ``d``, so it stays inside a node). 1 (default) without the options below: the base
      trainer.
    - ``ulysses_size``: 2D context parallelism, ``cp_size = ulysses_size x ring_size`` (Ulysses
      all-to-alls over ``ulysses_size`` contiguous ranks, the zigzag ring across them); it must
      divide ``cp_size`` and the model's query heads. 1 (default): the zigzag ring alone.
    - ``attn_backend``: the block kernel, one of ``ringft.ops.backends.BACKENDS``; None (default):
      ``"auto"`` picks. ``ring_backend=``, its old name, still works (a ``FutureWarning`` once).
    - ``loss_chunk_size``: tokens per chunk of the ``lm_head`` + cross-entropy (no full logits).
    - ``tiled_mlp_tokens``: run the MLP over token tiles of this size (``ringft.model.tiled_mlp``).
    - ``offload_activations``: keep the decoder's saved activations in CPU memory.
    - ``attention_tile_tokens``: run the attention kernels over tiles of at most this many queries
      and keys, merged exactly (``ringft.ops.tiles``): their transient memory follows the tile
      instead of the rank's sequence. None (default): untiled.
    - ``fused_rmsnorm``: the RMSNorms' fused backward (``ringft.model.fused_rmsnorm``: same values,
      no fp32 ``(tokens, hidden)`` temporaries), on whenever the ring or a memory option above is.
    - ``attention_checkpoint``: ``"recompute"`` (default), ``"save"`` or ``"offload"``: under
      gradient checkpointing, keep each layer's ring attention output and log-sum-exp from the
      forward (``offload``: in host memory) so that the backward's recompute skips the ring forward
      (:func:`ringft.apply_ring_attention`); ``save`` / ``offload`` need ``activation_checkpointing``.
    - ``tiled_norm_tokens``: run the RMSNorms over token tiles of this size (``ringft.model.tiled_norm``;
      not under DeepSpeed, whose ZeRO-3 hooks a tile's recompute would bypass).
    - ``master_weights``: fp32 master weights for the bf16 / fp16 parameters a plain optimizer
      steps (DDP or one process; :mod:`ringft.train.hf.masters`): full fine-tuning of a model
      loaded in bf16 keeps every small update. DeepSpeed and FSDP keep their own masters.
    - ``chunked_loss``: False computes the ``lm_head`` over the rank's whole shard at once (full
      logits: faster for a small vocabulary, more memory); True (default): ``loss_chunk_size`` chunks.
    - ``ring_path``: run ringft's path (the ring, the chunked loss, its batch path) even with
      ``cp_size=1`` and no memory option, as ``ringft train`` does.

    Gradient checkpointing is the Trainer's own (``activation_checkpointing=True``). Launch with
    ``accelerate launch`` (DDP, DeepSpeed ZeRO-3, FSDP1 / FSDP2 configs), ``cp_size`` given here,
    not in accelerate's ``parallelism_config``.
    """

    def __init__(
        self,
        *args: Any,
        cp_size: int = 1,
        ulysses_size: int = 1,
        attn_backend: str | None = None,
        loss_chunk_size: int = 4096,
        tiled_mlp_tokens: int | None = None,
        offload_activations: bool = False,
        attention_tile_tokens: int | None = None,
        fused_rmsnorm: bool = True,
        attention_checkpoint: str = "recompute",
        tiled_norm_tokens: int | None = None,
        master_weights: bool = False,
        ring_path: bool = False,
        chunked_loss: bool = True,
        **kwargs: Any,
    ):
        attn_backend = renamed_keyword(WHERE, kwargs, "attn_backend", attn_backend, default="auto")
        self._attn_backend = attn_backend
        as_integer(f"{WHERE}: cp_size", cp_size, 1)
        as_bool(f"{WHERE}: fused_rmsnorm", fused_rmsnorm)
        as_integer(f"{WHERE}: loss_chunk_size", loss_chunk_size, 1)
        as_integer(f"{WHERE}: attention_tile_tokens", attention_tile_tokens, 1, optional=True)
        as_integer(f"{WHERE}: tiled_norm_tokens", tiled_norm_tokens, 1, optional=True)
        self._master_weights = as_bool(f"{WHERE}: master_weights", master_weights)
        self._masters: Any = None
        self._flos_parameters: int | None = None
        problem = _ulysses_problem(cp_size, ulysses_size, args, kwargs)
        problem = problem or attention_checkpoint_problem(attention_checkpoint, _training_args(args, kwargs))
        if problem:
            raise ValueError(f"{WHERE}: {problem}")
        self._ring: _Ring | None = None
        saving = attention_checkpoint != "recompute"
        active = cp_size > 1 or bool(tiled_mlp_tokens) or offload_activations or bool(attention_tile_tokens)
        active = active or saving or bool(tiled_norm_tokens) or as_bool(f"{WHERE}: ring_path", ring_path)
        if active:
            check_versions(uses_trl=_uses_trl(type(self)))
            check_no_accelerate_cp(_training_args(args, kwargs))
            if kwargs.get("model_init") is not None:
                raise ValueError(f"{WHERE}: model_init is not supported with the ring: pass model=")
        super().__init__(*args, **kwargs)
        if not active:
            return
        layout = build_layout(cp_size, ulysses_size, self.args.device.type)
        check_trainer_options(self)
        from ringft.model.patch import apply_ring_attention

        apply_ring_attention(  # Ulysses x ring: the layout's groups
            self.model,
            layout,
            attn_backend,
            attention_tile_tokens=attention_tile_tokens,
            attention_checkpoint=attention_checkpoint,
        )
        install_ring_loss_forward(
            self.model, loss_chunk_size, offload_activations, as_bool(f"{WHERE}: chunked_loss", chunked_loss)
        )
        if fused_rmsnorm:
            from ringft.model.fused_rmsnorm import enable_fused_rmsnorm

            enable_fused_rmsnorm(self.model)
        if tiled_mlp_tokens:
            from ringft.model.tiled_mlp import enable_tiled_mlp

            enable_tiled_mlp(self.model, tile_tokens=tiled_mlp_tokens)
        if tiled_norm_tokens:  # after the fused norm, whose forward it then tiles
            check_tiled_norm(self)
            from ringft.model.tiled_norm import enable_tiled_norm

            enable_tiled_norm(self.model, tile_tokens=tiled_norm_tokens)
        if self.is_fsdp_enabled:  # reduce-scatter every micro-step: a rank never holds unsharded gradients
            self.accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = True
            note = configure_fsdp_precision(self.accelerator)  # (the Trainer prepares the model later)
            if note:
                self.accelerator.print(note)
        self.loss_is_scaled_for_ga = True  # the loss is divided by the whole step's count
        self._ring = _Ring(layout, *_pad_ids(self.processing_class))

    # -- layout and data ---------------------------------------------------------------------
    @property
    def ring_layout(self) -> ParallelLayout | None:
        """This process's DP x CP (CP = Ulysses x ring) layout (None when the ring is off)."""
        return None if self._ring is None else self._ring.layout

    def get_cp_size(self) -> int:
        """The ring's CP size (the Trainer divides the world by it to count DP replicas)."""
        return super().get_cp_size() if self._ring is None else self._ring.layout.cp_size

    def _get_dataloader(
        self, dataset, description, batch_size, sampler_fn=None, is_training=False, dataloader_key=None
    ):
        loader = super()._get_dataloader(
            dataset,
            description,
            batch_size,
            sampler_fn,
            is_training=is_training,
            dataloader_key=dataloader_key,
        )
        if self._ring is None:
            return loader
        return shard_loader_over_dp(
            loader, self._ring.layout, self._ring_collate(loader, is_training), description
        )

    def _ring_collate(self, loader: Any, is_training: bool) -> Any:
        """The collate function of a ring dataloader: the Trainer's, then this rank's CP shard."""
        ring = self._ring
        return RingCollate(
            loader.collate_fn,
            ring.layout.cp_rank,
            ring.layout.cp_size,
            ring.pad_token_id,
            keep_labels=not is_training,
            count_pad_token_id=ring.count_pad_token_id,
            ulysses_size=ring.layout.ulysses_size,
        )

    # -- training ----------------------------------------------------------------------------
    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        optimizer = super().create_optimizer(*args, **kwargs)
        if self._master_weights and not (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            from ringft.train.hf.masters import attach_master_weights

            self._masters = attach_master_weights(optimizer)
        return optimizer

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        if checkpoint is not None and self._ring is not None and self.is_fsdp_enabled:
            from ringft.train.hf.fsdp_resume import has_optimizer_state, materialize_optimizer_state

            if has_optimizer_state(checkpoint):  # (an empty state loads nothing under FSDP1)
                materialize_optimizer_state(self.optimizer)
        super()._load_optimizer_and_scheduler(checkpoint)

    def _clip_grad_norm(self, model: Any) -> Any:
        if self._masters is None:
            return super()._clip_grad_norm(model)
        self._masters.gradients_to_masters()  # clip the exact fp32 gradients the optimizer steps
        return torch.nn.utils.clip_grad_norm_(self._masters.master_parameters(), self.args.max_grad_norm)

    def floating_point_ops(self, inputs: dict) -> int:
        """The base class's estimate, 6 x input tokens x non-embedding parameters, with the parameters
        counted once (the base class walks every module and parameter on every micro-step)."""
        if self._ring is None:
            return super().floating_point_ops(inputs)
        main = getattr(self.model, "main_input_name", "input_ids")
        if main not in inputs or not hasattr(self.model, "num_parameters"):
            return 0
        if self._flos_parameters is None:
            self._flos_parameters = self.model.num_parameters(exclude_embeddings=True)
        return 6 * inputs[main].numel() * self._flos_parameters

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        if self._ring is None:
            return super()._get_num_items_in_batch(batch_samples, device)
        if not batch_samples:
            return None
        counts = exchange_step_counts(
            batch_samples, self._ring.layout, self.args.average_tokens_across_devices, device, WHERE
        )
        for batch, tokens in zip(batch_samples, counts.tokens):
            batch[_TOKENS] = tokens
        metrics = getattr(self, "_metrics", None)
        if metrics is not None and hasattr(self, "_total_train_tokens"):  # TRL's num_tokens
            self._total_train_tokens += sum(t[2] for t in counts.tokens)
            metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return counts.num_items

    def _track_num_input_tokens(self, inputs: dict) -> None:
        if self._ring is None:
            return super()._track_num_input_tokens(inputs)
        mode = self.args.include_num_input_tokens_seen
        if mode in ("no", False, None) or _TOKENS not in inputs:
            return None
        self.state.num_input_tokens_seen += inputs[_TOKENS][1 if mode == "non_padding" else 0]
        return None

    def training_step(self, model: Any, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        """The base class's micro-step; under DDP in one process, the gradients are reduced on the
        optimizer step's last micro-step only, as with several (accelerate wraps one CPU process in
        DDP but its ``no_sync`` needs several)."""
        if (
            self._ring is not None
            and isinstance(model, torch.nn.parallel.DistributedDataParallel)
            and not self.accelerator.use_distributed
            and not self.accelerator.sync_gradients
        ):
            with model.no_sync():
                return super().training_step(model, inputs, num_items_in_batch)
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The ring's loss share of this rank (see :mod:`ringft.train.hf.steps` for the scale)."""
        if self._ring is None:
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        if return_outputs:
            raise NotImplementedError(
                f"{WHERE}: compute_loss(return_outputs=True) would need full logits; use predict() for logits"
            )
        if num_items_in_batch is None:
            num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
        scale = loss_scale(self._ring.layout, self.args.average_tokens_across_devices)
        return ring_loss(model, inputs, num_items_in_batch, scale)

    # -- evaluation and prediction -------------------------------------------------------------
    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        if self._ring is not None:  # the base loop resets it to accelerate's when it ends
            self.gather_function = functools.partial(
                gather_over_dp, layout=self._ring.layout, gradient_state=self.accelerator.gradient_state
            )
        return super().evaluation_loop(*args, **kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """``(loss, logits, labels)`` of one eval batch, as one process computes them: the loss over
        the CP group, logits ``(batch, seq, vocab)`` gathered and un-zigzagged, the collated labels."""
        if self._ring is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        layout, avg = self._ring.layout, self.args.average_tokens_across_devices
        inputs = self._prepare_inputs(inputs)
        counts = exchange_step_counts([inputs], layout, avg, self.args.device, WHERE, need_labels=False)
        has_labels = inputs.get("shift_labels") is not None
        scale = layout.dp_size if avg else 1
        if prediction_loss_only:
            if not has_labels:
                return None, None, None
            total = eval_loss_sum(model, inputs, layout, router_scale=counts.num_items / scale)
            return total / counts.num_items * scale, None, None
        logits, loss_sum = predict_logits(
            model, inputs, layout, int(inputs[RING_LENGTH]), router_scale=counts.num_items / scale
        )
        loss = None if loss_sum is None else loss_sum / counts.num_items * scale
        return loss, logits, inputs.get(RING_LABELS)
