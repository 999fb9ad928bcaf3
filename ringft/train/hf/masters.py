"""fp32 master weights for a model trained in bf16 / fp16 by a plain optimizer (DDP, one process).

AdamW on bf16 parameters rounds every update to bf16's resolution (8 significant bits): an update
smaller than half a unit in the last place of a weight is lost, e.g. lr 2e-5 on a weight of 0.02
(whose spacing is 1.2e-4). DeepSpeed (bf16 mode) and FSDP with mixed precision keep fp32 copies for
the optimizer; under DDP :func:`attach_master_weights` does the same to an optimizer built on the
model's parameters (before its first step), with optimizer hooks only:

- the optimizer's low-precision parameters are replaced by fp32 *master* copies, which hold the
  exact sum of the updates (its states are fp32, as under DeepSpeed);
- before the step (or before clipping: :meth:`MasterWeights.gradients_to_masters`), the model's
  gradients are moved onto the masters (upcast, exact);
- after the step, the masters are rounded into the model's parameters (the forward and backward run
  in the model's dtype) and their gradients are freed;
- the optimizer's ``state_dict`` carries the master values, so a resumed run continues from the
  exact fp32 values (the model's checkpointed weights are the rounded ones).

Why not fp32 weights under autocast: autocast keeps fp32 weights *and* saves a bf16 copy of each
matmul's weight for the backward (2 more bytes per parameter while activations live), and runs the
norms and the rest outside matmuls in fp32: other numerics than the bf16 model. Masters cost 4 bytes
per trained parameter, gradients stay bf16 until the step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["MasterWeights", "attach_master_weights", "needs_master_weights"]

LOW_PRECISION = (torch.bfloat16, torch.float16)
_STATE_KEY = "ringft_master_weights"


def needs_master_weights(groups: list[dict[str, Any]]) -> bool:
    """Whether any trainable parameter of the optimizer ``groups`` is bf16 / fp16."""
    return any(p.dtype in LOW_PRECISION for g in groups for p in g["params"] if p.requires_grad)


class MasterWeights:
    """fp32 masters of the low-precision parameters of an optimizer (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError("master weights must be attached before the optimizer's first step")
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        for group in optimizer.param_groups:
            masters = []
            for p in group["params"]:
                if p.dtype in LOW_PRECISION:
                    master = nn.Parameter(p.detach().to(torch.float32).clone())
                    self.pairs.append((p, master))
                    masters.append(master)
                else:
                    masters.append(p)
            group["params"] = masters
        self._moved = False

    def master_parameters(self) -> list[nn.Parameter]:
        """The fp32 masters."""
        return [m for _, m in self.pairs]

    @torch.no_grad()
    def gradients_to_masters(self) -> None:
        """Move each low-precision gradient onto its master (upcast; the model's ``.grad`` is freed).
        Idempotent within a step."""
        if self._moved:
            return
        for param, master in self.pairs:
            master.grad = None if param.grad is None else param.grad.to(torch.float32)
            param.grad = None
        self._moved = True

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """Round the masters into the model's parameters and free the masters' gradients."""
        for param, master in self.pairs:
            param.copy_(master)
            master.grad = None
        self._moved = False

    def save_into(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (an optimizer state dict) with the master values added."""
        state[_STATE_KEY] = [m.detach().clone() for _, m in self.pairs]
        return state

    @torch.no_grad()
    def load_from(self, state: dict[str, Any]) -> None:
        """Restore the masters from an optimizer state dict written by :meth:`save_into` (and
        remove them from it, so that the optimizer reads only its own keys)."""
        saved = state.pop(_STATE_KEY, None)
        if saved is None:
            raise ValueError(
                "the checkpoint's optimizer state holds no fp32 master weights: it was written by a run "
                "without them (another model dtype); resume with that run's settings"
            )
        if len(saved) != len(self.pairs):
            raise ValueError(f"checkpoint holds {len(saved)} master weights, this model {len(self.pairs)}")
        for (param, master), value in zip(self.pairs, saved):
            master.copy_(value)
            param.copy_(master)


def attach_master_weights(optimizer: torch.optim.Optimizer) -> MasterWeights | None:
    """Give ``optimizer`` (not yet stepped) fp32 masters of its bf16 / fp16 parameters, kept by its
    step / state-dict hooks; None (nothing changed) when every parameter is fp32 already."""
    if not needs_master_weights(optimizer.param_groups):
        return None
    masters = MasterWeights(optimizer)
    optimizer.register_step_pre_hook(lambda *_: masters.gradients_to_masters())
    optimizer.register_step_post_hook(lambda *_: masters.masters_to_model())
    optimizer.register_state_dict_post_hook(lambda _opt, state: masters.save_into(state))
    optimizer.register_load_state_dict_pre_hook(lambda _opt, state: masters.load_from(state))
    return masters
