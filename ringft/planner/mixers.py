"""The token mixer's terms of one layer view (see :mod:`ringft.planner.formulas`): attention (GQA,
latent attention's own K/V head dims, Gemma 4's layers reusing K/V, Qwen3.5's output gate) and
Gated DeltaNet layers.

``T`` local tokens, ``a`` the activation byte size, per-token shapes as in :mod:`ringft.planner.shapes`:
``nh`` query heads, ``nkv`` K/V heads, ``d`` q/k head dim, ``dv`` V's head dim (``d`` but for latent
attention).
"""

from __future__ import annotations

from ringft.planner.kernel import kv_heads_sent
from ringft.planner.setup import TrainingSetup
from ringft.planner.shapes import ModelShape

__all__ = [
    "FP32_WEIGHT_NORMS",
    "GDN_CHUNK",
    "GDN_SAVED",
    "linear_exchange_bytes",
    "linear_exchange_seconds",
    "linear_flops",
    "linear_saved",
    "linear_working",
    "mixer_saved",
    "ring_buffers",
    "shared_kv_bytes",
]

#: Families whose RMSNorm multiplies by its weight in fp32 (``x.float() * rsqrt(...) * w.float()``):
#: the value kept for the weight's gradient is fp32.
FP32_WEIGHT_NORMS = ("gemma3_text", "gemma4_text", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
#: The chunk of transformers' torch ``torch_chunk_gated_delta_rule`` (its ``chunk_size``).
GDN_CHUNK = 64
#: A Gated DeltaNet layer's saved tensors per token, in fp32 values, as coefficients of ``nv*dk``,
#: ``nv*dv``, ``nv*C``, ``nv*dk*(dk + dv)/C`` and ``nk*dk`` (``C`` = :data:`GDN_CHUNK`): fitted to
#: the tensors autograd saves in one layer forward as ringft runs it (transformers' torch kernels
#: under :func:`ringft.ops.linear_scan.chunk_pass`, whose state columns are widened by ``dk``), fp32,
#: full fine-tuning, 256-1,024 tokens, head dims 64 / 128: within 1.2 % of every point
#: (``benchmarks/fit_gdn_saved.py``; ``tests/planner/test_planner_new_families.py`` re-measures
#: two). bf16 and frozen projections keep 5-10 % less (counted as fp32: conservative);
#: flash-linear-attention's kernel keeps less (not measured).
GDN_SAVED = (11.63, 10.40, 7.77, 2.03, 5.34)


def _qk_norm(m: ModelShape, s: TrainingSetup) -> int:
    """Per token, what q/k RMSNorms keep (Qwen3, Gemma 3/4, OLMo 2): the fp32 input ``4*(q + kv)``
    (in fp32 the projection's output itself, kept by nothing else), one ``rsqrt`` per normalised
    row (4 B per head, or per token over all heads) and the normalised value ``a*(q + kv)`` if the
    norm weights train (``4*(q + kv)`` for :data:`FP32_WEIGHT_NORMS`). A layer reusing K/V
    normalises q only. Gemma 4: 8 B per row (``pow(mean, -0.5)`` keeps its input and output) and a
    weightless V norm, ``4*kv + 8*nkv`` more (``8*nkv`` in fp32 with ``V = K``: its input is K's).
    Measured on CPU (``tests/planner/test_planner_new_families.py``)."""
    if not m.qk_norm:
        return 0
    kv_heads = 0 if m.kv_shared else m.kv_heads
    width = (m.heads + kv_heads) * m.head_dim
    rows = m.heads + kv_heads if m.qk_norm == "head" else 2
    per_row = 8 if m.model_type == "gemma4_text" else 4  # Gemma 4: pow(mean, -0.5) keeps both
    if s.fused_rmsnorm:  # the fused norm keeps its input and one rstd per row
        own = s.act_bytes * width + 4 * rows
    else:  # Gemma's and Qwen3.5's norms multiply by their weight in fp32: the fp32 normalised value
        normalised = 4 if m.model_type in FP32_WEIGHT_NORMS else s.act_bytes
        own = 4 * width + per_row * rows + (normalised * width if not s.lora else 0)
    if m.v_norm and not m.kv_shared:  # in fp32 V = K's norm reads the K projection's output itself
        own += (0 if m.v_from_k and s.act_bytes == 4 else 4 * kv_heads * m.head_dim) + per_row * kv_heads
    return own


def _latent_norms(m: ModelShape, s: TrainingSetup, inputs) -> tuple[int, int]:
    """Per token, latent attention's down-projection norms: each keeps the fp32 copy of its input
    ``4*r`` (in fp32 the down-projection's output, kept by nothing else; kv's then with its RoPE
    part, ``4*(r + rope)``), ``rsqrt`` (4 B), the
    normalised value ``a*r`` if its weight trains and its output ``a*r`` if the up-projection keeps
    it (``r`` = ``q_lora_rank``, ``kv_lora_rank``); and the up-projections' LoRA bytes."""
    a, total, lora = s.act_bytes, 0, 0
    for r, module in ((m.q_lora_rank, "q_b_proj"), (m.kv_lora_rank, "kv_b_proj")):
        if r:
            kept, extra = inputs(s, (module,), r, s.lora_rank)
            # in fp32 no copy: the norm's input is a view of kv_a's output, RoPE part included
            read = r + (m.rope_head_dim if module == "kv_b_proj" and a == 4 else 0)
            total += 4 * read + 4 + (a * r if not s.lora else 0) + (a * r if kept else 0)
            lora += extra
    return total, lora


def mixer_saved(m: ModelShape, s: TrainingSetup, inputs) -> tuple[int, int]:
    """Per token, ``(bytes the token mixer keeps, its o_proj / up-projections' LoRA bytes)`` of an
    attention layer view (``inputs`` is :func:`ringft.planner.formulas._linear_inputs`):

    - q, k, v and the output as the ring keeps them ``a*(nh*d + nkv*d + nkv*dv + nh*dv)``, fp32 lse
      ``4*nh`` (a layer reusing K/V keeps q, output, lse: its K/V are the earlier layer's,
      :func:`shared_kv_bytes`); Ulysses x ring: the head shards, o_proj's all-to-all'd copy of the
      output and ``nkv'`` replicated K/V heads ``a*(nh*d + 2*nh*dv + nkv'*(d + dv))``;
    - q/k norms (:func:`_qk_norm`), latent attention's down-projection norms (:func:`_latent_norms`);
    - latent attention (measured on CPU, ``tests/planner/test_planner_new_families.py``): V stays a
      view of ``kv_b_proj``'s output (``nh*(d - rope + dv)`` in all), o_proj copies the output
      (``nh*dv`` if it keeps its input); in fp32 the output stays a view of the padded block output
      (``nh*max(d, dv)``);
    - Qwen3.5's output gate: ``sigmoid(gate)`` and a contiguous copy of the output ``2*a*nh*dv``,
      the gated output o_proj reads ``a*nh*dv`` if o_proj keeps it (else o_proj reads the attention
      output, kept anyway); in fp32 the gate half of q_proj's output ``a*nh*d`` (the q norm keeps a
      view of it). Measured on CPU."""
    if m.mixer == "linear":
        return linear_saved(m, s, inputs)
    a, d, dv = s.act_bytes, m.head_dim, m.v_dim
    kv = 0 if m.kv_shared else m.kv_heads
    attention = a * (m.heads * d + kv * (d + dv) + m.heads * dv) + 4 * m.heads
    kept, extra = inputs(s, m.projections("o"), m.heads * dv, s.lora_rank)
    if m.kv_lora_rank:  # V is a view of kv_b_proj's output; o_proj copies the output
        attention += a * m.heads * (d - m.rope_head_dim) + (a * m.heads * dv if kept else 0)
        if a == 4:  # no cast after the merge: the output stays a view of the padded block output
            attention += a * m.heads * (max(d, dv) - dv)
    if s.ulysses_size > 1:
        kv = 0 if m.kv_shared else kv_heads_sent(m, s)
        attention = a * (m.heads * d + 2 * m.heads * dv + kv * (d + dv)) + 4 * m.heads
    attention += _qk_norm(m, s)
    latent, lora = _latent_norms(m, s, inputs)
    attention += latent
    if m.attn_gate:  # sigmoid(gate), a contiguous copy of the output, the product o_proj reads
        attention += 2 * a * m.heads * dv + (a * m.heads * dv if kept else 0)
        if a == 4:  # the q norm reads a view of q_proj's output: its gate half stays too
            attention += a * m.heads * d
    return attention, lora + extra


def linear_saved(m: ModelShape, s: TrainingSetup, inputs) -> tuple[int, int]:
    """Per token, a Gated DeltaNet layer's saved tensors (:data:`GDN_SAVED`, counted in fp32) and
    out_proj's LoRA bytes."""
    nk, nv, dk, dv, _ = m.linear_dims
    c = GDN_CHUNK
    features = (nv * dk, nv * dv, nv * c, nv * dk * (dk + dv) / c, nk * dk)
    saved = int(4 * sum(w * f for w, f in zip(GDN_SAVED, features)))
    return saved, inputs(s, ("out_proj",), nv * dv, s.lora_rank)[1]


def linear_exchange_bytes(m: ModelShape, s: TrainingSetup) -> int:
    """Bytes of the gathered chunk maps ``[b | A]`` one Gated DeltaNet layer keeps for its backward:
    ``cp x B x 2 chunks x nv x dk x (dv + dk)`` fp32 values
    (:func:`ringft.ops.linear_scan.ring_gated_delta_rule`), independent of the sequence length."""
    if m.mixer != "linear":
        return 0
    _, nv, dk, dv, _ = m.linear_dims
    return s.ring_size * s.micro_batch_size * 2 * nv * dk * (dv + dk) * 4


def linear_working(m: ModelShape, s: TrainingSetup, saved: int) -> int:
    """The Gated DeltaNet backward's transients beyond the saved tensors: taken as one more copy of
    the layer's saved kernel tensors (their gradients) plus the all-reduced gradient of the gathered
    chunk maps (derived, not measured)."""
    return saved + linear_exchange_bytes(m, s)


def ring_buffers(m: ModelShape, s: TrainingSetup) -> int:
    """The ring's buffers during an attention layer's backward, ``cp > 1``: fp32 dq accumulator
    ``4*T*nh*d``, K/V double buffer ``2*a*T*nkv*(d + dv)`` and the travelling fp32 dK/dV double buffer
    ``2*4*T*nkv*(d + dv)`` (a layer reusing K/V sends its K/V shard around as any other). None in a
    Gated DeltaNet layer (its exchange: :func:`linear_exchange_bytes`)."""
    if s.ring_size <= 1 or m.mixer == "linear":
        return 0
    t, a, nkv = s.tokens, s.act_bytes, kv_heads_sent(m, s)
    width = nkv * (m.head_dim + m.v_dim)
    return 4 * t * m.heads * m.head_dim + 2 * a * t * width + 2 * 4 * t * width


def shared_kv_bytes(m: ModelShape, s: TrainingSetup) -> int:
    """Gemma 4: the K and V that the last layer of each type before the reusing layers stores, alive
    from its forward until its backward (the reusing layers' checkpointed calls hold them), and
    their gradients, summed while the backward runs through the reusing layers:
    ``2 * a*T*nkv*(d + dv)`` per layer type reused (its own ``nkv``, ``d``)."""
    if not m.kv_shared_layers:
        return 0
    views = {m.layer(i) for i in range(m.layers - m.kv_shared_layers, m.layers)}
    return sum(2 * s.act_bytes * s.tokens * v.kv_heads * (v.head_dim + v.v_dim) for v in views)


def linear_flops(m: ModelShape, tokens: int) -> tuple[float, float]:
    """``(forward, backward)`` FLOP of a Gated DeltaNet layer's convolution and chunked delta rule on
    ``tokens`` tokens (projections apart), as ringft runs it: per token and value head, chunks of
    ``C`` (:data:`GDN_CHUNK`), state columns widened to ``dv' = dv + dk``
    (:func:`ringft.ops.linear_scan.chunk_pass`): ``k_beta k^T`` and ``q k^T`` ``2*C*dk``, the two
    triangular solves ``C*(dv' + dk)/2``, the intra-chunk product ``C*dv'``, reading and updating
    the state ``3*dk*dv'``, the entering state's correction ``dk*dv``; two FLOP per multiply-add,
    the backward twice the forward."""
    nk, nv, dk, dv, kernel = m.linear_dims
    c, wide = GDN_CHUNK, dv + dk
    macs = nv * (2 * c * dk + c * (wide + dk) / 2 + c * wide + 3 * dk * wide + dk * dv)
    fwd = 2.0 * tokens * (macs + kernel * (2 * nk * dk + nv * dv))
    return fwd, 2.0 * fwd


def linear_exchange_seconds(
    m: ModelShape, batch: int, ring: int, gbps: float, latency: float, a: int
) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one Gated DeltaNet layer's exchanges on the ring: the
    all-gather of the chunk maps (``B*2*nv*dk*(dv + dk)`` fp32 values per rank) and of the
    convolution's halo (``B*2*(K - 1)*conv_dim`` values), ``ring - 1`` pieces each; the backward's
    all-reduce of them, twice the bytes. Not overlapped with compute."""
    if ring <= 1:
        return 0.0, 0.0
    nk, nv, dk, dv, kernel = m.linear_dims
    piece = batch * 2 * (nv * dk * (dv + dk) * 4 + (kernel - 1) * (2 * nk * dk + nv * dv) * a)
    one = (ring - 1) * (piece / (gbps * 1e9) + 2 * latency)  # two all-gathers
    return one, 2 * one
