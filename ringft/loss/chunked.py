"""Chunked causal-LM cross-entropy that never materialises the full ``(tokens, vocab)`` logits.

At 512K context with CP = 8 each rank holds 64K tokens; with a 128K vocabulary the local logits
alone are ``64K * 128K * 4 B ~ 34 GB`` in fp32 (plus a bf16 copy and the same again for their
gradient). :func:`chunked_lm_loss` fuses the output projection (``lm_head``) with the cross-entropy
and walks over the tokens ``chunk_size`` at a time, in the forward *and* (by recomputing the chunk's
logits) in the backward, so the extra memory is ``O(chunk_size * vocab)`` whatever the sequence
length.

Conventions (the ones :class:`ringft.RingDataCollator` produces):

- ``labels`` are *pre-shifted*: ``labels[b, i]`` is the target of position ``i`` (the token at
  ``i + 1`` of the unsharded sequence), ``ignore_index`` (-100) where no loss is taken;
- the result is ``sum of token cross-entropies / num_items_in_batch``: with ``num_items_in_batch``
  the number of valid targets in the *global* batch (all CP ranks), each rank's value is its share
  and the shares sum to the batch's mean token loss. The default divides by the local count.

Numerics follow transformers' ``ForCausalLMLoss``: the logits are computed in the hidden-state
dtype (``hidden @ weight.T + bias``, e.g. bf16 matmul with fp32 accumulation), upcast to fp32,
and the log-softmax / loss / logits-gradient are computed in fp32; the logits-gradient is cast
back to the hidden dtype before the two backward matmuls, as autograd does through ``.float()``.
``grad_weight`` / ``grad_bias`` are accumulated over the chunks in fp32 and cast to the
parameter dtype once at the end. fp64 inputs are computed in fp64 throughout (for tests).

Memory (``c`` = chunk tokens, ``a`` = bytes of the hidden dtype): forward ``~8*c*V`` (fp32 logits
and one fp32 temporary); backward ``(4 + a)*c*V`` plus ``grad_hidden`` (``tokens x H``) and, when
the weight trains, an fp32 ``V x H`` accumulator. Saved for the backward: references to the inputs,
the valid-token indices (int64) and their fp32 log-sum-exp. Compute: the logits matmul runs twice
(forward and backward recompute), 4 instead of 3 ``tokens x H x V`` matmuls; ignored tokens
(prompt masks, padding) are skipped entirely.

Host synchronisation: finding the valid tokens (``nonzero``) needs their count on the host once per
call; the label range is checked on the device (``torch._assert_async``: no host sync on CUDA, where
a bad label stops the kernel stream with the message). The trainer checks token ids and labels
against the vocabulary once, where the data is loaded.

Not supported: logit soft-capping / scaling, double backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ringft.ops.dtypes import accumulator_dtype
from ringft.utils.values import as_integer

__all__ = ["chunk_logits", "chunked_lm_loss", "check_chunking", "given_denominator"]


def _as_dtype(weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """``weight``/``bias`` in the compute dtype (no copy when they already are, the usual case)."""
    return weight.to(dtype), (bias.to(dtype) if bias is not None else None)


def chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Logits ``(n, V)`` of ``n`` hidden rows ``(n, H)``: computed in ``h.dtype``, then upcast to
    the accumulator dtype (a fresh buffer the caller may modify in place)."""
    z = torch.nn.functional.linear(h, weight, bias)
    acc = accumulator_dtype(z.dtype)
    return z if z.dtype == acc else z.to(acc)


