"""How far do the chapters' asserted numbers move from machine to machine? (``make spread``)

Runs each notebook under several conditions, with ``LABKIT_CLAIMS_LOG`` set so every ``labkit.expect(...)``
records its value (and ``LABKIT_CLAIMS_KEEP_GOING`` so that a claim that fails does not hide the ones after
it), and prints, per claim, the smallest and largest value seen next to the range the chapter accepts and its
worst headroom (0 = on a bound, see :func:`headroom`) with the condition it came from; at the end, the claims
with the least headroom over every notebook and condition. A tolerance should sit well outside the measured
spread; a claim whose spread comes close to its bounds is flagged.

The conditions: CPU code paths and thread counts (the order of float reductions), ``loaded`` (the scalar
code path and 2 threads beside two busy processes, as ``make test-load`` runs the timing claims), and for
the chapters whose claims come from training runs (:data:`SEEDED`), the seeds ``LABKIT_SEED=1..7`` next
to the stored run's 0.

    python tests/claim_spread.py notebooks/01_precision.ipynb [--variants native-1,default-2] [--no-seeds | --seeds 4] [--jobs 2]

``--jobs 2`` runs two notebooks at a time: each run then has another one beside it, a harder condition for the
timing claims than the one its name says (the report says so), in half the time.

``--margins LOG`` instead reads a log that a test run wrote (``make test-load``, ``test-student``,
``test-portable`` and ``test-browser`` keep one in ``build/``) and prints the claims that came closest to their bounds on
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import busy as busy_processes  # noqa: E402  (tests/busy.py: competing busy processes)

# Each variant changes the order of floating-point reductions: PyTorch's kernels for another
# instruction set (ATEN_CPU_CAPABILITY, with MKL told the same) or another number of threads; "loaded"
# also runs BUSY competing processes beside the notebook (the timing claims' hardest condition).
SCALAR = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
VARIANTS = {
    "native-1": {"OMP_NUM_THREADS": "1"},
    "native-2": {"OMP_NUM_THREADS": "2"},
    "avx2-1": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "1"},
    "default-2": {**SCALAR, "OMP_NUM_THREADS": "2"},
    "loaded": {**SCALAR, "OMP_NUM_THREADS": "2"},
}
BUSY = {"loaded": 2}  # variant -> competing busy processes (tests/busy.py)
# Chapters whose claims come from training runs: also run with LABKIT_SEED = 1..7 (0 is native-1's run): eight seeds.
SEEDED = ("00_foundations", "01_precision", "02_norms_activations", "03_attention_kv_cache", "04_mixture_of_experts",
          "05_lora_peft", "10_preference_learning")
SEEDS = {f"seed-{k}": {"OMP_NUM_THREADS": "1", "LABKIT_SEED": str(k)} for k in range(1, 8)}


def run_notebook(notebook: Path, env_changes: dict, log: Path, out_dir: Path, busy: int = 0) -> float:
    """Seconds to run ``notebook`` with ``env_changes``, beside ``busy`` competing busy processes."""
    env = {**os.environ, **env_changes, "LABKIT_DEVICE": "cpu", "LABKIT_CLAIMS_LOG": str(log), "LABKIT_CLAIMS_KEEP_GOING": "1"}
    start = time.monotonic()
    spinners = busy_processes.start_spinners(busy, 1800) if busy else []
    try:
        subprocess.run([sys.executable, "-m", "labkit.execute", "--timeout", "600", "--output-dir", str(out_dir), str(notebook)],
                       env=env, check=True, capture_output=True)
    finally:
        busy_processes.stop(spinners)
    return time.monotonic() - start


def room_of(value, bounds) -> float:
    """:func:`headroom` of one log entry (a True/False claim: 1 if it held, -inf if not)."""
    if bounds is None:
        return 1.0 if value else -math.inf
    return headroom(value, *bounds)


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
        room = room_of(entry["value"], entry["bounds"])  # a True/False claim: only a False one is worth a line
        if entry["claim"] not in worst or room < worst[entry["claim"]][0]:
            worst[entry["claim"]] = (room, entry)
    print(f"claims with the least headroom in {log} ({len(worst)} claims; 0 = on a bound):")
    for room, entry in sorted(worst.values(), key=lambda item: item[0])[:top]:
        low, high = entry["bounds"] or (None, None)
        seen = f"{entry['value']:.4g} in [{low:.4g}, {high:.4g}]" if entry["bounds"] else str(entry["value"])
        print(f"  {room:6.2f}  {seen:28s} {entry['claim'][:110]}")


def report(notebook: str, records: dict) -> list[tuple]:
    """Print one notebook's claims (``records[claim][variant] = (value, bounds)``); return ``(room, variant,
    claim, value, bounds)`` of each claim's worst record. Each variant keeps its own bounds: a claim ``near``
    another measured number (``near=accuracy, tol=...``) has bounds that move with the run."""
    print(f"\n{notebook}")
    worst = []
    for claim, seen in records.items():
        room, variant = min((room_of(value, bounds), name) for name, (value, bounds) in seen.items())
        value, bounds = seen[variant]
        worst.append((room, variant, claim, value, bounds))
        values = {name: v for name, (v, _) in seen.items()}
        if bounds is None:  # a True/False claim
            print(f"  {'ok ' if all(values.values()) else 'BAD'} {claim}: {values}")
            continue
        status = "BAD" if room < 0 else ("tight" if room < 0.25 else "ok ")
        lows, highs = [b[0] for _, b in seen.values()], [b[1] for _, b in seen.values()]
        accepted = (f"{lows[0]:.6g} .. {highs[0]:.6g}" if len(set(lows)) == len(set(highs)) == 1
                    else "per run (bounds move with the run)")
        print(f"  {status} {claim}: seen {min(values.values()):.6g} .. {max(values.values()):.6g}, accepted {accepted}, "
              f"worst headroom {room:.2f} ({variant}: {value:.6g} in [{bounds[0]:.6g}, {bounds[1]:.6g}])  {values}")
    return worst


def print_worst(worst: list[tuple], top: int) -> None:
    """The ``top`` claims with the least headroom over every notebook and condition."""
    print(f"\nleast headroom over all conditions ({len(worst)} claims; 0 = on a bound):")
    for room, variant, claim, value, bounds in sorted(worst, key=lambda item: item[0])[:top]:
        seen = f"{value:.4g} in [{bounds[0]:.4g}, {bounds[1]:.4g}]" if bounds else str(value)
        print(f"  {room:6.2f}  {variant:10s} {seen:28s} {claim[:100]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names from: " + ", ".join([*VARIANTS, *SEEDS]))
    parser.add_argument("--no-seeds", action="store_true", help=f"skip the seed variants of the training chapters ({', '.join(SEEDS)})")
    parser.add_argument("--margins", type=Path, metavar="LOG", help="print the tightest claims of a claims log and exit")
    parser.add_argument("--top", type=int, default=12, help="with --margins: how many claims to print (and in the final summary)")
    parser.add_argument("--jobs", type=int, default=1, help="notebook runs at a time (default 1: each run alone)")
    parser.add_argument("--seeds", type=int, default=len(SEEDS), help=f"seed variants of the training chapters: LABKIT_SEED=1..K (default {len(SEEDS)})")
    args = parser.parse_args()
    if args.margins:
        print_margins(args.margins, args.top)
        return
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: expected at least 1")
    if not 1 <= args.seeds <= len(SEEDS):
        parser.error(f"--seeds {args.seeds}: expected 1..{len(SEEDS)}")
    seeds = dict(list(SEEDS.items())[:args.seeds])
    notebooks = args.notebooks or sorted(Path("notebooks").glob("[0-9]*.ipynb"))
    known = {**VARIANTS, **SEEDS}
    variants = {name: known[name] for name in args.variants.split(",")}
    runs = [(notebook, name, env_changes) for notebook in notebooks
            for name, env_changes in {**variants, **(seeds if not args.no_seeds and notebook.stem in SEEDED else {})}.items()]
    if args.jobs > 1:
        print(f"{args.jobs} runs at a time: every condition below also had another notebook running beside it", file=sys.stderr)
    worst = []
    with tempfile.TemporaryDirectory(prefix="labkit-spread-") as tmp, ThreadPoolExecutor(max_workers=args.jobs) as pool:
        def one_run(notebook: Path, name: str, env_changes: dict) -> Path:
            log, out_dir = Path(tmp) / f"{notebook.stem}-{name}.jsonl", Path(tmp) / f"{notebook.stem}-{name}"
            out_dir.mkdir()  # runs of one notebook at the same time must not write the same file
            seconds = run_notebook(notebook, env_changes, log, out_dir, busy=BUSY.get(name, 0))
            print(f"{notebook.name} [{name}] ran in {seconds:.0f} s", file=sys.stderr, flush=True)
            return log

        logs = {(notebook, name): pool.submit(one_run, notebook, name, env) for notebook, name, env in runs}
        for notebook in notebooks:
            records = defaultdict(dict)
            for (run_notebook_path, name), job in logs.items():
                if run_notebook_path != notebook:
                    continue
                log = job.result()
                for line in log.read_text().splitlines() if log.exists() else []:
                    entry = json.loads(line)
                    # a claim checked several times in one run (a loop over cases) keeps its worst record
                    old = records[entry["claim"]].get(name)
                    if old is None or room_of(entry["value"], entry["bounds"]) < room_of(*old):
                        records[entry["claim"]][name] = (entry["value"], entry["bounds"])
            worst += report(notebook.name, records)
            sys.stdout.flush()
    print_worst(worst, args.top)


if __name__ == "__main__":
    main()
