"""Every chapter's student version runs top to bottom in a fresh kernel (through labkit.grade's contained
runner): every grader cell fails with "not answered yet" and no other cell fails, so no chapter depends on a
learner's answer after an exercise."""
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


@pytest.fixture(scope="module")
def runner():
    from labkit import grade

    return grade


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_student_version_runs_apart_from_its_graders(path, runner, monkeypatch):
    monkeypatch.setenv("LABKIT_DEVICE", "cpu")
    notebook, exercises = student_version(path)
    run = runner.run_notebook(notebook, RUN_TIMEOUT_S)
    assert not run.failure, f"{path.name}: {run.failure}"
    problems = []
    for index, cell in enumerate(run.notebook["cells"]):
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
