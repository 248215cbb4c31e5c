"""Grade a class's submissions: ``python -m labkit.grade SUBMISSIONS... --out grades.csv`` (or ``make grade``).

SUBMISSIONS are notebooks or folders of them. The student is the first folder below a folder given on the
command line (``submissions/alice/00_foundations.ipynb`` → ``alice``; nbgrader's
``submitted/alice/ps1/00_foundations.ipynb`` → ``alice``), or the folder holding a notebook given directly.

Each submission runs top to bottom in a fresh kernel, in a child process of its own, in an empty temporary
working directory (and an empty ``HOME`` and ``TMPDIR``), with a time limit. Each exercise of its chapter gets
one row in the CSV (``student, chapter, exercise, result, message``), ``result`` being one of

- ``passed``: the grader accepted the answer;
- ``failed``: the grader rejected the answer (the message is the grader's);
- ``not attempted``: the skeleton's ``raise NotImplementedError("not answered yet ...")`` is still there;
- ``error``: anything else: another exception, the kernel died, the time ran out, the notebook left a process
  running or changed the teacher's files, the notebook could not be graded (not a notebook, another chapter's).

Notebooks are read with nbformat, as Jupyter writes them (sources as lists of lines or strings, any 4.x minor
version, cell ids or none, outputs and widget state stored or not).

**What a grade guarantees.** The grader cells are not run in the submission's kernel. The process that runs the
notebook (the *grading process*) runs each grader itself, in place of its cell, with a handle to the learner's
function that stays in the kernel (``labkit.checks._remote``): the inputs go to the kernel, the learner's code
runs there, and what it returns comes back as data that cannot run code when it is read (tensors, numbers,
strings, containers). Whether the answer is right is decided in the grading process, which none of the
submission's code runs in; ``grades.csv`` is written from what that process reports. So a submission that
patches ``labkit.checks``, ``CheckFailed``, ``torch.allclose``, builtins or ``sys.modules`` in its kernel, prints
a pass line, exits a cell early, calls ``sys.exit``/``os._exit``, or edits its stored outputs changes nothing but
its own kernel. While the learner's code runs, labkit's own implementation of the exercise refuses to run for
it (``labkit.checks._core.DELEGATES``). A run that outlasts the time limit, leaves a process behind (found by a
marker in its environment, even as a daemon), changes a file of the teacher's (the chapters, the submissions,
an earlier run's CSV and reports) or reads an earlier run's CSV or reports (seen through the file's access time,
under Linux's default ``relatime``; the CSV is also written readable by its owner only) is graded ``error``.
A few graders have to drive the learner's objects in place: chapter 05's ``LoRALinear`` (parameters edited,
backward run), chapter 12's ``block_manager`` (an allocator called method by method), ``plan_step`` (a plan read
field by field) and ``speculative_accept`` (``torch.Generator`` objects made where the function lives). That part
(their probe) runs in the learner's process and only records what came back; the verdict is still decided here,
from the probe's record, against the grader's own reference: a forged record passes only if it is what a right
answer does. Files a run leaves in its own folders are reported in rows
with the exercise ``(notebook)`` and the result ``contained``.

What it does not guarantee: that the learner wrote the answer (a classmate's or a copied one passes like any
right answer, and the delegation refusal stops the casual call, not a determined copy of labkit's source); and,
when ``make grade`` runs as an ordinary user, the kernel runs with that user's rights, so a submission built to
attack the grading processes themselves (reading or writing their files, signalling or tracing them through
``/proc``) is outside what it can stop. Run by root (in a container, say), the kernel runs as the unprivileged
user ``nobody`` where it can (it must be able to read Python and labkit), which closes that door: it can then
neither read the teacher's files nor reach the grading processes. A Markdown report per student goes to
``--reports`` (default: next to the CSV).
"""
from __future__ import annotations

import argparse
import ast
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

from labkit.execute import read_notebook, sliced_waits_client
from labkit.student import NOT_ANSWERED, cell_source, chapter_paths, grader_call, student_notebook

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
    """What running one notebook gave: the grading process's verdicts and what went wrong at the notebook level."""

    verdicts: dict[str, tuple[str, str]]       # grader cell id -> (result, message)
    failure: str = ""                          # timed out / kernel died / could not start, with the cell
    processes: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)   # the teacher's files that changed while it ran
    read: list[str] = field(default_factory=list)      # the teacher's files read while it ran



