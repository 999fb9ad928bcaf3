"""Floating-point dtypes by name, and the accumulator dtype of every reduction in ringft.

One map for the whole package: recipes, the eval CLI, the planner and the benchmarks name dtypes
``fp32`` / ``bf16`` / ``fp16`` / ``fp64`` and turn them into torch dtypes here.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["DTYPES", "accumulator_dtype", "dtype_from_name", "dtype_name", "follow_autocast", "no_autocast"]

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}


def dtype_from_name(name: str, allowed: tuple[str, ...] | None = None) -> torch.dtype:
    """The torch dtype called ``name`` (one of :data:`DTYPES`, or of ``allowed`` when given).

    Raises ``ValueError`` naming the value and the accepted names.
    """
    choices = tuple(DTYPES) if allowed is None else allowed
    if name not in choices or name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(choices)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The short name (``fp32``, ``bf16``, ...) of a floating-point torch dtype."""
    for name, known in DTYPES.items():
        if known == dtype:
            return name
    raise ValueError(f"dtype {dtype} has no short name: ringft knows {', '.join(DTYPES)}")


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of sums, log-sum-exps and merged partial results for inputs of ``dtype``.

    fp64 for fp64 inputs, fp32 for everything else (bf16 / fp16 / fp32).
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def follow_autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The floating-point ``tensors`` cast to the autocast dtype when autocast is on for their
    device (as ``scaled_dot_product_attention`` does), unchanged otherwise. Any shapes."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """A context in which autocast is off for ``device_type`` (a no-op when it already is)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
