"""Every chapter, driven in a real browser: JupyterLab in headless Chromium, Run All, then read the page.

For each chapter (found as notebooks/NN_*.ipynb, so a new chapter is covered without editing this file):
open it in a fresh workspace, run all cells, wait until the kernel is idle and every code cell has an
execution count, assert that no cell shows an error, that every widget cell (the cells marked
``# not compared: widget``) rendered its widget, move one control per chapter and assert that the widget's
output changed; save a screenshot to build/screenshots/ (``LABKIT_SCREENSHOTS``) and shut the kernel down.
A failure names the chapter, the cell, the error text and the screenshot.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from conftest import ROOT
from labkit.navigation import widget_cells
from labkit.student import chapter_paths

CHAPTERS = chapter_paths(ROOT / "notebooks")
RUN_TIMEOUT_S = 400     # one chapter from Run All to the last cell (the budget is 60 s on an idle machine)
WIDGET_TIMEOUT_S = 60   # a widget's first render, or its redraw after a control moved
ANSI = re.compile(r"\x1b\[[0-9;]*m")

# What the page knows about the open notebook: the kernel's status, and per code cell its execution
# count and any error output (read from the cell models, which hold every output of every cell).
STATE_JS = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const cells = [];
  panel.content.widgets.forEach((cell, index) => {
    const model = cell.model;
    if (model.type !== 'code') return;
    const errors = model.outputs.toJSON().filter(o => o.output_type === 'error');
    cells.push({index, count: model.executionCount, empty: model.sharedModel.getSource().trim() === '',
                source: model.sharedModel.getSource(),
                error: errors.length ? errors[0].ename + ': ' + errors[0].evalue + '\\n' +
                                       errors[0].traceback.slice(-3).join('\\n') : null});
  });
  const bar = document.querySelector('#jp-main-statusbar');
  return {kernel: kernel ? kernel.status : null, statusbar: bar ? bar.innerText : '', cells};
}"""

# Tag each cell's DOM node with its index, so that Playwright can address "cell 42" directly.
TAG_CELLS_JS = """() => window.jupyterapp.shell.currentWidget.content.widgets.forEach(
  (cell, index) => cell.node.setAttribute('data-labkit-cell', String(index)))"""

# What a widget shows (as opposed to its controls): Output widgets (interact's plots and prints) and HTML.
SHOWN_JS = """(node) => Array.from(node.querySelectorAll('.widget-output, .widget-html, .widget-htmlmath'))
  .map(e => e.innerHTML).join('\\n')"""

# Errors anywhere in the page, including those a widget callback printed into an Output widget.
PAGE_ERRORS_JS = """() => Array.from(document.querySelectorAll('[data-mime-type="application/vnd.jupyter.error"]'))
  .map(e => e.innerText.slice(0, 2000))"""


def page_state(page) -> dict:
    return page.evaluate(STATE_JS)


class ChapterFailure(AssertionError):
    pass


def shoot(page, path: Path, cell: int | None = None) -> Path:
    if cell is not None:
        page.evaluate("(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node.scrollIntoView()", cell)
        time.sleep(0.3)
    page.screenshot(path=str(path))
    return path


def fail(page, chapter: Path, shot: Path, cell: int | None, what: str, source: str = "") -> None:
    shoot(page, shot, cell)
    where = f"cell {cell + 1}" if cell is not None else "page"
    first_line = next((line for line in source.splitlines() if line.strip() and not line.startswith("#")), "")
    raise ChapterFailure(f"{chapter.name}, {where}{f' ({first_line.strip()[:80]})' if first_line else ''}: "
                         f"{ANSI.sub('', what)}\n  screenshot: {shot}")


