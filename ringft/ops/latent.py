"""Attention whose value head dim differs from the query/key head dim (latent attention: DeepSeek-V3's
``qk_head_dim`` 192 and ``v_head_dim`` 128).

Every block backend takes one head dim for q, k and v, so the operator pads the narrower side with
zeros: V up to the q/k dim (the padded output columns are exactly zero and sliced off; their
gradient never reaches V), or q and k up to V's dim (zero columns add nothing to any score; the
softmax scale is fixed from the real q/k dim first). Exact; the cost is the padded bytes on the ring.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

__all__ = ["pad_head_dims"]


def pad_head_dims(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """``(q, k, v, dv)`` with one common last dim (zero padding, differentiable); ``dv`` is V's own
    dim, to slice the output back to: ``out[..., :dv]``."""
    dqk, dv = k.shape[-1], v.shape[-1]
    if dv < dqk:
        return q, k, F.pad(v, (0, dqk - dv)), dv
    if dqk < dv:
        return F.pad(q, (0, dv - dqk)), F.pad(k, (0, dv - dqk)), v, dv
    return q, k, v, dv
