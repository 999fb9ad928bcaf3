"""Training recipes: a YAML file mapped onto dataclasses, with strict validation.

Unknown keys are errors (a typo must not silently fall back to a default). Overrides from the
command line use dotted keys: ``--train.max_steps 20 --parallel.cp_size 2``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class ModelConfig:
    name_or_path: str | None = None  # hub name or local path of a pretrained model
    config: dict[str, Any] | None = None  # or: build from this config (LlamaConfig kwargs) from scratch
    model_type: str = "llama"  # with `config`: llama | mistral
    tokenizer: str | None = None  # defaults to name_or_path; "demo" = the tokenizer shipped with ringft
    rope_theta: float | None = None  # raise RoPE theta for context extension
    rope_scaling: dict[str, Any] | None = None  # e.g. {"rope_type": "yarn", "factor": 4.0}
    max_position_embeddings: int | None = None
    sliding_window: str | int | None = "keep"  # "keep" | None (disable) | int
    attn_backend: str = "auto"  # auto | torch | flash_attn | reference
    dtype: str = "bf16"  # bf16 | fp32


@dataclass
class DataConfig:
    path: str | None = None  # a datasets save_to_disk folder with input_ids (+ labels)
    synthetic: dict[str, Any] | None = None  # or {num_examples, min_len?, loss_on?}: line retrieval
    seq_len: int = 4096  # every batch is padded to this many tokens
    shuffle: bool = True


@dataclass
class ParallelConfig:
    cp_size: int = 1  # ranks per ring; dp = world_size / cp_size


@dataclass
class LoraConfig:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class TrainConfig:
    micro_batch_size: int = 1
    grad_accum: int = 1
    max_steps: int = 100
    lr: float = 2e-5
    min_lr_ratio: float = 0.0
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    gradient_checkpointing: bool = True
    offload_activations: bool = False  # checkpointed layer inputs to CPU memory
    tiled_mlp_tokens: int | None = None  # run the MLP in tiles of this many tokens (None: off)
    chunked_loss: bool = True  # LM head + cross-entropy in token chunks
    loss_chunk_size: int = 4096
    seed: int = 0


@dataclass
class CheckpointConfig:
    output_dir: str = "outputs/run"
    save_every: int = 0  # steps; 0 = only at the end
    keep: int = 2  # newest complete checkpoints to keep


@dataclass
class LoggingConfig:
    tracker: str | None = "tensorboard"  # tensorboard | wandb | none
    project: str = "ringft"
    log_every: int = 1


@dataclass
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig | None = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "lora": LoraConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}


class RecipeError(ValueError):
    """A recipe that cannot run, with what is wrong and how to fix it."""


def _build(cls, values: dict[str, Any], where: str):
    if not isinstance(values, dict):
        raise RecipeError(f"recipe section {where!r} must be a mapping, got {type(values).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise RecipeError(
            f"unknown key(s) {', '.join(where + '.' + k for k in unknown)}; valid keys in {where!r}: "
            f"{', '.join(sorted(names))}"
        )
    values = dict(values)
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    return cls(**values)


def recipe_from_dict(raw: dict[str, Any]) -> Recipe:
    """Build and validate a :class:`Recipe` from a parsed YAML mapping."""
    raw = dict(raw or {})
    unknown = sorted(set(raw) - set(_SECTIONS))
    if unknown:
        raise RecipeError(f"unknown recipe section(s) {unknown}; valid: {', '.join(_SECTIONS)}")
    kwargs = {}
    for name, cls in _SECTIONS.items():
        if name in raw:
            kwargs[name] = None if raw[name] is None and name == "lora" else _build(cls, raw[name], name)
    recipe = Recipe(**kwargs)
    validate(recipe)
    return recipe


def _parse_scalar(text: str) -> Any:
    value = yaml.safe_load(text)
    if isinstance(value, str):  # YAML 1.1 reads "2e-3" as a string
        try:
            return float(value)
        except ValueError:
            return value
    return value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``["--train.max_steps", "20", "--lora", "null", ...]`` to a parsed recipe."""
    if len(overrides) % 2:
        raise RecipeError(f"overrides come in '--section.key value' pairs, got {overrides}")
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (raw or {}).items()}
    for flag, value in zip(overrides[::2], overrides[1::2]):
        if not flag.startswith("--"):
            raise RecipeError(f"override {flag!r} must look like --section.key")
        path = flag[2:].replace("-", "_").split(".")
        node = raw
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = _parse_scalar(value)
    return raw


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe, apply ``--section.key value`` overrides, validate."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file {str(path)!r} does not exist")
    raw = yaml.safe_load(path.read_text()) or {}
    return recipe_from_dict(apply_overrides(raw, overrides or []))


def validate(recipe: Recipe, world_size: int | None = None) -> None:
    """Checks that need no model or data; with ``world_size`` also the parallel layout."""
    m, d, p, t = recipe.model, recipe.data, recipe.parallel, recipe.train
    if (m.name_or_path is None) == (m.config is None):
        raise RecipeError("set exactly one of model.name_or_path (pretrained) or model.config (from scratch)")
    if m.config is not None and m.model_type not in ("llama", "mistral"):
        raise RecipeError(
            f"model.model_type {m.model_type!r} is not supported: ringft trains llama or mistral models"
        )
    from ringft.ops.kernels import BACKENDS

    if m.attn_backend not in BACKENDS:
        raise RecipeError(f"model.attn_backend must be one of {', '.join(BACKENDS)}, got {m.attn_backend!r}")
    if recipe.logging.tracker not in (None, "none", "tensorboard", "wandb"):
        raise RecipeError(
            f"logging.tracker must be tensorboard, wandb or none, got {recipe.logging.tracker!r}"
        )
    if recipe.lora is not None and recipe.lora.r < 1:
        raise RecipeError(f"lora.r must be >= 1, got {recipe.lora.r}")
    if m.dtype not in ("bf16", "fp32"):
        raise RecipeError(f"model.dtype must be bf16 or fp32, got {m.dtype!r}")
    if (d.path is None) == (d.synthetic is None):
        raise RecipeError("set exactly one of data.path (a save_to_disk folder) or data.synthetic")
    if d.path is not None and not Path(d.path).exists():
        raise RecipeError(
            f"dataset folder {d.path!r} does not exist: build it with data_prep/pack.py "
            "(or data_prep/make_synthetic.py) first"
        )
    if p.cp_size < 1:
        raise RecipeError(f"parallel.cp_size must be >= 1, got {p.cp_size}")
    if d.seq_len % (2 * p.cp_size):
        raise RecipeError(
            f"data.seq_len={d.seq_len} is not divisible by 2 * cp_size = {2 * p.cp_size}: use a multiple "
            f"such as {(d.seq_len // (2 * p.cp_size) + 1) * 2 * p.cp_size}"
        )
    if t.schedule not in ("constant", "cosine"):
        raise RecipeError(f"train.schedule must be constant or cosine, got {t.schedule!r}")
    if t.micro_batch_size < 1 or t.grad_accum < 1 or t.max_steps < 1:
        raise RecipeError("train.micro_batch_size, train.grad_accum and train.max_steps must be >= 1")
    if world_size is not None and world_size % p.cp_size:
        raise RecipeError(
            f"parallel.cp_size={p.cp_size} does not divide the world size {world_size}: launch a multiple "
            f"of {p.cp_size} processes or change cp_size"
        )
