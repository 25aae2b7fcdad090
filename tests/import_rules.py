"""The layout's import rules, checked from the source text (nothing is imported).

- the services (``predictor_service``, ``dispatcher``, ``workers``) never import each other;
- ``blockq`` imports no service and not ``loadgen`` at module level, and lazily only from its
  command line (``blockq.cli``), which loads a service when its subcommand is asked for;
- no import cycles among modules.

Imports under ``if TYPE_CHECKING:`` are not imports at run time and are left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SERVICES = ("predictor_service", "dispatcher", "workers")
PACKAGES = ("blockq", *SERVICES, "loadgen")
LAZY_SERVICE_IMPORTERS = ("blockq.cli",)


@dataclass(frozen=True)
class ImportEdge:
    importer: str  # dotted module name
    imported: str  # dotted module name, resolved to a module of the tree where it is one
    line: int
    module_level: bool


def read_tree(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, str]:
    """Dotted module name -> source, for every ``.py`` file of ``packages`` under ``root``."""
    sources = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            sources[".".join(parts)] = path.read_text()
    return sources


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, module_level: bool) -> Iterable[tuple[ast.Import | ast.ImportFrom, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            yield from _imports_of(child.orelse, module_level)
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, module_level
        nested = module_level and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _imports(child, nested)


def _imports_of(body: list[ast.stmt], module_level: bool) -> Iterable[tuple[ast.Import | ast.ImportFrom, bool]]:
    for statement in body:
        wrapper = ast.Module(body=[statement], type_ignores=[])
        yield from _imports(wrapper, module_level)


def import_edges(sources: dict[str, str]) -> list[ImportEdge]:
    """Every import of the tree's modules by the tree's modules."""
    edges = []
    for importer, source in sources.items():
        for node, module_level in _imports(ast.parse(source), True):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                # ``from pkg import name``: an edge to the submodule where ``name`` is one.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in sources else base for a in node.names]
            for target in dict.fromkeys(targets):
                if target in sources and target != importer:
                    edges.append(ImportEdge(importer, target, node.lineno, module_level))
    return edges


def _top(module: str) -> str:
    return module.split(".")[0]


def service_violations(edges: list[ImportEdge]) -> list[str]:
    return [f"{e.importer}:{e.line} imports {e.imported}" for e in edges
            if _top(e.importer) in SERVICES and _top(e.imported) in SERVICES and _top(e.importer) != _top(e.imported)]


def core_violations(edges: list[ImportEdge]) -> list[str]:
    found = []
    for e in edges:
        if _top(e.importer) != "blockq" or _top(e.imported) not in (*SERVICES, "loadgen"):
            continue
        lazy_allowed = any(e.importer == m or e.importer.startswith(m + ".") for m in LAZY_SERVICE_IMPORTERS)
        if e.module_level or not lazy_allowed:
            found.append(f"{e.importer}:{e.line} imports {e.imported}"
                         f"{' at module level' if e.module_level else ' (lazily, outside blockq.cli)'}")
    return found


def import_cycles(edges: list[ImportEdge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.imported)
        graph.setdefault(e.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles
