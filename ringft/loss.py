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

When ``lm_head`` cannot be read as a plain ``(weight, bias)`` pair -- a weight partitioned by
DeepSpeed ZeRO-3 or sharded as an FSDP2 DTensor, or a LoRA adapter on ``lm_head`` --
:func:`lm_loss_from_hidden` calls the module itself on each chunk under non-reentrant activation
checkpointing instead (:func:`checkpointed_head_loss`): the sharding framework's hooks gather the
weight and reduce its gradient as for any other module, and the memory bound is the same
(``O(chunk_size * vocab)``; the chunk's logits are recomputed in the backward).

Not supported: logit soft-capping / scaling, double backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor

from ringft.modeling import output_head, pretrained_model

__all__ = ["checkpointed_head_loss", "chunked_lm_loss", "lm_loss_from_hidden", "output_projection"]


def _as_dtype(weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """``weight``/``bias`` in the compute dtype (no copy when they already are, the usual case)."""
    return weight.to(dtype), (bias.to(dtype) if bias is not None else None)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the loss math: fp32, or fp64 for fp64 inputs (bf16/fp16/fp32 -> fp32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Logits ``(n, V)`` of ``n`` hidden rows ``(n, H)``: computed in ``h.dtype``, then upcast to
    :func:`_acc_dtype` (a fresh buffer the caller may modify in place)."""
    z = torch.nn.functional.linear(h, weight, bias)
    return z if z.dtype == _acc_dtype(z.dtype) else z.to(_acc_dtype(z.dtype))


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
        if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
            raise IndexError(
                f"labels must be in [0, {vocab}) or equal to ignore_index={ignore_index}; got values in "
                f"[{int(targets.min())}, {int(targets.max())}]"
            )
        w, b = _as_dtype(weight, bias, flat_h.dtype)
        acc = _acc_dtype(flat_h.dtype)
        lse = torch.empty(valid_idx.numel(), dtype=acc, device=flat_h.device)
        total = torch.zeros((), dtype=acc, device=flat_h.device)
        for start in range(0, valid_idx.numel(), chunk_size):
            idx = valid_idx[start : start + chunk_size]
            logits = _chunk_logits(flat_h.index_select(0, idx), w, b)  # (c, V) in acc
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
                g = _chunk_logits(h, w, b).sub_(lse[start:stop, None]).exp_()
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


def _check_chunking(hidden: Tensor, labels: Tensor, chunk_size: int) -> None:
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be labels.shape {tuple(labels.shape)} + (hidden_size,)"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _given_denominator(num_items_in_batch: int | Tensor | None) -> Tensor | None:
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
        labels: *pre-shifted* targets ``(batch, seq)`` int64, ``ignore_index`` where ignored.
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
    _check_chunking(hidden, labels, chunk_size)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (vocab, {hidden.shape[-1]}), got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    denom = _given_denominator(num_items_in_batch)
    if denom is None:
        denom = (labels != ignore_index).sum().clamp_min(1)
    denom = denom.reshape(()).to(device=hidden.device, dtype=torch.float32)
    return _ChunkedLMLoss.apply(hidden, weight, bias, labels, denom, int(chunk_size), int(ignore_index))


def _chunk_ce_sum(head: torch.nn.Module, h: Tensor, targets: Tensor) -> Tensor:
    logits = head(h)
    return torch.nn.functional.cross_entropy(
        logits.to(_acc_dtype(logits.dtype)), targets, reduction="sum"
    )


def checkpointed_head_loss(
    head: torch.nn.Module,
    hidden: Tensor,
    labels: Tensor,
    *,
    num_items_in_batch: int | Tensor | None = None,
    chunk_size: int = 4096,
    ignore_index: int = -100,
) -> Tensor:
    """The loss of :func:`chunked_lm_loss`, calling the ``head`` module on each chunk of tokens
    under non-reentrant :func:`torch.utils.checkpoint.checkpoint` (logits recomputed in backward).

    For heads that are not a plain readable ``(weight, bias)``: ZeRO-3-partitioned or FSDP-sharded
    weights (their module hooks gather them and reduce-scatter the gradient), LoRA on ``lm_head``.
    ``hidden`` ``(batch, seq, H)``, ``labels`` pre-shifted ``(batch, seq)``; returns an fp32 scalar
    (fp64 for fp64 inputs).

    Chunks are windows of ``chunk_size`` token *positions* (the valid tokens in each are gathered),
    so the module is called ``ceil(batch * seq / chunk_size)`` times, in the forward and again in
    the backward, however many targets are masked: each call is a collective under ZeRO-3 / FSDP,
    and every rank must issue the same number. Ranks must therefore hold the same number of local
    tokens (the trainer pads every batch to ``data.seq_len``).
    """
    _check_chunking(hidden, labels, chunk_size)
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_y = labels.reshape(-1).to(device=flat_h.device, dtype=torch.long)
    acc = _acc_dtype(hidden.dtype)
    # Starts from 0 * sum(hidden[:1]) so that an all-ignored input still returns a graph-connected
    # zero (every rank must run backward for DDP / ZeRO even when it holds no valid target).
    total = flat_h[:1].sum().to(acc) * 0
    n_valid = 0
    for start in range(0, flat_y.numel(), chunk_size):
        window = flat_y[start : start + chunk_size]
        idx = torch.nonzero(window != ignore_index).squeeze(1) + start
        n_valid += idx.numel()
        total = total + torch.utils.checkpoint.checkpoint(
            _chunk_ce_sum, head, flat_h.index_select(0, idx), flat_y.index_select(0, idx), use_reentrant=False
        )
    denom = _given_denominator(num_items_in_batch)
    if denom is None:
        denom = torch.as_tensor(max(1, n_valid))
    return total / denom.reshape(()).to(device=hidden.device, dtype=acc)


def _needs_module_call(head: torch.nn.Module) -> str | None:
    """Why ``head`` cannot be read as a plain ``(weight, bias)`` pair, or None when it can."""
    lora_a = getattr(head, "lora_A", None)
    if (
        lora_a is not None
        and len(lora_a) > 0
        and not getattr(head, "disable_adapters", False)
        and not getattr(head, "merged", False)
    ):
        return "lm_head carries a LoRA adapter"
    weight = head.weight
    if hasattr(weight, "ds_id"):
        return "lm_head.weight is a DeepSpeed ZeRO-3 parameter"
    if weight.numel() == 0 or type(weight).__name__ == "DTensor":
        return "lm_head.weight is sharded"
    return None


def output_projection(model: torch.nn.Module) -> torch.nn.Module:
    """The output-embedding module (``lm_head``) of a transformers causal LM, peft-wrapped or not,
    checked to be usable as a plain ``(weight, bias)`` projection by :func:`chunked_lm_loss`.

    Raises ``NotImplementedError`` naming the reason (LoRA on ``lm_head``, a ZeRO-3 / sharded weight)
    otherwise; :func:`lm_loss_from_hidden` handles those by calling the module
    (:func:`checkpointed_head_loss`).
    """
    head = output_head(model)
    why = _needs_module_call(head)
    if why is not None:
        raise NotImplementedError(f"{why}: use lm_loss_from_hidden / checkpointed_head_loss instead")
    return head


def lm_loss_from_hidden(
    model: torch.nn.Module,
    hidden: Tensor,
    labels: Tensor,
    num_items_in_batch: int | Tensor | None = None,
    chunk_size: int = 4096,
    ignore_index: int = -100,
) -> Tensor:
    """Chunked loss with ``model``'s ``lm_head`` (``get_output_embeddings()``).

    ``hidden`` is the base model's ``last_hidden_state`` ``(batch, seq_local, H)`` and ``labels``
    the pre-shifted ``(batch, seq_local)`` targets, e.g. ``model.model(input_ids,
    position_ids=...).last_hidden_state`` with the collator's ``shift_labels``. Works for
    ``LlamaForCausalLM`` / ``MistralForCausalLM`` and their peft wrappers (tied embeddings too).
    Uses the fused :func:`chunked_lm_loss` on a plain head, :func:`checkpointed_head_loss` on a
    ZeRO-3 / sharded / LoRA-adapted one.
    """
    config = getattr(pretrained_model(model), "config", None)
    if getattr(config, "final_logit_softcapping", None):
        raise NotImplementedError("logit soft-capping (final_logit_softcapping) is not supported")
    head = output_head(model)
    if _needs_module_call(head) is not None:
        return checkpointed_head_loss(
            head, hidden, labels, num_items_in_batch=num_items_in_batch, chunk_size=chunk_size,
            ignore_index=ignore_index,
        )
    return chunked_lm_loss(
        hidden,
        head.weight,
        labels,
        num_items_in_batch=num_items_in_batch,
        bias=getattr(head, "bias", None),
        chunk_size=chunk_size,
        ignore_index=ignore_index,
    )
