"""The router load-balancing loss of a sparse mixture-of-experts LM, over the whole sequence.

transformers' Mixtral / Qwen3-MoE / gpt-oss ``*ForCausalLM.forward`` adds, when
``config.output_router_logits`` is true, ``router_aux_loss_coef x aux`` to the LM loss, with
(``load_balancing_loss_func``, Switch Transformer eq. 4-6)::

    aux = E * sum_e  (T_e / N) * (P_e / N)
    T_e = sum over MoE layers and counted rows of [e in top-k(router logits of the row)]
    P_e = sum over MoE layers and counted rows of softmax(router logits of the row)_e
    N   = (MoE layers) x (counted rows)

a product of two means over the *batch*: every row of the one-process batch (the rows of its
``attention_mask`` when it has one). Under CP a rank holds a shard of the rows, so ``T``, ``P``
and ``N`` are summed over the CP group first (one all-reduce of ``2E + 1`` numbers per forward)
and every rank computes the same ``aux``. DeepSeek-V3's forward adds no such loss, nor does
any forward with ``output_router_logits`` false: ringft then adds none either.

The loss shares of ringft's ranks are *summed* (:mod:`ringft.loss.normalization`), so each CP
rank adds ``coef x aux / cp``: the shares of a replica add up to ``LM share + coef x aux``, what
one process of that replica's batch computes. The all-reduce's backward is the all-reduce of the
incoming gradients (the adjoint of "every rank gets the sum" when the objective sums every
rank's copy), so rank ``r``'s gradient is ``d(coef x aux)/dP . dP_r/dtheta`` and the ranks'
gradients sum to the one-process gradient. Over DP and gradient accumulation the term is per
replica and micro-batch, exactly as transformers' loss is per process and micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ringft.model.family_table import FAMILIES
from ringft.model.unwrap import pretrained_model

__all__ = ["RouterLoss", "group_sum", "load_balancing_loss", "router_loss_settings"]

# transformers' *ForCausalLM.forward of these families adds the load-balancing loss when
# config.output_router_logits is true; the other MoE families' forwards (DeepSeek-V3) add none.
_FORWARD_ADDS_AUX = ("mixtral", "qwen3_moe", "gpt_oss", "qwen3_5_moe_text", "qwen3_next")


@dataclass(frozen=True)
class RouterLoss:
    """The load-balancing term one forward of a causal LM adds: ``coef x aux`` with
    ``num_experts`` experts and ``top_k`` experts per token."""

    num_experts: int
    top_k: int
    coef: float


def router_loss_settings(model: nn.Module) -> RouterLoss | None:
    """The load-balancing term transformers' forward of ``model`` (a causal LM, peft-wrapped or
    not) adds to its loss, or None when it adds none (no MoE, ``output_router_logits`` false, or a
    family whose forward has none). A model of an untested family that carries transformers' usual
    attributes (``router_aux_loss_coef``, ``num_experts``, ``num_experts_per_tok``) is taken to
    compute ``load_balancing_loss_func`` as Mixtral does."""
    lm = pretrained_model(model)
    config = getattr(lm, "config", None)
    if not getattr(config, "output_router_logits", False):
        return None
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES and model_type not in _FORWARD_ADDS_AUX:
        return None
    if not all(hasattr(lm, a) for a in ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")):
        return None
    return RouterLoss(int(lm.num_experts), int(lm.num_experts_per_tok), float(lm.router_aux_loss_coef))


def _all_reduce(x: Tensor, group: Any) -> Tensor:
    on_device = dist.get_backend(group) == "nccl"
    buf = x.detach().clone().contiguous() if on_device else x.detach().to("cpu", copy=True).contiguous()
    dist.all_reduce(buf, group=group)
    return buf.to(x.device)


class _GroupSum(torch.autograd.Function):
    """``sum over group of x`` on every rank; backward: the group's sum of the incoming gradients
    (every rank's copy of the sum feeds its own loss, and those losses are summed)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad, ctx.group), None


def group_sum(x: Tensor, group: Any) -> Tensor:
    """Differentiable all-reduce (sum) of ``x`` over the process ``group`` (None: the default
    group; identity for a group of one); see :class:`_GroupSum` for its backward."""
    if dist.get_world_size(group) == 1:
        return x
    return _GroupSum.apply(x, group)


def load_balancing_loss(
    router_logits: Sequence[Tensor],
    num_experts: int,
    top_k: int,
    rows: Tensor | None = None,
    cp_group: Any = None,
    cp_size: int = 1,
) -> Tensor:
    """``aux`` (see the module docstring) of the rows of the whole CP group, the same value on
    every rank (0-d, at least fp32).

    Args:
        router_logits: per MoE layer, this rank's router logits ``(rows_local, num_experts)``, the
            rows in the order of the flattened ``(batch, seq_local)`` tokens.
        rows: ``(batch, seq_local)`` (or flat) weights of the rows the loss counts (1: counted, 0:
            padding the one-process loss does not see); None: every row.
        cp_group, cp_size: the CP group (None: the default group) and its size (1: this process
            alone, no collective).
    """
    if not router_logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one MoE layer")
    first = router_logits[0]
    dtype = torch.promote_types(first.dtype, torch.float32)
    count = first.shape[0]
    weight = (
        torch.ones(count, dtype=dtype, device=first.device)
        if rows is None
        else rows.reshape(-1).to(device=first.device, dtype=dtype)
    )
    if weight.numel() != count:
        raise ValueError(f"rows has {weight.numel()} entries for {count} router-logit rows")
    probs = torch.zeros(num_experts, dtype=dtype, device=first.device)
    chosen = torch.zeros(num_experts, dtype=dtype, device=first.device)
    picks = weight.repeat_interleave(top_k)
    for logits in router_logits:
        # top-k of the logits = top-k of their softmax (transformers takes it of the softmax)
        selected = torch.topk(logits, top_k, dim=-1).indices.reshape(-1)
        chosen = chosen.index_add(0, selected, picks)
        probs = probs + (torch.softmax(logits.to(dtype), dim=-1) * weight[:, None]).sum(0)
    total = (weight.sum() * len(router_logits)).reshape(1)
    summed = torch.cat([probs, chosen, total])
    summed = group_sum(summed, cp_group) if cp_size > 1 else summed
    probs, chosen, total = summed[:num_experts], summed[num_experts:-1], summed[-1].clamp_min(1)
    return num_experts * torch.sum((chosen / total) * (probs / total))
