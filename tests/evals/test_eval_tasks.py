"""The eval harness's tasks (eval-ppl, eval-niah, eval-ruler, eval-short) on CPU in this process:
every bad input is one line before any model loads and nothing is written; --text reading (files,
globs, jsonl, a save_to_disk folder, --concat); resumable results keyed by the settings and the
cases; the sliding window's coverage; the log bins; the memory formula's parameter count.

Model: a 1-layer random LLaMA with the demo tokenizer (tests/evals/test_eval_lines.py); the numbers
are checked against transformers in tests/evals/test_eval_tasks_real_model.py.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_model

BASE = ["--dtype", "fp32", "--attn-backend", "torch", "--no-progress"]
TEXT = "The lighthouse keeper climbed the stairs at dusk and wrote the weather in her logbook. " * 12


def run(command: str, argv: list[str]) -> tuple[int, str]:
    """``ringft <command> argv`` in this process: (exit code, its own stderr lines)."""
    from ringft.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([command, *argv])
    ours = [line for line in err.getvalue().splitlines() if line.startswith(f"ringft {command}")]
    return code, "".join(line + "\n" for line in ours)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny model, a second one (the 'base'), and texts: two files, a jsonl, a save_to_disk folder."""
    root = tmp_path_factory.mktemp("tasks")
    save_tiny_model(root / "model", max_positions=256)
    save_tiny_model(root / "base", max_positions=128)
    (root / "a.txt").write_text(TEXT)
    (root / "b.txt").write_text(TEXT[:100])  # about 50 tokens
    (root / "docs.jsonl").write_text(
        json.dumps({"text": TEXT}) + "\n" + json.dumps({"text": TEXT[:500]}) + "\n"
    )
    from datasets import Dataset

    Dataset.from_dict({"text": [TEXT, TEXT[::-1]], "other": [1, 2]}).save_to_disk(str(root / "dataset"))
    return root


