"""Packed documents through an unmodified transformers model on the ring vs each document on its own.

The packing collator puts several documents in a row (position ids restart at 0 per document, labels
shifted within each document); the ring derives the boundaries from the global position ids.
Oracle: every document run separately through the same unmodified transformers model (eager
attention) in one process; the loss is the sum of all documents' token losses over the total
number of targets. Tolerances (derived, fp32): both sides compute the same math with the sums in
another order, and recursive summation of n terms errs by at most (n - 1) * eps relative, so each
bound is eps times the longest chain of reductions (tests/tiny_models.py fp32_bounds); any
masking, position or label mistake is O(1e-1) relative. CP 1..4 run in one spawn of 4 processes (the
CP group of size N is ranks 0..N-1).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from ringft import RingDataCollator, apply_ring_attention, cp_gather
from ringft.data.packer import pack_rows
from ringft.utils.spawn import run_distributed
from tests.tiny_models import document_examples, documents_reference, fp32_bounds, tiny_model

SEQ = 48  # packed row length: a multiple of 2N for N = 1..4 (chunks of 24, 12, 8, 6)
LOGITS_RTOL, LOSS_RTOL, GRAD_RTOL = fp32_bounds(SEQ)  # tests/tiny_models.py derives them

LAYOUTS = {
    "one": [48],
    "straddle": [19, 13, 9, 5],  # boundaries 19, 32, 41, 46 (+2 pad): across and on chunk edges
    "in_one_chunk": [40, 3, 2],  # two short documents inside the last chunk
    "tiny": [3, 1, 2, 3, 1, 1, 2, 3, 2, 1, 3, 2, 1, 1, 2, 3, 2, 1, 3, 2],  # 20 documents of 1-3 tokens
    "two_rows": [30, 25, 20, 10],  # the packer -> rows {30, 10} and {25, 20}: different plans
}


CP_SIZES = (1, 2, 3, 4)  # one spawn of 4 processes: the CP group of size N is ranks 0..N-1


def _cases() -> list[tuple[str, str, list[int]]]:
    cases = [(name, "llama", lengths) for name, lengths in LAYOUTS.items()]
    return cases + [
        ("mistral-straddle", "mistral", LAYOUTS["straddle"]),
        ("lora-straddle", "lora", LAYOUTS["straddle"]),
    ]


def documents_worker(rank: int, world: int) -> dict[int, dict[str, float]]:
    """Every case on every CP group this rank is in (the one-process reference once per case):
    ``{N: {"case/measure": relative error}}``."""
    from peft import LoraConfig, get_peft_model

    groups = {n: dist.new_group(list(range(n))) for n in CP_SIZES}  # every rank creates every group
    errors: dict[int, dict[str, float]] = {n: {} for n in CP_SIZES if rank < n}
    for seed, (name, kind, lengths) in enumerate(_cases()):
        examples = document_examples(lengths, seed)
        base = tiny_model("mistral" if kind == "mistral" else "llama")
        if kind == "lora":
            lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                              lora_dropout=0.0, init_lora_weights=False)  # fmt: skip
            torch.manual_seed(5)
            base = get_peft_model(base, lora)
        clean = copy.deepcopy(base)  # before the reference's backward fills base's gradients
        ref_logits, ref_loss = documents_reference(base, examples)
        for n, group in ((n, groups[n]) for n in errors):
            collator = RingDataCollator(rank, n, pad_token_id=0, max_length=SEQ, packing=True)
            model = apply_ring_attention(copy.deepcopy(clean), group)
            out = model(**collator(examples))
            rows = collator.last_rows  # documents are reordered inside a row to balance the ranks
            out.loss.backward()
            loss = out.loss.detach().clone()
            dist.all_reduce(loss, group=group)
            logits = cp_gather(out.logits.detach(), group=group)  # (rows, SEQ, vocab)
            worst, scale = 0.0, max(x.abs().max().item() for x in ref_logits)
            for row, members in enumerate(rows):
                at = 0
                for i in members:
                    m = lengths[i]
                    worst = max(worst, (logits[row, at : at + m] - ref_logits[i]).abs().max().item() / scale)
                    at += m
            errors[n][f"{name}/logits"] = worst
            errors[n][f"{name}/loss"] = ((loss - ref_loss).abs() / ref_loss.abs()).item()
            worst = 0.0
            pairs = zip(model.named_parameters(), base.named_parameters())
            for (_, p), (_, pr) in ((a, b) for a, b in pairs if a[1].requires_grad):
                grad = p.grad.detach().clone()
                dist.all_reduce(grad, group=group)
                err = (grad - pr.grad).abs().max() / pr.grad.abs().max().clamp_min(1e-12)
                worst = max(worst, err.item())
            errors[n][f"{name}/grad"] = worst
    return errors


@pytest.fixture(scope="module")
def distributed_errors() -> list[dict[int, dict[str, float]]]:
    """One spawn of 4 gloo processes for the module: every rank's errors."""
    return run_distributed(documents_worker, max(CP_SIZES), timeout=240)


@pytest.mark.numerics
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", CP_SIZES)
def test_packed_documents_match_each_document_alone(distributed_errors, world):
    for rank in range(world):
        errors = distributed_errors[rank][world]
        assert len(errors) == 3 * len(_cases()), f"CP={world} rank {rank}: cases missing"
        for name, err in errors.items():
            limit = {"loss": LOSS_RTOL, "logits": LOGITS_RTOL, "grad": GRAD_RTOL}[name.split("/")[1]]
            assert err <= limit, f"CP={world} rank {rank} {name}: {err:.2e} > {limit:.1e}"


def test_packing_collator_layout():
    examples = document_examples([30, 25, 20, 10, 5], 0)
    collator = RingDataCollator(0, 1, pad_token_id=0, max_length=SEQ, packing=True)
    full = collator.global_batch(examples)
    assert full["input_ids"].shape == (2, SEQ)  # {30, 10, 5} and {25, 20}
    assert pack_rows([30, 25, 20, 10, 5], SEQ) == [[0, 3, 4], [1, 2]]
    assert collator.last_padding_fraction == pytest.approx(1 - 90 / 96)
    pos, labels = full["position_ids"][0].tolist(), full["shift_labels"][0].tolist()
    assert pos[:30] == list(range(30)) and pos[30:40] == list(range(10)) and pos[45:] == [0, 1, 2]
    # No target crosses a boundary: the last token of each document predicts nothing.
    assert labels[29] == -100 and labels[39] == -100 and labels[44] == -100 and labels[45:] == [-100] * 3
    assert labels[:29] == examples[0]["labels"][1:]
    with pytest.raises(ValueError, match="more than the packed row length max_length=48"):
        collator([{"input_ids": [1] * 49}])
    with pytest.raises(ValueError, match="packing=True needs max_length"):
        RingDataCollator(0, 1, pad_token_id=0, packing=True)
