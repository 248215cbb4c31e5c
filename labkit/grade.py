"""Grade a class's submissions: ``python -m labkit.grade SUBMISSIONS... --out grades.csv`` (or ``make grade``).

SUBMISSIONS are notebooks or folders of them. The student is the first folder below a folder given on the
command line (``submissions/alice/00_foundations.ipynb`` → ``alice``; nbgrader's
``submitted/alice/ps1/00_foundations.ipynb`` → ``alice``), or the folder holding a notebook given directly.

Each submission runs top to bottom in a fresh kernel, in a child process of its own, in an empty temporary
working directory (and an empty ``HOME`` and ``TMPDIR``), with a time limit. Each exercise of its chapter gets
one row in the CSV (``student, chapter, exercise, result, message``), ``result`` being one of

- ``passed``: its grader cell ran without error;
- ``failed``: the grader rejected the answer (the message is the grader's);
- ``not attempted``: the skeleton's ``raise NotImplementedError("not answered yet ...")`` is still there;
- ``error``: anything else: another exception, the kernel died, the time ran out, the notebook could not be
  graded (not a notebook, another chapter's notebook).

Grader cells are compared with the chapter's student version: an edited or deleted grader cell is put
back before the run, and the row's message says so. What a submission leaves behind is reported in rows
with the exercise ``(notebook)`` and the result ``contained``: processes it started (killed; every process
of a run carries a marker in its environment, so even a daemon is found) and files it left in its working
directory or ``TMPDIR`` (deleted with them). A Markdown report per student goes to ``--reports`` (default: next to the CSV).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from labkit.execute import sliced_waits_client
from labkit.student import NOT_ANSWERED, cell_source, chapter_paths, student_notebook

RESULTS = ("passed", "failed", "not attempted", "error", "contained")
NOTEBOOK_ROW = "(notebook)"
MARKER = "LABKIT_GRADE_RUN"  # set in the environment of every process a graded run starts
CSV_FIELDS = ["student", "chapter", "exercise", "result", "message"]
GRACE_S = 30  # beyond the per-notebook limit, for the kernel's start and shutdown


@dataclass(frozen=True)
class Row:
    student: str
    chapter: str
    exercise: str
    result: str
    message: str = ""


@dataclass(frozen=True)
class Reference:
    """A chapter's grader cells as its student version hands them out."""

    chapter: str
    graders: dict[str, str]       # grader cell id → its source
    exercises: dict[str, str]     # grader cell id → exercise name


@dataclass
class Run:
    """What running one notebook gave: the executed cells and what went wrong at the notebook level."""

    notebook: dict | None
    failure: str = ""                          # timed out / kernel died / could not start, with the cell
    processes: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)



def load_references(folder: Path) -> dict[str, Reference]:
    """The student versions of every chapter in ``folder`` (``NN_topic.ipynb``), by chapter name."""
    references = {}
    for path in chapter_paths(folder):
        notebook, _ = student_notebook(json.loads(path.read_text(encoding="utf-8")), path.stem)
        graders = {c["id"]: cell_source(c) for c in notebook["cells"] if c["metadata"].get("nbgrader", {}).get("grade")}
        exercises = {c["id"]: c["id"].removeprefix("check-") for c in notebook["cells"] if c["id"] in graders}
        references[path.stem] = Reference(path.stem, graders, exercises)
    if not references:
        raise ValueError(f"reference={str(folder)!r}: no chapter notebooks (NN_topic.ipynb) there")
    return references


def _chapter_of_name(path: Path, references: dict[str, Reference]) -> str | None:
    return next((name for name in references if name in path.name), None)


def _chapter_of_content(notebook: dict, references: dict[str, Reference]) -> str | None:
    """The chapter whose grader cells the notebook holds most of (its own metadata breaks ties)."""
    sources = {cell_source(c) for c in notebook.get("cells", [])}
    claimed = notebook.get("metadata", {}).get("labkit", {}).get("chapter")
    score = {name: (len(sources & set(ref.graders.values())), name == claimed) for name, ref in references.items()}
    best = max(score, key=score.get)
    return best if score[best] != (0, False) else None


