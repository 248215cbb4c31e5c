"""Numbers whose last digits depend on the machine, and the claims a chapter makes about them.

A training loss, an accuracy after training or the error of a random matmul is computed with
floating-point sums, and the order of those sums changes with the CPU's instruction set
(AVX2, AVX-512, ARM), the number of threads and the torch release. Most of the time only the
last bits move, but training amplifies them: two correct machines can print 98.8% and 99.0%.

So a chapter prints such a number marked as approximate, ``f"{about(loss):.3f}"`` → ``≈1.432``
(the stored outputs mask the digits after ``≈``; everything else in the cell is compared), and
it checks the claim its prose makes with :func:`expect`, with a tolerance set from the spread
measured across machines. A learner who changes a knob and breaks a claim gets told which claim
and by how much, instead of a silent wrong sentence.

Set ``LABKIT_CLAIMS_LOG=path.jsonl`` to append every checked value to a file: that is how the
tolerances were measured (``make spread``). ``LABKIT_CLAIMS_KEEP_GOING=1`` (with a log) records a claim that
fails instead of raising, so that a measurement run sees every claim of a chapter, not just those before the
first miss (the log shows the value outside its bounds; the cell prints one line).
"""
from __future__ import annotations

import json
import math
import os

LOG_ENV = "LABKIT_CLAIMS_LOG"
KEEP_GOING_ENV = "LABKIT_CLAIMS_KEEP_GOING"
APPROX = "≈"


class ClaimFailed(AssertionError):
    """A number a chapter's text relies on came out outside the range the text claims."""


class about:
    """A number (or an array of them) shown as approximate: formats like a float, with ``≈`` in front.

    ``f"{about(0.98765):.1%}"`` → ``'≈98.8%'``; a width in the format spec counts the ``≈``,
    so columns stay aligned: ``f"{about(1.5):6.2f}"`` → ``' ≈1.50'``. A tensor or array prints
    as rows of such numbers: ``f"{about(torch.tensor([[0.5, -1.25]])):.2f}"`` → ``'[[≈0.50 ≈-1.25]]'``.
    """

    __slots__ = ("value",)

    def __init__(self, value):
        if hasattr(value, "tolist") and getattr(value, "ndim", 0) > 0:  # a tensor or an ndarray
            self.value = value.tolist()
        else:
            self.value = float(value)

    def __format__(self, spec: str) -> str:
        if isinstance(self.value, list):
            return _format_nested(self.value, spec or ".4g")
        text = format(self.value, spec)
        digits = text.lstrip(" ")
        return (APPROX + digits).rjust(len(text))

    def __str__(self) -> str:
        return format(self, ".4g")

    __repr__ = __str__


def _format_nested(values: list, spec: str) -> str:
    """Rows of ``≈`` numbers, right-aligned in columns, bracketed like numpy prints arrays."""
    if not values or not isinstance(values[0], list):
        return "[" + " ".join(format(about(v), spec) for v in values) + "]"
    cells = [[format(about(v), spec) for v in row] for row in values]
    width = max((len(c) for row in cells for c in row), default=0)
    rows = ["[" + " ".join(c.rjust(width) for c in row) + "]" for row in cells]
    return "[" + "\n ".join(rows) + "]"


def _as_number(value, name: str) -> float:
    if isinstance(value, (str, bytes)):  # float("1.0") would pass: a printed string is not a measurement
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}") from None


def expect(value, claim: str, *, between: tuple | None = None, near=None, tol=None, rel=None) -> None:
    """Check that ``value`` supports ``claim``.

    - ``expect(flag, claim)`` with a bool: the claim holds when ``flag`` is True;
    - ``expect(x, claim, between=(low, high))``: ``low <= x <= high`` (either end may be None);
    - ``expect(x, claim, near=ref, tol=0.01)`` or ``rel=0.05``: ``|x - ref| <= tol + rel * |ref|``.

    Raises :class:`ClaimFailed` (an ``AssertionError``) whose message names the claim, the
    measured value and the accepted range. Returns None, so that a cell may end with it without
    printing anything (a trailing ``;`` does not silence a value under nbval).
    """
    if not isinstance(claim, str) or not claim.strip():
        raise TypeError("claim: expected a sentence saying what the value shows")
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        if between is not None or near is not None:
            raise TypeError("expect(True/False, claim) takes no range: the claim holds when the flag is True")
        _log(claim, bool(value), None)
        if not value:
            _fail(f"Claim not met: {claim}.\n  The check behind it came out False.{_HINT}")
        return
    if (between is None) == (near is None):
        raise TypeError("expect: give either between=(low, high) or near=reference (with tol= and/or rel=)")
    x = _as_number(value, "value")
    if near is not None:
        ref = _as_number(near, "near")
        if tol is None and rel is None:
            raise TypeError("expect(..., near=...): give tol= (absolute) and/or rel= (relative)")
        slack = (tol or 0.0) + (rel or 0.0) * abs(ref)
        low, high = ref - slack, ref + slack
        wanted = f"within {slack:.3g} of {ref:.4g}"
    else:
        if not (isinstance(between, (tuple, list)) and len(between) == 2):
            raise TypeError(f"between: expected (low, high), got {between!r}")
        low = -math.inf if between[0] is None else _as_number(between[0], "between[0]")
        high = math.inf if between[1] is None else _as_number(between[1], "between[1]")
        if low > high:
            raise ValueError(f"between={between!r}: low is above high")
        wanted = f"between {low:.4g} and {high:.4g}"
    _log(claim, x, (low, high))
    if not low <= x <= high:  # also rejects NaN
        _fail(f"Claim not met: {claim}.\n  Measured {x:.4g}, expected {wanted}.{_HINT}")


_HINT = (
    "\n  The accepted range covers what was measured on different CPUs, instruction sets and thread counts."
    "\n  If you changed this cell's settings (sizes, steps, seeds), the claim may no longer apply to them;"
    " if you did not, this machine disagrees with the chapter's text: please report it."
)


def _fail(message: str) -> None:
    """Raise :class:`ClaimFailed`, unless a measurement run keeps going (a log and ``LABKIT_CLAIMS_KEEP_GOING=1``)."""
    if os.environ.get(LOG_ENV) and os.environ.get(KEEP_GOING_ENV, "") not in ("", "0"):
        print(f"[{KEEP_GOING_ENV}] {message.splitlines()[0]} {message.splitlines()[1].strip()}")
        return
    raise ClaimFailed(message)


def _log(claim: str, value, bounds) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as log:
        log.write(json.dumps({"claim": claim, "value": value, "bounds": bounds}) + "\n")
