"""ringft.planner against GPU-measured peaks (constants; no GPU, no process spawned).

H200 traces (2026-11-26; NVIDIA H200 capped at 79.6 GiB with
``torch.cuda.set_per_process_memory_fraction``; torch 2.11.0+cu130, transformers 5.17.0,
peft 0.21.0, accelerate 1.15.0; cudnn attention). Command, for S in 131072 / 262144 / 393216::

    python benchmarks/gpu_memory_trace.py --out OUT --cap-gib 79.6 -- recipes/demo_cpu.yaml
      --model.config "{hidden_size: 4096, intermediate_size: 14336, num_hidden_layers: 2,
      num_attention_heads: 32, num_key_value_heads: 8, max_position_embeddings: 524288,
      vocab_size: 128256, rope_theta: 500000}" --model.dtype bf16 --model.attn_backend auto
      --parallel.cp_size 1 --train.micro_batch_size 1 --train.gradient_checkpointing true
      --train.loss_chunk_size 4096 --train.tiled_mlp_tokens 4096 --train.offload_activations true
      --lora "{r: 16, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
      down_proj]}" --data.seq_len S --train.max_steps 1 (+ the demo's data / logging settings)

The peak is ``torch.cuda.max_memory_allocated`` (= the replayed allocator history); at 393216
tokens the step ran out of memory in the second norm's backward: with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` it asked for 6 GiB more with 82,341,437,988 B
allocated, so that length needs at least their sum. The live blocks at the 131072-token peak,
grouped by the tensor they are (python frames of the trace), are pinned term by term.

H100 rows (2026-11-25; NVIDIA H100 80 GB, same versions; 32 layers, no activation offload,
``max_memory_allocated`` over 4 steps): benchmarks/RESULTS.md, "Planner against measured memory".
"""

from __future__ import annotations

import pytest

from ringft.planner import plan_memory

GIB, MIB = 2**30, 2**20
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LLAMA_8B_2_LAYERS = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
OFFLOAD = {"lora": True, "lora_targets": TARGETS, "loss_chunk_size": 4096, "tiled_mlp_tokens": 4096}
OFFLOAD["offload_activations"] = True

# (tokens, measured peak bytes, exact): exact False = a lower bound (the OOM'd step's need)
H200_2_LAYERS = [
    (131072, 31_636_496_932, True),  # 29.464 GiB (sum of the live blocks at the peak)
    (262144, round(56.078 * GIB), True),  # 56.078 GiB (peak.txt, 3 decimals)
    (393216, 82_341_437_988 + 6 * GIB, False),  # >= 82.686 GiB: allocated at the OOM + the request
]
# (tokens, tiled MLP, max_memory_allocated GiB) of the 32-layer Llama-3-8B shape, no offload
H100_32_LAYERS = [(16384, 0, 25.63), (32768, 0, 35.77), (65536, 0, 56.05), (131072, 4096, 73.11)]


def _plan(model, seq: int, **options):
    return plan_memory(
        model, seq, 1, 79.6, cp_size=1, fused_rmsnorm=False, **options
    )  # measured: autograd's norm


@pytest.mark.parametrize("seq, measured, exact", H200_2_LAYERS)
def test_plan_matches_the_h200_peaks(seq, measured, exact):
    """The plan without its 3 GiB framework overhead (which ``max_memory_allocated`` does not see)
    within 1 % of the measured peak. Tolerance: what the planner leaves out is a constant
    ~50-80 MiB (RoPE's ``inv_freq @ positions`` product, kernel workspaces, the batch; the plan's
    30 MiB of LoRA grads and Adam states are not yet allocated at the first step's peak): 0.15 %
    at 128K, 0.1 % at 256K. The 384K need is a lower bound: the plan may not be more than 1 % below
    it and must not fit the 79.6 GiB it was measured in."""
    plan = _plan(LLAMA_8B_2_LAYERS, seq, **OFFLOAD)
    planned = plan.total - plan.overhead
    err = (planned - measured) / measured
    assert abs(err) <= 0.01 if exact else err >= -0.01, (
        f"S={seq}: {planned / GIB:.3f} GiB vs {measured / GIB:.3f}"
    )
    assert plan.fits == exact
    d = plan.details
    assert plan.layer_working_set == d["layer_ws.norm_phase"] > d["layer_ws.attention_phase"]


