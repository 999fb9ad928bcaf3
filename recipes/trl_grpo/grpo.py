"""Reinforcement learning with TRL's GRPOTrainer on ringft's ring (``ringft.RingGRPOTrainer``).

TRL's own script shape (``TrlParser``: every ``GRPOConfig`` / ``ModelConfig`` option on the command
line) plus the ring's options: ``--cp_size`` (ranks per ring; 1: TRL's GRPOTrainer unchanged, the
one-process oracle the tests compare against), ``--ulysses_size`` (CP = Ulysses x ring),
``--ring_backend``. One script for the 8-GPU node (recipes/trl_grpo/run.sh) and its CPU variant
(recipes/trl_grpo/run_cpu.sh); launch it with ``accelerate launch`` (world = dp x cp).

Data: ``--dataset_name`` is a hub dataset with a ``prompt`` column (and an ``answer`` column for
the ``correct_answer`` reward), a local .json / .jsonl file, or ``synthetic-sums[:N]`` (made-up
arithmetic questions with their answers: no download). Rewards (rule-based, both summed):
``correct_answer`` (1 when the completion contains the answer) and ``mentions_operands`` (the
fraction of the question's numbers the completion repeats). Writes
``<output_dir>/log_history.json`` (the Trainer's logs), ``run_info.json`` (world, dp, cp) and the
trained model (or adapter) to ``<output_dir>/final``.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RingArguments:
    """The ring's options (ringft.RingTrainerMixin keywords)."""

    cp_size: int = field(default=1, metadata={"help": "ranks per ring (1: TRL's GRPOTrainer unchanged)"})
    ulysses_size: int = field(default=1, metadata={"help": "CP = Ulysses x ring (1: the ring alone)"})
    ring_backend: str = field(default="auto", metadata={"help": "auto, flash_attn, torch or reference"})


def synthetic_sums(n: int, seed: int) -> list[dict]:
    """``n`` conversational questions (a sum) with their answers, reproducible from ``seed``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}], "answer": str(a + b)})
    return rows


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def correct_answer(completions, answer, **kwargs) -> list[float]:
    """1 when the completion contains the answer, else 0."""
    return [float(a in _text(c)) for c, a in zip(completions, answer)]


def mentions_operands(prompts, completions, **kwargs) -> list[float]:
    """The fraction of the question's numbers that the completion repeats."""
    out = []
    for p, c in zip(prompts, completions):
        numbers = re.findall(r"\d+", _text(p))
        out.append(sum(x in _text(c) for x in numbers) / max(len(numbers), 1))
    return out


def load_prompts(name: str, split: str, seed: int):
    """The prompts as a ``datasets.Dataset``."""
    import datasets

    if name.startswith("synthetic-sums"):
        n = int(name.split(":")[1]) if ":" in name else 512
        return datasets.Dataset.from_list(synthetic_sums(n, seed))
    if name.endswith((".json", ".jsonl")):
        return datasets.load_dataset("json", data_files=name, split="train")
    return datasets.load_dataset(name, split=split)


def main(argv: list[str] | None = None) -> None:
    """Train (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer, ModelConfig, ScriptArguments, TrlParser, get_peft_config

    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig, RingArguments))
    script, config, model_args, ring_args = parser.parse_args_and_config(argv)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, padding_side="left")
    dtype = torch.bfloat16 if config.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path, dtype=dtype, attn_implementation="sdpa"
    )
    data = dict(
        model=model,
        reward_funcs=[correct_answer, mentions_operands],
        args=config,
        train_dataset=load_prompts(script.dataset_name, script.dataset_train_split, config.seed),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    if ring_args.cp_size > 1:
        from ringft import RingGRPOTrainer

        trainer = RingGRPOTrainer(
            **data,
            cp_size=ring_args.cp_size,
            ulysses_size=ring_args.ulysses_size,
            ring_backend=ring_args.ring_backend,
        )
    else:
        trainer = GRPOTrainer(**data)
    trainer.train()
    if trainer.is_world_process_zero():
        out = Path(config.output_dir)
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
        layout = getattr(trainer, "ring_layout", None)
        world = trainer.accelerator.num_processes
        info = {
            "world": world,
            "dp": layout.dp_size if layout else world,
            "cp": layout.cp_size if layout else 1,
        }
        (out / "run_info.json").write_text(json.dumps(info))
    trainer.save_model(str(Path(config.output_dir) / "final"))


if __name__ == "__main__":
    main()
