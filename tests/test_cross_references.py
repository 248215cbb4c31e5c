"""Every "chapter NN" a notebook's prose mentions names a chapter notebook that exists.

A reference like "LoRA (chapter 05)" sends a learner to notebooks/05_*.ipynb; when chapters are
renumbered or not written yet, the sentence points nowhere. Markdown cells only (code cells and
outputs are checked by running them); "chapters 03 and 05", "chapter-00" and "Chapter 3" count.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9]*.ipynb"))
REFERENCE = re.compile(r"\bchapters?[\s-]+(\d{1,2}(?:\s*(?:,|and|or|to|–|-)\s*\d{1,2})*)\b", re.IGNORECASE)


def chapter_numbers() -> set[int]:
    return {int(re.match(r"\d+", p.name).group()) for p in NOTEBOOKS}


def references(text: str) -> list[tuple[int, str]]:
    """``(chapter number, the words that name it)`` for each chapter reference in ``text``."""
    return [(int(n), m.group(0)) for m in REFERENCE.finditer(text) for n in re.findall(r"\d{1,2}", m.group(1))]


def test_references_are_found():
    assert references("LoRA (chapter 05) and chapters 03 and 4; the chapter-00 model; Chapter 7") == [
        (5, "chapter 05"), (3, "chapters 03 and 4"), (4, "chapters 03 and 4"), (0, "chapter-00"), (7, "Chapter 7")]
    assert references("chapterwise, 05 chapters") == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_chapter_references_name_existing_notebooks(path):
    existing = chapter_numbers()
    missing = []
    for index, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        for number, words in references("".join(cell["source"])):
            if number not in existing:
                missing.append(f"cell {index}: {words!r} -> no notebooks/{number:02d}_*.ipynb")
    assert not missing, f"{path.name} refers to chapters that do not exist:\n  " + "\n  ".join(missing)
