"""labkit's layers, as a contract: lower layers never import higher ones, and nothing imports in a circle.

The layers are declared in pyproject.toml under ``[tool.importlinter]`` (highest first):
teaching (widgets | checks | bench | student) <- plots <- chapter topics <- training (train : data)
<- model (model : nn) <- kernels <- runtime | formats | show | claims.
``lint-imports`` checks them with the import graph grimp builds from the source, which
includes the lazy imports written inside functions.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grimp

import labkit.attention
import labkit.bench
import labkit.formats
import labkit.nn
import labkit.precision
import labkit.show

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    # lint-imports is installed next to the interpreter running the tests (the venv's bin/);
    # without it, run its entry point through this interpreter.
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"]
    result = subprocess.run(
        [*cmd, "--no-cache", "--no-logo", str(ROOT / "pyproject.toml")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "COLUMNS": "120"},  # rich wraps its report at the terminal width
    )
    assert result.returncode == 0, f"lint-imports found broken contracts:\n{result.stdout}{result.stderr}"


def _graph():
    return grimp.build_graph("labkit", cache_dir=None)


def test_the_graph_sees_lazy_imports():
    # labkit.data imports labkit.model inside a function only; the contract must see such imports.
    assert _graph().direct_import_exists(importer="labkit.data", imported="labkit.model")


def test_no_import_cycle_between_labkit_modules():
    """Module by module (the acyclic_siblings contract compares packages): a DFS over the
    import graph that fails on the first edge back to a module still on the path."""
    graph = _graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        path.append(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported in path:
                cycle = path[path.index(imported):] + [imported]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if imported not in done:
                visit(imported, path)
        path.pop()
        done.add(module)

    for module in sorted(graph.modules):
        if module not in done:
            visit(module, [])


def test_moved_names_are_reexported_from_their_old_homes():
    assert labkit.attention.KVCache is labkit.nn.KVCache
    for name in ("FloatFormat", "FORMATS", "SPECIALS", "get_format", "encode", "decode"):
        assert getattr(labkit.precision, name) is getattr(labkit.formats, name), name
    assert labkit.bench.print_table is labkit.show.print_table
