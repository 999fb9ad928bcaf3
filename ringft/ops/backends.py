"""Block attention backends: the interface they implement (required and optional parts), and the
choice of one by name. The kernels themselves live in one module per backend.

Every backend implements the same two calls on one block of queries against one block of keys
(:class:`BlockAttention`):

    forward(q, k, v, causal, softmax_scale)                      -> (out, lse)
    backward(dout, q, k, v, out, lse, causal, softmax_scale)     -> (dq, dk, dv)

Layouts: ``q``/``out``/``dout``/``dq`` are ``(batch, seq_q, heads_q, head_dim)``; ``k``/``v`` and
their grads are ``(batch, seq_k, heads_kv, head_dim)`` with ``heads_q % heads_kv == 0`` (GQA/MQA);
``lse`` is ``(batch, heads_q, seq_q)``, natural log, fp32 (fp64 for fp64 inputs). ``out`` keeps the
input dtype. ``backward`` takes an *externally merged* ``out``/``lse`` (the result over all keys, not
just this block), which is what makes the ring backward exact. ``causal`` is only used with
``seq_q == seq_k`` (the diagonal block), so top-left vs bottom-right alignment never matters.

Optional capabilities, each its own Protocol, used when a backend has them: by packed documents
(:mod:`ringft.ops.document_blocks`), :class:`VarlenAttention` (causal attention inside each
document of a block in one call: flash-attn's varlen, the reference's mask) and
:class:`MaskedTileAttention` (aligned tiles in one batched call under an additive mask: torch on
CPU); by sliding windows (:mod:`ringft.ops.band`), :class:`WindowAttention` (a band of a block in
one call: flash-attn's ``window_size``, the reference's mask) or else ``MaskedTileAttention``.

Backends: ``reference`` (:mod:`ringft.ops.reference`), ``torch`` (:mod:`ringft.ops.torch_backend`),
``flash_attn`` (:mod:`ringft.ops.flash_backend`), ``cudnn`` (:mod:`ringft.ops.cudnn_backend`); ``auto``
picks cudnn on Hopper (sm90+) GPUs, else flash_attn, else cudnn, else torch, among those that will work
(:func:`auto_backend_choice`), and logs its choice once.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import warnings
from typing import Protocol, runtime_checkable

import torch

from ringft.ops.cudnn_backend import CudnnBackend
from ringft.ops.flash_backend import FlashAttnBackend
from ringft.ops.reference import ReferenceBackend
from ringft.ops.torch_backend import TorchBackend

Tensor = torch.Tensor

__all__ = [
    "BACKENDS",
    "BlockAttention",
    "CudnnBackend",
    "FlashAttnBackend",
    "MaskedTileAttention",
    "ReferenceBackend",
    "TorchBackend",
    "VarlenAttention",
    "WindowAttention",
    "auto_backend_choice",
    "default_softmax_scale",
    "get_backend",
]


_LOG = logging.getLogger(__name__)


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


@runtime_checkable
class VarlenAttention(Protocol):
    """Optional: causal attention inside each segment ``[bounds[i], bounds[i+1])`` of a block, in one
    call. q ``(B, S, Hq, D)``, k/v ``(B, S, Hkv, D)``, ``bounds = (0, ..., S)`` local offsets."""

    def forward_varlen(
        self, q: Tensor, k: Tensor, v: Tensor, bounds: tuple[int, ...], softmax_scale: float
    ) -> tuple[Tensor, Tensor]:
        """``(out (B, S, Hq, D), lse (B, Hq, S))``."""

    def backward_varlen(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        bounds: tuple[int, ...],
        softmax_scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` shaped like q, k, v, against the merged ``out``/``lse``."""


