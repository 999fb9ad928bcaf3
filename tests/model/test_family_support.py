"""Which models the ring accepts: the supported families without a flag, the refusals that name the
feature, and the per-layer windows ringft expects against what each model really passes."""

from __future__ import annotations

import pytest
import torch

from ringft import apply_ring_attention, remove_ring_attention
from ringft.model.families import (
    FAMILIES,
    SUPPORTED_MODEL_TYPES,
    attention_modules,
    check_model,
    layer_windows,
)
from ringft.model.patch import ring_attention_forward
from tests.model.family_models import (
    COMMON,
    FAMILY_CONFIGS,
    WINDOWED,
    family_model,
    tiny_family,
    windowed_model,
)
from tests.model.hybrid_models import MODULES as HYBRIDS
from tests.model.hybrid_models import hybrid_model


def test_every_supported_family_is_accepted_without_a_flag():
    names = (
        {FAMILY_CONFIGS[n][0] for n in FAMILY_CONFIGS}
        | {WINDOWED[n][0] for n in WINDOWED}
        | {"llama", "mistral"}
        | set(HYBRIDS)
    )
    assert names == set(SUPPORTED_MODEL_TYPES)
    for model_type in SUPPORTED_MODEL_TYPES:
        extra = {"head_dim": 16} if model_type == "gemma3_text" else {}
        hybrid = model_type in HYBRIDS  # 1 full-attention layer between 2 Gated DeltaNet layers
        model = (
            hybrid_model(model_type, torch.float32)
            if hybrid
            else tiny_family(model_type, torch.float32, **extra)
        )
        apply_ring_attention(model)
        modules = attention_modules(model)
        assert len(modules) == (1 if hybrid else COMMON["num_hidden_layers"])
        assert all(m._ringft_ring is not None for m in modules)
        assert type(model).__name__ in FAMILIES[model_type].classes
        remove_ring_attention(model)
        assert not any(hasattr(m, "_ringft_ring") for m in modules)


def _refusal(model_type: str, allow_untested: bool = True, **overrides) -> str:
    model = tiny_family(model_type, torch.float32, **overrides)
    with pytest.raises(ValueError) as info:
        apply_ring_attention(model, allow_untested=allow_untested)
    return str(info.value)


def test_features_the_ring_cannot_compute_are_refused_by_name():
    # Gemma 2: attention-logit and final-logit soft-capping (refused even with allow_untested).
    msg = _refusal("gemma2", head_dim=16)
    assert "attn_logit_softcapping=50.0" in msg and "final_logit_softcapping=30.0" in msg
    msg = _refusal("gemma2", head_dim=16, final_logit_softcapping=None)
    assert "attention-logit soft-capping" in msg and "final-logit" not in msg
    msg = _refusal("gemma3_text", False, head_dim=16, use_bidirectional_attention=True)
    assert "bidirectional (non-causal)" in msg
    msg = _refusal("gemma3_text", False, head_dim=16, final_logit_softcapping=30.0)
    assert "final-logit soft-capping (config.final_logit_softcapping=30.0" in msg
    # Gemma 4: bidirectional "all" is refused; "vision" only concerns the multimodal model's images
    msg = _refusal("gemma4_text", False, use_bidirectional_attention="all")
    assert "bidirectional (non-causal)" in msg
    apply_ring_attention(tiny_family("gemma4_text", torch.float32, use_bidirectional_attention="vision"))
    model = family_model("qwen2", torch.float32)
    model.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\]"):
        apply_ring_attention(model)


def test_unknown_types_need_allow_untested_and_multimodal_gemma3_is_pointed_to_its_text_model():
    msg = _refusal("cohere2", allow_untested=False)
    assert "model type 'cohere2' is not supported" in msg and "allow_untested=True" in msg
    assert "gemma3_text" in msg and "phi3" in msg  # names the supported types
    apply_ring_attention(tiny_family("cohere2", torch.float32), allow_untested=True)  # no refusal
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="Gemma3ForCausalLM \\(model type gemma3_text"):
        check_model(AutoConfig.for_model("gemma3"), [torch.nn.Module()], allow_untested=False)


