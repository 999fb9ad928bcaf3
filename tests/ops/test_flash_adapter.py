"""Contract test of the flash_attn adapter against stand-ins of every flash-attn generation.

flash-attn is CUDA-only and not installable here; ``tests/ops/flash_stubs.py`` reproduces the exact
signatures and return tuples of ``_flash_attn_forward`` / ``_flash_attn_backward`` in releases
2.4.0, 2.4.x-2.5.x, 2.6.x and 2.7.x-2.8.x (the latter as ``torch.library.custom_op`` like upstream)
and computes with fp64 math, so the test checks that the adapter calls each one right and maps its
results (out, lse layout, gradients) back correctly.
Tolerance 1e-6: fp64 throughout except the fp32 lse (rel. eps 6e-8 on values O(1-10)).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from ringft.ops import backends
from ringft.ops.backends import FlashAttnBackend, auto_backend_choice, get_backend
from ringft.ops.flash_backend import FLASH_API, flash_api_for, parse_version
from tests.ops.flash_stubs import TESTED_VERSIONS, make_stub, stub_2_6
from tests.oracle import full_attention_fp64

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version", TESTED_VERSIONS)
@pytest.mark.parametrize("head_dim", [64, 20])  # 20 exercises zero-padding to a multiple of 8
@pytest.mark.parametrize("causal", [True, False])
def test_flash_adapter_contract(version, head_dim, causal):
    calls: list = []
    backend = FlashAttnBackend(module=make_stub(version, calls), version=version)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 12, 4, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 12, 2, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 12, 2, head_dim, generator=gen, dtype=torch.float64)
    scale = head_dim**-0.5
    out, lse = backend.forward(q, k, v, causal, scale)
    ref_out, ref_lse = full_attention_fp64(q, k, v, causal)
    assert out.shape == q.shape and lse.shape == (2, 4, 12) and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    dout = torch.randn_like(q)
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, causal, scale)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    ro, _ = full_attention_fp64(qd, kd, vd, causal)
    for got, want in zip((dq, dk, dv), torch.autograd.grad(ro, (qd, kd, vd), dout)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # K/V reach the kernel with their own (fewer) heads: never expanded.
    assert [c[0] for c in calls] == ["fwd", "bwd"] and [c[2][2] for c in calls] == [2, 2]


def test_generation_by_version_and_schema():
    assert parse_version("2.7.4.post1+cu12torch2.6") == (2, 7, 4)
    expected = {
        "2.4.0": "2.4.0",
        "2.4.2": "2.4.1",
        "2.5.9": "2.4.1",
        "2.6.3": "2.6",
        "2.7.0": "2.7",
        "2.8.3": "2.7",
    }
    for version, key in expected.items():
        stub = make_stub(version, [])
        assert flash_api_for(version, stub._flash_attn_forward, stub._flash_attn_backward) is FLASH_API[key]
    # A 2.9 with the 2.7 signature is recognised by its schema; one with another signature is refused.
    stub = make_stub("2.8.3", [])
    assert flash_api_for("2.9.1", stub._flash_attn_forward, stub._flash_attn_backward) is FLASH_API["2.7"]
    old = stub_2_6([])
    with pytest.raises(RuntimeError, match="flash-attn 2.7.0: _flash_attn_forward.*pip install"):
        flash_api_for("2.7.0", old._flash_attn_forward, old._flash_attn_backward)
    with pytest.raises(RuntimeError, match="2.3.6 is too old"):
        flash_api_for("2.3.6", old._flash_attn_forward, old._flash_attn_backward)


def test_auto_choice_reasons():
    kw = dict(flash_installed=True, flash_import_error=None, capability=(9, 0))
    assert auto_backend_choice("cuda", torch.bfloat16, **kw) == ("flash_attn", None)
    assert auto_backend_choice("cpu", torch.bfloat16, **kw) == ("torch", None)
    assert auto_backend_choice("cuda", torch.bfloat16, **{**kw, "flash_installed": False}) == ("torch", None)
    name, reason = auto_backend_choice("cuda", torch.float32, **kw)
    assert name == "torch" and "fp16/bf16" in reason and "float32" in reason
    name, reason = auto_backend_choice(
        "cuda", torch.float16, **{**kw, "flash_import_error": "ImportError: x"}
    )
    assert name == "torch" and "does not import (ImportError: x)" in reason
    name, reason = auto_backend_choice("cuda", torch.float16, **{**kw, "capability": (7, 5)})
    assert name == "torch" and "sm75" in reason


def test_auto_warns_once_per_reason(monkeypatch):
    monkeypatch.setattr(FlashAttnBackend, "is_available", staticmethod(lambda: True))
    monkeypatch.setattr(backends, "_flash_import_error", lambda: None)
    monkeypatch.setattr(backends, "_capability", lambda index: (7, 0))
    monkeypatch.setattr(backends, "_WARNED", set())
    cuda = torch.device("cuda")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            assert get_backend("auto", cuda, torch.bfloat16).name == "torch"
    assert len(seen) == 1 and "sm70" in str(seen[0].message)
    monkeypatch.setattr(backends, "_capability", lambda index: (8, 0))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert get_backend("auto", cuda, torch.bfloat16).name == "flash_attn"
        assert get_backend("auto", cuda, torch.float32).name == "torch"
        assert get_backend("auto", cuda, torch.float32).name == "torch"
    assert len(seen) == 1 and "float32" in str(seen[0].message)


def test_flash_adapter_checks():
    backend = FlashAttnBackend(module=make_stub("2.8.3", []), version="2.8.3")
    assert "CUDA" in backend.check(torch.zeros(1, 2, 1, 8))
    if not FlashAttnBackend.is_available():
        assert "not installed" in FlashAttnBackend().check(torch.zeros(1, 2, 1, 8))
    assert get_backend("auto", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("xformers", torch.device("cpu"))


LAZY_CHECK = """
import json, sys
import torch
import ringft
from ringft.ops.backends import BACKENDS, FlashAttnBackend, get_backend
from ringft.ops.emulate import run_schedule

