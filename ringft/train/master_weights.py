"""fp32 master weights for low-precision (bf16 / fp16) parameters trained by a plain optimizer (DDP).

AdamW on bf16 parameters rounds every update to bf16's resolution (8 significant bits): an update
smaller than half a unit in the last place of a weight is lost, e.g. lr 2e-5 on a weight of 0.02
(whose spacing is 1.2e-4). DeepSpeed (bf16 mode) and FSDP with mixed precision keep fp32 copies for
the optimizer; under DDP ringft does the same here:

- the optimizer steps fp32 *master* copies (``optimizer_groups``), which hold the exact sum of the
  updates;
- before the step, the model's gradients are moved onto the masters (upcast, exact);
- after the step, the masters are rounded into the model's parameters (the forward and backward run
  in the model's dtype).

Memory: 4 bytes per trained low-precision parameter for the master, and the optimizer's states are
fp32 (as under DeepSpeed). Checkpoints hold the masters (``state_dict``), so a resumed run continues
from the exact fp32 values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["MasterWeights", "needs_master_weights"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def needs_master_weights(groups: list[dict[str, Any]]) -> bool:
    """Whether any trainable parameter of the optimizer ``groups`` is bf16 / fp16."""
    return any(p.dtype in _LOW_PRECISION for g in groups for p in g["params"])


class MasterWeights:
    """fp32 masters of the low-precision parameters of optimizer ``groups`` (fp32 ones are their own).

    Use: build the optimizer on :attr:`optimizer_groups`; after backward call
    :meth:`gradients_to_masters`, clip / step the optimizer, then :meth:`masters_to_model`.
    """

    def __init__(self, groups: list[dict[str, Any]]):
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        self.optimizer_groups: list[dict[str, Any]] = []
        for group in groups:
            masters = []
            for p in group["params"]:
                if p.dtype in _LOW_PRECISION:
                    master = nn.Parameter(p.detach().to(torch.float32).clone())
                    self.pairs.append((p, master))
                    masters.append(master)
                else:
                    masters.append(p)
            self.optimizer_groups.append({**group, "params": masters})

    def master_parameters(self) -> list[nn.Parameter]:
        """Every parameter the optimizer steps (fp32)."""
        return [p for g in self.optimizer_groups for p in g["params"]]

    @torch.no_grad()
    def gradients_to_masters(self) -> None:
        """Move each low-precision gradient onto its master (upcast; the model's ``.grad`` is freed)."""
        for param, master in self.pairs:
            master.grad = None if param.grad is None else param.grad.to(torch.float32)
            param.grad = None

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """Round the masters into the model's parameters (after the optimizer step)."""
        for param, master in self.pairs:
            param.copy_(master)

    def state_dict(self) -> dict[str, Any]:
        """The master values (for checkpoints: accelerate's ``register_for_checkpointing``)."""
        return {"masters": [m.detach().clone() for _, m in self.pairs]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the masters saved by :meth:`state_dict` (shapes must match)."""
        saved = state["masters"]
        if len(saved) != len(self.pairs):
            raise ValueError(f"checkpoint holds {len(saved)} master weights, this model {len(self.pairs)}")
        for (_, master), value in zip(self.pairs, saved):
            master.copy_(value)
