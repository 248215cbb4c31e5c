"""The chapter-06 graders accept labkit's functions and a learner's plain solutions, and reject the
typical wrong answers with a hint that names the mistake."""
import labkit  # noqa: F401

import pytest
import torch

from labkit.checks import ch06_quant as checks  # the graders unwrapped: delegating to labkit is refused by the package-level ones (test_checks_refusal.py)
from labkit import quant as Q
from labkit.checks import CheckFailed


# ----------------------------------------------------------------------------- quantize_symmetric
def labkit_symmetric(x, bits, axis):
    q = Q.quantize(x, bits, True, "channel", axis=axis)
    return q.codes, q.scale


def symmetric(x, bits, axis, *, absmax=lambda x, axis: x.abs().amax(dim=axis, keepdim=True), qmax=None,
              encode=lambda x, scale: torch.round(x / scale), clamp=True, to_fp32=True):
    """A learner's solution; the keyword arguments swap in one mistake at a time."""
    qmax = 2 ** (bits - 1) - 1 if qmax is None else qmax(bits)
    x = x.float() if to_fp32 else x
    amax = absmax(x, axis)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    codes = encode(x, scale)
    if clamp:
        codes = codes.clamp(-qmax, qmax)
    return codes.to(torch.int8), scale


def test_quantize_symmetric_accepts_labkit_and_a_plain_solution(capsys):
    checks.quantize_symmetric(labkit_symmetric)
    checks.quantize_symmetric(symmetric)
    # x * (1 / scale), like labkit, or x / scale: both are right (they differ only at ties)
    checks.quantize_symmetric(lambda x, b, a: symmetric(x, b, a, encode=lambda x, s: torch.round(x * (1 / s))))
    assert capsys.readouterr().out.count("✓ quantize_symmetric:") == 3


def _in_place(x, bits, axis):
    qmax = 2 ** (bits - 1) - 1
    x = x.float()  # the caller's tensor itself when it is fp32
    scale = x.abs().amax(dim=axis, keepdim=True).clamp(min=1e-30) / qmax
    scale = torch.where(x.abs().amax(dim=axis, keepdim=True) > 0, scale, torch.ones_like(scale))
    return x.div_(scale).round_().clamp_(-qmax, qmax).to(torch.int8), scale


_calls = []


def _stateful(x, bits, axis):
    _calls.append(1)
    codes, scale = symmetric(x, bits, axis)
    return codes, scale * (1 + 0.01 * (len(_calls) % 2))


def _zero_row_divides_by_zero(x, bits, axis):
    qmax = 2 ** (bits - 1) - 1
    scale = x.float().abs().amax(dim=axis, keepdim=True) / qmax
    return torch.round(x.float() / scale).nan_to_num(0).clamp(-qmax, qmax).to(torch.int8), scale


@pytest.mark.parametrize("wrong, words", [
    (lambda x, b, a: symmetric(x, b, a, absmax=lambda x, axis: x.amax(dim=axis, keepdim=True)), "absmax"),  # max, not absmax
    (lambda x, b, a: symmetric(x, b, a, qmax=lambda bits: 2 ** (bits - 1)), "2\\^\\(bits-1\\) - 1"),
    (lambda x, b, a: symmetric(x, b, a, encode=lambda x, s: torch.round(x) / s), "divide by the scale first, then round"),
    (lambda x, b, a: symmetric(x, b, a, encode=lambda x, s: (x / s).trunc()), "truncates"),  # a cast instead of round
    (lambda x, b, a: symmetric(x, b, a, absmax=lambda x, axis: x.abs().amax(dim=0, keepdim=True)), "axis"),  # wrong axis
    (lambda x, b, a: (symmetric(x, b, a)[0], symmetric(x, b, a)[1].squeeze(a)), "keepdim"),  # scale without the axis
    (lambda x, b, a: symmetric(x, b, a, absmax=lambda x, axis: x.abs().amax()), "axis"),  # one scale per tensor
    (lambda x, b, a: symmetric(x, b, a, to_fp32=False), "fp32"),  # scale in x's 16-bit dtype
    (lambda x, b, a: tuple(t.float() if t.dtype == torch.float32 else t for t in symmetric(x, b, a, to_fp32=False)), "fp32"),
    (lambda x, b, a: (symmetric(x, b, a)[0].long(), symmetric(x, b, a)[1]), "int8"),
    (lambda x, b, a: symmetric(x, b, a)[0], "tuple"),
    (_zero_row_divides_by_zero, "all-zero"),
    (_in_place, "modified"),
    (_stateful, "second call"),
])
def test_quantize_symmetric_rejects_typical_mistakes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.quantize_symmetric(wrong)


