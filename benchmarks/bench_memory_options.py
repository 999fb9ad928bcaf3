"""The planner's terms for ``train.attention_checkpoint`` and ``train.attention_tile_tokens``,
measured on CPU: measured vs planned bytes per token of each option's peak DIFFERENCE.

Model: a 2-layer LLaMA shaped like Llama-3-8B at reduced width (hidden 512 = 4 query heads / 1 K/V
head of 128, intermediate 3.5 x hidden), built from config with random weights, run as ``ringft
train`` runs it at CP 1: the fused RMSNorm, non-reentrant per-layer gradient checkpointing
(``activation_checkpointing_enable``, non-reentrant), ``apply_ring_attention`` (torch backend) with
the option under test, the chunked loss; one forward + backward (no optimizer: weights and grads
are in the baseline).

Two parts:

- ``step``: each option set in a fresh process, one warm-up step, then the RSS high-water rise of
  one step (``VmHWM`` after ``clear_refs``; ``MALLOC_MMAP_THRESHOLD_`` set so freed buffers leave
  the RSS). Planned = ``ringft.planner`` checkpointed + max(layer, loss working set) + what it puts
  in host memory (on CPU that stays in the RSS), overhead 0. The option's difference from
  ``recompute`` (untiled), measured and planned, divided by the tokens.
- ``op``: the attention alone, ``zigzag_ring_attention`` forward + backward at one rank on the
  layer's q/k/v shapes (what the attention phase of a layer's backward holds), untiled and tiled;
  "extra" = the peak above q, k, v and the output grad (on CUDA benchmarks/bench_attention_tiles.py's
  ``peak_extra``, on CPU the ``VmHWM`` rise). Planned = the planner's attention-kernel parts
  (``ringft.planner.kernel``) ``results + lse + max(workspace + tile_buffers, casts)``; on CPU
  torch's fused kernel has no workspace, so the CPU comparison leaves ``workspace`` out (the
  GPU-only part, printed apart).

Run: ``python benchmarks/bench_memory_options.py`` (fp32, 4K tokens, tiles of 1K; a few minutes on 2 cores);
``--dtype bf16``; ``--parts op`` for the attention alone. CUDA: ``--device cuda`` measures with
``max_memory_allocated`` and then compares the full planned terms (workspace included).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ringft without installing

MIB = 1 << 20
STEP_OPTIONS = {  # name: (attention_checkpoint, attention_tile_tokens)
    "recompute": ("recompute", None),
    "save": ("save", None),
    "offload": ("offload", None),
    "tiles": ("recompute", "TILE"),
}


def model_config(args: argparse.Namespace) -> dict:
    """The reduced Llama-3-8B shape (transformers LlamaConfig keys)."""
    return {
        "model_type": "llama",
        "vocab_size": args.vocab,
        "hidden_size": args.heads * 128,
        "intermediate_size": args.heads * 128 * 7 // 2,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": 128,
        "max_position_embeddings": args.seq,
        "tie_word_embeddings": False,
    }


def _options(args: argparse.Namespace, name: str) -> tuple[str, int | None]:
    mode, tile = STEP_OPTIONS[name]
    return mode, (args.tile if tile == "TILE" else None)


def planned_step(args: argparse.Namespace, name: str) -> int:
    """The planner's activation bytes of one step (what the RSS / allocator rise sees)."""
    from ringft.planner import plan_memory

    mode, tile = _options(args, name)
    plan = plan_memory(
        model_config(args),
        args.seq,
        1,
        1000.0,
        dtype=args.dtype,
        loss_chunk_size=args.loss_chunk,
        attn_backend="torch",
        attention_checkpoint=mode,
        attention_tile_tokens=tile,
        overhead_gib=0,
    )
    cpu = plan.details["host.attention"] if args.device == "cpu" else 0
    return plan.checkpointed_activations + max(plan.layer_working_set, plan.loss_working_set) + cpu


