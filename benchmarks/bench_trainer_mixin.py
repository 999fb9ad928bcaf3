"""``ringft train`` vs ``RingTrainerMixin`` in ``transformers.Trainer`` and TRL's ``SFTTrainer``:
the same model, data and options, one run; tokens/s and peak memory per rank, against the planner.

Setup (the defaults): a small LLaMA (hidden 256, 4 layers, GQA 8:2, the demo tokenizer's 1658
tokens), fp32, sequences of ``--seq`` tokens (every example exactly that long: no padding in any
path), one ring of 2 gloo processes (cp 2, dp 1), micro batch 1, AdamW lr 1e-4 constant, grad clip
1.0, activation checkpointing, chunked loss (``--loss-chunk`` tokens). The three paths run the same
optimizer steps on the same examples:

- ``ringft train``: :func:`ringft.train.front.build_trainer` from a recipe (its ``RecipeTrainer``);
- ``Trainer + mixin``: ``RingTrainer(RingTrainerMixin, Trainer)`` with a padding collator;
- ``SFTTrainer + mixin``: ``RingSFTTrainer(RingTrainerMixin, SFTTrainer)``, ``packing=True`` (each
  example fills a packed row: one document per row, padding-free).

Each path runs in fresh processes (``--repeats`` times, alternating the paths, so that load on a
shared machine hits them alike). Step time: the wall time between the ends of consecutive
optimizer steps (data loading, the step, logging: everything a step costs), median over the steps
after ``--warmup``. Tokens/s = global tokens per step / step time. Memory: the rise of each rank's
resident set during a step above its level at the step's start (the kernel's high-water mark
reset before the step, as benchmarks/bench_memory.py does; ``MALLOC_MMAP_THRESHOLD_`` makes freed
buffers leave RSS), max over the timed steps: activations, gradients and transients (weights and
optimizer states are in the level). Planned: ``ringft.planner.plan_memory`` for the same setup,
checkpointed activations + the larger working set (layer or loss) + the gradients.

Run: ``python benchmarks/bench_trainer_mixin.py`` (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ringft without installing

from benchmarks.machine import describe_machine  # noqa: E402

MIB = 1 << 20
MODEL = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16384,
    "tie_word_embeddings": False,
}
PATHS = ("ringft train", "Trainer + mixin", "SFTTrainer + mixin")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


class StepMeter:
    """Step-end times and per-step RSS rise of this process."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.cpu: list[float] = []
        self.rises: list[int] = []
        self.base = 0

    def begin(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark restarts at the current RSS
        self.base = _status_kib("VmRSS") * 1024

    def end(self) -> None:
        self.rises.append(_status_kib("VmHWM") * 1024 - self.base)
        self.ends.append(time.perf_counter())
        self.cpu.append(time.process_time())


def _dataset(n: int, seq: int):
    import datasets
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1658, (n, seq), generator=gen).tolist()
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})


def _meter_callback(meter: StepMeter) -> Any:
    """A Trainer callback that times each optimizer step with ``meter``."""
    from transformers import TrainerCallback

    class Meter(TrainerCallback):
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            meter.begin()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            meter.end()

    return Meter()


def _run_ringft(out: Path, data: Path, a: argparse.Namespace, meter: StepMeter) -> None:
    from ringft.train import front
    from ringft.train.recipe import recipe_from_dict

    raw = {
        "model": {
            "config": MODEL,
            "model_type": "llama",
            "tokenizer": "demo",
            "dtype": "fp32",
            "attn_backend": "torch",
        },
        "data": {"path": str(data), "seq_len": a.seq, "shuffle": False},
        "parallel": {"cp_size": 2},
        "train": {
            "micro_batch_size": 1,
            "max_steps": a.steps,
            "lr": 1e-4,
            "warmup_steps": 0,
            "schedule": "constant",
            "grad_clip": 1.0,
            "weight_decay": 0.0,
            "gradient_checkpointing": True,
            "chunked_loss": True,
            "loss_chunk_size": a.loss_chunk,
            "seed": 0,
        },
        "checkpoint": {"output_dir": str(out), "save_every": 0},
        "logging": {"tracker": "none"},
    }
    recipe = recipe_from_dict(raw)
    trainer, folder = front.build_trainer(recipe, progress=False)
    trainer.add_callback(_meter_callback(meter))
    try:
        front._run(trainer, folder, recipe)
    finally:
        folder.release()


