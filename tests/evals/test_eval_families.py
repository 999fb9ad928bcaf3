"""``ringft eval-lines`` on Gemma 3 and Qwen2 models with their chat templates.

Tiny random models (windowed: Gemma 3's local layer and Qwen2's upper layer have a 32-token window,
prompts are 256 tokens) with the demo tokenizer, its turn markers added as special tokens and the
families' chat-template formats (Gemma 3: ``<bos><start_of_turn>user ... <end_of_turn>`` then
``<start_of_turn>model``, end of turn as a stop token; Qwen2.5: ChatML with its default system turn).

Oracles: transformers' own ``apply_chat_template(..., tokenize=True)`` for the prompt ids, and the
unmodified model (eager, one process): its greedy ``generate`` for the generated ids, its logits for
the answer's teacher-forced log-probability (within the bound of test_eval_lines.py: ``2 * answer
tokens * (keys + features) * eps``, logits of this random init below 1).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ringft.utils.spawn import run_distributed

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
QWEN_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are Qwen, created by Alibaba "
    "Cloud. You are a helpful assistant.<|im_end|>\\n' }}{% endif %}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
FAMILIES = {  # model_type, config, chat template, turn markers (the last one ends a turn)
    "gemma3": (
        "gemma3_text",
        {"head_dim": 16, "query_pre_attn_scalar": 12, "layer_types": ["sliding_attention", "full_attention"]},
        GEMMA_TEMPLATE,
        ["<start_of_turn>", "<end_of_turn>"],
    ),
    "qwen2": (
        "qwen2",
        {"use_sliding_window": True, "max_window_layers": 1},
        QWEN_TEMPLATE,
        ["<|im_start|>", "<|im_end|>"],
    ),
}
LENGTH = 256
FP32_EPS = torch.finfo(torch.float32).eps
LOGIT_TERMS = LENGTH + 64  # as test_eval_lines.py: keys + features behind a logit (1..2 layers)


def save_family_model(path: Path, name: str) -> None:
    """A 2-layer random model of family ``name`` (window 32) with its chat template and stop token."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ringft.data.tokenizer import load_demo_tokenizer

    model_type, extra, template, markers = FAMILIES[name]
    tok = load_demo_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": markers})
    tok.chat_template = template
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=32,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids(markers[-1])]
    model.save_pretrained(path)
    tok.save_pretrained(path)


def eval_runs(rank: int, world: int, models: list[str], tmp: str) -> int:
    """Every model: eval-lines on CP = 2, in one 2-process group."""
    from ringft.evals.lines.task import main

    for model in models:
        args = ["--model", model, "--lengths", str(LENGTH), "--depths", "0,1", "--cases", "1",
                "--output", f"{model}-cp2", "--dtype", "fp32", "--attn-backend", "torch", "--cp-size", "2",
                "--no-progress", "--max-new-tokens", "4", "--prompt-style", "longchat"]  # fmt: skip
        assert main(args) == 0
    return 0


def _results(out: str) -> list[dict]:
    rows = []
    for part in sorted(Path(out).glob("results-dp*.jsonl")):
        rows += [json.loads(x) for x in part.read_text().splitlines()]
    return sorted(rows, key=lambda r: r["key"])


