"""Chapter 01 graders: decode an FP8 byte, the range of a format, one loss-scale decision, an FP8 scale,
the shared E8M0 exponent of a block, MX block quantization."""
from __future__ import annotations

import math
import random

import torch

from labkit import block_formats as B
from labkit import precision as P
from labkit.checks._core import (as_tensor, call, call_on_copies, call_twice, expect_device, expect_dtype, fail, other_device,
                                passed, same_values)

__all__ = ["decode_e4m3", "format_range", "update_scale", "amax_scale", "e8m0_exponent", "mx_quantize"]


NO_RETURN_HINT = "your function returned None: replace the placeholder with your code and `return` the result"


def _number(value, tried: str) -> float:
    if value is None:
        fail(tried, None, "a Python number", NO_RETURN_HINT)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(tried, f"a {type(value).__name__}", "a Python number", "return a float (e.g. `float(...)`)")
    return float(value)


def _same(got: float, expected: float, rel: float = 1e-12) -> bool:
    if math.isnan(expected):
        return math.isnan(got)
    if math.isinf(expected) or expected == 0:
        return got == expected
    return abs(got - expected) <= rel * abs(expected)


# ----------------------------------------------------------------------------- decode an E4M3 byte
def _e4m3_hint(code: int, got: float, expected: float) -> str:
    sign, exponent, mantissa = P.get_format("fp8_e4m3").fields(code)
    if got == -expected != 0:
        return "bit 7 is the sign: (-1)^s"
    if code & 0x7F == 0x7F:
        return "in E4M3FN only S.1111.111 is NaN (there is no inf)"
    if exponent == 15:
        return "E4M3FN has no inf: exponent 1111 holds ordinary numbers (up to 448), only mantissa 111 is NaN"
    if exponent == 0:
        return "exponent field 0 means subnormal: no implicit leading 1, and the exponent is 1 - bias = -6 (value = M/8 * 2^-6)"
    return "value = 2^(E - 7) * (1 + M/8) with E = bits 6..3 and M = bits 2..0; check the bias (7) and the /8"


def decode_e4m3(fn) -> None:
    """Grade ``fn(code: int) -> float``: the value of an FP8 E4M3 (E4M3FN) byte, all 256 of them."""
    fmt = P.get_format("fp8_e4m3")
    # Common codes first, so the first failure points at the most basic mistake.
    order = [*range(0x08, 0x78), *range(0x01, 0x08), 0x00, *range(0x78, 0x7F), 0x7F, *range(0x80, 0x100)]
    for code in order:
        tried = f"fn({code:#04x})  (bits {code:08b})"
        got = _number(call(fn, tried, code), tried)
        expected = P.decode(code, fmt).item()
        if not _same(got, expected):
            fail(tried, got, expected, _e4m3_hint(code, got, expected))
    passed("decode_e4m3", "all 256 E4M3 codes decode correctly, including subnormals, 448 and NaN")


# ----------------------------------------------------------------------------- range of a format
def _random_formats(rng: random.Random, count: int) -> list[P.FloatFormat]:
    formats = []
    for i in range(count):
        e, m = rng.randint(2, 8), rng.randint(1, 10)
        bias = (1 << (e - 1)) - 1 + rng.choice([0, 0, -1, 1, 3])
        formats.append(P.FloatFormat(f"custom_e{e}m{m}_{i}", e, m, bias, rng.choice(P.SPECIALS)))
    return formats


class FormatFields:
    """What the grader hands ``fn``: only the fields a format is defined by. Its derived values
    (``max``, ``min_normal``, ...) are what the learner computes, so reading them fails."""

    __slots__ = ("name", "exponent_bits", "mantissa_bits", "bias", "specials")

    def __init__(self, fmt: P.FloatFormat):
        for field in self.__slots__:
            object.__setattr__(self, field, getattr(fmt, field))

    def __getattr__(self, attr):
        raise AttributeError(f"this format exposes only name, exponent_bits, mantissa_bits, bias and specials, not "
                             f"{attr!r}: compute the range from those fields")

    def __setattr__(self, attr, value):
        raise AttributeError("the format is read-only")

    def __setstate__(self, state):  # unpickled in the learner's kernel (labkit.grade sends it there)
        for field, value in (state[1] if isinstance(state, tuple) else state).items():
            object.__setattr__(self, field, value)

    def __repr__(self):
        return (f"FloatFormat({self.name!r}, exponent_bits={self.exponent_bits}, mantissa_bits={self.mantissa_bits}, "
                f"bias={self.bias}, specials={self.specials!r})")


