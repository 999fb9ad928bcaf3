"""``ringft eval-lines`` end to end on CPU: CP = 2 results equal one-process results; resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ringft.utils.spawn import run_distributed


def eval_worker(rank: int, world: int, model: str, out: str, cp: int) -> int:
    from ringft.evals.lines.task import main

    return main(
        [
            "--model",
            model,
            "--lengths",
            "144,208",
            "--depths",
            "0,1",
            "--cases",
            "2",
            "--output",
            out,
            "--dtype",
            "fp32",
            "--attn-backend",
            "torch",
            "--cp-size",
            str(cp),
            "--no-progress",
            "--max-new-tokens",
            "4",
            "--prompt-style",
            "ringft",
        ]
    )


def _results(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]


def two_process_runs(rank: int, world: int, model: str, tmp: str) -> int:
    """In one 2-process group: CP = 2; DP = 2 (cp = 1); then a resume of the CP = 2 run after its
    last finished case was dropped (rank 0 edits the file while rank 1 waits)."""
    import torch.distributed as dist

    ring, dp = f"{tmp}/ring", f"{tmp}/dp"
    assert eval_worker(rank, world, model, ring, 2) == 0
    assert eval_worker(rank, world, model, dp, 1) == 0
    if rank == 0:
        part = Path(ring, "results-dp0.jsonl")
        lines = part.read_text().splitlines()
        Path(tmp, "ring-lines.txt").write_text(str(len(lines)))
        part.write_text("\n".join(lines[:-1]) + "\n")
    dist.barrier()
    return eval_worker(rank, world, model, ring, 2)


FP32_EPS = torch.finfo(torch.float32).eps
# |d log p(answer)| <= 2 * answer tokens * max|d logit| (log_softmax). A logit of this 1-layer,
# hidden-32 model is reached through fp32 sums of <= 208 keys and 64 features whose order the ring
# changes, each rounding adding <= eps relative: max|d logit| <= (208 + 64) * eps * max|logit|, with
# max|logit| < 1 at this random init (checked below: log p is -ln(vocab) per token within 0.5).
LOGIT_TERMS = 208 + 64


@pytest.mark.numerics
@pytest.mark.timeout(300)
def test_eval_lines_cp_matches_one_process_and_resumes(tmp_path, saved_tiny_model):
    model = saved_tiny_model
    one, ring, dp = tmp_path / "one", tmp_path / "ring", tmp_path / "dp"
    assert run_distributed(eval_worker, 1, str(model), str(one), 1, timeout=120) == [0]
    assert run_distributed(two_process_runs, 2, str(model), str(tmp_path), timeout=200) == [0, 0]
    a, b = _results(one), _results(ring)
    assert len(a) == 8 and [r["key"] for r in a] == [r["key"] for r in b]
    from ringft.data.tokenizer import load_demo_tokenizer

    vocab = len(load_demo_tokenizer())
    for x, y in zip(a, b, strict=True):
        assert x["generated_ids"] == y["generated_ids"] and x["correct"] == y["correct"]
        tokens = len(x["answer"]) + 1  # " " and one token per digit (the demo tokenizer)
        assert abs(x["answer_logprob"] / tokens + math.log(vocab)) < 0.5  # |logit| < 1, as assumed
        bound = 2 * tokens * LOGIT_TERMS * FP32_EPS
        assert abs(x["answer_logprob"] - y["answer_logprob"]) <= bound
    for name in ("summary.csv", "summary.md", "heatmap.png", "cases.jsonl", "settings.json"):
        assert (ring / name).is_file()
    assert "| 144 |" in (ring / "summary.md").read_text()

    # DP over cases: 2 processes with cp = 1 split the cases between two replicas, same results.
    assert [r["generated"] for r in _results(dp)] == [r["generated"] for r in a]
    assert (dp / "results-dp1.jsonl").is_file()

    # Resume: the dropped case was evaluated again, and only that one.
    lines = int((tmp_path / "ring-lines.txt").read_text())
    assert len((ring / "results-dp0.jsonl").read_text().splitlines()) == lines
    assert [r["generated"] for r in _results(ring)] == [r["generated"] for r in a]


def test_eval_loads_a_lora_adapter_with_its_saved_base_config(tmp_path, saved_tiny_model):
    """An adapter folder (as the trainer exports it: adapter + the run's base config) loads merged."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ringft.evals.model import load_eval_model

    base_dir, adapter_dir = saved_tiny_model, tmp_path / "adapter"
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    peft_model = get_peft_model(
        base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    peft_model.save_pretrained(adapter_dir)
    trained_config = peft_model.get_base_model().config
    trained_config.rope_parameters = {**trained_config.rope_parameters, "rope_theta": 123456.0}
    trained_config.save_pretrained(adapter_dir)
    model = load_eval_model(str(adapter_dir), torch.float32, torch.device("cpu"))
    assert model.config.rope_parameters["rope_theta"] == 123456.0
    assert not hasattr(model, "peft_config")  # merged into a plain model
    ids = torch.randint(1, 100, (1, 12))
    fresh = AutoModelForCausalLM.from_pretrained(base_dir)
    assert not torch.allclose(model(ids).logits, fresh(ids).logits)  # the adapter is applied


def test_defaults_stop_at_eos_and_one_prefill_per_case():
    """LongChat's budget (100 new tokens) and rule by default; generation stops at every EOS id of
    the tokenizer and the generation config; one engine call per case (a single prefill serves
    generation and the teacher-forced score)."""
    from types import SimpleNamespace

    from ringft.data.tokenizer import load_demo_tokenizer
    from ringft.evals.lines.cases import make_line_case
    from ringft.evals.lines.task import evaluate_case, parse_args, stop_token_ids

    args = parse_args(["--model", "m"])
    assert (args.max_new_tokens, args.scoring, args.prompt_style) == (100, "longchat", None)  # None: longchat
    tok = load_demo_tokenizer()
    chat_model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[7, tok.eos_token_id]))
    assert stop_token_ids(chat_model, tok) == sorted({7, tok.eos_token_id})
    assert stop_token_ids(SimpleNamespace(), tok) == [tok.eos_token_id]

    calls = []

    class OnlyJointEngine:  # the old two-pass code called generate() and answer_logprob()
        def generate_and_score(self, prompt_ids, answer_ids, max_new_tokens, eos_token_id=None):
            calls.append((len(prompt_ids), answer_ids, max_new_tokens, eos_token_id))
            return tok(" 12 then 7", add_special_tokens=False)["input_ids"], -0.5, False

    case = make_line_case(tok, 200, 0.5, seed=3, prompt_style="longchat")
    record = evaluate_case(OnlyJointEngine(), tok, case, 100, [7, 2])
    answer = tok(" " + case.answer, add_special_tokens=False)["input_ids"]
    assert calls == [(case.num_tokens, answer, 100, [7, 2])]
    assert record["generated"].strip() == "12 then 7" and record["answer_prob"] == math.exp(-0.5)


