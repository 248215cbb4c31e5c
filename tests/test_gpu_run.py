"""tools/gpu_run.sh, the script a lent GPU runs, end to end in its dry run (no GPU needed): the steps, the skips
with their reasons, and the benchmark's JSON and Markdown, so that it works the day a GPU is lent."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_script_runs_end_to_end_in_its_dry_run(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "LABKIT_DEVICE": "cpu"}
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_run.sh"), str(tmp_path), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=300)
    summary = (tmp_path / "summary.txt").read_text()
    assert done.returncode == 0, summary + done.stderr + (tmp_path / "bench.log").read_text()
    assert "env: passed" in summary and "bench: passed" in summary
    assert "kernels: skipped: no CUDA device" in summary and "chapters: skipped: no CUDA device" in summary
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["environment"]["dry_run"] is True
    assert {row["suite"] for row in report["rows"]} == {"norms", "attention", "quant", "quantize", "moe"}
    assert all(row["ms"] > 0 and row["value"] > 0 for row in report["rows"])
    # every kernel was checked against its reference on the way (codes bit for bit where the format is exact)
    assert all(row["max_error"] is not None and row["max_error"] < 1e-3 for row in report["rows"] if row["impl"] in (
        "triton", "int4", "nf4", "int8", "triton grouped"))
    assert len(report["targets"]) == 11 and {t["status"] for t in report["targets"]} == {"dry run"}
    assert {s["what"] for s in report["skipped"]} >= {"fp8 matmul ceiling", "torch.compile baselines"}
    markdown = (tmp_path / "benchmarks.md").read_text()
    for heading in ("**Dry run**", "## Ceilings (measured)", "## Targets", "## Kernels", "## Skipped"):
        assert heading in markdown


def test_without_a_gpu_and_without_dry_run_the_script_says_so():
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_run.sh"), "/tmp/labkit-gpu-run-refused"],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA device here: run with --dry-run" in done.stderr
