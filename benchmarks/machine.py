"""One line describing the machine a benchmark ran on: CPU model, instruction sets, GPU, versions.

bf16 is slow on AVX2-only CPUs and fast with AVX-512 BF16 / AMX, so a CPU figure without the
instruction set cannot be compared. Every benchmark prints :func:`describe_machine` with its results.
"""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (or platform.processor())."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_isa() -> str:
    """The widest vector / matrix instruction sets: e.g. 'AVX2', 'AVX-512 (bf16)', 'AVX-512 + AMX'."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((ln.split(":", 1)[1].split() for ln in fh if ln.startswith("flags")), [])
    except OSError:
        flags = []
    have = set(flags)
    parts = []
    if "avx512f" in have:
        parts.append("AVX-512" + (" (bf16)" if "avx512_bf16" in have else ""))
    elif "avx2" in have:
        parts.append("AVX2")
    elif "sse4_2" in have:
        parts.append("SSE4.2")
    if {"amx_bf16", "amx_tile"} & have:
        parts.append("AMX")
    overrides = [
        f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ
    ]
    return " + ".join(parts or ["unknown ISA"]) + (f" [{', '.join(overrides)}]" if overrides else "")


def describe_machine() -> str:
    """'CPU: <model>, <ISA>, <n> cores; GPU: <name or none>; torch <v>, transformers <v>'."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    try:
        import transformers

        tf = transformers.__version__
    except ImportError:  # pragma: no cover
        tf = "n/a"
    return (
        f"CPU: {cpu_model()}, {cpu_isa()}, {os.cpu_count()} cores; GPU: {gpu}; "
        f"torch {torch.__version__}, transformers {tf}"
    )


if __name__ == "__main__":
    print(describe_machine())
