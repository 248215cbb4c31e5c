"""Fixtures of the real-browser test (``make test-browser``): one JupyterLab server and one headless
Chromium for the whole run, a fresh browser context per chapter.

The test drives Debian's ``chromium`` (``LABKIT_CHROMIUM``, default /usr/bin/chromium) through Playwright's
``executable_path``: Playwright's own browser download is never used. It only runs when asked for
(``LABKIT_BROWSER_TEST=1``, which ``make test-browser`` sets), so ``make test`` does not start a browser.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("LABKIT_CHROMIUM", "/usr/bin/chromium")
SCREENSHOTS = Path(os.environ.get("LABKIT_SCREENSHOTS", ROOT / "build" / "screenshots"))
# Chromium as the probe of these machines starts it: no sandbox (root in a container), no GPU, and none of
# the background connections a closed network refuses.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update", "--disable-dev-shm-usage"]


def pytest_ignore_collect(collection_path, config):
    if os.environ.get("LABKIT_BROWSER_TEST") != "1":
        return True  # only `make test-browser` (LABKIT_BROWSER_TEST=1) runs this folder
    return None


@pytest.fixture(scope="session")
def lab():
    from labkit.student import chapter_paths
    from lab_server import LabServer

    workdir = Path(tempfile.mkdtemp(prefix="labkit-browser-"))
    server = LabServer(chapter_paths(ROOT / "notebooks"), workdir,
                       env={"LABKIT_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"})
    try:
        yield server
    finally:
        survivors = server.stop()
        log = server.log_path.read_text(errors="replace")
        shutil.rmtree(workdir, ignore_errors=True)
        assert not survivors, f"processes outlived the JupyterLab server (killed now): {survivors}\n{log[-2000:]}"


@pytest.fixture(scope="session")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: install Debian's package (apt-get install -y chromium) "
                    "or point LABKIT_CHROMIUM at one")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="session")
def screenshots() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS


def pytest_terminal_summary(terminalreporter):
    # Each passed chapter recorded (chapter, seconds, control moved, screenshot); with pytest-xdist the
    # properties travel back with the reports, so this works for parallel runs too.
    runs = sorted(value for report in terminalreporter.stats.get("passed", [])
                  for name, value in report.user_properties if name == "browser_run")
    if runs:
        terminalreporter.section("chapters in the browser")
        for chapter, seconds, moved, shot in runs:
            terminalreporter.write_line(f"{chapter:32s} {seconds:6.1f} s  {moved}  ({shot})")
