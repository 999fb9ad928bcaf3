"""Tokenizers for training and evaluation: :func:`load_tokenizer` (a hub name or folder, or the shipped
demo tokenizers), and how a prompt becomes ids (:func:`apply_template`, :func:`encode_prompt`).

The demo tokenizer is a tiny, offline byte-level BPE tokenizer for demos and tests (no Hub downloads).
It is trained deterministically (``tokenizers`` library) on line-retrieval text from
:mod:`ringft.data.line_retrieval.text` plus a few generic English sentences. Every digit is its own
token (numbers stay learnable), any byte string can be encoded (byte-level alphabet, no
``<unk>`` in practice) and decoding round-trips the text exactly. Special tokens: ``<s>``
(BOS, added in front by ``tokenizer(text)``), ``</s>`` (EOS), ``<pad>``, ``<unk>``. There is
no chat template, so prompts stay raw text.

The trained copy ships in ``ringft/assets/demo_tokenizer/``; rebuild it with
``python -m ringft.data.tokenizer --rebuild``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

__all__ = [
    "DEMO_TOKENIZER_DIR",
    "DEMO_VOCAB_SIZE",
    "SPECIAL_TOKENS",
    "apply_template",
    "build_demo_tokenizer",
    "demo_corpus",
    "encode_prompt",
    "has_chat_template",
    "line_template_pieces",
    "load_demo_lines_tokenizer",
    "load_demo_tokenizer",
    "load_tokenizer",
    "save_demo_tokenizer",
]

DEMO_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "demo_tokenizer"
DEMO_VOCAB_SIZE = 2048
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<unk>")  # ids 0..3

_ENGLISH = """\
The quick brown fox jumps over the lazy dog.
It was a bright cold day in April, and the clocks were striking thirteen.
Please remember the number I told you yesterday and tell it to me again later.
A long context model has to find a small detail hidden in a very long document.
We trained the model for a few hundred steps and the loss went down steadily.
What is the capital of France? The capital of France is Paris.
She opened the window, looked at the garden and smiled at the little birds.
The answer is the value that was written at the end of the requested line.
Reading a book on a rainy afternoon is one of the nicest things to do.
Numbers such as 7, 42, 1000 and 31337 appear in many different places.
Can you summarize the main points of this text in two or three sentences?
Thank you very much for your help; I really appreciate it.
The train leaves the station at nine o'clock in the morning, every day of the week.
Attention lets each token look at every other token in the sequence.
If you are not sure about the answer, say that you do not know.
"""


def demo_corpus() -> Iterator[str]:
    """Deterministic training text: line-retrieval records, every word, English sentences."""
    import ringft.data.line_retrieval.text as ld

    for _ in range(4):
        yield from _ENGLISH.splitlines()
    words = " ".join(ld.ADJECTIVES + ld.NOUNS)
    for _ in range(8):
        yield words
    for seed in range(24):
        num_words = 2 + seed % 2
        names = ld.unique_names(60, seed=seed, num_words=num_words, distinct_nouns=False)  # as shipped
        numbers = [(seed * 7919 + i * 104729) % ld.MAX_NUMBER + 1 for i in range(len(names))]
        idx = (seed * 13) % len(names)
        yield ld.build_record_text(names, numbers, idx) + f" {numbers[idx]}"


def build_demo_tokenizer() -> PreTrainedTokenizerFast:
    """Train the demo tokenizer from scratch (deterministic, about a second)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=DEMO_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(demo_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        add_bos_token=True,
        add_eos_token=False,
        model_max_length=1 << 24,
        clean_up_tokenization_spaces=False,
    )


