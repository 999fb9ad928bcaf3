"""The ``flash_attn`` block backend: flash-attn 2 (CUDA, optional extra ``ringft[flash]``).

Calls ``flash_attn.flash_attn_interface._flash_attn_forward`` / ``_backward`` directly, because
they return / accept the softmax log-sum-exp. Native layout ``(batch, seq, heads, head_dim)``,
native GQA. Head dims that are not a multiple of 8 are zero-padded, as ``flash_attn_func`` does.

Those two private functions changed signature and return arity three times between 2.4 and 2.8
(read from the tagged sources ``flash_attn/flash_attn_interface.py``):

========== =============================================== ======================================
versions   forward (after q, k, v, dropout_p, scale,        returns
           causal)
========== =============================================== ======================================
2.4.0      window_size, alibi_slopes, return_softmax       fwd: 8-tuple, lse at [5];
                                                           bwd: (dq, dk, dv, softmax_d); no
                                                           ``deterministic`` in bwd
2.4.1-2.5  same                                            same, bwd takes ``deterministic``
2.6.x      window_size, softcap, alibi_slopes,             same as 2.4.1
           return_softmax (softcap has no default)
2.7-2.8    window_size_left, window_size_right, softcap,   fwd: (out, lse, S_dmask, rng_state);
           alibi_slopes, return_softmax                    bwd: softmax_d, dq/dk/dv written in
           (``torch.library.custom_op``: positional or     place
           exact keywords only)
========== =============================================== ======================================

The generation is chosen by ``flash_attn.__version__`` and then confirmed against the installed
functions' parameter names (read from the custom op's schema for 2.7+), so an unknown release is
refused with a clear error instead of being called with misplaced arguments. Every call is
positional, in the order of that generation.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from ringft.ops.flash_varlen import flash_varlen_backward, flash_varlen_forward, varlen_generation
from ringft.ops.flash_window import flash_window_calls

Tensor = torch.Tensor

__all__ = ["FLASH_API", "FlashApi", "FlashAttnBackend", "flash_api_for", "parse_version"]

_HEAD = ("q", "k", "v", "dropout_p", "softmax_scale", "causal")
_BWD_HEAD = (
    "dout",
    "q",
    "k",
    "v",
    "out",
    "softmax_lse",
    "dq",
    "dk",
    "dv",
    "dropout_p",
    "softmax_scale",
    "causal",
)


@dataclass(frozen=True)
class FlashApi:
    """Calling convention of one flash-attn generation (parameter names in upstream order)."""

    generation: str  # key of FLASH_API and of ringft.ops.flash_varlen.VARLEN_NAMES
    versions: str
    forward: tuple[str, ...]
    backward: tuple[str, ...]
    forward_returns: int  # tuple length returned by _flash_attn_forward
    lse_index: int  # where softmax_lse sits in that tuple
    backward_returns_grads: bool  # True: (dq, dk, dv, softmax_d); False: softmax_d only


FLASH_API: dict[str, FlashApi] = {
    "2.4.0": FlashApi(
        "2.4.0",
        "2.4.0",
        _HEAD + ("window_size", "alibi_slopes", "return_softmax"),
        _BWD_HEAD + ("window_size", "alibi_slopes", "rng_state"),
        8,
        5,
        True,
    ),
    "2.4.1": FlashApi(
        "2.4.1",
        "2.4.1-2.5.x",
        _HEAD + ("window_size", "alibi_slopes", "return_softmax"),
        _BWD_HEAD + ("window_size", "alibi_slopes", "deterministic", "rng_state"),
        8,
        5,
        True,
    ),
    "2.6": FlashApi(
        "2.6",
        "2.6.x",
        _HEAD + ("window_size", "softcap", "alibi_slopes", "return_softmax"),
        _BWD_HEAD + ("window_size", "softcap", "alibi_slopes", "deterministic", "rng_state"),
        8,
        5,
        True,
    ),
    "2.7": FlashApi(
        "2.7",
        "2.7.x-2.8.x",
        _HEAD + ("window_size_left", "window_size_right", "softcap", "alibi_slopes", "return_softmax"),
        _BWD_HEAD
        + ("window_size_left", "window_size_right", "softcap", "alibi_slopes", "deterministic", "rng_state"),
        4,
        1,
        False,
    ),
}

# Argument values for plain (full, no dropout, no softcap, no ALiBi) attention, by parameter name.
_FIXED: dict[str, Any] = {
    "dropout_p": 0.0,
    "window_size": (-1, -1),
    "window_size_left": -1,
    "window_size_right": -1,
    "softcap": 0.0,
    "alibi_slopes": None,
    "return_softmax": False,
    "deterministic": False,
    "rng_state": None,
}


def _window_values(window: tuple[int, int]) -> dict[str, Any]:
    """flash-attn's window arguments of either generation: a ``window_size`` tuple (2.4-2.6) or
    ``window_size_left`` / ``window_size_right`` (2.7+)."""
    left, right = window
    return {"window_size": (left, right), "window_size_left": left, "window_size_right": right}


def parse_version(text: str) -> tuple[int, int, int]:
    """``"2.7.4.post1+cu12"`` -> ``(2, 7, 4)``; raises ``ValueError`` for an unreadable version."""
    match = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        raise ValueError(f"cannot read the flash-attn version {text!r}")
    return int(match[1]), int(match[2]), int(match[3] or 0)


def _parameter_names(fn) -> tuple[str, ...]:
    """Parameter names of a plain function, or of a ``torch.library.custom_op`` (its schema)."""
    op = getattr(fn, "_opoverload", None)
    if op is not None:
        return tuple(a.name for a in op._schema.arguments)
    return tuple(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


def flash_api_for(version: str, forward_fn, backward_fn) -> FlashApi:
    """The calling convention for flash-attn ``version`` whose private functions are given.

    Chosen by version, confirmed by the functions' parameter names; a release outside 2.4-2.8 is
    accepted only when its names match a known generation exactly. Raises ``RuntimeError`` (naming
    the version and the fix) otherwise.
    """
    v = parse_version(version)
    if v < (2, 4, 0):
        raise RuntimeError(
            f"flash-attn {version} is too old: ringft needs flash-attn >= 2.4 (pip install -U "
            "'flash-attn>=2.4'), or set attn_backend to 'torch'"
        )
    expected = (
        FLASH_API["2.4.0"]
        if v == (2, 4, 0)
        else FLASH_API["2.4.1"]
        if v < (2, 6, 0)
        else FLASH_API["2.6"]
        if v < (2, 7, 0)
        else FLASH_API["2.7"]
        if v < (2, 9, 0)
        else None
    )
    names = (_parameter_names(forward_fn), _parameter_names(backward_fn))
    candidates = [expected] if expected is not None else list(FLASH_API.values())
    for api in candidates:
        if names == (api.forward, api.backward):
            return api
    raise RuntimeError(
        f"flash-attn {version}: _flash_attn_forward{names[0]} / _flash_attn_backward{names[1]} do not "
        f"match the signatures ringft supports (flash-attn 2.4 to 2.8): install a supported version "
        "(pip install 'flash-attn>=2.4,<2.9') or set attn_backend to 'torch'"
    )


class FlashAttnBackend:
    """Block attention with flash-attn 2; layouts as in :mod:`ringft.ops.backends`.

    ``module``/``version`` stand in for ``flash_attn.flash_attn_interface`` and
    ``flash_attn.__version__`` (tests); by default both are imported lazily, at the first call.
    """

    name = "flash_attn"

    def __init__(self, module: ModuleType | Any | None = None, version: str | None = None):
        self._module = module
        self._version = version
        self._api: FlashApi | None = None
        self._varlen: tuple[tuple[str, ...], tuple[str, ...]] | None = None

    @property
    def module(self) -> Any:
        """``flash_attn.flash_attn_interface`` (imported on first use)."""
        if self._module is None:
            self._module = importlib.import_module("flash_attn.flash_attn_interface")
        return self._module

    @property
    def api(self) -> FlashApi:
        """The calling convention of the installed (or injected) flash-attn."""
        if self._api is None:
            version = self._version or importlib.import_module("flash_attn").__version__
            self._api = flash_api_for(
                version, self.module._flash_attn_forward, self.module._flash_attn_backward
            )
        return self._api

    @property
    def varlen_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Parameter names of the installed varlen forward / backward (checked against the generation)."""
        if self._varlen is None:
            module = self.module
            names = (
                _parameter_names(module._flash_attn_varlen_forward),
                _parameter_names(module._flash_attn_varlen_backward),
            )
            varlen_generation(self.api.generation, names, self._version or self.api.versions)
            self._varlen = names
        return self._varlen

    @staticmethod
    def is_available() -> bool:
        """Whether the ``flash_attn`` package is installed (its CUDA extension is not imported)."""
        return importlib.util.find_spec("flash_attn") is not None

    def check(self, q: Tensor) -> str | None:
        """Why flash-attn cannot run on ``q`` (with the fix), or None."""
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
                "cast the model, train with mixed precision (autocast), or use backend='torch'"
            )
        if q.shape[-1] > 256:
            return f"backend 'flash_attn' supports head_dim <= 256, got {q.shape[-1]}: use backend='torch'"
        return None

    @staticmethod
    def _pad(x: Tensor) -> Tensor:
        pad = (-x.shape[-1]) % 8
        return torch.nn.functional.pad(x, (0, pad)) if pad else x

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float, window=(-1, -1)
    ) -> tuple[Tensor, Tensor]:
        """``(out (B, Sq, Hq, D), lse (B, Hq, Sq) fp32)`` of ``q`` against ``k``/``v``; ``window``:
        flash-attn's ``window_size`` (left, right), passed as it is."""
        api, d = self.api, q.shape[-1]
        values = {
            "q": self._pad(q).contiguous(),
            "k": self._pad(k).contiguous(),
            "v": self._pad(v).contiguous(),
            "softmax_scale": softmax_scale,
            "causal": causal,
            **_window_values(window),
        }
        res = self.module._flash_attn_forward(*(values.get(n, _FIXED.get(n)) for n in api.forward))
        if len(res) != api.forward_returns:
            raise RuntimeError(
                f"flash-attn {api.versions}: _flash_attn_forward returned {len(res)} values, "
                f"expected {api.forward_returns}: report the installed flash-attn version"
            )
        return res[0][..., :d], res[api.lse_index].float()

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
        window=(-1, -1),
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq (B, Sq, Hq, D), dk, dv (B, Sk, Hkv, D))`` w.r.t. the merged ``out``/``lse``."""
        api, d = self.api, q.shape[-1]
        qp, kp, vp = self._pad(q).contiguous(), self._pad(k).contiguous(), self._pad(v).contiguous()
        values = {
            "dout": self._pad(dout).contiguous(),
            "q": qp,
            "k": kp,
            "v": vp,
            "out": self._pad(out).contiguous(),
            "softmax_lse": lse.float().contiguous(),
            "dq": torch.empty_like(qp),
            "dk": torch.empty_like(kp),
            "dv": torch.empty_like(vp),
            "softmax_scale": softmax_scale,
            "causal": causal,
            **_window_values(window),
        }
        res = self.module._flash_attn_backward(*(values.get(n, _FIXED.get(n)) for n in api.backward))
        if api.backward_returns_grads:
            if not (isinstance(res, (tuple, list)) and len(res) == 4):
                raise RuntimeError(
                    f"flash-attn {api.versions}: _flash_attn_backward should return (dq, dk, dv, "
                    "softmax_d): report the installed flash-attn version"
                )
            dq, dk, dv = res[0], res[1], res[2]
        else:  # 2.7+: the gradients are written into the buffers passed in
            dq, dk, dv = values["dq"], values["dk"], values["dv"]
        return dq[..., :d], dk[..., :d], dv[..., :d]

    def forward_window(
        self, q: Tensor, k: Tensor, v: Tensor, offset: int, window: int, softmax_scale: float
    ) -> tuple[Tensor, Tensor]:
        """A sliding-window band (row ``i`` sees key ``j`` iff ``0 <= i + offset - j < window``) with
        flash-attn's ``window_size``, in the row segments of :func:`flash_window_calls`."""
        parts = [
            self.forward(q[:, a:b], k[:, x:y], v[:, x:y], causal, softmax_scale, win)
            for a, b, x, y, causal, win in flash_window_calls(q.shape[1], k.shape[1], offset, window)
        ]
        return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 2)

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
        """Backward of :meth:`forward_window`: ``(dq, dk, dv)`` shaped like q, k, v (dk/dv fp32)."""
        dqs, dk, dv = [], k.new_zeros(k.shape, dtype=torch.float32), v.new_zeros(v.shape, dtype=torch.float32)
        for a, b, x, y, causal, win in flash_window_calls(q.shape[1], k.shape[1], offset, window):
            gq, gk, gv = self.backward(
                dout[:, a:b], q[:, a:b], k[:, x:y], v[:, x:y], out[:, a:b], lse[:, :, a:b], causal,
                softmax_scale, win,
            )  # fmt: skip
            dqs.append(gq)
            dk[:, x:y] += gk
            dv[:, x:y] += gv
        return torch.cat(dqs, 1), dk, dv

    def forward_varlen(
        self, q: Tensor, k: Tensor, v: Tensor, bounds: tuple[int, ...], softmax_scale: float
    ) -> tuple[Tensor, Tensor]:
        """Causal attention inside each segment ``[bounds[i], bounds[i+1])`` of every row, one varlen
        call: q ``(B, S, Hq, D)``, k/v ``(B, S, Hkv, D)`` -> ``(out (B, S, Hq, D), lse (B, Hq, S))``."""
        d, lse_padded = q.shape[-1], self.api.generation in ("2.4.0", "2.4.1")
        out, lse = flash_varlen_forward(
            self.module, self.varlen_names[0], lse_padded, self._pad(q), self._pad(k), self._pad(v), bounds,
            softmax_scale,
        )  # fmt: skip
        return out[..., :d], lse

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
        """Backward of :meth:`forward_varlen` w.r.t. the merged ``out``/``lse``: ``(dq, dk, dv)``."""
        d, api = q.shape[-1], self.api
        dq, dk, dv = flash_varlen_backward(
            self.module, self.varlen_names[1], api.generation in ("2.4.0", "2.4.1"), self._pad(dout),
            self._pad(q), self._pad(k), self._pad(v), self._pad(out), lse, bounds, softmax_scale,
            api.backward_returns_grads,
        )  # fmt: skip
        return dq[..., :d], dk[..., :d], dv[..., :d]
