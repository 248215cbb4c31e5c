"""Graders for chapter 06 (quantization).

* ``quantize_symmetric(x, bits, axis) -> (codes, scale)`` and
  ``quantize_asymmetric(x, bits, axis) -> (codes, scale, zero_point)``: per-channel round-to-nearest,
  the learner's version of ``labkit.quant.quantize(x, bits, symmetric, "channel", axis=axis)``
  (its ``codes``, ``scale`` and ``zero_point``);
* ``pack_int4(codes)`` and ``unpack_int4(packed, signed)``: :func:`labkit.quant.pack_int4` /
  :func:`labkit.quant.unpack_int4`;
* ``nearest_level(normalized, levels)``: :func:`labkit.quant.nearest_level` (NF4's lookup);
* ``gptq_quantize(weight, X, bits, group_size, damp) -> (codes, scale)``: GPTQ's column loop, graded on the
  layer-output error against labkit's :func:`labkit.quant.gptq_quantize` and round-to-nearest.

Each grader passes copies of its inputs (and checks that they come back unchanged), calls the
learner's function twice, checks types, dtypes and shapes, and compares with labkit's result.
Where rounding meets an exact tie (a value half-way between two codes or two levels, which one
ulp of a different but correct computation can push either way) either neighbour is accepted.
"""
from __future__ import annotations

import math

import torch

from labkit import quant as Q
from labkit.checks._core import call_on_copies, call_twice, fail, passed, results, same_values

__all__ = ["quantize_symmetric", "quantize_asymmetric", "pack_int4", "unpack_int4", "nearest_level", "gptq_quantize"]

TIE = 1e-3  # |fraction - 0.5| below this counts as a tie, where either neighbour is right


# ----------------------------------------------------------------------------- shared helpers
_MUTATION_HINT = ("work on new tensors: an in-place op (x /= s, x.round_(), ...) on x, or on x.float() of an fp32 x "
                  "(which is x itself), changes the caller's tensor")
_GPTQ_MUTATION_HINT = ("work on a copy: W = weight.float().clone() (weight.float() of an fp32 weight is the weight itself, so "
                       "the updates W[:, j+1:] -= ... would change the caller's layer)")


def _expect_dtype_shape(value: torch.Tensor, name: str, dtype: torch.dtype, shape, tried: str, hint: str) -> None:
    if value.dtype != dtype:
        fail(tried, f"{name} of dtype {value.dtype}", f"{name} of dtype {dtype}", hint)
    if tuple(value.shape) != tuple(shape):
        fail(tried, f"{name} of shape {tuple(value.shape)}", f"{name} of shape {tuple(shape)}", hint)


def _call_twice(fn, tried: str, args: tuple, names: tuple[str, ...], hint: str, mutation_hint: str) -> tuple:
    """:func:`call_twice` with a hint for an exception the case provokes (a layout, a singular matrix)."""
    first = results(call_on_copies(fn, tried, *args, hint=hint, mutation_hint=mutation_hint), names, tried)
    again = results(call_on_copies(fn, tried + " (called a second time)", *args, hint=hint, mutation_hint=mutation_hint),
                    names, tried)
    if not all(same_values(a, b) for a, b in zip(first, again)):
        fail(tried + " (called twice)", "a different result on the second call", "the same result for the same input",
             "does your function keep state between calls, or depend on randomness?")
    return first


def _first_difference(got: torch.Tensor, expected: torch.Tensor, bad: torch.Tensor) -> str:
    index = tuple(int(i) for i in bad.nonzero()[0])
    return f"{got[index].item():g} at index {index}", f"{expected[index].item():g}"


def _off_by_tie(got: torch.Tensor, expected: torch.Tensor, unrounded: torch.Tensor) -> torch.Tensor:
    """Where ``got`` differs from ``expected`` other than by one step at an exact tie."""
    fraction = unrounded - unrounded.floor()
    tie = (fraction - 0.5).abs() < TIE
    return (got != expected) & ~(tie & ((got - expected).abs() <= 1))


# ----------------------------------------------------------------------------- quantize
def _quantize_cases(symmetric: bool):
    """(tried, x, bits, axis): random shapes and axes in fp32/fp16/bf16, 2 to 8 bits, and a matrix of
    edge rows: all zero, constant, negative only, |min| > max, positive only, and a row whose zero
    point and largest value are exact ties (a missing clamp then produces code 2^bits)."""
    gen = torch.Generator().manual_seed(6)
    cases = [
        ("x of shape (4, 9) in float32, bits=8, axis=-1", torch.randn(4, 9, generator=gen) * 3 + 0.5, 8, -1),
        ("x of shape (3, 5, 6) in float16, bits=4, axis=1", (torch.randn(3, 5, 6, generator=gen) * 2).half(), 4, 1),
        ("x of shape (6, 4) in bfloat16, bits=3, axis=0", (torch.randn(6, 4, generator=gen) - 0.7).bfloat16(), 3, 0),
        ("x of shape (33,) in float32, bits=5, axis=0", torch.randn(33, generator=gen) * 0.01, 5, 0),
        ("x of shape (3, 7) in float16, bits=2, axis=-1", torch.randn(3, 7, generator=gen).half(), 2, -1),
    ]
    rows = torch.randn(7, 8, generator=gen)
    rows[0] = 0.0                                          # all zero: no range at all
    rows[1] = 0.75                                         # constant
    rows[2] = -(torch.rand(8, generator=gen) + 0.1)        # negative only
    rows[3] = torch.linspace(-3.0, 1.0, 8)                 # |min| > max
    rows[4] = torch.rand(8, generator=gen) + 0.5           # positive only
    rows[5] = -2.0                                         # negative constant
    rows[6] = torch.tensor([-0.4375, 1.4375, 0.3, -0.1, 0.0, 1.0, 0.6875, -0.25])  # 4 bits: -lo/scale = 3.5, hi/scale = 11.5
    edge = "x of shape (7, 8) in float32, bits=4, axis=-1, with rows: all zero, constant 0.75, negative only, " \
           "min -3 / max 1, positive only, constant -2, and one whose zero point is a tie"
    cases.append((edge, rows, 4, -1))
    cases.append(("the same rows transposed, x of shape (8, 7) in bfloat16, bits=4, axis=0", rows.T.contiguous().bfloat16(), 4, 0))
    return cases


