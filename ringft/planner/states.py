"""The model states of one rank: weights, grads, optimizer, ZeRO-3 gather buffers and what is
offloaded to host memory (see :mod:`ringft.planner`; re-exported by :mod:`ringft.planner.formulas`)."""

from __future__ import annotations

from ringft.planner.setup import TrainingSetup
from ringft.planner.shapes import ModelShape

__all__ = ["model_states"]


def model_states(m: ModelShape, s: TrainingSetup) -> dict[str, int]:
    """Weights, grads, optimizer, ZeRO-3 gather buffers and CPU-offloaded bytes per rank.

    With ``P`` parameters, ``N = num_gpus`` and bytes per parameter ``(w, g, o)`` =
    ``(2, 2, 12)`` (bf16 + fp32 master + Adam), ``(4, 4, 8)`` (fp32) or ``(2, 2, 4)``
    (bf16 without master weights):

    - full FT: weights ``w*P`` (``/N`` at ZeRO-3), grads ``g*P`` (``/N`` at ZeRO >= 2),
      optimizer ``o*P`` (``/N`` at ZeRO >= 1);
    - LoRA: frozen base ``w*P`` (``/N`` at ZeRO-3) and, for the ``P_lora`` adapter parameters,
      ``4 + 4 + 8`` B (fp32 adapters, peft's default; else ``(w, g, o)``), sharded the same way;
    - ZeRO-3 gather: ``(1 + prefetch)`` gathered copies of the largest unit (a decoder layer or the
      ``V x h`` lm_head/embedding) in the weight dtype, plus one unit of full-size grads (full FT)
      before the reduce-scatter;
    - ``offload_optimizer`` moves the optimizer states (incl. master weights) to CPU memory, and
      under ZeRO >= 2 the gradient partitions too: DeepSpeed then allocates its gradient-partition
      buffer (``grad_partitions_flat_buffer``, in the gradient dtype) on the CPU and copies each
      partition there as it is reduced (``partition_grads``), plus a persistent fp32 copy for the
      CPU optimizer (``fp32_partitioned_groups_flat[i].grad``): ``(g + 4) * P / N`` bytes of host
      memory (full-size grads exist only per unit, before the reduce-scatter: the gather term);
      ``offload_params`` (ZeRO-3) keeps only the gather buffers on the GPU.

    ``cpu`` is the host memory of the rank; ``cpu_optimizer`` / ``cpu_grads`` / ``cpu_weights`` its parts.
    """
    n = s.num_gpus
    wbytes = s.act_bytes
    if s.dtype == "fp32":
        gbytes, obytes = 4, 8
    else:
        gbytes, obytes = 2, (12 if s.master_weights else 4)
    p_total = m.total_params
    shard_w = n if s.zero_stage >= 3 else 1
    shard_g = n if s.zero_stage >= 2 else 1
    shard_o = n if s.zero_stage >= 1 else 1
    if s.lora:
        p_lora = m.lora_params(s.lora_rank, s.lora_targets)
        trainable = p_lora
        lw, lg, lo = (4, 4, 8) if (s.lora_fp32_adapters or s.dtype == "fp32") else (wbytes, gbytes, obytes)
        weights = wbytes * p_total // shard_w + lw * p_lora // shard_w
        grads = lg * p_lora // shard_g
        optimizer = lo * p_lora // shard_o
    else:
        trainable = p_total
        weights = wbytes * p_total // shard_w
        grads = gbytes * p_total // shard_g
        optimizer = obytes * p_total // shard_o
    gather = 0
    if s.zero_stage >= 3:
        unit = max(m.layer_params, m.embedding_params)
        gather = (1 + s.zero3_prefetch_layers) * unit * wbytes + (0 if s.lora else unit * gbytes)
    cpu_opt = cpu_grads = cpu_weights = 0
    if s.offload_optimizer:
        cpu_opt, optimizer = optimizer, 0
        if s.zero_stage >= 2:
            trainable_n = (p_lora if s.lora else p_total) // shard_g
            cpu_grads, grads = grads + 4 * trainable_n, 0
    if s.offload_params:
        cpu_weights, weights = weights, 0
    return {
        "params_total": p_total + (m.lora_params(s.lora_rank, s.lora_targets) if s.lora else 0),
        "params_trainable": trainable,
        "weights": weights,
        "grads": grads,
        "optimizer": optimizer,
        "zero3_gather": gather,
        "cpu": cpu_opt + cpu_grads + cpu_weights,
        "cpu_optimizer": cpu_opt,
        "cpu_grads": cpu_grads,
        "cpu_weights": cpu_weights,
    }
