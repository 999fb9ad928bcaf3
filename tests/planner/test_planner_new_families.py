"""The planner on latent attention (DeepSeek-V3, Mistral 4), Gemma 4 and the Gated DeltaNet hybrids
(Qwen3.5, Qwen3.5-MoE, Qwen3-Next): parameter counts against the transformers models (tiny, and the
presets' full sizes on the meta device), LoRA counts against peft, the Gated DeltaNet layer's saved
tensors against autograd's, the attention terms by hand, ``ringft plan`` on the presets."""

from __future__ import annotations

import pytest
import torch

from ringft.planner import load_model_shape, plan_main, plan_memory, step_time
from ringft.planner.formulas import checkpointed, layer_saved, layer_working_set
from ringft.planner.mixers import GDN_CHUNK, GDN_SAVED, linear_flops
from ringft.planner.setup import TrainingSetup
from tests.model.family_models import family_model, windowed_model
from tests.model.hybrid_models import MODULES, hybrid_model


@pytest.mark.parametrize("model_type", sorted(MODULES))
def test_hybrid_parameter_counts_equal_the_transformers_model(model_type):
    model = hybrid_model(model_type, torch.float32)
    shape = load_model_shape(model.config)
    assert shape.linear_layers == (0, 2) and shape.attn_gate
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    for i, layer in enumerate(model.model.layers):
        assert shape.layer_params_at(i) == sum(p.numel() for p in layer.parameters()), (model_type, i)


@pytest.mark.parametrize("preset", ["qwen3.5-9b", "deepseek-v3"])
def test_presets_count_as_the_transformers_model_on_the_meta_device(preset):
    from transformers import AutoConfig, AutoModelForCausalLM

    from ringft.planner import PRESETS

    config = dict(PRESETS[preset])
    if preset == "deepseek-v3":  # 2 dense + 2 sparse layers of the full width (671B would be slow)
        config.update(num_hidden_layers=4, first_k_dense_replace=2)
    model_type = config.pop("model_type")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
    shape = load_model_shape({**config, "model_type": model_type})
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    # published totals: Qwen3.5-9B's text decoder 8.95B (9B in its card); DeepSeek-V3 671B
    totals = {"qwen3.5-9b": 8.95e9, "deepseek-v3": 671.0e9}
    assert abs(load_model_shape(preset).total_params / totals[preset] - 1) < 0.001


def test_lora_counts_equal_peft():
    from peft import LoraConfig, get_peft_model

    for model, targets in (
        (family_model("deepseek_v3", torch.float32), ("q_a_proj", "kv_b_proj", "o_proj")),
        (hybrid_model("qwen3_5_text", torch.float32), ("q_proj", "v_proj", "in_proj_qkv", "out_proj")),
        (windowed_model("gemma4", 5, torch.float32), ("q_proj", "k_proj", "v_proj", "o_proj")),
    ):
        shape = load_model_shape(model.config)
        peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=list(targets)))
        trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        assert shape.lora_params(4, targets) == trainable, model.config.model_type
    latent = load_model_shape(family_model("deepseek_v3", torch.float32).config)
    latent_targets = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    assert latent.default_lora_targets == latent_targets
    with pytest.raises(ValueError, match="unknown LoRA target.*choose from q_a_proj"):
        latent.lora_params(4, ("q_proj", "k_proj"))


