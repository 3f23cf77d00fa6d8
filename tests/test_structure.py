"""The package's shape: no import cycles, lower layers independent of the engine,
modules and functions a reader can hold in mind.

Read from the source with ``ast`` (nothing is imported): every import counts,
those inside functions and under ``TYPE_CHECKING`` too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "asyncfeed"
PACKAGE = "asyncfeed"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
LOWER_LAYERS = ("asyncfeed._memory", "asyncfeed._io")

def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = (PACKAGE,) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source."""
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = base.split(".")[:len(base.split(".")) - (node.level - 1)]
                target = ".".join(pkg + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found |= {c for c in candidates if c in known and c != name}
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _rel(path: Path) -> str:
    return path.relative_to(ROOT.parent).as_posix()


def _findings() -> set[tuple[str, str]]:
    found = {("cycle", " ".join(c)) for c in _cycles(_graph())}
    for path in _modules().values():
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found.add(("module", _rel(path)))
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    found.add(("function", f"{_rel(path)}:{node.name}"))
    return found


FINDINGS = _findings()


def test_the_checks_see_the_package():
    graph = _graph()
    assert "asyncfeed._engine.loader" in graph
    assert "asyncfeed._engine.iterator" in graph["asyncfeed._engine.loader"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("kind", ["cycle", "module", "function"])
def test_nothing_of_kind(kind):
    """No import cycle, no module over 600 lines, no function over 80."""
    found = sorted(what for k, what in FINDINGS if k == kind)
    assert not found, f"{kind}: {found}"


@pytest.mark.parametrize("layer", LOWER_LAYERS)
def test_lower_layers_import_nothing_from_the_engine(layer):
    graph = _graph()
    bad = sorted(f"{m} -> {t}" for m, targets in graph.items()
                 if m == layer or m.startswith(layer + ".")
                 for t in targets if t.startswith("asyncfeed._engine"))
    assert not bad, bad
