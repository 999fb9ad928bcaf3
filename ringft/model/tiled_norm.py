"""Tiled RMSNorm: run the hidden-size RMSNorms of a supported family over token tiles.

An RMSNorm on bf16 activations computes in fp32: transformers' ``LlamaRMSNorm`` keeps an fp32 copy
of its input for the backward (``4 h`` bytes per token), and its backward holds five fp32
``(tokens, h)`` temporaries at once (the product's input grad, the mean's expanded grad, ``pow``'s
``x``, ``2 x`` and ``grad * 2 x``), measured on an H200 as the largest moment of a LoRA step with
offloaded activations (benchmarks/RESULTS.md, "Planner against measured memory"). Tiled
(:mod:`ringft.model.token_tiles`), the norm keeps only views of its input and recomputes each tile
in the backward, so those tensors exist for one tile of ``tile_tokens`` at a time: per norm
``4 h + 4`` bytes per token fewer saved, and ``5 * 4 h`` per token of the backward's temporaries
become ``5 * 4 h * tile_tokens`` in all.

Exactness: every row is normalised by the same code on the same values; only the norm weight's
gradient (full fine-tuning) is summed tile by tile (fp32 reordering).

Which norms: the RMSNorm modules of the supported families whose weight has ``hidden_size``
entries (the decoder layers' norms, Gemma 3's four per layer, the final norm, OLMo 2's q norm);
per-head q/k norms (Qwen 3, Gemma 3) are small and left as they are. Not under DeepSpeed ZeRO-3,
which gathers a module's partitioned weight in hooks of its own ``forward`` call, which a tile's
recompute does not go through (the trainer refuses that combination); FSDP unshards per decoder
layer, around the recompute.
"""

from __future__ import annotations

from torch import nn

from ringft.model.token_tiles import tile_modules, untile_modules
from ringft.model.unwrap import pretrained_model

__all__ = ["enable_tiled_norm", "disable_tiled_norm", "is_tiled_norm", "norm_modules"]

_STATE = "_ringft_tiled_norm"
_NORM_CLASSES = (
    "LlamaRMSNorm",
    "MistralRMSNorm",
    "Qwen2RMSNorm",
    "Qwen3RMSNorm",
    "Gemma3RMSNorm",
    "Phi3RMSNorm",
    "Olmo2RMSNorm",
)


def _entries(weight) -> int:
    return int(getattr(weight, "ds_numel", weight.numel()))  # ZeRO-3 partitioned: the full count


def norm_modules(model: nn.Module) -> list[nn.Module]:
    """The hidden-size RMSNorm modules of ``model`` (peft-wrapped models included)."""
    hidden = getattr(getattr(pretrained_model(model), "config", None), "hidden_size", None)
    return [
        m
        for m in model.modules()
        if type(m).__name__ in _NORM_CLASSES
        and isinstance(getattr(m, "weight", None), nn.Parameter)
        and _entries(m.weight) == hidden
    ]


def is_tiled_norm(model: nn.Module) -> bool:
    """Whether any norm module of ``model`` is currently tiled."""
    return any(hasattr(m, _STATE) for m in norm_modules(model))


def enable_tiled_norm(model: nn.Module, tile_tokens: int = 8192) -> nn.Module:
    """Compute every hidden-size RMSNorm of ``model`` over tiles of ``tile_tokens`` tokens.

    Idempotent (a second call updates the tile size); undo with :func:`disable_tiled_norm`.
    Returns ``model``. Raises ``ValueError`` if the model has no such norm or ``tile_tokens < 1``.
    """
    modules = norm_modules(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no hidden-size RMSNorm of a supported family "
            f"({', '.join(_NORM_CLASSES)}); the tiled norm supports the families of ringft.model.families"
        )
    tile_modules(modules, _STATE, None, tile_tokens)
    return model


def disable_tiled_norm(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_tiled_norm` (no-op for modules that are not tiled). Returns ``model``."""
    untile_modules(norm_modules(model), _STATE)
    return model
