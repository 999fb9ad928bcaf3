"""LLaMA on 2D context parallelism (Ulysses x ring) vs the unmodified transformers model in one process.

One spawn of 4 gloo processes runs every (ulysses, ring) factorisation of CP 2 (dp 2), CP 4 and CP 3
(ranks 0-2; rank 3 waits): 1 x 2, 2 x 1, 1 x 4, 2 x 2, 4 x 1, 1 x 3, 3 x 1. For each Ulysses size,
GQA with K/V heads fewer than (replicated), equal to and more than ``ulysses_size``; then packed
documents through the hybrid, from the collator's ``cu_seqlens`` and from the position ids alone
(the fallback that gathers them over the CP group), and RingInference (prefill through the hybrid,
decode on the per-CP-rank cache), and two bad inputs that must raise on every rank. At 2 x 2,
``attention_checkpoint`` save / offload against recompute (fp64, bitwise: the saved object is the
ring's own head-sharded out/lse; tests/model/attention_checkpoint_checks.py).

Oracle: the same weights, eager attention, one process, the whole (padded) batch; packed rows with
restarting position ids and no mask (transformers masks the documents itself). Tolerances:
``tests/tiny_models.fp32_bounds`` of the longest padded sequence (the all-to-alls move values
exactly; the ring reorders fp32 sums along the chain behind a logit), relative to the reference's
largest logit / loss / each parameter's largest gradient entry. A layout or masking mistake is O(1).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist

from ringft import RingDataCollator, apply_ring_attention, cp_gather, ring_spec
from ringft.ops.parallel import ParallelLayout, build_layout
from ringft.ops.sharding import cp_shard
from ringft.utils.spawn import run_distributed
from tests.model.attention_checkpoint_checks import attention_checkpoint_differences, check_differences
from tests.tiny_models import VOCAB, fp32_bounds, ragged_examples, tiny_model

LOGITS_RTOL, LOSS_RTOL, GRAD_RTOL = fp32_bounds(56)  # rows padded to at most 56 tokens (cp 4)
# (heads, kv_heads, head_dim) per Ulysses size: K/V heads fewer than, equal to, more than U.
HEADS = {
    1: [(4, 2, 16)],
    2: [(4, 1, 16), (4, 2, 16), (4, 4, 16)],
    3: [(6, 1, 8), (6, 3, 8), (6, 6, 8)],  # (hidden 48)
    4: [(4, 2, 16), (4, 4, 16), (8, 8, 8)],
}
LAYOUTS = [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (3, 1), (3, 3)]  # (cp, ulysses)
DOC_LENGTHS = (21, 9, 14, 5, 17, 11, 3)  # packed into rows of 48 tokens (boundaries across chunks)


def _model(hq: int, hkv: int, head_dim: int):
    hidden = 48 if hq == 6 else 64  # a multiple of the heads (transformers checks it)
    return tiny_model(
        "llama", hidden_size=hidden, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=head_dim
    )


def _target(world: int, cp: int, u: int):
    """``(what apply_ring_attention gets, CP group, CP rank)`` of this rank (None off the CP group).

    CP sizes dividing the world use ``build_layout``; CP 3 on ranks 0-2 builds its groups by
    hand (every rank creates every group, in the same order)."""
    if world % cp == 0:
        layout = build_layout(cp, u)
        return layout, layout.cp_group, layout.cp_rank
    cp_group = dist.new_group(list(range(cp)))
    uly = [dist.new_group([p * u + x for x in range(u)]) for p in range(cp // u)]
    ring = [dist.new_group([p * u + x for p in range(cp // u)]) for x in range(u)]
    rank = dist.get_rank()
    if rank >= cp:
        return None, None, None
    p, x = divmod(rank, u)
    return (ParallelLayout.from_groups(cp_group, uly[p], ring[x]) if u > 1 else cp_group), cp_group, rank


def _errors(model, ref, batch, full, group, u: int) -> dict[str, float]:
    """Relative errors of the ring run (``batch``: this rank's shard) against the one-process
    reference on ``full``: logits, loss, every parameter gradient."""
    out = model(**batch)
    out.loss.backward()
    positions = full.get("position_ids")
    ref_out = ref(
        input_ids=full["input_ids"],
        position_ids=positions,
        labels=full["shift_labels"],
        shift_labels=full["shift_labels"],
        num_items_in_batch=int((full["shift_labels"] != -100).sum()),
        use_cache=False,  # (with no mask and no cache, transformers masks packed rows itself)
    )
    ref_out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)
    logits = cp_gather(out.logits.detach(), group=group, ulysses_size=u)
    errors = {
        "logits": ((logits - ref_out.logits).abs().max() / ref_out.logits.abs().max()).item(),
        "loss": ((loss - ref_out.loss).abs() / ref_out.loss.abs()).item(),
    }
    worst = 0.0
    for (_, p), (_, pr) in zip(model.named_parameters(), ref.named_parameters()):
        grad = p.grad.detach().clone()
        dist.all_reduce(grad, group=group)  # each CP rank holds a partial gradient of the same replica
        worst = max(worst, ((grad - pr.grad).abs().max() / pr.grad.abs().max().clamp_min(1e-12)).item())
    errors["grad"] = worst
    return errors


def _documents(target, group, cp_rank: int, cp: int, u: int, hq: int, hkv: int, hd: int) -> dict:
    """Packed documents through the hybrid: the collator's cu_seqlens, then positions only."""
    collator = RingDataCollator(cp_rank, cp, pad_token_id=0, max_length=48, packing=True, ulysses_size=u)
    gen = torch.Generator().manual_seed(7)
    examples = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=gen).tolist()} for n in DOC_LENGTHS]
    batch, full = collator(examples), collator.global_batch(examples)
    assert any(len(row) > 2 for row in full["cu_seqlens"])
    ref = _model(hq, hkv, hd)
    errors = {}
    for name, drop in (("docs", ()), ("docs-positions", ("cu_seqlens",))):
        model = apply_ring_attention(copy.deepcopy(ref), target)
        local = {k: v for k, v in batch.items() if k not in drop}
        errors.update({f"{name}/{k}": v for k, v in _errors(model, ref, local, full, group, u).items()})
        ref.zero_grad()
    return errors


