"""Code that runs inside ``run_distributed``'s spawned ranks, shared by the trainer tests.

Spawned ranks import a worker by its module path, so everything here is a plain module-level
function (no fixtures). Trainings are expensive to launch (each process imports torch +
transformers: seconds on CPU), so runs that belong together share one ``run_distributed`` call:
``Accelerator.end_training()`` destroys the default process group, so between runs
:func:`fresh_group` resets accelerate's shared state and opens a fresh gloo group (a FileStore in the
test's tmp dir). A run that must start from a crash (``--resume`` after a SIGKILL) always starts in
fresh processes. Crashes are injected by :func:`inject_kill`, not by the library.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ringft.train.recipe import recipe_from_dict
from tests.tiny_training import RUN_TIMEOUT


def one_thread() -> None:
    """Keep run_distributed's one thread per rank. With OMP_NUM_THREADS unset, accelerate's MULTI_CPU
    setup calls ``torch.set_num_threads(physical cores / LOCAL_WORLD_SIZE)``, and run_distributed
    does not set LOCAL_WORLD_SIZE (read as 1): every rank would take all cores (2.5x slower here)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def fresh_group(store_dir: str, index: int, rank: int, world: int) -> None:
    """Prepare this process for another Trainer after ``end_training`` destroyed the group."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    if not dist.is_initialized():
        Path(store_dir).mkdir(parents=True, exist_ok=True)  # (a FileStore in a missing folder hangs)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_dir}/pg-{index}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=RUN_TIMEOUT),
        )


@contextlib.contextmanager
def full_disk(target: str, rank: int, at_rank: int, checkpoint_part: str):
    """Writes of ``target`` on ``at_rank`` fail with ENOSPC: ``checkpoint`` (torch.save of a path
    containing ``checkpoint_part``), ``marker`` (the ``ringft_run.json`` that marks that checkpoint
    complete), ``metrics`` (appends to metrics.jsonl, which :mod:`ringft.train.run_folder` writes)
    or ``export`` (the weights of ``output_dir/final``)."""
    from ringft.train import run_folder

    def enospc(path) -> OSError:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    import transformers.modeling_utils as modeling

    real_save, real_safe_save, real_write_text = torch.save, modeling.safe_save_file, Path.write_text

    def save(obj, f, *args, **kwargs):
        if target == "checkpoint" and checkpoint_part in str(f):
            raise enospc(f)
        return real_save(obj, f, *args, **kwargs)

    def safe_save(tensors, filename, *args, **kwargs):
        if target == "export" and "final" in Path(filename).parts:
            raise enospc(filename)
        return real_safe_save(tensors, filename, *args, **kwargs)

    def write_text(path, *args, **kwargs):
        if target == "marker" and path.name == "ringft_run.json" and checkpoint_part in str(path):
            raise enospc(path)
        return real_write_text(path, *args, **kwargs)

    def open_(path, mode="r", *args, **kwargs):
        if target == "metrics" and str(path).endswith("metrics.jsonl") and "a" in mode:
            raise enospc(path)
        return open(path, mode, *args, **kwargs)

    if rank == at_rank:
        torch.save, run_folder.open, modeling.safe_save_file = save, open_, safe_save
        Path.write_text = write_text
    try:
        yield
    finally:
        torch.save, modeling.safe_save_file, Path.write_text = real_save, real_safe_save, real_write_text
        run_folder.__dict__.pop("open", None)


def inject_kill(trainer, folder, spec: str, rank: int) -> None:
    """SIGKILL this process at a point of a ``ringft train`` run: ``step:N:R`` (rank R, right after
    optimizer step N) or ``save:N:R`` (rank R, inside the save of step N: after every rank wrote
    ``checkpoint-N``, before its ``ringft_run.json`` marks it complete)."""
    import signal

    from transformers import TrainerCallback

    point, at_step, at_rank = spec.split(":")
    if int(at_rank) != rank:
        return

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "step":

        class Kill(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == int(at_step):
                    die()

        trainer.add_callback(Kill())
    elif point == "save":
        mark_complete = folder.mark_complete

        def die_before_marking(path: Path, is_main: bool) -> None:
            if Path(path).name == f"checkpoint-{int(at_step)}":
                die()
            mark_complete(path, is_main)

        folder.mark_complete = die_before_marking
    else:
        raise ValueError(f"unknown kill point {spec!r}")


def _train(run: dict, rank: int) -> dict:
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    from ringft.train import front

    recipe = recipe_from_dict(run["recipe"])
    trainer, folder = front.build_trainer(recipe, resume=run.get("resume", False), progress=False)
    try:
        if run.get("kill"):
            inject_kill(trainer, folder, run["kill"], rank)
        if run.get("initial_adapter") and rank == 0:  # the LoRA weights a run starts from
            start_state = get_peft_model_state_dict(trainer.model)
            save_file(
                {k: v.detach().clone().contiguous() for k, v in start_state.items()}, run["initial_adapter"]
            )
        res = front._run(trainer, folder, recipe)
    finally:
        folder.release()
    return {"losses": res.losses, "start_step": folder.start_step, "steps": res.steps}


def train_runs(rank: int, world: int, runs: list[dict], store_dir: str) -> list[dict]:
    """Train each of ``runs`` in turn with ``ringft train``'s trainer: ``{"recipe": raw, "resume":
    bool | path, "kill": spec|None, "record": path|None, "initial_adapter": path|None}``. Returns
    per run the losses, the step it started from and the steps it ended at.

    ``record`` (rank 0) writes the result as JSON as soon as the run ends: a later run of the same
    call may be one that is meant to die, and then nothing is returned.
    """
    one_thread()
    results = []
    for i, run in enumerate(runs):
        if i:
            fresh_group(store_dir, i, rank, world)
        out = _train(run, rank)
        if run.get("record") and rank == 0:
            Path(run["record"]).write_text(json.dumps(out))
        results.append(out)
    return results
