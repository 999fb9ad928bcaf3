"""CP inference (sharded prefill + distributed KV cache) vs the one-process transformers model.

Oracle: the unmodified model (eager attention) in one process, ``generate`` with greedy decoding,
and its full-sequence logits. fp32; logits within 1e-5 abs, generated tokens identical. CP 1..3 run
in one spawn of 3 processes (the CP group of size N is ranks 0..N-1).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from ringft.utils.spawn import run_distributed
from tests.oracle import full_attention_fp64
from tests.tiny_models import VOCAB, tiny_model

CP_SIZES = (1, 2, 3)  # one spawn of 3 processes: the CP group of size N is ranks 0..N-1
CACHE_SIZES = (1, 3)


def worker(rank: int, world: int) -> dict[str, dict[int, object]]:
    """Generation records (:func:`generation_records`) and the sharded cache's error
    (:func:`cache_attention_error`) on every CP group this rank is in, keyed by its size."""
    groups = {n: dist.new_group(list(range(n))) for n in CP_SIZES}  # every rank creates every group
    out: dict[str, dict[int, object]] = {"generation": {}, "cache": {}}
    for n in CP_SIZES:
        if rank < n:
            out["generation"][n] = generation_records(groups[n])
    for n in CACHE_SIZES:
        if rank < n:
            out["cache"][n] = cache_attention_error(rank, n, groups[n])
    return out


def generation_records(group) -> list[dict]:
    """Every config through RingInference on ``group`` against the one-process model."""
    from ringft.model.inference import RingInference

    records = []
    configs = [
        ("llama", 41, {}),
        ("mistral", 30, {}),
        ("llama", 7, {}),
        ("mistral", 2, {"sliding_window": 8}),
    ]
    for kind, prompt_len, overrides in configs:
        ref = tiny_model(kind, **overrides).eval()
        engine = RingInference(copy.deepcopy(ref), group, "torch")
        gen = torch.Generator().manual_seed(prompt_len)
        prompt = torch.randint(1, VOCAB, (prompt_len,), generator=gen).tolist()
        other = torch.randint(1, VOCAB, (4,), generator=gen).tolist()  # an answer the model would not give
        first_logits = engine.prefill(prompt)
        engine.reset()
        new_tokens = 10 if overrides else 8  # with a window of 8, decoding runs past it
        tokens = engine.generate(prompt, new_tokens)
        # Stops at any of several EOS ids (e.g. end-of-turn and EOS), at the first one generated.
        stopped = engine.generate(prompt, new_tokens, eos_token_id=[VOCAB + 7, tokens[2]])
        logprob, argmax_ok = engine.answer_logprob(prompt, tokens[:3])
        other_logprob, other_ok = engine.answer_logprob(prompt, other)
        # One prefill for both: identical tokens, same scores as the separate calls.
        joint = engine.generate_and_score(prompt, tokens[:3], new_tokens)
        joint_other = engine.generate_and_score(prompt, other, new_tokens)
        logits = engine.prefill(prompt)
        for t in tokens[:-1]:  # the last decode step runs at position prompt_len + new_tokens - 2
            logits = engine.decode(t)
        engine.reset()
        with torch.no_grad():
            ref_tokens = ref.generate(
                torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )[0, prompt_len:].tolist()
            ref_logits = ref(torch.tensor([prompt + tokens[:3]])).logits[0].float()
            ref_other = ref(torch.tensor([prompt + other])).logits[0].float()
            ref_last = ref(torch.tensor([prompt + tokens[:-1]])).logits[0, -1].float()
        ref_logprob = sum(
            torch.log_softmax(ref_logits[prompt_len - 1 + i], -1)[t].item() for i, t in enumerate(tokens[:3])
        )
        ref_other_logprob = sum(
            torch.log_softmax(ref_other[prompt_len - 1 + i], -1)[t].item() for i, t in enumerate(other)
        )
        records.append(
            {
                "config": (kind, prompt_len, overrides),
                "tokens": tokens,
                "stopped": stopped,
                "ref_tokens": ref_tokens,
                "argmax_ok": argmax_ok,
                "logits_err": (first_logits - ref_logits[prompt_len - 1]).abs().max().item(),
                "decode_logits_err": (logits - ref_last).abs().max().item(),
                "logprob_err": abs(logprob - ref_logprob),
                "other_logprob_err": abs(other_logprob - ref_other_logprob),
                "other_ok": other_ok,
                "joint_tokens": [joint[0], joint_other[0]],
                "joint_ok": [joint[2], joint_other[2]],
                "joint_vs_separate": max(abs(joint[1] - logprob), abs(joint_other[1] - other_logprob)),
                "joint_vs_ref": max(abs(joint[1] - ref_logprob), abs(joint_other[1] - ref_other_logprob)),
            }
        )
    return records


# Log-probabilities are sums of <= 4 fp32 log-softmax values of O(10) magnitude: fp32 eps (1.2e-7)
# x |value| (~10) x a few hundred accumulated operations per logit -> ~1e-5; 1e-4 leaves a margin
# while any masking / position / cache mistake moves them by O(1e-1).
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def results() -> list[dict]:
    """One spawn of 3 gloo processes for the module: every rank's results."""
    return run_distributed(worker, max(CP_SIZES), timeout=200)


@pytest.mark.numerics
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", CP_SIZES)
def test_cp_generation_matches_one_process(results, world):
    for rank in range(world):
        records = results[rank]["generation"][world]
        assert len(records) == 4, f"CP={world} rank {rank}: configs missing"
        for rec in records:
            tag = (f"CP={world}", f"rank {rank}", *rec["config"])
            assert rec["tokens"] == rec["ref_tokens"], tag
            assert rec["stopped"] == rec["tokens"][: rec["tokens"].index(rec["tokens"][2])], tag
            assert rec["argmax_ok"], tag  # greedy tokens are the teacher-forced argmax
            assert not rec["other_ok"], tag
            assert rec["logits_err"] < 1e-5 and rec["decode_logits_err"] < 1e-5, tag
            assert rec["logprob_err"] < LOGPROB_TOL and rec["other_logprob_err"] < LOGPROB_TOL, tag
            assert rec["joint_tokens"] == [rec["tokens"], rec["tokens"]], tag
            assert rec["joint_ok"] == [True, False], tag
            assert rec["joint_vs_separate"] < LOGPROB_TOL and rec["joint_vs_ref"] < LOGPROB_TOL, tag


def cache_attention_error(rank: int, world: int, group) -> float:
    """This rank's part of the cache (an uneven split) through ``sharded_cache_attention`` on
    ``group``: the largest error against fp64 attention over the whole cache."""
    from ringft.ops.decode import sharded_cache_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 8, 16, generator=gen)
    k = torch.randn(2, 21, 2, 16, generator=gen)
    v = torch.randn(2, 21, 2, 16, generator=gen)
    # Uneven split, rank 1 may hold nothing: positions are dealt round-robin to ranks 0 and 2.
    owners = [i % 3 if world == 3 and i % 3 != 1 else i % world for i in range(21)]
    mine = [i for i, o in enumerate(owners) if o == rank]
    out = sharded_cache_attention(q, k[:, mine], v[:, mine], backend="torch", group=group)
    ref, _ = full_attention_fp64(q, k, v, causal=False)
    return (out.double() - ref).abs().max().item()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", CACHE_SIZES)
def test_sharded_cache_attention_matches_fp64(results, world):
    errors = [results[rank]["cache"][world] for rank in range(world)]
    assert max(errors) < 1e-5, f"CP={world}: errors by rank {errors}"
