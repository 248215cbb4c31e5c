"""Answers shown before their exercise: a chapter must not print, above an exercise, the code its solution writes.

``python -m labkit.leaks [NOTEBOOK ...]`` lists, for every graded exercise of a chapter, the cells above it that
give its answer away:

- ``copy``: a cell above (its source, or what it printed, e.g. a ``show_source`` listing) holds a run of
  :data:`RUN` consecutive lines that match as many consecutive solution lines, compared by *token shape*: every
  variable name becomes ``ID``, every number ``NUM``, every string ``STR`` (attribute names, keywords and
  operators are kept), so renaming the variables of a printed answer does not hide it; two lines match when
  their shapes agree to :data:`SIMILAR` (an extra argument or a renamed attribute does not hide one either);
- ``most lines``: at least half of the solution's lines (and two or more) match lines of one cell above, in
  any order;
- ``show_source``: a cell above calls ``show_source`` on the function or class the exercise grades, or on a
  member of it (``show_source(L.LoRALinear.forward)`` before the ``LoRALinear`` exercise), or on labkit's
  implementation of it as the grader's refusal lists it (``labkit.checks._refusal.DELEGATES``).

It finds copies, not paraphrases: an earlier cell that computes the same thing in other code needs a reader.

A chapter may explain the concept and its formula first; labkit's code for it comes after the exercise.
tests/test_leaks.py runs this over every chapter.
"""
from __future__ import annotations

import argparse
import builtins
import difflib
import html
import io
import keyword
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

from labkit.student import BEGIN, END, cell_source

RUN = 3               # consecutive solution lines that make a copy
MOST = 0.5            # or this fraction of them (at least two), matched anywhere in one cell
SIMILAR = 0.8         # difflib's ratio of two lines' shapes from which they match
MIN_TOKENS = 6        # lines shorter than this ("return x", "else:", "pass") are too common to count
# Names a learner does not rename: modules and the built-ins (they stay themselves in a line's shape).
KEPT_NAMES = frozenset({"torch", "np", "math", "F", "nn", "tl", "triton", "labkit", *dir(builtins)})
GRADER_CALL = re.compile(r"\b\w*checks\.(\w+)\(")  # checks.NAME( or an alias: moe_checks.NAME(
SHOW_SOURCE = re.compile(r"show_source\(\s*([\w.]+)")
TAG = re.compile(r"<[^>]+>")


@dataclass(frozen=True)
class Leak:
    """Cell ``cell`` (above the exercise in cell ``exercise_cell``, graded by ``graders``) shows its answer."""
    exercise_cell: int
    graders: tuple[str, ...]
    cell: int
    kind: str              # "copy", "most lines" (in the cell's source or its output) or "show_source"
    where: str             # "source" or "output"
    lines: tuple[str, ...]  # the solution lines it shows (for show_source: the call)

    def __str__(self) -> str:
        shown = "\n      ".join(self.lines)
        return (f"exercise in cell {self.exercise_cell + 1} ({', '.join(self.graders)}): cell {self.cell + 1}'s "
                f"{self.where} shows its answer ({self.kind}):\n      {shown}")


def line_shape(line: str) -> tuple[str, ...]:
    """The tokens of one line of code with variable names, numbers and strings replaced by their kind."""
    shape: list[str] = []
    previous = ""
    try:
        for token in tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline):
            kind, text = token.type, token.string
            if kind == tokenize.NAME:
                kept = keyword.iskeyword(text) or previous == "." or text in KEPT_NAMES
                shape.append(text if kept else "ID")
            elif kind == tokenize.NUMBER:
                shape.append("NUM")
            elif kind == tokenize.STRING or kind in _FSTRING_TOKENS:
                if not shape or shape[-1] != "STR":
                    shape.append("STR")
            elif kind == tokenize.OP:
                shape.append(text)
            elif kind == tokenize.COMMENT:
                break
            previous = text
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # a line cut inside brackets or a string: the tokens up to there are its shape
    return tuple(shape)


_FSTRING_TOKENS = {getattr(tokenize, name) for name in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
                   if hasattr(tokenize, name)}


