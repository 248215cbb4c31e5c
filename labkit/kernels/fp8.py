"""FP8 scaled cast: ``codes = fp8(x / scale)`` and back, with the rounding done by hand.

How a float cast really works, written with integer operations on the fp32 bit pattern
(``sign | 8-bit exponent | 23-bit mantissa``) of ``v = x / scale``:

* **normal range** (``|v| >= 2^(1-bias)``): keep the top ``m`` mantissa bits. Round to nearest
  even by adding ``0b0111..1`` (half an fp8 step minus one) plus the last kept bit, then shift
  right; a carry out of the mantissa bumps the exponent, which is exactly right. Re-bias the
  exponent by subtracting ``(127 - bias) << m``.
* **subnormal range**: the code is the number of ``2^(1-bias-m)`` steps in ``|v|``, i.e. the
  24-bit significand shifted right by ``151 - bias - m - exponent``, rounded half to even.
* **saturation**: positive fp32 bit patterns are ordered like their values, so clamping the
  pattern at the pattern of ``fmt.max`` clamps the value (and inf) before any rounding.
  Values beyond ±max therefore become ±max (the "satfinite" behaviour FP8 training wants);
  NaN stays NaN (the code :func:`labkit.formats.encode` gives NaN: ``S.1111.111`` in E4M3,
  the quiet NaN ``S.11111.10`` in E5M2).

This also sidesteps Triton's CPU interpreter, whose built-in fp8 casts are wrong for some
values: only int32 and fp32 operations are used. The division is ``div_rn`` (IEEE
round-to-nearest), because plain ``/`` compiles to an approximate division on NVIDIA GPUs and
a 1-ulp-off quotient can land on the other side of a rounding tie.

Without a ``scale``, a first kernel reduces ``amax = max |x|`` over the finite entries with an
atomic max and the cast kernel derives ``scale = amax / fmt.max`` on the device (no host sync).
"""
from __future__ import annotations

import math
import struct

import numpy as np
import torch
import triton
import triton.language as tl

# The formats come from labkit.formats, not from the chapter module labkit.precision: that
# one imports the kernels, and kernels sit below the chapters (tests/test_layers.py).
from labkit.formats import FloatFormat, encode, get_format
from labkit.kernels._common import check_kernel_tensor
from labkit.runtime import triton_mode

FP8_FORMATS = ("fp8_e4m3", "fp8_e5m2")


def _fp8_format(fmt: str | FloatFormat) -> FloatFormat:
    fmt = get_format(fmt)
    if fmt.name not in FP8_FORMATS:
        raise ValueError(f"fmt={fmt.name!r}: the FP8 kernel supports {FP8_FORMATS}")
    return fmt