def flash_modules():
    return sorted(m for m in sys.modules if m.split(".")[0] == "flash_attn")

seen = {"found": FlashAttnBackend.is_available(), "after_import": flash_modules()}
cpu, q = torch.device("cpu"), torch.zeros(1, 4, 2, 8)
backend = FlashAttnBackend()
seen["check"] = backend.check(q)
seen["chosen"] = {name: get_backend(name, cpu, torch.bfloat16).name for name in BACKENDS}
seen["auto"] = get_backend("auto", cpu).name
shards = [torch.randn(1, 4, 2, 8) for _ in range(2)]  # a 2-rank ring on CPU through "auto", fwd + bwd
run_schedule(get_backend("auto", cpu, torch.float32), *[shards] * 4, causal=True, softmax_scale=8**-0.5)
seen["after_use"] = flash_modules()
backend.module  # the first real use imports it: the stand-in is importable, so the check sees it
seen["after_first_call"] = flash_modules()
print(json.dumps(seen))
"""


@pytest.mark.timeout(120)
def test_flash_adapter_is_lazy(tmp_path):
    """flash_attn is optional and CUDA-only: importing ringft, building every backend, choosing one on
    CPU and running the ring through ``auto`` must leave it out of ``sys.modules``. Checked in a
    fresh interpreter where a stand-in ``flash_attn`` package is importable (an eager import would
    succeed there); the stand-in is imported at the backend's first real call, which shows the
    check sees an import when there is one."""
    stand_in = tmp_path / "flash_attn"
    stand_in.mkdir()
    (stand_in / "__init__.py").write_text('__version__ = "2.8.3"\n')
    (stand_in / "flash_attn_interface.py").write_text("")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", LAZY_CHECK], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["found"], "the stand-in flash_attn must be visible to the backend"
    assert seen["after_import"] == [] and seen["after_use"] == [], seen
    assert "CUDA" in seen["check"] and seen["auto"] == "torch"
    assert seen["chosen"] == {
        "auto": "torch",
        "torch": "torch",
        "flash_attn": "flash_attn",
        "cudnn": "cudnn",
        "reference": "reference",
    }
    assert seen["after_first_call"] == ["flash_attn", "flash_attn.flash_attn_interface"], seen


@pytest.mark.parametrize("version", TESTED_VERSIONS)
def test_flash_varlen_in_document_schedule(version):
    """Packed documents through the flash adapter's varlen path (step 0) and dense path (later
    steps) inside the emulated 3-rank ring, against each document run separately."""
    from ringft.ops.documents import document_layout
    from ringft.ops.emulate import run_schedule
    from ringft.ops.sharding import cp_shard, cp_unshard
    from tests.oracle import per_document_attention_fp64

    calls: list = []
    backend = FlashAttnBackend(module=make_stub(version, calls), version=version)
    n, seq, cu = 3, 36, [[0, 5, 17, 30, 36], [0, 2, 36]]
    gen = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(2, seq, 4, 20, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, seq, 2, 20, generator=gen, dtype=torch.float64) for _ in range(2))
    shards = [[cp_shard(t, r, n) for r in range(n)] for t in (q, k, v, dout)]
    layouts = [document_layout(cu, seq, r, n) for r in range(n)]
    outs, lses, dqs, dkvs = run_schedule(
        backend, *shards, causal=True, softmax_scale=20**-0.5, layouts=layouts
    )
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = per_document_attention_fp64(qd, kd, vd, cu)
    ref_grads = torch.autograd.grad(ref_out, (qd, kd, vd), dout)
    got = (
        cp_unshard([outs[r] for r in range(n)]),
        cp_unshard([lses[r] for r in range(n)], dim=2),
        cp_unshard([dqs[r] for r in range(n)]),
        cp_unshard([g[0] for g in dkvs]),
        cp_unshard([g[1] for g in dkvs]),
    )
    for g, want in zip(got, (ref_out, ref_lse, *ref_grads)):
        torch.testing.assert_close(g.double(), want.detach(), rtol=1e-6, atol=1e-6)
    assert {c[0] for c in calls} >= {"varlen_fwd", "varlen_bwd", "fwd", "bwd"}
