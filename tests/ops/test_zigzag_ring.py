"""Zigzag ring attention vs plain fp64 full attention on the global sequence.

One spawn of 4 gloo processes (CPU) runs every ring size N = 1..4 on the CP group of ranks 0..N-1
and loops over every config inside the processes (the fp64 oracle once per config and rank).

Tolerances (errors are max-abs, relative to the max-abs of the oracle tensor):
- fp32: 2e-5. Both the fused CPU kernel and the merge run in fp32 (eps 1.2e-7); with head_dim <= 80
  and <= 48 keys the accumulated round-off stays below ~1e-6, so 2e-5 leaves a 20x margin while
  still catching any masking / merge / ring-order mistake (those give O(1e-1) errors).
- bf16: the oracle runs in fp64 on the *bf16-rounded* inputs, so only the kernel's own bf16
  roundings remain (out is stored in bf16: 2^-8 = 3.9e-3 relative). We require the ring's error to be
  at most 2x the error of one fused bf16 attention call over the whole sequence on one process,
  plus 4e-3, i.e. splitting over ranks may not make bf16 numerics materially worse.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ringft import cp_position_ids, cp_shard, cp_unshard, zigzag_ring_attention
from ringft.utils.spawn import run_distributed
from tests.oracle import full_attention_fp64

HEADS = [(4, 4), (4, 2), (8, 2), (4, 1)]  # GQA ratios 1, 2, 4 and MQA
HEAD_DIMS = [64, 80]
DTYPES = [torch.float32, torch.bfloat16]


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def _make_inputs(seed, batch, seq, hq, hkv, dim, dtype):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, hq, dim, generator=gen).to(dtype)
    k = torch.randn(batch, seq, hkv, dim, generator=gen).to(dtype)
    v = torch.randn(batch, seq, hkv, dim, generator=gen).to(dtype)
    dout = torch.randn(batch, seq, hq, dim, generator=gen).to(dtype)
    return q, k, v, dout


def _oracle_with_grads(q, k, v, dout, causal):
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    out, lse = full_attention_fp64(qd, kd, vd, causal)
    dq, dk, dv = torch.autograd.grad(out, (qd, kd, vd), dout.double())
    return out.detach(), lse.detach(), dq, dk, dv


CP_SIZES = (1, 2, 3, 4)  # one spawn of 4 processes: the CP group of size N is ranks 0..N-1
REFERENCE_SIZES = (2, 3)  # the reference backend's ring, on the same processes


def ring_vs_oracle_worker(rank: int, world: int) -> dict[tuple[str, int], list[dict]]:
    """Every config on every ring this rank is in (the torch backend on CP groups of 1..4 ranks,
    the reference backend on 2 and 3): per-config relative errors (and the fused bf16 baseline),
    keyed ``(backend, N)``. The oracle and the baseline are computed once per config."""
    import torch.distributed as dist

    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    groups = {size: dist.new_group(list(range(size))) for size in CP_SIZES}
    runs = [("torch", n) for n in CP_SIZES] + [("reference", n) for n in REFERENCE_SIZES]
    records: dict[tuple[str, int], list[dict]] = {run: [] for run in runs if rank < run[1]}
    batch, seq = 2, 48  # 48 is a multiple of 2N for N = 1, 2, 3, 4
    configs = itertools.product(HEADS, HEAD_DIMS, [True, False], DTYPES)
    for i, ((hq, hkv), dim, causal, dtype) in enumerate(configs):
        q, k, v, dout = _make_inputs(1000 + i, batch, seq, hq, hkv, dim, dtype)
        ref = _oracle_with_grads(q, k, v, dout, causal)
        baselines: dict[str, dict] = {}
        for backend, n in runs:
            if rank >= n:
                continue
            shard = lambda t, n=n: cp_shard(t, rank, n).detach().clone()  # noqa: E731
            ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
            out, lse = zigzag_ring_attention(
                ql, kl, vl, causal=causal, backend=backend, group=groups[n], return_lse=True
            )
            assert out.dtype == dtype and lse.dtype == torch.float32
            assert out.shape == ql.shape and lse.shape == (batch, hq, seq // n)
            out.backward(shard(dout))
            errs = {
                "out": _rel_err(out, shard(ref[0])),
                "lse": _rel_err(lse, cp_shard(ref[1], rank, n, dim=2)),
                "dq": _rel_err(ql.grad, shard(ref[2])),
                "dk": _rel_err(kl.grad, shard(ref[3])),
                "dv": _rel_err(vl.grad, shard(ref[4])),
            }
            if dtype == torch.bfloat16 and backend not in baselines:
                # One fused bf16 attention over the whole sequence on one process, same inputs.
                qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
                of, lf = zigzag_ring_attention(
                    qf, kf, vf, causal=causal, backend=backend, group=singles[rank], return_lse=True
                )
                of.backward(dout)
                baselines[backend] = {
                    "out": _rel_err(of, ref[0]),
                    "lse": _rel_err(lf, ref[1]),
                    "dq": _rel_err(qf.grad, ref[2]),
                    "dk": _rel_err(kf.grad, ref[3]),
                    "dv": _rel_err(vf.grad, ref[4]),
                }
            config = (hq, hkv, dim, causal, str(dtype))
            records[backend, n].append({"config": config, "errors": errs, "baseline": baselines.get(backend)})
    for n in TILE_SIZES:
        if rank < n:
            records["tiles", n] = _tiled_ring_errors(rank, n, groups[n])
    return records


TILE_SIZES = (2, 3)  # attention_tile_tokens through the ring, fp64, on the same processes


def _tiled_ring_errors(rank: int, n: int, group) -> list[float]:
    """fp64 ring in tiles of 5 tokens (odd, dividing neither seq_local 24 nor 16) against the
    untiled ring and the fp64 oracle: max relative error of out, lse and the three grads."""
    errors = []
    for causal in (True, False):
        q, k, v, dout = _make_inputs(7, 2, 48, 4, 2, 16, torch.float64)
        ref = _oracle_with_grads(q, k, v, dout, causal)
        results = []
        for tile in (None, 5):
            ql, kl, vl = (cp_shard(t, rank, n).detach().clone().requires_grad_() for t in (q, k, v))
            out, lse = zigzag_ring_attention(
                ql, kl, vl, causal=causal, backend="torch", group=group, return_lse=True,
                attention_tile_tokens=tile,
            )  # fmt: skip
            out.backward(cp_shard(dout, rank, n))
            results.append((out, lse, ql.grad, kl.grad, vl.grad))
        shards = [cp_shard(ref[0], rank, n), cp_shard(ref[1], rank, n, dim=2)]
        shards += [cp_shard(g, rank, n) for g in ref[2:]]
        errors += [_rel_err(t, u.double()) for t, u in zip(results[1], results[0])]
        errors += [_rel_err(t, r) for t, r in zip(results[1], shards)]
    return errors


def _check_records(records: list[dict], backend: str, world: int, rank: int) -> None:
    assert len(records) == len(HEADS) * len(HEAD_DIMS) * 2 * len(DTYPES)  # every config ran
    for rec in records:
        dtype = rec["config"][-1]
        for name, err in rec["errors"].items():
            if dtype == "torch.float32":
                limit = 2e-5
            else:
                limit = 2 * rec["baseline"][name] + 4e-3
            where = f"{backend} N={world} rank {rank} config={rec['config']} {name}"
            assert err <= limit, f"{where}: rel err {err:.2e} > {limit:.2e}"


@pytest.fixture(scope="module")
def records() -> list[dict]:
    """One spawn of 4 gloo processes for the module: every rank's records."""
    return run_distributed(ring_vs_oracle_worker, max(CP_SIZES), timeout=240)


