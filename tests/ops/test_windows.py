"""Sliding-window zigzag ring attention (operator level) vs plain fp64 windowed attention.

Oracle: ``tests.oracle.windowed_attention_fp64`` (one explicit mask over the global sequence,
optionally with packed documents), not written with ringft code. Convention: transformers'
``sliding_window`` (query i sees keys i - window < j <= i); ``tests/model/test_windows_hf.py``
checks it against transformers' own mask function.

Tolerances (max-abs error relative to the oracle tensor's max-abs):
- fp64 (emulated schedules): 1e-10. Sums over <= 48 keys, head_dim 16 and <= 2N merges err by
  ~1e-14; any masking / window / merge mistake is O(1e-1). The flash-attn stand-ins return an fp32
  lse as flash-attn does (2^-24 relative on |lse| <= 10, entering out and the gradients): 1e-6.
- fp32: FP32_REL = (S + D + 2N) * eps32 * 2 (recursive fp32 sums over the keys, the head dim and
  the merges; x2 for the backward's recomputed probabilities), as in test_documents.py.
- bf16: the ring's error may be at most 2x the error of the same windowed attention on one process
  (one rank: no split over ranks) plus 4e-3 (one bf16 rounding of out, 2^-8), the bound of
  test_zigzag_ring.py: splitting over ranks may not make bf16 numerics materially worse.
"""

from __future__ import annotations

import random

import pytest
import torch

from ringft.ops.band import Band, band_pairs, square_pieces, strip_runs, trim_band
from ringft.ops.emulate import run_schedule
from ringft.ops.flash_window import flash_window_calls
from ringft.ops.sharding import cp_shard, cp_unshard
from ringft.ops.windows import chunks_meet, window_schedule
from tests.ops.flash_stubs import flash_visible, make_stub
from tests.ops.window_checks import DIM, DOCS, FP32_REL, inputs, oracle, rel, windows
from tests.oracle import windowed_attention_fp64


def _visible(i: int, j: int, window: int) -> bool:
    return 0 <= i - j < window


def test_plan_matches_brute_force():
    """Every chunk a rank needs (some query of its chunks sees some key of it) and nothing else;
    the exchange lasts as many steps as the farthest rank needed, never longer than the ring."""
    for n in (1, 2, 3, 4, 5):
        for c in (1, 3, 4):
            seq = 2 * n * c
            pos = [cp_shard(torch.arange(seq), r, n, dim=0).tolist() for r in range(n)]
            for w in range(1, seq + 1):
                plan = window_schedule(seq, n, w)
                far = 0
                for r in range(n):
                    for j in range(n):
                        want = tuple(
                            slot
                            for slot in (0, 1)
                            if j != r
                            and any(
                                _visible(i, key, w) for i in pos[r] for key in pos[j][slot * c : slot * c + c]
                            )
                        )
                        assert plan.needs[r][j] == want, (n, c, w, r, j)
                        far = max(far, abs(r - j) if want else 0)
                assert plan.steps == far <= max(n - 1, 0)
                for r in range(n):
                    assert plan.chunks_sent(r) <= 2 * (n - 1)  # the ring: N - 1 blocks of 2 chunks
                    assert sum(
                        len(s) for step in range(1, plan.steps + 1) for _, s in plan.receives(r, step)
                    ) == sum(len(plan.needs[r][j]) for j in range(n))


def _random_bands(seed: int, count: int):
    rng = random.Random(seed)
    for _ in range(count):
        w = rng.choice([1, 2, 3, 4, 5, 7, 9, 16, 40])
        r0, k0 = rng.randint(0, 6), rng.randint(0, 6)
        band = trim_band(
            Band(r0, r0 + rng.randint(1, 20), k0, k0 + rng.randint(1, 20), rng.randint(-5, 25), w)
        )
        if band is not None:
            yield band


def _want(band: Band) -> set[tuple[int, int]]:
    return {
        (i, j)
        for i in range(band.r0, band.r1)
        for j in range(band.k0, band.k1)
        if _visible(i + band.delta, j, band.window)
    }


