"""FSDP with gradient accumulation (issue 17, item 4): the trainer's micro-steps
(``ringft.train.integrations.run_micro_steps``) do not use ``no_sync`` under FSDP, so every
micro-step reduce-scatters and a rank only ever holds its gradient shard; the accumulated sharded
gradients equal one big step's.

accelerate runs FSDP only on accelerators, so this wraps the model with torch's FSDP (version 1,
``use_orig_params=True``, one unit per decoder layer: what recipes/accelerate/fsdp.yaml asks for)
directly, on CPU with gloo, 2 ranks x 2 micro-steps x 1 sequence.

Tolerance: the runs compute the same fp32 values with the sums in another order (per micro-step and
per shard vs one batch; chunked vs whole logits): eps32 x (tokens + vocab + hidden + intermediate)
relative to the largest gradient entry, as in tests/model/test_memory_options.py.

In the same processes, FSDP1 and FSDP2 (one unit per decoder layer and the root) under the policy
accelerate builds for ``mixed_precision: bf16``, as ringft's trainers adjust it
(``configure_fsdp_precision``: fp32 gradient reduction, FSDP1 buffers not cast). FSDP2's policy
keeps ``output_dtype=bf16``, which also casts the root's output: the loss. Both loss paths
(``run_micro_steps`` over ``CausalLMLoss``, and the mixin's ``ring_loss``) must log the fp32 loss
and give the fp32 sum of the per-micro-step bf16 gradients; FSDP1 must leave the rotary ``inv_freq``
fp32. Oracle: a bf16 copy of the model in one process, each micro-batch alone (the ranks' shapes, so
the same bf16 kernels), fp64 sums. Tolerance ``BF16_RTOL``: the same values summed in another order,
4 fp32 additions (4 eps32); bf16's own resolution (2^-8 relative, what the loss had when read from
the cast output) is 2^13 times larger.

Last in the same processes (its ``end_training`` closes the group): ``ringft train``'s Trainer on a
Qwen3-MoE with its router load-balancing loss (tests/train/moe_runs.py) at dp=1 x cp=2, under FSDP2
as accelerate prepares it from the shipped recipes/accelerate/fsdp2.yaml (``fsdp2_prepare_model``:
one unit per decoder layer, the experts' and routers' parameters DTensors sharded over the 2
ranks); then, on rank 0, the same recipe in one plain process. Tolerances: tests/train/moe_runs.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from ringft.utils.spawn import run_distributed
from tests.tiny_training import assert_updates_close, final_weights
from tests.train.moe_runs import (
    MOE_LOSS_RTOL,
    MOE_UPDATE_RTOL,
    expert_parameter_names,
    fsdp2_moe_runs,
    moe_recipe,
    save_moe,
    transformers_first_step_loss,
)

SEQ, VOCAB, HIDDEN, INTERMEDIATE = 48, 300, 32, 64
TOKENS = 4 * SEQ  # the global batch: 2 ranks x 2 micro-steps x 1 sequence
RTOL = torch.finfo(torch.float32).eps * (TOKENS + VOCAB + HIDDEN + INTERMEDIATE)
BF16_RTOL = 4 * torch.finfo(torch.float32).eps


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)


def _batch(example: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + example)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[:, : 5 * example] = -100  # examples hold different numbers of targets
    return {"input_ids": ids, "position_ids": torch.arange(SEQ)[None], "shift_labels": labels}


def _fsdp_worker(rank: int, world: int, sync_kind: str, moe: dict) -> dict:
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from ringft.loss import CausalLMLoss, loss_normalization
    from ringft.train.integrations import run_micro_steps

    model = _model()
    total = sum(p.numel() for p in model.parameters())  # (before FSDP shards them)
    reference = CausalLMLoss(copy.deepcopy(model), chunked=True, chunk_size=16, offload_activations=False)
    everything = [_batch(i) for i in range(world * 2)]
    big = {k: torch.cat([b[k] for b in everything]) for k in everything[0]}
    n_all = (big["shift_labels"] != -100).sum()
    reference(**big, num_items_in_batch=n_all).backward()  # one big step, one process
    expected = {n: p.grad for n, p in reference.named_parameters()}

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    wrapped = FSDP(
        CausalLMLoss(model, chunked=True, chunk_size=16, offload_activations=False),
        auto_wrap_policy=policy,
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    mine = [everything[2 * rank + m] for m in range(2)]  # this rank's micro-steps
    norm = loss_normalization([b["shift_labels"] for b in mine])  # over both ranks and micro-steps
    held: list[int] = []

    def backward(loss: torch.Tensor) -> None:
        loss.backward()
        held.append(sum(p.grad.numel() for p in wrapped.parameters() if p.grad is not None))

    run_micro_steps(wrapped, mine, norm, sync_kind, backward=backward)
    with FSDP.summon_full_params(wrapped, with_grads=True):
        got = {n.replace("_fsdp_wrapped_module.", ""): p.grad.clone() for n, p in wrapped.named_parameters()}
    errors = {n: ((got[n] - g).abs().max() / g.abs().max()).item() for n, g in expected.items()}
    bf16 = _bf16_runs(rank, everything, n_all)
    moe_out = fsdp2_moe_runs(rank, world, **moe)  # last: the Trainer's end_training closes the group
    return {"held": held, "total": total, "errors": errors, "bf16": bf16, "moe": moe_out}


def _rel(got: dict, expected: dict) -> dict[str, float]:
    return {n: ((got[n].double() - g).abs().max() / g.abs().max()).item() for n, g in expected.items()}


def _bf16_policy(version: int):
    """accelerate's policy for ``mixed_precision: bf16`` and FSDP ``version``, as ringft adjusts it."""
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin

    from ringft.train.hf.precision import configure_fsdp_precision

    plugin = FullyShardedDataParallelPlugin(fsdp_version=version)
    plugin.set_mixed_precision("bf16")
    configure_fsdp_precision(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)))
    return plugin.mixed_precision_policy


