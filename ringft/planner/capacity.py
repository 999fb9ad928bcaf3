"""``ringft plan --capacity-table``: the longest trainable sequence per GPU, as planned.

A prediction, not a measurement: for a Llama-3.2-1B- and a Llama-3-8B-shaped model, full fine-tuning
and LoRA, ringft's memory options switched on one after the other, on one GPU and on one node of 8
GPUs (the ring over all 8: cp = 8), with the host memory the offload rows need. Which planner terms
were checked against which measurement: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
from typing import Any

from ringft.planner.plan import plan_memory
from ringft.planner.search import max_seq_len_that_fits
from ringft.planner.setup import GIB
from ringft.planner.shapes import DEFAULT_LORA_TARGETS

__all__ = ["capacity_main", "capacity_rows", "capacity_table"]

MODELS = ("llama-3.2-1b", "llama-3-8b")
# Cumulative option sets. "ckpt" = per-layer gradient checkpointing, on in every row (without it
# nothing long fits); the first row is what a plain Hugging Face training step keeps: full logits.
# Rows up to the ZeRO-3 offload one run autograd's RMSNorm backward (fused_rmsnorm=False); the rows
# after them add the fused norm and the attention tiles.
_AUTOGRAD_NORM = {"fused_rmsnorm": False}
_OFFLOAD_ALL = {
    "tiled_mlp": True,
    "offload_activations": True,
    "offload_optimizer": True,
    "offload_params": True,
}
LADDER: list[tuple[str, dict[str, Any]]] = [
    ("ckpt, full logits (HF default loss)", {"chunked_loss": False, **_AUTOGRAD_NORM}),
    ("+ chunked loss", {**_AUTOGRAD_NORM}),
    ("+ tiled MLP", {"tiled_mlp": True, **_AUTOGRAD_NORM}),
    ("+ activation offload", {"tiled_mlp": True, "offload_activations": True, **_AUTOGRAD_NORM}),
    ("+ optimizer & param offload (ZeRO-3; grads in host memory)", {**_OFFLOAD_ALL, **_AUTOGRAD_NORM}),
]
FUSED = ("+ fused RMSNorm backward (`train.fused_rmsnorm`)", {**_OFFLOAD_ALL, "fused_rmsnorm": True})
TILES = (
    "+ attention tiles of 64K tokens (`train.attention_tile_tokens`)",
    {**FUSED[1], "attention_tile_tokens": 65536},
)
BF16_ADAPTERS_ALL = (
    "+ adapters in bf16 (`lora.adapter_dtype: model`)",
    {**TILES[1], "lora_fp32_adapters": False},
)
# Beside the ladder: RMSNorms over token tiles (`train.tiled_norm_tokens`) on top of the activation
# offload row (tiled norms are refused under DeepSpeed, whose offload the ladder plans), then for
# LoRA the adapters in the model's dtype (no fp32 copy of a target's input).
TILED_NORMS = (
    "act. offload + tiled norms (no ZeRO offload: DDP / FSDP)",
    {**LADDER[3][1], "tiled_norm_tokens": 4096},
)
BF16_ADAPTERS = (
    "+ adapters in bf16 (`lora.adapter_dtype: model`)",
    {**TILED_NORMS[1], "lora_fp32_adapters": False},
)


def _rows_of(mode: str) -> list[tuple[str, dict[str, Any]]]:
    lora = mode == "LoRA"
    return [
        *LADDER,
        FUSED,
        TILES,
        *([BF16_ADAPTERS_ALL] if lora else []),
        TILED_NORMS,
        *([BF16_ADAPTERS] if lora else []),
    ]


def _options(mode: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Planner options of one row: ZeRO-3, per-layer checkpointing, LoRA r16 for ``mode == "LoRA"``."""
    opts: dict[str, Any] = {"zero_stage": 3, "gradient_checkpointing": True, **extra}
    if mode == "LoRA":
        opts["lora"] = True  # r16 on the planner's default targets
    return opts


def tokens_label(tokens: int) -> str:
    """Tokens as ``64K`` / ``1.25M`` (``0``: nothing fits)."""
    if tokens == 0:
        return "0"
    return f"{tokens / 1e6:.2f}M" if tokens >= 1_000_000 else f"{tokens // 1024}K"


