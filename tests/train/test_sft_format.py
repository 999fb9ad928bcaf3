"""``ringft train`` with ``data.format`` (messages | prompt_completion | text, packed and not): raw
records through TRL's ``SFTTrainer`` on the ring (cp 2, 2 gloo processes) against TRL's plain
``SFTTrainer`` in one process on the same records and settings (tests/train/sft_runs.py), and
the recipe / data refusals in-process.

Oracles we did not write: TRL's SFTTrainer over the unmodified transformers model (its dataset
preparation, masks and packing; transformers keeps packed documents apart from the restarting
position_ids), the tokenizer itself for where a prompt ends, and, for packed rows, the model run
on every document alone.

Tolerances: tests/train/test_hf_trainer.py's derivation for the same tiny model (hidden 32, the
demo tokenizer's VOCAB logits) with at most TOKENS_PER_STEP = 4 x 64 targets per step: the step's
loss LOSS_RTOL, the first step's gradients per tensor GRAD_RTOL of the tensor's largest entry,
the update after STEPS AdamW steps STEPS x LOSS_RTOL (fp32 only). A prompt trained on (a mask not
passed to TRL), packed documents attending across their boundaries or a batch sharded wrongly move
the loss by whole per mille to per cents.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ringft.train.errors import RecipeError
from ringft.train.recipe import recipe_from_dict
from tests.train.hf_runs import GRAD_RTOL, LOSS_RTOL, assert_gradients_close, assert_updates_close
from tests.train.sft_runs import CASES, STEPS, make_root, recipe

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def sft_root(tmp_path_factory) -> Path:
    return make_root(tmp_path_factory.mktemp("sft"))


@pytest.fixture(scope="module")
def sft_runs(sft_root) -> dict[str, dict]:
    """One 2-process spawn: the oracles spread over the ranks (one process each), then every case
    on the ring (dp 1 x cp 2). ``name`` -> rank 0's ring run, ``name@1`` -> rank 1's, ``one-name``
    -> the oracle."""
    from ringft.utils.spawn import run_distributed
    from tests.train.sft_runs import worker

    names = list(CASES)
    alone = [names[0::2], names[1::2]]
    results = run_distributed(worker, 2, str(sft_root), alone, names, timeout=600.0)
    out = {}
    for rank, res in enumerate(results):
        out.update({f"one-{k}": v for k, v in res["alone"].items()})
        out.update({(k if rank == 0 else f"{k}@1"): v for k, v in res["together"].items()})
    return out


@pytest.mark.numerics
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(CASES))
def test_ring_matches_trl_one_process(sft_runs, name):
    """Same TRL-prepared rows; per-step loss and grad norm, first-step gradients per tensor and the
    update after STEPS steps == TRL's SFTTrainer in one process; the eval split's loss too."""
    ring, one = sft_runs[name], sft_runs[f"one-{name}"]
    assert ring["rows"] == one["rows"]  # the recipe's keys reached TRL's preparation
    assert len(ring["losses"]) == len(one["losses"]) == STEPS
    assert ring["losses"] == pytest.approx(one["losses"], rel=LOSS_RTOL)
    assert ring["grad_norms"] == pytest.approx(one["grad_norms"], rel=STEPS * LOSS_RTOL)
    assert_gradients_close(ring["grads"], one["grads"], GRAD_RTOL)
    assert_updates_close(ring["final"], one["final"], one["initial"], STEPS * LOSS_RTOL)
    assert sft_runs[f"{name}@1"]["losses"] == ring["losses"] and ring["cp"] == 2
    if CASES[name].get("eval"):
        assert ring["eval_loss"] == pytest.approx(one["eval_loss"], rel=LOSS_RTOL)


@pytest.mark.numerics
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [n for n in CASES if n.endswith("-packed")])
def test_packing_keeps_documents_apart(sft_runs, name):
    """The ring's first-step loss over packed rows == the mean token loss of every document run
    alone through the model (fp64 cross-entropy); the first step's rows hold several documents."""
    ring, one = sft_runs[name], sft_runs[f"one-{name}"]
    assert max(len(r["seq_lengths"]) for r in ring["rows"][:2]) >= 2
    assert ring["losses"][0] == pytest.approx(one["per_document_loss"], rel=LOSS_RTOL)


