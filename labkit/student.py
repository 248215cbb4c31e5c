"""Student versions of the chapter notebooks: solutions replaced by skeletons, outputs cleared.

``python -m labkit.student [NOTEBOOK ...] [--out student]`` (or ``make student``) writes a copy of each
chapter in which every exercise keeps its prose and becomes two kinds of cells:

- a *solution* cell: the learner's function with its signature, a docstring (the exercise's statement)
  and ``raise NotImplementedError("not answered yet: ...")`` pointing to the exercise text and its hint,
  in place of the code between ``# BEGIN SOLUTION`` and ``# END SOLUTION``;
- one locked *grader* cell per ``labkit.checks`` call, worth :data:`POINTS` point(s).

The cells carry nbgrader's metadata (``solution``, ``grade``, ``locked``, ``points``, ``grade_id``), so a
teacher who uses nbgrader can put the student versions in its ``source/`` folder, release and autograde
them; ``python -m labkit.grade`` grades them without nbgrader. A grader run on a skeleton fails with
"not answered yet" (:data:`NOT_ANSWERED`); every other cell runs as in the full chapter.
"""
from __future__ import annotations

import argparse
import ast
import io
import re
import textwrap
import tokenize
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
NOT_ANSWERED = "not answered yet"
POINTS = 1
CHAPTER_GLOB = "[0-9][0-9]_*.ipynb"
# A sentence ends at "." or ";" before a capital or a backtick (not after "e.g." or "i.e.").
SENTENCE_END = re.compile(r"(?<!e\.g\.)(?<!i\.e\.)(?<=[.;)])\s+(?=[A-Z`(])")
EXERCISE_TITLE = re.compile(r"\*\*(Exercise\s+\d+)[^*]*\*\*\s*")
NBGRADER_SCHEMA = 3


def chapter_paths(folder: Path) -> list[Path]:
    """The chapter notebooks in ``folder`` (``NN_topic.ipynb``), in chapter order."""
    return sorted(Path(folder).glob(CHAPTER_GLOB))


def placeholder(function: str | None, exercise: str | None, has_hint: bool) -> str:
    """The ``raise`` line that stands for a removed solution, pointing the learner to the exercise text."""
    what = f"write {function}" if function else "write this part"
    where = exercise or "the exercise"
    pointer = f"see the hint in {where} above" if has_hint else f"{where} above says what it must do"
    return f'raise NotImplementedError("{NOT_ANSWERED}: {what} ({pointer})")'


def strip_solutions(source: str, placeholders: list[str] | None = None) -> str:
    """``source`` with every solution block replaced by an indented ``raise`` line (``placeholders[i]`` for
    the i-th block; by default one that names no function)."""
    lines, inside, block = [], False, 0
    for number, line in enumerate(source.splitlines(), start=1):
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise ValueError(f"line {number}: '{BEGIN}' inside another solution block")
            inside = True
            text = placeholders[block] if placeholders else placeholder(None, None, False)
            lines.append(line[: len(line) - len(line.lstrip())] + text)
            block += 1
        elif marker == END:
            if not inside:
                raise ValueError(f"line {number}: '{END}' without a '{BEGIN}' before it")
            inside = False
        elif not inside:
            lines.append(line)
    if inside:
        raise ValueError(f"'{BEGIN}' is never closed by '{END}'")
    return "\n".join(lines)


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def grader_call(statement: ast.stmt) -> str | None:
    """The exercise name if ``statement`` is a grader call (``labkit.checks.NAME(fn)``, ``checks.NAME(fn)``,
    ``moe_checks.NAME(fn)``, ...), else None."""
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
        module, _, name = _dotted(statement.value.func).rpartition(".")
        if module.endswith("checks") and name and not name.startswith("_"):
            return name
    return None


