"""(Test-only.) A process of ``accelerate launch --config_file recipes/accelerate/fsdp.yaml`` (FSDP1) or
``fsdp2.yaml`` (FSDP2), emulated on CPU / gloo for ``ringft train``'s Trainer engine.

accelerate enables FSDP only on accelerators, and ``ringft train`` refuses an FSDP launch without
GPUs (:func:`ringft.train.front_launch.prepare_launch`: on CPU accelerate would silently train
unsharded). Inside :func:`fsdp_launch` this process has the environment ``accelerate launch`` gives
a training process for the shipped config (accelerate's own parsing of the yaml: ``FSDP_*``,
``ACCELERATE_USE_FSDP``, ``ACCELERATE_MIXED_PRECISION``), the refusal sees GPUs, and each Trainer's
(gloo, MULTI_CPU) Accelerator is switched to FSDP with the plugin read from that environment once it
is built, as accelerate sets it up on GPUs: ``prepare`` then shards with accelerate's own FSDP1 /
FSDP2 code, the Trainer saves and loads its FSDP checkpoints, and ``ringft train`` runs unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "accelerate"


def launch_environment(config: str, mixed_precision: str | None = None) -> dict[str, str]:
    """The variables ``accelerate launch --config_file recipes/accelerate/<config>`` adds to a
    training process's environment (``mixed_precision`` replaces the config's when given)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    argv = ["--config_file", str(CONFIGS / config), "train.py"]
    if mixed_precision is not None:
        argv[2:2] = ["--mixed_precision", mixed_precision]
    args = _validate_launch_command(launch_command_parser().parse_args(argv))[0]
    env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_")) and os.environ.get(k) != v}


def fsdp_plugin() -> Any:
    """The FSDP plugin of this process's launch environment, with its mixed precision (as the
    Accelerator builds it on GPUs), less FSDP1's ``sync_module_states``: torch broadcasts rank 0's
    weights at wrap time only from accelerator memory; every rank here loads the same weights."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    with mock.patch.dict(os.environ, {"FSDP_SYNC_MODULE_STATES": "false"}):
        plugin = FullyShardedDataParallelPlugin()
    mixed = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if mixed != "no":
        plugin.set_mixed_precision(mixed)
    return plugin


class Record:
    """What the emulated launch saw: ``no_sync`` entries; per training micro-step the gradient
    entries this rank held after it (local shards; every entry of a gradient not yet sharded); the
    dtypes of the losses the training steps returned; the Trainers built."""

    def __init__(self) -> None:
        self.no_sync = 0
        self.held: list[int] = []
        self.loss_dtypes: set[str] = set()
        self.trainers: list[Any] = []


def _held(model: torch.nn.Module) -> int:
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return sum(g.to_local().numel() if isinstance(g, DTensor) else g.numel() for g in grads)


@contextlib.contextmanager
def fsdp_launch(config: str, mixed_precision: str | None = None) -> Iterator[Record]:
    """Inside: this process is a rank of an FSDP launch of ``config`` (see the module docstring);
    yields the :class:`Record` of the Trainers built inside. The environment is restored on exit."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp._flat_param import FlatParamHandle
    from transformers import Trainer

    import ringft.train.front as front

    record = Record()
    real_prepare, real_create = front.prepare_launch, Trainer.create_accelerator_and_postprocess
    real_no_sync, real_step = Accelerator.no_sync, Trainer.training_step

    def prepare_launch(recipe: Any, is_main: bool) -> dict[str, Any]:
        with mock.patch.object(torch.cuda, "is_available", return_value=True):  # (the refusal only)
            return real_prepare(recipe, is_main)

    def create(self: Any) -> None:
        with mock.patch.dict(os.environ, {"ACCELERATE_USE_FSDP": "false"}):  # (its plugin needs GPUs)
            real_create(self)
        for state in (self.accelerator.state, PartialState()):  # (AcceleratorState copies PartialState's)
            state.distributed_type = DistributedType.FSDP
            state.device = torch.device("cpu")  # (not gloo's "cpu:0": FSDP1 compares it with the module's)
        self.accelerator.state.fsdp_plugin = fsdp_plugin()
        self.is_fsdp_enabled = True
        record.trainers.append(self)

    @contextlib.contextmanager
    def no_sync(self: Any, model: Any) -> Iterator[None]:
        record.no_sync += 1
        with real_no_sync(self, model):
            yield

    def training_step(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        loss = real_step(self, model, *args, **kwargs)
        record.held.append(_held(model))
        record.loss_dtypes.add(str(loss.dtype))
        return loss

    saved = dict(os.environ)
    os.environ.update(launch_environment(config, mixed_precision))
    try:
        with (
            # FSDP1's full state dict "offloaded to CPU" from a CPU device: the move is a no-op, and
            # torch then frees the unsharded storage the state dict still points into
            mock.patch.object(FlatParamHandle, "to_cpu", lambda self: contextlib.nullcontext()),
            mock.patch.object(front, "prepare_launch", prepare_launch),
            mock.patch.object(Trainer, "create_accelerator_and_postprocess", create),
            mock.patch.object(Accelerator, "no_sync", no_sync),
            mock.patch.object(Trainer, "training_step", functools.wraps(real_step)(training_step)),
        ):
            yield record
    finally:
        os.environ.clear()
        os.environ.update(saved)
