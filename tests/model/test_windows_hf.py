"""Sliding windows through transformers: the convention, Mistral on the ring, windowed decoding;
and, on the same processes, the operator-level distributed checks of tests/ops/test_windows.py.

Oracles: transformers' own mask function (``masking_utils.sliding_window_causal_mask_function``)
for the convention; the unmodified Mistral model in one process (eager attention, transformers'
sliding-window mask) for training and generation. fp32, the tolerances of test_patch.py: logits
1e-5 abs, loss 1e-6 abs, gradients 1e-5 relative to each parameter's largest entry (the ring only
reorders fp32 sums; a window off by one key moves them by O(1e-2) or more); packed documents: the
derived relative bounds of test_documents_hf.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from ringft import RingDataCollator, apply_ring_attention, cp_gather
from ringft.utils.spawn import run_distributed
from tests.ops.window_checks import ULYSSES_REL, check_window_results, ulysses_window_worker, window_worker
from tests.tiny_models import (
    VOCAB,
    compare_with_reference,
    document_examples,
    documents_reference,
    fp32_bounds,
    ragged_examples,
    tiny_model,
)

LOGITS_RTOL, LOSS_RTOL, GRAD_RTOL = fp32_bounds(48)  # the packed rows of _documents_errors
CP_SIZES = (1, 2, 3, 4)  # one spawn of 4 processes; the CP group of size N is ranks 0..N-1
WINDOWS = (5, 20)  # padded sequences of 72 tokens: chunks of 36, 18, 12, 9 tokens for CP 1..4


@pytest.mark.numerics
def test_window_convention_is_transformers_mask():
    """The operator's window, on the zigzag schedule, equals attention under transformers' own
    sliding-window causal mask (evaluated pair by pair), for windows of 1 key to the whole row."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    from ringft.ops.emulate import emulate_zigzag_attention

    seq = 24
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    for window in (1, 2, 3, 5, 6, 7, 13, 23, 24):
        fn = sliding_window_causal_mask_function(window)
        zero, pos = torch.tensor(0), torch.arange(seq)
        mask = fn(zero, zero, pos[:, None], pos[None, :]).expand(seq, seq)  # every (query, key) pair
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        ).transpose(1, 2)
        for world in (2, 3):
            got, _, _ = emulate_zigzag_attention(q, k, v, world, backend="torch", sliding_window=window)
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0, msg=f"window {window}, N={world}")


def _documents_errors(rank: int, world: int, window: int, group) -> dict[str, float]:
    """Packed documents and a window: each document alone through the windowed one-process model."""
    collator = RingDataCollator(rank, world, pad_token_id=0, max_length=48, packing=True)
    lengths = [19, 13, 9, 5]  # boundaries 19, 32, 41, 46 (+2 pad): across and on chunk edges
    examples = document_examples(lengths, 11)
    base = tiny_model("mistral", sliding_window=window)
    model = apply_ring_attention(copy.deepcopy(base), group)
    ref_logits, ref_loss = documents_reference(base, examples)
    out = model(**collator(examples))
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)
    logits = cp_gather(out.logits.detach(), group=group)
    worst, scale = 0.0, max(x.abs().max().item() for x in ref_logits)
    for row, members in enumerate(collator.last_rows):
        at = 0
        for i in members:
            worst = max(worst, (logits[row, at : at + lengths[i]] - ref_logits[i]).abs().max().item() / scale)
            at += lengths[i]
    grad_err = 0.0
    for (_, p), (_, pr) in zip(model.named_parameters(), base.named_parameters()):
        grad = p.grad.detach().clone()
        dist.all_reduce(grad, group=group)
        grad_err = max(grad_err, ((grad - pr.grad).abs().max() / pr.grad.abs().max().clamp_min(1e-12)).item())
    tag = f"docs-w{window}"
    return {
        f"{tag}/logits_rel": worst,
        f"{tag}/loss_rel": ((loss - ref_loss).abs() / ref_loss.abs()).item(),
        f"{tag}/grad_rel": grad_err,
    }


