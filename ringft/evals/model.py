"""The model under evaluation: where it lives, its config (read without weights), its identity and
loading it (a full model folder or hub name, or a LoRA adapter folder merged onto its base)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

from ringft.evals.checks import EvalInputError
from ringft.model.families import global_rope

# Files whose size and modification time identify a model folder's weights and settings.
_IDENTITY_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json")


class ModelPathError(EvalInputError):
    """``--model`` names no model folder (one line naming the path and the fix)."""


def is_adapter(path: str) -> bool:
    """Whether ``path`` is a LoRA adapter folder (``adapter_config.json``), as the trainer exports."""
    return Path(path, "adapter_config.json").is_file()


def check_model_path(path: str, flag: str = "--model") -> None:
    """Refuse a ``--model`` (or another ``flag``'s model) that looks like a local path but is no
    folder with a ``config.json`` or ``adapter_config.json``. A plain ``org/name`` that is not a
    local folder is left to the hub."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file() and not is_adapter(str(local)):
            raise ModelPathError(
                f"{flag} {path}: the folder has no config.json or adapter_config.json; "
                "give a model folder saved with save_pretrained (or a LoRA adapter folder)"
            )
        return
    looks_local = path.startswith(("/", ".", "~")) or path.count("/") != 1 or local.exists()
    if looks_local:
        raise ModelPathError(f"{flag} {path}: no such model folder; give a model folder or a hub name")


def adapter_base(path: str) -> str:
    """The base model name or path recorded in an adapter folder's ``adapter_config.json``."""
    from peft import PeftConfig

    return PeftConfig.from_pretrained(path).base_model_name_or_path


def load_config(path: str, rope_theta: float | None = None, flag: str = "--model") -> Any:
    """The model's config without its weights. For an adapter folder: the config saved next to the
    adapter (ringft's trainer saves the run's RoPE overrides there), else the base model's.
    ``rope_theta`` overrides ``config.rope_parameters["rope_theta"]`` (with RoPE per layer type, the
    global layers': :func:`ringft.model.families.global_rope`; ValueError when the config has no
    RoPE parameters to override). ``flag`` names the option in messages."""
    from transformers import AutoConfig

    source = path
    if is_adapter(path) and not Path(path, "config.json").is_file():
        source = adapter_base(path)
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as exc:  # hub lookups fail with OSError or HFValidationError
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelPathError(
            f"{flag} {path}: no such model folder, and no model of that name could be loaded "
            f"({reason}); give a model folder or a reachable hub name"
        ) from None
    if rope_theta is not None:
        params = copy.deepcopy(getattr(config, "rope_parameters", None))
        target = global_rope(params) if isinstance(params, dict) else None
        if not isinstance(target, dict) or "rope_theta" not in target:
            raise ValueError(
                f"--rope-theta {rope_theta:g}: {type(config).__name__} has no rope_parameters "
                "with a rope_theta to override; set it in the model's config.json instead"
            )
        target["rope_theta"] = float(rope_theta)  # Gemma 3: the global layers' base
        config.rope_parameters = params
    return config


def weights_identity(path: str) -> dict[str, list[int]]:
    """``{file: [size, mtime_ns]}`` for the weight and config files of a local model folder (and of
    an adapter's local base folder, prefixed ``base/``); empty for a hub name. Changing, replacing
    or retraining the weights changes this mapping, without reading gigabytes to hash them."""
    found: dict[str, list[int]] = {}
    folders = [("", Path(path))]
    if is_adapter(path) and Path(adapter_base(path)).is_dir():
        folders.append(("base/", Path(adapter_base(path))))
    for prefix, folder in folders:
        if not folder.is_dir():
            continue
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if entry.is_file() and entry.name.endswith(_IDENTITY_SUFFIXES):
                stat = entry.stat()
                found[prefix + entry.name] = [stat.st_size, stat.st_mtime_ns]
    return found


def load_eval_model(
    path: str, dtype: torch.dtype, device: torch.device, rope_theta: float | None = None
) -> torch.nn.Module:
    """A full model, or a LoRA adapter folder merged onto its base model, from a path or hub name,
    in ``dtype`` on ``device``. ``rope_theta`` is set on the config *before* the weights load, so
    the rotary frequencies are built from it (exactly as if config.json said so)."""
    from transformers import AutoModelForCausalLM

    config = load_config(path, rope_theta)
    if is_adapter(path):
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(adapter_base(path), config=config, dtype=dtype)
        model = PeftModel.from_pretrained(base, path).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    return model.to(device)
