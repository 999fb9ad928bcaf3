"""Gated DeltaNet (linear attention) layers on the zigzag ring: the conv halo and the state exchange.

Rank ``r`` of ``N`` holds global chunks ``r`` and ``2N-1-r`` (``c`` tokens each). A Gated DeltaNet
layer needs, per chunk, what came before it:

- the short causal convolution (kernel ``K``) reads the last ``K - 1`` inputs of the previous
  chunk (the *halo*): every rank all-gathers the tails of its two chunks (``K - 1`` tokens each);
- the recurrence ``S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T`` (per value
  head, ``S`` shaped ``(k_head_dim, v_head_dim)`` as transformers stores it: the transition acts
  on the key side, from the left) is affine in the state entering the chunk: the chunk maps
  ``S0`` to ``A S0 + b``. One run of the chunk kernel on the value columns widened by ``k_dim``
  zero columns, from the initial state ``[0 | I]``, gives everything at once: the columns evolve
  independently, so the final state is ``[b | A]`` and the extra output columns are
  ``u_t = A_{<=t}^T q_t``, with which the output for any entering state is ``o_t = o^0_t + S0^T u_t``.
  The ``[b | A]`` of every chunk (``(k_dim, v_dim + k_dim)`` per head: independent of the sequence
  length) are all-gathered, each rank composes the states entering its two chunks
  (``S_in(0) = 0``, ``S_in(j+1) = A_j S_in(j) + b_j``) and corrects its outputs. The backward of the
  all-gather all-reduces the gradients of the gathered pieces, so the gradient of each chunk's
  entering state flows back to the chunks before it, on their owners.

Packed documents reset the state and the convolution's reach at each document start: a chunk that
contains one has ``A = 0`` (its last document starts inside it), tokens after a start read no
entering state, and every document inside a chunk runs from the zero state.

``rule`` is the chunk kernel, called as transformers' ``torch_chunk_gated_delta_rule`` or
flash-linear-attention's ``chunk_gated_delta_rule``: ``rule(q, k, v, g=, beta=, initial_state=,
output_final_state=True, use_qk_l2norm_in_kernel=)`` returning ``(out, final_state)``. It runs in
the accumulator dtype (fp32, fp64 for fp64 inputs), so the output is rounded to the input dtype
once, as the one-process kernel does.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ringft.ops.dtypes import accumulator_dtype
from ringft.ops.sharding import zigzag_chunk_ids

Tensor = torch.Tensor
Offsets = Sequence[Sequence[int]]

__all__ = [
    "chunk_halos",
    "halo_problem",
    "chunk_pass",
    "conv_reach",
    "conv_tails",
    "document_starts",
    "entering_states",
    "gather_pieces",
    "halo_conv",
    "ring_causal_conv",
    "ring_gated_delta_rule",
]


class _GatherPieces(torch.autograd.Function):
    """All-gather along a new leading dim; backward: the all-reduced gradient of this rank's slot
    (every rank's copy of a piece feeds its own graph)."""

    @staticmethod
    def forward(ctx, x: Tensor, group, rank: int, size: int) -> Tensor:
        ctx.group, ctx.rank = group, rank
        x = x.contiguous()  # gloo mishandles strided buffers
        pieces = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(pieces, x, group=group)
        return torch.stack(pieces)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


def gather_pieces(x: Tensor, group, rank: int, size: int) -> Tensor:
    """``(size, *x.shape)``: every rank's ``x``, differentiable (see :class:`_GatherPieces`)."""
    if size == 1:
        return x.unsqueeze(0)
    return _GatherPieces.apply(x, group, rank, size)


def _owner(chunk: int, size: int) -> tuple[int, int]:
    """(rank, slot) holding global chunk ``chunk`` of ``2 * size``."""
    return (chunk, 0) if chunk < size else (2 * size - 1 - chunk, 1)


def document_starts(
    offsets: Offsets | None, seq_len: int, rank: int, size: int
) -> list[list[list[int]]] | None:
    """Per row, per slot (this rank's two chunks): the chunk-local positions where a document
    starts (``0`` included when one starts on the chunk's first token); None without documents."""
    if offsets is None:
        return None
    c = seq_len // (2 * size)
    out = []
    for row in offsets:
        slots = []
        for chunk in zigzag_chunk_ids(rank, size):
            lo, hi = chunk * c, (chunk + 1) * c
            slots.append([p - lo for p in row[bisect.bisect_left(row, lo) : bisect.bisect_left(row, hi)]])
        out.append(slots)
    return out


def conv_reach(
    offsets: Offsets | None, seq_len: int, rank: int, size: int, kernel: int, device=None
) -> Tensor | None:
    """``(batch, seq_local)`` int64: how many earlier tokens (at most ``kernel - 1``) of its own
    document each local token's convolution may read; None without documents."""
    if offsets is None:
        return None
    c = seq_len // (2 * size)
    positions = torch.cat([torch.arange(j * c, (j + 1) * c) for j in zigzag_chunk_ids(rank, size)])
    rows = []
    for row in offsets:
        starts = torch.tensor(list(row[:-1]), dtype=torch.long)
        begin = starts[torch.searchsorted(starts, positions, right=True) - 1]
        rows.append((positions - begin).clamp(max=kernel - 1))
    return torch.stack(rows).to(device)


def halo_problem(seq_local: int, kernel: int, size: int) -> str | None:
    """One line when a chunk (``seq_local / 2`` tokens) is shorter than the convolution's left
    context (``kernel - 1``), which would then reach past the previous chunk; else None."""
    if seq_local // 2 >= kernel - 1:
        return None
    return (
        f"linear-attention layers on the ring need zigzag chunks of at least linear_conv_kernel_dim - 1 = "
        f"{kernel - 1} tokens, got {seq_local // 2} (seq_local {seq_local} / 2, cp_size {size}): use longer "
        "sequences or a smaller cp_size"
    )


def conv_tails(x: Tensor, kernel: int) -> Tensor:
    """``(batch, 2, channels, kernel - 1)``: the last inputs of this rank's two chunks of
    ``x`` ``(batch, channels, seq_local)``."""
    c = x.shape[-1] // 2
    return torch.stack([x[..., c - kernel + 1 : c], x[..., 2 * c - kernel + 1 :]], dim=1)


def chunk_halos(tails: Tensor, rank: int) -> Tensor:
    """``(batch, 2, channels, kernel - 1)``: the inputs before this rank's two chunks (zeros before
    the sequence), from every rank's :func:`conv_tails` ``(size, batch, 2, channels, kernel - 1)``."""
    size = tails.shape[0]
    halos = []
    for chunk in zigzag_chunk_ids(rank, size):
        if chunk == 0:
            halos.append(torch.zeros_like(tails[0, :, 0]))
        else:
            owner, slot = _owner(chunk - 1, size)
            halos.append(tails[owner, :, slot])
    return torch.stack(halos, dim=1)


def halo_conv(x: Tensor, halos: Tensor, weight: Tensor, bias: Tensor | None, reach: Tensor | None) -> Tensor:
    """The depthwise causal convolution of this rank's chunks of ``x`` ``(batch, channels, seq_local)``
    with their ``halos``, before the activation, in ``weight``'s dtype (transformers' torch path):
    ``weight`` ``(channels, kernel)``; ``reach`` (:func:`conv_reach`) masks the taps that would read
    another document."""
    batch, channels, length = x.shape
    c, kernel = length // 2, weight.shape[-1]
    ext = torch.cat([halos, torch.stack(x.split(c, dim=-1), dim=1)], dim=-1).to(weight.dtype)
    ext = ext.reshape(batch * 2, channels, c + kernel - 1)
    if reach is None:
        out = torch.nn.functional.conv1d(ext, weight.unsqueeze(1), bias, groups=channels)
    else:
        lags = torch.stack(reach.split(c, dim=-1), dim=1).reshape(batch * 2, 1, c)
        taps = [(kernel - 1 - lag, lags >= lag) for lag in range(kernel)]  # (input offset, allowed)
        out = sum(weight[:, at, None] * ext[..., at : at + c] * ok for at, ok in taps)
        out = out if bias is None else out + bias[:, None]
    return torch.cat(out.reshape(batch, 2, channels, c).unbind(1), dim=-1)


def ring_causal_conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    group=None,
    rank: int = 0,
    size: int = 1,
    reach: Tensor | None = None,
) -> Tensor:
    """The causal depthwise convolution of the zigzag-sharded ``x`` ``(batch, channels, seq_local)``
    over the CP ``group`` (one all-gather of ``2 (kernel - 1)`` tokens per rank; its backward sends
    the halos' gradients back). Before the activation; ``weight`` ``(channels, kernel)``."""
    kernel = weight.shape[-1]
    if kernel == 1:  # no left context
        return halo_conv(x, x.new_zeros(x.shape[0], 2, x.shape[1], 0), weight, bias, reach)
    tails = gather_pieces(conv_tails(x, kernel), group, rank, size)
    return halo_conv(x, chunk_halos(tails, rank), weight, bias, reach)


