"""Packed documents on the zigzag ring (operator level) vs each document run separately.

Oracle: plain fp64 attention of every document on its own (tests/oracle.py). The distributed check
runs every ring size N = 1..4 in one spawn of 4 processes (the CP group of ranks 0..N-1).
"""

from __future__ import annotations

import random

import pytest
import torch

from ringft.ops import zigzag_ring_attention
from ringft.ops.documents import cu_seqlens_from_position_ids, document_layout
from ringft.ops.sharding import cp_shard
from ringft.utils.spawn import run_distributed
from tests.oracle import per_document_attention_fp64

SEQ = 48  # a multiple of 2N for N = 1..4; chunks of 24, 12, 8, 6 tokens
EPS32 = torch.finfo(torch.float32).eps
EPS64 = torch.finfo(torch.float64).eps
# Relative to the largest oracle entry: recursive fp32 sums over <= SEQ keys, head_dim 16 and <= 2N
# log-sum-exp merges err by < (48 + 16 + 8) * eps = 8.6e-6 worst case; a masking mistake is O(1e-1).
FP32_REL = (SEQ + 16 + 8) * EPS32 * 2  # x2: the backward's recomputed probabilities enter dq/dk/dv


def layouts(seq: int = SEQ) -> dict[str, list[list[int]]]:
    """Named document layouts (global offsets per row, batch of 2)."""
    gen = random.Random(0)
    tiny = [0] + sorted(gen.sample(range(1, seq), 20)) + [seq]
    return {
        "one": [[0, seq], [0, seq]],
        "edges": [[0, 6, 12, 24, 30, 36, seq], [0, 8, 16, 40, seq]],  # on chunk edges for N = 2..4
        "straddle": [[0, 5, 19, 31, 47, seq], [0, 13, 14, 35, seq]],  # across chunk edges
        "in_one_chunk": [[0, 2, 4, seq], [0, 44, 46, seq]],  # short documents inside one chunk
        "tiny": [tiny, tiny],  # 21 documents of 1-5 tokens
        "same_rows": [[0, 7, 29, seq], [0, 7, 29, seq]],  # one plan for the batch (uniform)
    }


def _inputs(seed, hq=4, hkv=2, dim=16, batch=2, seq=SEQ, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(batch, seq, h, dim, generator=gen).to(dtype)  # noqa: E731
    return make(hq), make(hkv), make(hkv), make(hq)


def _oracle(q, k, v, dout, cu):
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    out, lse = per_document_attention_fp64(qd, kd, vd, cu)
    grads = torch.autograd.grad(out, (qd, kd, vd), dout.double())
    return (out.detach(), lse.detach(), *grads)


def _rel(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


def test_plans_match_brute_force_masks():
    """Every (query, key) pair a plan computes is exactly a same-document causal pair, per step."""
    rng = random.Random(1)
    for n in (1, 2, 3, 4):
        for seq in (2 * n * 3, 2 * n * 5):
            for _ in range(40):
                m = rng.randint(0, min(seq - 1, 8))
                cu = [0, *sorted(rng.sample(range(1, seq), m)), seq]
                doc = [max(i for i, x in enumerate(cu[:-1]) if x <= g) for g in range(seq)]
                pos = [cp_shard(torch.arange(seq), r, n, dim=0).tolist() for r in range(n)]
                for rank in range(n):
                    row = document_layout([cu], seq, rank, n).rows[0]
                    d = row.diagonal
                    got = [{(i, j) for x, y in zip(d, d[1:]) for i in range(x, y) for j in range(x, i + 1)}]
                    for rect in row.blocks[1:]:
                        q0, q1, k0, k1 = rect or (0, 0, 0, 0)
                        got.append({(i, j) for i in range(q0, q1) for j in range(k0, k1)})
                    for step in range(n):
                        kv = pos[(rank - step) % n]
                        want = {
                            (i, j)
                            for i, g in enumerate(pos[rank])
                            for j, h in enumerate(kv)
                            if h <= g and doc[g] == doc[h]
                        }
                        assert got[step] == want, (n, seq, cu, rank, step)


def test_offsets_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [5, 6, 7, 8, 9, 10, 11, 12]])
    assert cu_seqlens_from_position_ids(pos) == [[0, 3, 5, 6, 8], [0, 8]]


