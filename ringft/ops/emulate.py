"""Run the zigzag ring schedule of N ranks inside one process (no communication).

Same block kernels, same per-step work and merges as the distributed operator, so it serves to
check a backend inside the real schedule on one device (e.g. one GPU) and to measure the cost of
decomposing one attention call into the ring's blocks.
"""

from __future__ import annotations

import torch

from ringft.ops.kernels import accumulator_dtype, default_scale, get_backend
from ringft.ops.zigzag import backward_block, forward_block
from ringft.sharding import zigzag_shard, zigzag_unshard

Tensor = torch.Tensor


def emulate_zigzag_attention(
    q: Tensor, k: Tensor, v: Tensor, world_size: int, *, causal: bool = True,
    softmax_scale: float | None = None, backend: str = "auto", dout: Tensor | None = None,
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor] | None]:
    """Emulate ``world_size`` ranks on the *global* ``q``/``k``/``v`` ``(batch, seq, heads, dim)``.

    Returns ``(out, lse, grads)`` in global order; ``grads = (dq, dk, dv)`` when ``dout`` is given.
    """
    kernel = get_backend(backend, q.device)
    scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    n = world_size
    qs, ks, vs = ([zigzag_shard(t, r, n) for r in range(n)] for t in (q, k, v))
    outs, lses = [], []
    for rank in range(n):
        out = lse = None
        for step in range(n):
            src = (rank - step) % n
            out, lse = forward_block(
                kernel, qs[rank], ks[src], vs[src], out, lse,
                step=step, source=src, rank=rank, causal=causal, scale=scale,
            )
        outs.append(out.to(q.dtype))
        lses.append(lse)
    grads = None
    if dout is not None:
        acc = accumulator_dtype(q.dtype)
        douts = [zigzag_shard(dout, r, n) for r in range(n)]
        dqs = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in qs]
        dkvs = [torch.zeros((2, *t.shape), dtype=acc, device=t.device) for t in ks]
        for rank in range(n):
            for step in range(n):
                src = (rank - step) % n
                dk_b, dv_b, part = backward_block(
                    kernel, douts[rank], qs[rank], ks[src], vs[src], outs[rank], lses[rank], dqs[rank],
                    step=step, source=src, rank=rank, causal=causal, scale=scale,
                )
                dkvs[src][0][:, part].add_(dk_b)
                dkvs[src][1][:, part].add_(dv_b)
        grads = (
            zigzag_unshard(dqs).to(q.dtype),
            zigzag_unshard([g[0] for g in dkvs]).to(k.dtype),
            zigzag_unshard([g[1] for g in dkvs]).to(v.dtype),
        )
    return zigzag_unshard(outs), zigzag_unshard(lses, dim=2), grads
