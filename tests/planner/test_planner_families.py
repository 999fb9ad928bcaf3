"""The planner on the supported families: presets from published configs, parameter counts against
the transformers models themselves, LoRA counts against peft, windows that change no memory term."""

from __future__ import annotations

import pytest
import torch

from ringft.planner import PRESETS, load_model_shape, plan_memory
from ringft.planner.setup import TrainingSetup
from tests.model.family_models import FAMILY_CONFIGS, family_model, windowed_model


def test_family_presets_match_the_published_parameter_counts():
    # Qwen2.5 / Qwen3 model cards: total and non-embedding parameters; Gemma 3 technical report,
    # table 1: embedding and non-embedding parameters of the text decoder (vision encoder apart).
    published = {  # name: (non-embedding, total) in billions, and the rounding of the figures
        "qwen2.5-7b": (6.53, 7.61, 0.01),  # the card truncates 7.6156
        "qwen3-8b": (6.95, 8.2, 0.05),
        # the report's embedding counts the 1152 x h image projection too (2.9M / 4.4M)
        "gemma-3-4b": (3.209, 3.209 + 0.675 - 1152 * 2560 / 1e9, 0.001),
        "gemma-3-12b": (10.759, 10.759 + 1.012 - 1152 * 3840 / 1e9, 0.001),
        "qwen3-30b-a3b": (29.9, 30.5, 0.05),  # model card: 30.5B total, 29.9B non-embedding
    }
    for name, (body, total, rounding) in published.items():
        shape = load_model_shape(name)
        emb = shape.embedding_params + shape.lm_head_params  # an untied lm_head counts as embedding
        assert abs((shape.total_params - emb) / 1e9 - body) <= rounding, name
        assert abs(shape.total_params / 1e9 - total) <= rounding, name
    gemma = load_model_shape("google/gemma-3-12b-it")
    assert gemma.head_dim == 256 != gemma.hidden // gemma.heads and gemma.norms == 4
    assert gemma.windows.count(1024) == 40 and gemma.windows[5::6] == (None,) * 8
    assert load_model_shape("Qwen/Qwen2.5-7B-Instruct").qkv_bias
    assert set(load_model_shape("qwen2.5-7b").windows) == {None}  # use_sliding_window false


def test_multimodal_config_reads_its_text_decoder():
    text = dict(PRESETS["gemma-3-4b"])
    text.pop("model_type")
    multimodal = {"model_type": "gemma3", "text_config": text, "vision_config": {"hidden_size": 1152}}
    shape = load_model_shape(multimodal)
    assert shape.total_params == load_model_shape("gemma-3-4b").total_params


WINDOWED_ONLY = ("mixtral", "gpt_oss", "gemma4")  # Gemma 4: shared K/V, V = K, per-layer inputs


@pytest.mark.parametrize("name", [*sorted(FAMILY_CONFIGS), *WINDOWED_ONLY])
def test_parameter_counts_equal_the_transformers_model(name):
    windowed = name in WINDOWED_ONLY
    model = windowed_model(name, 5, torch.float32) if windowed else family_model(name, torch.float32)
    shape = load_model_shape(model.config)
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    for i, layer in enumerate(model.model.layers):  # Llama 4: a dense and a sparse layer
        assert shape.layer_params_at(i) == sum(p.numel() for p in layer.parameters()), (name, i)


def test_lora_counts_with_fused_projections_equal_peft():
    from peft import LoraConfig, get_peft_model

    targets = ("qkv_proj", "o_proj", "gate_up_proj")
    model = family_model("phi3", torch.float32)
    shape = load_model_shape(model.config)
    assert shape.projections("qkv") == ("qkv_proj",)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=list(targets)))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert shape.lora_params(4, targets) == trainable
    with pytest.raises(ValueError, match="choose from qkv_proj, o_proj, gate_up_proj, down_proj"):
        shape.lora_params(4, ("q_proj",))
    plan = plan_memory(
        model.config,
        256,
        1,
        80,
        lora=True,
        lora_rank=4,
        lora_targets=targets,
        overhead_gib=0,
        fused_rmsnorm=False,
    )
    assert plan.params_trainable == trainable


def test_a_window_changes_no_memory_term():
    windowed = PRESETS["gemma-3-4b"]
    plain = {**windowed, "sliding_window": None}
    a = plan_memory(windowed, 131072, 8, 80, cp_size=8, zero_stage=3)
    b = plan_memory(plain, 131072, 8, 80, cp_size=8, zero_stage=3)
    assert a.total == b.total and a.details == b.details
    assert load_model_shape(windowed).windows != load_model_shape(plain).windows


def test_qk_norm_and_extra_norm_activations_by_hand():
    # T = 32 local tokens, bf16 (a = 2), full fine-tuning; nh = 4, nkv = 2, d = 8 -> q + kv = 48.
    base = {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 64,
    }
    setup = TrainingSetup(seq_len=64, num_gpus=2, gpu_mem_gib=1.0, cp_size=2, fused_rmsnorm=False)
    from ringft.planner.formulas import layer_saved

    def attention(model_type):
        return layer_saved(load_model_shape({**base, "model_type": model_type}), setup)["attention"]

    llama = attention("llama")
    # per-head norms: fp32 input 4*48, rsqrt per head 4*6, normalised a*48
    assert attention("qwen3") - llama == 32 * (4 * 48 + 4 * 6 + 2 * 48)
    # over all heads: one rsqrt per token for q and one for k
    assert attention("olmo2") - llama == 32 * (4 * 48 + 4 * 2 + 2 * 48)
    # Gemma 3: q/k norms per head (normalised in fp32: Gemma's norm multiplies in fp32) + two extra
    # norms (fp32 input 4h, rsqrt, fp32 normalised 4h)
    assert attention("gemma3_text") - llama == 32 * (4 * 48 + 4 * 6 + 4 * 48 + 2 * (4 * 16 + 4 + 4 * 16))


def test_gpt_oss_and_llama4_presets_plan_and_match_the_published_totals():
    # Model cards: gpt-oss-20b 20.91B parameters (21B, 3.6B active); Llama 4 Scout 109B total
    # (17B active), which counts the vision encoder too: the text decoder alone is ~1 % less.
    for name, total in (("gpt-oss-20b", 20.91e9), ("llama-4-scout", 109e9)):
        shape = load_model_shape(name)
        assert abs(shape.total_params / total - 1) <= 0.02, (name, shape.total_params)
        plan = plan_memory(name, 131072, 8, 80, cp_size=8, zero_stage=3)
        assert plan.params_total == shape.total_params and plan.total > 0
    scout = load_model_shape("llama-4-scout")
    assert scout.shared_expert_intermediate == 8192 and scout.dense_layers == ()
    assert load_model_shape("gpt-oss-20b").expert_bias
