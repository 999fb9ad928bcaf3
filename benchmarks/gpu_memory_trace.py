"""Where the GPU memory of a ``ringft train`` run goes at its peak.

Runs ``ringft train`` in this process with torch's CUDA allocator history recording on, then
replays the recorded allocations and frees to find the moment of the largest allocated total and
lists the blocks live at that moment, grouped by the innermost Python frame inside ringft,
transformers, peft or torch. The planner's terms (``ringft plan``) can be checked one by one
against that table.

Run (arguments after ``--`` go to ``ringft train``)::

    python benchmarks/gpu_memory_trace.py --out outputs/trace [--cap-gib 79.6] -- RECIPE [--overrides]

``--cap-gib`` caps this process's CUDA memory (``torch.cuda.set_per_process_memory_fraction``), so a
larger card behaves like a smaller one for "does it fit" questions. Writes ``peak.txt`` (the table)
and ``peak_blocks.pickle.gz`` (the trace events of the blocks live at the peak, with their Python
frames) to ``--out``. Without CUDA (a dry run of the command on a CPU) the run's resident-set
high-water mark stands in for the trace: ``peak.txt`` then holds the result and that figure only.
"""

from __future__ import annotations

import argparse
import gzip
import pickle
import sys
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ringft without installing

GIB = 2**30
OWN_CODE = ("/ringft/", "/transformers/", "/peft/", "/accelerate/", "/torch/")


def site_of(frames: list[dict[str, Any]], depth: int = 3) -> str:
    """The innermost ``depth`` frames in ringft / transformers / peft / accelerate / torch."""
    picked = []
    for frame in frames:
        name = frame.get("filename", "")
        if any(part in name for part in OWN_CODE) and "/torch/utils/" not in name:
            short = name.split("/site-packages/")[-1].split("/ringft/")[-1]
            picked.append(f"{short}:{frame.get('line')}:{frame.get('name')}")
        if len(picked) == depth:
            break
    return " < ".join(picked) or "(no python frame)"


def replay(trace: list[dict[str, Any]]) -> tuple[int, int, dict[int, dict[str, Any]]]:
    """(peak allocated bytes, event index of the peak, blocks live at the peak) from one device trace."""
    live: dict[int, dict[str, Any]] = {}
    current = peak = peak_at = 0
    for index, event in enumerate(trace):
        action, addr = event["action"], event.get("addr")  # an "oom" event has no address
        if action == "alloc":
            live[addr] = event
            current += event["size"]
            if current > peak:
                peak, peak_at = current, index
        elif action in ("free_requested", "free_completed") and addr in live:
            current -= live.pop(addr)["size"]
    live = {}
    for event in trace[: peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] in ("free_requested", "free_completed"):
            live.pop(event.get("addr"), None)
    return peak, peak_at, live


def peak_table(live: dict[int, dict[str, Any]], top: int = 40) -> list[tuple[float, int, str, list[int]]]:
    """``(GiB, count, site, sizes)`` rows of the live blocks, largest first."""
    groups: dict[str, list[int]] = defaultdict(list)
    for event in live.values():
        groups[site_of(event.get("frames", []))].append(event["size"])
    rows = [
        (sum(sizes) / GIB, len(sizes), site, sorted(sizes, reverse=True)[:4])
        for site, sizes in groups.items()
    ]
    return sorted(rows, reverse=True)[:top]


def _cpu_run(out: Path, train_args: list[str], ringft_main) -> None:
    """No CUDA: run the same training, record the process's RSS high-water mark (``VmHWM``)."""
    failure = None
    try:
        ringft_main(["train", *train_args])
    except BaseException as error:
        failure = f"{type(error).__name__}: {str(error)[:400]}"
        traceback.print_exc()
    with open("/proc/self/status") as fh:
        hwm_kib = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
    lines = [
        f"run: ringft train {' '.join(train_args)}",
        f"result: {failure or 'finished'}",
        f"events 0 (no CUDA: no allocator trace); process RSS high-water mark {hwm_kib / 2**20:.3f} GiB",
    ]
    (out / "peak.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--cap-gib", type=float, default=None)
    parser.add_argument("--max-entries", type=int, default=2_000_000)
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    import torch

    from ringft.cli import main as ringft_main

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_args = [a for a in args.train_args if a != "--"]
    if not torch.cuda.is_available():
        return _cpu_run(out, train_args, ringft_main)
    total = torch.cuda.get_device_properties(0).total_memory
    if args.cap_gib:
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total))
    torch.cuda.memory._record_memory_history(max_entries=args.max_entries, stacks="python")
    failure = None
    try:
        ringft_main(["train", *train_args])
    except BaseException as error:  # an OOM is a result here: report the trace up to it
        failure = f"{type(error).__name__}: {str(error)[:400]}"
        traceback.print_exc()  # the log keeps where it failed (the table below keeps what was live)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][0]
    peak, peak_at, live = replay(trace)
    with gzip.open(out / "peak_blocks.pickle.gz", "wb") as handle:
        pickle.dump(list(live.values()), handle)
    lines = [
        f"run: ringft train {' '.join(train_args)}",
        f"result: {failure or 'finished'}",
        f"events {len(trace)} (max {args.max_entries}); replayed peak {peak / GIB:.3f} GiB "
        f"at event {peak_at}; "
        f"torch max_memory_allocated {torch.cuda.max_memory_allocated() / GIB:.3f} GiB, "
        f"max_memory_reserved {torch.cuda.max_memory_reserved() / GIB:.3f} GiB",
        "",
        f"{'GiB':>8} {'count':>6}  site (innermost first)  [largest blocks, MiB]",
    ]
    for gib, count, site, sizes in peak_table(live):
        lines.append(f"{gib:8.3f} {count:6d}  {site}  {[round(s / 2**20) for s in sizes]}")
    (out / "peak.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:40]))


if __name__ == "__main__":
    main()
