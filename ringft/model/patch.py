"""transformers integration: run a decoder model's attention as zigzag ring attention.

transformers (>= 5) routes the attention of its decoder models through its ``AttentionInterface``
registry: the attention module calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` with
q ``(batch, heads_q, seq_local, head_dim)`` and k/v ``(batch, heads_kv, seq_local, head_dim)``
(RoPE applied, GQA not expanded). :func:`apply_ring_attention` registers the ring under the plain
name ``zigzag_ring`` (names containing "flash", "sdpa", "flex" or "/" trigger other code paths in
transformers) and switches the model to it: this is ringft's "monkey-patch" of the
flash-attention forward, done through the route transformers offers instead of replacing classes.

No mask function is registered, so transformers hands the attention ``attention_mask=None``. A
forward pre-hook on the decoder therefore checks each forward's inputs once, on every CP rank
together (one small all_gather; :mod:`ringft.model.inputs`): it refuses padding masks (they would
otherwise be dropped), insists on the global position ids that RoPE needs, refuses RoPE types that
are not exact under zigzag sharding, checks that every rank got the same shapes and document
offsets, and turns the offsets (the batch's ``cu_seqlens``, or transformers' ``cu_seq_lens_q/k``)
into this rank's document layout. The per-layer attention calls then skip that collective. Keyword
arguments of the decoder reach the attention function, which is how :mod:`ringft.model.inference`
hands it its KV cache (``ring_cache=``). With ``attention_checkpoint`` ``save`` / ``offload`` the
pre-hook also makes the checkpointed layers keep their ring outputs for the recompute
(:mod:`ringft.model.attention_checkpoint`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from ringft.model.attention_checkpoint import (
    ATTENTION_CHECKPOINT,
    prepare_attention_checkpoint,
    unwrap_checkpointing,
)
from ringft.model.chunked import (
    prepare_chunked_attention,
    release_chunked_attention,
    ring_query_and_documents,
)
from ringft.model.gated_deltanet import (
    linear_attention_problem,
    prepare_linear_attention,
    release_linear_attention,
)
from ringft.model.inputs import CHECKED, DOCUMENTS, check_forward_inputs
from ringft.model.rope import rope_problem
from ringft.model.unwrap import decoder, present_no_split_modules, pretrained_model
from ringft.ops import ShardedKVCache, ulysses_ring_attention, zigzag_ring_attention
from ringft.ops.comm import group_rank_and_size
from ringft.ops.parallel import ParallelLayout, resolve_cp_groups
from ringft.ops.saved_attention import active_store
from ringft.ops.ulysses import heads_problem
from ringft.utils.values import as_choice, as_integer

__all__ = [
    "ATTENTION_NAME",
    "RingSpec",
    "apply_ring_attention",
    "remove_ring_attention",
    "ring_attention",
    "ring_attention_forward",
    "ring_spec",
]

ATTENTION_NAME = "zigzag_ring"
MIN_TRANSFORMERS = (5, 0)


@dataclass(frozen=True)
class RingSpec:
    """How a model's attention runs on the ring: the CP group (``size`` ranks, this one ``rank``)
    and the block backend (its calls in tiles of ``attention_tile_tokens`` queries and keys, None:
    untiled); set by :func:`apply_ring_attention`, read with :func:`ring_spec`.

    2D context parallelism: ``ulysses_size > 1`` splits the CP group into Ulysses x ring
    (``layout``: its :class:`~ringft.ops.parallel.ParallelLayout`; None for the plain ring), and
    the tokens follow :mod:`ringft.ops.sharding`'s layout. ``attention_checkpoint``: ``recompute``,
    ``save`` or ``offload`` (:mod:`ringft.model.attention_checkpoint`)."""

    group: Any
    backend: str
    size: int
    rank: int
    previous_implementation: str | None
    ulysses_size: int = 1
    layout: ParallelLayout | None = None
    attention_tile_tokens: int | None = None
    attention_checkpoint: str = "recompute"

    @property
    def ring_rank(self) -> int:
        """This rank's position in its ring group (the CP rank on the plain ring)."""
        return self.rank if self.layout is None else self.layout.ring_rank

    @property
    def ring_size(self) -> int:
        """Ranks per ring group (the CP size on the plain ring)."""
        return self.size if self.layout is None else self.layout.ring_size


def ring_spec(model: torch.nn.Module) -> RingSpec | None:
    """The :class:`RingSpec` of a model switched to the ring (peft-wrapped or not), else None."""
    return getattr(pretrained_model(model), "_ringft_ring", None)


