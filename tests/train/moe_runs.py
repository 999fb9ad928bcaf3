"""A tiny Qwen3-MoE with its router load-balancing loss on, trained through ``ringft train``'s
recipe under DeepSpeed ZeRO-3 (tests/train/test_deepspeed.py) and FSDP2 (tests/train/test_fsdp.py,
tests/train/fsdp_launch.py) against one process.

The model is tests/train/hf_runs.py's ``tiny_moe``: 2 layers of 4 experts (2 per token),
``output_router_logits`` on, ``router_aux_loss_coef`` 0.5 (the term is ~1/3 of the step loss:
leaving it out, or counting it once per step instead of once per micro-batch, moves the loss by
tens of per cent; taking its two means over each CP shard instead of the whole row moves the
loss by only ~1e-4 at this near-uniform routing, but the routers' gradients by ~4 %, 20x the
update tolerance below).
The experts are MOE_WIDTH wide, so that each layer's fused expert tensors (``4 x 2 MOE_WIDTH x
32`` and ``4 x 32 x MOE_WIDTH``) exceed DeepSpeed's ``stage3_param_persistence_threshold`` (1e5
entries; the shipped config leaves the default): ZeRO-3 then keeps them partitioned between forwards
and gathers them in the experts' own hooks, as it does for any real MoE.

Every run reads the same 4 examples per step, one per micro-batch (dp x grad_accum = 4,
``data.shuffle`` off), so each micro-batch's load-balancing term is a statistic of
the same row in every layout: the sharded runs must reproduce the one-process loss step by step.

Oracle of the logged loss: transformers' own forward (``labels`` with ``output_router_logits``:
token loss + ``coef x load_balancing_loss_func``) of the unmodified model on the first step's 4
rows, summed over the micro-batches as transformers' Trainer sums them (``num_items_in_batch``
given: no division by the accumulation steps). The rows are the recipe's: padded to ``data.seq_len``
with the tokenizer's pad id and no attention mask, so the router statistics count every position of
the row, as transformers does for a batch without an attention mask.

Tolerances: tests/tiny_training.py's (reordered fp32 sums: LOSS_RTOL per step, STEPS x that for
the updates), with the experts' width added to the reduction lengths (as tests/train/test_fsdp.py
adds the MLP's), plus the router statistics: per micro-batch two means over LAYERS x seq_len rows,
summed in another order under CP, each off by at most LAYERS x TOKENS_PER_STEP eps32 relative.
MOE_LOSS_RTOL = 4.4e-4, MOE_UPDATE_RTOL = 1.8e-3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.tiny_training import EPS32, LOSS_RTOL, STEPS, TOKENS_PER_STEP, tiny_recipe

LAYERS = 2  # tiny_moe's MoE layers
MOE_WIDTH = 784  # the experts' intermediate size: 4 x 32 x 784 = 100352 entries > 1e5
MOE_LOSS_RTOL = LOSS_RTOL + (MOE_WIDTH + 2 * LAYERS * TOKENS_PER_STEP) * EPS32
MOE_UPDATE_RTOL = STEPS * MOE_LOSS_RTOL
ROWS_PER_STEP = 4


def save_moe(path: Path) -> str:
    """tiny_moe (seeded) saved as a pretrained folder (its config keeps the router settings)."""
    from tests.train.hf_runs import tiny_moe, tokenizer

    model = tiny_moe(tokenizer(), moe_intermediate_size=MOE_WIDTH)
    assert model.config.output_router_logits and model.config.router_aux_loss_coef == 0.5
    model.save_pretrained(str(path))
    return str(path)


def moe_recipe(output_dir: Path, data: str, model: str, dp: int, cp: int, **train: Any) -> dict:
    """The recipe of a dp x cp run of the saved MoE ``model``: one row per micro-batch, ``4 / dp``
    micro-batches per step; the chunked loss on the ring, transformers' full-logits loss without."""
    raw = tiny_recipe(
        output_dir,
        data,
        data={"shuffle": False},
        parallel={"cp_size": cp},
        train={"micro_batch_size": 1, "grad_accum": ROWS_PER_STEP // dp, "chunked_loss": cp > 1, **train},
    )
    for key in ("config", "model_type"):
        raw["model"].pop(key)
    raw["model"]["name_or_path"] = model
    return raw


def transformers_first_step_loss(model: str, data: str, seq_len: int = 64) -> float:
    """transformers' logged loss of the recipe's first step (see the module docstring): the
    unmodified model's forward loss of each of the first 4 rows, summed."""
    import datasets
    from transformers import AutoModelForCausalLM

    from ringft import RingDataCollator
    from ringft.data.tokenizer import load_tokenizer

    rows = datasets.load_from_disk(data).select(range(ROWS_PER_STEP))
    collate = RingDataCollator(0, 1, pad_token_id=load_tokenizer("demo").pad_token_id, max_length=seq_len)
    batches = [collate([{"input_ids": r["input_ids"], "labels": r["labels"]}]) for r in rows]
    items = sum(int((b["shift_labels"] != -100).sum()) for b in batches)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    assert lm.config.output_router_logits
    total = 0.0
    with torch.no_grad():
        for b in batches:
            labels = b["shift_labels"]
            out = lm(input_ids=b["input_ids"], labels=labels, shift_labels=labels, num_items_in_batch=items)
            total += float(out.loss)
    return total


def expert_parameter_names(state: dict[str, Any]) -> list[str]:
    """The experts' and routers' tensors of a state dict (what the sharded runs must shard)."""
    return sorted(k for k in state if ".mlp.experts." in k or ".mlp.gate." in k)
