"""Graders for chapter 08 (splitting the model).

* ``column_parallel_linear(cls)`` and ``row_parallel_linear(cls)``: the learner's Megatron layers,
  ``cls(linear, group)`` built from a dense ``nn.Linear`` and run on 4 gloo ranks, as one 4-rank
  group and as two 2-rank groups, against the dense layer: the weight and bias shards, the forward
  output, every gradient (input, weight, bias), the collectives of each pass, and that ``f`` and
  ``g`` are ``torch.autograd.Function`` classes of the learner's file;
* ``one_f_one_b_schedule(fn)``: ``fn(num_stages, micro_batches, stage) -> [("F"|"B", i), ...]``,
  graded by simulating the whole pipeline (:func:`labkit.parallel.simulate_schedule`): every
  micro-batch once each way, no deadlock, at most ``p - s`` micro-batches in flight on stage ``s``,
  and 1F1B's bubble ``(p-1)/(m+p-1)``.

Like chapter 07's graders of code that runs on ranks, the layer graders launch ONE group of ranks
(a launch costs seconds) that measures every case; the verdict is given here, from those measurements.
"""
from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import torch

from labkit.checks._core import CheckFailed, DelegationRefused, call, fail, passed
from labkit.checks.ch07_memory import _exercise_file, _load_class, _ReportErrors

__all__ = ["column_parallel_linear", "row_parallel_linear", "one_f_one_b_schedule"]

_RANKS = 4  # one launch: the whole world as one tensor-parallel group, and two groups of 2


# ============================================================================ exercise 1: f, g and the parallel linear layers
def _learner_functions(output: torch.Tensor, module: str) -> list[str]:
    """The ``torch.autograd.Function`` classes of ``module`` that ``output``'s graph went through."""
    found, seen, stack = [], set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        cls = getattr(node, "_forward_cls", None)
        if cls is not None and cls.__module__ == module:
            found.append(cls.__qualname__)
        stack += [n for n, _ in node.next_functions]
    return sorted(set(found))


