"""What ``run_distributed``'s ranks run for tests/train/test_front.py (module level: spawned ranks
import it): recipes trained by ``ringft train``'s Trainer front end (:mod:`ringft.train.front`) or,
as the reference, by ringft's own loop."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from ringft.train.recipe import recipe_from_dict
from tests.workers import fresh_group, full_disk, one_thread


def _kill_callback(at_step: int):
    from transformers import TrainerCallback

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == at_step:
                os.kill(os.getpid(), signal.SIGKILL)

    return Kill()


def front_runs(rank: int, world: int, runs: list[dict], store_dir: str) -> list[dict]:
    """Train each of ``runs`` in turn: ``{"recipe": raw, "engine": "trainer" | "loop", "resume":
    bool | path, "kill": "step:N:R" | None, "record": path | None}``. Returns per run the logged
    losses and the step it started from; ``record`` (rank 0) writes them as JSON when the run ends."""
    from ringft.train import front
    from ringft.train.loop import Trainer

    one_thread()
    results = []
    for i, run in enumerate(runs):
        fresh_group(store_dir, i, rank, world)
        recipe = recipe_from_dict(run["recipe"])
        if run.get("engine", "trainer") == "loop":
            res = Trainer(recipe, progress=False).run()
            out = {"losses": res.losses, "start_step": 0}
        else:
            trainer, folder = front.build_trainer(recipe, resume=run.get("resume", False), progress=False)
            if run.get("kill"):
                _, at_step, at_rank = run["kill"].split(":")
                if int(at_rank) == rank:
                    trainer.add_callback(_kill_callback(int(at_step)))
            try:
                res = front._run(trainer, folder, recipe)
            finally:
                folder.release()
            out = {"losses": res.losses, "start_step": folder.start_step}
        if run.get("record") and rank == 0:
            Path(run["record"]).write_text(json.dumps(out))
        results.append(out)
    return results


def fault_worker(rank: int, world: int, case: dict, store_dir: str) -> None:
    """Train ``case["raw"]`` with a full disk on ``case["at_rank"]``; each rank records its error and
    the time to ``store_dir/rank{rank}.json``; the rank that met the fault then exits with code 3
    (as ``ringft train`` does), and the other must fail at its next collective."""
    import time

    from ringft.train import front

    one_thread()
    fresh_group(store_dir, 0, rank, world)
    result: dict = {"error": None}
    with full_disk(case["target"], rank, case["at_rank"], "checkpoint-2"):
        try:
            front.train(recipe_from_dict(case["raw"]), progress=False)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            result = {"error": type(exc).__name__, "message": str(exc), "at": time.time()}
    (Path(store_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    if rank == case["at_rank"]:
        os._exit(3)
