"""Local block attention backends.

Every backend implements the same two calls on one block of queries against one block of keys:

    forward(q, k, v, causal, scale)                      -> (out, lse)
    backward(dout, q, k, v, out, lse, causal, scale)     -> (dq, dk, dv)

Layouts: ``q``/``out``/``dout``/``dq`` are ``(batch, seq_q, heads_q, head_dim)``; ``k``/``v`` and
their grads are ``(batch, seq_k, heads_kv, head_dim)`` with ``heads_q % heads_kv == 0`` (GQA/MQA);
``lse`` is ``(batch, heads_q, seq_q)``, natural log, fp32 (fp64 for fp64 inputs). ``out`` keeps the
input dtype. ``backward`` takes an *externally merged* ``out``/``lse`` (the result over all keys, not
just this block), which is what makes the ring backward exact. ``causal`` is only used with
``seq_q == seq_k`` (the diagonal block), so top-left vs bottom-right alignment never matters.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
from typing import Protocol

import torch

Tensor = torch.Tensor


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype used for lse and merged partial results: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class BlockAttention(Protocol):
    """Interface of a local block attention backend (see module docstring)."""

    name: str

    def check(self, q: Tensor) -> str | None:
        """Return why this backend cannot run on ``q`` (and how to fix it), or None."""

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]: ...

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]: ...


def _expand_kv(x: Tensor, groups: int) -> Tensor:
    """(B, S, Hkv, D) -> (B, S, Hkv * groups, D), each kv head repeated for its query group."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _reduce_kv_grad(dx: Tensor, groups: int) -> Tensor:
    """(B, S, Hkv * groups, D) -> (B, S, Hkv, D), summing the gradients of one query group."""
    if groups == 1:
        return dx
    b, s, h, d = dx.shape
    return dx.view(b, s, h // groups, groups, d).sum(dim=3)


class ReferenceBackend:
    """Plain matmul + softmax in fp32 (fp64 for fp64 inputs). For tests and debugging only."""

    name = "reference"

    def check(self, q: Tensor) -> str | None:
        return None

    @staticmethod
    def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
        acc = accumulator_dtype(q.dtype)
        groups = q.shape[2] // k.shape[2]
        kx = _expand_kv(k, groups).to(acc)
        s = torch.einsum("bqhd,bkhd->bhqk", q.to(acc), kx) * scale
        if causal:
            sq, sk = q.shape[1], k.shape[1]
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
            s = s.masked_fill(~mask, float("-inf"))
        return s

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        acc = accumulator_dtype(q.dtype)
        groups = q.shape[2] // k.shape[2]
        s = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.einsum("bhqk,bkhd->bqhd", p, _expand_kv(v, groups).to(acc))
        return out.to(q.dtype), lse

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        acc = accumulator_dtype(q.dtype)
        groups = q.shape[2] // k.shape[2]
        s = self._scores(q, k, causal, scale)
        p = torch.exp(s - lse.to(acc).unsqueeze(-1))  # probabilities w.r.t. the merged lse
        do, o = dout.to(acc), out.to(acc)
        kx, vx = _expand_kv(k, groups).to(acc), _expand_kv(v, groups).to(acc)
        dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
        dp = torch.einsum("bqhd,bkhd->bhqk", do, vx)
        delta = (do * o).sum(-1).transpose(1, 2).unsqueeze(-1)  # (B, H, Sq, 1)
        ds = p * (dp - delta) * scale
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, kx)
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(acc))
        return (
            dq.to(q.dtype),
            _reduce_kv_grad(dk, groups).to(k.dtype),
            _reduce_kv_grad(dv, groups).to(v.dtype),
        )


class TorchBackend:
    """PyTorch's fused attention ops that return the log-sum-exp.

    CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), GQA native.
    CUDA: ``aten._scaled_dot_product_flash_attention`` for fp16/bf16 with head_dim % 8 == 0 and
    <= 256, ``aten._scaled_dot_product_efficient_attention`` otherwise; heads of K/V are expanded
    locally (after communication) because these CUDA ops need equal head counts.
    """

    name = "torch"

    def check(self, q: Tensor) -> str | None:
        if q.device.type not in ("cpu", "cuda"):
            return f"backend 'torch' supports CPU and CUDA tensors, got device {q.device.type!r}"
        return None

    @staticmethod
    def _use_cuda_flash(q: Tensor) -> bool:
        d = q.shape[-1]
        return q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale
            )
            return out.transpose(1, 2), lse.to(accumulator_dtype(q.dtype))
        groups = q.shape[2] // k.shape[2]
        qt = q.transpose(1, 2)
        kt = _expand_kv(k, groups).transpose(1, 2)
        vt = _expand_kv(v, groups).transpose(1, 2)
        if self._use_cuda_flash(q):
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                qt, kt, vt, 0.0, causal, False, scale=scale
            )
            out, lse = res[0], res[1]
        else:
            res = torch.ops.aten._scaled_dot_product_efficient_attention(
                qt, kt, vt, None, True, 0.0, causal, scale=scale
            )
            out, lse = res[0], res[1][..., : q.shape[1]]  # the efficient kernel pads lse's seq dim
        return out.transpose(1, 2), lse.float()

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if q.device.type == "cpu":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout.transpose(1, 2),
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                out.transpose(1, 2),
                lse.to(accumulator_dtype(q.dtype)).contiguous(),
                0.0,
                causal,
                scale=scale,
            )
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        groups = q.shape[2] // k.shape[2]
        qt, dot, ot = q.transpose(1, 2), dout.transpose(1, 2), out.transpose(1, 2)
        kt = _expand_kv(k, groups).transpose(1, 2)
        vt = _expand_kv(v, groups).transpose(1, 2)
        lse = lse.float().contiguous()
        # None passes an undefined tensor: no varlen offsets, no dropout RNG state, no bias.
        if self._use_cuda_flash(q):
            sq, sk = q.shape[1], k.shape[1]
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dot, qt, kt, vt, ot, lse, None, None, sq, sk, 0.0, causal, None, None, scale=scale
            )
        else:
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                dot,
                qt,
                kt,
                vt,
                None,
                ot,
                lse,
                None,
                None,
                0.0,
                [True, True, True, False],
                causal,
                scale=scale,
            )
        return (
            dq.transpose(1, 2),
            _reduce_kv_grad(dk.transpose(1, 2), groups),
            _reduce_kv_grad(dv.transpose(1, 2), groups),
        )


