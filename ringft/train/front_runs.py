"""A recipe run's output folder under the Trainer: the lock, which checkpoint to resume from and
whether the recipe may continue it, ``metrics.jsonl``, and the final export.

Checkpoints are the Trainer's own folders, ``output_dir/checkpoint-N`` (model, optimizer, scheduler,
RNG states, ``trainer_state.json``). After each is complete the main process writes
``ringft_run.json`` into it (the recipe, the world size, dp): a checkpoint without it was cut off
mid-save and is never resumed from. ``--resume`` continues the newest checkpoint (refusing a damaged
newest one, naming the newest complete one), ``--resume PATH`` a given one; a recipe that would
change the data order or the model is refused (:func:`compare_recipes`).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ringft.ops.validate import PeerFailed, run_together
from ringft.train.errors import RecipeError, TrainError, first_line, io_error, is_io_failure
from ringft.train.recipe import Recipe
from ringft.train.run_folder import MetricsFile, OutputDirLock

__all__ = [
    "RUN_FILE",
    "RunFolder",
    "checkpoint_folders",
    "compare_recipes",
    "export_final",
    "in_loaded_dtypes",
    "intact_note",
    "push_export",
    "write_together",
]

RUN_FILE = "ringft_run.json"
EXPORT_RECIPE = "ringft_recipe.json"  # in output_dir/final: the export is complete
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# Recipe keys that change the data order, the model or the optimizer's state layout: a resumed run
# with another value would not continue the checkpointed run exactly (refused).
EXACT_KEYS = ("model.", "data.", "train.micro_batch_size", "train.grad_accum", "train.seed", "lora")
# Compared for nothing: where the run writes, how it logs, which attention kernel computes the ring.
IGNORED_KEYS = ("checkpoint.output_dir", "logging.", "model.attn_backend")
# Warned with the reason the run still continues: the data order depends on dp (not on how a CP
# group is split) and the weights do not depend on the layout at all.
CARRIED_OVER = {
    "parallel.ulysses_size": "weights, optimizer state and data order carry over: the split of a CP group "
    "only moves tokens between the ranks of a replica (sums reorder at fp32 round-off)",
}


def checkpoint_folders(output_dir: str | Path) -> list[Path]:
    """Every ``checkpoint-N`` folder of ``output_dir`` (complete or not), oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _CHECKPOINT.match(p.name)]
    return sorted(found, key=lambda p: int(_CHECKPOINT.match(p.name).group(1)))


def _step_of(folder: Path) -> int:
    match = _CHECKPOINT.match(folder.name)
    return int(match.group(1)) if match else 0


