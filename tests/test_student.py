from pathlib import Path

import nbformat
import pytest

from labkit.student import PLACEHOLDER, make_student_notebook, strip_solutions

NOTEBOOKS = sorted(Path(__file__).parent.parent.glob("notebooks/[0-9]*.ipynb"))


def test_strip_keeps_indentation_and_everything_outside_the_markers():
    source = "def f(x):\n    # BEGIN SOLUTION\n    return x + 1\n    # END SOLUTION\n\ncheck(f)"
    assert strip_solutions(source) == f"def f(x):\n    {PLACEHOLDER}\n\ncheck(f)"


@pytest.mark.parametrize("source, match", [
    ("# BEGIN SOLUTION\nx = 1", "never closed"),
    ("x = 1\n# END SOLUTION", "without"),
    ("# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION", "inside another"),
])
def test_unbalanced_markers_are_reported(source, match):
    with pytest.raises(ValueError, match=match):
        strip_solutions(source)


def test_placeholder_makes_the_grader_explain(capsys):
    import labkit.checks

    namespace = {}
    exec(strip_solutions("def my_get_batch(dataset, batch_size, context_length, device):\n"
                         "    # BEGIN SOLUTION\n    pass\n    # END SOLUTION"), namespace)
    with pytest.raises(labkit.checks.CheckFailed, match="your code here(.|\n)*write your answer in place"):
        labkit.checks.get_batch(namespace["my_get_batch"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_chapter_has_exercises_that_strip_cleanly(path, tmp_path):
    removed = make_student_notebook(path, tmp_path / path.name)
    assert removed >= 2  # each chapter ends with graded exercises
    student = nbformat.read(tmp_path / path.name, as_version=4)
    code = [c for c in student.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    text = "\n".join(c.source for c in code)
    assert "BEGIN SOLUTION" not in text and text.count(PLACEHOLDER) == removed
    assert "checks." in text  # the graders are still called