def _grade_quantize(fn, name: str, symmetric: bool) -> int:
    names = "(codes, scale)" if symmetric else "(codes, scale, zero_point)"
    code_dtype = torch.int8 if symmetric else torch.uint8
    cases = _quantize_cases(symmetric)
    for tried, x, bits, axis in cases:
        tried = f"{name}({tried})"
        q = Q.quantize(x, bits, symmetric, "channel", axis=axis)
        qmin, qmax = q.code_range
        got = call_twice(fn, tried, (x, bits, axis), tuple(names.strip("()").split(", ")), _MUTATION_HINT)
        codes, scale = got[0], got[1]
        _expect_dtype_shape(codes, "codes", code_dtype, x.shape, tried,
                            f"codes have x's shape, as {code_dtype} ({'signed' if symmetric else 'unsigned'} codes "
                            f"{qmin}..{qmax}): convert with .to({code_dtype})")
        if scale.dtype != torch.float32:
            fail(tried, f"scale of dtype {scale.dtype}", "scale of dtype torch.float32",
                 "compute in fp32 whatever x's dtype (x.float()): a 16-bit scale would add its own rounding error")
        if tuple(scale.shape) != tuple(q.scale.shape):
            fail(tried, f"scale of shape {tuple(scale.shape)}", f"scale of shape {tuple(q.scale.shape)}",
                 f"one scale per slice along axis={axis}: reduce over dim {axis} with keepdim=True, so that the scale "
                 "broadcasts against x (wrong axis?)")
        zero = None
        if not symmetric:
            zero = got[2]
            if zero.dtype.is_floating_point:
                fail(tried, f"zero_point of dtype {zero.dtype}", "zero_point of dtype torch.uint8",
                     "the zero point is an integer code: round it (torch.round) and store it as uint8, so that 0.0 is "
                     "represented exactly")
            _expect_dtype_shape(zero, "zero_point", torch.uint8, q.zero_point.shape, tried,
                                "one zero point per scale, as uint8, with the scale's shape")
        _check_scale(x, bits, axis, scale, q, symmetric, tried)
        low, high = int(codes.min()), int(codes.max())
        if low < qmin or high > qmax:
            fail(tried, f"codes from {low} to {high}", f"codes within [{qmin}, {qmax}]",
                 f"the symmetric grid is -{qmax}..{qmax}: the code {qmin - 1} is never used" if symmetric and low == qmin - 1 else
                 f"clamp the codes to [{qmin}, {qmax}] after rounding: at the ends of the range rounding can step one past them")
        x64 = x.double()
        s64 = scale.double()
        z64 = torch.zeros_like(s64) if symmetric else zero.double()
        if not symmetric:
            lo = torch.clamp(x64.amin(dim=axis, keepdim=True), max=0.0)
            unrounded_zero = -lo / s64
            bad = _off_by_tie(z64, q.zero_point.double(), unrounded_zero) & (x64.abs().amax(dim=axis, keepdim=True) > 0)
            if bad.any():
                got_text, expected_text = _first_difference(z64, q.zero_point.double(), bad)
                hint = ("zero_point = round(-lo / scale), clamped to [0, 2^bits - 1]: round to nearest, do not truncate"
                        if torch.equal(z64[bad], unrounded_zero.floor()[bad]) else
                        "zero_point = round(-lo / scale) with lo = min(x.min(axis), 0): the code that stands for 0.0")
                fail(tried, f"zero_point {got_text}", expected_text, hint)
        unrounded = x64 / s64
        expected = (unrounded.round() + z64).clamp(qmin, qmax)
        got_codes = codes.double()
        bad = _off_by_tie(got_codes, expected, unrounded)
        if bad.any():
            got_text, expected_text = _first_difference(got_codes, expected, bad)
            if torch.equal(got_codes[bad], (unrounded.trunc() + z64).clamp(qmin, qmax)[bad]):
                hint = "round to nearest with torch.round: converting to an integer dtype truncates toward zero"
            elif not symmetric and torch.equal(got_codes[bad], (unrounded - lo / s64).round().clamp(qmin, qmax)[bad]):
                hint = "round the zero point to an integer before adding it: round(x / scale) + round(-lo / scale)"
            else:
                hint = (f"codes = clamp(round(x / scale){'' if symmetric else ' + zero_point'}, {qmin}, {qmax}): "
                        "divide by the scale first, then round")
            fail(tried, f"code {got_text} (with your scale{'' if symmetric else ' and zero point'})",
                 f"{expected_text} = clamp(round(x / scale){'' if symmetric else ' + zero_point'})", hint)
        error = ((got_codes - z64) * s64 - x64).abs()
        if (error > s64 * (0.5 + TIE) + 1e-30).any():
            fail(tried, f"a value off by {error.max().item():.3g} after dequantizing", "at most half a step (scale / 2)",
                 "dequantized = scale * (codes - zero_point) must land within half a step of x")
    return len(cases)


def _check_scale(x, bits, axis, scale, q, symmetric, tried) -> None:
    x32 = x.float()
    zero_slice = x32.abs().amax(dim=axis, keepdim=True) == 0
    s = scale.double()
    if zero_slice.any():
        bad = zero_slice & ~(torch.isfinite(s) & (s > 0))
        if bad.any():
            fail(tried, f"scale {s[bad][0].item():g} for an all-zero slice", "a positive scale (labkit uses 1.0)",
                 "an all-zero slice has absmax 0: give it scale 1 instead of dividing by 0 (its codes are all "
                 f"{'0' if symmetric else 'the zero point'})")
    expected = q.scale.double()
    bad = ~torch.isclose(s, expected, rtol=1e-5, atol=0) & ~zero_slice
    if not bad.any():
        return
    got_text, expected_text = _first_difference(s, expected, bad)
    qmin, qmax = q.code_range
    if symmetric:
        from_max = x32.amax(dim=axis, keepdim=True).double() / qmax
        if torch.isclose(s[bad], from_max[bad], rtol=1e-5).all():
            hint = "the scale comes from the absmax, max |x|, not from max x: negative values need room too"
        elif torch.isclose(s[bad], expected[bad] * qmax / 2 ** (bits - 1), rtol=1e-5).all():
            hint = f"divide the absmax by 2^(bits-1) - 1 = {qmax}: the symmetric grid is -{qmax}..{qmax}"
        elif torch.isclose(s[bad], expected[bad], rtol=1e-2).all():
            hint = "compute the absmax and the scale in fp32 (x.float()), not in x's 16-bit dtype"
        else:
            hint = f"scale = absmax / {qmax} with absmax = x.abs().amax(dim=axis, keepdim=True)"
    else:
        no_zero = (x32.amax(dim=axis, keepdim=True) - x32.amin(dim=axis, keepdim=True)).double() / qmax
        if torch.isclose(s[bad], no_zero[bad], rtol=1e-5).all():
            hint = "the range must contain 0: lo = min(x.min(axis), 0), hi = max(x.max(axis), 0) (so 0.0 gets a code)"
        elif torch.isclose(s[bad], expected[bad], rtol=1e-2).all():
            hint = "compute the range and the scale in fp32 (x.float()), not in x's 16-bit dtype"
        else:
            hint = (f"scale = (hi - lo) / {qmax} with lo = min(x.min(axis), 0) and hi = max(x.max(axis), 0): "
                    "the range always contains 0")
    fail(tried, f"scale {got_text}", expected_text, hint)