@runtime_checkable
class MaskedTileAttention(Protocol):
    """Optional: many small blocks in one batched call under an additive mask (0 or -inf, q's dtype,
    no row fully masked): q ``(T, tile, Hq, D)``, k/v ``(T, tile, Hkv, D)``, mask ``(T, 1, tile, tile)``."""

    def causal_tile(self, q: Tensor) -> int | None:
        """The tile size to cut causal blocks into for ``q``, or None for one call per document."""

    def band_tile(self, q: Tensor, window: int) -> int | None:
        """Query rows per strip of a sliding-window band (:mod:`ringft.ops.band`), or None to cover
        bands by unmasked and causal calls only."""

    def forward_masked(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, softmax_scale: float
    ) -> tuple[Tensor, Tensor]:
        """``(out (T, tile, Hq, D), lse (T, Hq, tile))``."""

    def backward_masked(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        mask: Tensor,
        softmax_scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` shaped like q, k, v."""


@runtime_checkable
class WindowAttention(Protocol):
    """Optional: a sliding-window band of a block in one call. q ``(B, Sq, Hq, D)``, k/v ``(B, Sk,
    Hkv, D)``; query row ``i`` sees key ``j`` iff ``0 <= i + offset - j <= window - 1`` (``offset``
    = position of row 0 minus position of key 0); the caller guarantees every row sees a key."""

    def forward_window(
        self, q: Tensor, k: Tensor, v: Tensor, offset: int, window: int, softmax_scale: float
    ) -> tuple[Tensor, Tensor]:
        """``(out (B, Sq, Hq, D), lse (B, Hq, Sq))``."""

    def backward_window(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        offset: int,
        window: int,
        softmax_scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` shaped like q, k, v, against the merged ``out``/``lse``."""


def auto_backend_choice(
    device_type: str,
    dtype: torch.dtype | None,
    *,
    flash_installed: bool,
    flash_import_error: str | None,
    capability: tuple[int, int] | None,
    cudnn_usable: bool = False,
) -> tuple[str, str | None]:
    """What ``auto`` runs on: ``(backend name, reason flash-attn was passed over or None)``.

    On CUDA: cudnn first on sm90+ (Hopper: cuDNN's fused attention measured faster than the
    ``torch`` backend's kernels, benchmarks/RESULTS.md) when ``cudnn_usable`` (fp16/bf16, head_dim a
    multiple of 8 and <= 128, cuDNN 9); else flash_attn when it is installed, imports (its
    ``flash_attn_2_cuda`` extension loads), the GPU is sm80+ and the inputs are fp16/bf16; else cudnn
    when usable; else torch. The reason is None where flash-attn was never a candidate (CPU, not
    installed, cudnn preferred).
    """
    if device_type != "cuda":
        return "torch", None
    if cudnn_usable and capability is not None and capability >= (9, 0):
        return "cudnn", None
    fallback = "cudnn" if cudnn_usable else "torch"
    if not flash_installed:
        return fallback, None
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return fallback, (
            f"flash-attn needs fp16/bf16 inputs and these are {dtype} (model.dtype fp32 without "
            "mixed precision)"
        )
    if flash_import_error is not None:
        return fallback, f"flash-attn is installed but does not import ({flash_import_error})"
    if capability is not None and capability < (8, 0):
        return (
            fallback,
            "flash-attn 2 needs an sm80+ GPU (Ampere or newer), this one is "
            f"sm{capability[0]}{capability[1]}",
        )
    return "flash_attn", None


@functools.cache
def _cudnn_version() -> int:
    if not torch.backends.cudnn.is_available():
        return 0
    return torch.backends.cudnn.version() or 0


def _cudnn_usable(device: torch.device, dtype: torch.dtype | None, head_dim: int | None) -> bool:
    """cuDNN attention will run: CUDA, cuDNN 9+, fp16/bf16, a supported head_dim, sm80+."""
    if device.type != "cuda" or dtype is None or head_dim is None or _cudnn_version() < 90000:
        return False
    return CudnnBackend.problem("cuda", dtype, head_dim, _capability(device.index or 0)) is None


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
    b.name: b for b in (TorchBackend(), FlashAttnBackend(), CudnnBackend(), ReferenceBackend())
}
# Every name the ``attn_backend`` option accepts: "auto" and each backend's own name.
BACKENDS: tuple[str, ...] = ("auto", *_INSTANCES)


_LOGGED: set[tuple[str, str]] = set()


def _warn_once(name: str, reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"attn_backend 'auto' uses {name!r}: {reason}", RuntimeWarning, stacklevel=3)


def _log_choice_once(device: torch.device, name: str) -> None:
    key = (str(device), name)
    if device.type == "cuda" and key not in _LOGGED:
        _LOGGED.add(key)
        _LOG.info("attn_backend 'auto' uses %r on %s", name, device)


def get_backend(
    name: str, device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> BlockAttention:
    """The backend called ``name`` (one of :data:`BACKENDS`) for tensors on ``device``.

    ``auto`` picks by :func:`auto_backend_choice` (pass the inputs' ``dtype`` and ``head_dim``; cudnn
    is a candidate only when both are given), logs its CUDA choice once at INFO, and warns once per
    reason when flash-attn is installed but passed over.
    """
    if name == "auto":
        installed = device.type == "cuda" and FlashAttnBackend.is_available()
        cudnn = _cudnn_usable(device, dtype, head_dim)
        name, reason = auto_backend_choice(
            device.type,
            dtype,
            flash_installed=installed,
            flash_import_error=_flash_import_error() if installed else None,
            capability=_capability(device.index or 0) if installed or cudnn else None,
            cudnn_usable=cudnn,
        )
        if reason:
            _warn_once(name, reason)
        _log_choice_once(device, name)
    backend = _INSTANCES.get(name)
    if backend is None:
        raise ValueError(f"unknown attention backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return backend


def default_softmax_scale(head_dim: int) -> float:
    """The usual softmax scale ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim)
