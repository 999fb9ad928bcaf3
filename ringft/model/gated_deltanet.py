"""Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) on the zigzag ring.

A hybrid's ``linear_attention`` layers do not go through transformers' ``AttentionInterface``: their
forward calls two module-level functions of its modeling file, ``causal_conv1d_fn`` (the short
causal convolution over the q/k/v projections) and ``torch_chunk_gated_delta_rule`` (the
recurrence; transformers binds flash-linear-attention's ``chunk_gated_delta_rule`` there when it is
installed, else its torch path). On a rank's zigzag shard both would restart at the shard's edges.

:func:`prepare_linear_attention` therefore gives each such layer an instance ``forward`` that runs
transformers' own forward inside a context naming the layer's ring, and replaces those two names in
the modeling module (once) by dispatchers: outside that context they call the original functions
unchanged (an unpatched model of the same class is unaffected); inside it they run
:func:`ringft.ops.linear_scan.ring_causal_conv` (the halo exchange) and
:func:`ringft.ops.linear_scan.ring_gated_delta_rule` (the chunks' affine maps, exchanged and
composed) with the original kernel on each chunk, and with this forward's packed documents. The
projections, gates and norms stay transformers' code.

Refused by name: Ulysses x ring (``ulysses_size > 1``), a recurrent cache (``use_cache``,
``RingInference``), chunks shorter than ``linear_conv_kernel_dim - 1`` tokens.
"""

from __future__ import annotations

import contextvars
import functools
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch

from ringft.model.inputs import DOCUMENTS
from ringft.ops.linear_scan import (
    conv_reach,
    document_starts,
    halo_problem,
    ring_causal_conv,
    ring_gated_delta_rule,
)

__all__ = [
    "LINEAR_KERNELS",
    "linear_attention_modules",
    "linear_attention_problem",
    "prepare_linear_attention",
    "release_linear_attention",
]

LINEAR_KERNELS = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")
_ORIGINALS = "_ringft_linear_originals"  # modeling-module attribute: the functions the dispatchers wrap


@dataclass(frozen=True)
class _Active:
    spec: Any  # ringft.model.patch.RingSpec
    offsets: Any  # global document offsets per row, or None
    seq_len: int  # global


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("ringft_linear_layer", default=None)


def linear_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The Gated DeltaNet layers of ``model`` in layer order (a ``layer_idx``, a ``conv1d`` and the
    decay parameters ``A_log`` / ``dt_bias``)."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "layer_idx") and all(hasattr(m, a) for a in ("conv1d", "A_log", "dt_bias"))
    ]


def linear_attention_problem(model: torch.nn.Module, config: Any, ulysses_size: int) -> str | None:
    """Why the linear-attention layers of ``model`` cannot run on this ring exactly, or None."""
    kinds = list(getattr(config, "layer_types", None) or [])
    expected = kinds.count("linear_attention")
    found = len(linear_attention_modules(model))
    if found != expected:
        return (
            f"config.layer_types has {expected} linear_attention layers but the model has {found} Gated "
            "DeltaNet modules (layer_idx, conv1d, A_log, dt_bias): not the structure of transformers' "
            "Qwen3.5 / Qwen3-Next layers, which ringft runs on the ring"
        )
    if expected and ulysses_size > 1:
        return (
            f"ulysses_size={ulysses_size}: the linear-attention (Gated DeltaNet) layers of this hybrid run "
            "on the plain zigzag ring only; use ulysses_size 1"
        )
    return None


def _conv_dispatcher(original):
    @functools.wraps(original)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        active = _ACTIVE.get()
        if active is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        from transformers.activations import ACT2FN

        spec = active.spec
        reach = conv_reach(
            active.offsets, active.seq_len, spec.rank, spec.size, weight.shape[-1], hidden_states.device
        )
        out = ring_causal_conv(
            hidden_states, weight, bias, group=spec.group, rank=spec.rank, size=spec.size, reach=reach
        )
        out = out if activation is None else ACT2FN[activation](out)
        return out.to(hidden_states.dtype)

    return causal_conv1d_fn


def _rule_dispatcher(original):
    @functools.wraps(original)
    def torch_chunk_gated_delta_rule(query, key, value, *args, **kwargs):
        active = _ACTIVE.get()
        if active is None:
            return original(query, key, value, *args, **kwargs)
        if args or kwargs.get("initial_state") is not None or kwargs.get("output_final_state"):
            raise ValueError(
                "a Gated DeltaNet layer on the ring got a recurrent state or positional kernel arguments: "
                "ringft runs these layers from the zero state over the whole sequence only (no cache)"
            )
        spec = active.spec
        starts = document_starts(active.offsets, active.seq_len, spec.rank, spec.size)
        norm = kwargs.get("use_qk_l2norm_in_kernel", False)
        out = ring_gated_delta_rule(
            original, query, key, value, kwargs["g"], kwargs["beta"], group=spec.group, rank=spec.rank,
            size=spec.size, starts=starts, use_qk_l2norm_in_kernel=norm,
        )  # fmt: skip
        return out, None

    return torch_chunk_gated_delta_rule


def _install_dispatchers(module: types.ModuleType) -> None:
    if hasattr(module, _ORIGINALS):
        return
    originals = {name: getattr(module, name) for name in LINEAR_KERNELS}
    setattr(module, _ORIGINALS, originals)
    module.causal_conv1d_fn = _conv_dispatcher(originals["causal_conv1d_fn"])
    module.torch_chunk_gated_delta_rule = _rule_dispatcher(originals["torch_chunk_gated_delta_rule"])


def _ring_forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
    """The layer's transformers forward, with its kernels on the ring (see the module docstring)."""
    spec = self._ringft_ring
    if any(kwargs.get(key) is not None for key in ("cache", "cache_params", "past_key_values", "ring_cache")):
        raise ValueError(
            "the linear-attention (Gated DeltaNet) layers of this hybrid keep no cache on the ring: call the "
            "model with use_cache=False (RingInference does not support hybrids)"
        )
    seq_local = hidden_states.shape[1]
    problem = halo_problem(seq_local, self.conv1d.weight.shape[-1], spec.size)
    if problem:
        raise ValueError(problem)
    layout = kwargs.get(DOCUMENTS)
    offsets = None if layout is None else layout.offsets
    token = _ACTIVE.set(_Active(spec, offsets, seq_local * spec.size))
    try:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    finally:
        _ACTIVE.reset(token)


def prepare_linear_attention(model: torch.nn.Module, spec: Any) -> None:
    """Run every Gated DeltaNet layer of ``model`` on ``spec``'s ring (idempotent)."""
    for layer in linear_attention_modules(model):
        _install_dispatchers(sys.modules[type(layer).__module__])
        layer._ringft_ring = spec
        layer.forward = types.MethodType(_ring_forward, layer)


def release_linear_attention(model: torch.nn.Module) -> None:
    """Undo :func:`prepare_linear_attention` on ``model`` (the dispatchers stay: they pass through)."""
    for layer in linear_attention_modules(model):
        layer.__dict__.pop("forward", None)
        layer.__dict__.pop("_ringft_ring", None)
