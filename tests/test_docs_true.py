"""docs/ stays true to the code: the call signatures written in docs/api.md match the live
functions (names, order, keyword-only markers, defaults), the backend lists of the docs name every
backend of ``ringft.ops.backends.BACKENDS``, and the planner example of docs/recipes.md is the
number the command prints today."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import ringft
from ringft.ops.backends import BACKENDS

REPO = Path(__file__).resolve().parents[1]
API = REPO / "docs" / "api.md"
# `name(arg, arg=default, *, kw=default)` inside backquotes; `...` marks an abbreviated signature.
_CALL = re.compile(r"`((?:ringft\.)?[\w.]+)\(([^`]*)\)`")


def _resolve(name: str):
    if not name.startswith("ringft."):
        return getattr(ringft, name, None)
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr, None)


def _written(args: str) -> list[tuple[str, str | None, bool]]:
    """``(name, default source or None, keyword-only)`` of each parameter written in the docs."""
    a = ast.parse(f"def f({args}): pass").body[0].args  # type: ignore[attr-defined]
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    out = [(p.arg, d, False) for p, d in zip(positional, defaults)]
    kw = [None if d is None else ast.unparse(d) for d in a.kw_defaults]
    return out + [(p.arg, d, True) for p, d in zip(a.kwonlyargs, kw)]


def _signatures() -> list[tuple[str, str]]:
    """The signatures in the first cell of each row of the public-names table."""
    found = []
    for line in API.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        for name, args in _CALL.findall(line.split(" | ")[0]):
            target = _resolve(name)
            if "..." not in args and callable(target):
                found.append((name, args))
    return found


@pytest.mark.parametrize("name,args", _signatures(), ids=[n for n, _ in _signatures()])
def test_api_md_signature_matches_the_code(name, args):
    """Every parameter is written, in the code's order, keyword-only where the code has it (after a
    bare ``*``), with the code's default (a row that abbreviates writes ``...`` and is skipped)."""
    live = inspect.signature(_resolve(name))
    params = [p for p in live.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    written = _written(args)
    where = f"docs/api.md {name}({args})"
    assert [n for n, _, _ in written] == [p.name for p in params], f"{where}: the code has {live}"
    for (pname, default, keyword_only), p in zip(written, params):
        assert keyword_only == (p.kind is p.KEYWORD_ONLY), f"{where}: {pname}: keyword-only differs ({live})"
        if p.default is p.empty:
            assert default is None, f"{where}: {pname} has no default in the code"
        else:
            assert default is not None and ast.literal_eval(default) == p.default, (
                f"{where}: {pname}={default}, the code's default is {p.default!r}"
            )


def test_api_md_checks_the_main_signatures():
    checked = {name for name, _ in _signatures()}
    main = {"apply_ring_attention", "loss_normalization", "RingDataCollator", "zigzag_ring_attention"}
    assert main <= checked


# Pages that list the attention backends, and the sentence each list sits in.
BACKEND_LISTS = {
    "docs/api.md": r"Backends \(`backend=`\):(.*?)\n\n",
    "docs/trainer.md": r"`attn_backend`[^\n]*",
    "docs/evaluation.md": r"`--attn-backend [^`]*`",
    "docs/recipes.md": r"`attn_backend` \(.*?\)",
}


@pytest.mark.parametrize("page", sorted(BACKEND_LISTS))
def test_backend_lists_name_every_backend(page):
    text = (REPO / page).read_text()
    found = re.findall(BACKEND_LISTS[page], text, flags=re.S)
    listing = [f for f in found if "torch" in f and "flash_attn" in f]
    assert listing, f"{page}: no backend list found"
    for item in listing:
        missing = [b for b in BACKENDS if f"`{b}`" not in item and b not in item.split()]
        missing = [b for b in missing if not re.search(rf"\b{b}\b", item)]
        assert not missing, f"{page}: a backend list omits {missing}: {item[:200]}"


def _plan_output(capsys, argv: list[str]) -> str:
    from ringft.planner import plan_main

    plan_main(argv)
    return capsys.readouterr().out


def test_recipes_md_planner_example_is_what_the_planner_prints(capsys):
    """The ``$ ringft plan ...`` block of docs/recipes.md: its command re-run, each shown fix line
    printed as written; and the recommended --zero 3 figures of the paragraph above it."""
    text = (REPO / "docs" / "recipes.md").read_text()
    block = re.search(r"```text\n\$ (ringft plan [^\n]+)\n(.*?)```", text, flags=re.S)
    assert block, "docs/recipes.md: the planner example block is gone"
    out = _plan_output(capsys, block.group(1).split()[2:])
    shown = [line for line in block.group(2).splitlines() if line.strip() and line != "..."]
    for line in shown:
        assert line in out.splitlines(), f"docs/recipes.md shows {line!r}; the planner prints:\n{out}"
    import json

    argv = block.group(1).split()[2:] + ["--zero", "3", "--json"]
    best = json.loads(_plan_output(capsys, argv))["recommended"]
    gib = f"cp {best['cp']} x dp {best['dp']} at {best['total'] / 2**30:.1f} GiB per GPU"
    assert gib in " ".join(text.split()), f"docs/recipes.md should say: {gib}"
