"""Block-attention backends on a GPU: causal fwd+bwd time, TFLOP/s and extra peak memory.

Each backend (``torch``, ``cudnn``, ``flash_attn`` where installed) runs one causal block over the
whole sequence through ringft's :class:`~ringft.ops.backends.BlockAttention` calls (what one ring
step runs), next to one fused ``F.scaled_dot_product_attention`` call (autograd, ``enable_gqa``)
pinned to PyTorch's flash kernel and to its cuDNN kernel; then the emulated zigzag ring at
``--ring-world`` ranks (compute only) with each backend. Llama-3-8B attention shape by default.
Prints markdown and writes JSON lines to ``--json``.

    python benchmarks/bench_backends_cuda.py --seq 16K,64K,128K --json out.jsonl

``--device cpu`` runs the same cases on the CPU (wall-clock time, the resident set's rise for the
extra memory; the cuDNN cases are left out): a dry run of the command, not a GPU figure.

FLOPs (FlashAttention's convention): forward ``4 * S^2 * H * D / 2`` for a causal block, backward
2.5x the forward, so fwd+bwd = ``7 * S^2 * H * D``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_attention_memory import _PeakRss  # noqa: E402
from ringft.ops.backends import FlashAttnBackend, default_softmax_scale, get_backend  # noqa: E402
from ringft.ops.dtypes import dtype_from_name  # noqa: E402
from ringft.ops.emulate import emulate_zigzag_attention  # noqa: E402


def _parse(text: str) -> list[int]:
    return [int(x[:-1]) * 1024 if x.endswith("K") else int(x) for x in text.split(",")]


def _time(fn, repeats: int, warmup: int = 2, device: torch.device | None = None) -> tuple[float, float]:
    """(median ms, extra peak GiB) of ``fn`` over ``repeats`` runs after ``warmup``."""
    for _ in range(warmup):
        fn()
    if device is not None and device.type == "cpu":
        base, times = _PeakRss.current(), []
        with _PeakRss() as rss:
            for _ in range(repeats):
                tic = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - tic))
        return statistics.median(times), (rss.peak - base) / 2**30
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**30


def _inputs(seq: int, args: argparse.Namespace) -> list[torch.Tensor]:
    """q, k, v, dout ``(1, seq, heads, head_dim)`` on ``--device`` in ``--dtype``, seeded."""
    gen = torch.Generator(device=args.device).manual_seed(0)
    heads = (args.heads, args.kv_heads, args.kv_heads, args.heads)
    dtype = dtype_from_name(args.dtype)
    return [
        torch.randn(1, seq, h, args.head_dim, device=args.device, generator=gen, dtype=dtype) for h in heads
    ]


def _label(seq: int) -> str:
    return f"{seq // 1024}K" if seq % 1024 == 0 else str(seq)


def _ring(q, k, v, dout, world: int, backend: str):
    return lambda: emulate_zigzag_attention(q, k, v, world, backend=backend, dout=dout)


def _block(name, q, k, v, dout):
    kernel = get_backend(name, q.device, q.dtype, q.shape[-1])
    scale = default_softmax_scale(q.shape[-1])

    def run():
        out, lse = kernel.forward(q, k, v, True, scale)
        kernel.backward(dout, q, k, v, out, lse, True, scale)

    return run


def _fused(sdp: SDPBackend, q, k, v, dout, expand: bool):
    """One autograd SDPA call; ``expand``: K/V heads repeated beforehand (untimed) for kernels
    without native GQA (PyTorch's flash kernel), else ``enable_gqa``."""
    if expand:
        groups = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    dt = dout.transpose(1, 2)

    def run():
        with sdpa_kernel(sdp):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=not expand)
        out.backward(dt)
        qt.grad = kt.grad = vt.grad = None

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", default="16K,64K,128K")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ring-world", type=int, default=8)
    p.add_argument("--ring-seq", default="128K", help="lengths for the emulated ring ('' for none)")
    p.add_argument("--backends", default=None, help="comma-separated subset of torch,cudnn,flash_attn")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run")
    p.add_argument("--dtype", default="bf16", help="bf16 | fp16 | fp32")
    args = p.parse_args()
    dev = torch.device(args.device)
    cpu = dev.type == "cpu"
    backends = (
        ["torch"] if cpu else ["torch", "cudnn"] + (["flash_attn"] if FlashAttnBackend.is_available() else [])
    )
    if args.backends:
        backends = [b for b in backends if b in args.backends.split(",")]
    if cpu:
        print(f"CPU (dry run, not a GPU figure), torch {torch.__version__}")
    else:
        cudnn = torch.backends.cudnn.version()
        print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {cudnn}")
    print(f"auto picks: {get_backend('auto', dev, dtype_from_name(args.dtype), args.head_dim).name}")
    rows = []
    for seq in _parse(args.seq):
        q, k, v, dout = _inputs(seq, args)
        flops = 7 * seq**2 * args.heads * args.head_dim
        cases = {f"block {b}": _block(b, q, k, v, dout) for b in backends}
        cases["fused sdpa (flash, K/V expanded)"] = _fused(SDPBackend.FLASH_ATTENTION, q, k, v, dout, True)
        if not cpu:
            cases["fused sdpa (cudnn, enable_gqa)"] = _fused(SDPBackend.CUDNN_ATTENTION, q, k, v, dout, False)
        for name, fn in cases.items():
            try:
                ms, gib = _time(fn, args.repeats, device=dev)
            except RuntimeError as exc:
                print(f"{seq} {name}: failed: {str(exc).splitlines()[0][:200]}")
                continue
            rows.append(dict(seq=seq, case=name, ms=ms, tflops=flops / ms / 1e9, extra_gib=gib))
            print(f"| {_label(seq)} | {name} | {ms:.1f} | {flops / ms / 1e9:.0f} | {gib:.2f} |", flush=True)
        del q, k, v, dout, cases
        if not cpu:
            torch.cuda.empty_cache()
    for seq in _parse(args.ring_seq) if args.ring_seq else []:
        q, k, v, dout = _inputs(seq, args)
        for b in backends:
            n = args.ring_world
            ms, _ = _time(_ring(q, k, v, dout, n, b), args.repeats, warmup=1, device=dev)
            flops = 7 * seq**2 * args.heads * args.head_dim
            rows.append(dict(seq=seq, case=f"ring N={n} emulated {b}", ms=ms, tflops=flops / ms / 1e9))
            print(
                f"| {_label(seq)} | ring N={n} (emulated) {b} | {ms:.1f} | {flops / ms / 1e9:.0f} | - |",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
