"""Per-rank GPU memory planner for long-context fine-tuning with zigzag ring attention.

The planner adds up, for one rank of a ``num_gpus`` job split into ``dp`` data-parallel replicas
of ``cp`` context-parallel ranks (``num_gpus = dp * cp``), the bytes of:

- **weights / grads / optimizer** (the model states), sharded by ZeRO over all ``num_gpus`` ranks:
  the CP ranks of a replica hold the same parameters, so the shard group is ``dp x cp`` (as in
  DeepSpeed-Ulysses, Megatron's distributed optimizer and torchtitan's FSDP mesh);
- **checkpointed activations**: with per-layer gradient checkpointing only each decoder layer's
  input is kept, ``L * T * h`` values, ``T = micro_batch * seq_local`` and ``seq_local = S / cp``;
- **the one-layer recompute working set**: during the backward of a layer its forward is recomputed,
  so all of that layer's saved tensors are alive at once, plus the ring-attention buffers and the
  backward's transients;
- **loss / logits**: the final norm + output projection + cross-entropy; ``12 * T * V`` bytes of
  fp32 logits and their grads unless the chunked loss (:func:`ringft.loss.chunked_lm_loss`)
  bounds them to ``~8 * chunk * V``;
- a **framework overhead** constant (CUDA context, NCCL buffers, allocator slack).

The peak is ``weights + grads + optimizer + zero3_gather + checkpointed + max(layer working set,
loss working set) + overhead``: the loss's tensors are freed before the backward reaches the last
decoder layer, and a layer's working set exists only during that layer's backward. Grads are
counted as resident for the whole step (as DDP buckets / DeepSpeed's contiguous grad buffers
keep them); with ``zero_grad(set_to_none=True)`` and no persistent buffers the true peak is lower.
Allocator fragmentation is not modelled (on an H100 the caching allocator reserved 14-20 % more
than the peak allocation in a 32K-token step; ``expandable_segments:True`` reduces that).

Validated against measured peaks (one training step, per-layer checkpointing, CP = 1): CPU fp32
(tensor bytes from the profiler: within 0.1 %; peak RSS: within 4 %) and an H100 in bf16 with
ringft's ring attention, full and LoRA, chunked and unchunked loss (the plan was 0.5-2.2 %, a
constant ~70 MiB of cuBLAS/kernel workspaces, below ``max_memory_allocated``). The ring buffers of
``cp > 1`` follow ``ringft.ops.zigzag`` but were not measured on several GPUs.

Shapes (from the model config): ``h`` hidden size, ``i`` MLP intermediate size, ``L`` layers,
``nh`` attention heads, ``nkv`` key/value heads, ``d`` head dim, ``V`` vocabulary. ``a`` is the
activation dtype's byte size (2 for bf16, 4 for fp32), ``T = micro_batch * S / cp`` the local
tokens. All results are bytes per rank; ``GiB = 2**30`` bytes.

Assumptions (full fine-tuning, ``dtype="bf16"``, the ZeRO paper's mixed-precision Adam): bf16
weights (2 B/param) and bf16 grads (2 B/param), fp32 master weights + Adam ``m`` and ``v``
(12 B/param) -> 16 B/param before sharding. ``dtype="fp32"``: 4 + 4 + 8 B/param (plain AdamW).
``master_weights=False`` (pure bf16 training): 2 + 2 + 4 (bf16 Adam states). LoRA: frozen base
weights in the model dtype (no grads/optimizer); adapters in fp32 (peft's default upcast) with
fp32 grads and Adam: 16 B per adapter parameter. Dropout off (LoRA dropout 0, attention dropout 0).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "PRESETS",
    "MemoryPlan",
    "ModelShape",
    "TrainingSetup",
    "format_layouts",
    "format_plan",
    "load_model_shape",
    "max_seq_len_that_fits",
    "plan_layouts",
    "plan_main",
    "plan_memory",
    "recommend",
]

GIB = 1 << 30
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")

#: Model shapes as transformers config dicts (hub configs cannot be downloaded everywhere).
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
    },
    "llama-3.2-1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
    },
    "mistral-7b": {  # v0.3 shape: 32768 vocabulary, no sliding window
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 32768,
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "rms_norm_eps": 1e-5,
    },
}
_PRESET_ALIASES = {
    "meta-llama/meta-llama-3-8b": "llama-3-8b",
    "meta-llama/llama-3.1-8b": "llama-3-8b",
    "llama-3.1-8b": "llama-3-8b",
    "meta-llama/llama-3.2-1b": "llama-3.2-1b",
    "mistralai/mistral-7b-v0.3": "mistral-7b",
    "mistral-7b-v0.3": "mistral-7b",
}


# --------------------------------------------------------------------------------------------
# model shape


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a LLaMA/Mistral-style decoder that memory depends on."""

    name: str
    hidden: int  # h
    intermediate: int  # i
    layers: int  # L
    heads: int  # nh
    kv_heads: int  # nkv
    head_dim: int  # d
    vocab: int  # V
    tie_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> ModelShape:
        """From a transformers ``PretrainedConfig`` or a config dict (transformers key names)."""
        get = (
            config.get if isinstance(config, Mapping) else lambda k, default=None: getattr(config, k, default)
        )
        try:
            hidden = int(get("hidden_size"))
            heads = int(get("num_attention_heads"))
            shape = cls(
                name=name or str(get("_name_or_path") or get("model_type") or "model"),
                hidden=hidden,
                intermediate=int(get("intermediate_size")),
                layers=int(get("num_hidden_layers")),
                heads=heads,
                kv_heads=int(get("num_key_value_heads") or heads),
                head_dim=int(get("head_dim") or hidden // heads),
                vocab=int(get("vocab_size")),
                tie_embeddings=bool(get("tie_word_embeddings", False)),
                attention_bias=bool(get("attention_bias", False)),
                mlp_bias=bool(get("mlp_bias", False)),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(
                "the config needs hidden_size, intermediate_size, num_hidden_layers, "
                f"num_attention_heads and vocab_size (a LLaMA/Mistral-style config): {exc}"
            ) from exc
        if shape.heads % shape.kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads")
        return shape

    # parameter counts ------------------------------------------------------------------------
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of each projection of one decoder layer."""
        h, i, q, kv = (
            self.hidden,
            self.intermediate,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        )
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def layer_params(self) -> int:
        """One decoder layer: ``h*nh*d + 2*h*nkv*d + nh*d*h + 3*h*i + 2*h`` (+ biases)."""
        n = sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden
        if self.attention_bias:
            n += (self.heads + 2 * self.kv_heads) * self.head_dim + self.hidden
        if self.mlp_bias:
            n += 2 * self.intermediate + self.hidden
        return n

    @property
    def embedding_params(self) -> int:
        """Input embedding ``V*h``."""
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        """Output projection ``V*h`` (0 when tied to the input embedding)."""
        return 0 if self.tie_embeddings else self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        """``L * layer_params + V*h (embedding) + V*h (lm_head, unless tied) + h (final norm)``."""
        return self.layers * self.layer_params + self.embedding_params + self.lm_head_params + self.hidden

    def lora_params(self, rank: int, targets: Iterable[str] = DEFAULT_LORA_TARGETS) -> int:
        """``L * sum over targets of r * (in + out)`` (A is ``r x in``, B is ``out x r``)."""
        shapes = self.linear_shapes()
        unknown = [t for t in targets if t not in shapes]
        if unknown:
            raise ValueError(f"unknown LoRA target(s) {unknown}; choose from {', '.join(shapes)}")
        return self.layers * sum(rank * sum(shapes[t]) for t in targets)


def load_model_shape(model: Any) -> ModelShape:
    """A :class:`ModelShape` from a preset name, a config dict / ``PretrainedConfig``, a JSON file,
    or a local directory / hub name (``AutoConfig.from_pretrained``, which needs the hub or cache).
    """
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, Mapping) or hasattr(model, "hidden_size"):
        return ModelShape.from_config(model)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"cannot read a model shape from {type(model).__name__}")
    key = str(model).strip()
    preset = _PRESET_ALIASES.get(key.lower(), key.lower())
    if preset in PRESETS:
        return ModelShape.from_config(PRESETS[preset], name=preset)
    if os.path.isfile(key):
        with open(key) as fh:
            return ModelShape.from_config(json.load(fh), name=os.path.basename(key))
    if not os.path.exists(key) and (os.path.isabs(key) or key.startswith(".") or key.count("/") > 1):
        raise ValueError(f"{key!r} does not exist; use a preset ({', '.join(PRESETS)}) or a config.json path")
    try:
        from transformers import AutoConfig

        try:  # the local cache first: no network round trips when it is there
            config = AutoConfig.from_pretrained(key, local_files_only=True)
        except OSError:
            config = AutoConfig.from_pretrained(key)
        return ModelShape.from_config(config, name=key)
    except Exception as exc:  # noqa: BLE001 - hub/cache errors come in many types
        raise ValueError(
            f"could not load a config for {key!r} ({type(exc).__name__}: {exc}). Use a preset "
            f"({', '.join(PRESETS)}), a config.json path or a local model directory"
        ) from exc


# --------------------------------------------------------------------------------------------
# training setup and plan


@dataclass(frozen=True)
class TrainingSetup:
    """How one training step is run. ``num_gpus = dp * cp_size``; ZeRO shards over ``num_gpus``."""

    seq_len: int
    num_gpus: int
    cp_size: int
    gpu_mem_gib: float
    micro_batch: int = 1
    lora: bool = False
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    dtype: str = "bf16"  # "bf16" (mixed precision) or "fp32"
    master_weights: bool = True  # bf16 full FT: fp32 master copy in the optimizer
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False  # ZeRO-3 only
    gradient_checkpointing: bool = True
    offload_activations: bool = False
    chunked_loss: bool = True
    loss_chunk_size: int = 4096
    tiled_mlp: bool = False
    attention_backend: str = "flash_attn"  # "torch": ringft's TorchBackend on CUDA expands K/V
    lora_fp32_adapters: bool = True  # peft's autocast_adapter_dtype=True default
    mlp_tile_tokens: int | None = None  # default: h tokens per tile (ceil(T / h) tiles)
    zero3_prefetch_layers: int = 1
    overhead_gib: float = 3.0

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or self.cp_size < 1 or self.num_gpus % self.cp_size:
            raise ValueError(f"cp_size ({self.cp_size}) must divide num_gpus ({self.num_gpus})")
        if self.seq_len < 1 or self.seq_len % (2 * self.cp_size):
            raise ValueError(
                f"seq_len ({self.seq_len}) must be a positive multiple of 2 * cp_size ({2 * self.cp_size})"
            )
        if self.attention_backend not in ("flash_attn", "torch"):
            raise ValueError(
                f"attention_backend must be 'flash_attn' or 'torch', got {self.attention_backend!r}"
            )
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"dtype must be 'bf16' or 'fp32', got {self.dtype!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError("offload_params needs ZeRO stage 3 (parameters are only partitioned there)")
        if self.micro_batch < 1 or self.loss_chunk_size < 1 or self.lora_rank < 1:
            raise ValueError("micro_batch, loss_chunk_size and lora_rank must be >= 1")

    @property
    def dp_size(self) -> int:
        return self.num_gpus // self.cp_size

    @property
    def seq_local(self) -> int:
        """``S / cp``: tokens of one sequence on this rank."""
        return self.seq_len // self.cp_size

    @property
    def tokens(self) -> int:
        """``T = micro_batch * S / cp``."""
        return self.micro_batch * self.seq_local

    @property
    def offloads(self) -> str:
        names = [
            ("opt", self.offload_optimizer),
            ("param", self.offload_params),
            ("act", self.offload_activations),
        ]
        return "+".join(n for n, on in names if on) or "-"


@dataclass
class MemoryPlan:
    """Per-rank memory of one layout, in bytes. ``total`` is the predicted peak."""

    model: ModelShape
    setup: TrainingSetup
    params_total: int
    params_trainable: int
    weights: int
    grads: int
    optimizer: int
    zero3_gather: int
    checkpointed_activations: int
    layer_working_set: int
    loss_working_set: int
    overhead: int
    cpu_offloaded: int
    details: dict[str, int] = field(default_factory=dict)

    @property
    def model_states(self) -> int:
        return self.weights + self.grads + self.optimizer + self.zero3_gather

    @property
    def total(self) -> int:
        """``model states + checkpointed + max(layer working set, loss working set) + overhead``."""
        return (
            self.model_states
            + self.checkpointed_activations
            + max(self.layer_working_set, self.loss_working_set)
            + self.overhead
        )

    @property
    def gpu_bytes(self) -> int:
        return int(self.setup.gpu_mem_gib * GIB)

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_bytes

    @property
    def headroom(self) -> int:
        return self.gpu_bytes - self.total

    def as_dict(self) -> dict[str, Any]:
        """Plain-data form (bytes), e.g. for JSON."""
        keys = [
            "weights",
            "grads",
            "optimizer",
            "zero3_gather",
            "checkpointed_activations",
            "layer_working_set",
            "loss_working_set",
            "overhead",
            "cpu_offloaded",
        ]
        out: dict[str, Any] = {k: getattr(self, k) for k in keys}
        out.update(
            model=self.model.name,
            cp=self.setup.cp_size,
            dp=self.setup.dp_size,
            seq_len=self.setup.seq_len,
            seq_local=self.setup.seq_local,
            params_total=self.params_total,
            params_trainable=self.params_trainable,
            total=self.total,
            fits=self.fits,
            details=dict(self.details),
        )
        return out


# --------------------------------------------------------------------------------------------
# the formulas


def _model_states(m: ModelShape, s: TrainingSetup) -> dict[str, int]:
    """Weights, grads, optimizer, ZeRO-3 gather buffers and CPU-offloaded bytes per rank.

    With ``P`` parameters, ``N = num_gpus`` and bytes per parameter ``(w, g, o)`` =
    ``(2, 2, 12)`` (bf16 + fp32 master + Adam), ``(4, 4, 8)`` (fp32) or ``(2, 2, 4)``
    (bf16 without master weights):

    - full FT: weights ``w*P`` (``/N`` at ZeRO-3), grads ``g*P`` (``/N`` at ZeRO >= 2),
      optimizer ``o*P`` (``/N`` at ZeRO >= 1);
    - LoRA: frozen base ``w*P`` (``/N`` at ZeRO-3) and, for the ``P_lora`` adapter parameters,
      ``4 + 4 + 8`` B (fp32 adapters, peft's default; else ``(w, g, o)``), sharded the same way;
    - ZeRO-3 gather: ``(1 + prefetch)`` gathered copies of the largest unit (a decoder layer or the
      ``V x h`` lm_head/embedding) in the weight dtype, plus one unit of full-size grads (full FT)
      before the reduce-scatter;
    - ``offload_optimizer`` moves the optimizer states (incl. master weights) to CPU memory;
      ``offload_params`` (ZeRO-3) keeps only the gather buffers on the GPU.
    """
    n = s.num_gpus
    wbytes = 2 if s.dtype == "bf16" else 4
    if s.dtype == "fp32":
        gbytes, obytes = 4, 8
    else:
        gbytes, obytes = 2, (12 if s.master_weights else 4)
    p_total = m.total_params
    shard_w = n if s.zero_stage >= 3 else 1
    shard_g = n if s.zero_stage >= 2 else 1
    shard_o = n if s.zero_stage >= 1 else 1
    if s.lora:
        p_lora = m.lora_params(s.lora_rank, s.lora_targets)
        trainable = p_lora
        lw, lg, lo = (4, 4, 8) if (s.lora_fp32_adapters or s.dtype == "fp32") else (wbytes, gbytes, obytes)
        weights = wbytes * p_total // shard_w + lw * p_lora // shard_w
        grads = lg * p_lora // shard_g
        optimizer = lo * p_lora // shard_o
    else:
        trainable = p_total
        weights = wbytes * p_total // shard_w
        grads = gbytes * p_total // shard_g
        optimizer = obytes * p_total // shard_o
    gather = 0
    if s.zero_stage >= 3:
        unit = max(m.layer_params, m.embedding_params)
        gather = (1 + s.zero3_prefetch_layers) * unit * wbytes + (0 if s.lora else unit * gbytes)
    cpu = 0
    if s.offload_optimizer:
        cpu += optimizer
        optimizer = 0
    if s.offload_params:
        cpu += weights
        weights = 0
    return {
        "params_total": p_total + (m.lora_params(s.lora_rank, s.lora_targets) if s.lora else 0),
        "params_trainable": trainable,
        "weights": weights,
        "grads": grads,
        "optimizer": optimizer,
        "zero3_gather": gather,
        "cpu": cpu,
    }


def _act_bytes(s: TrainingSetup) -> int:
    """``a``: bytes of one activation value (2 for bf16, 4 for fp32)."""
    return 2 if s.dtype == "bf16" else 4


def _linear_inputs(s: TrainingSetup, modules: Sequence[str], in_features: int, rank: int) -> tuple[bool, int]:
    """What the Linear ``modules`` (sharing one input of ``in_features``) keep for the backward,
    per token: ``(input kept, extra bytes)``.

    A Linear keeps its input only when its weight trains (autograd saves conditionally). A LoRA
    target keeps the input of ``lora_A`` -- with fp32 adapters on a bf16 model peft casts the input
    to fp32 first, a separate ``4*in`` copy per target -- and ``lora_A``'s output (``r`` values).
    """
    a = _act_bytes(s)
    kept, extra = False, 0
    targets = set(s.lora_targets) if s.lora else set()
    cast = s.lora and s.lora_fp32_adapters and a != 4
    for name in modules:
        if not s.lora:
            kept = True
        elif name in targets:
            if cast:
                extra += 4 * in_features
            else:
                kept = True
            extra += (4 if s.lora_fp32_adapters else a) * rank
    return kept, extra


def _layer_saved(m: ModelShape, s: TrainingSetup) -> dict[str, int]:
    """Bytes one decoder layer keeps for its backward (what a recompute re-creates).

    With ``T`` local tokens, ``a`` the activation byte size, per token:

    - ``norm1``: the RMSNorm's fp32 copy of its input ``4*h`` (none in fp32: the input is the
      checkpointed layer input), ``rsqrt`` (4 B), the normalised value ``a*h`` if the norm weight
      trains, and the norm's output ``a*h`` if q/k/v keep it (their weights train);
    - ``attention``: RoPE'd q, k, v and the output ``a*(2*nh + 2*nkv)*d``, fp32 lse ``4*nh``;
    - ``norm2``: as norm1, its input ``4*h`` either way (fp32 copy, or in fp32 the residual itself);
      output kept if gate/up train (or by the tiled MLP, which keeps its input);
    - ``mlp`` (SwiGLU): gate, silu(gate), up ``3*a*i``, and their product ``a*i`` if down_proj
      trains; 0 with the tiled MLP (recomputed per tile in the backward);
    - ``lora_attn`` / ``lora_mlp``: per LoRA target, the fp32 copy of its input ``4*in`` (bf16 model,
      fp32 adapters) and ``lora_A``'s output ``4*r``.

    Full fine-tuning in bf16 gives ``T*(16*h + 2*(2*nh + 2*nkv)*d + 4*nh + 8*i + 8)``.
    """
    a = _act_bytes(s)
    h, i, d = m.hidden, m.intermediate, m.head_dim
    q, kv = m.heads * d, m.kv_heads * d
    trains = not s.lora
    r = s.lora_rank
    norm_y = a * h if trains else 0
    n1_kept, lora_attn = _linear_inputs(s, ("q_proj", "k_proj", "v_proj"), h, r)
    norm1 = (4 * h if a != 4 else 0) + 4 + norm_y + (a * h if n1_kept else 0)
    attention = a * (2 * q + 2 * kv) + 4 * m.heads
    lora_attn += _linear_inputs(s, ("o_proj",), q, r)[1]  # the attention output is kept anyway
    n2_kept, lora_mlp = _linear_inputs(s, ("gate_proj", "up_proj"), h, r)
    if s.tiled_mlp:
        norm2 = 4 * h + 4 + norm_y + a * h
        mlp, lora_mlp = 0, 0
    else:
        norm2 = 4 * h + 4 + norm_y + (a * h if n2_kept else 0)
        p_kept, p_extra = _linear_inputs(s, ("down_proj",), i, r)
        mlp = 3 * a * i + (a * i if p_kept else 0)
        lora_mlp += p_extra
    t = s.tokens
    return {
        "norm1": t * norm1,
        "attention": t * attention,
        "lora_attn": t * lora_attn,
        "norm2": t * norm2,
        "mlp": t * mlp,
        "lora_mlp": t * lora_mlp,
    }


def _mlp_tile(m: ModelShape, s: TrainingSetup) -> int:
    return min(s.tokens, s.mlp_tile_tokens or m.hidden)


def _attention_kernel(m: ModelShape, s: TrainingSetup) -> int:
    """Transients of the block attention backward, ``T`` tokens.

    ``dq`` ``a*T*nh*d``; ``dk, dv`` ``2*a*T*nkv*d``, computed at ``nh`` heads first when
    ``nkv < nh`` (flash-attention 2 expands them, ``+2*a*T*nh*d``); an fp32 dq workspace
    ``4*T*nh*d``; the output grad ``a*T*nh*d``; with ``attention_backend="torch"`` on CUDA (no
    native GQA) K/V are expanded to ``nh`` heads as well, ``+2*a*T*nh*d``.
    """
    a, t = _act_bytes(s), s.tokens
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    gqa = m.kv_heads < m.heads
    kernel = a * q + 2 * a * kv + (2 * a * q if gqa else 0) + 4 * q + a * q
    if gqa and s.attention_backend == "torch":
        kernel += 2 * a * q
    return t * kernel


def _layer_working_set(m: ModelShape, s: TrainingSetup, saved: dict[str, int]) -> dict[str, int]:
    """Peak of one decoder layer's backward (after its recompute), the larger of two phases.

    - MLP phase (the MLP backward runs first): everything the layer saved, the output grad
      ``a*T*h`` and the MLP backward's transients: untiled, gate/silu/up and the grads of the
      product, silu and up are alive together, ``6*a*T*i`` minus the MLP's saved bytes; tiled,
      one tile's recompute + transients ``6*a*t*i`` (``t`` tile tokens, plus the tile's LoRA input
      copies) and the input-grad accumulator ``a*T*h``;
    - attention phase (the second norm's and the MLP's tensors are freed): norm1 + attention +
      their LoRA tensors, the kernel transients (:func:`_attention_kernel`); with ``cp > 1`` the
      ring buffers: fp32 dq accumulator ``4*T*nh*d``, K/V double buffer ``2*2*a*T*nkv*d`` and the
      travelling fp32 dK/dV double buffer ``2*2*4*T*nkv*d``; and the gradient flow: output and
      input grads ``2*a*T*h`` plus the RMSNorm backward's fp32 temporary ``4*T*h``.
    """
    a = _act_bytes(s)
    t, h, d, nkv, i = s.tokens, m.hidden, m.head_dim, m.kv_heads, m.intermediate
    if s.tiled_mlp:
        tile = _mlp_tile(m, s)
        tile_lora = _linear_inputs(s, ("gate_proj", "up_proj"), h, s.lora_rank)[1]
        tile_lora += _linear_inputs(s, ("down_proj",), i, s.lora_rank)[1]
        mlp_extra = tile * (6 * a * i + tile_lora) + a * t * h
    else:
        mlp_extra = 6 * a * t * i - saved["mlp"]
    ring = 0
    if s.cp_size > 1:
        q = m.heads * d
        ring = 4 * t * q + 2 * 2 * a * t * nkv * d + 2 * 2 * 4 * t * nkv * d
    kernel = _attention_kernel(m, s)
    grad_flow = 2 * a * t * h + 4 * t * h
    mlp_phase = sum(saved.values()) + mlp_extra + a * t * h
    attn_phase = saved["norm1"] + saved["attention"] + saved["lora_attn"] + kernel + ring + grad_flow
    return {
        "mlp_phase": mlp_phase,
        "attention_phase": attn_phase,
        "ring_buffers": ring,
        "attention_kernel": kernel,
        "mlp_backward_extra": mlp_extra,
        "grad_flow": grad_flow,
    }


def _loss_working_set(m: ModelShape, s: TrainingSetup) -> dict[str, int]:
    """Peak of the final RMSNorm + output projection + cross-entropy (forward and backward).

    The final norm's tensors live from the end of the forward until the loss's backward is done:
    fp32 input ``4*T*h`` and ``rsqrt``, the normalised value ``a*T*h`` if its weight trains, its
    output ``a*T*h`` if the lm_head trains or the chunked loss keeps it. On top of them:

    - unchunked (transformers' ``ForCausalLMLoss``): during the backward the saved fp32
      log-softmax, its incoming and its outgoing grad are alive at once: ``12*T*V`` (larger than
      the forward's ``(a + 8)*T*V``);
    - chunked (:func:`ringft.loss.chunked_lm_loss`, ``c = min(chunk, T)``): the larger of the
      forward's ``8*c*V`` (fp32 logits + log-sum-exp temporary) and the backward's
      ``(4 + a')*c*V + a*T*h`` (grad_hidden) ``+ (4 + a')*V*h`` (fp32 lm_head grad accumulator
      and the low-precision product added to it, when the lm_head trains; ``a' = 0`` in fp32,
      else ``a``).
    """
    a = _act_bytes(s)
    t, v, h = s.tokens, m.vocab, m.hidden
    trains = not s.lora
    low = a if a != 4 else 0
    keep_out = trains or s.chunked_loss
    final_norm = t * (4 * h + 4 + (a * h if trains else 0) + (a * h if keep_out else 0))
    if not s.chunked_loss:
        return {"final_norm": final_norm, "logits": 12 * t * v}
    c = min(s.loss_chunk_size, t)
    head_grad = 4 * v * h if trains else 0
    # + the low-precision ``V x h`` product of a chunk's weight gradient (``g_low.t() @ h``, added
    # to the fp32 accumulator): measured, bf16 full fine-tuning peaks were exactly ``a*V*h`` above
    # the plan without this term (CPU bench_memory --dtype bf16: 27-31 MiB at V=32000, h=512;
    # H100 Llama-3-8B: -1.8 %, ~1 GiB). fp32 accumulates in place (addmm_): no such product.
    # On CPU the in-place add of that bf16 product into the fp32 accumulator also materialises an
    # fp32 copy (4*V*h) next to the chunk's a*c*V grad: where 4*V*h > 4*c*V this plan is low on CPU
    # (measured: V=8192, h=512, c=256, T=1024: 45 MiB vs 37 planned); GPU kernels cast on the fly.
    backward = (4 + low) * c * v + a * t * h + head_grad + low * v * h * trains
    return {
        "final_norm": final_norm,
        "logits": max(8 * c * v, backward, a * t * h + (4 + low) * v * h * trains),
    }


def _checkpointed(m: ModelShape, s: TrainingSetup, saved: dict[str, int]) -> dict[str, int]:
    """Activations kept from the forward until the backward reaches their layer.

    - per-layer checkpointing: the ``L`` layer inputs ``L*a*T*h``; with activation offload only
      ``2*a*T*h`` stay on the GPU (the layer in use and the one in flight), the rest is in CPU
      memory;
    - no checkpointing: every layer's saved tensors (:func:`_layer_saved`) plus its input;
    - always: RoPE's cos/sin ``2*a*T*d`` (shared by all layers).

    (The final norm's tensors are counted with the loss: they are freed before any layer's
    backward.)
    """
    a = 2 if s.dtype == "bf16" else 4
    t, h = s.tokens, m.hidden
    per_layer = a * t * h
    if not s.gradient_checkpointing:
        per_layer += sum(saved.values())
    layers = m.layers * per_layer
    cpu = 0
    if s.offload_activations and s.gradient_checkpointing:
        on_gpu = min(2, m.layers) * per_layer
        cpu, layers = layers - on_gpu, on_gpu
    return {"layers": layers, "rope": 2 * a * t * m.head_dim, "cpu": cpu}


def plan_memory(
    model: Any,
    seq_len: int,
    num_gpus: int,
    gpu_mem_gib: float,
    *,
    cp_size: int | None = None,
    **options: Any,
) -> MemoryPlan:
    """Predict the per-rank peak memory of one layout.

    Args:
        model: preset name, config dict, ``PretrainedConfig``, config.json path, model dir, or
            :class:`ModelShape`.
        seq_len: global sequence length ``S`` (a multiple of ``2 * cp_size``).
        num_gpus: ranks in the job; ``dp = num_gpus / cp_size``.
        gpu_mem_gib: memory of one GPU in GiB (an "80 GB" H100 has about 79.6 GiB).
        cp_size: context-parallel size (default ``num_gpus``).
        options: any other :class:`TrainingSetup` field (``lora``, ``zero_stage``,
            ``offload_optimizer``, ``chunked_loss``, ``tiled_mlp``, ``overhead_gib``, ...).
    """
    shape = load_model_shape(model)
    setup = TrainingSetup(
        seq_len=seq_len,
        num_gpus=num_gpus,
        cp_size=num_gpus if cp_size is None else cp_size,
        gpu_mem_gib=gpu_mem_gib,
        **_setup_options(options),
    )
    return _plan(shape, setup)


def _setup_options(options: Mapping[str, Any]) -> dict[str, Any]:
    allowed = {f.name for f in fields(TrainingSetup)} - {"seq_len", "num_gpus", "cp_size", "gpu_mem_gib"}
    unknown = set(options) - allowed
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; known: {sorted(allowed)}")
    out = dict(options)
    if "lora_targets" in out:
        out["lora_targets"] = tuple(out["lora_targets"])
    return out


def _plan(shape: ModelShape, setup: TrainingSetup) -> MemoryPlan:
    states = _model_states(shape, setup)
    saved = _layer_saved(shape, setup)
    work = _layer_working_set(shape, setup, saved)
    loss = _loss_working_set(shape, setup)
    ckpt = _checkpointed(shape, setup, saved)
    if setup.gradient_checkpointing:
        layer_ws = max(work["mlp_phase"], work["attention_phase"])
    else:  # the saved tensors are already counted as stored activations: transients only
        layer_ws = max(
            work["mlp_phase"] - sum(saved.values()),
            work["attention_phase"] - saved["norm1"] - saved["attention"] - saved["lora_attn"],
        )
    details = {f"layer_saved.{k}": v for k, v in saved.items()}
    details.update({f"layer_ws.{k}": v for k, v in work.items()})
    details.update({f"loss.{k}": v for k, v in loss.items()})
    details.update({f"checkpointed.{k}": v for k, v in ckpt.items() if k != "cpu"})
    return MemoryPlan(
        model=shape,
        setup=setup,
        params_total=states["params_total"],
        params_trainable=states["params_trainable"],
        weights=states["weights"],
        grads=states["grads"],
        optimizer=states["optimizer"],
        zero3_gather=states["zero3_gather"],
        checkpointed_activations=ckpt["layers"] + ckpt["rope"],
        layer_working_set=layer_ws,
        loss_working_set=sum(loss.values()),
        overhead=int(setup.overhead_gib * GIB),
        cpu_offloaded=states["cpu"] + ckpt["cpu"],
        details=details,
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_layouts(
    model: Any,
    seq_len: int,
    num_gpus: int,
    gpu_mem_gib: float,
    *,
    cp_sizes: Sequence[int] | None = None,
    explore_offload: bool = True,
    **options: Any,
) -> list[MemoryPlan]:
    """Plans for every ``(cp, dp = num_gpus / cp)`` layout (and, with ``explore_offload``, every
    combination of optimizer / parameter (ZeRO-3 only) / activation offload).

    ``cp_sizes`` defaults to the divisors of ``num_gpus``; sizes with ``seq_len % (2*cp) != 0``
    are skipped. Ordered by cp, then by the number of offloads. See :func:`recommend`.
    """
    shape = load_model_shape(model)
    opts = _setup_options(options)
    combos: list[dict[str, bool]] = [{}]
    if explore_offload:
        zero3 = opts.get("zero_stage", 0) == 3
        combos = [
            {"offload_optimizer": o, "offload_params": p, "offload_activations": act}
            for o in (False, True)
            for p in ((False, True) if zero3 else (False,))
            for act in (False, True)
        ]
        combos.sort(key=lambda c: sum(c.values()))
    plans = []
    for cp in cp_sizes or _divisors(num_gpus):
        if num_gpus % cp or seq_len % (2 * cp):
            continue
        for combo in combos:
            setup = TrainingSetup(
                seq_len=seq_len, num_gpus=num_gpus, cp_size=cp, gpu_mem_gib=gpu_mem_gib, **{**opts, **combo}
            )
            plans.append(_plan(shape, setup))
    return plans


def recommend(plans: Sequence[MemoryPlan], margin_fraction: float = 0.10) -> MemoryPlan | None:
    """The plan to use: among those that fit, prefer ones with ``margin_fraction`` of the GPU
    left free (allocator fragmentation is not modelled: 12-20 % on top of the peak allocation was
    seen with PyTorch's default caching allocator), then the fewest offloads (they cost
    speed), then the smallest cp (fewer ring hops, more data-parallel replicas), then the most
    headroom. ``None`` if nothing fits."""
    fitting = [p for p in plans if p.fits]
    if not fitting:
        return None

    def key(p: MemoryPlan) -> tuple[bool, int, int, int]:
        s = p.setup
        tight = p.headroom < margin_fraction * p.gpu_bytes
        return (tight, s.offload_optimizer + s.offload_params + s.offload_activations, s.cp_size, -p.headroom)

    return min(fitting, key=key)


def max_seq_len_that_fits(
    model: Any,
    num_gpus: int,
    gpu_mem_gib: float,
    *,
    cp_size: int | None = None,
    limit: int = 1 << 26,
    **options: Any,
) -> int:
    """Largest global sequence length (a multiple of ``2 * cp * 1024``) whose plan fits.

    Memory grows monotonically with the sequence length, so this is a binary search. With
    ``cp_size=None`` every divisor of ``num_gpus`` is tried and the best is returned. Returns 0 when
    not even ``2 * cp * 1024`` tokens fit, and at most ``limit``.
    """
    shape = load_model_shape(model)
    opts = _setup_options(options)
    if cp_size is None:
        return max(
            max_seq_len_that_fits(shape, num_gpus, gpu_mem_gib, cp_size=c, limit=limit, **opts)
            for c in _divisors(num_gpus)
        )
    unit = 2 * cp_size * 1024

    def fits(k: int) -> bool:
        setup = TrainingSetup(
            seq_len=k * unit, num_gpus=num_gpus, cp_size=cp_size, gpu_mem_gib=gpu_mem_gib, **opts
        )
        return _plan(shape, setup).fits

    lo, hi = 0, 1  # fits(lo) (or lo == 0); find hi that does not fit
    top = max(limit // unit, 1)
    while hi <= top and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, top + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * unit


# --------------------------------------------------------------------------------------------
# output


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def format_plan(plan: MemoryPlan) -> str:
    """A readable per-rank breakdown of one plan (GiB)."""
    m, s = plan.model, plan.setup
    mode = f"LoRA r={s.lora_rank} ({','.join(s.lora_targets)})" if s.lora else "full fine-tuning"
    loss = f"chunked loss (chunk {s.loss_chunk_size})" if s.chunked_loss else "unchunked loss (full logits)"
    lines = [
        f"model {m.name}: h={m.hidden} i={m.intermediate} L={m.layers} heads={m.heads} kv_heads={m.kv_heads} "
        f"head_dim={m.head_dim} V={m.vocab}{' (tied)' if m.tie_embeddings else ''}; "
        f"{plan.params_total / 1e9:.3f}B params, {plan.params_trainable / 1e6:.1f}M trainable",
        f"layout: {s.num_gpus} GPUs = dp {s.dp_size} x cp {s.cp_size}; S={s.seq_len} -> "
        f"{s.seq_local} tokens/rank x micro-batch {s.micro_batch}; {s.dtype}, {mode}, ZeRO-{s.zero_stage}, "
        f"offload {s.offloads}, {loss}, "
        f"{'tiled MLP, ' if s.tiled_mlp else ''}"
        f"{'per-layer checkpointing' if s.gradient_checkpointing else 'no checkpointing'}",
        "",
        f"{'per rank':<34}{'GiB':>10}",
        f"{'  weights':<34}{_gib(plan.weights):>10}",
        f"{'  grads':<34}{_gib(plan.grads):>10}",
        f"{'  optimizer states':<34}{_gib(plan.optimizer):>10}",
        f"{'  ZeRO-3 gather buffers':<34}{_gib(plan.zero3_gather):>10}",
        f"{'  checkpointed activations':<34}{_gib(plan.checkpointed_activations):>10}",
        f"{'  one-layer recompute working set':<34}{_gib(plan.layer_working_set):>10}",
        f"{'  loss / logits working set':<34}{_gib(plan.loss_working_set):>10}",
        f"{'  framework overhead':<34}{_gib(plan.overhead):>10}",
        f"{'peak = states + ckpt + max(ws) + ovh':<34}{_gib(plan.total):>10}"
        f"   of {s.gpu_mem_gib:g} GiB -> {'FITS' if plan.fits else 'DOES NOT FIT'}"
        f" ({'+' if plan.headroom >= 0 else '-'}{_gib(abs(plan.headroom))} GiB)",
    ]
    if plan.cpu_offloaded:
        lines.append(f"{'  offloaded to CPU memory':<34}{_gib(plan.cpu_offloaded):>10}")
    d = plan.details
    lines += [
        "",
        "layer working set: MLP phase {} GiB, attention phase {} GiB (ring buffers {} GiB)".format(
            _gib(d["layer_ws.mlp_phase"]),
            _gib(d["layer_ws.attention_phase"]),
            _gib(d["layer_ws.ring_buffers"]),
        ),
    ]
    return "\n".join(lines)


def format_layouts(plans: Sequence[MemoryPlan]) -> str:
    """A table with one row per plan (GiB per rank)."""
    head = (
        f"{'cp':>3} {'dp':>3} {'tok/rank':>9} {'offload':>15} {'weights':>8} {'grads':>7} {'optim':>7} "
        f"{'z3buf':>6} {'ckpt':>7} {'layer':>7} {'loss':>7} {'total':>8}  fits"
    )
    rows = [head, "-" * len(head)]
    for p in plans:
        s = p.setup
        rows.append(
            f"{s.cp_size:>3} {s.dp_size:>3} {s.tokens:>9} {s.offloads:>15} {_gib(p.weights):>8} "
            f"{_gib(p.grads):>7} {_gib(p.optimizer):>7} {_gib(p.zero3_gather):>6} "
            f"{_gib(p.checkpointed_activations):>7} {_gib(p.layer_working_set):>7} "
            f"{_gib(p.loss_working_set):>7} {_gib(p.total):>8}  {'yes' if p.fits else 'no'}"
        )
    return "\n".join(rows)


# --------------------------------------------------------------------------------------------
# CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringft plan",
        description="Per-rank GPU memory plan for long-context fine-tuning with zigzag ring attention.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help=f"preset ({', '.join(PRESETS)}), model directory or hub name")
    src.add_argument("--config-json", help="path to a transformers config.json")
    p.add_argument("--seq-len", type=int, required=True, help="global sequence length S")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs (dp * cp)")
    p.add_argument("--gpu-mem", type=float, required=True, help="memory per GPU in GiB")
    p.add_argument("--cp", type=int, action="append", help="CP size(s) to try (default: all divisors)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--lora", action="store_true", help="LoRA instead of full fine-tuning")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-targets", default=",".join(DEFAULT_LORA_TARGETS))
    p.add_argument(
        "--lora-bf16-adapters",
        action="store_true",
        help="adapters in the model dtype (peft autocast_adapter_dtype=False); default fp32 adapters",
    )
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--no-master-weights", action="store_true", help="pure bf16 (no fp32 master copy)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage")
    p.add_argument("--offload-optimizer", action="store_true")
    p.add_argument("--offload-params", action="store_true", help="ZeRO-3 parameter offload")
    p.add_argument("--offload-activations", action="store_true")
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--no-chunked-loss", action="store_true")
    p.add_argument("--loss-chunk", type=int, default=4096)
    p.add_argument("--tiled-mlp", action="store_true")
    p.add_argument("--mlp-tile", type=int, default=None, help="tokens per MLP tile (default: hidden size)")
    p.add_argument("--overhead-gib", type=float, default=3.0)
    p.add_argument("--explore-offload", action="store_true", help="also try every offload combination")
    p.add_argument("--json", action="store_true", help="print the plans as JSON")
    return p


def plan_main(argv: list[str] | None = None) -> int:
    """``ringft plan ...``: print the layout table, the recommended plan and the longest sequence
    that fits. Returns 0 when some layout fits, 1 when none does, 2 on bad arguments."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        shape = load_model_shape(args.config_json or args.model)
        options: dict[str, Any] = {
            "micro_batch": args.micro_batch,
            "lora": args.lora,
            "lora_rank": args.lora_rank,
            "lora_targets": tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()),
            "lora_fp32_adapters": not args.lora_bf16_adapters,
            "dtype": args.dtype,
            "master_weights": not args.no_master_weights,
            "zero_stage": args.zero,
            "offload_optimizer": args.offload_optimizer,
            "offload_params": args.offload_params,
            "offload_activations": args.offload_activations,
            "gradient_checkpointing": not args.no_gradient_checkpointing,
            "chunked_loss": not args.no_chunked_loss,
            "loss_chunk_size": args.loss_chunk,
            "tiled_mlp": args.tiled_mlp,
            "mlp_tile_tokens": args.mlp_tile,
            "overhead_gib": args.overhead_gib,
        }
        if args.explore_offload:
            for k in ("offload_optimizer", "offload_params", "offload_activations"):
                options.pop(k)
        plans = plan_layouts(
            shape,
            args.seq_len,
            args.gpus,
            args.gpu_mem,
            cp_sizes=args.cp,
            explore_offload=args.explore_offload,
            **options,
        )
    except (ValueError, TypeError) as exc:
        print(f"ringft plan: error: {exc}")
        return 2
    if not plans:
        print(f"ringft plan: error: no CP size divides both --gpus {args.gpus} and --seq-len / 2")
        return 2
    best = recommend(plans)
    if args.json:
        print(
            json.dumps(
                {"plans": [p.as_dict() for p in plans], "recommended": best.as_dict() if best else None}
            )
        )
        return 0 if best else 1
    print(format_layouts(plans))
    print()
    shown = best or min(plans, key=lambda p: p.total)
    print(("recommended layout:" if best else "nothing fits; the smallest plan:") + "\n")
    print(format_plan(shown))
    s = shown.setup
    longest = max_seq_len_that_fits(
        shape,
        s.num_gpus,
        s.gpu_mem_gib,
        cp_size=s.cp_size,
        **{
            **options,
            **{k: getattr(s, k) for k in ("offload_optimizer", "offload_params", "offload_activations")},
        },
    )
    print(f"\nlongest sequence that fits this layout (multiples of {2 * s.cp_size * 1024}): {longest}")
    return 0 if best else 1


if __name__ == "__main__":
    raise SystemExit(plan_main())
