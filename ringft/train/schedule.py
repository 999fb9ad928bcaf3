"""What both training engines share: the recipe's learning-rate schedule, the peak-memory figure
they log, and the result ``train`` returns."""

from __future__ import annotations

import math
import resource
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ringft.train.recipe import TrainConfig

__all__ = ["TrainResult", "lr_schedule", "peak_memory_gb"]


@dataclass
class TrainResult:
    """What ``train`` returns: steps done, per-step losses, the export folder, throughput."""

    steps: int
    losses: list[float]
    final_dir: str | None
    tokens_per_s: float


def lr_schedule(t: TrainConfig) -> Callable[[int], float]:
    """``step -> lr factor``: linear warmup over ``warmup_steps`` (step 0 already trains at
    ``1 / warmup_steps``), then constant or cosine down to ``min_lr_ratio`` at ``max_steps``."""

    def factor(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.schedule == "constant":
            return 1.0
        progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocations, or the CPU process's max RSS (GiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
