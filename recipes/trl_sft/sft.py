"""Chat SFT with TRL's SFTTrainer, documents packed (bfd, padding-free), on ringft's ring.

One script for the 8-GPU node (recipes/trl_sft/run.sh) and its CPU variant
(recipes/trl_sft/run_cpu.sh); launch it with ``accelerate launch`` (world = dp x cp), or with plain
``python`` for one process. ``--cp-size 1`` is TRL's SFTTrainer unchanged: the one-process oracle
the tests compare the ring against (tests/recipes/test_trl_sft_recipe.py).

Data: ``--dataset`` is a hub dataset name, a local .json / .jsonl file, or ``synthetic-chat`` (short
made-up conversations built here: no download); records carry ``messages`` (TRL's conversational
format: the model's chat template is applied, then the tokens are packed into rows of
``--max-length``). Writes ``<output-dir>/log_history.json`` (the Trainer's logs, main process),
``run_info.json`` (world, dp, cp, engine) and the trained model (or LoRA adapter) to
``<output-dir>/final``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


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


def load_chats(name: str, split: str, seed: int):
    """The conversations as a ``datasets.Dataset`` with a ``messages`` column."""
    import datasets

    if name.startswith("synthetic-chat"):
        n = int(name.split(":")[1]) if ":" in name else 512
        return datasets.Dataset.from_list(synthetic_chats(n, seed))
    if name.endswith((".json", ".jsonl")):
        return datasets.load_dataset("json", data_files=name, split="train")
    return datasets.load_dataset(name, split=split)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model folder or hub name (LLaMA / Mistral family)")
    p.add_argument(
        "--dataset", default="synthetic-chat", help="hub name, .json/.jsonl file, or synthetic-chat[:N]"
    )
    p.add_argument("--dataset-split", default="train")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--cp-size", type=int, default=1, help="ranks per ring (1: TRL's SFTTrainer unchanged)")
    p.add_argument("--ulysses-size", type=int, default=1, help="CP = Ulysses x ring (1: the ring alone)")
    p.add_argument("--max-length", type=int, default=2048, help="tokens per packed row")
    p.add_argument("--micro-batch", type=int, default=1, help="packed rows per replica and micro-step")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=-1, help="-1: one epoch")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument(
        "--lora", type=int, default=0, help="LoRA rank on the attention projections (0: full fine-tuning)"
    )
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPUs)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--loss-chunk-size", type=int, default=4096, help="tokens per lm_head + loss chunk")
    p.add_argument("--tiled-mlp-tokens", type=int, default=None)
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: no checkpoints)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Train (see the module docstring)."""
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from ringft import RingTrainerMixin

    class RingSFTTrainer(RingTrainerMixin, SFTTrainer):
        """TRL's SFTTrainer on ringft's ring."""

    config = SFTConfig(
        output_dir=args.output_dir,
        packing=True,  # bfd: padding-free rows, documents masked apart by the ring
        max_length=args.max_length,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.max_steps,
        num_train_epochs=1,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=0.03,  # a fraction of the steps
        bf16=args.bf16,
        activation_checkpointing=args.gradient_checkpointing,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        seed=args.seed,
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),  # else accelerate runs each CPU process alone
    )
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
        peft_config = LoraConfig(
            r=args.lora, lora_alpha=2 * args.lora, target_modules=targets, task_type="CAUSAL_LM"
        )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
    ring = {}
    if args.cp_size > 1 or args.tiled_mlp_tokens:
        ring = dict(
            cp_size=args.cp_size,
            ulysses_size=args.ulysses_size,
            loss_chunk_size=args.loss_chunk_size,
            tiled_mlp_tokens=args.tiled_mlp_tokens,
        )
    trainer = (RingSFTTrainer if ring else SFTTrainer)(
        model=model,
        args=config,
        train_dataset=load_chats(args.dataset, args.dataset_split, args.seed),
        processing_class=tokenizer,
        peft_config=peft_config,
        **ring,
    )
    trainer.train()
    if trainer.is_world_process_zero():
        out = Path(args.output_dir)
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
        layout = getattr(trainer, "ring_layout", None)
        info = {
            "world": trainer.accelerator.num_processes,
            "dp": layout.dp_size if layout else trainer.accelerator.num_processes,
            "cp": layout.cp_size if layout else 1,
            "ulysses": layout.ulysses_size if layout else 1,
            "distributed_type": str(trainer.accelerator.distributed_type),
        }
        (out / "run_info.json").write_text(json.dumps(info))
    trainer.save_model(str(Path(args.output_dir) / "final"))


if __name__ == "__main__":
    main()
