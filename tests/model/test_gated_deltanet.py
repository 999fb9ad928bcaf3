"""Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next text) on the zigzag ring vs the unmodified
transformers model in one process: logits, loss and every parameter's gradient at CP 1, 2, 3 and 4
(one spawn of 4 processes; the CP group of size N is ranks 0..N-1), ragged padded rows and packed
documents (each document alone through the unmodified model), and the refusals.

Both sides run inside tests/model/hybrid_models.py's ``fp64_linear_kernels``: transformers' own
linear-attention code with its ``torch.float32`` casts made fp64, so the comparison is fp64 (the
kernels' fp32 path is checked against the recurrence in tests/ops/test_linear_scan.py). Bounds:

- fp64 (logits, loss, gradients): the longest chain of fp64 sums behind a value is below
  3 layers x (hidden 32 + intermediate 48 + seq 48 x (k_dim 4 + head_dim 8)) ~ 2000 terms, so
  ~2000 eps64 = 5e-13 relative; 1e-10 leaves margin, while a wrong state, halo or document
  boundary is far larger (dropping the entering states moves the logits by 9e-5, the halos by 8e-2);
- ``grad32``: parameters whose gradient transformers forms in fp32 even in an fp64 model (the
  decoder RMSNorms' ``x.float()``, the decay ``g = -exp(A_log.float()) * softplus(a.float() +
  dt_bias)``): one fp32 rounding per token, summed over <= 2 x 48 tokens that the ring splits across
  ranks: 2 * SEQ * eps32.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringft import RingDataCollator, apply_ring_attention, cp_gather, remove_ring_attention
from ringft.model.families import check_model
from ringft.model.gated_deltanet import linear_attention_modules, linear_attention_problem
from ringft.utils.spawn import run_distributed
from tests.model.hybrid_models import fp64_linear_kernels, hybrid_model

SEQ, EPS32 = 48, torch.finfo(torch.float32).eps
BOUNDS = {"logits": 1e-10, "loss": 1e-10, "grad": 1e-10, "grad32": 2 * SEQ * EPS32}
LENGTHS = (37, 30)  # ragged rows: padded to 38..40 tokens, chunks of 19 (CP 1) .. 5 (CP 4)
PACKED = ([19, 13, 9, 5], SEQ)  # documents across and on chunk edges, one packed row
CASES = {  # tag: (model type, kind)
    "qwen3_5": ("qwen3_5_text", "padded"),
    "qwen3_5-packed": ("qwen3_5_text", "packed"),
    "qwen3_next": ("qwen3_next", "padded"),
    "qwen3_5_moe-packed": ("qwen3_5_moe_text", "packed"),
}
CP_SIZES = (1, 2, 3, 4)
FP32_GRADS = ("A_log", "dt_bias", "in_proj_a.weight", "in_proj_ba.weight")


def _examples(kind: str, seed: int = 3) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(PACKED[0] if kind == "packed" else LENGTHS):
        ids = torch.randint(3, 96, (n,), generator=gen).tolist()
        labels = list(ids)
        if i == 1:
            labels[: n // 2] = [-100] * (n // 2)  # a prompt that is not trained on
        out.append({"input_ids": ids, "labels": labels})
    return out


def _ce(logits: torch.Tensor, shift_labels: torch.Tensor, count: int) -> torch.Tensor:
    flat = logits.reshape(-1, logits.shape[-1]).double()
    return torch.nn.functional.cross_entropy(flat, shift_labels.reshape(-1), reduction="sum") / count


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _fp32(model) -> set[str]:
    norms = {f"{n}.weight" for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")}
    return norms | {n for n, _ in model.named_parameters() if n.endswith(FP32_GRADS)}


def _oracle(model_type: str, kind: str) -> dict:
    model = hybrid_model(model_type)
    examples = _examples(kind)
    if kind == "packed":  # every document alone
        total = sum(sum(x != -100 for x in ex["labels"][1:]) for ex in examples)
        logits, loss = [], torch.zeros((), dtype=torch.float64)
        for ex in examples:
            out = model(input_ids=torch.tensor([ex["input_ids"]])).logits[0]
            logits.append(out)
            loss = loss + _ce(out, torch.tensor(ex["labels"][1:] + [-100]), total)
    else:
        full = RingDataCollator(0, 1, pad_token_id=0).global_batch(examples)
        out = model(input_ids=full["input_ids"]).logits
        logits = [out[i, :n] for i, n in enumerate(LENGTHS)]
        loss = _ce(out, full["shift_labels"], int((full["shift_labels"] != -100).sum()))
    loss.backward()
    return {"logits": [x.detach() for x in logits], "loss": loss.detach(), "grads": _grads(model)}


def _ring(model_type: str, kind: str, group, rank: int, size: int) -> dict:
    model = apply_ring_attention(hybrid_model(model_type), group)
    packing = kind == "packed"
    collator = RingDataCollator(rank, size, pad_token_id=0, max_length=PACKED[1] if packing else None,
                                packing=packing)  # fmt: skip
    batch = collator(_examples(kind))
    extra = {"cu_seqlens": batch["cu_seqlens"]} if packing else {}
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **extra).logits
    loss = _ce(logits, batch["shift_labels"], int(batch["num_items_in_batch"]))
    loss.backward()
    logits = cp_gather(logits.detach(), group)
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=group)
    local = _grads(model)
    flat = torch.cat([g.flatten() for g in local.values()])
    dist.all_reduce(flat, group=group)  # each CP rank holds a partial gradient of the same replica
    grads = {
        n: part.view_as(g)
        for (n, g), part in zip(local.items(), flat.split([g.numel() for g in local.values()]))
    }
    if packing:
        (members,) = collator.last_rows  # documents are reordered inside the row
        got, at = [None] * len(members), 0
        for i in members:
            got[i] = logits[0, at : at + PACKED[0][i]]
            at += PACKED[0][i]
    else:
        got = [logits[i, :n] for i, n in enumerate(LENGTHS)]
    return {"logits": got, "loss": loss, "grads": grads, "fp32": _fp32(model)}


def _errors(got: dict, want: dict) -> dict[str, float]:
    scale = max(x.abs().max().item() for x in want["logits"])
    out = {
        "logits": max((a - b).abs().max().item() for a, b in zip(got["logits"], want["logits"])) / scale,
        "loss": abs((got["loss"] - want["loss"]) / want["loss"]).item(),
        "grad": 0.0,
        "grad32": 0.0,
    }
    for name, g in got["grads"].items():
        kind = "grad32" if name in got["fp32"] else "grad"
        err = (g - want["grads"][name]).abs().max().item() / want["grads"][name].abs().max().item()
        out[kind] = max(out[kind], err)
    return out


def hybrid_worker(rank: int, world: int, oracle_path: str) -> dict[str, float]:
    oracles = torch.load(oracle_path)
    errors: dict[str, float] = {}
    with fp64_linear_kernels():
        for size in CP_SIZES:
            group = dist.new_group(list(range(size)))
            if rank < size:
                for tag, (model_type, kind) in CASES.items():
                    got = _ring(model_type, kind, group, rank, size)
                    errors.update({f"cp{size}/{tag}/{k}": v for k, v in _errors(got, oracles[tag]).items()})
            dist.barrier()
    return errors


@pytest.fixture(scope="module")
def oracle_path(tmp_path_factory) -> str:
    with fp64_linear_kernels():
        oracles = {tag: _oracle(*case) for tag, case in CASES.items()}
    path = tmp_path_factory.mktemp("hybrids") / "oracles.pt"
    torch.save(oracles, path)
    return str(path)


@pytest.mark.numerics
@pytest.mark.timeout(300)
def test_hybrids_match_one_process_on_cp_1_to_4(oracle_path):
    results = run_distributed(hybrid_worker, max(CP_SIZES), oracle_path, timeout=240)
    worst: dict[str, float] = {}
    for rank, errors in enumerate(results):
        assert {k.split("/")[0] for k in errors} == {f"cp{s}" for s in CP_SIZES if rank < s}
        for key, err in errors.items():
            what = key.rsplit("/", 1)[1]
            assert err <= BOUNDS[what], f"{key}: {err:.2e} > {BOUNDS[what]:.1e}"
            worst[what] = max(worst.get(what, 0.0), err)
    print("worst relative errors:", ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items())))


def test_what_the_hybrids_cannot_do_on_the_ring_is_refused_by_name():
    model = apply_ring_attention(hybrid_model("qwen3_5_text", torch.float32))
    assert len(linear_attention_modules(model)) == 2
    ids = torch.randint(3, 96, (1, 8))
    with pytest.raises(ValueError, match="keep no cache on the ring"):
        model(input_ids=ids, position_ids=torch.arange(8)[None], use_cache=True)
    with pytest.raises(ValueError, match="chunks of at least linear_conv_kernel_dim - 1 = 3 tokens, got 2"):
        model(input_ids=ids[:, :4], position_ids=torch.arange(4)[None])
    model(input_ids=ids, position_ids=torch.arange(8)[None])  # chunks of 4: runs
    assert "use ulysses_size 1" in linear_attention_problem(model, model.config, 2)
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="model type qwen3_5_moe_text"):
        check_model(AutoConfig.for_model("qwen3_5_moe"), [torch.nn.Module()])
    other = hybrid_model("qwen3_next", torch.float32)
    other.config.model_type = "untested_hybrid"  # linear-attention layers outside the known hybrids
    with pytest.raises(ValueError, match=r"layer_types \['linear_attention'\]"):
        apply_ring_attention(other, allow_untested=True)
    remove_ring_attention(model)
    assert not any("forward" in vars(m) for m in linear_attention_modules(model))
