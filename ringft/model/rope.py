"""RoPE types as transformers reads them from a config, and the one rule about them on the ring.

transformers (``modeling_rope_utils.dynamic_rope_update``) recomputes the RoPE frequencies of a
"dynamic" type (any type whose name contains ``dynamic``) and of ``longrope`` from the largest
position the current forward holds. Under zigzag CP that position differs per rank, so every rank
would rotate with other frequencies: such a type is exact only with ``cp_size == 1``
(:func:`rope_problem`, used by :func:`ringft.apply_ring_attention`, the recipe and the training
build alike). Every other type (default, linear, yarn, llama3, ...) is a fixed function of the
position and exact on the ring.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "PRETRAINED_LENGTH_ROPE",
    "has_rope_scaling",
    "position_dependent_rope",
    "rope_problem",
    "rope_types",
]

# RoPE types whose frequencies are computed from the pretraining context length
# (``original_max_position_embeddings``): a raised max_position_embeddings must not replace it.
PRETRAINED_LENGTH_ROPE = ("yarn", "llama3", "longrope")


def _type_of(entry: Mapping[str, Any]) -> str:
    return str(entry.get("rope_type", entry.get("type", "default")))


def rope_types(config_or_parameters: Any) -> list[str]:
    """The RoPE types of a config (its ``rope_parameters``, or the legacy ``rope_scaling``) or of such
    a mapping itself: one flat ``{"rope_type": ...}`` (legacy key ``type``), or one per layer type
    (``{"full_attention": {...}, "sliding_attention": {...}}``). ``[]`` when there are none."""
    params = config_or_parameters
    if not isinstance(params, Mapping):
        params = getattr(params, "rope_parameters", None) or getattr(params, "rope_scaling", None) or {}
    if not isinstance(params, Mapping) or not params:
        return []
    if "rope_type" in params or "type" in params:
        return [_type_of(params)]
    return [_type_of(entry) for entry in params.values() if isinstance(entry, Mapping)]


def position_dependent_rope(config_or_parameters: Any) -> str | None:
    """The first RoPE type of ``config_or_parameters`` whose frequencies follow the largest position
    seen (transformers' rule: ``"dynamic" in type`` or ``type == "longrope"``), else None."""
    for kind in rope_types(config_or_parameters):
        if "dynamic" in kind or kind == "longrope":
            return kind
    return None


def rope_problem(
    config_or_parameters: Any, cp_size: int, subject: str = "rope_type", cp_name: str = "cp_size"
) -> str | None:
    """None when the RoPE of ``config_or_parameters`` is exact on ``cp_size`` zigzag ranks; else one
    line naming ``subject`` (what holds the type, e.g. ``"model.rope_scaling rope_type"``), the CP
    setting ``cp_name`` and the fix."""
    kind = position_dependent_rope(config_or_parameters)
    if kind is None or cp_size == 1:
        return None
    return (
        f"{subject} {kind!r} is not exact with {cp_name}={cp_size}: rope_type={kind!r} recomputes RoPE "
        "frequencies from the largest position each rank holds, which differs between zigzag ranks; use "
        "rope_type 'default', 'linear', 'yarn' or 'llama3' (a fixed scaling) or a rope_theta raise, or "
        "cp_size 1"
    )


def has_rope_scaling(config_or_parameters: Any) -> bool:
    """Whether any RoPE type of the config is a scaling (other than ``"default"``)."""
    return any(kind != "default" for kind in rope_types(config_or_parameters))
