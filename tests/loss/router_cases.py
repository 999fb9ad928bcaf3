"""The router load-balancing loss cases (tests/loss/test_router.py, and the CP 2 / 3 runs inside
tests/model/test_families.py's spawn): the tiny MoE families with ``output_router_logits`` on and
a large ``router_aux_loss_coef`` (0.5: leaving the term out moves the loss by ~10 %), ragged rows
padded to one fixed length, and the rows a one-process batch's attention mask counts."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ringft import RingDataCollator, apply_ring_attention
from ringft.loss import causal_lm_loss
from tests.model.family_models import FAMILY_CONFIGS, VOCAB, family_model, windowed_model

ROUTER_FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")
ROUTER_LENGTHS = (21, 14, 9)
ROUTER_SEQ = 24  # a multiple of 2 x CP for CP 1, 2, 3: every layout sees the same rows
COEF = 0.5


def router_model(name: str, dtype: torch.dtype = torch.float64):
    """The tiny ``name`` model with the load-balancing term on (a window longer than the rows)."""
    kw = dict(output_router_logits=True, router_aux_loss_coef=COEF)
    if name in FAMILY_CONFIGS:
        return family_model(name, dtype, **kw)
    return windowed_model(name, 2 * ROUTER_SEQ, dtype, **kw)


def router_batch(rank: int = 0, size: int = 1) -> dict[str, Any]:
    """The CP rank's shard of the ragged batch (fixed length :data:`ROUTER_SEQ`), with ``rows``:
    True on the real tokens (what a right-padding attention mask marks)."""
    gen = torch.Generator().manual_seed(3)
    examples = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=gen).tolist()} for n in ROUTER_LENGTHS]
    collator = RingDataCollator(rank, size, pad_token_id=0, max_length=ROUTER_SEQ)
    full = collator.global_batch(examples)
    full["rows"] = torch.arange(ROUTER_SEQ)[None, :] < torch.tensor(ROUTER_LENGTHS)[:, None]
    full["num_items_in_batch"] = int((full["shift_labels"] != -100).sum())
    return collator.shard(full)


def router_run(name: str, rank: int = 0, size: int = 1, group: Any = None) -> dict[str, Any]:
    """ringft's loss (chunked, with the router term) of the batch and every gradient: on one
    process (``size`` 1, the unmodified model, sdpa attention in fp64), or summed over the ring of
    ``group``."""
    model = router_model(name)
    if size > 1:
        apply_ring_attention(model, group)
    elif model._supports_sdpa:  # the fp64 oracle (eager attention's softmax is fp32; gpt-oss's is not)
        model.set_attn_implementation("sdpa")
    b = router_batch(rank, size)
    loss = causal_lm_loss(
        model,
        b["input_ids"],
        b["position_ids"],
        b["shift_labels"],
        b["num_items_in_batch"],
        cu_seqlens=b["cu_seqlens"],
        chunked=True,
        chunk_size=16,
        offload_activations=False,
        router_rows=b["rows"],
    )
    loss.backward()
    grads = {
        n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        for n, p in model.named_parameters()
    }
    loss = loss.detach().clone().reshape(1)
    if size > 1:
        flat = torch.cat([loss, *(g.flatten() for g in grads.values())])
        dist.all_reduce(flat, group=group)  # the ranks' shares and partial gradients add up
        loss, *parts = flat.split([1, *(g.numel() for g in grads.values())])
        grads = {n: p.view_as(g) for (n, g), p in zip(grads.items(), parts)}
    return {"loss": loss[0], "grads": grads}
