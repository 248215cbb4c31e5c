"""`make lab` opens the chapters without JupyterLab's "get notified about Jupyter news?" popup."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTIFICATION = "@jupyterlab/apputils-extension:notification"


def test_project_overrides_turn_news_off():
    overrides = json.loads((ROOT / "jupyter" / "lab-overrides.json").read_text())
    assert overrides[NOTIFICATION]["fetchNews"] == "false"  # the schema's "Never" (a string, not a bool)
    assert overrides[NOTIFICATION]["checkForUpdates"] is False


@pytest.mark.skipif(Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(), reason="runs in the project's own .venv (make test)")
def test_the_venvs_jupyterlab_reads_them():
    from jupyterlab.commands import get_app_dir
    from jupyterlab_server.settings_utils import _get_overrides

    overrides, error = _get_overrides(str(Path(get_app_dir()) / "settings"))
    assert not error
    assert overrides[NOTIFICATION]["fetchNews"] == "false"
