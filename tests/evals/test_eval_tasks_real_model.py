"""eval-ppl, eval-niah, eval-ruler and eval-short on a real pretrained chat model (SmolLM2-135M-Instruct,
tests/real_model.py) with CP = 2, against one transformers process: perplexities equal within a
derived bound, generated answers and verdicts equal case by case.

One spawn of 2 processes runs the four commands in a row; each process loads SmolLM2 once (the
harness's ``load_model`` hook hands the loaded model to every command; a RoPE-theta variant for
eval-short is a copy of it with the rotary frequencies rebuilt, as ``--rope-theta`` builds them).
Oracle: the unmodified model (eager attention, fp32) in this process: ``model(ids).logits`` for the
NLLs (per token ``-log_softmax``, sliding windows recomputed window by window), ``model.generate``
(greedy, stop at EOS) for the answers, scored with the tasks' own metrics.

Bounds, from the logits tolerance ``tol`` of each sequence (as tests/model/test_real_model.py
derives it: the larger of layers x eps x max|logit| and 4x transformers' own sdpa-vs-eager spread on
the same ids; the windows of the document and eval-short's prefix of it reuse the document's
spread): log_softmax moves by at most 2 tol per token, so a mean NLL (a log perplexity, a
bin's mean) by at most 2 tol; for KL(p||q) per token, perturbing the logits by tol moves it by at most
4 tol + (e^(2 tol) - 1) E_p|log p - log q| (expanding the sum, with |d log p| <= 2 tol); top-1
agreement can change only at tokens where either model's top-1/top-2 gap is within 2 tol; identical
greedy tokens are demanded only where every step's gap exceeds 2 tol (checked: a near-tie asks for
another seed).
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from ringft.utils.spawn import run_distributed
from tests.real_model import REAL_TEXT, load_smollm2, smollm2_path

FP32_EPS = torch.finfo(torch.float32).eps
NUM_LAYERS = 30
SPREAD_FACTOR = 4.0
LENGTHS = (64, 256, 464)
WINDOW, STRIDE = 256, 128
SHORT_LENGTH = 256
THETA = 1e6  # eval-short's "extended" model: SmolLM2 with RoPE theta 1e5 -> 1e6
NIAH = ("passkey,niah_single_1", "280", "0.5")
RULER = ("niah_multikey_2,fwe", "280")
BASE = ["--dtype", "fp32", "--attn-backend", "torch", "--no-progress"]


def with_rope_theta(model, theta: float):
    """A copy of ``model`` whose RoPE frequencies are built from ``theta`` (what --rope-theta does)."""
    other = copy.deepcopy(model)
    other.config.rope_parameters = {**other.config.rope_parameters, "rope_theta": float(theta)}
    other.model.rotary_emb = type(other.model.rotary_emb)(config=other.config)
    return other


_LOADED: dict = {}


def cached_loader(path, dtype, device, rope_theta):
    """The harness's ``load_model``: the models :func:`worker` loaded, by RoPE theta."""
    return _LOADED[rope_theta]


def worker(rank: int, world: int, model: str, text: str, out: str) -> list[int]:
    from ringft.evals.model import load_eval_model
    from ringft.evals.niah import task as niah
    from ringft.evals.ppl import task as ppl
    from ringft.evals.ruler import task as ruler
    from ringft.evals.short import task as short

    _LOADED[None] = load_eval_model(model, torch.float32, torch.device("cpu"))  # read once
    _LOADED[THETA] = with_rope_theta(_LOADED[None], THETA)  # copied before the ring patches it
    m = ["--model", model, *BASE]
    lengths = ",".join(map(str, LENGTHS))
    return [
        ppl.main(
            [
                *m,
                "--baseline",
                model,
                "--text",
                text,
                "--lengths",
                lengths,
                "--native-window",
                str(WINDOW),
                "--stride",
                str(STRIDE),
                "--chunk-size",
                "100",
                "--output",
                f"{out}/ppl",
            ],
            cached_loader,
        ),
        niah.main(
            [
                *m,
                "--tasks",
                NIAH[0],
                "--lengths",
                NIAH[1],
                "--depths",
                NIAH[2],
                "--samples",
                "1",
                "--output",
                f"{out}/niah",
            ],
            cached_loader,
        ),
        ruler.main(
            [*m, "--tasks", RULER[0], "--lengths", RULER[1], "--samples", "1", "--output", f"{out}/ruler"],
            cached_loader,
        ),
        short.main(
            [
                *m,
                "--rope-theta",
                str(THETA),
                "--baseline",
                model,
                "--text",
                text,
                "--length",
                str(SHORT_LENGTH),
                "--chunk-size",
                "64",
                "--output",
                f"{out}/short",
            ],
            cached_loader,
        ),
    ]


