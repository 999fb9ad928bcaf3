"""Recipe overrides from the command line and the messages for unknown recipe keys.

Overrides are dotted keys, ``--train.max_steps 20`` or ``--train.max_steps=20``; values are read as
YAML (``--lora null``, ``--train.betas [0.9,0.99]``). An unknown key is named with the closest valid
one (``train.lr`` for ``train.lrr``), or, for a Hugging Face ``TrainingArguments`` name
(``learning_rate``, ``output_dir``, ...), with the ringft key that does its job (:data:`HF_NAMES`).
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from ringft.train.errors import RecipeError

__all__ = ["ALIASES", "HF_NAMES", "apply_overrides", "resolve_aliases", "unknown_keys_message"]

# Hugging Face TrainingArguments names a recipe section accepts for its own keys (section -> name -> key).
ALIASES: dict[str, dict[str, str]] = {
    "train": {
        "learning_rate": "lr",
        "gradient_accumulation_steps": "grad_accum",
        "per_device_train_batch_size": "micro_batch_size",
        "max_grad_norm": "grad_clip",
        "eval_steps": "eval_every",
    },
    "checkpoint": {"save_steps": "save_every", "save_total_limit": "keep"},
    "logging": {"report_to": "tracker", "logging_steps": "log_every"},
}

# transformers.TrainingArguments / TRL / PEFT names -> the ringft recipe key (or what to do instead).
HF_NAMES: dict[str, str] = {
    "learning_rate": "train.lr",
    "lr": "train.lr",
    "gradient_accumulation_steps": "train.grad_accum",
    "per_device_train_batch_size": "train.micro_batch_size",
    "batch_size": "train.micro_batch_size",
    "max_steps": "train.max_steps",
    "warmup_steps": "train.warmup_steps",
    "warmup_ratio": "train.warmup_steps (a number of steps)",
    "weight_decay": "train.weight_decay",
    "lr_scheduler_type": "train.schedule (constant or cosine)",
    "max_grad_norm": "train.grad_clip",
    "adam_beta1": "train.betas ([beta1, beta2])",
    "adam_beta2": "train.betas ([beta1, beta2])",
    "seed": "train.seed",
    "gradient_checkpointing": "train.gradient_checkpointing",
    "output_dir": "checkpoint.output_dir",
    "save_steps": "checkpoint.save_every",
    "save_total_limit": "checkpoint.keep",
    "logging_steps": "logging.log_every",
    "report_to": "logging.tracker",
    "model_name_or_path": "model.name_or_path",
    "max_seq_length": "data.seq_len",
    "max_length": "data.seq_len",
    "seq_len": "data.seq_len",
    "dataset_path": "data.path",
    "bf16": "model.dtype (bf16 or fp32: the weights' dtype; bf16 by default)",
    "fp16": "model.dtype (bf16 or fp32; fp16 is not supported)",
    "num_train_epochs": "train.num_train_epochs",
    "eval_steps": "train.eval_every",
    "eval_strategy": "train.eval_every (steps between eval-loss passes; 0 = no evaluation)",
    "per_device_eval_batch_size": "train.micro_batch_size (the eval batches' size too)",
    "dataset_text_field": "data.text_field",
    "push_to_hub": "checkpoint.push_to_hub",
    "hub_model_id": "checkpoint.hub_model_id",
    "cp_size": "parallel.cp_size",
    "lora_r": "lora.r",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
}


def _hint(where: str, key: str, valid: Iterable[str], elsewhere: Mapping[str, str]) -> str:
    """``where.key`` with what was probably meant, e.g. ``train.lrr (did you mean train.lr?)``."""
    name = f"{where}.{key}" if where else key
    if key in elsewhere and elsewhere[key] != where:
        return f"{name} (did you mean {elsewhere[key]}.{key}?)"
    if key in HF_NAMES:
        meaning = HF_NAMES[key]
        return f"{name} (Hugging Face's {key}{': ' if meaning.startswith('not ') else ' is '}{meaning})"
    own = [*valid, *ALIASES.get(where, {})]  # the section's keys and their Hugging Face names
    close = difflib.get_close_matches(key, own + (list(HF_NAMES) if where else []), n=1, cutoff=0.6)
    if not close:
        return name
    if close[0] in own:
        return f"{name} (did you mean {where + '.' if where else ''}{close[0]}?)"
    return f"{name} (did you mean {close[0]}? Hugging Face's {close[0]} is {HF_NAMES[close[0]]})"


def unknown_keys_message(
    where: str, unknown: Iterable[str], valid: Iterable[str], elsewhere: Mapping[str, str] | None = None
) -> str:
    """One line naming each unknown key of section ``where`` ("" for the recipe's top level, whose
    keys are the sections) with its likely meaning, then the valid keys. ``elsewhere``: key -> the
    section it belongs to, for a key written in the wrong section."""
    valid = sorted(valid)
    named = ", ".join(_hint(where, k, valid, elsewhere or {}) for k in sorted(unknown))
    if not where:
        return f"unknown recipe section(s) {named}; valid: {', '.join(valid)}"
    return f"unknown key(s) {named}; valid keys in {where!r}: {', '.join(valid)}"


def resolve_aliases(where: str, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` of section ``where`` with Hugging Face names (:data:`ALIASES`) renamed to the
    section's keys; refuses a key given under both names."""
    names = ALIASES.get(where, {})
    out = dict(values)
    for hf, key in names.items():
        if hf in out:
            if key in out:
                raise RecipeError(f"{where}.{hf} and {where}.{key} are the same setting: give one of them")
            out[key] = _report_to(out.pop(hf)) if hf == "report_to" else out.pop(hf)
    return out


