"""Graders for chapter 09 (hardware and performance).

* ``matmul_cost(m, k, n, dtype) -> (flops, bytes)`` and ``add_cost(shape, dtype) -> (flops, bytes)``:
  :func:`labkit.hardware.matmul_cost` / :func:`labkit.hardware.add_cost`, the counts behind an
  operator's arithmetic intensity;
* ``roofline_time(flops, bytes_moved, peak_flops, bandwidth) -> seconds``: :func:`labkit.hardware.roofline_time`;
* ``softmax_rows(x) -> y``: :func:`labkit.hardware.softmax_rows`, the fix of the slow per-row loop
  :func:`labkit.hardware.softmax_rows_loop`, which must also be at least :data:`REQUIRED_SPEEDUP`
  times faster than that loop *on this machine* (medians of repeated timings, re-measured before failing);
* ``diagnose_step(step) -> {"bottleneck", "load_s", "run_s", ...}``: :func:`labkit.hardware.diagnose_step` on
  hidden :class:`labkit.hardware.TrainingStep` variants, one per bottleneck, in a hidden order: the times must be
  the steady-state medians (the first calls pay a one-off cost) and the bottleneck the one the step was built with.
"""
from __future__ import annotations

import math
import random

import torch

from labkit import hardware as H
from labkit.checks._core import CheckFailed, assert_close, call, call_on_copies, expect_device, expect_dtype, fail, other_device, passed

__all__ = ["matmul_cost", "add_cost", "roofline_time", "softmax_rows", "diagnose_step"]

REQUIRED_SPEEDUP = 10.0
SPEED_SHAPE = (2000, 64)
SPEED_ATTEMPTS = 3

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.int8)


def _two_ints(value, tried: str) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        fail(tried, "None" if value is None else repr(value), "a tuple (flops, bytes)",
             "your function returned None: did you forget `return`?" if value is None else "return (flops, bytes)")
    for name, v in zip(("flops", "bytes"), value):
        if isinstance(v, bool) or not isinstance(v, int):
            fail(tried, f"{name} = {v!r} ({type(v).__name__})", f"{name} as a Python int",
                 "counts are exact integers: use integer arithmetic (no /, math.pow or float()), and int(...) "
                 "if you took a size from a tensor")
    return int(value[0]), int(value[1])


def _cost_hint(got: tuple[int, int], expected: tuple[int, int], wrong: dict[str, tuple[int, int]]) -> str | None:
    for hint, candidate in wrong.items():
        if got == candidate and candidate != expected:
            return hint
    return None


def _grade_cost(fn, name: str, cases, reference, wrong_answers, generic_hint: str) -> None:
    for args, tried in cases:
        expected = reference(*args)
        got = _two_ints(call(fn, tried, *args), tried)
        if got == expected:
            again = _two_ints(call(fn, tried + " (called a second time)", *args), tried)
            if again != got:
                fail(tried + " (called twice)", f"{again} the second time", f"{got} again", "does your function keep state between calls?")
            continue
        hint = _cost_hint(got, expected, wrong_answers(*args)) or generic_hint
        fail(tried, f"(flops, bytes) = {got}", f"{expected}", hint)


def _size_hints(flops: int, elements: int, size: int, output: int) -> dict[str, tuple[int, int]]:
    """The typical wrong byte counts, each with its hint (``elements`` moved, ``output`` of them written)."""
    return {
        "return (flops, bytes) in that order": (elements * size, flops),
        "the output is written to memory too: count its bytes": (flops, (elements - output) * size),
        "bytes, not elements: multiply by the dtype's element size (torch.empty((), dtype=dtype).element_size())":
            (flops, elements),
        "bytes, not bits: one byte is 8 bits": (flops, 8 * elements * size),
        "use the dtype's element size (2 bytes for bf16/fp16, 1 for fp8/int8, 8 for fp64), not always 4": (flops, 4 * elements),
    }