def test_loss_masks_against_the_tokenizer(sft_runs, sft_root):
    """prompt_completion: labels are -100 exactly on the tokenized prompt (the tokenizer's own ids
    of the prompt alone), the input ids after it; messages with assistant_only_loss: the targets
    decode to the assistant turns as the template renders them; text: every token a target."""
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(sft_root / "model"))
    records = datasets.load_dataset("parquet", data_files=str(sft_root / "pc.parquet"), split="train")
    for row, rec in zip(sft_runs["prompt_completion"]["rows"], records):
        k = len(tok(rec["prompt"])["input_ids"])
        assert row["labels"][:k] == [-100] * k and row["labels"][k:] == row["input_ids"][k:]
    chats = datasets.load_dataset("json", data_files=str(sft_root / "chats.jsonl"), split="train")
    for row, rec in zip(sft_runs["messages"]["rows"], chats):
        targets = [t for t in row["labels"] if t != -100]
        turns = "".join(f"A: {m['content']}</s>" for m in rec["messages"] if m["role"] == "assistant")
        assert tok.decode(targets) == turns
    for row in sft_runs["text"]["rows"]:
        assert row["labels"] == row["input_ids"]


# -- refusals (one process, no model) -----------------------------------------------------------------


def _raw(root: Path, tmp: Path, **data) -> dict:
    raw = recipe("messages", root, tmp / "out", cp=1)
    raw["data"] = {k: v for k, v in {**raw["data"], **data}.items() if v is not None}
    return raw


@pytest.mark.parametrize(
    "data,message",
    [
        ({"document_masking": True}, "set data.packing: true"),
        ({"synthetic": {"num_examples": 4}, "path": None}, "data.synthetic makes tokenized records"),
        ({"format": None, "packing": True, "assistant_only_loss": None}, "data.packing is a key of raw SFT"),
        ({"too_long": "fail"}, "set data.too_long: truncate"),
        ({"completion_only_loss": True}, "for a loss on the answers only: data.assistant_only_loss"),
        ({"format": "text", "assistant_only_loss": True}, "data.format=text has no turns"),
        ({"text_field": "body"}, "data.text_field names the column of format text records"),
        ({"format": "jsonl"}, "data.format must be one of"),
    ],
)
def test_recipe_refusals(sft_root, tmp_path, data, message):
    with pytest.raises(RecipeError, match=message.replace(".", r"\.")):
        recipe_from_dict(_raw(sft_root, tmp_path, **data))


def test_data_refusals_and_eval_fraction(sft_root, tmp_path):
    """Missing columns (named with the columns found), pre-tokenized rows, an unreadable file, a
    tokenizer without a chat template, a template without generation markers; eval_fraction holds
    out records as the pre-tokenized path does."""
    import datasets
    from transformers import AutoTokenizer

    from ringft.data.tokenizer import load_tokenizer
    from ringft.train.sft_data import load_sft_data

    tok = AutoTokenizer.from_pretrained(str(sft_root / "model"))

    def load(tokenizer=tok, **data):
        return load_sft_data(recipe_from_dict(_raw(sft_root, tmp_path, **data)), tokenizer)

    texts = str(sft_root / "texts")
    with pytest.raises(
        RecipeError, match=r"no messages column for data.format=messages \(columns: \['body', 'text'\]"
    ):
        load(path=texts)
    with pytest.raises(RecipeError, match="no prompt, completion column .* rename the columns"):
        load(path=texts, format="prompt_completion", assistant_only_loss=False)
    with pytest.raises(RecipeError, match="no title column .* set data.text_field"):
        load(path=texts, format="text", text_field="title", assistant_only_loss=False)
    tokenized = tmp_path / "tokenized"
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]]}).save_to_disk(str(tokenized))
    with pytest.raises(RecipeError, match="holds input_ids .* drop data.format"):
        load(path=str(tokenized))
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(RecipeError, match="could not be read as a dataset"):
        load(path=str(tmp_path / "broken.jsonl"))
    (tmp_path / "records.csv").write_text("a\n1\n")
    with pytest.raises(RecipeError, match=r"give a \.jsonl, \.json or \.parquet file"):
        load(path=str(tmp_path / "records.csv"))
    with pytest.raises(RecipeError, match="has no chat template to render them"):
        load(tokenizer=load_tokenizer("demo"))
    tok.chat_template = TEMPLATE_WITHOUT_MARKERS
    with pytest.raises(
        RecipeError, match=r"needs \{% generation %\} markers .*data.assistant_only_loss: false"
    ):
        load()
    assert len(load(assistant_only_loss=False).train) == 24  # the same template, whole-sequence loss
    split = load(eval_fraction=0.25, assistant_only_loss=False)
    assert (len(split.train), len(split.eval)) == (18, 6)


TEMPLATE_WITHOUT_MARKERS = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
)
