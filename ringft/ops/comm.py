"""Point-to-point exchange inside a context-parallel process group: the one exchange every ring
schedule posts through.

One step's sends and receives go out as one ``batch_isend_irecv`` and return at once, so the
transfer overlaps with the compute on the blocks already at hand; ``wait`` hands back the receive
buffers. Every buffer handed to a collective is contiguous (gloo silently mishandles strided
buffers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

Tensor = torch.Tensor
Moves = tuple[list[tuple[int, Tensor]], list[tuple[int, Tensor]]]  # ([(peer, send)], [(peer, recv)])

__all__ = ["ChunkLayout", "Exchange", "Moves", "group_rank_and_size", "kv_buffer", "kv_views"]


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) of this process inside ``group``; (0, 1) when torch.distributed is not set up."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def kv_buffer(k: Tensor, v: Tensor) -> Tensor:
    """K and V in one flat contiguous buffer, each at its own size (v's head dim may differ from k's:
    latent attention), to send as one message."""
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def kv_views(buf: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """The views of a :func:`kv_buffer` (or a buffer laid out like one) shaped like ``k`` and ``v``."""
    return buf[: k.numel()].view(k.shape), buf[k.numel() :].view(v.shape)


@dataclass(frozen=True)
class ChunkLayout:
    """K and V of a zigzag shard's two chunks in one flat buffer, chunk by chunk: ``k0 v0 k1 v1``,
    each chunk's k ``k_shape`` ``(B, c, Hkv, D)`` then its v ``v_shape`` ``(B, c, Hkv, Dv)``. One
    chunk or both is a contiguous slice, and K and V keep their own sizes (latent attention)."""

    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]

    @classmethod
    def of(cls, k: Tensor, v: Tensor) -> ChunkLayout:
        """The layout of the shard ``k``/``v`` ``(B, 2c, Hkv, D|Dv)``."""
        c = k.shape[1] // 2
        return cls((k.shape[0], c, *k.shape[2:]), (v.shape[0], c, *v.shape[2:]))

    @property
    def numel(self) -> int:
        """Elements of one chunk (its k and v)."""
        return math.prod(self.k_shape) + math.prod(self.v_shape)

    def chunk(self, buf: Tensor, i: int) -> tuple[Tensor, Tensor]:
        """The k and v views of chunk ``i`` of ``buf`` (a buffer of one or two chunks)."""
        nk = math.prod(self.k_shape)
        part = buf[i * self.numel : (i + 1) * self.numel]
        return part[:nk].view(self.k_shape), part[nk:].view(self.v_shape)

    def slots(self, buf: Tensor, slots: tuple[int, ...]) -> Tensor:
        """Chunks ``slots`` (consecutive) of ``buf``: a contiguous slice."""
        return buf[slots[0] * self.numel : (slots[-1] + 1) * self.numel]

    def pack(self, k: Tensor, v: Tensor) -> Tensor:
        """``k``/``v`` ``(B, 2c, Hkv, D|Dv)`` in this layout (one copy)."""
        buf = k.new_empty(2 * self.numel)
        c = self.k_shape[1]
        for i in range(2):
            kc, vc = self.chunk(buf, i)
            kc.copy_(k[:, i * c : (i + 1) * c])
            vc.copy_(v[:, i * c : (i + 1) * c])
        return buf

    def unpack(self, buf: Tensor) -> tuple[Tensor, Tensor]:
        """``(k, v)`` ``(B, 2c, Hkv, D|Dv)`` of a two-chunk buffer."""
        (k0, v0), (k1, v1) = self.chunk(buf, 0), self.chunk(buf, 1)
        return torch.cat([k0, k1], dim=1), torch.cat([v0, v1], dim=1)


class Exchange:
    """Sends and receives of one step inside ``group``; peers are ranks of the group.

    Usage::

        ex = Exchange(group)
        pending = ex.start([(next_rank, block)], [(prev_rank, buffer)])  # returns immediately
        ...compute...
        (received,) = pending.wait()
    """

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group

    def _peer(self, p: int) -> int:
        return dist.get_global_rank(self.group, p) if self.group is not None else p

    def start(self, sends: list[tuple[int, Tensor]], recvs: list[tuple[int, Tensor]]) -> Pending:
        """Send each ``(peer, tensor)`` of ``sends`` and receive into each ``(peer, buffer)`` of
        ``recvs`` (contiguous; several messages between two ranks match in order)."""
        sends = [(p, t.contiguous()) for p, t in sends]
        if not all(buf.is_contiguous() for _, buf in recvs):
            raise ValueError("receive buffers must be contiguous")
        ops = [dist.P2POp(dist.isend, t, self._peer(p), self.group) for p, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self._peer(p), self.group) for p, t in recvs]
        return Pending(dist.batch_isend_irecv(ops) if ops else [], sends, [t for _, t in recvs])


class Pending:
    """One posted step of an :class:`Exchange`; keeps the send tensors referenced until ``wait``."""

    def __init__(self, works, sends: list[tuple[int, Tensor]], recvs: list[Tensor]):
        self._works, self._sends, self.recvs = works, sends, recvs

    def wait(self) -> list[Tensor]:
        """Block until every message of the step is done; the receive buffers, in ``recvs`` order."""
        for work in self._works:
            work.wait()
        self._sends = None  # the send buffers may be reused once the transfer is done
        return self.recvs