@pytest.mark.parametrize("dims", [(2, 4, 64, 64), (1, 2, 128, 128)])
def test_gated_deltanet_saved_tensors_match_autograd(dims):
    """The fitted per-token bytes of a Gated DeltaNet layer on the ring (transformers' torch kernels
    under ringft's chunk pass, one rank: the per-rank work of any ring size) against the tensors
    autograd saves, fp32, 256 local tokens."""
    from benchmarks.fit_gdn_saved import gdn_config, measure

    nk, nv, dk, dv = dims
    tokens = 256
    measured = measure(tokens, nk, nv, dk, dv)
    config = gdn_config(nk, nv, dk, dv)
    setup = TrainingSetup(seq_len=tokens, num_gpus=1, gpu_mem_gib=1.0, cp_size=1, dtype="fp32")
    view = load_model_shape(config).layer(0)
    assert view.mixer == "linear"
    planned = layer_saved(view, setup)["attention"]
    # Not a rounding bound: a least-squares fit over 9 shapes (within 1.2 % of each); allocator-free
    # (autograd's saved storages), so only the fit's error remains.
    assert abs(planned - measured) <= 0.02 * measured, (planned, measured)
    c = GDN_CHUNK
    by_hand = 4 * sum(
        w * f for w, f in zip(GDN_SAVED, (nv * dk, nv * dv, nv * c, nv * dk * (dk + dv) / c, nk * dk))
    )
    assert planned == tokens * int(by_hand)


