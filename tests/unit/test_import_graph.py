"""The package's import graph, read from its source with `ast`: no cycles, and one composition root.

Every `import` and `from ... import` of a sandboxd module counts, wherever it stands: a function-level
import is still a dependency, only a later one, and one under `if TYPE_CHECKING:` is one too (a type
names the module it lives in; such imports hid the cycles service -> revocation.operator ->
provenance.handlers -> service and auth <-> config this test was written against). The rule it
checks is the session model's: `sandboxd.service` builds every part and hands each what it needs, so
nothing but the daemon's entry point imports it, and no part reaches back into another.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sandboxd

PACKAGE = Path(sandboxd.__file__).parent
COMPOSITION_ROOT = "sandboxd.service"
#: the one module that builds a daemon (`build`) and so constructs the composition root
ENTRY_POINT = "sandboxd.daemon"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The sandboxd modules `path` imports (a `from package import name` of a submodule counts as it)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imports_of(path, modules) for path in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


GRAPH = import_graph()


def test_the_graph_is_read_from_the_source() -> None:
    # A reader that found nothing would pass every rule below: the entry point's imports are known.
    assert {COMPOSITION_ROOT, "sandboxd.server", "sandboxd.db"} <= GRAPH[ENTRY_POINT]
    assert len(GRAPH) > 50


def test_no_module_of_the_package_is_part_of_an_import_cycle() -> None:
    assert cycles(GRAPH) == []


def test_only_the_entry_point_imports_the_composition_root() -> None:
    importers = sorted(name for name, deps in GRAPH.items() if COMPOSITION_ROOT in deps)
    assert importers == [ENTRY_POINT]


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [["a", "b", "c"]]),
])
def test_the_cycle_finder_finds_cycles(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(graph) == expected
