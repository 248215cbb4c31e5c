"""Binary floating-point formats, read off their bits: the lowest layer of the precision chapter.

A binary float with ``e`` exponent bits, ``m`` mantissa bits and bias ``b`` stores
``sign | exponent field E | mantissa field M`` and means

* ``(-1)^sign * 2^(E - b) * (1 + M / 2^m)`` for ``E > 0`` (normal numbers),
* ``(-1)^sign * 2^(1 - b) * (M / 2^m)`` for ``E == 0`` (subnormals and ±0),

except for the codes a format reserves for inf/NaN. :class:`FloatFormat` describes a format,
:data:`FORMATS` / :func:`get_format` name the ones the course uses, and :func:`decode` /
:func:`encode` convert between codes and values (round-to-nearest-even, like the hardware and
PyTorch's casts).

Why a module of its own: the FP8 kernel (:mod:`labkit.kernels.fp8`) needs these definitions,
and the chapter module :mod:`labkit.precision` builds on the kernels, so the definitions sit
below both. This module imports nothing from labkit; chapter 01 reads it all through
``labkit.precision`` (``P.FloatFormat``, ``P.decode``, ...), which re-exports it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SPECIALS = ("ieee", "nan_only", "finite")


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format.

    ``specials`` says how it encodes inf/NaN:

    * ``"ieee"``: the all-ones exponent is reserved; mantissa 0 is ±inf, anything else NaN
      (fp32, fp16, bf16, fp8_e5m2).
    * ``"nan_only"``: no inf; only ``S.1111.111`` (all exponent and mantissa bits set, either
      sign: two codes, 0x7F and 0xFF in E4M3) is NaN, so the top binade holds ordinary numbers
      (fp8_e4m3, "E4M3FN": max 448 instead of 240).
    * ``"finite"``: every code is a number, no inf and no NaN (OCP MX fp6/fp4 elements).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    specials: str = "ieee"

    def __post_init__(self):
        if not isinstance(self.exponent_bits, int) or not 1 <= self.exponent_bits <= 11:
            raise ValueError(f"exponent_bits={self.exponent_bits!r}: expected an integer from 1 to 11")
        if not isinstance(self.mantissa_bits, int) or not 1 <= self.mantissa_bits <= 52:
            raise ValueError(f"mantissa_bits={self.mantissa_bits!r}: expected an integer from 1 to 52")
        if not isinstance(self.bias, int):
            raise TypeError(f"bias={self.bias!r}: expected an integer")
        if self.specials not in SPECIALS:
            raise ValueError(f"specials={self.specials!r}: expected one of {SPECIALS}")
        if self.specials == "ieee" and self.exponent_bits < 2:
            raise ValueError("exponent_bits: an 'ieee' format needs at least 2 exponent bits (one binade is reserved)")
        if self.bits > 63:
            raise ValueError(f"exponent_bits + mantissa_bits = {self.bits - 1}: at most 62 (codes are int64)")

    # ------------------------------------------------------------------ layout
    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def has_inf(self) -> bool:
        return self.specials == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.specials != "finite"

    @property
    def max_code(self) -> int:
        """The code (sign 0) of the largest finite value."""
        top = (1 << self.exponent_bits) - 1
        mant = (1 << self.mantissa_bits) - 1
        if self.specials == "ieee":
            return ((top - 1) << self.mantissa_bits) | mant
        if self.specials == "nan_only":
            return (top << self.mantissa_bits) | (mant - 1)
        return (top << self.mantissa_bits) | mant

    # ------------------------------------------------------------------ range and precision
    @property
    def max(self) -> float:
        """Largest finite value."""
        exponent, mantissa = divmod(self.max_code, 1 << self.mantissa_bits)
        return math.ldexp(1.0 + mantissa / (1 << self.mantissa_bits), exponent - self.bias)

    @property
    def min_normal(self) -> float:
        """Smallest positive value with the full ``1 + m`` bits of precision: ``2^(1-bias)``."""
        return math.ldexp(1.0, 1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value: one mantissa step above zero, ``2^(1-bias-m)``."""
        return math.ldexp(1.0, 1 - self.bias - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Distance from 1.0 to the next larger value: ``2^-m`` (the relative precision)."""
        return math.ldexp(1.0, -self.mantissa_bits)

    @property
    def decimal_digits(self) -> float:
        """Significant decimal digits the ``1 + m`` significand bits carry: ``(m + 1) log10 2``."""
        return (self.mantissa_bits + 1) * math.log10(2)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The matching PyTorch dtype, or None when torch has no (unpacked) dtype for it."""
        return _TORCH_DTYPES.get(self.name)

    def fields(self, code: int) -> tuple[int, int, int]:
        """``(sign, exponent field, mantissa field)`` of one code."""
        code = _check_code(code, self)
        m = self.mantissa_bits
        return code >> (self.bits - 1), (code >> m) & ((1 << self.exponent_bits) - 1), code & ((1 << m) - 1)


FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in (
        FloatFormat("fp32", 8, 23, 127),
        FloatFormat("fp16", 5, 10, 15),
        FloatFormat("bf16", 8, 7, 127),
        FloatFormat("fp8_e4m3", 4, 3, 7, "nan_only"),
        FloatFormat("fp8_e5m2", 5, 2, 15),
        FloatFormat("fp6_e3m2", 3, 2, 3, "finite"),
        FloatFormat("fp6_e2m3", 2, 3, 1, "finite"),
        FloatFormat("fp4_e2m1", 2, 1, 1, "finite"),
    )
}