def wait_for_run(page, chapter: Path, shot: Path) -> dict:
    """Poll until the kernel is idle and every code cell ran (or one failed, which stops Run All)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        state = page_state(page)
        code = [c for c in state["cells"] if not c["empty"]]
        failed = [c for c in code if c["error"]]
        idle = state["kernel"] == "idle" and "Idle" in state["statusbar"]
        if idle and (failed or all(c["count"] for c in code)):
            break
        if time.monotonic() > deadline:
            waiting = next((c for c in code if not c["count"]), None)
            fail(page, chapter, shot, waiting and waiting["index"],
                 f"still running after {RUN_TIMEOUT_S} s (kernel {state['kernel']})", waiting["source"] if waiting else "")
        time.sleep(0.5)
    for cell in failed:
        fail(page, chapter, shot, cell["index"], cell["error"], cell["source"])
    return state


def controls(cell) -> list:
    """The widget controls of a cell, the likeliest to redraw first: sliders, toggles, menus, checkboxes."""
    return [*cell.locator(".noUi-handle").all(), *cell.locator(".widget-toggle-button").all(),
            *cell.locator("select").all(), *cell.locator("input[type=checkbox]").all()]


def move(control) -> str:
    """Change ``control`` by one step; return a description of what was done."""
    kind = control.evaluate("e => e.classList.contains('noUi-handle') ? 'slider' : e.tagName.toLowerCase() === 'select' "
                            "? 'select' : e.type === 'checkbox' ? 'checkbox' : 'button'")
    if kind == "slider":
        before = control.get_attribute("aria-valuenow")
        control.focus()
        control.press("ArrowRight")
        if control.get_attribute("aria-valuenow") == before:  # already at its maximum
            control.press("ArrowLeft")
        return f"slider {before} → {control.get_attribute('aria-valuenow')}"
    if kind == "select":
        options = control.locator("option").all_inner_texts()
        current = control.evaluate("e => e.selectedIndex")
        choice = (current + 1) % len(options)
        control.select_option(index=choice)
        return f"menu {options[current]!r} → {options[choice]!r}"
    control.click()
    return f"{kind} clicked"


def check_widgets(page, chapter: Path, shot: Path, cells: list[int]) -> str:
    """Every widget cell rendered a widget; one control of one widget changes what that widget shows."""
    for index in cells:
        cell = page.locator(f'[data-labkit-cell="{index}"]')
        try:
            cell.locator(".jp-Cell-outputArea .jupyter-widgets").first.wait_for(timeout=WIDGET_TIMEOUT_S * 1000)
        except Exception:
            text = cell.locator(".jp-Cell-outputArea").inner_text()[:500]
            fail(page, chapter, shot, index, f"no rendered widget in the output (it shows: {text!r})")
        text = cell.locator(".jp-Cell-outputArea").inner_text()
        if "Error displaying widget" in text:
            fail(page, chapter, shot, index, f"widget failed to render: {text[:500]}")
    tried = []
    for index in cells:
        cell = page.locator(f'[data-labkit-cell="{index}"]')
        for control in controls(cell)[:4]:
            before = cell.evaluate(SHOWN_JS)
            action = move(control)
            # interact_manual (and any widget with a "run" button) recomputes only when the button is pressed.
            for button in cell.locator("button.widget-button:not(.widget-toggle-button)").all():
                button.click()
                action += f", then {button.inner_text()!r} pressed"
            deadline, previous = time.monotonic() + WIDGET_TIMEOUT_S, None
            while time.monotonic() < deadline:
                if page.evaluate(PAGE_ERRORS_JS):
                    fail(page, chapter, shot, index, f"after {action}: " + "\n".join(page.evaluate(PAGE_ERRORS_JS)))
                after = cell.evaluate(SHOWN_JS)
                # Changed, the kernel done with the callback, and the redraw settled (two equal reads).
                if after != before and after == previous and page_state(page)["kernel"] == "idle":
                    shoot(page, shot, index)
                    return f"cell {index + 1}: {action}"
                previous = after
                time.sleep(0.5)
            tried.append(f"cell {index + 1}: {action}")
    if cells:
        fail(page, chapter, shot, cells[0], "no control changed what its widget shows; tried: " + "; ".join(tried))
    shoot(page, shot)
    return "no widgets"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_runs_in_the_browser(chapter, lab, browser, screenshots, record_property):
    notebook = json.loads((lab.root / chapter.name).read_text(encoding="utf-8"))  # the copy being served
    shot = screenshots / f"{chapter.stem}.png"
    started = time.monotonic()
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    try:
        page.goto(lab.lab_url(f"browser-test-{chapter.stem}", chapter.name))
        page.wait_for_function("() => { const p = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
                               " return p && p.sessionContext && p.sessionContext.session &&"
                               " p.sessionContext.session.kernel && p.sessionContext.session.kernel.status === 'idle'"
                               " && p.content.widgets.length > 0; }", timeout=120_000)
        page.evaluate("() => { window.jupyterapp.commands.execute('application:toggle-left-area'); }")
        page.evaluate(TAG_CELLS_JS)
        # Not awaited: the command's promise settles only when the last cell has run.
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        wait_for_run(page, chapter, shot)
        if errors := page.evaluate(PAGE_ERRORS_JS):
            fail(page, chapter, shot, None, "\n".join(errors))
        moved = check_widgets(page, chapter, shot, widget_cells(notebook))
        record_property("browser_run", (chapter.stem, round(time.monotonic() - started, 1), moved, str(shot)))
    finally:
        context.close()
        lab.shutdown_kernels()