def quantize_symmetric(fn) -> None:
    """Grade ``fn(x, bits, axis) -> (codes, scale)``: symmetric per-channel round-to-nearest.

    ``scale = absmax / (2^(bits-1) - 1)`` (fp32, ``axis`` kept with size 1; an all-zero slice gets
    a positive scale, labkit uses 1), ``codes = clamp(round(x / scale), -qmax, qmax)`` as int8 with
    x's shape: what ``labkit.quant.quantize(x, bits, True, "channel", axis=axis)`` stores."""
    count = _grade_quantize(fn, "quantize_symmetric", symmetric=True)
    passed("quantize_symmetric", f"codes and scales right on {count} inputs: fp32/fp16/bf16, 2-8 bits, any axis, "
                                 "zero, constant and negative-only rows")


def quantize_asymmetric(fn) -> None:
    """Grade ``fn(x, bits, axis) -> (codes, scale, zero_point)``: asymmetric per-channel round-to-nearest.

    ``lo = min(x.min(axis), 0)``, ``hi = max(x.max(axis), 0)``, ``scale = (hi - lo) / (2^bits - 1)``
    (fp32, ``axis`` kept with size 1), ``zero_point = round(-lo / scale)`` (uint8) and
    ``codes = clamp(round(x / scale) + zero_point, 0, 2^bits - 1)`` (uint8): what
    ``labkit.quant.quantize(x, bits, False, "channel", axis=axis)`` stores."""
    count = _grade_quantize(fn, "quantize_asymmetric", symmetric=False)
    passed("quantize_asymmetric", f"codes, scales and zero points right on {count} inputs, including the clamp at the "
                                  "range's ends and rows without negative (or positive) values")


# ----------------------------------------------------------------------------- int4 packing
def _high_first(codes: torch.Tensor) -> torch.Tensor:
    nibbles = codes.to(torch.int16) & 0xF
    return ((nibbles[..., 0::2] << 4) | nibbles[..., 1::2]).to(torch.uint8)


def _every_pair(dtype: torch.dtype) -> torch.Tensor:
    values = torch.arange(-8, 8) if dtype == torch.int8 else torch.arange(16)
    return torch.cartesian_prod(values, values).to(dtype)


