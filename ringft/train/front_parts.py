"""The pieces :mod:`ringft.train.front` hands to a ``transformers.Trainer``: the recipe's dataset, its
data order, its collator, its learning-rate schedule, and the callback that writes ``metrics.jsonl``.

Data order: the recipe's (a seeded permutation per epoch, ``train.seed``; ``data.shuffle: false``
reads in order). One sampler yields the epoch's permutation; accelerate's batch sampler, re-pointed
at the DP group by the ring trainer, hands batch ``k`` to replica ``k mod dp``: per optimizer step
the replicas (x micro-steps) read exactly the examples one process reads with that micro batch, and
every CP rank of a replica reads the same. Resuming mid-epoch skips the epoch's consumed batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import TrainerCallback

from ringft.data.collator import RingDataCollator
from ringft.train.data import epoch_permutation
from ringft.train.recipe import Recipe
from ringft.train.run_folder import MetricsFile
from ringft.train.schedule import peak_memory_gb

__all__ = ["LastStep", "MetricsCallback", "RecipeDataset", "RecipeSampler", "whole_batch_collator"]


class RecipeDataset(torch.utils.data.Dataset):
    """The checked rows of :class:`ringft.train.data.TrainingData` as a map-style dataset."""

    def __init__(self, data: Any):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.data.examples([int(index)])[0]


class RecipeSampler(torch.utils.data.Sampler):
    """The recipe's data order: epoch ``e`` reads :func:`ringft.train.data.epoch_permutation` (or
    ``0..n-1`` without shuffling); the trainer calls :meth:`set_epoch` at the start of every epoch."""

    def __init__(self, n: int, seed: int, shuffle: bool):
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.n))
        return iter(epoch_permutation(self.n, self.seed, self.epoch).tolist())


def whole_batch_collator(recipe: Recipe, pad_token_id: int) -> Callable[[list[dict]], dict[str, Any]]:
    """Examples -> the whole ``(batch, data.seq_len)`` batch (``input_ids``, ``position_ids``,
    ``shift_labels``; padded to ``seq_len``, labels shifted within each document), which the ring
    trainer then shards for its CP rank. Positions restart per document with
    ``data.document_masking`` (the ring reads the documents from them)."""
    one = RingDataCollator(
        0,
        1,
        pad_token_id=pad_token_id,
        max_length=recipe.data.seq_len,
        document_masking=recipe.data.document_masking,
    )

    def collate(examples: list[dict[str, Any]]) -> dict[str, Any]:
        full = one.global_batch(examples)
        return {k: full[k] for k in ("input_ids", "position_ids", "shift_labels")}

    return collate


class LastStep(TrainerCallback):
    """The last step is always logged (the mean loss since the previous logged step, as any
    logged row: ``metrics.jsonl`` and the summary end with it whatever ``logging.log_every``);
    with ``checkpoint.save_final: false`` it writes no checkpoint (the Trainer writes one there
    whenever it saves every ``save_steps``; the ``save_every`` ones before it stay)."""

    def __init__(self, save_final: bool):
        self.save_final = save_final

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_log = True
            control.should_save = control.should_save and self.save_final


class MetricsCallback(TrainerCallback):
    """``output_dir/metrics.jsonl`` (main process): per logged step its loss, learning rate, grad
    norm, tokens/s and peak memory, as ``ringft train`` always wrote them. Step time: between the
    ends of consecutive optimizer steps (data loading and logging included)."""

    def __init__(self, metrics: MetricsFile, tokens_per_step: int, device: torch.device):
        self.metrics, self.tokens_per_step, self.device = metrics, tokens_per_step, device
        self.last_end = time.perf_counter()
        self.step_s = float("nan")
        self.losses: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_end = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.step_s, self.last_end = now - self.last_end, now

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs:  # eval / end-of-training summaries
            if state.is_world_process_zero and any(k.startswith("eval_") for k in logs):
                self.metrics.append({"step": state.global_step, **logs})
            return
        self.losses.append(float(logs["loss"]))
        row = {
            "step": state.global_step,
            "loss": float(logs["loss"]),
            "lr": logs.get("learning_rate"),
            "tokens_per_s": self.tokens_per_step / self.step_s,
            "peak_mem_gb": peak_memory_gb(self.device),
        }
        if self.device.type == "cuda":
            row["peak_reserved_gb"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        if logs.get("grad_norm") is not None:
            row["grad_norm"] = float(logs["grad_norm"])
        if state.is_world_process_zero:
            self.metrics.append(row)