@pytest.mark.numerics
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", CP_SIZES)
def test_ring_matches_fp64_full_attention(records, world):
    for rank in range(world):
        _check_records(records[rank]["torch", world], "torch", world, rank)


@pytest.mark.numerics
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", TILE_SIZES)
def test_tiled_ring_matches_untiled(records, world):
    # fp64 throughout: tiles only reorder sums of <= 48 terms (eps64 x 48 ~ 1e-14).
    for rank in range(world):
        assert max(records[rank]["tiles", world]) < 1e-12


@pytest.mark.numerics
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", REFERENCE_SIZES)
def test_reference_backend_ring(records, world):
    for rank in range(world):
        _check_records(records[rank]["reference", world], "reference", world, rank)


def test_single_process_without_distributed():
    q, k, v, dout = _make_inputs(7, 1, 16, 4, 2, 64, torch.float32)
    ref = _oracle_with_grads(q, k, v, dout, True)
    out = zigzag_ring_attention(q, k, v)
    assert _rel_err(out, ref[0]) < 2e-5


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_shard_round_trip(world):
    x = torch.arange(2 * 4 * world * 3 * 5).view(2, 4 * world * 3, 5)
    shards = [cp_shard(x, r, world) for r in range(world)]
    assert all(s.shape == (2, 4 * 3, 5) for s in shards)
    assert torch.equal(cp_unshard(shards), x)
    pos = [cp_position_ids(x.shape[1], r, world) for r in range(world)]
    assert torch.equal(torch.sort(torch.cat(pos)).values, torch.arange(x.shape[1]))
    # Each rank's positions are increasing (so the local diagonal block is plainly causal).
    assert all(torch.all(p[1:] > p[:-1]) for p in pos)
    # Rank r holds chunks r and 2N-1-r.
    c = x.shape[1] // (2 * world)
    assert pos[0][0] == 0 and pos[0][-1] == x.shape[1] - 1 and pos[-1][0] == (world - 1) * c


def test_shard_rejects_indivisible_length():
    with pytest.raises(ValueError, match="not divisible by 2 \\* cp_size"):
        cp_shard(torch.zeros(1, 10), 0, 3)


@pytest.mark.numerics
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_single_process_emulation_matches_oracle(world, causal):
    from ringft.ops.emulate import emulate_zigzag_attention

    q, k, v, dout = _make_inputs(11, 2, 48, 8, 2, 80, torch.float32)
    ref = _oracle_with_grads(q, k, v, dout, causal)
    out, lse, grads = emulate_zigzag_attention(q, k, v, world, causal=causal, dout=dout)
    for got, want in zip((out, lse, *grads), ref):
        assert _rel_err(got, want) < 2e-5
