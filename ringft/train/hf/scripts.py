"""What the TRL recipe scripts (recipes/trl_sft/sft.py, trl_dpo/dpo.py, trl_grpo/grpo.py) share:
ringft's command-line flags next to TRL's own (one dataclass for ``TrlParser``), the datasets
TRL's ``ScriptArguments`` name (train and eval splits), and the files a run leaves for the tests
and the user (the Trainer's logs, the layout it ran on, the model)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringft.ops.sharding import ulysses_size_problem
from ringft.utils.options import option_field

__all__ = ["RingArguments", "load_model", "load_records", "script_datasets", "write_run_files"]

LOCAL = (".json", ".jsonl")
NO_MEMORY_OPTIONS = {"loss_chunk_size": 4096, "tiled_mlp_tokens": None}  # the flags' defaults


@dataclass
class RingArguments:
    """ringft's flags (the keywords of :class:`~ringft.train.hf.RingTrainerMixin`); ``cp_size`` 1
    and no memory option leave TRL's trainer unchanged."""

    cp_size: int = option_field("cp_size", 1)  # 1: TRL's trainer unchanged
    ulysses_size: int = option_field("ulysses_size", 1)
    attn_backend: str = option_field("attn_backend", "auto")  # old flag: --ring_backend
    loss_chunk_size: int = option_field("loss_chunk_size", NO_MEMORY_OPTIONS["loss_chunk_size"])
    tiled_mlp_tokens: int | None = option_field("tiled_mlp_tokens", NO_MEMORY_OPTIONS["tiled_mlp_tokens"])

    def trainer_keywords(self, memory_options: bool = True) -> dict[str, Any]:
        """The keywords a ring trainer takes, or ``{}`` when the base trainer should run as it is.
        ``memory_options=False`` (DPO, GRPO: they score through TRL's own fused head): the chunked
        loss's and the tiled MLP's flags are refused instead of being ignored."""
        memory = dict(loss_chunk_size=self.loss_chunk_size, tiled_mlp_tokens=self.tiled_mlp_tokens)
        if not memory_options and memory != NO_MEMORY_OPTIONS:
            raise SystemExit(
                "error: --loss_chunk_size / --tiled_mlp_tokens apply to SFT (recipes/trl_sft/sft.py); "
                "DPO and GRPO score through TRL's fused head: drop them"
            )
        problem = ulysses_size_problem(self.cp_size, self.ulysses_size) if self.ulysses_size != 1 else None
        if problem:  # (with cp_size 1 the base trainer would run and ignore it)
            raise SystemExit(f"error: --ulysses_size: {problem}")
        if self.cp_size <= 1 and not self.tiled_mlp_tokens:
            if self.loss_chunk_size != NO_MEMORY_OPTIONS["loss_chunk_size"]:  # (the base trainer's own loss)
                raise SystemExit("error: --loss_chunk_size applies to the ring (--cp_size > 1): drop it")
            return {}
        ring = dict(cp_size=self.cp_size, ulysses_size=self.ulysses_size, attn_backend=self.attn_backend)
        return {**ring, **memory} if memory_options else ring