def grader_calls(source: str) -> list[str]:
    """The exercises graded by top-level calls in a code cell's ``source`` (empty if it does not parse)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [name for statement in tree.body if (name := grader_call(statement))]


@dataclass(frozen=True)
class Exercise:
    """What a solution cell tells about its exercise: the title and statement from the markdown above it."""

    title: str | None     # "Exercise 2"
    statement: str        # the exercise's prose without its bold title
    has_hint: bool


def exercise_text(cells: list[dict], index: int) -> Exercise:
    """The exercise statement for the solution cell ``cells[index]``: the nearest markdown paragraph above it
    (after the previous solution cell) that starts with ``**Exercise N ...**``, or else the markdown
    paragraph right above it."""
    above = []
    for cell in reversed(cells[:index]):
        if cell["cell_type"] == "code" and BEGIN in cell_source(cell):
            break
        if cell["cell_type"] == "markdown":
            above.extend(reversed(cell_source(cell).split("\n\n")))
    for paragraph in above:
        if match := EXERCISE_TITLE.search(paragraph):
            body = paragraph[match.end():].strip()
            return Exercise(match.group(1), " ".join(body.split()), "hint" in paragraph.lower())
    paragraph = above[0] if above else ""
    return Exercise(None, " ".join(paragraph.split()), "hint" in paragraph.lower())


def cell_source(cell: dict) -> str:
    """A notebook cell's source as one string (nbformat stores it as a string or a list of lines)."""
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _header_end(source: str, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> int:
    """The line (1-based) on which the ``def``/``class`` header of ``node`` ends (its closing ``:``)."""
    depth = 0
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    for token in tokens:
        if token.start[0] < node.lineno or (token.start[0] == node.lineno and token.string == "@"):
            continue
        if token.type == tokenize.OP and token.string in "([{":
            depth += 1
        elif token.type == tokenize.OP and token.string in ")]}":
            depth -= 1
        elif token.type == tokenize.OP and token.string == ":" and depth == 0:
            return token.start[0]
    raise ValueError(f"line {node.lineno}: could not find the end of the header")


def _docstring(statement: str, function: str, indent: str, alone: bool) -> list[str]:
    """``statement`` as a raw docstring at ``indent``. A cell that defines several functions gives each the
    sentences that name it (when some do); a function alone in its cell gets the whole statement."""
    sentences = SENTENCE_END.split(statement)
    own = [s for s in sentences if f"`{function}(" in s or f"`{function}`" in s]
    text = " ".join(sentences if alone or not own else own).replace('"""', "\'\'\'").rstrip("\\")
    lines = textwrap.wrap(text, width=max(40, 100 - len(indent) - 3)) or [function]
    lines[0] = 'r"""' + lines[0]
    lines[-1] += '"""'
    return [indent + line for line in lines]


def split_cell_magic(source: str) -> tuple[str, str]:
    """``(magic line, Python)`` of a cell that starts with a cell magic (``%%writefile my_ddp.py``: the
    cell's code goes to a file the ranks of a distributed exercise import), else ``("", source)``."""
    if source.startswith("%%"):
        magic, _, body = source.partition("\n")
        return magic + "\n", body
    return "", source


def skeleton(source: str, exercise: Exercise) -> str:
    """The learner's version of a solution cell: each function or class that holds a solution block keeps
    its signature, gains a docstring (the exercise statement) where it has none, and its solution becomes
    a ``raise NotImplementedError`` pointing to the exercise text. A leading cell magic line
    (``%%writefile ...``) is kept as it is and the Python below it is handled as a cell of its own."""
    magic, source = split_cell_magic(source)
    if magic:
        return magic + skeleton(source, exercise)
    try:
        tree = ast.parse(source)
    except SyntaxError as err:
        raise ValueError(f"a solution cell does not parse: {err}") from None
    lines = source.splitlines()
    markers = [n for n, line in enumerate(lines, start=1) if line.strip() == BEGIN]
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]

    def enclosing(line: int) -> str | None:
        around = sorted((n for n in scopes if n.lineno < line <= n.end_lineno), key=lambda n: n.lineno)
        return ".".join(n.name for n in around) or None

    alone = sum(n in scopes for n in tree.body) <= 1  # one function (or class) in the cell
    placeholders, documented = [], set()
    for line in markers:
        placeholders.append(placeholder(enclosing(line), exercise.title, exercise.has_hint))
        # The outermost definition (the function, or the class whose methods hold the blocks) gets the docstring.
        outer = next((n for n in tree.body if n in scopes and n.lineno < line <= n.end_lineno), None)
        if outer is None or outer.name in documented or ast.get_docstring(outer) is not None or not exercise.statement:
            continue
        documented.add(outer.name)
        indent = " " * (outer.body[0].col_offset if outer.body[0].lineno > outer.lineno else outer.col_offset + 4)
        lines[_header_end(source, outer) - 1] += "\n" + "\n".join(_docstring(exercise.statement, outer.name, indent, alone))
    return strip_solutions("\n".join(lines), placeholders)


