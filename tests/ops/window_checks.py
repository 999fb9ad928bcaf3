"""The windowed ring operator's shared inputs, fp64 oracle and distributed check, a plain module (no
test module imports another): ``tests/ops/test_windows.py`` runs the emulated and one-process
checks, ``tests/model/test_windows_hf.py`` runs :func:`window_worker` on the same processes as its
Mistral checks (one spawn per world size for both). Tolerances: test_windows.py's docstring.
"""

from __future__ import annotations

import torch

from ringft.ops import zigzag_ring_attention
from ringft.ops.sharding import cp_shard
from ringft.ops.windows import window_schedule
from tests.oracle import windowed_attention_fp64

SEQ, DIM = 48, 16  # 48: a multiple of 2N for N = 1..4 (chunks of 24, 12, 8, 6)
EPS32 = torch.finfo(torch.float32).eps
FP32_REL = (SEQ + DIM + 8) * EPS32 * 2
DOCS = [[0, 5, 19, 31, 47, SEQ], [0, 13, 14, 35, SEQ]]  # across and on chunk edges, a 1-token doc


def windows(world: int) -> list[int]:
    """Windows around the chunk size c: 1, shorter, equal, one longer (straddles a chunk edge), and
    over two chunks longer (for N = 4 it reaches the farthest rank)."""
    c = SEQ // (2 * world)
    return sorted({1, max(2, c - 1), c, c + 1, min(2 * c + 3, SEQ - 1)})


def inputs(seed, hq=4, hkv=2, batch=2, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(batch, SEQ, h, DIM, generator=gen).to(dtype)  # noqa: E731
    return make(hq), make(hkv), make(hkv), make(hq)


def oracle(q, k, v, dout, window, cu):
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = windowed_attention_fp64(qd, kd, vd, window, cu)
    return (out.detach(), lse.detach(), *torch.autograd.grad(out, (qd, kd, vd), dout.double()))


def rel(x, ref):
    """Max-abs error over the oracle's max-abs, or absolute where the oracle is below 1 (with a window
    of 1 key, dq is exactly 0: the output is the key's value whatever the query)."""
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()


def window_worker(rank: int, world: int, group=None, single=None) -> dict:
    """Every config on this rank: errors against the oracle (and the one-process bf16 baseline),
    the K/V traffic (counted sends), and whether windows >= S equal no window bit for bit."""
    import torch.distributed as dist

    if single is None:  # this rank alone: one process (every rank creates every group)
        single = [dist.new_group([r]) for r in range(world)][rank]
    real, sent = dist.batch_isend_irecv, []

    def counting(ops):
        sent.extend((op.peer, op.tensor.numel(), op.tensor.dtype) for op in ops if op.op is dist.isend)
        return real(ops)

    dist.batch_isend_irecv = counting
    records, c = [], SEQ // (2 * world)
    configs = []
    for i, w in enumerate(windows(world)):  # GQA fp32 and MQA bf16 with and without documents
        configs += [("torch", 4, 2, torch.float32, w, DOCS if i % 2 else None)]
        configs += [("torch", 4, 1, torch.bfloat16, w, None if i % 2 else DOCS)]
        if i in (0, 3):
            configs += [("reference", 4, 2, torch.float32, w, DOCS)]
    shard = lambda t: cp_shard(t, rank, world).detach().clone()  # noqa: E731
    for i, (backend, hq, hkv, dtype, w, cu) in enumerate(configs):
        q, k, v, dout = inputs(100 * world + i, hq=hq, hkv=hkv, dtype=dtype)
        ref = oracle(q, k, v, dout, w, cu)
        ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
        sent.clear()
        out, lse = zigzag_ring_attention(
            ql, kl, vl, backend=backend, return_lse=True, cu_seqlens=cu, sliding_window=w, group=group
        )
        forward_sent = list(sent)
        out.backward(shard(dout))
        got = (out, lse, ql.grad, kl.grad, vl.grad)
        want = (shard(ref[0]), cp_shard(ref[1], rank, world, dim=2), *(shard(g) for g in ref[2:]))
        errors = [rel(g, r) for g, r in zip(got, want)]
        base = None
        if dtype == torch.bfloat16:
            qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
            of, lf = zigzag_ring_attention(
                qf, kf, vf, backend=backend, group=single, return_lse=True, cu_seqlens=cu, sliding_window=w
            )
            of.backward(dout)
            base = [rel(g, r) for g, r in zip((of, lf, qf.grad, kf.grad, vf.grad), ref)]
        plan = window_schedule(SEQ, world, w)
        records.append(
            {
                "config": (backend, hq, hkv, str(dtype), w, cu is not None),
                "errors": errors,
                "baseline": base,
                "forward_sent": forward_sent,
                "backward_sent": list(sent[len(forward_sent) :]),
                "plan_elements": plan.chunks_sent(rank) * 2 * 2 * c * hkv * DIM,
                "plan_received": sum(map(len, plan.needs[rank])) * 2 * 2 * c * hkv * DIM,
                "plan_peers": sorted({p for s in range(1, plan.steps + 1) for p, _ in plan.sends(rank, s)}),
            }
        )
    # A window that every key is in runs the unwindowed ring itself: identical bits.
    q, k, v, _ = (shard(t) for t in inputs(7))
    same = all(
        torch.equal(
            zigzag_ring_attention(q, k, v, sliding_window=w, cu_seqlens=cu, group=group),
            zigzag_ring_attention(q, k, v, cu_seqlens=cu, group=group),
        )
        for w in (SEQ, SEQ + 5)
        for cu in (None, DOCS)
    )
    dist.batch_isend_irecv = real
    return {"records": records, "window_ge_seq_identical": same}


def check_window_results(results: list[dict], world: int) -> None:
    """Assert on every rank's :func:`window_worker` result (called by the distributed test, which
    runs in ``tests/model/test_windows_hf.py`` on the same processes as the Mistral checks: one
    spawn per world size for both, since starting processes costs more than the checks)."""
    c = SEQ // (2 * world)
    for rank, result in enumerate(results):
        assert result["window_ge_seq_identical"]
        for rec in result["records"]:
            backend, hq, hkv, dtype, w, docs = tag = rec["config"]
            for j, (what, err) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), rec["errors"])):
                limit = FP32_REL if dtype == "torch.float32" else 2 * rec["baseline"][j] + 4e-3
                assert err <= limit, f"N={world} rank {rank} {tag} {what}: {err:.2e} > {limit:.2e}"
            # K/V travel only to the ranks the window reaches, exactly the planned chunks; the
            # backward sends them again, and the dK/dV (fp32) of the chunks it received back.
            fwd, bwd = rec["forward_sent"], rec["backward_sent"]
            assert sum(n for _, n, _ in fwd) == rec["plan_elements"], tag
            assert sorted({p for p, _, _ in fwd}) == rec["plan_peers"], tag
            assert sum(n for _, n, _ in bwd) == rec["plan_elements"] + rec["plan_received"], tag
            if dtype == "torch.bfloat16":  # K/V in bf16, their dK/dV in fp32
                assert sum(n for _, n, d in bwd if d == torch.float32) == rec["plan_received"], tag
            if w <= c:  # one chunk of history: only the neighbours, at most one chunk each way
                assert all(abs(p - rank) == 1 for p, _, _ in fwd), tag
                assert sum(n for _, n, _ in fwd) <= 2 * 2 * c * hkv * DIM * 2, tag


