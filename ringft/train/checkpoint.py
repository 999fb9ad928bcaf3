"""Checkpoints: atomic saves, which one to resume from, whether the resumed recipe may continue it,
and the final export.

Layout: ``output_dir/checkpoints/step-NNNNNNNN/`` holds accelerate's state (model, optimizer,
schedulers, RNG; DeepSpeed's ZeRO shards) and ``trainer_state.json`` with the step, the recipe, the
world size and a manifest (every file with its size). A save writes ``step-N.tmp`` and renames it
when complete, so a crash mid-save never leaves a folder that looks like a checkpoint; a checkpoint
whose manifest does not match the disk (a file lost or cut) is *damaged* and never resumed from.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from ringft.train.errors import RecipeError, io_error, is_io_failure

__all__ = [
    "CHECKPOINT_PREFIX",
    "STATE_FILE",
    "checkpoint_folders",
    "complete_checkpoints",
    "compare_recipes",
    "check_resumable",
    "export_final",
    "missing_files",
    "read_state",
    "resume_point",
    "save_checkpoint",
]

CHECKPOINT_PREFIX = "step-"
STATE_FILE = "trainer_state.json"
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


def _step_of(folder: Path) -> int:
    return int(folder.name[len(CHECKPOINT_PREFIX) :])


def checkpoint_folders(output_dir: str | Path) -> list[Path]:
    """Every ``checkpoints/step-N`` folder (complete or not; never ``*.tmp``), oldest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and p.name[len(CHECKPOINT_PREFIX) :].isdigit()
    ]
    return sorted(found, key=_step_of)


