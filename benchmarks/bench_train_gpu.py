"""One-GPU training step of a Llama-3-8B-shaped model: the plain transformers + SDPA baseline, and the
summary (tokens/s, MFU, peak memory) of ``ringft train`` runs from their ``metrics.jsonl``.

Baseline: the model built from config on the GPU (random weights, bf16, ``attn_implementation
="sdpa"``), transformers' gradient checkpointing, its own loss (full logits), LoRA r16 on all seven
projections (peft), AdamW on the adapters; tokens/s over the steps after the first.

    python benchmarks/bench_train_gpu.py baseline --seq 32768 --steps 4
    python benchmarks/bench_train_gpu.py summary --seq 32768 --lora outputs/run/metrics.jsonl

Model FLOPs per step (MFU's numerator; recomputation not counted), T tokens of one sequence:
``c * N * T + L * 6 * T^2 * H * D`` with ``N`` the matmul weights (7 projections x L layers + the
LM head), ``c = 6`` for full fine-tuning and ``4`` for LoRA (no weight gradients of the frozen base),
and ``6 * T^2 * H * D`` a layer's causal attention (forward ``2 T^2 H D``: QK^T and PV halved by the
mask; backward twice that). Peak: 989.4 TFLOP/s (H100 SXM, dense bf16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=524288,
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEAK_TFLOPS = 989.4


def step_flops(tokens: int, lora: bool, layers: int = 32) -> float:
    """Model FLOPs of one training step on one sequence of ``tokens`` (module docstring)."""
    c = LLAMA3_8B
    h, kv, d = c["hidden_size"], c["num_key_value_heads"], c["hidden_size"] // c["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv * d + 3 * h * c["intermediate_size"]
    n = layers * per_layer + h * c["vocab_size"]
    attn = layers * 6 * tokens**2 * c["num_attention_heads"] * d
    return (4 if lora else 6) * n * tokens + attn


def baseline(seq: int, steps: int) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA3_8B, use_cache=False)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (1, seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        tic = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - tic)
    tps = seq / statistics.median(times[1:])
    return dict(
        run="plain transformers + sdpa, LoRA r16",
        seq=seq,
        tokens_per_s=tps,
        mfu=step_flops(seq, True) * tps / seq / (PEAK_TFLOPS * 1e12),
        peak_alloc_gib=torch.cuda.max_memory_allocated() / 2**30,
        peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
        step_s=times,
    )


def summary(path: str, seq: int, lora: bool) -> dict:
    rows = [json.loads(line) for line in open(path)]
    later = rows[1:] or rows
    tps = statistics.median(r["tokens_per_s"] for r in later)
    return dict(
        run=path,
        seq=seq,
        tokens_per_s=tps,
        mfu=step_flops(seq, lora) * tps / seq / (PEAK_TFLOPS * 1e12),
        peak_alloc_gib=max(r["peak_mem_gb"] for r in rows),
        peak_reserved_gib=max(r.get("peak_reserved_gb", 0.0) for r in rows),
        losses=[round(r["loss"], 4) for r in rows],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["baseline", "summary", "flops"])
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lora", default=None, help="summary: a LoRA run's metrics.jsonl")
    p.add_argument("--full", default=None, help="summary: a full fine-tuning run's metrics.jsonl")
    args = p.parse_args()
    if args.mode == "baseline":
        try:
            print(json.dumps(baseline(args.seq, args.steps)))
        except torch.OutOfMemoryError as exc:
            print(
                json.dumps(dict(run="plain transformers + sdpa, LoRA r16", seq=args.seq, oom=str(exc)[:200]))
            )
    elif args.mode == "flops":
        print(
            json.dumps(dict(seq=args.seq, lora=step_flops(args.seq, True), full=step_flops(args.seq, False)))
        )
    else:
        for path, lora in ((args.lora, True), (args.full, False)):
            if path:
                print(json.dumps(summary(path, args.seq, lora)))


if __name__ == "__main__":
    main()
