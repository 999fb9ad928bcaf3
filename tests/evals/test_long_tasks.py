"""The long-context task generators against RULER's and LongLoRA's rules: templates, needle counts,
key and value formats, depths, answer sets, token-length fitting, determinism by seed, bad input.

Tokenizer: the shipped demo tokenizer (byte-level BPE, no chat template); a copy with a small chat
template covers the template path. Lengths stay small (<= 4.5K tokens) to keep the module fast.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from ringft.data.tokenizer import encode_prompt, load_demo_tokenizer
from ringft.evals.long_tasks import (
    DEPTHS,
    NOISE,
    TASKS,
    LengthTooShortError,
    Sample,
    generate_sample,
    generate_samples,
    words,
)
from ringft.evals.long_tasks.prompt import render_prompt
from ringft.evals.long_tasks.registry import sample_request
from ringft.evals.long_tasks.word_extraction import fwe_minimum, zeta, zipf_counts

NUMBER7 = re.compile(r"^[1-9][0-9]{6}$")
UUID4 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
NAME5 = re.compile(r"^[A-Z]{5}$")


@pytest.fixture(scope="module")
def tok():
    return load_demo_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    tokenizer = load_demo_tokenizer()
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    return tokenizer


def _needle_word(key: str) -> bool:
    """Whether ``key`` is one of RULER's ``adjective-noun`` words (either part may hold a hyphen)."""
    return any(
        key[:i] in words.adjectives() and key[i + 1 :] in words.nouns() for i, c in enumerate(key) if c == "-"
    )


def test_passkey_is_longloras_format(tok):
    """Five lines, LongLoRA's strings verbatim, a 5-digit key at the requested depth, exact target."""
    sample = generate_sample("passkey", tok, 1024, 3, depth=0.25)
    key = sample.outputs[0]
    assert re.fullmatch(r"[1-4][0-9]{4}", key) and sample.target == f" {key}"
    lines = sample.prompt.split("\n")
    assert lines[0] == (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there."
    )
    assert lines[2] == f"The pass key is {key}. Remember it. {key} is the pass key."
    assert lines[4] == "What is the pass key? The pass key is" and sample.answer_prefix == " The pass key is"
    garbage = " ".join([NOISE] * 5000)
    n = sample.haystack_size
    assert lines[1] == garbage[: int(0.25 * n)] and lines[3] == garbage[: n - int(0.25 * n)]
    assert len(lines) == 5 and sample.needle_depths == (int(0.25 * n) / n,)
    assert generate_sample("passkey", tok, 1024, 3, depth=0.0).prompt.split("\n")[1] == ""
    assert generate_sample("passkey", tok, 1024, 3, depth=1.0).prompt.split("\n")[3] == ""


def test_niah_single_1(tok):
    """One needle (adjective-noun key, 7-digit value) among noise lines; singular template."""
    sample = generate_sample("niah_single_1", tok, 2048, 0)
    (value,) = sample.outputs
    assert NUMBER7.match(value)
    body = sample.input.split("\n")
    needles = [line for line in body if line.startswith("One of the special magic numbers for ")]
    assert len(needles) == 1 and needles[0].endswith(f" is: {value}.")
    key = needles[0].removeprefix("One of the special magic numbers for ").split(" is: ")[0]
    assert _needle_word(key)
    assert body.count(NOISE) == sample.haystack_size
    assert body[0] == (
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards."
    )
    assert body[-1] == f"What is the special magic number for {key} mentioned in the provided text?"
    assert sample.answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
    assert sample.tokens_to_generate == 128 and not sample.chat_template
    position = body.index(needles[0]) - 1  # lines of haystack before the needle
    assert sample.needle_depths == (position / sample.haystack_size,)


