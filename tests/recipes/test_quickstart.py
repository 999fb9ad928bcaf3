"""The README's 8-GPU quickstart, run end to end with the programs it calls replaced by recorders
that leave what each would leave (pack.py its output folder, a training stage its ``final/``
export), and what ``DRY_RUN`` means in every wrapper (``DRY_RUN=true`` never trains)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.recipes.shell_stubs import scratch_root

REPO = Path(__file__).resolve().parents[2]
STAGES = [f"recipes/llama3_8b_512k/stage{i}.yaml" for i in ("1_64k", "2_128k", "3_256k", "4_512k")]
TOOLS = ("python", "python3", "accelerate", "pip", "ringft")
# A stand-in that records its argv and leaves the folders the real program would write.
STUB = """#!{python}
import json, os, sys

import yaml

name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
if name.startswith("python") and args[:1] in (["-"], ["-c"]):
    os.execv({python!r}, [{python!r}, *args])
with open({log!r}, "a") as fh:
    fh.write(json.dumps([name, *args]) + "\\n")
if "data_prep/pack.py" in args:
    os.makedirs(args[args.index("--output") + 1], exist_ok=True)
if name == "accelerate" and "train" in args:
    recipe = yaml.safe_load(open(args[args.index("train") + 1]))
    final = os.path.join(recipe["checkpoint"]["output_dir"], "final")
    os.makedirs(final, exist_ok=True)
    open(os.path.join(final, "ringft_recipe.json"), "w").write("{{}}")
"""


def _quickstart() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Quickstart: a real 8-GPU node", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def _run(root: Path, script: str, **env: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    stubs, log = root / ".stubs", root / ".calls.jsonl"
    stubs.mkdir(exist_ok=True)
    log.unlink(missing_ok=True)
    for tool in TOOLS:
        (stubs / tool).write_text(STUB.format(python=sys.executable, log=str(log)))
        (stubs / tool).chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if k not in ("DRY_RUN", "STAGES", "PYTHON", "ACCELERATE")}
    clean["PATH"] = f"{stubs}{os.pathsep}{clean['PATH']}"
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=root, env={**clean, **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


def test_quickstart_packs_every_stage_trains_them_and_evaluates_what_they_wrote(tmp_path):
    root = scratch_root(tmp_path)
    proc, calls = _run(root, _quickstart())
    assert proc.returncode == 0, proc.stderr
    packs = [c for c in calls if "data_prep/pack.py" in c]
    for pack in packs:  # the quoted glob reaches pack.py as one argument
        assert pack[pack.index("--source") + 1] == "/data/books/*.jsonl"
    wanted = [yaml.safe_load((REPO / s).read_text())["data"] for s in STAGES]
    got = [(int(p[p.index("--seq-len") + 1]), p[p.index("--output") + 1]) for p in packs]
    assert got == [(d["seq_len"], d["path"]) for d in wanted]
    trains = [c[c.index("train") + 1] for c in calls if c[0] == "accelerate" and "train" in c]
    assert trains == STAGES
    evals = [c for c in calls if c[0] == "accelerate" and "eval-lines" in c]
    model = evals[0][evals[0].index("--model") + 1]
    last = yaml.safe_load((REPO / STAGES[-1]).read_text())["checkpoint"]["output_dir"]
    assert model == f"{last}/final" and (root / model).is_dir()
    for line in README_EVAL_BLOCK():  # the evaluation section's model is the same export
        assert f"M={last}/final;" in line


def README_EVAL_BLOCK() -> list[str]:
    text = (REPO / "README.md").read_text()
    return [line for line in text.splitlines() if line.startswith("M=outputs/")]


def test_stage_wrapper_checks_every_stage_data_before_stage_one(tmp_path):
    root = scratch_root(tmp_path)
    (root / "data/llama3-packed-64k").mkdir(parents=True)  # stage 1's data only
    proc, calls = _run(root, "bash recipes/llama3_8b_512k/run.sh")
    assert proc.returncode == 1 and not [c for c in calls if c[0] == "accelerate"]
    for folder in ("128k", "256k", "512k"):
        assert f"data.path data/llama3-packed-{folder}, which does not exist" in proc.stderr
    assert "packed-64k" not in proc.stderr


WRAPPERS = [
    "demo_cpu.sh",
    "llama3_8b_512k/run.sh",
    "llama3_8b_512k/run_lora.sh",
    "mistral_7b_512k/run.sh",
    "smollm2_32k/run.sh",
    "smollm2_32k/measure.sh",
    "trl_sft/run.sh",
    "trl_sft/run_cpu.sh",
    "trl_dpo/run.sh",
    "trl_dpo/run_cpu.sh",
    "trl_grpo/run.sh",
    "trl_grpo/run_cpu.sh",
]


def test_dry_run_means_the_same_in_every_wrapper(tmp_path):
    """``DRY_RUN=true`` prints (as ``DRY_RUN=1``, tested with each wrapper) and runs no program (the
    CPU variants do not fetch their model either), a value that is neither yes nor no is refused;
    neither launches anything."""
    root = scratch_root(tmp_path)
    for wrapper in WRAPPERS:
        proc, calls = _run(root, f"bash recipes/{wrapper}", DRY_RUN="true")
        assert proc.returncode == 0, (wrapper, proc.stderr)
        assert calls == [], wrapper  # printed: nothing launched, nor a model downloaded and built
        assert "launch" in proc.stdout, wrapper
        if wrapper not in ("llama3_8b_512k/run.sh", "smollm2_32k/measure.sh", "trl_sft/run.sh"):
            continue  # (one shared function: one wrapper per way of calling it)
        refused, calls = _run(root, f"bash recipes/{wrapper}", DRY_RUN="maybe")
        assert refused.returncode == 2 and "DRY_RUN=maybe" in refused.stderr, wrapper
        assert not [c for c in calls if c[0] == "accelerate"], wrapper
