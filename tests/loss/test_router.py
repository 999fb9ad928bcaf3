"""The router load-balancing loss (ringft.loss.router) against transformers in one process.

Oracles: transformers' own ``load_balancing_loss_func`` of each family (Mixtral, Qwen3-MoE,
gpt-oss: the router logits differ, gpt-oss's router has a bias) and their ``*ForCausalLM.forward``
loss with ``output_router_logits`` (token loss + ``router_aux_loss_coef x aux``). The CP 2 / 3 runs
(aux and gradients summed over the ring == this one-process loss) live in
tests/model/test_families.py's spawn.

Tolerances: transformers accumulates the router statistics in fp32 (``routing_weights.float()``)
and its token loss upcasts fp64 logits to fp32, while ringft stays in fp64: a sum of n fp32 terms
errs by at most n * eps32 relative, with n = layers x rows (48 x 2) for the statistics and the
vocabulary for the log-sum-exp.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from ringft.loss import causal_lm_loss
from ringft.loss.router import load_balancing_loss, router_loss_settings
from tests.loss.router_cases import COEF, ROUTER_FAMILIES, ROUTER_SEQ, router_batch, router_model
from tests.model.family_models import VOCAB, family_model

EPS32 = torch.finfo(torch.float32).eps
STATS_RTOL = 2 * len(router_batch()["input_ids"]) * ROUTER_SEQ * EPS32
LOSS_RTOL = STATS_RTOL + (VOCAB + ROUTER_SEQ) * EPS32


def _transformers_aux(name: str):
    model_type = router_model(name).config.model_type
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return module.load_balancing_loss_func


@pytest.mark.parametrize("name", ROUTER_FAMILIES)
@pytest.mark.parametrize("masked", [False, True])
def test_aux_matches_transformers(name, masked):
    """Value and gradient (w.r.t. every router logit) of the aux loss, with and without a mask."""
    model = router_model(name)
    b = router_batch()
    settings = router_loss_settings(model)
    assert settings is not None and settings.coef == COEF and settings.num_experts == 4
    with torch.no_grad():
        out = model(input_ids=b["input_ids"], position_ids=b["position_ids"], output_router_logits=True)
    mask = b["rows"].long() if masked else None
    logits = [x.detach().clone().requires_grad_(True) for x in out.router_logits]
    ours = load_balancing_loss(logits, settings.num_experts, settings.top_k, mask)
    ours_grads = torch.autograd.grad(ours, logits)
    theirs_in = [x.detach().clone().requires_grad_(True) for x in out.router_logits]
    theirs = _transformers_aux(name)(tuple(theirs_in), settings.num_experts, settings.top_k, mask)
    theirs_grads = torch.autograd.grad(theirs, theirs_in)
    assert ours.dtype == torch.float64 and abs(ours.item() - theirs.item()) <= STATS_RTOL * theirs.item()
    scale = max(g.abs().max().item() for g in theirs_grads)
    err = max((a - b).abs().max().item() for a, b in zip(ours_grads, theirs_grads))
    assert err <= STATS_RTOL * scale, f"{name}: gradient differs by {err / scale:.1e}"


@pytest.mark.parametrize("name", ROUTER_FAMILIES)
@pytest.mark.parametrize("chunked", [True, False])
def test_causal_lm_loss_adds_the_term_as_transformers(name, chunked):
    """ringft's loss == transformers' forward loss (token loss + coef x aux over the attention
    mask's rows), chunked head or not; and the term is really there (the token loss alone is off)."""
    model = router_model(name)
    b = router_batch()
    kw = dict(cu_seqlens=b["cu_seqlens"], chunk_size=16, offload_activations=False)
    with torch.no_grad():
        ours = causal_lm_loss(
            model, b["input_ids"], b["position_ids"], b["shift_labels"], b["num_items_in_batch"],
            chunked=chunked, router_rows=b["rows"], **kw,
        )  # fmt: skip
        want = model(
            input_ids=b["input_ids"], attention_mask=b["rows"].long(), labels=b["shift_labels"],
            shift_labels=b["shift_labels"], num_items_in_batch=b["num_items_in_batch"],
        ).loss  # fmt: skip
        model.config.output_router_logits = False
        bare = causal_lm_loss(
            model, b["input_ids"], b["position_ids"], b["shift_labels"], b["num_items_in_batch"],
            chunked=chunked, **kw,
        )  # fmt: skip
    assert abs(ours.item() - want.item()) <= LOSS_RTOL * want.item()
    assert abs(bare.item() - want.item()) > 0.05 * want.item()  # the term is ~coef x top-k = 1


def test_no_term_where_transformers_adds_none():
    """``output_router_logits`` false, DeepSeek-V3 (its forward adds no aux loss), a dense model."""
    assert router_loss_settings(family_model("qwen3_moe")) is None
    assert router_loss_settings(family_model("deepseek_v3", output_router_logits=True)) is None
    assert router_loss_settings(family_model("llama3")) is None
