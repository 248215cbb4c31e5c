"""Graders for chapter 08 (splitting the model).

* ``tp_collectives(layer, sequence_parallel) -> (forward, backward)``: which collective a column-
  or row-parallel layer runs at its boundary, as in :func:`labkit.parallel.tp_collectives`;
* ``bubble_fraction(num_stages, micro_batches)``: :func:`labkit.parallel.bubble_fraction`;
* ``tp_comm_bytes(batch, seq, d_model, tp, bytes_per_element)``: bytes one rank sends per step
  for one tensor-parallel layer, :func:`labkit.parallel.tp_comm_bytes`.

Each grader calls the learner's function twice on every case (a function that keeps state or
depends on randomness fails), checks the return types, tries random sizes and the edge cases, and
recognises the typical mistakes to give a hint that is true for them.
"""
from __future__ import annotations

import numbers
import random

from labkit import parallel as _P
from labkit.checks._core import call, fail, passed

__all__ = ["tp_collectives", "bubble_fraction", "tp_comm_bytes"]

_NAMES = {"all_reduce", "all_gather", "reduce_scatter", None}
_ALIASES = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter", "none": None, "identity": None}


def _twice(fn, tried: str, *args):
    first = call(fn, tried, *args)
    again = call(fn, tried + " (called a second time)", *args)
    if first != again:
        fail(tried + " (called twice)", f"{first!r}, then {again!r}", "the same answer for the same arguments",
             "does your function keep state between calls, or depend on randomness?")
    return first


def _tp_hint(layer: str, sp: bool, direction: str, got) -> str:
    if not sp and layer == "column" and direction == "forward" and got == "all_reduce":
        return ("a column-parallel layer's input is already the same on every rank and its output stays split by "
                "columns: nothing to sum in forward. The forward all-reduce belongs after the ROW-parallel layer (g)")
    if not sp and layer == "column" and direction == "backward" and got is None:
        return ("each rank's slice of W gives only part of the input gradient (x·Wᵀ summed over all output columns): "
                "the backward pass must all-reduce it (Megatron's f operator). Forgetting it leaves every rank a "
                "different, partial gradient")
    if not sp and layer == "row" and direction == "forward":
        return "each rank multiplies its slice of the features: the outputs are partial sums, all-reduced in forward (g)"
    if not sp and layer == "row" and direction == "backward":
        return ("the row-parallel layer's output gradient is the same on every rank, and its input is split like its "
                "weight: backward needs no communication")
    if sp and layer == "column":
        return ("with sequence parallelism the column layer's input arrives as sequence shards: all-gather them "
                "forward; backward, reduce-scatter the partial input gradients (sum, and keep your shard)")
    return ("with sequence parallelism the row layer's partial outputs are reduce-scattered (summed, each rank keeps "
            "its sequence shard for the norm that follows); backward all-gathers the gradient shards")


def tp_collectives(fn) -> None:
    """Grades ``fn(layer, sequence_parallel) -> (forward, backward)`` for ``layer`` in
    ``"column"``/``"row"``: each a ``torch.distributed`` collective name (``"all_reduce"``,
    ``"all_gather"``, ``"reduce_scatter"``; the ``*_tensor`` spellings count) or ``None``."""
    for sp in (False, True):
        for layer in ("column", "row"):
            tried = f"tp_collectives({layer!r}, sequence_parallel={sp})"
            got = _twice(fn, tried, layer, sp)
            if not isinstance(got, (tuple, list)) or len(got) != 2:
                fail(tried, repr(got), "a tuple (forward, backward)", "return two names, e.g. (None, 'all_reduce')")
            expected = _P.tp_collectives(layer, sp)
            for direction, value, want in zip(("forward", "backward"), got, expected):
                if value is not None and not isinstance(value, str):
                    fail(tried, f"{direction} = {value!r} (a {type(value).__name__})", "a collective's name or None",
                         "return torch.distributed function names as strings, e.g. 'all_reduce', or None for no communication")
                name = _ALIASES.get(value, value)
                if name not in _NAMES:
                    fail(tried, f"{direction} = {value!r}", f"one of {sorted(n for n in _NAMES if n)} or None",
                         "use torch.distributed's names: 'all_reduce', 'all_gather', 'reduce_scatter'")
                if name != want:
                    fail(tried, f"{direction} = {value!r}", f"{direction} = {want!r}", _tp_hint(layer, sp, direction, name))
    passed("tp_collectives", "column: f (all-reduce in backward), row: g (all-reduce in forward); with sequence parallelism "
                             "all-gather in and reduce-scatter out")