def format_range(fn) -> None:
    """Grade ``fn(fmt) -> (max, min_normal, min_subnormal)`` on the built-in formats, an fp64-like one
    (11 exponent bits: 2^1023 overflows fp32 arithmetic) and random custom ones (every kind of
    inf/NaN encoding). ``fmt`` exposes only ``exponent_bits``, ``mantissa_bits``, ``bias``,
    ``specials`` (and ``name``)."""
    formats = (list(P.FORMATS.values()) + [P.FloatFormat("e11m50", 11, 50, 1023, "ieee"), P.FloatFormat("e2m1_ieee", 2, 1, 1, "ieee")]
               + _random_formats(random.Random(0), 40))
    hints = {
        "ieee": "an 'ieee' format reserves the all-ones exponent for inf/NaN, so the largest finite value has exponent field 2^e - 2 and all mantissa bits set",
        "nan_only": "in a 'nan_only' format (like E4M3FN) only all-ones exponent AND all-ones mantissa is NaN: the max has exponent field 2^e - 1 and mantissa 2^m - 2",
        "finite": "a 'finite' format has no inf/NaN: the max has every exponent and mantissa bit set",
    }
    for fmt in formats:
        fields = FormatFields(fmt)
        tried = f"format_range({fields!r})"
        result = call(fn, tried, fields, hint="the grader's format has only the fields exponent_bits, mantissa_bits, bias "
                                              "and specials (reading fmt.max would skip the exercise): compute from them")
        if not isinstance(result, (tuple, list)) or len(result) != 3:
            fail(tried, repr(result), "a tuple (max, min_normal, min_subnormal)", NO_RETURN_HINT if result is None else "return three numbers")
        got = [_number(v, tried) for v in result]
        for name, g, e, hint in (
            ("max", got[0], fmt.max, hints[fmt.specials]),
            ("min_normal", got[1], fmt.min_normal, "the smallest normal has exponent field 1: 2^(1 - bias)"),
            ("min_subnormal", got[2], fmt.min_subnormal, "the smallest subnormal is one mantissa step above 0: 2^(1 - bias - mantissa_bits)"),
        ):
            if not _same(g, e):
                if not math.isfinite(g) or (g == 0 and e != 0):
                    hint = (f"{name} = {e!r} is a finite, non-zero float64: compute in Python floats (2.0 ** k), not in "
                            "float32 tensors (which overflow beyond 3.4e38 and flush below 1e-45)")
                fail(tried, f"{name} = {g!r}", f"{name} = {e!r}", hint)
    passed("format_range", f"max, min_normal and min_subnormal right for {len(formats)} formats, computed from the fields")


# ----------------------------------------------------------------------------- one loss-scale decision
def update_scale(fn) -> None:
    """Grade ``fn(scale, growth_tracker, found_inf, *, growth_factor, backoff_factor, growth_interval)
    -> (new_scale, new_growth_tracker)`` on single decisions and on long random runs."""
    cases = [
        ((1024.0, 0, False), dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
         "a good step only counts: the scale stays until growth_interval good steps in a row"),
        ((1024.0, 2, False), dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
         "this is the growth_interval-th good step in a row: multiply by growth_factor and reset the counter to 0"),
        ((1024.0, 1, True), dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
         "an overflow multiplies the scale by backoff_factor and resets the counter to 0"),
        ((1024.0, 2, True), dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
         "an overflow never grows the scale, even when the counter is about to reach growth_interval"),
        ((2.0**16, 1999, False), dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=2000),
         "grow when the counter *reaches* growth_interval (tracker + 1 == growth_interval), not one step later"),
        ((3.0, 0, False), dict(growth_factor=4.0, backoff_factor=0.25, growth_interval=1),
         "use the growth_factor argument, not a hard-coded 2"),
        ((3.0, 0, True), dict(growth_factor=4.0, backoff_factor=0.25, growth_interval=1),
         "use the backoff_factor argument, not a hard-coded 0.5"),
        ((2.0**1023, 4, False), dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=5),
         "the grown scale 2^1024 is inf: keep the old scale when growing would overflow (GradScaler takes the new "
         "scale only if it is finite), and still reset the counter to 0"),
        ((2.0**-1000, 0, True), dict(growth_factor=2.0, backoff_factor=2.0**-30, growth_interval=5),
         "an overflow multiplies the scale by backoff_factor, however small the scale already is"),
    ]
    for args, kwargs, hint in cases:
        tried = f"fn{args} with {kwargs}"
        _check_decision(fn, args, kwargs, tried, hint)
    rng = random.Random(1)
    for run in range(3):
        kwargs = dict(growth_factor=rng.choice([2.0, 1.5]), backoff_factor=rng.choice([0.5, 0.25]), growth_interval=rng.randint(2, 6))
        scale, tracker = 2.0**10, 0
        for step in range(60):
            found_inf = rng.random() < 0.15
            tried = f"step {step} of a run with {kwargs}: fn({scale}, {tracker}, {found_inf})"
            scale, tracker = _check_decision(fn, (scale, tracker, found_inf), kwargs, tried,
                                             "follow the rule exactly: overflow -> back off and reset; else count, and grow + reset at growth_interval")
    passed("update_scale", "same decisions as torch.amp.GradScaler on single steps and 180-step runs")