def test_llama4_chunk_configurations_the_ring_cannot_honour_are_refused():
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="train its text decoder as Llama4ForCausalLM"):
        check_model(AutoConfig.for_model("llama4"), [torch.nn.Module()], allow_untested=False)
    for size in (0, None):
        model = family_model("llama4", torch.float32)
        model.config.attention_chunk_size = size
        with pytest.raises(ValueError, match=f"attention_chunk_size={size}: it must be a positive integer"):
            apply_ring_attention(model)
    model = apply_ring_attention(family_model("llama4", torch.float32))
    nope = attention_modules(model)[1]  # the NoPE layer: its temperature moves into the ring
    assert nope.attn_temperature_tuning is False
    remove_ring_attention(model)
    assert nope.attn_temperature_tuning is True


def test_softcap_and_sinks_in_decoding_are_refused():
    model = apply_ring_attention(family_model("qwen2", torch.float32))
    module = attention_modules(model)[0]
    q = torch.zeros(1, 4, 4, 16)
    kv = torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match="softcap=30.0"):
        ring_attention_forward(module, q, kv, kv, None, scaling=0.25, softcap=30.0)
    from ringft.ops.decode import ShardedKVCache

    cache = ShardedKVCache([0, 1, 2, 3], 4, owner=True)
    with pytest.raises(ValueError, match=r"attention sinks \(s_aux\) run on the plain ring only"):
        ring_attention_forward(module, q, kv, kv, None, scaling=0.25, s_aux=torch.zeros(4), ring_cache=cache)


def test_layer_windows_and_scaling_match_what_each_model_passes():
    """Record what every model hands transformers' attention interface (a probe registered as an
    implementation) and compare it with ringft's table: ``layer_windows(config)`` and the scale."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen: dict[int, tuple] = {}

    def probe(module, query, key, value, attention_mask, scaling=None, sliding_window=None, **kwargs):
        seen[module.layer_idx] = (sliding_window, scaling, query.shape[-1])
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register("ringft_probe", probe)
    cases = [windowed_model(name, 5, torch.float32) for name in WINDOWED]
    cases += [family_model(name, torch.float32) for name in FAMILY_CONFIGS]
    cases.append(tiny_family("qwen2", torch.float32, sliding_window=5))  # use_sliding_window off: no window
    gemma = windowed_model("gemma3", 5, torch.float32, num_hidden_layers=7, layer_types=None)
    cases.append(gemma)  # transformers' default pattern: 5 local, 1 global, ...
    for model in cases:
        seen.clear()
        model.set_attn_implementation("ringft_probe")
        with torch.no_grad():
            model(input_ids=torch.randint(3, 90, (1, 12)))
        config = model.config
        windows = [seen[i][0] for i in range(config.num_hidden_layers)]
        assert windows == layer_windows(config), (config.model_type, windows)
        for _, scaling, head_dim in seen.values():
            want = getattr(config, "query_pre_attn_scalar", None) or head_dim
            want = 1.0 if config.model_type == "gemma4_text" else want**-0.5  # Gemma 4: q/k normed, scale 1
            assert scaling == pytest.approx(want), config.model_type
    assert layer_windows(gemma.config) == [5, 5, 5, 5, 5, None, 5]


def test_tiled_mlp_of_every_family_is_exact():
    """Tiling an MLP reorders only the weight-gradient sums over tokens (fp64 here): logits equal,
    gradients within fp64 rounding of the token sums (3 rows x 20 tokens)."""
    from ringft.model.tiled_mlp import enable_tiled_mlp

    ids = torch.randint(3, 90, (3, 20), generator=torch.Generator().manual_seed(0))
    moe = ("qwen3_moe", "deepseek_v3", "mistral4")  # their sparse MLPs are not tiled
    builds = [(family_model, (n,)) for n in FAMILY_CONFIGS if n not in moe]
    builds += [(windowed_model, (n, 5)) for n in ("olmo3", "smollm3", "ministral3")]
    for build, args in builds:
        name = args[0]
        ref = build(*args)
        tiled = enable_tiled_mlp(build(*args), num_tiles=7)
        for m in (ref, tiled):
            m(input_ids=ids, labels=ids).loss.backward()
        for (n, p), (_, q) in zip(tiled.named_parameters(), ref.named_parameters()):
            bound = 60 * torch.finfo(torch.float64).eps * q.grad.abs().max()
            assert (p.grad - q.grad).abs().max() <= bound, (name, n)
