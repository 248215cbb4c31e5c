"""Block-scaled cast: per-block amax, scale and element codes in one Triton kernel.

Each program loads a tile of whole blocks (``TILE_BLOCK_ROWS x TILE_BLOCK_COLS`` blocks of
``BLOCK_ROWS x BLOCK_COLS`` values), reshapes it to ``[block rows, rows, block cols, cols]`` and
reduces ``max |x|`` over each block, derives the block's scale, divides by it and rounds every
quotient to the element format, storing one uint8 code per value and one fp32 scale per block:

* ``"e8m0"`` (OCP MX): a power of two whose exponent comes from amax's fp32 bits with integer
  operations only: ``binade - emax_elem``, plus one when amax's mantissa field is larger than the
  element max's ("up", never clips), as is ("ocp", OCP MX v1.0 §6.3), or minus one when it is
  smaller ("down"); clamped to E8M0's -127..127; 1 for an all-zero block.
* ``"fp32"`` (DeepSeek-V3): ``amax / element max``, 1 for an all-zero block.
* ``"e4m3+fp32"`` (NVFP4): a first pass reduces the tensor's amax (the FP8 kernel's
  ``_finite_amax_kernel``), the tensor scale is ``amax / (6 * 448)``, and each block scale is
  ``amax_block / 6 / tensor_scale`` rounded to E4M3 with the same integer rounding as the
  elements; a block scale of 0 gives its elements the code of ±0.

The rounding is the FP8 kernel's (:mod:`labkit.kernels.fp8`): integer operations on the fp32 bit
pattern, round half to even, saturating at ±max, written here for any element width (E4M3, E5M2,
E3M2, E2M3, E2M1: the sign bit is bit ``bits - 1``). Only int32 and fp32 operations are used, so
Triton's CPU interpreter (whose fp8 casts are wrong for some values) gives the GPU's answer, and
divisions are ``div_rn`` (plain ``/`` is approximate on NVIDIA GPUs).

The pure-PyTorch reference is :func:`labkit.block_formats.quantize_blocks`, one layer up (it
builds on chapter 01's ``encode``); tests/test_kernels_block_scale.py checks that the codes and
scales agree bit for bit.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from labkit.formats import get_format
from labkit.kernels._common import check_kernel_tensor
from labkit.kernels.fp8 import _finite_amax_kernel, _fp32_bits, _round_to_code
from labkit.runtime import triton_mode

SCALE_KINDS = ("e8m0", "fp32", "e4m3+fp32")
ROUNDINGS = ("up", "ocp", "down")
ELEMENTS = ("fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1")
NVFP4_TENSOR_RANGE = 6.0 * 448.0  # largest E2M1 element x largest E4M3 block scale


# ----------------------------------------------------------------------------- device helpers
@triton.jit
def _positive_code_value(code, MANTISSA_BITS: tl.constexpr, BIAS: tl.constexpr, MIN_SUBNORMAL: tl.constexpr):
    """fp32 value of a non-negative finite code (the E4M3 block scale of NVFP4)."""
    exponent = code >> MANTISSA_BITS
    mantissa = code & ((1 << MANTISSA_BITS) - 1)
    normal_bits = ((exponent - BIAS + 127) << 23) | (mantissa << (23 - MANTISSA_BITS))
    return tl.where(exponent > 0, normal_bits.to(tl.float32, bitcast=True), mantissa.to(tl.float32) * MIN_SUBNORMAL)


# ----------------------------------------------------------------------------- the kernel
@triton.jit
def _block_quantize_kernel(
    X, CODES, SCALES, TENSOR_SCALE, AMAX, rows, cols, scale_rows, scale_cols,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, TILE_BLOCK_ROWS: tl.constexpr, TILE_BLOCK_COLS: tl.constexpr,
    SCALE_KIND: tl.constexpr, ROUNDING: tl.constexpr, EMAX: tl.constexpr, MAX_MANTISSA_FIELD: tl.constexpr,
    MAX_VALUE: tl.constexpr, MANTISSA_BITS: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr,
    MIN_NORMAL_BITS: tl.constexpr, SIGN_BIT: tl.constexpr,
):
    TILE_ROWS: tl.constexpr = TILE_BLOCK_ROWS * BLOCK_ROWS
    TILE_COLS: tl.constexpr = TILE_BLOCK_COLS * BLOCK_COLS
    row = tl.program_id(0).to(tl.int64) * TILE_ROWS + tl.arange(0, TILE_ROWS)
    col = tl.program_id(1).to(tl.int64) * TILE_COLS + tl.arange(0, TILE_COLS)
    mask = (row[:, None] < rows) & (col[None, :] < cols)
    offsets = row[:, None] * cols + col[None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)  # 0 outside: no effect on amax

    # Per-block amax: [rows, cols] -> [block rows, rows, block cols, cols] -> max over each block.
    blocks = tl.reshape(tl.abs(x), (TILE_BLOCK_ROWS, BLOCK_ROWS, TILE_BLOCK_COLS, BLOCK_COLS))
    amax = tl.max(tl.max(blocks, axis=3), axis=1)  # [TILE_BLOCK_ROWS, TILE_BLOCK_COLS]

    if SCALE_KIND == 0:  # e8m0: integer exponent arithmetic on amax's fp32 bits
        amax_bits = amax.to(tl.int32, bitcast=True)
        scale_exponent = (amax_bits >> 23) - 127 - EMAX  # "ocp": floor(log2 amax) - emax_elem
        if ROUNDING == 0:  # "up": one binade more when amax's significand exceeds the element max's
            scale_exponent += ((amax_bits & 0x7FFFFF) > MAX_MANTISSA_FIELD).to(tl.int32)
        elif ROUNDING == 2:  # "down"
            scale_exponent -= ((amax_bits & 0x7FFFFF) < MAX_MANTISSA_FIELD).to(tl.int32)
        scale_exponent = tl.where(amax > 0, scale_exponent, 0)
        scale_exponent = tl.minimum(tl.maximum(scale_exponent, -127), 127)
        # 2^e as fp32 bits; 2^-127 is the fp32 subnormal 0x00400000.
        scale = tl.where(scale_exponent >= -126, (scale_exponent + 127) << 23, 0x400000).to(tl.float32, bitcast=True)
        divisor = scale
    elif SCALE_KIND == 1:  # fp32: amax / max
        scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.zeros_like(amax) + MAX_VALUE), 1.0)
        divisor = scale
    else:  # e4m3 block scale x fp32 tensor scale
        tensor_amax = tl.load(AMAX)
        # 2688 = NVFP4_TENSOR_RANGE = 6 * 448
        tensor_scale = tl.where(tensor_amax > 0, tl.math.div_rn(tensor_amax, 2688.0), 1.0)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(TENSOR_SCALE, tensor_scale)
        raw = tl.math.div_rn(tl.math.div_rn(amax, tl.zeros_like(amax) + MAX_VALUE), tl.zeros_like(amax) + tensor_scale)
        # E4M3: 3 mantissa bits, bias 7, max 448 = 0x43E00000, min normal 2^-6 = 0x3C800000.
        scale = _positive_code_value(_round_to_code(raw, 3, 7, 0x43E00000, 0x3C800000, 0x80), 3, 7, 0.001953125)  # E4M3 min subnormal 2^-9
        divisor = tl.where(scale > 0, scale * tensor_scale, float("inf"))

    block_row = tl.program_id(0).to(tl.int64) * TILE_BLOCK_ROWS + tl.arange(0, TILE_BLOCK_ROWS)
    block_col = tl.program_id(1).to(tl.int64) * TILE_BLOCK_COLS + tl.arange(0, TILE_BLOCK_COLS)
    scale_mask = (block_row[:, None] < scale_rows) & (block_col[None, :] < scale_cols)
    tl.store(SCALES + block_row[:, None] * scale_cols + block_col[None, :], scale, mask=scale_mask)

    # Every value divided by its block's divisor, then rounded to the element format.
    divisor_4d = tl.broadcast_to(divisor[:, None, :, None], (TILE_BLOCK_ROWS, BLOCK_ROWS, TILE_BLOCK_COLS, BLOCK_COLS))
    v = tl.math.div_rn(x, tl.reshape(divisor_4d, (TILE_ROWS, TILE_COLS)))
    code = _round_to_code(v, MANTISSA_BITS, BIAS, MAX_BITS, MIN_NORMAL_BITS, SIGN_BIT)
    tl.store(CODES + offsets, code.to(tl.uint8), mask=mask)



# ----------------------------------------------------------------------------- launcher
def _tile_blocks(block: tuple[int, int], rows: int, cols: int) -> tuple[int, int]:
    """Blocks per program along rows and columns: big tiles under the interpreter (it pays per
    program), about 4096 values on a GPU."""
    budget = 16384 if triton_mode() == "interpreter" else 4096
    block_rows, block_cols = block
    tile_cols = max(1, min(triton.next_power_of_2(-(-cols // block_cols)), max(1, budget // block_rows // block_cols)))
    tile_rows = max(1, min(triton.next_power_of_2(-(-rows // block_rows)), max(1, budget // (block_rows * block_cols * tile_cols))))
    return tile_rows, tile_cols


def block_quantize(x: torch.Tensor, element: str, block: tuple[int, int], scale: str,
                   rounding: str = "up") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize finite ``x`` (fp32/fp16/bf16) to ``element`` codes with one ``scale`` per
    ``block = (rows, cols)`` tile (a one-row block runs along the last dim of any tensor; a taller
    one tiles a 2-D tensor; partial blocks at the ends are masked).

    Returns ``(codes, scales, tensor_scale)``: uint8 codes of ``x``'s shape, fp32 scales of shape
    ``(*x.shape[:-1], ceil(K / cols))`` (or ``(ceil(M / rows), ceil(K / cols))``), and the 0-d fp32
    tensor scale for ``"e4m3+fp32"`` (None otherwise); equal, bit for bit, to
    :func:`labkit.block_formats.quantize_blocks` of the matching format. ``rounding`` ("up",
    "ocp", "down") only applies to E8M0 scales.
    """
    check_kernel_tensor("x", x)
    fmt = get_format(element)
    if fmt.name not in ELEMENTS:
        raise ValueError(f"element={fmt.name!r}: expected one of {ELEMENTS}")
    if scale not in SCALE_KINDS:
        raise ValueError(f"scale={scale!r}: expected one of {SCALE_KINDS}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r}: expected one of {ROUNDINGS}")
    if rounding != "up" and scale != "e8m0":
        raise ValueError(f"rounding={rounding!r}: only E8M0 scales are rounded to a power of two")
    if (not isinstance(block, tuple) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 and b & (b - 1) == 0 for b in block)):
        raise ValueError(f"block={block!r}: expected (rows, cols), both powers of two")
    if x.dim() == 0 or (block[0] > 1 and x.dim() != 2):
        raise ValueError(f"x: expected {'a 2-D tensor' if block[0] > 1 else 'at least one dimension'} for {block[0]}x{block[1]} blocks, got shape {tuple(x.shape)}")
    if scale == "e4m3+fp32" and fmt.name != "fp4_e2m1":
        raise ValueError("scale='e4m3+fp32' is NVFP4's scaling: expected element 'fp4_e2m1'")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x: contains inf or NaN; the block-scaled cast takes finite values")
    rows, cols = (x.numel() // x.shape[-1], x.shape[-1]) if x.shape[-1] else (0, 0)
    scale_rows, scale_cols = -(-rows // block[0]), -(-cols // block[1])
    scale_shape = (scale_rows, scale_cols) if block[0] > 1 else (*x.shape[:-1], scale_cols)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(scale_shape, dtype=torch.float32, device=x.device)
    tensor_scale = torch.ones((), dtype=torch.float32, device=x.device) if scale == "e4m3+fp32" else None
    if x.numel() == 0:
        return codes, scales, tensor_scale
    flat = x.contiguous().view(-1)
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    if scale == "e4m3+fp32":
        amax_block = 16384 if triton_mode() == "interpreter" else 1024
        _finite_amax_kernel[(triton.cdiv(flat.numel(), amax_block),)](flat, amax, flat.numel(), BLOCK=amax_block)
    tile_rows, tile_cols = _tile_blocks(block, rows, cols)
    grid = (triton.cdiv(scale_rows, tile_rows), triton.cdiv(scale_cols, tile_cols))
    max_bits = _fp32_bits(fmt.max)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # x / inf and friends under numpy
        _block_quantize_kernel[grid](
            flat, codes, scales, tensor_scale if tensor_scale is not None else amax, amax, rows, cols, scale_rows, scale_cols,
            BLOCK_ROWS=block[0], BLOCK_COLS=block[1], TILE_BLOCK_ROWS=tile_rows, TILE_BLOCK_COLS=tile_cols,
            SCALE_KIND=SCALE_KINDS.index(scale), ROUNDING=ROUNDINGS.index(rounding),
            EMAX=math.frexp(fmt.max)[1] - 1, MAX_MANTISSA_FIELD=max_bits & 0x7FFFFF, MAX_VALUE=fmt.max,
            MANTISSA_BITS=fmt.mantissa_bits, BIAS=fmt.bias, MAX_BITS=max_bits, MIN_NORMAL_BITS=_fp32_bits(fmt.min_normal),
            SIGN_BIT=1 << (fmt.bits - 1),
        )
    return codes, scales, tensor_scale
