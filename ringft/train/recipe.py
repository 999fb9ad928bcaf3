"""Training recipes: a YAML file mapped onto typed dataclasses, checked where it is loaded.

Every key has a type and a range (``ringft.train.fields``); unknown keys are errors (a typo must not
silently fall back to a default), and so are values of the right name but the wrong type or range
(``train.lr: -1``, ``train.max_steps: "20"`` or ``20.5``, ``logging.log_every: 0``, ...). Each error is
one line naming the key, the value and what is accepted. Overrides from the command line use dotted
keys: ``--train.max_steps 20 --parallel.cp_size 2 --data.synthetic.num_examples=64`` (``overrides``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ringft.model.families import SUPPORTED_MODEL_TYPES
from ringft.model.rope import rope_problem
from ringft.ops.backends import BACKENDS
from ringft.ops.sharding import ulysses_size_problem, zigzag_length_problem
from ringft.ops.ulysses import heads_problem
from ringft.train.data_checks import SFT_FORMATS, data_problem
from ringft.train.errors import RecipeError
from ringft.train.fields import Section, boolean, choice, integer, number, pair, text, text_list
from ringft.train.overrides import apply_overrides, resolve_aliases, unknown_keys_message

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "ParallelConfig",
    "Recipe",
    "RecipeError",
    "SyntheticConfig",
    "TrainConfig",
    "apply_overrides",
    "load_recipe",
    "recipe_from_dict",
    "validate",
]

MODEL_TYPES = SUPPORTED_MODEL_TYPES  # ringft.model.families: the families the ring runs exactly


@dataclass
class ModelConfig(Section):
    """``model``: what to train (a pretrained folder / hub name, or a config built from scratch)."""

    NAME = "model"
    name_or_path: str | None = text(None, optional=True)  # hub name or local path of a pretrained model
    config: dict[str, Any] | None = None  # or: build from this config (LlamaConfig kwargs) from scratch
    # with `config`: a model type of ringft.model.families.FAMILIES
    model_type: str = choice("llama", MODEL_TYPES)
    tokenizer: str | None = text(None, optional=True)  # default name_or_path; "demo" = shipped tokenizer
    rope_theta: float | None = number(None, gt=0, optional=True)  # raise RoPE theta (context extension)
    rope_scaling: dict[str, Any] | None = None  # e.g. {"rope_type": "yarn", "factor": 4.0}
    max_position_embeddings: int | None = integer(None, lo=1, optional=True)
    # "keep" | None (no window on any layer) | int: the window of the layers the family windows
    # (Mistral, Phi-3: all; Qwen2/3, Gemma 3: the sliding layers of config.layer_types)
    sliding_window: str | int | None = "keep"
    attn_backend: str = choice("auto", BACKENDS)  # "auto" or a backend's name (ringft.ops.backends)
    dtype: str = choice("bf16", ("bf16", "fp32"))  # weights' dtype

    def check(self) -> None:
        if (self.name_or_path is None) == (self.config is None):
            raise RecipeError(
                "set exactly one of model.name_or_path (pretrained) or model.config (from scratch)"
            )
        if self.config is not None and not isinstance(self.config, dict):
            raise RecipeError(f"model.config must be a mapping of config keys, got {self.config!r}")
        if self.rope_scaling is not None:
            kind = (
                self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
                if isinstance(self.rope_scaling, dict)
                else None
            )
            if not isinstance(kind, str):
                raise RecipeError(
                    "model.rope_scaling must be a mapping with a rope_type (e.g. "
                    f"{{rope_type: yarn, factor: 4.0}}) or null, got {self.rope_scaling!r}"
                )
        sw = self.sliding_window
        if not (sw is None or sw == "keep" or (isinstance(sw, int) and not isinstance(sw, bool) and sw >= 1)):
            raise RecipeError(
                f"model.sliding_window must be keep, null (no window) or an integer >= 1, got {sw!r}"
            )

    @property
    def rope_type(self) -> str | None:
        """The RoPE type the recipe asks for (``rope_scaling``'s ``rope_type``), if any."""
        if not self.rope_scaling:
            return None
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))


