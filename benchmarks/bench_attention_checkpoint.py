"""One training step (forward + backward, gradient checkpointing on) with ``attention_checkpoint``
``recompute`` vs ``save`` vs ``offload``: step time and peak memory, and their ratios to recompute.

A reduced-width LLaMA built from config (random weights) on the ring at CP 1 (one process: the ring
is one block step; at CP N the recompute that ``save`` skips is the whole ring forward, N block
steps and N - 1 K/V exchanges). Each mode runs in a fresh process: ``--warmup`` steps, then the
median of ``--steps`` timed steps. Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over a
step minus what was allocated before it; on CPU the rise of the process's RSS high-water mark
(``VmHWM`` after ``clear_refs``, ``MALLOC_MMAP_THRESHOLD_`` set so freed buffers go back to the
OS). On CPU ``offload`` keeps the tensors where they are (host memory is where they already live),
so it measures the same as ``save``.

``save`` keeps, per layer until its backward, the attention output ``(B, S, Hq, D)`` in the compute
dtype and the log-sum-exp ``(B, Hq, S)`` in fp32: ``Hq * (D * itemsize + 4)`` bytes per token and
layer (printed as "kept").

Run: ``python benchmarks/bench_attention_checkpoint.py`` (CPU, fp32, ~2 minutes on 2 cores);
on a GPU e.g. ``python benchmarks/bench_attention_checkpoint.py --device cuda --dtype bf16 --seq
131072 --hidden 4096 --heads 32 --kv-heads 8 --intermediate 14336 --layers 4``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ringft without installing

MIB = 1 << 20
MODES = ("recompute", "save", "offload")


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ringft import apply_ring_attention
    from ringft.ops.dtypes import dtype_from_name

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq,
        use_cache=False,
    )
    model = LlamaForCausalLM(config).to(device=args.device, dtype=dtype_from_name(args.dtype))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    apply_ring_attention(model, None, args.backend, attention_checkpoint=args.mode)
    return model.train()


def measure(args) -> dict:
    """Median step seconds and peak bytes of ``args.mode`` in this process."""
    import torch

    from ringft.loss import CausalLMLoss

    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    model = _model(args)
    loss_fn = CausalLMLoss(model, chunked=True, chunk_size=4096, offload_activations=False)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, args.vocab, (1, args.seq), generator=gen).to(args.device)
    batch = dict(
        input_ids=ids,
        position_ids=torch.arange(args.seq, device=args.device)[None],
        shift_labels=torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1),
        num_items_in_batch=torch.tensor(args.seq - 1),
    )

    def step() -> float:
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss_fn(**batch).backward()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step()
    times = [step() for _ in range(args.steps)]
    model.zero_grad(set_to_none=True)  # the peak step starts from no gradients, like the timed ones
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _kib("VmRSS") * 1024
        step()
        peak = _kib("VmHWM") * 1024 - base
    return {"seconds": statistics.median(times), "peak": peak}


def kept_bytes_per_token_layer(args) -> int:
    """``Hq * (D * itemsize + lse itemsize)``: what ``save`` keeps per token and layer."""
    import torch

    from ringft.ops.dtypes import accumulator_dtype, dtype_from_name

    dtype = dtype_from_name(args.dtype)
    head_dim = args.hidden // args.heads
    lse = torch.finfo(accumulator_dtype(dtype)).bits // 8
    return args.heads * (head_dim * torch.finfo(dtype).bits // 8 + lse)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--backend", default="auto")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # child: measure this mode
    return p


def main(argv: list[str] | None = None) -> int:
    """Measure each mode in a fresh process; print the Markdown table."""
    args = _parser().parse_args(argv)
    if args.mode:
        print(json.dumps(measure(args)))
        return 0
    from benchmarks.machine import describe_machine

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS=str(args.threads))
    given = sys.argv[1:] if argv is None else argv
    results = {}
    for mode in MODES:
        out = subprocess.run(
            [sys.executable, __file__, *given, "--mode", mode],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=3600,
        ).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    kept = kept_bytes_per_token_layer(args)
    print("### attention_checkpoint: one training step, recompute vs save vs offload\n")
    command = " ".join(["python benchmarks/bench_attention_checkpoint.py", *given])
    print(f"- command: `{command}`")
    print(f"- machine: {describe_machine()}; {args.device}; {datetime.date.today().isoformat()}")
    print(
        f"- model: LLaMA hidden {args.hidden}, {args.heads} heads ({args.kv_heads} K/V), intermediate "
        f"{args.intermediate}, {args.layers} layers, vocab {args.vocab}, {args.dtype}; "
        f"{args.seq} tokens, CP 1"
    )
    print(
        f"- kept by save: {kept} B per token per layer = "
        f"{kept * args.seq * args.layers / MIB:.1f} MiB for this step\n"
    )
    print("| mode | step s | step / recompute | peak MiB | peak / recompute |")
    print("|---|---|---|---|---|")
    ref = results["recompute"]
    for mode, r in results.items():
        print(
            f"| {mode} | {r['seconds']:.3f} | {r['seconds'] / ref['seconds']:.3f} | "
            f"{r['peak'] / MIB:.0f} | {r['peak'] / ref['peak']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
