"""One option vocabulary (``ringft.utils.options``): every command takes the table's flags, each old
spelling still works and says once that it has a new name, the help texts are the table's, and the
trainer's old keyword warns once. No model is built: parsers and a bare mixin only."""

from __future__ import annotations

import argparse
import inspect
import warnings
from dataclasses import fields

import pytest

from ringft.utils import options
from ringft.utils.options import OPTIONS


def _plan_parser() -> argparse.ArgumentParser:
    from ringft.planner.cli import _parser

    return _parser()


def _eval_parser() -> argparse.ArgumentParser:
    from ringft.evals.harness import add_common_arguments
    from ringft.evals.lines.task import LinesTask

    parser = argparse.ArgumentParser(prog="ringft eval-lines")
    add_common_arguments(parser, LinesTask())
    return parser


def _trl_parser() -> argparse.ArgumentParser:
    from transformers import HfArgumentParser

    from ringft.train.hf.scripts import RingArguments

    return HfArgumentParser(RingArguments)


PARSERS = {"plan": _plan_parser, "eval": _eval_parser, "trl": _trl_parser}
REQUIRED = {"plan": ["--model", "llama-3-8b", "--seq-len", "64k", "--gpus", "8", "--gpu-mem", "80"]}
REQUIRED["eval"] = ["--model", "m"]
# command -> (old spelling words, the same with the table's spelling)
ALIASES = {
    "plan": [
        (["--cp", "8", "--cp", "4"], ["--cp-size", "8", "--cp_size", "4"]),
        (["--backend", "torch"], ["--attn-backend", "torch"]),
        (["--ulysses", "2"], ["--time-ulysses-size", "2"]),
    ],
    "eval": [(["--cp", "2"], ["--cp-size", "2"]), (["--backend", "torch"], ["--attn_backend", "torch"])],
    "trl": [
        (["--ring_backend", "torch"], ["--attn-backend", "torch"]),
        (["--ring-backend", "cudnn"], ["--attn_backend", "cudnn"]),
    ],
}


@pytest.fixture(autouse=True)
def _fresh_notes(monkeypatch):
    monkeypatch.setattr(options, "_NOTED", set())
    monkeypatch.delenv("RANK", raising=False)


@pytest.mark.parametrize("command", sorted(ALIASES))
def test_every_command_takes_the_new_and_the_old_spellings(command, capsys):
    parser = PARSERS[command]()
    for old, new in ALIASES[command]:
        want = vars(parser.parse_args([*REQUIRED.get(command, []), *new]))
        assert capsys.readouterr().err == ""
        for _ in range(2):  # the note: once per process
            assert vars(parser.parse_args([*REQUIRED.get(command, []), *old])) == want
        err = capsys.readouterr().err
        canonical = next(a for a in parser._actions if old[0] in a.option_strings).option_strings[0]  # noqa: SLF001
        assert err == f"ringft: note: `{old[0]}` is now `{canonical}` (the old name still works)\n"
        with pytest.raises(SystemExit):  # both spellings on one command line
            parser.parse_args([*REQUIRED.get(command, []), *old, *new])
        assert "given together with its old name" in capsys.readouterr().err


def test_the_note_is_printed_on_rank_0_only(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    assert _eval_parser().parse_args(["--model", "m", "--cp", "2"]).cp_size == 2
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_flags_dests_and_help_come_from_the_table(command):
    actions = {a.dest: a for a in PARSERS[command]()._actions}  # noqa: SLF001
    shared = [o for o in OPTIONS.values() if o.name in actions]
    assert {"cp_size", "attn_backend"} <= {o.name for o in shared}
    for o in shared:
        action = actions[o.name]
        assert set(o.flags) | set(o.old_flags) <= set(action.option_strings), action.option_strings
        table_help = o.help.split("; a count of tokens")[0]  # (TRL scripts: ints, no "64k")
        assert action.help.startswith(table_help), (command, o.name, action.help)
        assert not o.choices or set(action.choices) <= set(o.choices)


def test_the_table_names_the_recipe_keys_the_keywords_and_the_backends():
    from ringft.ops import BACKENDS
    from ringft.planner.setup import ATTENTION_CHECKPOINTS
    from ringft.train import recipe
    from ringft.train.hf.mixin import RingTrainerMixin

    sections = {c.NAME: c for c in vars(recipe).values() if isinstance(c, type) and hasattr(c, "NAME")}
    keywords = inspect.signature(RingTrainerMixin.__init__).parameters
    for o in OPTIONS.values():
        section, key = o.recipe_key.rsplit(".", 1)
        assert key == o.name and key in {f.name for f in fields(sections[section])}, o.recipe_key
        assert o.name in keywords
    assert OPTIONS["attn_backend"].choices == BACKENDS
    assert OPTIONS["attention_checkpoint"].choices == ATTENTION_CHECKPOINTS


def test_the_mixin_takes_its_old_backend_keyword_with_one_warning():
    from ringft.train.hf.mixin import RingTrainerMixin

    with pytest.warns(FutureWarning, match="`ring_backend=` is now `attn_backend=`"):
        trainer = RingTrainerMixin(ring_backend="torch")  # cp_size 1: no ring, the base class as it is
    assert trainer._attn_backend == "torch"  # noqa: SLF001
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert RingTrainerMixin(ring_backend="cudnn")._attn_backend == "cudnn"  # noqa: SLF001 (once)
        assert RingTrainerMixin()._attn_backend == "auto"  # noqa: SLF001
    with pytest.raises(ValueError, match="attn_backend= and its old name ring_backend= both given"):
        RingTrainerMixin(attn_backend="torch", ring_backend="torch")
