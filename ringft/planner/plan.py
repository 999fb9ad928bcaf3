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

    The layer working set is that of the layer kind (:meth:`ModelShape.layer_views`: Gemma 4's local
    and global layers, a hybrid's Gated DeltaNet and attention layers, a MoE model's dense layers)
    whose backward peaks highest; the details list that kind's terms.

    Raises ``ValueError`` when ``setup.ulysses_size`` does not split the model's query heads, or is
    above 1 for a model with Gated DeltaNet layers."""
    heads = heads_problem(shape.heads, setup.ulysses_size, setup.cp_size) if setup.ulysses_size > 1 else None
    if heads:
        raise ValueError(heads)
    if shape.linear_layers and setup.ulysses_size > 1:
        raise ValueError(
            f"ulysses_size={setup.ulysses_size}: the Gated DeltaNet layers of this hybrid run on the plain "
            "zigzag ring only; use ulysses_size 1"
        )
    states = model_states(shape, setup)
    loss = loss_working_set(shape, setup)
    layer_ws, saved, work = -1, {}, {}
    for view in shape.layer_views():  # the layer kind whose backward peaks highest
        v_saved = layer_saved(view, setup)
        v_work = layer_working_set(view, setup, v_saved)
        if setup.gradient_checkpointing:
            ws = max(v_work["mlp_phase"], v_work["norm_phase"], v_work["attention_phase"])
        else:  # the saved tensors are already counted as stored activations: transients only
            ws = max(
                v_work["mlp_phase"] - sum(v_saved.values()),
                v_work["attention_phase"] - v_saved["norm1"] - v_saved["attention"] - v_saved["lora_attn"],
                v_work["norm_transients"],
            )
        if ws > layer_ws:
            layer_ws, saved, work = ws, v_saved, v_work
    ckpt = checkpointed(shape, setup)
    details = {f"layer_saved.{k}": v for k, v in saved.items()}
    details.update({f"layer_ws.{k}": v for k, v in work.items()})
    details.update({f"loss.{k}": v for k, v in loss.items()})
    optional = ("shared_kv", "per_layer_inputs")  # Gemma 4's: listed where they exist
    shown = {k: v for k, v in ckpt.items() if not k.startswith("cpu") and (v or k not in optional)}
    details.update({f"checkpointed.{k}": v for k, v in shown.items()})
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
        checkpointed_activations=sum(v for k, v in ckpt.items() if not k.startswith("cpu")),
        layer_working_set=layer_ws,
        loss_working_set=sum(loss.values()),
        overhead=int(setup.overhead_gib * GIB),
        cpu_offloaded=sum(host.values()),
        details=details,
    )
