"""``eval-lines`` faults and bad input (issue 16): every bad input is one line before any model loads
and nothing is written; an I/O error on one rank ends every rank promptly, named once; resumable
results are keyed by the settings; damaged results lines are named or repaired."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import re
import time
from pathlib import Path

import pytest

from ringft.utils.spawn import run_distributed
from tests.tiny_models import save_tiny_model

BASE = ["--dtype", "fp32", "--attn-backend", "torch", "--no-progress", "--prompt-style", "ringft"]
SMALL = ["--lengths", "144", "--depths", "0,1", "--cases", "1", "--max-new-tokens", "3"]


def run_main(argv: list[str]) -> tuple[int, str]:
    """``ringft eval-lines`` in this process: (exit code, the lines it printed on stderr itself;
    progress bars of the libraries it calls are left out)."""
    from ringft.evals.lines.task import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    ours = [line for line in err.getvalue().splitlines() if line.startswith("ringft eval-lines")]
    return code, "".join(line + "\n" for line in ours)


def _no_model_loads(monkeypatch) -> None:
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def test_bad_inputs_one_line_before_any_model_loads(saved_tiny_model, tmp_path, monkeypatch):
    from ringft.data.tokenizer import load_demo_tokenizer

    VOCAB = len(load_demo_tokenizer())  # noqa: N806
    _no_model_loads(monkeypatch)
    small_vocab = tmp_path / "small-vocab"
    save_tiny_model(small_vocab, vocab_size=1000)
    no_config = tmp_path / "empty-folder"
    no_config.mkdir()
    no_rope = tmp_path / "no-rope"  # a model without RoPE: --rope-theta has nothing to set
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=VOCAB).save_pretrained(no_rope)
    bad_cases = tmp_path / "bad.jsonl"
    bad_cases.write_text('{"prompt": "x"}\n\n{not json\n')
    model = ["--model", str(saved_tiny_model)]
    cases = {
        "--cases 0: give at least 1 case": [*model, "--cases", "0"],
        "--lengths '': give at least one prompt length": [*model, "--lengths", ""],
        "--lengths 4k,x: 'x' is not a whole number": [*model, "--lengths", "4k,x"],
        "--depths ' , ': give at least one depth": [*model, "--depths", " , "],
        "--depths 0,1.5: 1.5 is outside [0, 1]": [*model, "--depths", "0,1.5"],
        "--depths nan: nan is outside [0, 1]": [*model, "--depths", "nan"],
        "--lengths 50: 50 tokens cannot hold one record line": [*model, "--lengths", "50"],
        "use lengths of at least ": [*model, "--lengths", "50"],
        "--max-new-tokens 0: give at least 1 new token": [*model, "--max-new-tokens", "0"],
        "--cp-size 0: give at least 1 process per CP group": [*model, "--cp-size", "0"],
        "--rope-theta -1: give a positive RoPE base": [*model, "--rope-theta", "-1"],
        "--rope-theta nan: give a positive RoPE base": [*model, "--rope-theta", "nan"],
        "--rope-theta 1e+06: GPT2Config has no rope_parameters": [
            *["--model", str(no_rope), "--tokenizer", "demo", "--rope-theta", "1e6"]
        ],
        "--attn-backend flash_attn needs CUDA GPUs, this run is on cpu": [
            *model,
            "--attn-backend",
            "flash_attn",
        ],
        "--model /nonexistent/model: no such model folder": ["--model", "/nonexistent/model"],
        f"--model {no_config}: the folder has no config.json": ["--model", str(no_config)],
        f"the tokenizer has {VOCAB} tokens but the model's embedding has 1000 rows": [
            "--model",
            str(small_vocab),
        ],
        f"--cases-file: {bad_cases} line 1: ": [*model, "--cases-file", str(bad_cases)],
        f"--cases-file {tmp_path}/none.jsonl: no such file": [
            *model,
            "--cases-file",
            str(tmp_path / "none.jsonl"),
        ],
        "--lengths is not used with --cases-file": [
            *model,
            "--cases-file",
            str(bad_cases),
            "--lengths",
            "100",
        ],
    }
    for expected, argv in cases.items():
        out = tmp_path / "out"
        code, err = run_main([*BASE, *argv, "--output", str(out)])  # argv overrides BASE
        assert code == 2, (expected, err)
        assert err.count("\n") == 1 and err.startswith("ringft eval-lines: error: "), err
        assert expected in err, (expected, err)
        assert not out.exists(), expected  # nothing written
    # The bad line is named with its own number (blank lines count).
    bad_cases.write_text(json.dumps({"prompt": "p", "answer": "1"})[:-1] + "\n")
    code, err = run_main([*model, *BASE, "--cases-file", str(bad_cases), "--output", str(out)])
    assert "line 1:" in err
    good = tmp_path / "cases.jsonl"
    from ringft.evals.lines.cases import make_line_cases
    from ringft.evals.lines.files import save_cases_jsonl

    save_cases_jsonl(make_line_cases(load_demo_tokenizer(), [200], [0.5], 2, seed=0), good)
    good.write_text(good.read_text() + "\n" + '{"answer": 3}\n')
    code, err = run_main([*model, *BASE, "--cases-file", str(good), "--output", str(out)])
    assert code == 2 and f"{good} line 4:" in err, err


def test_rope_theta_is_set_before_loading(saved_tiny_model):
    """--rope-theta builds the rotary frequencies from the new theta (not: load, then exit)."""
    import torch

    from ringft.evals.model import load_eval_model

    model = load_eval_model(str(saved_tiny_model), torch.float32, torch.device("cpu"), rope_theta=12345.0)
    assert model.config.rope_parameters["rope_theta"] == 12345.0
    inv_freq = model.model.rotary_emb.inv_freq
    dim = model.config.hidden_size // model.config.num_attention_heads
    expected = 1.0 / 12345.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    torch.testing.assert_close(inv_freq, expected, rtol=0, atol=0)


def _results(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]


def one_process_scenarios(rank: int, world: int, model: str, other: str, folder: str) -> list[str]:
    """Resume and results-file faults in one process group (world = 1); returns checked names."""
    import ringft.evals.lines.task as lines_mod

    calls = []
    real = lines_mod.evaluate_case

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    lines_mod.evaluate_case = counting
    import ringft.model.inference as inference_mod

    prompt_passes = []  # forward passes over more than one token: prefills (decode steps run one)
    hidden = inference_mod.RingInference._hidden

    def counting_hidden(self, ids, pos):
        if ids.shape[1] > 1:
            prompt_passes.append(ids.shape[1])
        return hidden(self, ids, pos)

    inference_mod.RingInference._hidden = counting_hidden
    out = Path(folder)
    argv = ["--model", model, *BASE, *SMALL, "--output", str(out)]
    done = []

    code, err = run_main(argv)
    assert code == 0 and len(calls) == 2, err
    # One prefill per case serves generation and the teacher-forced score (old code: two).
    assert len(prompt_passes) == 2, prompt_passes
    inference_mod.RingInference._hidden = hidden
    first = _results(out)
    assert {"settings.json", "cases.jsonl", "results-dp0.jsonl", "summary.md"} <= {
        p.name for p in out.iterdir()
    }

    calls.clear()  # same settings: nothing is evaluated again
    assert run_main(argv)[0] == 0 and not calls
    done.append("resume")

    calls.clear()  # another scoring re-scores the kept text, evaluates nothing
    code, err = run_main([*argv, "--scoring", "first-int"])
    assert code == 0 and not calls and {r["scoring"] for r in _results(out)} == {"first-int"}
    done.append("rescore")

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for extra, named in (
        (["--dtype", "bf16"], "dtype 'fp32' -> 'bf16'"),
        (["--max-new-tokens", "5"], "max_new_tokens 3 -> 5"),
        (["--rope-theta", "5e5"], "rope_theta None -> 500000.0"),
    ):
        code, err = run_main([*argv, *extra])
        assert code == 2 and "holds results of other settings" in err and named in err, err
    code, err = run_main(["--model", other, *BASE, *SMALL, "--output", str(out)])
    assert code == 2 and "model " in err and "weights: " in err, err
    assert not calls and {p.name: p.read_bytes() for p in out.iterdir()} == before
    done.append("settings")

    # A write cut off mid-line: ignored with a note, cut away, its case evaluated again.
    part = out / "results-dp0.jsonl"
    lines = part.read_text().splitlines(keepends=True)
    part.write_text(lines[0] + lines[1][:25])
    code, err = run_main(argv)
    assert code == 0 and len(calls) == 1, err
    assert "results-dp0.jsonl line 2: incomplete last line" in err and err.count("\n") == 1
    assert part.read_text().endswith("\n") and len(part.read_text().splitlines()) == 2
    assert [r["generated"] for r in _results(out)] == [r["generated"] for r in first]
    done.append("partial line")

    # A damaged line that is not the last one is an error naming file and line.
    part.write_text("garbage\n" + "".join(lines))
    calls.clear()
    code, err = run_main(argv)
    assert code == 2 and f"{part} line 1:" in err and err.count("\n") == 1 and not calls, err
    part.write_text("".join(lines))
    done.append("bad line")

    # Disk full while appending a result: one line naming the path, no traceback, exit 1.
    part.write_text(lines[0])
    import ringft.evals.store as store_mod

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    store_mod.os.fsync, saved = full, store_mod.os.fsync
    try:
        code, err = run_main(argv)
    finally:
        store_mod.os.fsync = saved
    assert code == 1 and err == f"ringft eval-lines: error: cannot write {part}: no space left on device\n"
    done.append("disk full")
    lines_mod.evaluate_case = real
    return done


@pytest.mark.timeout(240)
def test_results_keyed_by_settings_and_damaged_lines(saved_tiny_model, tmp_path):
    other = tmp_path / "other"
    save_tiny_model(other)
    args = (str(saved_tiny_model), str(other), str(tmp_path / "out"))
    done = run_distributed(one_process_scenarios, 1, *args, timeout=200)[0]
    assert done == ["resume", "rescore", "settings", "partial line", "bad line", "disk full"]


def failing_writer(
    rank: int, world: int, model: str, folder: str, short: str
) -> list[tuple[int, str, float]]:
    """Runs where one rank's results append fails (disk full): first the CP = 2 writer (rank 0),
    then replica 1's writer with CP = 1 (DP = 2); a run past the positions of the ``short`` model;
    a bad --cp-size; last the main process's summary write fails. Each: (exit code, stderr, seconds)."""
    import ringft.evals.store as store_mod

    real = store_mod.ResultsStore.append

    def full(self, dp_rank, record):
        path = self.folder / f"results-dp{dp_rank}.jsonl"
        raise store_mod.write_error(path, OSError(errno.ENOSPC, "No space left on device"))

    outcome = []
    for cp, fail_rank in ((2, 0), (1, 1)):
        store_mod.ResultsStore.append = full if rank == fail_rank else real
        argv = ["--model", model, *BASE, *SMALL, "--cases", "2", "--cp-size", str(cp)]
        start = time.monotonic()
        code, err = run_main([*argv, "--output", f"{folder}-cp{cp}"])
        outcome.append((code, err, time.monotonic() - start))
    store_mod.ResultsStore.append = real
    code, err = run_main(["--model", short, *BASE, *SMALL, "--cp-size", "2", "--output", f"{folder}-short"])
    outcome.append((code, err, 0.0))
    code, err = run_main(["--model", model, *BASE, *SMALL, "--cp-size", "3", "--output", f"{folder}-cp3"])
    outcome.append((code, err, 0.0))
    # Disk full while the main process writes the summary: every rank exits 1 (old code: rank 1 0).
    import ringft.evals.lines.task as lines_mod

    summarize = lines_mod.summarize

    def summary_disk_full(results, out_dir, *args):
        raise OSError(errno.ENOSPC, "No space left on device", str(out_dir / "summary.md"))

    lines_mod.summarize = summary_disk_full if rank == 0 else summarize
    argv = ["--model", model, *BASE, *SMALL, "--cp-size", "2", "--output", f"{folder}-summary"]
    outcome.append(run_main(argv) + (0.0,))
    lines_mod.summarize = summarize
    return outcome


