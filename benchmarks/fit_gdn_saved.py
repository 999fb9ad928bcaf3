"""The tensors a Gated DeltaNet layer saves for its backward on the ring, and the planner's fit of them
(``ringft.planner.mixers.GDN_SAVED``).

One ``Qwen3_5GatedDeltaNet`` (transformers' torch kernels) put on a one-rank ring with
:func:`ringft.model.gated_deltanet.prepare_linear_attention` (each rank's work at any ring size: its
two chunks through :func:`ringft.ops.linear_scan.chunk_pass`), one forward on ``T`` tokens under
``torch.autograd.graph.saved_tensors_hooks``: the bytes of the distinct storages autograd saves,
parameters and the layer input apart. The per-token bytes are fitted by least squares to
``4 B x (c1 nv dk + c2 nv dv + c3 nv C + c4 nv dk (dk + dv) / C + c5 nk dk)`` (``C`` = 64, the
kernel's chunk) over shapes with head dims 64 / 128.

Run: ``python benchmarks/fit_gdn_saved.py [--dtype fp32|bf16] [--frozen]`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ringft without installing

from ringft.planner.mixers import GDN_CHUNK, GDN_SAVED  # noqa: E402

#: (T, nk, nv, dk, dv): the shapes of the fit
POINTS = (
    (256, 2, 4, 128, 128),
    (512, 2, 4, 128, 128),
    (512, 1, 2, 128, 128),
    (512, 2, 2, 128, 128),
    (512, 2, 4, 64, 64),
    (512, 2, 4, 128, 64),
    (512, 2, 4, 64, 128),
    (1024, 2, 4, 64, 64),
    (512, 4, 8, 64, 64),
)


def saved_bytes(layer: torch.nn.Module, x: torch.Tensor, *inputs: torch.Tensor, **kwargs) -> int:
    """Bytes of the distinct storages autograd saves in ``layer(x, **kwargs)``, apart from the
    parameters, ``x`` and the other ``inputs`` (tensors among the keyword arguments)."""
    skip = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), x, *inputs)}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, **kwargs)
    return sum(seen.values())


def gdn_config(nk: int, nv: int, dk: int, dv: int, hidden: int = 64):
    """A one-layer ``qwen3_5_text`` config whose layer is a Gated DeltaNet layer of these sizes."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "qwen3_5_text", hidden_size=hidden, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=nk, linear_num_value_heads=nv,
        linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"], vocab_size=64,
    )  # fmt: skip


def measure(tokens: int, nk: int, nv: int, dk: int, dv: int, dtype=torch.float32, frozen=False) -> int:
    """Saved bytes of one Gated DeltaNet layer forward on a one-rank ring (see the module docstring)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from ringft.model.gated_deltanet import prepare_linear_attention

    config = gdn_config(nk, nv, dk, dv)
    torch.manual_seed(0)
    layer = modeling_qwen3_5.Qwen3_5GatedDeltaNet(config, 0).to(dtype).requires_grad_(not frozen)
    prepare_linear_attention(layer, types.SimpleNamespace(group=None, rank=0, size=1))
    x = torch.randn(1, tokens, config.hidden_size, dtype=dtype, requires_grad=True)
    return saved_bytes(layer, x)


def features(nk: int, nv: int, dk: int, dv: int) -> list[float]:
    c = GDN_CHUNK
    return [nv * dk, nv * dv, nv * c, nv * dk * (dk + dv) / c, nk * dk]


def main() -> None:
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--frozen", action="store_true", help="projections without grads (LoRA)")
    args = parser.parse_args()
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    rows, per_token = [], []
    for t, nk, nv, dk, dv in POINTS:
        rows.append(features(nk, nv, dk, dv))
        per_token.append(measure(t, nk, nv, dk, dv, dtype, args.frozen) / t / 4)
    a, b = np.array(rows), np.array(per_token)
    coef = np.linalg.lstsq(a, b, rcond=None)[0]
    planned = a @ np.array(GDN_SAVED)
    print(f"fitted coefficients: {np.round(coef, 2).tolist()} (planner: {list(GDN_SAVED)})")
    for point, m, p in zip(POINTS, b, planned):
        gap = p / m - 1
        print(f"T, nk, nv, dk, dv = {point}: measured {4 * m:.0f} B/token, planned {4 * p:.0f} ({gap:+.1%})")


if __name__ == "__main__":
    main()
