"""How far do the chapters' asserted numbers move from machine to machine? (``make spread``)

Runs each notebook under several CPU code paths and thread counts, with ``LABKIT_CLAIMS_LOG``
set so every ``labkit.expect(...)`` records its value, and prints, per claim, the smallest and
largest value seen next to the range the chapter accepts. A tolerance should sit well outside
the measured spread; a claim whose spread comes close to its bounds is flagged.

    python tests/claim_spread.py notebooks/01_precision.ipynb [--variants native-1,default-2]

``--margins LOG`` instead reads a log that a test run wrote (``make test-portable`` and ``make
test-browser`` keep one in ``build/``) and prints the claims that came closest to their bounds on
this machine: on CI, the tail of the log then shows how much room each timing claim had.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

# Each variant changes the order of floating-point reductions: PyTorch's kernels for another
# instruction set (ATEN_CPU_CAPABILITY, with MKL told the same) or another number of threads.
VARIANTS = {
    "native-1": {"OMP_NUM_THREADS": "1"},
    "native-2": {"OMP_NUM_THREADS": "2"},
    "avx2-1": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "1"},
    "default-2": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "OMP_NUM_THREADS": "2"},
}


def run_notebook(notebook: Path, env_changes: dict, log: Path, out_dir: Path) -> float:
    env = {**os.environ, **env_changes, "LABKIT_DEVICE": "cpu", "LABKIT_CLAIMS_LOG": str(log)}
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "labkit.execute", "--timeout", "600", "--output-dir", str(out_dir), str(notebook)],
                   env=env, check=True, capture_output=True)
    return time.monotonic() - start


def headroom(value: float, low: float, high: float) -> float:
    """How far ``value`` sits inside [low, high]: 0 on a bound, negative outside. Bounds that a value
    sits on by construction are left out: one it equals exactly (an exact claim), a floor of 0 and a
    ceiling of 1 (errors, counts, ratios and fractions cannot cross them). Two bounds left: measured in
    half-widths (1 at the centre); one: as a fraction of the value or the bound; none: inf."""
    if not low <= value <= high:  # also NaN
        return -math.inf
    checked = [b for b in (low, high) if math.isfinite(b) and b != value and not (b == 0 and value >= 0)
               and not (b == 1 and value <= 1)]
    if len(checked) == 2:
        return min(value - low, high - value) / ((high - low) / 2)
    if checked:
        return abs(value - checked[0]) / max(abs(value), abs(checked[0]))
    return math.inf


def print_margins(log: Path, top: int) -> None:
    """The ``top`` claims of a claims log with the least headroom (each claim's worst record)."""
    worst = {}
    for line in log.read_text(encoding="utf-8").splitlines() if log.exists() else []:
        entry = json.loads(line)
        if entry["bounds"] is None:  # a True/False claim: only a False one is worth a line
            room = 1.0 if entry["value"] else -math.inf
        else:
            room = headroom(entry["value"], *entry["bounds"])
        if entry["claim"] not in worst or room < worst[entry["claim"]][0]:
            worst[entry["claim"]] = (room, entry)
    print(f"claims with the least headroom in {log} ({len(worst)} claims; 0 = on a bound):")
    for room, entry in sorted(worst.values(), key=lambda item: item[0])[:top]:
        low, high = entry["bounds"] or (None, None)
        seen = f"{entry['value']:.4g} in [{low:.4g}, {high:.4g}]" if entry["bounds"] else str(entry["value"])
        print(f"  {room:6.2f}  {seen:28s} {entry['claim'][:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names from: " + ", ".join(VARIANTS))
    parser.add_argument("--margins", type=Path, metavar="LOG", help="print the tightest claims of a claims log and exit")
    parser.add_argument("--top", type=int, default=12, help="with --margins: how many claims to print")
    args = parser.parse_args()
    if args.margins:
        print_margins(args.margins, args.top)
        return
    notebooks = args.notebooks or sorted(Path("notebooks").glob("[0-9]*.ipynb"))
    variants = {name: VARIANTS[name] for name in args.variants.split(",")}
    with tempfile.TemporaryDirectory(prefix="labkit-spread-") as tmp:
        for notebook in notebooks:
            values, bounds = defaultdict(dict), {}
            for name, env_changes in variants.items():
                log = Path(tmp) / f"{notebook.stem}-{name}.jsonl"
                seconds = run_notebook(notebook, env_changes, log, Path(tmp))
                print(f"{notebook.name} [{name}] ran in {seconds:.0f} s", file=sys.stderr)
                for line in log.read_text().splitlines() if log.exists() else []:
                    entry = json.loads(line)
                    values[entry["claim"]][name] = entry["value"]
                    bounds[entry["claim"]] = entry["bounds"]
            print(f"\n{notebook.name}")
            for claim, seen in values.items():
                if bounds[claim] is None:  # a True/False claim
                    print(f"  {'ok ' if all(seen.values()) else 'BAD'} {claim}: {seen}")
                    continue
                low, high = bounds[claim]
                lo, hi = min(seen.values()), max(seen.values())
                # flag a spread that uses more than half of the room between the bounds and the values
                room = min(lo - low, high - hi)
                tight = room < (hi - lo)
                status = "BAD" if lo < low or hi > high else ("tight" if tight else "ok ")
                print(f"  {status} {claim}: seen {lo:.6g} .. {hi:.6g}, accepted {low:.6g} .. {high:.6g}  {seen}")


if __name__ == "__main__":
    main()
