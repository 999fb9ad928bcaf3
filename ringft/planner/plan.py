"""One plan: a :class:`MemoryPlan` from a model and a :class:`TrainingSetup` (see :mod:`ringft.planner`)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from ringft.ops.ulysses import heads_problem
from ringft.planner.formulas import (
    checkpointed,
    layer_saved,
    layer_working_set,
    loss_working_set,
    model_states,
)
from ringft.planner.setup import GIB, MemoryPlan, TrainingSetup
from ringft.planner.shapes import ModelShape, load_model_shape

__all__ = ["build_plan", "plan_memory", "setup_options"]


def plan_memory(
    model: Any,
    seq_len: int,
    num_gpus: int,
    gpu_mem_gib: float,
    *,
    cp_size: int | None = None,
    **options: Any,
) -> MemoryPlan:
    """Predict the per-rank peak memory of one layout.

    Args:
        model: preset name, config dict, ``PretrainedConfig``, config.json path, model dir, or
            :class:`ModelShape`.
        seq_len: global sequence length ``S`` (a multiple of ``2 * cp_size``).
        num_gpus: ranks in the job; ``dp = num_gpus / cp_size``.
        gpu_mem_gib: memory of one GPU in GiB (an "80 GB" H100 has about 79.6 GiB).
        cp_size: context-parallel size (default ``num_gpus``).
        options: any other :class:`TrainingSetup` field (``lora``, ``zero_stage``,
            ``offload_optimizer``, ``chunked_loss``, ``tiled_mlp_tokens``, ``micro_batch_size``,
            ``attn_backend``, ``overhead_gib``, ...).

    Returns:
        the :class:`MemoryPlan` (bytes per rank; ``plan.total`` is the predicted peak).

    Raises:
        ValueError: a bad value (the message names it and the fix); TypeError: an unknown option.
    """
    shape = load_model_shape(model)
    setup = TrainingSetup(
        seq_len=seq_len,
        num_gpus=num_gpus,
        cp_size=num_gpus if cp_size is None else cp_size,
        gpu_mem_gib=gpu_mem_gib,
        **setup_options(options),
    )
    return build_plan(shape, setup)


def setup_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` checked against the :class:`TrainingSetup` fields (other than the layout's
    ``seq_len``, ``num_gpus``, ``cp_size``, ``gpu_mem_gib``); ``lora_targets`` made a tuple.

    Raises ``TypeError`` naming each unknown option and the closest known name.
    """
    allowed = {f.name for f in fields(TrainingSetup)} - {"seq_len", "num_gpus", "cp_size", "gpu_mem_gib"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, sorted(allowed), n=1, cutoff=0.6)
            hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
        raise TypeError(f"unknown option(s) {', '.join(hints)}; known: {', '.join(sorted(allowed))}")
    out = dict(options)
    if "lora_targets" in out:
        out["lora_targets"] = tuple(out["lora_targets"])
    return out


def build_plan(shape: ModelShape, setup: TrainingSetup) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``setup`` for ``shape``: every term of :mod:`ringft.planner.formulas`.

    Raises ``ValueError`` when ``setup.ulysses_size`` does not split the model's query heads."""
    heads = heads_problem(shape.heads, setup.ulysses_size, setup.cp_size) if setup.ulysses_size > 1 else None
    if heads:
        raise ValueError(heads)
    states = model_states(shape, setup)
    saved = layer_saved(shape, setup)
    work = layer_working_set(shape, setup, saved)
    loss = loss_working_set(shape, setup)
    ckpt = checkpointed(shape, setup, saved)
    if setup.gradient_checkpointing:
        layer_ws = max(work["mlp_phase"], work["norm_phase"], work["attention_phase"])
    else:  # the saved tensors are already counted as stored activations: transients only
        layer_ws = max(
            work["mlp_phase"] - sum(saved.values()),
            work["attention_phase"] - saved["norm1"] - saved["attention"] - saved["lora_attn"],
            work["norm_transients"],
        )
    details = {f"layer_saved.{k}": v for k, v in saved.items()}
    details.update({f"layer_ws.{k}": v for k, v in work.items()})
    details.update({f"loss.{k}": v for k, v in loss.items()})
    details.update({f"checkpointed.{k}": v for k, v in ckpt.items() if not k.startswith("cpu")})
    host = {
        "optimizer": states["cpu_optimizer"],
        "grads": states["cpu_grads"],
        "weights": states["cpu_weights"],
        "activations": ckpt["cpu"],
        "attention": ckpt["cpu_attention"],
    }
    details.update({f"host.{k}": v for k, v in host.items()})
    return MemoryPlan(
        model=shape,
        setup=setup,
        params_total=states["params_total"],
        params_trainable=states["params_trainable"],
        weights=states["weights"],
        grads=states["grads"],
        optimizer=states["optimizer"],
        zero3_gather=states["zero3_gather"],
        checkpointed_activations=ckpt["layers"] + ckpt["rope"] + ckpt["attention_saves"],
        layer_working_set=layer_ws,
        loss_working_set=sum(loss.values()),
        overhead=int(setup.overhead_gib * GIB),
        cpu_offloaded=sum(host.values()),
        details=details,
    )
