"""What one forward of a model on the ring must get: the checks of the decoder pre-hook, one each,
and where the packed documents' boundaries come from.

The pre-hook (:func:`check_forward_inputs`) runs once per forward, on every CP rank together:
local checks first, then one small all_gather of each rank's verdict and facts
(:func:`ringft.ops.validate.exchange_facts`), so a bad input raises on every rank before any ring
traffic. The per-layer attention calls then skip that collective.

Document boundaries travel as data, per row, as global offsets ``[0, ..., S]`` (``S`` = the
padded global length):

- ``cu_seqlens``: what :class:`ringft.RingDataCollator` emits (a list of int lists, one per row);
- or transformers' varlen keys of one flattened row, ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32,
  equal) with ``max_length_q`` / ``max_length_k``, as ``DataCollatorWithFlattening(
  return_flash_attn_kwargs=True)`` and TRL's padding-free packing emit them (``seq_idx`` is dropped:
  the offsets say the same). They may end at the unpadded length; the padding up to ``S`` is then
  one more document.

Only when a caller gives neither are the offsets derived from the global position ids (a document
starts where the position is 0: transformers' padding-free convention), which takes one more
all_gather when some row is not plain ``0..S-1``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ringft.model.chunked import CHUNKS, POSITIONS, chunk_offsets, chunk_problem, chunk_size
from ringft.model.rope import rope_problem
from ringft.ops.documents import (
    DocumentLayout,
    check_cu_seqlens,
    cu_seqlens_from_position_ids,
    document_layout,
)
from ringft.ops.sharding import cp_position_ids, cp_unshard, local_length_problem, zigzag_padded_length
from ringft.ops.validate import DTYPE_CODES, checksum, exchange_facts, raise_if_facts_differ, raise_problems

__all__ = [
    "CHECKED",
    "DOCUMENTS",
    "OFFSETS",
    "VARLEN_KEYS",
    "check_forward_inputs",
    "mask_problems",
    "position_problems",
    "shape_problems",
    "take_document_offsets",
]

CHECKED = "ring_checked"  # decoder kwarg set by the pre-hook: this forward's inputs were validated
DOCUMENTS = "ring_documents"  # decoder kwarg set by the pre-hook: this forward's DocumentLayout
OFFSETS = "cu_seqlens"  # the batch key of ringft's per-row global document offsets
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
WHERE = "ring attention"


def mask_problems(mask: torch.Tensor | None) -> list[str]:
    """A padding mask would be dropped (no mask function is registered): refuse it. An all-ones
    2-D mask means "no padding" and is accepted."""
    if mask is None or (mask.dim() == 2 and bool(mask.all())):
        return []
    return [
        "zigzag ring attention does not support padding attention masks (the mask would be "
        "dropped): right-pad with RingDataCollator and drop attention_mask from the batch"
    ]


def position_problems(positions: torch.Tensor | None, cp_size: int, inference: bool) -> list[str]:
    """RoPE needs the global positions of the local tokens (the default arange is wrong on a ring)."""
    if positions is not None or (cp_size == 1 and not inference):
        return []
    return [
        "ring attention over a CP group needs the global position ids of the local tokens "
        "(RoPE): pass position_ids from RingDataCollator or cp_position_ids(...) (cp_position_ids(...) "
        "for the plain ring)"
    ]


def shape_problems(ids, positions, cp_size: int) -> tuple[int, int, list[str]]:
    """``(batch, seq_local, problems)`` of one forward's local ``input_ids`` (or embeddings) and
    ``position_ids``."""
    batch, seq_local = (ids.shape[0], ids.shape[1]) if ids is not None and ids.dim() >= 2 else (-1, -1)
    problems = []
    length = local_length_problem(seq_local, cp_size) if seq_local > 0 else None
    if length:
        problems.append(length)
    if positions is not None and not (
        positions.dim() == 2 and positions.shape[1] == seq_local and positions.shape[0] in (1, batch)
    ):
        problems.append(
            f"position_ids must be (batch, seq_local) = ({batch}, {seq_local}), got {tuple(positions.shape)}"
        )
    return batch, seq_local, problems


def _ints(value: Any) -> list[int]:
    return [int(x) for x in (value.flatten().tolist() if torch.is_tensor(value) else value)]


def _varlen_offsets(
    q: Any, k: Any, max_q: Any, max_k: Any, batch: int, seq_len: int, cp_size: int
) -> tuple[list[list[int]] | None, list[str]]:
    """transformers' one-row varlen offsets as ringft's per-row offsets, or the problems."""
    shapes = [tuple(x.shape) for x in (q, k) if torch.is_tensor(x)]
    if any(len(s) > 2 or (len(s) == 2 and s[0] != 1) for s in shapes):
        return None, [f"cu_seq_lens_q/k must be 1-D offsets of one flattened row, got shapes {shapes}"]
    cu_q = _ints(q if q is not None else k)
    cu_k = _ints(k if k is not None else q)
    if cu_q != cu_k:
        return None, [
            f"cu_seq_lens_q {cu_q[:6]} and cu_seq_lens_k {cu_k[:6]} differ: ring attention is "
            "self-attention over one packed sequence; pass the same offsets for both"
        ]
    if batch != 1:
        return None, [
            f"cu_seq_lens_q/k are the offsets of one flattened row, but the batch has {batch} rows: "
            "flatten the batch into one row (DataCollatorWithFlattening), or pass cu_seqlens per row"
        ]
    end = cu_q[-1] if cu_q else 0
    if len(cu_q) < 2 or cu_q[0] != 0 or any(b <= a for a, b in zip(cu_q, cu_q[1:])):
        return None, [f"cu_seq_lens_q must rise strictly from 0, got {cu_q[:6]} (len {len(cu_q)})"]
    if end != seq_len and zigzag_padded_length(end, cp_size) != seq_len:
        return None, [
            f"cu_seq_lens_q ends at {end} but the global sequence has {seq_len} tokens (seq_local "
            f"{seq_len // cp_size} x cp_size {cp_size}): the offsets must cover the sequence, which may "
            "only add the padding to the next multiple of 2 * cp_size"
        ]
    longest = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    lengths = {int(x) for x in (max_q, max_k) if x is not None}
    if len(lengths) > 1 or (lengths and lengths.pop() < longest):
        return None, [
            f"max_length_q={max_q} / max_length_k={max_k} do not match cu_seq_lens_q, whose longest "
            f"document has {longest} tokens: pass the collator's values unchanged"
        ]
    return [cu_q if end == seq_len else [*cu_q, seq_len]], []


def take_document_offsets(
    kwargs: dict[str, Any], batch: int, seq_len: int, cp_size: int
) -> tuple[list[list[int]] | None, list[str]]:
    """Pop the explicit document offsets from the decoder's ``kwargs`` (:data:`OFFSETS` or the
    :data:`VARLEN_KEYS`; none of them reaches the attention call): ``(per-row global offsets, or
    None when the caller gave none; problems)``."""
    ours = kwargs.pop(OFFSETS, None)
    q, k, max_q, max_k, _seq_idx = (kwargs.pop(key, None) for key in VARLEN_KEYS)
    rows, problems = None, []
    if ours is not None:
        rows = [_ints(row) for row in ours]
        problems += check_cu_seqlens(rows, seq_len, batch)
    if q is not None or k is not None:
        varlen, more = _varlen_offsets(q, k, max_q, max_k, batch, seq_len, cp_size)
        problems += more
        if rows is not None and varlen is not None and varlen != rows:
            problems.append(f"{OFFSETS} and cu_seq_lens_q/k disagree: pass the document offsets once")
        rows = rows if rows is not None else varlen
    elif max_q is not None or max_k is not None:
        problems.append(
            "max_length_q / max_length_k came without cu_seq_lens_q / cu_seq_lens_k: pass those too"
        )
    return rows, problems


def _plain_positions(positions: torch.Tensor, spec: Any) -> bool:
    """Whether ``positions`` ``(batch or 1, seq_local)`` are this rank's plain positions ``0..S-1``
    (zigzag; Ulysses x ring: :func:`cp_position_ids`), one document per row: nothing to mask
    beyond causality."""
    seq = positions.shape[1] * spec.size
    expected = cp_position_ids(seq, spec.rank, spec.size, spec.ulysses_size, device=positions.device)
    return bool((positions == expected).all())


def _offsets_from_positions(positions: torch.Tensor | None, spec: Any) -> list[list[int]]:
    """Global document offsets from every rank's ``positions`` (one all_gather over the CP group,
    unsharded by the CP layout, and a host copy)."""
    if spec.size > 1:
        if positions is None:  # another rank's positions are packed; ours are missing
            raise ValueError("ring attention: position_ids are needed on every CP rank")
        pieces = [torch.empty_like(positions.contiguous()) for _ in range(spec.size)]
        dist.all_gather(pieces, positions.contiguous(), group=spec.group)
        positions = cp_unshard(pieces, spec.ulysses_size)
    return cu_seqlens_from_position_ids(positions)


def _layout(offsets: list[list[int]], seq_len: int, batch: int, spec: Any) -> DocumentLayout | None:
    """This rank's document layout (for its *ring* rank and the ring's size: the ring masks the
    documents), or None when every row is one document (the unmasked schedule)."""
    if all(len(row) == 2 for row in offsets):
        return None
    layout = document_layout(offsets, seq_len, spec.ring_rank, spec.ring_size, batch=batch)
    return None if layout.single else layout


def check_forward_inputs(spec: Any, config, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """The decoder pre-hook's work on ``kwargs`` (modified in place): refuse what the ring cannot
    run exactly, on every rank together; drop an all-ones mask, default ``use_cache`` to False, and
    hand the attention calls this forward's :class:`DocumentLayout` and the mark that it was checked
    (``spec``: the model's :class:`ringft.model.patch.RingSpec`)."""
    cache = kwargs.get("ring_cache")
    ids = kwargs.get("input_ids", args[0] if args else None)
    ids = kwargs.get("inputs_embeds") if ids is None else ids
    positions = kwargs.get("position_ids")
    problems = mask_problems(kwargs.get("attention_mask"))
    kwargs["attention_mask"] = None
    problems += position_problems(positions, spec.size, cache is not None)
    problems += [p for p in [rope_problem(config, spec.size)] if p]
    if kwargs.get("use_cache") is None:
        kwargs["use_cache"] = False
    chunk = chunk_size(config)  # Llama 4's chunked layers
    problems += [p for p in [chunk_problem(config)] if p]
    if chunk is not None and cache is not None:
        problems.append(
            f"RingInference cannot decode chunked attention layers (attention_chunk_size={chunk}): generate "
            "with model.generate in one process"
        )
    if getattr(config, "attn_temperature_tuning", False):  # Llama 4's NoPE layers: from global positions
        kwargs[POSITIONS] = positions
    batch, seq_local, shapes = shape_problems(ids, positions, spec.size)
    offsets, documents = take_document_offsets(kwargs, batch, seq_local * spec.size, spec.size)
    if cache is not None and cache.is_prefilled:  # replicated one-token decode steps (RingInference)
        raise_problems(WHERE, problems, [bool(problems)], spec.rank)
        return
    problems += shapes or documents  # offsets are only read against a usable shape
    # Without explicit offsets: whether this rank's rows are single documents (one host sync).
    plain = offsets is not None or bool(problems) or positions is None or _plain_positions(positions, spec)
    param = next(module.parameters(), None)
    facts = (batch, seq_local, DTYPE_CODES.get(param.dtype, 0) if param is not None else 0, checksum(offsets))
    device = ids.device if ids is not None else torch.device("cpu")  # inputs sit where compute does
    rows = exchange_facts((int(bool(problems)),), facts, (int(plain),), group=spec.group, device=device)
    raise_problems(WHERE, problems, [bool(bad) for (bad,), _, _ in rows], spec.rank)
    raise_if_facts_differ(
        WHERE,
        [theirs for _, theirs, _ in rows],
        "(batch, seq_local, param dtype, document offsets checksum)",
        "all CP ranks must pass the same batch and seq_local (S / cp_size), the same document offsets "
        "and hold the same model dtype. Shard every sequence with RingDataCollator",
    )
    if offsets is None and not all(flag for _, _, (flag,) in rows):  # packed: one more all_gather
        offsets = _offsets_from_positions(positions, spec)
    if offsets is not None:
        kwargs[DOCUMENTS] = _layout(offsets, seq_local * spec.size, batch, spec)
    if chunk is not None:
        whole = offsets if offsets is not None else [[0, seq_local * spec.size]] * batch
        kwargs[CHUNKS] = _layout(chunk_offsets(whole, chunk), seq_local * spec.size, batch, spec)
    kwargs[CHECKED] = True