def test_niah_multikey_2_and_3(tok):
    """Haystack of distractor needles; the asked key appears in exactly one needle; value formats."""
    sample = generate_sample("niah_multikey_2", tok, 2048, 1)
    needles = sample.input.split("\n")[1:-1]
    assert len(needles) == sample.haystack_size + 1
    keys = [n.removeprefix("One of the special magic numbers for ").split(" is: ")[0] for n in needles]
    values = [n.split(" is: ")[1].removesuffix(".") for n in needles]
    asked = sample.answer_prefix.split(" for ")[1].split(" mentioned")[0]
    assert keys.count(asked) == 1 and values[keys.index(asked)] == sample.outputs[0]
    assert all(NUMBER7.match(v) for v in values) and all(_needle_word(k) for k in keys)
    sample = generate_sample("niah_multikey_3", tok, 2048, 1)
    needles = sample.input.split("\n")[1:-1]
    assert len(needles) == sample.haystack_size + 1 and sample.input.startswith("A special magic uuid is")
    for needle in needles:
        key, value = (
            needle.removeprefix("One of the special magic uuids for ").removesuffix(".").split(" is: ")
        )
        assert UUID4.match(key) and UUID4.match(value)
    assert UUID4.match(sample.outputs[0]) and sample.input.count(sample.outputs[0]) == 1


def test_variable_tracking(tok):
    """One 4-hop chain of 5-letter names in order; a solved 3-letter example first; answer = names."""
    sample = generate_sample("vt", tok, 2048, 0)
    names = sample.outputs
    assert len(names) == 5 and all(NAME5.match(n) for n in names)
    example, question = sample.input.split("\n\nMemorize and track")
    lines = question.split("\n")
    chain = [line for line in lines if line.startswith("VAR ")]
    value = chain[0].split(" = ")[1]
    assert re.fullmatch(r"[1-9][0-9]{4}", value)
    assert chain == [f"VAR {names[0]} = {value}"] + [
        f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(4)
    ]
    assert lines.count(NOISE) == sample.haystack_size
    assert sample.answer_prefix == (
        " Answer: According to the chain(s) of variable assignment in the text above, 5 variables are "
        f"assigned the value {value}, they are: "
    )
    assert lines[-1] == f"Question: Find all variables that are assigned the value {value} in the text above."
    shot = re.findall(r"VAR ([A-Z]{3}) = ", example)
    assert len(shot) == 5 and example.count("they are:  ") == 1  # RULER: answer prefix + " " + names
    assert sample.input.startswith(example + "\n\nMemorize and track") and example.endswith(" ".join(shot))
    assert (
        len(tok(example.split("they are:")[0] + "they are: ", add_special_tokens=False)["input_ids"]) <= 500
    )
    assert sample.tokens_to_generate == 30 and sample.needle_depths == tuple(sorted(sample.needle_depths))


def _listed(text: str) -> list[str]:
    return re.findall(r"\d+\. (\S+)", text)


@pytest.mark.parametrize("length, repeats", [(2048, (6, 1, 20, 3, 1)), (4608, (30, 3, 40, 10, 3))])
def test_common_words(tok, length, repeats):
    """10 common words x 30 (6 below 4096), the rest x 3 (1); a solved example first; answer = top 10."""
    common_n, rare_n, shot_words, shot_common, shot_rare = repeats
    sample = generate_sample("cwe", tok, length, 0)
    shot, question = sample.input.split("\nBelow is a numbered list", 1)
    listed = _listed(question.split("\n")[1])
    counts = {w: listed.count(w) for w in set(listed)}
    assert len(counts) == sample.haystack_size
    assert {w for w, c in counts.items() if c == common_n} == set(sample.outputs) and len(
        sample.outputs
    ) == 10
    assert all(c == rare_n for w, c in counts.items() if w not in sample.outputs)
    shot_list, shot_answer = shot.split("\n")[1], shot.split("are: ")[1]
    shot_counts = {w: _listed(shot_list).count(w) for w in _listed(shot_list)}
    assert len(shot_counts) == shot_words and set(_listed(shot_answer)) == {
        w for w, c in shot_counts.items() if c == shot_common
    } and all(c in (shot_common, shot_rare) for c in shot_counts.values())  # fmt: skip
    vocabulary = set(words.cwe_words(0))
    assert set(counts) <= vocabulary
    assert sample.answer_prefix == " Answer: The top 10 words that appear most often in the list are:"