def read_state(folder: Path) -> dict[str, Any] | None:
    """``trainer_state.json`` of a checkpoint folder, or None when missing or unreadable."""
    try:
        return json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def missing_files(folder: Path) -> list[str]:
    """What a checkpoint folder lacks: its state file, or files of its manifest (missing or cut)."""
    state = read_state(folder)
    if state is None:
        return [STATE_FILE if not (folder / STATE_FILE).exists() else f"a readable {STATE_FILE}"]
    lacking = []
    for rel, size in (state.get("files") or {}).items():
        path = folder / rel
        if not path.is_file():
            lacking.append(rel)
        elif path.stat().st_size != size:
            lacking.append(f"{rel} (cut: {path.stat().st_size} of {size} bytes)")
    return lacking


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete (undamaged) checkpoints, oldest first."""
    return [p for p in checkpoint_folders(output_dir) if not missing_files(p)]


def resume_point(output_dir: str | Path) -> Path | None:
    """The checkpoint ``--resume`` continues from: the newest, which must be complete.

    None when ``checkpoints/`` holds no checkpoint folder (a fresh start). Raises
    :class:`RecipeError` naming every folder and what it lacks when none is complete, and naming the
    damaged newest one and the newest complete one when only the newest is damaged.
    """
    folders = checkpoint_folders(output_dir)
    if not folders:
        return None
    lacks = {p: missing_files(p) for p in folders}
    complete = [p for p in folders if not lacks[p]]
    if not complete:
        detail = "; ".join(f"{p.name} lacks {', '.join(lacks[p][:3])}" for p in folders)
        raise RecipeError(
            f"--resume: no checkpoint in {Path(output_dir) / 'checkpoints'} is complete ({detail}): move "
            "them "
            "away to start fresh, or choose another checkpoint.output_dir"
        )
    newest = folders[-1]
    if lacks[newest]:
        raise RecipeError(
            f"--resume: the newest checkpoint {newest} is damaged (it lacks "
            f"{', '.join(lacks[newest][:3])}); the "
            f"newest complete one is {complete[-1]} (step {_step_of(complete[-1])}): move {newest.name} "
            "out of "
            "checkpoints/ and rerun with --resume to continue from it"
        )
    return newest


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def compare_recipes(saved: dict[str, Any], state: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(refused, warned)`` differences between a checkpoint's ``trainer_state.json`` (``saved``)
    and this run's ``state`` (same keys: ``recipe``, ``world_size``, ``dp_size``), as ``key a -> b``.

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


def _write_json_durably(path: Path, obj: Any) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1, default=str)
        fh.flush()
        os.fsync(fh.fileno())


def _manifest(folder: Path) -> dict[str, int]:
    return {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != STATE_FILE
    }


def save_checkpoint(
    accelerator: Any, output_dir: str | Path, step: int, state: dict[str, Any], keep: int
) -> Path:
    """Write ``checkpoints/step-N`` atomically and keep the newest ``keep`` complete ones.

    ``state`` (recipe, world size, ...) goes into ``trainer_state.json`` with the step and the
    manifest. Every rank calls this (accelerate's ``save_state`` writes per-rank files). A failed
    write (a full disk) raises a one-line :class:`TrainError` on the rank that met it; the previous
    checkpoint is untouched (old ones are removed only after the new one is complete).
    """
    root = Path(output_dir) / "checkpoints"
    final = root / f"{CHECKPOINT_PREFIX}{step:08d}"
    tmp = root / f"{final.name}.tmp"
    previous = complete_checkpoints(output_dir)
    kept = (
        f"the previous checkpoint {previous[-1]} is intact"
        if previous
        else "no earlier checkpoint was touched"
    )
    main = accelerator.is_main_process
    if main:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as exc:
            raise io_error("checkpoint", tmp, exc, kept) from exc
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))
    except Exception as exc:  # noqa: BLE001 - I/O failures become one line, anything else propagates
        if is_io_failure(exc):
            raise io_error("checkpoint", tmp, exc, kept) from exc
        raise
    accelerator.wait_for_everyone()
    if main:
        try:
            _write_json_durably(tmp / STATE_FILE, {"step": step, **state, "files": _manifest(tmp)})
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except OSError as exc:
            raise io_error("checkpoint", tmp, exc, kept) from exc
        for old in complete_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def check_resumable(folder: Path, state: dict[str, Any]) -> list[str]:
    """Refuse (:class:`RecipeError`) resuming ``folder`` with a run whose ``state`` breaks exactness;
    return the warning lines for the other differences (empty when the recipes agree)."""
    saved = read_state(folder) or {}
    refused, warned = compare_recipes(saved, state)
    if refused:
        raise RecipeError(
            f"--resume: {folder} was written by a run that differs in {'; '.join(refused)}: the data order "
            "or the "
            "model would change, so the run would not continue exactly; relaunch with the checkpoint's "
            "settings, "
            "or choose another checkpoint.output_dir to start a new run"
        )
    if warned:
        return [f"warning: resuming {folder.name} with settings that differ from it: {'; '.join(warned)}"]
    return []


def export_final(
    accelerator: Any,
    wrapped: Any,
    sharded: bool,
    recipe_dict: dict[str, Any],
    tokenizer: Any,
    output_dir: str | Path,
    cp_group: Any,
    backend: str,
) -> Path:
    """Save the final model (or LoRA adapter), tokenizer and recipe to ``output_dir/final``.

    ``wrapped``: the prepared :class:`ringft.loss.CausalLMLoss`; ``sharded``: FSDP / DeepSpeed, whose
    weights are first gathered into a full state dict (a collective, on every rank). The saved
    config names a standard attention implementation (the ring is removed for the save and put
    back). A LoRA export also saves the base config with this run's RoPE / context overrides, so
    the adapter is evaluated with the theta it was trained at.
    """
    from ringft.model.patch import apply_ring_attention, remove_ring_attention, ring_spec

    final = Path(output_dir) / "final"
    state = None
    if sharded:
        full = accelerator.get_state_dict(wrapped)
        if full is not None:  # (DeepSpeed returns it on the main process only)
            state = {k.removeprefix("model."): v for k, v in full.items()}
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(wrapped).model
        tiles = getattr(ring_spec(model), "attention_tile_tokens", None)
        remove_ring_attention(model)
        try:
            model.save_pretrained(str(final), state_dict=state)
            if hasattr(model, "get_base_model"):
                model.get_base_model().config.save_pretrained(str(final))
            tokenizer.save_pretrained(str(final))
            (final / "ringft_recipe.json").write_text(json.dumps(recipe_dict, indent=1, default=str))
        except Exception as exc:  # noqa: BLE001 - I/O failures become one line, anything else propagates
            if is_io_failure(exc):
                raise io_error("the final model", final, exc) from exc
            raise
        apply_ring_attention(model, cp_group, backend, attention_tile_tokens=tiles)
    accelerator.wait_for_everyone()
    return final