def _logits_and_tol(model, ids: list[int], spread: float | None = None) -> tuple[torch.Tensor, float, float]:
    """Eager fp32 logits ``(len(ids), vocab)``, the logits tolerance of this sequence and the
    sdpa-vs-eager spread it used (measured here unless given: a window reuses its document's)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
        if spread is None:
            model.set_attn_implementation("sdpa")
            spread = (model(torch.tensor([ids])).logits[0].double() - logits).abs().max().item()
            model.set_attn_implementation("eager")
    return logits, max(NUM_LAYERS * FP32_EPS * logits.abs().max().item(), SPREAD_FACTOR * spread), spread


def _nll(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return -torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def _generation_oracle(model, tokenizer, samples) -> list[dict]:
    from ringft.data.tokenizer import encode_prompt
    from ringft.evals.long_tasks import score_prediction

    out = []
    for s in samples:
        ids = encode_prompt(tokenizer, s.prompt, s.chat_template)
        _, tol, spread = _logits_and_tol(model, ids)
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]),
                max_new_tokens=s.tokens_to_generate,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                eos_token_id=[2],
                pad_token_id=tokenizer.pad_token_id,
            )
        tokens = gen.sequences[0, len(ids) :].tolist()
        tokens = tokens[:-1] if tokens and tokens[-1] == 2 else tokens
        margins = [float(x[0].topk(2).values[0] - x[0].topk(2).values[1]) for x in gen.scores]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        record = dict(
            task=s.task,
            depth=s.depth,
            tokens=tokens,
            margins=margins,
            tol=tol,
            score=score_prediction(s.task, text, s.outputs),
        )
        if s.target is not None:
            answer = tokenizer(s.target, add_special_tokens=False)["input_ids"]
            logits, _, _ = _logits_and_tol(model, ids + answer, spread)
            logp = torch.log_softmax(logits[len(ids) - 1 : -1], -1)
            record.update(
                answer_tokens=len(answer), logprob=logp[torch.arange(len(answer)), answer].sum().item()
            )
        out.append(record)
    return out


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    from ringft.evals.long_tasks import generate_samples, resolve_tasks

    model, tokenizer = load_smollm2()
    folder = tmp_path_factory.mktemp("real-tasks")
    text = folder / "story.txt"
    text.write_text(REAL_TEXT + "\n\n" + REAL_TEXT)
    ids = tokenizer(text.read_text())["input_ids"][: LENGTHS[-1]]
    assert len(ids) == LENGTHS[-1]
    full, tol, spread = _logits_and_tol(model, ids)
    windows, scored, tols = torch.zeros(len(ids) - 1, dtype=torch.float64), 1, [tol]
    for begin in range(0, len(ids), STRIDE):  # HF's sliding-window recipe, written out
        end = min(begin + WINDOW, len(ids))
        logits, t, _ = _logits_and_tol(model, ids[begin:end], spread)
        windows[scored - 1 : end - 1] = _nll(logits, ids[begin:end])[scored - begin - 1 :]
        scored, tols = end, tols + [t]
        if end == len(ids):
            break
    niah_samples = [
        s
        for spec in resolve_tasks(NIAH[0])
        for d in map(float, NIAH[2].split(","))
        for s in generate_samples(spec, tokenizer, int(NIAH[1]), 1, depth=d)
    ]
    ruler_samples = [
        s for spec in resolve_tasks(RULER[0]) for s in generate_samples(spec, tokenizer, int(RULER[1]), 1)
    ]
    short_ids = ids[:SHORT_LENGTH]
    base_logits, tol_a, _ = _logits_and_tol(model, short_ids, spread)
    model_logits, tol_b, _ = _logits_and_tol(with_rope_theta(model, THETA), short_ids, spread)
    return dict(
        text=text,
        full=_nll(full, ids),
        windows=windows,
        ppl_tol=max(tols),
        niah=_generation_oracle(model, tokenizer, niah_samples),
        ruler=_generation_oracle(model, tokenizer, ruler_samples),
        short=(
            torch.log_softmax(base_logits, -1),
            torch.log_softmax(model_logits, -1),
            short_ids,
            max(tol_a, tol_b),
        ),
    )


def _check_generation(records: list[dict], expected: list[dict]) -> None:
    assert len(records) == len(expected)
    for got, want in zip(records, expected, strict=True):
        assert (got["task"], got["depth"]) == (want["task"], want["depth"])
        steps = len(want["tokens"]) + (1 if len(want["tokens"]) < len(want["margins"]) else 0)
        assert min(want["margins"][:steps]) > 2 * want["tol"], "near-tie: choose another seed"
        assert got["generated_ids"] == want["tokens"], (got["task"], got["generated"])
        assert got["score"] == want["score"]
        if "logprob" in want:
            assert abs(got["target_logprob"] - want["logprob"]) <= 2 * want["answer_tokens"] * want["tol"]


@pytest.mark.numerics
@pytest.mark.timeout(1500)
def test_tasks_cp2_match_one_process_transformers(oracle, tmp_path):
    out = tmp_path / "runs"
    codes = run_distributed(worker, 2, str(smollm2_path()), str(oracle["text"]), str(out), timeout=900)
    assert codes == [[0, 0, 0, 0], [0, 0, 0, 0]]

    # eval-ppl: perplexity over the first L tokens (log ppl within 2 tol) and NLL by position bins.
    records = [json.loads(x) for x in (out / "ppl" / "results.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in records] == ["model", "baseline-window"]  # --baseline is --model
    bound = 2 * oracle["ppl_tol"]
    for r in records:
        nll = oracle["windows"] if r["variant"] == "baseline-window" else oracle["full"]
        for n in LENGTHS:
            assert abs(r["nll_sum"][str(n)] / (n - 1) - nll[: n - 1].mean().item()) <= bound
        for start, end, total, count in r["bins"]:
            assert abs(total / count - nll[start - 1 : end - 1].mean().item()) <= bound
    assert (oracle["windows"] - oracle["full"]).abs().max() > 100 * bound  # the window changes NLLs
    rows = (out / "ppl" / "ppl.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * len(LENGTHS) and (out / "ppl" / "ppl.png").is_file()

    # eval-niah and eval-ruler: the same greedy tokens, the same verdicts, case by case.
    _check_generation(
        [json.loads(x) for x in (out / "niah" / "results.jsonl").read_text().splitlines()], oracle["niah"]
    )
    ruler = [json.loads(x) for x in (out / "ruler" / "results.jsonl").read_text().splitlines()]
    _check_generation(ruler, oracle["ruler"])
    summary = json.loads((out / "ruler" / "summary.json").read_text())
    assert summary["scores"] == {w["task"]: {RULER[1]: round(100 * w["score"], 2)} for w in oracle["ruler"]}

    # eval-short: NLLs, mean KL and top-1 agreement of the two models.
    logp_a, logp_b, ids, tol = oracle["short"]
    record = json.loads((out / "short" / "results.jsonl").read_text())
    targets = torch.tensor(ids[1:])[:, None]
    la, lb = logp_a[:-1], logp_b[:-1]
    n = len(ids) - 1
    assert record["targets"] == n
    assert abs(record["nll_reference"] / n + la.gather(1, targets).mean().item()) <= 2 * tol
    assert abs(record["nll_model"] / n + lb.gather(1, targets).mean().item()) <= 2 * tol
    kl = (la.exp() * (la - lb)).sum(-1)
    kl_bound = 4 * tol + math.expm1(2 * tol) * (la.exp() * (la - lb).abs()).sum(-1)
    assert abs(record["kl"] / n - kl.mean().item()) <= kl_bound.mean().item()
    top_a, top_b = la.topk(2, -1).values, lb.topk(2, -1).values
    unsure = ((top_a[:, 0] - top_a[:, 1]) <= 2 * tol) | ((top_b[:, 0] - top_b[:, 1]) <= 2 * tol)
    agree = (la.argmax(-1) == lb.argmax(-1)).sum().item()
    assert abs(record["top1_agree"] - agree) <= unsure.sum().item()
    assert 0 < agree < n and kl.mean() > 10 * kl_bound.mean()  # the two models do differ
