"""Every chapter, driven in a real browser: JupyterLab in headless Chromium, Run All, then read the page.

For each chapter (found as notebooks/NN_*.ipynb, so a new chapter is covered without editing this file):
open it in a fresh workspace, run all cells, wait until the kernel is idle and every code cell has an
execution count, assert that no cell shows an error, that every widget cell (the cells marked
``# not compared: widget``) rendered its widget and answers one of its controls (moved three times) within
1.5 s, or, for a widget that trains, shows its progress within 1 s of its run button; save a screenshot to build/screenshots/ (``LABKIT_SCREENSHOTS``) and shut the kernel down.
A failure names the chapter, the cell, the error text and the screenshot.
"""
from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path

import pytest

from conftest import ROOT
from labkit.navigation import widget_cells
from labkit.student import chapter_paths

CHAPTERS = chapter_paths(ROOT / "notebooks")
RUN_TIMEOUT_S = 400     # one chapter from Run All to the last cell (the budget is 60 s on an idle machine)
WIDGET_TIMEOUT_S = 60   # a widget's first render, or its redraw after a control moved
WIDGET_LATENCY_S = 1.5  # the median of 3: from a control's change to the widget's updated output
PROGRESS_LATENCY_S = 1.0  # the median of 3 for a widget that trains: from its run button to a progress bar
POLL_S = 0.05
PROGRESS = re.compile(r"\b\d+/\d+\b")  # tqdm's "12/30"
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
SHOWN = "(node) => Array.from(node.querySelectorAll('.widget-output, .widget-html, .widget-htmlmath'))"
SHOWN_JS = SHOWN + ".map(e => e.innerHTML).join('\\n')"

SHOWN_TEXT_JS = SHOWN + ".map(e => e.innerText).join('\\n')"  # its text, where a progress bar shows
KERNEL_JS = """() => { const s = window.jupyterapp.shell.currentWidget.sessionContext.session;
  return s && s.kernel ? s.kernel.status : null; }"""

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
    """The widget controls of a cell, the likeliest to redraw first: sliders, toggles, menus, checkboxes, number boxes."""
    return [*cell.locator(".noUi-handle").all(), *cell.locator(".widget-toggle-button").all(),
            *cell.locator("select").all(), *cell.locator("input[type=checkbox]").all(),
            *cell.locator(".widget-text input[type=number]").all()]


def move(control) -> str:
    """Change ``control`` by one step; return a description of what was done."""
    kind = control.evaluate("e => e.classList.contains('noUi-handle') ? 'slider' : e.tagName.toLowerCase() === 'select' "
                            "? 'select' : e.type === 'checkbox' ? 'checkbox' : e.type === 'number' ? 'number' : 'button'")
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
    if kind == "number":  # a FloatText/IntText box: a new value, sent with Enter
        before = control.input_value()
        after = str(float(before) * 2 + 1) if "." in before or "e" in before.lower() else str(int(before) * 2 + 1)
        control.fill(after)
        control.press("Enter")
        return f"number {before} → {after}"
    control.click()
    return f"{kind} clicked"


def run_buttons(cell) -> list:
    """interact_manual's button (and any widget's "run" button): such a widget recomputes only when it is pressed."""
    return cell.locator("button.widget-button:not(.widget-toggle-button)").all()


def until_updated(page, chapter: Path, shot: Path, index: int, cell, before: str, started: float, action: str):
    """Poll what ``cell`` shows until it differs from ``before``, the kernel is idle and two reads agree.
    Returns (seconds from ``started`` to the first read of that final state, seconds to the first read that
    shows a progress bar or None), or (None, ...) if nothing changed within WIDGET_TIMEOUT_S."""
    deadline, previous, final_since, progress_at = started + WIDGET_TIMEOUT_S, None, None, None
    while time.monotonic() < deadline:
        if errors := page.evaluate(PAGE_ERRORS_JS):
            fail(page, chapter, shot, index, f"after {action}: " + "\n".join(errors))
        now = time.monotonic()
        after = cell.evaluate(SHOWN_JS)
        if progress_at is None and after != before and PROGRESS.search(cell.evaluate(SHOWN_TEXT_JS)):
            progress_at = now - started
        if after != previous:
            final_since = now
        elif after != before and page.evaluate(KERNEL_JS) == "idle":
            return final_since - started, progress_at
        previous = after
        time.sleep(POLL_S)
    return None, progress_at


def widget_latency(page, chapter: Path, shot: Path, index: int) -> str:
    """Move one control of the widget in cell ``index`` three times (the first control that changes what the
    widget shows); each time, measure how long the widget takes to show its updated output. A widget that
    trains (it has a run button) must show a progress bar within PROGRESS_LATENCY_S of the press; any other
    must be updated within WIDGET_LATENCY_S (the median of the three)."""
    cell = page.locator(f'[data-labkit-cell="{index}"]')
    tried = []
    for control in controls(cell)[:4]:
        updated, progress = [], []
        for _ in range(3):
            before = cell.evaluate(SHOWN_JS)
            started = time.monotonic()
            action = move(control)
            if buttons := run_buttons(cell):
                started = time.monotonic()  # a training widget is timed from its button
                for button in buttons:
                    button.click()
                action += f", then {buttons[0].inner_text()!r} pressed"
            seconds, progress_at = until_updated(page, chapter, shot, index, cell, before, started, action)
            if seconds is None:
                tried.append(action)
                break
            updated.append(seconds)
            progress.append(progress_at)
        else:
            shoot(page, shot, index)
            done = statistics.median(updated)
            if run_buttons(cell):
                shown = ", ".join("none" if p is None else f"{p:.2f} s" for p in progress)
                if None in progress or statistics.median(progress) > PROGRESS_LATENCY_S:
                    fail(page, chapter, shot, index, f"after {action}: a progress bar showed after {shown}; "
                         f"a widget that trains must show its progress within {PROGRESS_LATENCY_S} s (median of 3)")
                return f"cell {index + 1} ({action}): progress after {statistics.median(progress):.2f} s, done after {done:.1f} s"
            if done > WIDGET_LATENCY_S:
                fail(page, chapter, shot, index, f"after {action}: updated after "
                     f"{', '.join(f'{t:.2f} s' for t in updated)} (median {done:.2f} s); expected within {WIDGET_LATENCY_S} s")
            return f"cell {index + 1} ({action}): updated in {done:.2f} s (median of 3)"
    fail(page, chapter, shot, index, "no control changed what its widget shows; tried: " + "; ".join(tried))


def check_widgets(page, chapter: Path, shot: Path, cells: list[int]) -> str:
    """Every widget cell rendered a widget, and answers a control within its latency bound (widget_latency)."""
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
    if not cells:
        shoot(page, shot)
        return "no widgets"
    return "; ".join(widget_latency(page, chapter, shot, index) for index in cells)


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