# ----------------------------------------------------------------------------- quantize_asymmetric
def labkit_asymmetric(x, bits, axis):
    q = Q.quantize(x, bits, False, "channel", axis=axis)
    return q.codes, q.scale, q.zero_point


def asymmetric(x, bits, axis, *, contains_zero=True, round_zero=True, clamp=True, round_first=False):
    qmax = 2**bits - 1
    x = x.float()
    lo, hi = x.amin(dim=axis, keepdim=True), x.amax(dim=axis, keepdim=True)
    if contains_zero:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    scale = (hi - lo) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = -lo / scale
    if round_zero:
        zero = torch.round(zero)
    if round_first:
        codes = torch.round(x) / scale + zero
    elif round_zero:
        codes = torch.round(x / scale) + zero
    else:
        codes = torch.round(x / scale + zero)
    if clamp:
        codes = codes.clamp(0, qmax)
    return codes.to(torch.uint8), scale, zero.clamp(0, qmax).to(torch.uint8)


def test_quantize_asymmetric_accepts_labkit_and_a_plain_solution(capsys):
    checks.quantize_asymmetric(labkit_asymmetric)
    checks.quantize_asymmetric(asymmetric)
    assert capsys.readouterr().out.count("✓ quantize_asymmetric:") == 2


def _float_zero_point(x, bits, axis):
    codes, scale, zero = asymmetric(x, bits, axis)
    return codes, scale, zero.float()


def _asymmetric_wrong_axis(x, bits, axis):
    return asymmetric(x.movedim(axis, -1).movedim(0, -1), bits, -1) if x.dim() > 1 else asymmetric(x, bits, axis)


@pytest.mark.parametrize("wrong, words", [
    (lambda x, b, a: asymmetric(x, b, a, clamp=False), "clamp"),
    (lambda x, b, a: asymmetric(x, b, a, round_zero=False), "round"),  # zero point truncated when stored
    (_float_zero_point, "round it"),
    (lambda x, b, a: asymmetric(x, b, a, contains_zero=False), "contain 0"),
    (lambda x, b, a: asymmetric(x, b, a, round_first=True), "divide by the scale first, then round"),
    (_asymmetric_wrong_axis, "axis"),
    (lambda x, b, a: asymmetric(x, b, a)[:2], "zero_point"),
])
def test_quantize_asymmetric_rejects_typical_mistakes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.quantize_asymmetric(wrong)


def test_asymmetric_zero_point_not_rounded_before_adding_is_named():
    def zero_added_unrounded(x, bits, axis):
        codes, scale, zero = asymmetric(x, bits, axis)
        lo = x.float().amin(dim=axis, keepdim=True).clamp(max=0)
        codes = torch.round(x.float() / scale - lo / scale).clamp(0, 2**bits - 1)
        return codes.to(torch.uint8), scale, zero

    with pytest.raises(CheckFailed, match="round the zero point"):
        checks.quantize_asymmetric(zero_added_unrounded)


# ----------------------------------------------------------------------------- packing
def packed_low_first(codes):
    nibbles = codes.to(torch.int16) & 0xF
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).to(torch.uint8)


def unpacked(packed, signed):
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).to(torch.int16)
    return torch.where(nibbles >= 8, nibbles - 16, nibbles).to(torch.int8) if signed else nibbles.to(torch.uint8)


def _packed_through_view(codes):
    pairs = (codes.to(torch.int16) & 0xF).view(-1, 2)  # fails on a transposed view: its rows are not contiguous
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8).view(*codes.shape[:-1], -1)


def test_packing_graders_accept_labkit_and_plain_solutions(capsys):
    checks.pack_int4(Q.pack_int4)
    checks.pack_int4(packed_low_first)
    checks.unpack_int4(Q.unpack_int4)
    checks.unpack_int4(unpacked)
    out = capsys.readouterr().out
    assert out.count("✓ pack_int4:") == 2 and out.count("✓ unpack_int4:") == 2


