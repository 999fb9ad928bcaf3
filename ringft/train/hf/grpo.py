"""``RingGRPOTrainer``: TRL's ``GRPOTrainer`` with exact zigzag ring attention (CP) x DP.

::

    trainer = RingGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...),
                              train_dataset=prompts, cp_size=4)

A DP replica (its CP group) reads one process's prompts (:class:`RingScoringMixin`'s dataloaders).
Generation stays TRL's: every rank generates from its replica's prompts with the plain attention
(the ring is switched off for ``generate``), then the CP group's first rank broadcasts its
completions (and sampling log-probs) to the group, and the torch RNG state is made the CP group's
first rank's at each generation, so every CP rank scores, rewards and shuffles the same rows.
Rewards are gathered and advantages sliced over the DP group (``process_index = dp_rank``,
``num_processes = dp`` inside TRL's scoring and loss), so group normalisation sees each prompt's
``num_generations`` completions once. The per-token log-probs of the policy, the old policy and
the reference run on the ring through TRL's fused LM head (:mod:`ringft.train.hf.fused`: the
left-padded prompt + completion rows are left-aligned for the ring); TRL's ``_compute_loss`` then
runs unchanged: every loss type (grpo, bnpo, dr_grpo, dapo, luspo, cispo, sapo, vespo), the KL term,
the clipped ratio and the logged metrics are the one-process ones.

``generation_batch_size`` counts DP replicas: ``per_device_train_batch_size x dp x
steps_per_generation`` (GRPOConfig computes it from the world size; it is recomputed here).

Refused at construction (one line, every rank): ``use_liger_kernel``, ``vllm_mode="colocate"``,
``use_transformers_continuous_batching``, ``tools`` / ``environment_factory`` / ``rollout_func``
(they run per process), vision-language models, MoE router auxiliary losses, prompt-learning PEFT.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import trl.trainer.grpo_trainer as grpo_module
from trl import GRPOTrainer

from ringft.ops.parallel import ParallelLayout
from ringft.train.hf.checks import WHERE, scoring_problems
from ringft.train.hf.data import gather_over_dp
from ringft.train.hf.fused import unwrap_engine
from ringft.train.hf.trl_ring import RingScoringMixin, dp_gathers

__all__ = ["RingGRPOTrainer"]

_VIEWS: dict[type, type] = {}


def _grpo_problems(trainer: Any) -> list[str]:
    args, problems = trainer.args, []
    if args.use_liger_kernel:
        problems.append("use_liger_kernel=True: Liger's kernels are not checked on the ring: set it False")
    if trainer.use_vllm and trainer.vllm_mode == "colocate":
        problems.append("vllm_mode='colocate' is not supported: use vllm_mode='server' or HF generate")
    if getattr(trainer, "use_transformers_continuous_batching", False):
        problems.append("use_transformers_continuous_batching is not supported: use HF generate")
    if trainer.tools or trainer.environment_factories is not None or trainer.rollout_func is not None:
        problems.append(
            "tools / environment_factory / rollout_func run on every process and may differ between CP "
            "ranks: drop them"
        )
    if getattr(trainer, "_is_vlm", False):
        problems.append("vision-language models (images) cannot be sharded for the ring: use a text model")
    return problems + scoring_problems(trainer)


def _dp_class(cls: type) -> type:
    """``cls`` with ``process_index`` / ``num_processes`` read from ``_ringft_dp`` (dp_rank, dp)."""
    if cls not in _VIEWS:
        _VIEWS[cls] = type(
            f"RingDP{cls.__name__}",
            (cls,),
            {
                "process_index": property(lambda self: self._ringft_dp[0]),
                "num_processes": property(lambda self: self._ringft_dp[1]),
            },
        )
    return _VIEWS[cls]


def _gather_object_dp(obj: Any, layout: ParallelLayout) -> Any:
    """accelerate's ``gather_object`` over the DP group (lists concatenated in DP-rank order)."""
    if layout.dp_size == 1:
        return obj
    out: list[Any] = [None] * layout.dp_size
    dist.all_gather_object(out, obj, group=layout.dp_group)
    return [x for part in out for x in part]


