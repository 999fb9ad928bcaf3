"""The ``cudnn`` block backend: PyTorch's cuDNN fused attention (CUDA, no extra install).

Calls ``aten._scaled_dot_product_cudnn_attention`` (forward with the log-sum-exp) and
``aten._scaled_dot_product_cudnn_attention_backward`` (which takes an external ``out``/``lse``, so
the ring's merged result can be fed back). Both ship with every CUDA build of torch that links
cuDNN 9 (the ``nvidia-cudnn`` wheel torch depends on): nothing to compile. fp16/bf16 only,
``head_dim`` a multiple of 8 and <= 128, sm80 or newer.

GQA: the cuDNN graph takes K/V with fewer heads natively where the installed torch/cuDNN builds it;
the first GQA call probes that once and otherwise expands K/V heads locally (after communication),
as the ``torch`` backend does. Packed documents run as one causal call per document (no varlen
entry point), sliding windows as unmasked and causal calls (:mod:`ringft.ops.band`). Blocks of
fewer than ``MIN_BLOCK`` rows or keys run on the ``torch`` backend's kernels (cuDNN refuses 1 x 1).
"""

from __future__ import annotations

import torch

from ringft.ops.gqa import expand_kv_heads, reduce_kv_head_grads
from ringft.ops.torch_backend import TorchBackend

Tensor = torch.Tensor

__all__ = ["CudnnBackend"]

_MAX_HEAD_DIM = 128
# cuDNN refuses some tiny blocks ("s_q = s_kv = 1 is not supported", seen on an H100 with cuDNN 9.19
# in the sliding-window band's small squares); blocks with fewer rows or keys than this run on the
# ``torch`` backend's kernels instead (negligible work either way).
MIN_BLOCK = 8
_TORCH = TorchBackend()


def _tiny(q: Tensor, k: Tensor) -> bool:
    return min(q.shape[1], k.shape[1]) < MIN_BLOCK


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError)


class CudnnBackend:
    """Block attention with cuDNN's fused kernels; layouts as in :mod:`ringft.ops.backends`.

    ``forward(q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D), causal, softmax_scale)`` -> ``(out (B, Sq, Hq,
    D) in q's dtype, lse (B, Hq, Sq) fp32)``; ``backward`` takes the merged ``out``/``lse``.
    """

    name = "cudnn"

    def __init__(self) -> None:
        self.native_gqa: bool | None = None  # None: not probed yet
        self._lse_trailing_dim = True  # cuDNN's softmax stats are (B, H, S, 1); set by forward

    @staticmethod
    def problem(
        device_type: str, dtype: torch.dtype, head_dim: int, capability: tuple[int, int] | None
    ) -> str | None:
        """Why cuDNN attention cannot run on these inputs (and the fix), or None."""
        if device_type != "cuda":
            return f"backend 'cudnn' needs CUDA tensors, got device {device_type!r}: use backend 'torch'"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"backend 'cudnn' needs fp16/bf16 inputs, got {dtype}: use backend 'torch' (or bf16)"
        if head_dim % 8 or head_dim > _MAX_HEAD_DIM:
            return (
                f"backend 'cudnn' needs head_dim a multiple of 8 and <= {_MAX_HEAD_DIM}, got {head_dim}: "
                "use backend 'torch'"
            )
        if capability is not None and capability < (8, 0):
            return f"backend 'cudnn' needs an sm80+ GPU, this one is sm{capability[0]}{capability[1]}"
        return None

    def check(self, q: Tensor) -> str | None:
        """Why cuDNN attention cannot run on ``q``, or None."""
        cap = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
        return self.problem(q.device.type, q.dtype, q.shape[-1], cap)

    def _forward_call(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            None,
            True,
            0.0,
            causal,
            False,
            scale=scale,
        )
        out, lse = res[0], res[1]
        self._lse_trailing_dim = lse.dim() == 4
        if lse.dim() == 4:
            lse = lse[..., 0]
        return out.transpose(1, 2), lse.float()

    def _groups(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> int:
        """1 if K/V go to cuDNN with their own heads, else the expansion factor; probes once."""
        groups = q.shape[2] // k.shape[2]
        if groups == 1 or self.native_gqa:
            return 1
        if self.native_gqa is None:
            try:
                self._forward_call(q[:, :8], k[:, :8], v[:, :8], causal, scale)
                self.native_gqa = True
                return 1
            except RuntimeError as exc:
                if _is_oom(exc):
                    raise
                self.native_gqa = False
        return groups

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float
    ) -> tuple[Tensor, Tensor]:
        """``(out (B, Sq, Hq, D), lse (B, Hq, Sq))`` of ``q`` against ``k``/``v``."""
        if _tiny(q, k):
            return _TORCH.forward(q, k, v, causal, softmax_scale)
        groups = self._groups(q, k, v, causal, softmax_scale)
        k, v = expand_kv_heads(k, groups), expand_kv_heads(v, groups)
        return self._forward_call(q, k, v, causal, softmax_scale)

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
        """``(dq (B, Sq, Hq, D), dk, dv (B, Sk, Hkv, D))`` w.r.t. the merged ``out``/``lse``."""
        if _tiny(q, k):
            return _TORCH.backward(dout, q, k, v, out, lse, causal, softmax_scale)
        groups = self._groups(q, k, v, causal, softmax_scale)
        ke, ve = expand_kv_heads(k, groups), expand_kv_heads(v, groups)
        # cuDNN builds its graph from the strides: give dout and out the same (B, S, H, D) layout.
        qt, kt, vt, dot, ot = (t.contiguous().transpose(1, 2) for t in (q, ke, ve, dout, out))
        stats = lse.float().contiguous()
        if self._lse_trailing_dim:
            stats = stats.unsqueeze(-1)
        # None passes an undefined tensor: no dropout RNG state, no bias, no nested offsets.
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dot,
            qt,
            kt,
            vt,
            ot,
            stats,
            None,
            None,
            None,
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            causal,
            scale=softmax_scale,
        )
        return (
            dq.transpose(1, 2),
            reduce_kv_head_grads(dk.transpose(1, 2), groups),
            reduce_kv_head_grads(dv.transpose(1, 2), groups),
        )
