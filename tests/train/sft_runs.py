"""Runs of ``ringft train`` with ``data.format`` (raw SFT records through TRL's ``SFTTrainer`` on the
ring) and of TRL's plain ``SFTTrainer`` in one process on the same records and settings, for
tests/train/test_sft_format.py (module level: run_distributed imports it).

The model is tests/train/hf_runs.py's tiny LLaMA (2 layers, hidden 32, fp32, seeded) saved with the
demo tokenizer and :data:`TEMPLATE`, a chat template with ``{% generation %}`` markers around the
assistant turns (TRL's assistant-only loss reads them). The records are short word strings:
:data:`CASES` names, per run, the format, the files (messages .jsonl, prompt_completion .parquet,
text a save_to_disk folder) and the keys. The one-process oracle's ``SFTConfig`` is written out
here by hand from the recipe's values, not built by ringft.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.train.hf_runs import _first_step_gradients, _weights, tiny_model, tokenizer

TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ 'A: ' + m['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ 'U: ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}"
)
SEQ_LEN, MICRO_BATCH, STEPS, LR = 64, 2, 3, 1e-3
WORDS = (
    "river stone cloud maple harbor lantern meadow copper willow falcon ember orchard the a is of and "
    "quick brown fox jumps over lazy dog bright cold day clocks striking thirteen number answer value"
).split()
# name -> the recipe's data keys (besides path, seq_len, shuffle, too_long) and train.grad_accum
CASES: dict[str, dict[str, Any]] = {
    "messages": {"data": {"format": "messages", "assistant_only_loss": True}},
    "messages-packed": {"data": {"format": "messages", "packing": True}},
    "prompt_completion": {
        "data": {"format": "prompt_completion", "eval_path": "pc_eval.jsonl"},
        "eval": True,
    },
    "prompt_completion-packed": {"data": {"format": "prompt_completion", "packing": True}},
    "text": {"data": {"format": "text", "text_field": "body"}},
    "text-packed": {"data": {"format": "text", "packing": True}, "ga": 2},
}
FILES = {"messages": "chats.jsonl", "prompt_completion": "pc.parquet", "text": "texts"}


def _sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def make_root(root: Path, n: int = 24) -> Path:
    """The model folder (``model``) and the records (``chats.jsonl``, ``pc.parquet`` +
    ``pc_eval.jsonl``, ``texts`` with columns ``body`` and ``text``) under ``root``."""
    import datasets

    tok = tokenizer()
    tok.chat_template = TEMPLATE
    tiny_model(tok, lora=False).save_pretrained(str(root / "model"))
    tok.save_pretrained(str(root / "model"))
    rng = random.Random(5)
    chats = []
    for _ in range(n):
        turns = []
        for _ in range(rng.randint(1, 2)):
            turns += [
                {"role": "user", "content": _sentence(rng, 2, 6)},
                {"role": "assistant", "content": _sentence(rng, 2, 6)},
            ]
        chats.append({"messages": turns})
    datasets.Dataset.from_list(chats).to_json(str(root / "chats.jsonl"))
    pairs = [{"prompt": _sentence(rng, 3, 9), "completion": " " + _sentence(rng, 2, 8)} for _ in range(n + 6)]
    datasets.Dataset.from_list(pairs[:n]).to_parquet(str(root / "pc.parquet"))
    datasets.Dataset.from_list(pairs[n:]).to_json(str(root / "pc_eval.jsonl"))
    texts = [{"body": _sentence(rng, 4, 20)} for _ in range(n)]
    datasets.Dataset.from_list([{**t, "text": t["body"]} for t in texts]).save_to_disk(str(root / "texts"))
    return root


def recipe(name: str, root: Path, out: Path, cp: int = 2) -> dict[str, Any]:
    """The raw recipe of case ``name`` (what a YAML file parses to)."""
    case = CASES[name]
    data = {**case["data"], "path": str(root / FILES[case["data"]["format"]])}
    if "eval_path" in data:
        data["eval_path"] = str(root / data["eval_path"])
    return {
        "model": {"name_or_path": str(root / "model"), "dtype": "fp32", "attn_backend": "torch"},
        "data": {**data, "seq_len": SEQ_LEN, "shuffle": False, "too_long": "truncate"},
        "parallel": {"cp_size": cp},
        "train": {
            "micro_batch_size": MICRO_BATCH,
            "grad_accum": case.get("ga", 1),
            "max_steps": STEPS,
            "lr": LR,
            "warmup_steps": 0,
            "schedule": "constant",
            "grad_clip": 1.0,
            "gradient_checkpointing": False,
            "loss_chunk_size": 16,
            "eval_every": STEPS if case.get("eval") else 0,
        },
        "checkpoint": {"output_dir": str(out), "save_final": False},
        "logging": {"tracker": "none"},
    }


def _rows(dataset: Any, n: int = 6) -> list[dict[str, list[int]]]:
    """The first ``n`` rows of a prepared (tokenized) dataset: input_ids, labels, seq_lengths."""
    keys = [k for k in ("input_ids", "labels", "seq_lengths") if k in dataset.column_names]
    return [{k: list(dataset[i][k]) for k in keys} for i in range(min(n, len(dataset)))]


def _logs(history: list[dict]) -> dict[str, Any]:
    train = [h for h in history if "loss" in h]
    evals = [h["eval_loss"] for h in history if "eval_loss" in h]
    return {
        "losses": [h["loss"] for h in train],
        "grad_norms": [h["grad_norm"] for h in train],
        "eval_loss": evals[-1] if evals else None,
    }


def per_document_loss(model: torch.nn.Module, rows: list[dict]) -> float:
    """The mean token loss of packed ``rows`` with every document run alone through ``model`` (fp64
    cross-entropy; a document's first label is not a target, as TRL's padding-free collator sets)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            start = 0
            for length in row["seq_lengths"]:
                ids = torch.tensor(row["input_ids"][start : start + length])
                labels = torch.tensor(row["labels"][start : start + length])
                start += length
                logits = model(input_ids=ids[None]).logits[0, :-1].double()
                target = labels[1:]
                total += torch.nn.functional.cross_entropy(
                    logits, target, ignore_index=-100, reduction="sum"
                ).item()
                count += int((target != -100).sum())
    return total / count


