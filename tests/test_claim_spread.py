"""The margin report that `make test-portable` and `make test-browser` print after their run."""
import importlib.util
import json
import math
from pathlib import Path

spec = importlib.util.spec_from_file_location("claim_spread", Path(__file__).with_name("claim_spread.py"))
claim_spread = importlib.util.module_from_spec(spec)
spec.loader.exec_module(claim_spread)
headroom = claim_spread.headroom


def test_headroom_of_two_sided_ranges_is_in_half_widths():
    assert headroom(1.0, 0.5, 1.5) == 1.0           # a near=1, rel=0.5 claim measured dead on
    assert math.isclose(headroom(1.4, 0.5, 1.5), 0.2)
    assert headroom(1.6, 0.5, 1.5) == -math.inf     # outside: failed
    assert headroom(math.nan, 0.5, 1.5) == -math.inf


def test_headroom_of_one_sided_bounds_is_a_fraction_of_the_value():
    assert math.isclose(headroom(4.0, 3.0, math.inf), 0.25)    # a "several times slower" ratio of 4 against 3
    assert math.isclose(headroom(1.0, -math.inf, 1.25), 0.2)


def test_bounds_a_value_sits_on_by_construction_are_not_counted():
    assert headroom(16, 16, 16) == math.inf          # an exact count
    assert headroom(0.0, 0.0, 1e-3) == 1.0           # no error at all against "at most 1e-3": all the room
    assert math.isclose(headroom(2e-4, 0.0, 1e-3), 0.8)  # an error's floor of 0 is not a bound it can cross
    assert math.isclose(headroom(0.9, 0.8, 1.0), 1 / 9)  # nor is a fraction's ceiling of 1


def test_the_report_lists_the_worst_record_of_each_claim_tightest_first(tmp_path, capsys):
    log = tmp_path / "claims.jsonl"
    records = [("ratio", 10.0, (3, math.inf)), ("ratio", 3.3, (3, math.inf)), ("close", 1.0, (0.5, 1.5)),
               ("flag", False, None), ("held", True, None)]
    log.write_text("".join(json.dumps({"claim": c, "value": v, "bounds": b}) + "\n" for c, v, b in records))
    claim_spread.print_margins(log, top=3)
    lines = capsys.readouterr().out.splitlines()
    assert "4 claims" in lines[0]
    assert [line.split()[-1] for line in lines[1:]] == ["flag", "ratio", "close"]
    assert "3.3 in [3, inf]" in lines[2]


def test_a_missing_log_reports_no_claims(tmp_path, capsys):
    claim_spread.print_margins(tmp_path / "absent.jsonl", top=5)
    assert "0 claims" in capsys.readouterr().out


def test_a_notebooks_report_gives_each_claims_worst_condition(capsys):
    fast = (3, math.inf)
    records = {"speed-up": {"native-1": (10.0, fast), "loaded": (3.3, fast), "seed-1": (8.0, fast)},
               "flag": {"native-1": (True, None), "seed-1": (True, None)}}
    worst = claim_spread.report("09_x.ipynb", records)
    assert [(variant, claim) for _, variant, claim, _, _ in worst] == [("loaded", "speed-up"), ("native-1", "flag")]
    assert math.isclose(worst[0][0], 0.3 / 3.3)
    out = capsys.readouterr().out
    assert "worst headroom 0.09 (loaded: 3.3 in [3, inf])" in out and "ok  flag" in out
    claim_spread.print_worst(worst, top=5)
    lines = capsys.readouterr().out.splitlines()
    assert "2 claims" in lines[1] and lines[2].split()[1] == "loaded" and "3.3 in [3, inf]" in lines[2]


def test_the_loaded_condition_runs_the_scalar_path_beside_two_busy_processes():
    assert claim_spread.BUSY == {"loaded": 2}
    assert claim_spread.VARIANTS["loaded"]["ATEN_CPU_CAPABILITY"] == "default"
    assert sorted(claim_spread.SEEDS) == [f"seed-{k}" for k in range(1, 8)]  # with the stored run's seed 0: eight
    assert all(env["LABKIT_SEED"] == name.split("-")[1] for name, env in claim_spread.SEEDS.items())


def test_a_claim_near_a_measured_number_is_judged_by_each_runs_own_bounds(capsys):
    # "the swapped adapter answers as the trained model did": each run has its own accuracy, its own bounds
    records = {"same accuracy": {"avx2-1": (0.9899, (0.9898, 0.9900)), "seed-4": (0.9717, (0.9716, 0.9718))}}
    worst = claim_spread.report("05_x.ipynb", records)
    assert worst[0][0] > 0.9  # both runs sit at the centre of their own bounds
    out = capsys.readouterr().out
    assert "ok  same accuracy" in out and "per run" in out