def save_demo_tokenizer(path: str | Path = DEMO_TOKENIZER_DIR) -> Path:
    """Build the tokenizer and ``save_pretrained`` it to ``path`` (default: shipped copy)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_demo_tokenizer().save_pretrained(str(path))
    # transformers 5 records its internal class name ("TokenizersBackend"), which older
    # AutoTokenizer versions cannot resolve; the generic fast class loads under both.
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    # transformers 4 also wrote this file; keep it for older loaders.
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (path / "special_tokens_map.json").write_text(
        json.dumps(special, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    return path


def load_demo_tokenizer() -> PreTrainedTokenizerFast:
    """Load the shipped copy from ``ringft/assets/demo_tokenizer/``."""
    if not (DEMO_TOKENIZER_DIR / "tokenizer.json").is_file():
        hint = "python -m ringft.data.tokenizer --rebuild"
        raise FileNotFoundError(f"{DEMO_TOKENIZER_DIR} has no tokenizer.json; run `{hint}`")
    return PreTrainedTokenizerFast.from_pretrained(str(DEMO_TOKENIZER_DIR))


def line_template_pieces() -> tuple[str, ...]:
    """The strings of a ringft-style line-retrieval record that "demo-lines" makes single tokens: the
    header, the line's middle and end, the question's start and end, and each name noun joined to the
    text after it in a line (``"otter: REGISTER_CONTENT is <"``) and in the question
    (``"otter? Answer with the number."``).

    Each piece starts and ends where the record's text pieces do (header | ``line ...>\\n`` | question |
    `` number``), so tokenizing the pieces one by one equals tokenizing the whole record.
    """
    import ringft.data.line_retrieval.text as ld

    question_prefix, question_suffix = ld.QUESTION_TEMPLATE.split("{name}")
    line_middle, line_end = ld.LINE_TEMPLATE.split("{name}")[1].split("{number}")
    # "line " stays BPE ("line" + " brave"): the name's first word keeps its usual token.
    fixed = (ld.PREAMBLE, line_middle, line_end, question_prefix.removesuffix(" "), question_suffix)
    return fixed + tuple(n + line_middle for n in ld.NOUNS) + tuple(n + question_suffix for n in ld.NOUNS)


#: "demo-lines" reads numbers in chunks of up to this many digits, left to right ("31337" -> "313" "37").
NUMBER_CHUNK = 3


def load_demo_lines_tokenizer() -> PreTrainedTokenizerFast:
    """The demo tokenizer plus added tokens for the pieces of :func:`line_template_pieces` and for
    every string of 2 or 3 digits: the tokenizer of the CPU demo's base model (recipes/demo/).

    ``line brave-otter: REGISTER_CONTENT is <31337>\\n`` becomes ``line`` `` brave`` ``-``
    ``otter: REGISTER_CONTENT is <`` ``313`` ``37`` ``>\\n`` (7 tokens instead of 17), the question
    ends with ``otter? Answer with the number.``, and the 81-token header is one token. Added tokens
    match leftmost-longest, so a number splits into chunks of 3 digits from the left.

    Why: a 2-layer model retrieves by copying what followed a match (induction). Here the answer's
    first chunk follows the asked noun's question token in the same way the line's first chunk
    follows its noun's line token, and the second chunk follows the first in both places, so every
    answer token is one step of induction (benchmarks/history.md, "How the base model was made to
    retrieve"). Ids 0..len(demo)-1 are the demo tokenizer's.
    """
    from tokenizers import AddedToken

    tokenizer = load_demo_tokenizer()
    chunks = [f"{i:0{width}d}" for width in range(2, NUMBER_CHUNK + 1) for i in range(10**width)]
    pieces = [*line_template_pieces(), *chunks]
    tokenizer.add_tokens([AddedToken(p, normalized=False, special=False) for p in pieces])
    return tokenizer


def load_tokenizer(name_or_path: str, **kwargs: Any) -> Any:
    """``"demo"`` / ``"demo-lines"`` -> the shipped demo tokenizer(s), anything else -> ``AutoTokenizer``."""
    if name_or_path == "demo":
        return load_demo_tokenizer()
    if name_or_path == "demo-lines":
        return load_demo_lines_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, **kwargs)


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template (prompts then go in one user turn)."""
    return bool(getattr(tokenizer, "chat_template", None))


def apply_template(tokenizer: Any, text: str, chat_template: bool) -> str:
    """Wrap ``text`` as a single user turn with the tokenizer's chat template if requested."""
    if not chat_template:
        return text
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def encode_prompt(tokenizer: Any, prompt: str, chat_template: bool = False) -> list[int]:
    """Token ids of a final prompt (BOS added by the tokenizer only for raw prompts)."""
    enc = tokenizer(prompt, add_special_tokens=not chat_template, verbose=False)
    return list(enc["input_ids"])


def main(argv: list[str] | None = None) -> None:
    """CLI: show the shipped tokenizer, or ``--rebuild`` it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rebuild", action="store_true", help="retrain and rewrite the copy")
    parser.add_argument("--output", type=Path, default=DEMO_TOKENIZER_DIR, help="target dir")
    args = parser.parse_args(argv)
    if args.rebuild:
        out = save_demo_tokenizer(args.output)
        tok = PreTrainedTokenizerFast.from_pretrained(str(out))
        size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
        print(f"wrote {out} ({size} bytes)")
    else:
        tok = load_demo_tokenizer()
    sample = "line brave-otter: REGISTER_CONTENT is <31337>\n"
    ids = tok(sample)["input_ids"]
    print(f"vocab size {len(tok)}; {sample!r} -> {len(ids)} tokens:")
    print(tok.convert_ids_to_tokens(ids))


if __name__ == "__main__":
    main()