def _tp_rank(rank: int, world_size: int, path: str, name: str, kind: str, cases: list[dict], report: str,
             exercise: str) -> list[dict]:
    """One rank of the layer graders: every case, measured (and the dense layer's answers beside them)."""
    import copy

    import torch.distributed as dist

    from labkit.checks._refusal import refusing
    from labkit.dist import CommMeter

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in the same order
    out = []
    with _ReportErrors(report, rank) as errors, refusing(exercise):
        cls = _load_class(path, name)
        for case in cases:
            group = None if case["tp"] == world_size else pairs[rank // 2]
            tp_rank, tp = dist.get_rank(group), dist.get_world_size(group)
            dtype = getattr(torch, case["dtype"])
            torch.manual_seed(case["seed"])  # the same dense layer and data on every rank
            dense = torch.nn.Linear(case["d_in"], case["d_out"], bias=case["bias"], dtype=dtype)
            x = torch.randn(*case["shape"], case["d_in"], dtype=dtype)
            grad_out = torch.randn(*case["shape"], case["d_out"], dtype=dtype)
            reference, x_ref = copy.deepcopy(dense), x.clone().requires_grad_()
            y_ref = reference(x_ref)
            y_ref.backward(grad_out)
            cols = slice(tp_rank * case["d_out"] // tp, (tp_rank + 1) * case["d_out"] // tp)  # column: output block
            rows = slice(tp_rank * case["d_in"] // tp, (tp_rank + 1) * case["d_in"] // tp)  # row: input block
            w, b = dense.weight.detach(), dense.bias.detach() if case["bias"] else None
            if kind == "column":
                x_in, g = x, grad_out[..., cols]
                expected = {"out": y_ref.detach()[..., cols], "x_grad": x_ref.grad, "weight": w[cols],
                            "weight_grad": reference.weight.grad[cols], "bias": None if b is None else b[cols],
                            "bias_grad": None if b is None else reference.bias.grad[cols]}
                local = x @ w[cols].T
                wrong = {"out": {"f": tp * local + (0 if b is None else b[cols])},
                         "x_grad": {"partial": g @ w[cols], "mean": x_ref.grad / tp}}
            else:
                x_in, g = x[..., rows], grad_out
                expected = {"out": y_ref.detach(), "x_grad": x_ref.grad[..., rows], "weight": w[:, rows],
                            "weight_grad": reference.weight.grad[:, rows], "bias": b,
                            "bias_grad": None if b is None else reference.bias.grad}
                partial = x[..., rows] @ w[:, rows].T
                wrong = {"out": {"partial": partial + (0 if b is None else b),
                                 "bias_each_rank": None if b is None else y_ref.detach() + (tp - 1) * b},
                         "x_grad": {"g": tp * x_ref.grad[..., rows]}, "weight_grad": {"g": tp * reference.weight.grad[:, rows]}}
            errors.tried = f"{name}(linear, group) for {_describe_case(case, tp_rank, kind)}"
            layer = cls(copy.deepcopy(dense), group)
            params = dict(layer.named_parameters())
            weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
            result = {"tp": tp, "tp_rank": tp_rank, "params": sorted(params), "expected": expected, "wrong": wrong,
                      "weight": weight.detach().clone() if isinstance(weight, torch.Tensor) else None,
                      "weight_is_param": any(p is weight for p in params.values()),
                      "bias": bias.detach().clone() if isinstance(bias, torch.Tensor) else None,
                      "bias_is_param": any(p is bias for p in params.values()), "passes": []}
            if not _everywhere(isinstance(weight, torch.Tensor) and weight.shape == expected["weight"].shape):
                out.append(result)  # judged by its shards alone: running it could hang the ranks that did build it
                continue
            for attempt in range(2):  # twice: a layer that keeps state between calls shows it
                errors.tried = f"{name}.forward(x) for {_describe_case(case, tp_rank, kind)}" + (" (a second time)" if attempt else "")
                layer.zero_grad(set_to_none=True)
                x_mine = x_in.clone().requires_grad_()
                with CommMeter() as meter:
                    y = layer(x_mine)
                step = {"forward": dict(meter.calls), "x_changed": not torch.equal(x_mine.detach(), x_in)}
                if not _everywhere(isinstance(y, torch.Tensor)):
                    step["out_type"] = type(y).__name__
                    result["passes"].append(step)
                    break
                step.update(out=y.detach().clone(), requires_grad=bool(y.requires_grad),
                            functions=_learner_functions(y, Path(path).stem) if y.grad_fn is not None else [])
                if _everywhere(y.requires_grad and y.shape == g.shape):  # every rank takes the same branch
                    errors.tried = f"{name}: backward for {_describe_case(case, tp_rank, kind)}"
                    with CommMeter() as meter:
                        y.backward(g)
                    step.update(backward=dict(meter.calls), x_grad=x_mine.grad,
                                weight_grad=None if weight is None or weight.grad is None else weight.grad.clone(),
                                bias_grad=None if not isinstance(bias, torch.Tensor) or bias.grad is None else bias.grad.clone())
                result["passes"].append(step)
            out.append(result)
    return out


def _everywhere(condition: bool) -> bool:
    """Whether ``condition`` holds on every rank (a collective: every rank must ask)."""
    import torch.distributed as dist

    flag = torch.tensor([1.0 if condition else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _describe_case(case: dict, tp_rank: int, kind: str) -> str:
    shape = [*case["shape"], case["d_in"] if kind == "column" else case["d_in"] // case["tp"]]
    return (f"linear = nn.Linear({case['d_in']}, {case['d_out']}, bias={case['bias']}, dtype=torch.{case['dtype']}), "
            f"x of shape {shape}, on rank {tp_rank} of a {case['tp']}-rank group")


def _launch(rank_fn, cls, exercise: str, kind: str, cases: list[dict], timeout: float = 60) -> dict:
    """Run ``rank_fn`` for the learner's class on :data:`_RANKS` gloo ranks; a learner's exception (on
    whichever rank raised first) or a hang becomes a CheckFailed (the refusal stays a DelegationRefused)."""
    from labkit.checks._remote import Remote, apply
    from labkit.dist import RankFailedError, launch

    if isinstance(cls, Remote):  # labkit.grade: the ranks start from the learner's kernel, their measurements come back
        return apply(_launch, rank_fn, cls, exercise, kind, cases, timeout)
    path, name = _exercise_file(cls, exercise)
    with tempfile.TemporaryDirectory(prefix="labkit-grader-") as report:
        try:
            return launch(rank_fn, world_size=_RANKS, backend="gloo", timeout=timeout, quiet=True, path=path, name=name,
                          kind=kind, cases=cases, report=report, exercise=exercise)
        except RankFailedError as err:
            reports = [json.loads(f.read_text()) for f in Path(report).glob("error_*.json")]
            if not reports:
                hint = ("every rank of a group must call the same collectives in the same order, on the group it was given "
                        "(group=group): a rank waiting in an all-reduce the others never call hangs")
                fail(f"labkit.checks.{exercise}({name}) on {_RANKS} gloo ranks", "\n".join(str(err).splitlines())[-1500:],
                     "every rank to finish", hint)
            first = min(reports, key=lambda r: r["time"])
            if first["type"] == "DelegationRefused":
                raise DelegationRefused(first["message"]) from None
            if first["type"] == "NotImplementedError":
                hint = ("write your answer in place of the `raise NotImplementedError(...)` lines, run the %%writefile cell "
                        "and the import cell again, then this one")
            elif "shape" in first["message"] or "size" in first["message"]:
                hint = (f"nn.Linear's weight is [d_out, d_in]: the column-parallel layer keeps rows (output features) "
                        f"rank·d_out/N .. (rank+1)·d_out/N, the row-parallel one the same block of columns (input "
                        f"features); N and rank are those of `group` (dist.get_world_size(group), dist.get_rank(group))")
            else:
                hint = "run the failing call yourself: the lines above show where it raised"
            raise CheckFailed(f"\n  tried:    {first['tried']} (rank {first['rank']} of {_RANKS}, gloo)\n"
                              f"  raised:   {first['type']}: {first['message']}\n  where:    "
                              + first["where"].strip().replace("\n", "\n            ") + f"\n  hint:     {hint}") from None


def _tp_cases(seed: int) -> list[dict]:
    """Random sizes divisible by the group size, with and without bias, fp32 and fp64, 2-D and 3-D inputs."""
    rng = random.Random(seed)
    cases = []
    for tp, bias, dtype, dims in ((4, True, "float32", 1), (4, False, "float64", 2), (2, True, "float64", 2),
                                  (2, True, "float32", 1)):
        d_in, d_out = 4 * rng.randint(1, 4), 4 * rng.randint(1, 4)
        shape = [rng.randint(1, 4) for _ in range(dims)]
        cases.append({"tp": tp, "bias": bias, "dtype": dtype, "d_in": d_in, "d_out": d_out, "shape": shape,
                      "seed": rng.randint(0, 10_000)})
    return cases


def _close(got, want: torch.Tensor) -> bool:
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return False
    tol = 1e-10 if want.dtype == torch.float64 else 1e-5
    return bool(((got.double() - want.double()).abs().max() <= tol * (1 + want.double().abs().max())).item()) if want.numel() else True


def _mismatch(got, want: torch.Tensor) -> str:
    if not isinstance(got, torch.Tensor):
        return "None" if got is None else f"a {type(got).__name__}"
    if got.shape != want.shape:
        return f"shape {list(got.shape)}"
    diff = (got.double() - want.double()).abs()
    return f"values off by up to {diff.max().item():.3g} (dtype {got.dtype})"


_COLUMN_HINTS = {
    ("out", "f"): ("f all-reduced the input in forward: every rank holds the same x, so the sum is N·x. f is the identity "
                   "forward; its all-reduce belongs to backward"),
    ("x_grad", "partial"): ("that is this rank's partial input gradient (grad_out_r @ W_r): every rank's block of output "
                            "features contributes to x's gradient, so f's backward must all-reduce it (sum, not mean)"),
    ("x_grad", "mean"): "that is the mean over the ranks: f's backward sums the partial gradients (all-reduce with SUM, no division)",
}
_ROW_HINTS = {
    ("out", "partial"): ("that is this rank's partial output: X_r W_rᵀ is one of N terms of the sum. g must all-reduce it in "
                         "forward"),
    ("out", "bias_each_rank"): ("the bias was added on every rank before the all-reduce, so the sum holds it N times: add the "
                                "(whole, unsplit) bias once, after g"),
    ("x_grad", "g"): ("the input gradient is N times too large: g's backward all-reduced a gradient that is already the same on "
                      "every rank. g is the identity backward"),
    ("weight_grad", "g"): ("the weight gradient is N times too large: g's backward all-reduced a gradient that is already the "
                           "same on every rank. g is the identity backward"),
}


def _judge_layer(runs: dict, cases: list[dict], kind: str, name: str, exercise: str) -> None:
    hints = _COLUMN_HINTS if kind == "column" else _ROW_HINTS
    layer_name = "column-parallel" if kind == "column" else "row-parallel"
    block = ("rows rank·d_out/N .. (rank+1)·d_out/N of nn.Linear's [d_out, d_in] weight (its output features)" if kind == "column"
             else "columns rank·d_in/N .. (rank+1)·d_in/N of nn.Linear's [d_out, d_in] weight (its input features)")
    for index, case in enumerate(cases):
        for rank in sorted(runs):  # the shards of every rank first: a case whose shards are wrong somewhere did not run
            r = runs[rank][index]
            e = r["expected"]
            tried = f"{name}(linear, group) with {_describe_case(case, r['tp_rank'], kind)}"
            if r["weight"] is None or not r["weight_is_param"]:
                fail(tried, f"parameters {r['params']}", "a parameter `weight` (this rank's shard)",
                     "keep the shard as self.weight = nn.Parameter(...): the optimizer and the grader find it there")
            if not _close(r["weight"], e["weight"]):
                got = list(r["weight"].shape)
                if got == [case["d_out"], case["d_in"]]:
                    hint = f"keep only this rank's block: {block}"
                elif len(got) == 2 and (got[0] == case["d_out"] if kind == "column" else got[1] == case["d_in"]):
                    hint = f"split along the other dimension: the {layer_name} layer keeps {block}"
                else:
                    hint = (f"rank {r['tp_rank']} of a {r['tp']}-rank group keeps {block}: take N and the rank from the group "
                            "(dist.get_world_size(group), dist.get_rank(group)), not from the whole world")
                fail(tried, f"weight: {_mismatch(r['weight'], e['weight'])}",
                     f"weight of shape {list(e['weight'].shape)}, a copy of that block of linear.weight", hint)
            if e["bias"] is None:
                if r["bias"] is not None:
                    fail(tried, "a bias", "no bias (linear.bias is None)", "linear may come without a bias: keep self.bias = None then")
            else:
                if r["bias"] is None or not r["bias_is_param"]:
                    fail(tried, "no parameter `bias`", f"a parameter `bias` of shape {list(e['bias'].shape)}",
                         "keep the bias as self.bias = nn.Parameter(...)")
                if not _close(r["bias"], e["bias"]):
                    hint = ("the column-parallel layer adds its block of the bias to its block of outputs" if kind == "column" else
                            "the row-parallel layer's output is whole after g: it keeps the whole bias, on every rank")
                    fail(tried, f"bias: {_mismatch(r['bias'], e['bias'])}", f"bias of shape {list(e['bias'].shape)}", hint)
        for rank in sorted(runs):
            r = runs[rank][index]
            e = r["expected"]
            tried = f"{name}(linear, group) with {_describe_case(case, r['tp_rank'], kind)}"
            first = r["passes"][0]
            if "out_type" in first:
                fail(tried + ", forward", f"a {first['out_type']}", "a tensor", "forward returns the output tensor")
            if first["x_changed"]:
                fail(tried + ", forward", "x was changed in place", "x left as it was",
                     "all-reduce a copy (x.clone()), never the caller's tensor: the layer before still needs it")
            if not _close(first["out"], e["out"]):
                wrong = next((w for w, t in r["wrong"]["out"].items() if t is not None and _close(first["out"], t)), None)
                hint = hints.get(("out", wrong), f"compare with linear(x){'[..., block]' if kind == 'column' else ''} on one process")
                fail(tried + ", forward", f"output: {_mismatch(first['out'], e['out'])}",
                     f"output of shape {list(e['out'].shape)}: " + ("this rank's block of linear(x)" if kind == "column" else "linear(x), whole, on every rank"),
                     hint)
            if not first["requires_grad"]:
                fail(tried + ", forward", "an output without an autograd graph (requires_grad=False)", "a differentiable output",
                     "do not detach or compute under torch.no_grad(); return ctx-free tensors from your Function's forward as it "
                     "received them")
            for key, what in (("x_grad", "x.grad"), ("weight_grad", "weight.grad"), ("bias_grad", "bias.grad")):
                if e[key] is None:
                    continue
                got = first.get(key)
                if not _close(got, e[key]):
                    wrong = next((w for w, t in r["wrong"].get(key, {}).items() if _close(got, t)), None)
                    hint = hints.get((key, wrong), "check each rank's gradient against the matching block of the dense layer's")
                    fail(tried + ", backward", f"{what}: {_mismatch(got, e[key])}", f"{what} of shape {list(e[key].shape)}, "
                         "the matching block of the dense layer's", hint)
            want_f, want_b = ({}, {"all_reduce": 1}) if kind == "column" else ({"all_reduce": 1}, {})
            for direction, want in (("forward", want_f), ("backward", want_b)):
                got = {k: v for k, v in first[direction].items() if v}
                if got != want:
                    fail(tried + f", {direction}", f"collectives {got or 'none'}", f"{want or 'none'}",
                         ("f (before the column-parallel matmul) is the identity forward and one all-reduce of the input "
                          "gradient backward" if kind == "column" else
                          "g (after the row-parallel matmul) is one all-reduce forward and the identity backward")
                         + " (the grader counts calls through torch.distributed: dist.all_reduce(t, group=group))")
            if not first["functions"]:
                operator = "f" if kind == "column" else "g"
                fail(tried, "no torch.autograd.Function of your file in the output's graph",
                     f"{operator} as a torch.autograd.Function", f"write {operator} as class ...(torch.autograd.Function) with "
                     "@staticmethod forward(ctx, x, group) and backward(ctx, grad), and call it as ....apply(x, group)")
            second = r["passes"][1] if len(r["passes"]) > 1 else None
            if second is None or not all(_close(second.get(k), first.get(k)) for k in ("out", "x_grad", "weight_grad")
                                         if isinstance(first.get(k), torch.Tensor)):
                fail(tried + " (forward and backward a second time)", "a different result", "the same result for the same input",
                     "does your layer keep state between calls?")
    passed(exercise, f"{'f: identity forward, one all-reduce of the input gradient backward' if kind == 'column' else 'g: one all-reduce forward, identity backward'};"
                     f" output, input, weight and bias gradients equal the dense layer's on a 4-rank group and on two 2-rank groups")


def column_parallel_linear(cls) -> None:
    """Grades ``cls(linear, group)``: the column-parallel layer holding this rank's block of
    ``linear``'s output features (``weight`` ``[d_out/N, d_in]``, ``bias`` ``[d_out/N]`` or None);
    ``forward(x)`` (``x`` ``[..., d_in]``, the same on every rank) returns ``linear(x)[..., block]``,
    with ``f`` (a ``torch.autograd.Function`` of the learner's file) in front."""
    cases = _tp_cases(81)
    runs = _launch(_tp_rank, cls, "column_parallel_linear", "column", cases)
    _judge_layer(runs, cases, "column", getattr(cls, "__name__", repr(cls)), "column_parallel_linear")


def row_parallel_linear(cls) -> None:
    """Grades ``cls(linear, group)``: the row-parallel layer holding this rank's block of ``linear``'s
    input features (``weight`` ``[d_out, d_in/N]``, the whole ``bias`` or None); ``forward(x_r)``
    (``x_r`` ``[..., d_in/N]``, this rank's block of features) returns ``linear(x)``, whole on every
    rank, with ``g`` (a ``torch.autograd.Function`` of the learner's file) summing the partial outputs."""
    cases = _tp_cases(82)
    runs = _launch(_tp_rank, cls, "row_parallel_linear", "row", cases)
    _judge_layer(runs, cases, "row", getattr(cls, "__name__", repr(cls)), "row_parallel_linear")


# ============================================================================ exercise 2: the 1F1B order
def _orders(fn, p: int, m: int) -> dict[int, list[tuple[str, int]]]:
    """The learner's order for every stage, called twice and checked for its form."""
    orders = {}
    for s in range(p):
        tried = f"one_f_one_b_schedule(num_stages={p}, micro_batches={m}, stage={s})"
        got = call(fn, tried, p, m, s)
        again = call(fn, tried + " (called a second time)", p, m, s)
        if not isinstance(got, (list, tuple)):
            fail(tried, f"a {type(got).__name__}", "a list of (kind, micro_batch) pairs", "return e.g. [('F', 0), ('B', 0)]")
        actions = []
        for item in got:
            if (not isinstance(item, (tuple, list)) or len(item) != 2 or item[0] not in ("F", "B")
                    or isinstance(item[1], bool) or not isinstance(item[1], int)):
                fail(tried, f"an entry {item!r}", "pairs ('F', i) or ('B', i) with an int i",
                     "each entry is a pair: the kind ('F' forward, 'B' backward) and the micro-batch index")
            actions.append((item[0], item[1]))
        if not isinstance(again, (list, tuple)) or [tuple(a) if isinstance(a, (list, tuple)) else a for a in again] != actions:
            fail(tried + " (called twice)", "a different order the second time", "the same order for the same arguments",
                 "does your function keep state between calls, or depend on randomness?")
        everything = sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        if sorted(actions) != everything:
            extra = sorted(set(actions) - set(everything))
            missing = sorted(set(everything) - set(actions))
            twice = sorted({a for a in actions if actions.count(a) > 1})
            hint = ("with fewer micro-batches than stages there are only m forwards to warm up with: min(p - s - 1, m)"
                    if m < p and any(i >= m for _, i in extra) else
                    "every micro-batch 0..m-1 goes forward once and backward once on every stage")
            fail(tried, f"{actions}" if len(actions) <= 24 else f"{len(actions)} entries",
                 f"each of F0..F{m - 1} and B0..B{m - 1} exactly once",
                 f"{'missing ' + str(missing) + '; ' if missing else ''}{'out of range ' + str(extra) + '; ' if extra else ''}"
                 f"{'twice ' + str(twice) + '; ' if twice else ''}{hint}")
        for i in range(m):
            if actions.index(("B", i)) < actions.index(("F", i)):
                fail(tried, f"B{i} before F{i}", f"F{i} first",
                     "a backward needs the activations its forward saved: on each stage, B i comes after F i")
        orders[s] = actions
    return orders


def _in_flight(actions: list[tuple[str, int]]) -> int:
    held = most = 0
    for kind, _ in actions:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


def one_f_one_b_schedule(fn) -> None:
    """Grades ``fn(num_stages, micro_batches, stage) -> [("F"|"B", i), ...]``: the order in which
    stage ``stage`` of a 1F1B pipeline runs the forwards and backwards of its micro-batches."""
    from labkit.parallel import ScheduleDeadlock, measured_bubble, simulate_schedule

    rng = random.Random(8)
    cases = [(1, 1), (1, 3), (2, 1), (2, 4), (4, 4), (4, 8), (3, 2), (5, 3), (8, 16)]
    cases += [(rng.randint(2, 8), rng.randint(1, 12)) for _ in range(4)]
    for p, m in cases:
        orders = _orders(fn, p, m)
        tried = f"simulating a pipeline of {p} stages and {m} micro-batches with your orders"
        try:
            events = simulate_schedule(orders, p, m)
        except ScheduleDeadlock as stuck:
            fail(tried, str(stuck), "every stage reaches its last action",
                 "a backward waits for the next stage's backward of the same micro-batch, and that stage first needs this "
                 "one's forwards: a stage must run enough forwards before its first backward that the stages after it can "
                 "reach theirs (stage s warms up with p - s - 1, the last stage with none)")
        for s, actions in orders.items():
            limit = min(p - s, m)
            if (held := _in_flight(actions)) > limit:
                gpipe = actions == [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
                hint = ("that is GPipe: all forwards, then all backwards, which holds all m micro-batches' activations. 1F1B "
                        "starts backwards as soon as it can" if gpipe else
                        f"one warm-up forward too many: stage {s} needs p - s - 1 = {p - s - 1} before its first backward"
                        if held == limit + 1 else
                        "after its warm-up forwards, a stage alternates one forward and one backward, so what it holds stays constant")
                fail(f"one_f_one_b_schedule({p}, {m}, stage={s})", f"{held} micro-batches in flight at once",
                     f"at most p - s = {limit}" if limit == p - s else f"at most m = {m}", hint)
        bubble, want = measured_bubble(events), (p - 1) / (m + p - 1)
        if bubble > want + 1e-9:
            warmups = {s: next(n for n, (kind, _) in enumerate(a + [("B", -1)]) if kind == "B") for s, a in orders.items()}
            fail(tried + " (forward 1, backward 2 time units)", f"bubble {bubble:.4f} (warm-up forwards per stage: {warmups})",
                 f"1F1B's (p-1)/(m+p-1) = {want:.4f}",
                 "a stage with fewer than p - s - 1 warm-up forwards waits for the backward it asked for too early: warm up "
                 "with min(p - s - 1, m) forwards, then alternate forward, backward, then the remaining backwards")
    passed("one_f_one_b_schedule", "no deadlock, at most p - s micro-batches in flight on stage s, and 1F1B's bubble "
                                   "(p-1)/(m+p-1) in the simulated pipeline, for every p and m tried")
