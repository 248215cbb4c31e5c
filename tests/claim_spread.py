"""How far do the chapters' asserted numbers move from machine to machine? (``make spread``)

Runs each notebook under several CPU code paths and thread counts, with ``LABKIT_CLAIMS_LOG``
set so every ``labkit.expect(...)`` records its value, and prints, per claim, the smallest and
largest value seen next to the range the chapter accepts. A tolerance should sit well outside
the measured spread; a claim whose spread comes close to its bounds is flagged.

    python tests/claim_spread.py notebooks/01_precision.ipynb [--variants native-1,default-2]
"""
from __future__ import annotations

import argparse
import json
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names from: " + ", ".join(VARIANTS))
    args = parser.parse_args()
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
