"""The stored notebooks keep their promise to nbval: what is not compared is checked another way.

nbval compares every stored output digit for digit, except cells marked ``# NBVAL_IGNORE_OUTPUT``
and the digits printed after ``≈`` (``labkit.about``, masked by tests/nbval_sanitize.cfg). Those
two escapes are only for outputs that honestly differ between machines, and each must say why:
- an ignored cell either asserts the claim its output supports (``labkit.expect(...)`` or
  ``assert``) or names its kind on a comment line ``# not compared: timing|progress|widget|environment``;
- a cell that prints ``≈`` numbers asserts the claim they support.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("[0-9]*.ipynb"))
UNCOMPARED_KINDS = ("timing", "progress", "widget", "environment")
ASSERTS = re.compile(r"\b(?:labkit\.)?expect\(|^\s*assert\b", re.MULTILINE)
KIND = re.compile(r"^\s*# not compared: (\w+)", re.MULTILINE)


def code_cells(path: Path):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    return [("".join(c["source"]), c) for c in cells]


def output_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        parts.append("".join(out.get("text", "")))
        parts.append("".join(out.get("data", {}).get("text/plain", "")))
    return "".join(parts)


def ignored(source: str) -> bool:
    return any(line.strip().lstrip("#").strip() == "NBVAL_IGNORE_OUTPUT" for line in source.splitlines())


def test_there_are_notebooks():
    assert NOTEBOOKS, "no chapter notebooks found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_uncompared_output_is_explained_or_asserted(path):
    problems = []
    for index, (source, cell) in enumerate(code_cells(path)):
        if ignored(source):
            kind = KIND.search(source)
            if ASSERTS.search(source) or (kind and kind.group(1) in UNCOMPARED_KINDS):
                continue
            problems.append(f"cell {index}: NBVAL_IGNORE_OUTPUT without an assertion or '# not compared: "
                            f"{'|'.join(UNCOMPARED_KINDS)}'")
        elif "≈" in output_text(cell) and not ASSERTS.search(source):
            problems.append(f"cell {index}: prints approximate (≈) numbers but asserts no claim about them")
    assert not problems, f"{path.name}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_outputs_are_stored_from_one_clean_run(path):
    cells = code_cells(path)
    counts = [c.get("execution_count") for source, c in cells if source.strip()]
    assert None not in counts, f"{path.name}: cells without stored output (nbval would compare nothing there)"
    assert counts == list(range(1, len(counts) + 1)), f"{path.name}: not run top to bottom in a fresh kernel"
    errors = [i for i, (_, c) in enumerate(cells) if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    assert not errors, f"{path.name}: stored error outputs in cells {errors}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_cell_sets_up_labkit(path):
    source, _ = code_cells(path)[0]
    assert "import labkit" in source and "labkit.setup(" in source
