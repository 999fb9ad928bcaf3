"""Training-step memory and speed on CPU with ringft's memory options, measured vs planned.

For a small LLaMA (fp32, or bf16 with ``--dtype bf16``) one training step (forward + backward, no
optimizer) is run per (option set, sequence length, CP size) in gloo processes
(``ringft.utils.spawn.run_distributed``; one process for CP = 1, two for CP = 2, 1 thread each).
Option sets are cumulative:

- ``baseline``: full logits (transformers' loss), no checkpointing;
- ``chunked``: ``ringft.loss`` chunked lm_head + cross-entropy;
- ``+ckpt``: per-layer gradient checkpointing (non-reentrant);
- ``+offload``: ``save_on_cpu`` around the decoder (on CPU the "offloaded" copies stay in the same
  memory: only meaningful on GPU; reported for completeness);
- ``+tiled``: ``ringft.model.tiled_mlp`` (MLP over token tiles, each checkpointed).

Memory: the rise of the process's resident set during the step. Before each step the kernel's
high-water mark is reset to the current RSS (``echo 5 > /proc/self/clear_refs``) and that RSS is
the baseline (model weights and zero-filled grads in the model dtype, pre-allocated and kept between steps as
DDP's buckets keep them); the peak is ``VmHWM`` after the step minus the baseline: the step's
activations and transients. ``MALLOC_MMAP_THRESHOLD_`` is set in
the measured processes so that freed large buffers go back to the OS (glibc otherwise keeps them
in its heap and RSS never falls between steps). The planner (``ringft.planner``, ``dtype`` as
measured, no overhead constant) is compared with ``checkpointed + max(layer, loss working set)`` (+ the
activations it counts as offloaded, since on CPU they stay in RSS): the step has no optimizer and
weights and grads are in the baseline.

With ``--dtype bf16`` the model's weights and grads are bf16 (no fp32 master copy: the step has
no optimizer) and the planner is asked for ``dtype="bf16"``; its activation terms then use 2-byte
values, with the fp32 parts it models (RMSNorm's upcast, attention lse, loss logits) kept at 4 B.

Run: ``python benchmarks/bench_memory.py`` (about 6-8 minutes on 2 cores). ``--configs`` picks
option sets, ``--max-plan-gib`` skips sweep steps whose planned per-process total (weights + grads
+ activations) is larger (listed under the table), ``--no-search`` / ``--no-sweep`` run one part.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ringft without installing

from benchmarks.machine import describe_machine  # noqa: E402
from ringft.ops import DTYPES  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30

MODEL: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 65536,
    "tie_word_embeddings": False,
}
LOSS_CHUNK = 512
TILE_TOKENS = 1024
MEASURED_DTYPES = ("fp32", "bf16")
CONFIGS: dict[str, dict[str, bool]] = {
    "baseline": {"chunked": False, "ckpt": False, "offload": False, "tiled": False},
    "chunked": {"chunked": True, "ckpt": False, "offload": False, "tiled": False},
    "+ckpt": {"chunked": True, "ckpt": True, "offload": False, "tiled": False},
    "+offload": {"chunked": True, "ckpt": True, "offload": True, "tiled": False},
    "+tiled": {"chunked": True, "ckpt": True, "offload": True, "tiled": True},
}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> int:
    """Reset the RSS high-water mark to the current RSS; return that RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def _build_model(dtype: str = "fp32") -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, attn_implementation="sdpa"))
    model.to(DTYPES[dtype])  # weights (and hence grads and activations) in the model dtype
    model.config.use_cache = False
    return model.train()