def _wrap(module, layers, version: int):
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    policy = _bf16_policy(version)
    if version == 1:
        wrap = ModuleWrapPolicy({type(layers[0])})
        return FullyShardedDataParallel(
            module,
            auto_wrap_policy=wrap,
            device_id=torch.device("cpu"),
            use_orig_params=True,
            mixed_precision=policy,
        )
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    return fully_shard(module, mp_policy=policy)


def _full_grads(wrapped, version: int, prefix: str = "") -> dict[str, torch.Tensor]:
    if version == 2:
        return {prefix + n: p.grad.full_tensor() for n, p in wrapped.named_parameters()}
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(wrapped, with_grads=True):
        return {
            prefix + n.replace("_fsdp_wrapped_module.", ""): p.grad.clone()
            for n, p in wrapped.named_parameters()
        }


def _bf16_runs(rank: int, everything: list[dict], n_all: torch.Tensor) -> dict:
    """Both loss paths under the bf16 policies (see the module docstring): the logged loss's and
    the gradients' relative errors, the dtypes of the mixin's losses and of the buffers."""
    import torch.distributed as dist

    from ringft.loss import CausalLMLoss, loss_normalization
    from ringft.train.hf.forward import install_ring_loss_forward, ring_loss
    from ringft.train.integrations import FSDP, run_micro_steps

    world = dist.get_world_size()
    reference = CausalLMLoss(_model(), chunked=True, chunk_size=16, offload_activations=False)
    for p in reference.parameters():  # bf16 parameters, fp32 buffers (rotary inv_freq)
        p.data = p.data.to(torch.bfloat16)
    want_loss, want = torch.zeros((), dtype=torch.float64), {}
    for batch in everything:  # each micro-batch alone, scaled as the ranks scale it (a power of 2: exact)
        reference.zero_grad(set_to_none=True)
        loss = reference(**batch, num_items_in_batch=n_all, loss_scale=world)
        loss.backward()
        want_loss += loss.double() / world
        for n, p in reference.named_parameters():
            want[n] = want.get(n, 0) + p.grad.double() / world  # FSDP averages over the world

    mine = [everything[2 * rank + m] for m in range(2)]
    norm = loss_normalization([b["shift_labels"] for b in mine])
    out = {}
    for version in (2, 1):
        inner = _model()
        module = CausalLMLoss(inner, chunked=True, chunk_size=16, offload_activations=False)
        wrapped = _wrap(module, inner.model.layers, version)
        logged = run_micro_steps(wrapped, mine, norm, FSDP)
        dist.all_reduce(logged)
        out[f"CausalLMLoss FSDP{version}"] = {
            "loss": abs(logged.item() / want_loss.item() - 1),
            "grads": _rel(_full_grads(wrapped, version), want),
            "buffers": {str(b.dtype) for b in inner.buffers()},
        }
    lm = _model()
    install_ring_loss_forward(lm, chunk_size=16, offload_activations=False)
    lm = _wrap(lm, lm.model.layers, 2)
    logged, dtypes = torch.zeros(()), set()
    for batch in mine:
        loss = ring_loss(lm, batch, norm.num_items_in_batch, norm.loss_scale)
        dtypes.add(str(loss.dtype))
        loss.backward()
        logged += loss.detach() / norm.loss_scale
    dist.all_reduce(logged)
    out["ring_loss FSDP2"] = {
        "loss": abs(logged.item() / want_loss.item() - 1),
        "grads": _rel(_full_grads(lm, 2, "model."), want),
        "dtypes": dtypes,
    }
    return out