@dataclass
class SyntheticConfig(Section):
    """``data.synthetic``: line-retrieval records (or, ``task: repeat``, repeated random token runs)
    generated from ``train.seed`` (no download)."""

    NAME = "data.synthetic"
    # "lines": line-retrieval records; "repeat": a random token run then the same run again, loss on
    # the copy (teaches a fresh model to copy from context: the induction warm-up of the CPU demo)
    task: str = choice("lines", ("lines", "repeat"))
    num_examples: int = integer(256, lo=1)
    min_len: int | None = integer(None, lo=1, optional=True)  # lengths drawn from [min_len, seq_len]
    # loss on the answer tokens only, on all tokens, or (questions > 1) on the question/answer blocks
    loss_on: str = choice("answer", ("answer", "all", "questions"))
    questions: int = integer(1, lo=1)  # > 1: several questions per record, each record up to seq_len

    def check(self) -> None:
        if self.task == "repeat" and (
            self.min_len is not None or self.loss_on != "answer" or self.questions > 1
        ):
            raise RecipeError(
                "data.synthetic.task=repeat makes its own records (loss on the repeated copy): leave "
                "min_len, loss_on and questions unset"
            )
        if self.questions > 1 and (self.loss_on == "all" or self.min_len is not None):
            raise RecipeError(
                f"data.synthetic.questions={self.questions} makes records of up to seq_len tokens with the "
                "loss on answers or question blocks: set loss_on to answer or questions "
                f"(got {self.loss_on!r}) and leave min_len unset (or use questions: 1)"
            )
        if self.questions == 1 and self.loss_on == "questions":
            raise RecipeError(
                "data.synthetic.loss_on=questions needs data.synthetic.questions > 1: raise questions or use "
                "loss_on answer"
            )


@dataclass
class DataConfig(Section):
    """``data``: pre-tokenized rows (a packed dataset folder) or synthetic records, or raw SFT records
    tokenized by TRL's SFTTrainer (``format``); and the training length. Checks: data_checks.py."""

    NAME = "data"
    # a datasets save_to_disk folder with input_ids (+ labels); with format also a .jsonl/.json/.parquet file
    path: str | None = text(None, optional=True)
    synthetic: SyntheticConfig | None = None  # or synthetic line-retrieval records
    seq_len: int = integer(4096, lo=2)  # batches padded to it (data.format: rows cut at it, TRL pads)
    shuffle: bool = boolean(True)
    too_long: str = choice("fail", ("fail", "truncate", "drop"))  # rows longer than seq_len
    # attention and targets stay inside each document of a packed row (rows carry cu_seqlens)
    document_masking: bool = boolean(False)
    eval_path: str | None = text(None, optional=True)  # an eval split (as data.path), or:
    eval_fraction: float = number(0.0, lo=0, lt=1)  # this fraction of the rows, held out (seeded)
    # raw records through TRL's SFTTrainer: their columns (docs/recipes.md, "SFT data")
    format: str | None = choice(None, (None, *SFT_FORMATS))
    packing: bool = boolean(False)  # format: records packed into rows of seq_len, documents masked apart
    completion_only_loss: bool | None = boolean(None, optional=True)  # null: TRL's (prompt_completion: on)
    assistant_only_loss: bool = boolean(False)  # messages: loss on the assistant turns only
    text_field: str = text("text")  # format text: the column holding the text

    def check(self) -> None:
        if self.synthetic is not None and not isinstance(self.synthetic, SyntheticConfig):
            self.synthetic = build_section(SyntheticConfig, self.synthetic)
        problem = data_problem(self)
        if problem:
            raise RecipeError(problem)


@dataclass
class ParallelConfig(Section):
    """``parallel``: ranks per CP group (dp = world size / cp_size); ``ulysses_size`` > 1 splits it
    as Ulysses x ring (2D context parallelism; it must divide cp_size and the query heads)."""

    NAME = "parallel"
    cp_size: int = integer(1, lo=1)
    ulysses_size: int = integer(1, lo=1)

    def check(self) -> None:
        problem = ulysses_size_problem(self.cp_size, self.ulysses_size)
        if problem:
            raise RecipeError(f"parallel.{problem}")


@dataclass
class LoraConfig(Section):
    """``lora``: train a LoRA adapter instead of every weight (omit or null for full fine-tuning)."""

    NAME = "lora"
    r: int = integer(16, lo=1)
    alpha: float = number(32, gt=0)
    dropout: float = number(0.0, lo=0, lt=1)
    target_modules: list[str] = text_list(["q_proj", "k_proj", "v_proj", "o_proj"])
    # fp32 (peft's default: an fp32 copy of each target's input kept); model: no copies, fp32 masters
    adapter_dtype: str = choice("fp32", ("fp32", "model"))


