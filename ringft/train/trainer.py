"""Accelerate training loop combining context parallelism (the ring) with data parallelism.

Layout: world = dp x cp, CP ranks contiguous. All CP ranks of a replica read the same examples and
each keeps its zigzag shard; replicas read different examples. Every rank's loss is its share
(sum of its token losses / valid tokens of the whole global step, over all ranks and all
gradient-accumulation micro-steps); DDP averages gradients over the world, so the loss is scaled
by world_size before backward and the update equals the one-process update on the same data.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringft.data.collator import RingDataCollator
from ringft.hf import apply_ring_attention
from ringft.loss import lm_loss_from_hidden
from ringft.modeling import decoder, pretrained_model
from ringft.parallel import ParallelLayout, build_layout
from ringft.train.recipe import Recipe, RecipeError, validate

CHECKPOINT_PREFIX = "step-"
STATE_FILE = "trainer_state.json"


class CausalLMLoss(nn.Module):
    """Wraps a causal LM: ``forward(batch) -> loss share`` (what DDP wraps and the loop calls).

    With ``chunked=True`` the LM head + cross-entropy run in token chunks (no full logits).
    """

    def __init__(self, model: nn.Module, chunked: bool, chunk_size: int, offload_activations: bool):
        super().__init__()
        self.model = model
        self.chunked, self.chunk_size = chunked, chunk_size
        self.offload_activations = offload_activations

    @property
    def config(self):
        """The model's config (accelerate's DeepSpeed setup sizes its buckets from ``hidden_size``)."""
        return pretrained_model(self.model).config

    def _decoder(self) -> nn.Module:
        return decoder(self.model)

    def forward(self, input_ids, position_ids, shift_labels, num_items_in_batch, **_: Any) -> torch.Tensor:
        # Offload wraps only the decoder, whose checkpointed layer inputs are what it is for
        # (wrapping the loss too would copy the lm_head weight to CPU every step).
        offload = (
            torch.autograd.graph.save_on_cpu(pin_memory=input_ids.is_cuda)
            if self.offload_activations
            else contextlib.nullcontext()
        )
        if self.chunked:
            with offload:
                hidden = self._decoder()(
                    input_ids=input_ids, position_ids=position_ids, use_cache=False
                ).last_hidden_state
            return lm_loss_from_hidden(
                self.model, hidden, shift_labels, num_items_in_batch, chunk_size=self.chunk_size
            )
        with offload:
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                labels=shift_labels,
                shift_labels=shift_labels,
                num_items_in_batch=num_items_in_batch,
                use_cache=False,
            )
        return out.loss


def build_tokenizer(recipe: Recipe):
    from ringft.demo_tokenizer import load_tokenizer

    name = recipe.model.tokenizer or recipe.model.name_or_path
    if name is None:
        raise RecipeError("model.tokenizer is required when the model is built from model.config")
    return load_tokenizer(name)


def build_model(recipe: Recipe, vocab_size: int | None = None) -> nn.Module:
    """The model with the recipe's RoPE / context overrides applied (not yet on the ring)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, MistralConfig

    m = recipe.model
    dtype = torch.bfloat16 if m.dtype == "bf16" else torch.float32
    if m.config is not None:
        classes = {"llama": LlamaConfig, "mistral": MistralConfig}
        if m.model_type not in classes:
            raise RecipeError(f"model.model_type must be llama or mistral, got {m.model_type!r}")
        kwargs = dict(m.config)
        if vocab_size is not None:
            kwargs.setdefault("vocab_size", vocab_size)
        config = classes[m.model_type](**kwargs)
    else:
        config = AutoConfig.from_pretrained(m.name_or_path)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if m.rope_scaling:
        rope.update(m.rope_scaling)
    if m.rope_theta is not None:
        rope["rope_theta"] = float(m.rope_theta)
    if rope:
        config.rope_parameters = rope
    if m.max_position_embeddings is not None:
        config.max_position_embeddings = m.max_position_embeddings
    if m.sliding_window != "keep" and hasattr(config, "sliding_window"):
        config.sliding_window = m.sliding_window
    config.use_cache = False
    if m.config is not None:
        torch.manual_seed(recipe.train.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(
            m.name_or_path, config=config, dtype=dtype, attn_implementation="sdpa"
        )
    return model


def load_training_data(recipe: Recipe, tokenizer):
    """A ``datasets.Dataset`` with ``input_ids`` (and optionally ``labels``)."""
    d = recipe.data
    if d.path is not None:
        from datasets import load_from_disk

        ds = load_from_disk(d.path)
        if "input_ids" not in ds.column_names:
            raise RecipeError(f"dataset {d.path!r} has no input_ids column (columns: {ds.column_names})")
        return ds
    from ringft.data.synthetic import make_synthetic_dataset

    syn = dict(d.synthetic)
    return make_synthetic_dataset(
        tokenizer,
        syn.pop("num_examples", 256),
        d.seq_len,
        recipe.train.seed,
        loss_on=syn.pop("loss_on", "answer"),
        min_len=syn.pop("min_len", None),
    )


def example_indices(step: int, micro: int, layout: ParallelLayout, recipe: Recipe, n: int) -> list[int]:
    """Deterministic data order: examples of replica ``dp_rank`` for (optimizer step, micro-step).

    The stream is a seeded permutation per epoch, concatenated; resuming at a step needs no replay.
    """
    t = recipe.train
    per_micro = layout.dp_size * t.micro_batch_size
    start = ((step * t.grad_accum + micro) * per_micro) + layout.dp_rank * t.micro_batch_size
    out = []
    for pos in range(start, start + t.micro_batch_size):
        epoch, offset = divmod(pos, n)
        if recipe.data.shuffle:
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(t.seed * 100003 + epoch))
            out.append(int(perm[offset]))
        else:
            out.append(offset)
    return out


