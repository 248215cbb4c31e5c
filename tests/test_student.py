"""Student versions: skeletons in place of solutions, nbgrader metadata, and every chapter still runs.

``make test-student`` runs each chapter's student version under nbval against :func:`unanswered_run`'s
expectations (tested here).
"""
from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import nbformat
import pytest

import labkit.checks
from labkit.student import (BEGIN, NOT_ANSWERED, POINTS, chapter_paths, exercise_text, make_student_notebook,
                            placeholder, skeleton, split_cell_magic, strip_solutions, student_notebook,
                            unanswered_run)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = chapter_paths(ROOT / "notebooks")


def student_version(path: Path) -> tuple[dict, list[str]]:
    return student_notebook(json.loads(path.read_text(encoding="utf-8")), path.stem)


def source(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_strip_keeps_indentation_and_everything_outside_the_markers():
    text = "def f(x):\n    # BEGIN SOLUTION\n    return x + 1\n    # END SOLUTION\n\ncheck(f)"
    assert strip_solutions(text) == f"def f(x):\n    {placeholder(None, None, False)}\n\ncheck(f)"


@pytest.mark.parametrize("text, match", [
    ("# BEGIN SOLUTION\nx = 1", "never closed"),
    ("x = 1\n# END SOLUTION", "without"),
    ("# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION", "inside another"),
])
def test_unbalanced_markers_are_reported(text, match):
    with pytest.raises(ValueError, match=match):
        strip_solutions(text)


EXERCISE_CELLS = [
    {"cell_type": "markdown", "source": "## Exercises\n\n**Exercise 3 — pairs.** Write `pack(codes)`: two per byte. "
                                        "Then `unpack(packed, signed)`, its inverse (hint: shifts)."},
    {"cell_type": "code", "source": "def pack(codes):\n    # BEGIN SOLUTION\n    return codes\n    # END SOLUTION\n\n\n"
                                    "def unpack(packed, signed):\n    '''Already documented.'''\n    # BEGIN SOLUTION\n"
                                    "    return packed\n    # END SOLUTION\n\ncheck.pack(pack)"},
]


def test_a_skeleton_keeps_signatures_and_gains_docstrings_and_pointers():
    exercise = exercise_text(EXERCISE_CELLS, 1)
    assert exercise.title == "Exercise 3" and exercise.has_hint
    text = skeleton(EXERCISE_CELLS[1]["source"], exercise)
    tree = ast.parse(text)
    pack, unpack = tree.body[:2]
    assert [a.arg for a in pack.args.args] == ["codes"] and [a.arg for a in unpack.args.args] == ["packed", "signed"]
    assert ast.get_docstring(pack) == "Write `pack(codes)`: two per byte."  # only the sentences about it
    assert ast.get_docstring(unpack) == "Already documented."
    namespace = {}
    exec(text.replace("check.pack(pack)", ""), namespace)
    with pytest.raises(NotImplementedError, match=f"{NOT_ANSWERED}: write unpack \\(see the hint in Exercise 3 above\\)"):
        namespace["unpack"](b"", True)
    assert BEGIN not in text


def test_a_method_skeleton_names_its_class_and_the_class_gets_the_docstring():
    text = ("class Layer:\n    def __init__(self, n):\n        self.n = n\n        # BEGIN SOLUTION\n        self.w = n\n"
            "        # END SOLUTION\n")
    out = skeleton(text, exercise_text([{"cell_type": "markdown", "source": "**Exercise 1.** Write `Layer(n)`."}], 1))
    layer = ast.parse(out).body[0]
    assert ast.get_docstring(layer) == "Write `Layer(n)`."
    assert "write Layer.__init__ (Exercise 1 above says what it must do)" in out and "self.n = n" in out


def test_a_writefile_cell_keeps_its_magic_and_gets_a_skeleton():
    text = ("%%writefile {folder}/my_ddp.py\nimport torch\n\n\nclass DDP:\n    def step(self):\n        # BEGIN SOLUTION\n"
            "        return 1\n        # END SOLUTION\n")
    out = skeleton(text, exercise_text([{"cell_type": "markdown", "source": "**Exercise 4.** Write `DDP`."}], 1))
    magic, body = split_cell_magic(out)
    assert magic == "%%writefile {folder}/my_ddp.py\n" and body.startswith("import torch")
    assert ast.get_docstring(ast.parse(body).body[1]) == "Write `DDP`."
    assert "write DDP.step (Exercise 4 above says what it must do)" in body and "return 1" not in body
    assert split_cell_magic("x = 1") == ("", "x = 1")
    notebook = {"metadata": {}, "cells": [{"cell_type": "markdown", "metadata": {}, "source": "**Exercise 4.** Write `DDP`."},
                                          {"cell_type": "code", "metadata": {}, "source": text, "outputs": []}]}
    student, exercises = student_notebook(notebook, "07_x")
    assert student["cells"][1]["source"] == out and student["cells"][1]["metadata"]["nbgrader"]["solution"]
    assert exercises == []  # the grader call sits in a cell of its own


def test_the_placeholder_makes_the_grader_explain():
    namespace = {}
    exec(strip_solutions("def my_get_batch(dataset, batch_size, context_length, device):\n"
                         "    # BEGIN SOLUTION\n    pass\n    # END SOLUTION",
                         [placeholder("my_get_batch", "Exercise 1", False)]), namespace)
    with pytest.raises(labkit.checks.CheckFailed, match=f"{NOT_ANSWERED}(.|\n)*write your answer in place"):
        labkit.checks.get_batch(namespace["my_get_batch"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_chapter_has_skeletons_and_locked_graders(path, tmp_path):
    removed = make_student_notebook(path, tmp_path / path.name)
    assert removed >= 2  # each chapter ends with graded exercises
    student = nbformat.read(tmp_path / path.name, as_version=4)
    code = [c for c in student.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    assert "widgets" not in student.metadata and student.metadata.labkit.chapter == path.stem
    text = "\n".join(c.source for c in code)
    assert BEGIN not in text and text.count(NOT_ANSWERED) == removed
    solutions = [c for c in code if c.metadata.get("nbgrader", {}).get("solution")]
    graders = [c for c in code if c.metadata.get("nbgrader", {}).get("grade")]
    assert solutions and graders
    for cell in solutions:
        assert cell.metadata.nbgrader.locked is False and NOT_ANSWERED in cell.source
        tree = ast.parse(split_cell_magic(cell.source)[1])  # valid Python (below a %%writefile line) with docstrings
        assert all(ast.get_docstring(n) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
    for cell in graders:
        meta = cell.metadata.nbgrader
        assert meta.locked is True and meta.points == POINTS and meta.solution is False
        name = meta.grade_id.removeprefix("check-")
        assert callable(getattr(labkit.checks, name, None)), f"{meta.grade_id}: no labkit.checks.{name}"
        assert len(ast.parse(cell.source).body) == 1 and f".{name}(" in cell.source
    ids = [c.metadata.nbgrader.grade_id for c in solutions + graders]
    assert len(ids) == len(set(ids))


@pytest.mark.skipif(importlib.util.find_spec("nbgrader") is None,
                    reason="nbgrader is not installed (pip install -e '.[nbgrader]' to check its metadata too)")
def test_nbgrader_accepts_a_student_version(tmp_path, monkeypatch):
    """nbgrader's own checks on the cell metadata, then its `generate_assignment` (the teacher's release step)."""
    import os
    import sys

    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # its `alembic`
    from nbgrader.preprocessors import CheckCellMetadata

    notebook, exercises = student_version(NOTEBOOKS[0])
    nb = nbformat.from_dict(notebook)
    CheckCellMetadata().preprocess(nb, {})
    from nbgrader.apps import NbGraderAPI
    from traitlets.config import Config

    course = tmp_path / "course"
    (course / "source" / "ps1").mkdir(parents=True)
    nbformat.write(nb, course / "source" / "ps1" / NOTEBOOKS[0].name)
    config = Config()
    config.CourseDirectory.root = str(course)
    config.CourseDirectory.db_url = f"sqlite:///{tmp_path / 'gradebook.db'}"
    result = NbGraderAPI(config=config).generate_assignment("ps1", force=True, create=True)
    assert result["success"], result.get("error") or result.get("log")
    released = nbformat.read(course / "release" / "ps1" / NOTEBOOKS[0].name, as_version=4)
    locked = [c for c in released.cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert [c.metadata.nbgrader.points for c in locked] == [POINTS] * len(exercises)
    assert all(c.metadata.nbgrader.get("checksum") for c in locked)  # nbgrader can now detect edits


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_an_unanswered_run_expects_the_chapters_outputs_and_a_not_answered_grader(path):
    chapter = nbformat.read(path, as_version=4)
    stored = {c.get("id"): c for c in chapter.cells if c.cell_type == "code"}
    run = unanswered_run(chapter, path.stem)
    kept = unrun = 0
    for cell in (c for c in run["cells"] if c["cell_type"] == "code"):
        if cell["metadata"].get("nbgrader", {}).get("grade"):
            assert "raises-exception" in cell["metadata"]["tags"] and cell["execution_count"] == 1
            assert cell["outputs"] == [{"output_type": "error", "ename": "CheckFailed", "evalue": NOT_ANSWERED,
                                        "traceback": []}]
        elif cell["execution_count"] is None:  # the learner's cells (and a cell that lost its grader calls) run, unread
            assert not cell["outputs"] and source(cell) != source(stored.get(cell.get("id"), {"source": ""}))
            unrun += 1
        else:
            teacher = stored[cell["id"]]
            assert source(cell) == source(teacher) and cell["outputs"] == teacher.outputs
            assert cell["execution_count"] == teacher.execution_count
            kept += 1
    assert unrun >= 2 and kept > unrun
    assert run["metadata"].get("widgets") == chapter.metadata.get("widgets")
    # make test-load checks the timing chapters' claims in their student versions: every cell that asserts a
    # claim must run there as it is
    kept_ids = {c.get("id") for c in run["cells"] if c["cell_type"] == "code" and c["execution_count"] is not None}
    claims = [c.get("id") for c in chapter.cells if c.cell_type == "code" and "expect(" in source(c)]
    assert claims and set(claims) <= kept_ids, set(claims) - kept_ids


def test_the_unanswered_run_cli_writes_one_per_chapter(tmp_path):
    from labkit.student import main

    main([str(NOTEBOOKS[0]), "--unanswered-run", "--out", str(tmp_path)])
    written = nbformat.read(tmp_path / NOTEBOOKS[0].name, as_version=4)
    assert any("raises-exception" in c.metadata.get("tags", []) for c in written.cells)
    assert any(c.get("outputs") for c in written.cells if c.cell_type == "code")
