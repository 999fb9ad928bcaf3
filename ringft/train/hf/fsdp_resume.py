"""Resuming an FSDP1 optimizer from a sharded checkpoint.

accelerate loads an FSDP1 ``SHARDED_STATE_DICT`` optimizer checkpoint into the template
``FSDP.optim_state_dict`` of the optimizer being resumed; an optimizer that has not stepped yet has
no state, so the template is empty and AdamW would silently restart from zero moments and step 0.
:func:`materialize_optimizer_state` gives it its state first (as torch's distributed checkpoint does
for FSDP2): one step on zero gradients at learning rate 0, which leaves every parameter bit-exact
(AdamW's update and decay are both multiplied by the learning rate) and is then overwritten by the
checkpoint's state (only when the checkpoint holds one: :func:`has_optimizer_state`, so a
checkpoint without it leaves the optimizer as new).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["has_optimizer_state", "materialize_optimizer_state"]


def has_optimizer_state(checkpoint: str | Path) -> bool:
    """Whether the checkpoint folder holds an optimizer state (accelerate's ``optimizer*`` files or
    folders: ``optimizer_0/`` sharded, ``optimizer.bin`` full)."""
    return any(Path(checkpoint).glob("optimizer*"))


@torch.no_grad()
def materialize_optimizer_state(optimizer: Any) -> None:
    """Create the per-parameter state of ``optimizer`` (a torch optimizer, or accelerate's wrapper)
    without changing any parameter; a no-op when it has state already."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if inner.state:
        return
    params = [p for g in inner.param_groups for p in g["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in inner.param_groups]
    for g in inner.param_groups:
        g["lr"] = 0.0
    inner.step()
    for g, lr in zip(inner.param_groups, lrs):
        g["lr"] = lr
    for p in params:
        p.grad = None
