"""``ringft train``'s Trainer engine (transformers' Trainer with the ring mixin) under FSDP1 and FSDP2,
as ``accelerate launch`` with the shipped recipes/accelerate/fsdp.yaml / fsdp2.yaml prepares it,
on CPU / gloo (tests/train/fsdp_launch.py emulates the launch: accelerate runs FSDP only on
accelerators), 2 ranks, in one spawn:

- FSDP1 (fsdp.yaml, ``SHARDED_STATE_DICT`` checkpoints), dp=2, micro-batch 1 x grad_accum 2, weight
  decay, a checkpoint every 2 steps == one process with micro-batch 4: the logged losses, grad norms
  and the exported update (the export gathers the sharded model). The Trainer enters no ``no_sync``
  (the mixin sets ``sync_each_batch``): after the first micro-step a rank holds only its gradient
  shard, not the ~15 GiB of unsharded bf16 gradients an 8B model's no_sync would keep. ``--resume``
  from the sharded step-2 checkpoint replays steps 3 and 4 bit-exactly.
- FSDP2 (fsdp2.yaml) on a Qwen3-MoE with its router load-balancing loss (tests/train/moe_runs.py) at
  dp=1 x cp=2 == one process: losses (the first == transformers' own forward loss), grad norms, the
  exported update of every weight; the experts and routers are DTensors sharded over the 2 ranks.
- FSDP2 under the shipped ``mixed_precision: bf16`` with a bf16 model: fp32 master weights (the
  sharded parameters the optimizer steps), the policy as ringft adjusts it
  (``configure_fsdp_precision``: fp32 gradient reduction, FSDP2's bf16 outputs kept) and the fp32
  loss the training step returns although the root's output is cast to bf16; a bf16 model under
  ``mixed_precision: no`` is refused before anything loads.

The dense and MoE one-process references run first, one per rank, before the group forms.
Tolerances: tests/tiny_training.py's (LOSS_RTOL, UPDATE_RTOL: reordered fp32 sums) and
tests/train/moe_runs.py's; a resume replays the same operations: bit-exact.

In the same processes, the mixin's loss (``ring_loss``) under accelerate's bf16 policies as ringft
adjusts them, FSDP1 and FSDP2 wrapped by torch directly (one unit per decoder layer and the root):
it must give the fp32 loss and the fp32 sum of the per-micro-step bf16 gradients; FSDP1 must leave
the rotary ``inv_freq`` fp32. Oracle: a bf16 copy of the model in one process, each micro-batch
alone (the ranks' shapes, so the same bf16 kernels), fp64 sums. Tolerance ``BF16_RTOL``: the same
values summed in another order, 4 fp32 additions (4 eps32); bf16's own resolution (2^-8 relative,
what the loss had when read from the cast output) is 2^13 times larger.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ringft.utils.spawn import run_distributed
from tests.tiny_training import (
    LOSS_RTOL,
    UPDATE_RTOL,
    assert_updates_close,
    assert_weights_equal,
    final_weights,
    initial_weights,
    tiny_recipe,
)
from tests.train.moe_runs import (
    MOE_LOSS_RTOL,
    MOE_UPDATE_RTOL,
    expert_parameter_names,
    moe_recipe,
    save_moe,
    transformers_first_step_loss,
)

SEQ, VOCAB, HIDDEN, INTERMEDIATE = 48, 300, 32, 64  # the bf16 policy runs' Llama
BF16_RTOL = 4 * torch.finfo(torch.float32).eps
SPAWN_TIMEOUT = 420
WEIGHT_DECAY = 0.5  # decays by lr * 0.5 * w = ~1 % of an AdamW step at lr 1e-3: left off, visible


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


def _bf16_runs(rank: int) -> dict:
    """The mixin's loss under the bf16 policies (see the module docstring): per FSDP version the
    logged loss's and the gradients' relative errors, the losses' dtypes, the buffers' dtypes."""
    import torch.distributed as dist

    from ringft.loss import CausalLMLoss
    from ringft.train.hf.forward import install_ring_loss_forward, ring_loss

    world = dist.get_world_size()
    everything = [_batch(i) for i in range(world * 2)]
    n_all = sum((b["shift_labels"] != -100).sum() for b in everything)
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
            want[n.removeprefix("model.")] = want.get(n.removeprefix("model."), 0) + p.grad.double() / world

    mine = [everything[2 * rank + m] for m in range(2)]  # this rank's micro-steps
    out = {}
    for version in (2, 1):
        lm = _model()
        install_ring_loss_forward(lm, chunk_size=16, offload_activations=False)
        wrapped = _wrap(lm, lm.model.layers, version)
        logged, dtypes = torch.zeros(()), set()
        for batch in mine:
            loss = ring_loss(wrapped, batch, n_all, world)
            dtypes.add(str(loss.dtype))
            loss.backward()
            logged += loss.detach() / world
        dist.all_reduce(logged)
        out[f"ring_loss FSDP{version}"] = {
            "loss": abs(logged.item() / want_loss.item() - 1),
            "grads": _rel(_full_grads(wrapped, version), want),
            "dtypes": dtypes,
            "buffers": {str(b.dtype) for b in lm.buffers()},
        }
    return out


def _front(raw: dict, config: str, mixed_precision: str | None = None, resume: bool = False) -> dict:
    """``ringft train`` of ``raw`` under the emulated launch of ``config``: the logged losses and
    what the launch recorded; the experts' / routers' placements (MoE), the policy and the sharded
    parameters' dtypes."""
    from torch.distributed.tensor import DTensor

    from ringft.train import front
    from ringft.train.recipe import recipe_from_dict
    from tests.train.fsdp_launch import fsdp_launch

    with fsdp_launch(config, mixed_precision) as record:
        recipe = recipe_from_dict(raw)
        trainer, folder = front.build_trainer(recipe, resume=resume, progress=False)
        try:
            losses = front._run(trainer, folder, recipe).losses
        finally:
            folder.release()
    experts = {}
    for name, p in trainer.model.named_parameters():
        if ".mlp.experts." in name or ".mlp.gate." in name:
            placements = [str(x) for x in p.placements] if isinstance(p, DTensor) else None
            local = p.to_local() if isinstance(p, DTensor) else p
            experts[name] = {"shape": list(p.shape), "local": list(local.shape), "placements": placements}
    policy = trainer.accelerator.state.fsdp_plugin.mixed_precision_policy
    return {
        "losses": losses,
        "start_step": folder.start_step,
        "no_sync": record.no_sync,
        "held": record.held,
        "loss_dtypes": record.loss_dtypes,
        "param_dtypes": {str(p.dtype) for p in trainer.model.parameters()},
        "policy": None if policy is None else {k: str(v) for k, v in vars(policy).items()},
        "experts": experts,
    }


