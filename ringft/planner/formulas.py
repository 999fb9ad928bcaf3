"""The memory formulas: bytes per rank of each part of one training step (see :mod:`ringft.planner`).

Every function takes the model's :class:`ModelShape` ``m`` and the :class:`TrainingSetup` ``s`` and
returns bytes per rank. ``T = micro_batch_size * S / cp`` local tokens, ``a`` the activation
dtype's byte size, shapes as in :mod:`ringft.planner.shapes`.
"""

from __future__ import annotations

from collections.abc import Sequence

from ringft.planner.kernel import attention_kernel, attention_kernel_parts, kv_heads_sent
from ringft.planner.mixers import (
    linear_exchange_bytes,
    linear_working,
    mixer_saved,
    ring_buffers,
    shared_kv_bytes,
)
from ringft.planner.setup import TrainingSetup
from ringft.planner.shapes import ModelShape
from ringft.planner.states import model_states

__all__ = [
    "attention_kernel",
    "attention_kernel_parts",
    "checkpointed",
    "kv_heads_sent",
    "layer_saved",
    "layer_working_set",
    "loss_working_set",
    "model_states",
]


def _linear_inputs(s: TrainingSetup, modules: Sequence[str], in_features: int, rank: int) -> tuple[bool, int]:
    """What the Linear ``modules`` (sharing one input of ``in_features``) keep for the backward,
    per token: ``(input kept, extra bytes)``.

    A Linear keeps its input only when its weight trains (autograd saves conditionally). A LoRA
    target keeps the input of ``lora_A`` -- with fp32 adapters on a bf16 model peft casts the input
    to fp32 first, a separate ``4*in`` copy per target -- and ``lora_A``'s output (``r`` values).
    """
    a = s.act_bytes
    kept, extra = False, 0
    targets = set(s.lora_targets) if s.lora else set()
    cast = s.lora and s.lora_fp32_adapters and a != 4
    for name in modules:
        if not s.lora:
            kept = True
        elif name in targets:
            if cast:
                extra += 4 * in_features
            else:
                kept = True
            extra += (4 if s.lora_fp32_adapters else a) * rank
    return kept, extra


def _extra_norms_saved(m: ModelShape, s: TrainingSetup) -> int:
    """Per token, what the norms beyond the two pre-norms keep (Gemma 3's post-attention and
    post-feedforward norms): fp32 input ``4*h`` (the o_proj / down_proj output, kept by nothing
    else), ``rsqrt`` (4 B), the fp32 normalised value ``4*h`` if the weight trains (Gemma's norm
    multiplies in fp32)."""
    extra = max(m.norms - 2, 0)
    if s.fused_rmsnorm:  # its input (o_proj / down_proj output) and rstd
        return extra * (s.act_bytes * m.hidden + 4)
    return extra * (4 * m.hidden + 4 + (4 * m.hidden if not s.lora else 0))


def _per_layer_input_saved(m: ModelShape, s: TrainingSetup) -> int:
    """Per token, Gemma 4's per-layer input block (``p`` wide): the gate's input ``a*h`` if it keeps
    it, the gate's output, its activation and the product with the layer's input ``3*a*p``, and its
    post-norm as one more extra norm (fp32 input ``4*h``, ``rsqrt``, fp32 normalised ``4*h``)."""
    p = m.per_layer_input
    if not p:
        return 0
    kept, extra = _linear_inputs(s, ("per_layer_input_gate",), m.hidden, s.lora_rank)
    extra += _linear_inputs(s, ("per_layer_projection",), p, s.lora_rank)[1]
    norm = 4 * m.hidden + 4 + (4 * m.hidden if not s.lora else 0)
    return (s.act_bytes * m.hidden if kept else 0) + 3 * s.act_bytes * p + norm + extra


