"""Peak CUDA memory of fwd+bwd attention at long context: the ring operator vs one fused call.

Per-rank view: with N ranks a rank holds S/N tokens; its ring working set is its own q/k/v/out,
the fp32 accumulators, and two K/V + two dK/dV ring buffers. On one GPU we measure the operator at
N = 1 over the local length (what one rank of an N-rank ring holds) against the fused kernel, and
the one-rank share of the emulated schedule (``run_schedule(ranks=[0])`` minus the other ranks'
inputs it keeps around) is left out for simplicity.

    python benchmarks/bench_attention_memory_cuda.py --seq 64K,128K,256K,512K
"""

from __future__ import annotations

import argparse
import datetime

import torch

from ringft import zigzag_ring_attention
from ringft.ops.backends import TorchBackend


def _parse(text: str) -> list[int]:
    return [int(x[:-1]) * 1024 if x.endswith("K") else int(x) for x in text.split(",")]


def peak_gib(fn, *args) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*args)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def _ring(q, k, v, dout) -> None:
    zigzag_ring_attention(q, k, v, backend="torch").backward(dout)
    q.grad = k.grad = v.grad = None


def _fused(kernel, q, k, v, dout) -> None:
    scale = q.shape[-1] ** -0.5
    out, lse = kernel.forward(q, k, v, True, scale)
    kernel.backward(dout, q, k, v, out, lse, True, scale)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", default="64K,128K,256K,512K")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    print(
        f"- {torch.cuda.get_device_name()}; torch {torch.__version__}; "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    )
    print(
        "| tokens on the GPU | inputs q,k,v,dout GiB | ring op (N=1) extra peak GiB "
        "| fused call extra peak GiB |"
    )
    print("|---|---|---|---|")
    kernel = TorchBackend()
    for s in _parse(args.seq):
        q = torch.randn(1, s, args.heads, args.head_dim, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(1, s, args.kv_heads, args.head_dim, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        dout = torch.randn_like(q)
        inputs = sum(t.numel() * t.element_size() for t in (q, k, v, dout)) / 2**30

        r = peak_gib(_ring, q, k, v, dout)
        f = peak_gib(_fused, kernel, q.detach(), k.detach(), v.detach(), dout)
        print(f"| {s // 1024}K | {inputs:.2f} | {r:.2f} | {f:.2f} |", flush=True)
        q = k = v = dout = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
