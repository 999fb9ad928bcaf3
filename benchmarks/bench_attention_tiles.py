"""Attention in query x key tiles (``attention_tile_tokens``, :mod:`ringft.ops.tiles`): peak memory
and time of one causal fwd+bwd, tiled vs untiled, on one device.

Two cases per length and tile: ``block`` (the backend's forward + backward on the causal diagonal
block, what a ring step runs) and ``ring N=1`` (``zigzag_ring_attention`` fwd+bwd at one rank, which
adds the ring's fp32 accumulators). "extra" is the peak above the inputs q, k, v, dout: allocator
peak on CUDA, resident-set peak on CPU (a thread sampling ``/proc/self/statm``, glibc told to
return freed blocks at once). Prints one Markdown table.

    python benchmarks/bench_attention_tiles.py                       # CPU, torch backend, < 60 s
    python benchmarks/bench_attention_tiles.py --device cuda --backend cudnn --dtype bf16 \\
        --seq 64K,128K --tiles 4096,16384 --heads 32 --kv-heads 8 --head-dim 128   # Llama-3-8B
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
from pathlib import Path

import torch

if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # freed tensors leave the RSS at once (CPU figures)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable, *sys.argv])

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_common import int_list, seq_label, timed  # noqa: E402
from benchmarks.bench_attention_memory import _PeakRss  # noqa: E402
from benchmarks.machine import describe_machine  # noqa: E402
from ringft.ops.backends import get_backend  # noqa: E402
from ringft.ops.dtypes import dtype_from_name  # noqa: E402
from ringft.ops.tiles import tiled  # noqa: E402
from ringft.ops.zigzag import zigzag_ring_attention  # noqa: E402

Tensor = torch.Tensor
GIB = 2**30


def _block(kernel, q: Tensor, k: Tensor, v: Tensor, dout: Tensor) -> None:
    scale = q.shape[-1] ** -0.5
    out, lse = kernel.forward(q, k, v, True, scale)
    kernel.backward(dout, q, k, v, out, lse, True, scale)


def _ring(backend: str, tile: int | None, q: Tensor, k: Tensor, v: Tensor, dout: Tensor) -> None:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    zigzag_ring_attention(q, k, v, backend=backend, attention_tile_tokens=tile).backward(dout)


def peak_extra(fn, device: torch.device) -> int:
    """Peak bytes above what was allocated before ``fn()`` ran."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    base = _PeakRss.current()
    with _PeakRss() as rss:
        fn()
    return rss.peak - base


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--backend", default="torch", help="block backend (cudnn on an H100/H200)")
    p.add_argument("--dtype", default="fp32", help="fp32 | bf16 | fp16 | fp64")
    p.add_argument("--seq", default="1K,2K", help="local tokens (one rank's block), e.g. 64K,128K")
    p.add_argument("--tiles", default="256,1024", help="attention_tile_tokens values to compare")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="timed runs (median) after one warm-up")
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), dtype_from_name(args.dtype)
    torch.manual_seed(0)
    gpu = f"; {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    print(f"- {describe_machine()}{gpu}")
    print(
        f"- torch {torch.__version__}; backend {args.backend}; {args.dtype}; heads {args.heads}/"
        f"{args.kv_heads}, head_dim {args.head_dim}; causal fwd+bwd; median of {args.repeats} after 1 "
        f"warm-up; threads {torch.get_num_threads()}"
    )
    print("\n| local tokens | case | tile | ms | extra peak GiB | extra bytes / token |")
    print("|---|---|---|---|---|---|")
    base_kernel = get_backend(args.backend, device, dtype, args.head_dim)
    for s in int_list(args.seq):
        q = torch.randn(1, s, args.heads, args.head_dim, device=device, dtype=dtype)
        k = torch.randn(1, s, args.kv_heads, args.head_dim, device=device, dtype=dtype)
        v, dout = torch.randn_like(k), torch.randn_like(q)
        for tile in [None, *int_list(args.tiles)]:
            kernel = tiled(base_kernel, tile)
            cases = {
                "block": functools.partial(_block, kernel, q, k, v, dout),
                "ring N=1": functools.partial(_ring, args.backend, tile, q, k, v, dout),
            }
            for name, fn in cases.items():
                fn()  # warm-up (kernel selection, cuDNN graph build)
                times = [timed(fn, device) for _ in range(args.repeats)]
                extra = peak_extra(fn, device)
                label = "untiled" if tile is None else str(tile)
                print(
                    f"| {seq_label(s)} | {name} | {label} | {1e3 * statistics.median(times):.1f} | "
                    f"{extra / GIB:.3f} | {extra / s:,.0f} |",
                    flush=True,
                )
        q = k = v = dout = None
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
