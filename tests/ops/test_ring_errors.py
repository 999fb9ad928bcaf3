"""Bad inputs raise a clear ValueError on every rank, before any ring traffic, without hanging (on one
rank and on three, in one spawn of 3 processes: the CP group of size N is ranks 0..N-1)."""

from __future__ import annotations

import pytest
import torch

from ringft import zigzag_ring_attention
from ringft.utils.spawn import run_distributed


def _qkv(seq=8, hq=4, hkv=2, dim=16, dtype=torch.float32):
    return (
        torch.randn(1, seq, hq, dim, dtype=dtype),
        torch.randn(1, seq, hkv, dim, dtype=dtype),
        torch.randn(1, seq, hkv, dim, dtype=dtype),
    )


# (name, builder(rank) -> (q, k, v, backend), expected message fragment)
CASES = {
    "odd_seq": (lambda r: (*_qkv(seq=7), "torch"), "must be even"),
    "seq_differs": (lambda r: (*_qkv(seq=8 if r == 0 else 12), "torch"), "same batch, seq_local"),
    "heads": (lambda r: (*_qkv(hq=3 if r == 0 else 4), "torch"), "multiple of key/value heads"),
    "dtype": (
        lambda r: (torch.randn(1, 8, 4, 16), *_qkv(dtype=torch.bfloat16)[1:], "torch"),
        "share one dtype",
    ),
    "shape": (
        # (v's head_dim may differ from k's: latent attention; its heads may not)
        lambda r: (torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 1, 16), "torch"),
        "same shape",
    ),
    "backend": (lambda r: (*_qkv(), "triton"), "unknown backend"),
    "flash_on_cpu": (lambda r: (*_qkv(), "flash_attn"), "flash_attn"),
}


WORLDS = (1, 3)  # one spawn of 3 processes: the CP group of size N is ranks 0..N-1


def worker(rank: int, world: int) -> dict[int, dict[str, str]]:
    """:func:`errors_worker` on every CP group this rank is in, keyed by its size."""
    import torch.distributed as dist

    groups = {n: dist.new_group(list(range(n))) for n in WORLDS}  # every rank creates every group
    return {n: errors_worker(rank, n, groups[n]) for n in WORLDS if rank < n}


def errors_worker(rank: int, world: int, group) -> dict[str, str]:
    """Each bad input's message on this rank of ``group`` (``world`` ranks)."""
    seen = {}
    for name, (build, _) in CASES.items():
        q, k, v, backend = build(rank)
        try:
            zigzag_ring_attention(q, k, v, backend=backend, group=group)
            seen[name] = "no error"
        except ValueError as exc:
            seen[name] = str(exc)
    # Packed documents: offsets that differ between ranks, malformed offsets, non-causal.
    seq = 8 * world
    for name, kwargs in {
        "docs_differ": {"cu_seqlens": [[0, 3 + rank, seq]]},
        "docs_malformed": {"cu_seqlens": [[0, 5, 5, seq]]},
        "docs_noncausal": {"cu_seqlens": [[0, 3, seq]], "causal": False},
        "window_zero": {"sliding_window": 0},
        "window_float": {"sliding_window": 2.5},
        "window_bool": {"sliding_window": True},
        "window_noncausal": {"sliding_window": 4, "causal": False},
        "window_differs": {"sliding_window": 3 + rank},
    }.items():
        try:
            zigzag_ring_attention(*_qkv(), backend="torch", group=group, **kwargs)
            seen[name] = "no error"
        except ValueError as exc:
            seen[name] = str(exc)
    # The group is still usable afterwards: a good call runs.
    zigzag_ring_attention(*_qkv(), group=group)
    zigzag_ring_attention(*_qkv(), cu_seqlens=[[0, 3, seq]], group=group)
    zigzag_ring_attention(*_qkv(), cu_seqlens=[[0, 3, seq]], sliding_window=3, group=group)
    return seen


@pytest.fixture(scope="module")
def results() -> list[dict[int, dict[str, str]]]:
    """One spawn of 3 gloo processes for the module: every rank's messages."""
    return run_distributed(worker, max(WORLDS), timeout=90)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", WORLDS)
def test_errors_raised_on_every_rank(results, world):
    for rank, seen in enumerate(results[r][world] for r in range(world)):
        for name, (_, fragment) in CASES.items():
            if world == 1 and name == "seq_differs":
                continue  # one rank cannot disagree with itself
            msg = seen[name]
            assert msg != "no error", f"{name}: rank {rank} of {world} raised nothing"
            if name in ("heads",) and rank != 0:
                assert "rank(s) [0]" in msg, msg
            else:
                assert fragment in msg, f"{name} on rank {rank} of {world}: {msg}"
        if world > 1:
            assert "cu_seqlens checksum" in seen["docs_differ"], seen["docs_differ"]
        assert "must rise strictly from 0" in seen["docs_malformed"]
        assert "needs causal=True" in seen["docs_noncausal"]
        assert "sliding_window must be >= 1" in seen["window_zero"], seen["window_zero"]
        for name in ("window_float", "window_bool"):
            assert "sliding_window must be an int >= 1" in seen[name], seen[name]
        assert "sliding_window needs causal=True" in seen["window_noncausal"]
        if world > 1:
            assert "sliding_window)" in seen["window_differs"], seen["window_differs"]
