"""The attention kernel's terms of the plan: K/V heads on the ring and the block attention
backward's memory (see :mod:`ringft.planner`; re-exported by :mod:`ringft.planner.formulas`).

``T = micro_batch_size * S / cp`` local tokens, ``a`` the activation dtype's byte size, ``nh`` /
``nkv`` query / K/V heads of ``d``, as in :mod:`ringft.planner.formulas`.
"""

from __future__ import annotations

from ringft.ops.ulysses import kv_replication
from ringft.planner.setup import TrainingSetup
from ringft.planner.shapes import ModelShape

__all__ = ["attention_kernel", "attention_kernel_parts", "kv_heads_sent"]


def kv_heads_sent(m: ModelShape, s: TrainingSetup) -> int:
    """K/V heads the attention works on: ``nkv``, times the copies Ulysses sends when
    ``ulysses_size`` does not divide them (:func:`ringft.ops.ulysses.kv_replication`)."""
    return m.kv_heads * (kv_replication(m.kv_heads, s.ulysses_size) if s.ulysses_size > 1 else 1)


def attention_kernel_parts(m: ModelShape, s: TrainingSetup) -> dict[str, int]:
    """The block attention backward's memory, ``T`` tokens, in four parts (bytes):

    - ``results``: dq, dk, dv of the local block and the output grad, ``a*T*(2*nh + 2*nkv)*d``;
      tiled, dk/dv come back in fp32 (:mod:`ringft.ops.tiles`): ``T*(2*a*nh + 2*4*nkv)*d``;
    - ``workspace``: the kernel's own transients, per token of one call: an fp32 dq workspace
      ``4*nh*d``; dK/dV computed at ``nh`` heads first when ``nkv < nh`` (flash-attention 2 expands
      them, ``2*a*nh*d``); with ``attn_backend="torch"`` on CUDA (no native GQA) K/V expanded to
      ``nh`` heads as well, ``2*a*nh*d``. Untiled ``T`` tokens, tiled ``N`` (one tile). GPU only:
      torch's CPU kernel keeps ~nothing beyond its results;
    - ``tile_buffers`` (tiled): the wrapper's fp32 dq of one query tile ``4*N*nh*d`` and two sets of
      one tile call's results ``2*a*N*(nh + 2*nkv)*d`` (the previous call's are still referenced while
      the next runs);
    - ``casts`` (tiled, ``a < 4``): the ring's cast of the fp32 dk/dv to the input dtype after the
      tiles, ``2*a*T*nkv*d``, alive with the results but not with the tile buffers.

    Latent attention (q/k head dim ``d`` != V's ``dv``): every term at ``max(d, dv)``, the results
    with the padded copies of the backward call's inputs (V, output and its grad, or q and k: derived,
    not measured). None for a Gated DeltaNet layer.

    Tiled = ``attention_tile_tokens = N < T`` (a tile >= ``T`` runs the kernel unchanged). Measured
    on an H200 (cuDNN, bf16, 32 / 8 heads of 128; benchmarks/RESULTS.md "Attention in query tiles"):
    within 1 % at 64K-256K tokens, tiles of 4096 and 16384 and untiled
    (``tests/planner/test_planner_gpu_measured.py``).
    """
    a, t = s.act_bytes, s.tokens
    if m.mixer == "linear":
        return {"results": 0, "workspace": 0, "tile_buffers": 0, "casts": 0}
    d = max(m.head_dim, m.v_dim)  # latent attention: each call padded to one head dim
    q, kv = m.heads * d, kv_heads_sent(m, s) * d  # (U > 1: per head shard, same total)
    pads = 0
    if m.v_dim < m.head_dim:  # the padded V, output and output grad of the backward call
        pads = a * t * (kv + 2 * q)
    elif m.head_dim < m.v_dim:  # the padded q and k
        pads = a * t * (q + kv)
    gqa = kv < q
    workspace = (2 * a * q if gqa else 0) + 4 * q + (2 * a * q if gqa and s.attn_backend == "torch" else 0)
    n = s.attention_tile_tokens
    if n is None or n >= t:
        untiled = t * (2 * a * q + 2 * a * kv) + pads
        return {"results": untiled, "workspace": t * workspace, "tile_buffers": 0, "casts": 0}
    return {
        "results": t * (2 * a * q + 2 * 4 * kv) + pads,
        "workspace": n * workspace,
        "tile_buffers": n * (4 * q + 2 * a * (q + 2 * kv)),
        "casts": 2 * a * t * kv if a != 4 else 0,
    }


def attention_kernel(m: ModelShape, s: TrainingSetup) -> int:
    """Peak of the block attention backward, ``T`` tokens: ``results + max(workspace +
    tile_buffers, casts)`` (:func:`attention_kernel_parts`). Untiled in bf16 with GQA:
    ``T*(2*a*nh + 2*a*nkv)*d + T*(2*a + 4)*nh*d``; with tiles of ``N`` tokens the last term
    becomes ``N*(4*a + 8)*nh*d + 4*a*N*nkv*d`` (or the cast, when larger)."""
    p = attention_kernel_parts(m, s)
    return p["results"] + max(p["workspace"] + p["tile_buffers"], p["casts"])