@pytest.mark.numerics
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_emulated_ring_matches_each_document(backend):
    from ringft.ops.emulate import emulate_zigzag_attention

    for n in (1, 2, 3, 4):
        for i, (name, cu) in enumerate(layouts().items()):
            q, k, v, dout = _inputs(i)
            ref = _oracle(q, k, v, dout, cu)
            out, lse, grads = emulate_zigzag_attention(q, k, v, n, backend=backend, dout=dout, cu_seqlens=cu)
            for what, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), ref):
                assert _rel(got, want) < FP32_REL, f"{backend} N={n} {name} {what}: {_rel(got, want):.1e}"


def test_causal_pieces_cover_each_document_triangle_once():
    """Aligned tiles (masked), tail causal calls and staircase rectangles together cover every
    segment's causal triangle exactly once and nothing else."""
    from ringft.ops.document_blocks import causal_pieces, tile_mask

    for bounds in ((0, 3, 20, 21, 48), (0, 48), (0, 1, 2, 47, 48), (0, 40, 48)):
        want = sorted(
            (i, j) for x, y in zip(bounds, bounds[1:]) for i in range(x, y) for j in range(x, i + 1)
        )
        for tile in (None, 1, 4, 5, 16, 48, 100):
            aligned, pieces = causal_pieces(bounds, tile)
            got = []
            if aligned:
                mask = tile_mask(bounds, aligned, tile, 1, torch.float32, torch.device("cpu"))
                assert mask.shape == (aligned // tile, 1, tile, tile)
                for t, i, j in (mask[:, 0] == 0).nonzero().tolist():
                    got.append((t * tile + i, t * tile + j))
            for q0, q1, k0, k1, causal in pieces:
                got += [
                    (i, j) for i in range(q0, q1) for j in range(k0, k1) if not causal or j - k0 <= i - q0
                ]
            assert sorted(got) == want, (bounds, tile)


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_tiled_causal_blocks_match_each_document(monkeypatch, dtype):
    """On CPU the torch backend runs the local causal block as aligned tiles of 64 tokens (one
    batched masked call) plus rectangles; a tile of 5 runs that path (with a tail) on the small
    layouts.

    bf16: the oracle gets the same bf16 inputs; the baseline is the untiled path (one fused bf16
    call per document, what the default tile of 64 gives on these short blocks). Tiling adds at
    most a few bf16 roundings of partial outputs (2^-9 relative each, merged in fp32) on top of the
    same kernel roundings: within 2 x the baseline + 4e-3, the ring tests' bf16 bound."""
    import ringft.ops.torch_backend as torch_backend
    from ringft.ops.emulate import emulate_zigzag_attention

    def errors(n, i, cu):
        q, k, v, dout = _inputs(200 + i, dtype=dtype)
        ref = _oracle(q, k, v, dout, cu)
        out, lse, grads = emulate_zigzag_attention(q, k, v, n, backend="torch", dout=dout, cu_seqlens=cu)
        return [
            (what, _rel(got, want))
            for what, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), ref)
        ]

    cases = [(n, i, name, cu) for n in (1, 2, 3) for i, (name, cu) in enumerate(layouts().items())]
    baseline = {(n, name): errors(n, i, cu) for n, i, name, cu in cases} if dtype == torch.bfloat16 else None
    monkeypatch.setattr(torch_backend, "CPU_CAUSAL_TILE", 5)
    for n, i, name, cu in cases:
        for j, (what, err) in enumerate(errors(n, i, cu)):
            if dtype == torch.bfloat16:
                limit = 2 * baseline[n, name][j][1] + 4e-3
            else:
                limit = FP32_REL if dtype == torch.float32 else FP32_REL * EPS64 / EPS32
            assert err < limit, f"tile 5 {dtype} N={n} {name} {what}: {err:.1e} (limit {limit:.1e})"


