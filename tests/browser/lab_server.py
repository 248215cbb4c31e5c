"""A throwaway JupyterLab server for the browser test.

It serves a copy of the chapters (the browser may save them; the committed notebooks stay untouched) from
127.0.0.1 on a free port with a random token, reads only test-only settings (windowing off, so every cell
is in the page; no news popup; no autosave) and leaves the user's own JupyterLab settings, workspaces and
runtime files alone. ``stop()`` shuts the server and its kernels down and reports any process that
outlived it.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

# Settings a user would set in Settings → Settings Editor, written as the files JupyterLab keeps them in.
TEST_SETTINGS = {
    # JupyterLab 4 renders only the cells in view by default; the test reads every cell's prompt and output.
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    # "Get notified about Jupyter news?" would cover the notebook; "false" is the schema's "never" (a string).
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    # A copy of the chapters is served, but a save racing the next chapter's reset only adds noise.
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LabServer:
    """JupyterLab serving ``notebooks`` (copied into ``workdir``) for one test session."""

    def __init__(self, notebooks: list[Path], workdir: Path, env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.root = workdir / "notebooks"
        self.root.mkdir(parents=True)
        for path in notebooks:
            shutil.copy2(path, self.root / path.name)
        settings = workdir / "user-settings"
        for name, values in TEST_SETTINGS.items():
            target = settings / f"{name}.jupyterlab-settings"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(values))
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "jupyterlab.log"
        environment = dict(os.environ, **(env or {}))
        environment.update(
            JUPYTER_CONFIG_DIR=str(workdir / "config"),       # no user jupyter_server_config.py
            JUPYTER_RUNTIME_DIR=str(workdir / "runtime"),     # connection files die with the test
            JUPYTERLAB_SETTINGS_DIR=str(settings),
            JUPYTERLAB_WORKSPACES_DIR=str(workdir / "workspaces"),
        )
        command = [
            sys.executable, "-m", "jupyterlab", "--no-browser",
            "--ip=127.0.0.1", f"--port={self.port}", "--port-retries=0",
            f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
            "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: run commands, read cell models
        ]
        if os.geteuid() == 0:
            command.append("--allow-root")
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, cwd=self.root, env=environment, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_until_up()

    def api(self, method: str, path: str, timeout: float = 10.0):
        """Call the server's REST API; the decoded JSON reply (None when empty)."""
        request = urllib.request.Request(f"{self.url}{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            body = reply.read()
        return json.loads(body) if body else None

    def _wait_until_up(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.process.returncode}; log: {self.log_path}\n"
                                   + self.log_path.read_text()[-3000:])
            try:
                self.api("GET", "/api/status", timeout=2)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"JupyterLab did not answer on {self.url} within {timeout:.0f} s; log: {self.log_path}")

    def lab_url(self, workspace: str, notebook: str) -> str:
        """A fresh workspace (``?reset``) that opens ``notebook`` and nothing else."""
        return f"{self.url}/lab/workspaces/{workspace}/tree/{notebook}?reset&token={self.token}"

    def shutdown_kernels(self) -> None:
        """Delete every session (which shuts its kernel down) and wait until no kernel is left."""
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}", timeout=30)
        deadline = time.monotonic() + 30
        while self.api("GET", "/api/kernels") and time.monotonic() < deadline:
            time.sleep(0.2)
        if left := self.api("GET", "/api/kernels"):
            raise RuntimeError(f"kernels still running after shutdown: {[k['id'] for k in left]}")

    def stop(self) -> list[str]:
        """Stop the server; return a description of every process of it that had to be killed."""
        if self.process.poll() is not None:
            return []
        try:
            family = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        try:
            self.api("POST", "/api/shutdown", timeout=10)
            self.process.wait(timeout=30)
        except (urllib.error.URLError, ConnectionError, TimeoutError, subprocess.TimeoutExpired):
            pass
        survivors: list[str] = []
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            survivors.append(f"jupyter lab (pid {self.process.pid})")
        for child in family:
            try:
                if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                    survivors.append(f"{' '.join(child.cmdline())[:120]} (pid {child.pid})")
                    child.kill()
            except psutil.NoSuchProcess:
                pass
        return survivors
