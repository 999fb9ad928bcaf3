"""Memory options (tiled MLP, activation offload, chunked loss) change no loss and no gradient.

Oracle: the same tiny fp32 LLaMA, plain (no checkpointing, no offload, full logits), one process.
Comparison: loss relative to the loss, each parameter's gradient relative to the largest entry of
the reference gradient. Checkpoint recompute and ``save_on_cpu`` replay the same fp32 kernels on the
same values (bitwise equal); the tiled MLP and the chunked loss only change the order in which fp32
partial sums are accumulated: over the batch's tokens (weight gradients per tile / chunk, the loss per
chunk) and the vocabulary (log-sum-exp). Recursive summation of n terms is off by at most
(n - 1) * eps relative, so REL = eps32 * (tokens + vocab + hidden + intermediate) (derived below);
any real mistake (a dropped tile, a wrong label, a missing recompute) is O(1e-2) or more. The CP=2
case also reorders the ring's attention sums over the keys (+ seq_len).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from ringft import RingDataCollator, apply_ring_attention
from ringft.loss import CausalLMLoss
from ringft.model.tiled_mlp import disable_tiled_mlp, enable_tiled_mlp, is_tiled_mlp, mlp_modules
from ringft.utils.spawn import run_distributed
from tests.tiny_models import VOCAB, ragged_examples, saved_bytes, tiny_model

EPS32 = torch.finfo(torch.float32).eps
TOKENS = 3 * 52  # the collated batch: 3 ragged examples padded to <= 52 tokens (pads included)
REL = EPS32 * (TOKENS + VOCAB + 64 + 96)  # + vocab (log-sum-exp) + hidden + intermediate of tiny_model
CP_REL = REL + EPS32 * 52  # the ring also reorders the attention sums over <= 52 keys


def _batch(cp_rank: int = 0, cp_size: int = 1, seed: int = 3) -> tuple[dict, dict]:
    collator = RingDataCollator(cp_rank, cp_size, pad_token_id=0)
    examples = ragged_examples(seed)
    return collator(examples), collator.global_batch(examples)


def _step(
    model: torch.nn.Module, batch: dict, chunked: bool = False, offload: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients (by parameter name) of one forward + backward through CausalLMLoss."""
    model.zero_grad(set_to_none=True)
    wrapper = CausalLMLoss(model, chunked=chunked, chunk_size=17, offload_activations=offload)
    loss = wrapper(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        shift_labels=batch["shift_labels"],
        num_items_in_batch=batch["num_items_in_batch"],
    )
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def _assert_close(loss, grads, ref_loss, ref_grads, rel: float, tag: str) -> None:
    assert grads.keys() == ref_grads.keys() and grads
    loss_err = ((loss - ref_loss).abs() / ref_loss.abs()).item()
    assert loss_err <= rel, f"{tag}: loss rel error {loss_err:.2e}"
    for name, g in grads.items():
        ref = ref_grads[name]
        err = ((g - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
        assert err <= rel, f"{tag}: grad {name} rel error {err:.2e}"


def _one_process_batch(seed: int = 3) -> dict:
    batch, full = _batch(seed=seed)
    n = int((full["shift_labels"] != -100).sum())
    return {**full, "num_items_in_batch": torch.tensor(n)}


def _reference(batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return _step(tiny_model("llama"), batch)


def _ckpt(model: torch.nn.Module) -> torch.nn.Module:

    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


@pytest.mark.numerics
@pytest.mark.timeout(120)
def test_tiled_mlp_exact_and_reversible():
    batch = _one_process_batch()
    ref_loss, ref_grads = _reference(batch)
    model = tiny_model("llama")
    enable_tiled_mlp(model, tile_tokens=16)  # 150 tokens -> 10 tiles, the last one partial
    enable_tiled_mlp(model, tile_tokens=16)  # idempotent
    assert is_tiled_mlp(model)
    loss, grads = _step(model, batch)
    _assert_close(loss, grads, ref_loss, ref_grads, REL, "tiled")
    enable_tiled_mlp(model, num_tiles=4)  # settings update in place
    _assert_close(*_step(model, batch), ref_loss, ref_grads, REL, "tiled/4")
    with torch.no_grad():  # inference path: tiles without checkpoints
        plain = tiny_model("llama")(input_ids=batch["input_ids"]).logits
        tiled = model(input_ids=batch["input_ids"]).logits
    assert (tiled - plain).abs().max().item() <= REL * plain.abs().max().item()
    disable_tiled_mlp(model)
    assert not is_tiled_mlp(model)
    assert all("forward" not in m.__dict__ for m in mlp_modules(model))
    _assert_close(*_step(model, batch), ref_loss, ref_grads, REL, "disabled")


@pytest.mark.timeout(120)
def test_tiled_mlp_keeps_only_tile_inputs():
    """The forward saves no ``tokens x intermediate`` tensor: only the MLP input (by tile views)."""
    model = tiny_model("llama", intermediate_size=1000)
    mlp = mlp_modules(model)[0]
    x = torch.randn(2, 64, 64, requires_grad=True)

    plain = saved_bytes(lambda: mlp(x).sum().backward())
    enable_tiled_mlp(model, tile_tokens=32)
    tiled = saved_bytes(lambda: mlp(x).sum().backward())
    assert plain >= 3 * 128 * 1000 * 4  # gate, act(gate), up of all 128 tokens
    assert tiled <= 128 * 64 * 4 * 1.01, (plain, tiled)  # the input only


@pytest.mark.numerics
@pytest.mark.timeout(120)
def test_offload_with_checkpointing_exact():
    batch = _one_process_batch()
    ref_loss, ref_grads = _reference(batch)
    model = _ckpt(tiny_model("llama"))
    _assert_close(*_step(model, batch, offload=True), ref_loss, ref_grads, REL, "offload+ckpt")


@pytest.mark.numerics
@pytest.mark.timeout(120)
def test_all_options_together_exact():
    batch = _one_process_batch()
    ref_loss, ref_grads = _reference(batch)
    model = enable_tiled_mlp(_ckpt(tiny_model("llama")), tile_tokens=16)
    loss, grads = _step(model, batch, chunked=True, offload=True)
    _assert_close(loss, grads, ref_loss, ref_grads, REL, "tiled+offload+ckpt+chunked")


@pytest.mark.numerics
@pytest.mark.timeout(120)
def test_tiled_mlp_with_lora_on_mlp():
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"],
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    batch = _one_process_batch()
    torch.manual_seed(5)
    ref = get_peft_model(tiny_model("llama"), lora)
    model = copy.deepcopy(ref)
    ref_loss, ref_grads = _step(ref, batch)
    enable_tiled_mlp(_ckpt(model), tile_tokens=16)
    loss, grads = _step(model, batch, chunked=True, offload=True)
    assert any("lora_A" in n and "mlp" in n for n in grads)
    _assert_close(loss, grads, ref_loss, ref_grads, REL, "lora+tiled+offload+ckpt+chunked")


def _cp_worker(rank: int, world: int) -> dict[str, float]:
    batch, full = _batch(rank, world, seed=4)
    ref_batch = {**full, "num_items_in_batch": batch["num_items_in_batch"]}
    ref_loss, ref_grads = _reference(ref_batch)
    model = apply_ring_attention(enable_tiled_mlp(_ckpt(tiny_model("llama")), tile_tokens=16))
    loss, grads = _step(model, batch, chunked=True, offload=True)
    dist.all_reduce(loss)
    errors = {"loss": ((loss - ref_loss).abs() / ref_loss.abs()).item()}
    worst = 0.0
    for name, g in grads.items():
        dist.all_reduce(g)  # each CP rank holds a partial gradient of the same replica
        ref = ref_grads[name]
        worst = max(worst, ((g - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item())
    errors["grad"] = worst
    return errors


@pytest.mark.numerics
@pytest.mark.timeout(120)
def test_cp2_tiled_offload_chunked_matches_one_process():
    for rank, errors in enumerate(run_distributed(_cp_worker, 2, timeout=100)):
        assert errors["loss"] <= CP_REL, f"rank {rank}: loss rel error {errors['loss']:.2e}"
        assert errors["grad"] <= CP_REL, f"rank {rank}: grad rel error {errors['grad']:.2e}"