def load_references(folder: Path) -> dict[str, Reference]:
    """The student versions of every chapter in ``folder`` (``NN_topic.ipynb``), by chapter name."""
    references = {}
    for path in chapter_paths(folder):
        notebook, _ = student_notebook(read_notebook(path), path.stem)
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
    """The submission at ``path`` as nbformat reads it; ValueError saying why it is not a notebook."""
    try:
        return read_notebook(Path(path))
    except UnicodeDecodeError as err:
        raise ValueError(f"not a notebook (not text: {err})") from None


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


def fingerprint(folders: list[Path]) -> dict[str, tuple[int, int, int]]:
    """``path -> (size, mtime, atime)`` (ns) of every file under ``folders`` (the teacher's: chapters, submissions,
    the CSV's folder)."""
    seen = {}
    for folder in folders:
        folder = Path(folder)
        for path in ([folder] if folder.is_file() else folder.rglob("*") if folder.is_dir() else []):
            try:
                info = path.lstat()
            except OSError:
                continue
            if not path.is_dir():
                seen[str(path)] = (info.st_size, info.st_mtime_ns, info.st_atime_ns)
    return seen


def arm_read_detection(paths) -> None:
    """Set each file's access time just before its modification time. Linux's default ``relatime`` then
    records the next read (it updates an access time older than the modification time), so a read shows in
    :func:`fingerprint`. (A file system mounted ``noatime`` records none: reads go unseen there.)"""
    for path in paths:
        try:
            info = os.stat(path)
            os.utime(path, ns=(info.st_mtime_ns - 1_000_000_000, info.st_mtime_ns))
        except OSError:
            continue


def file_changes(before: dict, after: dict) -> tuple[list[str], list[str]]:
    """``(changed, read)``: files written, added or removed between the fingerprints, and files only read."""
    changed = sorted(p for p in set(before) | set(after) if before.get(p, (None,) * 3)[:2] != after.get(p, (None,) * 3)[:2])
    read = sorted(p for p in set(before) & set(after) if p not in changed and before[p][2] != after[p][2])
    return changed, read


def _unprivileged_user() -> tuple[int, int] | None:
    """``(uid, gid)`` of ``nobody`` when this process is root and ``nobody`` can run Python with labkit (then the
    kernel runs as ``nobody``); else None (the kernel runs as this user)."""
    if os.name != "posix" or os.geteuid() != 0 or os.environ.get("LABKIT_GRADE_SAME_USER"):
        return None
    import pwd

    try:
        user = pwd.getpwnam("nobody")
    except KeyError:
        return None
    try:
        probe = subprocess.run([sys.executable, "-c", "import labkit, ipykernel, torch"], user=user.pw_uid,
                               group=user.pw_gid, extra_groups=[], cwd="/", capture_output=True, timeout=120,
                               env=dict(os.environ, HOME="/tmp"))
    except (OSError, subprocess.SubprocessError):  # e.g. Python lives under /root, which `nobody` cannot enter
        return None
    return (user.pw_uid, user.pw_gid) if probe.returncode == 0 else None


