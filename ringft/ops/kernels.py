"""Local block attention backends: the interface, and the choice of one by name.

Every backend implements the same two calls on one block of queries against one block of keys:

    forward(q, k, v, causal, softmax_scale)                      -> (out, lse)
    backward(dout, q, k, v, out, lse, causal, softmax_scale)     -> (dq, dk, dv)

Layouts: ``q``/``out``/``dout``/``dq`` are ``(batch, seq_q, heads_q, head_dim)``; ``k``/``v`` and
their grads are ``(batch, seq_k, heads_kv, head_dim)`` with ``heads_q % heads_kv == 0`` (GQA/MQA);
``lse`` is ``(batch, heads_q, seq_q)``, natural log, fp32 (fp64 for fp64 inputs). ``out`` keeps the
input dtype. ``backward`` takes an *externally merged* ``out``/``lse`` (the result over all keys, not
just this block), which is what makes the ring backward exact. ``causal`` is only used with
``seq_q == seq_k`` (the diagonal block), so top-left vs bottom-right alignment never matters.

Backends: ``reference`` (:mod:`ringft.ops.reference`), ``torch`` (:mod:`ringft.ops.torch_backend`),
``flash_attn`` (:mod:`ringft.ops.flash_backend`); ``auto`` picks flash_attn on CUDA when it will
work, torch otherwise.
"""

from __future__ import annotations

import functools
import importlib
import math
import warnings
from typing import Protocol

import torch

from ringft.ops.flash_backend import FlashAttnBackend
from ringft.ops.reference import ReferenceBackend
from ringft.ops.torch_backend import TorchBackend

Tensor = torch.Tensor

__all__ = [
    "BACKENDS",
    "BlockAttention",
    "FlashAttnBackend",
    "ReferenceBackend",
    "TorchBackend",
    "auto_backend_choice",
    "default_softmax_scale",
    "get_backend",
]

BACKENDS = ("auto", "torch", "flash_attn", "reference")


class BlockAttention(Protocol):
    """Interface of a local block attention backend (see the module docstring for layouts)."""

    name: str

    def check(self, q: Tensor) -> str | None:
        """Return why this backend cannot run on ``q`` (and how to fix it), or None."""

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float
    ) -> tuple[Tensor, Tensor]:
        """``(out (B, Sq, Hq, D), lse (B, Hq, Sq))``."""

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        softmax_scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq (B, Sq, Hq, D), dk (B, Sk, Hkv, D), dv (B, Sk, Hkv, D))``."""


def auto_backend_choice(
    device_type: str,
    dtype: torch.dtype | None,
    *,
    flash_installed: bool,
    flash_import_error: str | None,
    capability: tuple[int, int] | None,
) -> tuple[str, str | None]:
    """What ``auto`` runs on: ``(backend name, reason flash-attn was passed over or None)``.

    flash_attn only on CUDA, when it is installed, imports (its ``flash_attn_2_cuda`` extension
    loads), the GPU is sm80 or newer and the inputs are fp16/bf16; torch otherwise. The reason is
    None where flash-attn was never a candidate (CPU, not installed).
    """
    if device_type != "cuda" or not flash_installed:
        return "torch", None
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return "torch", (
            f"flash-attn needs fp16/bf16 inputs and these are {dtype} (model.dtype fp32 without "
            "mixed precision)"
        )
    if flash_import_error is not None:
        return "torch", f"flash-attn is installed but does not import ({flash_import_error})"
    if capability is not None and capability < (8, 0):
        return (
            "torch",
            "flash-attn 2 needs an sm80+ GPU (Ampere or newer), this one is "
            f"sm{capability[0]}{capability[1]}",
        )
    return "flash_attn", None


@functools.cache
def _flash_import_error() -> str | None:
    try:
        importlib.import_module("flash_attn.flash_attn_interface")  # loads flash_attn_2_cuda
    except Exception as exc:  # noqa: BLE001 - ImportError, OSError (undefined symbol), ...
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


_WARNED: set[str] = set()
# Backends are stateless apart from flash-attn's signature lookup: one instance each.
_INSTANCES: dict[str, BlockAttention] = {
    "torch": TorchBackend(),
    "flash_attn": FlashAttnBackend(),
    "reference": ReferenceBackend(),
}


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"attn_backend 'auto' uses 'torch': {reason}", RuntimeWarning, stacklevel=3)


def get_backend(name: str, device: torch.device, dtype: torch.dtype | None = None) -> BlockAttention:
    """The backend called ``name`` (one of :data:`BACKENDS`) for tensors on ``device``.

    ``auto`` is flash_attn where it will work (see :func:`auto_backend_choice`; pass the inputs'
    ``dtype``), else torch, with one warning per reason when flash-attn is installed but passed over.
    """
    if name == "auto":
        installed = device.type == "cuda" and FlashAttnBackend.is_available()
        name, reason = auto_backend_choice(
            device.type,
            dtype,
            flash_installed=installed,
            flash_import_error=_flash_import_error() if installed else None,
            capability=_capability(device.index or 0) if installed else None,
        )
        if reason:
            _warn_once(reason)
    backend = _INSTANCES.get(name)
    if backend is None:
        raise ValueError(f"unknown attention backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return backend


def default_softmax_scale(head_dim: int) -> float:
    """The usual softmax scale ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim)