def oracle_run(name: str, root: Path, out: Path) -> dict[str, Any]:
    """TRL's SFTTrainer in one process, with the recipe's settings written out as an SFTConfig."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    raw = recipe(name, root, out, cp=1)
    d, t = raw["data"], raw["train"]
    evaluate = bool(t["eval_every"])
    args = SFTConfig(
        output_dir=str(out),
        per_device_train_batch_size=MICRO_BATCH,
        per_device_eval_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=t["grad_accum"],
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        optim="adamw_torch",
        seed=0,
        train_sampling_strategy="sequential",  # data.shuffle: false
        dataloader_drop_last=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=STEPS,
        max_length=SEQ_LEN,
        packing=d.get("packing", False),
        assistant_only_loss=d.get("assistant_only_loss", False),
        dataset_text_field=d.get("text_field", "text"),
    )

    def load(path: str) -> Any:
        p = Path(path)
        if p.is_dir():
            return datasets.load_from_disk(path)
        return datasets.load_dataset(
            "json" if p.suffix == ".jsonl" else "parquet", data_files=path, split="train"
        )

    model = AutoModelForCausalLM.from_pretrained(str(root / "model"), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(root / "model"))
    evals = load(d["eval_path"]) if "eval_path" in d else None
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=load(d["path"]), eval_dataset=evals, processing_class=tok
    )
    grads: dict[str, Any] = {}
    trainer.add_callback(_first_step_gradients(grads))
    initial = _weights(trainer.model)
    rows = _rows(trainer.train_dataset)
    first = rows[: MICRO_BATCH * t["grad_accum"]]
    per_doc = per_document_loss(trainer.model, first) if "seq_lengths" in first[0] else None
    trainer.train()
    return {
        **_logs(trainer.state.log_history),
        "grads": grads,
        "initial": initial,
        "final": _weights(trainer.model),
        "rows": rows,
        "per_document_loss": per_doc,
    }


def ring_run(name: str, root: Path, out: Path) -> dict[str, Any]:
    """``ringft train`` of the case's recipe (the default engine), at the launch's world size."""
    from ringft.train import front
    from ringft.train.recipe import recipe_from_dict

    rec = recipe_from_dict(recipe(name, root, out))
    trainer, folder = front.build_trainer(rec, progress=False)
    grads: dict[str, Any] = {}
    trainer.add_callback(_first_step_gradients(grads))
    initial = _weights(trainer.model)
    try:
        front._run(trainer, folder, rec)
    finally:
        folder.release()
    result = {**_logs(trainer.state.log_history), "rows": _rows(trainer.train_dataset)}
    result["cp"] = trainer.ring_layout.cp_size
    if not dist.is_initialized() or dist.get_rank() == 0:
        result.update(grads=grads, initial=initial, final=_weights(trainer.model))
    return result


def worker(rank: int, world: int, root: str, alone: list[list[str]], together: list[str]) -> dict:
    """Rank ``r`` runs the oracles ``alone[r]`` with no process group, then every rank runs the ring
    runs ``together`` in a fresh ``world``-rank gloo group; results by case name."""
    import os
    import time

    from tests.train.hf_runs import _DIST_ENV, _reset_accelerate
    from tests.workers import fresh_group, one_thread

    one_thread()
    os.environ["HF_DATASETS_CACHE"] = f"{root}/hf-cache"
    saved = {k: os.environ[k] for k in _DIST_ENV if k in os.environ}
    dist.destroy_process_group()
    for key in saved:
        del os.environ[key]
    os.environ["WORLD_SIZE"] = "1"
    base = Path(root)
    out: dict[str, Any] = {"alone": {}, "together": {}}
    for name in alone[rank]:
        _reset_accelerate()
        start = time.perf_counter()
        out["alone"][name] = oracle_run(name, base, base / f"one-{name}")
        out["alone"][name]["seconds"] = time.perf_counter() - start
    os.environ.update(saved)
    for i, name in enumerate(together):
        fresh_group(str(base / "store"), i, rank, world)
        start = time.perf_counter()
        out["together"][name] = ring_run(name, base, base / f"ring-{name}")
        out["together"][name]["seconds"] = time.perf_counter() - start
    return out
