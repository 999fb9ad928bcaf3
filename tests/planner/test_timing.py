"""The step-time model (ringft.planner.timing): recorded H100 figures, monotonicity, units, limits,
the recommendation and the ``ringft plan --time`` flags."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ringft.planner import load_model_shape, plan_main
from ringft.planner.timing import (
    H100_ATTENTION,
    H100_STEPS,
    TORCH_ATTN_TFLOPS,
    Hardware,
    attention_seconds,
    layer_traffic,
    layouts_of,
    step_time,
)
from ringft.planner.timing_report import compare_layouts, explain, recommend_layout

LLAMA = load_model_shape("llama-3-8b")  # the measured attention shape: 32 heads, 8 K/V heads, dim 128
K = 1024


def test_attention_compute_matches_recorded_h100_figures():
    """Every recorded H100 point (one fused call, and the ring emulated at N = 2, 4, 8 for 16K-128K)
    within 2 % (the fit's largest residual is 1.6 %; the runs' own repeat spread is 1-3 %), and the
    ring step efficiency at N = 8, 128K within half a point of the recorded 93.5 %."""
    hw = Hardware(attn_tflops=TORCH_ATTN_TFLOPS)  # the figures are the torch kernel's
    for seq, n, ms in H100_ATTENTION:
        fwd, bwd = attention_seconds(LLAMA, seq, 1, n, hw=hw)
        assert abs((fwd + bwd) * 1e3 / ms - 1) < 0.02, (seq, n, (fwd + bwd) * 1e3, ms)
    fused = sum(attention_seconds(LLAMA, 128 * K, 1, 1, hw=hw))
    ring = sum(attention_seconds(LLAMA, 128 * K, 1, 8, hw=hw))
    assert abs(fused / (8 * ring) - 0.935) < 0.005


def test_step_time_matches_recorded_h100_steps():
    """The recorded one-H100 ``ringft train`` steps (Llama-3-8B, LoRA r16 on 7 projections, cudnn,
    checkpointing; 32K: 7.13 s, 128K with the tiled MLP: 59.5 s) within 10 %. The per-token
    memory-bound constant is fitted to the 32K step alone; the 128K step (attention 63 % of it, the
    tiled MLP's extra forward) is the check (0.1 % off). Counted as full fine-tuning the 32K step,
    and at the torch kernel's rate the 128K step, are off by more than 10 %."""
    for seq, tile, seconds in H100_STEPS:
        t = step_time(LLAMA, seq, 1, 1, 1, lora=True, tiled_mlp=bool(tile))
        assert abs(t.seconds / seconds - 1) < 0.10, (seq, t.seconds, seconds)
    seq, tile, seconds = H100_STEPS[0]
    assert step_time(LLAMA, seq, 1, 1, 1, lora=False).seconds / seconds > 1.10
    seq, tile, seconds = H100_STEPS[1]
    slow = _hw(attn_tflops=TORCH_ATTN_TFLOPS)
    assert step_time(LLAMA, seq, 1, 1, 1, hw=slow, lora=True, tiled_mlp=True).seconds / seconds > 1.10


def test_saved_attention_skips_one_attention_forward():
    base = step_time(LLAMA, 128 * K, 1, 1, 1, lora=True)
    for mode in ("save", "offload"):
        saved = step_time(LLAMA, 128 * K, 1, 1, 1, lora=True, attention_checkpoint=mode)
        fwd, _ = attention_seconds(LLAMA, 128 * K, 1, 1)
        assert saved.seconds == pytest.approx(base.seconds - LLAMA.layers * fwd, rel=1e-9)


def _hw(**changes) -> Hardware:
    return dataclasses.replace(Hardware(), **changes)


@pytest.mark.parametrize("seq", [16 * K, 64 * K, 512 * K])
def test_more_bandwidth_is_never_slower(seq):
    for u, r in layouts_of(LLAMA, 16):
        times = []
        for scale in (0.1, 0.5, 1, 2, 10):
            hw = _hw(nvlink_gbps=300 * scale, ib_gbps=40 * scale)
            times.append(step_time(LLAMA, seq, 16, u, r, hw=hw).seconds)
        assert times == sorted(times, reverse=True), (u, r, times)
        lower_latency = step_time(LLAMA, seq, 16, u, r, hw=_hw(ib_latency=1e-6, nvlink_latency=1e-6))
        assert lower_latency.seconds <= times[2]


def test_longer_sequence_is_never_faster():
    for u, r in layouts_of(LLAMA, 16):
        times = [step_time(LLAMA, s * 32 * K, 16, u, r).seconds for s in (1, 2, 3, 4, 8, 16)]
        assert times == sorted(times), (u, r, times)


def test_units_seconds_and_bytes():
    """Bytes by hand for ulysses 2 x ring 4 (LLaMA-3-8B, S = 64K, bf16), seconds of the right size."""
    t = layer_traffic(LLAMA, 64 * K, 2, 4)
    tokens = 64 * K // 8  # per rank
    qkv = tokens * (32 + 2 * 8) * 128 * 2
    out = tokens * 32 * 128 * 2
    assert t.a2a_buffers == (qkv, out, out, qkv)
    assert t.a2a_bytes == ((qkv + out) // 2, (out + qkv) // 2)  # half of each buffer leaves the rank
    assert t.a2a_messages == (2, 2) and t.a2a_calls == (2, 2)
    kv_block = 2 * (64 * K // 4) * (8 // 2) * 128 * 2
    assert t.kv_block_bytes == kv_block and t.grad_block_bytes == 2 * kv_block
    assert t.ring_messages == (3, 3 + 4) and t.ring_bytes == (3 * kv_block, 3 * kv_block + 4 * 2 * kv_block)
    # 128K on 8 GPUs, attention per rank per layer ~ 0.2 s (RESULTS: 205 ms): seconds, not ms.
    assert 0.15 < sum(attention_seconds(LLAMA, 128 * K, 1, 8, hw=_hw(attn_tflops=TORCH_ATTN_TFLOPS))) < 0.25
    st = step_time(LLAMA, 64 * K, 16, 8, 2)
    assert 0.5 < st.seconds < 10  # a 64K step of an 8B model on 16 H100s
    parts = (
        st.attention_ideal
        + st.attention_inefficiency
        + st.ring_exposed
        + st.all_to_all
        + st.linear
        + st.elementwise
    )
    assert st.seconds == pytest.approx(parts)


def test_replication_is_counted_and_heads_must_split():
    """U above the 8 K/V heads: K/V replicated (2x at U = 16), in the all-to-all and ring bytes."""
    plain, replicated = layer_traffic(LLAMA, 64 * K, 8, 2), layer_traffic(LLAMA, 64 * K, 16, 1)
    tokens = 64 * K // 16
    assert replicated.a2a_buffers[0] == tokens * (32 + 2 * 16) * 128 * 2
    assert plain.a2a_buffers[0] == tokens * (32 + 2 * 8) * 128 * 2
    assert step_time(LLAMA, 64 * K, 16, 16, 1).kv_copies == 2
    three = dataclasses.replace(LLAMA, heads=24, kv_heads=3)  # U = 2 does not divide 3 K/V heads
    t = layer_traffic(three, 64 * K, 2, 4)
    assert t.kv_block_bytes == 2 * (64 * K // 4) * 3 * 128 * 2  # lcm(3, 2) = 6 heads, 3 per rank
    odd = dataclasses.replace(LLAMA, heads=28, kv_heads=4)
    with pytest.raises(ValueError, match=r"heads \(28\) are not divisible by ulysses_size=8.*\[1, 2, 4\]"):
        step_time(odd, 64 * K, 16, 8, 2)
    assert [u for u, _ in layouts_of(odd, 16)] == [1, 2, 4]


def test_two_nodes_of_eight_recommend_the_hybrid():
    """The documented example: 2 x 8 H100s, cp 16. At 64K and 512K the hybrid (Ulysses inside a node,
    ring across the two) wins; pure ring pays small blocks, pure Ulysses pays InfiniBand all-to-alls
    with K/V heads replicated 2x. On one node (cp 8) nothing crosses InfiniBand."""
    for seq in (64 * K, 512 * K):
        times = compare_layouts(LLAMA, seq, 16, 16)
        best = recommend_layout(times)
        assert (best.ulysses, best.ring) == (8, 2)
        assert best.links == {"ring": "InfiniBand", "ulysses": "NVLink"}
        text = explain(times)
        assert text.startswith("recommended: ulysses 8 x ring 2 (hybrid)")
        assert "K/V heads replicated 2x" in text and "unvalidated" in text
    # at the torch kernel's rate the ring's small blocks cost most; at cudnn's (1.7x faster) the
    # ring's InfiniBand hops are exposed more than the blocks' inefficiency
    ring = step_time(LLAMA, 64 * K, 16, 1, 16, hw=_hw(attn_tflops=TORCH_ATTN_TFLOPS))
    assert max(ring.overheads, key=ring.overheads.get) == "attention kernel inefficiency"
    ring = step_time(LLAMA, 64 * K, 16, 1, 16)
    assert max(ring.overheads, key=ring.overheads.get) == "exposed ring communication"
    assert all(t.links["ring"] != "InfiniBand" for t in compare_layouts(LLAMA, 64 * K, 16, 8))


def test_plan_cli_time(capsys):
    argv = ["--model", "llama-3-8b", "--seq-len", str(64 * K), "--gpus", "16", "--gpu-mem", "79.6"]
    assert plan_main([*argv, "--zero", "3", "--cp", "16", "--time"]) == 0
    out = capsys.readouterr().out
    assert "step time, cp 16 x dp 1" in out and "recommended: ulysses 8 x ring 2 (hybrid)" in out
    assert plan_main([*argv, "--zero", "3", "--cp", "16", "--time", "--ulysses", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["step_times"]
    assert [(r["ulysses"], r["ring"], r["recommended"]) for r in rows] == [(1, 16, True)]
    assert plan_main([*argv, "--time", "--ib-gbps", "0"]) == 2
    assert "--ib-gbps 0 must be > 0" in capsys.readouterr().out
    # The memory plan of the recommended hybrid (--ulysses-size), and its refusals.
    assert plan_main([*argv, "--zero", "3", "--cp", "16", "--ulysses-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "cp 16 (ulysses 8 x ring 2)" in out and "all-to-all buffers" in out
    assert plan_main([*argv, "--cp", "16", "--ulysses-size", "3"]) == 2
    out = capsys.readouterr().out
    assert (
        "--ulysses-size 3 does not divide --gpus 16" in out
        and "--ulysses-size 3 does not divide --cp-size 16" in out
    )
