"""How one training step is run (:class:`TrainingSetup`) and its per-rank memory (:class:`MemoryPlan`).

Option names are the recipes' names (``train.micro_batch_size``, ``model.attn_backend``,
``train.tiled_mlp_tokens``, ``train.loss_chunk_size``, ...), and dtype names come from
:data:`ringft.ops.DTYPES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ringft.ops.dtypes import DTYPES, dtype_from_name
from ringft.ops.sharding import ulysses_size_problem, zigzag_length_problem
from ringft.planner.shapes import DEFAULT_LORA_TARGETS, ModelShape
from ringft.utils import values

__all__ = ["GIB", "PLANNED_DTYPES", "ATTN_BACKENDS", "ATTENTION_CHECKPOINTS", "MemoryPlan", "TrainingSetup"]

GIB = 1 << 30
PLANNED_DTYPES = ("bf16", "fp32")  # bf16 = mixed precision (bf16 compute), fp32 = plain fp32
ATTN_BACKENDS = ("flash_attn", "torch")
ATTENTION_CHECKPOINTS = ("recompute", "save", "offload")  # train.attention_checkpoint


@dataclass(frozen=True)
class TrainingSetup:
    """How one training step is run, for one rank of ``num_gpus = dp * cp_size`` ranks.

    ZeRO (DeepSpeed) and FSDP shard over all ``num_gpus`` ranks (the CP ranks of a replica hold
    the same parameters). ``tiled_mlp_tokens`` set means the tiled MLP is on with that tile size
    (as in recipes); ``tiled_mlp=True`` alone tiles by ``hidden_size`` tokens. Every value is
    checked: a bad one raises ``ValueError`` naming it and the fix. ``ulysses_size > 1``: the CP
    group runs Ulysses x ring (``cp_size = ulysses_size x ring``; its all-to-all buffers and
    replicated K/V heads are in the plan).
    """

    seq_len: int
    num_gpus: int
    cp_size: int
    gpu_mem_gib: float
    micro_batch_size: int = 1
    lora: bool = False
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    dtype: str = "bf16"  # "bf16" (mixed precision) or "fp32"
    master_weights: bool = True  # bf16 full FT: fp32 master copy in the optimizer
    zero_stage: int = 0  # 0: DDP; 1, 2, 3: DeepSpeed ZeRO (FSDP FULL_SHARD = 3, SHARD_GRAD_OP = 2)
    offload_optimizer: bool = False
    offload_params: bool = False  # ZeRO-3 only
    gradient_checkpointing: bool = True
    offload_activations: bool = False
    chunked_loss: bool = True
    loss_chunk_size: int = 4096
    tiled_mlp: bool = False
    attn_backend: str = "flash_attn"  # "torch": ringft's TorchBackend on CUDA expands K/V
    lora_fp32_adapters: bool = True  # peft's autocast_adapter_dtype=True default
    tiled_mlp_tokens: int | None = None  # tokens per MLP tile; None: hidden_size (ceil(T / h) tiles)
    tiled_norm_tokens: int | None = None  # tokens per RMSNorm tile (train.tiled_norm_tokens); None: untiled
    zero3_prefetch_layers: int = 1
    overhead_gib: float = 3.0
    ulysses_size: int = 1  # 2D context parallelism: cp_size = ulysses_size x ring size
    fused_rmsnorm: bool = True  # train.fused_rmsnorm: the RMSNorms' fused backward
    attention_tile_tokens: int | None = None  # train.attention_tile_tokens: attention transients per tile
    attention_checkpoint: str = "recompute"  # train.attention_checkpoint: recompute | save | offload

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))
        if self.tiled_mlp_tokens is not None and not self.tiled_mlp:
            object.__setattr__(self, "tiled_mlp", True)

    def problems(self) -> list[str]:
        """One message per bad value (naming it and the fix); empty when the setup is valid."""
        positive = ("num_gpus", "cp_size", "micro_batch_size", "loss_chunk_size", "lora_rank")
        out = values.problems(
            *(partial(values.as_integer, name, getattr(self, name), 1) for name in positive),
            partial(values.as_integer, "seq_len", self.seq_len, 2),
        )
        if not out:
            if self.num_gpus % self.cp_size:
                out.append(
                    f"cp_size {self.cp_size} does not divide num_gpus {self.num_gpus}: use a divisor of "
                    f"{self.num_gpus} ({', '.join(str(d) for d in divisors(self.num_gpus))})"
                )
            length = zigzag_length_problem(self.seq_len, self.cp_size, subject=f"seq_len {self.seq_len}")
            out += [length] if length else []
            split = ulysses_size_problem(self.cp_size, self.ulysses_size)
            out += [split] if split else []
        out += values.problems(
            partial(values.as_number, "gpu_mem_gib", self.gpu_mem_gib, gt=0, fix="GiB per GPU, e.g. 79.6"),
            partial(values.as_integer, "tiled_mlp_tokens", self.tiled_mlp_tokens, 1, optional=True),
            partial(values.as_integer, "tiled_norm_tokens", self.tiled_norm_tokens, 1, optional=True),
            partial(values.as_integer, "attention_tile_tokens", self.attention_tile_tokens, 1, optional=True),
            partial(
                values.as_choice,
                "attention_checkpoint",
                self.attention_checkpoint,
                ATTENTION_CHECKPOINTS,
                fix="recompute (default), save (attention output + lse kept on the GPU) or offload "
                "(in host memory)",
            ),
            partial(values.as_integer, "zero3_prefetch_layers", self.zero3_prefetch_layers, 0),
            partial(values.as_number, "overhead_gib", self.overhead_gib, 0),
            partial(
                values.as_choice,
                "attn_backend",
                self.attn_backend,
                ATTN_BACKENDS,
                fix="a recipe's 'auto' runs flash_attn on a GPU with flash-attn installed for bf16, "
                "else torch",
            ),
        )
        if self.lora and not self.lora_targets:
            out.append(
                f"lora_targets is empty: name the modules LoRA adapts, e.g. {','.join(DEFAULT_LORA_TARGETS)}"
            )
        try:
            dtype_from_name(self.dtype, PLANNED_DTYPES)
        except ValueError as exc:
            out.append(str(exc))
        out += values.problems(partial(values.as_choice, "zero_stage", self.zero_stage, (0, 1, 2, 3)))
        if self.zero_stage in (0, 1, 2) and self.offload_params:
            out.append(
                "offload_params needs ZeRO stage 3 (zero_stage=3): parameters are only partitioned there"
            )
        return out

    @property
    def ring_size(self) -> int:
        """Ranks per ring group: ``cp_size / ulysses_size``."""
        return self.cp_size // self.ulysses_size

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: ``num_gpus / cp_size``."""
        return self.num_gpus // self.cp_size

    @property
    def seq_local(self) -> int:
        """``S / cp``: tokens of one sequence on this rank."""
        return self.seq_len // self.cp_size

    @property
    def tokens(self) -> int:
        """``T = micro_batch_size * S / cp``: the local tokens of one micro-step."""
        return self.micro_batch_size * self.seq_local

    @property
    def act_bytes(self) -> int:
        """``a``: bytes of one activation value (2 for bf16, 4 for fp32)."""
        return DTYPES[self.dtype].itemsize

    @property
    def offloads(self) -> str:
        """Short label of the offloads that are on, e.g. ``"opt+act"`` (``"-"`` for none)."""
        names = [
            ("opt", self.offload_optimizer),
            ("param", self.offload_params),
            ("act", self.offload_activations),
            ("attn", self.attention_checkpoint == "offload"),
        ]
        return "+".join(n for n, on in names if on) or "-"


def divisors(n: int) -> list[int]:
    """The divisors of ``n >= 1``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


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
        """Weights + grads + optimizer states + ZeRO-3 gather buffers."""
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
        """The GPU's memory in bytes."""
        return int(self.setup.gpu_mem_gib * GIB)

    @property
    def fits(self) -> bool:
        """Whether the predicted peak is within the GPU's memory."""
        return self.total <= self.gpu_bytes

    @property
    def headroom(self) -> int:
        """GPU bytes left at the peak (negative: over by that much)."""
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
            ulysses=self.setup.ulysses_size,
            dp=self.setup.dp_size,
            seq_len=self.setup.seq_len,
            seq_local=self.setup.seq_local,
            micro_batch_size=self.setup.micro_batch_size,
            offloads=self.setup.offloads,
            params_total=self.params_total,
            params_trainable=self.params_trainable,
            total=self.total,
            fits=self.fits,
            details=dict(self.details),
        )
        return out