def _inference(target, cp_rank: int, hq: int, hkv: int, hd: int) -> dict:
    """RingInference on the hybrid: prefill logits, greedy tokens and a decode step's logits."""
    from ringft.model.inference import RingInference

    ref = _model(hq, hkv, hd).eval()
    engine = RingInference(copy.deepcopy(ref), target, "torch")
    prompt = torch.randint(1, VOCAB, (29,), generator=torch.Generator().manual_seed(3)).tolist()
    first = engine.prefill(prompt)
    engine.reset()
    tokens = engine.generate(prompt, 6)
    logits = engine.prefill(prompt)
    for t in tokens[:-1]:
        logits = engine.decode(t)
    engine.reset()
    with torch.no_grad():
        ref_tokens = ref.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        ref_first = ref(torch.tensor([prompt])).logits[0, -1]
        ref_last = ref(torch.tensor([prompt + tokens[:-1]])).logits[0, -1]
    scale = ref_first.abs().max()
    return {
        "inference/tokens": float(tokens != ref_tokens[0, len(prompt) :].tolist()),
        "inference/prefill": ((first - ref_first).abs().max() / scale).item(),
        "inference/decode": ((logits - ref_last).abs().max() / ref_last.abs().max()).item(),
    }


def _with_warnings(fn, *args):
    """``(fn(*args), messages logged by ringft.ops.ulysses meanwhile)``."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("ringft.ops.ulysses")
    handler = Keep()
    logger.addHandler(handler)
    try:
        result = fn(*args)
    finally:
        logger.removeHandler(handler)
    return result, records


def worker(rank: int, world: int) -> dict:
    """Errors per (cp, ulysses, config), keyed ``"cp x u / config / measure"``; refusals."""
    out: dict = {"errors": {}, "seen": {}, "saved": {}}
    examples = ragged_examples(3)
    for cp, u in LAYOUTS:
        target, group, cp_rank = _target(world, cp, u)
        if target is None:
            continue
        collator = RingDataCollator(cp_rank, cp, pad_token_id=0, ulysses_size=u)
        batch, full = collator(examples), collator.global_batch(examples)
        if u == 1:  # the plain ring: today's operator and today's zigzag shards, exactly
            zigzag = {k: cp_shard(full[k], cp_rank, cp) for k in ("input_ids", "position_ids")}
            out["seen"][f"{cp}x1/same shards"] = all(torch.equal(batch[k], v) for k, v in zigzag.items())
        for hq, hkv, hd in HEADS[u]:
            ref = _model(hq, hkv, hd)
            model = apply_ring_attention(copy.deepcopy(ref), target)
            out["seen"][f"{cp}x{u}/spec"] = (ring_spec(model).ulysses_size, ring_spec(model).layout is None)
            tag = f"{cp}x{u}/{hq}q{hkv}kv"
            errors, warnings = _with_warnings(_errors, model, ref, batch, full, group, u)
            out["errors"].update({f"{tag}/{k}": v for k, v in errors.items()})
            out["seen"][f"{tag}/warnings"] = warnings
        if u > 1:
            hq, hkv, hd = HEADS[u][1]  # K/V heads = ulysses_size
            docs = _documents(target, group, cp_rank, cp, u, hq, hkv, hd)
            out["errors"].update({f"{cp}x{u}/{k}": v for k, v in docs.items()})
            if (cp, u) in ((4, 2), (3, 3)):
                inference = _inference(target, cp_rank, *HEADS[u][0])
                out["errors"].update({f"{cp}x{u}/{k}": v for k, v in inference.items()})
        if (cp, u) == (4, 2):
            out["saved"] = attention_checkpoint_differences(cp_rank, cp, target, ulysses_size=u)
        if (cp, u) == (4, 2):  # bad inputs raise on every rank, before any all-to-all
            model = apply_ring_attention(_model(*HEADS[u][1]), target)
            skewed = RingDataCollator(cp_rank, cp, pad_token_id=0, ulysses_size=u)(
                ragged_examples(1, lengths=(40, 40 + 8 * cp_rank))
            )
            no_positions = {k: v for k, v in batch.items() if k != "position_ids"}
            for name, bad in (("skewed", skewed), ("positions", no_positions)):
                try:
                    model(**bad)
                    out["seen"][name] = "no error"
                except ValueError as exc:
                    out["seen"][name] = str(exc)
            model(**batch)  # the groups still work
        if (cp, u) == (3, 3):
            try:
                apply_ring_attention(tiny_model("llama"), target)  # 4 query heads, ulysses 3
                out["seen"]["heads"] = "no error"
            except ValueError as exc:
                out["seen"]["heads"] = str(exc)
    return out


@pytest.mark.numerics
@pytest.mark.timeout(300)
def test_hybrid_model_matches_one_process():
    results = run_distributed(worker, 4, timeout=240)
    for rank, result in enumerate(results):
        errors, seen = result["errors"], result["seen"]
        layouts = {(cp, u) for cp, u in LAYOUTS if 4 % cp == 0 or rank < cp}  # CP 3: ranks 0-2
        assert {tuple(map(int, k.split("/")[0].split("x"))) for k in errors} == layouts, rank
        for name, err in errors.items():
            measure = name.rsplit("/", 1)[1]
            limit = {
                "logits": LOGITS_RTOL,
                "loss": LOSS_RTOL,
                "grad": GRAD_RTOL,
                "prefill": LOGITS_RTOL,
                "decode": LOGITS_RTOL,
                "tokens": 0.0,
            }[measure]
            assert err <= limit, f"rank {rank} {name}: {err:.2e} > {limit:.1e}"
        for cp, u in layouts:
            assert seen[f"{cp}x{u}/spec"] == (u, u == 1), (cp, u)  # U = 1: the ring's own path
            if u == 1:
                assert seen[f"{cp}x1/same shards"]
        # K/V heads replicated (fewer than U and not dividing it): logged once per process, naming
        # the copies; never for the other head counts.
        replicated = {(2, 1): 2, (3, 1): 3, (4, 2): 2}  # (U, kv heads) -> copies
        logged: set = set()
        for cp, u in [layout for layout in LAYOUTS if layout in layouts]:  # in the order they ran
            for hq, hkv, _ in HEADS[u]:
                warnings = seen[f"{cp}x{u}/{hq}q{hkv}kv/warnings"]
                copies = replicated.get((u, hkv))
                if copies is None or (u, hkv) in logged:
                    assert warnings == [], (cp, u, hkv, warnings)
                else:
                    assert len(warnings) == 1 and f"sent {copies} times" in warnings[0], warnings
                    logged.add((u, hkv))
        check_differences(result["saved"], f"Ulysses 2 x ring 2 rank {rank}")
        assert "same batch and seq_local" in seen["skewed"], seen["skewed"]
        assert "cp_position_ids" in seen["positions"], seen["positions"]
        if rank < 3:
            assert "query heads (4) are not divisible by ulysses_size=3" in seen["heads"], seen["heads"]
            assert seen["heads"].endswith("[1]"), seen["heads"]