def matmul_cost(fn) -> None:
    """Grade ``fn(m, k, n, dtype) -> (flops, bytes)`` of ``[m, k] @ [k, n]``: ``2 m k n`` FLOPs (a
    multiply and an add per product) and ``(m k + k n + m n) x element size`` bytes (A and B read once,
    C written once), as Python ints."""
    rng = random.Random(9)
    cases = [((1, 1, 1, torch.float32), "matmul_cost(1, 1, 1, torch.float32)"),
             ((4096, 4096, 4096, torch.bfloat16), "matmul_cost(4096, 4096, 4096, torch.bfloat16)")]
    for dtype in _DTYPES:
        m, k, n = rng.randint(1, 300), rng.randint(1, 300), rng.randint(1, 300)
        cases.append(((m, k, n, dtype), f"matmul_cost({m}, {k}, {n}, {dtype})"))
    cases.append(((16, 8192, 3, torch.float16), "matmul_cost(16, 8192, 3, torch.float16) (a skinny matmul)"))

    def wrong(m, k, n, dtype):
        size = H.element_size(dtype)
        elements = m * k + k * n + m * n
        hints = _size_hints(2 * m * k * n, elements, size, m * n)
        hints["each of the m k n products is a multiply AND an add: 2 m k n FLOPs"] = (m * k * n, elements * size)
        hints["C = A @ B only writes C (it does not read it): m k + k n + m n elements"] = (2 * m * k * n, (elements + m * n) * size)
        return hints

    _grade_cost(fn, "matmul_cost", cases, H.matmul_cost, wrong,
                "FLOPs = 2 m k n; bytes = (m k + k n + m n) x element size")
    passed("matmul_cost", f"FLOPs and bytes exact for {len(cases)} shapes in {len(_DTYPES)} dtypes, skinny and 1x1x1 included")


def add_cost(fn) -> None:
    """Grade ``fn(shape, dtype) -> (flops, bytes)`` of ``x + y`` with ``x``, ``y`` and the output of
    ``shape``: one FLOP per element and ``3 x numel x element size`` bytes, as Python ints."""
    rng = random.Random(10)
    cases = [(((1,), torch.float32), "add_cost((1,), torch.float32)"),
             ((torch.Size([3, 1, 5]), torch.bfloat16), "add_cost(torch.Size([3, 1, 5]), torch.bfloat16)")]
    for dtype in _DTYPES:
        shape = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 4)))
        cases.append(((shape, dtype), f"add_cost({shape}, {dtype})"))

    def wrong(shape, dtype):
        numel, size = math.prod(shape), H.element_size(dtype)
        hints = _size_hints(numel, 3 * numel, size, numel)
        hints["one addition per element: numel FLOPs, not 2 numel"] = (2 * numel, 3 * numel * size)
        hints["count all elements: numel = the product of the shape's sizes"] = (shape[0], 3 * shape[0] * size)
        return hints

    _grade_cost(fn, "add_cost", cases, H.add_cost, wrong, "FLOPs = numel; bytes = 3 x numel x element size (x, y read, out written)")
    passed("add_cost", f"FLOPs and bytes exact for {len(cases)} shapes (1 to 4 dims) in {len(_DTYPES)} dtypes")


_SLOWER = ("the slower of flops / peak_flops and bytes_moved / bandwidth sets the time (max): not the faster one (min), "
           "and not one of them alone")


def roofline_time(fn) -> None:
    """Grade ``fn(flops, bytes_moved, peak_flops, bandwidth) -> seconds``: on a roofline compute and
    memory traffic overlap, so the time is ``max(flops / peak_flops, bytes_moved / bandwidth)``."""
    h100 = H.Roofline.datasheet("H100 SXM")
    cases = [
        ((2 * 4096**3, 3 * 4096**2 * 2, h100.peak_flops, h100.bandwidth), "a 4096^3 bf16 matmul on the H100 datasheet roofline (compute-bound)"),
        ((1 << 24, 3 * (1 << 24) * 2, h100.peak_flops, h100.bandwidth), "a bf16 add of 16M elements on the H100 (memory-bound)"),
        ((1000, 20, 100.0, 2.0), "1000 FLOPs and 20 bytes on a 100 FLOP/s, 2 byte/s machine (exactly at the ridge)"),
        ((0, 4096, 1e12, 1e9), "no FLOPs at all, 4096 bytes (a copy)"),
        ((5e9, 0, 1e11, 1e10), "5e9 FLOPs on data already on chip (no bytes)"),
        ((3e9, 2e9, 4e10, 5e9), "3e9 FLOPs and 2e9 bytes on a 40 GFLOP/s, 5 GB/s laptop"),
    ]
    for args, tried in cases:
        tried = f"roofline_time{args}: {tried}"
        expected = H.roofline_time(*args)
        got = call(fn, tried, *args)
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            fail(tried, f"a {type(got).__name__}", "seconds as a float",
                 "your function returned None: did you forget `return`?" if got is None else "return a Python float (seconds)")
        if math.isclose(got, expected, rel_tol=1e-9, abs_tol=0.0):
            continue
        flops, nbytes, peak, bandwidth = args
        compute, memory = flops / peak, nbytes / bandwidth
        wrong = {
            "compute and memory traffic overlap on a roofline: the time is the slower of the two (max), not their sum":
                compute + memory,
            _SLOWER: min(compute, memory),
            _SLOWER + " ": compute,
            _SLOWER + "  ": memory,
            "divide FLOPs by the FLOP/s peak and bytes by the bandwidth (bytes/s)": max(flops / bandwidth, nbytes / peak),
            "seconds, not milliseconds": 1e3 * expected,
        }
        hint = next((h.strip() for h, value in wrong.items() if math.isclose(got, value, rel_tol=1e-9) and value != expected),
                    "time = max(flops / peak_flops, bytes_moved / bandwidth)")
        fail(tried, f"{got!r} s", f"{expected!r} s", hint)
    passed("roofline_time", f"right on {len(cases)} cases: compute-bound, memory-bound, at the ridge, no FLOPs, no bytes")


