"""Tiled MLP: run the gated MLP of a supported family over token tiles, each under a checkpoint.

The MLP ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` is the largest activation of a decoder
layer: ``gate``, ``act_fn(gate)``, ``up`` and their product are ``tokens x intermediate`` each
(``intermediate ~ 3.5 * hidden``). The MLP is independent per token, so it can be computed over
slices of the (flattened) tokens without changing any value. :func:`enable_tiled_mlp` wraps the
forward of every MLP module so that each tile runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the forward keeps only the tile
inputs (views of the MLP input), and the backward recomputes one tile at a time, so the
``tokens x intermediate`` tensors of only one tile are alive at once in the forward and in the
backward.

Exactness: each token's output and each parameter's gradient contribution are computed by the same
kernels on the same values; only the gradient of the weights is accumulated tile by tile (a
different summation order of the fp32 partial sums over tokens), which changes results at the
level of fp32 rounding, not more.

Compatible with peft LoRA on the MLP projections (the projections are called through the original
forward, so their wrappers run unchanged) and with the model's own gradient checkpointing
(non-reentrant checkpoints nest).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["enable_tiled_mlp", "disable_tiled_mlp", "is_tiled_mlp", "mlp_modules"]

_STATE = "_ringft_tiled_mlp"
# The per-token gated MLPs (SwiGLU; Gemma 3: GeGLU; Phi-3: fused gate_up_proj) of the supported
# families (ringft.model.families): each is a plain ``forward(x)``, independent per token.
_MLP_CLASSES = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Gemma3MLP", "Phi3MLP", "Olmo2MLP")


class _TiledState:
    """What a wrapped MLP module remembers: the forward to restore and the tiling settings."""

    def __init__(self, original: Any, had_instance_forward: bool, num_tiles: int | None, tile_tokens: int):
        self.original = original
        self.had_instance_forward = had_instance_forward
        self.num_tiles = num_tiles
        self.tile_tokens = tile_tokens


def mlp_modules(model: nn.Module) -> list[nn.Module]:
    """The MLP modules of ``model`` (peft-wrapped models included) of a supported family."""
    return [m for m in model.modules() if type(m).__name__ in _MLP_CLASSES]


def is_tiled_mlp(model: nn.Module) -> bool:
    """Whether any MLP module of ``model`` is currently tiled."""
    return any(hasattr(m, _STATE) for m in mlp_modules(model))


def _tile_size(tokens: int, state: _TiledState) -> int:
    if state.num_tiles is not None:
        return max(1, math.ceil(tokens / state.num_tiles))
    return max(1, state.tile_tokens)


def _make_forward(module: nn.Module):
    def tiled_forward(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        state: _TiledState = getattr(module, _STATE)
        if args or kwargs:  # not the plain ``forward(x)`` of the LLaMA MLP: leave it alone
            return state.original(x, *args, **kwargs)
        flat = x.reshape(-1, x.shape[-1])
        tiles = torch.split(flat, _tile_size(flat.shape[0], state))
        if torch.is_grad_enabled():
            outs = [checkpoint(state.original, t, use_reentrant=False) for t in tiles]
        else:
            outs = [state.original(t) for t in tiles]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.view(*x.shape[:-1], out.shape[-1])

    return tiled_forward


def enable_tiled_mlp(model: nn.Module, num_tiles: int | None = None, tile_tokens: int = 8192) -> nn.Module:
    """Compute every MLP of ``model`` over token tiles (see the module docstring).

    Args:
        model: a transformers model of a supported family (or a peft wrapper of one).
        num_tiles: split the (batch x sequence) tokens of each MLP call into this many tiles;
            when given it overrides ``tile_tokens``.
        tile_tokens: tokens per tile (the last tile may be smaller).

    Idempotent: a second call updates the settings. Undo with :func:`disable_tiled_mlp`.
    Returns ``model``. Raises ``ValueError`` if the model has no supported MLP module.
    """
    if num_tiles is not None and num_tiles < 1:
        raise ValueError(f"num_tiles must be >= 1, got {num_tiles}")
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1, got {tile_tokens}")
    modules = mlp_modules(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no MLP module of a supported family ({', '.join(_MLP_CLASSES)}); "
            "the tiled MLP supports the families of ringft.model.families"
        )
    for module in modules:
        state: _TiledState | None = getattr(module, _STATE, None)
        if state is not None:
            state.num_tiles, state.tile_tokens = num_tiles, tile_tokens
            continue
        had_instance_forward = "forward" in module.__dict__
        state = _TiledState(module.forward, had_instance_forward, num_tiles, tile_tokens)
        setattr(module, _STATE, state)
        module.forward = _make_forward(module)
    return model


def disable_tiled_mlp(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_tiled_mlp` (no-op for modules that are not tiled). Returns ``model``."""
    for module in mlp_modules(model):
        state: _TiledState | None = module.__dict__.pop(_STATE, None)
        if state is None:
            continue
        if state.had_instance_forward:
            module.forward = state.original
        else:
            del module.forward
    return model
