"""The process layout: world = dp * cp, cp = ulysses * ring, over one device mesh.

Global rank ``g = dp_rank * cp_size + cp_rank`` (CP ranks contiguous, so a CP group stays inside a
node when it fits), and ``cp_rank = ring_rank * ulysses_size + ulysses_rank``: a Ulysses group is
``ulysses_size`` contiguous ranks (keep it inside a node: its all-to-alls are the heavy traffic), a
ring group is the CP ranks of equal Ulysses rank (its point-to-point K/V blocks hide behind compute,
so it may cross nodes). ``ulysses_size = 1`` is the plain zigzag ring over the CP group. Token
ownership is in :mod:`ringft.ops.sharding`.

One :class:`ParallelLayout` describes it all; :func:`build_layout` makes it from the initialised
default group as one ``("dp", "ring", "ulysses")`` DeviceMesh with ``("ring", "ulysses")``
flattened into ``"cp"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ringft.ops.sharding import ulysses_size_problem

__all__ = ["ParallelLayout", "build_layout", "resolve_cp_groups", "world_for_cp"]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


@dataclass
class ParallelLayout:
    """Where this process sits, and the process groups it talks over.

    Sizes and ranks: ``world_size = dp_size * cp_size``, ``cp_size = ulysses_size * ring_size``;
    ``rank = dp_rank * cp_size + cp_rank``, ``cp_rank = ring_rank * ulysses_size + ulysses_rank``.
    Groups (None without torch.distributed or for one process): ``cp_group`` (the CP ranks of this
    replica: input checks, gathers, the plain ring), ``dp_group`` (the ranks holding the same CP
    position in every replica), ``ulysses_group`` (all-to-all) and ``ring_group`` (the zigzag ring
    under Ulysses). ``mesh``: the DeviceMesh they were cut from (None when built from groups).
    """

    world_size: int
    rank: int
    cp_size: int
    dp_size: int
    cp_rank: int
    dp_rank: int
    ulysses_size: int = 1
    ulysses_rank: int = 0
    cp_group: Any = None
    dp_group: Any = None
    ulysses_group: Any = None
    ring_group: Any = None
    mesh: Any = None

    @property
    def ring_size(self) -> int:
        """Ranks per ring group (``cp_size // ulysses_size``)."""
        return self.cp_size // self.ulysses_size

    @property
    def ring_rank(self) -> int:
        """This rank's position in its ring group (``cp_rank // ulysses_size``)."""
        return self.cp_rank // self.ulysses_size

    @classmethod
    def from_groups(cls, cp_group: Any, ulysses_group: Any, ring_group: Any) -> ParallelLayout:
        """The layout of process groups built by hand (e.g. a CP group on some ranks of the world):
        sizes and ranks read from the groups; one replica (``dp_size`` 1)."""
        cp_size, cp_rank = (
            (dist.get_world_size(cp_group), dist.get_rank(cp_group)) if _initialized() else (1, 0)
        )
        u_size, u_rank = (
            (dist.get_world_size(ulysses_group), dist.get_rank(ulysses_group)) if _initialized() else (1, 0)
        )
        world, rank = (dist.get_world_size(), dist.get_rank()) if _initialized() else (1, 0)
        return cls(
            world, rank, cp_size, 1, cp_rank, 0, ulysses_size=u_size, ulysses_rank=u_rank,
            cp_group=cp_group, ulysses_group=ulysses_group, ring_group=ring_group,
        )  # fmt: skip

    def group_sizes(self) -> tuple[int, int, int]:
        """``(ulysses, ring, cp)`` sizes of the groups themselves (all 1 without torch.distributed)."""
        if not _initialized():
            return 1, 1, 1
        return tuple(dist.get_world_size(g) for g in (self.ulysses_group, self.ring_group, self.cp_group))

    def group_ranks(self) -> tuple[int, int, int]:
        """This process's ``(ulysses, ring, cp)`` ranks in the groups (all 0 without torch.distributed)."""
        if not _initialized():
            return 0, 0, 0
        return tuple(dist.get_rank(g) for g in (self.ulysses_group, self.ring_group, self.cp_group))

    def problem(self) -> str | None:
        """Why the groups are not a Ulysses x ring split of the CP group (``None`` when they are):
        sizes ``cp = ulysses * ring`` and ``cp_rank = ring_rank * ulysses_size + ulysses_rank``."""
        (u_size, r_size, cp_size), (u_rank, r_rank, cp_rank) = self.group_sizes(), self.group_ranks()
        if u_size * r_size != cp_size or r_rank * u_size + u_rank != cp_rank:
            return (
                f"the groups are not a ulysses x ring layout of the CP group (ulysses {u_size} x ring "
                f"{r_size} != cp {cp_size}, or cp_rank {cp_rank} != ring_rank {r_rank} * {u_size} + "
                f"ulysses_rank {u_rank}): build them with ringft.ops.parallel.build_layout"
            )
        return None


def world_for_cp(cp_size: int) -> tuple[bool, int, int]:
    """``(initialized, world size, rank)`` of the default group (``(False, 1, 0)`` without one);
    ``ValueError`` when ``cp_size`` does not divide the world size (local and identical on every
    rank, so every rank raises it)."""
    initialized = _initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if initialized else (1, 0)
    if cp_size < 1 or world % cp_size:
        raise ValueError(
            f"cp_size={cp_size} does not divide the world size {world}: launch a multiple of {cp_size} "
            "processes or choose a cp_size that divides the number of GPUs"
        )
    return initialized, world, rank


def build_layout(cp_size: int, ulysses_size: int = 1, device_type: str = "cpu") -> ParallelLayout:
    """The layout of the initialised default group: one ``(dp, ring, ulysses)`` DeviceMesh, its
    ``("ring", "ulysses")`` dimensions flattened into the CP group.

    Raises ``ValueError`` on every rank (the checks are local and identical everywhere) when
    ``cp_size`` does not divide the world size or ``ulysses_size`` does not divide ``cp_size``.
    Every group is a real process group, also where its size is 1.
    """
    initialized, world, rank = world_for_cp(cp_size)
    problem = ulysses_size_problem(cp_size, ulysses_size)
    if problem:
        raise ValueError(problem)
    dp, cp_rank = world // cp_size, rank % cp_size
    layout = ParallelLayout(
        world, rank, cp_size, dp, cp_rank, rank // cp_size,
        ulysses_size=ulysses_size, ulysses_rank=cp_rank % ulysses_size,
    )  # fmt: skip
    if initialized and world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        names = ("dp", "ring", "ulysses")
        mesh = init_device_mesh(
            device_type, (dp, cp_size // ulysses_size, ulysses_size), mesh_dim_names=names
        )
        layout.mesh = mesh
        layout.cp_group = mesh["ring", "ulysses"]._flatten("cp").get_group()
        layout.dp_group = mesh.get_group("dp")
        layout.ulysses_group, layout.ring_group = mesh.get_group("ulysses"), mesh.get_group("ring")
    return layout


def resolve_cp_groups(
    layout: Any = None, ulysses_size: int | None = None
) -> tuple[Any, ParallelLayout | None]:
    """``(CP group, ParallelLayout or None)`` of what a caller passes as "the CP group":

    - a process group or ``None`` (the default group): the zigzag ring over it (``ulysses_size``
      None or 1), or, with ``ulysses_size > 1`` and a group spanning every process, the Ulysses x
      ring split of the whole world (builds its groups: call it on every rank, in the same order);
    - a :class:`ParallelLayout`: its groups.

    The second value is None for the plain ring (``ulysses_size == 1``: the zigzag ring over the CP
    group). Raises ``ValueError`` (the same on every rank) when ``ulysses_size`` disagrees with the
    layout, does not divide the CP size, or needs groups that cannot be built here.
    """
    if ulysses_size is not None and (not isinstance(ulysses_size, int) or isinstance(ulysses_size, bool)):
        raise ValueError(f"ulysses_size must be an integer >= 1, got {ulysses_size!r}")
    if not isinstance(layout, ParallelLayout):
        return _from_process_group(layout, 1 if ulysses_size is None else ulysses_size)
    if ulysses_size is not None and ulysses_size != layout.ulysses_size:
        raise ValueError(
            f"ulysses_size={ulysses_size} but the layout passed is ulysses {layout.ulysses_size} x ring: "
            "pass one of them (build_layout(cp_size, ulysses_size) makes the layout)"
        )
    if layout.ulysses_size == 1:
        return layout.cp_group, None
    problem = layout.problem()
    if problem:
        raise ValueError(problem)
    return layout.cp_group, layout


def _from_process_group(group: Any, ulysses_size: int) -> tuple[Any, ParallelLayout | None]:
    size = dist.get_world_size(group) if _initialized() else 1
    problem = ulysses_size_problem(size, ulysses_size)
    if problem:
        raise ValueError(problem)
    if ulysses_size == 1:
        return group, None
    if size != dist.get_world_size():
        raise ValueError(
            f"ulysses_size={ulysses_size} with a CP group of {size} of the {dist.get_world_size()} "
            "processes: the Ulysses and ring groups of every CP group must be built on every rank; pass "
            "build_layout(cp_size, ulysses_size) instead of the group"
        )
    device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    layout = build_layout(size, ulysses_size, device_type)
    return layout.cp_group, layout
