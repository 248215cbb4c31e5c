"""labkit.checks graders of chapter 09: the reference solutions pass; each typical mistake is rejected
with a message that says what was tried and a hint that names the mistake."""
import labkit  # noqa: F401

import math

import pytest
import torch

from labkit.checks import ch09_hardware as checks  # the graders unwrapped: delegating to labkit is refused by the package-level ones (test_checks_refusal.py)
from labkit import hardware as H
from labkit.checks import CheckFailed


def size(dtype):
    return torch.empty((), dtype=dtype).element_size()


# ----------------------------------------------------------------------------- matmul_cost
def matmul_ok(m, k, n, dtype):
    return 2 * m * k * n, (m * k + k * n + m * n) * dtype.itemsize


def test_matmul_cost_accepts_the_reference(capsys):
    checks.matmul_cost(matmul_ok)
    checks.matmul_cost(H.matmul_cost)
    assert "✓ matmul_cost" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, hint", [
    (lambda m, k, n, d: (m * k * n, (m * k + k * n + m * n) * size(d)), "multiply AND an add"),
    (lambda m, k, n, d: (2 * m * k * n, (m * k + k * n) * size(d)), "output is written"),
    (lambda m, k, n, d: (2 * m * k * n, (m * k + k * n + m * n) * 4), "not always 4"),
    (lambda m, k, n, d: (2 * m * k * n, m * k + k * n + m * n), "bytes, not elements"),
    (lambda m, k, n, d: (2 * m * k * n, 8 * (m * k + k * n + m * n) * size(d)), "not bits"),
    (lambda m, k, n, d: (2 * m * k * n, (m * k + k * n + 2 * m * n) * size(d)), "only writes C"),
    (lambda m, k, n, d: ((m * k + k * n + m * n) * size(d), 2 * m * k * n), "in that order"),
    (lambda m, k, n, d: (2.0 * m * k * n, (m * k + k * n + m * n) * size(d)), "Python int"),
    (lambda m, k, n, d: None, "forget `return`"),
    (lambda m, k, n, d: 2 * m * k * n, "return (flops, bytes)"),
    (lambda m, k, n, d: (2 * m * k * n, (m * k * n) * size(d)), "FLOPs = 2 m k n; bytes"),
])
def test_matmul_cost_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match="tried") as err:
        checks.matmul_cost(wrong)
    assert hint in str(err.value)


def test_matmul_cost_rejects_state_and_placeholder():
    calls = []

    def stateful(m, k, n, d):
        calls.append(1)
        flops, nbytes = matmul_ok(m, k, n, d)
        return flops, nbytes + (len(calls) % 2 == 0)

    with pytest.raises(CheckFailed, match="keep state"):
        checks.matmul_cost(stateful)

    def unanswered(m, k, n, d):
        raise NotImplementedError

    with pytest.raises(CheckFailed, match="write your answer"):
        checks.matmul_cost(unanswered)


# ----------------------------------------------------------------------------- add_cost
def add_ok(shape, dtype):
    numel = math.prod(shape)
    return numel, 3 * numel * dtype.itemsize


def test_add_cost_accepts_the_reference():
    checks.add_cost(add_ok)
    checks.add_cost(H.add_cost)


@pytest.mark.parametrize("wrong, hint", [
    (lambda s, d: (math.prod(s), 2 * math.prod(s) * size(d)), "output is written"),
    (lambda s, d: (2 * math.prod(s), 3 * math.prod(s) * size(d)), "one addition per element"),
    (lambda s, d: (math.prod(s), 3 * math.prod(s) * 4), "not always 4"),
    (lambda s, d: (math.prod(s), 3 * math.prod(s)), "bytes, not elements"),
    (lambda s, d: (s[0], 3 * s[0] * size(d)), "product of the shape"),
    (lambda s, d: (math.prod(s), 3 * math.prod(s) * size(d) / 1), "Python int"),
    (lambda s, d: (torch.tensor(s).prod(), 3), "Python int"),
])
def test_add_cost_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match="tried") as err:
        checks.add_cost(wrong)
    assert hint in str(err.value)


# ----------------------------------------------------------------------------- roofline_time
def roofline_ok(flops, bytes_moved, peak_flops, bandwidth):
    return max(flops / peak_flops, bytes_moved / bandwidth)


def test_roofline_time_accepts_the_reference():
    checks.roofline_time(roofline_ok)
    checks.roofline_time(H.roofline_time)


@pytest.mark.parametrize("wrong, hint", [
    (lambda f, b, p, w: f / p + b / w, "not their sum"),
    (lambda f, b, p, w: min(f / p, b / w), "not the faster one (min)"),
    (lambda f, b, p, w: max(f / w, b / p), "divide FLOPs by the FLOP/s peak"),
    (lambda f, b, p, w: 1e3 * max(f / p, b / w), "not milliseconds"),
    (lambda f, b, p, w: f / p, "not one of them alone"),
    (lambda f, b, p, w: b / w, "not one of them alone"),
    (lambda f, b, p, w: (f + b) / (p + w), "time = max(flops / peak_flops, bytes_moved / bandwidth)"),
    (lambda f, b, p, w: None, "forget `return`"),
    (lambda f, b, p, w: torch.tensor(max(f / p, b / w)), "Python float"),
])
def test_roofline_time_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match="tried") as err:
        checks.roofline_time(wrong)
    assert hint in str(err.value)


# ----------------------------------------------------------------------------- softmax_rows
def softmax_ok(x):
    e = (x - x.amax(dim=-1, keepdim=True)).exp()
    return e / e.sum(dim=-1, keepdim=True)


def test_softmax_rows_accepts_the_reference_and_torch(capsys):
    checks.softmax_rows(softmax_ok)
    checks.softmax_rows(lambda x: torch.softmax(x, dim=-1))
    assert "at least 10x faster" in capsys.readouterr().out


