"""What ringft changes in a launch's FSDP mixed-precision policy (both trainers call it before
accelerate's ``prepare``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["configure_fsdp_precision"]


def configure_fsdp_precision(accelerator: Any) -> str | None:
    """Under FSDP, adjust the launch's mixed-precision policy (call before ``prepare``).

    accelerate's ``mixed_precision: bf16`` gives FSDP1 ``MixedPrecision(param_dtype=bf16,
    reduce_dtype=bf16, buffer_dtype=bf16)`` and FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=bf16, output_dtype=bf16)``. ringft keeps the bf16 compute and changes:

    - ``reduce_dtype`` -> fp32 (both versions): the gradient reduce-scatter sums the partial
      gradients of every DP x CP rank; in bf16 each hop of the ring rounds the partial sum (the
      error grows ~sqrt(world): benchmarks/bench_reduce_dtype.py), in fp32 the sum of the ranks'
      bf16 gradients is exact to fp32 round-off (torchtitan's default, Megatron-LM's for bf16).
      Cost: twice the reduce-scatter bytes, overlapped with the backward;
    - FSDP1 ``buffer_dtype`` -> None (buffers keep their dtype): bf16 would round the rotary
      ``inv_freq`` (kept fp32 by transformers), off by radians at long positions.

    FSDP2's ``output_dtype=bf16`` stays (decoder layers keep bf16 outputs); the loss it casts is
    read in fp32 (:class:`ringft.loss.CausalLMLoss`). Returns a one-line note when it changed
    the policy, else None (no mixed precision, or already so).
    """
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    policy = getattr(plugin, "mixed_precision_policy", None)
    if policy is None:  # no mixed precision: everything in the parameters' dtype
        return None
    changes: dict[str, Any] = {}
    reduce = policy.reduce_dtype or policy.param_dtype  # FSDP1: None means param_dtype
    if reduce not in (None, torch.float32, torch.float64):
        changes["reduce_dtype"] = torch.float32
    if getattr(policy, "buffer_dtype", None) not in (None, torch.float32, torch.float64):
        changes["buffer_dtype"] = None
    if not changes:
        return None
    plugin.mixed_precision_policy = dataclasses.replace(policy, **changes)
    done = ["gradients reduced in fp32"] if "reduce_dtype" in changes else []
    done += ["buffers kept in their dtype"] if "buffer_dtype" in changes else []
    was = ", ".join(f"{k}={str(getattr(policy, k)).replace('torch.', '')}" for k in changes)
    return f"ringft: FSDP mixed precision: {' and '.join(done)} (the launch's policy had {was})"