def layer_saved(m: ModelShape, s: TrainingSetup) -> dict[str, int]:
    """Bytes one decoder layer keeps for its backward (what a recompute re-creates).

    With ``T`` local tokens, ``a`` the activation byte size, per token:

    - ``norm1``: the RMSNorm's fp32 copy of its input ``4*h`` (none in fp32: the input is the
      checkpointed layer input), ``rsqrt`` (4 B), the normalised value ``a*h`` if the norm weight
      trains, and the norm's output ``a*h`` if q/k/v keep it (their weights train);
    - ``attention``: the token mixer's tensors (:func:`ringft.planner.mixers.mixer_saved`): for a
      LLaMA-style layer RoPE'd q, k, v and the output ``a*(2*nh + 2*nkv)*d``, fp32 lse ``4*nh``, the
      q/k norms' tensors; Ulysses x ring (``U > 1``): the head shards of q, k, v (K/V heads ``nkv'``
      = :func:`kv_heads_sent`, replicated where ``U`` does not divide ``nkv``) and of the output,
      and o_proj the output's all-to-all'd copy: ``a*(3*nh + 2*nkv')*d``; latent attention at its
      own K/V head dims, Qwen3.5's output gate, a Gated DeltaNet layer's (fitted) tensors; plus the
      extra norms' (:func:`_extra_norms_saved`) and Gemma 4's per-layer input block's;
    - ``norm2``: as norm1, its input ``4*h`` either way (fp32 copy, or in fp32 the residual itself);
      output kept if gate/up train (or by the tiled MLP, which keeps its input);
    - ``mlp`` (SwiGLU): gate, silu(gate), up ``3*a*i``, and their product ``a*i`` if down_proj
      trains; 0 with the tiled MLP (recomputed per tile in the backward);
    - ``lora_attn`` / ``lora_mlp``: per LoRA target, the fp32 copy of its input ``4*in`` (bf16 model,
      fp32 adapters) and ``lora_A``'s output ``4*r``.

    Tiled norms (``tiled_norm_tokens``, :mod:`ringft.model.tiled_norm`): each norm keeps views of
    its input ``a*h`` (counted even where the input is kept anyway: conservative) instead of the
    fp32 copy, ``rsqrt`` and normalised value. The fused norm (``fused_rmsnorm``,
    :mod:`ringft.model.fused_rmsnorm`): each norm keeps its input ``a*h`` (counted as for tiles)
    and an fp32 ``rstd`` (4 B); q/k and extra norms likewise.

    Full fine-tuning in bf16 gives ``T*(16*h + 2*(2*nh + 2*nkv)*d + 4*nh + 8*i + 8)``.
    """
    a = s.act_bytes
    h, i = m.hidden, m.intermediate
    trains = not s.lora
    r = s.lora_rank
    norm_y = a * h if trains else 0
    n1_kept, lora_attn = _linear_inputs(s, m.projections("qkv"), h, r)
    norm1 = (4 * h if a != 4 else 0) + 4 + norm_y + (a * h if n1_kept else 0)
    if s.tiled_norm_tokens:  # views of the input instead of the fp32 copy, rsqrt, normalised value
        norm1 = a * h + (a * h if n1_kept else 0)
    elif s.fused_rmsnorm:  # its input and rstd
        norm1 = a * h + 4 + (a * h if n1_kept else 0)
    attention, mixer_lora = mixer_saved(m, s, _linear_inputs)  # the output o_proj reads is kept anyway
    attention += _extra_norms_saved(m, s) + _per_layer_input_saved(m, s)
    lora_attn += mixer_lora
    n2_kept, lora_mlp = _linear_inputs(s, m.projections("gate_up"), h, r)
    norm2_own = a * h if s.tiled_norm_tokens else (a * h + 4 if s.fused_rmsnorm else 4 * h + 4 + norm_y)
    if s.tiled_mlp:
        norm2 = norm2_own + a * h
        mlp, lora_mlp = 0, 0
    else:
        norm2 = norm2_own + (a * h if n2_kept else 0)
        p_kept, p_extra = _linear_inputs(s, m.projections("down"), i, r)
        mlp = 3 * a * i + (a * i if p_kept else 0)
        lora_mlp += p_extra
    t = s.tokens
    return {
        "norm1": t * norm1,
        "attention": t * attention,
        "lora_attn": t * lora_attn,
        "norm2": t * norm2,
        "mlp": t * mlp,
        "lora_mlp": t * lora_mlp,
    }


