"""CUDA backends inside the zigzag schedule vs fp64 full attention (runs only where CUDA is).

CI has no GPU, so this module skips there; it is run on a GPU machine by hand
(``python -m pytest tests/ops/test_cuda_backend.py`` or ``python tests/ops/test_cuda_backend.py``) and its
results are recorded in benchmarks/RESULTS.md.

Tolerance: relative max error vs fp64 on the rounded inputs must be <= 2x the error of one fused
call over the whole sequence (same backend, same dtype) + 4e-3 for bf16/fp16, and 2e-5 for fp32
(efficient kernel; TF32 disabled).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ringft.ops.backends import FlashAttnBackend
from ringft.ops.emulate import emulate_zigzag_attention
from tests.oracle import full_attention_fp64

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


def run_cuda_checks(verbose: bool = False) -> list[str]:
    torch.backends.cuda.matmul.allow_tf32 = False
    backends = ["torch", "cudnn"] + (["flash_attn"] if FlashAttnBackend.is_available() else [])
    failures = []
    grid = itertools.product(
        backends,
        [torch.bfloat16, torch.float16, torch.float32],
        [(8, 8), (8, 2), (8, 1)],
        [64, 80, 128],
        [1, 2, 4],
        [True, False],
    )
    for backend, dtype, (hq, hkv), dim, world, causal in grid:
        if backend in ("flash_attn", "cudnn") and dtype == torch.float32:
            continue
        if backend == "cudnn" and dim % 8:
            continue
        gen = torch.Generator(device="cuda").manual_seed(0)
        shape = (2, 256)
        q = torch.randn(*shape, hq, dim, device="cuda", generator=gen).to(dtype)
        k = torch.randn(*shape, hkv, dim, device="cuda", generator=gen).to(dtype)
        v = torch.randn(*shape, hkv, dim, device="cuda", generator=gen).to(dtype)
        dout = torch.randn(*shape, hq, dim, device="cuda", generator=gen).to(dtype)
        qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
        ro, rl = full_attention_fp64(qd, kd, vd, causal)
        ref = (ro.detach(), rl.detach(), *torch.autograd.grad(ro, (qd, kd, vd), dout.double()))
        got = emulate_zigzag_attention(q, k, v, world, causal=causal, backend=backend, dout=dout)
        base = emulate_zigzag_attention(q, k, v, 1, causal=causal, backend=backend, dout=dout)
        for name, g, b, r in zip(
            ("out", "lse", "dq", "dk", "dv"), (got[0], got[1], *got[2]), (base[0], base[1], *base[2]), ref
        ):
            err = _rel(g, r)
            limit = 2e-5 if dtype == torch.float32 else 2 * _rel(b, r) + 4e-3
            line = (
                f"{backend} {dtype} heads={hq}/{hkv} dim={dim} N={world} causal={causal} "
                f"{name}: {err:.2e} (limit {limit:.2e})"
            )
            if verbose:
                print(line)
            if err > limit:
                failures.append(line)
    return failures


def test_cuda_backends_in_zigzag_schedule():
    failures = run_cuda_checks()
    assert not failures, "\n".join(failures)


if __name__ == "__main__":
    fails = run_cuda_checks(verbose=True)
    print(f"{len(fails)} failures")
    for f in fails:
        print("FAIL", f)
