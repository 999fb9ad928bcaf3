"""Packed documents through an unmodified transformers model on the ring vs each document on its own.

The packing collator puts several documents in a row (position ids restart at 0 per document, labels
shifted within each document); the ring derives the boundaries from the global position ids.
Oracle: every document run separately through the same unmodified transformers model (eager
attention) in one process; the loss is the sum of all documents' token losses over the total
number of targets. Tolerances (derived, fp32): both sides compute the same math with the sums in
another order, and recursive summation of n terms errs by at most (n - 1) * eps relative, so each
bound is eps times the longest chain of reductions (PATH below); any masking, position or label
mistake is O(1e-1) relative.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.distributed as dist

from ringft import RingDataCollator, apply_ring_attention, zigzag_gather
from ringft.data.packer import pack_rows
from ringft.ops.spawn import run_distributed
from tests.model.test_patch import VOCAB, tiny_model

SEQ = 48  # packed row length: a multiple of 2N for N = 1..4 (chunks of 24, 12, 8, 6)
EPS32 = torch.finfo(torch.float32).eps
# tiny_model: per layer q/k/v (hidden 64) + attention (<= SEQ keys) + o_proj (64) + gate/up (64) +
# down (96), 2 layers, then lm_head (64): the longest chain of fp32 sums behind one logit.
PATH = 2 * (64 + SEQ + 64 + 64 + 96) + 64
LOGITS_RTOL = PATH * EPS32  # max |logit error| / max |logit|
LOSS_RTOL = (PATH + VOCAB + SEQ) * EPS32  # + the log-sum-exp over VOCAB and the mean over <= SEQ targets
GRAD_RTOL = 2 * PATH * EPS32  # the backward retraces the path; relative to the parameter's max entry

LAYOUTS = {
    "one": [48],
    "straddle": [19, 13, 9, 5],  # boundaries 19, 32, 41, 46 (+2 pad): across and on chunk edges
    "in_one_chunk": [40, 3, 2],  # two short documents inside the last chunk
    "tiny": [3, 1, 2, 3, 1, 1, 2, 3, 2, 1, 3, 2, 1, 1, 2, 3, 2, 1, 3, 2],  # 20 documents of 1-3 tokens
    "two_rows": [30, 25, 20, 10],  # the packer -> rows {30, 10} and {25, 20}: different plans
}


def _examples(lengths: list[int], seed: int) -> list[dict]:
    gen = random.Random(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = [gen.randrange(1, VOCAB) for _ in range(n)]
        labels = list(ids)
        if i % 3 == 1 and n > 2:
            labels[: n // 2] = [-100] * (n // 2)  # an SFT prompt that is not trained on
        out.append({"input_ids": ids, "labels": labels})
    return out


def _reference(ref, examples) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each document alone through the unmodified model; loss = all token losses / all targets."""
    total = sum(sum(x != -100 for x in ex["labels"][1:]) for ex in examples)
    logits, loss = [], torch.zeros(())
    for ex in examples:
        ids = torch.tensor([ex["input_ids"]])
        shift = torch.tensor([ex["labels"][1:] + [-100]])
        out = ref(input_ids=ids, labels=shift, shift_labels=shift, num_items_in_batch=total)
        logits.append(out.logits[0].detach())
        loss = loss + out.loss
    loss.backward()
    return logits, loss.detach()


def documents_worker(rank: int, world: int) -> dict[str, float]:
    from peft import LoraConfig, get_peft_model

    errors: dict[str, float] = {}
    collator = RingDataCollator(rank, world, pad_token_id=0, max_length=SEQ, packing=True)
    cases = [(name, "llama", lengths) for name, lengths in LAYOUTS.items()]
    cases += [
        ("mistral-straddle", "mistral", LAYOUTS["straddle"]),
        ("lora-straddle", "lora", LAYOUTS["straddle"]),
    ]
    for seed, (name, kind, lengths) in enumerate(cases):
        examples = _examples(lengths, seed)
        base = tiny_model("mistral" if kind == "mistral" else "llama")
        if kind == "lora":
            lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                              lora_dropout=0.0, init_lora_weights=False)  # fmt: skip
            torch.manual_seed(5)
            base = get_peft_model(base, lora)
        model = apply_ring_attention(copy.deepcopy(base))
        ref_logits, ref_loss = _reference(base, examples)
        out = model(**collator(examples))
        rows = collator.last_rows  # documents are reordered inside a row to balance the ranks
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        logits = zigzag_gather(out.logits.detach())  # (rows, SEQ, vocab)
        worst, scale = 0.0, max(x.abs().max().item() for x in ref_logits)
        for row, members in enumerate(rows):
            at = 0
            for i in members:
                n = lengths[i]
                worst = max(worst, (logits[row, at : at + n] - ref_logits[i]).abs().max().item() / scale)
                at += n
        errors[f"{name}/logits"] = worst
        errors[f"{name}/loss"] = ((loss - ref_loss).abs() / ref_loss.abs()).item()
        worst = 0.0
        pairs = zip(model.named_parameters(), base.named_parameters())
        for (_, p), (_, pr) in ((a, b) for a, b in pairs if a[1].requires_grad):
            grad = p.grad.detach().clone()
            dist.all_reduce(grad)
            worst = max(worst, ((grad - pr.grad).abs().max() / pr.grad.abs().max().clamp_min(1e-12)).item())
        errors[f"{name}/grad"] = worst
    return errors


@pytest.mark.numerics
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_packed_documents_match_each_document_alone(world):
    for errors in run_distributed(documents_worker, world, timeout=240):
        for name, err in errors.items():
            limit = {"loss": LOSS_RTOL, "logits": LOGITS_RTOL, "grad": GRAD_RTOL}[name.split("/")[1]]
            assert err <= limit, f"CP={world} {name}: {err:.2e} > {limit:.1e}"


def test_packing_collator_layout():
    examples = _examples([30, 25, 20, 10, 5], 0)
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
