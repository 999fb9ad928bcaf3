"""README.md and docs/*.md name only what exists (issue 23, item 6): the docs are moved and rewritten
as the package changes, and a renamed module or file must not leave a stale pointer behind.

Checked on every page: each relative link resolves (a file or folder; a ``#anchor`` names a heading
of the target page, by GitHub's slug rule); each repository path written in the text
(``ringft/...``, ``tests/...``, ``recipes/...``, ``benchmarks/...``, ``data_prep/...``, ``docs/...``,
``tools/...``)
exists; each dotted ``ringft.x.y`` name imports (a module, or an attribute of one); and no page
points outside the repository (a machine path, a design file).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "RESULTS.md"]
TOP = ("ringft", "tests", "recipes", "benchmarks", "data_prep", "docs", "tools", ".ci")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./<>{}*-]*)")
_DOTTED = re.compile(r"(?<![\w./-])(ringft(?:\.\w+)+)")


def _ids(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # no headings in code
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_docs_pages_exist():
    names = {p.name for p in PAGES}
    expected = {"api.md", "packed-data.md", "evaluation.md", "faults.md", "recipes.md", "architecture.md"}
    assert expected | {"development.md", "README.md"} <= names, names


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_links_resolve(page: Path):
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        assert dest.exists(), f"{_ids(page)}: link to missing {target}"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{_ids(page)}: {target}: no heading with anchor #{anchor}"


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_named_paths_exist(page: Path):
    for raw in _PATH.findall(page.read_text()):
        path = raw.rstrip(".")
        if any(c in path for c in "<>{}*"):  # a pattern (stage{1..4}_*.yaml, <name>_backend.py)
            path = path[: min(path.index(c) for c in "<>{}*" if c in path)].rpartition("/")[0]
        assert (REPO / path).exists(), f"{_ids(page)} names {raw}, which is not in the repository"


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_named_modules_import(page: Path):
    for dotted in sorted(set(_DOTTED.findall(page.read_text()))):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            for attr in parts[cut:]:
                assert hasattr(obj, attr), f"{_ids(page)} names {dotted}: {attr!r} not found"
                obj = getattr(obj, attr)
            break


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_pages_stay_inside_the_repository(page: Path):
    text = page.read_text()
    for needle in ("/" + "work/", "../" + "shared", "DESIGN" + ".md"):  # built so this file names none
        assert needle not in text, f"{_ids(page)} refers to {needle!r}, which is not in the repository"