def chunk_pass(
    rule: Callable, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, starts=None, **rule_kwargs
) -> tuple[Tensor, Tensor, Tensor]:
    """Run this rank's two chunks from the widened initial state ``[0 | I]``.

    ``q``/``k`` ``(batch, seq_local, k_heads, k_dim)``, ``v`` ``(batch, seq_local, v_heads, v_dim)``,
    ``g``/``beta`` ``(batch, seq_local, v_heads)``; ``starts``: :func:`document_starts`. Returns
    ``out0`` ``(batch, seq_local, v_heads, v_dim)`` (from the zero state), ``reads``
    ``(batch, seq_local, v_heads, k_dim)`` (``u``: zero for tokens after a document start) and
    ``affine`` ``(batch, 2, v_heads, k_dim, v_dim + k_dim)`` = ``[b | A]`` per chunk, in the
    accumulator dtype."""
    batch, length, _, k_dim = k.shape
    v_dim = v.shape[-1]
    c, acc = length // 2, accumulator_dtype(v.dtype)
    q, k, v, g, beta = (t.to(acc) for t in (q, k, v, g, beta))
    wide = torch.cat([v, v.new_zeros(*v.shape[:-1], k_dim)], dim=-1)

    def run(sl_rows: slice, lo: int, hi: int, slot: int) -> tuple[Tensor, Tensor]:
        pieces = [t[sl_rows, slot * c + lo : slot * c + hi] for t in (q, k, wide, g, beta)]
        rows = pieces[0].shape[0]
        eye = torch.eye(k_dim, dtype=acc, device=v.device).expand(rows, wide.shape[2], k_dim, k_dim)
        init = torch.cat([eye.new_zeros(*eye.shape[:-1], v_dim), eye], dim=-1)
        qq, kk, vv, gg, bb = pieces
        return rule(qq, kk, vv, g=gg, beta=bb, initial_state=init, output_final_state=True, **rule_kwargs)

    if starts is None or not any(cuts for row in starts for cuts in row):
        outs, finals = zip(*(run(slice(None), 0, c, slot) for slot in (0, 1)))
        out = torch.cat(outs, dim=1).to(acc)
        return out[..., :v_dim], out[..., v_dim:], torch.stack(finals, dim=1).to(acc)
    out_rows, final_rows = [], []
    for b, row in enumerate(starts):
        outs, finals = [], []
        for slot, cuts in enumerate(row):
            bounds = [0, *[s for s in cuts if s > 0], c]
            for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
                out, final = run(slice(b, b + 1), lo, hi, slot)
                if i > 0 or cuts[:1] == [0]:  # a document starts here: it reads no entering state
                    out = torch.cat([out[..., :v_dim], torch.zeros_like(out[..., v_dim:])], dim=-1)
                outs.append(out.to(acc))
            if cuts:  # the chunk's last document starts inside it: no entering state passes through
                final = torch.cat([final[..., :v_dim], torch.zeros_like(final[..., v_dim:])], dim=-1)
            finals.append(final.to(acc))
        out_rows.append(torch.cat(outs, dim=1))
        final_rows.append(torch.stack(finals, dim=1))
    out = torch.cat(out_rows)
    return out[..., :v_dim], out[..., v_dim:], torch.cat(final_rows)


