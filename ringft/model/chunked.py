"""Llama 4's chunked local attention and NoPE attention temperature on the zigzag ring.

Chunked layers (``config.layer_types[i] == "chunked_attention"``, Llama 4's RoPE layers) attend
causally within fixed chunks of ``config.attention_chunk_size`` tokens. transformers' mask puts a
query and a key in the same chunk when ``position // chunk_size`` agrees, on the position ids of a
packed row (``remap_positions_for_packed_sequence``), i.e. the chunk grid restarts at every
document's start. That is a block-diagonal mask, so it is one more set of packed documents: each
document ``[a, b)`` cut at ``a + chunk_size, a + 2 * chunk_size, ...`` (:func:`chunk_offsets`). The
decoder pre-hook hands the chunked layers this forward's :class:`~ringft.ops.documents.DocumentLayout`
of those pieces (``ring_chunks``), so every ring step whose blocks share no piece is skipped, as
for packed documents.

NoPE layers (``no_rope_layers[i] == 0``) with ``attn_temperature_tuning`` scale each query by
``1 + attn_scale * log1p(floor((position + 1) / floor_scale))``. transformers computes ``position``
as ``arange(seq_len)`` of the tensor it sees, which on a zigzag shard is the wrong token index:
:func:`prepare_chunked_attention` switches that off on the module and the ring applies the same
formula to the queries, from the global position ids (``ring_positions``, set by the pre-hook).
For one unpacked row this is transformers' own value; for packed rows it is each document's
(transformers' one-row value counts from the row's start instead).

Refused: chunked layers without a positive integer ``attention_chunk_size``, and chunked layers
under ``RingInference`` (its decoding keeps no chunk boundaries).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ringft.utils.values import as_integer, problems

if TYPE_CHECKING:  # no torch import at run time: ringft.model.families (read by the planner) imports this
    import torch

__all__ = [
    "CHUNKS",
    "POSITIONS",
    "attention_temperature",
    "chunk_offsets",
    "chunk_problem",
    "chunk_size",
    "prepare_chunked_attention",
    "release_chunked_attention",
    "ring_query_and_documents",
]

CHUNKS = "ring_chunks"  # decoder kwarg set by the pre-hook: the chunked layers' DocumentLayout
POSITIONS = "ring_positions"  # decoder kwarg set by the pre-hook: global position ids (temperature)
_TEMPERATURE = "_ringft_temperature"  # attention-module attribute: (attn_scale, floor_scale)
_CHUNKED = "_ringft_chunked"  # attention-module attribute: this layer attends within chunks


def chunk_size(config: Any) -> int | None:
    """``config.attention_chunk_size`` when some layer is a ``chunked_attention`` layer, else None."""
    if "chunked_attention" not in (getattr(config, "layer_types", None) or []):
        return None
    return getattr(config, "attention_chunk_size", None)


def chunk_problem(config: Any) -> str | None:
    """Why the ring cannot honour ``config``'s chunked layers (a one-line message), or None."""
    kinds = getattr(config, "layer_types", None) or []
    if "chunked_attention" not in kinds:
        return None
    size = getattr(config, "attention_chunk_size", None)
    if problems(lambda: as_integer("attention_chunk_size", size, 1)):
        return (
            f"config.layer_types has chunked_attention layers but attention_chunk_size={size!r}: it must "
            "be a positive integer (the chunk length in tokens)"
        )
    return None


def chunk_offsets(offsets: list[list[int]], chunk: int) -> list[list[int]]:
    """Per row, the global document ``offsets`` with every document ``[a, b)`` also cut at
    ``a + k * chunk`` (``0 < k * chunk < b - a``): the pieces a chunked layer attends within."""
    rows = []
    for row in offsets:
        cuts = [row[0]]
        for a, b in zip(row, row[1:]):
            cuts += list(range(a + chunk, b, chunk)) + [b]
        rows.append(cuts)
    return rows


def attention_temperature(
    query: torch.Tensor, positions: torch.Tensor | None, attn_scale: float, floor_scale: float
) -> torch.Tensor:
    """Llama 4's NoPE query scaling for ``query`` ``(B, S, H, D)`` at ``positions`` ``(B or 1, S)``
    (None: ``0..S-1``), in transformers' arithmetic (fp32 scales, product cast back to the dtype)."""
    import torch

    if positions is None:
        positions = torch.arange(query.shape[1], device=query.device)[None]
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return (query * scales[:, :, None, None]).to(query.dtype)


def prepare_chunked_attention(modules: list[torch.nn.Module], config: Any) -> None:
    """Mark the chunked layers among the attention ``modules`` and move the NoPE layers' attention
    temperature into the ring (see the module docstring). Idempotent."""
    kinds = getattr(config, "layer_types", None) or []
    for module in modules:
        idx = module.layer_idx
        module.__dict__[_CHUNKED] = idx < len(kinds) and kinds[idx] == "chunked_attention"
        params = module.__dict__.get(_TEMPERATURE)
        if params is None and getattr(module, "attn_temperature_tuning", False) and not module.use_rope:
            params = (module.attn_scale, module.floor_scale)
            module.attn_temperature_tuning = False
        if params is not None:
            module.__dict__[_TEMPERATURE] = params


def release_chunked_attention(modules: list[torch.nn.Module]) -> None:
    """Undo :func:`prepare_chunked_attention`."""
    for module in modules:
        module.__dict__.pop(_CHUNKED, None)
        if module.__dict__.pop(_TEMPERATURE, None) is not None:
            module.attn_temperature_tuning = True


def ring_query_and_documents(
    module: torch.nn.Module, query: torch.Tensor, kwargs: dict, documents: Any
) -> tuple:
    """``(query, document layout)`` for ``module``'s ring call: the query with the NoPE temperature
    applied (``query`` ``(B, S, H, D)``), and the chunks' layout on a chunked layer (else
    ``documents``)."""
    params = module.__dict__.get(_TEMPERATURE)
    if params is not None:
        query = attention_temperature(query, kwargs.get(POSITIONS), *params)
    if module.__dict__.get(_CHUNKED):
        documents = kwargs.get(CHUNKS)
    return query, documents
