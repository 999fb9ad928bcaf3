"""Tests for ringft.data.pack_corpus and the data_prep/pack.py CLI (all local, no downloads)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # allow running without the package installed
    sys.path.insert(0, str(REPO_ROOT))
packing = importlib.import_module("ringft.data.pack_corpus")

CLI_PATH = REPO_ROOT / "data_prep" / "pack.py"

WORDS = (
    "the quick brown fox jumps over lazy dog ring attention long context llama mistral "
    "token sequence pack shard rotate query key value"
).split()
VOCAB = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
EOS = VOCAB["</s>"]


def _make_docs() -> list[str]:
    rng = np.random.default_rng(0)
    lengths = [5, 1, 17, 3, 40, 8, 2, 11, 26, 4, 9, 13, 6, 31, 7]
    return [" ".join(rng.choice(WORDS, size=n)) for n in lengths]


DOCS = _make_docs()


def _ids(doc: str) -> list[int]:
    """Reference tokenization, independent of the tokenizer object."""
    return [VOCAB[w] for w in doc.split()]


def _expected_stream(docs: list[str], add_eos: bool = True) -> list[int]:
    out: list[int] = []
    for d in docs:
        out += _ids(d) + ([EOS] if add_eos else [])
    return out


def _make_tokenizer(eos: bool = True) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    kwargs = {"eos_token": "</s>"} if eos else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", **kwargs)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return _make_tokenizer()


def _check_packed(
    packed: datasets.Dataset, summary, docs: list[str], seq_len: int, add_eos: bool = True
) -> None:
    stream = _expected_stream(docs, add_eos)
    n_seq = len(stream) // seq_len
    assert summary.documents == len(docs)
    assert summary.tokens_in == sum(len(_ids(d)) + int(add_eos) for d in docs) == len(stream)
    assert summary.sequences == n_seq == len(packed)
    assert summary.tokens_out == n_seq * seq_len
    assert summary.dropped_tail_tokens == len(stream) % seq_len
    assert summary.tokens_in == summary.tokens_out + summary.dropped_tail_tokens
    assert summary.seq_len == seq_len
    assert packed.column_names == ["input_ids"]
    rows = packed["input_ids"]
    assert all(len(r) == seq_len for r in rows)
    flat = [t for r in rows for t in r]
    assert flat == stream[: n_seq * seq_len]


def _write_corpus(kind: str, root: Path, docs: list[str]) -> Path:
    """Write ``docs`` as a directory of jsonl / parquet / txt files; return the directory."""
    d = root / kind
    d.mkdir()
    if kind == "txt":  # one document per file (txt_sample_by="document")
        for i, doc in enumerate(docs):
            (d / f"doc_{i:03d}.txt").write_text(doc + "\n", encoding="utf-8")
        return d
    halves = [docs[: len(docs) // 2], docs[len(docs) // 2 :]]
    for i, part in enumerate(halves):
        rows = [{"id": j, "text": t} for j, t in enumerate(part)]
        if kind == "jsonl":
            with open(d / f"part-{i}.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        else:
            datasets.Dataset.from_list(rows).to_parquet(str(d / f"part-{i}.parquet"))
    return d


def _rows(packed: datasets.Dataset) -> list[list[int]]:
    return packed["input_ids"][:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seq_len", [1, 7, 16, 64])
def test_pack_in_memory_exact(tokenizer, tmp_path, seq_len):
    ds = datasets.Dataset.from_dict({"text": DOCS, "other": list(range(len(DOCS)))})
    packed, summary = packing.pack_dataset(ds, tokenizer, seq_len, batch_size=4, cache_dir=str(tmp_path))
    _check_packed(packed, summary, DOCS, seq_len)
    assert str(summary).startswith(f"packed {len(DOCS)} documents")
    assert "\n" not in str(summary)


@pytest.mark.timeout(120)
def test_pack_without_eos_and_empty_docs(tokenizer, tmp_path):
    docs = ["", *DOCS[:5], None]
    ds = datasets.Dataset.from_dict({"text": docs})
    packed, summary = packing.pack_dataset(ds, tokenizer, 5, cache_dir=str(tmp_path))
    _check_packed(packed, summary, [d or "" for d in docs], 5)
    packed, summary = packing.pack_dataset(ds, tokenizer, 5, add_eos=False, cache_dir=str(tmp_path))
    _check_packed(packed, summary, [d or "" for d in docs], 5, add_eos=False)


@pytest.mark.timeout(120)
def test_streaming_matches_map_style(tokenizer, tmp_path):
    ds = datasets.Dataset.from_dict({"text": DOCS})
    packed, summary = packing.pack_dataset(ds, tokenizer, 9, batch_size=3, cache_dir=str(tmp_path))
    s_packed, s_summary = packing.pack_dataset(
        ds.to_iterable_dataset(num_shards=2), tokenizer, 9, batch_size=3, cache_dir=str(tmp_path)
    )
    assert s_summary == summary
    assert _rows(s_packed) == _rows(packed)
    _check_packed(s_packed, s_summary, DOCS, 9)


@pytest.mark.timeout(120)
def test_packing_is_incremental(tokenizer):
    """The packer must not read the whole corpus before producing the first sequence."""
    consumed = []

    def gen():
        for i, doc in enumerate(DOCS * 50):
            consumed.append(i)
            yield {"text": doc}

    stream = datasets.IterableDataset.from_generator(gen)
    summary = packing.PackSummary()
    it = packing.iter_packed_sequences(stream, tokenizer, 4, batch_size=5, summary=summary)
    first = next(it)
    assert first.tolist() == _expected_stream(DOCS)[:4]
    assert len(consumed) <= 10  # at most the peeked row plus one batch
    rest = list(it)
    assert summary.sequences == 1 + len(rest)
    _check_stream = _expected_stream(DOCS * 50)
    assert summary.tokens_in == len(_check_stream)
    assert np.concatenate([first, *rest]).tolist() == _check_stream[: summary.tokens_out]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["jsonl", "parquet", "txt"])
def test_load_corpus_formats(tokenizer, tmp_path, kind):
    src = _write_corpus(kind, tmp_path, DOCS)
    cache = str(tmp_path / "cache")
    results = []
    for streaming in (False, True):
        corpus = packing.load_corpus(str(src), streaming=streaming, cache_dir=cache)
        assert isinstance(corpus, datasets.IterableDataset if streaming else datasets.Dataset)
        packed, summary = packing.pack_dataset(corpus, tokenizer, 8, cache_dir=cache)
        _check_packed(packed, summary, DOCS, 8)
        results.append((_rows(packed), summary))
    assert results[0] == results[1]


@pytest.mark.timeout(120)
def test_load_corpus_single_file_glob_and_txt_lines(tokenizer, tmp_path):
    src = _write_corpus("jsonl", tmp_path, DOCS)
    cache = str(tmp_path / "cache")
    one = packing.load_corpus(str(src / "part-0.jsonl"), cache_dir=cache)
    assert one["text"][:] == DOCS[: len(DOCS) // 2]
    both = packing.load_corpus(str(src / "part-*.jsonl"), split="validation", cache_dir=cache)
    assert both["text"][:] == DOCS
    txt = tmp_path / "lines.txt"
    txt.write_text("\n".join(DOCS) + "\n", encoding="utf-8")
    lines = packing.load_corpus(str(txt), txt_sample_by="line", cache_dir=cache)
    assert lines["text"][:] == DOCS
    whole = packing.load_corpus(str(txt), cache_dir=cache)
    assert len(whole) == 1
    packed, summary = packing.pack_dataset(whole, tokenizer, 10, cache_dir=cache)
    assert summary.tokens_in == sum(len(_ids(d)) for d in DOCS) + 1


@pytest.mark.timeout(120)
def test_num_proc_and_max_documents(tokenizer, tmp_path):
    ds = datasets.Dataset.from_dict({"text": DOCS})
    packed, summary = packing.pack_dataset(
        ds, tokenizer, 6, num_proc=2, batch_size=4, cache_dir=str(tmp_path)
    )
    _check_packed(packed, summary, DOCS, 6)
    for corpus in (ds, ds.to_iterable_dataset()):
        packed, summary = packing.pack_dataset(corpus, tokenizer, 6, max_documents=7, cache_dir=str(tmp_path))
        _check_packed(packed, summary, DOCS[:7], 6)


@pytest.mark.timeout(120)
def test_corpus_shorter_than_seq_len(tokenizer):
    ds = datasets.Dataset.from_dict({"text": DOCS[:2]})
    packed, summary = packing.pack_dataset(ds, tokenizer, 10_000)
    assert len(packed) == 0 and packed.column_names == ["input_ids"]
    assert summary.sequences == 0 and summary.tokens_out == 0
    assert summary.dropped_tail_tokens == summary.tokens_in == len(_expected_stream(DOCS[:2]))


@pytest.mark.timeout(120)
def test_load_corpus_errors(tmp_path):
    bad = tmp_path / "corpus.csv"
    bad.write_text("text\nhello\n")
    with pytest.raises(ValueError, match=r"unsupported file extension '\.csv'"):
        packing.load_corpus(str(bad))
    with pytest.raises(ValueError, match="no such file"):
        packing.load_corpus(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="no files match"):
        packing.load_corpus(str(tmp_path / "*.parquet"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="contains no"):
        packing.load_corpus(str(empty))
    src = _write_corpus("jsonl", tmp_path, DOCS)
    (src / "extra.txt").write_text("hello\n")
    with pytest.raises(ValueError, match="mixes file types"):
        packing.load_corpus(str(src))
    os.remove(src / "extra.txt")
    for streaming in (False, True):
        with pytest.raises(ValueError, match=r"'content' not found.*'id', 'text'"):
            packing.load_corpus(
                str(src),
                text_column="content",
                streaming=streaming,
                cache_dir=str(tmp_path / "cache"),
            )


@pytest.mark.timeout(120)
def test_pack_dataset_errors(tokenizer):
    ds = datasets.Dataset.from_dict({"body": ["a b"], "n": [1]})
    with pytest.raises(ValueError, match=r"'text' not found.*'body', 'n'"):
        packing.pack_dataset(ds, tokenizer, 4)
    good = datasets.Dataset.from_dict({"text": ["the dog"]})
    for seq_len in (0, -3):
        with pytest.raises(ValueError, match="seq_len"):
            packing.pack_dataset(good, tokenizer, seq_len)
    with pytest.raises(ValueError, match="eos_token_id"):
        packing.pack_dataset(good, _make_tokenizer(eos=False), 4)
    with pytest.raises(ValueError, match="drop_tail"):
        packing.pack_dataset(good, tokenizer, 4, drop_tail=False)
    with pytest.raises(ValueError, match="must hold strings"):
        packing.pack_dataset(ds, tokenizer, 4, text_column="n")


def _load_cli():
    spec = importlib.util.spec_from_file_location("ringft_pack_cli", CLI_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_cli_main_writes_loadable_dataset(tokenizer, tmp_path, capsys):
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(str(tok_dir))
    src = _write_corpus("jsonl", tmp_path, DOCS)
    out = tmp_path / "out" / "packed"
    argv = [
        "--tokenizer",
        str(tok_dir),
        "--source",
        str(src),
        "--seq-len",
        "12",
        "--output",
        str(out),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--streaming",
    ]
    cli = _load_cli()
    assert cli.main(argv) == 0
    stdout = capsys.readouterr().out
    assert "packed 15 documents" in stdout
    loaded = datasets.load_from_disk(str(out))
    stream = _expected_stream(DOCS)
    assert len(loaded) == len(stream) // 12
    assert [t for r in loaded["input_ids"] for t in r] == stream[: len(loaded) * 12]
    meta = json.loads((out / cli.SUMMARY_FILE).read_text())
    assert meta["tokens_in"] == len(stream) and meta["seq_len"] == 12
    assert not [p for p in (tmp_path / "out").iterdir() if p.name != "packed"]  # scratch gone
    # Refuses to clobber a non-empty output unless --overwrite; --max-documents limits input.
    assert cli.main(argv) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert cli.main([*argv, "--overwrite", "--max-documents", "3"]) == 0
    assert datasets.load_from_disk(str(out))["input_ids"][:] == [
        stream[i : i + 12] for i in range(0, len(_expected_stream(DOCS[:3])) - 11, 12)
    ]


@pytest.mark.timeout(120)
def test_cli_subprocess_clean_errors(tokenizer, tmp_path):
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(str(tok_dir))
    src = _write_corpus("jsonl", tmp_path, DOCS)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    cmd = [
        sys.executable,
        str(CLI_PATH),
        "--tokenizer",
        str(tok_dir),
        "--source",
        str(src),
        "--seq-len",
        "8",
        "--output",
        str(tmp_path / "out"),
        "--text-column",
        "content",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=110)
    assert proc.returncode == 1
    err_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(err_lines) == 1 and "'content' not found" in err_lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_load_corpus_hub_name_dispatch(monkeypatch):
    """A name that is not a local path goes to datasets.load_dataset (mocked: no network)."""
    calls = []

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return datasets.Dataset.from_dict({"text": ["the dog"], "meta": [0]})

    monkeypatch.setattr(packing.datasets, "load_dataset", fake_load_dataset)
    ds = packing.load_corpus("some-org/some-corpus", split="validation", streaming=True)
    assert ds["text"][:] == ["the dog"]
    assert calls == [("some-org/some-corpus", {"split": "validation", "streaming": True, "cache_dir": None})]
    with pytest.raises(ValueError, match=r"'body' not found.*'text', 'meta'"):
        packing.load_corpus("some-org/some-corpus", text_column="body")


@pytest.mark.timeout(120)
def test_cli_checks_the_source_first_and_accepts_the_demo_tokenizer(tmp_path, capsys, monkeypatch):
    """Issue 11: a missing --source failed only after trying the hub for the tokenizer 'demo'."""
    cli = _load_cli()

    def no_tokenizer(name, **kwargs):
        raise AssertionError(f"tokenizer {name!r} loaded before the source was checked")

    monkeypatch.setattr(cli, "load_tokenizer", no_tokenizer)
    missing, out = tmp_path / "nonexistent.jsonl", str(tmp_path / "o")
    argv = ["--tokenizer", "demo", "--source", str(missing), "--seq-len", "16", "--output", out]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"error: no such file or directory: {str(missing)!r}"
    assert not (tmp_path / "o").exists()

    monkeypatch.undo()
    from ringft.data.tokenizer import load_tokenizer

    def no_hub(*args, **kwargs):
        raise AssertionError("asked the hub for a path-like tokenizer name")

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", no_hub)
    src = _write_corpus("jsonl", tmp_path, DOCS)
    bad_tok = ["--tokenizer", str(tmp_path / "no-tok"), "--source", str(src), "--seq-len", "16"]
    assert cli.main([*bad_tok, "--output", out]) == 1
    assert "no such folder" in capsys.readouterr().err and not (tmp_path / "o").exists()

    argv = ["--tokenizer", "demo", "--source", str(src), "--seq-len", "16", "--output", out]
    assert cli.main(argv) == 0  # the shipped tokenizer: no download
    demo = load_tokenizer("demo")
    rows = datasets.load_from_disk(str(tmp_path / "o"))["input_ids"]
    stream = [t for d in DOCS for t in demo(d, add_special_tokens=False)["input_ids"] + [demo.eos_token_id]]
    assert [t for r in rows for t in r] == stream[: len(rows) * 16] and len(rows) == len(stream) // 16


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seq_len", [7, 16])
def test_pack_with_document_offsets(tokenizer, tmp_path, seq_len):
    """--document-masking: each row carries its document offsets; a document cut by a row start
    continues as its own document; the rows themselves are unchanged; the collator turns the
    offsets into per-document positions and labels."""
    from ringft.data.collator import RingDataCollator

    ds = datasets.Dataset.from_dict({"text": DOCS})
    plain, _ = packing.pack_dataset(ds, tokenizer, seq_len, batch_size=4, cache_dir=str(tmp_path / "a"))
    packed, summary = packing.pack_dataset(
        ds, tokenizer, seq_len, batch_size=4, cache_dir=str(tmp_path / "b"), document_masking=True
    )
    assert packed.column_names == ["input_ids", "cu_seqlens"]
    assert packed["input_ids"][:] == plain["input_ids"][:]
    starts, at = set(), 0
    for d in DOCS:
        starts.add(at)
        at += len(_ids(d)) + 1
    for i, cu in enumerate(packed["cu_seqlens"]):
        want = sorted({0, seq_len} | {s - i * seq_len for s in starts if i * seq_len < s < (i + 1) * seq_len})
        assert cu == want, (i, cu, want)
    example = {"input_ids": packed["input_ids"][0], "cu_seqlens": packed["cu_seqlens"][0]}
    collator = RingDataCollator(0, 1, pad_token_id=0, max_length=16, document_masking=True)
    batch = collator.global_batch([example])
    cu = example["cu_seqlens"]
    for a, b in zip(cu, cu[1:]):
        assert batch["position_ids"][0, a:b].tolist() == list(range(b - a))
        assert batch["shift_labels"][0, b - 1] == -100  # the last token of a document predicts nothing
        assert batch["shift_labels"][0, a : b - 1].tolist() == example["input_ids"][a + 1 : b]
    with pytest.raises(ValueError, match="no 'cu_seqlens'"):
        RingDataCollator(0, 1, pad_token_id=0, document_masking=True)([{"input_ids": [1, 2]}])


def test_pack_examples_keeps_each_example_whole_with_its_offsets():
    """SFT examples (prompt labels -100) packed best-fit decreasing into rows with cu_seqlens: every
    example appears once, whole and contiguous, with its own labels; rows fit seq_len; with
    cp_size > 1 the order inside a row is balanced (any order is exact)."""
    import random

    gen = random.Random(3)
    lengths = [gen.randint(1, 40) for _ in range(30)]
    ids = [[gen.randrange(3, 200) for _ in range(n)] for n in lengths]
    labels = [[-100] * (n // 2) + x[n // 2 :] for n, x in zip(lengths, ids)]
    examples = datasets.Dataset.from_dict({"input_ids": ids, "labels": labels})
    for cp_size in (1, 4):
        packed, padding = packing.pack_examples(examples, 48, cp_size=cp_size)
        assert packed.column_names == ["input_ids", "labels", "cu_seqlens"]
        found = []
        for row, lab, cu in zip(packed["input_ids"], packed["labels"], packed["cu_seqlens"]):
            assert cu[0] == 0 and cu[-1] == len(row) == len(lab) <= 48
            found += [(tuple(row[a:b]), tuple(lab[a:b])) for a, b in zip(cu, cu[1:])]
        assert sorted(found) == sorted(zip(map(tuple, ids), map(tuple, labels)))
        optimum_bound = -(-sum(lengths) // 48)
        assert len(packed) <= 11 / 9 * optimum_bound + 6 / 9  # best-fit decreasing's guarantee
        assert padding == pytest.approx(1 - sum(lengths) / (len(packed) * 48))
    unlabeled, _ = packing.pack_examples(examples.remove_columns("labels"), 48)
    assert unlabeled["labels"] == unlabeled["input_ids"]
    with pytest.raises(ValueError, match="1 examples are longer than seq_len=32 .*example 0, 33 tokens"):
        packing.pack_examples(datasets.Dataset.from_dict({"input_ids": [[1] * 33, [1]]}), 32)