_TORCH_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def get_format(fmt: str | FloatFormat) -> FloatFormat:
    """The :class:`FloatFormat` called ``fmt`` (a FloatFormat passes through)."""
    if isinstance(fmt, FloatFormat):
        return fmt
    if isinstance(fmt, str) and fmt in FORMATS:
        return FORMATS[fmt]
    raise ValueError(f"fmt={fmt!r}: unknown format; expected a FloatFormat or one of {sorted(FORMATS)}")


# ----------------------------------------------------------------------------- codes <-> values
def decode(codes, fmt: str | FloatFormat) -> torch.Tensor:
    """Values (float64) of the bit patterns ``codes`` (an integer tensor or int).

    Codes are ``0 .. 2^bits - 1``; negative codes are read as two's complement, so
    ``decode(t.view(torch.int16), "fp16")`` works as well as unsigned codes.
    """
    fmt = get_format(fmt)
    codes = _as_codes(codes, fmt)
    m, bits = fmt.mantissa_bits, fmt.bits
    sign = (codes >> (bits - 1)) & 1
    exponent = (codes >> m) & ((1 << fmt.exponent_bits) - 1)
    mantissa = (codes & ((1 << m) - 1)).double()
    # Subnormals have no implicit leading 1 and share the exponent of the smallest normals.
    normal = exponent > 0
    significand = torch.where(normal, mantissa + (1 << m), mantissa)
    power = torch.where(normal, exponent, torch.ones_like(exponent)) - fmt.bias - m
    magnitude = torch.ldexp(significand, power.double())
    top = (1 << fmt.exponent_bits) - 1
    if fmt.specials == "ieee":
        magnitude = torch.where(exponent == top, torch.where(mantissa == 0, math.inf, math.nan), magnitude)
    elif fmt.specials == "nan_only":
        magnitude = torch.where((codes & ((1 << (bits - 1)) - 1)) == fmt.max_code + 1, math.nan, magnitude)
    return torch.where(sign == 1, -magnitude, magnitude)


