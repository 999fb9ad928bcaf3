"""Ring point-to-point exchange inside a context-parallel process group.

Each rank sends a tensor to the next rank of the ring and receives one from the previous rank,
asynchronously, so the transfer overlaps with the compute on the block already at hand. Every
buffer handed to a collective is contiguous (gloo silently mishandles strided buffers).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Tensor = torch.Tensor


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


class RingExchange:
    """Async send-to-next / receive-from-previous inside a process group.

    Usage::

        ring = RingExchange(group)
        handle = ring.start(send_tensor)      # returns immediately
        ...compute...
        received = handle.wait()              # tensor from the previous rank
    """

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.rank, self.size = group_rank_and_size(group)
        if self.size > 1:
            self.next_peer = (
                dist.get_global_rank(group, (self.rank + 1) % self.size)
                if group
                else (self.rank + 1) % self.size
            )
            self.prev_peer = (
                dist.get_global_rank(group, (self.rank - 1) % self.size)
                if group
                else (self.rank - 1) % self.size
            )

    def start(self, tensor: Tensor, recv_buffer: Tensor | None = None) -> _Pending:
        """Send ``tensor`` to the next rank and receive a same-shaped tensor from the previous one."""
        send = tensor.contiguous()
        recv = torch.empty_like(send) if recv_buffer is None else recv_buffer
        if not recv.is_contiguous() or recv.shape != send.shape:
            raise ValueError("ring receive buffer must be contiguous and shaped like the send tensor")
        ops = [
            dist.P2POp(dist.isend, send, self.next_peer, self.group),
            dist.P2POp(dist.irecv, recv, self.prev_peer, self.group),
        ]
        return _Pending(dist.batch_isend_irecv(ops), send, recv)


class _Pending:
    def __init__(self, works, send: Tensor, recv: Tensor):
        self._works, self._send, self.recv = works, send, recv

    def wait(self) -> Tensor:
        for work in self._works:
            work.wait()
        self._send = None  # the send buffer may be reused once the transfer is done
        return self.recv
