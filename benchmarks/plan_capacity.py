"""Largest trainable sequence per GPU on 80 GB H100s, predicted by ``ringft.planner``.

Not a measurement: the planner's prediction for a Llama-3.2-1B- and a Llama-3-8B-shaped model,
full fine-tuning and LoRA, with ringft's memory options switched on one after the other, on one
GPU and on one node of 8 GPUs (the ring over all 8: cp = 8). The planner was checked against
measured peaks on an H100 at 32K tokens (-0.5 % .. -2.2 %, see RESULTS.md) and on CPU
(-1.7 % .. +5.7 %); at the lengths below the dominant terms (checkpointed layer inputs, the MLP
working set) are the same per-token terms, extrapolated linearly. The host memory that the
offload rows need is printed too (per GPU).

Run: ``python benchmarks/plan_capacity.py [--gpu-mem 79.6] [--out RESULTS.md]`` (a second).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ringft without installing

from benchmarks.machine import describe_machine  # noqa: E402
from ringft.planner import DEFAULT_LORA_TARGETS, GIB, max_seq_len_that_fits, plan_memory  # noqa: E402

MODELS = ["llama-3.2-1b", "llama-3-8b"]
# Cumulative option sets. "ckpt" = per-layer gradient checkpointing, on in every row (without it
# nothing long fits); the first row is what a plain Hugging Face training step keeps: full logits.
# Rows up to the ZeRO-3 offload one run autograd's RMSNorm backward (fused_rmsnorm=False), as before
# the fused norm; the rows after them add the fused norm and the attention tiles.
_OLD = {"fused_rmsnorm": False}
LADDER: list[tuple[str, dict[str, Any]]] = [
    ("ckpt, full logits (HF default loss)", {"chunked_loss": False, **_OLD}),
    ("+ chunked loss", {**_OLD}),
    ("+ tiled MLP", {"tiled_mlp": True, **_OLD}),
    ("+ activation offload", {"tiled_mlp": True, "offload_activations": True, **_OLD}),
    (
        "+ optimizer & param offload (ZeRO-3; grads in host memory)",
        {
            "tiled_mlp": True,
            "offload_activations": True,
            "offload_optimizer": True,
            "offload_params": True,
            **_OLD,
        },
    ),
]
FUSED = ("+ fused RMSNorm backward (`train.fused_rmsnorm`)", {**LADDER[4][1], "fused_rmsnorm": True})
TILES = (
    "+ attention tiles of 64K tokens (`train.attention_tile_tokens`)",
    {**FUSED[1], "attention_tile_tokens": 65536},
)
NEW_ROWS = [FUSED, TILES]
BF16_ADAPTERS_ALL = (
    "+ adapters in bf16 (`lora.adapter_dtype: model`)",
    {**TILES[1], "lora_fp32_adapters": False},
)


# Beside the ladder's last row: RMSNorms over token tiles (`train.tiled_norm_tokens`) on top of the
# activation-offload row (tiled norms are refused under DeepSpeed, whose offload the last row
# plans), then for LoRA the adapters in the model's dtype (`lora.adapter_dtype: model`: no fp32
# copy of a target's input)
TILED_NORMS = (
    "act. offload + tiled norms (no ZeRO offload: DDP / FSDP)",
    {**LADDER[3][1], "tiled_norm_tokens": 4096, "fused_rmsnorm": False},
)
BF16_ADAPTERS = (
    "+ adapters in bf16 (`lora.adapter_dtype: model`)",
    {**TILED_NORMS[1], "lora_fp32_adapters": False},
)


def _options(mode: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Planner options of one row: ZeRO-3, per-layer checkpointing, LoRA r16 for ``mode == "LoRA"``."""
    opts: dict[str, Any] = {"zero_stage": 3, "gradient_checkpointing": True, **extra}
    if mode == "LoRA":
        opts["lora"] = True  # r16 on all linear layers (the planner's default targets)
    return opts


def _k(tokens: int) -> str:
    """Tokens as ``64K`` / ``1.25M``."""
    if tokens == 0:
        return "0"
    return f"{tokens / 1e6:.2f}M" if tokens >= 1_000_000 else f"{tokens // 1024}K"


def capacity_rows(gpu_mem: float) -> list[dict[str, Any]]:
    """One row per (model, full / LoRA, option set): longest sequence on 1 GPU and on 8 (cp 8)."""
    rows = []
    for model in MODELS:
        for mode in ("full", "LoRA"):
            rows_of = LADDER + NEW_ROWS + ([BF16_ADAPTERS_ALL] if mode == "LoRA" else [])
            rows_of += [TILED_NORMS] + ([BF16_ADAPTERS] if mode == "LoRA" else [])
            for name, extra in rows_of:
                opts = _options(mode, extra)
                one = max_seq_len_that_fits(model, 1, gpu_mem, cp_size=1, **opts)
                node = max_seq_len_that_fits(model, 8, gpu_mem, cp_size=8, **opts)
                host = node_host = 0.0
                if one:
                    host = plan_memory(model, one, 1, gpu_mem, cp_size=1, **opts).cpu_offloaded / GIB
                if node:
                    node_host = plan_memory(model, node, 8, gpu_mem, cp_size=8, **opts).cpu_offloaded / GIB
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


def markdown(rows: list[dict[str, Any]], gpu_mem: float) -> str:
    """The rows as a Markdown table headed by the command, the machine and the planner settings."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = [
        f"Command: `python benchmarks/plan_capacity.py --gpu-mem {gpu_mem}` ({now}). Planner settings:",
        "bf16 weights with fp32 master weights and Adam states (full) / fp32 LoRA r16 adapters on",
        f"{', '.join(DEFAULT_LORA_TARGETS)} (LoRA); zero_stage 3 in every row: DeepSpeed ZeRO-3 or FSDP",
        "FULL_SHARD over the GPUs of the run (on one GPU: nothing to shard, i.e. DDP-equal; the offload",
        "rows are DeepSpeed ZeRO-3 offload, which also works on one GPU, its gradient partitions in host",
        "memory); micro-batch 1; flash-attn backend's transients; 3 GiB framework overhead; loss chunk",
        "4096 tokens; MLP tile = hidden size tokens. The first row is a plain transformers step's loss",
        "(12 T V bytes of fp32 logits and grads): at 32K on one H100 it plans 71 GiB and the measured",
        "step ran out of memory (RESULTS.md, issue 25 item 1): that row is optimistic. Host GiB: the",
        "offloaded optimizer states, gradient partitions, parameters and activations (per GPU; node: x 8).",
        f"Computed on {describe_machine()} (a prediction for GPUs: it does not depend on this machine).",
        "",
        "| model | mode | options (cumulative) | 1 GPU: max tokens | host GiB (1 GPU) "
        "| 8 GPUs, cp 8: max tokens | host GiB (node) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        host = f"{r['one_gpu_host_gib']:.1f}" if r["one_gpu_host_gib"] else "-"
        node_host = f"{r['node_host_gib']:.0f}" if r["node_host_gib"] else "-"
        cells = [r["model"], r["mode"], r["options"], _k(r["one_gpu"]), host, _k(r["node_cp8"]), node_host]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print (and with ``--out`` append) the capacity table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu-mem", type=float, default=79.6, help="GiB per GPU (an 80 GB H100: ~79.6)")
    p.add_argument("--out", default=None, help="append the table to this file")
    args = p.parse_args(argv)
    text = markdown(capacity_rows(args.gpu_mem), args.gpu_mem)
    print(text)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write("\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