@contextlib.contextmanager
def dp_view(accelerator: Any, layout: ParallelLayout) -> Iterator[None]:
    """TRL's GRPO scoring as one ``dp``-process run: ``accelerator.process_index`` / ``num_processes``
    / ``gather`` / ``gather_for_metrics`` / ``reduce`` and grpo_trainer's ``gather`` /
    ``gather_object`` over the DP group (re-entrant; undone after)."""
    cls = type(accelerator)
    if cls in _VIEWS.values():
        yield
        return
    saved = grpo_module.gather, grpo_module.gather_object
    accelerator._ringft_dp = (layout.dp_rank, layout.dp_size)
    accelerator.__class__ = _dp_class(cls)
    grpo_module.gather = lambda data: gather_over_dp(data, layout, gradient_state=None)
    grpo_module.gather_object = lambda obj: _gather_object_dp(obj, layout)
    try:
        with dp_gathers(accelerator, layout):
            yield
    finally:
        accelerator.__class__ = cls
        grpo_module.gather, grpo_module.gather_object = saved


@contextlib.contextmanager
def world_view(accelerator: Any) -> Iterator[None]:
    """Undo :func:`dp_view` for the duration (generation: vLLM slices by the world's process index)."""
    view = type(accelerator)
    if view not in _VIEWS.values():
        yield
        return
    names = ("gather", "gather_for_metrics", "reduce")
    shadows = {k: accelerator.__dict__.pop(k) for k in names if k in accelerator.__dict__}
    accelerator.__class__ = view.__mro__[1]
    try:
        yield
    finally:
        accelerator.__class__ = view
        accelerator.__dict__.update(shadows)


def cp_broadcast(obj: Any, layout: ParallelLayout) -> Any:
    """``obj`` of the CP group's first rank, on every rank of the group (picklable objects)."""
    if layout.cp_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(layout.cp_group, 0), group=layout.cp_group)
    return box[0]


class RingGRPOTrainer(RingScoringMixin, GRPOTrainer):
    """TRL's ``GRPOTrainer`` on the ring: the keywords of :class:`ringft.RingTrainerMixin`
    (``cp_size``, ``ulysses_size``, ``attn_backend``, ...), every other argument TRL's."""

    def __init__(self, *args: Any, **kwargs: Any):
        cp_size = kwargs.get("cp_size", 1)
        config = (
            kwargs.get("args") if kwargs.get("args") is not None else (args[2] if len(args) > 2 else None)
        )
        if isinstance(cp_size, int) and cp_size > 1 and config is not None:
            dp = max(config.world_size // cp_size, 1)
            config.generation_batch_size = (
                config.per_device_train_batch_size * dp * config.steps_per_generation
            )
        super().__init__(*args, **kwargs)
        if self._ring is None:
            return
        problems = _grpo_problems(self)
        if config is not None and config.generation_batch_size % self.num_generations:
            problems.append(
                f"generation_batch_size {config.generation_batch_size} (per_device_train_batch_size x dp x "
                f"steps_per_generation) must be a multiple of num_generations {self.num_generations}"
            )
        if problems:
            raise ValueError(f"{WHERE}: " + "; ".join(problems))

    # -- generation: TRL's, once per CP group ------------------------------------------------------
    def _ring_sync_rng(self) -> None:
        """The CP group's first rank's torch RNG state on every rank of the group."""
        layout = self._ring.layout
        cuda = torch.cuda.is_available() and self.accelerator.device.type == "cuda"
        state = cp_broadcast((torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None), layout)
        torch.set_rng_state(state[0])
        if cuda:
            torch.cuda.set_rng_state(state[1])

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        if self._ring is None:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        from ringft.model.patch import remove_ring_attention

        remove_ring_attention(unwrap_engine(self.model))  # generate with the model's own attention
        try:
            with world_view(self.accelerator):
                out = super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images
                )
        finally:
            self._ring_install(self.model)
        return cp_broadcast(out, self._ring.layout)

    # -- scoring and loss over the DP group ---------------------------------------------------------
    def _prepare_inputs(self, generation_batch: Any) -> Any:
        if self._ring is None:
            return super()._prepare_inputs(generation_batch)
        self._ring_sync_rng()
        with dp_view(self.accelerator, self._ring.layout):
            return super()._prepare_inputs(generation_batch)

    def _compute_loss(self, model: Any, inputs: Any) -> torch.Tensor:
        if self._ring is None:
            return super()._compute_loss(model, inputs)
        with dp_view(self.accelerator, self._ring.layout):
            return super()._compute_loss(model, inputs)