def test_h200_peak_tensors_term_by_term():
    """The live blocks at the 128K peak (second norm's backward, layer 1), as the planner's terms:
    T = 131072, so a bf16 ``(T, h)`` is 1 GiB and an fp32 one 2 GiB."""
    t, h = 131072, 4096
    d = _plan(LLAMA_8B_2_LAYERS, t, **OFFLOAD).details
    # peft _cast_input_dtype: the fp32 inputs of q, k, v (3 x 2 GiB) and o (2 GiB); lora_A's fp32
    # outputs (linear.py forward, 4 x 8 MiB)
    assert d["layer_saved.lora_attn"] == 4 * 2 * GIB + 4 * 8 * MIB
    # modeling_llama RMSNorm ``hidden_states.to(float32)``: norm1's and norm2's 2 GiB (+ rsqrt)
    assert d["layer_saved.norm1"] == 2 * GIB + 4 * t
    # q, k after RoPE (1 GiB, 256 MiB), v (peft's result, 256 MiB), the ring output (1 GiB), lse
    assert d["layer_saved.attention"] == 2 * GIB + 512 * MIB + 16 * MIB
    # blocks with no python frame (the autograd engine): five 2 GiB (the RMSNorm backward's fp32
    # temporaries, allocated within 0.6 ms) and the residual stream's 1 GiB grad
    assert d["layer_ws.norm_transients"] == 5 * 2 * GIB + 1 * GIB
    assert (
        d["layer_ws.norm_phase"]
        == (d["layer_saved.norm1"] + d["layer_saved.attention"] + d["layer_saved.lora_attn"])
        + (2 * GIB + 4 * t)
        + d["layer_ws.norm_transients"]
    )
    # offload: the embedding output (functional.embedding, 1 GiB) stays; RoPE cos/sin 2 x 32 MiB
    assert d["checkpointed.layers"] == 2 * t * h == GIB
    assert d["checkpointed.rope"] == 2 * 32 * MIB


def test_h200_recompute_forward_stays_below_the_norm_phase():
    """At 384K the allocator history's largest moment before the OOM (75,999,257,124 B, no
    expandable segments) is layer 1's recompute forward inside the second RMSNorm: the first
    half's saved tensors, the unpacked layer input, the residual and the output grad (bf16 each),
    the norm's fp32 input and product, and two bf16 casts (``(5*a + 8)*T*h``, the formulas'
    docstring). That sum matches it within 1 % and stays below the norm phase the plan uses."""
    t, h = 393216, 4096
    plan = _plan(LLAMA_8B_2_LAYERS, t, **OFFLOAD)
    d = plan.details
    first_half = d["layer_saved.norm1"] + d["layer_saved.attention"] + d["layer_saved.lora_attn"]
    states = plan.weights + plan.checkpointed_activations
    forward = states + first_half + (5 * 2 + 8) * t * h
    assert abs(forward - 75_999_257_124) / 75_999_257_124 <= 0.01
    assert forward < states + d["layer_ws.norm_phase"]


@pytest.mark.parametrize("seq, tile, measured_gib", H100_32_LAYERS)
def test_plan_matches_the_h100_peaks(seq, tile, measured_gib):
    """Llama-3-8B (32 layers) LoRA without offload: plan minus overhead within 2 % of the allocated
    peak (seen: -0.4 / -0.8 / -1.2 % at 16K-64K, where the MLP phase sets the peak, +0.1 % at
    128K with the tiled MLP, where the norm phase does; the reported values have 2 decimals)."""
    options = {"lora": True, "lora_targets": TARGETS, "loss_chunk_size": 4096}
    if tile:
        options["tiled_mlp_tokens"] = tile
    plan = _plan("llama-3-8b", seq, **options)
    planned = (plan.total - plan.overhead) / GIB
    assert abs(planned - measured_gib) / measured_gib <= 0.02, (seq, planned, measured_gib)
    phase = "layer_ws.norm_phase" if tile else "layer_ws.mlp_phase"
    assert plan.layer_working_set == plan.details[phase]


