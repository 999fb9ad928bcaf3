"""Reinforcement learning with TRL's GRPOTrainer on ringft's ring (``ringft.RingGRPOTrainer``).

TRL's own script shape (``TrlParser``: every ``GRPOConfig`` / ``ModelConfig`` option on the command
line) plus the ring's options: ``--cp_size`` (ranks per ring; 1: TRL's GRPOTrainer unchanged, the
one-process oracle the tests compare against), ``--ulysses_size`` (CP = Ulysses x ring),
``--attn_backend``. One script for the 8-GPU node (recipes/trl_grpo/run.sh) and its CPU variant
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

import random
import re

from ringft.train.hf.scripts import RingArguments, load_model, script_datasets, write_run_files


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


def main(argv: list[str] | None = None) -> None:
    """Train (see the module docstring)."""
    from trl import GRPOConfig, GRPOTrainer, ModelConfig, ScriptArguments, TrlParser, get_peft_config

    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig, RingArguments))
    script, config, model_args, ring_args = parser.parse_args_and_config(argv)
    model, tokenizer = load_model(model_args, config, padding_side="left")
    data = dict(
        model=model,
        reward_funcs=[correct_answer, mentions_operands],
        args=config,
        **script_datasets(script, config, "synthetic-sums", synthetic_sums, evaluate=False),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    ring = ring_args.trainer_keywords(memory_options=False)
    if ring:
        from ringft import RingGRPOTrainer

        trainer = RingGRPOTrainer(**data, **ring)
    else:
        trainer = GRPOTrainer(**data)
    trainer.train()
    write_run_files(trainer, config.output_dir)


if __name__ == "__main__":
    main()