def pack_int4(fn) -> None:
    """Grade ``fn(codes) -> packed``: two 4-bit codes per byte along the last dim, element ``2i`` in
    the low nibble; int8 codes ``-8..7`` as 4-bit two's complement, uint8 codes ``0..15`` as they are.
    ``codes`` may be a non-contiguous view (one case is a transpose: ``.view(-1, 2)`` fails on it)."""
    gen = torch.Generator().manual_seed(7)
    cases = [
        ("every pair of signed codes -8..7, int8 of shape (256, 2)", _every_pair(torch.int8)),
        ("every pair of unsigned codes 0..15, uint8 of shape (256, 2)", _every_pair(torch.uint8)),
        ("random signed codes, int8 of shape (3, 4, 6)", torch.randint(-8, 8, (3, 4, 6), generator=gen).to(torch.int8)),
        ("random unsigned codes, uint8 of shape (5, 10)", torch.randint(0, 16, (5, 10), generator=gen).to(torch.uint8)),
        ("one row of two codes, int8 [[-1, -8]]", torch.tensor([[-1, -8]], dtype=torch.int8)),
        ("a non-contiguous view: signed codes int8 of shape (3, 4, 6) transposed from (3, 6, 4) (a weight's codes "
         "read along another axis)", torch.randint(-8, 8, (3, 6, 4), generator=gen).to(torch.int8).transpose(1, 2)),
    ]
    for tried, codes in cases:
        tried = f"pack_int4({tried})"
        hint = ("codes may be a view with any strides: .view() cannot merge dimensions that are not contiguous in memory; "
                "use .reshape(), or take the pairs with codes[..., 0::2] and codes[..., 1::2], which work on any layout"
                if not codes.is_contiguous() else "run that call yourself and read the traceback")
        (packed,) = _call_twice(fn, tried, (codes,), ("packed",), hint, _MUTATION_HINT)
        expected = Q.pack_int4(codes)
        _expect_dtype_shape(packed, "packed", torch.uint8, expected.shape, tried,
                            "two codes per byte: uint8 with the last dim halved")
        bad = packed != expected
        if bad.any():
            got_text, expected_text = _first_difference(packed, expected, bad)
            if torch.equal(packed, _high_first(codes)):
                hint = "element 2i goes in the LOW nibble (bits 0-3) and element 2i+1 in the high nibble (bits 4-7)"
            elif codes.dtype == torch.int8:
                hint = ("keep the sign as 4-bit two's complement: take code & 0xF of EACH code (-1 -> 0b1111) before "
                        "shifting and combining, or the int8 sign bits spill into the other nibble (and no +8 offset)")
            else:
                hint = "packed = codes[..., 0::2] | (codes[..., 1::2] << 4), computed in a wide enough integer type"
            fail(tried, f"byte {got_text}", expected_text, hint)
    passed("pack_int4", "every pair of signed and unsigned codes packs low nibble first, on any shape and memory layout")


def unpack_int4(fn) -> None:
    """Grade ``fn(packed, signed) -> codes``: the inverse of :func:`pack_int4`, int8 ``-8..7`` when
    ``signed`` (sign-extending each nibble), else uint8 ``0..15``; the last dim doubles."""
    gen = torch.Generator().manual_seed(8)
    every_byte = torch.arange(256).to(torch.uint8)
    cases = [
        ("every byte 0..255 of shape (256,), signed=True", every_byte, True),
        ("every byte 0..255 of shape (256,), signed=False", every_byte, False),
        ("random bytes of shape (3, 4), signed=False", torch.randint(0, 256, (3, 4), generator=gen).to(torch.uint8), False),
        ("random bytes of shape (2, 2, 5), signed=True", torch.randint(0, 256, (2, 2, 5), generator=gen).to(torch.uint8), True),
    ]
    for tried, packed, signed in cases:
        tried = f"unpack_int4({tried})"
        (codes,) = call_twice(fn, tried, (packed, signed), ("codes",), _MUTATION_HINT)
        expected = Q.unpack_int4(packed, signed)
        _expect_dtype_shape(codes, "codes", expected.dtype, expected.shape, tried,
                            "two codes per byte: the last dim doubles; int8 if signed, else uint8")
        bad = codes != expected
        if bad.any():
            got_text, expected_text = _first_difference(codes, expected, bad)
            swapped = torch.stack([packed >> 4, packed & 0xF], dim=-1).flatten(-2).to(torch.int16)
            if torch.equal(codes.to(torch.int16), (swapped ^ 8) - 8 if signed else swapped):
                hint = "the low nibble (bits 0-3) is element 2i, the high nibble element 2i+1: low nibble first"
            elif signed:
                hint = "sign-extend each nibble: 0..7 stay, 8..15 become -8..-1 (subtract 16 from nibbles >= 8)"
            else:
                hint = "codes: packed & 0xF and packed >> 4, interleaved (low nibble first)"
            fail(tried, f"code {got_text}", expected_text, hint)
    passed("unpack_int4", "every byte unpacks to the right signed and unsigned codes")