# ----------------------------------------------------------------------------- reference
def fp8_quantize_reference(x: torch.Tensor, fmt: str | FloatFormat = "fp8_e4m3", scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's own cast with the kernel's semantics: ``clamp(x / scale, ±max)`` cast to FP8."""
    fmt = _fp8_format(fmt)
    x32 = x.float()
    if scale is None:
        finite = x32.abs()[torch.isfinite(x32)]
        amax = finite.max() if finite.numel() else torch.zeros((), device=x.device)
        scale = torch.where(amax > 0, amax / fmt.max, torch.ones_like(amax))
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(())
    clamped = (x32 / scale).clamp(-fmt.max, fmt.max)  # clamp keeps NaN
    return clamped.to(fmt.torch_dtype).view(torch.uint8), scale


def fp8_dequantize_reference(codes: torch.Tensor, scale, fmt: str | FloatFormat = "fp8_e4m3") -> torch.Tensor:
    fmt = _fp8_format(fmt)
    return codes.view(fmt.torch_dtype).float() * torch.as_tensor(scale, dtype=torch.float32, device=codes.device)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _finite_amax_kernel(X, AMAX, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offsets, mask=offsets < n, other=0.0).to(tl.float32)
    magnitude = tl.abs(x)
    # NaN fails the comparison, inf equals it: neither may set the scale.
    magnitude = tl.where(magnitude < float("inf"), magnitude, 0.0)
    tl.atomic_max(AMAX, tl.max(magnitude, axis=0))


@triton.jit
def _round_to_code(v, MANTISSA_BITS: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr,
                   MIN_NORMAL_BITS: tl.constexpr, SIGN_BIT: tl.constexpr):
    """Codes (int32) of fp32 ``v`` in a small float format with ``MANTISSA_BITS`` and ``BIAS``: round to
    nearest even with integer arithmetic on the bits (the interpreter's fp8 casts are wrong for some values),
    saturating at ``MAX_BITS`` (the fp32 bits of the format's max), sign in ``SIGN_BIT``. Below
    ``MIN_NORMAL_BITS`` it counts steps of the subnormal spacing; a NaN comes out as the max code."""
    bits = v.to(tl.int32, bitcast=True)
    negative = bits < 0
    magnitude = tl.minimum(bits & 0x7FFFFFFF, MAX_BITS)  # saturate: |v| > max becomes max
    # Normal range: drop 23 - m mantissa bits, rounding half to even; re-bias the exponent.
    drop: tl.constexpr = 23 - MANTISSA_BITS
    last_kept = (magnitude >> drop) & 1
    normal_code = ((magnitude + ((1 << (drop - 1)) - 1) + last_kept) >> drop) - ((127 - BIAS) << MANTISSA_BITS)
    # Subnormal range: count steps of 2^(1 - bias - m), rounding half to even; the significand has its implicit 1
    # unless v is itself an fp32 subnormal (exponent field 0), far below any step. The count may reach 1 << m:
    # the smallest normal, correctly.
    exponent = magnitude >> 23
    significand = tl.where(exponent > 0, (magnitude & 0x7FFFFF) | 0x800000, magnitude)
    shift = tl.minimum(151 - BIAS - MANTISSA_BITS - tl.maximum(exponent, 1), 30)
    steps = significand >> shift
    remainder = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (remainder > half) | ((remainder == half) & ((steps & 1) == 1))
    code = tl.where(magnitude < MIN_NORMAL_BITS, steps + round_up.to(tl.int32), normal_code)
    return tl.where(negative, code | SIGN_BIT, code)


@triton.jit
def _fp8_quantize_kernel(
    X, CODES, SCALE, AMAX, n,
    MANTISSA_BITS: tl.constexpr, BIAS: tl.constexpr, MAX_VALUE: tl.constexpr,
    MAX_BITS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, NAN_CODE: tl.constexpr,
    SCALE_FROM_AMAX: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if SCALE_FROM_AMAX:
        amax = tl.load(AMAX)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, MAX_VALUE), 1.0)
        if pid == 0:
            tl.store(SCALE, scale)
    else:
        scale = tl.load(SCALE)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.math.div_rn(x, tl.zeros_like(x) + scale)

    code = _round_to_code(v, MANTISSA_BITS, BIAS, MAX_BITS, MIN_NORMAL_BITS, 0x80)  # ±inf saturate to ±max
    is_nan = (v.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000
    code = tl.where(is_nan, NAN_CODE | (code & 0x80), code)
    tl.store(CODES + offsets, code.to(tl.uint8), mask=mask)


@triton.jit
def _fp8_dequantize_kernel(
    CODES, SCALE, Y, n,
    MANTISSA_BITS: tl.constexpr, BIAS: tl.constexpr, MIN_SUBNORMAL: tl.constexpr,
    IEEE_SPECIALS: tl.constexpr, BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    code = tl.load(CODES + offsets, mask=mask, other=0).to(tl.int32)
    magnitude = code & 0x7F
    exponent = magnitude >> MANTISSA_BITS
    mantissa = magnitude & ((1 << MANTISSA_BITS) - 1)
    # A normal fp8 value is an fp32 with the exponent re-biased and the mantissa left-aligned.
    normal_bits = ((exponent - BIAS + 127) << 23) | (mantissa << (23 - MANTISSA_BITS))
    value = tl.where(exponent > 0, normal_bits.to(tl.float32, bitcast=True), mantissa.to(tl.float32) * MIN_SUBNORMAL)
    if IEEE_SPECIALS:  # e5m2: top exponent is inf (mantissa 0) or NaN
        top = exponent == (1 << (7 - MANTISSA_BITS)) - 1
        value = tl.where(top & (mantissa == 0), float("inf"), value)
        value = tl.where(top & (mantissa != 0), float("nan"), value)
    else:  # e4m3fn: only S.1111.111 is NaN
        value = tl.where(magnitude == 0x7F, float("nan"), value)
    value = tl.where(code >= 0x80, -value, value)
    tl.store(Y + offsets, value * tl.load(SCALE), mask=mask)


# ----------------------------------------------------------------------------- launchers
def _block_size(n: int) -> int:
    # The interpreter pays per program, a GPU wants many programs: big blocks only on the CPU.
    cap = 16384 if triton_mode() == "interpreter" else 1024
    return max(16, min(cap, triton.next_power_of_2(max(n, 1))))


def _fp32_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _scale_tensor(scale, device) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale: expected a single number (per-tensor scale), got shape {tuple(scale.shape)}")
        value = float(scale.item())
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        value = float(scale)
    else:
        raise TypeError(f"scale: expected None, a number or a one-element tensor, got {type(scale).__name__}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"scale={value}: expected a positive finite number")
    return torch.tensor(value, dtype=torch.float32, device=device)


def fp8_quantize(x: torch.Tensor, fmt: str | FloatFormat = "fp8_e4m3", scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (fp32/fp16/bf16, any shape) to FP8 codes with a per-tensor ``scale``.

    Returns ``(codes, scale)``: ``codes`` uint8 of ``x``'s shape, equal to
    ``(x / scale).to(torch.float8_*).view(torch.uint8)`` wherever ``|x / scale| <= fmt.max``,
    ±max beyond (saturating), NaN kept; ``scale`` a 0-d fp32 tensor. Without ``scale`` it is
    ``amax / fmt.max`` (amax over finite entries; 1 if there are none), so the largest entry
    lands on the format's largest value. Dequantize with ``codes_value * scale``.
    """
    fmt = _fp8_format(fmt)
    check_kernel_tensor("x", x)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scale_out = torch.ones((), dtype=torch.float32, device=x.device) if scale is None else _scale_tensor(scale, x.device)
    n = x.numel()
    if n == 0:
        return codes, scale_out
    flat = x.contiguous().view(-1)
    block = _block_size(n)
    grid = (triton.cdiv(n, block),)
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    # The interpreter runs the kernel with numpy, which warns about inf/NaN arithmetic that
    # IEEE defines (x / scale for x = inf, say); the GPU raises nothing.
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        if scale is None:
            _finite_amax_kernel[grid](flat, amax, n, BLOCK=block)
        _fp8_quantize_kernel[grid](
            flat, codes, scale_out, amax, n,
            MANTISSA_BITS=fmt.mantissa_bits, BIAS=fmt.bias, MAX_VALUE=fmt.max,
            MAX_BITS=_fp32_bits(fmt.max), MIN_NORMAL_BITS=_fp32_bits(fmt.min_normal),
            NAN_CODE=int(encode(math.nan, fmt).item()), SCALE_FROM_AMAX=scale is None, BLOCK=block,
        )
    return codes, scale_out


def fp8_dequantize(codes: torch.Tensor, scale, fmt: str | FloatFormat = "fp8_e4m3") -> torch.Tensor:
    """fp32 values of FP8 ``codes`` (uint8) times the per-tensor ``scale``."""
    fmt = _fp8_format(fmt)
    check_kernel_tensor("codes", codes, dtypes=(torch.uint8,))
    scale_t = _scale_tensor(scale, codes.device)
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    n = codes.numel()
    if n == 0:
        return out
    block = _block_size(n)
    with np.errstate(over="ignore", invalid="ignore"):  # inf * scale, NaN * scale under numpy
        _fp8_dequantize_kernel[(triton.cdiv(n, block),)](
            codes.contiguous().view(-1), scale_t, out, n,
            MANTISSA_BITS=fmt.mantissa_bits, BIAS=fmt.bias, MIN_SUBNORMAL=fmt.min_subnormal,
            IEEE_SPECIALS=fmt.has_inf, BLOCK=block,
        )
    return out