CP_SIZES = (1, 2, 3, 4)  # one spawn of 4 processes: the CP group of size N is ranks 0..N-1


def documents_worker(rank: int, world: int) -> dict[int, list[tuple[str, float]]]:
    """Every layout, GQA and MHA, on every CP group this rank is in: ``{N: [(case, rel err)]}``
    (the oracle once per case)."""
    import torch.distributed as dist

    groups = {n: dist.new_group(list(range(n))) for n in CP_SIZES}  # every rank creates every group
    errors: dict[int, list[tuple[str, float]]] = {n: [] for n in CP_SIZES if rank < n}
    for i, (name, cu) in enumerate(layouts().items()):
        for hq, hkv in ((4, 2), (4, 4)):  # GQA and MHA
            q, k, v, dout = _inputs(100 + i, hq=hq, hkv=hkv)
            ref = _oracle(q, k, v, dout, cu)
            for n in errors:
                shard = lambda t, n=n: cp_shard(t, rank, n).detach().clone()  # noqa: E731
                ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
                out, lse = zigzag_ring_attention(
                    ql, kl, vl, backend="torch", return_lse=True, cu_seqlens=cu, group=groups[n]
                )
                out.backward(shard(dout))
                got = (out, lse, ql.grad, kl.grad, vl.grad)
                want = (shard(ref[0]), cp_shard(ref[1], rank, n, dim=2), *(shard(g) for g in ref[2:]))
                for what, g, r in zip("o l dq dk dv".split(), got, want):
                    errors[n].append((f"{name} {hq}/{hkv} {what}", _rel(g, r)))
    return errors


@pytest.fixture(scope="module")
def distributed_errors() -> list[dict[int, list[tuple[str, float]]]]:
    """One spawn of 4 gloo processes for the module: every rank's errors."""
    return run_distributed(documents_worker, max(CP_SIZES), timeout=240)


@pytest.mark.numerics
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", CP_SIZES)
def test_distributed_ring_matches_each_document(distributed_errors, world):
    for rank in range(world):
        cases = distributed_errors[rank][world]
        assert len(cases) == len(layouts()) * 2 * 5, f"N={world} rank {rank}: cases missing"
        for name, err in cases:
            assert err < FP32_REL, f"N={world} rank {rank} {name}: {err:.1e}"


def test_fewer_pairs_than_full_causal():
    n, seq = 4, 64
    full = sum(document_layout([[0, seq]], seq, r, n).attention_pairs() for r in range(n))
    assert full == seq * (seq + 1) // 2  # one document: exactly the causal pairs
    cu = [0, 16, 32, 48, seq]
    packed = sum(document_layout([cu], seq, r, n).attention_pairs() for r in range(n))
    assert packed == 4 * 16 * 17 // 2
    assert document_layout([[0, seq]], seq, 1, n).single and not document_layout([cu], seq, 1, n).single


def test_balanced_order_evens_out_the_ranks():
    from ringft.data.packer import balanced_order
    from ringft.ops.documents import rank_pairs

    seq, n = 4096, 4
    for seed in range(4):  # 16 documents at uniform random cut points
        gen = random.Random(seed)
        cu = [0, *sorted(gen.sample(range(1, seq), 15)), seq]
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        order = balanced_order(lengths, seq, n)
        assert sorted(order) == list(range(16)) and order == balanced_order(lengths, seq, n)  # deterministic
        before, after = rank_pairs(lengths, seq, n), rank_pairs([lengths[i] for i in order], seq, n)
        assert sum(before) == sum(after)  # the same work, spread differently
        busiest = max(after) / (sum(after) / n)  # 1.0 = perfectly even
        assert busiest <= max(before) / (sum(before) / n)
        if seed == 0:  # measured 1.64 -> 1.07 (a single document holding 31% of S limits seed 2)
            assert busiest < 1.1
