"""`python -m labkit.grade` against submissions that try to forge their grade, all saved as Jupyter saves
notebooks (``nbformat.write``: sources as lists of lines), beside the honest ones (untouched, the teacher's
own answers, a realistic mistake). Every attack grades ``failed`` or ``error``, never ``passed``."""
from __future__ import annotations

import csv
import os

import nbformat
import pytest

from labkit import grade
from labkit.student import student_notebook, with_solutions
from test_grade import RIGHT, TINY, WRONG_AXES, answered, edited_grader

TIMEOUT_S = 45

REASSIGN = ("import labkit.checks as _c, labkit.checks.ch02_norms as _m\n"
            "_c.reduction_dims = _m.reduction_dims = lambda fn: print('✓ reduction_dims: all good')\n"
            "def reduction_dims(norm, ndim):\n    pass")
SYS_MODULES = ("import sys, types, labkit\nfake = types.ModuleType('labkit.checks')\n"
               "fake.reduction_dims = fake.gradient_collective = lambda fn: print('✓ all good')\n"
               "sys.modules['labkit.checks'] = labkit.checks = fake\n"
               "def reduction_dims(norm, ndim):\n    return None")
RELOAD = ("import importlib, labkit.checks, labkit.checks._core as core, labkit.checks.ch02_norms as m\n"
          "core.CheckFailed = type('CheckFailed', (Exception,), {})\nm.fail = lambda *a, **k: None\n"
          "importlib.reload(labkit.checks)\n" + WRONG_AXES)
PATCHED_COMPARISONS = ("import builtins, torch, labkit.checks\n"
                       "builtins.AssertionError = type('AssertionError', (BaseException,), {})\n"
                       "labkit.checks.CheckFailed = type('CheckFailed', (BaseException,), {})\n"
                       "torch.allclose = torch.equal = lambda *a, **k: True\n"
                       "torch.testing.assert_close = lambda *a, **k: None\n" + WRONG_AXES)
PASS_LINE_AND_SWALLOW = ("print('✓ reduction_dims: all good')\n"
                         "get_ipython().set_custom_exc((BaseException,), lambda *a, **k: print('✓ all good'))\n" + WRONG_AXES)
DETECTS_GRADING = ("import inspect, labkit.dist\n_answer = labkit.dist.gradient_collective\n"
                   "def gradient_collective(strategy):\n"
                   "    graded = any('labkit' in frame.filename for frame in inspect.stack()[1:])\n"
                   "    return _answer(strategy) if graded else 'all_reduce'")
SLEEPS = "import time\ndef reduction_dims(norm, ndim):\n    time.sleep(3600)"
FORKS = ("import subprocess\ndef reduction_dims(norm, ndim):\n"
         "    subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
         "    return tuple(range(ndim - 1)) if norm == 'batchnorm' else (ndim - 1,)")
DIES = "import os\ndef reduction_dims(norm, ndim):\n    os._exit(0)"
FORGED_REPLY = ("import io, pickle, labkit.checks._remote as r\n"
                "class Payload:\n    def __reduce__(self):\n        return (exec, ('import sys; sys.exit(3)',))\n"
                "r.handle = lambda request, namespace=None: pickle.dumps({'status': 'ok', 'value': Payload()})\n"
                "def reduction_dims(norm, ndim):\n    return None")


def writes_into(path) -> str:
    return (f"def reduction_dims(norm, ndim):\n    open({str(path)!r}, 'w').write('alice,00_tiny,reduction_dims,passed,')\n"
            "    return tuple(range(ndim - 1)) if norm == 'batchnorm' else (ndim - 1,)")


def reads(path) -> str:
    return (f"def reduction_dims(norm, ndim):\n    print(open({str(path)!r}).read())\n"
            "    return tuple(range(ndim - 1)) if norm == 'batchnorm' else (ndim - 1,)")


