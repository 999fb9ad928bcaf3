"""Run a per-token module's ``forward(x)`` over token tiles, each tile under a checkpoint.

For a module whose output row depends only on the same input row (an MLP, an RMSNorm), the
(flattened) rows can be computed in tiles without changing any value. :func:`tile_modules` wraps
the forward of each module so that every tile runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the forward keeps only the tile
inputs (views of the module's input), and the backward recomputes one tile at a time, so the
module's intermediate tensors exist for one tile at a time in the forward and in the backward.
Only the parameters' gradients are accumulated tile by tile (another summation order of fp32
partial sums over tokens: fp32 rounding, not more).

Used by :mod:`ringft.model.tiled_mlp` and :mod:`ringft.model.tiled_norm`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ringft.utils.values import as_integer

__all__ = ["tile_modules", "untile_modules"]


class _TiledState:
    """What a wrapped module remembers: the forward to restore and the tiling settings."""

    def __init__(self, original: Any, had_instance_forward: bool, num_tiles: int | None, tile_tokens: int):
        self.original = original
        self.had_instance_forward = had_instance_forward
        self.num_tiles = num_tiles
        self.tile_tokens = tile_tokens


def _tile_size(rows: int, state: _TiledState) -> int:
    if state.num_tiles is not None:
        return max(1, math.ceil(rows / state.num_tiles))
    return max(1, state.tile_tokens)


def _make_forward(module: nn.Module, attr: str):
    def tiled_forward(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        state: _TiledState = getattr(module, attr)
        if args or kwargs:  # not a plain ``forward(x)``: leave it alone
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


def tile_modules(modules: list[nn.Module], attr: str, num_tiles: int | None, tile_tokens: int) -> None:
    """Wrap each module's forward to run over row tiles (``attr`` names the state kept on it).

    ``num_tiles`` (when given) overrides ``tile_tokens`` (rows per tile; the last may be smaller).
    Idempotent: a second call updates the settings. Raises ``ValueError`` for a bad setting."""
    as_integer("num_tiles", num_tiles, 1, optional=True)
    as_integer("tile_tokens", tile_tokens, 1)
    for module in modules:
        state: _TiledState | None = getattr(module, attr, None)
        if state is not None:
            state.num_tiles, state.tile_tokens = num_tiles, tile_tokens
            continue
        had_instance_forward = "forward" in module.__dict__
        setattr(module, attr, _TiledState(module.forward, had_instance_forward, num_tiles, tile_tokens))
        module.forward = _make_forward(module, attr)


def untile_modules(modules: list[nn.Module], attr: str) -> None:
    """Undo :func:`tile_modules` (no-op for modules that are not tiled)."""
    for module in modules:
        state: _TiledState | None = module.__dict__.pop(attr, None)
        if state is None:
            continue
        if state.had_instance_forward:
            module.forward = state.original
        else:
            del module.forward
