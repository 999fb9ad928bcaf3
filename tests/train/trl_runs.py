"""Runs of TRL's ``DPOTrainer`` / ``GRPOTrainer``, with and without ringft's ring, for
tests/train/test_hf_dpo.py and test_hf_grpo.py (module level: run_distributed imports it).

The model is tests/train/hf_runs.py's tiny LLaMA (2 layers, hidden 32, fp32, seeded) over the demo
tokenizer; the preference pairs are random token strings (prompts 8..24 tokens, completions
2..12). :func:`worker` runs, per rank, one-process references with no process group, then every
rank runs the distributed runs in a fresh gloo group (as hf_runs.phased_worker does).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.train.hf_runs import (
    _DIST_ENV,
    SEED,
    TIMEOUT,
    _reset_accelerate,
    _weights,
    tiny_model,
    tiny_model_dir,
    tokenizer,
)

METRICS = (
    "loss",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "entropy",
    "mean_token_accuracy",
    "num_tokens",
)


def pairs(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` preference pairs of random demo-tokenizer words (no special tokens)."""
    tok = tokenizer()
    gen = torch.Generator().manual_seed(seed)

    def text(low: int, high: int) -> str:
        length = int(torch.randint(low, high + 1, (1,), generator=gen))
        return tok.decode(torch.randint(3, 300, (length,), generator=gen).tolist())

    return [
        {"prompt": text(8, 24), "chosen": " " + text(2, 12), "rejected": " " + text(2, 12)} for _ in range(n)
    ]