@pytest.mark.numerics
@pytest.mark.timeout(300)
def test_eval_lines_with_chat_templates_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ringft.evals.lines.cases import LineCase

    models = []
    for name in FAMILIES:
        save_family_model(tmp_path / name, name)
        models.append(str(tmp_path / name))
    assert run_distributed(eval_runs, 2, models, str(tmp_path), timeout=240) == [0, 0]
    for name, model_dir in zip(FAMILIES, models):
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
        ring = _results(f"{model_dir}-cp2")
        lines = Path(f"{model_dir}-cp2", "cases.jsonl").read_text().splitlines()
        cases = [LineCase.from_json(x) for x in lines]
        assert len(ring) == len(cases) == 2
        stops = model.generation_config.eos_token_id
        for case, x in zip(sorted(cases, key=lambda c: c.depth), ring):
            assert case.chat_template
            start, end = FAMILIES[name][3]
            content = case.prompt.split(start + "user\n", 1)[1].rsplit(end, 1)[0]
            messages = [{"role": "user", "content": content}]
            want = tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )
            ids = case.input_ids(tok)
            assert ids == list(want["input_ids"]), name  # the same tokens transformers gives the model
            answer = tok(case.answer, add_special_tokens=False)["input_ids"]  # the reply after the header
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False,
                                     eos_token_id=stops, pad_token_id=tok.pad_token_id)  # fmt: skip
                logits = model(torch.tensor([ids + answer])).logits[0, len(ids) - 1 : -1].double()
            generated = out[0, len(ids) :].tolist()
            generated = generated[: next((i for i, t in enumerate(generated) if t in stops), len(generated))]
            assert x["generated_ids"] == generated, name
            logprob = logits.log_softmax(-1).gather(1, torch.tensor(answer)[:, None]).sum().item()
            bound = 2 * len(answer) * LOGIT_TERMS * FP32_EPS
            assert abs(x["answer_logprob"] - logprob) <= bound, (name, x["answer_logprob"], logprob)
            assert math.isfinite(x["answer_logprob"])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_task_plans_with_the_family_config_and_template(tmp_path, name, monkeypatch):
    """eval-ppl, eval-niah, eval-ruler and eval-short accept a Gemma 3 / Qwen2 model folder: every input
    check passes and the cases build from its config and tokenizer with no model loaded
    (``prepare_run``); the generation tasks' prompts are the family's chat template around the task
    (the same ids as transformers' ``apply_chat_template``), counted in the length, and the answer
    prefix follows the template's model turn. The ring evaluation itself is the family-independent
    harness checked above (eval-lines) and in test_eval_tasks_real_model.py."""
    import transformers
    from transformers import AutoTokenizer

    from ringft.data.tokenizer import encode_prompt
    from ringft.evals.harness import parse_task_args
    from ringft.evals.niah.task import NiahTask
    from ringft.evals.ppl.task import PplTask
    from ringft.evals.prepare import prepare_run
    from ringft.evals.ruler.task import RulerTask
    from ringft.evals.short.task import ShortTask

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded while planning")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    model = str(tmp_path / name)
    save_family_model(tmp_path / name, name)
    text = tmp_path / "a.txt"
    text.write_text("The lighthouse keeper climbed the stairs at dusk and wrote the weather down. " * 40)
    common = ["--model", model, "--dtype", "fp32", "--no-progress"]
    runs = {
        PplTask(): [
            "--baseline",
            model,
            "--text",
            str(text),
            "--lengths",
            "128,256",
            "--native-window",
            "128",
        ],
        ShortTask(): ["--baseline", model, "--text", str(text), "--length", "128"],
        NiahTask(): ["--lengths", "400", "--depths", "0,1", "--samples", "1"],
        RulerTask(): ["--tasks", "niah_multikey_2,vt,cwe,fwe", "--lengths", "1400", "--samples", "1"],
    }
    tok = AutoTokenizer.from_pretrained(model)
    start, end = FAMILIES[name][3]
    for task, argv in runs.items():
        args = parse_task_args(task, [*common, *argv, "--output", str(tmp_path / task.command)])
        plan = prepare_run(task, args)
        assert plan.cases and plan.ctx.configs["model"].model_type == FAMILIES[name][0], task.command
        assert not (tmp_path / task.command).exists()  # nothing written before start()
        if not isinstance(task, (NiahTask, RulerTask)):
            continue
        for case in plan.cases:
            assert case.chat_template, (task.command, case.task)
            ids = encode_prompt(tok, case.prompt, case.chat_template)
            assert len(ids) == case.num_tokens <= case.length - case.tokens_to_generate
            content = case.prompt.split(start + "user\n", 1)[1].rsplit(end, 1)[0]
            messages = [{"role": "user", "content": content}]
            want = tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )
            assert ids[: len(want["input_ids"])] == list(want["input_ids"]), (task.command, case.task)