def load_model(model_args: Any, config: Any, padding_side: str | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` named by TRL's ``ModelConfig``, loaded with the keywords TRL's own
    scripts use (``--model_revision``, ``--dtype``, ``--attn_implementation`` (default ``sdpa``),
    ``--trust_remote_code`` and ``--model_init_kwargs``, which then stay with this model). A
    quantized base (``--load_in_4bit`` / ``--load_in_8bit``) is refused: not tested on the ring."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_args.load_in_4bit or model_args.load_in_8bit:
        raise SystemExit(
            "error: --load_in_4bit / --load_in_8bit: quantized (QLoRA) base models are not supported "
            "by ringft's scripts (not tested on the ring): load the model in bf16 and use --use_peft"
        )
    if not model_args.model_name_or_path:
        raise SystemExit("error: --model_name_or_path is required (a hub name or a model folder)")
    dtype = model_args.dtype
    kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=bool(getattr(config, "trust_remote_code", False)),
        attn_implementation=model_args.attn_implementation or "sdpa",
        dtype=dtype if dtype in ("auto", None) else getattr(torch, dtype),
    )
    kwargs.update(getattr(config, "model_init_kwargs", None) or {})
    config.model_init_kwargs = None  # applied here (the trainer gets a loaded model)
    name = model_args.model_name_or_path
    shared = {"revision": model_args.model_revision, "trust_remote_code": kwargs["trust_remote_code"]}
    padding = {"padding_side": padding_side} if padding_side else {}
    tokenizer = AutoTokenizer.from_pretrained(name, **shared, **padding)
    return AutoModelForCausalLM.from_pretrained(name, **kwargs), tokenizer


def load_records(
    name: str,
    split: str,
    seed: int,
    synthetic: str,
    make: Callable[[int, int], list[dict]],
    subset: str | None = None,
) -> Any:
    """Split ``split`` of the records ``name`` names, as a ``datasets.Dataset``: ``synthetic[:N]``
    (``make(N, seed)``, N = 512 by default), a local .json / .jsonl file (its records, whatever the
    split), or a hub dataset (``subset``: its configuration, TRL's ``--dataset_config``)."""
    import datasets

    if name.startswith(synthetic):
        n = int(name.split(":")[1]) if ":" in name else 512
        return datasets.Dataset.from_list(make(n, seed))
    if name.endswith(LOCAL):
        return datasets.load_dataset("json", data_files=name, split="train")
    return datasets.load_dataset(name, subset, split=split)


def script_datasets(
    script: Any, config: Any, synthetic: str, make: Callable[[int, int], list[dict]], evaluate: bool = True
) -> dict[str, Any]:
    """``train_dataset`` and, when ``config.eval_strategy`` is not ``"no"`` (and ``evaluate``),
    ``eval_dataset``, as TRL's own scripts pass them from ``ScriptArguments``: the eval records are
    the hub dataset's ``--dataset_test_split``, other made-up records (seed + 1) for ``synthetic``,
    or a local file named by ``--dataset_test_split`` (a local training file has no other split)."""
    name = script.dataset_name or synthetic
    train = load_records(
        name, script.dataset_train_split, config.seed, synthetic, make, script.dataset_config
    )
    out = {"train_dataset": train}
    if not evaluate or config.eval_strategy == "no":
        return out
    test = script.dataset_test_split
    if name.endswith(LOCAL) and not test.endswith(LOCAL):
        raise SystemExit(
            f"error: --eval_strategy needs held-out records and {name} is one file: name them with "
            "--dataset_test_split FILE.jsonl (or --eval_strategy no)"
        )
    source = test if test.endswith(LOCAL) else name
    seed = config.seed + 1 if name.startswith(synthetic) else config.seed
    out["eval_dataset"] = load_records(source, test, seed, synthetic, make, script.dataset_config)
    return out


def write_run_files(trainer: Any, output_dir: str) -> None:
    """After ``trainer.train()``: ``log_history.json`` and ``run_info.json`` (world, dp, cp, ulysses,
    the distributed type) from the main process, then the model (or adapter) in ``final`` (every
    rank calls it: ZeRO-3 gathers the weights)."""
    out = Path(output_dir)
    if trainer.is_world_process_zero():
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
        layout = getattr(trainer, "ring_layout", None)
        world = trainer.accelerator.num_processes
        info = {
            "world": world,
            "dp": layout.dp_size if layout else world,
            "cp": layout.cp_size if layout else 1,
            "ulysses": layout.ulysses_size if layout else 1,
            "distributed_type": str(trainer.accelerator.distributed_type),
        }
        (out / "run_info.json").write_text(json.dumps(info))
    trainer.save_model(str(out / "final"))
