"""Peak memory of one RMSNorm forward + backward, untiled vs tiled (``ringft.model.tiled_norm``) vs
fused (``ringft.model.fused_rmsnorm``), on CPU, against the planner's terms for it.

Each case runs in a fresh process (``MALLOC_MMAP_THRESHOLD_`` set so that freed buffers return to
the OS): a ``LlamaRMSNorm`` of width ``h`` on a bf16 ``(T, h)`` input that requires grad, with the
output grad made beforehand; peak = rise of the process's RSS high-water mark (``VmHWM`` after
``clear_refs``) over forward + backward. Planned, with ``a = 2`` (bf16), from
``ringft.planner.formulas`` (``RMSNORM_BACKWARD_TEMPS``):

- untiled: the saved fp32 copy and rsqrt ``T*(4h + 4)``, the output ``a*T*h``, the backward's five
  fp32 temporaries ``5*4*T*h`` and the input grad ``a*T*h``;
- tiled (``c`` tokens per tile): the output ``a*T*h``, one tile's recompute and temporaries
  ``c*(6*4*h + 4)``, the tiles' input grads, their cat and two more ``a*T*h`` seen here
  (``TILED_NORM_GRADS * a*T*h``);
- fused (``tile`` given as ``f``; its norm has a bf16 weight, as a bf16 model's has, and so has
  the untiled case ``b`` it is compared with; the other two cases keep the fp32 weight they were
  first recorded with, whose fp32 output and output grad add ``2*a*T*h``): the rstd ``4*T`` (its
  input is the caller's), the output and the input grad ``2*a*T*h``, one row chunk's fp32 temporaries
  ``FUSED_NORM_TEMPS * 4 * min(T, CHUNK_ROWS) * h``.

Run: ``python benchmarks/bench_tiled_norm.py [--seqs 16384,65536] [--hidden 1024] [--tile 4096]``
(under a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ringft without installing

MIB = 1 << 20


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def measure(seq: int, hidden: int, tile: int | str) -> int:
    """Peak RSS rise (bytes) of one norm forward + backward in this process (``tile`` 0: untiled,
    ``"f"``: fused, ``"b"``: untiled; both with a bf16 weight)."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from ringft.model.tiled_norm import enable_tiled_norm

    torch.set_num_threads(1)
    holder = torch.nn.Module()
    holder.config = LlamaConfig(hidden_size=hidden)
    holder.norm = LlamaRMSNorm(hidden)
    if tile in ("f", "b"):  # a bf16 model's norm (bf16 weight: bf16 output and output grad)
        holder.norm.to(torch.bfloat16)
    if tile == "f":
        from ringft.model.fused_rmsnorm import enable_fused_rmsnorm

        enable_fused_rmsnorm(holder)
    elif tile and tile != "b":
        enable_tiled_norm(holder, tile_tokens=tile)
    x = torch.randn(seq, hidden, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(seq, hidden, dtype=torch.bfloat16)
    small = torch.randn(64, hidden, dtype=torch.bfloat16, requires_grad=True)
    holder.norm(small).backward(grad[:64])  # warm-up: page in every code path
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _kib("VmRSS") * 1024
    holder.norm(x).backward(grad)
    return _kib("VmHWM") * 1024 - base


def planned(seq: int, hidden: int, tile: int | str) -> int:
    """The planner's terms for one isolated norm (see the module docstring)."""
    from ringft.model.fused_rmsnorm import CHUNK_ROWS
    from ringft.planner.formulas import FUSED_NORM_TEMPS
    from ringft.planner.formulas import RMSNORM_BACKWARD_TEMPS as temps
    from ringft.planner.formulas import TILED_NORM_GRADS as grads

    a, t, h = 2, seq, hidden
    if tile == "f":
        return 4 * t + 2 * a * t * h + FUSED_NORM_TEMPS * 4 * min(t, CHUNK_ROWS) * h
    if not tile or tile == "b":
        return t * (4 * h + 4) + a * t * h + temps * 4 * t * h + a * t * h
    return a * t * h + min(tile, t) * ((temps + 1) * 4 * h + 4) + grads * a * t * h


def main(argv: list[str] | None = None) -> int:
    """Measure each case in a fresh process; print the Markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="16384,65536")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--tile", type=int, default=4096)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: "seq,hidden,tile[,tile...]"
    args = p.parse_args(argv)
    if args.one:  # one process, the cases one after the other (freed buffers go back to the OS)
        seq, hidden, *tiles = (v if v in ("f", "b") else int(v) for v in args.one.split(","))
        print(json.dumps([measure(seq, hidden, tile) for tile in tiles]))
        return 0
    from benchmarks.machine import describe_machine

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        for tile in (0, args.tile, "b", "f"):  # a fresh process per case
            out = subprocess.run(
                [sys.executable, __file__, "--one", f"{seq},{args.hidden},{tile}"],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                timeout=600,
            ).stdout
            got, plan = json.loads(out.strip().splitlines()[-1])[0], planned(seq, args.hidden, tile)
            rows.append((seq, tile, got, plan))
    print("### Tiled RMSNorm: peak of one forward + backward, measured vs planned (CPU)\n")
    print(
        f"- command: `python benchmarks/bench_tiled_norm.py --seqs {args.seqs} --hidden {args.hidden} "
        f"--tile {args.tile}`"
    )
    print(f"- machine: {describe_machine()}; {datetime.date.today().isoformat()}\n")
    print("| T | tiles | measured MiB | planned MiB | measured / planned |")
    print("|---|---|---|---|---|")
    for seq, tile, got, plan in rows:
        names = {"f": "fused (bf16 weight)", "b": "untiled (bf16 weight)", 0: "untiled"}
        label = names.get(tile, f"{tile} tokens")
        print(f"| {seq} | {label} | {got / MIB:.0f} | {plan / MIB:.0f} | {got / plan:.2f} |")
    for seq in sorted({r[0] for r in rows}):
        plain, tiled, plain_bf16, fused = (r[2] for r in rows if r[0] == seq)
        print(
            f"\nT = {seq}: measured tiled / untiled {tiled / plain:.2f}, fused / untiled (bf16 weights) "
            f"{fused / plain_bf16:.2f}",
            end="",
        )
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