def entering_states(affine: Tensor, rank: int) -> Tensor:
    """``(batch, 2, v_heads, k_dim, v_dim)``: the states entering this rank's two chunks, composed
    from every rank's ``[b | A]`` ``(size, batch, 2, v_heads, k_dim, v_dim + k_dim)`` in global
    chunk order from the zero state."""
    size, k_dim = affine.shape[0], affine.shape[-2]
    first, second = zigzag_chunk_ids(rank, size)
    state = torch.zeros_like(affine[0, :, 0, ..., :-k_dim])
    states = {0: state}
    for chunk in range(second):
        owner, slot = _owner(chunk, size)
        step = affine[owner, :, slot]
        state = step[..., -k_dim:] @ state + step[..., :-k_dim]
        states[chunk + 1] = state
    return torch.stack([states[first], states[second]], dim=1)


def _finish(out0: Tensor, reads: Tensor, entering: Tensor, dtype: torch.dtype) -> Tensor:
    """``o_t = o^0_t + S0^T u_t`` per chunk, cast once to ``dtype``."""
    batch, length, heads, k_dim = reads.shape
    c = length // 2
    u = reads.reshape(batch, 2, c, heads, k_dim)
    fix = torch.einsum("bsthk,bshkv->bsthv", u, entering).reshape(batch, length, heads, -1)
    return (out0 + fix).to(dtype)