def test_band_covers_are_exact():
    """CPU calls (strips, triangles halved into rectangles), squares (no mask) and flash-attn window
    calls cover every visible pair of a band exactly once, never an invisible one, and never give a
    kernel a row without a key; the primary CPU pieces hold each row once."""
    for band in _random_bands(0, 400):
        want = _want(band)
        assert len(want) == band_pairs(band)
        rows_seen = {i for i, _ in want}
        assert rows_seen == set(range(band.r0, band.r1))  # trimmed: every row sees a key
        for tile in (1, 2, 3, 5, 64):
            got, primary = [], []
            for s in strip_runs(band, tile):
                for t in range(s.count):
                    for i in range(s.rows):
                        row = s.r0 + t * s.step + i
                        keys = [s.k0 + t * s.step + j for j in range(s.keys)]
                        vis = [key for j, key in enumerate(keys) if 0 <= i + s.offset - j < s.window]
                        assert vis, (band, tile, s)  # no fully masked row reaches a kernel
                        assert s.masked or len(vis) == len(keys)
                        got += [(row, key) for key in vis]
                        primary += [row] if s.primary else []
            assert sorted(got) == sorted(want), (band, tile)
            assert sorted(primary) == list(range(band.r0, band.r1)), (band, tile)  # each row once
            got = []
            for q0, q1, x0, x1, kind in square_pieces(band, tile):
                if kind != "full":
                    assert q1 - q0 == x1 - x0, (band, tile)
                for i in range(q1 - q0):
                    keep = {"full": range(x1 - x0), "causal": range(i + 1), "anti": range(i, x1 - x0)}[kind]
                    assert keep, (band, tile)
                    got += [(q0 + i, x0 + j) for j in keep]
            assert sorted(got) == sorted(want), (band, tile)
        # flash-attn: read each call's mask the way flash-attn rewrites its arguments
        got = []
        offset = band.r0 + band.delta - band.k0
        for a, b, x, y, causal, win in flash_window_calls(
            band.r1 - band.r0, band.k1 - band.k0, offset, band.window
        ):
            visible = flash_visible(b - a, y - x, causal, win)
            visible = torch.ones(b - a, y - x, dtype=torch.bool) if visible is None else visible
            assert bool(visible.any(1).all()), (band, win)
            got += [(band.r0 + a + i, band.k0 + x + j) for i, j in visible.nonzero().tolist()]
        assert sorted(got) == sorted(want), band


def _emulate(kernel, q, k, v, dout, n, window, cu):
    shard = lambda t: [cp_shard(t, r, n).contiguous() for r in range(n)]  # noqa: E731
    outs, lses, dqs, dkvs = run_schedule(
        kernel, shard(q), shard(k), shard(v), shard(dout), causal=True, softmax_scale=DIM**-0.5,
        sliding_window=window, cu_seqlens=cu,
    )  # fmt: skip
    return (
        cp_unshard([outs[r] for r in range(n)]),
        cp_unshard([lses[r] for r in range(n)], dim=2),
        cp_unshard([dqs[r] for r in range(n)]),
        cp_unshard([g[0] for g in dkvs]),
        cp_unshard([g[1] for g in dkvs]),
    )


class _NoStrips:
    """The torch backend without its strip capability: bands as unmasked + causal calls (what the
    CUDA torch kernels get), run on CPU."""

    name = "torch-squares"

    def __init__(self):
        from ringft.ops.backends import get_backend

        self._inner = get_backend("torch", torch.device("cpu"))

    def check(self, q):
        return None

    def forward(self, *args):
        return self._inner.forward(*args)

    def backward(self, *args):
        return self._inner.backward(*args)


@pytest.mark.numerics
def test_emulated_paths_match_oracle(monkeypatch):
    """fp64 through every way a band is computed: strips with tiles smaller than a chunk (torch on
    CPU), squares (torch without masks, as on CUDA), the reference's mask, and flash-attn's
    window_size through the stand-ins of the 2.4-2.6 (tuple) and 2.7-2.8 (custom op) generations."""
    import ringft.ops.band as band_module
    import ringft.ops.torch_backend as torch_backend
    from ringft.ops.backends import FlashAttnBackend, get_backend

    monkeypatch.setattr(torch_backend, "CPU_BAND_TILE", 3)
    band_module.strip_runs.cache_clear()
    cpu = torch.device("cpu")
    kernels = {
        "strips": get_backend("torch", cpu),
        "squares": _NoStrips(),
        "reference": get_backend("reference", cpu),
        "flash-2.4.0": FlashAttnBackend(module=make_stub("2.4.0", []), version="2.4.0"),
        "flash-2.8.3": FlashAttnBackend(module=make_stub("2.8.3", []), version="2.8.3"),
    }
    for name, kernel in kernels.items():
        flash = name.startswith("flash")
        for n in (1, 2, 3, 4) if not flash else (2, 3):
            for i, w in enumerate(windows(n) if not flash else (1, 5, 13)):
                cu = DOCS if i % 2 else None
                q, k, v, dout = inputs(10 * n + i, hq=4, hkv=1 if i % 3 == 0 else 2, dtype=torch.float64)
                ref = oracle(q, k, v, dout, w, cu)
                got = _emulate(kernel, q, k, v, dout, n, w, cu)
                limit = 1e-6 if flash else 1e-10  # flash-attn's lse is fp32 (2^-24 x |lse| <= 10)
                for what, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
                    assert rel(g, r) < limit, (
                        f"{name} N={n} w={w} docs={cu is not None} {what}: {rel(g, r):.1e}"
                    )
    band_module.strip_runs.cache_clear()