def _mlp_tile(m: ModelShape, s: TrainingSetup) -> int:
    return min(s.tokens, s.tiled_mlp_tokens or m.hidden)


# The RMSNorm backward (transformers' Llama-style norm, ``w * (x32 * rsqrt(mean(x32**2) + eps))``)
# holds five fp32 ``(T, h)`` tensors at once: the x-grad of the ``x32 * rsqrt`` product (waiting for
# the variance path), the mean's expanded grad and pow's ``x**1``, ``2*x`` and ``grad * 2x``. Counted
# on CPU (torch 2.13, bf16 and fp32 alike) and on the GPU (H200, torch 2.11: five 2 GiB blocks at 128K).
RMSNORM_BACKWARD_TEMPS = 5
# The fused norm's backward (ringft.model.fused_rmsnorm) works on row chunks of FUSED_NORM_CHUNK
# (its CHUNK_ROWS) tokens and holds FUSED_NORM_TEMPS fp32 (chunk, h) temporaries at its largest
# (the chunk's x_hat, u and their product), besides its output dx (a*T*h). Measured on CPU
# (benchmarks/bench_tiled_norm.py: 3.0 chunks at T = 16K and 64K, h = 1024).
FUSED_NORM_CHUNK = 4096
FUSED_NORM_TEMPS = 3
# A tiled norm's backward (ringft.model.tiled_norm): the tiles' input grads and their cat, plus two
# more a*T*h that the CPU measurement shows (benchmarks/bench_tiled_norm.py; taken as the GPU's too,
# an upper bound).
TILED_NORM_GRADS = 4


