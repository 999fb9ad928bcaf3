"""Ulysses x ring attention vs plain fp64 attention on the global sequence (tests/oracle.py).

Each world size is spawned once (gloo, CPU); inside, every (ulysses, ring) factorisation of it runs
every config: GQA with K/V heads fewer than, equal to and more than ``ulysses_size`` (and not
dividing it: replicated K/V heads), causal, bidirectional, packed documents and a sliding window
over packed documents, fp32 and bf16, out, lse and dq/dk/dv. The ranks return their shards; the
parent unshards them with ``cp_unshard`` and compares with the oracle. ``ulysses_size = 1`` must
equal today's ring bit for bit.

Tolerances (max-abs error relative to the oracle's max-abs):
- fp32: the all-to-alls move data exactly, so the error is the ring's on the ring shard: fp32
  sums over at most ``g * S`` terms (GQA group ``g`` for dk/dv, ``S = 24`` keys), ``D = 16`` in the
  dot products and ``<= 2 * cp`` log-sum-exp merges err by ``< (g*S + D + 2*cp) * eps``; x2 for
  the backward's recomputed probabilities. A layout mistake is O(1e-1).
- bf16: as in test_zigzag_ring.py, at most 2x the error of one fused bf16 call over the whole
  sequence in one process, plus 4e-3; for replicated K/V heads (``r`` copies) dk/dv also carry the
  bf16 rounding of each copy's gradient before they are summed: ``+ r * 2^-8``.
"""

from __future__ import annotations

import io

import pytest
import torch

from ringft.ops.sharding import cp_shard, cp_unshard
from ringft.ops.ulysses import kv_replication, ulysses_ring_attention
from ringft.utils.spawn import run_distributed
from tests.oracle import full_attention_fp64, per_document_attention_fp64, windowed_attention_fp64

SEQ, DIM, BATCH = 24, 16, 2  # SEQ: a multiple of 2 * cp for cp = 2, 3, 4, 6
EPS32 = torch.finfo(torch.float32).eps
DOCS = [[0, 5, 11, 19, SEQ], [0, 7, 8, SEQ]]  # across chunk and piece edges for every layout
# (heads, kv_heads) per ulysses_size: K/V heads fewer than, equal to, more than U, and not dividing U.
HEADS = {
    1: [(4, 2)],
    2: [(4, 1), (4, 2), (8, 4), (6, 3)],
    3: [(6, 1), (6, 2), (6, 3), (12, 6)],
    4: [(8, 2), (4, 4), (8, 8), (12, 6)],
    6: [(6, 2), (6, 3), (6, 6), (12, 12)],
}


F32, BF16 = torch.float32, torch.bfloat16
COMBOS = [(F32, "causal"), (BF16, "docs"), (F32, "docs"), (BF16, "causal"), (F32, "full"), (F32, "window")]
WINDOW = 5  # "window": a sliding window over packed documents, across chunk and piece edges
CP_SIZES = (2, 3, 4, 6)  # one spawn of 6 processes: cp 2 (dp 3), 3 (dp 2), 6 (dp 1), and 4 on ranks 0-3


def configs(cp: int) -> list[tuple]:
    """``(ulysses, hq, hkv, dtype, mode)`` for every factorisation of ``cp``; mode is ``causal``,
    ``full`` (bidirectional), ``docs`` (packed documents) or ``window`` (a sliding window of
    ``WINDOW`` keys over the packed documents). Each head config runs two of the combos in turn, so
    every factorisation runs every combo and every head config."""
    out = []
    for u in (x for x in range(1, cp + 1) if cp % x == 0):
        for j, (hq, hkv) in enumerate(HEADS[u]):
            n = len(COMBOS)
            picks = range(n) if len(HEADS[u]) == 1 else (2 * j % n, (2 * j + 1) % n)
            out += [(u, hq, hkv, *COMBOS[c]) for c in picks]
    return out


def _inputs(index: int, hq: int, hkv: int, dtype):
    gen = torch.Generator().manual_seed(500 + index)
    make = lambda h: torch.randn(BATCH, SEQ, h, DIM, generator=gen).to(dtype)  # noqa: E731
    return make(hq), make(hkv), make(hkv), make(hq)