class FlashAttnBackend:
    """flash-attn 2 (CUDA, optional extra ``ringft[flash]``), imported lazily.

    Uses ``flash_attn.flash_attn_interface._flash_attn_forward/_backward`` directly because they
    return / accept the softmax log-sum-exp. Native layout ``(batch, seq, heads, head_dim)`` and
    native GQA. Both the >= 2.6 signature (``window_size_left/right``, ``softcap``) and the older
    2.4-2.5 one (``window_size`` tuple) are supported. Head dims that are not a multiple of 8 are
    zero-padded, as flash-attn's own ``flash_attn_func`` does.
    """

    name = "flash_attn"

    def __init__(self, module=None):
        self._module = module

    @property
    def module(self):
        if self._module is None:
            self._module = importlib.import_module("flash_attn.flash_attn_interface")
        return self._module

    @staticmethod
    def is_available() -> bool:
        return importlib.util.find_spec("flash_attn") is not None

    def check(self, q: Tensor) -> str | None:
        if self._module is None and not self.is_available():
            return (
                "backend 'flash_attn' needs the flash-attn package, which is not installed: "
                "`pip install 'ringft[flash]'` on a CUDA machine, or use backend='torch'"
            )
        if q.device.type != "cuda":
            return (
                f"backend 'flash_attn' runs on CUDA tensors only, got {q.device.type!r} tensors: "
                "use backend='torch' (or 'auto') on CPU"
            )
        if q.dtype not in (torch.float16, torch.bfloat16):
            return (
                f"backend 'flash_attn' needs fp16/bf16 inputs, got {q.dtype}: "
                "cast the model or use backend='torch'"
            )
        return None

    def _window_kwargs(self, fn) -> dict:
        params = inspect.signature(fn).parameters
        if "window_size_left" in params:
            kw = {"window_size_left": -1, "window_size_right": -1}
            if "softcap" in params:
                kw["softcap"] = 0.0
        else:
            kw = {"window_size": (-1, -1)}
        return kw

    @staticmethod
    def _pad(x: Tensor) -> Tensor:
        pad = (-x.shape[-1]) % 8
        return torch.nn.functional.pad(x, (0, pad)) if pad else x

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        fn = self.module._flash_attn_forward
        d = q.shape[-1]
        res = fn(
            self._pad(q).contiguous(),
            self._pad(k).contiguous(),
            self._pad(v).contiguous(),
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            alibi_slopes=None,
            return_softmax=False,
            **self._window_kwargs(fn),
        )
        # >= 2.6: (out, lse, S_dmask, rng_state); <= 2.5: (out, q, k, v, out_padded, lse, S_dmask, rng)
        out, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])
        return out[..., :d], lse.float()

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        fn = self.module._flash_attn_backward
        d = q.shape[-1]
        qp, kp, vp = self._pad(q).contiguous(), self._pad(k).contiguous(), self._pad(v).contiguous()
        dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
        fn(
            self._pad(dout).contiguous(),
            qp,
            kp,
            vp,
            self._pad(out).contiguous(),
            lse.float().contiguous(),
            dq,
            dk,
            dv,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            alibi_slopes=None,
            deterministic=False,
            rng_state=None,
            **self._window_kwargs(fn),
        )
        return dq[..., :d], dk[..., :d], dv[..., :d]


BACKENDS = ("auto", "torch", "flash_attn", "reference")


def get_backend(name: str, device: torch.device) -> BlockAttention:
    """Resolve a backend name; ``auto`` is flash_attn on CUDA when importable, else torch."""
    if name == "auto":
        name = "flash_attn" if device.type == "cuda" and FlashAttnBackend.is_available() else "torch"
    if name == "torch":
        return TorchBackend()
    if name == "flash_attn":
        return FlashAttnBackend()
    if name == "reference":
        return ReferenceBackend()
    raise ValueError(f"unknown attention backend {name!r}: choose one of {', '.join(BACKENDS)}")


def default_scale(head_dim: int) -> float:
    """The usual softmax scale 1/sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)