def _shapes(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """(line, shape) for every line of ``text`` long enough to count."""
    return [(line.strip(), shape) for line in text.splitlines() if len(shape := line_shape(line)) >= MIN_TOKENS]


def solution_lines(source: str) -> str:
    """The lines between each ``# BEGIN SOLUTION`` and its ``# END SOLUTION`` in a cell's source."""
    kept, inside = [], False
    for line in source.splitlines():
        if line.strip() == BEGIN:
            inside = True
        elif line.strip() == END:
            inside = False
        elif inside:
            kept.append(line)
    return "\n".join(kept)


def shown_output(cell: dict) -> str:
    """The text a learner sees in a code cell's stored outputs (streams, plain text, Markdown, HTML)."""
    parts = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            parts.append(_joined(output.get("text", "")))
        for mime, value in (output.get("data") or {}).items():
            if mime in ("text/plain", "text/markdown"):
                parts.append(_joined(value))
            elif mime == "text/html":
                parts.append(html.unescape(TAG.sub("", _joined(value))))
    return "\n".join(parts)


def _joined(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def _matches(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    return a == b or difflib.SequenceMatcher(a=a, b=b, autojunk=False).ratio() >= SIMILAR


def _shared_run(solution: list[tuple[str, tuple]], text: list[tuple[str, tuple]]) -> tuple[str, ...] | None:
    """The first :data:`RUN` consecutive solution lines that match as many consecutive lines of ``text``."""
    for i in range(len(solution) - RUN + 1):
        for j in range(len(text) - RUN + 1):
            if all(_matches(solution[i + d][1], text[j + d][1]) for d in range(RUN)):
                return tuple(line for line, _ in solution[i:i + RUN])
    return None


def _matched_lines(solution: list[tuple[str, tuple]], text: list[tuple[str, tuple]]) -> tuple[str, ...]:
    """The solution lines that match some line of ``text``."""
    return tuple(line for line, shape in solution if any(_matches(shape, other) for _, other in text))


def answer_leaks(notebook: dict) -> list[Leak]:
    """Every place above a graded exercise of ``notebook`` (nbformat 4, as a dict) that shows its answer."""
    cells = notebook["cells"]
    leaks = []
    # a delegate that is itself an exercise of the chapter is judged by its own exercise (shown after it is fine)
    graded = {name for cell in cells if cell["cell_type"] == "code" for name in GRADER_CALL.findall(cell_source(cell))}
    for index, cell in enumerate(cells):
        source = cell_source(cell)
        if cell["cell_type"] != "code" or BEGIN not in source:
            continue
        graders = tuple(dict.fromkeys(GRADER_CALL.findall(source) + _graders_after(cells, index)))
        solution = _shapes(solution_lines(source))
        for above in range(index):
            earlier = cells[above]
            texts = [("source", cell_source(earlier))]
            if earlier["cell_type"] == "code":
                texts.append(("output", shown_output(earlier)))
                for call in SHOW_SOURCE.findall(texts[0][1]):
                    if set(call.split(".")) & (set(graders) | (_delegate_names(graders) - graded)):
                        leaks.append(Leak(index, graders, above, "show_source", "source", (f"show_source({call})",)))
            for where, text in texts:
                shown = _shapes(text)
                if run := _shared_run(solution, shown):
                    leaks.append(Leak(index, graders, above, "copy", where, run))
                elif len(matched := _matched_lines(solution, shown)) >= max(2, MOST * len(solution)):
                    leaks.append(Leak(index, graders, above, "most lines", where, matched))
    return leaks


def _delegate_names(graders: tuple[str, ...]) -> set[str]:
    """The last names of labkit's implementations of these exercises (the graders' refused delegates): printing
    ``dist.ShardedOptimizer.step`` above the ZeRO-1 exercise shows its answer as surely as printing the grader's
    namesake would."""
    from labkit.checks._refusal import DELEGATES

    return {name.rsplit(".", 1)[-1] for grader in graders for name in DELEGATES.get(grader, ()) if name.startswith("labkit.")}


def _graders_after(cells: list[dict], index: int) -> list[str]:
    """The graders called in the code cells right after a solution cell (before the next prose)."""
    found = []
    for cell in cells[index + 1:]:
        if cell["cell_type"] != "code" or BEGIN in cell_source(cell):
            break
        found += GRADER_CALL.findall(cell_source(cell))
    return found


def main(argv: list[str] | None = None) -> int:
    import nbformat

    from labkit.student import chapter_paths

    parser = argparse.ArgumentParser(prog="python -m labkit.leaks", description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/NN_*.ipynb")
    args = parser.parse_args(argv)
    found = 0
    for path in args.notebooks or chapter_paths(Path("notebooks")):
        for leak in answer_leaks(nbformat.read(path, as_version=4)):
            print(f"{path.name}: {leak}")
            found += 1
    print(f"{found} answer(s) shown before their exercise")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