def lr_lambda(recipe: Recipe):
    t = recipe.train

    def factor(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.schedule == "constant":
            return 1.0
        progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first. Half-written ones (``*.tmp``) are never listed."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir()
        and p.name.startswith(CHECKPOINT_PREFIX)
        and p.name[len(CHECKPOINT_PREFIX) :].isdigit()
        and (p / STATE_FILE).is_file()
    ]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]))


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)


@dataclass
class TrainResult:
    steps: int
    losses: list[float]
    final_dir: str | None
    tokens_per_s: float


def _test_hook(name: str, step: int) -> None:
    """Fault injection for the resume tests: RINGFT_TEST_KILL=<point>:<step>:<rank>."""
    spec = os.environ.get("RINGFT_TEST_KILL")
    if not spec:
        return
    point, at_step, at_rank = spec.split(":")
    if (
        point == name
        and int(at_step) == step
        and int(at_rank) == (dist.get_rank() if dist.is_initialized() else 0)
    ):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


class Trainer:
    """Builds everything from a :class:`Recipe` and runs the loop. See :func:`train`."""

    def __init__(self, recipe: Recipe, resume: bool = False, progress: bool = True):
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration

        self.recipe, self.resume, self.progress = recipe, resume, progress
        out = Path(recipe.checkpoint.output_dir)
        tracker = recipe.logging.tracker
        tracker = None if tracker in (None, "none") else tracker
        from accelerate.utils import InitProcessGroupKwargs

        handlers = []
        cpu = not torch.cuda.is_available()
        if cpu and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            raise RecipeError(
                "an FSDP launch config needs GPUs (accelerate runs FSDP only on accelerators; on CPU it "
                "would silently train without sharding): on CPU use recipes/accelerate/cpu_2proc.yaml, "
                "or a DeepSpeed ZeRO-3 config (DeepSpeed's CPU accelerator runs on gloo)"
            )
        if cpu and _deepspeed_launch():
            # DeepSpeed without a GPU (its CPU accelerator, e.g. the tests): accelerate's cpu=True
            # would silently drop DeepSpeed, and cpu=False finds no backend unless one is named.
            cpu = False
            handlers.append(InitProcessGroupKwargs(backend="gloo"))
        self.accelerator = Accelerator(
            cpu=cpu,  # without a GPU: gloo on CPU (accelerate's MULTI_CPU)
            kwargs_handlers=handlers,
            log_with=tracker,
            project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "logs")),
        )
        world = self.accelerator.num_processes
        validate(recipe, world_size=world)
        from accelerate.utils import DistributedType

        self.deepspeed = self.accelerator.distributed_type == DistributedType.DEEPSPEED
        if self.deepspeed:
            _configure_deepspeed(self.accelerator, recipe, world)
        self.device = self.accelerator.device
        self.layout = build_layout(recipe.parallel.cp_size, self.device.type)
        torch.manual_seed(recipe.train.seed)
        self.tokenizer = build_tokenizer(recipe)
        with _zero3_init(self.accelerator) if self.deepspeed else contextlib.nullcontext():
            model = build_model(recipe, vocab_size=len(self.tokenizer))
        if recipe.train.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        apply_ring_attention(model, self.layout.cp_group, recipe.model.attn_backend)
        if recipe.train.tiled_mlp_tokens:
            from ringft.tiled_mlp import enable_tiled_mlp

            enable_tiled_mlp(model, tile_tokens=recipe.train.tiled_mlp_tokens)
        if recipe.lora is not None:
            from peft import LoraConfig, get_peft_model

            lc = recipe.lora
            model = get_peft_model(
                model,
                LoraConfig(
                    r=lc.r,
                    lora_alpha=lc.alpha,
                    lora_dropout=lc.dropout,
                    target_modules=list(lc.target_modules),
                    task_type="CAUSAL_LM",
                ),
            )
            if recipe.train.gradient_checkpointing:
                model.enable_input_require_grads()
        model.train()
        self.model = model
        self.dataset = load_training_data(recipe, self.tokenizer)
        if len(self.dataset) == 0:
            raise RecipeError("the training dataset is empty")
        pad = self.tokenizer.pad_token_id
        pad = self.tokenizer.eos_token_id if pad is None else pad
        self.collator = RingDataCollator(
            self.layout.cp_rank, self.layout.cp_size, pad_token_id=pad, max_length=recipe.data.seq_len
        )
        t = recipe.train
        params = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=t.lr,
            betas=tuple(t.betas),
        )
        # The learning rate is a pure function of the step (set before each update, see _set_lr):
        # nothing to checkpoint, and it reaches whatever optimizer DeepSpeed puts in place of this
        # one (e.g. DeepSpeedCPUAdam under optimizer offload).
        self.lr_factor = lr_lambda(recipe)
        self.last_lr = t.lr * self.lr_factor(0)
        self.last_grad_norm: float | None = None  # before clipping; logged when known
        wrapped = CausalLMLoss(model, t.chunked_loss, t.loss_chunk_size, t.offload_activations)
        # Under DeepSpeed, ``self.wrapped`` is its engine (which also owns the optimizer step).
        self.wrapped, self.optimizer = self.accelerator.prepare(wrapped, optimizer)
        self.start_step = 0
        if resume:
            ckpts = complete_checkpoints(out)
            if ckpts:
                self.accelerator.load_state(str(ckpts[-1]))
                state = json.loads((ckpts[-1] / STATE_FILE).read_text())
                self.start_step = state["step"]
                self.accelerator.print(f"resumed from {ckpts[-1]} (step {self.start_step})")
            else:
                self.accelerator.print(
                    f"--resume: no complete checkpoint in {out}/checkpoints, starting fresh"
                )
        if tracker:
            self.accelerator.init_trackers(recipe.logging.project, config=_flat(recipe.to_dict()))

    # -- one optimizer step ------------------------------------------------------------------
    def _micro_batches(self, step: int) -> list[dict[str, Any]]:
        out = []
        for micro in range(self.recipe.train.grad_accum):
            idx = example_indices(step, micro, self.layout, self.recipe, len(self.dataset))
            batch = self.collator([self.dataset[i] for i in idx])
            out.append({k: (v.to(self.device) if torch.is_tensor(v) else v) for k, v in batch.items()})
        return out

    def _all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and self.layout.world_size > 1:
            value = value.clone()
            dist.all_reduce(value)
        return value

    def _set_lr(self, step: int) -> None:
        self.last_lr = self.recipe.train.lr * self.lr_factor(step)
        for group in self.optimizer.param_groups:
            group["lr"] = self.last_lr

    def train_step(self, step: int) -> tuple[float, int]:
        batches = self._micro_batches(step)
        # Valid targets of the whole global step: every CP rank of a replica counted the same
        # replica batch, so divide the world sum by cp_size.
        local = torch.tensor(float(sum(int(b["num_items_in_batch"]) for b in batches)), device=self.device)
        global_items = self._all_reduce(local) / self.layout.cp_size
        world = self.layout.world_size
        self._set_lr(step)
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            sync = i == len(batches) - 1
            # DDP skips the gradient all-reduce until the last micro-step; ZeRO reduces every
            # micro-step (no no_sync there) and is told the boundary below.
            skip_sync = not sync and not self.deepspeed
            ctx = self.accelerator.no_sync(self.wrapped) if skip_sync else contextlib.nullcontext()
            with ctx:
                loss = self.wrapped(
                    input_ids=batch["input_ids"],
                    position_ids=batch["position_ids"],
                    shift_labels=batch["shift_labels"],
                    num_items_in_batch=global_items,
                )
                if self.deepspeed:
                    # The engine averages gradients over the world (as DDP) and divides the loss by
                    # its gradient_accumulation_steps (= train.grad_accum, see _configure_deepspeed);
                    # it clips and steps at the boundary micro-step only.
                    engine = self.wrapped
                    engine.set_gradient_accumulation_boundary(is_boundary=sync)
                    engine.backward(loss * (world * len(batches)))
                    if sync:
                        engine.step()
                        self.last_grad_norm = _as_float(engine.get_global_grad_norm())
                else:
                    self.accelerator.backward(loss * world)  # DDP averages over the world
            loss_sum += loss.detach().float()
        if not self.deepspeed:
            if self.recipe.train.grad_clip:
                # The prepared module's parameters: under FSDP accelerate then clips with the global norm.
                clip = self.recipe.train.grad_clip
                norm = self.accelerator.clip_grad_norm_(self.wrapped.parameters(), clip)
                self.last_grad_norm = _as_float(norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        total_tokens = sum(b["input_ids"].numel() for b in batches) * world
        return float(self._all_reduce(loss_sum)), total_tokens

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> Path:
        """Write ``checkpoints/step-N`` atomically: into ``step-N.tmp``, then one rename."""
        root = Path(self.recipe.checkpoint.output_dir) / "checkpoints"
        final = root / f"{CHECKPOINT_PREFIX}{step:08d}"
        tmp = root / f"{final.name}.tmp"
        if self.accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(tmp))
        self.accelerator.wait_for_everyone()
        _test_hook("save", step)
        if self.accelerator.is_main_process:
            state = {"step": step, "recipe": self.recipe.to_dict(), "world_size": self.layout.world_size}
            with open(tmp / STATE_FILE, "w") as fh:
                json.dump(state, fh, indent=1, default=str)
                fh.flush()
                os.fsync(fh.fileno())
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in complete_checkpoints(root.parent)[: -max(1, self.recipe.checkpoint.keep)]:
                shutil.rmtree(old, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        return final

    def export(self) -> Path:
        """Save the final model (or LoRA adapter) and tokenizer to ``output_dir/final``."""
        final = Path(self.recipe.checkpoint.output_dir) / "final"
        from accelerate.utils import DistributedType

        # Sharded weights (FSDP, ZeRO-3) are gathered into a full state dict first (a collective).
        state = None
        if self.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            full = self.accelerator.get_state_dict(self.wrapped)
            if full is not None:  # (DeepSpeed returns it on the main process only)
                state = {k.removeprefix("model."): v for k, v in full.items()}
        if self.accelerator.is_main_process:
            model = self.accelerator.unwrap_model(self.wrapped).model
            from ringft.hf import remove_ring_attention

            remove_ring_attention(model)  # saved configs name a standard attention implementation
            model.save_pretrained(str(final), state_dict=state)
            if hasattr(model, "get_base_model"):
                # A LoRA adapter: also save the base config with this run's RoPE / context
                # overrides, so the adapter is evaluated with the theta it was trained at.
                model.get_base_model().config.save_pretrained(str(final))
            apply_ring_attention(model, self.layout.cp_group, self.recipe.model.attn_backend)
            self.tokenizer.save_pretrained(str(final))
            (final / "ringft_recipe.json").write_text(
                json.dumps(self.recipe.to_dict(), indent=1, default=str)
            )
        self.accelerator.wait_for_everyone()
        return final

    def _append_metrics(self, row: dict[str, Any]) -> None:
        """``output_dir/metrics.jsonl``, one line per logged step (main process; with any tracker)."""
        if self.accelerator.is_main_process:
            path = Path(self.recipe.checkpoint.output_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as fh:
                fh.write(json.dumps(row) + "\n")

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> TrainResult:
        from tqdm.auto import tqdm

        t, ck = self.recipe.train, self.recipe.checkpoint
        losses: list[float] = []
        bar = tqdm(
            total=t.max_steps,
            initial=self.start_step,
            desc="train",
            dynamic_ncols=True,
            disable=not (self.progress and self.accelerator.is_main_process),
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
                if self.last_grad_norm is not None:
                    metrics["grad_norm"] = self.last_grad_norm
                self.accelerator.log(metrics, step=step + 1)
                self._append_metrics({"step": step + 1, **metrics})
            _test_hook("step", step + 1)
            if ck.save_every and (step + 1) % ck.save_every == 0 and step + 1 < t.max_steps:
                self.save_checkpoint(step + 1)
        bar.close()
        wall = time.perf_counter() - started
        self.save_checkpoint(t.max_steps)
        final = self.export()
        self.accelerator.end_training()
        tps = tokens_done / wall if wall > 0 else 0.0
        if losses:
            self.accelerator.print(
                f"ringft: {t.max_steps} steps (dp={self.layout.dp_size} x cp={self.layout.cp_size}), "
                f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, {tps:,.0f} tokens/s, "
                f"peak {peak_memory_gb(self.device):.2f} GB/rank, model saved to {final}"
            )
        return TrainResult(t.max_steps, losses, str(final), tps)


def _as_float(value: Any) -> float | None:
    if value is None:
        return None
    return float(value.item() if torch.is_tensor(value) else value)


def _deepspeed_launch() -> bool:
    """Launched with a DeepSpeed accelerate config (``accelerate launch`` sets this variable)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


@contextlib.contextmanager
def _zero3_init(accelerator):
    """Build the model under ``deepspeed.zero.Init`` only when the launch config's
    ``zero3_init_flag`` asks for it. (accelerate registers the ZeRO-3 config with transformers
    whatever the flag, so transformers would partition at construction anyway.) Without it every
    rank builds the full model and the engine partitions it: a model built from config then gets
    exactly the one-process initialisation (under zero.Init its random init differs)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin.is_zero3_init_enabled():
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def _configure_deepspeed(accelerator, recipe: Recipe, world: int) -> None:
    """Fill the DeepSpeed config from the recipe before ``prepare`` (which has no dataloader here).

    The recipe is the one source of truth for the batch layout and clipping: DeepSpeed's micro batch
    = ``train.micro_batch_size``, its gradient accumulation = ``train.grad_accum`` (the trainer
    feeds the micro-steps and marks the boundary), clipping = ``train.grad_clip``. Its
    ``train_batch_size`` counts every rank (DeepSpeed sees dp x cp ranks as data parallel; the CP
    ranks of a replica share examples, so that is ``cp`` times the examples actually consumed).
    """
    plugin = accelerator.state.deepspeed_plugin
    cfg = plugin.deepspeed_config
    t = recipe.train
    given = cfg.get("gradient_clipping")
    if given not in (None, "auto") and t.grad_clip and float(given) != float(t.grad_clip):
        accelerator.print(
            f"ringft: DeepSpeed config gradient_clipping={given} replaced by the recipe's "
            f"train.grad_clip={t.grad_clip}"
        )
    cfg["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    cfg["gradient_accumulation_steps"] = t.grad_accum
    cfg["train_batch_size"] = t.micro_batch_size * t.grad_accum * world
    cfg["gradient_clipping"] = float(t.grad_clip or 0.0)
    accelerator.gradient_accumulation_steps = t.grad_accum


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def train(recipe: Recipe, resume: bool = False, progress: bool = True) -> TrainResult:
    """Train with a recipe (call under ``accelerate launch`` for several processes)."""
    return Trainer(recipe, resume=resume, progress=progress).run()
