"""Log-sum-exp merge of partial attention results.

Two attention results over disjoint key sets, ``(out_a, lse_a)`` and ``(out_b, lse_b)``, combine
into the attention over the union of the keys:

    lse = log(exp(lse_a) + exp(lse_b))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

written in an overflow-free form (the one of ring-flash-attention's ``update_out_and_lse``):

    out = out_a + sigmoid(lse_b - lse_a) * (out_b - out_a)      (a lerp)
    lse = lse_a - logsigmoid(lse_a - lse_b)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def merge_attention_(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Merge a block result into the accumulator, in place.

    Args:
        out: accumulator ``(batch, seq, heads, head_dim)`` in fp32 (may be a view).
        lse: accumulator log-sum-exp ``(batch, heads, seq)`` in fp32 (may be a view).
        block_out: block output ``(batch, seq, heads, head_dim)``, any float dtype.
        block_lse: block log-sum-exp ``(batch, heads, seq)``, fp32.
    """
    block_lse = block_lse.to(lse.dtype)
    # Broadcast the (batch, heads, seq) lse against the (batch, seq, heads, dim) output.
    weight_b = torch.sigmoid(block_lse - lse).transpose(1, 2).unsqueeze(-1)
    out.lerp_(block_out.to(out.dtype), weight_b)  # out + w * (block_out - out), one temporary
    lse.sub_(F.logsigmoid(lse - block_lse))