# The Ulysses x ring operator hands the window to the ring unchanged; its ring is zigzag over the
# ring group with head shards. fp32 sums over <= g * S terms for dk/dv (GQA group g = 2), D in the
# dot products and <= 2 * cp merges, x2 for the backward (tests/ops/test_ulysses.py's bound).
ULYSSES_REL = (2 * SEQ + DIM + 8) * EPS32 * 2


def ulysses_window_worker(rank: int, world: int, ulysses: int = 2) -> dict[str, float]:
    """Windows (shorter than, straddling and longer than a ring chunk; with and without packed
    documents) through ``ulysses_ring_attention`` on ``ulysses x (world / ulysses)``: this rank's
    largest error of out, lse, dq, dk, dv against the fp64 windowed oracle, per window."""
    from ringft.ops.parallel import build_layout
    from ringft.ops.sharding import cp_shard
    from ringft.ops.ulysses import ulysses_ring_attention

    layout = build_layout(world, ulysses)

    def shard(t, dim=1):
        return cp_shard(t, layout.cp_rank, world, ulysses, dim=dim).detach().clone()

    errors = {}
    for i, (w, cu) in enumerate(((1, DOCS), (5, None), (13, DOCS), (30, None))):
        q, k, v, dout = inputs(300 + i, hq=4, hkv=2)
        ref = oracle(q, k, v, dout, w, cu)
        ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
        out, lse = ulysses_ring_attention(
            ql, kl, vl, groups=layout, backend="torch", return_lse=True, cu_seqlens=cu,
            sliding_window=w,
        )  # fmt: skip
        out.backward(shard(dout))
        got = (out, lse, ql.grad, kl.grad, vl.grad)
        want = (shard(ref[0]), shard(ref[1], dim=2), *(shard(g) for g in ref[2:]))
        errors[f"ulysses{ulysses}-w{w}{'-docs' if cu else ''}"] = max(rel(g, r) for g, r in zip(got, want))
    return errors