def test_summary_reports_accuracy_and_answer_probability(tmp_path):
    from ringft.evals.lines.summary import summarize

    def record(length, depth, correct, prob):
        return dict(length=length, depth=depth, correct=correct, answer_prob=prob, num_tokens=length - 3,
                    teacher_forced_correct=prob > 0.5)  # fmt: skip

    results = [record(100, 0.0, True, 0.9), record(100, 0.0, False, 0.5), record(100, 1.0, False, 3e-5)]
    results += [record(200, 0.0, True, 0.7), record(200, 1.0, True, 0.8)]
    table = summarize(results, tmp_path, "longchat", 100)
    import csv

    rows = {(r["length"], r["depth"]): r for r in csv.DictReader(open(tmp_path / "summary.csv"))}
    assert (
        rows[("100", "0.0")]["accuracy"] == "0.5000"
        and float(rows[("100", "0.0")]["mean_answer_prob"]) == 0.7
    )
    assert rows[("100", "1.0")]["cases"] == "1" and float(rows[("100", "1.0")]["mean_answer_prob"]) == 3e-5
    assert "| 100 | 0.50 | 0.00 | 0.33 | 97 |" in table  # accuracy by depth, all, mean tokens
    assert "| 100 | 0.70 | 3.0e-05 | 0.47 | 97 |" in table  # mean answer probability, small ones readable
    assert "the last integer of the output" in table and (tmp_path / "heatmap.png").is_file()
