"""The package's layering, read from its own imports (``ast``), so the structure stays true.

Layers, lowest first (docs/architecture.md). A module may import from a lower layer, or from its
own package (``ringft.train.front`` -> ``ringft.train.recipe``); never from a higher layer or from a
sibling package of the same layer. Lazy imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ringft"
TESTS = Path(__file__).resolve().parent
TEST_FOLDERS_BEYOND_THE_PACKAGE = {"recipes"}  # tests/recipes: the shipped recipes/ folder

LAYERS: dict[str, int] = {
    "ringft.utils": -1,  # value checks with one error style, the N-process launcher: no attention math
    "ringft.ops": 0,  # math + communication: backends, merge, zigzag layout and schedule, emulation
    "ringft.data": 1,  # the CP collator, packing, line-retrieval text and records
    "ringft.model": 2,  # the transformers patch, model unwrapping, tiled MLP, RingInference
    "ringft.loss": 3,  # chunked LM loss and the step's normalisation
    "ringft.train": 4,  # typed recipe, the recipe front end over transformers.Trainer, the ring mixin
    "ringft.evals": 4,  # evaluations on the ring
    "ringft.planner": 4,  # memory model, `ringft plan`
    "ringft.cli": 5,
    "ringft.__main__": 6,
    "ringft": 6,  # the package __init__: the public API
}
MAX_LINES = 400  # a module is read in one sitting


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _unit(module: str) -> str:
    """The layered unit a module belongs to (the longest matching key of LAYERS)."""
    best = max((k for k in LAYERS if module == k or module.startswith(k + ".")), key=len, default=None)
    if best is None:
        raise AssertionError(f"{module} is not assigned a layer in tests/test_architecture.py")
    return best


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, imported names, line) for every ringft import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "ringft"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "ringft":
                found.append((target, [a.name for a in node.names], node.lineno))
    return found


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_layers_are_the_folders():
    """Every layer but the entry points is a folder of ``ringft/``, and every folder is a layer."""
    folders = {f"ringft.{p.name}" for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {f"ringft.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert folders | modules | {"ringft"} == set(LAYERS), sorted(
        set(LAYERS) ^ (folders | modules | {"ringft"})
    )
    assert modules == {"ringft.cli", "ringft.__main__"}, (
        f"loose modules at the package root: {sorted(modules)}"
    )


def test_every_module_has_a_layer():
    for path in _sources():
        _unit(_module_name(path))


def test_imports_only_go_down():
    problems = []
    for path in _sources():
        me = _module_name(path)
        mine = _unit(me)
        for target, names, line in _imports(path):
            theirs = _unit(target)
            if theirs == mine:
                continue
            if LAYERS[theirs] >= LAYERS[mine]:
                problems.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line}: {me} (layer {LAYERS[mine]}) imports "
                    f"{target} (layer {LAYERS[theirs]})"
                )
            private = [n for n in names if n.startswith("_")]
            if private:
                problems.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line}: private name(s) {private} imported "
                    f"across packages from {target}"
                )
    assert not problems, "layering violations:\n" + "\n".join(problems)


def test_no_import_cycles():
    graph: dict[str, set[str]] = {}
    for path in _sources():
        me = _unit(_module_name(path))
        graph.setdefault(me, set()).update(_unit(t) for t, _, _ in _imports(path) if _unit(t) != me)
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*trail, node, nxt]))
            if not state.get(nxt):
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in sorted(graph):
        if not state.get(node):
            visit(node, [])


def _module_edges() -> dict[str, set[str]]:
    """Module -> the ringft modules it imports (``from pkg import sub`` names the submodule ``pkg.sub``
    when there is one, else ``pkg``); TYPE_CHECKING and function-level imports included."""
    modules = {_module_name(path): path for path in _sources()}
    graph: dict[str, set[str]] = {}
    for me, path in modules.items():
        targets = graph.setdefault(me, set())
        for target, names, _ in _imports(path):
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            if len(subs) < len(names) or not names:
                targets.add(target)
            targets.update(subs)
        targets.discard(me)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    cycles = []
    for component in components:
        inside = set(component)
        start, trail, seen = component[0], [component[0]], {component[0]}
        while True:  # walk inside the component until a node repeats: that loop is a cycle
            nxt = min(graph[trail[-1]] & inside)
            if nxt in seen:
                cycles.append([*trail[trail.index(nxt) :], nxt])
                break
            trail.append(nxt)
            seen.add(nxt)
        del start
    return cycles


def test_no_module_import_cycles():
    """No module imports itself through others, package ``__init__`` modules included; lazy and
    TYPE_CHECKING imports count (a cycle hidden by them still ties the modules into one)."""
    cycles = _cycles(_module_edges())
    assert not cycles, "module import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert sorted(map(tuple, _cycles(graph))) == [("a", "b", "c", "a"), ("e", "e2", "e")]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_ops_never_imports_transformers():
    for path in sorted((PACKAGE / "ops").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n.split(".")[0] in ("transformers", "accelerate", "peft") for n in names), path


def test_ops_never_imports_option_parsing():
    """The operator checks its own inputs (``ringft.ops.ring_checks``); the option checks of recipes,
    flags and trainer keywords (``ringft.utils.values``) belong to the layers that read options."""
    for path in sorted((PACKAGE / "ops").rglob("*.py")):
        for target, names, line in _imports(path):
            modules = {target, *(f"{target}.{n}" for n in names)}
            assert "ringft.utils.values" not in modules, f"{path.relative_to(PACKAGE.parent)}:{line}"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_module_fits_in_one_sitting(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, (
        f"{path.relative_to(PACKAGE.parent)} has {lines} lines (> {MAX_LINES}): split it"
    )


def test_public_functions_have_docstrings():
    missing = []
    for path in _sources():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                if ast.get_docstring(node) is None:
                    missing.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}")
    assert not missing, "public functions/classes without a docstring:\n" + "\n".join(missing)


def test_test_folders_mirror_the_package():
    """tests/ has a folder per layer folder of ``ringft/`` (and one for the shipped recipes/)."""
    layers = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == layers | TEST_FOLDERS_BEYOND_THE_PACKAGE, sorted(
        folders ^ (layers | TEST_FOLDERS_BEYOND_THE_PACKAGE)
    )


def _test_module_name(path: Path) -> str:
    parts = list(path.relative_to(TESTS.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_test_module(module: str) -> bool:
    """``tests.x.test_y`` (a module of tests that pytest collects), as opposed to a helper."""
    parts = module.split(".")
    return parts[0] == "tests" and parts[-1].startswith("test_")


def test_no_test_module_imports_another():
    """Shared helpers live in plain modules (tests/conftest.py lists them): a test module imported by
    another runs its module-level code twice and hides what is shared. Lazy imports count too."""
    problems = []
    for path in sorted(TESTS.rglob("*.py")):
        me = _test_module_name(path)
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    base = ".".join(up[: len(up) - (node.level - 1)] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                if _is_test_module(target) and target != me:
                    problems.append(f"{path.relative_to(TESTS.parent)}:{node.lineno} imports {target}")
    assert not problems, "test modules importing test modules (move the helper out):\n" + "\n".join(problems)
