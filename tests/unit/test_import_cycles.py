"""No import circle inside spark_dl: the graph of which module imports which, read from the
source with ``ast`` (nothing is imported), has no cycle.

Every import statement counts, at module level and inside functions alike (a deferred import
is still an arrow between two modules). An arrow goes to the module named: ``from .x import
y`` to ``x`` (or to ``x.y`` when that is a module), not to the packages above it, whose
``__init__.py`` Python runs first but which do not depend on the importer. Arrows to
``spark_dl`` itself are left out: its ``__init__.py`` is the public face, which imports the
whole package, and every absolute import runs it first (``runtime/stage.py`` imports it only
to read where it was loaded from)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "spark_dl"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:      # `import a.b.c` of a name in a.b
                target = target.rpartition(".")[0]
            if target and target not in (name, PACKAGE.name):
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}                  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_reads_relative_and_deferred_imports():
    graph = import_graph()
    assert "spark_dl.models.activations" in graph["spark_dl.models.cnn"]
    assert "spark_dl.planning.cost_model" in graph["spark_dl.planning.partitions"]  # deferred


def test_spark_dl_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