# ----------------------------------------------------------------------------- softmax_rows: right, then fast
def _softmax_cases():
    gen = torch.Generator().manual_seed(11)
    return [
        ("x of shape (5, 7) in float32", torch.randn(5, 7, generator=gen)),
        ("x of shape (3, 1) in float32 (one column: every output is 1)", torch.randn(3, 1, generator=gen)),
        ("x of shape (1, 300) in float32", torch.randn(1, 300, generator=gen) * 4),
        ("x of shape (6, 40) in float32 with values near 1000 (exp overflows without subtracting the max)",
         torch.randn(6, 40, generator=gen) * 5 + 1000),
        ("x of shape (4, 33) in float32 with values down to -2000", torch.randn(4, 33, generator=gen) * 500 - 1000),
        ("x of shape (8, 16) in bfloat16", torch.randn(8, 16, generator=gen).bfloat16()),
        ("x of shape (9, 24) in float16", (torch.randn(9, 24, generator=gen) * 3).half()),
        ("x of shape (12, 12) in float32 (square: the wrong dim is not caught by shapes)", torch.randn(12, 12, generator=gen)),
    ]


def _check_softmax_values(fn) -> None:
    for tried, x in _softmax_cases():
        tried = f"softmax_rows({tried})"
        y = call_on_copies(fn, tried, x)
        expected = torch.softmax(x.float(), dim=-1).to(x.dtype)
        if not isinstance(y, torch.Tensor):
            fail(tried, "None" if y is None else f"a {type(y).__name__}", "a torch.Tensor",
                 "did you forget `return`?" if y is None else "return a tensor")
        if y.shape == x.shape and y.dtype == x.dtype and y.is_floating_point():
            yf = y.float()
            if not torch.isfinite(yf).all():
                fail(tried, "inf or NaN in the output", "finite probabilities",
                     "subtract each row's max before exp: exp(1000) overflows, and softmax(x) = softmax(x - max)")
            if x.shape[0] == x.shape[1] and torch.allclose(yf, torch.softmax(x.float(), dim=0), atol=1e-3) \
                    and not torch.allclose(yf, expected.float(), atol=1e-3):
                fail(tried, "columns that sum to 1", "rows that sum to 1", "softmax over the last dim (dim=-1): keepdim=True on the max and the sum")
        atol = 1e-6 if x.dtype == torch.float32 else 1e-2
        assert_close(y, expected, tried, "y = exp(x - max) / sum(exp(x - max)) along the last dim, keepdim=True so it broadcasts",
                     rtol=1e-4 if x.dtype == torch.float32 else 2e-2, atol=atol)
        again = call_on_copies(fn, tried + " (called a second time)", x)
        if not torch.equal(again, y):
            fail(tried + " (called twice)", "a different result the second time", "the same result", "does your function keep state between calls?")
    device = other_device()
    x = torch.randn(4, 6, device=device)
    tried = f"softmax_rows(x of shape (4, 6) on {device})"
    y = call(fn, tried, x, hint="use torch ops on x itself (no .numpy(), no tensors created on the CPU)")
    if isinstance(y, torch.Tensor):
        expect_device(y, device, "y", tried)
        expect_dtype(y, x.dtype, "y", tried, "keep x's dtype")


def _timed_here(fn, x: torch.Tensor) -> tuple[float, float, float]:
    pair = H.compare(lambda: H.softmax_rows_loop(x), lambda: fn(x), repeats=5, threads=1)
    return pair.speedup, pair.baseline.median, pair.candidate.median


def _speedup(fn, x: torch.Tensor) -> tuple[float, float, float]:
    """(speed-up, loop seconds, fn seconds): the two timed in alternation, the median of the paired ratios, where
    ``fn`` runs (under labkit.grade, in the learner's process: a call from here would time the transport)."""
    from labkit.checks._remote import apply

    return apply(_timed_here, fn, x)


