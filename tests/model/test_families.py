"""Every supported family on the zigzag ring vs the unmodified transformers model in one process.

Tiny random models in fp64 (tests/model/family_models.py), sharded over CP = 1..4 (one spawn per
world size; every family, window and layout runs inside it): logits, loss and every parameter's
gradient. Windows shorter than a chunk, straddling chunk edges and longer than a chunk; windows
with packed documents; decoding with a window (RingInference vs ``model.generate``).

Oracles (both unmodified transformers, one process, whole sequence):

- ``sdpa`` in fp64: transformers builds the causal / sliding-window / per-document mask itself and
  torch's SDPA computes in fp64. Bounds: both sides compute the same math with the sums in another
  order; recursive summation of n terms errs by at most (n - 1) * eps relative, so each bound is
  eps64 times the longest chain of reductions behind a value (PATH), relative to the largest value;
- ``eager`` (the reference implementation): its softmax runs in fp32 (``softmax(dtype=float32)``),
  so it is only fp32-accurate. Bound: twice transformers' own sdpa-vs-eager spread on the same
  input, plus the fp64 bound. Any mask, window, position or label mistake is O(1e-2) or larger.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from ringft import RingDataCollator, apply_ring_attention, zigzag_gather
from ringft.ops.spawn import run_distributed
from tests.model.family_models import COMMON, FAMILY_CONFIGS, VOCAB, WINDOWED, family_model, windowed_model

EPS64, EPS32 = torch.finfo(torch.float64).eps, torch.finfo(torch.float32).eps
LENGTHS = (37, 50, 29)  # ragged rows: padded to 50..56 tokens, chunks of 25 (CP 1) .. 7 (CP 4)
SEQ = 56
HID, INTER, LAYERS = COMMON["hidden_size"], COMMON["intermediate_size"], COMMON["num_hidden_layers"]
# Per layer: q/k/v (hidden) + attention (<= SEQ keys, head_dim <= 32) + o_proj (<= 4 * 32) + MLP
# (hidden, intermediate), then the lm_head (hidden): the longest chain of fp64 sums behind a logit.
PATH = LAYERS * (HID + SEQ + 32 + 128 + HID + INTER) + HID
BOUNDS = {"logits": PATH * EPS64, "loss": (PATH + VOCAB + SEQ) * EPS64, "grad": 2 * PATH * EPS64}
BOUNDS["decode"] = BOUNDS["logits"] + EPS32  # RingInference returns fp32 logits: one more rounding
WINDOWS = (1, 3, 13, 40)  # 1: itself only; 3 < every chunk; 13 straddles chunk edges; 40 > a chunk
PACKED = ([19, 13, 9, 5], 48)  # documents across and on chunk edges, one packed row of 48
DECODE_PROMPT, DECODE_NEW, DECODE_WINDOW = 30, 12, 8


def _examples(seed: int, lengths=LENGTHS) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
        labels = list(ids)
        if i == 1:
            labels[: n // 2] = [-100] * (n // 2)  # an SFT prompt that is not trained on
        out.append({"input_ids": ids, "labels": labels})
    return out


def _grad_error(model, ref, summed: bool) -> float:
    """Largest gradient error over parameters, relative to each parameter's largest entry in
    ``ref``. ``summed``: ``model`` is a ring replica whose gradients are partial on each CP rank."""
    worst = 0.0
    pairs = list(zip(model.named_parameters(), ref.named_parameters()))
    assert pairs and all(a[0] == b[0] for a, b in pairs)
    for (_, p), (_, pr) in pairs:
        grad = p.grad.detach().clone()
        if summed and dist.is_initialized():
            dist.all_reduce(grad)
        worst = max(worst, ((grad - pr.grad).abs().max() / pr.grad.abs().max().clamp_min(1e-300)).item())
    return worst


def _ce(logits: torch.Tensor, shift_labels: torch.Tensor, count: int) -> torch.Tensor:
    """Sum of the fp64 token losses over ``count`` (transformers' loss would round to fp32)."""
    flat = logits.reshape(-1, logits.shape[-1]).double()
    return torch.nn.functional.cross_entropy(flat, shift_labels.reshape(-1), reduction="sum") / count


def _ring_step(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring's forward + backward on one CP rank's ``batch``: gathered logits and the whole loss."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    loss = _ce(logits, batch["shift_labels"], int(batch["num_items_in_batch"]))
    loss.backward()
    return zigzag_gather(logits.detach()), _summed(loss)


def _summed(loss: torch.Tensor) -> torch.Tensor:
    """The whole batch's loss from each CP rank's share."""
    loss = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(loss)
    return loss


def _logits_error(got, want) -> float:
    scale = max(x.abs().max().item() for x in want)
    return max((a - b).abs().max().item() for a, b in zip(got, want)) / scale


def _oracle(ref, implementation: str, run) -> tuple[list[torch.Tensor], torch.Tensor, torch.nn.Module]:
    """``run(model) -> (logits list, loss)`` on a copy of ``ref`` with ``implementation``; backward."""
    model = copy.deepcopy(ref)
    model.set_attn_implementation(implementation)
    logits, loss = run(model)
    loss.backward()
    return [x.detach() for x in logits], loss.detach(), model


def _errors(tag: str, got, loss, model, oracles) -> dict[str, float]:
    """Relative errors of the ring (``got`` logits list, ``loss``, ``model`` grads) against each
    oracle, and the eager-vs-sdpa spread (``tag/spread/*``) the eager bound is built from."""
    out = {}
    for name, (logits, ref_loss, ref) in oracles.items():
        out[f"{tag}/{name}/logits"] = _logits_error(got, logits)
        out[f"{tag}/{name}/loss"] = abs((loss - ref_loss) / ref_loss).item()
        out[f"{tag}/{name}/grad"] = _grad_error(model, ref, summed=True)
    (e_logits, e_loss, e_ref), (s_logits, s_loss, s_ref) = oracles["eager"], oracles["sdpa"]
    out[f"{tag}/spread/logits"] = _logits_error(e_logits, s_logits)
    out[f"{tag}/spread/loss"] = abs((e_loss - s_loss) / s_loss).item()
    out[f"{tag}/spread/grad"] = _grad_error(e_ref, s_ref, summed=False)
    return out


def _padded_case(tag, ref, collator, seed) -> dict[str, float]:
    """Ragged rows right-padded to one length: the ring vs the whole padded batch in one process."""
    examples = _examples(seed)
    batch, full = collator(examples), collator.global_batch(examples)
    n = int((full["shift_labels"] != -100).sum())

    def run(m):
        logits = m(input_ids=full["input_ids"]).logits
        return list(logits), _ce(logits, full["shift_labels"], n)

    oracles = {name: _oracle(ref, name, run) for name in ("eager", "sdpa")}
    model = apply_ring_attention(copy.deepcopy(ref))
    logits, loss = _ring_step(model, batch)
    return _errors(tag, list(logits), loss, model, oracles)


def _packed_case(tag, ref, rank, world, seed) -> dict[str, float]:
    """Documents packed into one row: the ring vs every document alone in one process."""
    lengths, seq = PACKED
    collator = RingDataCollator(rank, world, pad_token_id=0, max_length=seq, packing=True)
    examples = _examples(seed, lengths)
    total = sum(sum(x != -100 for x in ex["labels"][1:]) for ex in examples)

    def run(m):
        logits, loss = [], torch.zeros((), dtype=torch.float64)
        for ex in examples:
            out = m(input_ids=torch.tensor([ex["input_ids"]])).logits[0]
            logits.append(out)
            loss = loss + _ce(out, torch.tensor(ex["labels"][1:] + [-100]), total)
        return logits, loss

    oracles = {name: _oracle(ref, name, run) for name in ("eager", "sdpa")}
    model = apply_ring_attention(copy.deepcopy(ref))
    batch = collator(examples)
    (members,) = collator.last_rows  # documents are reordered inside the row
    logits, loss = _ring_step(model, batch)
    got, at = [None] * len(lengths), 0
    for i in members:
        got[i] = logits[0, at : at + lengths[i]]
        at += lengths[i]
    return _errors(tag, got, loss, model, oracles)


def _decode_case(tag, ref) -> dict[str, float]:
    """RingInference greedy decoding past the window vs ``model.generate`` (eager), and every step's
    logits vs one whole-sequence forward (both oracles)."""
    from ringft.model.inference import RingInference

    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, VOCAB, (DECODE_PROMPT,), generator=gen).tolist()
    engine = RingInference(copy.deepcopy(ref), None, "torch")
    steps = [engine.prefill(prompt)]
    tokens = [int(steps[0].argmax())]
    while len(tokens) < DECODE_NEW:
        steps.append(engine.decode(tokens[-1]))
        tokens.append(int(steps[-1].argmax()))
    engine.reset()
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=DECODE_NEW, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, DECODE_PROMPT:].tolist()  # fmt: skip
    out = {f"{tag}/tokens/differ": float(tokens != want)}  # RingInference's logits are fp32
    full = {}
    for name in ("eager", "sdpa"):
        m = copy.deepcopy(ref)
        m.set_attn_implementation(name)
        with torch.no_grad():
            full[name] = list(m(torch.tensor([prompt + tokens[:-1]])).logits[0, DECODE_PROMPT - 1 :])
        out[f"{tag}/{name}/decode"] = _logits_error(steps, full[name])
    out[f"{tag}/spread/decode"] = _logits_error(full["eager"], full["sdpa"])
    return out


