"""``python -m labkit.bench SUITE`` — run one benchmark suite (each lives in labkit/bench/SUITE.py)."""
from __future__ import annotations

import argparse
import importlib
import pkgutil

import labkit  # noqa: F401  (switches Triton to the interpreter on CPU before anything imports it)
import labkit.bench


def main() -> None:
    suites = sorted(m.name for m in pkgutil.iter_modules(labkit.bench.__path__) if not m.name.startswith("_"))
    parser = argparse.ArgumentParser(prog="python -m labkit.bench", description=__doc__)
    parser.add_argument("suite", choices=suites)
    args, _ = parser.parse_known_args()  # the rest is the suite's own options
    importlib.import_module(f"labkit.bench.{args.suite}").main()


if __name__ == "__main__":
    main()
