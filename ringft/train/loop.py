"""The training loop: CP (the ring) x DP under Accelerate, DeepSpeed or FSDP.

Layout: world = dp x cp, CP ranks contiguous, and cp = ulysses x ring (``parallel.ulysses_size``;
Ulysses groups contiguous inside a CP group). All CP ranks of a replica read the same examples and
each keeps its shard (zigzag over the ring, cut into ``ulysses_size`` pieces); replicas read
different examples (``train/data.py``). Each rank's loss is its share of the step's mean token loss
(``ringft.loss.loss_normalization``), so the update equals the one-process update on the same
global batch.

Order of work in :class:`Trainer`: everything that can be refused is checked first, on every rank
(recipe vs world size, tokenizer vs model config, the data), then the output folder is locked and
the checkpoint to resume from is chosen and compared with the recipe, and only then is the model
loaded. A refused run writes nothing.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ringft.data.collator import RingDataCollator
from ringft.loss import CausalLMLoss, loss_normalization
from ringft.ops.parallel import build_layout
from ringft.ops.validate import PeerFailed, run_together
from ringft.train import checkpoint as ckpt
from ringft.train.build import (
    build_model,
    build_tokenizer,
    decay_parameter_groups,
    model_config,
    prepare_for_training,
)
from ringft.train.data import example_indices, load_training_data
from ringft.train.errors import RecipeError
from ringft.train.integrations import (
    DDP,
    DEEPSPEED,
    FSDP,
    check_precision,
    configure_deepspeed,
    configure_fsdp_precision,
    distributed_kind,
    make_accelerator,
    model_construction,
    run_micro_steps,
)
from ringft.train.master_weights import MasterWeights, needs_master_weights
from ringft.train.recipe import Recipe, validate
from ringft.train.run_dir import MetricsFile, OutputDirLock
from ringft.train.schedule import TrainResult, lr_schedule, peak_memory_gb

__all__ = ["TrainResult", "Trainer", "lr_schedule", "train"]


def _as_float(value: Any) -> float | None:
    if value is None:
        return None
    return float(value.item() if torch.is_tensor(value) else value)


def _tracker_config(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The recipe as flat ``section.key -> scalar`` pairs (what trackers accept as hyper-parameters)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_tracker_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def _refuse_trainer_only(recipe: Recipe) -> None:
    t, d, c = recipe.train, recipe.data, recipe.checkpoint
    asked = [
        name
        for name, on in [
            ("train.num_train_epochs", t.num_train_epochs),
            ("train.eval_every", t.eval_every),
            ("data.eval_path", d.eval_path),
            ("data.eval_fraction", d.eval_fraction),
            ("checkpoint.push_to_hub", c.push_to_hub),
        ]
        if on
    ]
    if asked:
        raise RecipeError(f"{', '.join(asked)}: only the default engine runs them (drop --engine loop)")


class Trainer:
    """Builds everything from a :class:`Recipe` and runs the loop (:meth:`run`). See :func:`train`.

    Attributes for tests and tools: ``model`` (the trained module, peft-wrapped with LoRA),
    ``wrapped`` (the prepared :class:`ringft.loss.CausalLMLoss`: DDP / FSDP module or DeepSpeed
    engine), ``layout``, ``tokenizer``, ``data``, ``start_step``.
    """

    def __init__(self, recipe: Recipe, resume: bool = False, progress: bool = True):
        self.recipe, self.progress = recipe, progress
        self.accelerator = make_accelerator(recipe)
        self.lock = OutputDirLock(recipe.checkpoint.output_dir)
        try:
            self._setup(resume)
        except BaseException:
            self.lock.release()  # local: the kernel would drop it at exit anyway
            raise

    def _setup(self, resume: bool) -> None:
        recipe, acc, t = self.recipe, self.accelerator, self.recipe.train
        world = acc.num_processes
        validate(recipe, world_size=world)
        _refuse_trainer_only(recipe)
        self.kind = distributed_kind(acc)
        check_precision(self.kind, acc, recipe)
        if self.kind == DEEPSPEED:
            configure_deepspeed(acc, recipe, world)
        if self.kind == FSDP and (note := configure_fsdp_precision(acc)):
            acc.print(note)
        self.device = acc.device
        p = recipe.parallel
        self.layout = build_layout(p.cp_size, p.ulysses_size, self.device.type)
        torch.manual_seed(t.seed)
        self.tokenizer = build_tokenizer(recipe)
        config = model_config(recipe, len(self.tokenizer))
        self.data = load_training_data(recipe, self.tokenizer, config.vocab_size)
        resume_from = self._claim_output_dir(resume)
        for note in self.data.notes:
            acc.print(note)
        with model_construction(acc, self.kind):
            model = build_model(recipe, len(self.tokenizer), config)
        self.model = prepare_for_training(model, recipe, self.layout)
        pad = self.tokenizer.pad_token_id
        pad = self.tokenizer.eos_token_id if pad is None else pad
        self.collator = RingDataCollator(
            self.layout.cp_rank,
            self.layout.cp_size,
            pad_token_id=pad,
            max_length=recipe.data.seq_len,
            document_masking=recipe.data.document_masking,  # positions restart per document: the ring masks
            ulysses_size=self.layout.ulysses_size,
        )
        groups = decay_parameter_groups(self.model, t.weight_decay)
        self.masters = MasterWeights(groups) if self.kind == DDP and needs_master_weights(groups) else None
        optimizer = torch.optim.AdamW(
            self.masters.optimizer_groups if self.masters else groups, lr=t.lr, betas=tuple(t.betas)
        )
        # The learning rate is set before each update (a function of the step): it reaches whatever
        # optimizer DeepSpeed puts in place of this one (e.g. DeepSpeedCPUAdam under offload).
        self.lr_factor = lr_schedule(t)
        self.last_lr = t.lr * self.lr_factor(0)
        self.last_grad_norm: float | None = None  # before clipping; logged when known
        wrapped = CausalLMLoss(self.model, t.chunked_loss, t.loss_chunk_size, t.offload_activations)
        # Under DeepSpeed, ``self.wrapped`` is its engine (which also owns the optimizer step).
        self.wrapped, self.optimizer = acc.prepare(wrapped, optimizer)
        if self.masters is not None:
            acc.register_for_checkpointing(self.masters)
        self.start_step = 0
        if resume_from is not None:
            acc.load_state(str(resume_from))
            self.start_step = ckpt.read_state(resume_from)["step"]
            acc.print(f"resumed from {resume_from} (step {self.start_step})")
        tracker = recipe.logging.tracker
        if tracker not in (None, "none"):
            acc.init_trackers(recipe.logging.project, config=_tracker_config(recipe.to_dict()))

    def _run_state(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe.to_dict(),
            "world_size": self.layout.world_size,
            "dp_size": self.layout.dp_size,
        }

    def _claim_output_dir(self, resume: bool) -> Path | None:
        """Pick the checkpoint to resume from (read-only: every rank reads the same files and raises
        the same error), then lock ``output_dir`` (main process; the verdict is broadcast) and fix
        up ``metrics.jsonl``. Nothing is written before every check has passed."""
        acc, out = self.accelerator, Path(self.recipe.checkpoint.output_dir)
        folder, notes = self._choose_checkpoint(out, resume)

        def lock() -> None:
            held = self.lock.acquire()
            if held:
                raise RecipeError(held)

        try:  # the main process locks; every rank stops with its one-line reason
            run_together(lock, here=acc.is_main_process, share_message=True)
        except PeerFailed as exc:
            raise RecipeError(exc.message or str(exc)) from None
        if self.lock.unsupported:
            acc.print(f"warning: {self.lock.unsupported}")
        for line in notes:
            acc.print(line)
        self.metrics = MetricsFile(out)
        if acc.is_main_process:
            if folder is None:
                self.metrics.restart()
            else:
                self.metrics.truncate_after(ckpt.read_state(folder)["step"])
        return folder

    def _choose_checkpoint(self, out: Path, resume: bool) -> tuple[Path | None, list[str]]:
        if not resume:
            existing = ckpt.checkpoint_folders(out)
            if existing:
                raise RecipeError(
                    f"checkpoint.output_dir {str(out)!r} already holds checkpoints of a run "
                    f"({existing[-1].name}): "
                    "pass --resume to continue it, or choose another checkpoint.output_dir (or delete "
                    f"{out / 'checkpoints'}) to start a new run"
                )
            return None, []
        folder = ckpt.resume_point(out)
        if folder is None:
            return None, [f"--resume: no checkpoint in {out / 'checkpoints'}, starting fresh"]
        return folder, ckpt.check_resumable(folder, self._run_state())

    # -- one optimizer step ------------------------------------------------------------------
    def _micro_batches(self, step: int) -> list[dict[str, Any]]:
        out = []
        for micro in range(self.recipe.train.grad_accum):
            idx = example_indices(step, micro, self.layout, self.recipe, len(self.data))
            batch = self.collator(self.data.examples(idx))
            out.append({k: (v.to(self.device) if torch.is_tensor(v) else v) for k, v in batch.items()})
        return out

    def _set_lr(self, step: int) -> None:
        self.last_lr = self.recipe.train.lr * self.lr_factor(step)
        for group in self.optimizer.param_groups:
            group["lr"] = self.last_lr

    def _optimizer_step(self) -> None:
        clip = self.recipe.train.grad_clip
        if self.kind == DEEPSPEED:  # the engine clips and steps at the boundary micro-step
            self.wrapped.step()
            self.last_grad_norm = _as_float(self.wrapped.get_global_grad_norm())
            return
        if self.masters is not None:
            self.masters.gradients_to_masters()
            if clip:
                norm = torch.nn.utils.clip_grad_norm_(self.masters.master_parameters(), clip)
                self.last_grad_norm = _as_float(norm)
        elif clip:
            # The prepared module's parameters: under FSDP accelerate then clips with the global norm.
            self.last_grad_norm = _as_float(self.accelerator.clip_grad_norm_(self.wrapped.parameters(), clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.masters is not None:
            self.masters.masters_to_model()

    def train_step(self, step: int) -> tuple[float, int]:
        """One optimizer step (every micro-step). Returns (the step's mean token loss, tokens)."""
        batches = self._micro_batches(step)
        norm = loss_normalization([b["shift_labels"] for b in batches])
        self._set_lr(step)
        loss_sum = run_micro_steps(self.wrapped, batches, norm, self.kind, backward=self.accelerator.backward)
        self._optimizer_step()
        if dist.is_initialized() and self.layout.world_size > 1:
            dist.all_reduce(loss_sum)
        total_tokens = sum(b["input_ids"].numel() for b in batches) * self.layout.world_size
        return float(loss_sum), total_tokens

    def save_checkpoint(self, step: int) -> Path:
        """``checkpoints/step-N`` (atomic; see :func:`ringft.train.checkpoint.save_checkpoint`)."""
        c = self.recipe.checkpoint
        return ckpt.save_checkpoint(self.accelerator, c.output_dir, step, self._run_state(), c.keep)

    def export(self) -> Path:
        """The final model (or LoRA adapter) and tokenizer in ``output_dir/final``."""
        return ckpt.export_final(
            self.accelerator,
            self.wrapped,
            self.kind != DDP,
            self.recipe.to_dict(),
            self.tokenizer,
            self.recipe.checkpoint.output_dir,
            self.layout,
            self.recipe.model.attn_backend,
        )

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> TrainResult:
        """Train from ``start_step`` to ``train.max_steps``, checkpoint, export. Releases the lock."""
        try:
            return self._run()
        finally:
            self.lock.release()  # local, no collective

    def _run(self) -> TrainResult:
        from tqdm.auto import tqdm

        acc, t, c = self.accelerator, self.recipe.train, self.recipe.checkpoint
        losses: list[float] = []
        bar = tqdm(
            total=t.max_steps,
            initial=self.start_step,
            desc="train",
            dynamic_ncols=True,
            disable=not (self.progress and acc.is_main_process),
            file=sys.stdout,
        )
        tokens_done, started = 0, time.perf_counter()
        for step in range(self.start_step, t.max_steps):
            tic = time.perf_counter()
            loss, tokens = self.train_step(step)
            elapsed = time.perf_counter() - tic
            tokens_done += tokens
            losses.append(loss)
            peak = peak_memory_gb(self.device)
            tps = tokens / elapsed
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:,.0f}", peak_gb=f"{peak:.2f}")
            bar.update(1)
            if (step + 1) % self.recipe.logging.log_every == 0:
                metrics = {"loss": loss, "lr": self.last_lr, "tokens_per_s": tps, "peak_mem_gb": peak}
                if self.device.type == "cuda":
                    metrics["peak_reserved_gb"] = torch.cuda.max_memory_reserved(self.device) / 2**30
                if self.last_grad_norm is not None:
                    metrics["grad_norm"] = self.last_grad_norm
                acc.log(metrics, step=step + 1)
                if acc.is_main_process:
                    self.metrics.append({"step": step + 1, **metrics})
            if c.save_every and (step + 1) % c.save_every == 0 and step + 1 < t.max_steps:
                self.save_checkpoint(step + 1)
        bar.close()
        wall = time.perf_counter() - started
        final = None
        if c.save_final:
            self.save_checkpoint(t.max_steps)
            final = self.export()
        acc.end_training()
        tps = tokens_done / wall if wall > 0 else 0.0
        if losses:
            split = f" = ulysses {self.layout.ulysses_size} x ring {self.layout.ring_size}"
            acc.print(
                f"ringft: {t.max_steps} steps (dp={self.layout.dp_size} x cp={self.layout.cp_size}"
                f"{split if self.layout.ulysses_size > 1 else ''}), "
                f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, {tps:,.0f} tokens/s, "
                f"peak {peak_memory_gb(self.device):.2f} GB/rank, "
                + (f"model saved to {final}" if final else "not saved (checkpoint.save_final: false)")
            )
        return TrainResult(t.max_steps, losses, str(final) if final else None, tps)


def train(recipe: Recipe, resume: bool = False, progress: bool = True) -> TrainResult:
    """Train with a recipe (call under ``accelerate launch`` for several processes)."""
    return Trainer(recipe, resume=resume, progress=progress).run()