def _refused(raw: dict) -> str:
    """The error ``ringft train`` of ``raw`` (a bf16 model) raises under fsdp2.yaml with
    ``mixed_precision: no``."""
    from ringft.train import front
    from ringft.train.errors import RecipeError
    from ringft.train.recipe import recipe_from_dict
    from tests.train.fsdp_launch import fsdp_launch

    with fsdp_launch("fsdp2.yaml", "no"), pytest.raises(RecipeError) as caught:
        front.build_trainer(recipe_from_dict(raw), progress=False)
    return str(caught.value)


def _fsdp_worker(rank: int, world: int, plan: dict) -> dict:
    """The one-process references (``alone``: one per rank, before the group), then the runs of
    the module docstring in a fresh ``world``-rank group."""
    import torch.distributed as dist

    from tests.train.hf_runs import _DIST_ENV
    from tests.workers import fresh_group, one_thread

    one_thread()
    saved = {k: os.environ.pop(k) for k in _DIST_ENV if k in os.environ}
    dist.destroy_process_group()
    os.environ["WORLD_SIZE"] = "1"
    alone = _front_plain(plan["alone"][rank])
    os.environ.update(saved)
    out: dict[str, Any] = {"alone": alone, "refused": _refused(plan["refused"])}
    fresh_group(plan["store"], 0, rank, world)
    out["bf16"] = _bf16_runs(rank)
    for i, (name, raw, config, mixed, resume) in enumerate(plan["runs"], start=1):
        if name == "fsdp1-resumed" and rank == 0:  # only the step-2 checkpoint, written by "fsdp1"
            first = Path(plan["runs"][0][1]["checkpoint"]["output_dir"])
            again = Path(raw["checkpoint"]["output_dir"])
            shutil.copytree(first, again, ignore=shutil.ignore_patterns("final", "metrics.jsonl", "logs"))
            shutil.rmtree(again / "checkpoint-4")
        fresh_group(plan["store"], i, rank, world)  # (a barrier: the copy is done)
        out[name] = _front(raw, config, mixed, resume)
    return out