def encode(x, fmt: str | FloatFormat, saturate: bool | None = None) -> torch.Tensor:
    """The codes (int64) of the values of ``fmt`` nearest to ``x``, ties to the even code.

    Overflow (a value that rounds beyond ``fmt.max``, or ±inf) follows the format unless
    ``saturate`` says otherwise. ``None``: "ieee" formats give ±inf, the others clamp to ±max,
    which is what PyTorch's casts do since pytorch/pytorch#178817 (April 2026) made the eager
    float8_e4m3fn cast saturate; releases before it returned NaN, which ``saturate=False``
    reproduces. ``True`` always clamps to ±max, like the hardware's saturating "satfinite"
    casts. NaN stays NaN.
    """
    fmt = get_format(fmt)
    x = _as_values(x, "x")
    if saturate is None:
        saturate = fmt.specials != "ieee"
    if not saturate and fmt.specials == "finite":
        raise ValueError(f"saturate=False: {fmt.name} has no inf or NaN to overflow to; use saturate=True")
    nan = torch.isnan(x)
    if nan.any() and not fmt.has_nan:
        raise ValueError(f"x: contains NaN, which {fmt.name} cannot represent")
    m = fmt.mantissa_bits
    negative = torch.signbit(x)
    finite = torch.isfinite(x)
    magnitude = torch.where(finite, x.abs(), 0.0)
    binade = _binade(magnitude, fmt)
    steps = torch.round(torch.ldexp(magnitude, (m - binade).double())).long()  # round half to even
    carried = steps == (2 << m)  # rounding up to the next power of two
    binade = binade + carried.long()
    steps = torch.where(carried, torch.full_like(steps, 1 << m), steps)
    normal = steps >= (1 << m)
    exponent_field = torch.where(normal, binade + fmt.bias, torch.zeros_like(binade))
    magnitude_code = (exponent_field << m) | torch.where(normal, steps - (1 << m), steps)
    overflow = (magnitude_code > fmt.max_code) | ~finite
    if saturate:
        overflow_code = fmt.max_code
    else:
        overflow_code = ((1 << fmt.exponent_bits) - 1) << m if fmt.has_inf else fmt.max_code + 1
    magnitude_code = torch.where(overflow & ~nan, overflow_code, magnitude_code)
    if fmt.has_nan:
        nan_code = (((1 << fmt.exponent_bits) - 1) << m) | (1 << (m - 1)) if fmt.has_inf else fmt.max_code + 1
        magnitude_code = torch.where(nan, nan_code, magnitude_code)
    return torch.where(negative, magnitude_code | (1 << (fmt.bits - 1)), magnitude_code)


# ----------------------------------------------------------------------------- helpers
def _as_values(x, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bool or x.is_complex():
            raise TypeError(f"{name}: expected real numbers, got a {x.dtype} tensor")
        return x.detach().to(device="cpu", dtype=torch.float64)
    if isinstance(x, bool):
        raise TypeError(f"{name}: expected numbers, got a bool")
    try:
        return torch.as_tensor(x, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"{name}: expected a tensor or numbers, got {type(x).__name__}") from err


def _binade(magnitude: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """``floor(log2 |x|)``, but never below the smallest normal binade ``1 - bias``: values
    there (subnormals, zero) share that binade's spacing, which is what gradual underflow is."""
    _, frexp_exp = torch.frexp(magnitude)  # magnitude = f * 2^frexp_exp with f in [0.5, 1)
    return torch.where(magnitude > 0, frexp_exp.long() - 1, -(1 << 30)).clamp(min=1 - fmt.bias)


def _as_codes(codes, fmt: FloatFormat) -> torch.Tensor:
    if isinstance(codes, torch.Tensor):
        if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
            raise TypeError(f"codes: expected an integer tensor of bit patterns, got {codes.dtype}")
        codes = codes.detach().cpu().long()
    elif isinstance(codes, int) and not isinstance(codes, bool):
        codes = torch.tensor(codes, dtype=torch.int64)
    else:
        raise TypeError(f"codes: expected an integer tensor or int, got {type(codes).__name__}")
    if codes.numel() and (codes.min() < -(1 << (fmt.bits - 1)) or codes.max() >= (1 << fmt.bits)):
        raise ValueError(
            f"codes: {fmt.name} codes lie in [0, 2^{fmt.bits}) (or [-2^{fmt.bits - 1}, 0) as two's complement), "
            f"got min {int(codes.min())}, max {int(codes.max())}"
        )
    return codes & ((1 << fmt.bits) - 1)


def _check_code(code: int, fmt: FloatFormat) -> int:
    if not isinstance(code, int) or isinstance(code, bool) or not 0 <= code < (1 << fmt.bits):
        raise ValueError(f"code={code!r}: expected an integer in [0, {1 << fmt.bits}) for {fmt.name}")
    return code