def read_submission(path: Path) -> dict:
    """The submission at ``path`` as an nbformat-4 dict; ValueError saying why it is not one."""
    try:
        notebook = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"not a notebook (not JSON: {err})") from None
    if not isinstance(notebook, dict) or notebook.get("nbformat") != 4 or not isinstance(notebook.get("cells"), list):
        raise ValueError("not a notebook (no nbformat-4 'cells')")
    if any(not isinstance(c, dict) or c.get("cell_type") not in ("code", "markdown", "raw") for c in notebook["cells"]):
        raise ValueError("not a notebook (a cell without a valid cell_type)")
    return notebook


def restore_graders(notebook: dict, reference: Reference) -> tuple[dict, dict[str, str]]:
    """A copy of ``notebook`` ready to run (outputs cleared, every grader cell as handed out) and, per grader
    cell id, a note on what had been changed in it."""
    cells = [dict(c, outputs=[], execution_count=None) if c["cell_type"] == "code" else dict(c)
             for c in notebook["cells"]]
    notes = {}
    for cell_id, source in reference.graders.items():
        same = [c for c in cells if c.get("id") == cell_id] or [c for c in cells if cell_source(c) == source]
        if not same:
            notes[cell_id] = "grader cell deleted; put back at the end before grading"
            cells.append({"cell_type": "code", "id": cell_id, "metadata": {}, "source": source,
                          "outputs": [], "execution_count": None})
        elif cell_source(same[0]) != source:
            notes[cell_id] = f"grader cell edited (it read {cell_source(same[0]).strip()[:80]!r}); put back before grading"
            same[0]["source"], same[0]["cell_type"], same[0]["id"] = source, "code", cell_id
            same[0].update(outputs=[], execution_count=None)
        else:
            same[0]["id"] = cell_id
    return {**notebook, "cells": cells}, notes


def _marked_processes(marker: str) -> list:
    import psutil

    found = []
    for process in psutil.process_iter(["pid"]):
        try:
            if process.environ().get(MARKER) == marker:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _children(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=False)
    except psutil.NoSuchProcess:
        return []


def _kill_marked(marker: str) -> list[tuple[int, str]]:
    """Kill every process carrying ``marker``; ``(pid, description)`` of each."""
    import psutil

    killed = []
    for process in _marked_processes(marker):
        try:
            killed.append((process.pid, f"{' '.join(process.cmdline())[:80]} (pid {process.pid})"))
            process.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return killed


