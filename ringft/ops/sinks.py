"""Attention sinks on the ring: a learned logit per query head in the softmax denominator (gpt-oss).

With a sink ``s_h`` a query row's weights are ``p_j = exp(x_j - L)`` over its real keys, with
``L = logaddexp(lse, s_h)`` and ``lse`` the log-sum-exp of the row's real scores ``x_j``; the sink
takes ``exp(s_h - L)`` and contributes no value. So the sink needs nothing from other ranks: after
the ring's log-sum-exp merge of every block (any backend, windows and documents included) one
rescale gives the output,

    out_sink = out * exp(lse - L) = out * sigmoid(lse - s_h),

and the backward through the real keys is the ring's own backward run with ``(out_sink, L)`` in
place of ``(out, lse)``: it recomputes ``p_j = exp(x_j - L)`` and uses ``dout . out_sink`` as the
row's softmax correction, which is the gradient of ``out_sink`` with respect to ``x_j``. The sink's
gradient is ``d s_h = -sum over rows of exp(s_h - L) * (dout . out_sink)`` (its share of the row's
probability times the row's correction). Under context parallelism each rank holds the sum over
its own rows: a partial gradient, reduced over the CP group like every parameter's.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

__all__ = ["sink_gradient", "sink_problems", "sink_rescale"]


def sink_problems(sinks: Tensor | None, q: Tensor) -> list[str]:
    """What is wrong with ``sinks`` for q ``(B, S, Hq, D)``: one message per problem."""
    if sinks is None:
        return []
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] != q.shape[2]:
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        return [f"sinks must be a 1-D tensor of one logit per query head ({q.shape[2]}), got {shape}"]
    if sinks.device != q.device:
        return ["sinks must be on q's device"]
    return []


def sink_rescale(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """``(out * exp(lse - L), L)`` with ``L = logaddexp(lse, sinks)``, in ``out``'s (fp32) dtype.

    ``out`` ``(B, S, Hq, D)`` and ``lse`` ``(B, Hq, S)`` (fp32) are the merged ring results over
    the real keys; ``sinks`` ``(Hq,)``."""
    sink = sinks.detach().to(lse.dtype).view(1, -1, 1)
    total = torch.logaddexp(lse, sink)
    scale = torch.exp(lse - total)  # sigmoid(lse - sink); 0 for a row without keys (lse = -inf)
    return out * scale.transpose(1, 2).unsqueeze(-1).to(out.dtype), total


def sink_gradient(dout: Tensor, out: Tensor, total: Tensor, sinks: Tensor) -> Tensor:
    """``d sinks`` ``(Hq,)`` in sinks' dtype: ``-sum over (batch, rows) of exp(s_h - L) * (dout .
    out)`` with ``out`` the rescaled output and ``total`` its ``L`` ``(B, Hq, S)``."""
    acc = total.dtype if total.dtype == torch.float64 else torch.float32
    row = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # (B, Hq, S)
    p_sink = torch.exp(sinks.detach().to(acc).view(1, -1, 1) - total.to(acc))
    return (-(p_sink * row).sum(dim=(0, 2))).to(sinks.dtype)