def _front_plain(raw: dict) -> list[float]:
    """``ringft train`` of ``raw`` in this process alone (no launch): its logged losses."""
    from tests.tiny_training import in_process_front

    with in_process_front(raw) as run:
        return run.run().losses


@pytest.fixture(scope="module")
def fsdp_spawn(tmp_path_factory, data_path) -> dict:
    """The 2-rank spawn of every test here; ``root``: the runs' folder."""
    root = tmp_path_factory.mktemp("fsdp")
    moe = save_moe(root / "moe")
    wd = {"weight_decay": WEIGHT_DECAY}
    dense = tiny_recipe(
        root / "fsdp1",
        data_path,
        train={"micro_batch_size": 1, "grad_accum": 2, **wd},
        checkpoint={"save_every": 2, "keep": 3},
    )
    bf16 = tiny_recipe(root / "bf16", data_path, model={"dtype": "bf16"}, train={"max_steps": 2})
    plan = {
        "alone": [
            tiny_recipe(root / "one", data_path, train={"micro_batch_size": 4, **wd}),
            moe_recipe(root / "one-moe", data_path, moe, dp=1, cp=1),
        ],
        "refused": tiny_recipe(root / "refused", data_path, model={"dtype": "bf16"}),
        "runs": [
            ("fsdp1", dense, "fsdp.yaml", "no", False),
            (
                "fsdp1-resumed",
                {**dense, "checkpoint": {**dense["checkpoint"], "output_dir": str(root / "again")}},
                "fsdp.yaml",
                "no",
                True,
            ),
            (
                "fsdp2-moe",
                moe_recipe(root / "fsdp2-moe", data_path, moe, dp=1, cp=2),
                "fsdp2.yaml",
                "no",
                False,
            ),
            ("fsdp2-bf16", bf16, "fsdp2.yaml", None, False),
        ],
        "store": str(root / "store"),
    }
    ranks = run_distributed(_fsdp_worker, 2, plan, timeout=SPAWN_TIMEOUT)
    return {"ranks": ranks, "root": root, "dense": dense}


