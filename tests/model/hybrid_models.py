"""Tiny Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next text models) and fp64 kernels.

transformers' torch fallbacks of the linear-attention kernels (``torch_chunk_gated_delta_rule``,
``torch_recurrent_gated_delta_rule``, the gated RMSNorm) compute in fp32 whatever the model's dtype
(``x.to(torch.float32)``). :func:`fp64_linear_kernels` lifts that to fp64 for the tests by giving
the modeling modules a ``torch`` whose ``float32`` is ``float64`` (everything else is torch), so the
same transformers code serves as an fp64 oracle. ``.float()`` calls (the decoder's RMSNorm, the
decay ``g``) stay fp32.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import types
from typing import Any

import torch

MODULES = {
    "qwen3_5_text": "transformers.models.qwen3_5.modeling_qwen3_5",
    "qwen3_5_moe_text": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next",
}
HYBRID = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # 2 value heads per key head (the kernels' grouped value attention)
    linear_key_head_dim=4,
    linear_value_head_dim=6,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MOE = dict(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention"]


class _Fp64Torch(types.ModuleType):
    float32 = torch.float64

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextlib.contextmanager
def fp64_linear_kernels():
    """While open, the hybrids' modeling modules compute their ``torch.float32`` casts in fp64."""
    modules = [importlib.import_module(name) for name in MODULES.values()]
    proxy = _Fp64Torch("torch")
    try:
        for module in modules:
            module.torch = proxy
        yield
    finally:
        for module in modules:
            module.torch = torch


def hybrid_model(model_type: str, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides: Any):
    """A random hybrid ``*ForCausalLM`` (3 layers: linear, full, linear attention), eager attention
    and experts, eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = MOE if model_type != "qwen3_5_text" else {}
    config = AutoConfig.for_model(model_type, **{**HYBRID, **extra, "num_hidden_layers": 3,
                                                 "layer_types": LAYER_TYPES, **overrides})  # fmt: skip
    torch.manual_seed(seed)
    kwargs = {} if model_type == "qwen3_5_text" else {"experts_implementation": "eager"}
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager", **kwargs)
    return model.eval()


def kernels(model_type: str = "qwen3_5_text") -> tuple[Any, Any]:
    """transformers' ``(torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)`` torch paths
    (under ringft's dispatchers, once a hybrid was put on the ring in this process)."""
    module = importlib.import_module(MODULES[model_type])
    chunk, recurrent = module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule
    return inspect.unwrap(chunk), inspect.unwrap(recurrent)