def layer_working_set(m: ModelShape, s: TrainingSetup, saved: dict[str, int]) -> dict[str, int]:
    """Peak of one decoder layer's backward (after its recompute), the largest of three phases.

    - MLP phase (the MLP backward runs first): everything the layer saved, the output grad
      ``a*T*h`` and the MLP backward's transients: untiled, gate/silu/up and the grads of the
      product, silu and up are alive together, ``6*a*T*i`` minus the MLP's saved bytes; tiled,
      one tile's recompute + transients ``6*a*t*i`` (``t`` tile tokens, plus the tile's LoRA input
      copies) and the input-grad accumulator ``a*T*h``;
    - norm phase (the second norm's backward, right after the MLP's): the first half's saved
      tensors (norm1 + attention + their LoRA tensors), the second norm's fp32 input and rsqrt
      ``(4*h + 4)*T``, the residual stream's grad ``a*T*h`` and the RMSNorm backward's
      :data:`RMSNORM_BACKWARD_TEMPS` fp32 temporaries ``5*4*T*h``. For bf16 LoRA on Llama shapes
      this is the peak: with fp32 adapters on q/k/v/o (their fp32 input copies ``12*h + 4*nh*d``)
      and a tiled MLP, ``T*(42*h + 4*nh*d + 2*(2*nh + 2*nkv)*d + 4*nh + 8 + 16*r)``, measured on an
      H200 within 0.2 % (``tests/planner/test_planner_gpu_measured.py``). With extra norms (Gemma 3's
      post-feedforward norm, whose backward runs first, while everything is saved) the phase is the
      larger of that and ``sum(saved) + a*T*h + 5*4*T*h`` (derived, not measured). The recompute
      *forward* never exceeds this phase: at its largest (the second norm's forward, measured at
      384K) it holds, besides the first half's saved tensors, the layer input (offload: unpacked
      from CPU), the residual and the output grad ``a*T*h`` each, the norm's fp32 input and
      product ``2*4*T*h`` and two ``a*T*h`` casts: ``(5*a + 8)*T*h`` against ``(a + 24)*T*h``
      here (in fp32 the casts are no-ops);
    - attention phase (the second norm's and the MLP's tensors are freed): norm1 + attention +
      their LoRA tensors, the kernel transients (:func:`attention_kernel`); with ``cp > 1`` the
      ring buffers: fp32 dq accumulator ``4*T*nh*d``, K/V double buffer ``2*2*a*T*nkv*d`` and the
      travelling fp32 dK/dV double buffer ``2*2*4*T*nkv*d``; and the gradient flow: output and
      input grads ``2*a*T*h`` plus the RMSNorm backward's fp32 temporary ``4*T*h``.
      Ulysses x ring: the ring buffers exist when ``ring_size > 1`` (at ``nkv'`` K/V heads); the
      backward all-to-all of dq/dk/dv (after the ring's backward has freed its buffers) holds
      the head-shard grads, the send and receive buffers and the sequence-shard result,
      ``4*a*T*(nh + 2*nkv')*d``: the phase takes the larger of that and kernel + ring.

    ``norm_transients`` is the norm phase's part that no saved tensor accounts for (the grad and the
    temporaries), what the phase adds when the saved tensors are counted elsewhere (no checkpointing).

    Tiled norms (``tiled_norm_tokens = c``): a norm's backward holds one tile's recompute and
    temporaries ``c*(6*4*h + 4)`` plus its tiles' input grads, their cat and what else the CPU
    measurement shows, :data:`TILED_NORM_GRADS` ``*a*T*h`` (in the norm phase, and in the attention
    phase's gradient flow for the first norm), and the second norm keeps ``a*T*h`` of input views
    instead of ``(4*h + 4)*T`` (benchmarks/bench_tiled_norm.py).

    The fused norm (``fused_rmsnorm``, untiled): a norm's backward holds its input grad ``a*T*h``
    and :data:`FUSED_NORM_TEMPS` fp32 ``(c, h)`` temporaries, ``c = min(T, FUSED_NORM_CHUNK)``, in
    the norm phase and in the attention phase's gradient flow; the second norm keeps
    ``(a*h + 4)*T`` (benchmarks/bench_tiled_norm.py).
    """
    a = s.act_bytes
    t, h, i = s.tokens, m.hidden, m.intermediate
    if s.tiled_mlp:
        tile = _mlp_tile(m, s)
        tile_lora = _linear_inputs(s, m.projections("gate_up"), h, s.lora_rank)[1]
        tile_lora += _linear_inputs(s, m.projections("down"), i, s.lora_rank)[1]
        mlp_extra = tile * (6 * a * i + tile_lora) + a * t * h
    else:
        mlp_extra = 6 * a * t * i - saved["mlp"]
    ring, all_to_all = ring_buffers(m, s), 0
    if s.ulysses_size > 1 and m.mixer != "linear":
        all_to_all = 2 * a * t * (m.heads + 2 * kv_heads_sent(m, s)) * (m.head_dim + m.v_dim)
    kernel = attention_kernel(m, s)
    if m.mixer == "linear":  # the Gated DeltaNet backward's transients in the kernel's place
        kernel = linear_working(m, s, t * mixer_saved(m, s, _linear_inputs)[0])
    if s.tiled_norm_tokens:
        # one tile's recompute (fp32 copy, rsqrt) and backward temporaries; the tiles' input grads
        # and their cat, and two more a*T*h seen on CPU (benchmarks/bench_tiled_norm.py: 4*a*T*h in
        # all matched the CPU peak within 4 %)
        tile = min(t, s.tiled_norm_tokens)
        norm_backward = tile * ((RMSNORM_BACKWARD_TEMPS + 1) * 4 * h + 4) + TILED_NORM_GRADS * a * t * h
        norm_own = a * t * h  # the second norm's saved input views
    elif s.fused_rmsnorm:
        # its input grad dx and one row chunk's fp32 temporaries; it keeps its input and rstd
        norm_backward = a * t * h + FUSED_NORM_TEMPS * 4 * min(t, FUSED_NORM_CHUNK) * h
        norm_own = t * (a * h + 4)
    else:
        norm_backward = RMSNORM_BACKWARD_TEMPS * 4 * t * h
        norm_own = t * (4 * h + 4)
    grad_flow = 2 * a * t * h + (norm_backward if s.tiled_norm_tokens or s.fused_rmsnorm else 4 * t * h)
    mlp_phase = sum(saved.values()) + mlp_extra + a * t * h
    attn_saved = saved["norm1"] + saved["attention"] + saved["lora_attn"]
    attn_phase = attn_saved + max(kernel + ring, all_to_all) + grad_flow
    norm_transients = a * t * h + norm_backward
    norm_phase = attn_saved + norm_own + norm_transients
    if m.norms > 2:
        norm_phase = max(norm_phase, sum(saved.values()) + norm_transients)
    return {
        "mlp_phase": mlp_phase,
        "norm_phase": norm_phase,
        "attention_phase": attn_phase,
        "ring_buffers": ring,
        "all_to_all_buffers": all_to_all,
        "attention_kernel": kernel,
        "mlp_backward_extra": mlp_extra,
        "grad_flow": grad_flow,
        "norm_transients": norm_transients,
    }


