"""A hand-in saved by JupyterLab itself, graded as a teacher grades it.

The student version of chapter 00 (``make student``) is opened in the browser; the teacher's answer to its first
exercise is typed into that exercise's cell, and the second exercise's cell gets the forgery that once passed
(no answer, the grader reassigned in the answer cell); the notebook is saved with Ctrl+S, and ``labkit.grade``
grades the file JupyterLab wrote: the first exercise ``passed``, the forged one ``failed`` or ``error``.
"""
from __future__ import annotations

import json
import shutil
import time

import nbformat

from conftest import ROOT
from labkit import grade
from labkit.student import cell_source, student_notebook, with_solutions

CHAPTER = ROOT / "notebooks" / "00_foundations.ipynb"
FORGERY = ("import labkit.checks as _c, labkit.checks.ch00_foundations as _m\n"
           "_c.cross_entropy = _m.cross_entropy = lambda fn: print('✓ cross_entropy: all good')\n\n\n"
           "def my_cross_entropy(logits, targets):\n    pass\n")
DIRTY = "window.jupyterapp.shell.currentWidget.context.model.dirty"


def type_into(page, index: int, text: str) -> None:
    """Replace cell ``index``'s source through its editor, as a paste does (no auto-indent of typed lines)."""
    editor = page.locator(f'[data-labkit-cell="{index}"] .cm-content')
    editor.scroll_into_view_if_needed()
    editor.click()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(text)


def test_a_notebook_saved_in_jupyterlab_grades_as_it_should(lab, browser, tmp_path):
    from test_chapters import TAG_CELLS_JS

    chapter = nbformat.read(CHAPTER, as_version=4)
    handed_out, exercises = student_notebook(chapter, CHAPTER.stem)
    assert exercises[:2] == ["get_batch", "cross_entropy"]
    solutions = [i for i, c in enumerate(handed_out["cells"]) if c.get("metadata", {}).get("nbgrader", {}).get("solution")]
    answer = cell_source(with_solutions(handed_out, chapter)["cells"][solutions[0]])
    name = "handed-in-00_foundations.ipynb"
    nbformat.write(nbformat.from_dict(handed_out), lab.root / name)

    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    try:
        page.goto(lab.lab_url("browser-test-saved-submission", name))
        page.wait_for_function("() => { const p = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
                               " return p && p.context && p.context.isReady && p.content.widgets.length > 0; }",
                               timeout=120_000)
        page.evaluate(TAG_CELLS_JS)
        type_into(page, solutions[0], answer)
        type_into(page, solutions[1], FORGERY)
        page.keyboard.press("Escape")
        assert page.evaluate(f"() => {DIRTY}"), "typing into the cells did not change the notebook"
        page.keyboard.press("Control+s")
        page.wait_for_function(f"() => !{DIRTY}", timeout=30_000)  # written to disk
    finally:
        context.close()
        lab.shutdown_kernels()

    saved = json.loads((lab.root / name).read_text(encoding="utf-8"))
    sources = [saved["cells"][i]["source"] for i in solutions[:2]]
    assert all(isinstance(s, list) for s in sources), "JupyterLab stores each source as a list of lines"
    assert "".join(sources[0]) == answer and "".join(sources[1]) == FORGERY
    submissions = tmp_path / "submissions" / "carol"
    submissions.mkdir(parents=True)
    shutil.copy2(lab.root / name, submissions / name)
    started = time.monotonic()
    rows = grade.grade([tmp_path / "submissions"], ROOT / "notebooks", timeout=300, chapter="00",
                       out=tmp_path / "grades.csv")
    results = {row.exercise: (row.result, row.message) for row in rows}
    assert results["get_batch"][0] == "passed", (results, f"{time.monotonic() - started:.0f} s")
    assert results["cross_entropy"][0] in ("failed", "error"), results
    assert all(result == "not attempted" for exercise, (result, _) in results.items()
               if exercise not in ("get_batch", "cross_entropy")), results