class _ChunkedLMLoss(torch.autograd.Function):
    """``sum_t CE(hidden[t] @ W.T + b, labels[t]) / denom`` over the valid tokens, chunked.

    Forward saves ``hidden``/``weight``/``bias`` (references, no copies), the indices of the valid
    tokens (int64, ``n_valid``) and their fp32 log-sum-exp (``n_valid``); nothing of size
    ``tokens x vocab``. Backward recomputes each chunk's logits.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        denom: Tensor,
        chunk_size: int,
        ignore_index: int,
    ) -> Tensor:
        flat_h = hidden.reshape(-1, hidden.shape[-1])
        flat_y = labels.reshape(-1).to(device=flat_h.device, dtype=torch.long)
        valid_idx = torch.nonzero(flat_y != ignore_index).squeeze(1)  # (n_valid,)
        targets = flat_y.index_select(0, valid_idx)  # (n_valid,)
        vocab = weight.shape[0]
        torch._assert_async(
            ((targets >= 0) & (targets < vocab)).all(),
            f"labels must be in [0, {vocab}) or equal to ignore_index={ignore_index}",
        )
        w, b = _as_dtype(weight, bias, flat_h.dtype)
        acc = accumulator_dtype(flat_h.dtype)
        lse = torch.empty(valid_idx.numel(), dtype=acc, device=flat_h.device)
        total = torch.zeros((), dtype=acc, device=flat_h.device)
        for start in range(0, valid_idx.numel(), chunk_size):
            idx = valid_idx[start : start + chunk_size]
            logits = chunk_logits(flat_h.index_select(0, idx), w, b)  # (c, V) in acc
            chunk_lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, targets[start : start + chunk_size, None]).squeeze(1)
            lse[start : start + chunk_size] = chunk_lse
            total += (chunk_lse - target_logit).sum()
            del logits
        ctx.save_for_backward(hidden, weight, bias, valid_idx, targets, lse, denom)
        ctx.chunk_size = chunk_size
        return total / denom.to(acc)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: Tensor):  # type: ignore[override]
        hidden, weight, bias, valid_idx, targets, lse, denom = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        flat_h = hidden.reshape(-1, hidden.shape[-1])
        acc = lse.dtype
        scale = (grad_out.to(acc) / denom.to(acc)).reshape(())  # d loss / d (token CE)
        grad_h = torch.zeros_like(flat_h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = (
            torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b and bias is not None else None
        )
        if need_h or need_w or need_b:
            w, b = _as_dtype(weight, bias, hidden.dtype)
            for start in range(0, valid_idx.numel(), ctx.chunk_size):
                stop = start + ctx.chunk_size
                idx = valid_idx[start:stop]
                h = flat_h.index_select(0, idx)  # (c, H)
                # d CE / d logits = softmax - onehot, built in place in the (fp32) logits buffer
                g = chunk_logits(h, w, b).sub_(lse[start:stop, None]).exp_()
                g.scatter_add_(1, targets[start:stop, None], g.new_full((idx.numel(), 1), -1.0))
                g.mul_(scale)
                g_low = g if hidden.dtype == acc else g.to(hidden.dtype)  # backward of the upcast
                del g
                if grad_b is not None:
                    grad_b += g_low.sum(0, dtype=acc)
                if grad_h is not None:
                    grad_h.index_copy_(0, idx, g_low @ w)
                if grad_w is not None:
                    if hidden.dtype == acc:
                        grad_w.addmm_(g_low.t(), h)
                    else:  # low-precision matmul (fp32 accumulate inside), fp32 sum over chunks
                        grad_w += g_low.t() @ h
                del g_low
        grad_hidden = grad_h.view_as(hidden) if grad_h is not None else None
        grad_weight = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_bias = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def check_chunking(hidden: Tensor, labels: Tensor, chunk_size: int) -> None:
    """Raise ``ValueError`` unless ``hidden`` is ``labels.shape + (H,)`` and ``chunk_size >= 1``."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be labels.shape {tuple(labels.shape)} + (hidden_size,)"
        )
    as_integer("chunk_size", chunk_size, 1)


def given_denominator(num_items_in_batch: int | Tensor | None) -> Tensor | None:
    """``num_items_in_batch`` as a 0-d tensor (checked to be a scalar), or None when not given."""
    if num_items_in_batch is None:
        return None
    denom = torch.as_tensor(num_items_in_batch)
    if denom.numel() != 1:
        raise ValueError(f"num_items_in_batch must be a scalar, got shape {tuple(denom.shape)}")
    return denom.reshape(())


def chunked_lm_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    num_items_in_batch: int | Tensor | None = None,
    bias: Tensor | None = None,
    chunk_size: int = 4096,
    ignore_index: int = -100,
) -> Tensor:
    """Fused ``lm_head`` + causal-LM cross-entropy, ``chunk_size`` tokens of logits at a time.

    Args:
        hidden: final hidden states ``(batch, seq, H)`` (any leading shape matching ``labels``),
            in the model's compute dtype; may require grad.
        weight: output projection ``(V, H)`` (``lm_head.weight``); may be frozen (e.g. LoRA), in
            which case no weight gradient is computed.
        labels: *pre-shifted* targets ``(batch, seq)`` int64 or int32, ``ignore_index`` where
            ignored, else in ``[0, V)`` (checked on the device: a ``RuntimeError`` on CPU, a
            device-side assert on CUDA).
        num_items_in_batch: divisor; int or (scalar) tensor. Default: the number of valid labels
            here (at least 1, so an all-ignored input gives 0, not NaN).
        bias: optional output bias ``(V,)``.
        chunk_size: valid tokens per chunk: the logits buffers take about ``8 * chunk_size * V``
            bytes (see the module docstring). Ignored tokens are skipped: chunks are taken over
            the valid tokens only.
        ignore_index: label value that is excluded from the loss.

    Returns:
        scalar ``sum_t CE_t / num_items_in_batch``, fp32 (fp64 for fp64 inputs). Not twice
        differentiable.
    """
    check_chunking(hidden, labels, chunk_size)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (vocab, {hidden.shape[-1]}), got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    denom = given_denominator(num_items_in_batch)
    if denom is None:
        denom = (labels != ignore_index).sum().clamp_min(1)
    denom = denom.reshape(()).to(device=hidden.device, dtype=torch.float32)
    return _ChunkedLMLoss.apply(hidden, weight, bias, labels, denom, int(chunk_size), int(ignore_index))