def loss_working_set(m: ModelShape, s: TrainingSetup) -> dict[str, int]:
    """Peak of the final RMSNorm + output projection + cross-entropy (forward and backward).

    The final norm's tensors live from the end of the forward until the loss's backward is done:
    fp32 input ``4*T*h`` and ``rsqrt``, the normalised value ``a*T*h`` if its weight trains, its
    output ``a*T*h`` if the lm_head trains or the chunked loss keeps it. On top of them:

    - unchunked (transformers' ``ForCausalLMLoss``): during the backward the saved fp32
      log-softmax, its incoming and its outgoing grad are alive at once: ``12*T*V`` (larger than
      the forward's ``(a + 8)*T*V``);
    - chunked (:func:`ringft.loss.chunked_lm_loss`, ``c = min(chunk, T)``): the larger of the
      forward's ``8*c*V`` (fp32 logits + log-sum-exp temporary) and the backward's
      ``(4 + a')*c*V + a*T*h`` (grad_hidden) ``+ (4 + a')*V*h`` (fp32 lm_head grad accumulator
      and the low-precision product added to it, when the lm_head trains; ``a' = 0`` in fp32,
      else ``a``).

    ``attention_checkpoint="save"``: the last layer's attention output and lse
    ``T*(a*nh*d + 4*nh)`` (``attention_saves``), kept until that layer's backward, are alive here
    too (:func:`checkpointed` counts the other ``L - 1`` layers').
    """
    a = s.act_bytes
    t, v, h = s.tokens, m.vocab, m.hidden
    trains = not s.lora
    low = a if a != 4 else 0
    keep_out = trains or s.chunked_loss
    final_norm = t * (4 * h + 4 + (a * h if trains else 0) + (a * h if keep_out else 0))
    if s.tiled_norm_tokens:  # views of its input instead of the fp32 copy, rsqrt, normalised value
        final_norm = t * (a * h + (a * h if keep_out else 0))
    elif s.fused_rmsnorm:  # its input and rstd
        final_norm = t * (a * h + 4 + (a * h if keep_out else 0))
    saves = _attention_out(m.layer(m.layers - 1), s) if s.attention_checkpoint == "save" else 0
    if not s.chunked_loss:
        return {"final_norm": final_norm, "logits": 12 * t * v, "attention_saves": saves}
    c = min(s.loss_chunk_size, t)
    head_grad = 4 * v * h if trains else 0
    # + the low-precision ``V x h`` product of a chunk's weight gradient (``g_low.t() @ h``, added
    # to the fp32 accumulator): measured, bf16 full fine-tuning peaks were exactly ``a*V*h`` above
    # the plan without this term (CPU bench_memory --dtype bf16: 27-31 MiB at V=32000, h=512;
    # H100 Llama-3-8B: -1.8 %, ~1 GiB). fp32 accumulates in place (addmm_): no such product.
    # On CPU the in-place add of that bf16 product into the fp32 accumulator also materialises an
    # fp32 copy (4*V*h) next to the chunk's a*c*V grad: where 4*V*h > 4*c*V this plan is low on CPU
    # (measured: V=8192, h=512, c=256, T=1024: 45 MiB vs 37 planned); GPU kernels cast on the fly.
    backward = (4 + low) * c * v + a * t * h + head_grad + low * v * h * trains
    return {
        "final_norm": final_norm,
        "logits": max(8 * c * v, backward, a * t * h + (4 + low) * v * h * trains),
        "attention_saves": saves,
    }


