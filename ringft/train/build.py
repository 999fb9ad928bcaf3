"""Build what a recipe trains: tokenizer, model config (RoPE / context overrides), model, LoRA,
the names of the parameters that decay.

Everything that can be refused without the weights is refused here before they load: a tokenizer
larger than the model's embedding, a RoPE type that is not exact under CP, a sliding window the
model's family cannot take, a model folder that does not exist. LoRA targets the model does not have
are refused by name before peft sees them.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ringft.model.families import family_of, global_rope, set_window
from ringft.model.rope import PRETRAINED_LENGTH_ROPE, rope_problem
from ringft.ops.dtypes import dtype_from_name
from ringft.ops.ulysses import heads_problem
from ringft.train.errors import RecipeError, first_line
from ringft.train.recipe import Recipe

__all__ = [
    "add_lora",
    "build_model",
    "build_tokenizer",
    "decay_parameter_names",
    "decayed_parameters",
    "model_config",
    "unwrapped_name",
]


def build_tokenizer(recipe: Recipe) -> Any:
    """The recipe's tokenizer (``model.tokenizer``, default ``model.name_or_path``; "demo" = shipped)."""
    from ringft.data.tokenizer import load_tokenizer

    name = recipe.model.tokenizer or recipe.model.name_or_path
    if name is None:
        raise RecipeError("model.tokenizer is required when the model is built from model.config")
    try:
        return load_tokenizer(name)
    except Exception as exc:  # noqa: BLE001 - every loader failure becomes one line
        raise RecipeError(
            f"model.tokenizer {name!r} could not be loaded ({first_line(exc)}): give a tokenizer folder, "
            "a hub "
            "name, or demo"
        ) from None


def _load_pretrained_config(name: str) -> Any:
    from transformers import AutoConfig

    local = Path(name).expanduser()
    looks_local = name.startswith(("/", ".", "~")) or name.count("/") > 1
    if looks_local and not local.is_dir():
        raise RecipeError(
            f"model.name_or_path {name!r}: no such model folder (train the previous stage first, or fix "
            "the path)"
        )
    try:
        return AutoConfig.from_pretrained(name)
    except Exception as exc:  # noqa: BLE001 - every loader failure becomes one line
        raise RecipeError(
            f"model.name_or_path {name!r} could not be loaded ({first_line(exc)}): give a folder with "
            "config.json and weights, or a hub model name"
        ) from None


def _rope_parameters(config: Any, recipe: Recipe) -> dict[str, Any]:
    """The config's RoPE parameters with the recipe's ``rope_scaling`` / ``rope_theta`` applied (for
    RoPE per layer type, to the global layers: :func:`ringft.model.families.global_rope`) and, for
    YaRN / llama3 / longrope, the *pretraining* context as ``original_max_position_embeddings``."""
    m = recipe.model
    everything = copy.deepcopy(dict(getattr(config, "rope_parameters", None) or {}))
    rope = global_rope(everything)  # Gemma 3: the global layers' entry; local layers keep theirs
    if m.rope_scaling:
        asked = dict(m.rope_scaling)
        if "type" in asked:
            asked.setdefault("rope_type", asked.pop("type"))
        rope.pop("type", None)
        rope.update(asked)
    if m.rope_theta is not None:
        rope["rope_theta"] = float(m.rope_theta)
    # transformers would default the pretraining length to the raised max_position_embeddings
    if rope.get("rope_type") in PRETRAINED_LENGTH_ROPE:
        pretrained = (
            getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings
        )
        rope.setdefault("original_max_position_embeddings", pretrained)
    return everything


def model_config(recipe: Recipe, tokenizer_size: int | None = None) -> Any:
    """The transformers config the recipe trains (no weights loaded), with its overrides applied.

    Raises :class:`RecipeError` for a tokenizer of more than ``vocab_size`` tokens, a
    position-dependent RoPE (dynamic, longrope) with CP > 1, and a ``model.sliding_window`` the
    family cannot take (:func:`ringft.model.families.set_window`). Windows shorter than
    ``data.seq_len`` are honoured exactly on the ring.
    """
    from transformers import AutoConfig

    m = recipe.model
    if m.config is not None:
        kwargs = dict(m.config)
        if tokenizer_size is not None:
            kwargs.setdefault("vocab_size", tokenizer_size)
        try:
            config = AutoConfig.for_model(m.model_type, **kwargs)
        except (TypeError, ValueError) as exc:
            raise RecipeError(
                f"model.config is not a valid {m.model_type} config: {first_line(exc)}"
            ) from None
    else:
        config = _load_pretrained_config(m.name_or_path)
    rope = _rope_parameters(config, recipe)
    if rope:
        config.rope_parameters = rope
    if m.max_position_embeddings is not None:
        config.max_position_embeddings = m.max_position_embeddings
    if m.sliding_window != "keep":
        try:
            set_window(config, m.sliding_window)
        except ValueError as exc:
            raise RecipeError(f"model.sliding_window={m.sliding_window}: {exc}") from None
    config.use_cache = False
    _check_config(recipe, config, tokenizer_size)
    return config


