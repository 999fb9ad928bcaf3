"""What the trainer builds, checked against what it must be: fp32 master weights
for bf16 full fine-tuning under DDP, RoPE scaling keeping the pretraining length, weight decay on
the matrices of a ZeRO-3-partitioned model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ringft.train.build import build_model, decay_parameter_names, model_config
from ringft.train.errors import RecipeError
from ringft.train.recipe import recipe_from_dict
from tests.tiny_training import VOCAB, final_weights, in_process_front, tiny_recipe


def _train_in_process(raw: dict) -> dict[str, torch.Tensor]:
    with in_process_front(raw) as run:
        run.run()
    return final_weights(raw["checkpoint"]["output_dir"])


@pytest.mark.numerics
@pytest.mark.timeout(300)
def test_bf16_full_finetune_keeps_small_updates(tmp_path, short_data):
    """bf16 weights, full fine-tuning, no DeepSpeed / FSDP: 20 AdamW steps at lr 3e-5, each smaller
    than half the bf16 spacing of a typical weight (|w| ~ 0.02: spacing 1.2e-4), must add up as in
    fp32. Compared with the same run in fp32 (same initial weights, rounded to bf16 for the bf16 run):

    - the final bf16 weights are the fp32 masters rounded once to nearest: an error of at most half
      a spacing per moved entry, uniform over that interval, so an RMS of half a spacing / sqrt(3)
      (``rounding`` below, as a norm relative to the fp32 run's update);
    - the bf16 forward / backward rounds the gradients about as much (AdamW passes relative gradient
      errors into the update), so the bound is twice that rounding;
    - without master weights most steps are rounded away: the update error is ~85 % (measured).
    """
    train = {"lr": 3e-5, "max_steps": 20, "warmup_steps": 0, "schedule": "constant", "micro_batch_size": 2}
    runs = {
        dtype: _train_in_process(
            tiny_recipe(tmp_path / dtype, short_data, model={"dtype": dtype}, train=train)
        )
        for dtype in ("fp32", "bf16")
    }
    start = build_model(
        recipe_from_dict(tiny_recipe(tmp_path / "x", short_data)), vocab_size=VOCAB
    ).state_dict()
    err2 = ref2 = rounding2 = 0.0
    for name, w0 in start.items():
        update32 = runs["fp32"][name] - w0
        update16 = runs["bf16"][name].float() - w0.to(torch.bfloat16).float()
        final = runs["fp32"][name].abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
        half_spacing = torch.exp2(torch.floor(torch.log2(final)) - 8)  # bf16: 8 significant bits
        half_spacing = half_spacing * (update32 != 0)  # an entry that never moved is not rounded
        err2 += float((update16 - update32).double().norm() ** 2)
        ref2 += float(update32.double().norm() ** 2)
        rounding2 += float(half_spacing.double().norm() ** 2)
    error, rounding = math.sqrt(err2 / ref2), math.sqrt(rounding2 / ref2 / 3)
    assert rounding < 0.3, f"the test's updates are too small to be seen in bf16 ({rounding:.2f})"
    assert error <= 2 * rounding, (
        f"bf16 update differs by {error:.2f} of the fp32 update (bound {2 * rounding:.2f})"
    )


def _rope_recipe(tmp_path, rope_scaling: dict, cp: int = 1) -> dict:
    return tiny_recipe(
        tmp_path / "out",
        tmp_path,
        parallel={"cp_size": cp},
        model={"rope_scaling": rope_scaling, "max_position_embeddings": 512},  # pretrained at 128
    )


ROPES = {
    "yarn": {"rope_type": "yarn", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.1, 1.2, 1.3],
        "long_factor": [2.0, 2.5, 3.0, 4.0],
    },
}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_rope_scaling_keeps_the_pretraining_length(tmp_path, kind):
    """A model pretrained at 128 positions, extended to 512 with YaRN / llama3 / longrope: the
    frequencies must be computed from the *pretraining* length (128), as a transformers model
    configured by hand computes them, not from the new 512."""
    from transformers import LlamaConfig, LlamaForCausalLM

    raw = _rope_recipe(tmp_path, ROPES[kind])
    model = build_model(recipe_from_dict(raw), vocab_size=VOCAB)
    assert model.config.rope_parameters["original_max_position_embeddings"] == 128
    kwargs = {
        **raw["model"]["config"],
        "max_position_embeddings": 512,
        "vocab_size": VOCAB,
        "rope_parameters": {"rope_theta": 10000.0, **ROPES[kind], "original_max_position_embeddings": 128},
    }
    reference = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    reference.load_state_dict(model.state_dict())
    ours, theirs = model.model.rotary_emb, reference.model.rotary_emb
    assert torch.equal(ours.inv_freq, theirs.inv_freq)
    assert ours.attention_scaling == theirs.attention_scaling
    ids = torch.randint(3, 200, (1, 300), generator=torch.Generator().manual_seed(0))  # past 128
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_position_dependent_rope_refused_with_cp(tmp_path):
    """dynamic NTK in the model's own config (not the recipe's rope_scaling) is refused with CP > 1
    before any weight loads; with cp 1 it is built."""
    raw = tiny_recipe(tmp_path / "out", tmp_path, parallel={"cp_size": 2})
    raw["model"]["config"]["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(RecipeError, match=r"RoPE type 'dynamic' is not exact with parallel.cp_size=2"):
        model_config(recipe_from_dict(raw), VOCAB)
    raw["parallel"]["cp_size"] = 1
    model_config(recipe_from_dict(raw), VOCAB)


def test_weight_decay_groups_read_the_zero3_shape(tmp_path):
    """Under deepspeed.zero.Init every parameter is a 1-D partition with its real shape in
    ``ds_shape``: matrices must still decay, norm weights must not."""
    model = build_model(recipe_from_dict(tiny_recipe(tmp_path / "out", tmp_path)), vocab_size=VOCAB)
    for p in model.parameters():  # what zero.Init leaves behind
        p.ds_shape = p.shape
        p.data = p.data.reshape(-1)[:1].clone()
    decay = decay_parameter_names(model)
    assert sorted(decay) == sorted(n for n, p in model.named_parameters() if len(p.ds_shape) >= 2)
    assert any("proj" in n for n in decay) and len(decay) == 9


def test_bf16_weights_need_mixed_precision_under_deepspeed_or_fsdp(tmp_path):
    """DeepSpeed / FSDP keep fp32 master weights only in their bf16 mixed-precision mode: bf16
    weights with the launch config's mixed_precision "no" are refused (under DDP ringft keeps the
    masters itself)."""
    from ringft.train.front_launch import check_master_precision

    recipe = recipe_from_dict(tiny_recipe(tmp_path / "out", tmp_path, model={"dtype": "bf16"}))
    for kind in ("deepspeed", "fsdp"):
        with pytest.raises(RecipeError, match=r"model.dtype bf16 under .* set mixed_precision: bf16"):
            check_master_precision(kind, "no", recipe)
        check_master_precision(kind, "bf16", recipe)
    check_master_precision("ddp", "no", recipe)


def test_no_collective_in_except_or_finally():
    """An error on one rank must end every rank promptly: no ``except`` / ``finally`` block of the
    training code may call a collective (it would wait for ranks that are elsewhere)."""
    import ast
    from pathlib import Path

    import ringft.loss
    import ringft.train

    collectives = {
        "barrier",
        "all_reduce",
        "all_gather",
        "all_gather_object",
        "broadcast",
        "broadcast_object_list",
        "reduce",
        "reduce_scatter",
        "gather",
        "scatter",
        "wait_for_everyone",
        "save_state",
        "load_state",
        "get_state_dict",
        "save_checkpoint",
        "export_final",
        "loss_normalization",
        "_same_on_every_rank",
    }
    found = []
    for package in (ringft.train, ringft.loss):
        for path in sorted(Path(package.__file__).parent.glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                handlers = [h.body for h in getattr(node, "handlers", [])] + [getattr(node, "finalbody", [])]
                for body in handlers:
                    for call in (c for stmt in body for c in ast.walk(stmt) if isinstance(c, ast.Call)):
                        name = getattr(call.func, "attr", getattr(call.func, "id", ""))
                        if name in collectives:
                            found.append(f"{path.name}:{call.lineno} {name}")
    assert not found, found


@pytest.mark.timeout(120)
def test_save_final_false_writes_nothing_at_the_end(tmp_path, short_data):
    """``checkpoint.save_final: false`` (benchmark runs): the steps run and are logged (the last
    one too, off the ``log_every`` grid), and neither the last checkpoint (which the Trainer writes
    when it saves every N steps) nor the export is written; the checkpoints before it are."""
    saves = {"save_final": False, "save_every": 1}
    raw = tiny_recipe(
        tmp_path / "run", short_data, train={"max_steps": 3}, checkpoint=saves, logging={"log_every": 2}
    )
    with in_process_front(raw) as run:
        result = run.run()
    out = tmp_path / "run"
    assert result.steps == 3 and len(result.losses) == 2 and result.final_dir is None
    assert not (out / "final").exists()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint-1",
        "checkpoint-2",
    ]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3]


def test_recipe_attention_tiles_reach_the_ring(tmp_path, short_data):
    """train.attention_tile_tokens is what the patched attention's RingSpec carries (one rank)."""
    from ringft.model.patch import ring_spec

    raw = tiny_recipe(tmp_path / "out", short_data, train={"attention_tile_tokens": 48})
    with in_process_front(raw) as run:
        assert ring_spec(run.model).attention_tile_tokens == 48