def _report_to(value: Any) -> Any:
    """``logging.report_to`` as Hugging Face writes it (a name, a list of names, ``none``) -> the one
    ``logging.tracker``; several trackers, or ``all``, are refused by that name."""
    names = [value] if isinstance(value, str) or value is None else list(value)
    names = [n for n in names if n not in (None, "none")]
    if len(names) > 1 or names == ["all"]:
        raise RecipeError(
            f"logging.report_to={value!r}: a recipe logs to one tracker (tensorboard or wandb); "
            "name one, or none"
        )
    return names[0] if names else "none"


def _pairs(overrides: list[str]) -> list[tuple[str, str]]:
    """``["--a.b", "1", "--c.d=2"]`` -> ``[("--a.b", "1"), ("--c.d", "2")]``."""
    pairs, i = [], 0
    while i < len(overrides):
        flag = overrides[i]
        if flag.startswith("--") and "=" in flag:
            pairs.append(tuple(flag.split("=", 1)))
            i += 1
        elif i + 1 < len(overrides):
            pairs.append((flag, overrides[i + 1]))
            i += 2
        else:
            raise RecipeError(
                f"override {flag} has no value: write '--section.key value' or '--section.key=value'"
            )
    return pairs  # type: ignore[return-value]


def apply_overrides(raw: dict[str, Any] | None, overrides: list[str]) -> dict[str, Any]:
    """Apply ``["--train.max_steps", "20", "--lora", "null", "--train.lr=1e-5", ...]`` to a parsed
    recipe (a copy). An override given by the other name of a key the recipe sets (``--train.learning_rate``
    for ``train.lr``, or the reverse) replaces it."""
    raw = copy.deepcopy(raw or {})
    for flag, value in _pairs(overrides):
        if not flag.startswith("--") or len(flag) < 3:
            raise RecipeError(f"override {flag!r} must look like --section.key")
        path = flag[2:].replace("-", "_").split(".")
        node = raw
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        for other in _other_names(path):  # the override replaces the setting under either name
            node.pop(other, None)
        try:
            node[path[-1]] = yaml.safe_load(value)
        except yaml.YAMLError:
            node[path[-1]] = value  # not YAML: the text itself
    return raw


def _other_names(path: list[str]) -> list[str]:
    """The other spelling of the setting at ``path`` (``train.learning_rate`` <-> ``train.lr``)."""
    if len(path) != 2:
        return []
    names = ALIASES.get(path[0], {})
    return [key for hf, key in names.items() if hf == path[1]] + [
        hf for hf, key in names.items() if key == path[1]
    ]