def _check_config(recipe: Recipe, config: Any, tokenizer_size: int | None) -> None:
    cp = recipe.parallel.cp_size
    vocab = getattr(config, "vocab_size", None)
    if tokenizer_size is not None and vocab is not None and tokenizer_size > vocab:
        raise RecipeError(
            f"the tokenizer has {tokenizer_size} tokens but the model's embedding has {vocab} rows: use the "
            "model's own tokenizer (model.tokenizer) or a model with a large enough vocab_size"
        )
    rope = rope_problem(config, cp, "the model's RoPE type", "parallel.cp_size")
    if rope:
        raise RecipeError(rope)
    ulysses = recipe.parallel.ulysses_size
    heads = heads_problem(getattr(config, "num_attention_heads", 0), ulysses, cp) if ulysses > 1 else None
    if heads:
        raise RecipeError(f"parallel.ulysses_size: {heads}")


def build_model(recipe: Recipe, vocab_size: int | None = None, config: Any = None) -> nn.Module:
    """The model with the recipe's RoPE / context overrides applied (not yet on the ring).

    ``vocab_size``: the tokenizer's size (a model built from ``model.config`` gets it as its
    ``vocab_size`` unless the config names one). ``config``: a config from :func:`model_config`.
    """
    from transformers import AutoModelForCausalLM

    m = recipe.model
    dtype = dtype_from_name(m.dtype, allowed=("bf16", "fp32"))
    config = config if config is not None else model_config(recipe, vocab_size)
    if m.config is not None:
        torch.manual_seed(recipe.train.seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return AutoModelForCausalLM.from_pretrained(
        m.name_or_path, config=config, dtype=dtype, attn_implementation="sdpa"
    )


def add_lora(model: nn.Module, recipe: Recipe) -> nn.Module:
    """The model with the recipe's LoRA adapter (peft; the model itself without ``lora``)."""
    if recipe.lora is None:
        return model
    from peft import LoraConfig, get_peft_model

    lc = recipe.lora
    _check_lora_targets(model, lc.target_modules)
    model = get_peft_model(
        model,
        LoraConfig(
            r=lc.r,
            lora_alpha=lc.alpha,
            lora_dropout=lc.dropout,
            target_modules=list(lc.target_modules),
            task_type="CAUSAL_LM",
        ),
        autocast_adapter_dtype=lc.adapter_dtype == "fp32",
    )
    if recipe.train.gradient_checkpointing:
        model.enable_input_require_grads()
    return model


def _check_lora_targets(model: nn.Module, targets: list[str]) -> None:
    """Refuse LoRA target names that are no module of ``model`` (Phi-3's attention is ``qkv_proj``)."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in names]
    if missing:
        fam = family_of(getattr(model, "config", None))
        hint = f"; its attention projections are {', '.join(fam.attention_projections)}" if fam else ""
        raise RecipeError(
            f"lora.target_modules {missing} are not modules of this "
            f"{getattr(model.config, 'model_type', type(model).__name__)} model{hint}"
        )


def decay_parameter_names(model: nn.Module) -> list[str]:
    """The trainable parameters AdamW decays: matrices (embeddings, projections), not vectors (norm
    weights, biases).

    The rank is read from ``ds_shape`` when present: under DeepSpeed's ``zero.Init`` every parameter
    is a 1-D partition, and its ``shape`` would put everything into the no-decay group.
    """
    return [
        name
        for name, p in model.named_parameters()
        if p.requires_grad and len(getattr(p, "ds_shape", None) or p.shape) >= 2
    ]


# wrappers accelerate may put around modules before the optimizer is built: FSDP1, its activation
# checkpointing, torch.compile
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def unwrapped_name(name: str) -> str:
    """A parameter's name in the model, without the wrappers' prefixes."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def decayed_parameters(model: nn.Module, decay: set[str], weight_decay: float) -> list[str]:
    """The names in ``model`` (as wrapped when the optimizer is built) of the parameters in
    ``decay`` (:func:`decay_parameter_names` of the model before wrapping). With ``weight_decay``
    set, every one of them must be found: a wrapper that renames or flattens parameters (FSDP1
    without ``use_orig_params``) would otherwise silently train without decay."""
    names = [name for name, _ in model.named_parameters() if unwrapped_name(name) in decay]
    missing = sorted(decay - {unwrapped_name(name) for name in names})
    if weight_decay and missing:
        raise RecipeError(
            f"train.weight_decay={weight_decay}: {len(missing)} of the {len(decay)} matrices AdamW "
            f"should decay are not parameters of the model the optimizer is built for (e.g. "
            f"{missing[0]!r}); under FSDP1 set fsdp_use_orig_params: true in the launch config "
            "(flattened parameters cannot be told apart), or set train.weight_decay: 0"
        )
    return names
