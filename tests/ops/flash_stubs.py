"""Stand-ins for ``flash_attn.flash_attn_interface`` of each flash-attn generation (CPU, fp64 math).

They honour ``window_size`` (local attention) and ``causal`` as flash-attn 2 does (bottom-right
aligned, with its rewriting of the window arguments: :func:`flash_visible`); a row that sees no key
gets out 0 and lse +inf.

Each stub reproduces its release's exact calling convention, copied from the tagged upstream file
``flash_attn/flash_attn_interface.py``: parameter names and order (no ``**kwargs``), which ones have
defaults, the return tuples, and for 2.7+ the registration as a ``torch.library.custom_op`` (whose
Python signature is ``(*args, **kwargs)``; upstream registers it for "cuda", these for "cpu"). They
also enforce flash-attn's layout contract: q/k/v/out ``(batch, seq, heads, head_dim)`` contiguous,
``head_dim % 8 == 0``, native GQA, ``softmax_lse`` ``(batch, heads, seq)`` fp32.
"""

from __future__ import annotations

import inspect
import types
from typing import Optional

import torch

Tensor = torch.Tensor


def _check_layout(*tensors: Tensor) -> None:
    for t in tensors:
        assert t.dim() == 4 and t.is_contiguous() and t.shape[-1] % 8 == 0, t.shape


def flash_visible(sq: int, sk: int, causal: bool, window, limit: int | None = None) -> Tensor | None:
    """Which keys each query sees in flash-attn 2 (2.3-2.8: ``flash_api.cpp`` mha_fwd/mha_bwd and
    ``set_params_fprop``, the kernels' local mask): a side ``>= seqlen_k`` (``limit``: max_seqlen_k
    for varlen) becomes -1; ``causal`` (unless seqlen_q == 1) sets right = 0; with one side bounded
    the other becomes seqlen_k; row i sees keys [i + sk - sq - left, i + sk - sq + right] (bottom-right
    aligned). ``(sq, sk)`` bool, or None for every key."""
    left, right = (int(x) for x in window)
    limit = sk if limit is None else limit
    left, right = (-1 if left >= limit else left), (-1 if right >= limit else right)
    if causal and sq != 1:
        right = 0
    if left < 0 and right < 0:
        return None
    left, right = (limit if left < 0 else left), (limit if right < 0 else right)
    gap = torch.arange(sk)[None, :] - torch.arange(sq)[:, None] - (sk - sq)  # j - i - (sk - sq)
    return (gap >= -left) & (gap <= right)