def _read_run(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None


def intact_note(output_dir: str | Path) -> str:
    """What a failed save leaves intact: the newest complete checkpoint, if any."""
    complete = [p for p in checkpoint_folders(output_dir) if _read_run(p) is not None]
    return (
        f"the previous checkpoint {complete[-1]} is intact"
        if complete
        else "no earlier checkpoint was touched"
    )


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def compare_recipes(saved: dict[str, Any], state: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(refused, warned)`` differences between a checkpoint's ``ringft_run.json`` (``saved``) and
    this run's ``state`` (same keys: ``recipe``, ``world_size``, ``dp_size``), as ``key a -> b``.

    Refused: the world size / dp (they set the data order) and :data:`EXACT_KEYS`. Warned: the rest,
    e.g. ``train.lr`` or ``train.max_steps``.
    """
    refused, warned = [], []
    for key in ("world_size", "dp_size"):
        if key in saved and saved[key] != state[key]:
            refused.append(f"{key.replace('_', ' ')} {saved[key]} -> {state[key]}")
    if not saved.get("recipe"):
        return refused, warned
    old, new = _flat(saved["recipe"]), _flat(state["recipe"])
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "unset"), new.get(key, "unset")
        if key.startswith(IGNORED_KEYS) or a == b:
            continue
        note = f" ({CARRIED_OVER[key]})" if key in CARRIED_OVER else ""
        (refused if key.startswith(EXACT_KEYS) else warned).append(f"{key} {a!r} -> {b!r}{note}")
    return refused, warned


def _newest_complete(output_dir: Path) -> Path | None:
    folders = checkpoint_folders(output_dir)
    if not folders:
        return None
    complete = [p for p in folders if _read_run(p) is not None]
    newest = folders[-1]
    if not complete:
        raise RecipeError(
            f"--resume: no checkpoint in {output_dir} is complete (none holds {RUN_FILE}: cut off mid-save): "
            "move them away to start fresh, or choose another checkpoint.output_dir"
        )
    if newest != complete[-1]:
        raise RecipeError(
            f"--resume: the newest checkpoint {newest} is damaged (it lacks {RUN_FILE}: cut off mid-save); "
            f"the newest complete one is {complete[-1]} (step {_step_of(complete[-1])}): move {newest.name} "
            "away and rerun with --resume to continue from it"
        )
    return newest


class RunFolder:
    """The run's ``checkpoint.output_dir``: locked by :meth:`claim` until :meth:`release`."""

    def __init__(self, recipe: Recipe, world_size: int):
        self.recipe, self.world_size = recipe, world_size
        self.out = Path(recipe.checkpoint.output_dir)
        self.lock = OutputDirLock(self.out)
        self.metrics = MetricsFile(self.out)
        self.resume_from: str | None = None
        self.start_step = 0

    def run_state(self) -> dict[str, Any]:
        """What ``ringft_run.json`` holds: the recipe and the layout that set the data order."""
        cp = self.recipe.parallel.cp_size
        return {
            "recipe": self.recipe.to_dict(),
            "world_size": self.world_size,
            "dp_size": self.world_size // cp,
        }

    def _choose(self, resume: bool | str) -> tuple[Path | None, list[str]]:
        old_steps = sorted((self.out / "checkpoints").glob("step-*"))
        if old_steps:
            raise RecipeError(
                f"checkpoint.output_dir {str(self.out)!r} holds checkpoints of an older ringft "
                f"({old_steps[-1].relative_to(self.out)}), which this version cannot resume: choose "
                "another checkpoint.output_dir"
            )
        finished = (self.out / "final" / EXPORT_RECIPE).is_file()  # only an export: save_every 0
        if not resume:
            existing = checkpoint_folders(self.out)
            if existing:
                raise RecipeError(
                    f"checkpoint.output_dir {str(self.out)!r} already holds checkpoints of a run "
                    f"({existing[-1].name}): pass --resume to continue it, or choose another "
                    "checkpoint.output_dir (or delete them) to start a new run"
                )
            if finished:
                raise RecipeError(
                    f"checkpoint.output_dir {str(self.out)!r} holds the export of a finished run (final/): "
                    "choose another checkpoint.output_dir (or delete it) to start a new run"
                )
            return None, []
        if isinstance(resume, str):
            folder = Path(resume)
            if _read_run(folder) is None:
                raise RecipeError(
                    f"--resume {resume!r}: not a complete ringft checkpoint folder (no {RUN_FILE}): give a "
                    f"{self.out}/checkpoint-N folder"
                )
        else:
            folder = _newest_complete(self.out)
            if folder is None and finished:
                raise RecipeError(
                    f"--resume: {self.out} holds the export of a finished run (final/) and no checkpoint to "
                    "continue it from (checkpoint.save_every: 0 writes none): choose another "
                    "checkpoint.output_dir, or delete it to train again"
                )
            if folder is None:
                return None, [f"--resume: no checkpoint in {self.out}, starting fresh"]
        refused, warned = compare_recipes(_read_run(folder) or {}, self.run_state())
        if refused:
            raise RecipeError(
                f"--resume: {folder} was written by a run that differs in {'; '.join(refused)}: the data "
                "order or the model would change, so the run would not continue exactly; relaunch with the "
                "checkpoint's settings, or choose another checkpoint.output_dir to start a new run"
            )
        notes = [f"warning: resuming {folder.name} with settings that differ from it: {'; '.join(warned)}"]
        return folder, notes if warned else []

    def claim(self, resume: bool | str, is_main: bool) -> None:
        """Choose the checkpoint (read-only, every rank alike), then lock the folder (main process;
        every rank stops with the one-line reason when it is busy) and fix up ``metrics.jsonl``."""
        folder, notes = self._choose(resume)

        def lock() -> None:
            held = self.lock.acquire()
            if held:
                raise RecipeError(held)

        try:
            run_together(lock, here=is_main, share_message=True)
        except PeerFailed as exc:
            raise RecipeError(exc.message or str(exc)) from None
        if is_main:
            if self.lock.unsupported:
                print(f"warning: {self.lock.unsupported}", flush=True)
            for line in notes:
                print(line, flush=True)
            if folder is None:
                self.metrics.restart()
            else:
                self.metrics.truncate_after(_step_of(folder))
        if folder is not None:
            self.resume_from, self.start_step = str(folder), _step_of(folder)
            if is_main:
                print(f"resumed from {folder} (step {self.start_step})", flush=True)

    def attach(self, trainer: Any) -> None:
        """Let ``trainer`` (a RecipeTrainer) mark its checkpoints complete here."""
        trainer.run_folder = self

    def mark_complete(self, folder: Path, is_main: bool) -> None:
        """After every rank saved ``folder``: write its ``ringft_run.json`` (main process), then
        remove all but the newest ``checkpoint.keep`` complete checkpoints. An I/O error propagates
        (the caller, :func:`write_together`, turns it into one verdict on every rank)."""
        if not is_main:
            return
        state = {"step": _step_of(folder), **self.run_state()}
        (folder / RUN_FILE).write_text(json.dumps(state, default=str))
        complete = [p for p in checkpoint_folders(self.out) if _read_run(p) is not None]
        for old in complete[: -self.recipe.checkpoint.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def release(self) -> None:
        """Drop the lock (local, idempotent)."""
        self.lock.release()


def write_together(what: str, path: Path, write: Callable[[], None], kept: str = "") -> None:
    """Run ``write`` (collectives first, then this rank's writes) on every rank, then one verdict: an
    I/O failure on any rank ends every rank, the failing one with one line naming ``what`` at
    ``path`` (and ``kept``, what is still intact), the others naming that rank."""

    def guarded() -> None:
        try:
            write()
        except Exception as exc:  # noqa: BLE001 - I/O failures become one line, anything else propagates
            if is_io_failure(exc):
                raise io_error(what, path, exc, kept) from exc
            raise

    try:
        run_together(guarded, share_message=True)
    except PeerFailed as exc:
        raise TrainError(f"writing {what} {path} failed on rank {exc.rank}: {exc}") from None


def in_loaded_dtypes(state: dict[str, Any], dtypes: dict[str, Any]) -> dict[str, Any]:
    """The gathered ``state`` with each floating tensor back in its dtype as loaded (``dtypes``: name
    -> dtype, taken before the launch wrapped the model): a bf16 launch's FSDP holds fp32 masters,
    and the export is the model the user trained, bf16 where it was bf16 and fp32 where it was
    fp32 (LoRA adapters in fp32, a model's fp32-kept modules), as DDP and ZeRO-3 save it."""
    import torch

    def cast(name: str, value: Any) -> Any:
        if not (torch.is_tensor(value) and value.is_floating_point()) or name not in dtypes:
            return value
        return value.to(dtypes[name])

    return {k: cast(k, v) for k, v in state.items()}


def export_final(trainer: Any, recipe: Recipe) -> Path:
    """Save the final model (or LoRA adapter), tokenizer and recipe to ``output_dir/final`` (every
    rank: sharded weights are gathered). The saved config names a standard attention implementation
    (the ring is removed for the save and put back); a LoRA export also saves the base config with
    this run's RoPE / context overrides, so the adapter is evaluated with the theta it was trained at.

    Under FSDP the full state dict is gathered whatever the launch's ``fsdp_state_dict_type``
    (the Trainer's ``save_model`` writes no weights under ``SHARDED_STATE_DICT``) and saved with each
    tensor in its dtype as loaded (:func:`in_loaded_dtypes`)."""
    from ringft.model.patch import apply_ring_attention, remove_ring_attention, ring_spec

    final = Path(recipe.checkpoint.output_dir) / "final"
    model = trainer.accelerator.unwrap_model(trainer.model)  # (FSDP1 keeps its wrapper as trainer.model)
    spec = ring_spec(model)
    remove_ring_attention(model)

    def save() -> None:  # the gathers come first, the main process's writes last
        if trainer.is_fsdp_enabled:
            state = trainer.accelerator.get_state_dict(trainer.model)  # a collective: every rank
            if trainer.args.process_index == 0:
                trainer._save(str(final), state_dict=in_loaded_dtypes(state, trainer.export_dtypes))
        else:
            trainer.save_model(str(final))
        if trainer.args.process_index == 0:
            if hasattr(model, "get_base_model"):
                model.get_base_model().config.save_pretrained(str(final))
            (final / EXPORT_RECIPE).write_text(json.dumps(recipe.to_dict(), indent=1, default=str))

    write_together("the final model", final, save)
    if spec is not None:
        apply_ring_attention(
            model,
            spec.layout if spec.layout is not None else spec.group,
            spec.backend,
            attention_tile_tokens=spec.attention_tile_tokens,
            attention_checkpoint=spec.attention_checkpoint,
        )
    trainer.accelerator.wait_for_everyone()
    return final


def push_export(final: Path, repo_id: str) -> None:
    """Upload the export folder to the Hugging Face Hub repository ``repo_id`` (created if missing;
    the token is the user's ``huggingface-cli login``). A failed upload is one line naming the repo."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id, exist_ok=True)
        api.upload_folder(folder_path=str(final), repo_id=repo_id, commit_message="ringft train: final model")
    except Exception as exc:  # noqa: BLE001 - network, auth: one line, the export stays on disk
        raise TrainError(
            f"checkpoint.push_to_hub: uploading {final} to {repo_id!r} failed ({first_line(exc)}); the "
            "export is intact on disk: log in (huggingface-cli login) or fix checkpoint.hub_model_id, "
            "then upload it"
        ) from None