def _check_decision(fn, args, kwargs, tried, hint):
    result = call(fn, tried, *args, **kwargs)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        fail(tried, repr(result), "a tuple (new_scale, new_growth_tracker)",
             NO_RETURN_HINT if result is None else "return both the scale and the counter")
    expected = P.update_scale(*args, **kwargs)
    if isinstance(result[1], bool) or not isinstance(result[1], int):
        fail(tried, f"new_growth_tracker = {result[1]!r} (a {type(result[1]).__name__})", f"the int {expected[1]}",
             "the growth tracker counts good steps: return a Python int")
    got = (_number(result[0], tried), result[1])
    if not _same(got[0], expected[0]) or got[1] != expected[1]:
        fail(tried, got, expected, hint)
    return expected


# ----------------------------------------------------------------------------- per-tensor FP8 scale
def amax_scale(fn) -> None:
    """Grade ``fn(x, fmt, margin=0) -> float``: the per-tensor scale that maps max |x| to the
    format's max (``x / scale`` is what gets stored)."""
    g = torch.Generator().manual_seed(0)
    spiky = torch.randn(2, 3, 4, 5, generator=g)
    spiky[1, 2, 3, 4] = -50.0
    cases = [
        (torch.randn(64, 32, generator=g) * 3, "fp8_e4m3", 0,
         "scale = amax / fmt.max: dividing x by it puts the largest |x| exactly on the format's max"),
        (torch.tensor([0.5, -7.0, 2.0]), "fp8_e4m3", 0,
         "amax is the largest *magnitude*: the most negative entry counts too (use .abs())"),
        (torch.randn(100, generator=g) * 1e-3, "fp8_e5m2", 0, "use the format's own max (57344 for fp8_e5m2)"),
        (torch.randn(50, generator=g), "fp8_e4m3", 2,
         "a margin of k leaves 2^k of headroom: scale = amax / fmt.max * 2^margin"),
        (torch.zeros(10), "fp8_e4m3", 0, "an all-zero tensor has no amax to map: return scale 1.0 instead of dividing 0 by max"),
        (torch.tensor([1.0, math.inf, math.nan, -3.0]), "fp8_e4m3", 0,
         "inf/NaN entries must not set the scale: take amax over the finite entries (torch.isfinite)"),
        (torch.tensor([math.inf, -math.inf, math.nan]), "fp8_e4m3", 0,
         "no finite entry at all: like an all-zero tensor, return 1.0 (the max of an empty selection raises)"),
        (spiky, "fp8_e4m3", 1, "amax over every entry of a rank-4 tensor, not along one dim"),
        ((torch.randn(3, 2, 2, 2, 5, generator=g) * 2e4).clamp(-6e4, 6e4).half(), "fp8_e5m2", 0,
         "an fp16 tensor: take amax in fp32 (x.float()) and return a Python float"),
        ((torch.randn(40, generator=g) * 1e30).bfloat16(), "fp8_e4m3", 0,
         "a bf16 tensor with |x| ~ 1e30: amax / fmt.max, computed in fp32 or Python floats"),
        (torch.randn(40, generator=g) * 1e-30, "fp8_e4m3", 3, "a tiny tensor (|x| ~ 1e-30): the scale is tiny too, not 0"),
    ] + [(torch.randn(16, generator=g) * 5, name, 0, f"use {name}'s own max") for name in P.FORMATS]
    device = other_device(None)
    if device is not None:
        cases.append((torch.randn(8, 8, generator=g).to(device), "fp8_e5m2", 1, "x on the GPU: .item() brings amax back as a float"))
    for x, fmt, margin, hint in cases:
        tried = (f"amax_scale(x of shape {tuple(x.shape)} in {x.dtype}{' on ' + str(x.device) if x.device.type != 'cpu' else ''} "
                 f"with finite amax {P.finite_amax(x):.4g}, {fmt!r}, margin={margin})")
        got = _number(call_on_copies(fn, tried, x, fmt, margin, hint=hint,
                                     mutation_hint="do not change x (x.abs_(), x[~finite] = 0, x.nan_to_num_()): the "
                                                   "caller still needs it; work on x.abs() or a copy"), tried)
        expected = P.amax_scale(x, fmt, margin)
        if not _same(got, expected, rel=1e-6):
            fail(tried, got, expected, hint)
    passed("amax_scale", "per-tensor scales right for every format, fp32/fp16/bf16 and rank-1 to rank-5 inputs, "
                        "with margin, zeros, inf/NaN entries and tiny or huge values")


