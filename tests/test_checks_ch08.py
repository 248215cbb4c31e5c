import json
from pathlib import Path

import pytest

import labkit  # noqa: F401
from labkit import parallel
from labkit.checks import ch08_parallel as checks  # the graders unwrapped: delegating to labkit is refused by the package-level ones (test_checks_refusal.py)
from labkit.checks import CheckFailed, DelegationRefused
from labkit.checks import column_parallel_linear as refusing_column_grader
from labkit.checks import import_file
from labkit.checks import one_f_one_b_schedule as refusing_schedule_grader
from labkit.student import exercise_text, skeleton, split_cell_magic

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "08_model_parallelism.ipynb"


def notebook_cell(cell_id: str) -> str:
    cells = json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]
    return "".join(next(c for c in cells if c.get("id") == cell_id)["source"])


# ----------------------------------------------------------------------------- exercise 1: f, g and the parallel layers
# The right answer is the notebook's own %%writefile cell; each mistake is a small edit of it, written to a file (the
# grader's ranks import it), as a learner's cell would be.
def learner_module(tmp_path, edits=(), student=False):
    source = notebook_cell("ex1-file")
    if student:
        source = skeleton(source, exercise_text([{"cell_type": "markdown", "source": "**Exercise 1.** Write it."}], 1))
    source = split_cell_magic(source)[1]
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new)
    path = tmp_path / f"my_tp_{abs(hash(tuple(edits))) % 10**8}.py"
    path.write_text(source)
    return import_file(path)


def test_the_notebooks_layers_pass(tmp_path, capsys):
    module = learner_module(tmp_path)
    checks.column_parallel_linear(module.ColumnParallelLinear)
    checks.row_parallel_linear(module.RowParallelLinear)
    out = capsys.readouterr().out
    assert "✓ column_parallel_linear" in out and "✓ row_parallel_linear" in out and "two 2-rank groups" in out


F_FORWARD = ("        ctx.group = group\n        return x\n",
             "        ctx.group = group\n        x = x.clone()\n        dist.all_reduce(x, group=group)\n        return x\n")
COLUMN_MISTAKES = {
    "f all-reduces in forward too": ([F_FORWARD], "f all-reduced the input in forward"),
    "f without its backward all-reduce": ([("        dist.all_reduce(grad, group=ctx.group)\n", "")], "must all-reduce it"),
    "f averages the gradient": ([("        dist.all_reduce(grad, group=ctx.group)\n        return grad, None",
                                  "        dist.all_reduce(grad, group=ctx.group)\n        return grad / dist.get_world_size(ctx.group), None")],
                                "no division"),
    "weight split along the input features": ([("self.weight = nn.Parameter(linear.weight.detach()[block].clone())",
                                                "self.weight = nn.Parameter(linear.weight.detach()[:, block].clone())")],
                                              "other dimension"),
    "group ignored": ([("        rank, world = dist.get_rank(group), dist.get_world_size(group)\n        block = slice(rank * linear.out_features",
                        "        rank, world = dist.get_rank(), dist.get_world_size()\n        block = slice(rank * linear.out_features")],
                      "not from the whole world"),
    "f as a gradient hook, not an autograd.Function": ([("        x = CopyToTensorParallel.apply(x, self.group)\n",
                                                         "        x = x.view_as(x)\n        x.register_hook(lambda g: _summed(g, self.group))\n"),
                                                        ("class ColumnParallelLinear", "def _summed(g, group):\n    g = g.clone()\n"
                                                         "    dist.all_reduce(g, group=group)\n    return g\n\n\nclass ColumnParallelLinear")],
                                                       "autograd.Function"),
    "whole weight kept": ([("self.weight = nn.Parameter(linear.weight.detach()[block].clone())",
                            "self.weight = nn.Parameter(linear.weight.detach().clone())")], "other dimension|this rank's block"),
}


@pytest.mark.parametrize("mistake", COLUMN_MISTAKES)
def test_column_parallel_linear_rejects_mistakes(tmp_path, mistake):
    edits, hint = COLUMN_MISTAKES[mistake]
    with pytest.raises(CheckFailed, match=hint):
        checks.column_parallel_linear(learner_module(tmp_path, edits).ColumnParallelLinear)


ROW_MISTAKES = {
    "g all-reduces in backward too": ([("    def backward(ctx, grad):\n        # BEGIN SOLUTION\n        return grad, None",
                                        "    def backward(ctx, grad):\n        # BEGIN SOLUTION\n        grad = grad.clone()\n"
                                        "        dist.all_reduce(grad)\n        return grad, None")],
                                      "g's backward all-reduced"),
    "bias added on every rank before the all-reduce": ([("        y = ReduceFromTensorParallel.apply(x @ self.weight.T, self.group)\n"
                                                         "        return y if self.bias is None else y + self.bias",
                                                         "        y = x @ self.weight.T\n        y = y if self.bias is None else y + self.bias\n"
                                                         "        return ReduceFromTensorParallel.apply(y, self.group)")],
                                                       "summed N times|once, after g"),
    "no all-reduce at all": ([("        dist.all_reduce(out, group=group)\n", "")], "partial output"),
    "weight split along the output features": ([("self.weight = nn.Parameter(linear.weight.detach()[:, block].clone())",
                                                 "self.weight = nn.Parameter(linear.weight.detach()[block].clone())")],
                                               "other dimension"),
}


