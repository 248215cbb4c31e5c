"""`python -m labkit.grade` on a generated class: a two-exercise chapter (real labkit graders, so every run
takes seconds) and one submission per kind of student (correct, partly correct, empty, hanging, crashing,
grader cell edited, not a notebook, another chapter's notebook, one that starts a process and writes a
file) give the expected CSV."""
from __future__ import annotations

import csv
import json
import os

import nbformat
import pytest

from labkit import grade
from labkit.student import student_notebook

TIMEOUT_S = 45  # per notebook: the kernel's start and `import labkit` take ~10 s on a busy 2-core machine


def chapter(cells: list[tuple[str, str]]) -> dict:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(s) if kind == "md" else nbformat.v4.new_code_cell(s) for kind, s in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return json.loads(nbformat.writes(nb))


TINY = chapter([
    ("md", "# Chapter 00 — Tiny"),
    ("code", "import labkit\nlabkit.setup()"),
    ("md", "**Exercise 1 — norm axes.** Write `reduction_dims(norm, ndim)`: the dims each norm reduces over."),
    ("code", "def reduction_dims(norm, ndim):\n    # BEGIN SOLUTION\n"
             "    return tuple(range(ndim - 1)) if norm == 'batchnorm' else (ndim - 1,)\n    # END SOLUTION\n\n"
             "labkit.checks.reduction_dims(reduction_dims)"),
    ("md", "**Exercise 2 — the collective.** Write `gradient_collective(strategy)`."),
    ("code", "def gradient_collective(strategy):\n    # BEGIN SOLUTION\n"
             "    return 'all_reduce' if strategy in ('ddp', 'zero1') else 'reduce_scatter'\n    # END SOLUTION"),
    ("code", "labkit.checks.gradient_collective(gradient_collective)"),
    ("code", "print('after the exercises')"),
])
OTHER = chapter([
    ("md", "# Chapter 01 — Other"),
    ("code", "import labkit"),
    ("md", "**Exercise 1 — bytes.** Write `adamw_mixed_precision_bytes(num_params)`."),
    ("code", "def adamw_mixed_precision_bytes(num_params):\n    # BEGIN SOLUTION\n    return 16 * num_params\n"
             "    # END SOLUTION\n\nlabkit.checks.adamw_mixed_precision_bytes(adamw_mixed_precision_bytes)"),
])
RIGHT = {"reduction_dims": "def reduction_dims(norm, ndim):\n    return tuple(range(ndim - 1)) if norm == 'batchnorm' else (ndim - 1,)",
         "gradient_collective": "def gradient_collective(strategy):\n"
                                "    return 'all_reduce' if strategy in ('ddp', 'zero1') else 'reduce_scatter'"}
WRONG_AXES = "def reduction_dims(norm, ndim):\n    return (ndim - 1,)  # BatchNorm too: the typical mistake"
HANG = "import time\ntime.sleep(3600)\n" + RIGHT["reduction_dims"]
CRASH = "import os\nos._exit(1)\n" + RIGHT["reduction_dims"]
LEAVES_THINGS = ("import subprocess\nsubprocess.Popen(['sleep', '300'], start_new_session=True)\n"
                 "open('notes.txt', 'w').write('hello')\n" + RIGHT["reduction_dims"])


def answered(nb: dict, answers: dict[str, str]) -> dict:
    """``nb`` (a student version) with the solution cells holding ``answers`` (by the function they define)."""
    nb = json.loads(json.dumps(nb))
    for cell in nb["cells"]:
        if cell["metadata"].get("nbgrader", {}).get("solution"):
            name = next(n for n in ("reduction_dims", "gradient_collective") if f"def {n}(" in "".join(cell["source"]))
            if name in answers:
                cell["source"] = answers[name]
    return nb


def edited_grader(nb: dict, exercise: str, source: str) -> dict:
    nb = json.loads(json.dumps(nb))
    next(c for c in nb["cells"] if c.get("id") == f"check-{exercise}")["source"] = source
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("class")
    reference = root / "notebooks"
    reference.mkdir()
    (reference / "00_tiny.ipynb").write_text(json.dumps(TINY))
    (reference / "01_other.ipynb").write_text(json.dumps(OTHER))
    handed_out, _ = student_notebook(TINY, "00_tiny")
    other_handed_out, _ = student_notebook(OTHER, "01_other")
    submissions = {
        "alice": answered(handed_out, RIGHT),
        "bob": answered(handed_out, {**RIGHT, "reduction_dims": WRONG_AXES}),
        "carol": handed_out,
        "dave": answered(handed_out, {**RIGHT, "reduction_dims": HANG}),
        "erin": answered(handed_out, {**RIGHT, "reduction_dims": CRASH}),
        "frank": edited_grader(answered(handed_out, {"gradient_collective": RIGHT["gradient_collective"]}),
                               "reduction_dims", "print('✓ reduction_dims')"),
        "gina": "this is my essay, not a notebook",
        "hank": other_handed_out,
        "ivan": answered(handed_out, {**RIGHT, "reduction_dims": LEAVES_THINGS}),
    }
    folder = root / "submissions"
    for student, content in submissions.items():
        (folder / student).mkdir(parents=True)
        text = content if isinstance(content, str) else json.dumps(content)
        (folder / student / "00_tiny.ipynb").write_text(text)
    out = root / "grades.csv"
    old = os.environ.get("LABKIT_DEVICE")
    os.environ["LABKIT_DEVICE"] = "cpu"
    try:
        assert grade.main([str(folder), "--out", str(out), "--reference", str(reference),
                           "--timeout", str(TIMEOUT_S), "--jobs", "3"]) == 0
    finally:
        os.environ.pop("LABKIT_DEVICE") if old is None else os.environ.__setitem__("LABKIT_DEVICE", old)
    with open(out, newline="") as handle:
        rows = list(csv.DictReader(handle))
    return rows, root