# ----------------------------------------------------------------------------- the E8M0 exponent of a block
def _boundaries(element: P.FloatFormat) -> torch.Tensor:
    """Every float32 ``max * 2^k`` (k from -150 to 127) with its two float32 neighbours: where a logarithm's
    rounding puts ``amax`` in the wrong binade."""
    k = torch.arange(-150, 128, dtype=torch.float64)
    exact = (element.max * torch.exp2(k)).float()
    exact = exact[torch.isfinite(exact) & (exact > 0)]
    around = torch.stack([torch.nextafter(exact, torch.tensor(0.0)), exact, torch.nextafter(exact, torch.tensor(math.inf))], -1)
    around = around.flatten()
    return around[torch.isfinite(around)]


def _e8m0_cases(g: torch.Generator) -> list[tuple[torch.Tensor, P.FloatFormat, str]]:
    """(amax, element format, what the case is about), the basic mistakes first."""
    def spread(*shape):
        return (torch.rand(*shape, generator=g) + 0.5) * torch.exp2(torch.randint(-40, 40, shape, generator=g).float())

    elements = [B.get_block_format(name).element_format for name in B.MX_FORMATS]
    e4m3, e2m1 = P.get_format("fp8_e4m3"), P.get_format("fp4_e2m1")
    with_zeros = spread(3, 16)
    with_zeros[0, :4], with_zeros[2, 7] = 0.0, 0.0
    cases = [(spread(4, 8), e4m3, "block amaxes of E4M3 blocks (a 4x8 tensor)"),
             (torch.tensor([6.0, 7.0, 12.0, 3.0, 6.5, 1.0]), e2m1, "E2M1 amaxes on and off max x 2^k")]
    cases += [(spread(2, 5, 3), element, f"{element.name} amaxes (rank 3)") for element in elements]
    cases += [(_boundaries(element), element, f"every max x 2^k of {element.name} and the float32 just below and just "
                                              "above it (from 2^-150 to 3e38)") for element in elements]
    cases += [(with_zeros, e4m3, "amax 0 (all-zero blocks) among others"),
              (torch.tensor([1e-38, 1e-40, 1.4e-45, 2.0**-126, 0.0]), e2m1, "float32 subnormal and tiny amaxes"),
              (torch.tensor([3.4028235e38, 1e38, 2.0**127]), e2m1, "the largest float32 amaxes"),
              (torch.tensor(448.0 * 2.0**-130), e4m3, "a 0-d amax below E8M0's range")]
    device = other_device(None)
    if device is not None:
        cases.append((spread(8, 4).to(device), e4m3, f"amax on {device}"))
    return cases