def test_frequent_words(tok):
    """Zipf(2) counts of 6-letter coded words, rank 1 is '...', answer = ranks 2 to 4."""
    sample = generate_sample("fwe", tok, 1536, 2)
    text = sample.input.split("coded words. ")[1].split("\nQuestion:")[0].split(" ")
    counts = {w: text.count(w) for w in set(text)}
    ranked = sorted(counts, key=counts.get, reverse=True)
    assert ranked[0] == "..." and set(ranked[1:4]) == set(sample.outputs)
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in ranked[1:])
    expected = [c for c in zipf_counts(sample.haystack_size, (1536 - 50) // 50) if c > 0]
    assert sorted(counts.values(), reverse=True) == expected
    assert sample.input.endswith("What are the three most frequently appeared words in the above coded text?")
    assert fwe_minimum(29) == 27  # int(27 / 16 / zeta(2)) = 1 > int(27 / 25 / zeta(2)) = 0


def test_zeta_against_closed_forms():
    """The Euler-Maclaurin zeta against pi^2/6, pi^4/90 and Apery's constant (RULER: scipy)."""
    assert zeta(2.0) == pytest.approx(math.pi**2 / 6, rel=1e-15)
    assert zeta(4.0) == pytest.approx(math.pi**4 / 90, rel=1e-15)
    assert zeta(3.0) == pytest.approx(1.2020569031595942, rel=1e-15)
    with pytest.raises(ValueError, match="s > 1"):
        zeta(1.0)


@pytest.mark.parametrize(
    "task", ["passkey", "niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe"]
)
def test_length_fitting_is_tight(tok, chat_tok, task):
    """prompt tokens + tokens to generate <= length, and one more haystack unit would not fit; the
    count is the prompt's real tokenization (chat template included when used)."""
    for tokenizer, length in ((tok, 1800), (chat_tok, 2500)):
        sample = generate_sample(task, tokenizer, length, 0)
        ids = encode_prompt(tokenizer, sample.prompt, sample.chat_template)
        assert len(ids) == sample.num_tokens <= length - sample.tokens_to_generate
        request = sample_request(task, tokenizer, length, 0)
        render, _ = TASKS[task].builder(request)
        _, bigger = render_prompt(tokenizer, render(sample.haystack_size + 1), request.chat_template)
        assert len(encode_prompt(tokenizer, bigger, request.chat_template)) > request.budget
        unreserved = generate_sample(task, tokenizer, length, 0, count_generated=False)
        assert sample.num_tokens <= unreserved.num_tokens <= length  # (a noise line can exceed 30 tokens)


def test_chat_template_wraps_input_not_answer_prefix(chat_tok):
    sample = generate_sample("niah_single_1", chat_tok, 1024, 0)
    assert sample.chat_template and sample.input.startswith("<s><|user|>\nA special magic number")
    assert sample.input.endswith("</s>\n<|assistant|>\n") and sample.prompt.endswith(sample.answer_prefix)
    raw = generate_sample("niah_single_1", chat_tok, 1024, 0, chat_template=False)
    assert raw.input.startswith("A special magic") and not raw.chat_template


def test_determinism_and_seeds(tok):
    """Same arguments -> same sample (and same as in a batch); seed or index changes it; a requested
    depth moves the needle but keeps the key."""
    for task in ("passkey", "niah_single_1", "niah_multikey_3", "vt", "cwe", "fwe"):
        length = 2048
        first = generate_sample(task, tok, length, 1, seed=7)
        assert (
            first
            == generate_samples(task, tok, length, 2, seed=7)[1]
            == generate_sample(task, tok, length, 1, seed=7)
        )
        assert generate_sample(task, tok, length, 1, seed=8).prompt != first.prompt
        assert generate_sample(task, tok, length, 2, seed=7).prompt != first.prompt
    shallow = generate_sample("niah_single_1", tok, 2048, 0, depth=0.0)
    deep = generate_sample("niah_single_1", tok, 2048, 0, depth=1.0)
    assert shallow.outputs == deep.outputs and shallow.prompt != deep.prompt
    assert shallow.needle_depths == (0.0,) and deep.needle_depths == (1.0,)
    assert Sample.from_dict(json.loads(shallow.to_json())) == shallow


def test_requested_depths(tok):
    """The needle sits after int(depth * n) of the n haystack lines (noise, distractors, characters)."""
    for task in ("niah_single_1", "niah_multikey_2", "passkey"):
        for depth in (0.1, 0.5, 0.9):
            sample = generate_sample(task, tok, 2048, 0, depth=depth)
            n = sample.haystack_size
            assert sample.needle_depths == (int(depth * n) / n,)
    lines = generate_sample("niah_single_1", tok, 2048, 0, depth=0.5).input.split("\n")
    needle = next(i for i, line in enumerate(lines) if line.startswith("One of"))
    assert lines[1:needle].count(NOISE) == needle - 1 == int(0.5 * lines.count(NOISE))


def test_ruler_placement_without_depth(tok):
    """Without a depth the needles land where RULER's draw puts them: any line, varying by sample."""
    depths = {generate_sample("niah_single_1", tok, 1024, i).needle_depths[0] for i in range(8)}
    assert len(depths) > 4 and all(0 <= d < 1 for d in depths)
    assert DEPTHS[:4] == (0, 3, 5, 8) and DEPTHS[-1] == 100 and len(set(DEPTHS)) == 40


def test_bad_input(tok):
    with pytest.raises(
        LengthTooShortError, match=r"niah_single_1: length 200 leaves 72 prompt tokens .* at least"
    ) as err:
        generate_sample("niah_single_1", tok, 200, 0)
    assert "\n" not in str(err.value)
    with pytest.raises(LengthTooShortError, match="passkey: length 50"):
        generate_sample("passkey", tok, 50, 0)
    with pytest.raises(ValueError, match="coded vocabulary of 2 words"):
        generate_sample("fwe", tok, 150, 0)
    with pytest.raises(
        ValueError, match=r"vt takes no needle depth; depth applies to: passkey, niah_single_1"
    ):
        generate_sample("vt", tok, 2048, 0, depth=0.5)
    with pytest.raises(ValueError, match=r"depth must be in \[0, 1\]"):
        generate_sample("passkey", tok, 2048, 0, depth=1.5)
    for kwargs in ({"length": 0}, {"length": 1.5}, {"index": -1}):
        args = {"length": 1024, "index": 0, **kwargs}
        with pytest.raises(ValueError, match="must be an integer"):
            generate_sample("passkey", tok, args["length"], args["index"])
    with pytest.raises(ValueError, match="unknown task"):
        generate_sample("niah_single_4", tok, 1024, 0)
    with pytest.raises(ValueError, match="num_samples must be"):
        generate_samples("passkey", tok, 1024, 0)


def test_word_sources():
    """RULER's adjective-noun keys are unique strings, so independent draws are its distribution;
    the common-words vocabulary is extended past wonderwords without repeats."""
    adjectives, nouns = set(words.adjectives()), set(words.nouns())
    # "a-n" == "a2-n2" with a != a2 needs a hyphenated adjective a2 = a + "-" + x and a noun x + "-" + n2.
    clashes = [
        (a2, n)
        for a2 in adjectives
        for i, ch in enumerate(a2)
        if ch == "-" and a2[:i] in adjectives
        for n in nouns
        if n.startswith(a2[i + 1 :] + "-") and n[len(a2) - i :] in nouns
    ]
    assert clashes == []
    extended = words.sample_cwe_words(__import__("random").Random(0), 0, len(words.cwe_words(0)) + 500)
    assert (
        len(set(extended)) == len(extended)
        and sum("-" in w and w not in words.cwe_words(0) for w in extended) == 500
    )


def test_real_chat_template_smollm2():
    """SmolLM2's own chat template: the task text is the user turn, the answer prefix follows the
    assistant header, and the count is the real tokenization (<= length - tokens to generate).
    The model folder is converted on first use (tests/real_model.py), never skipped."""
    from transformers import AutoTokenizer

    from tests.real_model import smollm2_path

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    for task in ("niah_single_1", "vt", "passkey"):
        sample = generate_sample(task, tokenizer, 3072, 0)
        assert sample.chat_template and sample.input.startswith("<|im_start|>")
        assert sample.input.endswith("<|im_start|>assistant\n")
        ids = encode_prompt(tokenizer, sample.prompt, True)
        assert len(ids) == sample.num_tokens <= 3072 - sample.tokens_to_generate
        assert sample.num_tokens > 3072 - sample.tokens_to_generate - 60  # one haystack unit short at most
