"""The long-context launchers turn on torch's expandable segments unless the user chose otherwise.

At 384K tokens on an H200 the caching allocator held 13.8 GiB reserved but unallocated when a step
ran out of memory, 0.17 GiB with ``expandable_segments:True`` (benchmarks/RESULTS.md). The launcher
(``accelerate``) is replaced by a script that records the variable it was started with.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _launch_env(script: str, tmp_path: Path, preset: str | None) -> str:
    record = tmp_path / "conf"
    stub = tmp_path / "accelerate"
    stub.write_text(f'#!/usr/bin/env bash\nprintf %s "${{PYTORCH_CUDA_ALLOC_CONF-unset}}" > {record}\n')
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "STAGES", "DRY_RUN")}
    env.update(ACCELERATE=str(stub), STAGES="1")
    if preset is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = preset
    # a stage wrapper checks its data folder before launching: point it at one that exists
    extra = ["--data.path", str(tmp_path)] if "512k" in script else []
    subprocess.run(["bash", script, *extra], cwd=REPO, env=env, check=True, capture_output=True, timeout=60)
    return record.read_text()


@pytest.mark.parametrize("script", ["recipes/llama3_8b_512k/run.sh", "recipes/trl_sft/run.sh"])
def test_expandable_segments_unless_set(script, tmp_path):
    assert _launch_env(script, tmp_path, None) == "expandable_segments:True"
    assert _launch_env(script, tmp_path, "max_split_size_mb:512") == "max_split_size_mb:512"