def ring_gated_delta_rule(
    rule: Callable,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    group=None,
    rank: int = 0,
    size: int = 1,
    starts=None,
    **rule_kwargs,
) -> Tensor:
    """The gated delta rule over the whole zigzag-sharded sequence, on this rank's shard
    ``(batch, seq_local, heads, dim)`` (shapes as :func:`chunk_pass`), from the zero state, with
    the packed documents' ``starts`` (:func:`document_starts`). Returns the output
    ``(batch, seq_local, v_heads, v_dim)`` in ``v``'s dtype. One all-gather of
    ``2 * v_heads * k_dim * (v_dim + k_dim)`` values per row and rank (and one all-reduce of that
    times ``size`` in the backward)."""
    out0, reads, affine = chunk_pass(rule, q, k, v, g, beta, starts, **rule_kwargs)
    entering = entering_states(gather_pieces(affine, group, rank, size), rank)
    return _finish(out0, reads, entering, v.dtype)


def emulate_gated_delta_rule(
    rule: Callable, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, size: int, offsets=None, **kw
) -> Tensor:
    """:func:`ring_gated_delta_rule` of ``size`` ranks in one process, on global tensors
    ``(batch, seq, ...)``, with global document ``offsets``; returns the global output."""
    from ringft.ops.sharding import cp_shard, cp_unshard

    shards = [[cp_shard(t, r, size) for t in (q, k, v, g, beta)] for r in range(size)]
    passes = [
        chunk_pass(rule, *shards[r], document_starts(offsets, q.shape[1], r, size), **kw) for r in range(size)
    ]
    affine = torch.stack([p[2] for p in passes])
    outs = [_finish(p[0], p[1], entering_states(affine, r), v.dtype) for r, p in enumerate(passes)]
    return cp_unshard(outs)
