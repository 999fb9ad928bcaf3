"""CP inference (sharded prefill + distributed KV cache) vs the one-process transformers model.

Oracle: the unmodified model (eager attention) in one process, ``generate`` with greedy decoding,
and its full-sequence logits. fp32; logits within 1e-5 abs, generated tokens identical.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ringft.testing import run_distributed
from tests.oracle import full_attention_fp64
from tests.test_hf_ring import VOCAB, tiny_model


def inference_worker(rank: int, world: int) -> list[dict]:
    from ringft.inference import RingInference

    records = []
    for kind, prompt_len in [("llama", 41), ("mistral", 30), ("llama", 7)]:
        ref = tiny_model(kind).eval()
        engine = RingInference(copy.deepcopy(ref), None, "torch")
        gen = torch.Generator().manual_seed(prompt_len)
        prompt = torch.randint(1, VOCAB, (prompt_len,), generator=gen).tolist()
        first_logits = engine.prefill(prompt)
        engine.spec.cache = None
        tokens = engine.generate(prompt, 8)
        logprob, argmax_ok = engine.answer_logprob(prompt, tokens[:3])
        with torch.no_grad():
            ref_tokens = ref.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0
            )[0, prompt_len:].tolist()
            ref_logits = ref(torch.tensor([prompt + tokens[:3]])).logits[0].float()
        ref_logprob = sum(
            torch.log_softmax(ref_logits[prompt_len - 1 + i], -1)[t].item() for i, t in enumerate(tokens[:3])
        )
        records.append(
            {
                "tokens": tokens,
                "ref_tokens": ref_tokens,
                "argmax_ok": argmax_ok,
                "logits_err": (first_logits - ref_logits[prompt_len - 1]).abs().max().item(),
                "logprob_err": abs(logprob - ref_logprob),
            }
        )
    return records


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_cp_generation_matches_one_process(world):
    for records in run_distributed(inference_worker, world, timeout=150):
        for rec in records:
            assert rec["tokens"] == rec["ref_tokens"]
            assert rec["argmax_ok"]  # greedy tokens are the teacher-forced argmax
            assert rec["logits_err"] < 1e-5 and rec["logprob_err"] < 1e-4


def cache_attention_worker(rank: int, world: int) -> float:
    from ringft.ops.decode import sharded_cache_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 8, 16, generator=gen)
    k = torch.randn(2, 21, 2, 16, generator=gen)
    v = torch.randn(2, 21, 2, 16, generator=gen)
    # Uneven split, rank 1 may hold nothing: positions are dealt round-robin to ranks 0 and 2.
    owners = [i % 3 if world == 3 and i % 3 != 1 else i % world for i in range(21)]
    mine = [i for i, o in enumerate(owners) if o == rank]
    out = sharded_cache_attention(q, k[:, mine], v[:, mine], backend="torch")
    ref, _ = full_attention_fp64(q, k, v, causal=False)
    return (out.double() - ref).abs().max().item()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 3])
def test_sharded_cache_attention_matches_fp64(world):
    assert max(run_distributed(cache_attention_worker, world, timeout=90)) < 1e-5