def without_marker_sentences(text: str) -> str:
    """Markdown ``text`` without the sentences that point to the solution markers (a student version has
    none; nbgrader would also take a marker named in prose for a solution region)."""
    paragraphs = []
    for paragraph in text.split("\n\n"):
        if BEGIN.lstrip("# ") in paragraph or END.lstrip("# ") in paragraph:
            kept = [s for s in SENTENCE_END.split(" ".join(paragraph.split()))
                    if BEGIN.lstrip("# ") not in s and END.lstrip("# ") not in s]
            paragraph = " ".join(kept)
        if paragraph.strip():
            paragraphs.append(paragraph)
    return "\n\n".join(paragraphs)


def _split_graders(source: str) -> tuple[str, list[tuple[str, str]]]:
    """Split a code cell into its code and its trailing grader calls: ``(code, [(exercise, call), ...])``.
    A cell that is not plain Python (an IPython magic) has no grader calls."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return source, []
    first = len(body)
    while first > 0 and grader_call(body[first - 1]):
        first -= 1
    if first == len(body):
        return source, []
    lines = source.splitlines()
    calls = [(grader_call(s), "\n".join(lines[s.lineno - 1: s.end_lineno])) for s in body[first:]]
    return "\n".join(lines[: body[first].lineno - 1]).rstrip(), calls


def _cell(kind: str, source: str, **metadata) -> dict:
    cell = {"cell_type": kind, "metadata": metadata, "source": source}
    if kind == "code":
        cell.update(outputs=[], execution_count=None)
    return cell


def _nbgrader(grade_id: str, *, solution: bool, grade: bool, locked: bool, points: int | None = None) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": NBGRADER_SCHEMA,
            "solution": solution, "task": False}
    if points is not None:
        meta["points"] = points
    return meta


def student_notebook(notebook: dict, chapter: str) -> tuple[dict, list[str]]:
    """The student version of ``notebook`` (a chapter, as a dict in nbformat 4) and the exercises it grades,
    in order. The chapter name (``"00_foundations"``) goes into the notebook metadata."""
    nb = deepcopy(notebook)
    cells, exercises = [], []
    for index, cell in enumerate(nb["cells"]):
        cell.setdefault("metadata", {}).pop("nbgrader", None)
        if cell["cell_type"] != "code":
            if BEGIN.lstrip("# ") in cell_source(cell) or END.lstrip("# ") in cell_source(cell):
                cell["source"] = without_marker_sentences(cell_source(cell))
            cells.append(cell)
            continue
        source = cell_source(cell)
        cell.update(outputs=[], execution_count=None)
        if BEGIN in source:
            try:
                source = skeleton(source, exercise_text(nb["cells"], index))
            except ValueError as err:
                raise ValueError(f"cell {index + 1}: {err}") from None
            cell["metadata"]["nbgrader"] = _nbgrader(f"answer-{cell.get('id', index)}", solution=True,
                                                     grade=False, locked=False)
        code, calls = _split_graders(source)
        if code.strip() or not calls:
            cell["source"] = code
            cells.append(cell)
        for name, call in calls:
            grader = _cell("code", call, nbgrader=_nbgrader(f"check-{name}", solution=False, grade=True,
                                                            locked=True, points=POINTS))
            grader["id"] = f"check-{name}"[:64]
            cells.append(grader)
            exercises.append(name)
    nb["cells"] = cells
    nb["metadata"].pop("widgets", None)  # the saved widget state belongs to outputs that are gone
    nb["metadata"]["labkit"] = {**nb["metadata"].get("labkit", {}), "chapter": chapter, "student_version": True}
    if len(set(exercises)) != len(exercises):
        raise ValueError(f"an exercise is graded twice: {exercises}")
    return nb, exercises


def with_solutions(student: dict, chapter: dict) -> dict:
    """``student`` (a student version of ``chapter``) with every solution cell holding the chapter's own answer
    (markers removed, its grader calls left in their own cells): a hand-in that solved everything."""
    answers = {c.get("id"): cell_source(c) for c in chapter["cells"] if c.get("cell_type") == "code"}
    handed_in = deepcopy(student)
    for cell in handed_in["cells"]:
        if cell.get("metadata", {}).get("nbgrader", {}).get("solution") and cell.get("id") in answers:
            code, _ = _split_graders(answers[cell["id"]])
            cell["source"] = "\n".join(line for line in code.splitlines() if line.strip() not in (BEGIN, END))
    return handed_in


def unanswered_run(notebook: dict, chapter: str) -> dict:
    """The student version of ``notebook`` as a run of it with no exercise answered must look, for nbval to
    compare (``make test-student``). Every code cell the student version keeps unchanged carries the chapter's
    stored outputs: it must print what the teacher's run printed, so nothing after an exercise may depend on
    the learner's answer. The learner's cells are left unrun (nbval runs them and compares nothing). Each
    grader cell is tagged ``raises-exception`` and holds the error an unanswered grader gives, a
    ``CheckFailed`` saying :data:`NOT_ANSWERED` (tests/nbval_sanitize.cfg reduces the message to those words,
    so a grader that passes, or fails for another reason, is a mismatch)."""
    run, _ = student_notebook(notebook, chapter)
    stored = {cell.get("id"): cell for cell in notebook["cells"] if cell.get("cell_type") == "code"}
    for cell in run["cells"]:
        if cell["cell_type"] != "code":
            continue
        if cell["metadata"].get("nbgrader", {}).get("grade"):
            tags = cell["metadata"].setdefault("tags", [])
            tags.append("raises-exception")
            cell["execution_count"] = 1
            cell["outputs"] = [{"output_type": "error", "ename": "CheckFailed", "evalue": NOT_ANSWERED, "traceback": []}]
            continue
        teacher = stored.get(cell.get("id"))
        if teacher is not None and cell_source(teacher) == cell_source(cell):
            cell["outputs"] = deepcopy(teacher["outputs"])
            cell["execution_count"] = teacher["execution_count"]
    if "widgets" in notebook["metadata"]:  # the widget state of the outputs kept
        run["metadata"]["widgets"] = deepcopy(notebook["metadata"]["widgets"])
    return run


def make_student_notebook(src: Path, dst: Path) -> int:
    """Write the student version of notebook ``src`` to ``dst``; return the number of solutions removed."""
    import nbformat

    notebook = nbformat.read(src, as_version=4)
    try:
        student, _ = student_notebook(notebook, Path(src).stem)
    except ValueError as err:
        raise ValueError(f"{src}: {err}") from None
    dst.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nbformat.from_dict(student), dst)
    return sum(cell_source(c).count(BEGIN) for c in notebook.cells if c.cell_type == "code")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m labkit.student", description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/NN_*.ipynb")
    parser.add_argument("--out", type=Path, default=Path("student"), help="output folder (default: student/)")
    parser.add_argument("--unanswered-run", action="store_true",
                        help="write what a run of each student version with no answer must show, for nbval (make test-student)")
    args = parser.parse_args(argv)
    paths = args.notebooks or chapter_paths(Path("notebooks"))
    if not paths:
        parser.error("no notebooks given and none found in notebooks/")
    for path in paths:
        if args.unanswered_run:
            import nbformat

            run = unanswered_run(nbformat.read(path, as_version=4), path.stem)
            args.out.mkdir(parents=True, exist_ok=True)
            nbformat.write(nbformat.from_dict(run), args.out / path.name)
            print(f"{args.out / path.name}: the student version with the chapter's outputs")
            continue
        removed = make_student_notebook(path, args.out / path.name)
        print(f"{args.out / path.name}: {removed} solution(s) removed")


if __name__ == "__main__":
    main()