def test_latent_gemma4_and_gate_terms_by_hand():
    # T = 32 local tokens, bf16 (a = 2), full fine-tuning, cp 2, untiled, no fused norms
    setup = TrainingSetup(seq_len=64, num_gpus=2, gpu_mem_gib=1.0, cp_size=2, fused_rmsnorm=False)
    t, a = 32, 2
    base = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "vocab_size": 64}
    # latent: 4 heads, q/k 8 + 4 = 12, v 6, q rank 10, kv rank 8 (K/V at every head)
    latent = load_model_shape(
        {**base, "model_type": "deepseek_v3", "num_attention_heads": 4, "qk_nope_head_dim": 8,
         "qk_rope_head_dim": 4, "v_head_dim": 6, "q_lora_rank": 10, "kv_lora_rank": 8,
         "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "n_shared_experts": 1,
         "first_k_dense_replace": 1}
    )  # fmt: skip
    view = latent.layer(1)
    assert (view.head_dim, view.v_dim, view.kv_heads, view.experts) == (12, 6, 4, 4)
    assert latent.layer(0).experts == 0 and latent.layer(0).intermediate == 32
    # q, k, v, output; kv_b_proj's output beyond V (its view), o_proj's copy of the output
    attention = 4 * 12 + 4 * 12 + 4 * 6 + 4 * 6 + 4 * 8 + 4 * 6
    norms = sum(4 * r + 4 + a * r + a * r for r in (10, 8))  # fp32 input, rsqrt, normalised, output
    assert layer_saved(view, setup)["attention"] == t * (a * attention + 4 * 4 + norms)
    work = layer_working_set(view, setup, layer_saved(view, setup))
    assert work["ring_buffers"] == t * (4 * 4 * 12 + 2 * a * 4 * 18 + 2 * 4 * 4 * 18)
    # the kernel at max(d, dv) = 12, plus the padded V, output and output grad
    assert work["attention_kernel"] == t * (2 * a * 48 + 2 * a * 48) + a * t * (48 + 2 * 48) + t * 4 * 48
    # Gemma 4: local head dim 4 (2 K/V heads), global 8 (1 K/V head, V = K); layer 3 reuses layer 1's K/V
    gemma = load_model_shape(
        {**base, "num_hidden_layers": 4, "model_type": "gemma4_text", "num_attention_heads": 2,
         "num_key_value_heads": 2, "head_dim": 4, "global_head_dim": 8, "num_global_key_value_heads": 1,
         "attention_k_eq_v": True, "num_kv_shared_layers": 1, "hidden_size_per_layer_input": 0,
         "layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 8}
    )  # fmt: skip
    glob, shared = gemma.layer(1), gemma.layer(3)
    assert (glob.head_dim, glob.kv_heads, glob.v_from_k, glob.kv_shared) == (8, 1, True, False)
    assert (shared.head_dim, shared.kv_shared, "k_proj" in shared.linear_shapes()) == (8, True, False)
    own = a * (16 + 8 + 8 + 16) + 4 * 2  # q, k, v, output; lse
    # q/k norms (fp32 normalised values, 8 B per row: pow's input and output); the V norm (no weight)
    qk = 4 * (16 + 8) + 8 * 3 + 4 * (16 + 8) + 4 * 8 + 8 * 1
    extra = 2 * (4 * 16 + 4 + 4 * 16)  # Gemma's post-norms
    assert layer_saved(glob, setup)["attention"] == t * (own + qk + extra)
    reusing = a * (16 + 16) + 4 * 2 + 4 * 16 + 8 * 2 + 4 * 16 + extra  # q, output, lse, q norm only
    assert layer_saved(shared, setup)["attention"] == t * reusing
    assert checkpointed(gemma, setup)["shared_kv"] == 2 * a * t * 1 * (8 + 8)
    # Qwen3.5's output gate: sigmoid(gate) and the gated output o_proj keeps
    hybrid = load_model_shape(hybrid_model("qwen3_5_text", torch.float32).config)
    gated = hybrid.layer(1)
    plain = {**vars(gated), "attn_gate": False}
    ungated = type(gated)(**plain)
    difference = layer_saved(gated, setup)["attention"] - layer_saved(ungated, setup)["attention"]
    assert difference == t * 3 * a * 2 * 8  # sigmoid(gate), the output's copy, the gated output


def test_hybrid_plan_and_time():
    hybrid = load_model_shape("qwen3.5-9b")
    plan = plan_memory(hybrid, 131072, 8, 80, cp_size=8, zero_stage=3)
    assert plan.params_total == hybrid.total_params
    assert plan.details["layer_ws.ring_buffers"] == 0  # a Gated DeltaNet layer peaks
    with pytest.raises(ValueError, match="Gated DeltaNet layers of this hybrid run on the plain"):
        plan_memory(hybrid, 131072, 8, 80, cp_size=8, ulysses_size=2)
    t = step_time(hybrid, 131072, 8, 1, 8)
    attn_view = hybrid.layer(3)
    fwd = 131072**2 * 16 * (256 + 256) / 8  # per rank, one attention layer
    assert t.attention_ideal == pytest.approx(8 * (2 * fwd + 2.5 * fwd) / 541e12)
    f, b = linear_flops(hybrid.layer(0), 131072 // 8)
    assert t.linear_attention > 24 * (2 * f + b) / 500e12 and attn_view.mixer == "attention"
    latent = load_model_shape("deepseek-v3")
    assert step_time(latent, 32768, 8, 1, 8).traffic.kv_block_bytes == 32768 // 8 * 128 * (192 + 128) * 2


@pytest.mark.parametrize("preset", ["qwen3.5-9b", "deepseek-v3"])
def test_cli_plans_the_presets(preset, capsys):
    gpus = "64" if preset == "deepseek-v3" else "8"
    argv = ["--model", preset, "--seq-len", "131072", "--gpus", gpus, "--gpu-mem", "80", "--zero", "3"]
    assert plan_main([*argv, "--lora", "--time"]) == 0
    out = capsys.readouterr().out
    assert "recommended layout" in out and "step time" in out
    if preset == "deepseek-v3":
        assert "kv_b_proj" in out  # the latent projections are the default LoRA targets


def test_cli_plans_a_gemma4_config(tmp_path, capsys):
    config = windowed_model("gemma4", 5, torch.float32).config
    path = tmp_path / "config.json"
    path.write_text(config.to_json_string(use_diff=False))
    argv = ["--config-json", str(path), "--seq-len", "4096", "--gpus", "2", "--gpu-mem", "8"]
    assert plan_main([*argv, "--overhead-gib", "0"]) == 0
    assert load_model_shape(str(path)).total_params == sum(
        p.numel() for p in windowed_model("gemma4", 5, torch.float32).parameters()
    )
    assert "recommended layout" in capsys.readouterr().out


@pytest.mark.parametrize(
    "overrides",
    [
        {"use_double_wide_mlp": True},
        {"use_double_wide_mlp": True, "attention_k_eq_v": False, "num_kv_shared_layers": 1},
    ],
)
def test_gemma4_variants_count_as_the_model(overrides):
    model = windowed_model("gemma4", 5, torch.float32, **overrides)
    shape = load_model_shape(model.config)
    assert shape.global_layers == (1, 3) and shape.double_wide_mlp
    for i, layer in enumerate(model.model.layers):
        assert shape.layer_params_at(i) == sum(p.numel() for p in layer.parameters()), (overrides, i)


def _attention_models(dtype: torch.dtype):
    """The models whose attention modules the saved-tensor test measures."""
    yield family_model("llama3", dtype)
    yield family_model("deepseek_v3", dtype)  # latent attention, V narrower than q/k
    yield family_model("mistral4", dtype)  # + the query scale by position (4 B per token, unplanned)
    yield family_model("gemma3", dtype)
    yield windowed_model("gemma4", 5, dtype, num_kv_shared_layers=0)  # per-layer head dims, V = K
    yield hybrid_model("qwen3_5_text", dtype)  # the gated attention layer


def _attention_saved(rank: int, world: int) -> list[tuple[str, int, int]]:
    """(case, measured, planned) bytes each attention layer keeps, ring attention on a one-rank gloo
    group (the spawned worker of :func:`test_attention_saved_tensors_match_autograd`)."""
    from benchmarks.fit_gdn_saved import saved_bytes
    from ringft import apply_ring_attention
    from ringft.planner.formulas import _extra_norms_saved, _per_layer_input_saved

    out, tokens = [], 256
    for dtype in (torch.float32, torch.bfloat16):
        setup = TrainingSetup(
            seq_len=tokens, num_gpus=1, gpu_mem_gib=1.0, cp_size=1, fused_rmsnorm=False,
            dtype="fp32" if dtype == torch.float32 else "bf16",
        )  # fmt: skip
        for model in _attention_models(dtype):
            model = apply_ring_attention(model.train(), backend="torch")
            x = torch.randn(1, tokens, model.config.hidden_size, dtype=dtype, requires_grad=True)
            positions = torch.arange(tokens)[None]
            shape, kind = load_model_shape(model.config), model.config.model_type
            for i, layer in enumerate(model.model.layers):
                if not hasattr(layer, "self_attn"):
                    continue
                per_type = kind.startswith("gemma")  # RoPE per layer type
                args = (model.config.layer_types[i],) if per_type else ()
                cos, sin = model.model.rotary_emb(x, positions, *args)
                kwargs = {
                    "position_embeddings": (cos, sin),
                    "attention_mask": None,
                    "position_ids": positions,
                }
                if kind == "gemma4_text":
                    kwargs["shared_kv_states"] = {}
                measured = saved_bytes(layer.self_attn, x, cos, sin, **kwargs)
                view = shape.layer(i)  # post-norms, per-layer inputs: the decoder layer's, outside self_attn
                outside = _extra_norms_saved(view, setup) + _per_layer_input_saved(view, setup)
                planned = layer_saved(view, setup)["attention"] - tokens * outside
                out.append((f"{kind} {dtype} layer {i}", measured, planned))
    return out


@pytest.mark.timeout(300)
def test_attention_saved_tensors_match_autograd():
    """The planner's attention term against the storages autograd saves in the attention module's
    forward under ring attention, fp32 and bf16: LLaMA; latent attention (V a view of kv_b_proj's
    output, the output copied by o_proj, in fp32 a view of the padded block output); Gemma 3 and 4
    (fp32 normalised values, Gemma 4's two values per row and weightless V norm, V = K); Qwen3.5's
    gated attention."""
    from ringft.utils.spawn import run_distributed

    for case, measured, planned in run_distributed(_attention_saved, 1, timeout=240)[0]:
        # Not a rounding bound: autograd's storages, no allocator in between; seen equal but for
        # T-independent scalars and norm weights (64-256 B) and Mistral 4's query scale (4 B per
        # token): within 0.2 %.
        assert abs(planned - measured) <= 0.01 * measured, (case, planned, measured)
