"""Document boundaries travel as data: transformers' own varlen keys (``DataCollatorWithFlattening``'s
``cu_seq_lens_q/k``, ``max_length_q/k``, ``seq_idx``) and the collator's ``cu_seqlens`` reach the ring
without an all_gather of the position ids; bad offsets raise on every rank.

CP 2 and CP 3 run in one spawn of 3 processes (CP 2 on a subgroup). Oracle: the unmodified
transformers model, eager, in one process, on the flattened row with no
attention mask and no cache: transformers then masks the packed documents itself (it finds them in
the restarting position ids). Tolerances: those of ``test_documents_hf`` (same model, a 46-token row
padded to its 48-token sequence: eps32 times the longest chain of fp32 sums behind a logit).
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from ringft import RingDataCollator, apply_ring_attention, cp_gather, cp_shard
from ringft.model.inputs import VARLEN_KEYS, take_document_offsets
from ringft.ops.sharding import zigzag_padded_length
from ringft.ops.validate import PeerFailed, run_together
from ringft.utils.spawn import run_distributed
from tests.tiny_models import VOCAB, fp32_bounds, tiny_model

LOGITS_RTOL, LOSS_RTOL, GRAD_RTOL = fp32_bounds(48)  # packed rows of 48 tokens

LENGTHS = (19, 13, 9, 5)  # 46 tokens: padded to 48 for CP 2 and 3; boundaries across chunk edges


def flattened(lengths=LENGTHS, seed: int = 0) -> dict:
    """transformers' DataCollatorWithFlattening output for documents of ``lengths`` (one SFT prompt)."""
    from transformers import DataCollatorWithFlattening

    gen = torch.Generator().manual_seed(seed)
    features = []
    for i, n in enumerate(lengths):
        ids = torch.randint(1, VOCAB, (n,), generator=gen).tolist()
        labels = [-100] * (n // 2) + ids[n // 2 :] if i == 1 else list(ids)
        features.append({"input_ids": ids, "labels": labels})
    return DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(features)


def ring_batch(flat: dict, rank: int, world: int) -> dict:
    """``flat`` padded to a multiple of 2 * world (the padding: one more document without targets),
    labels pre-shifted on the whole row, then zigzag-sharded; the varlen keys as they came."""
    length = flat["input_ids"].shape[1]
    pad = zigzag_padded_length(length, world) - length
    shift = torch.cat([flat["labels"][:, 1:], torch.full((1, 1 + pad), -100)], dim=1)
    full = {
        "input_ids": torch.cat([flat["input_ids"], torch.zeros(1, pad, dtype=torch.long)], dim=1),
        "position_ids": torch.cat([flat["position_ids"], torch.arange(pad)[None]], dim=1),
        "shift_labels": shift,
        "seq_idx": torch.cat([flat["seq_idx"], torch.full((1, pad), len(LENGTHS), dtype=torch.int32)], dim=1),
    }
    local = {k: cp_shard(v, rank, world).contiguous() for k, v in full.items()}
    varlen = {k: flat[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    local["labels"] = local["shift_labels"]
    return {**local, **varlen, "num_items_in_batch": int((shift != -100).sum())}


def _gathers_in(fn) -> int:
    """all_gather calls made while ``fn()`` runs."""
    with mock.patch.object(dist, "all_gather", wraps=dist.all_gather) as spy:
        fn()
    return spy.call_count


def _exactness(rank: int, cp: int, group) -> dict[str, float]:
    flat = flattened()
    ref = tiny_model("llama")
    ref_out = ref(
        input_ids=flat["input_ids"], position_ids=flat["position_ids"], labels=flat["labels"], use_cache=False
    )
    ref_out.loss.backward()
    model = apply_ring_attention(copy.deepcopy(ref), group)
    batch = ring_batch(flat, rank, cp)
    outputs = []

    def step() -> None:
        outputs.append(model(**batch))
        outputs[0].loss.backward()

    gathers = _gathers_in(step)
    out = outputs[0]
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)
    logits = cp_gather(out.logits.detach(), group=group)[:, : flat["input_ids"].shape[1]]
    errors = {
        "gathers": float(gathers),
        "logits": ((logits - ref_out.logits).abs().max() / ref_out.logits.abs().max()).item(),
        "loss": ((loss - ref_out.loss).abs() / ref_out.loss.abs()).item(),
    }
    worst = 0.0
    for (_, p), (_, pr) in zip(model.named_parameters(), ref.named_parameters()):
        grad = p.grad.detach().clone()
        dist.all_reduce(grad, group=group)
        worst = max(worst, ((grad - pr.grad).abs().max() / pr.grad.abs().max().clamp_min(1e-12)).item())
    errors["grad"] = worst
    # The collator's own packed rows: its cu_seqlens replace the old all_gather of the positions.
    collator = RingDataCollator(rank, cp, pad_token_id=0, max_length=48, packing=True)
    examples = [{"input_ids": list(range(1, n + 1))} for n in (30, 25, 20, 10)]
    packed = collator(examples)
    errors["collator gathers"] = float(_gathers_in(lambda: model(**packed).loss.backward()))
    return errors


def _refusals(rank: int, world: int) -> dict[str, str]:
    flat = flattened()
    model = apply_ring_attention(tiny_model("llama"))
    good = ring_batch(flat, rank, world)
    cu = flat["cu_seq_lens_q"]
    seq = good["input_ids"].shape[1] * world
    two_rows = {
        k: torch.cat([v, v]) if k in ("input_ids", "position_ids", "labels") else v for k, v in good.items()
    }
    bad = {
        "q_vs_k": {**good, "cu_seq_lens_k": torch.tensor([0, 20, 32, 41, 46], dtype=torch.int32)},
        "two_rows": {k: v for k, v in two_rows.items() if k not in ("shift_labels", "num_items_in_batch")},
        "short": {**good, "cu_seq_lens_q": cu[:-1], "cu_seq_lens_k": cu[:-1]},
        "max_length": {**good, "max_length_q": 9, "max_length_k": 9},
        "ranks_differ": {
            **{k: v for k, v in good.items() if not k.startswith(("cu_seq", "max_len"))},
            "cu_seqlens": [[0, 10 + rank, seq]],
        },
        "malformed": {**good, "cu_seq_lens_q": None, "cu_seq_lens_k": None, "cu_seqlens": [[0, 5, 5, seq]]},
    }
    seen = {}
    for name, batch in bad.items():
        try:
            model(**batch)
            seen[name] = "no error"
        except ValueError as exc:
            seen[name] = str(exc)
    model(**good)  # the group still works
    # One rank fails; every rank stops, the others with its message.
    try:
        run_together(lambda: 1 / 0 if rank == world - 1 else None, share_message=True)
        seen["together"] = "no error"
    except PeerFailed as exc:
        seen["together"] = f"peer {exc.rank}: {exc.message}"
    except ZeroDivisionError as exc:
        seen["together"] = f"own: {exc}"
    seen["value"] = str(run_together(lambda: rank * 10))
    return seen


def worker(rank: int, world: int) -> tuple[dict[int, dict[str, float]], dict[str, str]]:
    """CP 2 (ranks 0 and 1 of a subgroup; rank 2 waits) and CP 3 (the world), one spawn."""
    errors = {}
    for cp in (2, 3):
        group = dist.new_group(list(range(cp)))  # every rank creates every group
        if rank < cp:
            errors[cp] = _exactness(rank, cp, group)
    return errors, _refusals(rank, world)


@pytest.mark.numerics
@pytest.mark.timeout(240)
def test_flattened_batch_on_the_ring_matches_one_process():
    world = 3
    for rank, (by_cp, seen) in enumerate(run_distributed(worker, world, timeout=200)):
        assert sorted(by_cp) == [2, 3][rank // 2 :]
        for cp, errors in by_cp.items():
            # One validation all_gather per forward, none for the document boundaries (was 2 for packed rows).
            assert errors.pop("gathers") == 1 and errors.pop("collator gathers") == 1, (cp, errors)
            for name, err in errors.items():
                limit = {"loss": LOSS_RTOL, "logits": LOGITS_RTOL, "grad": GRAD_RTOL}[name]
                assert err <= limit, f"CP={cp} {name}: {err:.2e} > {limit:.1e}"
        assert "cu_seq_lens_q" in seen["q_vs_k"] and "differ" in seen["q_vs_k"], seen
        assert "one flattened row" in seen["two_rows"], seen
        assert "must cover the sequence" in seen["short"], seen
        assert "max_length_q=9" in seen["max_length"] and "19 tokens" in seen["max_length"], seen
        assert "document offsets" in seen["ranks_differ"], seen
        assert "must rise strictly" in seen["malformed"], seen
        last = world - 1
        expected = "own: division by zero" if rank == last else f"peer {last}: division by zero"
        assert seen["together"] == expected and seen["value"] == str(rank * 10), seen


def test_offsets_are_taken_from_the_kwargs():
    """The explicit keys leave the decoder's kwargs (nothing reaches the attention call); transformers'
    one-row offsets ending before the padding get the padding as one more document."""
    flat = flattened()
    kwargs = {k: flat[k] for k in VARLEN_KEYS}
    rows, problems = take_document_offsets(kwargs, 1, 48, 2)
    assert (rows, problems, kwargs) == ([[0, 19, 32, 41, 46, 48]], [], {})
    rows, problems = take_document_offsets({"cu_seq_lens_q": [0, 46]}, 1, 60, 3)
    assert rows is None and "must cover" in problems[0]  # more than the padding to 2 * cp_size
    rows, problems = take_document_offsets({"cu_seqlens": [[0, 3, 8], [0, 8]], "use_cache": False}, 2, 8, 2)
    assert (rows, problems) == ([[0, 3, 8], [0, 8]], [])
    _, problems = take_document_offsets({"cu_seqlens": [[0, 3, 8]], "cu_seq_lens_q": [0, 4, 8]}, 1, 8, 2)
    assert "disagree" in problems[0]
    _, problems = take_document_offsets({"max_length_q": 4}, 1, 8, 2)
    assert "without cu_seq_lens_q" in problems[0]
    assert take_document_offsets({}, 1, 8, 2) == (None, [])


def test_collator_offsets_reach_the_loss_unharmed():
    """The collator's ``cu_seqlens``: per row, the packed documents' global offsets, then the padding;
    an unpatched model (one process) passes the key to its loss, which ignores it."""
    lengths = (30, 25, 20, 10, 5)
    collator = RingDataCollator(0, 2, pad_token_id=0, max_length=48, packing=True)
    batch = collator([{"input_ids": list(range(1, n + 1))} for n in lengths])
    for row, offsets in zip(collator.last_rows, batch["cu_seqlens"]):
        expected = [0]
        for i in row:
            expected.append(expected[-1] + lengths[i])
        assert offsets == (expected if expected[-1] == 48 else [*expected, 48])
    plain = RingDataCollator(1, 2, pad_token_id=0)([{"input_ids": [1, 2, 3]}, {"input_ids": [4] * 6}])
    assert plain["cu_seqlens"] == [[0, 8], [0, 8]]
    ref = tiny_model("llama")
    one = RingDataCollator(0, 1, pad_token_id=0)([{"input_ids": list(range(1, 11))}])
    with torch.no_grad():
        with_key = ref(**one).loss
        without = ref(**{k: v for k, v in one.items() if k != "cu_seqlens"}).loss
    assert torch.equal(with_key, without)
