"""Chat SFT with TRL's SFTTrainer, documents packed (bfd, padding-free), on ringft's ring.

A ``TrlParser`` script, as TRL's own ``trl/scripts/sft.py``: TRL's ``ScriptArguments``,
``SFTConfig`` and ``ModelConfig`` flags (``--model_name_or_path``, ``--dataset_name``,
``--max_length``, ``--packing``, ``--learning_rate``, ``--use_peft --lora_r 16``, ``--config
x.yaml``, ...; dashes or underscores) plus ringft's :class:`RingArguments` (``--cp_size``,
``--ulysses_size``, ``--loss_chunk_size``, ``--tiled_mlp_tokens``). One script for the 8-GPU node
(recipes/trl_sft/run.sh) and its CPU variant (recipes/trl_sft/run_cpu.sh); launch it with
``accelerate launch`` (world = dp x cp), or with plain ``python`` for one process. ``--cp_size 1``
is TRL's SFTTrainer unchanged: the one-process oracle the tests compare the ring against
(tests/train/test_hf_launch.py).

Data: ``--dataset_name`` is a hub dataset name, a local .json / .jsonl file, or ``synthetic-chat``
(short made-up conversations built here: no download; the default); records carry ``messages``
(TRL's conversational format: the model's chat template is applied, then the tokens are packed
into rows of ``--max_length``). With ``--eval_strategy steps`` (or ``epoch``) the eval loss is
computed on the ring on ``--dataset_test_split`` (a hub split, or a local .jsonl file; other
made-up chats for ``synthetic-chat``). Writes ``<output-dir>/log_history.json`` (the Trainer's
logs, main process), ``run_info.json`` (world, dp, cp, engine) and the trained model (or LoRA
adapter) to ``<output-dir>/final``.
"""

import random
from typing import Any

from ringft.train.hf.scripts import RingArguments, load_model, script_datasets, write_run_files


def synthetic_chats(n: int, seed: int) -> list[dict]:
    """``n`` short conversations (arithmetic, word reversal, counting), reproducible from ``seed``."""
    rng = random.Random(seed)
    words = "river stone cloud maple harbor lantern meadow copper willow falcon ember orchard".split()
    chats = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            a, b = rng.randint(2, 999), rng.randint(2, 999)
            q, r = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
        elif kind == 1:
            ws = rng.sample(words, rng.randint(3, 6))
            q, r = f"Reverse the order of these words: {' '.join(ws)}", " ".join(reversed(ws))
        else:
            ws = [rng.choice(words) for _ in range(rng.randint(4, 9))]
            w = rng.choice(ws)
            q, r = (
                f"How many times does '{w}' appear in: {', '.join(ws)}?",
                f"'{w}' appears {ws.count(w)} times.",
            )
        chats.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": r}]})
    return chats


def parse_args(argv: list[str] | None = None) -> tuple[Any, Any, Any, RingArguments]:
    """``(ScriptArguments, SFTConfig, ModelConfig, RingArguments)`` from ``argv`` (and ``--config``)."""
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig, RingArguments))
    return parser.parse_args_and_config(args=argv)


def main(argv: list[str] | None = None) -> None:
    """Train (see the module docstring)."""
    script, config, model_args, ring_args = parse_args(argv)
    from trl import SFTTrainer, get_peft_config

    from ringft import RingTrainerMixin

    class RingSFTTrainer(RingTrainerMixin, SFTTrainer):
        """TRL's SFTTrainer on ringft's ring."""

    model, tokenizer = load_model(model_args, config)
    ring = ring_args.trainer_keywords()
    trainer = (RingSFTTrainer if ring else SFTTrainer)(
        model=model,
        args=config,
        **script_datasets(script, config, "synthetic-chat", synthetic_chats),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        **ring,
    )
    trainer.train()
    write_run_files(trainer, config.output_dir)


if __name__ == "__main__":
    main()
