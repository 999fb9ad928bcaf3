"""The ``cudnn`` backend (torch's cuDNN fused attention): refusals and ``auto``'s choice on CPU, and
exactness against fp64 attention on a GPU (the CUDA tests skip without one; run by hand on a GPU
machine, results in benchmarks/RESULTS.md).

Tolerance (CUDA): relative max error vs fp64 on the rounded bf16/fp16 inputs. One cuDNN call over
the whole sequence must stay within 2x the ``torch`` backend's error (PyTorch's flash kernel, the
same fp32-accumulated algorithm) + 4e-3 (about 2 bf16 ulps of the output scale: bf16 has 8
mantissa bits, 2^-8 = 3.9e-3); the ring schedule with cuDNN blocks within 2x the one-call error +
4e-3 (the lse merge is fp32, each block output is rounded once to bf16 before the merge).
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from ringft.ops import backends
from ringft.ops.backends import CudnnBackend, auto_backend_choice, get_backend
from ringft.ops.emulate import emulate_zigzag_attention
from ringft.ops.zigzag import zigzag_ring_attention
from tests.oracle import full_attention_fp64, per_document_attention_fp64, windowed_attention_fp64

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cudnn_refusals_name_the_fix():
    kernel = get_backend("cudnn", torch.device("cpu"))
    assert "needs CUDA" in kernel.check(torch.zeros(1, 4, 2, 64))
    assert "fp16/bf16" in CudnnBackend.problem("cuda", torch.float32, 64, (9, 0))
    assert "head_dim" in CudnnBackend.problem("cuda", torch.bfloat16, 256, (9, 0))
    assert "head_dim" in CudnnBackend.problem("cuda", torch.bfloat16, 60, (9, 0))
    assert "sm75" in CudnnBackend.problem("cuda", torch.bfloat16, 64, (7, 5))
    assert CudnnBackend.problem("cuda", torch.bfloat16, 128, (8, 0)) is None


def test_auto_prefers_cudnn_on_hopper_then_flash():
    kw = dict(flash_installed=True, flash_import_error=None, capability=(9, 0), cudnn_usable=True)
    assert auto_backend_choice("cuda", torch.bfloat16, **kw) == ("cudnn", None)
    assert auto_backend_choice("cpu", torch.bfloat16, **kw) == ("torch", None)
    assert auto_backend_choice("cuda", torch.bfloat16, **{**kw, "capability": (8, 0)}) == ("flash_attn", None)
    ampere_no_flash = {**kw, "capability": (8, 0), "flash_installed": False}
    assert auto_backend_choice("cuda", torch.bfloat16, **ampere_no_flash) == ("cudnn", None)
    name, reason = auto_backend_choice(
        "cuda", torch.bfloat16, **{**kw, "capability": (8, 6), "flash_import_error": "E"}
    )
    assert name == "cudnn" and "does not import" in reason
    # fp32 or an unsupported head_dim: get_backend passes cudnn_usable=False, torch remains.
    assert auto_backend_choice(
        "cuda", torch.float32, **{**kw, "cudnn_usable": False, "flash_installed": False}
    ) == (
        "torch",
        None,
    )


def test_auto_never_picks_cudnn_without_cudnn(monkeypatch):
    monkeypatch.setattr(backends, "_cudnn_version", lambda: 0)
    monkeypatch.setattr(backends, "_capability", lambda index: (9, 0))
    assert get_backend("auto", torch.device("cuda"), torch.bfloat16, 128).name in ("torch", "flash_attn")
    monkeypatch.setattr(backends, "_cudnn_version", lambda: 90100)
    assert get_backend("auto", torch.device("cuda"), torch.bfloat16, 128).name == "cudnn"
    assert get_backend("auto", torch.device("cuda"), torch.bfloat16, 256).name != "cudnn"
    assert get_backend("auto", torch.device("cuda"), torch.float32, 128).name != "cudnn"
    assert get_backend("auto", torch.device("cuda"), torch.bfloat16).name != "cudnn"


def _rel(x, ref):
    # The scale is floored at 1e-2 (inputs are unit normals: every non-degenerate reference here is
    # far above it) so that an exactly-zero reference measures the absolute error: dq and dk of a
    # one-key block (1 x 1) are 0 (softmax over one key has no gradient), which a kernel computes as
    # dP - D with the two fp32 sums in different orders, i.e. ~1e-7 instead of 0.
    return ((x.double() - ref).abs().max() / max(ref.abs().max().item(), 1e-2)).item()


def _inputs(shape, hq, hkv, dim, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h: torch.randn(*shape, h, dim, device="cuda", generator=gen).to(dtype)  # noqa: E731
    return make(hq), make(hkv), make(hkv), make(hq)


def _reference(q, k, v, dout, fn):
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ro, rl = fn(qd, kd, vd)
    return (ro.detach(), rl.detach(), *torch.autograd.grad(ro, (qd, kd, vd), dout.double()))


def _errors(got, ref):
    return [_rel(g, r) for g, r in zip((got[0], got[1], *got[2]), ref)]


NAMES = ("out", "lse", "dq", "dk", "dv")


def run_cudnn_checks(verbose: bool = False) -> list[str]:
    """Every case against fp64; returns the failing lines (all lines printed when ``verbose``)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    kernel = get_backend("cudnn", torch.device("cuda"))
    failures = []

    def report(case, errs, limits):
        for name, err, limit in zip(NAMES, errs, limits):
            line = f"{case} {name}: {err:.2e} (limit {limit:.2e})"
            if verbose:
                print(line)
            if err > limit:
                failures.append(line)

    for native in (None, False):  # None: probe native GQA (what runs by default); False: expand K/V
        kernel.native_gqa = native
        grid = itertools.product([torch.bfloat16, torch.float16], [(8, 8), (8, 2), (32, 8)], [64, 128])
        for dtype, (hq, hkv), dim in grid:
            for world, causal, seq in [
                (1, True, 256),
                (2, True, 256),
                (4, True, 256),
                (3, True, 6 * 23),
                (2, False, 256),
            ]:
                q, k, v, dout = _inputs((2, seq), hq, hkv, dim, dtype)
                ref = _reference(q, k, v, dout, functools.partial(full_attention_fp64, causal=causal))
                one = _errors(
                    emulate_zigzag_attention(q, k, v, 1, causal=causal, backend="torch", dout=dout), ref
                )
                base = _errors(
                    emulate_zigzag_attention(q, k, v, 1, causal=causal, backend="cudnn", dout=dout), ref
                )
                got = _errors(
                    emulate_zigzag_attention(q, k, v, world, causal=causal, backend="cudnn", dout=dout), ref
                )
                case = f"cudnn gqa={kernel.native_gqa} {dtype} heads={hq}/{hkv} dim={dim} S={seq} N={world}"
                case += f" causal={causal}"
                report(case + " one-call", base, [2 * o + 4e-3 for o in one])
                report(case, got, [2 * b + 4e-3 for b in base])
    kernel.native_gqa = None
    # Tiny blocks (cuDNN refuses 1 x 1; they run on the torch kernels): 1 x 1, 1 x 40, 5 x 5.
    for sq, sk, causal in [(1, 1, True), (1, 40, False), (5, 5, True)]:
        q, _, _, dout = _inputs((1, sq), 32, 8, 128, torch.bfloat16, seed=2)
        _, k, v, _ = _inputs((1, sk), 32, 8, 128, torch.bfloat16, seed=3)
        fn = functools.partial(full_attention_fp64, causal=causal)
        ref = _reference(q, k, v, dout, fn)
        out, lse = kernel.forward(q, k, v, causal, 128**-0.5)
        grads = kernel.backward(dout, q, k, v, out, lse, causal, 128**-0.5)
        # one torch-kernel call in bf16: 2 bf16 ulps of the output scale
        report(f"cudnn tiny block {sq}x{sk}", _errors((out, lse, grads), ref), [8e-3] * 5)
    # Packed documents (one causal cuDNN call per document) and a sliding window, bf16, GQA 32/8.
    cu = [[0, 40, 100, 240], [0, 240]]
    for world in (1, 2, 3):
        q, k, v, dout = _inputs((2, 240), 32, 8, 128, torch.bfloat16, seed=1)
        ref = _reference(q, k, v, dout, lambda a, b, c: per_document_attention_fp64(a, b, c, cu))
        base = _errors(emulate_zigzag_attention(q, k, v, 1, backend="torch", dout=dout, cu_seqlens=cu), ref)
        got = _errors(
            emulate_zigzag_attention(q, k, v, world, backend="cudnn", dout=dout, cu_seqlens=cu), ref
        )
        report(f"cudnn packed documents N={world}", got, [2 * b + 4e-3 for b in base])
        ref = _reference(q, k, v, dout, lambda a, b, c: windowed_attention_fp64(a, b, c, 64))
        base = _errors(
            emulate_zigzag_attention(q, k, v, 1, backend="torch", dout=dout, sliding_window=64), ref
        )
        got = _errors(
            emulate_zigzag_attention(q, k, v, world, backend="cudnn", dout=dout, sliding_window=64), ref
        )
        report(f"cudnn sliding window 64 N={world}", got, [2 * b + 4e-3 for b in base])
    # Attention in tiles (attention_tile_tokens, one rank): each tile's output is merged in fp32 and
    # rounded once to bf16, as an untiled call's is, so the one-call bound applies.
    q, k, v, dout = _inputs((2, 240), 32, 8, 128, torch.bfloat16, seed=4)
    for causal, tile, extra in [(True, 100, {}), (False, 37, {}), (True, 64, {"cu_seqlens": cu}),
                                (True, 50, {"sliding_window": 64})]:  # fmt: skip
        if "cu_seqlens" in extra:
            fn = lambda a, b, c: per_document_attention_fp64(a, b, c, cu)  # noqa: E731
        elif "sliding_window" in extra:
            fn = lambda a, b, c: windowed_attention_fp64(a, b, c, 64)  # noqa: E731
        else:
            fn = functools.partial(full_attention_fp64, causal=causal)
        ref = _reference(q, k, v, dout, fn)
        base = _errors(
            emulate_zigzag_attention(q, k, v, 1, causal=causal, backend="torch", dout=dout, **extra), ref
        )
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out, lse = zigzag_ring_attention(
            qg, kg, vg, causal=causal, backend="cudnn", return_lse=True, attention_tile_tokens=tile, **extra
        )
        grads = torch.autograd.grad(out, (qg, kg, vg), dout)
        report(f"cudnn tiles of {tile} causal={causal} {extra}", _errors((out, lse, grads), ref),
               [2 * b + 4e-3 for b in base])  # fmt: skip
    return failures


@cuda
@pytest.mark.numerics
def test_cudnn_exact_against_fp64():
    failures = run_cudnn_checks()
    assert not failures, "\n".join(failures)


if __name__ == "__main__":
    fails = run_cudnn_checks(verbose=True)
    print(f"{len(fails)} failures")
    for f in fails:
        print("FAIL", f)
