"""What the TRL recipe scripts (recipes/trl_sft/sft.py, trl_dpo/dpo.py, trl_grpo/grpo.py) share:
ringft's command-line flags next to TRL's own (one dataclass for ``TrlParser``), and the files a
run leaves for the tests and the user (the Trainer's logs, the layout it ran on, the model)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringft.utils.options import option_field

__all__ = ["RingArguments", "write_run_files"]


@dataclass
class RingArguments:
    """ringft's flags (the keywords of :class:`~ringft.train.hf.RingTrainerMixin`); ``cp_size`` 1
    and no memory option leave TRL's trainer unchanged."""

    cp_size: int = option_field("cp_size", 1)  # 1: TRL's trainer unchanged
    ulysses_size: int = option_field("ulysses_size", 1)
    attn_backend: str = option_field("attn_backend", "auto")  # old flag: --ring_backend
    loss_chunk_size: int = option_field("loss_chunk_size", 4096)
    tiled_mlp_tokens: int | None = option_field("tiled_mlp_tokens", None)

    def trainer_keywords(self, memory_options: bool = True) -> dict[str, Any]:
        """The keywords a ring trainer takes, or ``{}`` when the base trainer should run as it is.
        ``memory_options=False`` (DPO, GRPO: they score through TRL's own fused head): the chunked
        loss's and the tiled MLP's flags are refused instead of being ignored."""
        memory = dict(loss_chunk_size=self.loss_chunk_size, tiled_mlp_tokens=self.tiled_mlp_tokens)
        if not memory_options and memory != {"loss_chunk_size": 4096, "tiled_mlp_tokens": None}:
            raise SystemExit(
                "error: --loss_chunk_size / --tiled_mlp_tokens apply to SFT (recipes/trl_sft/sft.py); "
                "DPO and GRPO score through TRL's fused head: drop them"
            )
        if self.cp_size <= 1 and not self.tiled_mlp_tokens:
            return {}
        ring = dict(cp_size=self.cp_size, ulysses_size=self.ulysses_size, attn_backend=self.attn_backend)
        return {**ring, **memory} if memory_options else ring


def write_run_files(trainer: Any, output_dir: str) -> None:
    """After ``trainer.train()``: ``log_history.json`` and ``run_info.json`` (world, dp, cp, ulysses,
    the distributed type) from the main process, then the model (or adapter) in ``final`` (every
    rank calls it: ZeRO-3 gathers the weights)."""
    out = Path(output_dir)
    if trainer.is_world_process_zero():
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
        layout = getattr(trainer, "ring_layout", None)
        world = trainer.accelerator.num_processes
        info = {
            "world": world,
            "dp": layout.dp_size if layout else world,
            "cp": layout.cp_size if layout else 1,
            "ulysses": layout.ulysses_size if layout else 1,
            "distributed_type": str(trainer.accelerator.distributed_type),
        }
        (out / "run_info.json").write_text(json.dumps(info))
    trainer.save_model(str(out / "final"))