# Attention in query tiles (benchmarks/RESULTS.md "Attention in query tiles", 2026-11-28): H200,
# cuDNN, bf16, 32 q / 8 kv heads of 128; zigzag_ring_attention fwd + bwd at one rank ("ring N=1",
# what a training step runs); extra bytes per local token above q, k, v and the output grad.
# (local tokens, attention_tile_tokens or None, measured bytes per token)
H200_RING_TILES = [
    (65536, None, 53_632),
    (131072, None, 53_632),
    (262144, None, 53_632),
    (65536, 4096, 29_456),
    (65536, 16384, 43_328),
    (131072, 4096, 28_928),
    (131072, 16384, 34_080),
    (262144, 4096, 28_928),
    (262144, 16384, 29_456),
]


@pytest.mark.parametrize("seq, tile, measured", H200_RING_TILES)
def test_attention_kernel_term_matches_the_h200_tiles(seq, tile, measured):
    """The planner's attention-kernel term (+ the fp32 lse, 4 B per head and token, which the op
    returns and the planner counts with the layer's saved tensors) within 2 % of the measured
    extra bytes. Tolerance: what it leaves out is cuDNN's 8 B per head and token beyond the fp32
    dq workspace and expanded dK/dV (``8*nh*d + 8*nh`` measured vs ``(2*a + 4)*nh*d`` planned):
    seen -0.4 .. -0.5 % at every point. (Tiled, the measured law is 24,704 S + 74,000 T bytes: fp32
    dk/dv of the block, and per tile token the workspace, the wrapper's fp32 dq and two sets of a
    tile call's results; where 74,000 T is below the ring's final cast of dk/dv, 4,096 S, the cast
    sets the peak.)"""
    plan = plan_memory(
        LLAMA_8B_2_LAYERS, seq, 1, 1000.0, cp_size=1, attention_tile_tokens=tile, overhead_gib=0
    )
    planned = plan.details["layer_ws.attention_kernel"] + 4 * 32 * seq
    assert abs(planned - measured * seq) / (measured * seq) <= 0.02, (seq, tile, planned / seq, measured)


def test_attention_save_term_matches_the_measured_bytes():
    """``attention_checkpoint``: ``save`` keeps ``Hq*(D*itemsize + 4)`` bytes per token per layer
    for ``L - 1`` layers beyond ``recompute`` (the layer in its backward holds its own anyway);
    ``offload`` adds nothing on the GPU. Measured (benchmarks/RESULTS.md "Attention output saved
    under checkpointing"): H200, 2-layer Llama-3-8B shape, bf16, 128K tokens: save +1,040 MiB
    (35,771 -> 36,811 MiB), offload +0 MiB; CPU, 4 layers of 4 heads x 64, fp32, 4,096 tokens:
    +12 MiB (122 -> 134)."""
    t = 131072
    base, save, off = (
        plan_memory(LLAMA_8B_2_LAYERS, t, 1, 1000.0, attention_checkpoint=mode, overhead_gib=0)
        for mode in ("recompute", "save", "offload")
    )
    per_layer = 32 * (128 * 2 + 4)  # 8,320 B per token
    assert save.checkpointed_activations - base.checkpointed_activations == (2 - 1) * per_layer * t
    assert save.total - base.total == 1040 * MIB == (36_811 - 35_771) * MIB
    assert off.total == base.total and off.cpu_offloaded - base.cpu_offloaded == (2 - 1) * per_layer * t
    cpu = {
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
    }  # fmt: skip
    r, s = (
        plan_memory(cpu, 4096, 1, 1000.0, dtype="fp32", attention_checkpoint=m, overhead_gib=0)
        for m in ("recompute", "save")
    )
    assert s.checkpointed_activations - r.checkpointed_activations == 3 * 4 * (64 * 4 + 4) * 4096
    assert round((s.total - r.total) / MIB) == 12 == 134 - 122