@pytest.fixture(scope="module")
def fsdp_spawn(tmp_path_factory, data_path) -> dict:
    """The 2-rank spawn of every test here; ``root``: the MoE runs' folder."""
    from ringft.train.integrations import FSDP

    root = tmp_path_factory.mktemp("fsdp")
    model = save_moe(root / "moe")
    moe = {
        "ring": moe_recipe(root / "fsdp2-moe", data_path, model, dp=1, cp=2),
        "one": moe_recipe(root / "one-moe", data_path, model, dp=1, cp=1),
        "store": str(root / "store"),
    }
    return {"ranks": run_distributed(_fsdp_worker, 2, FSDP, moe, timeout=210), "root": root}


@pytest.mark.numerics
@pytest.mark.timeout(240)
def test_fsdp_micro_steps_reduce_scatter_and_match_one_big_step(fsdp_spawn):
    for rank, out in enumerate(fsdp_spawn["ranks"]):
        worst = max(out["errors"], key=out["errors"].get)
        assert out["errors"][worst] <= RTOL, f"rank {rank}: grad {worst} off by {out['errors'][worst]:.2e}"
        # after the first micro-step the rank holds its shard of the gradients (about half), not all
        shard = out["total"] / 2 + 64  # + FSDP's padding of each flat parameter to a multiple of 2
        assert out["held"][0] <= shard, f"rank {rank}: {out['held'][0]} gradient entries of {out['total']}"
        # accelerate's bf16 policies as ringft adjusts them: the fp32 loss, fp32 sums of bf16 gradients
        for path, res in out["bf16"].items():
            assert res["loss"] <= BF16_RTOL, f"rank {rank} {path}: logged loss off by {res['loss']:.2e}"
            worst = max(res["grads"], key=res["grads"].get)
            assert res["grads"][worst] <= BF16_RTOL, (
                f"rank {rank} {path}: grad {worst} {res['grads'][worst]:.2e}"
            )
            assert res.get("buffers", {"torch.float32"}) == {"torch.float32"}, (path, res["buffers"])
        assert out["bf16"]["ring_loss FSDP2"]["dtypes"] == {"torch.float32"}, out["bf16"]


@pytest.mark.numerics
@pytest.mark.timeout(240)
def test_fsdp2_moe_router_loss_matches_one_process(fsdp_spawn, data_path):
    """``ringft train`` under fsdp2.yaml's FSDP2, dp=1 x cp=2, a Qwen3-MoE with its router loss ==
    one process: logged losses (the first == transformers' own forward loss), grad norms, the
    exported update of every weight (experts and routers included); the experts and routers were
    DTensors sharded on the expert (row) dim, half on each rank."""
    from safetensors.torch import load_file

    root = fsdp_spawn["root"]
    ring, one = fsdp_spawn["ranks"][0]["moe"], fsdp_spawn["ranks"][0]["moe"]["one"]
    assert one[0] == pytest.approx(
        transformers_first_step_loss(str(root / "moe"), data_path), rel=MOE_LOSS_RTOL
    )
    assert ring["losses"] == pytest.approx(one, rel=MOE_LOSS_RTOL)

    def grad_norms(out: Path) -> list[float]:
        return [json.loads(line)["grad_norm"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    assert grad_norms(root / "fsdp2-moe") == pytest.approx(grad_norms(root / "one-moe"), rel=MOE_UPDATE_RTOL)
    start = load_file(str(root / "moe" / "model.safetensors"))
    got, want = final_weights(root / "fsdp2-moe"), final_weights(root / "one-moe")
    assert_updates_close(got, want, start, MOE_UPDATE_RTOL)
    for name in expert_parameter_names(want):
        assert not torch.equal(want[name], start[name]), name
    for rank, out in enumerate(fsdp_spawn["ranks"]):
        held = out["moe"]["experts"]
        assert len(held) == 2 * 3, sorted(held)  # per layer: the fused gate_up / down experts, the router
        for name, h in held.items():
            assert h["placements"] == ["S(0)"] and h["local"] == [h["shape"][0] // 2, *h["shape"][1:]], (
                rank,
                name,
                h,
            )


def test_fsdp_precision_policy_reduces_in_fp32_and_keeps_buffers():
    """``configure_fsdp_precision`` on accelerate's bf16 policies: fp32 reduce, bf16 compute kept
    (and FSDP2's bf16 outputs), FSDP1 buffers not cast; a second call and no policy change nothing."""
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin

    from ringft.train.hf.precision import configure_fsdp_precision

    for version in (1, 2):
        policy = _bf16_policy(version)
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32), policy
        if version == 1:
            assert policy.buffer_dtype is None, policy
        else:
            assert policy.output_dtype == torch.bfloat16, policy
        plugin = FullyShardedDataParallelPlugin(fsdp_version=version)
        accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))
        assert configure_fsdp_precision(accelerator) is None  # mixed_precision "no": no policy
        plugin.set_mixed_precision("bf16")
        assert "gradients reduced in fp32" in configure_fsdp_precision(accelerator)
        assert configure_fsdp_precision(accelerator) is None
