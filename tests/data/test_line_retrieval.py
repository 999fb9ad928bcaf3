"""Tests for line-retrieval records fitted to a length, the demo tokenizer and synthetic data."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from ringft.data import line_retrieval as ld
from ringft.data.line_retrieval import LINE_RE, PREAMBLE, target_index_for_depth, unique_names
from ringft.data.line_retrieval.text import NOUNS, RecordStream
from ringft.data.line_retrieval.training import make_synthetic_dataset, make_synthetic_example
from ringft.data.seeds import derive_seed
from ringft.data.tokenizer import (
    DEMO_TOKENIZER_DIR,
    apply_template,
    build_demo_tokenizer,
    encode_prompt,
    load_demo_tokenizer,
)
from ringft.evals.lines.cases import LineCase, make_line_case, make_line_cases

REPO = Path(__file__).resolve().parents[2]
QUESTION_RE = re.compile(
    r"\nThe record is finished\. What is the <REGISTER_CONTENT> of line ([a-z-]+)\? "
    r"Answer with the number\.$"
)


@pytest.fixture(scope="module")
def tok():
    return load_demo_tokenizer()


def parse_prompt(prompt: str) -> tuple[list[tuple[str, int]], str]:
    """Split a raw prompt into its (name, number) lines and the asked name."""
    assert prompt.startswith(PREAMBLE)
    body_and_question = prompt[len(PREAMBLE) :]
    q = QUESTION_RE.search(body_and_question)
    assert q is not None, body_and_question[-200:]
    body = body_and_question[: q.start()]
    assert body.endswith("\n")
    lines = []
    for raw in body[:-1].split("\n"):
        m = LINE_RE.match(raw)
        assert m is not None, raw
        lines.append((m.group(1), int(m.group(2))))
    return lines, q.group(1)


def next_line_prompt(tokenizer, case: LineCase) -> str:
    """The prompt the generator would build with one more line (same seed and depth)."""
    num_words = case.target_line.count("-") + 1
    stream = RecordStream(case.seed, num_words)
    stream.ensure(case.num_lines + 1)
    n = case.num_lines + 1
    idx = target_index_for_depth(case.depth, n)
    text = ld.build_record_text(stream.names[:n], stream.numbers[:n], idx)
    return apply_template(tokenizer, text, case.chat_template)


# --------------------------------------------------------------------------- format


@pytest.mark.timeout(120)
def test_prompt_format(tok):
    case = make_line_case(tok, 600, 0.5, seed=3)
    lines, asked = parse_prompt(case.prompt)
    assert len(lines) == case.num_lines >= 2
    assert asked == case.target_line
    assert "\n\nline " in case.prompt  # blank line after the preamble
    assert case.prompt.count("\n\nThe record is finished.") == 1  # blank line before question
    for name, number in lines:
        assert ld.MIN_NUMBER <= number <= ld.MAX_NUMBER
        assert not any(ch.isdigit() for ch in name)
    assert not case.chat_template  # the demo tokenizer has no chat template


@pytest.mark.timeout(120)
def test_answer_unique_and_consistent(tok):
    for depth in (0.0, 0.3, 1.0):
        case = make_line_case(tok, 900, depth, seed=11)
        lines, _ = parse_prompt(case.prompt)
        body = case.prompt[len(PREAMBLE) : case.prompt.rindex("\nThe record is finished")]
        assert body.count(case.target_line) == 1
        assert case.prompt.count(case.target_line) == 2  # record line + question
        matching = [num for name, num in lines if name == case.target_line]
        assert matching == [int(case.answer)]
        assert f"line {case.target_line}: REGISTER_CONTENT is <{case.answer}>\n" in body
        assert lines[case.target_index] == (case.target_line, int(case.answer))


@pytest.mark.timeout(120)
def test_names_unique_and_scale():
    for count, width in ((50, 2), (9000, 2), (30000, 3)):
        names = unique_names(count, seed=1)
        assert len(names) == len(set(names)) == count
        assert {n.count("-") + 1 for n in names} == {width}
        assert all(re.fullmatch(r"[a-z]+(-[a-z]+)+", n) for n in names)
    assert unique_names(100, seed=1) == unique_names(100, seed=1)
    assert unique_names(100, seed=1) != unique_names(100, seed=2)
    # Prefix property: the first names do not depend on how many are asked for.
    assert unique_names(500, seed=4)[:100] == unique_names(100, seed=4)
    # The first len(NOUNS) names have distinct nouns (then nouns repeat); without the rule, a
    # 70-name draw repeats nouns (the birthday bound over 130 nouns).
    for seed in range(5):
        nouns = [n.split("-")[-1] for n in unique_names(300, seed=seed, num_words=2)]
        assert len(set(nouns[: len(NOUNS)])) == len(NOUNS) and len(set(nouns)) == len(NOUNS)
        free = [n.split("-")[-1] for n in unique_names(70, seed=seed, num_words=2, distinct_nouns=False)]
        assert len(set(free)) < 70


@pytest.mark.timeout(120)
def test_word_lists_substring_free():
    assert len(ld.ADJECTIVES) >= 100 and len(ld.NOUNS) >= 100
    assert ld.name_capacity(2) >= 10_000
    for words in (ld.ADJECTIVES, ld.NOUNS):
        assert len(set(words)) == len(words)
        assert all(re.fullmatch(r"[a-z]+", w) for w in words)
        for w in words:
            assert not any(w != o and w in o for o in words), w


# --------------------------------------------------------------------------- length


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", [180, 1000, 4096, 20000])
def test_length_within_one_line(tok, target):
    case = make_line_case(tok, target, 0.5, seed=target)
    ids = encode_prompt(tok, case.prompt)
    assert ids[0] == tok.bos_token_id  # counted convention: BOS included
    assert len(ids) == case.num_tokens == len(case.input_ids(tok))
    assert case.num_tokens <= target
    assert case.length == target
    # Adding one more line would exceed the target ...
    longer = len(encode_prompt(tok, next_line_prompt(tok, case)))
    assert longer > target
    # ... and the gap is smaller than one line.
    lines, _ = parse_prompt(case.prompt)
    enc = tok([ld.render_line(n, v) for n, v in lines], add_special_tokens=False)
    max_line = max(len(ids) for ids in enc["input_ids"])
    assert target - case.num_tokens < max_line + 2


@pytest.fixture(scope="module")
def merging_tok():
    """A tokenizer that is NOT additive on line boundaries (BPE merges across newlines)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ringft.data.tokenizer import demo_corpus

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    backend.decoder = decoders.Metaspace(prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(
        vocab_size=1500, special_tokens=["<s>", "</s>", "<unk>"], show_progress=False
    )
    backend.train_from_iterator(demo_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", [300, 6000])
def test_length_with_non_additive_tokenizer(merging_tok, target):
    standalone = len(merging_tok("line a-b: x\n", add_special_tokens=False)["input_ids"])
    joined = len(merging_tok("line a-b: x\nline a-b: x\n", add_special_tokens=False)["input_ids"])
    assert joined != 2 * standalone  # really non-additive
    case = make_line_case(merging_tok, target, 0.5, seed=1)
    assert len(encode_prompt(merging_tok, case.prompt)) == case.num_tokens <= target
    assert len(encode_prompt(merging_tok, next_line_prompt(merging_tok, case))) > target
    parse_prompt(case.prompt)


class CountingTokenizer:
    """Delegates to a tokenizer and counts whole-prompt tokenizations (single-string calls)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.full_prompts = tokenizer, 0

    def __call__(self, text, **kwargs):
        self.full_prompts += isinstance(text, str)
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.timeout(120)
def test_length_search_is_a_bisection_over_prefix_sums(tok, merging_tok):
    """Additive tokenizer: the prefix-sum guess is right, confirmed by 3 full tokenizations (one line,
    the guess, one more line). Non-additive: a few more, growing with log2 of the guess's error."""
    for target in (1000, 20000):
        counting = CountingTokenizer(tok)
        case = make_line_case(counting, target, 0.5, seed=target)
        assert counting.full_prompts == 3 and case.num_tokens <= target
    counting = CountingTokenizer(merging_tok)
    case = make_line_case(counting, 6000, 0.5, seed=1)
    assert case.num_tokens <= 6000 and counting.full_prompts <= 3 + 2 * 10


@pytest.mark.timeout(120)
def test_too_small_target_raises(tok):
    with pytest.raises(ValueError):
        make_line_case(tok, 50, 0.5, seed=0)
    with pytest.raises(ValueError):
        make_line_case(tok, 1000, 1.5, seed=0)


# --------------------------------------------------------------------------- depth


@pytest.mark.timeout(120)
def test_depth_placement(tok):
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        case = make_line_case(tok, 1500, depth, seed=7)
        n = case.num_lines
        expected = {0.0: 0, 1.0: n - 1}.get(depth, int(depth * (n - 1) + 0.5))
        assert case.target_index == expected
        assert case.actual_depth == pytest.approx(expected / (n - 1))
        assert abs(case.actual_depth - depth) <= 0.5 / (n - 1) + 1e-12
        lines, _ = parse_prompt(case.prompt)
        assert lines[expected][0] == case.target_line
    assert target_index_for_depth(0.5, 1) == 0
    assert target_index_for_depth(0.5, 4) == 2  # round half up: 1.5 -> 2
    assert target_index_for_depth(1.0, 7) == 6


# --------------------------------------------------------------------------- determinism


@pytest.mark.timeout(120)
def test_determinism(tok):
    a = make_line_cases(tok, [300, 700], [0.0, 1.0], 2, seed=5)
    b = make_line_cases(tok, [300, 700], [0.0, 1.0], 2, seed=5)
    c = make_line_cases(tok, [300, 700], [0.0, 1.0], 2, seed=6)
    assert len(a) == 8
    assert [x.to_dict() for x in a] == [x.to_dict() for x in b]
    assert all(x.prompt != y.prompt for x, y in zip(a, c, strict=True))
    # Cells and case indices get distinct seeds, and the order is (length, depth, index).
    assert len({x.seed for x in a}) == len(a)
    assert [(x.length, x.depth, x.case_index) for x in a[:4]] == [
        (300, 0.0, 0),
        (300, 0.0, 1),
        (300, 1.0, 0),
        (300, 1.0, 1),
    ]
    assert a[1].seed == derive_seed("lines-eval", 5, 300, 0.0, 1)


# --------------------------------------------------------------------------- chat template


@pytest.mark.timeout(120)
def test_chat_template_applied_and_counted(tok):
    chat_tok = copy.deepcopy(tok)
    chat_tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    case = make_line_case(chat_tok, 800, 0.5, seed=2)
    assert case.chat_template
    assert case.prompt.startswith("<s>[user] " + PREAMBLE)
    assert case.prompt.endswith("Answer with the number.\n[assistant] ")
    ids = case.input_ids(chat_tok)
    assert ids.count(chat_tok.bos_token_id) == 1  # BOS from the template text only
    assert len(ids) == case.num_tokens <= 800
    raw = make_line_case(chat_tok, 800, 0.5, seed=2, chat_template=False)
    assert not raw.chat_template and raw.prompt.startswith(PREAMBLE)


# --------------------------------------------------------------------------- scoring


# --------------------------------------------------------------------------- demo tokenizer


@pytest.mark.timeout(120)
def test_demo_tokenizer_basics(tok):
    assert len(tok) <= 2048
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",
    )
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}) == 4
    assert not tok.chat_template
    text = "line brave-otter: REGISTER_CONTENT is <31337>\nHello,  wörld! ☃\ttabs 0042"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.eos_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.unk_token_id not in ids
    digits = tok(" 31337 9", add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([i]) for i in digits]
    assert [p for p in pieces if p.strip()] == ["3", "1", "3", "3", "7", "9"]
    for d in "0123456789":
        assert len(tok(d, add_special_tokens=False)["input_ids"]) == 1
    # Frequent record words are single tokens.
    assert len(tok("REGISTER_CONTENT", add_special_tokens=False)["input_ids"]) <= 3


