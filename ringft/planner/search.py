"""Searching layouts: every (cp, dp) split and offload combination, the recommended one, the longest
sequence that fits, and which option changes would make a setup fit (see :mod:`ringft.planner`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ringft.ops.sharding import zigzag_length_problem, zigzag_padded_length
from ringft.planner.plan import build_plan, setup_options
from ringft.planner.setup import MemoryPlan, TrainingSetup, divisors
from ringft.planner.shapes import load_model_shape

__all__ = ["Fix", "fixes_that_fit", "max_seq_len_that_fits", "plan_layouts", "recommend"]


def plan_layouts(
    model: Any,
    seq_len: int,
    num_gpus: int,
    gpu_mem_gib: float,
    *,
    cp_sizes: Sequence[int] | None = None,
    explore_offload: bool = True,
    **options: Any,
) -> list[MemoryPlan]:
    """Plans for every ``(cp, dp = num_gpus / cp)`` layout (and, with ``explore_offload``, every
    combination of optimizer / parameter (ZeRO-3 only) / activation offload).

    ``cp_sizes`` defaults to the divisors of ``num_gpus``; sizes with ``seq_len % (2*cp) != 0``
    are skipped. Ordered by cp, then by the number of offloads. See :func:`recommend`.
    """
    shape = load_model_shape(model)
    opts = setup_options(options)
    combos: list[dict[str, bool]] = [{}]
    if explore_offload:
        zero3 = opts.get("zero_stage", 0) == 3
        combos = [
            {"offload_optimizer": o, "offload_params": p, "offload_activations": act}
            for o in (False, True)
            for p in ((False, True) if zero3 else (False,))
            for act in (False, True)
        ]
        combos.sort(key=lambda c: sum(c.values()))
    plans = []
    for cp in cp_sizes or divisors(num_gpus):
        if num_gpus % cp or zigzag_length_problem(seq_len, cp):
            continue
        for combo in combos:
            setup = TrainingSetup(
                seq_len=seq_len, num_gpus=num_gpus, cp_size=cp, gpu_mem_gib=gpu_mem_gib, **{**opts, **combo}
            )
            plans.append(build_plan(shape, setup))
    return plans


def recommend(plans: Sequence[MemoryPlan], margin_fraction: float = 0.10) -> MemoryPlan | None:
    """The plan to use: among those that fit, prefer ones with ``margin_fraction`` of the GPU
    left free (allocator fragmentation is not modelled: 12-20 % on top of the peak allocation was
    seen with PyTorch's default caching allocator), then the fewest offloads (they cost
    speed), then the smallest cp (fewer ring hops, more data-parallel replicas), then the most
    headroom. ``None`` if nothing fits."""
    fitting = [p for p in plans if p.fits]
    if not fitting:
        return None

    def key(p: MemoryPlan) -> tuple[bool, int, int, int]:
        s = p.setup
        tight = p.headroom < margin_fraction * p.gpu_bytes
        return (tight, s.offload_optimizer + s.offload_params + s.offload_activations, s.cp_size, -p.headroom)

    return min(fitting, key=key)


def max_seq_len_that_fits(
    model: Any,
    num_gpus: int,
    gpu_mem_gib: float,
    *,
    cp_size: int | None = None,
    limit: int = 1 << 26,
    **options: Any,
) -> int:
    """Largest global sequence length (a multiple of ``2 * cp * 1024``) whose plan fits.

    Memory grows monotonically with the sequence length, so this is a binary search. With
    ``cp_size=None`` every divisor of ``num_gpus`` is tried and the best is returned. Returns 0 when
    not even ``2 * cp * 1024`` tokens fit, and at most ``limit``.
    """
    shape = load_model_shape(model)
    opts = setup_options(options)
    if cp_size is None:
        return max(
            max_seq_len_that_fits(shape, num_gpus, gpu_mem_gib, cp_size=c, limit=limit, **opts)
            for c in divisors(num_gpus)
        )
    unit = zigzag_padded_length(1, cp_size) * 1024  # whole chunk pairs of 512 tokens

    def fits(k: int) -> bool:
        setup = TrainingSetup(
            seq_len=k * unit, num_gpus=num_gpus, cp_size=cp_size, gpu_mem_gib=gpu_mem_gib, **opts
        )
        return build_plan(shape, setup).fits

    lo, hi = 0, 1  # fits(lo) (or lo == 0); find hi that does not fit
    top = max(limit // unit, 1)
    while hi <= top and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, top + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * unit


@dataclass(frozen=True)
class Fix:
    """A set of option changes that makes a setup fit: ``changes`` (TrainingSetup field -> new
    value), its ``cost`` (a rough order of how much speed or training behaviour it gives up) and the
    recommended ``plan`` with them."""

    changes: dict[str, Any]
    cost: float
    plan: MemoryPlan


# (option, new value, cost): what each change gives up, roughly. Chunked loss is free; ZeRO stages
# add communication; tiling and a smaller micro-batch cost speed; recomputation +~1/3 compute;
# offloads cost PCIe traffic; LoRA changes what is trained, so it comes last.
_FIX_COSTS: dict[str, float] = {
    "chunked_loss": 0.1,
    "zero_stage": 0.3,  # per stage
    "tiled_mlp": 0.5,
    "micro_batch_size": 1.0,
    "gradient_checkpointing": 1.5,
    "offload_activations": 2.0,
    "offload_optimizer": 3.0,
    "offload_params": 4.0,
    "lora": 6.0,
}


def _fix_dimensions(opts: dict[str, Any]) -> list[list[tuple[str, Any, float]]]:
    """Per option, the alternatives to the current value that use less memory (first: keep it)."""
    base = TrainingSetup(seq_len=2, num_gpus=1, cp_size=1, gpu_mem_gib=1, **opts)
    dims: list[list[tuple[str, Any, float]]] = []
    if base.zero_stage < 3:
        stages = range(base.zero_stage + 1, 4)
        dims.append([("zero_stage", z, _FIX_COSTS["zero_stage"] * (z - base.zero_stage)) for z in stages])
    if base.micro_batch_size > 1:
        dims.append([("micro_batch_size", 1, _FIX_COSTS["micro_batch_size"])])
    for flag in (
        "chunked_loss",
        "gradient_checkpointing",
        "tiled_mlp",
        "offload_activations",
        "offload_optimizer",
        "offload_params",
        "lora",
    ):
        if not getattr(base, flag):
            dims.append([(flag, True, _FIX_COSTS[flag])])
    return [[("", None, 0.0), *alternatives] for alternatives in dims]


def _dominates(small: dict[str, Any], big: dict[str, Any]) -> bool:
    """Whether ``small`` is part of ``big`` (a lower ZeRO stage counts as part of a higher one)."""
    for key, value in small.items():
        if key not in big:
            return False
        if key == "zero_stage" and value > big[key]:
            return False
    return True


def fixes_that_fit(
    model: Any,
    seq_len: int,
    num_gpus: int,
    gpu_mem_gib: float,
    *,
    cp_sizes: Sequence[int] | None = None,
    max_fixes: int = 3,
    margin_fraction: float = 0.10,
    **options: Any,
) -> list[Fix]:
    """The cheapest option changes under which some layout fits, when the given options do not.

    Searches every combination of: a higher ZeRO stage, micro-batch size 1, chunked loss,
    gradient checkpointing, tiled MLP, activation / optimizer / parameter (ZeRO-3) offload and LoRA
    (only the ones not already on), over the CP sizes ``cp_sizes`` (default: all divisors of
    ``num_gpus``). Returns up to ``max_fixes`` minimal combinations (none contains another),
    cheapest first (see ``_FIX_COSTS``), among those whose plan leaves ``margin_fraction`` of the
    GPU free (as :func:`recommend` prefers) or, if there are none, among those that only just fit;
    empty when nothing fits even with all of them.
    """
    shape = load_model_shape(model)
    opts = setup_options(options)
    cps = [c for c in (cp_sizes or divisors(num_gpus)) if num_gpus % c == 0 and seq_len % (2 * c) == 0]
    found: list[Fix] = []
    for combo in itertools.product(*_fix_dimensions(opts)):
        changes = {key: value for key, value, _ in combo if key}
        if not changes or (
            changes.get("offload_params") and changes.get("zero_stage", opts.get("zero_stage", 0)) != 3
        ):
            continue
        plans = [
            build_plan(
                shape,
                TrainingSetup(
                    seq_len=seq_len,
                    num_gpus=num_gpus,
                    cp_size=cp,
                    gpu_mem_gib=gpu_mem_gib,
                    **{**opts, **changes},
                ),
            )
            for cp in cps
        ]
        best = recommend(plans)
        if best is not None:
            found.append(Fix(changes, sum(cost for *_, cost in combo), best))
    # Prefer fixes that leave recommend()'s margin free (allocator fragmentation); tight ones only
    # when nothing else fits.
    roomy = [f for f in found if f.plan.headroom >= margin_fraction * f.plan.gpu_bytes]
    found = sorted(roomy or found, key=lambda f: (f.cost, len(f.changes), f.plan.total))
    minimal: list[Fix] = []
    for fix in found:
        if not any(_dominates(kept.changes, fix.changes) for kept in minimal):
            minimal.append(fix)
    return minimal[:max_fixes]
