"""Latent attention (v head dim != q/k head dim) through the operator, against the fp64 oracle.

fp64. One rank with a window; CP 1-4 on the plain ring, with packed documents and with a sliding
window (with and without documents), where K and V travel at their own sizes: on the ring every
message is k-size + v-size elements, in the window's exchange the chunks its schedule sends, each
a chunk's k + v elements (sends counted by a patched ``batch_isend_irecv``). The model-level
comparison at CP 1-4 is DeepSeek-V3 / Mistral 4 in tests/model/test_families.py. Bound: 64 eps64
relative, as tests/ops/test_sinks.py (the same sums in another order).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringft.ops import zigzag_ring_attention
from ringft.ops.sharding import cp_shard
from ringft.ops.windows import window_schedule
from ringft.utils.spawn import run_distributed
from tests.oracle import full_attention_fp64, per_document_attention_fp64, windowed_attention_fp64

BOUND = 64 * torch.finfo(torch.float64).eps


def test_v_narrower_or_wider_than_q_and_k_is_exact():
    gen = torch.Generator().manual_seed(0)
    for dqk, dv in ((24, 12), (8, 20)):
        q = torch.randn(2, 16, 4, dqk, generator=gen, dtype=torch.float64, requires_grad=True)
        k = torch.randn(2, 16, 2, dqk, generator=gen, dtype=torch.float64, requires_grad=True)
        v = torch.randn(2, 16, 2, dv, generator=gen, dtype=torch.float64, requires_grad=True)
        dout = torch.randn(2, 16, 4, dv, generator=gen, dtype=torch.float64)
        out = zigzag_ring_attention(q, k, v, backend="torch", sliding_window=5)
        assert out.shape == (2, 16, 4, dv)
        got = [out, *torch.autograd.grad(out, (q, k, v), dout)]
        ref = windowed_attention_fp64(q, k, v, 5)[0]
        want = [ref, *torch.autograd.grad(ref, (q, k, v), dout)]
        for a, b in zip(got, want):
            assert (a - b).abs().max() <= BOUND * b.abs().max(), (dqk, dv)
        full = zigzag_ring_attention(q, k, v, backend="reference")
        assert (full - full_attention_fp64(q, k, v, True)[0]).abs().max() <= BOUND * full.abs().max()


SHAPES = ((24, 12), (8, 20))  # (dqk, dv): v narrower (DeepSeek-V3's 192 / 128) and wider
DOCS = [[0, 5, 19, 24]]  # packed documents across chunk edges
WINDOW = 5  # over a chunk edge at every CP size (chunks of 12, 6, 4 and 3 tokens)
CONFIGS = [(shape, docs, None) for shape in SHAPES for docs in (None, DOCS)] + [
    (SHAPES[0], None, WINDOW),
    (SHAPES[1], DOCS, WINDOW),
]  # (shape, documents, window): the ring with and without documents; the window once each way


def _inputs(dqk: int, dv: int):
    gen = torch.Generator().manual_seed(dqk)
    shapes = ((1, 24, 4, dqk), (1, 24, 2, dqk), (1, 24, 2, dv), (1, 24, 4, dv))
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def _oracle(dqk: int, dv: int, packed: bool, window: int | None) -> list[torch.Tensor]:
    q, k, v, dout = (x.requires_grad_() for x in _inputs(dqk, dv))
    if window is not None:
        ref = windowed_attention_fp64(q, k, v, window, DOCS if packed else None)[0]
    elif packed:
        ref = per_document_attention_fp64(q, k, v, DOCS)[0]
    else:
        ref = full_attention_fp64(q, k, v, True)[0]
    return [ref.detach(), *torch.autograd.grad(ref, (q, k, v), dout)]


def latent_worker(rank: int, world: int) -> list[tuple]:
    """Per CP size, shape, layout and window: this rank's (out, dq, dk, dv) errors relative to the
    oracle's largest entry, the element counts of every message it sent in the forward and in the
    backward, and the counts the layout promises."""
    real, sent = dist.batch_isend_irecv, []

    def counting(ops):
        sent.extend(op.tensor.numel() for op in ops if op.op is dist.isend)
        return real(ops)

    dist.batch_isend_irecv = counting
    results = []
    for size in (1, 2, 3, 4):
        group = dist.new_group(list(range(size)))
        if rank >= size:
            continue
        for (dqk, dv), docs, window in CONFIGS:
            q, k, v, dout = (cp_shard(x, rank, size).requires_grad_() for x in _inputs(dqk, dv))
            sent.clear()
            out = zigzag_ring_attention(
                q, k, v, group=group, backend="torch", cu_seqlens=docs, sliding_window=window
            )
            forward = list(sent)
            got = [out.detach(), *torch.autograd.grad(out, (q, k, v), dout.detach())]
            full = _oracle(dqk, dv, docs is not None, window)
            want = [cp_shard(w, rank, size) for w in full]
            errors = [((a - b).abs().max() / f.abs().max()).item() for a, b, f in zip(got, want, full)]
            backward = sent[len(forward) :]
            if window is None:  # K/V: size - 1 hops forward and backward; dK/dV: size hops
                kv = k.numel() + v.numel()
                promised = [kv] * (size - 1 if size > 1 else 0), [kv] * (2 * size - 1 if size > 1 else 0)
            else:  # the chunks the schedule sends; backward: those again, and the received ones' dK/dV
                chunk = (k.numel() + v.numel()) // 2  # one chunk's k and v elements
                assert all(n % chunk == 0 for n in sent)  # whole chunks at their own sizes
                schedule = window_schedule(24, size, window)
                chunks, received = schedule.chunks_sent(rank), sum(map(len, schedule.needs[rank]))
                promised = chunks * chunk, (chunks + received) * chunk
                forward, backward = sum(forward), sum(backward)
            results.append((size, dqk, docs is not None, window, errors, (forward, backward), promised))
    dist.batch_isend_irecv = real
    return results


@pytest.mark.timeout(300)
def test_k_and_v_travel_at_their_own_sizes_on_cp_1_to_4():
    for rank_results in run_distributed(latent_worker, 4, timeout=240):
        for size, dqk, packed, window, errors, sent, promised in rank_results:
            assert max(errors) <= BOUND, (size, dqk, packed, window, errors)
            assert sent == promised, (size, dqk, packed, window, sent, promised)