@pytest.mark.parametrize("wrong, words", [
    (lambda c: ((c.to(torch.int16) & 0xF)[..., 0::2] << 4 | (c.to(torch.int16) & 0xF)[..., 1::2]).to(torch.uint8), "LOW nibble"),
    (lambda c: (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8), "sign"),  # the low code's sign bits spill over
    (lambda c: packed_low_first(c.abs()), "sign"),  # sign lost
    (lambda c: packed_low_first((c.to(torch.int16) + 8) if c.dtype == torch.int8 else c), "sign"),  # offset binary
    (lambda c: packed_low_first(c).to(torch.int16), "uint8"),
    (lambda c: packed_low_first(c.flatten()), "shape"),
    (lambda c: _packed_through_view(c), "non-contiguous"),
])
def test_pack_int4_rejects_typical_mistakes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.pack_int4(wrong)


@pytest.mark.parametrize("wrong, words", [
    (lambda p, signed: unpacked(p, False).to(torch.int8) if signed else unpacked(p, False), "sign-extend"),
    (lambda p, signed: torch.where(unpacked(p, False).to(torch.int16) > 8, unpacked(p, False).to(torch.int16) - 16,
                                   unpacked(p, False).to(torch.int16)).to(torch.int8) if signed else unpacked(p, False), "sign-extend"),
    (lambda p, signed: unpacked(((p & 0xF) << 4) | (p >> 4), signed), "low nibble first"),
    (lambda p, signed: unpacked(p, signed).long(), "dtype"),
    (lambda p, signed: unpacked(p, signed)[..., ::2], "shape"),
])
def test_unpack_int4_rejects_typical_mistakes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.unpack_int4(wrong)


# ----------------------------------------------------------------------------- NF4 lookup
def nearest_by_argmin(normalized, levels):
    return (normalized.float()[..., None] - levels).abs().argmin(dim=-1).to(torch.uint8)


def test_nearest_level_accepts_labkit_and_argmin(capsys):
    checks.nearest_level(Q.nearest_level)
    checks.nearest_level(nearest_by_argmin)
    assert capsys.readouterr().out.count("✓ nearest_level:") == 2


@pytest.mark.parametrize("wrong, words", [
    (lambda x, levels: torch.searchsorted(levels, x.float().contiguous()).clamp(max=len(levels) - 1).to(torch.uint8), "searchsorted"),
    (lambda x, levels: levels[nearest_by_argmin(x, levels).long()], "not the level's value"),
    (lambda x, levels: torch.round((x.float() + 1) / 2 * (len(levels) - 1)).to(torch.uint8), "argmin"),  # a uniform grid
    (lambda x, levels: nearest_by_argmin(x, levels).long(), "uint8"),
    (lambda x, levels: (x.float()[..., None] - levels).abs().argmin(dim=0).to(torch.uint8), "shape"),
])
def test_nearest_level_rejects_typical_mistakes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.nearest_level(wrong)


def test_failures_say_what_was_tried_got_expected_and_a_hint():
    with pytest.raises(CheckFailed) as info:
        checks.quantize_asymmetric(lambda x, b, a: asymmetric(x, b, a, clamp=False))
    message = str(info.value)
    for part in ("tried:", "got:", "expected:", "hint:", "quantize_asymmetric("):
        assert part in message


# ----------------------------------------------------------------------------- GPTQ
def labkit_gptq(weight, X, bits, group_size, damp):
    q = Q.gptq_quantize(weight, X, bits, group_size, damp=damp)
    return q.codes, q.scale


