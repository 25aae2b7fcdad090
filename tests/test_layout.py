"""The layout's rules (docs/architecture.md), checked on the tree and shown to catch planted
violations: services never import each other, ``blockq`` imports no service at module level,
no import cycles, and module names that repeat hold the same kind of thing."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from tests.import_rules import (
    PACKAGES,
    core_violations,
    import_cycles,
    import_edges,
    read_tree,
    service_violations,
)

ROOT = Path(__file__).resolve().parents[1]

# A module name may repeat only where each copy does the same job for its own package.
REPEATABLE_NAMES = {
    "__init__": "the package",
    "__main__": "python -m PACKAGE",
    "cli": "the package's subcommands and flags",
    "config": "the package's frozen, validated configuration",
    "base": "the protocol the package's registry implements",
    "simple": "the package's simplest implementations of that protocol",
    "metrics": "the package's Prometheus metrics",
    "service": "the Redis-facing shell around the package's pure core",
    "worker": "the package's worker process",
    "keys": "Redis key names",
}


@pytest.fixture(scope="module")
def edges():
    return import_edges(read_tree(ROOT))


def test_services_never_import_each_other(edges):
    assert service_violations(edges) == []


def test_blockq_imports_no_service_at_module_level(edges):
    assert core_violations(edges) == []


def test_no_import_cycles(edges):
    assert import_cycles(edges) == []


def test_repeated_module_names_do_one_job():
    by_name = defaultdict(list)
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            by_name[path.stem].append(path.relative_to(ROOT))
    repeated = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert set(repeated) <= set(REPEATABLE_NAMES), sorted(set(repeated) - set(REPEATABLE_NAMES))
    for path in by_name["metrics"]:  # every metrics.py is Prometheus
        imported = {n.module for n in ast.walk(ast.parse((ROOT / path).read_text()))
                    if isinstance(n, ast.ImportFrom) and n.module}
        assert any(m.startswith("prometheus_client") for m in imported), path


# --- the rules catch what they are for ------------------------------------------------------


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in PACKAGES:
        (root / package).mkdir(exist_ok=True)
        (root / package / "__init__.py").touch()


def _planted(tmp_path: Path, files: dict[str, str]):
    _write_tree(tmp_path, files)
    return import_edges(read_tree(tmp_path))


def test_planted_service_import_is_caught(tmp_path):
    edges = _planted(tmp_path, {"dispatcher/core.py": "import workers.engine\n",
                                "workers/engine.py": "X = 1\n"})
    assert service_violations(edges) == ["dispatcher.core:1 imports workers.engine"]


def test_planted_lazy_service_import_is_caught_too(tmp_path):
    edges = _planted(tmp_path, {"workers/intake.py": "def f():\n    from predictor_service.stage import g\n",
                                "predictor_service/stage.py": "def g(): pass\n"})
    assert service_violations(edges) == ["workers.intake:2 imports predictor_service.stage"]


def test_planted_core_import_is_caught(tmp_path):
    edges = _planted(tmp_path, {
        "blockq/local/up.py": "from workers.refinement import add_refine_arguments\n",
        "blockq/local/top.py": "def view():\n    from predictor_service.feedback import decode\n",
        "blockq/cli/main.py": "def run():\n    from dispatcher.cli import run\n",  # lazily, from the CLI: allowed
        "workers/refinement.py": "", "predictor_service/feedback.py": "", "dispatcher/cli.py": ""})
    assert core_violations(edges) == [
        "blockq.local.top:2 imports predictor_service.feedback (lazily, outside blockq.cli)",
        "blockq.local.up:1 imports workers.refinement at module level"]


def test_planted_cycles_are_caught_deferred_or_not_but_not_type_only(tmp_path):
    edges = _planted(tmp_path, {
        "loadgen/cli.py": "from loadgen.simulation.cli import run\n",
        "loadgen/simulation/cli.py": "def run():\n    from loadgen.cli import add\n",
        "loadgen/simulation/__init__.py": "",
        "dispatcher/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dispatcher.b import B\n",
        "dispatcher/b.py": "from dispatcher import a\n"})
    assert import_cycles(edges) == [["loadgen.cli", "loadgen.simulation.cli"]]
