"""The mixin's training step under FSDP2 (``fully_shard``, what accelerate's ``fsdp_version: 2``
applies) and FSDP1 against one process; see tests/train/hf_fsdp.py for the setup and the tolerance.
The steps run inside the 2-process spawn of tests/train/conftest.py (one process start for every
2-rank test)."""

from __future__ import annotations

import pytest

from tests.train.hf_fsdp import RTOL


@pytest.mark.numerics
@pytest.mark.timeout(600)
def test_fsdp2_and_fsdp1_steps_match_one_process(hf_two):
    for rank, name in enumerate(("fsdp", "fsdp@1")):
        for version, res in hf_two[name]["versions"].items():
            worst = max(res["errors"], key=res["errors"].get)
            assert res["errors"][worst] <= RTOL, (
                f"FSDP{version} rank {rank}: {worst} off by {res['errors'][worst]:.2e}"
            )
            # gradients stay sharded after every micro-step (about half of them per rank)
            assert max(res["held"]) <= res["total"] / 2 + 64, (version, res["held"], res["total"])
