"""The DP x (Ulysses x ring) process layout: world = dp * cp, cp = ulysses_size * ring_size.

Global rank ``g = dp_rank * cp_size + cp_rank`` (CP ranks contiguous, as in
:mod:`ringft.ops.parallel`), and ``cp_rank = ring_rank * ulysses_size + ulysses_rank``: a Ulysses
group is ``ulysses_size`` contiguous ranks (keep it inside a node: its all-to-alls are the heavy
traffic), a ring group is the CP ranks of equal Ulysses rank (its point-to-point K/V blocks hide
behind compute, so it may cross nodes). Token ownership is in :mod:`ringft.ops.sharding`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ringft.ops.parallel import ParallelLayout, world_for_cp
from ringft.ops.sharding import ulysses_size_problem

__all__ = ["HybridGroups", "HybridLayout", "build_hybrid_layout", "resolve_cp_groups"]


@dataclass(frozen=True)
class HybridGroups:
    """The three process groups one attention call of the 2D layout uses.

    ``ulysses``: this rank's Ulysses group (all-to-all); ``ring``: its ring group (zigzag ring);
    ``cp``: the whole CP group (input validation, gathers). ``None`` everywhere means one process.
    With torch.distributed initialised, a ``None`` group would be the world group, so build the
    groups with :func:`build_hybrid_layout` (it makes real groups even of size 1).
    """

    ulysses: Any = None
    ring: Any = None
    cp: Any = None

    def sizes(self) -> tuple[int, int, int]:
        """``(ulysses_size, ring_size, cp_size)`` (all 1 without torch.distributed)."""
        if not dist.is_available() or not dist.is_initialized():
            return 1, 1, 1
        return tuple(dist.get_world_size(g) for g in (self.ulysses, self.ring, self.cp))

    def ranks(self) -> tuple[int, int, int]:
        """``(ulysses_rank, ring_rank, cp_rank)`` of this process (all 0 without torch.distributed)."""
        if not dist.is_available() or not dist.is_initialized():
            return 0, 0, 0
        return tuple(dist.get_rank(g) for g in (self.ulysses, self.ring, self.cp))

    def problem(self) -> str | None:
        """Why these groups are not a Ulysses x ring split of the CP group (``None`` when they are):
        sizes ``cp = ulysses * ring`` and ``cp_rank = ring_rank * ulysses_size + ulysses_rank``."""
        (u_size, r_size, cp_size), (u_rank, r_rank, cp_rank) = self.sizes(), self.ranks()
        if u_size * r_size != cp_size or r_rank * u_size + u_rank != cp_rank:
            return (
                f"the groups are not a ulysses x ring layout of the CP group (ulysses {u_size} x ring "
                f"{r_size} != cp {cp_size}, or cp_rank {cp_rank} != ring_rank {r_rank} * {u_size} + "
                f"ulysses_rank {u_rank}): build them with ringft.ops.hybrid_layout.build_hybrid_layout"
            )
        return None


@dataclass
class HybridLayout(ParallelLayout):
    """:class:`~ringft.ops.parallel.ParallelLayout` plus the Ulysses x ring split of the CP group
    (``cp_group`` and ``dp_group`` keep their meaning there)."""

    ulysses_size: int = 1
    ring_size: int = 1
    ulysses_rank: int = 0
    ring_rank: int = 0
    groups: HybridGroups = HybridGroups()


def build_hybrid_layout(cp_size: int, ulysses_size: int = 1, device_type: str = "cpu") -> HybridLayout:
    """Build the (dp, ring, ulysses) and (dp, cp) device meshes from the initialised default group.

    Raises ``ValueError`` on every rank (the checks are local and identical everywhere) when
    ``cp_size`` does not divide the world size or ``ulysses_size`` does not divide ``cp_size``.
    Every group is a real process group, also where its size is 1.
    """
    initialized, world, rank = world_for_cp(cp_size)
    problem = ulysses_size_problem(cp_size, ulysses_size)
    if problem:
        raise ValueError(problem)
    ring = cp_size // ulysses_size
    cp_rank = rank % cp_size
    ring_rank, ulysses_rank = divmod(cp_rank, ulysses_size)
    layout = HybridLayout(
        world, rank, cp_size, world // cp_size, cp_rank, rank // cp_size,
        ulysses_size=ulysses_size, ring_size=ring, ulysses_rank=ulysses_rank, ring_rank=ring_rank,
    )  # fmt: skip
    if initialized and world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dp = world // cp_size
        names = ("dp", "ring", "ulysses")
        mesh3 = init_device_mesh(device_type, (dp, ring, ulysses_size), mesh_dim_names=names)
        mesh2 = init_device_mesh(device_type, (dp, cp_size), mesh_dim_names=("dp", "cp"))
        layout.cp_group, layout.dp_group = mesh2.get_group("cp"), mesh2.get_group("dp")
        layout.groups = HybridGroups(mesh3.get_group("ulysses"), mesh3.get_group("ring"), layout.cp_group)
    return layout


def resolve_cp_groups(groups: Any = None, ulysses_size: int | None = None) -> tuple[Any, HybridGroups | None]:
    """``(CP group, HybridGroups or None)`` of what a caller passes as "the CP group":

    - a process group or ``None`` (the default group): the zigzag ring over it (``ulysses_size``
      None or 1), or, with ``ulysses_size > 1`` and a group spanning every process, the Ulysses x
      ring split of the whole world (builds its groups: call it on every rank, in the same order);
    - a :class:`HybridLayout` / :class:`~ringft.ops.parallel.ParallelLayout`, or
      :class:`HybridGroups`: their groups.

    The second value is None for the plain ring (``ulysses_size == 1``: today's operator over the
    CP group, bit for bit). Raises ``ValueError`` (the same on every rank) when ``ulysses_size``
    disagrees with the layout, does not divide the CP size, or needs groups that cannot be built
    here.
    """
    if ulysses_size is not None and (not isinstance(ulysses_size, int) or isinstance(ulysses_size, bool)):
        raise ValueError(f"ulysses_size must be an integer >= 1, got {ulysses_size!r}")
    if isinstance(groups, HybridLayout):
        cp_group, given, hybrid = groups.cp_group, groups.ulysses_size, groups.groups
    elif isinstance(groups, ParallelLayout):
        cp_group, given, hybrid = groups.cp_group, 1, None
    elif isinstance(groups, HybridGroups):
        cp_group, given, hybrid = groups.cp, groups.sizes()[0], groups
    else:
        return _from_process_group(groups, 1 if ulysses_size is None else ulysses_size)
    if ulysses_size is not None and ulysses_size != given:
        raise ValueError(
            f"ulysses_size={ulysses_size} but the layout passed is ulysses {given} x ring: pass one of them "
            "(build_hybrid_layout(cp_size, ulysses_size) makes the layout)"
        )
    if given == 1:
        return cp_group, None
    problem = hybrid.problem()
    if problem:
        raise ValueError(problem)
    return cp_group, hybrid


def _from_process_group(group: Any, ulysses_size: int) -> tuple[Any, HybridGroups | None]:
    initialized = dist.is_available() and dist.is_initialized()
    size = dist.get_world_size(group) if initialized else 1
    problem = ulysses_size_problem(size, ulysses_size)
    if problem:
        raise ValueError(problem)
    if ulysses_size == 1:
        return group, None
    if size != dist.get_world_size():
        raise ValueError(
            f"ulysses_size={ulysses_size} with a CP group of {size} of the {dist.get_world_size()} "
            "processes: the Ulysses and ring groups of every CP group must be built on every rank; pass "
            "build_hybrid_layout(cp_size, ulysses_size) (the layout, or its .groups) instead of the group"
        )
    device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    layout = build_hybrid_layout(size, ulysses_size, device_type)
    return layout.cp_group, layout.groups