def checkpointed(m: ModelShape, s: TrainingSetup) -> dict[str, int]:
    """Activations kept from the forward until the backward reaches their layer.

    - per-layer checkpointing: the ``L`` layer inputs ``L*a*T*h``; with activation offload
      (``save_on_cpu`` around the decoder) one ``a*T*h`` stays on the GPU, the rest is in CPU
      memory. Measured (H200, LoRA): that one is the embedding output, which ringft's
      ``enable_input_require_grads`` (LoRA + checkpointing) makes a leaf that requires grad, so
      autograd's AccumulateGrad node keeps it on the GPU for the whole step; the input of the layer
      being recomputed (``unpack_from_cpu``, another ``a*T*h``) is freed once the recompute is
      done, before the backward's peak (full fine-tuning: that input is what the term covers);
    - no checkpointing: every layer's saved tensors (:func:`layer_saved` of its layer view) plus its
      input;
    - always: RoPE's cos/sin ``2*a*T*d`` (shared by all layers; one table per head dim: Gemma 4's
      local and global, latent attention's ``qk_rope_head_dim``);
    - Gemma 4: the K/V the reusing layers read and their gradients
      (:func:`ringft.planner.mixers.shared_kv_bytes`) and the per-layer inputs ``(2*a + 4)*T*L*p``
      (their embedding, their norm's fp32 input, the sum the layers read: derived, not measured);
    - ``attention_checkpoint="save"``: each attention layer's output and lse, ``T*(a*nh*dv + 4*nh)``,
      kept from the forward for the backward (no attention forward in the recompute): ``L - 1``
      layers' worth besides the layer in its backward (whose tensors the working set counts; the
      loss phase holds all ``L``: :func:`loss_working_set`); ``"offload"``: those ``L - 1`` in
      host memory and nothing more on the GPU: the forward copies out the output the layer returns
      anyway, and the copy brought back for the backward stands in for the recomputed output
      (measured on an H200: the same peak as ``recompute``, benchmarks/RESULTS.md "Attention
      output saved under checkpointing").

    (The final norm's tensors are counted with the loss: they are freed before any layer's
    backward.)
    """
    a = s.act_bytes
    t, h = s.tokens, m.hidden
    per_layer = a * t * h
    views = m.layer_views()
    layers = m.layers * per_layer
    if not s.gradient_checkpointing:
        own = {v: sum(layer_saved(v, s).values()) + linear_exchange_bytes(v, s) for v in views}
        layers += sum(count * own[v] for v, count in views.items())
    cpu = 0
    if s.offload_activations and s.gradient_checkpointing:
        on_gpu = per_layer
        cpu, layers = layers - on_gpu, on_gpu
    every = sum(count * _attention_out(v, s) for v, count in views.items())
    rest = every - _attention_out(m.layer(m.layers - 1), s)
    saves, cpu_attention = 0, 0
    if s.attention_checkpoint == "save":
        saves = rest
    elif s.attention_checkpoint == "offload":
        cpu_attention = rest
    dims = {v.rope_head_dim or v.head_dim for v in views if v.mixer != "linear"}
    p = m.per_layer_input
    return {
        "layers": layers,
        "rope": 2 * a * t * sum(dims),
        "attention_saves": saves,
        "shared_kv": shared_kv_bytes(m, s),
        "per_layer_inputs": (2 * a + 4) * t * m.layers * p,
        "cpu": cpu,
        "cpu_attention": cpu_attention,
    }


def _attention_out(m: ModelShape, s: TrainingSetup) -> int:
    """One attention layer's output and lse ``T*(a*nh*dv + 4*nh)`` (0 for a Gated DeltaNet layer)."""
    return 0 if m.mixer == "linear" else s.tokens * (s.act_bytes * m.heads * m.v_dim + 4 * m.heads)