def run_notebook(notebook: dict, reference: Reference, timeout: float, watched: list[tuple[Path, bool]] = (),
                 user: tuple[int, int] | None = None) -> Run:
    """Run ``notebook`` in a fresh kernel in a child process, contained, its graders run by that child (see the
    module docstring); ``watched``: the teacher's files and folders, each checked for changes and, if its flag
    is set, for reads."""
    marker = uuid.uuid4().hex
    folders = [path for path, _ in watched]
    unread = tuple(str(path) for path, reads in watched if not reads)
    before = fingerprint(folders)
    with tempfile.TemporaryDirectory(prefix="labkit-grade-") as tmp:
        workdir, scratch, home, io_dir, calls, runtime = (Path(tmp) / name for name in ("work", "tmp", "home", "io", "calls", "runtime"))
        for folder in (workdir, scratch, home, io_dir, calls, runtime):
            folder.mkdir()
        (io_dir / "in.ipynb").write_text(json.dumps(notebook), encoding="utf-8")
        (io_dir / "graders.json").write_text(json.dumps(reference.exercises), encoding="utf-8")
        if user is not None:  # the kernel (as `nobody`) works in these; the grading process reads io/ only
            os.chmod(tmp, 0o755)
            for folder in (workdir, scratch, home, calls, runtime):
                os.chown(folder, *user)
        env = dict(os.environ, **{MARKER: marker}, HOME=str(home), TMPDIR=str(scratch), MPLBACKEND="Agg",
                   JUPYTER_RUNTIME_DIR=str(runtime))
        command = [sys.executable, "-m", "labkit.grade", "--run-one", str(io_dir), "--timeout", str(timeout)]
        if user is not None:
            command += ["--kernel-user", f"{user[0]}:{user[1]}"]
        child = subprocess.Popen(command, cwd=workdir, env=env, start_new_session=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = child.communicate(timeout=timeout + GRACE_S)
            report = _report_of(out)
            failure = "" if child.returncode == 0 and report is not None else \
                f"the grading process failed: {err.decode(errors='replace')[-500:]}"
        except subprocess.TimeoutExpired:
            report, failure = None, f"timed out after {timeout:.0f} s (and the kernel did not stop)"
        # The runner and its kernel are expected while the run lasts; anything else with the marker was
        # started by the notebook (a daemon too: it keeps the environment).
        ours = {child.pid, *(p.pid for p in _children(child.pid))} if child.poll() is None else set()
        leftovers = [p for pid, p in _kill_marked(marker) if pid not in ours]
        child.kill() if child.poll() is None else None
        child.wait()
        report = report or {}
        # HOME is left out: the kernel writes its IPython profile there.
        files = sorted(str(p.relative_to(folder)) for folder in (workdir, scratch) for p in folder.rglob("*") if p.is_file())
        changed, read = file_changes(before, fingerprint(folders))
        read = [path for path in read if not path.startswith(unread)] if unread else read
        arm_read_detection(read)
        return Run(report.get("verdicts", {}), report.get("failure") or failure, leftovers, files, changed, read)


def _report_of(stdout: bytes) -> dict | None:
    """The grading process's report: the last line of its standard output (the kernel's output goes elsewhere)."""
    lines = stdout.decode(errors="replace").strip().splitlines()
    try:
        report = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    return report if isinstance(report, dict) else None


class KernelTransport:
    """Requests to the learner process over the kernel's shell channel: the request goes into a file, one
    silent line runs :func:`labkit.checks._remote.serve` in the kernel, and the reply comes back in a file.
    Each exchange waits at most until ``deadline`` (then the kernel is interrupted) and fails at once when the
    kernel dies."""

    def __init__(self, client, folder: Path, deadline: float):
        from jupyter_client import BlockingKernelClient

        self.client, self.folder, self.deadline = client, folder, deadline
        self.kc = BlockingKernelClient()
        self.kc.load_connection_info(client.km.get_connection_info())
        self.kc.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)

    def close(self) -> None:
        self.kc.stop_channels()

    def _alive(self) -> bool:
        process = getattr(getattr(self.client.km, "provisioner", None), "process", None)
        return process is None or process.poll() is None

    def exchange(self, request: bytes) -> bytes:
        import queue

        from labkit.checks._remote import MAX_RESPONSE_BYTES, RemoteFailure

        name = uuid.uuid4().hex
        asked, reply = self.folder / f"{name}.request", self.folder / f"{name}.reply"
        asked.write_bytes(request)
        os.chmod(asked, 0o644)
        code = f"__import__('labkit.checks._remote', fromlist=['serve']).serve({str(asked)!r}, {str(reply)!r})"
        msg_id = self.kc.execute(code, silent=True, store_history=False, allow_stdin=False)
        try:
            while True:
                if not self._alive():
                    raise RemoteFailure("the kernel died while the grader ran your code")
                if time.monotonic() > self.deadline:
                    from jupyter_core.utils import run_sync

                    run_sync(self.client.km.interrupt_kernel)()
                    raise RemoteFailure("the time limit ran out while the grader ran your code")
                try:
                    message = self.kc.get_shell_msg(timeout=min(1.0, max(0.05, self.deadline - time.monotonic())))
                except queue.Empty:
                    continue
                if message.get("parent_header", {}).get("msg_id") == msg_id:
                    break
            if not reply.is_file() or reply.is_symlink():
                raise RemoteFailure("the kernel gave no reply (did your code replace labkit's reply channel?)")
            if reply.stat().st_size > MAX_RESPONSE_BYTES:
                raise RemoteFailure(f"a reply of {reply.stat().st_size} bytes")
            return reply.read_bytes()
        finally:
            for path in (asked, reply):
                path.unlink(missing_ok=True)