def softmax_rows(fn) -> None:
    """Grade ``fn(x) -> y``: softmax over the last dim of a 2-D float tensor (fp32, bf16, fp16; any
    device), without the per-row Python loop of :func:`labkit.hardware.softmax_rows_loop`.

    First the values (large inputs included, where exp overflows without subtracting the max), dtype,
    device, and inputs left unchanged. Then the speed on this machine: on a :data:`SPEED_SHAPE` input,
    ``fn`` and the loop timed in alternation on one thread (:func:`labkit.hardware.compare`), ``fn`` must be at least
    :data:`REQUIRED_SPEEDUP` times faster (median of the paired ratios); a miss is re-measured (up to
    :data:`SPEED_ATTEMPTS` times) before it fails, since another program may have been busy."""
    _check_softmax_values(fn)
    x = torch.randn(*SPEED_SHAPE, generator=torch.Generator().manual_seed(12))
    best = None
    for _ in range(SPEED_ATTEMPTS):
        measured = _speedup(fn, x)
        best = measured if best is None or measured[0] > best[0] else best
        if best[0] >= REQUIRED_SPEEDUP:
            break
    speedup, slow, fast = best
    if speedup < REQUIRED_SPEEDUP:
        fail(f"timing softmax_rows and labkit.hardware.softmax_rows_loop on x of shape {SPEED_SHAPE} "
             f"(median of interleaved timings, best of {SPEED_ATTEMPTS} attempts)",
             f"{speedup:.1f}x faster than the loop ({H.format_seconds(fast)} against {H.format_seconds(slow)})",
             f"at least {REQUIRED_SPEEDUP:g}x faster",
             "no Python loop over rows (or elements): every torch call costs microseconds of dispatch, so compute all "
             "rows at once with dim=-1 reductions (x.amax(dim=-1, keepdim=True), .exp(), .sum(dim=-1, keepdim=True))")
    passed("softmax_rows", f"right on {len(_softmax_cases())} inputs (fp32/bf16/fp16, values near ±1000) and at least "
                           f"{REQUIRED_SPEEDUP:g}x faster than the per-row loop on this machine")


# ----------------------------------------------------------------------------- diagnose_step
DIAGNOSIS_SEEDS = (11, 12, 13, 14, 15)  # one hidden variant per bottleneck: sizes, depths and waits differ by seed
TIME_FACTOR, TIME_SLACK_S = 4.0, 2e-3  # a median must lie within 4x (+- 2 ms) of the grader's, timed before and after
TIME_ATTEMPTS = 3  # the whole measurement is repeated (on a fresh step) before a time outside the range fails

_WHY = {
    "data": "loading the batch took longer than the step itself: time load_batch() and run(batch) separately; when "
            "the load's median exceeds the step's, the step waits for data (the fix: a prefetcher, more workers)",
    "sync": "the step reads values back from the device: profile run(batch) and count aten::_local_scalar_dense / "
            "aten::item events (an .item(), float(t), or `if t > x` inside the step); on a GPU each one drains the queue",
    "launch": f"the step runs thousands of tiny ops: count the profiled events of one run(batch) (more than "
              f"{H.LAUNCH_BOUND_OPS} here), each costing microseconds of dispatch whatever its size",
    "shape": f"its matmuls are skinny: from the profiled shapes of aten::mm/addmm, their FLOPs over their bytes is "
             f"below {H.LOW_INTENSITY:g} FLOP/byte, far below the ridge point: memory-bound however fast the cores",
    "compute": f"nothing stalls it: load is faster than the step, no syncs, fewer than {H.LAUNCH_BOUND_OPS} ops, and "
               f"matmuls above {H.LOW_INTENSITY:g} FLOP/byte: the step is bound by arithmetic, the healthy case",
}


def _diagnose_here(fn, bottleneck: str, seed: int):
    """Build the hidden step where ``fn`` runs and diagnose it with ``fn``; time a twin of it (same seed) the grader's
    way just before and just after, so that a burst of load from other programs widens the accepted range instead
    of failing a right answer: ``(fn's result, load references, run references)``, each ``(fastest call, median
    before, median after)``."""
    twin = H.TrainingStep(bottleneck, seed)
    batch = twin.load_batch()
    twin.run(batch)  # the twin pays its first-call costs here, untimed

    def timings():
        return (H.timeit(twin.load_batch, warmup=0, cold=True, repeats=5, number=1),
                H.timeit(twin.run, batch, warmup=0, cold=True, repeats=5, number=1))

    before = timings()
    result = fn(H.TrainingStep(bottleneck, seed))
    after = timings()
    # The lower end of the range comes from the fastest single call: a busy machine slows the grader's medians
    # (a fresh clone's tests under load 16 on 2 cores measured medians 16x a quiet call), never its fastest call.
    return result, *((min(b.min, a.min), b.median, a.median) for b, a in zip(before, after))