def capacity_rows(gpu_mem: float, models: tuple[str, ...] = MODELS) -> list[dict[str, Any]]:
    """One dict per (model, full / LoRA, option set): the longest sequence on 1 GPU and on 8 (cp 8),
    and the host GiB the plan offloads (per GPU; ``node_host_gib``: the whole node)."""
    rows = []
    for model in models:
        for mode in ("full", "LoRA"):
            for name, extra in _rows_of(mode):
                opts = _options(mode, extra)
                one = max_seq_len_that_fits(model, 1, gpu_mem, cp_size=1, **opts)
                node = max_seq_len_that_fits(model, 8, gpu_mem, cp_size=8, **opts)
                host = (
                    plan_memory(model, one, 1, gpu_mem, cp_size=1, **opts).cpu_offloaded / GIB if one else 0.0
                )
                node_host = (
                    plan_memory(model, node, 8, gpu_mem, cp_size=8, **opts).cpu_offloaded / GIB
                    if node
                    else 0.0
                )
                rows.append(
                    {
                        "model": model,
                        "mode": mode,
                        "options": name,
                        "one_gpu": one,
                        "one_gpu_host_gib": host,
                        "node_cp8": node,
                        "node_host_gib": 8 * node_host,
                    }
                )
    return rows


def capacity_table(rows: list[dict[str, Any]], gpu_mem: float) -> str:
    """``rows`` as a Markdown table headed by the command, the date and the planner settings."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = [
        f"Command: `ringft plan --capacity-table --gpu-mem {gpu_mem:g}` ({now}); planned, not measured.",
        "Planner settings: bf16 weights with fp32 master weights and Adam states (full) / fp32 LoRA r16",
        f"adapters on {', '.join(DEFAULT_LORA_TARGETS)} (LoRA); zero_stage 3 in every row: DeepSpeed",
        "ZeRO-3 or FSDP FULL_SHARD over the GPUs of the run (on one GPU: nothing to shard, i.e. DDP-equal;",
        "the offload rows are DeepSpeed ZeRO-3 offload, which also works on one GPU, its gradient",
        "partitions in host memory); micro-batch 1; flash-attn backend's transients; 3 GiB framework",
        "overhead; loss chunk 4096 tokens; MLP tile = hidden size tokens. The first row is a plain",
        "transformers step's loss (12 T V bytes of fp32 logits and grads): at 32K on one H100 it plans",
        "71 GiB where the measured step ran out of memory, so that row is optimistic. Host GiB: the",
        "offloaded optimizer states, gradient partitions, parameters and activations (per GPU; node: x 8).",
        "",
        "| model | mode | options (cumulative) | 1 GPU: max tokens | host GiB (1 GPU) "
        "| 8 GPUs, cp 8: max tokens | host GiB (node) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        host = f"{r['one_gpu_host_gib']:.1f}" if r["one_gpu_host_gib"] else "-"
        node_host = f"{r['node_host_gib']:.0f}" if r["node_host_gib"] else "-"
        cells = [r["model"], r["mode"], r["options"], tokens_label(r["one_gpu"]), host]
        cells += [tokens_label(r["node_cp8"]), node_host]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def capacity_main(argv: list[str]) -> int:
    """``ringft plan --capacity-table [--gpu-mem G] [--out FILE]``: print (and append) the table."""
    p = argparse.ArgumentParser(
        prog="ringft plan --capacity-table",
        description="The planner's longest trainable sequence per GPU for Llama-3.2-1B / Llama-3-8B shapes.",
    )
    p.add_argument("--capacity-table", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gpu-mem", type=float, default=79.6, help="GiB per GPU (an 80 GB H100: ~79.6)")
    p.add_argument("--out", default=None, help="also append the table to this file")
    args = p.parse_args(argv)
    if not args.gpu_mem > 0:
        print(f"ringft plan: error: --gpu-mem {args.gpu_mem:g} must be > 0 GiB (e.g. 79.6)")
        return 2
    text = capacity_table(capacity_rows(args.gpu_mem), args.gpu_mem)
    print(text, end="")
    if args.out:
        with open(args.out, "a") as fh:
            fh.write("\n" + text)
    return 0
