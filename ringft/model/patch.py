"""transformers integration: run LLaMA / Mistral attention as zigzag ring attention.

transformers (>= 5) routes the attention of LLaMA-style models through its ``AttentionInterface``
registry: the attention module calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` with
q ``(batch, heads_q, seq_local, head_dim)`` and k/v ``(batch, heads_kv, seq_local, head_dim)``
(RoPE applied, GQA not expanded). :func:`apply_ring_attention` registers the ring under the plain
name ``zigzag_ring`` (names containing "flash", "sdpa", "flex" or "/" trigger other code paths in
transformers) and switches the model to it: this is ringft's "monkey-patch" of the
flash-attention forward, done through the route transformers offers instead of replacing classes.

No mask function is registered, so transformers hands the attention ``attention_mask=None``. A
forward pre-hook on the decoder therefore checks each forward's inputs once, on every CP rank
together (one small all_gather): it refuses padding masks (they would otherwise be dropped),
insists on the global position ids that RoPE needs, refuses RoPE types that are not exact under
zigzag sharding, and checks that every rank got the same shapes. The per-layer attention calls
then skip that collective. Keyword arguments of the decoder reach the attention function, which is
how :mod:`ringft.model.inference` hands it its KV cache (``ring_cache=``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ringft.model.unwrap import decoder, pretrained_model
from ringft.ops import ShardedKVCache, zigzag_ring_attention
from ringft.ops.comm import group_rank_and_size
from ringft.ops.documents import DocumentPlan, cu_seqlens_from_position_ids, document_plan
from ringft.ops.sharding import zigzag_position_ids, zigzag_unshard
from ringft.ops.validate import DTYPE_CODES, raise_on_every_rank

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
_CHECKED = "ring_checked"  # decoder kwarg set by the pre-hook: this forward's inputs were validated
_DOCUMENTS = "ring_documents"  # decoder kwarg set by the pre-hook: this forward's DocumentPlan


@dataclass(frozen=True)
class RingSpec:
    """How a model's attention runs on the ring: the CP group (``size`` ranks, this one ``rank``)
    and the block backend; set by :func:`apply_ring_attention`, read with :func:`ring_spec`."""

    group: Any
    backend: str
    size: int
    rank: int
    previous_implementation: str | None


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
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, S, H, D)
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
    out = zigzag_ring_attention(
        q,
        k,
        v,
        causal=getattr(module, "is_causal", True),
        softmax_scale=scaling,
        group=spec.group,
        backend=spec.backend,
        validate=not kwargs.get(_CHECKED, False),
        cu_seqlens=kwargs.get(_DOCUMENTS),
        sliding_window=sliding_window,  # transformers passes each layer's own (None: full attention)
    )
    if ring_cache is not None:
        ring_cache.store_prefill(module.layer_idx, k, v)
    return out.contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ring_attention_forward)


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from ringft.model.families import attention_modules  # found by what they pass, not by name

    return attention_modules(model)


def _inexact_rope(config) -> str | None:
    """The RoPE type of ``config`` if its frequencies depend on the largest position seen, which
    differs per zigzag rank (transformers' ``dynamic_rope_update``: dynamic NTK, longrope)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    dicts = [params] if ("rope_type" in params or "type" in params) else list(params.values())
    for entry in dicts:
        if isinstance(entry, dict):
            kind = str(entry.get("rope_type", entry.get("type", "default")))
            if "dynamic" in kind or kind == "longrope":
                return kind
    return None


def _rope_problem(config, size: int) -> str | None:
    kind = _inexact_rope(config)
    if kind is None or size == 1:
        return None
    return (
        f"rope_type={kind!r} recomputes RoPE frequencies from the largest position each rank holds, "
        f"which differs between zigzag ranks (cp_size={size}), so the result would not be exact: use "
        "rope_type 'default', 'linear', 'yarn' or 'llama3' (a fixed scaling), or cp_size 1"
    )


def _plain_positions(positions: torch.Tensor, spec: RingSpec) -> bool:
    """Whether ``positions`` ``(batch or 1, seq_local)`` are this rank's plain zigzag positions
    ``0..S-1`` (one document per row), i.e. nothing to mask beyond causality."""
    seq = positions.shape[1] * spec.size
    expected = zigzag_position_ids(seq, spec.rank, spec.size, device=positions.device)
    return bool((positions == expected).all())


def _document_plan(positions: torch.Tensor | None, batch: int, spec: RingSpec) -> DocumentPlan:
    """This rank's :class:`DocumentPlan` from every rank's ``positions`` (documents start where the
    global position id is 0, transformers' padding-free convention): one all_gather of the
    ``(batch, seq_local)`` position ids and a host copy, once per forward."""
    if spec.size > 1:
        if positions is None:  # another rank's positions are packed; ours are missing
            raise ValueError("ring attention: position_ids are needed on every CP rank")
        pieces = [torch.empty_like(positions.contiguous()) for _ in range(spec.size)]
        dist.all_gather(pieces, positions.contiguous(), group=spec.group)
        positions = zigzag_unshard(pieces)
    cu_seqlens = cu_seqlens_from_position_ids(positions)
    return document_plan(cu_seqlens, positions.shape[1], spec.rank, spec.size, batch=batch)


def _shape_problems(ids, positions) -> tuple[int, int, list[str]]:
    """``(batch, seq_local, problems)`` of one forward's local ``input_ids`` and ``position_ids``."""
    batch, seq_local = (ids.shape[0], ids.shape[1]) if ids is not None and ids.dim() >= 2 else (-1, -1)
    problems = []
    if seq_local > 0 and seq_local % 2:
        problems.append(
            f"seq_local ({seq_local}) must be even (two zigzag chunks per rank): pad the global "
            "sequence to a multiple of 2 * cp_size (RingDataCollator does this)"
        )
    if positions is not None and not (
        positions.dim() == 2 and positions.shape[1] == seq_local and positions.shape[0] in (1, batch)
    ):
        problems.append(
            f"position_ids must be (batch, seq_local) = ({batch}, {seq_local}), got {tuple(positions.shape)}"
        )
    return batch, seq_local, problems


def _input_check_hook(spec: RingSpec, config):
    def hook(module, args, kwargs):
        cache: ShardedKVCache | None = kwargs.get("ring_cache")
        ids = kwargs.get("input_ids", args[0] if args else None)
        ids = kwargs.get("inputs_embeds") if ids is None else ids
        positions = kwargs.get("position_ids")
        problems = []
        mask = kwargs.get("attention_mask")
        if mask is not None and not (mask.dim() == 2 and bool(mask.all())):
            problems.append(
                "zigzag ring attention does not support padding attention masks (the mask would be "
                "dropped): right-pad with RingDataCollator and drop attention_mask from the batch"
            )
        kwargs["attention_mask"] = None  # an all-ones 2-D mask means "no padding"
        if (spec.size > 1 or cache is not None) and positions is None:
            problems.append(
                "ring attention over a CP group needs the global position ids of the local tokens "
                "(RoPE): pass position_ids from RingDataCollator or zigzag_position_ids(...)"
            )
        problems += [p for p in [_rope_problem(config, spec.size)] if p]
        if kwargs.get("use_cache") is None:
            kwargs["use_cache"] = False
        if cache is not None and cache.is_prefilled:  # replicated one-token decode steps (RingInference)
            if problems:
                raise ValueError("; ".join(problems))
            return args, kwargs
        batch, seq_local, shape_problems = _shape_problems(ids, positions)
        problems += shape_problems
        # Whether this rank's rows are single documents (one host sync); exchanged with the checks.
        plain = bool(problems) or positions is None or _plain_positions(positions, spec)
        param = next(module.parameters(), None)
        extras = raise_on_every_rank(
            "ring attention",
            problems,
            (batch, seq_local, DTYPE_CODES.get(param.dtype, 0) if param is not None else 0),
            "(batch, seq_local, param dtype)",
            "all CP ranks must pass the same batch and seq_local (S / cp_size) and hold the same "
            "model dtype. Shard every sequence with RingDataCollator",
            group=spec.group,
            rank=spec.rank,
            size=spec.size,
            device=ids.device if ids is not None else torch.device("cpu"),  # inputs sit where compute does
            extra=(int(plain),),
        )
        if not all(flag for (flag,) in extras):  # packed documents: one more all_gather
            kwargs[_DOCUMENTS] = _document_plan(positions, batch, spec)
        kwargs[_CHECKED] = True
        return args, kwargs

    return hook


def apply_ring_attention(
    model: torch.nn.Module,
    cp_group: dist.ProcessGroup | None = None,
    backend: str = "auto",
    *,
    allow_untested: bool = False,
) -> torch.nn.Module:
    """Switch a model of a supported family (:data:`ringft.model.families.FAMILIES`: LLaMA, Mistral,
    Qwen2/2.5, Qwen3, Gemma 3 text, Phi-3, OLMo 2) to zigzag ring attention over ``cp_group``.

    Idempotent (a second call updates the group/backend); undo with :func:`remove_ring_attention`.
    Works on a peft-wrapped model too. Returns ``model``. Inputs are then the CP rank's shard:
    ``input_ids`` / ``position_ids`` ``(batch, S / cp_size)`` (see ``RingDataCollator``).
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
    rank, size = group_rank_and_size(cp_group)
    rope = _rope_problem(config, size)
    if rope:
        raise ValueError(rope)
    _register()
    old = ring_spec(model)
    hook = getattr(pretrained, "_ringft_hook", None)
    if hook is not None:
        hook.remove()
    previous = old.previous_implementation if old else config._attn_implementation
    spec = RingSpec(group=cp_group, backend=backend, size=size, rank=rank, previous_implementation=previous)
    pretrained._ringft_hook = decoder(model).register_forward_pre_hook(
        _input_check_hook(spec, config), with_kwargs=True
    )
    pretrained._ringft_ring = spec
    for module in attn_modules:
        module._ringft_ring = spec
    pretrained.set_attn_implementation(ATTENTION_NAME)
    return model


def remove_ring_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`apply_ring_attention`: restore the previous attention implementation."""
    pretrained = pretrained_model(model)
    spec = ring_spec(model)
    if spec is None:
        return model
    pretrained._ringft_hook.remove()
    for module in _attention_modules(model):
        module.__dict__.pop("_ringft_ring", None)
    del pretrained._ringft_ring
    del pretrained._ringft_hook
    pretrained.set_attn_implementation(spec.previous_implementation or "sdpa")
    return model


@contextlib.contextmanager
def ring_attention(model: torch.nn.Module, cp_group=None, backend: str = "auto"):
    """Context manager form: ``with ring_attention(model, group): ...``."""
    apply_ring_attention(model, cp_group, backend)
    try:
        yield model
    finally:
        remove_ring_attention(model)