E8M0_RULE = ("e = ceil(log2(amax / max)) of the exact ratio: with amax = s * 2^b and max = s_max * 2^emax (s, s_max in "
             "[1, 2)), e = b - emax + (1 if s > s_max else 0); then clamp to [-127, 127], and 0 for amax 0")


def _e8m0_hint(amax: torch.Tensor, element: P.FloatFormat, got: torch.Tensor) -> str:
    """Name the mistake that produces ``got``, if it is one of the typical ones; else the rule."""
    expected = B.e8m0_exponent(amax, element).long()
    got = got.long()
    positive = amax > 0
    ratio = amax / element.max

    def same(candidate):
        return torch.equal(candidate.where(positive, 0).long(), got.where(positive, 0))

    if torch.equal(got[positive], expected[positive]) and not torch.equal(got, expected):
        return "amax 0 (an all-zero block) has no logarithm: give it exponent 0 (scale 1), not -127 and not garbage"
    fp32_log = torch.ceil(torch.log2(ratio)).clamp(-127, 127)
    if same(fp32_log):
        return ("a float32 log2 misplaces amax one float above max x 2^k: amax / max rounds to 2^k (or log2 rounds to k) "
                "and the ceil gives k instead of k + 1. Compute e from amax's bits instead: " + E8M0_RULE)
    if same(B.e8m0_exponent(amax, element, "ocp")):
        return ("that is OCP's floor(log2(amax)) - emax, which lets amax / scale exceed max (those entries clip); this "
                "chapter rounds the scale UP: the smallest e with amax / 2^e <= max")
    exact = positive & (ratio.double() == torch.exp2(torch.round(torch.log2(ratio.double()))))
    differ = got != expected
    if differ.any() and (differ <= exact).all() and torch.equal(got[differ], expected[differ] + 1):
        return ("where amax / max is exactly a power of two 2^j, e is j itself (ceil(j) = j): floor(...) + 1 is one too "
                "large there; compare the significands with > (not >=)")
    emax_rule = ("emax is floor(log2(max)) (E4M3 8, E5M2 15, E3M2 4, E2M3 2, E2M1 2; math.frexp(max) gives it exactly, "
                 "but its mantissa lies in [0.5, 1), so emax = exponent - 1)")
    shift = (got - expected)[positive & (expected > -127) & (expected < 127)]
    offset = int(shift[0]) if shift.numel() and (shift == shift[0]).all() else 0
    if offset in (-1, 1):
        if offset == -1:
            return ("every exponent is off by -1: either rounded down (floor where the rule says ceil: amax / 2^e then "
                    f"exceeds max and clips) or emax one too large: {emax_rule}")
        return f"every exponent is off by +1: emax one too small, or one added on top of the ceil: {emax_rule}"
    if same(B.e8m0_exponent(amax, element, "down")) or same(torch.floor(torch.log2(ratio.double())).clamp(-127, 127)):
        return ("rounded down: amax / 2^e is then above max and the block's largest entries clip; round UP, the smallest e "
                "with amax / 2^e <= max")
    if offset:
        return f"every exponent is off by {offset:+d}: {emax_rule}"
    if ((got < -127) | (got > 127)).any():
        return "E8M0 exponents run from -127 to 127 only: clamp (2^-127, E8M0's smallest scale, is a float32 subnormal)"
    return E8M0_RULE


