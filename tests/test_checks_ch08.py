import itertools

import pytest

import labkit  # noqa: F401
from labkit.checks import ch08_parallel as checks  # the graders unwrapped: delegating to labkit is refused by the package-level ones (test_checks_refusal.py)
from labkit.checks import CheckFailed
from labkit.parallel import bubble_fraction, tp_collectives, tp_comm_bytes


def test_references_pass(capsys):
    checks.tp_collectives(tp_collectives)
    checks.bubble_fraction(bubble_fraction)
    checks.tp_comm_bytes(tp_comm_bytes)
    out = capsys.readouterr().out
    assert "✓ tp_collectives" in out and "✓ bubble_fraction" in out and "✓ tp_comm_bytes" in out


def _table(changes=None):
    table = {("column", False): (None, "all_reduce"), ("row", False): ("all_reduce", None),
             ("column", True): ("all_gather", "reduce_scatter"), ("row", True): ("reduce_scatter", "all_gather")}
    table.update(changes or {})
    return lambda layer, sp: table[(layer, sp)]


def test_tp_collectives_accepts_other_spellings():
    checks.tp_collectives(_table())
    spelled = {("column", False): ("none", "all_reduce"), ("row", False): ("all_reduce", "identity"),
               ("column", True): ("all_gather_into_tensor", "reduce_scatter_tensor"), ("row", True): ("reduce_scatter_tensor", "all_gather")}
    checks.tp_collectives(lambda layer, sp: spelled[(layer, sp)])


@pytest.mark.parametrize("wrong,hint", [
    (_table({("column", False): ("all_reduce", "all_reduce")}), "belongs after the ROW-parallel"),  # all-reduce after column
    (_table({("column", False): (None, None)}), "must all-reduce it"),  # forgot the backward all-reduce
    (_table({("row", False): (None, "all_reduce")}), "partial sums"),  # f and g swapped
    (_table({("column", True): ("all_reduce", "all_reduce")}), "all-gather"),  # sequence parallelism ignored
    (_table({("row", True): ("all_gather", "reduce_scatter")}), "reduce-scattered"),
    (lambda layer, sp: "all_reduce", "a tuple"),
    (lambda layer, sp: (dist_all_reduce, None), "as strings"),
    (lambda layer, sp: ("allreduce", None), "torch.distributed's names"),
    (lambda layer, sp: 1 / 0, "ZeroDivisionError"),
])
def test_tp_collectives_rejects_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.tp_collectives(wrong)


def dist_all_reduce():  # a function where a name is expected
    pass


def test_stateful_answers_fail():
    calls = itertools.count()
    with pytest.raises(CheckFailed, match="keep state"):
        checks.bubble_fraction(lambda p, m: (p - 1) / (m + p - 1) + next(calls) * 1e-3)


@pytest.mark.parametrize("wrong,hint", [
    (lambda p, m: (m - 1) / (m + p - 1), "m and p swapped"),
    (lambda p, m: (p - 1) / m, "relative to the ideal"),
    (lambda p, m: (p - 1) / (m + p), "count slots"),
    (lambda p, m: 1 - m / (m + p), "count slots"),
    (lambda p, m: p / m, "m of the m \\+ p - 1 slots"),
    (lambda p, m: str((p - 1) / (m + p - 1)), "Python number"),
    (lambda p, m: True, "Python number"),
    (lambda p, m: None, "Python number"),
])
def test_bubble_fraction_rejects_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.bubble_fraction(wrong)


def test_bubble_fraction_tries_more_than_square_cases():
    # (1, 1) and (2, 2) cannot tell a swap; the case after them must
    with pytest.raises(CheckFailed, match="num_stages=1, micro_batches=7"):
        checks.bubble_fraction(lambda p, m: (m - 1) / (m + p - 1))


@pytest.mark.parametrize("wrong,hint", [
    (lambda b, s, d, tp, p: 2 * 2 * (tp - 1) / tp * b * s * d * p, "forward pass alone"),  # forgot backward
    (lambda b, s, d, tp, p: 4 * (tp - 1) / tp * b * s * d * p, "reduce-scatter alone"),  # (tp-1)/tp per all-reduce
    (lambda b, s, d, tp, p: 4 * b * s * d * p, "INTO the all-reduces"),  # no ring factor
    (lambda b, s, d, tp, p: 2 * (tp - 1) / tp * b * s * d * p, "two sublayers"),
    (lambda b, s, d, tp, p: 4 * 2 * (tp - 1) / tp * b * s * 4 * d * p, "count the all-reduces"),  # d_ff instead of d_model
    (lambda b, s, d, tp, p: f"{tp_comm_bytes(b, s, d, tp, p)}", "Python number"),
])
def test_tp_comm_bytes_rejects_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.tp_comm_bytes(wrong)


def test_tp_comm_bytes_accepts_an_integer_answer():
    checks.tp_comm_bytes(lambda b, s, d, tp, p: 8 * (tp - 1) * b * s * d * p // tp)