def _no_model_loads(monkeypatch) -> None:
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def test_bad_inputs_one_line_before_any_model_loads(folder, monkeypatch):
    _no_model_loads(monkeypatch)
    model, base = ["--model", str(folder / "model")], ["--baseline", str(folder / "base")]
    a, b = str(folder / "a.txt"), str(folder / "b.txt")
    cases = {
        # eval-ppl
        ("eval-ppl", f"--lengths: 1 of 2 documents are shorter than 128 tokens: {b} ("): [
            *model,
            "--text",
            a,
            b,
            "--lengths",
            "64,128",
        ],
        ("eval-ppl", "give longer documents, a smaller length, or --concat to join them"): [
            *model,
            "--text",
            b,
            "--lengths",
            "128",
        ],
        ("eval-ppl", "--lengths: the 1 documents joined (--concat) have"): [
            *model,
            "--text",
            b,
            "--lengths",
            "4096",
            "--concat",
        ],
        ("eval-ppl", f"--text {folder}/none*.txt: no such file, folder or matching glob"): [
            *model,
            "--text",
            str(folder / "none*.txt"),
        ],
        ("eval-ppl", f"--text {folder}: a folder but not a datasets.save_to_disk folder"): [
            *model,
            "--text",
            str(folder),
        ],
        ("eval-ppl", "no column 'body' (columns: text, other); choose --text-field"): [
            *model,
            "--text",
            str(folder / "dataset"),
            "--text-field",
            "body",
        ],
        ("eval-ppl", f"--text {folder}/docs.jsonl line 1: no text field 'body'"): [
            *model,
            "--text",
            str(folder / "docs.jsonl"),
            "--text-field",
            "body",
        ],
        ("eval-ppl", "--lengths '': give at least one prompt length"): [*model, "--text", a, "--lengths", ""],
        ("eval-ppl", "a perplexity needs lengths of at least 2 tokens"): [
            *model,
            "--text",
            a,
            "--lengths",
            "1",
        ],
        ("eval-ppl", "--stride applies to the --baseline model"): [*model, "--text", a, "--stride", "8"],
        ("eval-ppl", "--stride 128: give a stride below the window (128 tokens)"): [
            *model,
            *base,
            "--text",
            a,
            "--lengths",
            "64",
            "--stride",
            "128",
        ],
        ("eval-ppl", "--chunk-size 0: give at least 1 token per chunk"): [
            *model,
            "--text",
            a,
            "--chunk-size",
            "0",
        ],
        ("eval-ppl", "--baseline /nonexistent: no such model folder"): [
            *model,
            "--text",
            a,
            "--baseline",
            "/nonexistent",
        ],
        ("eval-ppl", "--model /nonexistent: no such model folder"): ["--model", "/nonexistent", "--text", a],
        # eval-niah / eval-ruler
        ("eval-niah", "--tasks '': no tasks given; valid tasks: passkey,"): [*model, "--tasks", ""],
        ("eval-niah", "--tasks 'passkey,needle': unknown task 'needle'; valid tasks: "): [
            *model,
            "--tasks",
            "passkey,needle",
        ],
        ("eval-niah", "vt takes no needle depth; eval-niah runs passkey"): [*model, "--tasks", "vt"],
        ("eval-niah", "--depths 0,2: 2 is outside [0, 1]"): [*model, "--depths", "0,2"],
        ("eval-niah", "--samples 0: give at least 1 sample per cell"): [*model, "--samples", "0"],
        ("eval-niah", "--seed -1: give a seed >= 0"): [*model, "--seed", "-1"],
        ("eval-niah", "--lengths 64: passkey: length 64 leaves 56 prompt tokens"): [
            *model,
            "--lengths",
            "64",
        ],
        ("eval-ruler", "--tasks ' , ': no tasks given"): [*model, "--tasks", " , "],
        ("eval-ruler", "--tasks 'qa_9': unknown task 'qa_9'"): [*model, "--tasks", "qa_9"],
        ("eval-ruler", "--threshold 0: threshold must be in (0, 100]"): [*model, "--threshold", "0"],
        ("eval-ruler", "--threshold 100.5: threshold must be in (0, 100]"): [*model, "--threshold", "100.5"],
        ("eval-ruler", "--threshold nan: threshold must be in (0, 100]"): [*model, "--threshold", "nan"],
        ("eval-ruler", "--threshold -3: threshold must be in (0, 100]"): [*model, "--threshold", "-3"],
        ("eval-ruler", "--lengths 100: fwe: length 100 gives a coded vocabulary"): [
            *model,
            "--tasks",
            "fwe",
            "--lengths",
            "100",
        ],
        ("eval-ruler", "--cp-size 0: give at least 1 process per CP group"): [*model, "--cp-size", "0"],
        ("eval-ruler", "--cp-size 3 does not divide the 1 processes"): [*model, "--cp-size", "3"],
        # eval-short
        ("eval-short", "--length: 1 of 1 documents are shorter than 128 tokens"): [
            *model,
            *base,
            "--text",
            b,
        ],
        ("eval-short", "--max-ppl-increase -1.0: give a percentage >= 0"): [
            *model,
            *base,
            "--text",
            a,
            "--max-ppl-increase",
            "-1",
        ],
        ("eval-short", "--num-docs 0: give at least 1 document"): [
            *model,
            *base,
            "--text",
            a,
            "--num-docs",
            "0",
        ],
    }
    for (command, expected), argv in cases.items():
        out = folder / "out"
        code, err = run(command, [*BASE, *argv, "--output", str(out)])
        assert code == 2, (command, expected, err)
        assert err.count("\n") == 1 and err.startswith(f"ringft {command}: error: "), err
        assert expected in err, (expected, err)
        assert not out.exists(), expected  # nothing written


def test_texts_files_globs_jsonl_datasets_and_concat(folder):
    from ringft.data.tokenizer import load_demo_tokenizer
    from ringft.evals.ppl.texts import make_documents, read_texts

    tok = load_demo_tokenizer()
    texts = read_texts([str(folder / "*.txt"), str(folder / "docs.jsonl"), str(folder / "dataset")])
    names = [name for name, _ in texts]
    assert names == [
        str(folder / "a.txt"),
        str(folder / "b.txt"),
        f"{folder / 'docs.jsonl'}:1",
        f"{folder / 'docs.jsonl'}:2",
        f"{folder / 'dataset'}[0]",
        f"{folder / 'dataset'}[1]",
    ]
    long_ones = [t for t in texts if len(tok(t[1])["input_ids"]) >= 100]
    docs = make_documents(long_ones, tok, 100)
    assert all(len(d.ids) == 100 for d in docs) and docs[0].ids == tuple(tok(TEXT)["input_ids"][:100])
    joined = make_documents(texts, tok, 100, concat=True, max_docs=3)
    stream = []
    for _, text in texts:
        stream += tok(text)["input_ids"] + [tok.eos_token_id]
    assert [d.ids for d in joined] == [tuple(stream[i * 100 : (i + 1) * 100]) for i in range(3)]
    assert [d.name for d in joined] == ["concat[0]", "concat[1]", "concat[2]"]


