"""Student versions of the chapter notebooks: solutions removed, outputs cleared.

``python -m labkit.student [NOTEBOOK ...] [--out student]`` (or ``make student``) writes a copy of each
notebook in which the code between ``# BEGIN SOLUTION`` and ``# END SOLUTION`` is replaced by a
``raise NotImplementedError`` the learner overwrites; the ``labkit.checks`` call after it then
grades their answer.
"""
from __future__ import annotations

import argparse
from pathlib import Path

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
PLACEHOLDER = 'raise NotImplementedError("your code here")'


def strip_solutions(source: str) -> str:
    """``source`` with every solution block replaced by an indented placeholder."""
    lines, inside = [], False
    for number, line in enumerate(source.splitlines(), start=1):
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise ValueError(f"line {number}: '{BEGIN}' inside another solution block")
            inside = True
            lines.append(line[: len(line) - len(line.lstrip())] + PLACEHOLDER)
        elif marker == END:
            if not inside:
                raise ValueError(f"line {number}: '{END}' without a '{BEGIN}' before it")
            inside = False
        elif not inside:
            lines.append(line)
    if inside:
        raise ValueError(f"'{BEGIN}' is never closed by '{END}'")
    return "\n".join(lines)


def make_student_notebook(src: Path, dst: Path) -> int:
    """Write the student version of notebook ``src`` to ``dst``; return the number of solutions removed."""
    import nbformat

    nb = nbformat.read(src, as_version=4)
    removed = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        try:
            stripped = strip_solutions(cell.source)
        except ValueError as err:
            raise ValueError(f"{src}: {err}") from None
        removed += cell.source.count(BEGIN)
        cell.source = stripped
        cell.outputs, cell.execution_count = [], None
    dst.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dst)
    return removed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m labkit.student", description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/[0-9]*.ipynb")
    parser.add_argument("--out", type=Path, default=Path("student"), help="output folder (default: student/)")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted(Path("notebooks").glob("[0-9]*.ipynb"))
    if not paths:
        parser.error("no notebooks given and none found in notebooks/")
    for path in paths:
        removed = make_student_notebook(path, args.out / path.name)
        print(f"{args.out / path.name}: {removed} solution(s) removed")


if __name__ == "__main__":
    main()
