"""Every chapter's student version runs top to bottom in a fresh kernel, as a learner runs it (graders in the
kernel): every grader cell fails with "not answered yet" and no other cell fails, so no chapter depends on a
learner's answer after an exercise. (Grading them, where the graders run outside the kernel, is
tests/grading's and tests/test_grade.py's.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit.student import NOT_ANSWERED, chapter_paths, student_notebook

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = chapter_paths(ROOT / "notebooks")
RUN_TIMEOUT_S = 600  # a chapter is ≤ 60 s on an idle 2-core machine; this one is shared


def student_version(path: Path) -> tuple[dict, list[str]]:
    return student_notebook(json.loads(path.read_text(encoding="utf-8")), path.stem)


def source(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def run_in_a_kernel(notebook: dict, workdir: Path) -> dict:
    """``notebook`` executed top to bottom in a fresh kernel, every cell run whatever the cells before gave."""
    import nbformat
    from nbclient import NotebookClient

    from labkit.execute import sliced_waits_client  # a widget cell's reply can otherwise wait for the time limit (nbclient#312)

    executed = nbformat.reads(json.dumps(notebook), as_version=4)
    sliced_waits_client(NotebookClient)(executed, timeout=RUN_TIMEOUT_S, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(workdir)}}).execute()
    return executed


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_student_version_runs_apart_from_its_graders(path, monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_DEVICE", "cpu")
    notebook, exercises = student_version(path)
    problems = []
    for index, cell in enumerate(run_in_a_kernel(notebook, tmp_path)["cells"]):
        if cell["cell_type"] != "code" or not source(cell).strip():
            continue
        error = next((o for o in cell["outputs"] if o["output_type"] == "error"), None)
        is_grader = cell["metadata"].get("nbgrader", {}).get("grade")
        if is_grader and (error is None or NOT_ANSWERED not in error["evalue"] + "".join(error["traceback"])):
            problems.append(f"grader cell {index + 1} ({source(cell).strip()}) did not say '{NOT_ANSWERED}': "
                            f"{error and error['ename'] + ': ' + error['evalue'][:300]}")
        elif not is_grader and error is not None:
            problems.append(f"cell {index + 1} failed: {error['ename']}: {error['evalue'][:300]}\n    "
                            + source(cell).strip().splitlines()[0])
        elif not is_grader and not cell.get("execution_count"):
            problems.append(f"cell {index + 1} did not run")
    assert not problems, f"{path.name}:\n  " + "\n  ".join(problems)
    assert exercises
