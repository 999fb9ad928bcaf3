"""Peak memory per rank of ``ringft eval-ppl``'s forward, measured vs the formula of
``ringft.evals.ppl.memory`` (``ppl_peak_memory``), on CPU with CP = 2.

Model: SmolLM2-135M's shape (LLaMA, 30 layers, hidden 576, 9/3 heads, MLP 1536, vocabulary 49152,
tied embeddings), randomly initialised in fp32 (memory does not depend on the weights' values).
Each rank runs exactly what eval-ppl runs per document: :func:`ringft.evals.ppl.nll.ring_token_nll`
(one ring forward without a cache, the head in ``--chunk-size`` token chunks, one all-reduce of the
per-token vector). Peak = rise of the process's RSS during that call: the kernel's high-water mark
is reset first (``echo 5 > /proc/self/clear_refs``), peak = ``VmHWM`` after minus ``VmRSS`` before
(the weights are in that baseline), max over the ranks; ``MALLOC_MMAP_THRESHOLD_`` is set so that
freed buffers return to the OS. The formula's ``peak - weights`` is what the measurement sees.

Run: ``python benchmarks/bench_eval_memory.py`` (defaults ``--seqs 2048,4096,8192,16384 --chunks
1024,128``; about 15 minutes on 2 idle cores, 16K dominating).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ringft without installing

MIB = 1 << 20
SMOLLM2 = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
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


def config():
    """SmolLM2-135M's config (a LlamaConfig)."""
    from transformers import LlamaConfig

    return LlamaConfig(**SMOLLM2)


def worker(rank: int, world: int, jobs: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Each ``(sequence length, chunk size)``: the per-token NLL of random ids on the ring."""
    import torch
    from transformers import LlamaForCausalLM

    from ringft.evals.ppl.nll import ring_token_nll
    from ringft.model.inference import RingInference

    torch.manual_seed(0)
    engine = RingInference(LlamaForCausalLM(config()).eval(), None, "torch")
    ring_token_nll(engine, list(range(1, 257)), 64)  # warm-up: page in every code path
    out = []
    for seq, chunk in jobs:
        ids = torch.randint(1, SMOLLM2["vocab_size"], (seq,), generator=torch.Generator().manual_seed(seq))
        base = _reset_peak()
        start = time.perf_counter()
        ring_token_nll(engine, ids.tolist(), chunk)
        seconds = time.perf_counter() - start
        peak = _status_kib("VmHWM") * 1024 - base
        out.append({"seq": seq, "chunk": chunk, "peak": peak, "seconds": seconds})
        if rank == 0:
            print(
                f"  rank 0: S={seq} chunk={chunk}: {seconds:.0f} s, peak {peak / MIB:.0f} MiB",
                file=sys.stderr,
            )
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure, print the Markdown table (planned vs measured)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="2048,4096,8192,16384")
    p.add_argument("--chunks", default="1024,128")
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--timeout", type=float, default=7200)
    args = p.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    from benchmarks.machine import describe_machine
    from ringft.evals.ppl.memory import ppl_peak_memory
    from ringft.utils.spawn import run_distributed

    seqs = [int(s) for s in args.seqs.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    jobs = [(s, c) for s in seqs for c in chunks]
    started = time.time()
    results = run_distributed(worker, args.cp, jobs, timeout=args.timeout)
    print(
        f"{describe_machine()}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"{time.time() - started:.0f} s"
    )
    print("| S | cp | chunk | largest phase | planned MiB | measured MiB | plan err | seconds |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|")
    for i, (seq, chunk) in enumerate(jobs):
        measured = max(r[i]["peak"] for r in results)
        t = ppl_peak_memory(config(), seq, args.cp, 4, chunk)
        phase = max(("attention", "mlp", "head"), key=lambda k: t[k])
        planned = t["peak"] - t["weights"]
        seconds = max(r[i]["seconds"] for r in results)
        print(
            f"| {seq} | {args.cp} | {chunk} | {phase} | {planned / MIB:.0f} | {measured / MIB:.0f} | "
            f"{(planned - measured) / measured:+.1%} | {seconds:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
