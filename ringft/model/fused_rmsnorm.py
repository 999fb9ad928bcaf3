"""Fused RMSNorm backward: transformers' RMSNorm forward, an analytic backward over row chunks.

Autograd of transformers' RMSNorm keeps an fp32 copy of the input (``4 h`` bytes per token), and its
backward holds five fp32 ``(tokens, h)`` temporaries at once (see :mod:`ringft.model.tiled_norm`).
Here the forward is the module's own arithmetic, op for op (hence bitwise equal), and keeps the
input itself (a view, no copy) and the fp32 ``rstd`` per row; the backward computes, row chunk by
row chunk of :data:`CHUNK_ROWS` rows, with ``x_hat = x * rstd`` and ``u`` the gradient reaching
``x_hat`` in fp32::

    dx = rstd * (u - x_hat * mean(u * x_hat))        (cast to the input's dtype)
    dw = sum over rows of (g * x_hat)                 (fp32 sums, cast to the weight's dtype)

so its only ``(tokens, h)`` tensor is ``dx`` itself, in the input's dtype; the fp32 temporaries
exist for one chunk at a time.

The three forms of the supported families, with the casts autograd would make:

- ``llama`` (Llama, Mistral, Qwen 2, Qwen 3, Phi-3): ``w * x_hat.to(in)``; ``u = (g * w).to(in)``
  in fp32, ``dw = sum(g * x_hat.to(in))``;
- ``gemma`` (Gemma 3): ``(x_hat * (1 + w.float())).type_as(x)``; ``u = g.float() * (1 + w)``,
  ``dw = sum(g.float() * x_hat)``;
- ``olmo2`` (OLMo 2): ``(w * x_hat).to(in)``; ``u = g.float() * w``, ``dw = sum(g.float() * x_hat)``.

Every RMSNorm module of those classes is fused, per-head q/k norms included, when a probe (fp32, a
few rows) finds the class's forward bitwise equal to the fused forward and its gradients within
round-off of autograd's: a class whose code differs from the forms above is left as it is.

Installing swaps the module's ``forward`` (reversibly), so the module is still called: DeepSpeed
ZeRO-3's hooks gather a partitioned weight around it, FSDP unshards per decoder layer, checkpointing
and ``save_on_cpu`` see the saved tensors through autograd's hooks. Enable it before the tiled norm
(:mod:`ringft.model.tiled_norm`), which then runs the fused norm tile by tile.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "CHUNK_ROWS",
    "FUSED_NORM_CLASSES",
    "disable_fused_rmsnorm",
    "enable_fused_rmsnorm",
    "fused_norm_modules",
    "is_fused_rmsnorm",
    "rms_norm",
]

CHUNK_ROWS = 4096  # rows per backward chunk: the fp32 temporaries are (CHUNK_ROWS, h)
_STATE = "_ringft_fused_rmsnorm"
_TILED = "_ringft_tiled_norm"
FUSED_NORM_CLASSES: dict[str, str] = {
    "LlamaRMSNorm": "llama",
    "MistralRMSNorm": "llama",
    "Qwen2RMSNorm": "llama",
    "Qwen3RMSNorm": "llama",
    "Phi3RMSNorm": "llama",
    "Gemma3RMSNorm": "gemma",
    "Olmo2RMSNorm": "olmo2",
}
_PROBED: dict[type, bool] = {}


def _rstd(x32: Tensor, eps: float) -> Tensor:
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def _forward_rows(x: Tensor, w: Tensor, eps: float, form: str) -> tuple[Tensor, Tensor]:
    """The module's arithmetic, op for op, on rows ``x`` ``(n, h)``: ``(output, rstd)``."""
    x32 = x.to(torch.float32)
    rstd = _rstd(x32, eps)
    x_hat = x32 * rstd
    if form == "llama":
        return w * x_hat.to(x.dtype), rstd
    if form == "gemma":
        return (x_hat * (1.0 + w.float())).type_as(x), rstd
    return (w * x_hat).to(x.dtype), rstd


