"""tests/busy.py, the competing busy processes of `make test-load` and `make spread`'s loaded condition."""
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

BUSY = Path(__file__).with_name("busy.py")
spec = importlib.util.spec_from_file_location("busy", BUSY)
busy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(busy)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_wrapper_keeps_the_commands_exit_status_and_ends_its_spinners():
    marker = "import os, sys; print(os.getloadavg() is not None); sys.exit(3)"
    run = subprocess.run([sys.executable, str(BUSY), "--procs", "2", "--seconds", "60", "--", sys.executable, "-c", marker],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 3
    assert "2 busy processes" in run.stderr and "busy processes ended" in run.stderr


def test_spinners_stop_after_their_time_and_when_their_parent_is_gone():
    start = time.monotonic()
    spinners = busy.start_spinners(1, 0.3)
    spinners[0].wait(timeout=20)
    assert time.monotonic() - start < 20
    # a spinner whose parent dies ends by itself: start one from a short-lived parent
    code = (f"import importlib.util, sys; spec = importlib.util.spec_from_file_location('busy', {str(BUSY)!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(m.start_spinners(1, 60)[0].pid, flush=True)")
    pid = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30).stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            os.waitpid(pid, os.WNOHANG)  # not our child: only reaps if it were
        except ChildProcessError:
            pass
    assert not _alive(pid)


def test_stop_kills_spinners_still_running():
    spinners = busy.start_spinners(2, 60)
    busy.stop(spinners)
    assert all(p.returncode is not None for p in spinners)