def no_max(x):
    e = x.exp()
    return e / e.sum(dim=-1, keepdim=True)


def wrong_dim(x):
    e = (x - x.amax(dim=0, keepdim=True)).exp()
    return e / e.sum(dim=0, keepdim=True)


def in_place(x):
    x -= x.amax(dim=-1, keepdim=True)
    x.exp_()
    return x / x.sum(dim=-1, keepdim=True)


def per_row_softmax(x):  # still a Python loop, with one fused op per row
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = torch.softmax(x[i], dim=-1)
    return out


def upcast(x):
    return softmax_ok(x.float())


def global_max(x):
    e = (x - x.max()).exp()
    return e / e.sum(dim=-1, keepdim=True)


def on_cpu(x):
    return softmax_ok(x.cpu()) if x.device.type != "meta" else torch.empty(x.shape)


@pytest.mark.parametrize("wrong, hint", [
    (no_max, "subtract each row's max"),
    (wrong_dim, "last dim"),
    (in_place, "argument 1 was modified"),
    (H.softmax_rows_loop, "no Python loop over rows"),
    (per_row_softmax, "no Python loop over rows"),
    (upcast, "keep the input's dtype"),
    (lambda x: None, "forget `return`"),
    (lambda x: x.exp() / x.exp().sum(), "exp(x - max) / sum"),
    (on_cpu, "y on cpu"),
])
def test_softmax_rows_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match="tried") as err:
        checks.softmax_rows(wrong)
    assert hint in str(err.value)


def test_softmax_rows_global_max_is_caught_where_rows_differ():
    # x - x.max() over the whole tensor is mathematically fine, but rows far below the max underflow to 0/0
    with pytest.raises(CheckFailed):
        checks.softmax_rows(global_max)


def test_softmax_rows_retries_before_failing(monkeypatch):
    from labkit.checks import ch09_hardware as C

    measured = iter([(2.0, 1.0, 0.5), (30.0, 1.0, 0.03)])
    monkeypatch.setattr(C, "_speedup", lambda fn, x: next(measured))
    checks.softmax_rows(softmax_ok)  # a noisy first attempt is measured again
    monkeypatch.setattr(C, "_speedup", lambda fn, x: (3.0, 1.0, 0.3))
    with pytest.raises(CheckFailed, match="best of 3 attempts"):
        checks.softmax_rows(softmax_ok)


def test_graders_are_exported():
    assert {"matmul_cost", "add_cost", "roofline_time", "softmax_rows"} <= set(C_all())


def C_all():
    from labkit.checks import ch09_hardware as C

    return C.__all__


# ----------------------------------------------------------------------------- diagnose_step
def diagnosis(step, *, mistake=None):
    """A learner's diagnose_step; ``mistake`` swaps in one typical error."""
    import statistics
    import time

    from torch.autograd.profiler import profile

    def median(fn, *args, calls=5):
        samples = []
        for _ in range(calls):
            start = time.perf_counter()
            fn(*args)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    if mistake == "cold":  # one call each, the first: the one-off costs are in it
        start = time.perf_counter()
        batch = step.load_batch()
        load_s = time.perf_counter() - start
        run_s = median(step.run, batch, calls=1)
    else:
        batch = step.load_batch()
        step.run(batch)
        load_s = median(step.load_batch)
        run_s = median(lambda: step.run(step.load_batch())) if mistake == "together" else median(step.run, batch)
    with profile(record_shapes=True) as prof:
        loss = step.run(batch)
        if mistake == "own item":
            print(end="" if loss.item() else "")  # reads the loss inside the profiled region: not the step's sync
    events = list(prof.function_events)
    syncs = sum(e.name in H.SYNC_OPS for e in events)
    flops = moved = 0
    for e in events:
        if e.name in ("aten::mm", "aten::addmm"):
            a, b = (e.input_shapes[1], e.input_shapes[2]) if e.name == "aten::addmm" else e.input_shapes[:2]
            flops += 2 * a[0] * a[1] * b[1]
            moved += 4 * (a[0] * a[1] + a[1] * b[1] + a[0] * b[1])
    if mistake == "time only":
        named = "data" if load_s > run_s else "compute"
    elif load_s > run_s:
        named = "data"
    elif syncs:
        named = "sync"
    elif len(events) > 1000:
        named = "launch"
    elif flops / moved < 10 and mistake != "no intensity":
        named = "shape"
    else:
        named = "compute"
    scale = 1000.0 if mistake == "milliseconds" else 1.0
    return {"bottleneck": named, "load_s": load_s * scale, "run_s": run_s * scale}


def test_training_step_bottlenecks_are_what_labkits_diagnosis_measures():
    for bottleneck in H.BOTTLENECKS:
        found = H.diagnose_step(H.TrainingStep(bottleneck, seed=3))
        assert found["bottleneck"] == bottleneck, found
    with pytest.raises(ValueError, match="bottleneck"):
        H.TrainingStep("memory")


def test_diagnose_step_accepts_labkit_and_a_plain_solution(capsys):
    checks.diagnose_step(H.diagnose_step)
    checks.diagnose_step(diagnosis)
    assert capsys.readouterr().out.count("✓ diagnose_step:") == 2


@pytest.mark.parametrize("mistake, hint", [
    ("cold", "warm up first"),
    ("together", "warm up first"),  # the load inside the step's time: run_s far above the step's
    ("milliseconds", "in seconds"),
    ("time only", "the measurements show it"),
    ("no intensity", "FLOP/byte"),
    ("own item", "'sync'"),
])
def test_diagnose_step_rejects_typical_mistakes(mistake, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.diagnose_step(lambda step: diagnosis(step, mistake=mistake))