def grader_arguments(source: str) -> tuple[str, list]:
    """``(exercise, arguments)`` of a grader cell ``labkit.checks.NAME(ARG, ...)``: each argument is a dotted
    name (the learner's object) or a literal."""
    tree = ast.parse(source)
    statement = tree.body[0] if len(tree.body) == 1 else None
    name = grader_call(statement) if statement is not None else None
    if name is None:
        raise ValueError(f"not a grader call: {source.strip()[:80]!r}")
    arguments = []
    for node in statement.value.args:
        dotted, part = [], node
        while isinstance(part, ast.Attribute):
            dotted.insert(0, part.attr)
            part = part.value
        if isinstance(part, ast.Name):
            arguments.append(("name", ".".join([part.id, *dotted])))
        else:
            arguments.append(("literal", ast.literal_eval(node)))
    return name, arguments


def grade_here(source: str, transport, earlier_failure: str = "") -> tuple[str, str]:
    """``(result, message)``: the grader of the cell ``source`` run in this process on handles to the learner's
    objects in the kernel."""
    import contextlib
    import io

    import labkit.checks as checks
    from labkit.checks._remote import Remote, RemoteFailure

    try:
        exercise, arguments = grader_arguments(source)
    except (SyntaxError, ValueError) as err:
        return "error", f"not graded: {err}"
    handles = [Remote(transport, value, exercise) if kind == "name" else value for kind, value in arguments]
    feedback = io.StringIO()
    try:
        with contextlib.redirect_stdout(feedback):
            getattr(checks, exercise)(*handles)
        return "passed", ""
    except checks.CheckFailed as err:
        if NOT_ANSWERED in str(err):
            return "not attempted", ""
        return "failed", _first_line(str(err))
    except RemoteFailure as err:
        return "error", f"not graded: {err}"
    except Exception as err:  # noqa: BLE001  (the learner's objects may be missing or raise anything)
        if NOT_ANSWERED in str(err):
            return "not attempted", ""
        return "error", f"{type(err).__name__}: {_first_line(str(err), 200)}" + (f" ({earlier_failure})" if earlier_failure else "")
    finally:
        for handle in handles:
            if isinstance(handle, Remote):
                with contextlib.suppress(Exception, RemoteFailure):
                    handle.release()
                break


def _kernel_manager_as(user: tuple[int, int]) -> type:
    """nbclient's kernel manager, handing the connection file to ``user`` (the kernel runs as it) before launch."""
    from jupyter_client.manager import AsyncKernelManager

    class UnprivilegedKernelManager(AsyncKernelManager):
        async def _async_launch_kernel(self, kernel_cmd, **kw):
            os.chown(self.connection_file, *user)
            return await super()._async_launch_kernel(kernel_cmd, **kw)

    return UnprivilegedKernelManager