def _transformers_version() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def ring_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    ring_cache: ShardedKVCache | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function registered as ``zigzag_ring`` in transformers' ``AttentionInterface``.

    Takes q ``(B, Hq, S_local, D)``, k/v ``(B, Hkv, S_local, D)``; returns
    ``((B, S_local, Hq, D) contiguous, None)``. transformers' ``scaling`` is the softmax scale.
    With ``ring_cache`` (inference) the first call of a layer is the ring prefill, which keeps the
    layer's local K/V in the cache; later calls decode one token against the sharded cache.
    ``sliding_window`` (the layer's, as transformers passes it) is honoured exactly, in the ring
    and in decoding.
    """
    spec: RingSpec | None = getattr(module, "_ringft_ring", None)
    if spec is None:
        raise RuntimeError(
            f"{type(module).__name__} uses attn_implementation={ATTENTION_NAME!r} but was not prepared "
            "by ringft.apply_ring_attention(model, cp_group): call it on the model first"
        )
    if attention_mask is not None:
        raise ValueError(
            "zigzag ring attention got an attention mask; padding masks are not supported. Right-pad "
            "with RingDataCollator (pads are excluded from the loss by ignore_index) instead of masking"
        )
    from ringft.model.families import call_problem  # (imported here: patch.py's imports stay as they are)

    unsupported = call_problem(kwargs)
    if unsupported:
        raise ValueError(unsupported)
    if dropout:
        raise ValueError(
            f"attention dropout ({dropout}) is not supported by ring attention: set "
            "config.attention_dropout = 0.0"
        )
    sinks = kwargs.get("s_aux")  # gpt-oss: merged after the ring (ringft.ops.sinks)
    if sinks is not None and (ring_cache is not None or spec.layout is not None):
        raise ValueError(
            "attention sinks (s_aux) run on the plain ring only: RingInference and ulysses_size > 1 "
            "do not compute them (use ulysses_size 1 and model.generate in one process)"
        )
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, S, H, D)
    q, documents = ring_query_and_documents(module, q, kwargs, kwargs.get(DOCUMENTS))  # Llama 4
    if ring_cache is not None and ring_cache.is_filled(module.layer_idx):
        out = ring_cache.decode_attention(
            module.layer_idx,
            q,
            k,
            v,
            softmax_scale=scaling,
            group=spec.group,
            backend=spec.backend,
            sliding_window=sliding_window,
        )
        return out.contiguous(), None
    out = _attend(
        spec,
        q,
        k,
        v,
        causal=getattr(module, "is_causal", True),
        softmax_scale=scaling,
        backend=spec.backend,
        validate=not kwargs.get(CHECKED, False),
        cu_seqlens=documents,
        sliding_window=sliding_window,  # transformers passes each layer's own (None: full attention)
        attention_tile_tokens=spec.attention_tile_tokens,
        store=None if spec.attention_checkpoint == "recompute" else active_store(),
        **({} if sinks is None else {"sinks": sinks}),
    )
    if ring_cache is not None:
        ring_cache.store_prefill(module.layer_idx, k, v)
    return out.contiguous(), None


def _attend(
    spec: RingSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any
) -> torch.Tensor:
    """The zigzag ring over the CP group, or Ulysses x ring over ``spec.layout``'s groups."""
    if spec.layout is None:
        return zigzag_ring_attention(q, k, v, group=spec.group, **options)
    return ulysses_ring_attention(q, k, v, groups=spec.layout, **options)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ring_attention_forward)


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from ringft.model.families import attention_modules  # found by what they pass, not by name

    return attention_modules(model)


def _input_check_hook(spec: RingSpec, config):
    def hook(module, args, kwargs):
        prepare_attention_checkpoint(module, spec.attention_checkpoint)
        check_forward_inputs(spec, config, module, args, kwargs)
        return args, kwargs

    return hook