def e8m0_exponent(fn) -> None:
    """Grade ``fn(amax, element) -> exponent``: the shared E8M0 exponent ``e`` of MX blocks whose largest
    magnitudes are ``amax`` (a float32 tensor, any shape, finite and >= 0), for the element format ``element``
    (a FloatFormat: E4M3, E5M2, E3M2, E2M3, E2M1). ``e = ceil(log2(amax / element.max))`` of the exact ratio,
    clamped to ``[-127, 127]``, and 0 where amax is 0: an integer tensor (int32 or int64) of amax's shape on
    amax's device, compared with :func:`labkit.block_formats.e8m0_exponent` on every ``max * 2^k`` boundary
    and the float32 on either side of it."""
    g = torch.Generator().manual_seed(8)
    cases = _e8m0_cases(g)
    for amax, element, about in cases:
        where = f" on {amax.device}" if amax.device.type != "cpu" else ""
        tried = f"e8m0_exponent(amax of shape {tuple(amax.shape)}{where}, {element.name} with max {element.max:g}): {about}"
        mutation_hint = "do not change amax (amax.abs_(), amax /= max, ...): work on a copy"
        got = call_on_copies(fn, tried, amax, element, mutation_hint=mutation_hint)
        if got is None:
            fail(tried, None, "an integer tensor of exponents", NO_RETURN_HINT)
        got = as_tensor(got, tried)
        again = call_on_copies(fn, tried + " (called a second time)", amax, element, mutation_hint=mutation_hint)
        if not (isinstance(again, torch.Tensor) and same_values(got.detach(), again.detach())):
            fail(tried + " (called twice)", "a different exponent on the second call", "the same result for the same input",
                 "does your function keep state between calls, or depend on randomness?")
        if got.shape != amax.shape:
            fail(tried, f"exponent of shape {tuple(got.shape)}", f"shape {tuple(amax.shape)}", "one exponent per amax: keep amax's shape")
        if got.dtype not in (torch.int32, torch.int64):
            fail(tried, f"exponent of dtype {got.dtype}", "an integer tensor (torch.int32 or torch.int64)",
                 "the exponent is an integer: return it as int32 or int64 (.to(torch.int32)), not as a float or a bool")
        expect_device(got, amax.device, "exponent", tried)
        expected = B.e8m0_exponent(amax, element).cpu()
        got_cpu = got.detach().cpu()
        if not torch.equal(got_cpu.long(), expected.long()):
            bad = tuple((got_cpu.long() != expected.long()).nonzero()[0].tolist()) if got_cpu.dim() else ()
            value = amax.cpu()[bad].item()
            fail(tried, f"exponent {int(got_cpu[bad])} for amax {value!r} ({value / element.max!r} x max)",
                 f"{int(expected[bad])}", _e8m0_hint(amax.cpu(), element, got_cpu))
    passed("e8m0_exponent", f"exact E8M0 exponents on {len(cases)} cases: every MX element format, every max x 2^k from "
                            "2^-150 to 3e38 and the float32 on either side of it, zeros, subnormal and huge amaxes, "
                            "clamped to [-127, 127]")


# ----------------------------------------------------------------------------- MX block quantization
MX_ROUND_UP_HINT = ("round the scale UP to a power of two: scale = 2^ceil(log2(amax / max)) with max the element "
                    "format's largest value; a smaller power of two makes amax / scale exceed max, and those entries clip")


def _mx_cases(g: torch.Generator) -> list[tuple[torch.Tensor, str, str]]:
    """(x, fmt, what the case is about), ordered so that the first failure names the basic mistake."""
    def spread(*shape):
        return torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-6, 6, (*shape[:-1], 1), generator=g).float())

    negative = spread(2, 64)
    negative[0, 3], negative[1, 40] = -50.0, -0.5  # blocks whose largest magnitude is a negative entry
    negative[1, 32:64] = negative[1, 32:64].abs() * 0.01
    boundary = spread(3, 96)
    boundary[:, 0] = torch.tensor([448.0, 6.0, 1.5 * 2.0**-20])  # amax exactly max x 2^j in some blocks
    boundary[:, 32] = torch.tensor([3.0 * 2.0**-4, 28.0 * 2.0**5, 7.5])
    zeros = spread(2, 3, 64)
    zeros[0, 1, :32] = 0.0  # an all-zero block
    tiny = spread(2, 64)
    tiny[1, 32:] = tiny[1, 32:] * 1e-38  # amax / max below 2^-127: E8M0's smallest scale
    cases = [(spread(4, 64) * 3, "mxfp8_e4m3", "a 4x64 fp32 tensor (2 blocks per row)"),
             (negative, "mxfp8_e4m3", "blocks whose largest magnitude is a negative entry"),
             (spread(3, 128), "mxfp4_e2m1", "MXFP4 (E2M1 elements, max 6)")]
    cases += [(spread(rows, 32 * blocks), name, f"{name}, {rows} rows of {blocks} blocks")
              for name, rows, blocks in [("mxfp8_e5m2", 5, 3), ("mxfp6_e3m2", 2, 4), ("mxfp6_e2m3", 6, 2)]]
    cases += [(boundary, name, "blocks whose amax is exactly the element max times a power of two") for name in B.MX_FORMATS]
    cases += [(_boundary_blocks(name, g), name, "one block per max x 2^k and per float32 just below and just above it")
              for name in B.MX_FORMATS]
    cases += [(zeros, "mxfp6_e2m3", "a rank-3 tensor with an all-zero block (its scale is 1)"),
              (spread(3, 2, 5, 96).bfloat16(), "mxfp8_e4m3", "a rank-4 bf16 tensor"),
              (spread(7, 160).half(), "mxfp4_e2m1", "an fp16 tensor"),
              (spread(256), "mxfp6_e3m2", "a rank-1 tensor of 8 blocks"),
              (spread(2, 64) * 1e30, "mxfp8_e4m3", "huge values (|x| ~ 1e30)"),
              (tiny, "mxfp8_e4m3", "a block so small that amax / max < 2^-127")]
    return cases


