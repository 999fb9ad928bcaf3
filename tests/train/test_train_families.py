"""Recipes and the trainer on the supported families: model types, ``model.sliding_window`` per
family, RoPE overrides on Gemma 3's global layers, LoRA targets by name, and a windowed Gemma 3
trained on the ring (CP = 2) equal to the same steps data-parallel (CP = 1)."""

from __future__ import annotations

import json

import pytest
import torch

from ringft.model.families import SUPPORTED_MODEL_TYPES, layer_windows
from ringft.train.build import add_lora, model_config
from ringft.train.recipe import MODEL_TYPES, RecipeError, recipe_from_dict
from ringft.utils.spawn import run_distributed
from tests.tiny_training import (
    LOSS_RTOL,
    RUN_TIMEOUT,
    UPDATE_RTOL,
    assert_updates_close,
    final_weights,
    initial_weights,
    tiny_recipe,
)
from tests.workers import train_runs

GEMMA3 = {
    "model_type": "gemma3_text",
    "config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 12,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 24,
        "max_position_embeddings": 128,
    },
}
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 128}  # fmt: skip


def _config(tmp_path, model: dict, **sections):
    raw = tiny_recipe(tmp_path, tmp_path, model=model, **sections)
    raw["data"].pop("path")
    raw["data"]["synthetic"] = {"num_examples": 4}
    return model_config(recipe_from_dict(raw), tokenizer_size=300)


def test_every_family_is_a_recipe_model_type(tmp_path):
    assert set(MODEL_TYPES) == set(SUPPORTED_MODEL_TYPES)
    for model_type in MODEL_TYPES:
        extra = {"head_dim": 8} if model_type == "gemma3_text" else {}
        config = _config(tmp_path, {"model_type": model_type, "config": {**SMALL, **extra}})
        assert config.model_type == model_type and config.vocab_size == 300


def test_sliding_window_per_family(tmp_path):
    def windows(model_type, window, **config):
        model = {"model_type": model_type, "config": {**SMALL, **config}, "sliding_window": window}
        return layer_windows(_config(tmp_path, model))

    assert windows("mistral", 16) == [16, 16] and windows("mistral", None) == [None, None]
    assert windows("phi3", 16) == [16, 16]
    assert windows("gemma3_text", 16, head_dim=8, layer_types=["sliding_attention", "full_attention"]) == [
        16,
        None,
    ]
    qwen = {"use_sliding_window": True, "max_window_layers": 1, "sliding_window": 64}
    assert windows("qwen2", 16, **qwen) == [None, 16]  # layers >= max_window_layers
    assert windows("qwen3", None, **qwen) == [None, None]
    assert windows("llama", None) == [None, None]
    refusals = [
        (("llama", 16), "LLaMA 2 / 3.x has no sliding-window attention"),
        (("olmo2", 16), "OLMo 2 has no sliding-window attention"),
        (("gemma3_text", None), "Gemma 3's local layers were trained with a sliding window"),
        (("qwen2", 16), "no layer of this Qwen2 / Qwen2.5 config is a sliding-window layer"),
    ]
    for (model_type, window), message in refusals:
        extra = {"head_dim": 8} if model_type == "gemma3_text" else {}
        with pytest.raises(RecipeError, match=f"model.sliding_window={window}: {message}"):
            windows(model_type, window, **extra)


def test_rope_overrides_reach_gemma3_global_layers_only(tmp_path):
    model = {**GEMMA3, "rope_theta": 5e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    rope = _config(tmp_path, model).rope_parameters
    assert rope["full_attention"]["rope_theta"] == 5e6 and rope["full_attention"]["rope_type"] == "yarn"
    assert rope["full_attention"]["original_max_position_embeddings"] == 128
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    from ringft.evals.model import load_config

    folder = tmp_path / "gemma"
    _config(tmp_path, GEMMA3).save_pretrained(folder)
    assert load_config(str(folder), 2e6).rope_parameters["full_attention"]["rope_theta"] == 2e6


def test_lora_targets_are_checked_by_name(tmp_path):
    from transformers import AutoModelForCausalLM

    model = {"model_type": "phi3", "config": {**SMALL, "pad_token_id": 0}}
    raw = tiny_recipe(tmp_path, tmp_path, model=model, lora={"r": 2})
    raw["data"].pop("path")
    raw["data"]["synthetic"] = {"num_examples": 4}
    recipe = recipe_from_dict(raw)
    phi3 = AutoModelForCausalLM.from_config(model_config(recipe, tokenizer_size=300))
    with pytest.raises(RecipeError, match=r"\['q_proj', 'k_proj', 'v_proj'\] are not modules of this phi3"):
        add_lora(phi3, recipe)
    recipe.lora.target_modules = ["qkv_proj", "o_proj"]
    trained = add_lora(phi3, recipe)
    assert sum(p.numel() for p in trained.parameters() if p.requires_grad) == 2 * 2 * (32 + 64 + 32 + 32)


@pytest.mark.numerics
@pytest.mark.timeout(300)
def test_windowed_gemma3_trains_on_the_ring_as_data_parallel(tmp_path, data_path):
    """Gemma 3 with its config's window of 24 replaced by the recipe's ``model.sliding_window: 13``
    on its local layer (shorter than the ring's chunks of 16 tokens, so windows straddle chunk
    edges), sequences of 64: (cp 2) on 2 processes == (dp 2, cp 1) on the same 2 processes (the same
    global batch of 2 rows per step), and the exported config keeps the window. Same bounds as
    test_trainer's dp x cp test: per-step losses within reordered fp32 sums, updates within AdamW's
    pass-through of those relative errors over the steps."""
    train = {"micro_batch_size": 2, "chunked_loss": True}
    model = {**GEMMA3, "sliding_window": 13}
    ring = tiny_recipe(tmp_path / "cp2", data_path, model=model, parallel={"cp_size": 2}, train=train)
    dp = tiny_recipe(tmp_path / "dp2", data_path, model=model, train={**train, "micro_batch_size": 1})
    got = run_distributed(
        train_runs, 2, [{"recipe": ring}, {"recipe": dp}], str(tmp_path), timeout=RUN_TIMEOUT
    )
    for rank in range(2):
        assert got[rank][0]["losses"] == pytest.approx(got[rank][1]["losses"], rel=LOSS_RTOL), rank
    assert_updates_close(
        final_weights(tmp_path / "cp2"), final_weights(tmp_path / "dp2"), initial_weights(dp), UPDATE_RTOL
    )
    assert torch.isfinite(torch.tensor(got[0][0]["losses"])).all()
    exported = json.loads((tmp_path / "cp2" / "final" / "config.json").read_text())
    assert exported["sliding_window"] == 13 and exported["layer_types"] == GEMMA3["config"]["layer_types"]
