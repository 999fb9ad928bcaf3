"""The DP x CP process layout: world = dp * cp, CP ranks contiguous (a ring stays inside a node)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass
class ParallelLayout:
    """Where this process sits: ranks ``dp_rank * cp_size + cp_rank``."""

    world_size: int
    rank: int
    cp_size: int
    dp_size: int
    cp_rank: int
    dp_rank: int
    cp_group: Any = None  # the ring's process group (None when cp_size == 1 or no distributed)
    dp_group: Any = None  # ranks holding the same CP position in every replica


def world_for_cp(cp_size: int) -> tuple[bool, int, int]:
    """``(initialized, world size, rank)`` of the default group (``(False, 1, 0)`` without one);
    ``ValueError`` when ``cp_size`` does not divide the world size (local and identical on every
    rank, so every rank raises it)."""
    initialized = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if initialized else (1, 0)
    if cp_size < 1 or world % cp_size:
        raise ValueError(
            f"cp_size={cp_size} does not divide the world size {world}: launch a multiple of {cp_size} "
            "processes or choose a cp_size that divides the number of GPUs"
        )
    return initialized, world, rank


def build_layout(cp_size: int, device_type: str = "cpu") -> ParallelLayout:
    """Build the (dp, cp) DeviceMesh from the initialised default group.

    Raises ``ValueError`` (on every rank: the check is local and identical everywhere) when
    ``cp_size`` does not divide the world size.
    """
    initialized, world, rank = world_for_cp(cp_size)
    dp = world // cp_size
    layout = ParallelLayout(world, rank, cp_size, dp, rank % cp_size, rank // cp_size)
    if initialized and world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (dp, cp_size), mesh_dim_names=("dp", "cp"))
        layout.cp_group = mesh.get_group("cp")
        layout.dp_group = mesh.get_group("dp")
    return layout