def _boundary_blocks(fmt: str, g: torch.Generator) -> torch.Tensor:
    """One block of 32 per amax of :func:`_boundaries` (k from -120 to 120): the amax entry, with a random sign, at a
    random place, and 31 smaller entries."""
    amax = _boundaries(B.get_block_format(fmt).element_format)
    amax = amax[(amax > 2.0**-120) & (amax < 2.0**120)]
    blocks = amax[:, None] * (torch.rand(amax.numel(), 32, generator=g) * 1.8 - 0.9)
    place = torch.randint(0, 32, (amax.numel(), 1), generator=g)
    sign = torch.where(torch.rand(amax.numel(), 1, generator=g) < 0.5, -1.0, 1.0)
    return blocks.scatter(1, place, sign * amax[:, None])


def _mx_scale_hint(x: torch.Tensor, fmt: str, got: torch.Tensor) -> str:
    """Name the mistake that produces ``got``, if it is one of the typical ones; else the rule."""
    f = B.get_block_format(fmt)
    element = f.element_format
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = blocks.abs().amax(-1)
    signed_max = blocks.amax(-1).clamp(min=0)

    def same(candidate):
        return candidate.shape == got.shape and torch.equal(candidate.to(got.dtype), got.detach().cpu())

    fp32_log = torch.exp2(torch.ceil(torch.log2(amax / element.max)).clamp(-127, 127)).where(amax > 0, 1.0)
    if same(fp32_log):
        return ("a float32 log2 misplaces amax one float above max x 2^k (amax / max rounds to 2^k, whose ceil is k, "
                "not k + 1): take the exponent exactly from amax's bits, as your e8m0_exponent of exercise 5 does")
    if same(B.e8m0_scale(amax, f, "ocp")) or same(B.e8m0_scale(amax, f, "down")):
        return MX_ROUND_UP_HINT
    if same(B.e8m0_scale(signed_max, f)):
        return "amax is the largest MAGNITUDE in the block: take x.abs() before the max (a negative entry can be the largest)"
    if same(torch.exp2(torch.ceil(torch.log2(amax))).where(amax > 0, 1.0)) or (
            torch.isfinite(amax * element.max).all() and same(B.e8m0_scale(amax * element.max, f))):
        return (f"divide amax by the element format's max ({element.max:g} for {element.name}) before taking log2, so "
                "that amax / scale lands at the top of the element range, not at 1")
    if got.numel() and torch.unique(got).numel() == 1 and torch.unique(B.e8m0_scale(amax, f)).numel() > 1:
        return "one scale per block of 32 consecutive values along the last dim, not one for the whole tensor"
    if (amax == 0).any() and not same(B.e8m0_scale(amax, f)) and not torch.isfinite(got).all():
        return "an all-zero block has amax 0 (log2(0) = -inf): give it scale 1"
    if ((got < 2.0**-127) & (amax > 0)).any():
        return "E8M0 scales go down to 2^-127 and no further: clamp the exponent to [-127, 127] (2^-127 is a float32 subnormal, not 0)"
    reference = B.e8m0_scale(amax, f)
    boundary = (amax > 0) & (amax == reference * element.max)  # amax / max exactly a power of two
    differ = got.detach().cpu() != reference
    if differ.any() and (differ <= boundary).all() and torch.equal(got.detach().cpu()[differ], 2 * reference[differ]):
        return ("where amax / max is exactly a power of two 2^j, the scale is 2^j itself (ceil(j) = j): "
                "floor(log2(...)) + 1 is one binade too large there")
    if (amax == 0).any():
        return "an all-zero block gets scale 1; every other block 2^ceil(log2(amax / max)), clamped to [-127, 127]"
    return ("per block of 32 consecutive values along the last dim: scale = 2^ceil(log2(amax / max)) (max: the element "
            "format's largest value), clamped to [2^-127, 2^127]")


