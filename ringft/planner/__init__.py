"""Per-rank GPU memory planner for long-context fine-tuning with zigzag ring attention.

The planner adds up, for one rank of a ``num_gpus`` job split into ``dp`` data-parallel replicas
of ``cp`` context-parallel ranks (``num_gpus = dp * cp``), the bytes of:

- **weights / grads / optimizer** (the model states), sharded by ZeRO over all ``num_gpus`` ranks:
  the CP ranks of a replica hold the same parameters, so the shard group is ``dp x cp`` (as in
  DeepSpeed-Ulysses, Megatron's distributed optimizer and torchtitan's FSDP mesh);
- **checkpointed activations**: with per-layer gradient checkpointing only each decoder layer's
  input is kept, ``L * T * h`` values, ``T = micro_batch_size * seq_local`` and ``seq_local = S / cp``;
- **the one-layer recompute working set**: during the backward of a layer its forward is recomputed,
  so all of that layer's saved tensors are alive at once, plus the ring-attention buffers and the
  backward's transients;
- **loss / logits**: the final norm + output projection + cross-entropy; ``12 * T * V`` bytes of
  fp32 logits and their grads unless the chunked loss (:func:`ringft.loss.chunked_lm_loss`)
  bounds them to ``~8 * chunk * V``;
- a **framework overhead** constant (CUDA context, NCCL buffers, allocator slack).

The peak is ``weights + grads + optimizer + zero3_gather + checkpointed + max(layer working set,
loss working set) + overhead``: the loss's tensors are freed before the backward reaches the last
decoder layer, and a layer's working set exists only during that layer's backward. Grads are
counted as resident for the whole step (as DDP buckets / DeepSpeed's contiguous grad buffers
keep them); with ``zero_grad(set_to_none=True)`` and no persistent buffers the true peak is lower.
Allocator fragmentation is not modelled (on an H100 the caching allocator reserved 14-20 % more
than the peak allocation in a 32K-token step; ``expandable_segments:True`` reduces that).

Validated against measured peaks (one training step, per-layer checkpointing, CP = 1): CPU fp32
(tensor bytes from the profiler: within 0.1 %; peak RSS: within 4 %) and an H100 in bf16 with
ringft's ring attention, full and LoRA, chunked and unchunked loss (the plan was 0.5-2.2 %, a
constant ~70 MiB of cuBLAS/kernel workspaces, below ``max_memory_allocated``), and tensor by tensor
against CUDA allocator traces on an H200 (bf16 LoRA, tiled MLP, activation offload, 128K-384K
tokens: within 0.2 %; the peak is the second RMSNorm's backward, whose five fp32 ``(T, h)``
temporaries are the largest single term, see ``tests/planner/test_planner_gpu_measured.py``). The
ring buffers of ``cp > 1`` follow ``ringft.ops.zigzag``. Which figures are measured, emulated or
planned, and on which machine: ``benchmarks/RESULTS.md``.

Shapes (from the model config): ``h`` hidden size, ``i`` MLP intermediate size, ``L`` layers,
``nh`` attention heads, ``nkv`` key/value heads, ``d`` head dim, ``V`` vocabulary. ``a`` is the
activation dtype's byte size (2 for bf16, 4 for fp32), ``T = micro_batch_size * S / cp`` the local
tokens. All results are bytes per rank; ``GiB = 2**30`` bytes.

Layer kinds: a model whose layers differ is planned per layer view (:meth:`ModelShape.layer_views`):
latent attention (DeepSeek-V3, Mistral 4: K/V at their own head dims on the ring), Gemma 4's local
and global layers and the layers reusing an earlier layer's K/V, the hybrids' Gated DeltaNet layers
(Qwen3.5, Qwen3.5-MoE, Qwen3-Next: no ring K/V, a length-independent state exchange, their saved
tensors fitted to autograd's, :mod:`~ringft.planner.mixers`), a MoE model's dense layers. The
checkpointed activations and parameters are summed over the layers; the working set is the largest
layer kind's.

Assumptions (full fine-tuning, ``dtype="bf16"``, the ZeRO paper's mixed-precision Adam): bf16
weights (2 B/param) and bf16 grads (2 B/param), fp32 master weights + Adam ``m`` and ``v``
(12 B/param) -> 16 B/param before sharding. ``dtype="fp32"``: 4 + 4 + 8 B/param (plain AdamW).
``master_weights=False`` (pure bf16 training): 2 + 2 + 4 (bf16 Adam states). LoRA: frozen base
weights in the model dtype (no grads/optimizer); adapters in fp32 (peft's default upcast) with
fp32 grads and Adam: 16 B per adapter parameter. Dropout off (LoRA dropout 0, attention dropout 0).

Gradient accumulation does not change the per-rank memory: under DDP (ZeRO 0/1) the full gradients
are resident anyway; under DeepSpeed ZeRO-2/3 *and under FSDP* (``zero_stage`` 3 = FULL_SHARD, 2 =
SHARD_GRAD_OP) ringft reduce-scatters the gradients on every micro-step (it does not use
``no_sync`` there; ``no_sync`` would keep the full unsharded gradients until the last micro-step,
``2 * P`` bytes more per rank in bf16), so each rank only keeps its gradient shard ``g * P / N``
between micro-steps, plus one unit of full-size grads before each reduce-scatter (counted in the
ZeRO-3 gather buffers).

Option names are the recipes' names (``micro_batch_size``, ``attn_backend``, ``tiled_mlp_tokens``,
``loss_chunk_size``, ...); dtype names come from :data:`ringft.ops.DTYPES`.

Modules: :mod:`~ringft.planner.shapes` (model shapes, presets), :mod:`~ringft.planner.shape_families`
(the family facts of a config, one layer's parameters), :mod:`~ringft.planner.mixers` (the token
mixer's terms: attention of every kind, Gated DeltaNet layers), :mod:`~ringft.planner.setup`
(:class:`TrainingSetup`, :class:`MemoryPlan`), :mod:`~ringft.planner.formulas` (the terms),
:mod:`~ringft.planner.states` (the model states), :mod:`~ringft.planner.kernel` (the attention kernel's),
:mod:`~ringft.planner.plan` (:func:`plan_memory`), :mod:`~ringft.planner.search` (layouts,
recommendation, longest sequence, fixes when nothing fits), :mod:`~ringft.planner.report` (text),
:mod:`~ringft.planner.cli` (``ringft plan``), :mod:`~ringft.planner.capacity` (``ringft plan
--capacity-table``), :mod:`~ringft.planner.timing` (step-time model of the ring, Ulysses and hybrid
layouts) and :mod:`~ringft.planner.timing_report` (``ringft plan --time``).
"""

from ringft.planner.cli import plan_main
from ringft.planner.plan import build_plan, plan_memory
from ringft.planner.report import format_layouts, format_plan
from ringft.planner.search import Fix, fixes_that_fit, max_seq_len_that_fits, plan_layouts, recommend
from ringft.planner.setup import GIB, MemoryPlan, TrainingSetup
from ringft.planner.shapes import DEFAULT_LORA_TARGETS, PRESETS, ModelShape, load_model_shape
from ringft.planner.timing import Hardware, StepTime, layer_traffic, step_time
from ringft.planner.timing_report import compare_layouts, explain, recommend_layout

__all__ = [
    "DEFAULT_LORA_TARGETS",
    "GIB",
    "PRESETS",
    "Fix",
    "Hardware",
    "MemoryPlan",
    "StepTime",
    "ModelShape",
    "TrainingSetup",
    "build_plan",
    "compare_layouts",
    "explain",
    "fixes_that_fit",
    "format_layouts",
    "format_plan",
    "layer_traffic",
    "load_model_shape",
    "max_seq_len_that_fits",
    "plan_layouts",
    "plan_main",
    "plan_memory",
    "recommend",
    "recommend_layout",
    "step_time",
]