def gptq(weight, X, bits, group_size=None, damp=0.01, *, factor="cholesky of the inverse", dead_columns=True, damped=True,
         static_groups=False, next_column_only=False, divide_by_diagonal=True, sign=1.0, copy=True):
    """A learner's solution (no lazy batches, H unnormalised); the keyword arguments swap in one mistake at a time."""
    W = weight.float().clone() if copy else weight.float()
    X = X.float()
    d_out, d_in = W.shape
    qmax = 2 ** (bits - 1) - 1
    H = 2 * X.T @ X
    if dead_columns:
        dead = H.diagonal() == 0
        H[dead, dead] = 1.0
        W[:, dead] = 0.0
    if damped:
        H += damp * H.diagonal().mean() * torch.eye(d_in)
    U = {"cholesky of the inverse": lambda: torch.linalg.cholesky(torch.linalg.inv(H), upper=True),
         "H": lambda: H,
         "inverse": lambda: torch.linalg.inv(H),
         "lower": lambda: torch.linalg.cholesky(torch.linalg.inv(H)),
         "transposed": lambda: torch.linalg.inv(torch.linalg.cholesky(H)).T}[factor]()
    group = group_size or d_in
    original = W.clone()
    codes = torch.zeros(d_out, d_in, dtype=torch.int8)
    scale = torch.zeros(d_out, d_in // group)
    for j in range(d_in):
        if j % group == 0:
            absmax = (original if static_groups else W)[:, j:j + group].abs().amax(dim=1)
            s = torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))
            scale[:, j // group] = s
        q = torch.clamp(torch.round(W[:, j] / s), -qmax, qmax)
        codes[:, j] = q.to(torch.int8)
        err = W[:, j] - q * s
        if divide_by_diagonal:
            err = err / U[j, j]
        if next_column_only:
            if j + 1 < d_in:
                W[:, j + 1] -= sign * err * U[j, j + 1]
        else:
            W[:, j + 1:] -= sign * err[:, None] * U[j, j + 1:][None, :]
    return codes, scale


def test_gptq_quantize_accepts_labkit_and_a_plain_solution(capsys):
    checks.gptq_quantize(labkit_gptq)
    checks.gptq_quantize(gptq)
    checks.gptq_quantize(lambda *a: gptq(*a, static_groups=True))  # group scales from the original weights: AutoGPTQ's option
    assert capsys.readouterr().out.count("✓ gptq_quantize:") == 3


def test_gptq_grader_inputs_make_gptq_clearly_better_than_rounding():
    for tried, weight, X, bits, group, dead in checks._gptq_cases():
        no_dead = weight.float().clone()
        no_dead[:, dead] = 0
        rtn = Q.dequantize(Q.quantize(no_dead, bits, True, "channel" if group is None else "group", group), torch.float32)
        gptq_error = Q.layer_output_error(X, weight, Q.dequantize(Q.gptq_quantize(weight, X, bits, group), torch.float32))
        assert gptq_error < 0.7 * Q.layer_output_error(X, weight, rtn), tried


def _dequantized_instead(weight, X, bits, group_size, damp):
    codes, scale = gptq(weight, X, bits, group_size, damp)
    return codes * scale.repeat_interleave(weight.shape[1] // scale.shape[1], dim=1)


@pytest.mark.parametrize("wrong, words", [
    (lambda *a: gptq(*a, factor="lower"), "round-to-nearest's"),          # no feedback reaches later columns: RTN
    (lambda *a: gptq(*a, divide_by_diagonal=False), "divide the rounding error by U"),  # feedback far too small
    (lambda *a: gptq(*a, factor="H"), "worse than plain rounding"),       # H where its inverse's factor belongs
    (lambda *a: gptq(*a, factor="transposed"), "worse than plain rounding"),  # inv(cholesky(H)).T: the other order's factor
    (lambda *a: gptq(*a, factor="inverse"), "inverse without the Cholesky"),  # OBS's first step repeated without updating
    (lambda *a: gptq(*a, next_column_only=True), "not only"),
    (lambda *a: gptq(*a, sign=-1.0), "worse than plain rounding"),
    (lambda *a: gptq(*a, damped=False), "damp"),                          # singular H on 24 rows of 40 features
    (lambda *a: gptq(*a, dead_columns=False), "dead"),
    (lambda *a: gptq(*a, copy=False), "modified"),                        # updates the caller's fp32 weight in place
    (lambda weight, X, bits, group_size, damp: Q.dequantize(Q.quantize(weight, bits, True, "channel")), "tuple"),
    (_dequantized_instead, "tuple"),
    (lambda *a: (gptq(*a)[0].long(), gptq(*a)[1]), "int8"),
    (lambda *a: (gptq(*a)[0], gptq(*a)[1].double()), "float32"),
])
def test_gptq_quantize_rejects_typical_mistakes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.gptq_quantize(wrong)


def test_gptq_grader_is_fast():
    import time

    start = time.perf_counter()
    checks.gptq_quantize(gptq)
    assert time.perf_counter() - start < 3.0


@pytest.mark.parametrize("grader, answer", [
    ("gptq_quantize", labkit_gptq),
    ("quantize_symmetric", labkit_symmetric),
    ("quantize_asymmetric", labkit_asymmetric),
])
def test_the_packaged_graders_refuse_labkits_own_answer(grader, answer):
    from labkit import checks as packaged
    from labkit.checks import DelegationRefused

    with pytest.raises(DelegationRefused, match="write it yourself"):
        getattr(packaged, grader)(answer)
