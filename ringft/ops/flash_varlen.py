"""flash-attn 2's varlen functions for the packed-document diagonal block (see ``flash_backend``).

``_flash_attn_varlen_forward`` / ``_flash_attn_varlen_backward`` take the batch flattened to
``(total, heads, head_dim)`` with int32 ``cu_seqlens``. Their signatures, read from the tagged
upstream ``flash_attn/flash_attn_interface.py``, grew trailing arguments within a generation, and the
log-sum-exp layout changed in 2.6:

=========== ============================================================= ==========================
versions    after (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,     softmax_lse
            max_seqlen_k, dropout_p, softmax_scale, causal)
=========== ============================================================= ==========================
2.4-2.5     window_size, alibi_slopes, return_softmax                     (batch, heads, max_seqlen_q)
2.6.0       window_size, softcap, alibi_slopes, return_softmax,           (heads, total_q)
            block_table (2.6.1: + leftpad_k; 2.6.2: + seqused_k)
2.7-2.8     window_size_left/right, softcap, alibi_slopes,                (heads, total_q)
            return_softmax, block_table, leftpad_k, seqused_k
            (2.7.3: + zero_tensors); custom ops
=========== ============================================================= ==========================

The backward follows its dense sibling (2.4.0 has no ``deterministic``; 2.6 adds ``softcap``; 2.7
window_size_left/right; 2.7.3 + ``zero_tensors``) with cu_seqlens/max_seqlen after dq, dk, dv.
"""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor

__all__ = ["VARLEN_NAMES", "flash_varlen_backward", "flash_varlen_forward", "varlen_generation"]

_FWD = (
    "q",
    "k",
    "v",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "dropout_p",
    "softmax_scale",
    "causal",
)
_BWD = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv") + _FWD[3:]
_W = ("window_size",)
_W27 = ("window_size_left", "window_size_right")
_TAIL27 = ("softcap", "alibi_slopes", "return_softmax", "block_table", "leftpad_k", "seqused_k")

# generation -> (accepted forward name tuples, accepted backward name tuples)
VARLEN_NAMES: dict[str, tuple[tuple[tuple[str, ...], ...], tuple[tuple[str, ...], ...]]] = {
    "2.4.0": (
        (_FWD + _W + ("alibi_slopes", "return_softmax"),),
        (_BWD + _W + ("alibi_slopes", "rng_state"),),
    ),
    "2.4.1": (
        (_FWD + _W + ("alibi_slopes", "return_softmax"),),
        (_BWD + _W + ("alibi_slopes", "deterministic", "rng_state"),),
    ),
    "2.6": (
        tuple(
            _FWD + _W + ("softcap", "alibi_slopes", "return_softmax", "block_table") + extra
            for extra in ((), ("leftpad_k",), ("leftpad_k", "seqused_k"))
        ),
        (_BWD + _W + ("softcap", "alibi_slopes", "deterministic", "rng_state"),),
    ),
    "2.7": (
        (_FWD + _W27 + _TAIL27, _FWD + _W27 + _TAIL27 + ("zero_tensors",)),
        tuple(
            _BWD + _W27 + ("softcap", "alibi_slopes", "deterministic", "rng_state") + extra
            for extra in ((), ("zero_tensors",))
        ),
    ),
}

_FIXED: dict[str, Any] = {
    "dropout_p": 0.0,
    "window_size": (-1, -1),
    "window_size_left": -1,
    "window_size_right": -1,
    "softcap": 0.0,
    "alibi_slopes": None,
    "return_softmax": False,
    "block_table": None,
    "leftpad_k": None,
    "seqused_k": None,
    "zero_tensors": False,
    "deterministic": False,
    "rng_state": None,
}