def test_sliding_windows_score_every_token_once_with_enough_context(monkeypatch):
    """Each token t >= 1 is scored by exactly one window, which holds it and at least window - stride
    earlier tokens (all of them within the first window)."""
    import ringft.evals.ppl.nll as nll_mod

    seen = []

    def fake(engine, ids, chunk_size=1024):  # NLL of token j = its id, tagged with the window's start
        seen.append(ids[0])
        return torch.tensor([float(i) + 1000 * ids[0] for i in ids[1:]], dtype=torch.float64)

    monkeypatch.setattr(nll_mod, "ring_token_nll", fake)
    for n, window, stride in ((50, 16, 8), (50, 16, 15), (50, 16, 5), (10, 16, 8), (33, 32, 1)):
        seen.clear()
        got = nll_mod.sliding_token_nll(None, list(range(n)), window, stride)
        tokens, begins = got.remainder(1000).long(), got.div(1000, rounding_mode="floor").long()
        assert tokens.tolist() == list(range(1, n))
        context = tokens - begins
        assert bool((context[: window - 1] == tokens[: window - 1]).all())  # the first window: all of it
        assert (
            int(context.min()) >= 1 and min(context[window - 1 :].tolist(), default=window) >= window - stride
        )
        assert int(context.max()) <= window - 1 and seen == nll_mod.window_starts(n, window, stride)


def test_log_bins_partition_the_positions():
    from ringft.evals.ppl.nll import binned_sums, log_bins, prefix_sums

    for n in (2, 3, 17, 1024, 1000, 16384):
        bins = log_bins(n)
        assert bins[0][0] == 1 and bins[-1][1] == n
        assert all(a < b and b == c for (a, b), (c, _) in zip(bins, bins[1:], strict=False))
    nll = torch.arange(1, 16, dtype=torch.float64)  # token t has NLL t
    assert sum(s for _, _, s, _ in binned_sums(nll, log_bins(16))) == nll.sum()
    assert prefix_sums(nll, [2, 16]) == {"2": 1.0, "16": float(nll.sum())}


def test_parameter_count_matches_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM

    from ringft.evals.ppl.memory import parameter_count, ppl_peak_memory

    for tied in (True, False):
        config = LlamaConfig(
            vocab_size=100,
            hidden_size=24,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            tie_word_embeddings=tied,
        )
        model = LlamaForCausalLM(config)
        assert parameter_count(config) == sum(p.numel() for p in model.parameters())
    terms = ppl_peak_memory(config, 1000, 2, 4, 64)
    assert terms["peak"] == terms["weights"] + max(terms["attention"], terms["mlp"], terms["head"]) + 16000