def planned_op(args: argparse.Namespace, tile: int | None) -> dict[str, int]:
    """The attention kernel's planned parts for the layer's shapes (+ the lse the op returns)."""
    from ringft.planner.kernel import attention_kernel_parts
    from ringft.planner.setup import TrainingSetup
    from ringft.planner.shapes import load_model_shape

    setup = TrainingSetup(
        seq_len=args.seq, num_gpus=1, cp_size=1, gpu_mem_gib=1000.0, dtype=args.dtype,
        attn_backend="torch", attention_tile_tokens=tile,
    )  # fmt: skip
    parts = attention_kernel_parts(load_model_shape(model_config(args)), setup)
    parts["lse"] = 4 * args.heads * args.seq
    return parts


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def measure_step(args: argparse.Namespace, name: str) -> int:
    """In this process: the peak rise of one training step with option set ``name``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ringft import apply_ring_attention
    from ringft.loss import CausalLMLoss
    from ringft.model.fused_rmsnorm import enable_fused_rmsnorm
    from ringft.ops.dtypes import dtype_from_name

    torch.set_num_threads(1)
    mode, tile = _options(args, name)
    torch.manual_seed(0)
    config = {k: v for k, v in model_config(args).items() if k != "model_type"}
    model = LlamaForCausalLM(LlamaConfig(**config, use_cache=False))
    model.to(device=args.device, dtype=dtype_from_name(args.dtype))
    enable_fused_rmsnorm(model)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    apply_ring_attention(model, None, "torch", attention_checkpoint=mode, attention_tile_tokens=tile)
    model.train()
    for p in model.parameters():  # resident grads: part of the baseline
        p.grad = torch.zeros_like(p)
    loss_fn = CausalLMLoss(model, chunked=True, chunk_size=args.loss_chunk, offload_activations=False)
    ids = torch.randint(1, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(args.device)
    batch = dict(
        input_ids=ids,
        position_ids=torch.arange(args.seq, device=args.device)[None],
        shift_labels=torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1),
        num_items_in_batch=torch.tensor(args.seq - 1),
    )

    def step() -> None:
        loss_fn(**batch).backward()
        model.zero_grad(set_to_none=False)

    step()  # warm-up: kernels, lazy imports, the grads' first write
    if args.device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _kib("VmRSS") * 1024
    step()
    return _kib("VmHWM") * 1024 - base


def measure_op(args: argparse.Namespace, tile: int | None) -> int:
    """In this process: the attention's extra peak (bench_attention_tiles's ``ring N=1`` case)."""
    import functools

    import torch

    from benchmarks.bench_attention_tiles import _ring, peak_extra
    from ringft.ops.dtypes import dtype_from_name

    torch.set_num_threads(1)
    dev, dtype = torch.device(args.device), dtype_from_name(args.dtype)
    torch.manual_seed(0)
    q = torch.randn(1, args.seq, args.heads, 128, device=dev, dtype=dtype)
    k = torch.randn(1, args.seq, args.kv_heads, 128, device=dev, dtype=dtype)
    v, dout = torch.randn_like(k), torch.randn_like(q)
    fn = functools.partial(_ring, "torch", tile, q, k, v, dout)
    fn()  # warm-up
    if args.device == "cuda":
        return peak_extra(fn, dev)
    # on CPU the kernel's high-water mark (a sampling thread can miss a short peak on a loaded core)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _kib("VmRSS") * 1024
    fn()
    return _kib("VmHWM") * 1024 - base


def _child(args: argparse.Namespace, job: str) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    argv = [sys.executable, __file__, *args.given, "--job", job]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode:
        raise RuntimeError(f"{job}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _pct(measured: float, planned: float) -> str:
    return f"{100 * (planned - measured) / measured:+.1f} %" if measured else "-"


def report_step(args: argparse.Namespace) -> list[str]:
    """Measure each option set in a fresh process; the table of differences from ``recompute``."""
    s = args.seq
    peaks = {name: _child(args, f"step:{name}") for name in STEP_OPTIONS}
    plans = {name: planned_step(args, name) for name in STEP_OPTIONS}
    lines = [
        "| option | peak MiB | planned MiB | diff vs recompute B/token, measured | planned | plan err |",
        "|---|---|---|---|---|---|",
    ]
    for name in STEP_OPTIONS:
        label = name if name != "tiles" else f"tiles {args.tile}"
        dm = (peaks[name] - peaks["recompute"]) / s
        dp = (plans[name] - plans["recompute"]) / s
        err = _pct(dm, dp) if name != "recompute" and abs(dm) > 64 else "-"
        lines.append(
            f"| {label} | {peaks[name] / MIB:.1f} | {plans[name] / MIB:.1f} | "
            f"{dm:+,.0f} | {dp:+,.0f} | {err} |"
        )
    return lines


def report_op(args: argparse.Namespace) -> list[str]:
    """Measure the attention alone, untiled and tiled, against the planner's kernel parts."""
    s, cpu = args.seq, args.device == "cpu"
    lines = [
        "| tile | extra B/token, measured | planned (CPU-visible: results + lse + max(tile buffers, casts)) "
        "| plan err | GPU-only workspace B/token |",
        "|---|---|---|---|---|",
    ]
    for tile in (None, args.tile):
        extra = _child(args, f"op:{tile or 0}")
        p = planned_op(args, tile)
        work = 0 if cpu else p["workspace"]
        plan = p["results"] + p["lse"] + max(work + p["tile_buffers"], p["casts"])
        lines.append(
            f"| {tile or 'untiled'} | {extra / s:,.0f} | {plan / s:,.0f} | {_pct(extra, plan)} | "
            f"{p['workspace'] / s:,.0f} |"
        )
    return lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--seq", type=int, default=4096, help="tokens (one sequence, CP 1)")
    p.add_argument("--tile", type=int, default=1024, help="attention_tile_tokens of the tiled runs")
    p.add_argument("--heads", type=int, default=4, help="query heads of 128 (hidden = 128 x heads)")
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--loss-chunk", type=int, default=1024)
    p.add_argument("--parts", default="step,op", help="step, op or both")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)  # child: step:NAME[+NAME] or op:TILE
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the selected parts (each measurement in a fresh process) and print Markdown."""
    args = _parser().parse_args(argv)
    if args.job:
        kind, value = args.job.split(":")
        if kind == "step":  # NAME or NAME+NAME+...: each a fresh model in this process
            names = value.split("+")
            result = [measure_step(args, n) for n in names] if len(names) > 1 else measure_step(args, value)
        else:
            result = measure_op(args, int(value) or None)
        print(json.dumps(result))
        return 0
    from benchmarks.machine import describe_machine

    args.given = sys.argv[1:] if argv is None else list(argv)
    parts = args.parts.split(",")
    lines = [
        f"- command: `python benchmarks/bench_memory_options.py {' '.join(args.given)}`".replace(" `", " `"),
        f"- machine: {describe_machine()}; {platform.platform()}; {args.device}; "
        f"{datetime.date.today().isoformat()}",
        f"- model: LLaMA {args.layers} layers, hidden {args.heads * 128} ({args.heads} / {args.kv_heads} "
        f"heads of 128), intermediate {args.heads * 128 * 7 // 2}, vocab {args.vocab}, {args.dtype}; "
        f"{args.seq} tokens, CP 1, loss chunk {args.loss_chunk}, fused RMSNorm, checkpointing",
        "",
    ]
    if "step" in parts:
        lines += ["Training step (fwd + bwd), peak rise per option:", "", *report_step(args), ""]
    if "op" in parts:
        lines += ["Attention alone (ring at one rank, fwd + bwd):", "", *report_op(args), ""]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
