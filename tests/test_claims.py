"""labkit.about and labkit.expect: approximate numbers and the claims checked on them."""
import json
import math
import re
from pathlib import Path

import pytest

import labkit
from labkit.claims import ClaimFailed, about, expect

SANITIZE = Path(__file__).with_name("nbval_sanitize.cfg")


def test_about_formats_like_a_float_with_a_marker():
    assert f"{about(0.98765):.1%}" == "≈98.8%"
    assert f"{about(1.5):6.2f}" == " ≈1.50"  # the width counts the marker: columns stay aligned
    assert f"{about(-2.25e-7):.2e}" == "≈-2.25e-07"
    assert f"{about(1234567):,.0f}" == "≈1,234,567"
    assert str(about(2 / 3)) == "≈0.6667"


def sanitize(text: str) -> str:
    pairs = re.findall("^regex: (.*)$\n^replace: (.*)$", SANITIZE.read_text(), flags=re.MULTILINE)
    for pattern, replacement in pairs:  # what nbval does to stored and new outputs alike
        text = re.sub(pattern, replacement, text)
    return text


@pytest.mark.parametrize("a, b", [(0.98812, 0.99031), (9.99, 10.0), (-0.5, 0.25), (1e-5, 3.2e-6), (12345.0, 987.0)])
def test_sanitizer_hides_only_the_approximate_digits(a, b):
    line = "loss {:8.3f} accuracy {:.1%} exact 42 tokens"
    first = line.format(about(a), about(a / 2))
    second = line.format(about(b), about(b / 2))
    assert sanitize(first) == sanitize(second)
    assert "exact 42 tokens" in sanitize(first)
    assert sanitize("exact 41") != sanitize("exact 42")


def test_expect_is_silent_when_the_claim_holds():
    # None: a cell ending with expect(...) prints nothing, under nbval too
    assert expect(1.43, "the loss ends near 1.43", between=(1.3, 1.5)) is None
    assert expect(0.99, "accuracy is about 99%", near=0.99, tol=0.01) is None
    assert expect(105.0, "within 10% of 100", near=100, rel=0.1) is None
    assert expect(True, "the resumed run repeats the losses") is None
    assert expect(3.0, "at least 2", between=(2, None)) is None


@pytest.mark.parametrize("call", [
    lambda: expect(1.6, "the loss ends below 1.5", between=(None, 1.5)),
    lambda: expect(0.9, "accuracy is about 99%", near=0.99, tol=0.01),
    lambda: expect(math.nan, "the loss is finite", between=(0, 10)),
    lambda: expect(False, "cached and uncached decoding agree"),
])
def test_expect_raises_a_teaching_assertion(call):
    with pytest.raises(ClaimFailed) as info:
        call()
    assert isinstance(info.value, AssertionError)
    message = str(info.value)
    assert message.startswith("Claim not met: ") and "settings" in message


def test_expect_rejects_malformed_claims():
    with pytest.raises(TypeError, match="claim"):
        expect(1.0, "", between=(0, 2))
    with pytest.raises(TypeError, match="either between"):
        expect(1.0, "x")
    with pytest.raises(TypeError, match="tol"):
        expect(1.0, "x", near=1.0)
    with pytest.raises(ValueError, match="low is above high"):
        expect(1.0, "x", between=(2, 1))
    with pytest.raises(TypeError, match="no range"):
        expect(True, "x", between=(0, 1))
    with pytest.raises(TypeError, match="value: expected a number"):
        expect("1.0", "x", between=(0, 2))


def test_expect_logs_values_for_measuring_the_spread(tmp_path, monkeypatch):
    log = tmp_path / "claims.jsonl"
    monkeypatch.setenv("LABKIT_CLAIMS_LOG", str(log))
    expect(1.25, "a loss", between=(1, 2))
    expect(True, "a flag")
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert entries == [{"claim": "a loss", "value": 1.25, "bounds": [1.0, 2.0]},
                       {"claim": "a flag", "value": True, "bounds": None}]


def test_a_measurement_run_may_keep_going_past_a_failed_claim(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_CLAIMS_KEEP_GOING", "1")
    with pytest.raises(ClaimFailed):  # without a log nothing records it: it still raises
        expect(3.0, "a loss", between=(1, 2))
    log = tmp_path / "claims.jsonl"
    monkeypatch.setenv("LABKIT_CLAIMS_LOG", str(log))
    expect(3.0, "a loss", between=(1, 2))
    expect(False, "a flag")
    assert [json.loads(line)["value"] for line in log.read_text().splitlines()] == [3.0, False]
    assert "Claim not met: a loss" in capsys.readouterr().out
    monkeypatch.setenv("LABKIT_CLAIMS_KEEP_GOING", "0")
    with pytest.raises(ClaimFailed):
        expect(3.0, "a loss", between=(1, 2))


def test_exported_from_the_package():
    assert labkit.about is about and labkit.expect is expect


def test_about_formats_arrays_row_by_row():
    import torch

    assert f"{about(torch.tensor([[0.5, -1.25], [3.0, 4.0]])):.2f}" == "[[ ≈0.50 ≈-1.25]\n [ ≈3.00  ≈4.00]]"
    assert f"{about(torch.tensor([0.5, -1.25])):.1f}" == "[≈0.5 ≈-1.2]"
    assert f"{about(torch.tensor(0.5)):.2f}" == "≈0.50"


def test_sanitizer_ignores_alignment_padding():
    assert sanitize("a    b") == sanitize("a b") == "a b"
    assert sanitize("[[ ≈0.50 ≈-1.25]\n [ ≈3.00  ≈4.00]]") == sanitize("[[≈0.49 ≈-1.26]\n [≈13.00 ≈4.10]]")