def test_results_resume_and_are_keyed(folder):
    """A finished run is not evaluated again; another seed is other cases (evaluated, the old ones
    kept); other settings are refused, naming the difference; the summaries are rebuilt."""
    import ringft.evals.long_tasks.generation as gen_mod

    calls = []
    real = gen_mod.GenerationTask.evaluate

    def counting(self, runner, case):
        calls.append(case.task)
        return real(self, runner, case)

    gen_mod.GenerationTask.evaluate = counting
    try:
        out = folder / "niah"
        common = [*BASE, "--model", str(folder / "model"), "--tasks", "passkey", "--lengths", "200"]
        argv = [*common, "--depths", "0,1", "--samples", "2", "--output", str(out)]
        assert run("eval-niah", argv)[0] == 0 and len(calls) == 4
        first = (out / "results.jsonl").read_text()
        calls.clear()
        assert run("eval-niah", argv)[0] == 0 and not calls and (out / "results.jsonl").read_text() == first
        assert run("eval-niah", [*argv, "--seed", "1"])[0] == 0 and len(calls) == 4
        assert len((out / "results-dp0.jsonl").read_text().splitlines()) == 8
        code, err = run("eval-niah", [*argv, "--dtype", "bf16"])
        assert code == 2 and "holds results of other settings (dtype 'fp32' -> 'bf16')" in err, err
        code, err = run("eval-ruler", [*common, "--output", str(out)])
        assert code == 2 and "task 'eval-niah' -> 'eval-ruler'" in err, err
    finally:
        gen_mod.GenerationTask.evaluate = real
    records = [json.loads(x) for x in first.splitlines()]
    assert [(r["task"], r["depth"], r["index"]) for r in records] == [
        ("passkey", 0.0, 0),
        ("passkey", 0.0, 1),
        ("passkey", 1.0, 0),
        ("passkey", 1.0, 1),
    ]
    assert all("teacher_forced_correct" in r and len(r["generated_ids"]) <= 8 for r in records)
    for name in ("samples.jsonl", "niah.csv", "summary.md", "heatmap.png", "summary.json", "settings.json"):
        assert (out / name).is_file(), name


def test_figures_red_to_green_heatmap_and_ppl_labelled_a_sanity_check(folder, monkeypatch, tmp_path):
    """The NIAH/lines heatmaps use one red (0) to green (full score) scale; eval-ppl (in this process,
    the tiny model, base beside it) writes its CSVs and titles its figure a sanity check."""
    import matplotlib
    from matplotlib.axes import Axes

    import ringft.evals.ppl.summary as ppl_summary
    from ringft.evals.figures import curves, heatmaps

    seen, titles = [], []
    imshow = Axes.imshow

    def recording(self, grid, **kwargs):
        seen.append(kwargs)
        return imshow(self, grid, **kwargs)

    monkeypatch.setattr(Axes, "imshow", recording)
    heatmaps(tmp_path / "h.png", [("passkey", [[0.0, 100.0]])], ["4K"], ["0%", "100%"],
             xlabel="depth", ylabel="length", colorbar="score", vmax=100)  # fmt: skip
    assert seen == [{"vmin": 0, "vmax": 100, "cmap": "RdYlGn", "aspect": "auto"}]
    low, high = matplotlib.colormaps["RdYlGn"](0.0), matplotlib.colormaps["RdYlGn"](1.0)
    assert low[0] > 2 * low[1] and high[1] > 2 * high[0]  # 0 is red, the full score green

    def recording_curves(path, panels, *, title=None):
        titles.append(title)
        return curves(path, panels, title=title)

    monkeypatch.setattr(ppl_summary, "curves", recording_curves)
    out = tmp_path / "ppl"
    argv = [*BASE, "--model", str(folder / "model"), "--baseline", str(folder / "base"), "--text",
            str(folder / "a.txt"), "--lengths", "64,192", "--output", str(out)]  # fmt: skip
    assert run("eval-ppl", argv)[0] == 0
    assert titles and titles[0].startswith("Sanity check, not a retrieval measure")
    assert "sanity check" in (out / "summary.md").read_text()
    variants = {row.split(",")[0] for row in (out / "ppl.csv").read_text().splitlines()[1:]}
    assert variants == {"model", "baseline", "baseline-window"}  # base in full and in its window
    for name in ("nll_by_position.csv", "ppl.png", "summary.json", "results.jsonl"):
        assert (out / name).is_file(), name


def test_short_regression_flag_at_the_stated_threshold():
    """eval-short flags a perplexity rise strictly above --max-ppl-increase percent, never a fall."""
    from ringft.evals.short.task import regression_verdict

    for base, model, limit, increase, flagged in (
        (10.0, 10.5, 5.0, 5.0, False),
        (10.0, 10.6, 5.0, 6.0, True),
        (10.0, 6.0, 0.0, -40.0, False),
        (10.0, 10.01, 0.0, 0.1, True),
    ):
        got = regression_verdict(base, model, limit)
        assert got[0] == pytest.approx(increase) and got[1] is flagged, (base, model, limit, got)