def test_outside_blocks_are_never_computed():
    """Pairs the kernels compute: every call holds visible pairs only up to the strips' edge waste,
    and a chunk pair outside the window never reaches a kernel. S = 1024 over N = 4 (chunks of 128),
    window 64, strips of 16 rows: each row computes at most 15 keys it does not see (half a strip
    at each edge of the band), and the whole is under 1/6 of causal attention."""
    from ringft.ops.backends import get_backend

    seq, n, w, tile = 1024, 4, 64, 16
    inner = get_backend("torch", torch.device("cpu"))
    computed = [0]

    class Counting:
        name = "counting"
        band_tile = staticmethod(lambda q, window: tile)
        causal_tile = staticmethod(inner.causal_tile)

        def check(self, q):
            return None

        def forward(self, q, k, v, causal, scale):
            computed[0] += q.shape[0] * q.shape[1] * k.shape[1]
            return inner.forward(q, k, v, causal, scale)

        def forward_masked(self, q, k, v, mask, scale):
            computed[0] += q.shape[0] * q.shape[1] * k.shape[1]
            return inner.forward_masked(q, k, v, mask, scale)

        backward = inner.backward
        backward_masked = inner.backward_masked

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq, 2, 8, generator=gen)
    k, v = torch.randn(1, seq, 1, 8, generator=gen), torch.randn(1, seq, 1, 8, generator=gen)
    shard = lambda t: [cp_shard(t, r, n).contiguous() for r in range(n)]  # noqa: E731
    run_schedule(
        Counting(), shard(q), shard(k), shard(v), None, causal=True, softmax_scale=0.3, sliding_window=w
    )
    plan = window_schedule(seq, n, w)
    visible = sum(plan.attention_pairs(r) for r in range(n))
    assert visible == sum(min(i + 1, w) for i in range(seq))
    assert visible <= computed[0] <= visible + (tile - 1) * seq
    assert computed[0] < seq * (seq + 1) / 2 / 6
    # No chunk pair beyond the window is ever planned.
    c = seq // (2 * n)
    assert not chunks_meet(5, 3, c, w) and chunks_meet(5, 4, c, w) and plan.steps == 1


@pytest.mark.numerics
def test_decode_honours_each_layers_window():
    """ShardedKVCache: decode steps of a layer with a window and one without (per-layer windows, as
    Gemma 3 interleaves them) against fp64 windowed attention over prompt + generated tokens."""
    from ringft.ops.decode import ShardedKVCache

    gen = torch.Generator().manual_seed(0)
    prompt, steps, window = 11, 5, 4
    k = torch.randn(2, 1, prompt + steps, 2, DIM, generator=gen)  # (layer, batch, seq, heads, dim)
    v = torch.randn(2, 1, prompt + steps, 2, DIM, generator=gen)
    q = torch.randn(2, 1, prompt + steps, 4, DIM, generator=gen)
    cache = ShardedKVCache(list(range(prompt)), prompt, owner=True)
    for layer in (0, 1):
        cache.store_prefill(layer, k[layer, :, :prompt], v[layer, :, :prompt])
    for t in range(prompt, prompt + steps):
        for layer, w in ((0, window), (1, None)):
            got = cache.decode_attention(
                layer, q[layer, :, t : t + 1], k[layer, :, t : t + 1], v[layer, :, t : t + 1],
                softmax_scale=None, group=None, backend="torch", sliding_window=w,
            )  # fmt: skip
            want, _ = windowed_attention_fp64(
                q[layer, :, : t + 1], k[layer, :, : t + 1], v[layer, :, : t + 1], w or t + 1
            )
            assert rel(got, want[:, t : t + 1]) < FP32_REL, (layer, t)
        cache.advance()