def test_decay_names_survive_wrappers_and_lost_matrices_are_refused(tmp_path):
    """The decayed matrices are found again under the wrappers accelerate adds before the
    optimizer is built (FSDP1's activation checkpointing renames every layer's parameters); a
    wrapper that loses them (FSDP1's flat parameters) is refused while weight decay is on."""
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from ringft.train.build import decayed_parameters, unwrapped_name

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    decay = set(decay_parameter_names(model))
    assert decay == {"0.weight", "2.weight"}
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Linear))
    names = decayed_parameters(model, decay, 0.1)
    assert len(names) == 2 and all("_checkpoint_wrapped_module" in n for n in names), names
    assert {unwrapped_name(n) for n in names} == decay
    flat = nn.Linear(4, 4)  # parameters under other names: nothing of ``decay`` is there
    with pytest.raises(RecipeError, match="fsdp_use_orig_params: true"):
        decayed_parameters(flat, decay, 0.1)
    assert decayed_parameters(flat, decay, 0.0) == []  # no decay: nothing to lose


def test_fsdp_export_keeps_each_tensors_loaded_dtype_and_resume_needs_a_saved_state(tmp_path):
    """FSDP's gathered fp32 masters go back to each tensor's dtype as loaded (bf16 weights, fp32
    LoRA adapters and fp32-kept modules, integer buffers untouched); the FSDP1 optimizer state is
    created for a resume only when the checkpoint holds one."""
    from ringft.train.front_runs import in_loaded_dtypes
    from ringft.train.hf.fsdp_resume import has_optimizer_state

    state = {
        "w": torch.randn(3, dtype=torch.float32),
        "lora_A": torch.randn(3, dtype=torch.float32),
        "steps": torch.arange(3),
        "unknown": torch.randn(2),
    }
    dtypes = {"w": torch.bfloat16, "lora_A": torch.float32, "steps": torch.int64}
    out = in_loaded_dtypes(state, dtypes)
    assert {k: v.dtype for k, v in out.items()} == {
        "w": torch.bfloat16,
        "lora_A": torch.float32,
        "steps": torch.int64,
        "unknown": torch.float32,
    }
    assert torch.equal(out["w"], state["w"].to(torch.bfloat16)) and out["lora_A"] is state["lora_A"]
    assert not has_optimizer_state(tmp_path)
    (tmp_path / "optimizer_0").mkdir()
    assert has_optimizer_state(tmp_path)


def test_an_eval_split_never_evaluated_is_named(tmp_path, short_data, capsys):
    """Rows held out for evaluation without train.eval_every would silently leave training: warned."""
    raw = tiny_recipe(tmp_path / "out", short_data, data={"eval_fraction": 0.25})
    with in_process_front(raw):
        pass
    assert "the eval split is never evaluated (train.eval_every: 0)" in capsys.readouterr().out
