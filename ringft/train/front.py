"""``ringft train RECIPE.yaml`` as a recipe front end over ``transformers.Trainer`` with
:class:`ringft.RingTrainerMixin` (run under ``accelerate launch``, as the Trainer is).

The recipe becomes ``TrainingArguments`` (:func:`training_arguments`) and a :class:`RecipeTrainer`
(the mixin over ``Trainer``, with the recipe's data order, optimizer groups and learning-rate
schedule). Order of work: everything that can be refused is checked first on every rank
(recipe vs world size, tokenizer vs model config, the data), then the output folder is locked and
the checkpoint to resume from is chosen and compared with the recipe, and only then is the model
loaded. A refused run writes nothing.

Under it, everything is the mixin's: the ring (CP = Ulysses x ring), the batch path (collate ->
shift on the whole sequence -> pad to 2 x cp -> shard), the loss normalisation over every rank and
micro-step, fp32 master weights for a bf16 model under DDP, the memory options.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ringft.train.build import (
    add_lora,
    build_model,
    build_tokenizer,
    decay_parameter_names,
    decayed_parameters,
    model_config,
)
from ringft.train.data import load_training_data, split_eval_data
from ringft.train.errors import RecipeError
from ringft.train.front_launch import model_construction, prepare_launch
from ringft.train.front_parts import (
    LastStep,
    MetricsCallback,
    RecipeDataset,
    RecipeSampler,
    whole_batch_collator,
)
from ringft.train.front_runs import RunFolder, export_final, intact_note, push_export, write_together
from ringft.train.front_sft import sft_arguments, sft_inputs
from ringft.train.hf.mixin import RingTrainerMixin
from ringft.train.recipe import Recipe, validate
from ringft.train.schedule import TrainResult, lr_schedule, peak_memory_gb

__all__ = ["TrainResult", "build_trainer", "train", "training_arguments"]


def _report_to(tracker: str | None) -> list[str]:
    return [] if tracker in (None, "none") else [tracker]


def training_arguments(
    recipe: Recipe,
    progress: bool = True,
    bf16: bool = False,
    arguments_class: type | None = None,
    **extra: Any,
) -> Any:
    """The ``TrainingArguments`` of a recipe (the schedule is the recipe's: :class:`RecipeTrainer`);
    ``arguments_class`` (e.g. TRL's ``SFTConfig``) with ``extra`` keywords instead, if given."""
    from transformers import TrainingArguments

    t, c, lg = recipe.train, recipe.checkpoint, recipe.logging
    evaluation = (
        {"eval_strategy": "steps", "eval_steps": t.eval_every, "prediction_loss_only": True}
        if t.eval_every
        else {}
    )
    length = (
        {"max_steps": -1, "num_train_epochs": t.num_train_epochs}
        if t.num_train_epochs
        else {"max_steps": t.max_steps}
    )
    values = dict(
        output_dir=c.output_dir,
        per_device_train_batch_size=t.micro_batch_size,
        per_device_eval_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.grad_accum,
        learning_rate=t.lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.betas[0],
        adam_beta2=t.betas[1],
        max_grad_norm=t.grad_clip,
        optim="adamw_torch",
        lr_scheduler_type="constant",  # replaced by the recipe's (RecipeTrainer.create_scheduler)
        seed=t.seed,
        activation_checkpointing=t.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False},
        logging_strategy="steps",
        logging_steps=lg.log_every,
        save_strategy="steps" if c.save_every else "no",  # 0: no checkpoints (the export is apart)
        save_steps=c.save_every or t.max_steps,
        save_total_limit=None,  # RunFolder.mark_complete rotates, once a new checkpoint is complete
        report_to=_report_to(lg.tracker),
        run_name=lg.project,
        remove_unused_columns=False,
        dataloader_drop_last=True,  # every optimizer step reads a whole global batch
        ddp_find_unused_parameters=False,
        average_tokens_across_devices=True,  # the one-process update on the step's global batch
        disable_tqdm=not progress,
        use_cpu=not torch.cuda.is_available(),
        bf16=bf16,  # the launch's mixed precision (DeepSpeed / FSDP keep fp32 masters then)
        **{**evaluation, **length},
    )
    return (arguments_class or TrainingArguments)(**{**values, **extra})


@functools.cache
def _trainer_class(base: type) -> type:
    """The ring trainer over ``base`` (``Trainer``, or TRL's ``SFTTrainer`` for ``data.format``)."""

    class RecipeTrainer(RingTrainerMixin, base):
        """The ring trainer with the recipe's data order, weight-decay groups and schedule."""

        def __init__(self, *args: Any, recipe: Recipe, **kwargs: Any):
            self.recipe = recipe
            super().__init__(*args, **kwargs)
            self._decay = set(decay_parameter_names(self.model))  # (the optimizer is built after prepare)
            # each tensor's dtype as loaded: the export puts back what FSDP's fp32 masters upcast
            fsdp = self.is_fsdp_enabled
            self.export_dtypes = {k: v.dtype for k, v in self.model.state_dict().items()} if fsdp else {}

        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            dataset = train_dataset if train_dataset is not None else self.train_dataset
            return RecipeSampler(len(dataset), self.recipe.train.seed, self.recipe.data.shuffle)

        def _get_dataloader(self, *args: Any, is_training: bool = False, **kwargs: Any) -> Any:
            """Training drops a last partial batch (every optimizer step reads a whole global
            batch); with one replica an eval split is read whole (a last partial batch is exact on
            the ring), with several its partial last global batch is dropped (accelerate would
            fill it up with repeated rows, which the DP-wide token mean would count)."""
            keep = self.args.dataloader_drop_last
            self.args.dataloader_drop_last = keep and (is_training or self.ring_layout.dp_size > 1)
            try:
                return super()._get_dataloader(*args, is_training=is_training, **kwargs)
            finally:
                self.args.dataloader_drop_last = keep

        def get_decay_parameter_names(self, model: torch.nn.Module) -> list[str]:
            return decayed_parameters(model, self._decay, self.args.weight_decay)

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            """The Trainer's save on every rank, then one verdict; then the main process marks
            the checkpoint complete (``ringft_run.json``) and rotates, again with one verdict. An
            I/O failure on any rank ends every rank with one line naming the folder; only a
            checkpoint every rank completed is marked complete, and only then are old ones
            rotated out."""
            folder = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
            kept = intact_note(self.args.output_dir)
            save = super()._save_checkpoint
            write_together("checkpoint", folder, lambda: save(model, trial), kept)
            is_main = self.args.process_index == 0
            write_together("checkpoint", folder, lambda: self.run_folder.mark_complete(folder, is_main), kept)

        def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
            if self.lr_scheduler is None:
                optimizer = self.optimizer if optimizer is None else optimizer
                steps = dataclasses.replace(self.recipe.train, max_steps=num_training_steps)
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(steps))
            return self.lr_scheduler

    return RecipeTrainer


