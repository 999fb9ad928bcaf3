"""recipes/accelerate/fsdp.yaml and fsdp2.yaml name no layer class: accelerate wraps the model's
``_no_split_modules``. Check, through accelerate's own launch parsing and wrap-policy code, that
this gives one FSDP unit per decoder layer for every supported family once the model is on the
ring (apply_ring_attention narrows ``_no_split_modules`` to the classes the model contains)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ringft import apply_ring_attention
from ringft.model.families import SUPPORTED_MODEL_TYPES
from ringft.model.unwrap import decoder
from tests.model.family_models import tiny_family
from tests.model.hybrid_models import MODULES as HYBRIDS
from tests.model.hybrid_models import hybrid_model

ACCEL = Path(__file__).resolve().parents[2] / "recipes" / "accelerate"


def _plugin(name: str, monkeypatch):
    """The FSDP plugin ``accelerate launch --config_file NAME`` hands the training process."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(ACCEL / name), "train.py"])
    env = prepare_multi_gpu_env(_validate_launch_command(args)[0])
    assert "FSDP_TRANSFORMER_CLS_TO_WRAP" not in env  # no class named: the model's own list
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # fsdp.yaml's sync_module_states asks for the current GPU at construction; the wrap policy does
    # not depend on it, so build the plugin as on CPU.
    monkeypatch.setenv("FSDP_SYNC_MODULE_STATES", "false")
    return FullyShardedDataParallelPlugin()


def _wrapped(name: str, model, monkeypatch) -> list[torch.nn.Module]:
    """The modules accelerate's policy for launch config ``name`` makes FSDP units."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    plugin = _plugin(name, monkeypatch)
    if plugin.fsdp_version == 2:
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
        return [m for m in model.modules() if policy(m)]
    plugin.set_auto_wrap_policy(model)
    return [m for m in model.modules() if plugin.auto_wrap_policy(m, recurse=False, nonwrapped_numel=0)]


def _model(model_type: str):
    if model_type in HYBRIDS:  # Gated DeltaNet hybrids (Qwen3.5's text model lists vision blocks)
        return hybrid_model(model_type, torch.float32)
    extra = {"head_dim": 16} if model_type == "gemma3_text" else {}
    return tiny_family(model_type, torch.float32, **extra)


@pytest.mark.parametrize("config", ["fsdp.yaml", "fsdp2.yaml"])
def test_fsdp_wrap_policy_resolves_for_every_family(config, monkeypatch):
    for model_type in SUPPORTED_MODEL_TYPES:
        model = apply_ring_attention(_model(model_type))
        units = _wrapped(config, model, monkeypatch)
        layers = list(decoder(model).layers)
        assert units == layers, f"{model_type}: {[type(m).__name__ for m in units]}"


def test_text_model_of_a_multimodal_family_needs_the_narrowing(monkeypatch):
    """Without apply_ring_attention's narrowing, accelerate refuses Qwen3.5's text model (its
    ``_no_split_modules`` names the vision block); with it, the layers are wrapped."""
    model = _model("qwen3_5_text")
    with pytest.raises(ValueError, match="VisionBlock"):
        _wrapped("fsdp2.yaml", model, monkeypatch)
    apply_ring_attention(model)
    assert _wrapped("fsdp2.yaml", model, monkeypatch) == list(decoder(model).layers)
