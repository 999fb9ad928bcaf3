"""Plain transformers + SDPA vs ringft on the same GPU, one training step each way, with a profile.

Both runs train the same Llama-3-8B-shaped model (random weights built on the GPU, bf16, ``--layers``
layers) with LoRA r16 on all seven projections, per-layer non-reentrant gradient checkpointing and
AdamW on the adapters, on one sequence of ``--seq`` tokens:

- ``plain``: ``attn_implementation="sdpa"`` (the kernel torch picks is recorded from the profile),
  transformers' own loss on full logits;
- ``ringft``: the same model switched to the ring (:func:`ringft.apply_ring_attention`, CP = 1 on a
  one-process group, backend ``--backend``), the batch from :class:`ringft.RingDataCollator`, the
  chunked loss (:class:`ringft.loss.module.CausalLMLoss`: the ``causal_lm_loss`` that ``ringft
  train`` runs per rank).

Tokens/s are the median over the steps after the first; the ratio is measured in one process, one
after the other. One extra step of each run is profiled (``torch.profiler``) and its CUDA kernel time
split by kernel name into attention / GEMM / other (norms, elementwise, copies, reductions): peft's
adapters run as GEMMs and norms as elementwise kernels, so those two are not separable by name.

    python benchmarks/bench_step_profile.py --seq 16384 --layers 32 --json out.jsonl
    RINGFT_GPU_TINY=1 python benchmarks/bench_step_profile.py --seq 256   # CPU dry run, tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import time

import torch
import torch.distributed as dist

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CATEGORIES = {
    "attention": re.compile(r"flash|fmha|cudnn|attention|attn|sdpa|mha", re.I),
    "gemm": re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma|matmul|^aten::(addmm|mm|bmm|baddbmm)$", re.I),
}


def _config(layers: int):
    from transformers import LlamaConfig

    if os.environ.get("RINGFT_GPU_TINY") == "1":
        shape = dict(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=2048,
        )
    else:
        shape = dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            rope_theta=500000.0,
        )
    return LlamaConfig(**shape, num_hidden_layers=layers, max_position_embeddings=524288, use_cache=False)


def _model(config, device: torch.device, dtype: torch.dtype):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))


def _step_fn(mode: str, model, ids: torch.Tensor, backend: str):
    """A closure running one forward + backward of ``mode`` on ``ids`` (1, S)."""
    if mode == "plain":
        return lambda: model(input_ids=ids, labels=ids).loss.backward()
    from ringft import RingDataCollator, apply_ring_attention
    from ringft.loss import loss_normalization
    from ringft.loss.module import CausalLMLoss

    apply_ring_attention(model, None, backend)
    batch = RingDataCollator(cp_rank=0, cp_size=1, pad_token_id=0)([{"input_ids": ids[0].tolist()}])
    batch = {k: v.to(ids.device) if torch.is_tensor(v) else v for k, v in batch.items()}
    norm = loss_normalization(batch["shift_labels"], gradients_averaged=False)
    batch["num_items_in_batch"] = norm.num_items_in_batch
    wrapped = CausalLMLoss(model, chunked=True, chunk_size=4096, offload_activations=False)
    return lambda: wrapped(**batch).backward()


def _profile(step, device: torch.device) -> dict[str, float]:
    """Kernel time (ms) of one step by category (module docstring); ``kernels``: the top names. On
    CPU (a dry run) the aten ops' own CPU time stands in for the kernels'."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    split = {"attention": 0.0, "gemm": 0.0, "other": 0.0}
    names: dict[str, float] = {}
    for evt in prof.key_averages():
        if device.type == "cpu":  # a dry run: the CPU kernels are the aten ops (self time, no double count)
            ms = evt.self_cpu_time_total / 1e3
            if ms <= 0 or not evt.key.startswith("aten::"):
                continue
        else:
            ms = getattr(evt, "self_device_time_total", 0.0) / 1e3
            if ms <= 0 or evt.key.startswith(("aten::", "autograd::", "Optimizer", "cuda")):
                continue
        cat = next((c for c, pat in CATEGORIES.items() if pat.search(evt.key)), "other")
        split[cat] += ms
        names[evt.key[:80]] = names.get(evt.key[:80], 0.0) + ms
    top = sorted(names.items(), key=lambda kv: -kv[1])[:6]
    return {**{k: round(v, 1) for k, v in split.items()}, "top_kernels": [[n, round(t, 1)] for n, t in top]}


def run(mode: str, seq: int, layers: int, steps: int, backend: str, device: torch.device) -> dict:
    """Tokens/s, peak memory and the profiled step of one ``mode`` (``plain`` or ``ringft``)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = _config(layers)
    model = _model(config, device, dtype)
    ids = torch.randint(0, config.vocab_size, (1, seq), device=device)
    step = _step_fn(mode, model, ids, backend)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        sync()
        tic = time.perf_counter()
        step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - tic)
    if device.type == "cuda":
        peak_key, peak = "peak_alloc_gib", torch.cuda.max_memory_allocated() / 2**30
    else:  # a CPU dry run: the process's resident-set high-water mark (both runs so far)
        peak_key, peak = "peak_rss_gib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    prof = _profile(step, device)
    opt.zero_grad(set_to_none=True)
    del model, opt, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(
        mode=mode,
        seq=seq,
        layers=layers,
        backend=backend if mode == "ringft" else "sdpa",
        tokens_per_s=seq / statistics.median(times[1:] or times),
        step_s=[round(t, 3) for t in times],
        **{peak_key: round(peak, 2)},
        profile_ms=prof,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--backend", default="auto", help="ringft's block backend")
    p.add_argument("--json", default=None, help="append the two rows as JSON lines here")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not dist.is_initialized():  # the ring's group: one process
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method="tcp://127.0.0.1:29533",
            rank=0,
            world_size=1,
        )
    if device.type == "cuda":
        torch.cuda.set_device(0)
    rows = [run(mode, a.seq, a.layers, a.steps, a.backend, device) for mode in ("plain", "ringft")]
    rows[1]["vs_plain"] = round(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
    for row in rows:
        print(json.dumps(row))
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