def _recipe_inputs(recipe: Recipe, tokenizer: Any, vocab: int) -> tuple[type, dict[str, Any], list[str]]:
    """``(Trainer, its dataset and collator keywords, notes)`` for pre-tokenized or synthetic rows."""
    from transformers import Trainer

    data, eval_data = split_eval_data(recipe, load_training_data(recipe, tokenizer, vocab), vocab)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    datasets = dict(
        train_dataset=RecipeDataset(data),
        eval_dataset=None if eval_data is None else RecipeDataset(eval_data),
        data_collator=whole_batch_collator(recipe, pad),
    )
    return Trainer, datasets, data.notes


def build_trainer(recipe: Recipe, resume: bool | str = False, progress: bool = True) -> tuple[Any, RunFolder]:
    """The :class:`RecipeTrainer` of ``recipe`` and its locked :class:`RunFolder` (which says what to
    resume from). ``resume``: False, True (the newest checkpoint) or a checkpoint folder."""
    launch = prepare_launch(recipe, is_main=os.environ.get("RANK", "0") == "0")
    args = training_arguments(recipe, progress, **launch, **sft_arguments(recipe))
    world = args.world_size
    validate(recipe, world_size=world)
    _tracker_setup(recipe)
    torch.manual_seed(recipe.train.seed)
    tokenizer = build_tokenizer(recipe)
    config = model_config(recipe, len(tokenizer))
    inputs = sft_inputs if recipe.data.format else _recipe_inputs
    base, datasets, notes = inputs(recipe, tokenizer, config.vocab_size)
    if recipe.train.eval_every and datasets["eval_dataset"] is None:
        raise RecipeError("train.eval_every needs an eval split: set data.eval_path or data.eval_fraction")
    if not recipe.train.eval_every and datasets["eval_dataset"] is not None:
        notes = [
            *notes,
            "warning: the eval split is never evaluated (train.eval_every: 0): set train.eval_every",
        ]
    folder = RunFolder(recipe, world)
    folder.claim(resume, is_main=args.process_index == 0)
    try:
        for note in notes:
            _print_main(args, note)
        with model_construction():
            model = build_model(recipe, len(tokenizer), config)
        model = add_lora(model, recipe)
        t, p = recipe.train, recipe.parallel
        trainer = _trainer_class(base)(
            model=model,
            args=args,
            **datasets,
            processing_class=tokenizer,
            recipe=recipe,
            cp_size=p.cp_size,
            ulysses_size=p.ulysses_size,
            attn_backend=recipe.model.attn_backend,
            loss_chunk_size=t.loss_chunk_size,
            chunked_loss=t.chunked_loss,
            tiled_mlp_tokens=t.tiled_mlp_tokens,
            tiled_norm_tokens=t.tiled_norm_tokens,
            offload_activations=t.offload_activations,
            attention_tile_tokens=t.attention_tile_tokens,
            fused_rmsnorm=t.fused_rmsnorm,
            attention_checkpoint=t.attention_checkpoint,
            master_weights=True,
            ring_path=True,
        )
        _check_batches(trainer, t.micro_batch_size)
    except BaseException:
        folder.release()
        raise
    _quiet(trainer, progress)
    trainer.add_callback(LastStep(recipe.checkpoint.save_final))
    folder.attach(trainer)
    return trainer, folder