def dpo_run(s: dict[str, Any]) -> dict[str, Any]:
    """One DPO training run as ``s`` says: ``cp`` (0: plain DPOTrainer), ``mb`` (per device batch),
    ``loss`` (DPOConfig.loss_type list), ``ref`` (an explicit reference model) or ``precompute``
    (precompute_ref_log_probs), ``steps``, ``ga``, ``evaluate``, ``metrics`` (a compute_metrics);
    returns the logged metrics per step, the weights before / after (rank 0) and the eval metrics."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    from ringft.train.hf.dpo import RingDPOTrainer

    tok = tokenizer()
    model = tiny_model(tok, lora=False)
    ref = tiny_model(tok, lora=False) if s.get("ref") else None
    args = DPOConfig(
        output_dir=s["out"],
        per_device_train_batch_size=s["mb"],
        per_device_eval_batch_size=s["mb"],
        gradient_accumulation_steps=s.get("ga", 1),
        max_steps=s.get("steps", 3),
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=SEED,
        beta=0.5,
        loss_type=s["loss"],
        precompute_ref_log_probs=s.get("precompute", False),
        gradient_checkpointing=False,
        include_num_input_tokens_seen="non_padding",
        max_length=64,
        dataset_num_proc=None,
        bf16=False,
    )
    train = datasets.Dataset.from_list(pairs(16, 3))
    if s.get("precompute"):  # TRL caches the reference log-probs next to the dataset's files: one folder
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:
            train.save_to_disk(f"{s['out']}/pairs")
        if dist.is_initialized():
            dist.barrier()
        train = datasets.load_from_disk(f"{s['out']}/pairs")
    evals = datasets.Dataset.from_list(pairs(8, 4)) if s.get("evaluate") else None
    data = dict(args=args, train_dataset=train, eval_dataset=evals, processing_class=tok, ref_model=ref)
    if s.get("metrics"):
        data["compute_metrics"] = lambda pred: {}
    if s["cp"]:
        trainer = RingDPOTrainer(model=model, **data, cp_size=s["cp"], attn_backend="torch")
    else:
        trainer = DPOTrainer(model=model, **data)
    initial = _weights(trainer.model)
    trainer.train()
    out: dict[str, Any] = {
        "logs": [{k: h[k] for k in METRICS if k in h} for h in trainer.state.log_history if "loss" in h],
        "tokens_seen": trainer.state.num_input_tokens_seen,
    }
    if s.get("evaluate"):
        out["eval"] = trainer.evaluate()
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.update(initial=initial, final=_weights(trainer.model))
    return out


GRPO_METRICS = (
    "loss",
    "grad_norm",
    "reward",
    "reward_std",
    "rewards/even_tokens/mean",
    "rewards/even_tokens/std",
    "frac_reward_zero_std",
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_mean",
    "clip_ratio/high_max",
    "clip_ratio/region_mean",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "num_tokens",
)


def even_tokens(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """A rule-based reward: the fraction of even token ids in each completion."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def stub_completions(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """Fixed completions in place of generation (GRPOTrainer._generate_single_turn): 2..12 random
    tokens seeded by the prompt and its repeat, every other one ending with EOS."""
    seen: dict[tuple, int] = {}
    out = []
    for ids in prompt_ids:
        k = seen.setdefault(tuple(ids), 0)
        seen[tuple(ids)] = k + 1
        gen = torch.Generator().manual_seed(sum(ids) * 7 + len(ids) * 1000 + k)
        toks = torch.randint(3, 300, (int(torch.randint(2, 13, (1,), generator=gen)),), generator=gen)
        if k % 2 == 0:
            toks[-1] = self.eos_token_ids[0]
        out.append(toks.tolist())
    return out, None


def grpo_run(s: dict[str, Any]) -> dict[str, Any]:
    """One GRPO training run as ``s`` says: ``cp`` (0: plain GRPOTrainer), ``mb`` (per device
    batch), ``loss`` (loss_type), ``beta``, ``generate`` (real greedy generation instead of the
    fixed completions), ``prompt`` (prompt lengths low, high), ``metrics`` (a refused option);
    2 optimizer steps on one generation (num_iterations 2: the second step's ratio is not 1)."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from ringft.train.hf.grpo import RingGRPOTrainer

    tok = tokenizer()
    model = Path(s["out"]) / "model"  # a saved model: with beta > 0 TRL loads the reference from it
    if not dist.is_initialized() or dist.get_rank() == 0:
        tiny_model_dir(model)
    if dist.is_initialized():
        dist.barrier()
    args = GRPOConfig(
        output_dir=s["out"],
        per_device_train_batch_size=s["mb"],
        num_generations=2,
        num_iterations=2,
        max_steps=2,
        max_completion_length=12,
        learning_rate=3e-2,
        epsilon=0.02,
        beta=s.get("beta", 0.0),
        loss_type=s["loss"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=SEED,
        gradient_checkpointing=False,
        generation_kwargs={"do_sample": False} if s.get("generate") else None,
        bf16=False,
    )
    gen = torch.Generator().manual_seed(5)
    low, high = s.get("prompt", (8, 24))
    prompts = [
        {
            "prompt": tok.decode(
                torch.randint(
                    3, 300, (int(torch.randint(low, high + 1, (1,), generator=gen)),), generator=gen
                ).tolist()
            )
        }
        for _ in range(8)
    ]
    model = str(model)
    data = dict(
        reward_funcs=even_tokens,
        args=args,
        train_dataset=datasets.Dataset.from_list(prompts),
        processing_class=tok,
    )
    if s.get("refuse"):
        data["rollout_func"] = lambda batch, trainer: {}
    if not s.get("generate"):
        GRPOTrainer._generate_single_turn = stub_completions
    try:
        if s["cp"]:
            trainer = RingGRPOTrainer(model=model, **data, cp_size=s["cp"], attn_backend="torch")
        else:
            trainer = GRPOTrainer(model=model, **data)
        initial = _weights(trainer.model)
        trainer.train()
    finally:
        GRPOTrainer._generate_single_turn = GRPO_GENERATE
    out: dict[str, Any] = {
        "logs": [{k: h[k] for k in GRPO_METRICS if k in h} for h in trainer.state.log_history if "loss" in h],
        "tokens_seen": trainer.state.num_input_tokens_seen,
    }
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.update(initial=initial, final=_weights(trainer.model))
    return out


def _grpo_generate():
    from trl import GRPOTrainer

    return GRPOTrainer._generate_single_turn


def dpo_zero3_argv(model_dir: str, out: str) -> list[str]:
    """recipes/trl_dpo/dpo.py arguments of the ZeRO-3 test (tests/train/test_hf_dpo.py): full
    fine-tuning of the tiny model (TRL loads the reference model from the same folder), the
    synthetic arithmetic pairs (rows of < 64 tokens), 2 pairs per step, 2 steps."""
    return [  # TRL's own flags (dpo.py is a TrlParser script)
        *("--model_name_or_path", model_dir, "--dataset_name", "synthetic-pairs:8", "--beta", "0.5"),
        *("--max_length", "64", "--per_device_train_batch_size", "2", "--max_steps", "2"),
        *("--learning_rate", "1e-3", "--logging_steps", "1", "--save_strategy", "no"),
        *("--report_to", "none", "--use_cpu", "true", "--bf16", "false"),
        *("--gradient_checkpointing", "false", "--disable_tqdm", "true", "--output_dir", out),
    ]


def dpo_script_run(s: dict[str, Any]) -> dict[str, Any]:
    """recipes/trl_dpo/dpo.py ``main(argv)`` in this process, as ``python dpo.py argv`` runs it;
    its logged metrics per step and its output folder."""
    import importlib.util
    import json
    import sys

    path = Path(__file__).resolve().parents[2] / "recipes" / "trl_dpo" / "dpo.py"
    spec = importlib.util.spec_from_file_location("trl_dpo_recipe", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    module.main(s["argv"])
    history = json.loads((Path(s["out"]) / "log_history.json").read_text())
    return {"logs": [{k: h[k] for k in METRICS if k in h} for h in history if "loss" in h], "out": s["out"]}


GRPO_GENERATE: Any = None
RUNS = {"dpo": dpo_run, "grpo": grpo_run, "dpo-script": dpo_script_run}


def _guarded(s: dict[str, Any]) -> dict[str, Any]:
    global GRPO_GENERATE
    if s["kind"] == "grpo" and GRPO_GENERATE is None:
        GRPO_GENERATE = _grpo_generate()
    start = time.perf_counter()
    try:
        out = RUNS[s["kind"]](s)
    except (ValueError, NotImplementedError, RuntimeError) as exc:
        out = {"error": str(exc).splitlines()[0]}
    out["seconds"] = time.perf_counter() - start
    return out


def worker(rank: int, world: int, alone: list[list[dict]], together: list[dict], store: str) -> dict:
    """Rank ``r`` runs ``alone[r]`` with no process group, then every rank runs ``together`` in a
    fresh ``world``-rank gloo group."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    saved = {k: os.environ[k] for k in _DIST_ENV if k in os.environ}
    results: dict[str, list[dict]] = {"alone": [], "together": []}
    dist.destroy_process_group()
    for key in saved:
        del os.environ[key]
    os.environ["WORLD_SIZE"] = "1"
    for s in alone[rank] if rank < len(alone) else []:
        _reset_accelerate()
        results["alone"].append(_guarded(s))
    os.environ.update(saved)
    Path(store).mkdir(parents=True, exist_ok=True)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}/pg",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=TIMEOUT),
    )
    for s in together:
        _reset_accelerate()
        results["together"].append(_guarded(s))
    return results


def dpo_plan(r: str, model_dir: str) -> tuple[dict[str, dict], dict[str, dict]]:
    """tests/train/test_hf_dpo.py's runs: (one-process references, 4-rank ring runs) by name; the
    ZeRO-3 test's reference is recipes/trl_dpo/dpo.py on the tiny model saved in ``model_dir``."""
    sig = dict(kind="dpo", loss=["sigmoid"], ref=True, steps=2, evaluate=True)
    ipo = dict(kind="dpo", loss=["ipo", "sft"], precompute=True, steps=2, mb=1, ga=2)
    alone = {
        "dpo/one-sig": dict(sig, cp=0, mb=4, out=f"{r}/one-sig"),
        "dpo/one-ipo": dict(ipo, cp=0, out=f"{r}/one-ipo"),
        "dpo/one-zero3": dict(
            kind="dpo-script", out=f"{r}/one-zero3", argv=dpo_zero3_argv(model_dir, f"{r}/one-zero3")
        ),
    }
    together = {
        "dpo/sig": dict(sig, cp=2, mb=2, out=f"{r}/sig"),
        "dpo/ipo": dict(ipo, cp=4, out=f"{r}/ipo"),
        "dpo/refused": dict(sig, cp=2, mb=2, steps=1, evaluate=False, metrics=True, out=f"{r}/refused"),
    }
    return alone, together


GRPO_LOSSES = [(loss, beta) for beta in (0.0, 0.1) for loss in ("grpo", "bnpo", "dr_grpo", "dapo")]
GRPO_LONG = (40, 64)  # prompt tokens; + <= 12 completion tokens, over 4 ranks: < 20 tokens each


def grpo_plan(r: str) -> tuple[dict[str, dict], dict[str, dict]]:
    """tests/train/test_hf_grpo.py's runs: (one-process references, 4-rank ring runs) by name."""
    base = dict(kind="grpo", mb=4)
    runs = {
        f"{loss}-{beta}": dict(base, loss=loss, beta=beta, prompt=GRPO_LONG) for loss, beta in GRPO_LOSSES
    }
    runs["dp2"] = dict(base, loss="grpo", beta=0.1)
    runs["generate"] = dict(base, loss="grpo", beta=0.1, generate=True)
    cp = {name: 2 if name in ("dp2", "generate") else 4 for name in runs}
    alone = {  # one process = dp 2 replicas' rows
        f"grpo/one-{name}": dict(s, cp=0, mb=8 if cp[name] == 2 else 4, out=f"{r}/one-{name}")
        for name, s in runs.items()
    }
    together = {f"grpo/{name}": dict(s, cp=cp[name], out=f"{r}/{name}") for name, s in runs.items()}
    together["grpo/refused"] = dict(runs["dp2"], cp=2, refuse=True, out=f"{r}/refused")
    return alone, together


def spawn_plans(
    root: Path, *plans: tuple[dict[str, dict], dict[str, dict]], timeout: float
) -> dict[str, dict]:
    """Every plan's runs in one 4-rank spawn (the references spread over the ranks): ``name`` ->
    rank 0's result (a reference's: its rank's), ``name@r`` -> rank r's ring result."""
    from ringft.utils.spawn import run_distributed

    alone_named = {k: v for plan in plans for k, v in plan[0].items()}
    together_named = {k: v for plan in plans for k, v in plan[1].items()}
    order = sorted(alone_named, key=lambda k: k.startswith("dpo"), reverse=True)  # the slow ones first
    alone: list[list[dict]] = [[], [], [], []]
    for i, k in enumerate(order):
        alone[i % 4].append(alone_named[k])
    results = run_distributed(
        worker, 4, alone, list(together_named.values()), str(root / "store"), timeout=timeout
    )
    out = {k: results[i % 4]["alone"][i // 4] for i, k in enumerate(order)}
    for rank, res in enumerate(results):
        for k, got in zip(together_named, res["together"]):
            out[k if rank == 0 else f"{k}@{rank}"] = got
    return out
