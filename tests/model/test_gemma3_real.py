"""A real pretrained Gemma 3 on the ring: Gemma 3 270M (tests/real_model.py) vs one process.

Oracle: the unmodified transformers model (eager attention, fp32) in one process, on a real English
text of 1,536 tokens (tests/real_text.py): three times the 512-token window of its local layers,
so every local layer's window and the global layers' full attention are both exercised. CP runs use
the path a user takes: ``RingDataCollator`` + ``apply_ring_attention`` for the forward,
``RingInference`` for generation.

Logits: at every position and over the whole 262,144-token vocabulary. fp32 logits of 1,536
positions would take 1.6 GB per copy, so each side returns its final hidden states ``h`` and the
test computes the logits' difference ``lm_head(h_ring - h_ref)`` in chunks of positions (the model
has no final-logit soft-cap: its logits are exactly ``lm_head(h)``). Each CP rank does this for its
own positions, in parallel.

Tolerance, derived as in test_real_model.py: the larger of ``layers * eps * max|logit|`` and 4 x
transformers' own sdpa-vs-eager spread on the same text and CPU (2x for the ring's extra merge
roundings times a 2x margin). Greedy generation on CP = 2 must equal ``model.generate`` on a
prompt longer than the window (decoding then reads a windowed, sharded KV cache).
"""

from __future__ import annotations

import pytest
import torch

from ringft.ops.spawn import run_distributed
from tests.real_model import gemma3_path, gemma3_tokenizer, load_gemma3
from tests.real_text import LONG_TEXT

FP32_EPS = torch.finfo(torch.float32).eps
NUM_LAYERS = 18
SEQ = 1536
PROMPT = 640  # > the 512-token window
MAX_NEW_TOKENS = 16
CHUNK = 128  # positions per lm_head product (128 x 262144 fp32 = 128 MiB)
SPREAD_FACTOR = 4.0


def _logit_gap(lm_head: torch.nn.Module, a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |lm_head(a) - lm_head(b)|`` over all rows of ``a``, ``b`` ``(positions, hidden)``, as
    ``max |W (a - b)|`` in chunks (the same difference without cancellation)."""
    with torch.no_grad():
        return max(
            (lm_head.weight @ (a[i : i + CHUNK] - b[i : i + CHUNK]).T).abs().max().item()
            for i in range(0, a.shape[0], CHUNK)
        )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One-process oracle: final hidden states of the text, the tolerance, greedy tokens."""
    torch.set_num_threads(2)  # alone on the machine while the fixture runs
    model, tokenizer = load_gemma3(), gemma3_tokenizer()
    ids = tokenizer(LONG_TEXT)["input_ids"][:SEQ]
    assert len(ids) == SEQ
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
        model.set_attn_implementation("sdpa")
        sdpa = model.model(torch.tensor([ids])).last_hidden_state[0]
        model.set_attn_implementation("eager")
        spread = _logit_gap(model.lm_head, sdpa, hidden)
        # max |logit| over every 8th position: a floor that can only be lower than the full one
        scale = (model.lm_head(hidden[::8]).abs().max()).item()
        out = model.generate(
            torch.tensor([ids[:PROMPT]]),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    tokens = out.sequences[0, PROMPT:].tolist()
    if tokens and tokens[-1] == tokenizer.eos_token_id:
        tokens = tokens[:-1]  # RingInference.generate returns the tokens without EOS
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    tolerance = max(NUM_LAYERS * FP32_EPS * scale, SPREAD_FACTOR * spread)
    ref = {"ids": ids, "hidden": hidden, "tokens": tokens, "margins": margins, "tolerance": tolerance}
    ref["eos"] = tokenizer.eos_token_id
    ref.update(spread=spread, scale=scale)
    path = tmp_path_factory.mktemp("gemma3") / "reference.pt"
    torch.save(ref, path)
    torch.set_num_threads(1)
    return str(path), ref


def ring_worker(rank: int, world: int, ref_path: str, generate: bool) -> dict:
    """Each rank's largest logit error on its own positions; greedy CP generation if asked."""
    from ringft import RingDataCollator, apply_ring_attention
    from ringft.model.inference import RingInference

    ref = torch.load(ref_path)
    model = apply_ring_attention(load_gemma3())
    batch = RingDataCollator(rank, world, pad_token_id=0)([{"input_ids": ref["ids"]}])
    with torch.no_grad():
        local = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    positions = batch["position_ids"][0]
    mine = positions < len(ref["ids"])  # no padding at 1536 = a multiple of 2 * cp for cp 2, 3
    hidden = local.last_hidden_state[0][mine]
    result = {"logits_err": _logit_gap(model.lm_head, hidden, ref["hidden"][positions[mine]])}
    result["positions"] = int(mine.sum())
    if generate:
        result["tokens"] = RingInference(model).generate(ref["ids"][:PROMPT], MAX_NEW_TOKENS, ref["eos"])
    return result


def _check_logits(results: list[dict], world: int, tolerance: float) -> None:
    assert sum(r["positions"] for r in results) == SEQ  # every position compared once
    for rank, res in enumerate(results):
        err = res["logits_err"]
        assert err <= tolerance, f"CP={world} rank {rank}: logits off by {err:.2e} > {tolerance:.1e}"


@pytest.mark.numerics
@pytest.mark.timeout(600)
def test_gemma3_cp2_logits_and_greedy_generation_match_one_process(reference):
    ref_path, ref = reference
    # Identical greedy tokens are a fair demand only where no step is a near-tie.
    assert min(ref["margins"]) > 2 * ref["tolerance"], f"near-tie in the prompt: {ref['margins']}"
    results = run_distributed(ring_worker, 2, ref_path, True, timeout=500)
    _check_logits(results, 2, ref["tolerance"])
    for rank, res in enumerate(results):
        assert res["tokens"] == ref["tokens"], f"rank {rank}: {res['tokens']} != {ref['tokens']}"


@pytest.mark.numerics
@pytest.mark.timeout(600)
def test_gemma3_cp3_logits_match_one_process(reference):
    ref_path, ref = reference
    _check_logits(run_distributed(ring_worker, 3, ref_path, False, timeout=500), 3, ref["tolerance"])


def test_gemma3_270m_is_the_model_the_issue_names():
    """18 layers, 4 query / 1 KV heads of 256, hidden 640, window 512 on 5 of 6 layers, 32K."""
    from transformers import AutoConfig

    from ringft.model.families import layer_windows

    config = AutoConfig.from_pretrained(gemma3_path())
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (18, 4, 1)
    assert (config.head_dim, config.hidden_size, config.max_position_embeddings) == (256, 640, 32768)
    assert layer_windows(config) == ([512] * 5 + [None]) * 3
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1e6
