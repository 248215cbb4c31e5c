"""Finding your way through the chapters: a "where you are" line at the top of each, a "next" link at the end.

``python -m labkit.navigation [NOTEBOOK ...]`` (default: every ``notebooks/NN_*.ipynb``) inserts or updates,
in each chapter, a one-line markdown cell at the top (previous and next chapter, prerequisites, estimated
time) and one at the end (the next chapter). Both cells are recognised by their cell id, so running the
script again rewrites them in place and leaves a notebook that is already up to date byte for byte as it
was. ``--check`` only reports which notebooks would change (exit status 1 if any); ``--table`` prints the
README's chapter table (estimated time, and whether a chapter has kernels, widgets and distributed parts).

What the line says is read off the notebooks themselves: the title is the first markdown heading, the
estimated time follows from the amount of prose, code, widgets and exercises (:func:`estimated_minutes`),
and a chapter's notebook metadata may override both the time and the prerequisites::

    "metadata": {"labkit": {"minutes": 90, "prerequisites": ["00", "02"]}}

Chapters are read in the order of their numbers, except where a chapter's metadata says to read it right
after another (``"after": "00"``: chapter 11, tokenization and data, comes straight after the foundations);
the previous/next links follow that reading order (:func:`reading_order`).
"""
from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from pathlib import Path

from labkit.execute import read_notebook
from labkit.student import BEGIN, cell_source, chapter_paths, grader_calls