def _tracker_setup(recipe: Recipe) -> None:
    """wandb: the recipe's ``logging.project`` is the project (transformers' callback reads
    ``WANDB_PROJECT``), and a missing package is refused before the model loads."""
    lg = recipe.logging
    if lg.tracker != "wandb":
        return
    if importlib.util.find_spec("wandb") is None:
        raise RecipeError(
            "logging.tracker wandb needs the wandb package: pip install wandb (then wandb login), or "
            "set logging.tracker to tensorboard or none"
        )
    os.environ["WANDB_PROJECT"] = lg.project


def _check_batches(trainer: Any, micro_batch_size: int) -> None:
    """Refuse a training set without one whole batch over the data-parallel replicas (the Trainer
    would stop at step 0 and the untrained model be exported), and an eval split that makes no
    eval batch (its eval loss silently missing); rows as the trainer holds them (after TRL's
    processing for ``data.format``)."""
    dp = trainer.ring_layout.dp_size
    per = dp * micro_batch_size
    batch = f"{per} rows (train.micro_batch_size {micro_batch_size} x {dp} data-parallel replicas)"
    rows = len(trainer.train_dataset)
    if rows < per:
        raise RecipeError(
            f"the training set holds {rows} rows, fewer than one batch of {batch}: give more data, or "
            "lower train.micro_batch_size"
            + (" or data.eval_fraction" if trainer.eval_dataset is not None else "")
        )
    rows = len(trainer.eval_dataset) if trainer.eval_dataset is not None else None
    if rows is not None and rows < (per if dp > 1 else 1):
        raise RecipeError(
            f"the eval split holds {rows} rows, fewer than one eval batch of {batch if dp > 1 else '1 row'}: "
            "hold out more rows (data.eval_fraction, data.eval_path) or drop the eval split"
        )


def _print_main(args: Any, line: str) -> None:
    if args.process_index == 0:
        print(line, flush=True)


def _quiet(trainer: Any, progress: bool) -> None:
    """No per-log printing without a progress bar (metrics.jsonl and the trackers have every row)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    if not progress:
        trainer.remove_callback(ProgressCallback)


def train(recipe: Recipe, resume: bool | str = False, progress: bool = True) -> TrainResult:
    """Train with a recipe (call under ``accelerate launch`` for several processes)."""
    trainer, folder = build_trainer(recipe, resume, progress)
    try:
        return _run(trainer, folder, recipe)
    finally:
        folder.release()


def _run(trainer: Any, folder: RunFolder, recipe: Recipe) -> TrainResult:
    t, layout = recipe.train, trainer.ring_layout
    tokens_per_step = layout.dp_size * t.micro_batch_size * t.grad_accum * recipe.data.seq_len
    metrics = MetricsCallback(folder.metrics, tokens_per_step, trainer.args.device)
    trainer.add_callback(metrics)
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=folder.resume_from)
    wall = time.perf_counter() - started
    final = export_final(trainer, recipe) if recipe.checkpoint.save_final else None
    if final is not None and recipe.checkpoint.push_to_hub and trainer.args.process_index == 0:
        push_export(final, recipe.checkpoint.hub_model_id or Path(recipe.checkpoint.output_dir).name)
    done = trainer.state.global_step - folder.start_step
    tps = tokens_per_step * done / wall if wall > 0 else 0.0
    losses = metrics.losses
    if losses and trainer.args.process_index == 0:
        split = f" = ulysses {layout.ulysses_size} x ring {layout.ring_size}"
        print(
            f"ringft: {trainer.state.global_step} steps (dp={layout.dp_size} x cp={layout.cp_size}"
            f"{split if layout.ulysses_size > 1 else ''}), "
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, {tps:,.0f} tokens/s, "
            f"peak {peak_memory_gb(trainer.args.device):.2f} GB/rank, "
            + (f"model saved to {final}" if final else "not saved (checkpoint.save_final: false)"),
            file=sys.stdout,
            flush=True,
        )
    return TrainResult(trainer.state.global_step, losses, str(final) if final else None, tps)