@pytest.mark.parametrize("mistake", ROW_MISTAKES)
def test_row_parallel_linear_rejects_mistakes(tmp_path, mistake):
    edits, hint = ROW_MISTAKES[mistake]
    with pytest.raises(CheckFailed, match=hint):
        checks.row_parallel_linear(learner_module(tmp_path, edits).RowParallelLinear)


def test_an_unanswered_skeleton_says_so_from_the_ranks(tmp_path):
    with pytest.raises(CheckFailed, match="(?s)NotImplementedError: not answered yet.*write your answer in place"):
        checks.column_parallel_linear(learner_module(tmp_path, student=True).ColumnParallelLinear)


def test_labkits_layers_are_refused_on_the_ranks(tmp_path):
    module = learner_module(tmp_path, [("    def __init__(self, linear, group=None):\n        super().__init__()\n        self.group = group\n"
                                        "        # BEGIN SOLUTION\n        rank, world = dist.get_rank(group), dist.get_world_size(group)\n"
                                        "        block = slice(rank * linear.out_features",
                                        "    def __init__(self, linear, group=None):\n        super().__init__()\n        self.group = group\n"
                                        "        from labkit.parallel import ColumnParallelLinear as theirs\n"
                                        "        self.theirs = theirs(linear.in_features, linear.out_features, group)\n"
                                        "        # BEGIN SOLUTION\n        rank, world = dist.get_rank(group), dist.get_world_size(group)\n"
                                        "        block = slice(rank * linear.out_features")])
    with pytest.raises(DelegationRefused, match="labkit.parallel.ColumnParallelLinear"):
        refusing_column_grader(module.ColumnParallelLinear)


# ----------------------------------------------------------------------------- exercise 2: the 1F1B order
def test_labkits_schedule_passes(capsys):
    checks.one_f_one_b_schedule(parallel.one_f_one_b_schedule)
    assert "✓ one_f_one_b_schedule" in capsys.readouterr().out


def test_the_notebooks_schedule_passes(capsys):
    namespace = {}
    exec(notebook_cell("ex2-code").split("\n\nlabkit.checks")[0], namespace)  # noqa: S102  (the teacher's answer)
    checks.one_f_one_b_schedule(namespace["my_one_f_one_b_schedule"])
    assert "✓ one_f_one_b_schedule" in capsys.readouterr().out


def _warmed_up(warmup):
    def schedule(p, m, s):
        w = max(0, min(warmup(p, s), m))
        order = [("F", i) for i in range(w)]
        for i in range(w, m):
            order += [("F", i), ("B", i - w)]
        return order + [("B", i) for i in range(m - w, m)]
    return schedule


def _lifo(p, m, s):  # backwards of the newest micro-batch first, as a stack of saved activations suggests
    order, held = [], []
    for i in range(m):
        order.append(("F", i))
        held.append(i)
        if len(held) > p - s - 1:
            order.append(("B", held.pop()))
    return order + [("B", i) for i in reversed(held)]


SCHEDULE_MISTAKES = {
    "GPipe": (parallel.gpipe_schedule, "that is GPipe"),
    "one warm-up forward too many": (_warmed_up(lambda p, s: p - s), "one warm-up forward too many"),
    "one warm-up forward too few": (_warmed_up(lambda p, s: p - s - 2), "bubble"),
    "warm-up counted from the wrong end": (_warmed_up(lambda p, s: s), "deadlocks"),
    "no warm-up": (_warmed_up(lambda p, s: 0), "bubble"),
    "warm-up not capped at m": (lambda p, m, s: [("F", i) for i in range(p - s - 1)] + _warmed_up(lambda p, s: p - s - 1)(p, m, s)[p - s - 1:],
                                "exactly once"),
    "backward before its forward": (lambda p, m, s: [a for i in range(m) for a in (("B", i), ("F", i))], "B0 before F0"),
    "newest micro-batch backward first": (_lifo, "deadlocks|bubble"),
    "strings instead of pairs": (lambda p, m, s: [f"{k}{i}" for k, i in parallel.one_f_one_b_schedule(p, m, s)], "pairs"),
    "stateful": (lambda p, m, s, calls=[]: calls.append(1) or parallel.one_f_one_b_schedule(p, m, s)[: len(calls) % 2 + 2 * m - 1],
                 "exactly once|second time"),
}


@pytest.mark.parametrize("mistake", SCHEDULE_MISTAKES)
def test_one_f_one_b_schedule_rejects_mistakes(mistake):
    wrong, hint = SCHEDULE_MISTAKES[mistake]
    with pytest.raises(CheckFailed, match=hint):
        checks.one_f_one_b_schedule(wrong)


def test_labkits_schedule_is_refused():
    with pytest.raises(DelegationRefused, match="labkit.parallel.one_f_one_b_schedule"):
        refusing_schedule_grader(lambda p, m, s: parallel.SCHEDULES["1f1b"](p, m, s))