@pytest.mark.timeout(120)
def test_demo_tokenizer_shipped_and_reproducible():
    files = {p.name: p for p in DEMO_TOKENIZER_DIR.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= set(files)
    assert sum(p.stat().st_size for p in files.values()) < 200_000
    shipped = json.loads(files["tokenizer.json"].read_text(encoding="utf-8"))
    rebuilt = json.loads(build_demo_tokenizer().backend_tokenizer.to_str())
    assert rebuilt["model"]["vocab"] == shipped["model"]["vocab"]
    assert rebuilt["model"]["merges"] == shipped["model"]["merges"]


# --------------------------------------------------------------------------- synthetic


@pytest.mark.timeout(120)
def test_synthetic_example_labels(tok):
    ex = make_synthetic_example(tok, 400, 0.4, seed=9)
    ids, labels = ex["input_ids"], ex["labels"]
    assert len(ids) == len(labels) <= 400
    assert len(ids) > 400 - 40  # about seq_len
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    supervised = [i for i, lab in enumerate(labels) if lab != -100]
    assert supervised == list(range(supervised[0], len(ids)))  # one contiguous tail span
    assert all(labels[i] == ids[i] for i in supervised)
    answer_text = tok.decode([ids[i] for i in supervised])
    m = re.fullmatch(r" ([0-9]+)</s>", answer_text)
    assert m is not None, answer_text
    prompt = tok.decode(ids[: supervised[0]], skip_special_tokens=True)
    lines, asked = parse_prompt(prompt)
    assert dict(lines)[asked] == int(m.group(1))


@pytest.mark.timeout(120)
def test_synthetic_dataset(tok):
    ds = make_synthetic_dataset(tok, 6, 512, seed=0, min_len=200)
    assert ds.column_names == ["input_ids", "labels"]
    assert len(ds) == 6
    lengths = [len(x) for x in ds["input_ids"]]
    assert all(150 <= n <= 512 for n in lengths) and len(set(lengths)) > 1
    for ids, labels in zip(ds["input_ids"], ds["labels"], strict=True):
        assert len(ids) == len(labels)
        assert labels[-1] == tok.eos_token_id
        assert 2 <= sum(lab != -100 for lab in labels) <= 8  # " " + digits + EOS
    again = make_synthetic_dataset(tok, 6, 512, seed=0, min_len=200)
    assert again["input_ids"] == ds["input_ids"]
    full = make_synthetic_dataset(tok, 2, 300, seed=1, loss_on="all")
    assert full["labels"] == full["input_ids"]
    with pytest.raises(ValueError):
        make_synthetic_example(tok, 300, 0.5, seed=0, loss_on="prompt")
