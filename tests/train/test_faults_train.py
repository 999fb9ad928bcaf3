"""Faults and bad input in ``ringft train`` (issues 11 and 16), by injection.

Multi-process part: one ``run_distributed`` call (2 gloo ranks, hard timeout) walks through
- bad inputs, each launched through ``ringft.cli.main`` on both ranks: the run must end on *every*
  rank with exit code 2 and one line naming the value and the fix, before the model is loaded (the
  worker replaces the model builder by a tripwire) and without writing anything;
- faults: a full disk (ENOSPC, simulated by patching the writes) while rank 1 saves checkpoint-2 and
  while rank 0 appends to metrics.jsonl. The failing rank reports one line naming the path and "no
  space left on device"; the other rank's next collective fails at once (no hang); the previous
  checkpoint stays the one to resume from; the same for the write of the ``ringft_run.json`` that
  marks checkpoint-2 complete and for the final export (one verdict on every rank). Between faults
  the worker opens a fresh process group.
In-process part: the pieces (data checks, recipe comparison on resume, lock, metrics rewrite) one by
one.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from ringft.utils.spawn import run_distributed
from tests.tiny_training import tiny_recipe
from tests.workers import fresh_group, full_disk, one_thread

TIMEOUT = 180.0


def _save_rows(path: Path, rows: list[list[int]], labels: list[list[int]] | None = None) -> str:
    import datasets

    columns = {"input_ids": rows}
    if labels is not None:
        columns["labels"] = labels
    datasets.Dataset.from_dict(columns).save_to_disk(str(path))
    return str(path)


def _short_rows(n: int = 12, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 200, (int(torch.randint(16, 24, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]


def _listing(root: Path) -> list[tuple[str, int, int]]:
    if not root.exists():
        return []
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


def _older_ringft_checkpoint(out: Path, step: int) -> Path:
    """A checkpoint folder of an older ringft (``checkpoints/step-N``), which this one cannot resume."""
    folder = out / "checkpoints" / f"step-{step:08d}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
    return folder


def _fake_hf_checkpoint(out: Path, step: int, recipe: dict, complete: bool = True) -> Path:
    """A ``ringft train`` (Trainer) checkpoint ``checkpoint-N``; ``complete``: its ringft_run.json
    written (what every rank's finished save leads to)."""
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    if complete:
        (folder / "ringft_run.json").write_text(
            json.dumps({"step": step, "recipe": recipe, "world_size": 2, "dp_size": 2})
        )
    return folder


# ---------------------------------------------------------------------------------------------
# the worker (module level: run_distributed imports this module in each rank)
# ---------------------------------------------------------------------------------------------


def _run_bad_input(case: dict) -> dict:
    from ringft import cli
    from ringft.train import front

    def tripwire(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    real, front.build_model = front.build_model, tripwire
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = cli.main(["train", case["recipe"], "--no-progress", *case.get("args", [])])
    finally:
        front.build_model = real
    return {"rc": rc, "stderr": err.getvalue()}


def _run_fault(case: dict, rank: int) -> dict:
    """Train under an injected full disk. The rank that meets it exits (``os._exit``) right after
    recording its error, as ``ringft train`` would; the other rank must then fail at once."""
    from ringft.train import front
    from ringft.train.recipe import recipe_from_dict

    out = io.StringIO()
    result: dict = {"error": None}
    with (
        full_disk(case["target"], rank, case["at_rank"], "checkpoint-2"),
        contextlib.redirect_stdout(out),
    ):
        try:
            front.train(recipe_from_dict(case["raw"]), progress=False)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            result = {"error": type(exc).__name__, "message": str(exc), "at": time.time()}
    result["stdout"] = out.getvalue()
    return result


def _faults_worker(rank: int, world: int, cases: list[dict], store_dir: str) -> None:
    """Run ``cases`` in order; each result goes to ``store_dir/rank{rank}.json`` as soon as it is
    known (a fault, the last case, ends the rank that meets it: nothing is returned then)."""
    one_thread()
    record = Path(store_dir) / f"rank{rank}.json"
    results: dict = {}
    for index, case in enumerate(cases, start=1):
        if case["kind"] == "bad":
            results[case["name"]] = _run_bad_input(case)
            fresh_group(store_dir, index, rank, world)
        else:
            results[case["name"]] = _run_fault(case, rank)
        record.write_text(json.dumps(results))
        if case["kind"] == "fault_kept":  # the run failed on every rank with one verdict: go on
            fresh_group(store_dir, index, rank, world)
        elif case["kind"] != "bad" and rank == case["at_rank"]:
            os._exit(3)


def _faulty_run(cases: list[dict], store: Path, failing_rank: int) -> list[dict]:
    """The ranks' results; the rank that met the fault exited with code 3 (and nothing else died)."""
    store.mkdir()
    with pytest.raises(RuntimeError) as info:
        run_distributed(_faults_worker, 2, cases, str(store), timeout=TIMEOUT)
    assert re.search(rf"rank\(s\) \[{failing_rank}\] .*died with exit codes \[3\]", str(info.value)), (
        info.value
    )
    return [json.loads((store / f"rank{r}.json").read_text()) for r in range(2)]


# ---------------------------------------------------------------------------------------------
# the multi-process test
# ---------------------------------------------------------------------------------------------


def _write(path: Path, raw: dict) -> str:
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.timeout(300)
def test_bad_inputs_and_faults_on_two_ranks(tmp_path):
    from ringft.train.recipe import recipe_from_dict
    from ringft.train.run_folder import OutputDirLock

    good = _save_rows(tmp_path / "good", _short_rows())
    long_rows = _save_rows(tmp_path / "long", _short_rows()[:5] + [list(range(3, 103))])
    foreign = _save_rows(tmp_path / "foreign", _short_rows()[:5] + [[3, 4, 5000, 6] * 5])

    def recipe(name: str, dataset: str = good, **sections) -> dict:
        return tiny_recipe(tmp_path / name, dataset, **sections)

    cases: list[dict] = []
    expect: dict[str, list[str]] = {}

    def bad(
        name: str, raw: dict, words: list[str], args: list[str] | None = None, existing: bool = False
    ) -> None:
        cases.append(
            {
                "kind": "bad",
                "name": name,
                "recipe": _write(tmp_path / f"{name}.yaml", raw),
                "args": args or [],
                "out": raw["checkpoint"]["output_dir"],
                "existing": existing,
            }
        )
        expect[name] = words

    bad("lr", recipe("lr"), ["train.lr must be a number > 0, got 'fast'"], ["--train.lr", "fast"])
    bad("cp3", recipe("cp3", parallel={"cp_size": 3}), ["parallel.cp_size=3 does not divide the 2 launched"])
    bad(
        "max_steps",
        recipe("max_steps", train={"max_steps": "20"}),
        ["train.max_steps", "write 20 without quotes"],
    )
    bad(
        "log_every",
        recipe("log_every", logging={"log_every": 0}),
        ["logging.log_every must be an integer >= 1"],
    )
    bad(
        "vocab",
        recipe("vocab", model={"config": {"vocab_size": 100}}),
        ["tokenizer has 1658 tokens", "embedding has 100 rows", "model.tokenizer"],
    )
    bad(
        "long",
        recipe("long", long_rows),
        ["1 of 6 rows", "longer than data.seq_len=64", "longest 100", "data.too_long"],
    )
    bad("foreign", recipe("foreign", foreign), ["'input_ids' holds values in [3, 5000]", "outside [0, 1658)"])
    bad(
        "no_model",
        recipe("no_model", model={"config": None, "name_or_path": str(tmp_path / "missing-model")}),
        ["no such model folder"],
    )
    bad(
        "window",
        recipe("window", model={"model_type": "llama", "sliding_window": 32}),
        ["model.sliding_window=32", "has no sliding-window attention", "sliding_window: keep"],
    )

    # checkpoints already there (the Trainer's checkpoint-N folders): resume cases, a fresh start
    base = recipe("ckpt")
    incomplete = tmp_path / "incomplete"
    _fake_hf_checkpoint(incomplete, 2, base, complete=False)
    _fake_hf_checkpoint(incomplete, 4, base, complete=False)
    bad(
        "incomplete",
        recipe("incomplete"),
        ["no checkpoint", "is complete", "none holds ringft_run.json: cut off mid-save"],
        ["--resume"],
        True,
    )
    damaged = tmp_path / "damaged"
    _fake_hf_checkpoint(damaged, 2, recipe_from_dict(recipe("damaged")).to_dict())
    _fake_hf_checkpoint(damaged, 4, base, complete=False)
    bad(
        "damaged",
        recipe("damaged"),
        [
            "checkpoint-4 is damaged",
            "lacks ringft_run.json",
            "newest complete one is",
            "checkpoint-2 (step 2)",
        ],
        ["--resume"],
        True,
    )
    changed = tmp_path / "changed"
    _fake_hf_checkpoint(changed, 2, recipe_from_dict(recipe("changed", data={"seq_len": 32})).to_dict())
    bad(
        "changed",
        recipe("changed"),
        ["data.seq_len 32 -> 64", "would not continue exactly"],
        ["--resume"],
        True,
    )
    gone = str(tmp_path / "changed" / "checkpoint-9")
    bad(
        "resume_path",
        recipe("changed"),
        ["--resume", "checkpoint-9", "not a complete"],
        ["--resume", gone],
        True,
    )
    bad("fresh_over", recipe("changed"), ["already holds checkpoints", "pass --resume"], [], True)
    _older_ringft_checkpoint(tmp_path / "older", 2)
    older = ["checkpoints/step-00000002", "older ringft", "cannot resume", "another checkpoint.output_dir"]
    bad("older", recipe("older"), older, ["--resume"], True)
    held = tmp_path / "held"
    held.mkdir()
    bad("held", recipe("held"), ["is in use by another ringft run"], [], True)

    # faults: a full disk in a checkpoint save (rank 1) and in metrics.jsonl (rank 0)
    cases.append(
        {
            "kind": "fault",
            "name": "ckpt_enospc",
            "target": "checkpoint",
            "at_rank": 1,
            "raw": recipe(
                "ckpt_enospc", train={"max_steps": 3, "warmup_steps": 0}, checkpoint={"save_every": 1}
            ),
        }
    )
    cases.append(
        {
            "kind": "fault",
            "name": "metrics_enospc",
            "target": "metrics",
            "at_rank": 0,
            "raw": recipe("metrics_enospc", train={"max_steps": 3, "warmup_steps": 0}),
        }
    )

    before = {c["name"]: _listing(Path(c["out"])) for c in cases if c["kind"] == "bad"}
    lock = OutputDirLock(held)
    assert lock.acquire() is None  # another run holds the folder
    lock_file_before = _listing(held)
    metrics_case = cases.pop()  # a second call: a fault ends the call it happens in
    # the final export's weights cannot be written on rank 0 (only it writes): every rank ends with
    # one verdict and the group survives, so the metrics fault follows in the same call
    export_case = {
        "kind": "fault_kept",
        "name": "export_enospc",
        "target": "export",
        "at_rank": 0,
        "raw": recipe("export_enospc", train={"max_steps": 1, "warmup_steps": 0}),
    }
    try:
        ranks = _faulty_run(cases, tmp_path / "store", failing_rank=1)
    finally:
        lock.release()
    # checkpoint-2's ringft_run.json (rank 0 marks every rank's finished save complete) cannot be
    # written: one verdict on every rank again, checkpoint-1 stays the newest complete one
    marker_case = {
        "kind": "fault_kept",
        "name": "marker_enospc",
        "target": "marker",
        "at_rank": 0,
        "raw": recipe(
            "marker_enospc", train={"max_steps": 3, "warmup_steps": 0}, checkpoint={"save_every": 1}
        ),
    }
    second = _faulty_run([export_case, marker_case, metrics_case], tmp_path / "store2", failing_rank=0)
    for rank, more in enumerate(second):
        ranks[rank].update(more)

    for case in cases:
        name = case["name"]
        if case["kind"] != "bad":
            continue
        for rank, results in enumerate(ranks):
            got = results[name]
            lines = [line for line in got["stderr"].splitlines() if line.startswith("ringft train: error:")]
            assert got["rc"] == 2 and len(lines) == 1 and "Traceback" not in got["stderr"], (name, rank, got)
            for word in expect[name]:
                assert word in lines[0], f"{name} (rank {rank}): {word!r} not in {lines[0]!r}"
        after = _listing(Path(case["out"]))
        assert after == (lock_file_before if name == "held" else before[name]), (
            f"{name}: something was written"
        )

    # full disk while rank 1 saves checkpoint-2: one line on rank 1, rank 0 ends at once
    from ringft.train.errors import RecipeError
    from ringft.train.front_runs import RunFolder

    r0, r1 = (results["ckpt_enospc"] for results in ranks)
    assert r1["error"] == "TrainError", r1
    assert "checkpoint-2" in r1["message"] and "no space left on device" in r1["message"]
    assert "checkpoint-1 is intact" in r1["message"] and "\n" not in r1["message"]
    assert r0["error"] is not None and abs(r0["at"] - r1["at"]) < 10, (r0, r1)  # no hang
    # the cut-off checkpoint-2 is never resumed from: --resume names it and the complete checkpoint-1
    (ckpt_case,) = [c for c in cases if c["name"] == "ckpt_enospc"]
    folder = RunFolder(recipe_from_dict(ckpt_case["raw"]), world_size=2)
    with pytest.raises(RecipeError, match="checkpoint-2 is damaged .* newest complete one is .*checkpoint-1"):
        folder.claim(True, is_main=True)
    # the mostly-padding warning: once, on the main process only, with the figures
    assert len(re.findall(r"about \d+% of each batch is padding", r0["stdout"])) == 1, r0["stdout"]
    assert "padding" not in r1["stdout"]

    r0, r1 = (results["export_enospc"] for results in ranks)
    assert r0["error"] == "TrainError" and "final" in r0["message"], r0
    assert "no space left on device" in r0["message"] and "\n" not in r0["message"]
    assert r1["error"] == "TrainError" and "failed on rank 0" in r1["message"], r1
    assert abs(r0["at"] - r1["at"]) < 10, (r0, r1)

    r0, r1 = (results["marker_enospc"] for results in ranks)
    assert r0["error"] == "TrainError" and "checkpoint-2" in r0["message"], r0
    assert "no space left on device" in r0["message"] and "checkpoint-1 is intact" in r0["message"]
    assert r1["error"] == "TrainError" and "failed on rank 0" in r1["message"], r1
    assert abs(r0["at"] - r1["at"]) < 10, (r0, r1)
    folder = RunFolder(recipe_from_dict(marker_case["raw"]), world_size=2)
    with pytest.raises(RecipeError, match="checkpoint-2 is damaged .* newest complete one is .*checkpoint-1"):
        folder.claim(True, is_main=True)

    r0, r1 = (results["metrics_enospc"] for results in ranks)
    assert r0["error"] == "TrainError" and "metrics.jsonl" in r0["message"], r0
    assert "no space left on device" in r0["message"]
    assert r1["error"] is not None and abs(r0["at"] - r1["at"]) < 10, (r0, r1)


# ---------------------------------------------------------------------------------------------
# in-process pieces
# ---------------------------------------------------------------------------------------------


def _recipe(tmp_path: Path, data: str, **data_keys):
    from ringft.train.recipe import recipe_from_dict

    return recipe_from_dict(tiny_recipe(tmp_path / "out", data, data=data_keys))


@pytest.mark.parametrize("mode", ["truncate", "drop"])
def test_long_rows_truncate_or_drop_with_counts(tmp_path, mode):
    import datasets

    from ringft.train.data import check_rows

    rows = _short_rows(4) + [list(range(3, 103)), list(range(3, 83))]
    labels = [list(r) for r in rows]
    path = _save_rows(tmp_path / "d", rows, labels)
    data = check_rows(datasets.load_from_disk(path), _recipe(tmp_path, path, too_long=mode), 1658, "d")
    assert any(
        "2 of 6 rows of d are longer than data.seq_len=64 (longest 100 tokens)" in n for n in data.notes
    )
    if mode == "truncate":
        assert len(data) == 6
        cut = data.examples([4, 0])
        assert len(cut[0]["input_ids"]) == len(cut[0]["labels"]) == 64 and cut[1]["input_ids"] == rows[0]
    else:
        assert len(data) == 4 and [data.examples([i])[0]["input_ids"] for i in range(4)] == rows[:4]
    assert not list((tmp_path / "d").glob("cache-*"))  # nothing written next to the dataset


def test_label_range_and_padding_figures(tmp_path):
    import datasets

    from ringft.train.data import check_rows
    from ringft.train.errors import RecipeError

    rows = _short_rows(4)
    labels = [[-100] * 3 + r[3:] for r in rows]
    labels[2][5] = -7
    path = _save_rows(tmp_path / "d", rows, labels)
    with pytest.raises(RecipeError, match=r"'labels' holds values in .* outside \[0, 1658\) or -100"):
        check_rows(datasets.load_from_disk(path), _recipe(tmp_path, path), 1658, "d")
    labels[2][5] = 17
    path = _save_rows(tmp_path / "ok", rows, labels)
    data = check_rows(datasets.load_from_disk(path), _recipe(tmp_path, path), 1658, "ok")
    (warning,) = data.notes
    assert (
        "warning: rows hold" in warning
        and "of each batch is padding" in warning
        and "data.seq_len=64" in warning
    )


def test_resume_differences_refused_or_warned(tmp_path):
    """What a checkpoint's ringft_run.json and the resuming run may differ in (compare_recipes:
    ``(refused, warned)``; RunFolder turns them into the refusal and the warning line)."""
    from ringft.train.front_runs import compare_recipes
    from ringft.train.recipe import recipe_from_dict

    def state(raw: dict, world: int = 2) -> dict:
        return {"recipe": recipe_from_dict(raw).to_dict(), "world_size": world, "dp_size": world}

    raw = tiny_recipe(tmp_path / "out", tmp_path)
    saved = {"step": 2, **state(raw)}
    assert compare_recipes(saved, state(raw)) == ([], [])
    raw["train"]["lr"], raw["train"]["max_steps"] = 5e-4, 8
    refused, warned = compare_recipes(saved, state(raw))
    assert not refused and "train.lr 0.001 -> 0.0005" in warned and "train.max_steps 4 -> 8" in warned
    for key, value in [("micro_batch_size", 1), ("seed", 3), ("grad_accum", 2)]:
        changed = tiny_recipe(tmp_path / "out", tmp_path, train={key: value})
        refused, _ = compare_recipes(saved, state(changed))
        assert [line for line in refused if line.startswith(f"train.{key}")], refused
    refused, _ = compare_recipes(saved, state(tiny_recipe(tmp_path / "out", tmp_path), world=4))
    assert refused == ["world size 2 -> 4", "dp size 2 -> 4"]
    # Another split of the same CP group: weights and data order carry over (warned, not refused).
    split = tiny_recipe(tmp_path / "out", tmp_path, parallel={"cp_size": 2, "ulysses_size": 2})
    same_cp = tiny_recipe(tmp_path / "out", tmp_path, parallel={"cp_size": 2})
    refused, (warning,) = compare_recipes({"step": 6, **state(same_cp)}, state(split))
    assert not refused
    assert "parallel.ulysses_size 1 -> 2 (weights, optimizer state and data order carry over" in warning


def test_metrics_rewrite_after_resume(tmp_path):
    from ringft.train.run_folder import MetricsFile

    metrics = MetricsFile(tmp_path)
    for step in (1, 2, 3):
        metrics.append({"step": step, "loss": float(step)})
    with open(metrics.path, "a") as fh:
        fh.write('{"step": 4, "lo')  # killed mid-write
    assert metrics.truncate_after(2) == 2
    assert [json.loads(line)["step"] for line in metrics.path.read_text().splitlines()] == [1, 2]


def test_lock_is_exclusive_and_dies_with_its_process(tmp_path):
    from ringft.train.run_folder import OutputDirLock

    first, second = OutputDirLock(tmp_path), OutputDirLock(tmp_path)
    assert first.acquire() is None
    assert "in use by another ringft run" in second.acquire()
    first.release()
    assert second.acquire() is None
    second.release()
    # a process that holds the lock and is killed (SIGKILL) releases it
    code = (
        "import time; from ringft.train.run_folder import OutputDirLock; "
        f"OutputDirLock({str(tmp_path)!r}).acquire(); "
        "print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert "in use" in OutputDirLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    third = OutputDirLock(tmp_path)
    assert third.acquire() is None
    third.release()