def _metric(output_dir: Path, key: str = "loss") -> list[float]:
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows]


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT + 60)
def test_fsdp1_trainer_matches_one_process_shards_gradients_and_resumes(fsdp_spawn):
    root, ranks = fsdp_spawn["root"], fsdp_spawn["ranks"]
    one = ranks[0]["alone"]
    for rank, out in enumerate(ranks):
        run = out["fsdp1"]
        assert run["losses"] == pytest.approx(one, rel=LOSS_RTOL), rank
        # no no_sync: every micro-step reduce-scatters, so after it the rank holds about half
        assert run["no_sync"] == 0, run["no_sync"]
        total = sum(t.numel() for t in final_weights(root / "one").values())
        assert len(run["held"]) == 2 * 4 and max(run["held"]) <= total / 2 + 64, (run["held"], total)
        assert run["policy"] is None and run["param_dtypes"] == {"torch.float32"}
    assert _metric(root / "fsdp1", "grad_norm") == pytest.approx(
        _metric(root / "one", "grad_norm"), rel=UPDATE_RTOL
    )
    weights = final_weights(root / "fsdp1")
    assert_updates_close(
        weights, final_weights(root / "one"), initial_weights(fsdp_spawn["dense"]), UPDATE_RTOL
    )
    step2 = root / "fsdp1" / "checkpoint-2"
    shards = {p.name for p in (step2 / "pytorch_model_fsdp_0").iterdir()}
    assert {"__0_0.distcp", "__1_0.distcp"} <= shards, shards  # SHARDED_STATE_DICT: one file per rank
    for out in ranks:  # the resumed run: from step 2, the same losses and weights
        assert out["fsdp1-resumed"]["start_step"] == 2
        assert out["fsdp1-resumed"]["losses"] == out["fsdp1"]["losses"][2:]
    assert_weights_equal(final_weights(root / "again"), weights)


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT + 60)
def test_fsdp2_moe_router_loss_matches_one_process(fsdp_spawn, data_path):
    """``ringft train`` under fsdp2.yaml's FSDP2, dp=1 x cp=2, a Qwen3-MoE with its router loss ==
    one process: logged losses (the first == transformers' own forward loss), grad norms, the
    exported update of every weight (experts and routers included); the experts and routers were
    DTensors sharded on the expert (row) dim, half on each rank."""
    from safetensors.torch import load_file

    root = fsdp_spawn["root"]
    one = fsdp_spawn["ranks"][1]["alone"]
    assert one[0] == pytest.approx(
        transformers_first_step_loss(str(root / "moe"), data_path), rel=MOE_LOSS_RTOL
    )

    def grad_norms(out: Path) -> list[float]:
        return _metric(out, "grad_norm")

    assert grad_norms(root / "fsdp2-moe") == pytest.approx(grad_norms(root / "one-moe"), rel=MOE_UPDATE_RTOL)
    start = load_file(str(root / "moe" / "model.safetensors"))
    got, want = final_weights(root / "fsdp2-moe"), final_weights(root / "one-moe")
    assert_updates_close(got, want, start, MOE_UPDATE_RTOL)
    for name in expert_parameter_names(want):
        assert not torch.equal(want[name], start[name]), name
    for rank, out in enumerate(fsdp_spawn["ranks"]):
        run = out["fsdp2-moe"]
        assert run["losses"] == pytest.approx(one, rel=MOE_LOSS_RTOL), rank
        assert run["no_sync"] == 0, run["no_sync"]
        held = run["experts"]
        assert len(held) == 2 * 3, sorted(held)  # per layer: the fused gate_up / down experts, the router
        for name, h in held.items():
            assert h["placements"] == ["S(0)"] and h["local"] == [h["shape"][0] // 2, *h["shape"][1:]], (
                rank,
                name,
                h,
            )


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT + 60)
def test_fsdp_bf16_fp32_masters_fp32_loss_and_reduction(fsdp_spawn):
    """The shipped ``mixed_precision: bf16`` through the Trainer (see the module docstring), and
    the mixin's loss under both versions' bf16 policies against a bf16 oracle."""
    for rank, out in enumerate(fsdp_spawn["ranks"]):
        run = out["fsdp2-bf16"]
        assert run["param_dtypes"] == {"torch.float32"}, run  # the masters the optimizer steps
        assert run["loss_dtypes"] == {"torch.float32"}, run
        policy = run["policy"]
        assert (policy["param_dtype"], policy["reduce_dtype"], policy["output_dtype"]) == (
            "torch.bfloat16",
            "torch.float32",
            "torch.bfloat16",
        ), policy
        assert len(run["losses"]) == 2 and all(0 < x < 10 for x in run["losses"]), run["losses"]
        exported = final_weights(fsdp_spawn["root"] / "bf16")  # model.dtype bf16: a bf16 export
        assert {str(v.dtype) for v in exported.values()} == {"torch.bfloat16"}
        assert "mixed_precision: bf16" in out["refused"], out["refused"]
        for path, res in out["bf16"].items():
            assert res["loss"] <= BF16_RTOL, f"rank {rank} {path}: logged loss off by {res['loss']:.2e}"
            worst = max(res["grads"], key=res["grads"].get)
            assert res["grads"][worst] <= BF16_RTOL, (
                f"rank {rank} {path}: grad {worst} {res['grads'][worst]:.2e}"
            )
            assert res["dtypes"] == {"torch.float32"}, (path, res["dtypes"])
            assert res["buffers"] == {"torch.float32"}, (path, res["buffers"])


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
