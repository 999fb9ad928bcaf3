"""Ring attention outputs kept across activation checkpointing, so the recompute skips the ring.

Under non-reentrant ``torch.utils.checkpoint`` a checkpointed region (a decoder layer) runs twice:
in the forward, and again in the backward to rebuild what its backward needs. The ring's backward
needs q, k, v (the recompute rebuilds them from the layer input) and the merged ``out`` and ``lse``,
which only a whole ring forward (N steps of block attention and K/V exchange) rebuilds.

:func:`checkpoint_contexts` is a ``context_fn`` for ``checkpoint(..., use_reentrant=False)``: each
checkpointed call gets one fresh :class:`AttentionStore` and two context managers, one around the
forward, one around the recompute. The ring operators (given :func:`active_store` as ``store=``)
keep each call's ``(out, lse)`` in the forward (``offload``: in host memory, pinned on CUDA) and, in
the recompute, take them back in call order instead of running the ring forward; their backward is
unchanged. The kept ``out`` is the tensor the forward returned, so the backward is bit for bit the
one of a full recompute. Any disagreement (more calls, other shapes, an ``out`` changed in place)
raises; nothing is guessed. The store lives as long as the checkpoint's own state: it is released
with the layer's saved tensors after the layer's backward.

Bytes kept per token and layer: ``heads_q * head_dim * itemsize(compute dtype) + heads_q *
itemsize(lse)`` (lse is fp32 for fp32/bf16/fp16 inputs, fp64 for fp64).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

Tensor = torch.Tensor

__all__ = ["AttentionStore", "active_store", "checkpoint_contexts"]

_ACTIVE = threading.local()  # the recompute runs on autograd's device thread: a stack per thread


@dataclass
class _Kept:
    out: Tensor
    lse: Tensor
    version: int  # out's version counter when kept (device copy only); an in-place change raises


class AttentionStore:
    """The ``(out, lse)`` of the ring calls of one checkpointed call, in call order."""

    def __init__(self, offload: bool = False):
        self.offload = offload
        self.replaying = False
        self._kept: list[_Kept] = []
        self._next = 0

    def __len__(self) -> int:
        return len(self._kept)

    def begin(self, replaying: bool) -> None:
        """Enter the forward (keep) or a recompute (take back from the first call on)."""
        self.replaying, self._next = replaying, 0

    def record(self, out: Tensor, lse: Tensor) -> None:
        """Keep a forward's ``out`` ``(B, S, Hq, D)`` and ``lse`` ``(B, Hq, S)`` (detached)."""
        out, lse = out.detach(), lse.detach()
        if self.offload and out.device.type != "cpu":
            self._kept.append(_Kept(_to_host(out), _to_host(lse), -1))
        else:  # on CPU, "offload" has nowhere else to go
            self._kept.append(_Kept(out, lse, out._version))

    def replay(self, q: Tensor) -> tuple[Tensor, Tensor] | None:
        """``None`` in the forward; in a recompute, the next kept ``(out, lse)`` on q's device,
        checked against the recomputed ``q`` ``(B, S, Hq, D)``."""
        if not self.replaying:
            return None
        if self._next >= len(self._kept):
            raise RuntimeError(
                f"attention_checkpoint: the checkpoint's recompute made more ring attention calls than "
                f"its forward ({len(self._kept)}): the layer does not repeat its forward; use "
                "attention_checkpoint='recompute'"
            )
        kept = self._kept[self._next]
        self._next += 1
        b, s, h, _ = q.shape
        if kept.out.shape != q.shape or kept.out.dtype != q.dtype or kept.lse.shape != (b, h, s):
            raise RuntimeError(
                f"attention_checkpoint: ring attention call {self._next} of the recompute has q "
                f"{tuple(q.shape)} {q.dtype} but the forward kept out {tuple(kept.out.shape)} "
                f"{kept.out.dtype}: the layer's recompute differs from its forward; use "
                "attention_checkpoint='recompute'"
            )
        if kept.version >= 0 and kept.out._version != kept.version:
            raise RuntimeError(
                "attention_checkpoint: the attention output was modified in place after the forward, so "
                "the kept copy is not what the backward needs; use attention_checkpoint='recompute'"
            )
        if kept.out.device != q.device:
            return kept.out.to(q.device, non_blocking=True), kept.lse.to(q.device, non_blocking=True)
        return kept.out.detach(), kept.lse.detach()  # new tensors each time: the autograd Function owns them


def _to_host(t: Tensor) -> Tensor:
    """A host copy of a device tensor (pinned on CUDA, so the copy runs asynchronously on the
    current stream; the later copy back is ordered after it on the same stream)."""
    pinned = t.device.type == "cuda"
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
    return host.copy_(t, non_blocking=pinned)


class _Scope:
    """Makes ``store`` the active store of this thread while a forward / recompute runs."""

    def __init__(self, store: AttentionStore, replaying: bool):
        self.store, self.replaying = store, replaying

    def __enter__(self) -> AttentionStore:
        self.store.begin(self.replaying)
        stack = getattr(_ACTIVE, "stack", None)
        if stack is None:
            stack = _ACTIVE.stack = []
        stack.append(self.store)
        return self.store

    def __exit__(self, *exc) -> None:
        _ACTIVE.stack.pop()


def checkpoint_contexts(offload: bool = False) -> tuple[_Scope, _Scope]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (bind
    ``offload`` with ``functools.partial``): the forward's and the recompute's context managers,
    sharing one new :class:`AttentionStore`."""
    store = AttentionStore(offload)
    return _Scope(store, False), _Scope(store, True)


def active_store() -> AttentionStore | None:
    """The store of the innermost checkpointed call running on this thread (None outside one)."""
    stack = getattr(_ACTIVE, "stack", None)
    return stack[-1] if stack else None