# ----------------------------------------------------------------------------- NF4 lookup
def nearest_level(fn) -> None:
    """Grade ``fn(normalized, levels) -> indices``: for each value (in ``[-1, 1]``, any float dtype
    and shape) the index of the nearest of the ascending ``levels`` (fp32), as uint8. At an exact
    midpoint between two levels either is accepted (labkit takes the lower)."""
    gen = torch.Generator().manual_seed(9)
    nf4 = Q.nf4_codebook()
    random_levels = torch.cat([torch.tensor([-1.0]), torch.rand(6, generator=gen) * 1.6 - 0.8, torch.tensor([1.0])]).sort().values
    uniform = lambda *shape: torch.rand(*shape, generator=gen) * 2 - 1  # noqa: E731
    cases = [
        ("201 evenly spaced values from -1 to 1 (float32), NF4 levels", torch.linspace(-1, 1, 201), nf4),
        ("the NF4 levels themselves", nf4.clone(), nf4),
        ("random values of shape (5, 7) in float32, NF4 levels", uniform(5, 7), nf4),
        ("random values of shape (3, 64) in bfloat16, NF4 levels", uniform(3, 64).bfloat16(), nf4),
        ("random values of shape (33,) in float16, 15 evenly spaced levels", uniform(33).half(), torch.linspace(-1, 1, 15)),
        ("random values of shape (4, 9) in float32, 8 unevenly spaced levels", uniform(4, 9), random_levels),
    ]
    for tried, x, levels in cases:
        tried = f"nearest_level({tried})"
        (indices,) = call_twice(fn, tried, (x, levels), ("indices",), _MUTATION_HINT)
        if indices.dtype.is_floating_point:
            fail(tried, f"a {indices.dtype} tensor", "uint8 indices into levels",
                 "return the index of the nearest level (0 .. len(levels) - 1), not the level's value")
        _expect_dtype_shape(indices, "indices", torch.uint8, x.shape, tried,
                            "one index per value, with normalized's shape, as torch.uint8 (the 4-bit code it becomes)")
        distance = (x.double()[..., None] - levels.double()).abs()
        best = distance.min(dim=-1, keepdim=True).values
        index = indices.long()
        if int(index.min()) < 0 or int(index.max()) >= len(levels):
            fail(tried, f"indices from {int(index.min())} to {int(index.max())}", f"indices in [0, {len(levels) - 1}]",
                 "an index into levels")
        chosen = distance.gather(-1, index[..., None])
        bad = (chosen - best > 1e-6).squeeze(-1)
        if bad.any():
            expected = distance.argmin(dim=-1)
            position = tuple(int(i) for i in bad.nonzero()[0])
            value, got_index, right = x[position].item(), int(index[position]), int(expected[position])
            searchsorted = torch.searchsorted(levels.double(), x.double().contiguous())
            if torch.equal(index[bad], searchsorted[bad].clamp(max=len(levels) - 1)):
                hint = ("searchsorted gives the insertion point, the next level up, not the nearest: compare with the "
                        "midpoints between neighbouring levels, or take argmin |x - level|")
            else:
                hint = "argmin over the levels of |x - level| (the last dim after x[..., None] - levels), as uint8"
            fail(tried, f"index {got_index} (level {levels[got_index].item():.4f}) for x = {value:.4f} at {position}",
                 f"index {right} (level {levels[right].item():.4f})", hint)
    passed("nearest_level", "nearest NF4 (and other) levels for fp32/fp16/bf16 values of any shape, ends included")


# ----------------------------------------------------------------------------- GPTQ
GPTQ_TOLERANCE = 1.05   # the learner's layer-output error may exceed labkit's GPTQ by at most 5%
_GPTQ_FACTOR_HINT = ("the feedback must go through U, the UPPER Cholesky factor of the damped inverse Hessian, "
                     "Hinv = (H + damp * mean(diag H) * I)^-1 = U^T U (torch.linalg.cholesky(Hinv, upper=True)); for "
                     "column j: err = (w - q) / U[j, j], then W[:, j+1:] -= err[:, None] * U[j, j+1:]. Neither H itself, "
                     "nor inv(cholesky(H)).T (a factor of the other column order), nor the inverse without the Cholesky "
                     "step (right for the first column only)")


