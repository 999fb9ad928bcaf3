"""Run the shipped shell scripts for real, with the programs they call replaced by recorders.

:func:`run_script` runs ``bash recipes/SCRIPT`` from a scratch root whose ``PATH`` starts with
stand-ins for ``python``, ``python3``, ``accelerate`` and ``pip``: each appends its argument vector
to a log and succeeds (``python -m venv DIR`` also puts the stand-ins into ``DIR/bin``; inline
Python, ``python -`` / ``python -c``, really runs). :func:`check_command` then checks one recorded
command against what it calls: the file or module exists in this repository, an ``accelerate
launch`` config exists and every launch flag is one accelerate knows, and the called program's own
argument parser accepts the arguments (``ringft train``: the recipe loads with the overrides).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import yaml

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("python", "python3", "accelerate", "pip")
# Variables the scripts read: a value in the test's own environment must not leak into a run.
KNOBS = (
    "STAGES DRY_RUN ACCELERATE ACCELERATE_CONFIG LAUNCH_ARGS PYTHON NUM_GPUS SIDES STYLES LENGTHS DEPTHS"
    " CASES BEFORE AFTER OUT SOURCE MODEL RECORDS NUM_PROC TEXT_COLUMN RINGFT_VENV"
).split()

STUB = """#!{python}
import json, os, shutil, sys

name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
if name.startswith("python") and args[:1] in (["-"], ["-c"]):
    os.execv({python!r}, [{python!r}, *args])  # inline code really runs (e.g. reading a YAML key)
with open({log!r}, "a") as fh:
    fh.write(json.dumps([name, *args]) + "\\n")
if name.startswith("python") and args[:2] == ["-m", "venv"]:
    os.makedirs(os.path.join(args[2], "bin"), exist_ok=True)
    for tool in {tools!r}:
        shutil.copy(__file__, os.path.join(args[2], "bin", tool))
"""


@dataclass
class Run:
    """A finished script run: exit code, output, and the recorded commands (argv lists, in order)."""

    returncode: int
    stdout: str
    stderr: str
    commands: list[list[str]]


def scratch_root(tmp_path: Path) -> Path:
    """A repo root holding what the scripts touch: recipes/, setup.cfg, pyproject.toml, and an empty
    stand-in for the shipped demo base model (demo_cpu.sh checks that it exists)."""
    root = tmp_path / "root"
    shutil.copytree(REPO / "recipes", root / "recipes")
    for name in ("setup.cfg", "pyproject.toml"):
        shutil.copy(REPO / name, root / name)
    base = root / "ringft" / "assets" / "demo_base"
    base.mkdir(parents=True)
    (base / "model.safetensors").write_bytes(b"")
    return root


def run_script(root: Path, script: str, *args: str, **env: str) -> Run:
    """``bash recipes/SCRIPT ARGS`` in ``root`` (see :func:`scratch_root`) with the stand-ins first on
    ``PATH``; ``env`` adds variables."""
    stubs, log = root / ".stubs", root / ".stub-calls.jsonl"
    stubs.mkdir(exist_ok=True)
    log.unlink(missing_ok=True)
    text = STUB.format(python=sys.executable, log=str(log), tools=TOOLS)
    for tool in TOOLS:
        (stubs / tool).write_text(text)
        (stubs / tool).chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if k not in KNOBS}
    clean["PATH"] = f"{stubs}{os.pathsep}{clean.get('PATH', '')}"
    proc = subprocess.run(
        ["bash", str(root / "recipes" / script), *args],
        cwd=root,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    commands = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return Run(proc.returncode, proc.stdout, proc.stderr, commands)


class _Parsed(Exception):
    pass


def parsed_by(main, argv: list[str]) -> argparse.Namespace:
    """Call ``main(argv)`` and stop right after its argument parser accepted ``argv`` (nothing runs)."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        try:
            main(argv)
        except _Parsed as done:
            return done.args[0]
        except SystemExit as exc:
            raise AssertionError(f"{argv} refused by {main.__module__}: exit {exc.code}") from None
    raise AssertionError(f"{main.__module__}.main returned without parsing its arguments")


def _script_main(path: Path):
    spec = importlib.util.spec_from_file_location(f"_checked_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _check_ringft(argv: list[str], data_dir: Path) -> str:
    """``ringft SUBCOMMAND ARGS`` as the CLI would take it (without running anything)."""
    from ringft.cli import COMMANDS

    sub, rest = argv[0], argv[1:]
    assert sub in COMMANDS, f"ringft has no subcommand {sub!r}"
    if sub == "train":
        recipe, *overrides = [a for a in rest if a not in ("--resume", "--no-progress")]
        from ringft.train.recipe import load_recipe

        raw = yaml.safe_load((REPO / recipe).read_text())
        if (raw.get("data") or {}).get("path") is not None:  # the packed data is not in the repository
            overrides += ["--data.path", str(data_dir)]
        load_recipe(REPO / recipe, overrides)
    elif sub == "eval-lines":
        from ringft.evals.lines.task import main

        parsed_by(main, rest)
    else:
        from ringft.planner import plan_main

        parsed_by(plan_main, rest)
    return f"ringft {sub}"


def _check_python(args: list[str], data_dir: Path) -> str:
    if args[:1] == ["-m"]:
        module, rest = args[1], args[2:]
        if module in ("venv", "pip"):
            assert rest, f"python -m {module} without arguments"
            return module
        if module == "ringft":
            return _check_ringft(rest, data_dir)
        assert importlib.util.find_spec(module) is not None, f"no module {module}"
        parsed_by(importlib.import_module(module).main, rest)
        return module
    script, rest = args[0], args[1:]
    assert (REPO / script).is_file(), f"{script} does not exist in the repository"
    parsed_by(_script_main(REPO / script), rest)
    return script


def launched(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """An ``accelerate launch ... -m MODULE ARGS`` command as accelerate parses it, and ``[MODULE,
    *ARGS]``."""
    from accelerate.commands.launch import launch_command_parser

    assert argv[:2] == ["accelerate", "launch"], f"{argv[:2]}: only `accelerate launch` is expected"
    try:
        launch = launch_command_parser().parse_args(argv[2:])
    except SystemExit as exc:
        raise AssertionError(f"accelerate launch refuses {argv[2:]}: exit {exc.code}") from None
    assert launch.module, "ringft is launched as a module (-m ringft)"
    return launch, [launch.training_script, *launch.training_script_args]


def script_namespace(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """A ``python SCRIPT.py ARGS`` command: the script, and ARGS as its own parser reads them."""
    assert os.path.basename(argv[0]).startswith("python") and argv[1].endswith(".py"), argv
    return argv[1], parsed_by(_script_main(REPO / argv[1]), argv[2:])


def _check_launch(argv: list[str], data_dir: Path) -> str:
    launch, module = launched(argv)
    assert launch.config_file and (REPO / launch.config_file).is_file(), f"no config {launch.config_file}"
    return _check_python(["-m", *module], data_dir)


def check_command(argv: list[str], data_dir: Path) -> str:
    """Check one recorded command (see the module docstring); returns what it runs, e.g. ``"ringft
    train"``, ``"data_prep/pack.py"``, ``"pip"``. ``data_dir``: an existing folder standing in for
    a recipe's packed data."""
    name, args = os.path.basename(argv[0]), argv[1:]
    if name == "accelerate":
        return _check_launch(argv, data_dir)
    if name.startswith("python"):
        return _check_python(args, data_dir)
    if name == "pip":
        return "pip"
    raise AssertionError(f"unexpected program {name}")
