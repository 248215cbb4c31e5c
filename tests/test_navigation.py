"""The chapters' "where you are" and "next chapter" lines, tried on copies of the chapters (never notebooks/)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest

from labkit import navigation
from labkit.navigation import BOTTOM_ID, TOP_ID, broken_links, read_chapter, update_chapters
from labkit.student import chapter_paths

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = chapter_paths(ROOT / "notebooks")


@pytest.fixture
def course(tmp_path) -> list[Path]:
    """A copy of the course, README.md and notebooks/NN_*.ipynb, with the navigation lines taken out (so the tests
    see them inserted, as on a chapter that never had them)."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    (tmp_path / "notebooks").mkdir()
    copies = []
    for path in CHAPTERS:
        notebook = json.loads(path.read_text())
        notebook["cells"] = [c for c in notebook["cells"] if c.get("id") not in (TOP_ID, BOTTOM_ID)]
        copy = tmp_path / "notebooks" / path.name
        copy.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
        copies.append(copy)
    return copies


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def test_every_chapter_gets_a_first_and_a_last_line_whose_links_resolve(course):
    before = {p: [c for c in cells(p) if c["cell_type"] == "code"] for p in course}
    assert sorted(update_chapters(course)) == course
    order = [c.path for c in navigation.reading_order([read_chapter(p) for p in course])]
    for index, path in enumerate(order):
        nb = cells(path)
        assert nb[0]["id"] == TOP_ID and nb[-1]["id"] == BOTTOM_ID
        top, bottom = "".join(nb[0]["source"]), "".join(nb[-1]["source"])
        assert "\n" not in top and f"Chapter {path.name[:2]} of {len(course)}" in top and " min" in top
        if index > 0:
            assert f"({order[index - 1].name})" in top
        if index + 1 < len(order):
            assert f"({order[index + 1].name}) →" in top and f"({order[index + 1].name})" in bottom
        else:
            assert "last chapter" in top and "README.md#chapters" in bottom
        assert navigation.links(json.loads(path.read_text()))
        assert broken_links(path) == [], path.name
        assert [c for c in nb if c["cell_type"] == "code"] == before[path]  # code and outputs untouched
        nbformat.validate(nbformat.read(path, as_version=4))


def test_running_it_again_changes_nothing(course):
    update_chapters(course)
    texts = {p: p.read_text() for p in course}
    assert update_chapters(course) == []
    assert {p: p.read_text() for p in course} == texts


def test_a_new_chapter_updates_its_neighbours_in_place(course, tmp_path):
    order = [c.path for c in navigation.reading_order([read_chapter(p) for p in course])]
    update_chapters([p for p in course if p != order[-1]])
    assert update_chapters(course, write=False)[-2:] == order[-2:]  # the old last one and the new one
    update_chapters(course)
    assert sum(c.get("id") == TOP_ID for c in cells(order[-2])) == 1
    assert f"({order[-1].name})" in "".join(cells(order[-2])[-1]["source"])


def test_a_broken_link_is_reported(course):
    update_chapters(course)
    following = navigation.reading_order([read_chapter(p) for p in course])[1].path  # the chapter 00 links to as next
    following.unlink()
    assert any(following.name in problem for problem in broken_links(course[0]))
    (course[0].parent.parent / "README.md").write_text("# no chapter table here\n")
    assert any("#chapters" in problem for problem in broken_links(course[0]))


def test_the_cli_checks_updates_and_prints_the_table(course, capsys):
    paths = [str(p) for p in course]
    assert navigation.main(["--check", *paths]) == 1
    assert navigation.main(paths) == 0
    assert navigation.main(["--check", *paths]) == 0
    capsys.readouterr()
    assert navigation.main(["--table", *paths]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 2 + len(course) and table[0].startswith("| # | chapter | time |")


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_each_chapter_has_a_title_and_a_plausible_time(path):
    chapter = read_chapter(path)
    assert chapter.title and not chapter.title[0].isdigit()
    assert 15 <= chapter.minutes <= 240 and chapter.exercises >= 2


def test_metadata_overrides_the_estimate_and_the_prerequisites(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 03 · Things")])
    nb.metadata["labkit"] = {"minutes": 42, "prerequisites": ["00", "01"]}
    path = tmp_path / "03_things.ipynb"
    nbformat.write(nb, path)
    chapter = read_chapter(path)
    assert (chapter.title, chapter.minutes, chapter.prerequisites) == ("Things", 42, ("00", "01"))


def test_a_file_that_is_not_a_chapter_is_refused(tmp_path):
    with pytest.raises(ValueError, match="NN_topic.ipynb"):
        read_chapter(tmp_path / "notes.ipynb")


def test_the_stored_chapters_carry_current_navigation_lines():
    assert update_chapters(CHAPTERS, write=False) == [], "run `python -m labkit.navigation` after adding or renaming a chapter"


def test_a_chapter_marked_after_another_is_read_right_after_it(course):
    # in number order first (chapter 11 is itself marked "after 00"), then the last chapter moved behind 00
    chapters = [navigation.Chapter(**{**read_chapter(p).__dict__, "after": None}) for p in course]
    last = chapters[-1]
    moved = navigation.reading_order([*chapters[:-1], navigation.Chapter(**{**last.__dict__, "after": "00"})])
    assert [c.number for c in moved[:2]] == ["00", last.number]
    assert [c.number for c in moved[2:]] == [c.number for c in chapters[1:-1]]
    with pytest.raises(ValueError, match="after"):
        navigation.reading_order([*chapters[:-1], navigation.Chapter(**{**last.__dict__, "after": "99"})])


def test_one_chapter_given_alone_keeps_its_place_in_the_course(course):
    """``python -m labkit.navigation notebooks/01_precision.ipynb`` updates that chapter as one of the whole course
    in its folder (not as "chapter 1 of 1"), and leaves the other chapters untouched."""
    assert navigation.main([str(p) for p in course]) == 0
    whole = {p: p.read_text() for p in course}
    target = course[2]
    notebook = json.loads(target.read_text())
    notebook["cells"] = [c for c in notebook["cells"] if c.get("id") not in (TOP_ID, BOTTOM_ID)]
    target.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
    others = {p: p.stat().st_mtime_ns for p in course if p != target}
    assert navigation.main([str(target)]) == 0
    assert target.read_text() == whole[target]
    assert {p: p.stat().st_mtime_ns for p in course if p != target} == others
    with pytest.raises(ValueError, match="only"):
        update_chapters(course[:3], only=[course[5]])