def varlen_generation(generation: str, names: tuple[tuple[str, ...], tuple[str, ...]], version: str) -> None:
    """Raise ``RuntimeError`` unless the varlen functions' parameter ``names`` (forward, backward)
    are ones that flash-attn ``generation`` shipped."""
    fwd_ok, bwd_ok = VARLEN_NAMES[generation]
    if names[0] not in fwd_ok or names[1] not in bwd_ok:
        raise RuntimeError(
            f"flash-attn {version}: _flash_attn_varlen_forward{names[0]} / _flash_attn_varlen_backward"
            f"{names[1]} do not match the signatures ringft supports (flash-attn 2.4 to 2.8): install a "
            "supported version or set attn_backend to 'torch'"
        )


def _segments(
    bounds: tuple[int, ...], batch: int, seq: int, device
) -> tuple[Tensor, int, list[tuple[int, int]]]:
    """int32 cu_seqlens over the flattened batch, the longest segment, and (start, length) per segment."""
    segs = [(b * seq + x, y - x) for b in range(batch) for x, y in zip(bounds, bounds[1:])]
    cu = torch.tensor([s for s, _ in segs] + [batch * seq], dtype=torch.int32, device=device)
    return cu, max(n for _, n in segs), segs


def flash_varlen_forward(
    module, names: tuple[str, ...], lse_padded: bool, q: Tensor, k: Tensor, v: Tensor, bounds, softmax_scale
) -> tuple[Tensor, Tensor]:
    """Causal attention inside each segment of q ``(B, S, Hq, Dp)`` and k/v ``(B, S, Hkv, Dp)``
    (head dim already padded to a multiple of 8): ``(out (B, S, Hq, Dp), lse (B, Hq, S) fp32)``."""
    b, s, h, _ = q.shape
    cu, longest, segs = _segments(bounds, b, s, q.device)
    values = {
        "q": q.reshape(b * s, h, -1).contiguous(),
        "k": k.reshape(b * s, k.shape[2], -1).contiguous(),
        "v": v.reshape(b * s, v.shape[2], -1).contiguous(),
        "cu_seqlens_q": cu,
        "cu_seqlens_k": cu,
        "max_seqlen_q": longest,
        "max_seqlen_k": longest,
        "softmax_scale": softmax_scale,
        "causal": True,
    }
    res = module._flash_attn_varlen_forward(*(values.get(n, _FIXED.get(n)) for n in names))
    out, lse = (res[0], res[5]) if len(res) == 8 else (res[0], res[1])
    if lse_padded:  # (segments, heads, longest) -> (heads, total)
        lse = torch.cat([lse[i, :, :n] for i, (_, n) in enumerate(segs)], dim=1)
    return out.view(b, s, h, -1), lse.float().view(h, b, s).transpose(0, 1)


def flash_varlen_backward(
    module,
    names: tuple[str, ...],
    lse_padded: bool,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    bounds,
    softmax_scale,
    returns_grads: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of :func:`flash_varlen_forward` w.r.t. the merged ``out`` / ``lse`` ``(B, Hq, S)``."""
    b, s, h, _ = q.shape
    cu, longest, segs = _segments(bounds, b, s, q.device)
    flat_lse = lse.float().transpose(0, 1).reshape(h, b * s)
    if lse_padded:
        padded = flat_lse.new_zeros(len(segs), h, longest)
        for i, (start, n) in enumerate(segs):
            padded[i, :, :n] = flat_lse[:, start : start + n]
        flat_lse = padded
    flat = lambda t: t.reshape(b * s, t.shape[2], -1).contiguous()  # noqa: E731
    values = {
        "dout": flat(dout),
        "q": flat(q),
        "k": flat(k),
        "v": flat(v),
        "out": flat(out),
        "softmax_lse": flat_lse.contiguous(),
        "dq": torch.empty_like(flat(q)),
        "dk": torch.empty_like(flat(k)),
        "dv": torch.empty_like(flat(v)),
        "cu_seqlens_q": cu,
        "cu_seqlens_k": cu,
        "max_seqlen_q": longest,
        "max_seqlen_k": longest,
        "softmax_scale": softmax_scale,
        "causal": True,
    }
    res = module._flash_attn_varlen_backward(*(values.get(n, _FIXED.get(n)) for n in names))
    dq, dk, dv = (res[0], res[1], res[2]) if returns_grads else (values["dq"], values["dk"], values["dv"])
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
