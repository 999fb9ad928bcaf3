"""The mixin's training step under FSDP2 (``fully_shard``, what accelerate's ``fsdp_version: 2``
applies) and FSDP1 against one process; see tests/train/hf_fsdp.py for the setup and the tolerance.
The steps run inside the 2-process spawn of tests/train/conftest.py (one process start for every
2-rank test)."""

from __future__ import annotations

import math

import pytest

from tests.train.hf_fsdp import MOE_RTOL, RTOL


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


@pytest.mark.numerics
@pytest.mark.timeout(600)
def test_fsdp2_moe_router_loss_step_matches_one_process(hf_two):
    """The MoE steps of tests/train/hf_fsdp.py (Qwen3-MoE, Mixtral): the logged loss (with the
    router term) and every gradient, the experts' and routers' included, == transformers in one
    process; the experts and routers were DTensors sharded on the expert (row) dim over 2 ranks."""
    for rank, name in enumerate(("fsdp", "fsdp@1")):
        assert sorted(hf_two[name]["moe"]) == ["mixtral", "qwen3_moe"]
        for family, res in hf_two[name]["moe"].items():
            assert res["loss"] <= MOE_RTOL, (rank, family, res["values"])
            # the term is there: 2 micro-batches x 0.5 x aux (~top-k = 2) over a token loss of ~ln(vocab)
            assert res["values"][1] > math.log(1658) + 1, (family, res["values"])
            worst = max(res["errors"], key=res["errors"].get)
            assert res["errors"][worst] <= MOE_RTOL, (
                f"rank {rank} {family}: {worst} {res['errors'][worst]:.2e}"
            )
            assert any(".experts." in n for n in res["errors"]) and any(".gate." in n for n in res["errors"])
            assert len(res["experts"]) == 2 * 3, sorted(res["experts"])  # per layer: gate_up, down, router
            for n, h in res["experts"].items():
                assert h["placements"] == ["S(0)"] and h["local"] == [h["shape"][0] // 2, *h["shape"][1:]], (
                    family,
                    n,
                    h,
                )