def apply_ring_attention(
    model: torch.nn.Module,
    cp_group: Any = None,
    backend: str = "auto",
    *,
    ulysses_size: int | None = None,
    allow_untested: bool = False,
    attention_tile_tokens: int | None = None,
    attention_checkpoint: str = "recompute",
) -> torch.nn.Module:
    """Switch a model of a supported family (:data:`ringft.model.families.FAMILIES`) to zigzag ring
    attention over ``cp_group``.

    ``cp_group``: the CP process group (``None``: the default group), or, for 2D context parallelism
    (Ulysses x ring), the :class:`~ringft.ops.parallel.ParallelLayout` of :func:`ringft.ops.build_layout`.
    ``ulysses_size`` (default 1: the plain ring, bit for bit) splits a CP group that spans every process
    into Ulysses x ring itself; it must divide the CP size and the query heads (refused naming the sizes
    that work). ``attention_checkpoint``: under gradient checkpointing, ``"recompute"`` (default) runs
    each layer's ring forward again in the backward; ``"save"`` keeps each layer's attention output and
    log-sum-exp from the forward so the recompute skips the ring forward (same gradients, bit for bit;
    ``heads_q * (head_dim * itemsize + 4)`` more bytes per token and layer until the layer's backward);
    ``"offload"`` keeps them in host memory (pinned on CUDA). ``save`` / ``offload`` need non-reentrant
    gradient checkpointing (refused at the first training forward without it). Idempotent (a second call
    updates the groups/backend); undo with :func:`remove_ring_attention`. Works on a peft-wrapped model
    too. Returns ``model``. Inputs are then the CP rank's shard: ``input_ids`` / ``position_ids``
    ``(batch, S / cp_size)`` (``RingDataCollator(..., ulysses_size=)``). ``attention_tile_tokens`` (an int
    >= 1; None: untiled) runs every attention kernel call over tiles of at most that many queries and
    keys, merged exactly by log-sum-exp (:mod:`ringft.ops.tiles`), so the kernels' transient memory
    follows the tile instead of the local sequence.
    """
    if _transformers_version() < MIN_TRANSFORMERS:
        import transformers

        raise RuntimeError(
            f"ringft needs transformers >= 5.0 (AttentionInterface routing), found "
            f"{transformers.__version__}: pip install -U 'transformers>=5,<6'"
        )
    pretrained = pretrained_model(model)
    config = getattr(pretrained, "config", None)
    attn_modules = _attention_modules(model)
    from ringft.model.families import SUPPORTED_MODEL_TYPES, check_model

    if config is None:
        raise ValueError(
            f"{type(model).__name__} is not a transformers model (no config); supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (their *ForCausalLM and base models)"
        )
    check_model(config, attn_modules, allow_untested)
    as_integer("attention_tile_tokens", attention_tile_tokens, 1, optional=True)
    as_choice("attention_checkpoint", attention_checkpoint, ATTENTION_CHECKPOINT)
    group, hybrid = resolve_cp_groups(cp_group, ulysses_size)  # (may build groups: every rank calls it)
    rank, size = group_rank_and_size(group)
    uly = 1 if hybrid is None else hybrid.group_sizes()[0]
    heads = heads_problem(config.num_attention_heads, uly, size) if uly > 1 else None
    if heads:
        raise ValueError(heads)
    rope = rope_problem(config, size)
    if rope:
        raise ValueError(rope)
    linear = linear_attention_problem(model, config, uly)  # Gated DeltaNet hybrids
    if linear:
        raise ValueError(linear)
    _register()
    old = ring_spec(model)
    hook = getattr(pretrained, "_ringft_hook", None)
    if hook is not None:
        hook.remove()
    previous = old.previous_implementation if old else config._attn_implementation
    spec = RingSpec(
        group, backend, size, rank, previous, ulysses_size=uly, layout=hybrid,
        attention_tile_tokens=attention_tile_tokens, attention_checkpoint=attention_checkpoint,
    )  # fmt: skip
    unwrap_checkpointing(decoder(model))  # (the pre-hook wraps again for save / offload)
    pretrained._ringft_hook = decoder(model).register_forward_pre_hook(
        _input_check_hook(spec, config), with_kwargs=True
    )
    pretrained._ringft_ring = spec
    for module in attn_modules:
        module._ringft_ring = spec
    prepare_linear_attention(model, spec)
    prepare_chunked_attention(attn_modules, config)

    present_no_split_modules(model)  # accelerate's FSDP wraps these when the launch config names none
    pretrained.set_attn_implementation(ATTENTION_NAME)
    return model


def remove_ring_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`apply_ring_attention`: restore the previous attention implementation."""
    pretrained = pretrained_model(model)
    spec = ring_spec(model)
    if spec is None:
        return model
    pretrained._ringft_hook.remove()
    unwrap_checkpointing(decoder(model))
    for module in _attention_modules(model):
        module.__dict__.pop("_ringft_ring", None)
    release_linear_attention(model)
    release_chunked_attention(_attention_modules(model))
    del pretrained._ringft_ring
    del pretrained._ringft_hook
    pretrained.set_attn_implementation(spec.previous_implementation or "sdpa")
    return model


@contextlib.contextmanager
def ring_attention(
    model: torch.nn.Module,
    cp_group=None,
    backend: str = "auto",
    *,
    ulysses_size=None,
    attention_checkpoint: str = "recompute",
):
    """Context manager form: ``with ring_attention(model, group): ...``."""
    apply_ring_attention(
        model, cp_group, backend, ulysses_size=ulysses_size, attention_checkpoint=attention_checkpoint
    )
    try:
        yield model
    finally:
        remove_ring_attention(model)