def _masked_attention(q, k, v, visible, scale):
    """fp64 attention under ``visible`` (None: all keys); a row that sees no key gets out 0 and lse
    +inf, as flash-attn writes it."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(groups, 2)) * scale
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)
    p = torch.exp(s - lse.masked_fill(empty, 0.0).unsqueeze(-1))
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(groups, 2))
    return out, lse.masked_fill(empty, float("inf"))


def _attend(calls, q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes, return_softmax):
    _check_layout(q, k, v)
    assert (softcap, dropout_p, alibi_slopes, return_softmax) == (0.0, 0.0, None, False)
    visible = flash_visible(q.shape[1], k.shape[1], causal, window)
    out, lse = _masked_attention(q, k, v, visible, softmax_scale)  # zero-padded dims change nothing
    calls.append(("fwd", tuple(q.shape), tuple(k.shape), tuple(int(x) for x in window), causal))
    return out.to(q.dtype), lse.float()


def _explicit_grads(do, q, k, v, out, lse, visible, scale):
    """Softmax-attention backward written out, as flash-attn computes it: probabilities from the
    given ``lse`` (B, H, Sq) and ``delta = rowsum(dout * out)`` from the given ``out`` -- so a block
    of a larger (merged) attention gets its exact share. (Autograd does not run inside a custom op.)"""
    groups = q.shape[2] // k.shape[2]
    kx, vx = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kx) * scale
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.exp(s - lse.double().unsqueeze(-1))
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vx)
    delta = (do * out).sum(-1).transpose(1, 2).unsqueeze(-1)  # (B, H, Sq, 1)
    ds = p * (dp - delta) * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kx)
    fold = lambda x: x.view(x.shape[0], x.shape[1], -1, groups, x.shape[3]).sum(3)  # noqa: E731
    return dq, fold(torch.einsum("bhqk,bqhd->bkhd", ds, q)), fold(torch.einsum("bhqk,bqhd->bkhd", p, do))


def _grads(calls, dout, q, k, v, out, lse, dq, dk, dv, dropout_p, softmax_scale, causal, window, softcap):
    _check_layout(dout, q, k, v, out, dq, dk, dv)
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (q.shape[0], q.shape[2], q.shape[1])
    assert (softcap, dropout_p) == (0.0, 0.0)
    visible = flash_visible(q.shape[1], k.shape[1], causal, window)
    gq, gk, gv = _explicit_grads(
        dout.double(), q.double(), k.double(), v.double(), out.double(), lse, visible, softmax_scale
    )
    dq.copy_(gq), dk.copy_(gk), dv.copy_(gv)
    calls.append(("bwd", tuple(q.shape), tuple(k.shape), tuple(int(x) for x in window), causal))
    return torch.zeros(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)  # softmax_d


def _varlen_attend(calls, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, padded_lse, window=(-1, -1)):
    """q/k/v (total, heads, dim): causal attention per segment (within ``window`` as flash-attn
    reads it, against max_seqlen_k); lse (heads, total), or (segments, heads, max_seqlen_q) before 2.6."""
    assert q.dim() == 3 and q.is_contiguous() and q.shape[-1] % 8 == 0 and cu_q.dtype == torch.int32
    assert torch.equal(cu_q, cu_k) and causal
    cu = cu_q.tolist()
    assert max_q == max_k == max(b - a for a, b in zip(cu, cu[1:]))
    out = torch.empty_like(q)
    lse = torch.full(
        (len(cu) - 1, q.shape[1], max_q) if padded_lse else (q.shape[1], q.shape[0]), float("nan")
    )
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        visible = flash_visible(b - a, b - a, causal, window, max_k)
        o, ls = _masked_attention(q[None, a:b], k[None, a:b], v[None, a:b], visible, scale)
        out[a:b] = o[0].to(q.dtype)
        if padded_lse:
            lse[i, :, : b - a] = ls[0].float()
        else:
            lse[:, a:b] = ls[0].float()
    calls.append(("varlen_fwd", tuple(q.shape), tuple(k.shape), tuple(int(x) for x in window)))
    return out, lse.float()


def _varlen_grads(calls, dout, q, k, v, out, lse, dq, dk, dv, cu_q, scale, padded_lse, window=(-1, -1)):
    cu = cu_q.tolist()
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    expected = (len(cu) - 1, q.shape[1], longest) if padded_lse else (q.shape[1], q.shape[0])
    assert lse.dtype == torch.float32 and tuple(lse.shape) == expected, (lse.shape, expected)
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        seg_lse = lse[i, :, : b - a] if padded_lse else lse[:, a:b]
        gq, gk, gv = _explicit_grads(
            dout[None, a:b].double(),
            q[None, a:b].double(),
            k[None, a:b].double(),
            v[None, a:b].double(),
            out[None, a:b].double(),
            seg_lse[None],
            flash_visible(b - a, b - a, True, window, longest),
            scale,
        )
        dq[a:b], dk[a:b], dv[a:b] = gq[0], gk[0], gv[0]
    calls.append(("varlen_bwd", tuple(q.shape), tuple(k.shape), tuple(int(x) for x in window)))
    return torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)


def _namespace(functions: dict) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{k: v for k, v in functions.items() if k.startswith("_flash_attn")})


# fmt: off
# The signatures below are upstream's, parameter for parameter (one line per upstream line group).

def stub_2_4_0(calls: list) -> types.SimpleNamespace:
    """v2.4.0: window_size tuple; the backward has no ``deterministic``; varlen lse padded."""

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                            return_softmax):
        out, lse = _attend(calls, q, k, v, dropout_p, softmax_scale, causal, window_size, 0.0, alibi_slopes,
                           return_softmax)
        return out, q, k, v, out, lse, None, None

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, alibi_slopes, rng_state=None):
        d = _grads(calls, dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                   window_size, 0.0)
        return dq, dk, dv, d

    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, window_size, alibi_slopes, return_softmax):
        assert (dropout_p, alibi_slopes, return_softmax) == (0.0, None, False)
        out, lse = _varlen_attend(calls, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale, causal, True, window_size)
        return out, q, k, v, out, lse, None, None

    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                    alibi_slopes, rng_state=None):
        d = _varlen_grads(calls, dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                          softmax_scale, True, window_size)
        return dq, dk, dv, d

    return _namespace(locals())


def stub_2_5(calls: list) -> types.SimpleNamespace:
    """v2.4.1 - v2.5.9: as 2.4.0, and both backwards take ``deterministic``."""

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                            return_softmax):
        out, lse = _attend(calls, q, k, v, dropout_p, softmax_scale, causal, window_size, 0.0, alibi_slopes,
                           return_softmax)
        return out, q, k, v, out, lse, None, None

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, alibi_slopes, deterministic, rng_state=None):
        d = _grads(calls, dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                   window_size, 0.0)
        return dq, dk, dv, d

    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, window_size, alibi_slopes, return_softmax):
        out, lse = _varlen_attend(calls, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale, causal, True, window_size)
        return out, q, k, v, out, lse, None, None

    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                    alibi_slopes, deterministic, rng_state=None):
        d = _varlen_grads(calls, dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                          softmax_scale, True, window_size)
        return dq, dk, dv, d

    return _namespace(locals())


def stub_2_6(calls: list, patch: int = 3) -> types.SimpleNamespace:
    """v2.6.x: window_size tuple and a ``softcap`` without default in the dense functions; the varlen
    forward ends with ``block_table`` (2.6.0) or ``block_table, leftpad_k, seqused_k`` with defaults
    (2.6.2-2.6.3); varlen lse unpadded ``(heads, total)``."""

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                            return_softmax):
        out, lse = _attend(calls, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes,
                           return_softmax)
        return out, q, k, v, out, lse, None, None

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, softcap, alibi_slopes, deterministic, rng_state=None):
        d = _grads(calls, dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                   window_size, softcap)
        return dq, dk, dv, d

    if patch == 0:
        def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, dropout_p,
                                       softmax_scale, causal, window_size, softcap, alibi_slopes,
                                           return_softmax,
                                       block_table):
            assert block_table is None and softcap == 0.0
            out, lse = _varlen_attend(calls, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale, causal, False, window_size)
            return out, q, k, v, out, lse, None, None
    else:
        def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, dropout_p,
                                       softmax_scale, causal, window_size=(-1, -1), softcap=0.0,
                                                                           alibi_slopes=None,
                                       return_softmax=False, block_table=None, leftpad_k=None,
                                           seqused_k=None):
            assert (block_table, leftpad_k, seqused_k, softcap) == (None, None, None, 0.0)
            out, lse = _varlen_attend(calls, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale, causal, False, window_size)
            return out, q, k, v, out, lse, None, None

    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                    softcap, alibi_slopes, deterministic, rng_state=None):
        d = _varlen_grads(calls, dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                          softmax_scale, False, window_size)
        return dq, dk, dv, d

    return _namespace(locals())
# fmt: on


_CUSTOM_OPS: dict[str, types.SimpleNamespace] = {}


def stub_custom_op(namespace: str, calls: list, zero_tensors: bool = True) -> types.SimpleNamespace:
    """v2.7.0 - v2.8.3: ``torch.library.custom_op`` functions with window_size_left/right; forward
    returns ``(out, softmax_lse, S_dmask, rng_state)``, backward returns ``softmax_d`` and writes
    dq/dk/dv in place. ``namespace`` keeps each registration (one per test version) apart."""
    if namespace in _CUSTOM_OPS:
        stub = _CUSTOM_OPS[namespace]
        stub.calls = calls
        return stub
    stub = types.SimpleNamespace(calls=calls)

    @torch.library.custom_op(f"{namespace}::_flash_attn_forward", mutates_args=(), device_types="cpu")
    def _flash_attn_forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: Optional[torch.Tensor],  # noqa: UP045 - upstream's annotation
        return_softmax: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        window = (window_size_left, window_size_right)
        out, lse = _attend(
            stub.calls,
            q,
            k,
            v,
            dropout_p,
            softmax_scale,
            causal,
            window,
            softcap,
            alibi_slopes,
            return_softmax,
        )
        return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)

    @torch.library.custom_op(
        f"{namespace}::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu"
    )
    def _flash_attn_backward(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        softmax_lse: torch.Tensor,
        dq: Optional[torch.Tensor],  # noqa: UP045
        dk: Optional[torch.Tensor],  # noqa: UP045
        dv: Optional[torch.Tensor],  # noqa: UP045
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: Optional[torch.Tensor],  # noqa: UP045
        deterministic: bool,
        rng_state: Optional[torch.Tensor] = None,  # noqa: UP045
    ) -> torch.Tensor:
        window = (window_size_left, window_size_right)
        return _grads(
            stub.calls,
            dout,
            q,
            k,
            v,
            out,
            softmax_lse,
            dq,
            dk,
            dv,
            dropout_p,
            softmax_scale,
            causal,
            window,
            softcap,
        )

    stub._flash_attn_forward, stub._flash_attn_backward = _flash_attn_forward, _flash_attn_backward
    stub._flash_attn_varlen_forward, stub._flash_attn_varlen_backward = _varlen_custom_ops(
        namespace, stub, zero_tensors
    )
    _CUSTOM_OPS[namespace] = stub
    return stub


def _varlen_custom_ops(namespace: str, stub, zero_tensors: bool):
    """2.7.0-2.7.2 (no ``zero_tensors``) or 2.7.3+ (with it) varlen custom ops."""

    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int = -1,
        window_size_right: int = -1,
        softcap: float = 0.0,
        alibi_slopes: Optional[torch.Tensor] = None,  # noqa: UP045
        return_softmax: bool = False,
        block_table: Optional[torch.Tensor] = None,  # noqa: UP045
        leftpad_k: Optional[torch.Tensor] = None,  # noqa: UP045
        seqused_k: Optional[torch.Tensor] = None,  # noqa: UP045
        zero_tensors: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        assert (softcap, alibi_slopes, block_table) == (0.0, None, None)
        out, lse = _varlen_attend(
            stub.calls,
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            causal,
            False,
            (window_size_left, window_size_right),
        )
        return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)

    def backward(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        softmax_lse: torch.Tensor,
        dq: Optional[torch.Tensor],  # noqa: UP045
        dk: Optional[torch.Tensor],  # noqa: UP045
        dv: Optional[torch.Tensor],  # noqa: UP045
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: Optional[torch.Tensor],  # noqa: UP045
        deterministic: bool,
        rng_state: Optional[torch.Tensor] = None,  # noqa: UP045
        zero_tensors: bool = False,
    ) -> torch.Tensor:
        return _varlen_grads(
            stub.calls, dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, softmax_scale, False,
            (window_size_left, window_size_right),
        )  # fmt: skip

    if not zero_tensors:  # drop the trailing parameter, as 2.7.0-2.7.2 do
        for fn in (forward, backward):
            params = list(inspect.signature(fn).parameters.values())[:-1]
            fn.__signature__ = inspect.Signature(
                params, return_annotation=inspect.signature(fn).return_annotation
            )
    fwd = torch.library.custom_op(
        f"{namespace}::_flash_attn_varlen_forward", forward, mutates_args=(), device_types="cpu"
    )
    bwd = torch.library.custom_op(
        f"{namespace}::_flash_attn_varlen_backward",
        backward,
        mutates_args=("dq", "dk", "dv"),
        device_types="cpu",
    )
    return fwd, bwd


def make_stub(version: str, calls: list) -> types.SimpleNamespace:
    """The stand-in of flash-attn ``version`` (one of :data:`TESTED_VERSIONS`)."""
    if version == "2.4.0":
        return stub_2_4_0(calls)
    if version.startswith(("2.4.", "2.5.")):
        return stub_2_5(calls)
    if version.startswith("2.6."):
        return stub_2_6(calls, patch=int(version.split(".")[2]))
    zero = tuple(map(int, version.split("."))) >= (2, 7, 3)
    return stub_custom_op("ringft_stub_" + version.replace(".", "_"), calls, zero_tensors=zero)


TESTED_VERSIONS = ("2.4.0", "2.4.2", "2.5.9", "2.6.0", "2.6.3", "2.7.0", "2.7.4", "2.8.3")
