"""Every chapter's student version with the teacher's own answers pasted in, saved as Jupyter saves it and graded
as a class is graded (the graders in the grading process, the learner's code in the kernel): every exercise
``passed``. It catches what the tiny chapter of test_grade_attacks.py cannot: a grader whose inputs cannot cross
from the grading process to the kernel (chapter 02's 8 GiB address-space case once killed the kernel there), or
whose reference breaks when its learner's objects live in another process."""
from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

from labkit import grade
from labkit.student import chapter_paths, student_notebook, with_solutions

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = chapter_paths(ROOT / "notebooks")
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def graded(tmp_path_factory, request):
    # only the chapters whose tests were selected (`-k 12_serving` grades chapter 12 alone)
    selected = {item.callspec.params["path"] for item in request.session.items
                if item.module is request.module and "path" in getattr(getattr(item, "callspec", None), "params", {})}
    folder = tmp_path_factory.mktemp("teacher") / "submissions"
    for path in [p for p in CHAPTERS if p in selected]:
        chapter = nbformat.read(path, as_version=4)
        handed_out, _ = student_notebook(chapter, path.stem)
        (folder / f"teacher-{path.stem[:2]}").mkdir(parents=True)
        nbformat.write(nbformat.from_dict(with_solutions(handed_out, chapter)), folder / f"teacher-{path.stem[:2]}" / path.name)
    old = os.environ.get("LABKIT_DEVICE")
    os.environ["LABKIT_DEVICE"] = "cpu"
    try:
        rows = grade.grade([folder], ROOT / "notebooks", timeout=TIMEOUT_S, jobs=2)
    finally:
        os.environ.pop("LABKIT_DEVICE") if old is None else os.environ.__setitem__("LABKIT_DEVICE", old)
    return rows


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_the_teachers_answers_pass_when_graded(graded, path):
    rows = [row for row in graded if row.chapter == path.stem]
    assert rows, f"{path.stem}: no rows"
    wrong = [row for row in rows if row.result != "passed" and row.exercise != grade.NOTEBOOK_ROW]
    # "contained" rows only report files a chapter leaves in its temporary folders (chapter 07's exercise files)
    notebook_rows = [row for row in rows if row.exercise == grade.NOTEBOOK_ROW and row.result != "contained"]
    assert not wrong and not notebook_rows, "\n".join(f"{r.exercise}: {r.result}: {r.message[:400]}" for r in wrong + notebook_rows)