def _gptq_inputs(seed: int, d_out: int, d_in: int, rows: int, outliers: int, dead: int):
    """``(weight, X, dead_features)``: calibration inputs ``X [rows, d_in]`` whose features are strongly correlated
    (a rank-``d_in / 4`` mixture plus a little noise: what GPTQ's feedback exploits), ``outliers`` features 8x
    larger than the rest, ``dead`` features zero in every row, and a weight whose dead columns are the largest
    entries of their rows (a solution that keeps them gets a coarser scale for nothing)."""
    gen = torch.Generator().manual_seed(seed)
    rank = max(2, d_in // 4)
    X = torch.randn(rows, rank, generator=gen) @ torch.randn(rank, d_in, generator=gen)
    X = X + 0.3 * torch.randn(rows, d_in, generator=gen)
    features = torch.randperm(d_in, generator=gen)
    X[:, features[:outliers]] *= 8.0
    dead_features = features[outliers: outliers + dead].sort().values
    X[:, dead_features] = 0.0
    weight = torch.randn(d_out, d_in, generator=gen) * 0.1
    weight[:, dead_features] *= 10.0
    return weight, X, dead_features


def _gptq_cases():
    """(tried, weight, X, bits, group_size, dead features)."""
    cases = []
    for seed, d_out, d_in, rows, outliers, dead, bits, group, dtype, note in [
        (61, 24, 32, 256, 2, 0, 3, None, torch.float32, ""),
        (62, 16, 48, 256, 2, 0, 4, 16, torch.float32, ""),
        (63, 20, 40, 24, 2, 3, 3, None, torch.float32, ", only 24 rows: X^T X is singular"),
        (64, 12, 64, 200, 3, 0, 2, 32, torch.bfloat16, ""),
        (65, 9, 36, 100, 2, 2, 4, 12, torch.float32, ""),
    ]:
        weight, X, dead_features = _gptq_inputs(seed, d_out, d_in, rows, outliers, dead)
        scales = "one scale per row" if group is None else f"group_size={group}"
        tried = (f"gptq_quantize(weight [{d_out}, {d_in}] in {str(dtype).replace('torch.', '')}, X [{rows}, {d_in}] with "
                 f"correlated features, {outliers} outlier features"
                 + (f", dead features {dead_features.tolist()} (zero in every row of X)" if dead else "")
                 + f"{note}, bits={bits}, {scales}, damp=0.01)")
        cases.append((tried, weight.to(dtype), X, bits, group, dead_features))
    return cases


def _expand(scale: torch.Tensor, d_in: int) -> torch.Tensor:
    """Per-group scales ``[d_out, groups]`` -> one per weight ``[d_out, d_in]``."""
    return scale.repeat_interleave(d_in // scale.shape[1], dim=1)


def gptq_quantize(fn) -> None:
    """Grade ``fn(weight, X, bits, group_size, damp) -> (codes, scale)``: GPTQ's column loop, symmetric integer codes.

    ``weight [d_out, d_in]`` (any float dtype, computed in fp32), calibration inputs ``X [rows, d_in]``,
    ``bits`` 2..8, ``group_size`` (``None``: one scale per output row) and ``damp`` (0.01).
    Returns ``codes`` (int8 ``[d_out, d_in]`` in ``[-qmax, qmax]``, ``qmax = 2^(bits-1) - 1``) and ``scale``
    (fp32 ``[d_out, d_in // group_size]``, ``[d_out, 1]`` per row), dequantized as ``codes * scale`` of the
    codes' group. Graded on the layer-output error ``||X W^T - X W_hat^T|| / ||X W^T||``: at most 5% above
    labkit's ``gptq_quantize`` on every input (which is far below round-to-nearest's there), on correlated
    inputs with outlier features, dead features (zero in every row of ``X``: their weights become 0 before
    any scale is computed, their codes are 0) and fewer rows than features (only the damping makes H
    invertible). Per-row scales (and the first group's) must be round-to-nearest's of that weight; a later group's
    scale may come from the weights as updated when the loop reaches the group (labkit, the paper's code) or
    from the original weights (AutoGPTQ's ``static_groups``): both are graded on the error alone."""
    cases = _gptq_cases()
    for tried, weight, X, bits, group, dead in cases:
        d_out, d_in = weight.shape
        qmax = 2 ** (bits - 1) - 1
        hint = ("X has fewer rows than features here, so H = 2 X^T X is singular: add damp * mean(diag H) to H's "
                "diagonal before inverting, and give dead features (H[j, j] == 0) H[j, j] = 1"
                if X.shape[0] < d_in else "run that call yourself and read the traceback")
        codes, scale = _call_twice(fn, tried, (weight, X, bits, group, 0.01), ("codes", "scale"), hint, _GPTQ_MUTATION_HINT)
        groups = 1 if group is None else d_in // group
        _expect_dtype_shape(codes, "codes", torch.int8, (d_out, d_in), tried,
                            f"one signed code per weight, as torch.int8 ({-qmax}..{qmax}), with weight's shape")
        _expect_dtype_shape(scale, "scale", torch.float32, (d_out, groups), tried,
                            "fp32 scales [d_out, d_in // group_size], [d_out, 1] with one scale per row, as "
                            "labkit.quant.gptq_quantize stores them")
        if not torch.isfinite(scale).all() or not (scale > 0).all():
            fail(tried, "a scale that is NaN, inf or not positive", "positive, finite scales",
                 "a NaN or inf comes from inverting an H that is (nearly) singular: damp it, H += damp * mean(diag H) * I, "
                 "and give an all-zero row of the weight scale 1")
        low, high = int(codes.min()), int(codes.max())
        if low < -qmax or high > qmax:
            fail(tried, f"codes from {low} to {high}", f"codes within [{-qmax}, {qmax}]",
                 f"clamp(round(w / scale), -{qmax}, {qmax}): the updated weights can leave the range the scale was set for")
        reference = Q.gptq_quantize(weight, X, bits, group)
        if len(dead) and (codes[:, dead] != 0).any():
            fail(tried, f"non-zero codes in the dead columns {dead.tolist()}", "code 0 there",
                 "a feature that is zero in every row of X never reaches the output: set W[:, dead] = 0 (and H[j, j] = 1) "
                 "before computing any scale, or its weight sets the row's scale for nothing")
        first = scale[:, :1].double()
        first_expected = reference.scale[:, :1].double()
        if not torch.allclose(first, first_expected, rtol=1e-4, atol=0):
            row = int((~torch.isclose(first, first_expected, rtol=1e-4, atol=0)).nonzero()[0, 0])
            fail(tried, f"scale {first[row, 0].item():.6g} of row {row}, first group",
                 f"{first_expected[row, 0].item():.6g} = max |w| over that group / {qmax}",
                 "the first group's (or the row's) scale is round-to-nearest's: absmax of the weight, dead columns zeroed, "
                 f"over the group, divided by {qmax}: nothing has been updated yet when the loop starts")
        dequantized = codes.double() * _expand(scale.double(), d_in)
        error = Q.layer_output_error(X, weight, dequantized)
        expected_error = Q.layer_output_error(X, weight, Q.dequantize(reference, torch.float32))
        no_dead = weight.float().clone()
        no_dead[:, dead] = 0.0
        rtn = Q.quantize(no_dead, bits, True, "channel" if group is None else "group", group)
        rtn_error = Q.layer_output_error(X, weight, Q.dequantize(rtn, torch.float32))
        if not math.isfinite(error) or error > GPTQ_TOLERANCE * expected_error:
            got_text = f"layer-output error {error:.4f} (round-to-nearest: {rtn_error:.4f})"
            expected_text = f"at most {GPTQ_TOLERANCE:.2f} x {expected_error:.4f}, labkit's GPTQ"
            if torch.equal(codes, rtn.codes):
                hint = ("your codes are round-to-nearest's: no rounding error reached the later columns. Each column's "
                        "err = (w - q) / U[j, j] must update W[:, j+1:] before they are quantized, through row j of the "
                        "UPPER factor U (a lower factor, or its column below the diagonal, is zero there)")
            elif error > 1.02 * rtn_error:
                hint = "the feedback makes the output worse than plain rounding: " + _GPTQ_FACTOR_HINT
            elif error > 0.98 * rtn_error:
                hint = ("the feedback barely changes round-to-nearest's result, so it is far too small: it must reach every "
                        "later column W[:, j+1:] (not only column j + 1), and divide the rounding error by U[j, j] (a small "
                        "number) before spreading it; " + _GPTQ_FACTOR_HINT)
            else:
                hint = ("the feedback helps, but less than GPTQ's: it must reach every later column W[:, j+1:] (not only "
                        "column j + 1), and " + _GPTQ_FACTOR_HINT)
            fail(tried, got_text, expected_text, hint)
    passed("gptq_quantize", f"layer-output error within {GPTQ_TOLERANCE - 1:.0%} of labkit's GPTQ (far below round-to-nearest's) "
                            f"on {len(cases)} layers: per-row scales and groups, 2-4 bits, correlated and outlier features, "
                            "dead features, fewer rows than features")