@dataclass
class TrainConfig(Section):
    """``train``: batch layout, optimizer, schedule and memory options."""

    NAME = "train"
    micro_batch_size: int = integer(1, lo=1)
    grad_accum: int = integer(1, lo=1)
    max_steps: int = integer(100, lo=1)
    lr: float = number(2e-5, gt=0)
    min_lr_ratio: float = number(0.0, lo=0, hi=1)
    warmup_steps: int = integer(0, lo=0)
    schedule: str = choice("constant", ("constant", "cosine"))
    weight_decay: float = number(0.0, lo=0)
    betas: tuple[float, float] = pair((0.9, 0.95), lo=0, lt=1)
    grad_clip: float = number(1.0, lo=0)  # global-norm clipping; 0 = off
    gradient_checkpointing: bool = boolean(True)
    offload_activations: bool = boolean(False)  # checkpointed layer inputs to CPU memory
    attention_checkpoint: str = choice("recompute", ("recompute", "save", "offload"))  # docs/recipes.md
    tiled_mlp_tokens: int | None = integer(None, lo=1, optional=True)  # MLP in tiles of this many tokens
    tiled_norm_tokens: int | None = integer(None, lo=1, optional=True)  # RMSNorms in tiles (not DeepSpeed)
    attention_tile_tokens: int | None = integer(None, lo=1, optional=True)  # attention kernels in tiles
    fused_rmsnorm: bool = boolean(True)  # RMSNorms with the fused backward (ringft.model.fused_rmsnorm)
    chunked_loss: bool = boolean(True)  # LM head + cross-entropy in token chunks
    loss_chunk_size: int = integer(4096, lo=1)
    seed: int = integer(0, lo=0)
    num_train_epochs: float | None = number(None, gt=0, optional=True)  # set: epochs decide, not max_steps
    eval_every: int = integer(0, lo=0)  # steps between eval-loss passes over the eval split; 0 = off

    def check(self) -> None:
        if (mode := self.attention_checkpoint) != "recompute" and not self.gradient_checkpointing:
            raise RecipeError(f"train.attention_checkpoint={mode} needs train.gradient_checkpointing: true")
        if self.num_train_epochs is None and self.warmup_steps > self.max_steps:  # (epochs: steps unknown)
            raise RecipeError(
                f"train.warmup_steps={self.warmup_steps} is beyond train.max_steps={self.max_steps}: "
                "use at most max_steps warmup steps"
            )


@dataclass
class CheckpointConfig(Section):
    """``checkpoint``: where the run writes, and how often."""

    NAME = "checkpoint"
    output_dir: str = text("outputs/run")
    save_every: int = integer(0, lo=0)  # steps (and the last step); 0 = no checkpoints, only the export
    keep: int = integer(2, lo=1)  # newest complete checkpoints to keep
    save_final: bool = boolean(True)  # false: neither the last checkpoint nor the export (benchmark runs)
    push_to_hub: bool = boolean(False)  # upload the export (final/) to the Hugging Face Hub
    hub_model_id: str | None = text(None, optional=True)  # the Hub repository (default: the folder's name)

    def check(self) -> None:
        if self.push_to_hub and not self.save_final:
            raise RecipeError("checkpoint.push_to_hub uploads the export: set checkpoint.save_final: true")


@dataclass
class LoggingConfig(Section):
    """``logging``: the tracker and how often a step is logged."""

    NAME = "logging"
    tracker: str | None = choice("tensorboard", (None, "none", "tensorboard", "wandb"))
    project: str = text("ringft")
    log_every: int = integer(1, lo=1)


SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig,
    "data": DataConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "lora": LoraConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}


@dataclass
class Recipe:
    """A whole recipe; ``lora`` is None for full fine-tuning. Built by :func:`recipe_from_dict`."""

    model: ModelConfig
    data: DataConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig | None = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        d, p = self.data, self.parallel
        length = zigzag_length_problem(d.seq_len, p.cp_size, subject=f"data.seq_len={d.seq_len}")
        if length:
            raise RecipeError(length)
        rope = rope_problem(
            self.model.rope_scaling, p.cp_size, "model.rope_scaling rope_type", "parallel.cp_size"
        )
        if rope:
            raise RecipeError(rope)
        # (model.config's heads are known here; a pretrained model's: build.model_config)
        heads = self.model.config.get("num_attention_heads") if isinstance(self.model.config, dict) else None
        if isinstance(heads, int) and p.ulysses_size > 1:
            problem = heads_problem(heads, p.ulysses_size, p.cp_size)
            if problem:
                raise RecipeError(f"parallel.ulysses_size: {problem}")

    def to_dict(self) -> dict[str, Any]:
        """The recipe as plain data (what YAML holds; ``betas`` as a list)."""
        out = dataclasses.asdict(self)
        out["train"]["betas"] = list(out["train"]["betas"])
        return out


