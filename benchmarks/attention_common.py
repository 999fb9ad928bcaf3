"""What the zigzag ring attention benchmarks share: inputs, timing, the Markdown report, the options.

The benchmarks, one script each (``--help`` lists the options):

- ``bench_attention_overhead.py``: ring schedule vs one fused causal call, fwd+bwd time;
- ``bench_attention_balance.py``: per-rank compute time, zigzag vs contiguous sharding;
- ``bench_attention_memory.py``: per-rank peak memory of the real operator at N gloo ranks;
- ``bench_attention_overlap.py``: real 2-rank operator vs the same rank without communication.

Each prints Markdown tables headed by the command, machine, torch version and date (one per dtype);
``--markdown-out PATH`` appends them to a file as well.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import sys
import time
from collections.abc import Callable

import torch

from benchmarks.machine import describe_machine
from ringft.ops import DTYPES as _ALL_DTYPES
from ringft.ops.sharding import cp_shard
from ringft.ops.zigzag import zigzag_ring_attention

Tensor = torch.Tensor
DTYPES = {name: _ALL_DTYPES[name] for name in ("bf16", "fp32", "fp16")}
MIB = 1024 * 1024


# ----------------------------------------------------------------------------------------------
# inputs and timing


def int_list(text: str) -> list[int]:
    """Parse ``"2K,4096,16k"`` into ``[2048, 4096, 16384]``."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if item:
            out.append(int(item[:-1]) * 1024 if item.endswith("k") else int(item))
    return out


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of ``fn()`` (device-synchronised on both ends)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def make(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A seeded normal tensor drawn in fp32 on the CPU, then cast and moved."""
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def make_inputs(
    seed: int,
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Seeded global ``q, k, v, dout`` in layout ``(batch, seq, heads, dim)`` (CPU RNG, same everywhere)."""
    gen = torch.Generator().manual_seed(seed)
    q = make((batch, seq, heads, dim), gen, dtype, device)
    k = make((batch, seq, kv_heads, dim), gen, dtype, device)
    v = make((batch, seq, kv_heads, dim), gen, dtype, device)
    dout = make((batch, seq, heads, dim), gen, dtype, device)
    return q, k, v, dout


def shards(t: Tensor, n: int) -> list[Tensor]:
    """The zigzag shards of ``t`` (sequence dim 1) for ranks ``0..n-1``."""
    return [cp_shard(t, r, n).contiguous() for r in range(n)]


def operator_fwd_bwd(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, backend: str) -> None:
    """The real autograd operator (world group, or none), fwd+bwd; leaves' grads are reset."""
    for t in (q, k, v):
        t.grad = None
    out = zigzag_ring_attention(q, k, v, causal=True, backend=backend)
    out.backward(dout)


# ----------------------------------------------------------------------------------------------
# the report


def seq_label(seq: int) -> str:
    """``8192`` -> ``"8K"``; other lengths as they are."""
    return f"{seq // 1024}K" if seq % 1024 == 0 else str(seq)


def ms(seconds: float) -> str:
    """Milliseconds with about three significant digits."""
    value = seconds * 1e3
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def ratio_stats(ratios: list[float]) -> str:
    """``median (min-max)`` of per-repeat ratios."""
    return f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"


def header(args: argparse.Namespace, title: str, device: torch.device) -> list[str]:
    """Markdown heading lines: command, machine, torch version, threads, date."""
    machine = describe_machine()  # CPU model and instruction set: CPU figures depend on both
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%a %b %d %H:%M:%S UTC %Y")
    cmd = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    return [
        f"### {title}",
        "",
        f"- command: `{cmd}`",
        f"- machine: {machine}; device {device.type}",
        f"- torch {torch.__version__}; torch.set_num_threads({args.threads}); backend `{args.backend}`; "
        f"batch {args.batch}, heads {args.heads}, kv_heads {args.kv_heads}, head_dim {args.head_dim}",
        f"- date: {date}",
        "",
    ]


def table(columns: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def emit(args: argparse.Namespace, lines: list[str]) -> None:
    """Print the lines, and append them to ``--markdown-out`` if given."""
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if args.markdown_out:
        with open(args.markdown_out, "a", encoding="utf-8") as fh:
            fh.write(text + "\n")


# ----------------------------------------------------------------------------------------------
# options and the run


def common_parser(doc: str) -> argparse.ArgumentParser:
    """The options every attention benchmark takes; a script adds its own, then calls :func:`parse`."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bf16,fp32", help="comma-separated: bf16, fp32, fp16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--backend", default="torch", help="ring and fused backend")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in this process")
    p.add_argument("--markdown-out", default=None, help="append the tables to this Markdown file")
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; ``args.dtypes`` is the checked list of ``--dtype``."""
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad:
        p.error(f"unknown dtype: {bad}")
    return args


def run(name: str, report: Callable[[argparse.Namespace, torch.device, str], None], args) -> None:
    """Run ``report(args, device, dtype_name)`` for every dtype (time of each on stderr)."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    for dtype_name in args.dtypes:
        t0 = time.perf_counter()
        report(args, device, dtype_name)
        print(f"[{name} {dtype_name}: {time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