TOP_ID, BOTTOM_ID = "labkit-where-you-are", "labkit-next-chapter"
WIDGET_CELL = re.compile(r"^\s*# not compared: widget\s*$", re.MULTILINE)
# A cell that runs Triton kernels (labkit.kernels) or distributed ranks (labkit.dist, torch.distributed).
USES_KERNELS = re.compile(r"\bkernels\.\w+\(|from labkit\.kernels|import labkit\.kernels")
USES_DISTRIBUTED = re.compile(r"\b(?:dist|dist_demos)\.\w+\(|torch\.distributed|from labkit\.dist")
TITLE_PREFIX = re.compile(r"^(?:chapter\s+)?\d+\s*[—·:.-]\s*", re.IGNORECASE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")

# The reading and working pace behind the estimate (a learner who reads the prose, runs and skims
# every code cell, plays with each widget and solves each exercise).
WORDS_PER_MINUTE = 150
MINUTES_PER_CODE_CELL = 0.5
MINUTES_PER_WIDGET = 3
MINUTES_PER_EXERCISE = 10


@dataclass(frozen=True)
class Chapter:
    """What the navigation line and the README table say about one chapter notebook."""

    path: Path
    number: str
    title: str
    minutes: int
    prerequisites: tuple[str, ...]
    widget_cells: tuple[int, ...]
    exercises: int
    kernels: bool
    distributed: bool
    after: str | None = None  # read right after this chapter (metadata "after"), not in number order

    @property
    def label(self) -> str:
        return f"{self.number} {self.title}"



def widget_cells(notebook: dict) -> list[int]:
    """Indices (into ``notebook["cells"]``) of the code cells that display a widget: the ones whose
    output nbval skips with ``# not compared: widget``."""
    return [i for i, cell in enumerate(notebook["cells"])
            if cell["cell_type"] == "code" and WIDGET_CELL.search(cell_source(cell))]


def estimated_minutes(notebook: dict) -> int:
    """Minutes to work through ``notebook``, rounded up to 5: prose at :data:`WORDS_PER_MINUTE`, plus
    fixed times per code cell, widget and exercise; the navigation cells themselves do not count."""
    cells = [c for c in notebook["cells"] if c.get("id") not in (TOP_ID, BOTTOM_ID)]
    words = sum(len(cell_source(c).split()) for c in cells if c["cell_type"] == "markdown")
    code = [cell_source(c) for c in cells if c["cell_type"] == "code"]
    minutes = (words / WORDS_PER_MINUTE + MINUTES_PER_CODE_CELL * len(code)
               + MINUTES_PER_WIDGET * len(widget_cells(notebook))
               + MINUTES_PER_EXERCISE * sum(source.count(BEGIN) for source in code))
    return max(5, 5 * math.ceil(minutes / 5))


def read_chapter(path: Path) -> Chapter:
    """The :class:`Chapter` for notebook ``path`` (named ``NN_topic.ipynb``)."""
    path = Path(path)
    number = path.name[:2]
    if not (number.isdigit() and path.name[2:3] == "_" and path.suffix == ".ipynb"):
        raise ValueError(f"path={str(path)!r}: expected a chapter notebook named NN_topic.ipynb")
    notebook = read_notebook(path)
    title = next((line.lstrip("#").strip() for c in notebook["cells"] if c["cell_type"] == "markdown"
                  and c.get("id") != TOP_ID for line in cell_source(c).splitlines() if line.startswith("# ")), "")
    title = TITLE_PREFIX.sub("", title) or path.stem[3:].replace("_", " ")
    meta = notebook.get("metadata", {}).get("labkit", {})
    previous = f"{int(number) - 1:02d}"
    prerequisites = tuple(meta.get("prerequisites", [] if number == "00" else [previous]))
    code = "\n".join(cell_source(c) for c in notebook["cells"] if c["cell_type"] == "code")
    graded = [name for c in notebook["cells"] if c["cell_type"] == "code" for name in grader_calls(cell_source(c))]
    return Chapter(path=path, number=number, title=title,
                   minutes=int(meta.get("minutes", estimated_minutes(notebook))),
                   prerequisites=prerequisites, widget_cells=tuple(widget_cells(notebook)),
                   exercises=len(graded), kernels=bool(USES_KERNELS.search(code)),
                   distributed=bool(USES_DISTRIBUTED.search(code)), after=meta.get("after"))


def reading_order(chapters: list[Chapter]) -> list[Chapter]:
    """``chapters`` in the order a learner reads them: by number, each chapter with an ``after`` moved to
    follow that chapter (several after the same one keep their number order)."""
    ordered = sorted((c for c in chapters if c.after is None), key=lambda c: c.number)
    numbers = {c.number for c in chapters}
    for chapter in sorted((c for c in chapters if c.after is not None), key=lambda c: c.number, reverse=True):
        if chapter.after not in numbers or chapter.after == chapter.number:
            raise ValueError(f"{chapter.path.name}: metadata labkit.after={chapter.after!r} names no other chapter")
        where = next(i for i, c in enumerate(ordered) if c.number == chapter.after)
        ordered.insert(where + 1, chapter)
    return ordered


def _link(chapter: Chapter) -> str:
    return f"[{chapter.label}]({chapter.path.name})"


def navigation_lines(chapters: list[Chapter], index: int) -> tuple[str, str]:
    """The "where you are" line and the closing "next chapter" line of ``chapters[index]``."""
    here = chapters[index]
    by_number = {c.number: c for c in chapters}
    previous = f"← {_link(chapters[index - 1])}" if index > 0 else "← [all chapters](../README.md#chapters)"
    following = f"{_link(chapters[index + 1])} →" if index + 1 < len(chapters) else "last chapter"
    prerequisites = ", ".join(_link(by_number[n]) if n in by_number else n for n in here.prerequisites) or "none"
    top = (f"**Chapter {here.number} of {len(chapters)}** · {previous} · {following} · "
           f"prerequisites: {prerequisites} · about {here.minutes} min")
    if index + 1 < len(chapters):
        bottom = f"**Next:** {_link(chapters[index + 1])} →"
    else:
        bottom = "**That was the last chapter.** Back to [all chapters](../README.md#chapters)."
    return top, bottom


def _markdown_cell(cell_id: str, text: str) -> dict:
    return {"cell_type": "markdown", "id": cell_id, "metadata": {}, "source": [text]}


def update_notebook(notebook: dict, top: str, bottom: str) -> dict:
    """``notebook`` with its navigation cells set to ``top`` (first cell) and ``bottom`` (last cell)."""
    cells = [c for c in notebook["cells"] if c.get("id") not in (TOP_ID, BOTTOM_ID)]
    return {**notebook, "cells": [_markdown_cell(TOP_ID, top), *cells, _markdown_cell(BOTTOM_ID, bottom)]}


def _dump(notebook: dict) -> str:
    # Jupyter's own layout (nbformat.write: one-space indent, sorted keys, sources as lists of lines), so a
    # save in JupyterLab and a run of this script give the same file.
    import nbformat

    return nbformat.writes(nbformat.from_dict(notebook)) + "\n"


def update_chapters(paths: list[Path], write: bool = True, only: list[Path] | None = None) -> list[Path]:
    """Insert or update the navigation cells of every chapter in ``paths`` (all chapters of a course, in
    order), or of those in ``only`` among them; return the notebooks whose file changed (or would change,
    with ``write=False``)."""
    if not paths:
        raise ValueError("paths: expected at least one chapter notebook")
    chapters = reading_order([read_chapter(p) for p in paths])
    if only is not None:
        unknown = {Path(p).resolve() for p in only} - {c.path.resolve() for c in chapters}
        if unknown:
            raise ValueError(f"only: {sorted(map(str, unknown))} are not chapters of the course in paths")
    wanted = None if only is None else {Path(p).resolve() for p in only}
    changed = []
    for index, chapter in enumerate(chapters):
        if wanted is not None and chapter.path.resolve() not in wanted:
            continue
        text = chapter.path.read_text(encoding="utf-8")
        notebook = read_notebook(text)
        if notebook.get("nbformat", 0) < 4 or (notebook["nbformat"] == 4 and notebook.get("nbformat_minor", 0) < 5):
            raise ValueError(f"{chapter.path}: expected nbformat >= 4.5 (cell ids), got "
                             f"{notebook.get('nbformat')}.{notebook.get('nbformat_minor')}")
        new = _dump(update_notebook(notebook, *navigation_lines(chapters, index)))
        if new != text:
            changed.append(chapter.path)
            if write:
                chapter.path.write_text(new, encoding="utf-8")
    return changed


def links(notebook: dict) -> list[str]:
    """The link targets of the navigation cells of ``notebook``."""
    return [target for c in notebook["cells"] if c.get("id") in (TOP_ID, BOTTOM_ID)
            for target in LINK.findall(cell_source(c))]


def heading_anchor(heading: str) -> str:
    """The anchor GitHub and JupyterLab give a markdown heading (``## Chapters`` → ``chapters``)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(path: Path) -> list[str]:
    """Every navigation link of notebook ``path`` whose file (or ``#anchor`` heading) does not exist."""
    path = Path(path)
    broken = []
    for target in links(read_notebook(path)):
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve()
        if not resolved.is_file():
            broken.append(f"{target}: no file {resolved}")
        elif anchor:
            text = resolved.read_text(encoding="utf-8")
            if resolved.suffix == ".ipynb":
                text = "\n".join(cell_source(c) for c in read_notebook(text)["cells"] if c["cell_type"] == "markdown")
            headings = {heading_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}
            if anchor not in headings:
                broken.append(f"{target}: no heading '#{anchor}' in {resolved.name}")
    return broken


def chapter_table(chapters: list[Chapter]) -> str:
    """The README's chapter table: estimated time, and which chapters have kernels, widgets, distributed parts."""
    rows = ["| # | chapter | time | kernels | widgets | distributed | exercises |", "|---|---|---|---|---|---|---|"]
    for c in chapters:
        rows.append(f"| {c.number} | [{c.title}](notebooks/{c.path.name}) | ~{c.minutes} min | "
                    f"{'yes' if c.kernels else '—'} | {len(c.widget_cells) or '—'} | "
                    f"{'yes' if c.distributed else '—'} | {c.exercises} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.navigation", description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="the chapters to update or check (default: notebooks/NN_*.ipynb); the course they belong to is "
                             "every NN_*.ipynb in their folders, so one chapter given alone keeps its place in it")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook is out of date")
    parser.add_argument("--table", action="store_true", help="print the README chapter table and change nothing")
    args = parser.parse_args(argv)
    folders = sorted({p.parent for p in args.notebooks}) or [Path("notebooks")]
    course = sorted({p.resolve() for folder in folders for p in chapter_paths(folder)} | {p.resolve() for p in args.notebooks})
    if not course:
        parser.error("no notebooks given and none found in notebooks/")
    if args.table:
        print(chapter_table(reading_order([read_chapter(p) for p in course])))
        return 0
    changed = update_chapters(course, write=not args.check, only=args.notebooks or None)
    for path in changed:
        print(f"{path}: {'out of date' if args.check else 'updated'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