def _number(got, tried: str, what: str) -> float:
    if isinstance(got, bool) or not isinstance(got, numbers.Real):
        fail(tried, f"{got!r} (a {type(got).__name__})", what, "return a Python number (int or float)")
    return float(got)


def bubble_fraction(fn) -> None:
    """Grades ``fn(num_stages, micro_batches) -> idle fraction of a GPipe/1F1B pipeline``."""
    rng = random.Random(8)
    cases = [(1, 1), (1, 7), (2, 1), (4, 1), (2, 2), (4, 8), (8, 4), (16, 64)] + [(rng.randint(2, 32), rng.randint(1, 128)) for _ in range(8)]
    for p, m in cases:
        tried = f"bubble_fraction(num_stages={p}, micro_batches={m})"
        got = _number(_twice(fn, tried, p, m), tried, "a float in [0, 1)")
        expected = _P.bubble_fraction(p, m)
        if abs(got - expected) > 1e-9:
            if p != m and abs(got - (m - 1) / (m + p - 1)) < 1e-9:
                hint = ("that is (m-1)/(m+p-1): m and p swapped. The bubble grows with the stages p (p-1 slots to fill "
                        "and drain the pipe) and shrinks with the micro-batches m")
            elif abs(got - (p - 1) / m) < 1e-9:
                hint = ("(p-1)/m is the bubble's time relative to the ideal compute time; the fraction of the whole "
                        "schedule is (p-1)/(m+p-1)")
            elif abs(got - (p - 1) / (m + p)) < 1e-9 or abs(got - p / (m + p)) < 1e-9:
                hint = "count slots: a schedule of m micro-batches over p stages lasts m + p - 1 slots; each stage idles p - 1"
            else:
                hint = "each stage works m of the m + p - 1 slots of the schedule and idles in the rest"
            fail(tried, f"{got:.6g}", f"{expected:.6g}", hint)
    passed("bubble_fraction", "(p-1)/(m+p-1): 0 for one stage, (p-1)/p for one micro-batch, → 0 as m grows")


def tp_comm_bytes(fn) -> None:
    """Grades ``fn(batch, seq, d_model, tp, bytes_per_element) -> bytes one rank sends`` per
    training step (forward and backward) for one tensor-parallel layer (attention and MLP) with
    ring all-reduces."""
    rng = random.Random(80)
    cases = [(1, 1024, 4096, 8, 2), (2, 8, 32, 2, 4), (4, 2048, 8192, 4, 2), (1, 16, 64, 1, 4)]
    cases += [(rng.randint(1, 8), 8 * rng.randint(1, 256), 64 * rng.randint(1, 64), rng.choice([2, 4, 8]), rng.choice([1, 2, 4]))
              for _ in range(6)]
    for b, s, d, tp, p in cases:
        tried = f"tp_comm_bytes(batch={b}, seq={s}, d_model={d}, tp={tp}, bytes_per_element={p})"
        got = _number(_twice(fn, tried, b, s, d, tp, p), tried, "a number of bytes")
        expected = _P.tp_comm_bytes(b, s, d, tp, p)
        if abs(got - expected) > 1e-6 * max(expected, 1):
            activation = b * s * d * p
            ring = 2 * (tp - 1) / tp
            if tp > 1 and abs(got - expected / 2) < 1e-6 * expected:
                hint = ("half of it: either the forward pass alone (backward runs the f operators' all-reduces too: 4 "
                        "all-reduces per layer and step), or (tp-1)/tp per all-reduce, which is a reduce-scatter alone "
                        "(an all-reduce is a reduce-scatter plus an all-gather: 2(tp-1)/tp)")
            elif tp > 1 and abs(got - 4 * activation) < 1e-6 * expected:
                hint = ("4 x the activation is what goes INTO the all-reduces; a ring all-reduce makes each rank send "
                        "2(tp-1)/tp of its tensor")
            elif tp > 1 and abs(got - expected / 4) < 1e-6 * expected:
                hint = "one all-reduce: a layer has two sublayers (attention, MLP), each all-reducing in forward and backward"
            else:
                hint = (f"each all-reduce moves the batch·seq·d_model activation ({activation:,} bytes here), and each rank "
                        f"sends {ring:.3g} of it; count the all-reduces per layer, forward and backward")
            fail(tried, f"{got:,.6g}", f"{expected:,.6g}", hint)
    passed("tp_comm_bytes", "4 all-reduces per layer and step, each sending 2(tp-1)/tp · batch·seq·d_model·bytes")
