"""``attention_checkpoint``: save / offload vs recompute on one process (CP 1), the store's own
refusals, and what is refused or left alone around it. The distributed cases run in the spawns of
tests/model/test_patch.py (CP 2, 3) and tests/model/test_ulysses_model.py (Ulysses 2 x ring 2);
the oracle and the bitwise criterion are tests/model/attention_checkpoint_checks.py's.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import ringft.model.attention_checkpoint as attention_checkpoint
from ringft import RingDataCollator, apply_ring_attention, remove_ring_attention
from ringft.ops.saved_attention import AttentionStore, checkpoint_contexts
from tests.model.attention_checkpoint_checks import (
    LAYERS,
    MODES,
    attention_checkpoint_differences,
    check_differences,
    checkpointed,
    counted_ring_forwards,
    mode_differences,
)
from tests.tiny_models import ragged_examples, tiny_model


def _batch(seed: int = 5) -> dict:
    return RingDataCollator(0, 1, pad_token_id=0)(ragged_examples(seed))


@pytest.mark.numerics
@pytest.mark.timeout(120)
def test_save_and_offload_equal_recompute_on_one_rank():
    check_differences(attention_checkpoint_differences(0, 1, None, modes=MODES), "CP=1")


@pytest.mark.numerics
@pytest.mark.timeout(120)
def test_micro_batches_in_flight_and_stores_released(monkeypatch):
    """Two forwards before their backwards (in the other order) and a second backward through a
    retained graph: each checkpointed call has its own store; all are gone after the backwards."""
    stores: list[weakref.ref] = []

    def tracked(offload: bool = False):
        contexts = checkpoint_contexts(offload)
        stores.append(weakref.ref(contexts[0].store))
        return contexts

    monkeypatch.setattr(attention_checkpoint, "checkpoint_contexts", tracked)
    ref = tiny_model("llama").double()
    batches = [_batch(5), _batch(6)]
    results = {}
    for mode in MODES:
        model = checkpointed(copy.deepcopy(ref), None, mode)
        with counted_ring_forwards() as count:
            losses = [model(**b).loss for b in batches]
            losses[1].backward(retain_graph=True)
            losses[1].backward()  # the retained graph's recompute takes the kept out/lse again
            losses[0].backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        results[mode] = (sum(loss.detach() for loss in losses), grads, count[0])
        del losses
        gc.collect()
        assert all(r() is None for r in stores), f"{mode}: a store outlived its backward"
    differences = mode_differences(results, "in-flight")
    assert differences.pop("in-flight/recompute/forwards") == 5 * LAYERS  # 2 forwards + 3 recomputes
    for name, value in differences.items():
        assert value == (2 * LAYERS if name.endswith("forwards") else 0.0), (name, value)
    assert len(stores) == 2 * 2 * LAYERS  # save, offload: one store per layer per forward


def test_refused_without_checkpointing_or_with_reentrant():
    batch = _batch()
    model = apply_ring_attention(tiny_model("llama"), None, "torch", attention_checkpoint="save").train()
    with pytest.raises(ValueError, match=r"attention_checkpoint='save' .* layers are not checkpointed"):
        model(**batch)
    with torch.no_grad():  # no backward, nothing to keep: runs
        model(**batch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match=r"needs non-reentrant checkpointing .*'use_reentrant': False"):
        model(**batch)
    with pytest.raises(ValueError, match=r"attention_checkpoint must be one of recompute, save, offload"):
        apply_ring_attention(tiny_model("llama"), None, attention_checkpoint="keep")


def test_switching_back_to_recompute_unwraps():
    batch = _batch()
    model = checkpointed(tiny_model("llama"), None, "offload")
    with counted_ring_forwards() as count:
        model(**batch).loss.backward()
    assert count[0] == LAYERS
    apply_ring_attention(model, None, "torch")  # recompute again: the layers' own functions back
    layers = [m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]
    assert layers and all(
        not isinstance(m._gradient_checkpointing_func, attention_checkpoint._KeepingAttention) for m in layers
    )
    with counted_ring_forwards() as count:
        model(**batch).loss.backward()
    assert count[0] == 2 * LAYERS
    remove_ring_attention(checkpointed(model, None, "save"))
    model(**batch)  # the pre-hook wrapped nothing yet; removing left plain checkpointing
    assert all(
        not isinstance(m._gradient_checkpointing_func, attention_checkpoint._KeepingAttention) for m in layers
    )


def test_store_refuses_a_recompute_that_differs():
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    out, lse = torch.randn_like(q), torch.randn(1, 2, 4, dtype=torch.float64)
    store = AttentionStore()
    store.begin(replaying=False)
    assert store.replay(q) is None
    store.record(out, lse)
    store.begin(replaying=True)
    kept = store.replay(q)
    assert torch.equal(kept[0], out) and torch.equal(kept[1], lse) and kept[0] is not out
    with pytest.raises(RuntimeError, match="more ring attention calls than its forward"):
        store.replay(q)
    store.begin(replaying=True)
    with pytest.raises(RuntimeError, match=r"q \(1, 8, 2, 8\) .* kept out \(1, 4, 2, 8\)"):
        store.replay(torch.randn(1, 8, 2, 8, dtype=torch.float64))
    store.begin(replaying=True)
    out.add_(1)  # the forward's output changed in place after it was kept
    with pytest.raises(RuntimeError, match="modified in place"):
        store.replay(q)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by hand on a GPU machine)")
@pytest.mark.timeout(300)
def test_offload_on_cuda_keeps_pinned_host_copies_and_equals_recompute(monkeypatch):
    """On CUDA ``offload`` really moves the kept out/lse to pinned host memory and back
    (asynchronous copies on the compute stream): bf16 loss and gradients still bitwise equal."""
    kept: list[AttentionStore] = []

    def tracked(offload: bool = False):
        contexts = checkpoint_contexts(offload)
        kept.append(contexts[0].store)
        return contexts

    monkeypatch.setattr(attention_checkpoint, "checkpoint_contexts", tracked)
    ref = tiny_model("llama").to("cuda", torch.bfloat16)
    batch = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in _batch().items()}
    results = {}
    for mode in MODES:
        model = checkpointed(copy.deepcopy(ref), None, mode)
        with counted_ring_forwards() as count:
            loss = model(**batch).loss
            if mode == "offload":
                hosts = [entry.out for store in kept for entry in store._kept]
                assert len(hosts) == LAYERS and all(t.device.type == "cpu" and t.is_pinned() for t in hosts)
            loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        results[mode] = (loss.detach(), grads, count[0])
        kept.clear()
    differences = mode_differences(results, "cuda-bf16")
    check_differences(differences, "CUDA")