def _run_hf(kind: str, out: Path, a: argparse.Namespace, meter: StepMeter) -> None:
    import torch
    from transformers import (
        DataCollatorForSeq2Seq,
        LlamaConfig,
        LlamaForCausalLM,
        Trainer,
        TrainingArguments,
    )

    from ringft import RingTrainerMixin
    from ringft.data.tokenizer import load_tokenizer

    tok = load_tokenizer("demo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, vocab_size=len(tok), attn_implementation="sdpa"))
    common = dict(
        output_dir=str(out),
        per_device_train_batch_size=1,
        max_steps=a.steps,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        optim="adamw_torch",
        adam_beta2=0.95,
        activation_checkpointing=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        train_sampling_strategy="sequential",
    )
    ring = dict(
        cp_size=2, attn_backend="torch", loss_chunk_size=a.loss_chunk, callbacks=[_meter_callback(meter)]
    )
    data = _dataset(a.steps, a.seq)
    if kind == "sft":
        from trl import SFTConfig, SFTTrainer

        cls = type("RingSFTTrainer", (RingTrainerMixin, SFTTrainer), {})
        args = SFTConfig(**common, packing=True, max_length=a.seq, bf16=False)
        trainer = cls(
            model=model, args=args, train_dataset=data.remove_columns("labels"), processing_class=tok, **ring
        )
    else:
        cls = type("RingTrainer", (RingTrainerMixin, Trainer), {})
        trainer = cls(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=data,
            data_collator=DataCollatorForSeq2Seq(tok),
            processing_class=tok,
            **ring,
        )
    trainer.train()


def worker(rank: int, world: int, path: str, out: str, data: str, a: argparse.Namespace) -> dict[str, Any]:
    """One path in this process (rank ``rank`` of the ring): step ends and RSS rises."""
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    meter = StepMeter()
    if path == PATHS[0]:
        _run_ringft(Path(out), Path(data), a, meter)
    else:
        _run_hf("sft" if path == PATHS[2] else "trainer", Path(out), a, meter)
    return {"ends": meter.ends, "cpu": meter.cpu, "rises": meter.rises}


def planned(a: argparse.Namespace) -> int:
    """Planner bytes for what a step's RSS rise holds: activations (checkpointed + the larger
    working set) and the fp32 gradients."""
    from ringft.planner import plan_memory

    plan = plan_memory(
        MODEL | {"model_type": "llama", "vocab_size": 1658},
        a.seq,
        2,
        1.0,
        cp_size=2,
        dtype="fp32",
        gradient_checkpointing=True,
        chunked_loss=True,
        loss_chunk_size=a.loss_chunk,
        overhead_gib=0.0,
    )
    return plan.checkpointed_activations + max(plan.layer_working_set, plan.loss_working_set) + plan.grads


def main(argv: list[str] | None = None) -> None:
    """Run the paths and print the markdown table."""
    import tempfile

    from ringft.utils.spawn import run_distributed

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (global)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    p.add_argument("--loss-chunk", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2, help="runs of each path, alternating")
    a = p.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 16))  # inherited by the spawned ranks
    results: dict[str, list[dict]] = {path: [] for path in PATHS}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        _dataset(a.steps, a.seq).save_to_disk(str(data))
        for repeat in range(a.repeats):
            for i, path in enumerate(PATHS):
                out = Path(tmp) / f"run{repeat}-{i}"
                res = run_distributed(worker, 2, path, str(out), str(data), a, timeout=1800)
                results[path].append(res)
                print(f"  {path} (repeat {repeat}) done", file=sys.stderr, flush=True)
    plan = planned(a)
    rows, base = [], None
    for path in PATHS:
        times, cpu, rises = [], [[], []], [[], []]
        for res in results[path]:
            ends = res[0]["ends"]
            times += [b - t for t, b in zip(ends[a.warmup - 1 : -1], ends[a.warmup :])]
            for rank in (0, 1):
                rises[rank].append(max(res[rank]["rises"][a.warmup :]))
                c = res[rank]["cpu"]
                cpu[rank] += [b - t for t, b in zip(c[a.warmup - 1 : -1], c[a.warmup :])]
        tps = a.seq / statistics.median(times)
        base = base or tps
        peaks = [max(r) / MIB for r in rises]
        cpu_s = [statistics.median(c) for c in cpu]
        rows.append((path, tps, tps / base, cpu_s, peaks, [x * MIB / plan for x in peaks]))
    cmd = "python benchmarks/bench_trainer_mixin.py " + shlex.join(argv or sys.argv[1:])
    print(f"{cmd}\n{describe_machine()}; {datetime.date.today()}")
    print(f"seq {a.seq} (cp 2: {a.seq // 2} tokens per rank), {a.steps} steps, {a.warmup} warm-up,", end=" ")
    print(f"{a.repeats} repeats")
    print("\n| path | tokens/s | vs ringft train | CPU s / step, rank 0 / 1 |", end=" ")
    print("step rise, rank 0 / 1 (MiB) | / plan |")
    print("|---|---|---|---|---|---|")
    for path, tps, ratio, cpu_s, peaks, vs in rows:
        print(f"| {path} | {tps:,.0f} | {ratio:.3f} | {cpu_s[0]:.2f} / {cpu_s[1]:.2f} |", end=" ")
        print(f"{peaks[0]:.0f} / {peaks[1]:.0f} | {vs[0]:.3f} / {vs[1]:.3f} |")
    print(f"\nplanned (activations + working set + grads): {plan / MIB:.0f} MiB per rank")


if __name__ == "__main__":
    main()