def mx_quantize(fn) -> None:
    """Grade ``fn(x, fmt) -> (values, scales)``: MX quantization of ``x`` (shape ``[..., K]``, K a
    multiple of 32; fp32/bf16/fp16) in an MX format ``fmt`` ("mxfp8_e4m3", ..., "mxfp4_e2m1"):
    ``scales`` (float32, ``[..., K // 32]``) the E8M0 power-of-two scales rounded up,
    ``2^ceil(log2(amax / max))`` clamped to ``[2^-127, 2^127]`` (1 for an all-zero block), and
    ``values`` (float32, ``x``'s shape) ``x / scale`` rounded to the element format (nearest even,
    saturating), compared with :func:`labkit.block_formats.mx_quantize` bit for bit."""
    g = torch.Generator().manual_seed(16)
    cases = _mx_cases(g)
    device = other_device(None)
    if device is not None:
        cases.append((torch.randn(4, 64, generator=g).to(device), "mxfp4_e2m1", f"x on {device}"))
    for x, fmt, about in cases:
        tried = f"mx_quantize(x of shape {tuple(x.shape)} in {x.dtype}{' on ' + str(x.device) if x.device.type != 'cpu' else ''}, {fmt!r}): {about}"
        values, scales = call_twice(fn, tried, (x, fmt), ("values", "scales"),
                                    mutation_hint="do not change x (x.abs_(), x /= scale, ...): work on x.abs() or a copy")
        ref_values, ref_scales = B.mx_quantize(x, fmt)
        for name, got, expected in (("scales", scales, ref_scales), ("values", values, ref_values)):
            if got.shape != expected.shape:
                fail(tried, f"{name} of shape {tuple(got.shape)}", f"{name} of shape {tuple(expected.shape)}",
                     "scales has one entry per block of 32 along the last dim: shape [..., K // 32]; values has x's shape")
            expect_dtype(got, torch.float32, name, tried, "return float32 tensors (P.round_to gives float64: add .float())")
            expect_device(got, x.device, name, tried)
        got_scales = scales.detach().cpu()
        if not torch.equal(got_scales, ref_scales.cpu()):
            bad = (got_scales != ref_scales.cpu()).nonzero()[0]
            fail(tried, f"scales{tuple(bad.tolist())} = {got_scales[tuple(bad)].item():.6g}",
                 f"{ref_scales.cpu()[tuple(bad)].item():.6g} (block amax {B.block_amax(x, (1, 32)).cpu()[tuple(bad)].item():.6g})",
                 _mx_scale_hint(x.cpu(), fmt, got_scales))
        got_values = values.detach().cpu()
        if not torch.equal(got_values, ref_values.cpu()):
            bad = (got_values != ref_values.cpu()).nonzero()[0]
            scale = ref_scales.cpu()[tuple(bad[:-1].tolist()) + (int(bad[-1]) // 32,)].item()
            unrounded = (x.float().cpu() / B.expand_scales(ref_scales.cpu(), fmt, tuple(x.shape)))
            hint = ("round x / scale to the element format: P.round_to(x / scale, element, saturate=True)"
                    if torch.equal(got_values, unrounded) else
                    "values are x / scale (in float32) rounded to the element format, nearest even: P.round_to(..., saturate=True)")
            fail(tried, f"values{tuple(bad.tolist())} = {got_values[tuple(bad)].item():.6g}",
                 f"{ref_values.cpu()[tuple(bad)].item():.6g} (x = {x.float().cpu()[tuple(bad)].item():.6g}, scale {scale:.6g})", hint)
    passed("mx_quantize", f"scales and element values bit for bit on {len(cases)} cases: every MX element format, "
                          "fp32/bf16/fp16, rank 1 to 4, negative, all-zero, tiny and huge blocks, and amax on, just "
                          "below and just above every max x 2^k")