def _mode_options(mode: str) -> dict:
    window = {"sliding_window": WINDOW} if mode == "window" else {}
    return {"causal": mode != "full", "cu_seqlens": DOCS if mode in ("docs", "window") else None, **window}


def _call(q, k, v, mode, **kw):
    return ulysses_ring_attention(q, k, v, return_lse=True, **_mode_options(mode), **kw)


def _groups_on_first_ranks(cp: int, u: int):
    """``(ParallelLayout, cp group)`` of a CP group on ranks ``0..cp-1`` of a larger world (``None`` on
    the other ranks), built by hand: every rank creates every group, in the same order."""
    import torch.distributed as dist

    from ringft.ops.parallel import ParallelLayout

    cp_group = dist.new_group(list(range(cp)))
    uly = [dist.new_group([p * u + x for x in range(u)]) for p in range(cp // u)]
    ring = [dist.new_group([p * u + x for p in range(cp // u)]) for x in range(u)]
    if dist.get_rank() >= cp:
        return None, None
    p, x = divmod(dist.get_rank(), u)
    return ParallelLayout.from_groups(cp_group, uly[p], ring[x]), cp_group


def _layouts(world: int, cp: int, u: int):
    """``(groups, cp_group, cp_rank, dp_rank)`` of this rank for a ``cp`` x ``dp`` layout."""
    from ringft.ops.parallel import build_layout

    if world % cp == 0:
        layout = build_layout(cp, u)
        return layout, layout.cp_group, layout.cp_rank, layout.dp_rank
    groups, cp_group = _groups_on_first_ranks(cp, u)
    rank = torch.distributed.get_rank()
    return (groups, cp_group, rank, 0) if groups is not None else (None, None, None, None)


def hybrid_worker(rank: int, world: int) -> bytes:
    """Every CP size and config on this rank: its shards of out, lse, dq, dk, dv (and the U = 1
    equality with the ring), keyed by ``(cp, config index, dp rank, cp rank)``."""
    from ringft.ops.zigzag import zigzag_ring_attention

    records = {}
    for cp in CP_SIZES:
        layouts = {}
        for i, (u, hq, hkv, dtype, mode) in enumerate(configs(cp)):
            if u not in layouts:
                layouts[u] = _layouts(world, cp, u)
            groups, cp_group, cp_rank, dp_rank = layouts[u]
            if groups is None:
                continue
            q, k, v, dout = (cp_shard(t, cp_rank, cp, u).clone() for t in _inputs(i, hq, hkv, dtype))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out, lse = _call(*leaves, mode, groups=groups, backend="torch")
            out.backward(dout)
            record = {"tensors": [out.detach(), lse, *(t.grad for t in leaves)]}
            if u == 1:  # today's ring over the CP group, same inputs: bit for bit
                ring = [t.clone().requires_grad_() for t in (q, k, v)]
                r_out, r_lse = zigzag_ring_attention(
                    *ring, return_lse=True, group=cp_group, backend="torch", **_mode_options(mode)
                )
                r_out.backward(dout)
                got = [r_out.detach(), r_lse, *(t.grad for t in ring)]
                record["bitwise"] = all(torch.equal(a, b) for a, b in zip(record["tensors"], got))
            records[(cp, i, dp_rank, cp_rank)] = record
    records[("errors", rank)] = _error_cases(rank, world)
    records[("alltoall", rank)] = _alltoall_cases(rank, world)
    return _to_bytes(records)  # tensors through the result queue would need shared memory


def _alltoall_cases(rank: int, world: int) -> list[str]:
    """gloo's all_to_all_single through seq_to_heads / heads_to_seq, exactly, for every split of 6
    and fp64, fp32, bf16, fp16 (integer-valued data), with non-contiguous incoming gradients.
    Returns the failures (empty when all is well)."""
    from ringft.ops.alltoall import heads_to_seq, seq_to_heads
    from ringft.ops.parallel import build_layout
    from ringft.ops.sharding import cp_position_ids

    failures = []
    for u in (2, 3, 6):
        layout = build_layout(world, u)
        g, h = layout, 12 // u  # 12 heads, h per rank after the exchange
        ring_shard = torch.cat([cp_position_ids(SEQ, layout.ring_rank * u + j, world, u) for j in range(u)])
        heads = slice(layout.ulysses_rank * h, (layout.ulysses_rank + 1) * h)
        for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            x = torch.arange(BATCH * SEQ * 12 * 4).view(BATCH, SEQ, 12, 4).remainder(251).to(dtype)
            grad = -x.transpose(0, 1).contiguous().transpose(0, 1)  # same values, non-contiguous
            mine = cp_shard(x, rank, world, u).clone().requires_grad_()
            (y,) = seq_to_heads(mine, group=g.ulysses_group)
            (back,) = heads_to_seq(y, group=g.ulysses_group)
            (y * grad[:, ring_shard, heads]).sum().backward()
            checks = {
                "to heads": torch.equal(y, x[:, ring_shard, heads]),
                "round trip": torch.equal(back, mine),
                "backward": torch.equal(mine.grad, cp_shard(grad, rank, world, u)),
            }
            failures += [f"U={u} {dtype} {name}" for name, ok in checks.items() if not ok]
    return failures


def _raises(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _error_cases(rank: int, world: int) -> dict[str, str]:
    """Bad inputs on a cp = 6 = ulysses 2 x ring 3 layout: each case's message on this rank."""
    from ringft.ops.documents import document_layout
    from ringft.ops.parallel import ParallelLayout, build_layout

    layout = build_layout(world, 2)
    g = layout
    wrong = ParallelLayout.from_groups(g.cp_group, g.ulysses_group, g.cp_group)  # ring = the CP group
    qkv = lambda s=4, hq=4, hkv=2: [torch.randn(1, s, h, DIM) for h in (hq, hkv, hkv)]  # noqa: E731
    plan = document_layout(DOCS[:1], 4 * world, rank, world)  # built for the CP rank, not the ring rank
    seen = {
        "heads": _raises(ulysses_ring_attention, *qkv(hq=3, hkv=1), groups=g),
        "heads_one_rank": _raises(ulysses_ring_attention, *qkv(hq=3 if rank == 0 else 4, hkv=1), groups=g),
        "odd_seq": _raises(ulysses_ring_attention, *qkv(s=3), groups=g),
        "seq_differs": _raises(ulysses_ring_attention, *qkv(s=4 if rank else 6), groups=g),
        "layout": _raises(ulysses_ring_attention, *qkv(), groups=wrong),
        "docs_differ": _raises(ulysses_ring_attention, *qkv(), groups=g, cu_seqlens=[[0, 3 + rank, 24]]),
        "docs_plan": _raises(ulysses_ring_attention, *qkv(), groups=g, cu_seqlens=plan),
        "ulysses_not_dividing": _raises(build_layout, world, 4),
        "cp_not_dividing": _raises(build_layout, 4, 2),
        "shard_seq": _raises(cp_shard, torch.zeros(1, 18), 0, 6, 2),
    }
    # The groups are still usable: a good call runs on every rank.
    ulysses_ring_attention(*qkv(), groups=g, cu_seqlens=[[0, 3, 4 * world]])
    return seen


ERRORS = {  # case -> fragment every rank's message contains
    "heads": "query heads (3) are not divisible by ulysses_size=2: use a ulysses_size dividing the heads "
    "and cp_size=6: [1, 3]",
    "odd_seq": "must be even",
    "seq_differs": "same batch, seq_local",
    "layout": "not a ulysses x ring layout",
    "docs_differ": "cu_seqlens checksum",
    "docs_plan": "ring rank",
    "ulysses_not_dividing": "ulysses_size=4 does not divide cp_size=6",
    "cp_not_dividing": "cp_size=4 does not divide the world size 6",
    "shard_seq": "not divisible by 2 * cp_size = 12",
}


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _oracle(q, k, v, dout, mode):
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    if mode == "window":
        out, lse = windowed_attention_fp64(qd, kd, vd, WINDOW, DOCS)
    elif mode == "docs":
        out, lse = per_document_attention_fp64(qd, kd, vd, DOCS)
    else:
        out, lse = full_attention_fp64(qd, kd, vd, mode == "causal")
    return (out.detach(), lse.detach(), *torch.autograd.grad(out, (qd, kd, vd), dout.double()))


def _fused_bf16(q, k, v, dout, mode):
    """One bf16 attention over the whole sequence in one process (the bf16 baseline)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = _call(*leaves, mode, backend="torch")
    out.backward(dout)
    return (out.detach(), lse, *(t.grad for t in leaves))


def _rel(x, ref) -> float:
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


NAMES = ("out", "lse", "dq", "dk", "dv")


def _check(cp: int, records: dict) -> None:
    dp = max(key[2] for key in records if key[0] == cp) + 1
    for i, (u, hq, hkv, dtype, mode) in enumerate(configs(cp)):
        q, k, v, dout = _inputs(i, hq, hkv, dtype)
        ref = _oracle(q, k, v, dout, mode)
        base = _fused_bf16(q, k, v, dout, mode) if dtype == torch.bfloat16 else None
        copies = kv_replication(hkv, u)
        where = f"cp {cp} = ulysses {u} x ring {cp // u}, heads {hq}/{hkv}, {dtype}, {mode}"
        for replica in range(dp):
            mine = [records[(cp, i, replica, c)] for c in range(cp)]
            for j, name in enumerate(NAMES):
                got = cp_unshard([m["tensors"][j] for m in mine], u, dim=2 if name == "lse" else 1)
                assert got.dtype == (torch.float32 if name == "lse" else dtype)
                if dtype == torch.float32:
                    limit = ((hq // hkv) * SEQ + DIM + 2 * cp) * EPS32 * 2
                else:
                    limit = 2 * _rel(base[j], ref[j]) + 4e-3 + (copies * 2**-8 if name in ("dk", "dv") else 0)
                err = _rel(got, ref[j])
                assert err <= limit, f"{where}, replica {replica}, {name}: rel err {err:.2e} > {limit:.2e}"
            if u == 1:
                assert all(m["bitwise"] for m in mine), f"{where}: ulysses_size 1 is not the ring bit for bit"


@pytest.fixture(scope="module")
def records() -> dict:
    """One spawn of 6 gloo processes for the whole module: every rank's records, merged."""
    merged = {}
    for payload in run_distributed(hybrid_worker, 6, timeout=200):
        merged.update(torch.load(io.BytesIO(payload)))
    return merged


@pytest.mark.numerics
@pytest.mark.timeout(240)
@pytest.mark.parametrize("cp", CP_SIZES)
def test_ulysses_ring_matches_fp64_attention(records, cp):
    _check(cp, records)  # tiny fp64 oracles, one thread (tests/conftest.py)


@pytest.mark.timeout(240)
def test_bad_inputs_raise_on_every_rank(records):
    """Each bad input raises a ValueError naming the problem and the fix on every rank, no hang."""
    for rank in range(6):
        seen = records[("errors", rank)]
        for case, fragment in ERRORS.items():
            assert fragment in seen[case], f"{case} on rank {rank}: {seen[case]}"
        expected = "query heads (3)" if rank == 0 else "bad inputs on CP rank(s) [0]"
        assert expected in seen["heads_one_rank"], seen["heads_one_rank"]


@pytest.mark.timeout(240)
def test_all_to_all_is_exact_on_gloo(records):
    """fp64 / fp32 / bf16 / fp16 through gloo's all_to_all_single, forward and backward, bit-exact."""
    for rank in range(6):
        assert records[("alltoall", rank)] == [], records[("alltoall", rank)]


def test_one_process_is_the_ring():
    """Without torch.distributed the operator is the plain local attention (groups=None)."""
    q, k, v, dout = _inputs(0, 4, 2, torch.float32)
    ref = _oracle(q, k, v, dout, "causal")
    out = ulysses_ring_attention(q, k, v, backend="torch")
    assert _rel(out, ref[0]) < (2 * SEQ + DIM) * EPS32 * 2
