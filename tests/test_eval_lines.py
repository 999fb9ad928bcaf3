"""``ringft eval-lines`` end to end on CPU: CP = 2 results equal one-process results; resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ringft.testing import run_distributed


def _save_tiny_model(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from ringft.demo_tokenizer import load_demo_tokenizer

    tok = load_demo_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        )
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)


def eval_worker(rank: int, world: int, model: str, out: str, cp: int) -> int:
    from ringft.evals.lines import main

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
            "--backend",
            "torch",
            "--cp",
            str(cp),
            "--no-progress",
            "--max-new-tokens",
            "4",
        ]
    )


def _results(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_eval_lines_cp_matches_one_process_and_resumes(tmp_path):
    model = tmp_path / "model"
    _save_tiny_model(model)
    one, ring, dp = tmp_path / "one", tmp_path / "ring", tmp_path / "dp"
    assert run_distributed(eval_worker, 1, str(model), str(one), 1, timeout=120) == [0]
    assert run_distributed(eval_worker, 2, str(model), str(ring), 2, timeout=120) == [0, 0]
    a, b = _results(one), _results(ring)
    assert len(a) == 8 and [r["key"] for r in a] == [r["key"] for r in b]
    for x, y in zip(a, b):
        assert x["generated"] == y["generated"] and x["correct"] == y["correct"]
        assert abs(x["answer_prob"] - y["answer_prob"]) <= 1e-5 * max(x["answer_prob"], 1e-30) + 1e-12
    for name in ("summary.csv", "summary.md", "heatmap.png", "cases.jsonl"):
        assert (ring / name).is_file()
    assert "| 144 |" in (ring / "summary.md").read_text()

    # DP over cases: 2 processes with cp = 1 split the cases between two replicas, same results.
    assert run_distributed(eval_worker, 2, str(model), str(dp), 1, timeout=120) == [0, 0]
    assert [r["generated"] for r in _results(dp)] == [r["generated"] for r in a]
    assert (dp / "results-dp1.jsonl").is_file()

    # Resume: drop one finished case; a re-run evaluates only that one.
    part = ring / "results-dp0.jsonl"
    lines = part.read_text().splitlines()
    part.write_text("\n".join(lines[:-1]) + "\n")
    assert run_distributed(eval_worker, 2, str(model), str(ring), 2, timeout=120) == [0, 0]
    assert len(part.read_text().splitlines()) == len(lines)
    assert [r["generated"] for r in _results(ring)] == [r["generated"] for r in a]


def test_eval_loads_a_lora_adapter_with_its_saved_base_config(tmp_path):
    """An adapter folder (as the trainer exports it: adapter + the run's base config) loads merged."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ringft.evals.lines import load_eval_model

    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    _save_tiny_model(base_dir)
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