def _run_one(io_dir: Path, timeout: float, kernel_user: tuple[int, int] | None = None) -> None:
    """The grading process of :func:`run_notebook`: run io_dir/in.ipynb cell by cell in a kernel, each grader
    cell's grader here instead of in the kernel; print the report (verdicts, failure) as one JSON line."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    notebook = read_notebook(io_dir / "in.ipynb")
    graders = json.loads((io_dir / "graders.json").read_text(encoding="utf-8"))
    deadline = time.monotonic() + timeout
    # The limit is for the whole notebook: each cell gets what is left of it.
    client = sliced_waits_client(NotebookClient)(
        notebook, timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
        kernel_name="python3", allow_errors=True, resources={"metadata": {"path": os.getcwd()}},
        **({"kernel_manager_class": _kernel_manager_as(kernel_user)} if kernel_user is not None else {}))
    failure, verdicts, first_error, index = "", {}, "", None
    # The kernel's own output never reaches this process's standard output, which carries the report.
    launch = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "stdin": subprocess.DEVNULL}
    if kernel_user is not None:
        launch.update(user=kernel_user[0], group=kernel_user[1], extra_groups=[])
    try:
        with client.setup_kernel(**launch):
            transport = KernelTransport(client, io_dir.parent / "calls", deadline)
            try:
                for index, cell in enumerate(notebook.cells):
                    if cell.get("id") in graders:
                        verdicts[cell["id"]] = grade_here(cell_source(cell), transport, first_error)
                        if time.monotonic() > deadline:
                            raise CellTimeoutError("the time limit ran out in a grader")
                        continue
                    client.execute_cell(cell, index)
                    error = _error_of(cell)
                    if error is not None and not first_error:
                        first_error = f"cell {index + 1} failed first: {error.get('ename')}: {_first_line(error.get('evalue', ''), 120)}"
            finally:
                transport.close()
    except CellTimeoutError:
        failure = f"timed out after {timeout:.0f} s in cell {index + 1}" if index is not None else f"timed out after {timeout:.0f} s"
    except DeadKernelError:
        failure = f"the kernel died in cell {index + 1}" if index is not None else "the kernel died"
    except Exception as err:  # a kernel that cannot start, a broken cell: the grade says so
        failure = f"could not run: {type(err).__name__}: {str(err)[:300]}"
    for cell_id, _ in graders.items():
        if cell_id not in verdicts or (failure and verdicts[cell_id][0] == "error"):
            verdicts[cell_id] = ("error", f"not graded: {failure or 'the cell did not run'}")
    sys.stdout.write("\n" + json.dumps({"verdicts": verdicts, "failure": failure}) + "\n")
    sys.stdout.flush()


def _error_of(cell: dict) -> dict | None:
    return next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), None)


def _first_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return " / ".join(lines)[:limit]


def grade_cells(run: Run, reference: Reference, notes: dict[str, str]) -> list[tuple[str, str, str]]:
    """``(exercise, result, message)`` for every exercise of ``reference``, from the grading process's verdicts."""
    graded = []
    spoiled = ""
    if run.processes:
        spoiled = f"not graded: the notebook left {len(run.processes)} process(es) running (a process that outlives its run could change what is graded)"
    elif run.changed or run.read:
        what = "changed" if run.changed else "were read"
        files = run.changed or run.read
        shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        spoiled = (f"not graded: the teacher's files {what} while it ran ({shown}); with --jobs > 1 another submission "
                   "may have done it: grade again with --jobs 1")
    for cell_id, exercise in reference.exercises.items():
        result, message = run.verdicts.get(cell_id, ("error", f"not graded: {run.failure or 'the cell did not run'}"))
        if spoiled:
            result, message = "error", spoiled
        graded.append((exercise, result, "; ".join(m for m in (notes.get(cell_id, ""), message) if m)))
    return graded


def grade_submission(path: Path, student: str, references: dict[str, Reference], timeout: float,
                     chapter: str | None = None, watched: list[tuple[Path, bool]] = (),
                     user: tuple[int, int] | None = None) -> list[Row]:
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
    run = run_notebook(runnable, reference, timeout, watched, user)
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
    """Write the grades readable by their owner only (a kernel run as ``nobody`` cannot read an earlier CSV)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", newline="", encoding="utf-8") as handle:
        os.chmod(out, 0o600)
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
          chapter: str | None = None, out: Path | None = None, reports: Path | None = None) -> list[Row]:
    """Every row for ``submissions`` (files or folders), graded against the chapters in ``reference``; the
    teacher's files (``reference``, the submissions, ``out`` and ``reports``) are watched while each runs."""
    if timeout <= 0:
        raise ValueError(f"timeout={timeout}: expected a positive number of seconds")
    if jobs < 1:
        raise ValueError(f"jobs={jobs}: expected at least 1")
    references = load_references(reference)
    found = find_submissions(submissions)
    # The teacher's files: an earlier run's grades, watched for reads and writes; the chapters (public: the
    # course's repository has their solutions) and the submissions (read by the grading itself), for writes.
    private = [Path(out), Path(reports or Path(out).parent / "reports")] if out is not None else []
    watched = [(path, True) for path in private] + [(Path(path), False) for path in (reference, *submissions)]
    arm_read_detection(fingerprint(private))
    user = _unprivileged_user()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        graded = pool.map(lambda item: grade_submission(item[0], item[1], references, timeout, chapter, watched, user), found)
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
    parser.add_argument("--kernel-user", help=argparse.SUPPRESS)     # uid:gid its kernel runs as
    args = parser.parse_args(argv)
    if args.run_one:
        user = tuple(int(v) for v in args.kernel_user.split(":")) if args.kernel_user else None
        _run_one(args.run_one, args.timeout, user)
        return 0
    if not args.submissions:
        parser.error("no submissions given")
    try:
        rows = grade(args.submissions, args.reference, args.timeout, args.jobs, args.chapter, args.out, args.reports)
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