def _check_time(got, references: tuple[float, float, float], name: str, tried: str) -> None:
    """``references``: the grader's fastest single call, and its medians before and after the learner's call."""
    if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
        fail(tried, f"{name} = {got!r}", f"{name} in seconds, a finite float", "return the median in seconds (a Python float)")
    low, high = min(references) / TIME_FACTOR - TIME_SLACK_S, max(references) * TIME_FACTOR + TIME_SLACK_S
    if not low <= got <= high:
        if got > high and min(references) / TIME_FACTOR <= got / 1000 <= max(references) * TIME_FACTOR:
            fail(tried, f"{name} = {got!r}", f"about {H.format_seconds(got / 1000)}: a time in seconds",
                 "return seconds (time.perf_counter() differences as they are), not milliseconds")
        fail(tried, f"{name} = {H.format_seconds(got)}",
             f"between {H.format_seconds(max(low, 0))} and {H.format_seconds(high)} (the grader's medians of 5 calls "
             f"after a warm-up were {' and '.join(H.format_seconds(r) for r in references[1:])}, its fastest call "
             f"{H.format_seconds(references[0])})",
             f"warm up first: the first load_batch() and the first run() each pay a one-off cost ({H.FIRST_CALL_REPEATS} "
             "times a normal call here; compilation and allocation in a real step); then take the median of several "
             "calls, and time load_batch() and run(batch) separately" if got > high else
             "time the whole call (a median of several), in seconds, not one part of it or a per-element figure")


def diagnose_step(fn) -> None:
    """Grade ``fn(step) -> dict``: ``step`` has ``load_batch()`` and ``run(batch)``; the dict holds ``"bottleneck"``
    (one of ``labkit.hardware.BOTTLENECKS``) and ``"load_s"``, ``"run_s"`` (steady-state medians in seconds).
    Graded on one hidden :class:`labkit.hardware.TrainingStep` per bottleneck, in a hidden order."""
    from labkit.checks._remote import apply

    order = random.Random(9).sample(H.BOTTLENECKS, len(H.BOTTLENECKS))
    for number, (bottleneck, seed) in enumerate(zip(order, DIAGNOSIS_SEEDS), 1):
        tried = f"diagnose_step(step) on hidden training step {number} of {len(order)}"
        for attempt in range(1, TIME_ATTEMPTS + 1):
            result, load_s, run_s = call(lambda: apply(_diagnose_here, fn, bottleneck, seed), tried)
            if not isinstance(result, dict):
                fail(tried, "None" if result is None else f"a {type(result).__name__}",
                     'a dict with "bottleneck", "load_s" and "run_s"',
                     "did you forget `return`?" if result is None else 'return {"bottleneck": ..., "load_s": ..., "run_s": ...}')
            missing = [key for key in ("bottleneck", "load_s", "run_s") if key not in result]
            if missing:
                fail(tried, f"a dict with keys {sorted(map(str, result))}", f"the keys {missing} too",
                     'return {"bottleneck": ..., "load_s": ..., "run_s": ...}')
            try:
                _check_time(result["load_s"], load_s, "load_s", tried)
                _check_time(result["run_s"], run_s, "run_s", tried)
                break
            except CheckFailed:
                # A burst of load from another program can land inside the learner's timing and not the grader's
                # (or the other way round); a timing mistake fails every attempt, on a fresh step each time.
                if attempt == TIME_ATTEMPTS:
                    raise
        named = result["bottleneck"]
        if named not in H.BOTTLENECKS:
            fail(tried, f"bottleneck = {named!r}", f"one of {H.BOTTLENECKS}", "name it with one of these words")
        if named != bottleneck:
            fail(tried, f"bottleneck = {named!r} (load {H.format_seconds(load_s[1])}, step {H.format_seconds(run_s[1])})",
                 repr(bottleneck), f"the measurements show it: {_WHY[bottleneck]}. Check the criteria in the order "
                                   f"{', '.join(H.BOTTLENECKS)}: the first that holds is the bottleneck")
    passed("diagnose_step", f"the right bottleneck and steady-state load and step times for {len(order)} hidden steps "
                            f"({', '.join(H.BOTTLENECKS)})")
