"""Every supported family on the zigzag ring vs the unmodified transformers model in one process.

Tiny random models in fp64 (tests/model/family_models.py) on CP groups of 1, 2, 3 and 4 ranks
(one spawn of 4 processes: the CP group of size N is ranks 0..N-1; every family, window and layout
runs inside it): logits, loss and every parameter's gradient. Windows shorter than a chunk,
straddling chunk edges and longer than a chunk; windows with packed documents; decoding with a
window (RingInference vs ``model.generate``); Llama 4's chunked layers (chunks of 5 tokens, on no
zigzag chunk edge) and its NoPE layer's query temperature, on padded rows and a packed row; Mistral 4
(latent attention, queries scaled by position) on a packed row; Gemma 4 (per-layer head dims, layers
reusing an earlier layer's K/V, V = K) with a window, on padded rows and a packed row.

Oracles (unmodified transformers, one process, whole sequence; computed once, in the test process):

- ``sdpa`` in fp64: transformers builds the causal / sliding-window / padding mask itself and
  torch's SDPA computes in fp64. Bounds: both sides compute the same math with the sums in another
  order; recursive summation of n terms errs by at most (n - 1) * eps relative, so each bound is
  eps64 times the longest chain of reductions behind a value (`bounds`), relative to the largest value;
- ``eager`` (the reference implementation): its softmax runs in fp32 (``softmax(dtype=float32)``),
  so it is only fp32-accurate. Bound: twice transformers' own sdpa-vs-eager spread on the same
  input, plus the fp64 bound. Any mask, window, position or label mistake is O(1e-2) or larger.

Packed rows are compared with every document run alone (no reliance on transformers' detection of
packed rows). The loss is an fp64 cross-entropy of the logits on both sides (transformers' own loss
rounds the logits to fp32); the labels come sharded from the collator.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from ringft import RingDataCollator, apply_ring_attention, cp_gather
from ringft.utils.spawn import run_distributed
from tests.loss.router_cases import ROUTER_FAMILIES, router_run
from tests.model.family_models import COMMON, VOCAB, WINDOWED, family_model, windowed_model

EPS64, EPS32 = torch.finfo(torch.float64).eps, torch.finfo(torch.float32).eps
LENGTHS = (37, 50, 29)  # ragged rows: padded to 50..56 tokens, chunks of 25 (CP 1) .. 7 (CP 4)
SEQ = 56
HID, INTER = COMMON["hidden_size"], COMMON["intermediate_size"]
DEEP = {"gemma4": 4}  # layers of the tiny models deeper than the usual 2


def bounds(layers: int) -> dict[str, float]:
    """The fp64 bounds of a model of ``layers`` layers. Per layer: q/k/v (hidden) + attention (<= SEQ
    keys, head_dim <= 32) + o_proj (<= 4 * 32) + MLP (hidden, intermediate), then the lm_head
    (hidden): the longest chain of fp64 sums behind a logit."""
    path = layers * (HID + SEQ + 32 + 128 + HID + INTER) + HID
    out = {"logits": path * EPS64, "loss": (path + VOCAB + SEQ) * EPS64, "grad": 2 * path * EPS64}
    out["decode"] = out["logits"] + EPS32  # RingInference returns fp32 logits: one more rounding
    # Gemma's RMSNorm weights (and DeepSeek-V3's router) get their gradient as an fp32 sum over the
    # batch's tokens (transformers computes them in fp32), which the ring splits across ranks:
    # recursive fp32 summation of <= 3 * SEQ terms.
    out["grad32"] = 3 * SEQ * EPS32
    return out


WINDOWS = (1, 3, 13, 40)  # 1: itself only; 3 < every chunk; 13 straddles chunk edges; 40 > a chunk
PACKED = ([19, 13, 9, 5], 48)  # documents across and on chunk edges, one packed row of 48
DECODE_PROMPT, DECODE_NEW, DECODE_WINDOW = 30, 12, 8
CP_SIZES = (1, 2, 3, 4)
# Families whose attention call is one already covered at every CP size (or, for gpt-oss's sinks,
# covered at CP 2-4 by tests/ops/test_sinks.py) run at CP 3 only: an odd ring, uneven chunks.
# Llama 4's unpacked rows run at CP 3 (its packed row, chunks cut inside documents, at every size).
ODD_ONLY = (
    "olmo3", "smollm3", "ministral3", "mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "mistral4", "llama4",
    "gemma4-packed-w7", "gemma4-decode-w8",
)  # fmt: skip
ROUTER_SIZES = (2, 3)  # the router load-balancing loss over the ring (tests/loss/router_cases.py)


@dataclass(frozen=True)
class Case:
    """One comparison: ``kind`` padded (ragged rows), packed (documents in one row) or decode."""

    tag: str
    kind: str
    build: tuple  # ("family", name) | ("windowed", name, window) | ("lora", name)
    seed: int

    @property
    def sizes(self) -> tuple[int, ...]:
        return (3,) if self.build[1] in ODD_ONLY or self.tag in ODD_ONLY else CP_SIZES

    def model(self):
        if self.build[0] == "family":
            return family_model(self.build[1])
        if self.build[0] == "windowed":
            return windowed_model(self.build[1], self.build[2])
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["qkv_proj", "o_proj"], lora_dropout=0.0,
                          init_lora_weights=False)  # fmt: skip
        base = family_model(self.build[1])
        torch.manual_seed(5)
        return get_peft_model(base, lora)


def _cases() -> list[Case]:
    # full attention on every layer; Qwen2/3's and Gemma 3's full layers also run in the windowed
    # cases below (layer 0, resp. 1), with the same configs otherwise
    plain = ("qwen2-yarn", "phi3", "olmo2", "llama3", "deepseek_v3")  # Qwen3-MoE: packed, below
    cases = [Case(name, "padded", ("family", name), i) for i, name in enumerate(plain)]
    # every window on Gemma 3 (a local and a global layer); a straddling one on every other family
    cases += [Case(f"gemma3-w{w}", "padded", ("windowed", "gemma3", w), 10 + w) for w in WINDOWS]
    cases += [
        Case(f"{name}-w13", "padded", ("windowed", name, 13), 60 + i)
        for i, name in enumerate(n for n in WINDOWED if n not in ("gemma3", "gpt_oss"))
    ]
    # gpt-oss (sinks, a sliding and a full layer) runs here only: its eager experts are slow
    for i, name in enumerate(("gemma3", "mistral", "gpt_oss", "gemma4")):
        cases.append(Case(f"{name}-packed-w7", "packed", ("windowed", name, 7), 70 + i))
    cases.append(Case("qwen3_moe-packed", "packed", ("family", "qwen3_moe"), 75))
    cases += [Case("llama4", "padded", ("family", "llama4"), 3)]
    cases.append(Case("llama4-packed", "packed", ("family", "llama4"), 4))
    cases.append(Case("mistral4-packed", "packed", ("family", "mistral4"), 6))
    cases.append(Case("phi3-lora", "padded", ("lora", "phi3"), 80))
    for name in ("gemma3", "qwen2", "gemma4"):
        cases.append(Case(f"{name}-decode-w{DECODE_WINDOW}", "decode", ("windowed", name, DECODE_WINDOW), 90))
    return cases


def _examples(case: Case) -> list[dict]:
    lengths = PACKED[0] if case.kind == "packed" else LENGTHS
    gen = torch.Generator().manual_seed(case.seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
        labels = list(ids)
        if i == 1:
            labels[: n // 2] = [-100] * (n // 2)  # an SFT prompt that is not trained on
        out.append({"input_ids": ids, "labels": labels})
    return out


def _ce(logits: torch.Tensor, shift_labels: torch.Tensor, count: int) -> torch.Tensor:
    """Sum of the fp64 token losses over ``count``."""
    flat = logits.reshape(-1, logits.shape[-1]).double()
    return torch.nn.functional.cross_entropy(flat, shift_labels.reshape(-1), reduction="sum") / count


def _fp32_parameters(model) -> set[str]:
    """Parameters whose gradient transformers accumulates in fp32 even in an fp64 model: Gemma's
    RMSNorm weights (``x.float() * (1 + weight.float())``), DeepSeek-V3's router weight
    (``linear(x.float(), weight.float())``)."""
    fp32 = ("Gemma3RMSNorm", "DeepseekV3TopkRouter")  # DeepSeek-V3's router: fp32 logits
    if getattr(model.config, "model_type", None) == "gemma4_text":
        # Gemma 4's RMSNorms (q/k/v norms, per-layer-input norm included) round in fp32 on the way
        # back too, so every gradient behind them is fp32-accurate: the fp32 bound for all
        return {n for n, _ in model.named_parameters()}
    return {f"{n}.weight" for n, m in model.named_modules() if type(m).__name__ in fp32}


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _run(model, case: Case) -> dict:
    """One process, whole sequences: per-example logits, the fp64 loss, every gradient."""
    examples = _examples(case)
    if case.kind == "packed":  # every document alone
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


def _decode_oracle(model, case: Case) -> dict:
    gen = torch.Generator().manual_seed(case.seed)
    prompt = torch.randint(3, VOCAB, (DECODE_PROMPT,), generator=gen).tolist()
    with torch.no_grad():
        tokens = model.generate(torch.tensor([prompt]), max_new_tokens=DECODE_NEW, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, DECODE_PROMPT:].tolist()  # fmt: skip
        steps = model(torch.tensor([prompt + tokens[:-1]])).logits[0, DECODE_PROMPT - 1 :]
    return {"prompt": prompt, "tokens": tokens, "logits": list(steps)}


def _oracles(case: Case) -> dict:
    out = {}
    for name in ("eager", "sdpa"):
        model = case.model()
        if name == "sdpa" and not model._supports_sdpa:
            # gpt-oss has no sdpa path; its eager attention (sinks included) computes in the model's
            # dtype, fp64: it is the fp64 oracle, and the eager-vs-sdpa spread is 0
            out[name] = out["eager"]
            continue
        model.set_attn_implementation(name)
        out[name] = _decode_oracle(model, case) if case.kind == "decode" else _run(model, case)
    return out


def _rel(got, want) -> float:
    scale = max(x.abs().max().item() for x in want)
    return max((a - b).abs().max().item() for a, b in zip(got, want)) / scale


def _grad_errors(got: dict, want: dict, fp32: set[str]) -> dict[str, float]:
    """Per parameter, the largest error relative to the parameter's largest gradient entry; for a
    gradient that is 0 but for rounding noise (below 1e-10 of the model's largest entry: a window
    of 1, whose softmax over one key passes no gradient to q and k), relative to the model's
    largest gradient entry."""
    worst = {"grad": 0.0, "grad32": 0.0}
    assert list(got) == list(want)
    overall = max(w.abs().max().item() for w in want.values())
    for name, g in got.items():
        scale = want[name].abs().max().item()
        scale = scale if scale > 1e-10 * overall else overall
        err = (g - want[name]).abs().max().item() / scale
        key = "grad32" if name in fp32 else "grad"
        worst[key] = max(worst[key], err)
    return worst


def _compare(tag: str, got: dict, oracles: dict, fp32: set[str]) -> dict[str, float]:
    """Relative errors against both oracles, and the eager-vs-sdpa spread (``tag/spread/*``)."""
    out = {}
    pairs = [(name, got, oracles[name]) for name in ("eager", "sdpa")]
    pairs.append(("spread", oracles["eager"], oracles["sdpa"]))
    for name, a, b in pairs:
        if "tokens" in b:  # decode
            out[f"{tag}/{name}/decode"] = _rel(a["logits"], b["logits"])
            if name != "spread":
                out[f"{tag}/{name}/tokens"] = float(a["tokens"] != b["tokens"])
            continue
        out[f"{tag}/{name}/logits"] = _rel(a["logits"], b["logits"])
        out[f"{tag}/{name}/loss"] = abs((a["loss"] - b["loss"]) / b["loss"]).item()
        out.update({f"{tag}/{name}/{k}": v for k, v in _grad_errors(a["grads"], b["grads"], fp32).items()})
    return out


def _ring(case: Case, group, rank: int, size: int) -> dict:
    """The case on the ring of ``group``: gathered logits, whole loss, summed gradients."""
    model = case.model()
    if case.kind == "decode":
        from ringft.model.inference import RingInference

        engine = RingInference(model, group, "torch")
        gen = torch.Generator().manual_seed(case.seed)
        prompt = torch.randint(3, VOCAB, (DECODE_PROMPT,), generator=gen).tolist()
        steps = [engine.prefill(prompt)]
        tokens = [int(steps[0].argmax())]
        while len(tokens) < DECODE_NEW:
            steps.append(engine.decode(tokens[-1]))
            tokens.append(int(steps[-1].argmax()))
        return {"tokens": tokens, "logits": steps}
    apply_ring_attention(model, group)
    max_length = PACKED[1] if case.kind == "packed" else None
    packing = max_length is not None
    collator = RingDataCollator(rank, size, pad_token_id=0, max_length=max_length, packing=packing)
    batch = collator(_examples(case))
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    loss = _ce(logits, batch["shift_labels"], int(batch["num_items_in_batch"]))
    loss.backward()
    logits = cp_gather(logits.detach(), group)
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=group)
    local = _grads(model)
    flat = torch.cat([g.flatten() for g in local.values()])  # one all_reduce for every gradient
    dist.all_reduce(flat, group=group)  # each CP rank holds a partial gradient of the same replica
    parts = flat.split([g.numel() for g in local.values()])
    grads = {name: part.view_as(g) for (name, g), part in zip(local.items(), parts)}
    if case.kind == "packed":
        (members,) = collator.last_rows  # documents are reordered inside the row
        got, at = [None] * len(members), 0
        for i in members:
            got[i] = logits[0, at : at + PACKED[0][i]]
            at += PACKED[0][i]
    else:
        got = [logits[i, :n] for i, n in enumerate(LENGTHS)]
    return {"logits": got, "loss": loss, "grads": grads, "fp32": _fp32_parameters(model)}


def _refuse_chunked_decoding(group) -> None:
    from ringft.model.inference import RingInference

    engine = RingInference(family_model("llama4"), group, "torch")
    with pytest.raises(ValueError, match=r"cannot decode chunked attention layers \(attention_chunk_size=5"):
        engine.prefill(list(range(3, 20)))


def families_worker(rank: int, world: int, oracle_path: str) -> dict[str, float]:
    oracles = torch.load(oracle_path)
    errors: dict[str, float] = {}
    for size in CP_SIZES:
        group = dist.new_group(list(range(size)))  # every rank takes part in creating each group
        if rank < size:
            for case in _cases():
                if size in case.sizes:
                    got = _ring(case, group, rank, size)
                    errors.update(
                        _compare(f"cp{size}/{case.tag}", got, oracles[case.tag], got.get("fp32", set()))
                    )
            if size == 2:  # a refusal raised on every rank, before any ring traffic
                _refuse_chunked_decoding(group)
            for name in ROUTER_FAMILIES if size in ROUTER_SIZES else ():
                got, want = router_run(name, rank, size, group), oracles[f"router/{name}"]
                tag = f"cp{size}/router-{name}/sdpa"
                errors[f"{tag}/loss"] = abs((got["loss"] - want["loss"]) / want["loss"]).item()
                grad_errors = _grad_errors(got["grads"], want["grads"], set())
                errors.update({f"{tag}/{k}": v for k, v in grad_errors.items()})
        dist.barrier()
    return errors


@pytest.fixture(scope="module")
def oracle_path(tmp_path_factory) -> str:
    oracles = {case.tag: _oracles(case) for case in _cases()}  # one thread (tests/conftest.py)
    oracles.update({f"router/{name}": router_run(name) for name in ROUTER_FAMILIES})
    path = tmp_path_factory.mktemp("families") / "oracles.pt"
    torch.save(oracles, path)
    return str(path)


def _check(errors: dict[str, float]) -> None:
    for key, err in errors.items():
        tag, oracle, what = key.rsplit("/", 2)
        if what == "tokens":
            assert err == 0.0, f"{tag}: RingInference's tokens differ from model.generate"
        elif oracle != "spread":
            spread = errors.get(f"{tag}/spread/{what}", 0.0)  # the router runs have one oracle
            layers = next((n for family, n in DEEP.items() if tag.startswith(family)), 2)
            bound = bounds(layers)[what] + (2 * spread if oracle == "eager" else 0.0)
            assert err <= bound, f"{key}: {err:.2e} > {bound:.1e}"


@pytest.mark.numerics
@pytest.mark.timeout(600)
def test_families_match_one_process_on_cp_1_to_4(oracle_path):
    results = run_distributed(families_worker, max(CP_SIZES), oracle_path, timeout=540)
    worst: dict[str, float] = {}
    for rank, errors in enumerate(results):
        sizes = [s for s in CP_SIZES if rank < s]
        assert {k.split("/")[0] for k in errors} == {f"cp{s}" for s in sizes}  # every case ran
        _check(errors)
        for key, err in errors.items():
            kind = "/".join(key.rsplit("/", 2)[1:])
            worst[kind] = max(worst.get(kind, 0.0), err)
    print("worst relative errors:", ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items())))