def families_worker(rank: int, world: int) -> dict[str, float]:
    torch.set_num_threads(1)
    errors: dict[str, float] = {}
    collator = RingDataCollator(rank, world, pad_token_id=0)
    seed = 0
    for name in FAMILY_CONFIGS:
        errors.update(_padded_case(name, family_model(name), collator, seed := seed + 1))
    for name in WINDOWED:
        for window in WINDOWS:
            ref = windowed_model(name, window)
            errors.update(_padded_case(f"{name}-w{window}", ref, collator, seed := seed + 1))
    for name in ("mistral", "gemma3", "qwen2"):
        ref = windowed_model(name, 7)
        errors.update(_packed_case(f"{name}-packed-w7", ref, rank, world, seed := seed + 1))
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["qkv_proj", "o_proj"], lora_dropout=0.0,
                      init_lora_weights=False)  # fmt: skip
    torch.manual_seed(5)
    errors.update(_padded_case("phi3-lora", get_peft_model(family_model("phi3"), lora), collator, 99))
    for name in ("gemma3", "qwen2", "mistral"):
        errors.update(_decode_case(f"{name}-decode-w{DECODE_WINDOW}", windowed_model(name, DECODE_WINDOW)))
    return errors


def _check(errors: dict[str, float], world: int) -> None:
    for key, err in errors.items():
        tag, oracle, what = key.rsplit("/", 2)
        if oracle == "tokens":
            assert err == 0.0, f"CP={world} {tag}: RingInference's tokens differ from model.generate"
        elif oracle != "spread":
            bound = BOUNDS[what] + (2 * errors[f"{tag}/spread/{what}"] if oracle == "eager" else 0.0)
            assert err <= bound, f"CP={world} {key}: {err:.2e} > {bound:.1e}"


@pytest.mark.numerics
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_families_match_one_process(world):
    results = run_distributed(families_worker, world, timeout=240)
    for errors in results:
        _check(errors, world)
    assert results[0]  # every family ran
