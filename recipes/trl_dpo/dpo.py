"""Preference fine-tuning with TRL's DPOTrainer on ringft's ring (``ringft.RingDPOTrainer``).

TRL's own script shape (``TrlParser``: every ``DPOConfig`` / ``ModelConfig`` option on the command
line) plus the ring's options: ``--cp_size`` (ranks per ring; 1: TRL's DPOTrainer unchanged, the
one-process oracle the tests compare against), ``--ulysses_size`` (CP = Ulysses x ring),
``--attn_backend``. One script for the 8-GPU node (recipes/trl_dpo/run.sh) and its CPU variant
(recipes/trl_dpo/run_cpu.sh); launch it with ``accelerate launch`` (world = dp x cp).

Data: ``--dataset_name`` is a hub dataset with ``prompt`` / ``chosen`` / ``rejected`` columns
(conversational or plain text), a local .json / .jsonl file, or ``synthetic-pairs[:N]`` (made-up
arithmetic questions, the right answer chosen and a wrong one rejected: no download; the default).
``--eval_strategy steps`` evaluates on ``--dataset_test_split`` (as recipes/trl_sft/sft.py). Writes
``<output_dir>/log_history.json`` (the Trainer's logs), ``run_info.json`` (world, dp, cp, the
accelerate distributed type) and the trained model (or adapter) to ``<output_dir>/final``.
"""

from __future__ import annotations

import random

from ringft.train.hf.scripts import RingArguments, load_model, script_datasets, write_run_files


def synthetic_pairs(n: int, seed: int) -> list[dict]:
    """``n`` conversational preference pairs (a sum, right vs wrong), reproducible from ``seed``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        wrong = a + b + rng.choice([-10, -1, 1, 10, 100])
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
                "chosen": [{"role": "assistant", "content": f"{a} plus {b} is {a + b}."}],
                "rejected": [{"role": "assistant", "content": f"{a} plus {b} is {wrong}."}],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    """Train (see the module docstring)."""
    from trl import DPOConfig, DPOTrainer, ModelConfig, ScriptArguments, TrlParser, get_peft_config

    parser = TrlParser((ScriptArguments, DPOConfig, ModelConfig, RingArguments))
    script, config, model_args, ring_args = parser.parse_args_and_config(argv)
    model, tokenizer = load_model(model_args, config)
    data = dict(
        model=model,
        args=config,
        **script_datasets(script, config, "synthetic-pairs", synthetic_pairs),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    ring = ring_args.trainer_keywords(memory_options=False)
    if ring:
        from ringft import RingDPOTrainer

        trainer = RingDPOTrainer(**data, **ring)
    else:
        trainer = DPOTrainer(**data)
    trainer.train()
    write_run_files(trainer, config.output_dir)


if __name__ == "__main__":
    main()