def _forward(x: Tensor, w: Tensor, eps: float, form: str) -> tuple[Tensor, Tensor]:
    """``(output, rstd)`` of ``x`` ``(..., h)``, :data:`CHUNK_ROWS` rows at a time (each row's values
    are those of the whole-tensor call: the reduction runs within a row)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= CHUNK_ROWS:
        y, rstd = _forward_rows(rows, w, eps, form)
        return y.view(*x.shape[:-1], y.shape[-1]), rstd
    y, rstd = None, torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)
    for start in range(0, rows.shape[0], CHUNK_ROWS):
        part = slice(start, start + CHUNK_ROWS)
        y_part, rstd[part] = _forward_rows(rows[part], w, eps, form)
        if y is None:
            y = torch.empty(rows.shape[0], y_part.shape[-1], dtype=y_part.dtype, device=x.device)
        y[part] = y_part
    return y.view(*x.shape[:-1], y.shape[-1]), rstd


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, eps: float, form: str) -> Tensor:
        y, rstd = _forward(x, w, eps, form)
        ctx.form = form
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, w, rstd = ctx.saved_tensors
        form, h = ctx.form, x.shape[-1]
        rows, grads, rstd = x.reshape(-1, h), g.reshape(-1, h), rstd.reshape(-1, 1)
        dx = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        want_w = ctx.needs_input_grad[1]
        dw = torch.zeros(h, dtype=torch.float32, device=x.device) if want_w else None
        factor = (1.0 + w.float()) if form == "gemma" else w
        for start in range(0, rows.shape[0], CHUNK_ROWS):
            part = slice(start, start + CHUNK_ROWS)
            x_hat = rows[part].to(torch.float32, copy=True).mul_(rstd[part])
            gc = grads[part]
            if form == "llama":
                if want_w:
                    dw += (gc * x_hat.to(x.dtype)).sum(0, dtype=torch.float32)
                u = (gc * factor).to(x.dtype).to(torch.float32)
            else:
                g32 = gc.to(torch.float32, copy=True)
                if want_w:
                    dw += (g32 * x_hat).sum(0)
                u = g32.mul_(factor)
            mean = (u * x_hat).mean(-1, keepdim=True)
            dx[part] = u.sub_(x_hat.mul_(mean)).mul_(rstd[part])
        return dx.view(x.shape), (dw.to(w.dtype) if want_w else None), None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float, form: str = "llama") -> Tensor:
    """RMSNorm of the last dimension of ``x`` (any leading shape) in one of the forms of the module
    docstring, with the fused backward."""
    if form not in ("llama", "gemma", "olmo2"):
        raise ValueError(f"form {form!r} is not one of llama, gemma, olmo2")
    return _FusedRMSNorm.apply(x, weight, eps, form)


def _eps(module: nn.Module) -> float:
    return float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))


def _make_forward(module: nn.Module, form: str):
    def fused_forward(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if args or kwargs:  # not a plain ``forward(x)``: the module's own code
            return type(module).forward(module, x, *args, **kwargs)
        return _FusedRMSNorm.apply(x, module.weight, _eps(module), form)

    return fused_forward


def _probe(cls: type, form: str) -> bool:
    """Whether ``cls.forward`` is the fused ``form``: fp32, forward bitwise, grads within 1e-5 of
    the largest (fp32 round-off over 8 entries is ~1e-6; a different form is off by O(1))."""
    if cls not in _PROBED:
        gen = torch.Generator().manual_seed(0)
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.weight = nn.Parameter(torch.randn(8, dtype=torch.float32, generator=gen))
        m.variance_epsilon = m.eps = 1e-6
        x = torch.randn(3, 8, dtype=torch.float32, generator=gen, requires_grad=True)
        g = torch.randn(3, 8, dtype=torch.float32, generator=gen)
        try:
            ref = cls.forward(m, x)
            ref_grads = torch.autograd.grad(ref, (x, m.weight), g)
            out = _FusedRMSNorm.apply(x, m.weight, 1e-6, form)
            grads = torch.autograd.grad(out, (x, m.weight), g)
            _PROBED[cls] = torch.equal(out, ref) and all(
                ((a - b).abs().max() <= 1e-5 * b.abs().max()).item() for a, b in zip(grads, ref_grads)
            )
        except Exception:  # noqa: BLE001 - a forward we cannot call on a probe is not fused
            _PROBED[cls] = False
    return _PROBED[cls]


def fused_norm_modules(model: nn.Module) -> list[nn.Module]:
    """The RMSNorm modules of ``model`` (any width) whose class the fused norm reproduces."""
    return [
        m
        for m in model.modules()
        if type(m).__name__ in FUSED_NORM_CLASSES
        and isinstance(getattr(m, "weight", None), nn.Parameter)
        and _probe(type(m), FUSED_NORM_CLASSES[type(m).__name__])
    ]


def is_fused_rmsnorm(model: nn.Module) -> bool:
    """Whether any norm module of ``model`` runs the fused backward."""
    return any(hasattr(m, _STATE) for m in model.modules())


def enable_fused_rmsnorm(model: nn.Module) -> int:
    """Give every RMSNorm of a supported family in ``model`` the fused backward (idempotent; undo
    with :func:`disable_fused_rmsnorm`). Returns the number of fused modules (0: none to fuse).

    Raises ``ValueError`` for a norm already tiled (:func:`ringft.model.tiled_norm.enable_tiled_norm`
    wraps the forward it finds: enable the fused norm first)."""
    modules = fused_norm_modules(model)
    tiled = [m for m in modules if hasattr(m, _TILED) and not hasattr(m, _STATE)]
    if tiled:
        raise ValueError(
            "the RMSNorms are tiled already: enable the fused norm before the tiled norm "
            "(or disable_tiled_norm first)"
        )
    for m in modules:
        if hasattr(m, _STATE):
            continue
        if "forward" in m.__dict__:
            raise ValueError(f"{type(m).__name__} has a forward of its own: the fused norm leaves it alone")
        setattr(m, _STATE, True)
        m.forward = _make_forward(m, FUSED_NORM_CLASSES[type(m).__name__])
    return len(modules)


def disable_fused_rmsnorm(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_fused_rmsnorm` (no-op for modules not fused). Returns ``model``."""
    fused = [m for m in model.modules() if _STATE in m.__dict__]
    if any(hasattr(m, _TILED) for m in fused):
        raise ValueError("disable the tiled norm before the fused norm")
    for m in fused:
        del m.__dict__[_STATE]
        del m.forward
    return model
