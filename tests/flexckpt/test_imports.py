"""flexckpt's modules import one another one way: no import circle.

Every ``import`` statement counts, at module level and inside functions alike (a lazy
import inside a function is still a dependency that runs back up). An edge goes to the
module named (``from flexckpt.tier import LocalTier`` names ``flexckpt.tier``;
``from flexckpt import cli`` names ``flexckpt.cli``), not to the parent packages Python
also imports on the way. Sub-packages count as one node too: ``save.pipeline`` importing
``tier.inventory`` while ``tier.fast`` imports ``save.pipeline`` is a circle between
the ``save`` and ``tier`` packages."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "flexckpt"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:  # ``from pkg import mod`` names the module, else the package
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in out if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def by_subpackage(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph with each sub-package (``flexckpt.tier``, ``flexckpt.convert``) one node."""
    def node(m: str) -> str:
        return ".".join(m.split(".")[:2])

    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(node(m), set()).update(node(d) for d in deps if node(d) != node(m))
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_find_cycle_names_a_circle_and_passes_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_graph_sees_function_level_imports():
    graph = import_graph()
    assert "flexckpt.convert.dcp" in graph["flexckpt.convert.cli"]  # imported inside cmd_import_dcp
    assert "flexckpt.tier.fast" in graph and len(graph) > 30


def _assert_no_cycle(graph: dict[str, set[str]]) -> None:
    cycle = find_cycle(graph)
    assert cycle is None, f"import circle: {' -> '.join(cycle)}; move what both need into a module below them"


def test_flexckpt_has_no_import_circle():
    _assert_no_cycle(import_graph())


def test_flexckpt_has_no_import_circle_between_its_subpackages_and_the_rest():
    graph = by_subpackage(import_graph())
    assert "flexckpt.tier" in graph and "flexckpt.convert" in graph
    _assert_no_cycle(graph)