def _decode_errors(rank: int, world: int, group) -> dict[str, float]:
    """RingInference with a window shorter than the prompt: greedy tokens and logits vs generate."""
    from ringft.model.inference import RingInference

    ref = tiny_model("mistral", sliding_window=8).eval()
    engine = RingInference(copy.deepcopy(ref), group, "torch")
    prompt = torch.randint(1, VOCAB, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    first = engine.prefill(prompt)
    engine.reset()
    tokens = engine.generate(prompt, 10)
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        ref_first = ref(torch.tensor([prompt])).logits[0, -1]
    return {
        "decode/tokens_differ": float(tokens != want[0, len(prompt) :].tolist()),
        "decode/logits": (first - ref_first).abs().max().item(),
    }


def windows_worker(rank: int, world: int) -> dict[int, tuple[dict, dict[str, float], dict[str, float]]]:
    """For each CP size N of CP_SIZES (the group of ranks 0..N-1; the others wait): the
    operator-level checks of tests/ops/test_windows.py and the Mistral checks; at N = 4 (the
    world) windows through Ulysses 2 x ring 2 too. One spawn: starting processes costs more than
    the checks."""
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    out = {}
    for size in CP_SIZES:
        group = dist.new_group(list(range(size)))
        if rank < size:
            ulysses = ulysses_window_worker(rank, size) if size == world else {}
            out[size] = (
                window_worker(rank, size, group, singles[rank]),
                mistral_window_worker(rank, size, group),
                ulysses,
            )
        dist.barrier()
    return out


def mistral_window_worker(rank: int, world: int, group=None) -> dict[str, float]:
    """Mistral with windows shorter and longer than a chunk, packed documents with a window and
    windowed decoding: errors against the one-process model."""
    errors: dict[str, float] = {}
    collator = RingDataCollator(rank, world, pad_token_id=0, pad_to_multiple_of=24)
    examples = ragged_examples(3, lengths=(37, 50, 29))
    batch, full = collator(examples), collator.global_batch(examples)
    assert full["input_ids"].shape[1] == 72
    for window in WINDOWS:
        ref = tiny_model("mistral", sliding_window=window)
        model = apply_ring_attention(copy.deepcopy(ref), group)
        tag = f"mistral-w{window}"
        errors.update(compare_with_reference(model, ref, batch, full, rank, world, tag, group))
    errors.update(_documents_errors(rank, world, 6, group))
    errors.update(_decode_errors(rank, world, group))
    return errors


@pytest.mark.numerics
@pytest.mark.timeout(540)
def test_windowed_ring_matches_oracles():
    """The windowed ring operator against fp64 windowed attention (tests/ops/test_windows.py's
    worker: out/lse/dq/dk/dv, K/V traffic), the same through Ulysses 2 x ring 2 (4 ranks), and
    Mistral with windows against one process."""
    limits = {
        "loss": 1e-6,
        "logits": 1e-5,
        "grad": 1e-5,
        "logits_rel": LOGITS_RTOL,
        "loss_rel": LOSS_RTOL,
        "grad_rel": GRAD_RTOL,
        "tokens_differ": 0.0,
    }
    per_rank = run_distributed(windows_worker, max(CP_SIZES), timeout=480)
    for world in CP_SIZES:
        results = [per_rank[rank][world] for rank in range(world)]
        check_window_results([ops for ops, _, _ in results], world)
        for rank, (_, _, ulysses) in enumerate(results):
            for name, err in ulysses.items():
                assert err <= ULYSSES_REL, f"CP={world} rank {rank} {name}: {err:.2e} > {ULYSSES_REL:.1e}"
        assert world != 4 or all(len(u) == 4 for _, _, u in results)
        for _, errors, _ in results:
            for name, err in errors.items():
                limit = limits[name.split("/")[1]]
                assert err <= limit, f"CP={world} {name}: {err:.2e} > {limit:.1e}"