EXPECTED = [  # student, exercise, result, words the message must contain
    ("alice", "reduction_dims", "passed", ""),
    ("alice", "gradient_collective", "passed", ""),
    ("bob", "reduction_dims", "failed", "BatchNorm averages each feature"),
    ("bob", "gradient_collective", "passed", ""),
    ("carol", "reduction_dims", "not attempted", ""),
    ("carol", "gradient_collective", "not attempted", ""),
    ("dave", "reduction_dims", "error", f"not graded: timed out after {TIMEOUT_S} s in cell 4"),
    ("dave", "gradient_collective", "error", "not graded: timed out"),
    ("dave", "(notebook)", "error", f"timed out after {TIMEOUT_S} s in cell 4"),
    ("erin", "reduction_dims", "error", "not graded: the kernel died in cell 4"),
    ("erin", "gradient_collective", "error", "not graded: the kernel died"),
    ("erin", "(notebook)", "error", "the kernel died in cell 4"),
    ("frank", "reduction_dims", "not attempted", "grader cell edited (it read \"print('✓ reduction_dims')\")"),
    ("frank", "gradient_collective", "passed", ""),
    ("gina", "(notebook)", "error", "not a notebook"),
    ("hank", "(notebook)", "error", "is chapter 01_other's notebook, not 00_tiny's"),
    ("ivan", "reduction_dims", "error", "not graded: the notebook left 1 process(es) running"),
    ("ivan", "gradient_collective", "error", "not graded: the notebook left 1 process(es) running"),
    ("ivan", "(notebook)", "contained", "1 process(es) still running after the notebook, killed: sleep 300"),
    ("ivan", "(notebook)", "contained", "left 1 file(s) in its working directory or TMPDIR, deleted: notes.txt"),
]


def test_the_csv_has_one_expected_row_per_exercise(graded):
    rows, _ = graded
    assert [(r["student"], r["exercise"], r["result"]) for r in rows] == [e[:3] for e in EXPECTED]
    assert all(r["chapter"] == "00_tiny" for r in rows)
    for row, (*_, words) in zip(rows, EXPECTED):
        assert words in row["message"], (row, words)
        assert (row["message"] == "") == (words == ""), row


def test_nothing_the_submissions_started_is_left(graded):
    import time

    import psutil

    def graded_sleepers():
        """The submissions' `sleep 300`s: a process with that command line *and* the grading runs' marker
        in its environment (another `sleep 300` on the machine is none of this test's business)."""
        found = []
        for p in psutil.process_iter(["cmdline", "status"]):
            if (p.info["cmdline"] or [])[:2] != ["sleep", "300"] or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            try:
                if grade.MARKER in p.environ():
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    deadline = time.monotonic() + 5  # SIGKILL takes effect when the kernel next schedules the process
    while graded_sleepers() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = graded_sleepers()
    described = [(p.pid, p.ppid(), p.create_time()) for p in left]
    for p in left:
        p.kill()
    assert not left, f"(pid, parent, started) of each: {described}"


def test_every_student_gets_a_report(graded):
    _, root = graded
    report = (root / "reports" / "bob.md").read_text()
    assert "## 00_tiny: 1 of 2 exercise(s) passed" in report and "| reduction_dims | failed |" in report
    assert sorted(p.stem for p in (root / "reports").glob("*.md")) == sorted({e[0] for e in EXPECTED})


def test_bad_arguments_are_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        grade.main([str(tmp_path / "missing"), "--out", str(tmp_path / "g.csv")])
    assert "no such file or folder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="timeout"):
        grade.grade([tmp_path], tmp_path, timeout=0)


def test_a_grader_cell_deleted_is_put_back():
    handed_out, _ = student_notebook(TINY, "00_tiny")
    reference = grade.Reference("00_tiny", {"check-softmax": "labkit.checks.softmax(softmax)"},
                                {"check-softmax": "softmax"})
    restored, notes = grade.restore_graders(handed_out, reference)
    assert restored["cells"][-1]["source"] == "labkit.checks.softmax(softmax)"
    assert "deleted" in notes["check-softmax"]


def test_channel_waits_are_sliced_so_a_missed_wake_up_costs_a_second():
    import asyncio
    import queue
    import time

    from labkit.execute import sliced_waits

    waits = []

    async def get_msg(timeout=None):  # a channel whose message is there from the third poll on
        waits.append(timeout)
        if len(waits) < 3:
            raise queue.Empty
        return {"msg_type": "execute_reply"}

    assert asyncio.run(sliced_waits(get_msg, step_s=0.01)(timeout=None)) == {"msg_type": "execute_reply"}
    assert waits == [0.01, 0.01, 0.01]

    async def never(timeout=None):
        await asyncio.sleep(timeout)
        raise queue.Empty

    start = time.monotonic()
    with pytest.raises(queue.Empty):
        asyncio.run(sliced_waits(never, step_s=0.02)(timeout=0.1))
    assert time.monotonic() - start < 1.0
