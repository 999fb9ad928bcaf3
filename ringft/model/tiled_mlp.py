"""Tiled MLP: run the gated MLP of a supported family over token tiles, each under a checkpoint.

The MLP ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` is the largest activation of a decoder
layer: ``gate``, ``act_fn(gate)``, ``up`` and their product are ``tokens x intermediate`` each
(``intermediate ~ 3.5 * hidden``). The MLP is independent per token, so it can be computed over
slices of the (flattened) tokens without changing any value. :func:`enable_tiled_mlp` wraps the
forward of every MLP module (:mod:`ringft.model.token_tiles`) so that each tile runs under
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

from torch import nn

from ringft.model.token_tiles import tile_modules, untile_modules

__all__ = ["enable_tiled_mlp", "disable_tiled_mlp", "is_tiled_mlp", "mlp_modules"]

_STATE = "_ringft_tiled_mlp"
# The per-token gated MLPs (SwiGLU; Gemma 3: GeGLU; Phi-3: fused gate_up_proj) of the supported
# families (ringft.model.families): each is a plain ``forward(x)``, independent per token.
# The sparse MoE blocks (Mixtral, Qwen3-MoE) are not tiled (Qwen3-MoE's dense layers and Llama 4's
# dense layers and shared experts are).
_MLP_CLASSES = (
    "LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Gemma3MLP", "Phi3MLP", "Olmo2MLP", "Olmo3MLP",
    "SmolLM3MLP", "Ministral3MLP", "Qwen3MoeMLP", "Llama4TextMLP",
)  # fmt: skip


def mlp_modules(model: nn.Module) -> list[nn.Module]:
    """The MLP modules of ``model`` (peft-wrapped models included) of a supported family."""
    return [m for m in model.modules() if type(m).__name__ in _MLP_CLASSES]


def is_tiled_mlp(model: nn.Module) -> bool:
    """Whether any MLP module of ``model`` is currently tiled."""
    return any(hasattr(m, _STATE) for m in mlp_modules(model))


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
    modules = mlp_modules(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no MLP module of a supported family ({', '.join(_MLP_CLASSES)}); "
            "the tiled MLP supports the families of ringft.model.families"
        )
    tile_modules(modules, _STATE, num_tiles, tile_tokens)
    return model


def disable_tiled_mlp(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_tiled_mlp` (no-op for modules that are not tiled). Returns ``model``."""
    untile_modules(mlp_modules(model), _STATE)
    return model
