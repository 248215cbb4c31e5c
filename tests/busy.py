"""Competing busy processes for ``make test-load``: run a command while N processes spin on the cores.

    python tests/busy.py --procs 2 --seconds 900 -- pytest ...   # the command's exit status is kept
    python tests/busy.py --spin 60                               # one spinner (what the others run)

Each spinner is a plain Python loop (what a second program on a learner's laptop does to a timing: it takes
a share of the cores). It ends by itself after ``--seconds``, and as soon as the process that started it is
gone (it checks its parent every 50 ms), so a killed ``make`` or a Ctrl-C leaves nothing spinning behind.
The wrapper also kills its spinners when the command ends, whatever way it ends.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def spin(seconds: float, parent: int) -> None:
    """Burn one core's worth of CPU for ``seconds``, or until ``parent`` is no longer our parent."""
    deadline = time.monotonic() + seconds
    check = time.monotonic()
    x = 0
    while True:
        for _ in range(20_000):  # about a millisecond of work between clock reads
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        now = time.monotonic()
        if now >= deadline:
            return
        if now - check >= 0.05:
            check = now
            if os.getppid() != parent:
                return


def start_spinners(procs: int, seconds: float) -> list[subprocess.Popen]:
    me = os.getpid()
    return [subprocess.Popen([sys.executable, __file__, "--spin", str(seconds), "--parent", str(me)],
                             stdin=subprocess.DEVNULL) for _ in range(procs)]


def stop(spinners: list[subprocess.Popen]) -> None:
    for p in spinners:
        if p.poll() is None:
            p.kill()
    for p in spinners:
        p.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, default=2, help="how many busy processes (default 2)")
    parser.add_argument("--seconds", type=float, default=900.0, help="each spinner stops after this long (default 900)")
    parser.add_argument("--spin", type=float, metavar="S", help="be one spinner for S seconds")
    parser.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run beside the spinners")
    args = parser.parse_args(argv)
    if args.spin is not None:
        spin(args.spin, args.parent if args.parent is not None else os.getppid())
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command to run beside the busy processes (after --)")
    spinners = start_spinners(args.procs, args.seconds)
    # SIGTERM (make's own, a CI timeout) ends the command and then the spinners, like Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    child = None
    try:
        print(f"busy.py: {args.procs} busy processes (at most {args.seconds:.0f} s) beside: {' '.join(command)}",
              file=sys.stderr, flush=True)
        child = subprocess.Popen(command)
        return child.wait()
    except KeyboardInterrupt:
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
        return 130
    finally:
        stop(spinners)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(f"busy.py: busy processes ended (load average {load:.1f})", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
