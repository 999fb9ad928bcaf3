"""``attention_checkpoint`` save / offload against recompute, on one CP rank (importable by spawned
ranks: tests/model/test_patch.py runs it at CP 2 and 3, tests/model/test_ulysses_model.py through
Ulysses 2 x ring 2, tests/model/test_attention_checkpoint.py at CP 1).

Oracle: the same fp64 model under gradient checkpointing with ``recompute`` (the ring forward run
again in the backward). ``save`` hands the recompute the very tensors the forward computed, so this
rank's loss and every local gradient must be bitwise equal (any difference, even one rounding, is a
bug). The ring forwards are counted (one loop for every schedule: the full ring and the sliding window):
``recompute`` runs one per layer per forward and per recompute, ``save`` / ``offload`` one per
layer per forward. On CPU ``offload`` keeps the tensors where they are (host memory already): the
distributed cases run ``recompute`` and ``save`` only.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch

from ringft import RingDataCollator, apply_ring_attention
from tests.tiny_models import TINY, document_examples, ragged_examples, tiny_model

MODES = ("recompute", "save", "offload")
LAYERS = TINY["num_hidden_layers"]


@contextlib.contextmanager
def counted_ring_forwards() -> Iterator[list[int]]:
    """Counts the ring forwards (zigzag and sliding-window schedules) run meanwhile: ``[count]``."""
    import ringft.ops.ring_loop as ring_loop

    count = [0]
    originals = {ring_loop: ring_loop._ring_forward}

    def counting(real):
        def run(*args, **kwargs):
            count[0] += 1
            return real(*args, **kwargs)

        return run

    for module, real in originals.items():
        module._ring_forward = counting(real)
    try:
        yield count
    finally:
        for module, real in originals.items():
            module._ring_forward = real


def checkpointed(model: torch.nn.Module, target, mode: str) -> torch.nn.Module:
    """``model`` on the ring of ``target`` with ``attention_checkpoint=mode``, non-reentrant
    gradient checkpointing, in training mode."""
    model = apply_ring_attention(model, target, "torch", attention_checkpoint=mode)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def run_modes(ref: torch.nn.Module, target, batch: dict, modes=MODES) -> dict[str, tuple]:
    """Per mode: ``(loss, {name: grad}, ring forwards)`` of one forward + backward of a copy of ``ref``."""
    out = {}
    for mode in modes:
        model = checkpointed(copy.deepcopy(ref), target, mode)
        with counted_ring_forwards() as count:
            loss = model(**batch).loss
            loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        out[mode] = (loss.detach(), grads, count[0])
    return out


def mode_differences(results: dict[str, tuple], tag: str) -> dict[str, float]:
    """``{tag/mode/loss|grad: max |difference| against recompute, tag/mode/forwards: ring forwards}``."""
    ref_loss, ref_grads, ref_count = results["recompute"]
    out = {f"{tag}/recompute/forwards": float(ref_count)}
    for mode in [m for m in results if m != "recompute"]:
        loss, grads, count = results[mode]
        assert grads.keys() == ref_grads.keys() and grads
        out[f"{tag}/{mode}/loss"] = (loss - ref_loss).abs().item()
        out[f"{tag}/{mode}/grad"] = max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)
        out[f"{tag}/{mode}/forwards"] = float(count)
    return out


def attention_checkpoint_differences(
    cp_rank: int, cp_size: int, target, ulysses_size: int = 1, modes=("recompute", "save")
) -> dict[str, float]:
    """LLaMA (ragged rows), packed documents and Mistral with a window shorter than a chunk, alone
    and with packed documents: :func:`mode_differences` of ``modes``, fp64."""
    plain = RingDataCollator(cp_rank, cp_size, pad_token_id=0, ulysses_size=ulysses_size)
    packed = RingDataCollator(
        cp_rank, cp_size, pad_token_id=0, max_length=48, packing=True, ulysses_size=ulysses_size
    )
    rows, docs = plain(ragged_examples(5)), packed(document_examples([19, 13, 9, 5], 11))
    cases = [
        ("llama", {}, rows),
        ("llama-docs", {}, docs),
        ("mistral-w5", {"sliding_window": 5}, rows),
        ("mistral-w6-docs", {"sliding_window": 6}, docs),
    ]
    out = {}
    for tag, overrides, batch in cases:
        ref = tiny_model(tag.split("-")[0], **overrides).double()
        out.update(mode_differences(run_modes(ref, target, batch, modes), tag))
    return out


def check_differences(differences: dict[str, float], where: str) -> None:
    """Bitwise equal to recompute, and the ring forward run once per layer instead of twice."""
    assert differences, where
    for name, value in differences.items():
        tag, mode, measure = name.split("/")
        if measure == "forwards":
            want = 2 * LAYERS if mode == "recompute" else LAYERS
            assert value == want, f"{where} {name}: {value:g} ring forwards, want {want}"
        else:
            assert value == 0.0, f"{where} {name}: differs from recompute by {value:.2e}"
