"""``ringft eval-lines`` on a real pretrained chat model (SmolLM2-135M-Instruct, tests/real_model.py)
with CP = 2, against one transformers process: same prompt ids, same greedy answer, same score.

The cases go in as rows of a LongChat test-case file (``--cases-file``), so the run also checks that
LongChat's rows are read verbatim and wrapped in one user turn of the model's chat template.
Oracle: the unmodified model (eager attention, fp32) in one process: ``apply_chat_template`` on the
raw LongChat prompt, ``model.generate`` (greedy, stop at EOS), LongChat's scoring rule applied to
its text, and the teacher-forced log-probability of the answer from one forward pass.
"""

from __future__ import annotations

import json

import pytest
import torch

from ringft.utils.spawn import run_distributed
from tests.real_model import load_smollm2, smollm2_path

FP32_EPS = torch.finfo(torch.float32).eps
NUM_LAYERS = 30
# Logits tolerance, as in tests/model/test_real_model.py: the larger of layers * eps * max|logit| (each
# layer's reordered fp32 sums add ~eps relative) and 4x transformers' own sdpa-vs-eager spread on the
# same prompt (this model's massive activations amplify reordering; 2x ring merges x 2x margin).
SPREAD_FACTOR = 4.0
MAX_NEW_TOKENS = 32  # a sentence answer ("The <REGISTER_CONTENT> of line x is N.") fits
LENGTH = 320


def longchat_rows(tokenizer) -> list[dict]:
    """Two LongChat-format rows built with ringft's longchat style. Seeds chosen so that the model
    answers both with a sentence holding a number: right (seed 1, last line) and wrong (seed 2,
    first line), so both outcomes of the scoring are compared."""
    from ringft.data.line_retrieval import build_record_text, fit_record

    rows = []
    for seed, depth in ((1, 1.0), (2, 0.0)):
        record = fit_record(tokenizer, LENGTH, depth, seed, chat_template=True, prompt_style="longchat")
        key, number = record.names[record.target_index], int(record.answer)
        raw = build_record_text(record.names, record.numbers, record.target_index, "longchat")
        rows.append(
            {
                "random_idx": [key, record.target_index],
                "expected_number": number,
                "num_lines": len(record.names),
                "correct_line": f"line {key}: REGISTER_CONTENT is <{number}>\n",
                "prompt": raw,
            }
        )
    return rows


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """The rows' file, and per row: prompt ids, greedy tokens, their top-1/top-2 margins, the answer's
    log-probability and the logits tolerance."""
    from ringft.evals.lines.scoring import extract_last_integer

    model, tokenizer = load_smollm2()
    folder = tmp_path_factory.mktemp("longchat")
    rows = longchat_rows(tokenizer)
    path = folder / "320_lines.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = []
    for row in rows:
        chat = [{"role": "user", "content": row["prompt"]}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
        answer = tokenizer(str(row["expected_number"]), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            full = torch.tensor([list(ids) + answer])
            logits = model(full).logits[0, len(ids) - 1 : -1]
            model.config._attn_implementation = "sdpa"
            spread = (model(full).logits[0, len(ids) - 1 : -1] - logits).abs().max().item()
            model.config._attn_implementation = "eager"
        tokens = out.sequences[0, len(ids) :].tolist()
        if tokens and tokens[-1] == tokenizer.eos_token_id:
            tokens = tokens[:-1]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        logprob = torch.log_softmax(logits, -1)[torch.arange(len(answer)), answer].sum().item()
        tolerance = max(NUM_LAYERS * FP32_EPS * logits.abs().max().item(), SPREAD_FACTOR * spread)
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        correct = extract_last_integer(text) == row["expected_number"]
        expected.append(
            dict(
                ids=list(ids),
                tokens=tokens,
                margins=margins,
                logprob=logprob,
                tolerance=tolerance,
                correct=correct,
                answer_tokens=len(answer),
            )
        )
    return path, expected


def eval_worker(rank: int, world: int, model: str, cases_file: str, out: str) -> int:
    from ringft.evals.lines.task import main

    argv = ["--model", model, "--cases-file", cases_file, "--output", out, "--dtype", "fp32"]
    argv += ["--attn-backend", "torch", "--max-new-tokens", str(MAX_NEW_TOKENS), "--no-progress"]
    return main(argv)


@pytest.mark.numerics
@pytest.mark.timeout(600)  # the one-process oracle alone took 300 s under load 10 on 2 cores
def test_eval_lines_cp2_matches_one_process_generate(oracle, tmp_path):
    from ringft.evals.lines.scoring import extract_first_integer, extract_last_integer

    path, expected = oracle
    out = tmp_path / "eval"
    assert run_distributed(eval_worker, 2, str(smollm2_path()), str(path), str(out), timeout=240) == [0, 0]
    results = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(results) == len(expected) == 2
    assert [w["correct"] for w in expected] == [True, False]  # both outcomes are compared
    for got, want in zip(results, expected, strict=True):
        assert got["num_tokens"] == len(want["ids"])  # the LongChat row, in one chat-template user turn
        # Identical greedy tokens are a fair demand where no step is a near-tie: a flip needs an
        # error above the logits tolerance, so every top-1/top-2 gap must exceed twice it.
        steps = len(want["tokens"]) + 1
        assert min(want["margins"][:steps]) > 2 * want["tolerance"], "near-tie: choose another seed"
        assert got["generated_ids"] == want["tokens"], (got["generated"], want["tokens"])
        assert got["correct"] == want["correct"] and got["scoring"] == "longchat"
        # The two rules agree on the model's sentence answers (record names hold no digits).
        assert extract_first_integer(got["generated"]) == extract_last_integer(got["generated"])
        # log_softmax moves by at most 2 max|d logit| per answer token.
        bound = 2 * want["answer_tokens"] * want["tolerance"]
        assert abs(got["answer_logprob"] - want["logprob"]) <= bound
    summary = (out / "summary.md").read_text()
    assert all(f"| {r['num_lines']} lines |" in summary for r in results)