def _set_options(model: torch.nn.Module, opts: dict[str, bool]) -> None:
    from ringft.model.tiled_mlp import disable_tiled_mlp, enable_tiled_mlp

    if opts["ckpt"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    if opts["tiled"]:
        enable_tiled_mlp(model, tile_tokens=TILE_TOKENS)
    else:
        disable_tiled_mlp(model)
    model.train()


def _step(model: torch.nn.Module, seq: int, rank: int, world: int, opts: dict[str, bool]) -> float:
    """One forward + backward of a ``seq``-token sequence (global); returns seconds."""
    from ringft import RingDataCollator
    from ringft.loss import CausalLMLoss

    gen = torch.Generator().manual_seed(seq)
    ids = torch.randint(1, MODEL["vocab_size"], (seq,), generator=gen).tolist()
    batch = RingDataCollator(rank, world, pad_token_id=0)([{"input_ids": ids}])
    loss_fn = CausalLMLoss(model, opts["chunked"], LOSS_CHUNK, opts["offload"])
    if world > 1:
        torch.distributed.barrier()
    t0 = time.perf_counter()
    loss = loss_fn(**batch)
    loss.backward()
    if world > 1:
        torch.distributed.barrier()
    elapsed = time.perf_counter() - t0
    del loss
    model.zero_grad(set_to_none=False)  # keep the (pre-allocated) grads resident, as DDP does
    return elapsed


def measure_worker(
    rank: int, world: int, jobs: list[tuple[str, int]], dtype: str = "fp32"
) -> list[dict[str, Any]]:
    """Run each ``(config, global seq)`` step in this process; per-step RSS rise and time."""
    from ringft import apply_ring_attention

    model = apply_ring_attention(_build_model(dtype))
    for param in model.parameters():  # resident grads (DDP buckets keep them): part of the baseline
        param.grad = torch.zeros_like(param)
    _set_options(model, CONFIGS["+tiled"])
    _step(model, 512 * world, rank, world, CONFIGS["+tiled"])  # warm-up: page in all code paths
    _set_options(model, CONFIGS["baseline"])
    _step(model, 512 * world, rank, world, CONFIGS["baseline"])
    out = []
    for name, seq in jobs:
        opts = CONFIGS[name]
        _set_options(model, opts)
        base = _reset_peak()
        seconds = _step(model, seq, rank, world, opts)
        peak = _status_kib("VmHWM") * 1024 - base
        out.append({"config": name, "seq": seq, "peak": peak, "seconds": seconds, "base": base})
        if rank == 0:  # progress (steps can take minutes)
            msg = f"  rank 0: {name} S={seq}: {seconds:.0f} s, peak {peak / MIB:.0f} MiB"
            print(msg, file=sys.stderr, flush=True)
    return out


def planned(seq: int, cp: int, opts: dict[str, bool], dtype: str = "fp32", cap_gib: float = 1.0) -> int:
    """Planner's bytes for what the measurement sees: activations (incl. the CPU-offloaded ones)."""
    from ringft.planner import plan_memory

    plan = plan_memory(
        MODEL | {"model_type": "llama"},
        seq,
        cp,
        cap_gib,
        cp_size=cp,
        dtype=dtype,
        gradient_checkpointing=opts["ckpt"],
        offload_activations=opts["offload"],
        chunked_loss=opts["chunked"],
        loss_chunk_size=LOSS_CHUNK,
        tiled_mlp_tokens=TILE_TOKENS if opts["tiled"] else None,
        overhead_gib=0.0,
    )
    working = max(plan.layer_working_set, plan.loss_working_set)
    return plan.checkpointed_activations + working + plan.cpu_offloaded


def weight_bytes(dtype: str = "fp32") -> int:
    """Weights + resident grads, both in the model dtype (no optimizer, so no fp32 master copy)."""
    from ringft.planner import load_model_shape

    per_param = 2 * DTYPES[dtype].itemsize
    return per_param * load_model_shape(MODEL | {"model_type": "llama"}).total_params


def max_local_seq(cp: int, opts: dict[str, bool], cap: int, dtype: str = "fp32", limit_k: int = 256) -> int:
    """Largest per-rank sequence (multiple of 1K) with planned weights + grads + activations <= cap."""
    best = 0
    for k in range(1, limit_k + 1):
        if weight_bytes(dtype) + planned(k * 1024 * cp, cp, opts, dtype) > cap:
            break
        best = k * 1024
    return best


def _run(cp: int, jobs: list[tuple[str, int]], dtype: str, timeout: float) -> list[list[dict[str, Any]]]:
    from ringft.utils.spawn import run_distributed

    return run_distributed(measure_worker, cp, jobs, dtype, timeout=timeout)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _err_range(errs: list[float]) -> str:
    return f"{min(errs):+.1f} % .. {max(errs):+.1f} %" if errs else "-"


# ----------------------------------------------------------------------------------------------
# the run: options, sweep, largest-sequence search, report


@dataclass
class Sweep:
    """The measured sweep: table rows, plan errors (%), skipped steps, seconds per CP size."""

    rows: list[list[str]] = field(default_factory=list)
    errs: list[float] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    cp_seconds: dict[int, float] = field(default_factory=dict)


@dataclass
class Search:
    """The largest-sequence search: table rows and plan errors (%) of the confirmed sizes."""

    rows: list[list[str]] = field(default_factory=list)
    errs: list[float] = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``seqs``, ``cps`` and ``names`` are the parsed lists."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", default="1024,2048,4096", help="global sequence lengths")
    p.add_argument("--cp", default="1,2")
    p.add_argument("--dtype", choices=MEASURED_DTYPES, default="fp32", help="model weights/grads/activations")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"option sets, from {','.join(CONFIGS)}")
    p.add_argument(
        "--max-plan-gib",
        type=float,
        default=None,
        help="skip sweep steps whose planned weights + grads + activations per process exceed this",
    )
    p.add_argument("--cap-gib", type=float, default=0.75, help="memory cap for the largest-sequence search")
    p.add_argument("--confirm-max-seq", type=int, default=4096, help="measure found sizes up to this")
    p.add_argument("--no-sweep", action="store_true", help="only the largest-sequence search")
    p.add_argument("--no-search", action="store_true", help="only the sweep")
    p.add_argument("--timeout", type=float, default=900, help="seconds per group of measured processes")
    p.add_argument("--out", default=None, help="append the markdown section to this file")
    args = p.parse_args(argv)
    args.seqs = [int(s) for s in args.seqs.split(",")]
    args.cps = [int(c) for c in args.cp.split(",")]
    args.names = [c.strip() for c in args.configs.split(",")]
    unknown = [n for n in args.names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown --configs {unknown}; known: {list(CONFIGS)}")
    return args


def run_sweep(args: argparse.Namespace) -> Sweep:
    """Measure every (option set, sequence) at every CP size, skipping plans above --max-plan-gib."""
    out, dtype, wbytes = Sweep(), args.dtype, weight_bytes(args.dtype)
    for cp in args.cps:
        jobs = []
        for name in args.names:
            for s in args.seqs:
                total = wbytes + planned(s, cp, CONFIGS[name], dtype)
                if args.max_plan_gib is not None and total > args.max_plan_gib * GIB:
                    out.skipped.append(f"CP={cp} {name} S={s} (plan {total / GIB:.1f} GiB per process)")
                else:
                    jobs.append((name, s))
        if not jobs:
            continue
        t0 = time.time()
        per_rank = _run(cp, jobs, dtype, timeout=args.timeout)
        out.cp_seconds[cp] = time.time() - t0
        print(f"CP={cp}: {out.cp_seconds[cp]:.0f} s", flush=True)
        for i, (name, seq) in enumerate(jobs):
            peak = max(r[i]["peak"] for r in per_rank)
            sec = max(r[i]["seconds"] for r in per_rank)
            plan = planned(seq, cp, CONFIGS[name], dtype)
            err = 100 * (plan - peak) / peak
            out.errs.append(err)
            note = " (same RSS on CPU)" if name == "+offload" else ""
            out.rows.append(
                [
                    str(cp),
                    name + note,
                    str(seq),
                    str(seq // cp),
                    f"{peak / MIB:.0f}",
                    f"{plan / MIB:.0f}",
                    f"{err:+.1f}%",
                    f"{seq / sec:.0f}",
                ]
            )
            print(out.rows[-1], flush=True)
    return out


def _confirm_search(
    args: argparse.Namespace, found: dict[tuple[int, str], int]
) -> dict[tuple[int, str], int]:
    """Measure the found sizes up to --confirm-max-seq: the peak rise per (CP, option set)."""
    confirm: dict[int, list[tuple[str, int]]] = {cp: [] for cp in args.cps}
    for (cp, name), local in found.items():
        # +offload is +ckpt on CPU (the same RSS): not confirmed separately
        if 0 < local and local * cp <= args.confirm_max_seq and name != "+offload":
            confirm[cp].append((name, local * cp))
    measured: dict[tuple[int, str], int] = {}
    for cp in args.cps:
        if confirm[cp]:
            t0 = time.time()
            per_rank = _run(cp, confirm[cp], args.dtype, timeout=args.timeout)
            print(f"search confirmations CP={cp}: {time.time() - t0:.0f} s", flush=True)
            for i, (name, _seq) in enumerate(confirm[cp]):
                measured[(cp, name)] = max(r[i]["peak"] for r in per_rank)
    return measured


def run_search(args: argparse.Namespace) -> Search:
    """Largest sequence per rank under --cap-gib (planner), confirmed by measurement where short."""
    out, dtype, wbytes, cap = Search(), args.dtype, weight_bytes(args.dtype), int(args.cap_gib * GIB)
    found = {
        (cp, name): max_local_seq(cp, CONFIGS[name], cap, dtype) for cp in args.cps for name in args.names
    }
    measured = _confirm_search(args, found)
    for cp in args.cps:
        for name in args.names:
            local = found[(cp, name)]
            m = measured.get((cp, name))
            plan = wbytes + planned(local * cp, cp, CONFIGS[name], dtype) if local else 0
            meas = f"{(wbytes + m) / MIB:.0f}" if m is not None else "not run"
            fits = ("yes" if wbytes + m <= cap else "NO") if m is not None else "-"
            if m is not None:
                out.errs.append(100 * (plan - wbytes - m) / m)
            shown = str(local) if local else "< 1024"
            out.rows.append(
                [
                    str(cp),
                    name,
                    shown,
                    str(local * cp) if local else "-",
                    f"{plan / MIB:.0f}" if local else "-",
                    meas,
                    fits,
                ]
            )
    return out


def _report_header(args: argparse.Namespace, cmd_args: list[str], total_s: float, sweep: Sweep) -> list[str]:
    """The section title, command, machine, model and method lines."""
    dtype, wbytes = args.dtype, weight_bytes(args.dtype)
    sweep_s = ", ".join(f"CP={c} sweep {s:.0f} s" for c, s in sweep.cp_seconds.items())
    return [
        "",
        f"## Training memory on CPU, {dtype} (bench_memory.py)",
        "",
        f"Command: `python benchmarks/bench_memory.py {shlex.join(cmd_args)}`  ",
        f"Machine: {describe_machine()} (cores shared with other jobs), {platform.platform()}; "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC (end); "
        f"run time {total_s:.0f} s" + (f" ({sweep_s})" if sweep_s else "") + ".  ",
        f'Model: LLaMA **{dtype}** (weights and grads {dtype}, planner `dtype="{dtype}"`), hidden '
        f"{MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, "
        f"{MODEL['num_attention_heads']} heads / {MODEL['num_key_value_heads']} kv, intermediate "
        f"{MODEL['intermediate_size']}, vocab {MODEL['vocab_size']} (untied): {wbytes / 2 / MIB:.0f} MiB of "
        f"weights (+ the same in resident grads). One sequence per step, fwd + bwd (no optimizer), "
        f"ring attention (torch backend), "
        f"loss chunk {LOSS_CHUNK}, MLP tile {TILE_TOKENS} tokens; 1 thread per process.",
        "",
        "Peak = rise of RSS during the step (`VmHWM` after a `clear_refs` reset, minus RSS before, "
        "which holds the weights and the pre-allocated grads): activations + transients, max over "
        "ranks; `MALLOC_MMAP_THRESHOLD_=131072` in the measured "
        "processes. Plan = `ringft.planner` checkpointed + max(layer, loss working set) "
        "(+ the part it would move to CPU: on CPU offload keeps the same memory, so the `+offload` "
        "rows are only meaningful on a GPU); plan err = (plan - peak) / peak. tokens/s = global "
        "tokens / wall time of the step (slowest rank).",
        "",
    ]


def _report_sweep(args: argparse.Namespace, sweep: Sweep) -> list[str]:
    lines = _table(
        [
            "CP",
            "options (cumulative)",
            "S global",
            "S/rank",
            "peak MiB",
            "plan MiB",
            "plan err",
            "tokens/s",
        ],
        sweep.rows,
    )
    lines += ["", f"Plan error range ({args.dtype} sweep): {_err_range(sweep.errs)}."]
    if sweep.skipped:
        lines += [
            "",
            f"Skipped (planned weights + grads + activations above --max-plan-gib {args.max_plan_gib:g} "
            "per process): " + "; ".join(sweep.skipped) + ".",
        ]
    return lines


def _report_search(args: argparse.Namespace, search: Search) -> list[str]:
    dtype, wbytes = args.dtype, weight_bytes(args.dtype)
    lines = [
        "",
        f"Largest sequence per rank that fits a {args.cap_gib:g} GiB cap on {dtype} weights + grads + "
        "activations (planner search over multiples of 1K; confirmed by one measured step when the "
        f"global size is <= {args.confirm_max_seq}, longer steps were not run to keep the run short; "
        f"measured = {wbytes / MIB:.0f} MiB weights + grads + the measured peak rise):",
        "",
    ]
    lines += _table(
        ["CP", "options", "max S/rank (plan)", "S global", "planned MiB", "measured MiB", "fits"],
        search.rows,
    )
    lines += ["", f"Plan error range (confirmed {dtype} sizes, activations): {_err_range(search.errs)}."]
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and the search (as selected), print the Markdown section, append it to --out."""
    args = parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # inherited by the spawned measured processes
    t_start = time.time()
    sweep = Sweep() if args.no_sweep else run_sweep(args)
    search = Search() if args.no_search else run_search(args)
    cmd_args = sys.argv[1:] if argv is None else argv
    lines = _report_header(args, cmd_args, time.time() - t_start, sweep)
    if not args.no_sweep:
        lines += _report_sweep(args, sweep)
    if not args.no_search:
        lines += _report_search(args, search)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
