"""No answer shown above its exercise (labkit.leaks): the detector itself, and every chapter against it."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from labkit.leaks import answer_leaks, line_shape
from labkit.student import chapter_paths
ROOT = Path(__file__).resolve().parents[1]

# Leaks the chapters still have, per chapter: (grader, kind). Each chapter's rework under the exercise issue
# moves these cells below their exercise and deletes its entry; a leak that is not listed fails the test, and
# so does a listed one that is gone (so that the list only ever shrinks).
KNOWN: dict[str, set[tuple[str, str]]] = {
}
SOLVED = ("def my_softmax(x):\n    # BEGIN SOLUTION\n    shifted = x - x.max(dim=-1, keepdim=True).values\n"
          "    exps = torch.exp(shifted)\n    total = exps.sum(dim=-1, keepdim=True)\n    return exps / total\n"
          "    # END SOLUTION\n\nchecks.softmax(my_softmax)")


def chapter(*cells) -> dict:
    return nbformat.v4.new_notebook(cells=list(cells))


def code(source: str, printed: str = "") -> dict:
    cell = nbformat.v4.new_code_cell(source)
    if printed:
        cell.outputs = [nbformat.v4.new_output("display_data", data={"text/markdown": f"```python\n{printed}```"})]
    return cell


def test_a_shape_keeps_attributes_and_keywords_and_forgets_variable_names():
    assert line_shape("total = exps.sum(dim=-1)") == line_shape("s = e.sum(axis=-2)")
    assert line_shape("total = exps.sum(dim=-1)") != line_shape("total = exps.mean(dim=-1)")
    assert line_shape("x = torch.exp(y)  # comment") == line_shape("z=torch.exp(w)")
    assert line_shape("out = f(a,") == ("ID", "=", "ID", "(", "ID", ",")  # a line cut inside brackets


def test_a_printed_answer_with_renamed_variables_is_found():
    printed = ("def softmax(z):\n    m = z - z.max(dim=-1, keepdim=True).values\n    e = torch.exp(m)\n"
               "    s = e.sum(dim=-1, keepdim=True)\n    return e / s\n")
    leaks = answer_leaks(chapter(code("labkit.show_source(labkit.nn.stable)", printed), code(SOLVED)))
    assert [(leak.graders, leak.cell, leak.kind, leak.where) for leak in leaks] == [(("softmax",), 0, "copy", "output")]


def test_the_same_code_in_a_cell_below_or_in_prose_above_is_told_apart():
    below = answer_leaks(chapter(code(SOLVED), code(SOLVED.replace("my_softmax", "again"))))
    assert [leak.exercise_cell for leak in below] == [1]  # the second exercise sees the first; not the reverse
    fenced = nbformat.v4.new_markdown_cell("```python\nshifted = x - x.max(dim=-1, keepdim=True).values\n"
                                           "exps = torch.exp(shifted)\ntotal = exps.sum(dim=-1, keepdim=True)\n```")
    assert [leak.where for leak in answer_leaks(chapter(fenced, code(SOLVED)))] == ["source"]


def test_show_source_of_the_graded_function_or_a_member_of_its_class_is_found():
    for shown in ("labkit.nn.softmax", "labkit.nn.Softmax.softmax"):
        leaks = answer_leaks(chapter(code(f"labkit.show_source({shown})"), code(SOLVED)))
        assert [leak.kind for leak in leaks] == ["show_source"], shown
    assert answer_leaks(chapter(code("labkit.show_source(labkit.nn.causal_mask)"), code(SOLVED))) == []


def test_unrelated_code_above_is_not_a_leak():
    other = "y = model(x)\nloss = F.cross_entropy(y.flatten(0, 1), t.flatten())\nloss.backward()\nopt.step()"
    assert answer_leaks(chapter(code(other), code(SOLVED))) == []


@pytest.mark.parametrize("path", chapter_paths(ROOT / "notebooks"), ids=lambda p: p.stem)
def test_no_chapter_shows_an_answer_above_its_exercise(path):
    leaks = answer_leaks(nbformat.read(path, as_version=4))
    found = {(grader, leak.kind) for leak in leaks for grader in leak.graders}
    known = KNOWN.get(path.stem, set())
    new = [str(leak) for leak in leaks if not {(g, leak.kind) for g in leak.graders} <= known]
    assert not new, ("answers shown above their exercise: move these cells below it (show labkit's version after "
                     "the exercise) or rewrite them:\n  " + "\n  ".join(new))
    gone = known - found
    assert not gone, f"no longer shown above their exercise: {sorted(gone)}; delete them from KNOWN in {__file__}"


def test_show_source_of_labkits_implementation_of_the_exercise_is_found():
    zero1 = ("class MyZero1:\n    # BEGIN SOLUTION\n    def step(self):\n        pass\n    # END SOLUTION\n\n"
             "checks.zero1_optimizer(MyZero1)")
    leaks = answer_leaks(chapter(code("labkit.show_source(dist.ShardedOptimizer.step)"), code(zero1)))
    assert [leak.kind for leak in leaks] == ["show_source"]  # ShardedOptimizer is the ZeRO-1 grader's refused delegate
    # a delegate with an exercise of its own is judged by that exercise: shown after it, it is no leak for the next one
    e8m0 = "def mine(a, e):\n    # BEGIN SOLUTION\n    return a\n    # END SOLUTION\n\nchecks.e8m0_exponent(mine)"
    mx = "def mx(x, f):\n    # BEGIN SOLUTION\n    return x\n    # END SOLUTION\n\nchecks.mx_quantize(mx)"
    assert answer_leaks(chapter(code(e8m0), code("labkit.show_source(B.e8m0_exponent)"), code(mx))) == []