@pytest.mark.timeout(200)
def test_io_error_on_one_rank_ends_every_rank(saved_tiny_model, tmp_path):
    """Old code: the failing rank's ``finally: dist.barrier()`` waited for ranks that were already in
    the next case's ring collective (or in their own next case), so the run hung."""
    short = tmp_path / "short"
    save_tiny_model(short, max_positions=128)
    got = run_distributed(
        failing_writer, 2, str(saved_tiny_model), str(tmp_path / "out"), str(short), timeout=150
    )
    (code0, err0, _), (code1, err1, _) = got[0][2], got[1][2]
    assert code0 == code1 == 0 and not err1  # the position warning: once, on the main process
    warning = re.fullmatch(
        r"ringft eval-lines: warning: the longest prompt \((\d+) tokens\) plus 3 new tokens reaches "
        r"position (\d+), past the model's max_position_embeddings 128 and it has no RoPE scaling: "
        r"results beyond 128 tokens measure extrapolation\n",
        err0,
    )
    assert warning and int(warning[2]) == int(warning[1]) + 3 > 128, err0
    (code0, err0, _), (code1, err1, _) = got[0][3], got[1][3]  # a bad input: named once, by rank 0
    assert code0 == code1 == 2 and not err1 and not (tmp_path / "out-cp3").exists()
    assert err0 == (
        "ringft eval-lines: error: --cp-size 3 does not divide the 2 processes: launch a multiple of 3 "
        "processes, or choose a --cp-size that divides 2\n"
    )
    for (code0, err0, _), (code1, err1, _) in zip(got[0][:2], got[1][:2], strict=True):
        assert code0 == code1 == 1
        named = [err for err in (err0, err1) if "no space left on device" in err]
        assert len(named) == 1 and named[0].count("\n") == 1, got  # named once, by the failing rank
        assert "results-dp" in named[0] and (err0 + err1).count("error: ") == 1
    assert "results-dp0.jsonl" in got[0][0][1] and "results-dp1.jsonl" in got[1][1][1]
    (code0, err0, _), (code1, err1, _) = got[0][4], got[1][4]
    summary = tmp_path / "out-summary" / "summary.md"
    assert (code0, code1, err1) == (1, 1, "")
    assert err0 == f"ringft eval-lines: error: cannot write {summary}: no space left on device\n"


def test_case_keys_keep_prompt_styles_apart():
    """Results of another prompt style in the same --output are other cases (their prompt hash
    differs), never reused; the same case keeps its key."""
    from ringft.data.tokenizer import load_demo_tokenizer
    from ringft.evals.lines.cases import case_key, make_line_case

    tok = load_demo_tokenizer()
    keys = {
        style: case_key(make_line_case(tok, 400, 0.5, 1, prompt_style=style))
        for style in ("ringft", "longchat")
    }
    assert keys["ringft"] != keys["longchat"]
    assert case_key(make_line_case(tok, 400, 0.5, 1, prompt_style="ringft")) == keys["ringft"]