def stored_pass(nb: dict) -> dict:
    nb = answered(nb, {"reduction_dims": WRONG_AXES})
    cell = next(c for c in nb["cells"] if c.get("id") == "check-reduction_dims")
    cell["execution_count"] = 5
    cell["outputs"] = [nbformat.v4.new_output("stream", name="stdout", text="✓ reduction_dims: all good\n")]
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("attacks")
    reference = root / "notebooks"
    reference.mkdir()
    nbformat.write(nbformat.from_dict(TINY), reference / "00_tiny.ipynb")
    out = root / "grades.csv"
    out.write_text("student,chapter,exercise,result,message\nbob,00_tiny,reduction_dims,failed,\n")  # an earlier run
    handed_out, _ = student_notebook(TINY, "00_tiny")
    submissions = {
        "untouched": handed_out,
        "teacher": with_solutions(handed_out, TINY),
        "wrong": answered(handed_out, {"reduction_dims": WRONG_AXES}),
        "reassign": answered(handed_out, {"reduction_dims": REASSIGN}),
        "sys_modules": answered(handed_out, {"reduction_dims": SYS_MODULES}),
        "reload": answered(handed_out, {"reduction_dims": RELOAD}),
        "patched": answered(handed_out, {"reduction_dims": PATCHED_COMPARISONS}),
        "pass_line": answered(handed_out, {"reduction_dims": PASS_LINE_AND_SWALLOW}),
        "exit_grader": edited_grader(answered(handed_out, {"reduction_dims": WRONG_AXES}), "reduction_dims",
                                     "import sys\nsys.exit(0)"),
        "os_exit_grader": edited_grader(answered(handed_out, {"reduction_dims": WRONG_AXES}), "reduction_dims",
                                        "import os\nos._exit(0)"),
        "stored_pass": stored_pass(handed_out),
        "delegates": answered(handed_out, {"gradient_collective": DETECTS_GRADING}),
        "sleeps": answered(handed_out, {"reduction_dims": SLEEPS}),
        "forks": answered(handed_out, {"reduction_dims": FORKS}),
        "dies": answered(handed_out, {"reduction_dims": DIES}),
        "forged_reply": answered(handed_out, {"reduction_dims": FORGED_REPLY}),
        "writes": answered(handed_out, {"reduction_dims": writes_into(reference / "00_tiny.ipynb")}),
        "reads": answered(handed_out, {"reduction_dims": reads(out)}),
    }
    folder = root / "submissions"
    for student, nb in submissions.items():
        (folder / student).mkdir(parents=True)
        nbformat.write(nbformat.from_dict(nb), folder / student / "00_tiny.ipynb")  # as Jupyter saves it
    old = os.environ.get("LABKIT_DEVICE")
    os.environ["LABKIT_DEVICE"] = "cpu"
    try:
        assert grade.main([str(folder), "--out", str(out), "--reference", str(reference),
                           "--timeout", str(TIMEOUT_S), "--jobs", "1"]) == 0
    finally:
        os.environ.pop("LABKIT_DEVICE") if old is None else os.environ.__setitem__("LABKIT_DEVICE", old)
    with open(out, newline="") as handle:
        rows = list(csv.DictReader(handle))
    return {(r["student"], r["exercise"]): r for r in rows if r["exercise"] != grade.NOTEBOOK_ROW}


def test_saved_by_jupyter_the_handed_out_version_is_not_attempted_and_the_teachers_answers_pass(graded):
    assert [graded["untouched", e]["result"] for e in ("reduction_dims", "gradient_collective")] == ["not attempted"] * 2
    assert [graded["teacher", e]["result"] for e in ("reduction_dims", "gradient_collective")] == ["passed"] * 2
    assert graded["wrong", "reduction_dims"]["result"] == "failed"
    assert "BatchNorm averages each feature" in graded["wrong", "reduction_dims"]["message"]


@pytest.mark.parametrize("student, exercise, result, words", [
    ("reassign", "reduction_dims", "failed", ""),
    ("sys_modules", "reduction_dims", "error", ""),  # its fake labkit.checks breaks the kernel's side of the channel
    ("reload", "reduction_dims", "failed", "BatchNorm"),
    ("patched", "reduction_dims", "failed", "BatchNorm"),
    ("pass_line", "reduction_dims", "failed", "BatchNorm"),
    ("exit_grader", "reduction_dims", "failed", "grader cell edited"),
    ("os_exit_grader", "reduction_dims", "failed", "grader cell edited"),
    ("stored_pass", "reduction_dims", "failed", "BatchNorm"),
    ("delegates", "gradient_collective", "failed", "write it yourself: `labkit.dist.gradient_collective`"),
    ("sleeps", "reduction_dims", "error", ""),
    ("forks", "reduction_dims", "error", ""),
    ("dies", "reduction_dims", "error", "kernel died"),
    ("forged_reply", "reduction_dims", "error", "unreadable reply"),
    ("writes", "reduction_dims", "error", "the teacher's files changed"),
    ("reads", "reduction_dims", "error", "the teacher's files were read"),
])
def test_no_attack_passes(graded, student, exercise, result, words):
    row = graded[student, exercise]
    assert row["result"] in ("failed", "error"), row
    assert row["result"] == result and words in row["message"], row


def test_the_grades_file_is_the_teachers_alone(graded, tmp_path_factory):
    out = next(tmp_path_factory.getbasetemp().glob("attacks*/grades.csv"))
    assert oct(out.stat().st_mode & 0o777) == "0o600"