def build_section(cls: type[Section], values: Any) -> Section:
    """``cls(**values)``, refusing a non-mapping and unknown keys (naming the valid ones)."""
    where = cls.NAME
    if not isinstance(values, dict):
        raise RecipeError(f"recipe section {where!r} must be a mapping, got {values!r}")
    values = resolve_aliases(where, values)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - names)
    if unknown:
        elsewhere = {f.name: n for n, c in SECTIONS.items() for f in dataclasses.fields(c)}  # type: ignore
        raise RecipeError(unknown_keys_message(where, unknown, names, elsewhere))
    return cls(**values)


def _cp_divides_world(cp_size: Any, world_size: int) -> None:
    if isinstance(cp_size, int) and cp_size >= 1 and world_size % cp_size:
        raise RecipeError(
            f"parallel.cp_size={cp_size} does not divide the {world_size} launched processes: launch a "
            f"multiple of {cp_size} processes or choose a cp_size that divides {world_size}"
        )


def recipe_from_dict(raw: dict[str, Any] | None, world_size: int | None = None) -> Recipe:
    """Build and check a :class:`Recipe` from a parsed YAML mapping.

    With ``world_size`` (the number of launched processes), a ``parallel.cp_size`` that does not
    divide it is reported first (before any check it would make fail).
    """
    raw = dict(raw or {})
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        elsewhere = {f.name: n for n, c in SECTIONS.items() for f in dataclasses.fields(c)}  # type: ignore
        raise RecipeError(unknown_keys_message("", unknown, SECTIONS, elsewhere))
    if world_size is not None and isinstance(raw.get("parallel"), dict):
        _cp_divides_world(raw["parallel"].get("cp_size", 1), world_size)
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        if name in raw:
            value = raw[name]
            sections[name] = None if value is None and name == "lora" else build_section(cls, value)
    for required in ("model", "data"):
        if required not in sections:
            raise RecipeError(f"the recipe has no {required!r} section")
    recipe = Recipe(**sections)
    validate(recipe, world_size)
    return recipe


def launched_world_size() -> int | None:
    """The number of processes of this launch (``WORLD_SIZE``, set by accelerate / torchrun), if any."""
    value = os.environ.get("WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) >= 1 else None


def load_recipe(
    path: str | Path, overrides: list[str] | None = None, world_size: int | None = None
) -> Recipe:
    """Read a YAML recipe, apply ``--section.key value`` overrides, check it (``world_size``: by
    default the launch's ``WORLD_SIZE``; see :func:`recipe_from_dict`)."""
    path = Path(path)
    if path.is_dir():
        found = sorted(str(f) for f in path.glob("*.yaml"))[:3]
        yamls = ", ".join(found) or "it has none"
        raise RecipeError(f"recipe {str(path)!r} is a folder: give a recipe YAML file ({yamls})")
    if not path.is_file():
        raise RecipeError(f"recipe file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        first = str(exc).replace("\n", " ")
        raise RecipeError(f"recipe file {str(path)!r} is not valid YAML: {first}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe file {str(path)!r} must hold a mapping of sections, got {raw!r}")
    return recipe_from_dict(apply_overrides(raw, overrides or []), world_size or launched_world_size())


def validate(recipe: Recipe, world_size: int | None = None) -> None:
    """Checks beyond the types: the dataset folder exists; with ``world_size``, cp_size divides it."""
    if world_size is not None:
        _cp_divides_world(recipe.parallel.cp_size, world_size)
    for path in (p for p in (recipe.data.path, recipe.data.eval_path) if p is not None):
        if recipe.data.format and not Path(path).exists():
            raise RecipeError(
                f"dataset {path!r} does not exist: give a .jsonl/.json/.parquet file or a folder"
            )
        if not Path(path).exists():
            raise RecipeError(
                f"dataset folder {path!r} does not exist: build it with data_prep/pack.py "
                "(or data_prep/make_synthetic.py) first"
            )
