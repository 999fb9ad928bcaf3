"""Gradient error of FSDP's bf16 vs fp32 gradient reduction over N ranks (one process, simulated).

Under accelerate's ``mixed_precision: bf16`` FSDP computes each rank's gradient with bf16
parameters (a bf16 gradient per rank) and reduce-scatters it in ``reduce_dtype``. NCCL's ring
reduce-scatter adds the N ranks' contributions one hop at a time, each partial sum stored in the
reduce dtype: N - 1 roundings per element in bf16, none that matter in fp32. With ringft every rank
of the world (DP x CP) holds a partial gradient of its own tokens, so N is the whole world.

For each N this builds a tiny Llama, gives each of N ranks its own sequence, and compares with the
fp64 gradient of the whole batch (one process, fp64 parameters):

- ``rank grads``: the exact (fp64) sum of the N ranks' bf16 gradients: the error bf16 compute
  alone leaves (what an exact reduction gives);
- ``fp32 reduce``: the ranks' bf16 gradients summed in fp32 (``reduce_dtype=fp32``);
- ``bf16 reduce``: summed in bf16, rounding after every hop (``reduce_dtype=bf16``); and its error
  against the exact sum (the reduction's own error).

Errors are ``||g - oracle|| / ||oracle||`` over all parameters (2-norm). The loss of each rank is
``N x sum of its token losses / all targets`` (ringft's loss scale); FSDP's average divides by N
(a power of 2 here: exact).

    python benchmarks/bench_reduce_dtype.py [--ranks 2 8 32 64] [--tokens 128]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import describe_machine  # noqa: E402
from ringft.loss import CausalLMLoss  # noqa: E402

VOCAB, HIDDEN, INTERMEDIATE, LAYERS = 512, 128, 256, 2


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config)


def _grads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in module.parameters()]


def _norm_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(((g.double() - w.double()) ** 2).sum() for g, w in zip(got, want))
    den = sum((w.double() ** 2).sum() for w in want)
    return float((num / den).sqrt())


def measure(ranks: int, tokens: int) -> dict[str, float]:
    """The errors of one world size (see the module docstring)."""
    base = _model()
    gen = torch.Generator().manual_seed(ranks)
    ids = torch.randint(0, VOCAB, (ranks, tokens), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((ranks, 1), -100)], dim=1)
    positions = torch.arange(tokens)[None].expand(ranks, -1)
    n_all = (labels != -100).sum()

    oracle = CausalLMLoss(
        copy.deepcopy(base).double(), chunked=False, chunk_size=tokens, offload_activations=False
    )
    oracle(ids, positions, labels, n_all).backward()
    want = _grads(oracle)

    low = CausalLMLoss(copy.deepcopy(base), chunked=False, chunk_size=tokens, offload_activations=False)
    for p in low.parameters():  # bf16 parameters, fp32 buffers: FSDP's param_dtype=bf16
        p.data = p.data.to(torch.bfloat16)
    exact = [torch.zeros_like(w) for w in want]
    fp32 = [torch.zeros(w.shape, dtype=torch.float32) for w in want]
    bf16: list[torch.Tensor] | None = None
    for r in range(ranks):
        low.zero_grad(set_to_none=True)
        low(ids[r : r + 1], positions[r : r + 1], labels[r : r + 1], n_all, loss_scale=ranks).backward()
        mine = _grads(low)  # bf16, this rank's contribution before the reduction
        for e, f, g in zip(exact, fp32, mine):
            e += g.double()
            f += g.float()
        bf16 = (
            mine if bf16 is None else [(a.float() + g.float()).to(torch.bfloat16) for a, g in zip(bf16, mine)]
        )
    assert bf16 is not None
    exact = [e / ranks for e in exact]
    fp32 = [f / ranks for f in fp32]
    bf16 = [b / ranks for b in bf16]
    return {
        "rank grads": _norm_error(exact, want),
        "fp32 reduce": _norm_error(fp32, want),
        "bf16 reduce": _norm_error(bf16, want),
        "bf16 reduce vs exact sum": _norm_error(bf16, exact),
        "fp32 reduce vs exact sum": _norm_error(fp32, exact),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 32, 64])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"- command: `python benchmarks/bench_reduce_dtype.py {' '.join(sys.argv[1:])}`".rstrip())
    print(f"- machine: {describe_machine()}")
    print(f"- tiny Llama (hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}), {args.tokens} tokens per rank\n")
    columns = [
        "N",
        "rank grads (exact sum)",
        "fp32 reduce",
        "bf16 reduce",
        "bf16 vs exact sum",
        "fp32 vs exact sum",
    ]
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|")
    for n in args.ranks:
        e = measure(n, args.tokens)
        print(
            f"| {n} | {e['rank grads']:.2e} | {e['fp32 reduce']:.2e} | {e['bf16 reduce']:.2e} "
            f"| {e['bf16 reduce vs exact sum']:.2e} | {e['fp32 reduce vs exact sum']:.2e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