def run_notebook(notebook: dict, timeout: float) -> Run:
    """Run ``notebook`` in a fresh kernel in a child process, contained (see the module docstring)."""
    marker = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="labkit-grade-") as tmp:
        workdir, scratch, home, io_dir = (Path(tmp) / name for name in ("work", "tmp", "home", "io"))
        for folder in (workdir, scratch, home, io_dir):
            folder.mkdir()
        (io_dir / "in.ipynb").write_text(json.dumps(notebook), encoding="utf-8")
        env = dict(os.environ, **{MARKER: marker}, HOME=str(home), TMPDIR=str(scratch), MPLBACKEND="Agg")
        command = [sys.executable, "-m", "labkit.grade", "--run-one", str(io_dir), "--timeout", str(timeout)]
        child = subprocess.Popen(command, cwd=workdir, env=env, start_new_session=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            log, _ = child.communicate(timeout=timeout + GRACE_S)
            failure = "" if child.returncode == 0 else f"the grading process failed: {log.decode(errors='replace')[-500:]}"
        except subprocess.TimeoutExpired:
            failure = f"timed out after {timeout:.0f} s (and the kernel did not stop)"
        # The runner and its kernel are expected while the run lasts; anything else with the marker was
        # started by the notebook (a daemon too: it keeps the environment).
        ours = {child.pid, *(p.pid for p in _children(child.pid))} if child.poll() is None else set()
        leftovers = [p for pid, p in _kill_marked(marker) if pid not in ours]
        child.wait()
        status = json.loads((io_dir / "status.json").read_text()) if (io_dir / "status.json").exists() else {}
        executed = json.loads((io_dir / "out.ipynb").read_text()) if (io_dir / "out.ipynb").exists() else None
        # HOME is left out: the kernel writes its IPython profile there.
        files = sorted(str(p.relative_to(folder)) for folder in (workdir, scratch) for p in folder.rglob("*") if p.is_file())
        return Run(executed, status.get("failure", failure), leftovers, files)


def _run_one(io_dir: Path, timeout: float) -> None:
    """The child process of :func:`run_notebook`: execute io_dir/in.ipynb, write out.ipynb and status.json."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    notebook = nbformat.from_dict(json.loads((io_dir / "in.ipynb").read_text(encoding="utf-8")))
    deadline = time.monotonic() + timeout
    # The limit is for the whole notebook: each cell gets what is left of it.
    client = sliced_waits_client(NotebookClient)(
        notebook, timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
        kernel_name="python3", allow_errors=True, resources={"metadata": {"path": os.getcwd()}})
    failure, running = "", {"index": None}
    client.on_cell_execute = lambda cell, cell_index: running.update(index=cell_index)

    def current_cell() -> str:
        return f"cell {running['index'] + 1}" if running["index"] is not None else "the kernel's start"

    try:
        client.execute()
    except CellTimeoutError:
        failure = f"timed out after {timeout:.0f} s in {current_cell()}"
    except DeadKernelError:
        failure = f"the kernel died in {current_cell()}"
    except Exception as err:  # a kernel that cannot start, a broken cell: the grade says so
        failure = f"could not run: {type(err).__name__}: {str(err)[:300]}"
    (io_dir / "out.ipynb").write_text(json.dumps(notebook), encoding="utf-8")
    (io_dir / "status.json").write_text(json.dumps({"failure": failure}))


def _error_of(cell: dict) -> dict | None:
    return next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), None)


def _first_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return " / ".join(lines)[:limit]


def grade_cells(run: Run, reference: Reference, notes: dict[str, str]) -> list[tuple[str, str, str]]:
    """``(exercise, result, message)`` for every exercise of ``reference`` in the executed notebook."""
    cells = {c.get("id"): c for c in (run.notebook or {}).get("cells", [])}
    order = [c.get("id") for c in (run.notebook or {}).get("cells", [])]
    graded = []
    for cell_id, exercise in reference.exercises.items():
        cell, note = cells.get(cell_id), notes.get(cell_id, "")
        error = _error_of(cell) if cell else None
        if cell is None or (error is None and not cell.get("execution_count")):
            result, message = "error", f"not graded: {run.failure or 'the cell did not run'}"
        elif error is None:
            result, message = "passed", ""
        elif NOT_ANSWERED in error.get("evalue", "") or any(NOT_ANSWERED in line for line in error.get("traceback", [])):
            result, message = "not attempted", ""
        elif error.get("ename") == "CheckFailed":
            result, message = "failed", _first_line(error.get("evalue", ""))
        else:
            result, message = "error", f"{error.get('ename')}: {_first_line(error.get('evalue', ''), 200)}"
            earlier = [(i, _error_of(c)) for i, c in enumerate(run.notebook["cells"][: order.index(cell_id)])
                       if c.get("cell_type") == "code" and _error_of(c)]
            if earlier:
                i, first = earlier[0]
                message += f" (cell {i + 1} failed first: {first.get('ename')}: {_first_line(first.get('evalue', ''), 120)})"
        graded.append((exercise, result, "; ".join(m for m in (note, message) if m)))
    return graded


def grade_submission(path: Path, student: str, references: dict[str, Reference], timeout: float,
                     chapter: str | None = None) -> list[Row]:
    """The CSV rows for one submitted notebook (never raises for a bad submission: it gets an error row)."""
    named = _chapter_of_name(path, references) or (chapter and next((n for n in references if n.startswith(chapter)), None))
    try:
        notebook = read_submission(path)
    except (OSError, ValueError) as err:
        return [Row(student, named or "?", NOTEBOOK_ROW, "error", f"{path.name}: {err}")]
    content = _chapter_of_content(notebook, references)
    expected = next((n for n in references if chapter and n.startswith(chapter)), None) or named or content
    if content is None:
        return [Row(student, expected or "?", NOTEBOOK_ROW, "error",
                    f"{path.name}: no grader cell of any chapter in it (is it a student version?)")]
    if content != expected:
        return [Row(student, expected, NOTEBOOK_ROW, "error",
                    f"{path.name} is chapter {content}'s notebook, not {expected}'s: not graded")]
    reference = references[content]
    runnable, notes = restore_graders(notebook, reference)
    run = run_notebook(runnable, timeout)
    rows = [Row(student, content, exercise, result, message)
            for exercise, result, message in grade_cells(run, reference, notes)]
    if run.failure:
        rows.append(Row(student, content, NOTEBOOK_ROW, "error", run.failure))
    if run.processes:
        rows.append(Row(student, content, NOTEBOOK_ROW, "contained",
                        f"{len(run.processes)} process(es) still running after the notebook, killed: " + "; ".join(run.processes)))
    if run.files:
        shown = ", ".join(run.files[:5]) + (f" and {len(run.files) - 5} more" if len(run.files) > 5 else "")
        rows.append(Row(student, content, NOTEBOOK_ROW, "contained",
                        f"left {len(run.files)} file(s) in its working directory or TMPDIR, deleted: {shown}"))
    return rows


def find_submissions(arguments: list[Path]) -> list[tuple[Path, str]]:
    """``(notebook, student)`` for every notebook named or found (recursively) in the folders named."""
    found = []
    for argument in arguments:
        if argument.is_dir():
            for path in sorted(argument.rglob("*.ipynb")):
                if ".ipynb_checkpoints" in path.parts:
                    continue
                relative = path.relative_to(argument).parts
                found.append((path, relative[0] if len(relative) > 1 else argument.resolve().name))
        elif argument.exists():
            found.append((argument, argument.resolve().parent.name))
        else:
            raise ValueError(f"submission {str(argument)!r}: no such file or folder")
    return found


def write_csv(rows: list[Row], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({name: getattr(row, name) for name in CSV_FIELDS})


def write_reports(rows: list[Row], folder: Path) -> list[Path]:
    """One Markdown report per student: a table per chapter and the points (passed exercises) it earned."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for student in sorted({r.student for r in rows}):
        mine = [r for r in rows if r.student == student]
        lines = [f"# {student}", ""]
        for chapter in sorted({r.chapter for r in mine}):
            here = [r for r in mine if r.chapter == chapter]
            exercises = [r for r in here if r.exercise != NOTEBOOK_ROW]
            passed = sum(r.result == "passed" for r in exercises)
            lines += [f"## {chapter}: {passed} of {len(exercises)} exercise(s) passed", "",
                      "| exercise | result | message |", "|---|---|---|"]
            lines += ["| " + " | ".join((r.exercise, r.result, r.message.replace("|", "\\|"))) + " |" for r in here]
            lines.append("")
        path = folder / f"{student}.md"
        path.write_text("\n".join(lines), encoding="utf-8")
        written.append(path)
    return written


def grade(submissions: list[Path], reference: Path, timeout: float, jobs: int = 1,
          chapter: str | None = None) -> list[Row]:
    """Every row for ``submissions`` (files or folders), graded against the chapters in ``reference``."""
    if timeout <= 0:
        raise ValueError(f"timeout={timeout}: expected a positive number of seconds")
    if jobs < 1:
        raise ValueError(f"jobs={jobs}: expected at least 1")
    references = load_references(reference)
    found = find_submissions(submissions)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        graded = pool.map(lambda item: grade_submission(item[0], item[1], references, timeout, chapter), found)
        rows = [row for rows in graded for row in rows]
    return sorted(rows, key=lambda r: (r.student, r.chapter))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.grade", description=__doc__.splitlines()[0])
    parser.add_argument("submissions", nargs="*", type=Path, help="submitted notebooks, or folders of them")
    parser.add_argument("--out", type=Path, default=Path("grades.csv"), help="the CSV to write (default: grades.csv)")
    parser.add_argument("--reports", type=Path, help="folder for one Markdown report per student (default: OUT's folder/reports)")
    parser.add_argument("--reference", type=Path, default=Path("notebooks"), help="the chapters (default: notebooks/)")
    parser.add_argument("--chapter", help="the assigned chapter (e.g. 00): a notebook of another chapter is not graded")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per notebook (default: 600)")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks graded at once (default: 1)")
    parser.add_argument("--run-one", type=Path, help=argparse.SUPPRESS)  # the contained child process
    args = parser.parse_args(argv)
    if args.run_one:
        _run_one(args.run_one, args.timeout)
        return 0
    if not args.submissions:
        parser.error("no submissions given")
    try:
        rows = grade(args.submissions, args.reference, args.timeout, args.jobs, args.chapter)
    except ValueError as err:
        parser.error(str(err))
    write_csv(rows, args.out)
    reports = write_reports(rows, args.reports or args.out.parent / "reports")
    counts = {result: sum(r.result == result for r in rows) for result in RESULTS}
    print(f"{args.out}: {len(rows)} row(s) for {len(reports)} student(s): "
          + ", ".join(f"{n} {result}" for result, n in counts.items() if n))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
