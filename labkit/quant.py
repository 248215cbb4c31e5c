"""Chapter 06, quantization: store weights (and activations) in a few bits and measure what it costs.

Everything here is written out in PyTorch so it can be read line by line:

* **Uniform (affine) quantization** - :func:`quantize` / :func:`dequantize`: ``x ~ scale * (q - zero_point)``
  with integer codes ``q``; symmetric or asymmetric; one scale per tensor, per channel or per
  group of ``group_size`` consecutive values. :func:`quantization_error` measures MSE and SQNR.
* **Storage** - :func:`bits_per_parameter` counts the bits a format spends per weight, scales
  included; :func:`pack_int4` / :func:`pack_bits` put the codes into bytes.
* **NF4** (QLoRA) - :func:`nf4_codebook`, the 16 levels at quantiles of a standard normal;
  :func:`nf4_quantize` with one absmax per block of 64 and, optionally, double quantization of
  those absmax values.
* **Outliers** - :func:`int8_mixed_matmul`, LLM.int8()'s decomposition: the few huge feature
  dimensions stay in 16/32-bit, the rest go through an int8 x int8 -> int32 matmul;
  :func:`smoothquant_scales`, SmoothQuant's migration of the activations' range into the weights.
* **GPTQ** - :func:`gptq_quantize`: quantize a layer column by column and let the columns not yet
  quantized absorb each rounding error, using the inverse Hessian of the layer's own inputs;
  :func:`awq_quantize`, AWQ's activation-aware scales searched on the same inputs.
* **Models** - :class:`QuantLinear` (packed weight-only int2..int8 / NF4, optionally the Triton
  kernel ``labkit.kernels.quant_matmul``), :func:`quantize_model`, :func:`evaluate_adder` and
  :func:`compare_quantizations` for accuracy vs bits per parameter on the shipped tiny adder.
* **KV cache** - :class:`QuantizedKVCache`, keys and values stored in 8 or fewer bits.
* **Play** - :func:`quantization_explorer`, the widget's callback.
"""
from __future__ import annotations

import copy
import fnmatch
import math
from dataclasses import dataclass

import torch
from torch import nn

from labkit.data import ArithmeticTask, get_batch
from labkit.nn import Linear
from labkit.train import TrainConfig, estimate_loss

GRANULARITIES = ("tensor", "channel", "group")
MIN_BITS, MAX_BITS = 2, 8
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# bitsandbytes' create_normal_map: the outermost quantile used for the +-1 levels. It is the mean
# of 1 - 1/(2*15) and 1 - 1/(2*16), the two natural choices for 15 and 16 quantile bins
# (the quantile at p = 1 itself would be infinite).
NF4_OFFSET = 0.9677083


# ============================================================================ uniform quantization
@dataclass(frozen=True)
class QuantizedTensor:
    """Integer codes plus everything needed to turn them back into numbers.

    ``codes`` has the original shape: ``int8`` for symmetric codes, ``uint8`` for asymmetric
    ones. ``scale`` (fp32) and ``zero_point`` (``uint8``, ``None`` when symmetric) have the
    original shape with ``axis`` replaced by the number of groups (1 for ``"channel"``), or are
    0-d for ``"tensor"``. The value of a code is ``scale * (code - zero_point)``.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    bits: int
    symmetric: bool
    granularity: str
    group_size: int | None
    axis: int
    shape: torch.Size
    dtype: torch.dtype
    full_range: bool = False

    @property
    def code_range(self) -> tuple[int, int]:
        return code_range(self.bits, self.symmetric, self.full_range)

    def levels(self, group_index: tuple[int, ...] = ()) -> torch.Tensor:
        """Every value the codes of one group can represent (fp32, ascending); ``group_index``
        indexes ``scale`` (``()`` for ``"tensor"``)."""
        qmin, qmax = self.code_range
        zero = 0 if self.zero_point is None else int(self.zero_point[group_index])
        return self.scale[group_index] * (torch.arange(qmin, qmax + 1, dtype=torch.float32, device=self.scale.device) - zero)


def code_range(bits: int, symmetric: bool, full_range: bool = False) -> tuple[int, int]:
    """``(qmin, qmax)``: ``(-(2^(b-1) - 1), 2^(b-1) - 1)`` symmetric (``-2^(b-1)`` as qmin with
    ``full_range``), ``(0, 2^b - 1)`` asymmetric."""
    _check_bits(bits)
    if symmetric:
        return -(2 ** (bits - 1) - int(not full_range)), 2 ** (bits - 1) - 1
    return 0, 2**bits - 1


def quantize(x: torch.Tensor, bits: int, symmetric: bool = True, granularity: str = "tensor",
             group_size: int | None = None, axis: int = -1, full_range: bool = False) -> QuantizedTensor:
    """Round-to-nearest uniform quantization of ``x`` to ``bits``-bit integer codes.

    Convention: ``x ~ scale * (q - zero_point)``; each group of values shares one scale.

    * ``granularity="tensor"``: one scale for all of ``x``. ``"channel"``: one scale per slice
      along ``axis``, i.e. the statistics reduce over ``axis`` (for a weight ``[d_out, d_in]``
      and ``axis=-1`` that is one scale per output channel). ``"group"``: one scale per
      ``group_size`` consecutive values along ``axis`` (``group_size`` must divide that axis).
    * **symmetric**: ``scale = absmax / (2^(b-1) - 1)``, ``zero_point = 0``, codes in
      ``[-(2^(b-1) - 1), 2^(b-1) - 1]``. The code ``-2^(b-1)`` is never used: with the scale set
      by the absmax, ``|x / scale| <= 2^(b-1) - 1`` already, and keeping the grid symmetric means
      ``-x`` quantizes to exactly ``-q`` (the "restricted range" of TensorRT's symmetric int8,
      and LLM.int8()'s ``127 / absmax``). It costs 1 of ``2^b`` levels: at 4 bits, 15 of 16.
      ``full_range=True`` (symmetric only) keeps that level instead, as torch.ao's observers and
      torchao's ``MappingType.SYMMETRIC`` do: ``scale = absmax / (2^(b-1) - 1/2)`` (half of the
      ``2^b - 1`` steps from ``-2^(b-1)`` to ``2^(b-1) - 1``), codes in ``[-2^(b-1), 2^(b-1) - 1]``;
      ``+absmax`` then rounds to ``2^(b-1)`` and is clipped to ``2^(b-1) - 1``, ``-absmax`` is exact.
    * **asymmetric**: the range ``[lo, hi] = [min(x, 0), max(x, 0)]`` is split into ``2^b - 1``
      steps, ``scale = (hi - lo) / (2^b - 1)``, and ``zero_point = round(-lo / scale)`` clamped
      to ``[0, 2^b - 1]``: an integer, so 0.0 is represented exactly (zero padding, ReLU
      outputs and pruned weights stay exactly zero). Codes in ``[0, 2^b - 1]``.
    * codes ``= clamp(round(x * (1 / scale)) + zero_point, qmin, qmax)``, rounding half to
      even. Multiplying by the reciprocal (one division per group, not per value) is what
      ``torch.quantize_per_tensor`` does too, so 8-bit codes match torch's bit for bit.
    * A group that is all zero has no range: its scale is set to 1 (every code is the zero
      point). A scale below the smallest normal fp32 number is raised to it, so that
      ``1 / scale`` stays finite.

    ``x``: fp32, fp16 or bf16 (computed in fp32). Every value of ``x`` is within ``scale / 2``
    of its dequantized value (up to fp32 rounding). ``bits``: 2 to 8.
    """
    x32, axis = _check_quantize_args(x, bits, granularity, group_size, axis)
    if not isinstance(full_range, bool) or (full_range and not symmetric):
        raise ValueError(f"full_range={full_range!r}: expected a bool, True only with symmetric=True "
                         "(asymmetric codes always use all 2^bits levels)")
    grouped = _grouped(x32, granularity, group_size, axis)
    scale, zero = _scale_and_zero(grouped, bits, symmetric, full_range)
    codes = _encode(grouped, scale[..., None], None if zero is None else zero[..., None], bits, symmetric, full_range)
    codes = _ungrouped(codes, granularity, axis, x.shape)
    scale, zero = (_group_stat_layout(t, granularity, axis) for t in (scale, zero))
    return QuantizedTensor(codes, scale, None if symmetric else zero.to(torch.uint8), bits, symmetric,
                           granularity, group_size if granularity == "group" else None, axis, x.shape, x.dtype,
                           full_range)


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``scale * (codes - zero_point)`` in fp32, returned in ``dtype`` (default: the original dtype).

    The rounded zero point can shift an asymmetric grid by up to half a step, so its last level
    may lie just beyond the largest finite value of ``dtype`` (only for inputs near that value):
    such levels saturate to it instead of becoming inf.
    """
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q: expected a QuantizedTensor, got {type(q).__name__}")
    dtype = q.dtype if dtype is None else dtype
    values = _grouped(q.codes, q.granularity, q.group_size, q.axis).float()
    if q.zero_point is not None:
        values = values - _grouped_stat(q.zero_point, q.granularity, q.axis).float()[..., None]
    values = values * _grouped_stat(q.scale, q.granularity, q.axis)[..., None]
    largest = torch.finfo(dtype).max
    return _ungrouped(values, q.granularity, q.axis, q.shape).clamp(-largest, largest).to(dtype)


def _check_bits(bits) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits={bits!r}: expected an integer from {MIN_BITS} to {MAX_BITS}")
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits={bits}: expected an integer from {MIN_BITS} to {MAX_BITS}")


def _check_float_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected dtype float32, float16 or bfloat16, got {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"{name}: is empty (shape {tuple(x.shape)}); there is nothing to quantize")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name}: contains NaN or inf, which no scale can represent")


def _check_quantize_args(x, bits, granularity, group_size, axis) -> tuple[torch.Tensor, int]:
    _check_float_tensor("x", x)
    _check_bits(bits)
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r}: expected one of {GRANULARITIES}")
    if granularity != "tensor":
        if x.dim() == 0:
            raise ValueError(f"granularity={granularity!r}: needs at least one dimension, x is a scalar")
        if not -x.dim() <= axis < x.dim():
            raise ValueError(f"axis={axis}: out of range for x with {x.dim()} dimensions")
        axis = axis % x.dim()
    else:
        axis = axis % x.dim() if x.dim() else 0
    if granularity == "group":
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size={group_size!r}: granularity='group' needs a positive integer")
        if x.shape[axis] % group_size:
            raise ValueError(f"group_size={group_size}: must divide the size {x.shape[axis]} of axis {axis} of x")
    elif group_size is not None:
        raise ValueError(f"group_size={group_size}: only granularity='group' takes a group size")
    return x.float(), axis


def _grouped(t: torch.Tensor, granularity: str, group_size: int | None, axis: int) -> torch.Tensor:
    """``t`` as ``[..., groups, values per group]``: each scale's values in the last dim."""
    if granularity == "tensor":
        return t.reshape(1, -1)
    moved = t.movedim(axis, -1)
    size = group_size if granularity == "group" else moved.shape[-1]
    return moved.reshape(*moved.shape[:-1], moved.shape[-1] // size, size)


def _ungrouped(t: torch.Tensor, granularity: str, axis: int, shape: torch.Size) -> torch.Tensor:
    if granularity == "tensor":
        return t.reshape(shape)
    return t.flatten(-2).movedim(-1, axis)


def _group_stat_layout(stat: torch.Tensor | None, granularity: str, axis: int) -> torch.Tensor | None:
    """Per-group statistic ``[..., groups]`` -> the layout stored: ``axis`` holds the groups."""
    if stat is None:
        return None
    return stat.reshape(()) if granularity == "tensor" else stat.movedim(-1, axis)


def _grouped_stat(stat: torch.Tensor, granularity: str, axis: int) -> torch.Tensor:
    return stat.reshape(1) if granularity == "tensor" else stat.movedim(axis, -1)


def _scale_and_zero(groups: torch.Tensor, bits: int, symmetric: bool,
                    full_range: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point, as an fp32 integer) of each group: statistics over the last dim."""
    qmin, qmax = code_range(bits, symmetric, full_range)
    if symmetric:
        scale = groups.abs().amax(dim=-1) / ((qmax - qmin) / 2)  # qmax, or qmax + 1/2 with the full range
    else:
        lo = groups.amin(dim=-1).clamp(max=0.0)  # the range always contains 0
        hi = groups.amax(dim=-1).clamp(min=0.0)
        scale = hi / qmax - lo / qmax  # = (hi - lo) / qmax, without overflowing when hi - lo > fp32 max
    scale = torch.where(scale == 0, torch.ones_like(scale), scale.clamp(min=torch.finfo(torch.float32).tiny))
    if symmetric:
        return scale, None
    zero = torch.round(-lo * (1.0 / scale)).clamp(qmin, qmax)
    return scale, zero


def _encode(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, symmetric: bool,
            full_range: bool = False) -> torch.Tensor:
    """``clamp(round(values * (1 / scale)) + zero, qmin, qmax)`` as int8 (symmetric) or uint8 codes."""
    qmin, qmax = code_range(bits, symmetric, full_range)
    codes = torch.round(values * (1.0 / scale))
    if zero is not None:
        codes = codes + zero
    return codes.clamp(qmin, qmax).to(torch.int8 if symmetric else torch.uint8)


def _decode(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    values = codes.float() if zero is None else codes.float() - zero.float()
    return values * scale


# ============================================================================ error
def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``10 log10(sum x^2 / sum (x - x_hat)^2)`` in dB
    (computed in fp64; ``inf`` when ``x_hat == x``). Each extra bit adds about 6.02 dB: the step
    halves, so the noise power drops 4x and ``10 log10 4 = 6.02``."""
    x64, err = x.double(), x.double() - x_hat.double()
    noise = err.pow(2).sum().item()
    return math.inf if noise == 0 else 10.0 * math.log10(x64.pow(2).sum().item() / noise)


def quantization_error(x: torch.Tensor, quantized) -> dict:
    """``{"mse", "max_abs_error", "sqnr_db"}`` of a :class:`QuantizedTensor`, an :class:`NF4Tensor`
    or an already dequantized tensor against the original ``x``."""
    if isinstance(quantized, QuantizedTensor):
        x_hat = dequantize(quantized, torch.float32)
    elif isinstance(quantized, NF4Tensor):
        x_hat = nf4_dequantize(quantized, torch.float32)
    elif isinstance(quantized, torch.Tensor):
        x_hat = quantized
    else:
        raise TypeError(f"quantized: expected a QuantizedTensor, NF4Tensor or tensor, got {type(quantized).__name__}")
    if x_hat.shape != x.shape:
        raise ValueError(f"quantized: shape {tuple(x_hat.shape)} differs from x's {tuple(x.shape)}")
    err = x.double() - x_hat.double()
    return {"mse": err.pow(2).mean().item(), "max_abs_error": err.abs().max().item(), "sqnr_db": sqnr_db(x, x_hat)}


# ============================================================================ storage
def bits_per_parameter(bits: float, group_size: int | None = None, scale_bits: int = 16, zero_point_bits: int = 0,
                       double_quant_block: int | None = None, double_quant_scale_bits: int = 32) -> float:
    """Bits a format spends per weight: the code plus its share of the per-group metadata.

    ``bits + (scale_bits + zero_point_bits) / group_size``; with double quantization the scales
    themselves are ``scale_bits``-bit codes and every ``double_quant_block`` of them shares one
    ``double_quant_scale_bits`` scale: ``+ double_quant_scale_bits / (group_size * double_quant_block)``.
    ``group_size=None`` means one scale for a whole (large) tensor: its share rounds to 0.
    Per-tensor constants (e.g. the one fp32 mean double quantization subtracts) are left out.

    QLoRA's numbers: NF4 with blocks of 64 and fp32 absmax is ``bits_per_parameter(4, 64, 32)``
    = 4.5; with 8-bit absmax in blocks of 256, ``bits_per_parameter(4, 64, 8, double_quant_block=256)``
    = 4 + 8/64 + 32/(64*256) = 4.127.
    """
    if not bits > 0:
        raise ValueError(f"bits={bits}: expected a positive number")
    metadata_bits = dict(scale_bits=scale_bits, zero_point_bits=zero_point_bits, double_quant_scale_bits=double_quant_scale_bits)
    for name, value in metadata_bits.items():
        if value < 0:
            raise ValueError(f"{name}={value}: expected >= 0")
    if group_size is None:
        if double_quant_block is not None:
            raise ValueError("double_quant_block: double quantization needs group_size (the scales it quantizes)")
        return float(bits)
    if group_size < 1:
        raise ValueError(f"group_size={group_size}: expected a positive integer or None")
    total = bits + (scale_bits + zero_point_bits) / group_size
    if double_quant_block is not None:
        if double_quant_block < 1:
            raise ValueError(f"double_quant_block={double_quant_block}: expected a positive integer or None")
        total += double_quant_scale_bits / (group_size * double_quant_block)
    return total


def state_dict_bytes(module: nn.Module) -> int:
    """Bytes of every tensor in ``module.state_dict()``: what saving it writes (before pickling)."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dim: element ``2i`` in the low nibble (bits 0-3),
    element ``2i+1`` in the high nibble (bits 4-7).

    ``codes``: ``int8`` holding signed codes in ``[-8, 7]``, stored as 4-bit two's complement
    (``-1`` -> ``0b1111``), or ``uint8`` holding unsigned codes in ``[0, 15]``. The last dim must
    be even; any memory layout (a transposed or sliced view) is fine. Returns ``uint8`` with the
    last dim halved. Low-nibble-first is the order of a little-endian bit stream, so
    :func:`pack_bits` packs any width the same way. Checkpoint formats differ: GPTQ packs 8
    consecutive input features per int32, low nibble first (``[K/8, N]``); AWQ packs 8 output
    features per int32 in the order ``[0, 2, 4, 6, 1, 3, 5, 7]``; bitsandbytes puts the first
    code in the high nibble.
    """
    _check_codes(codes, 4)
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes: last dim must be even (two codes per byte), got shape {tuple(codes.shape)}")
    nibbles = codes.to(torch.int16) & 0xF  # the two's-complement nibble of a signed code
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, signed: bool = False) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``uint8 [..., n]`` -> codes ``[..., 2n]``, ``int8`` in
    ``[-8, 7]`` (sign-extending each nibble) if ``signed`` else ``uint8`` in ``[0, 15]``."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"packed: expected a uint8 tensor, got {getattr(packed, 'dtype', type(packed).__name__)}")
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    if signed:
        return ((nibbles.to(torch.int16) ^ 8) - 8).to(torch.int8)  # 8..15 -> -8..-1
    return nibbles


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``bits``-bit codes (2..8) along the last dim into a little-endian bit stream:
    code ``j`` occupies stream bits ``j*bits .. j*bits + bits - 1``, each row padded with zero
    bits to whole bytes, so a row of ``n`` codes takes ``ceil(n * bits / 8)`` bytes. Signed
    (``int8``) codes are stored as ``bits``-bit two's complement. At 4 bits this is exactly
    :func:`pack_int4`; at 8 bits the bytes are the codes themselves."""
    _check_codes(codes, bits)
    if codes.dim() == 0:
        raise ValueError("codes: expected at least one dimension")
    if bits == 8:
        return codes.contiguous().view(torch.uint8)
    if bits == 4 and codes.shape[-1] % 2 == 0:
        return pack_int4(codes)
    stream_bits = (codes.to(torch.int16).unsqueeze(-1) >> torch.arange(bits, device=codes.device)) & 1
    stream = stream_bits.flatten(-2)
    stream = nn.functional.pad(stream, (0, (-stream.shape[-1]) % 8))
    byte_bits = stream.unflatten(-1, (-1, 8)) << torch.arange(8, device=codes.device)
    return byte_bits.sum(dim=-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int, signed: bool) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` codes of each row of ``packed``."""
    _check_bits(bits)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"packed: expected a uint8 tensor, got {getattr(packed, 'dtype', type(packed).__name__)}")
    if count * bits > packed.shape[-1] * 8:
        raise ValueError(f"count={count}: {count} codes of {bits} bits need {math.ceil(count * bits / 8)} bytes per row, "
                         f"packed has {packed.shape[-1]}")
    if bits == 8:
        codes = packed[..., :count]
        return codes.view(torch.int8) if signed else codes
    if bits == 4:
        return unpack_int4(packed, signed)[..., :count]
    stream = ((packed.to(torch.int16).unsqueeze(-1) >> torch.arange(8, device=packed.device)) & 1).flatten(-2)
    code_bits = stream[..., : count * bits].unflatten(-1, (count, bits))
    codes = (code_bits << torch.arange(bits, device=packed.device)).sum(dim=-1)
    if signed:
        codes = codes - ((codes >> (bits - 1)) & 1) * (1 << bits)  # sign-extend the top bit
        return codes.to(torch.int8)
    return codes.to(torch.uint8)


def _check_codes(codes, bits: int) -> None:
    _check_bits(bits)
    if not isinstance(codes, torch.Tensor) or codes.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"codes: expected int8 (signed codes) or uint8 (unsigned codes), got "
                        f"{getattr(codes, 'dtype', type(codes).__name__)}")
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if codes.dtype == torch.int8 else (0, 2**bits - 1)
    if codes.numel() and (int(codes.min()) < lo or int(codes.max()) > hi):
        raise ValueError(f"codes: {bits}-bit {'signed' if lo else 'unsigned'} codes must lie in [{lo}, {hi}], "
                         f"got min {int(codes.min())}, max {int(codes.max())}")


# ============================================================================ NF4
def nf4_codebook() -> torch.Tensor:
    """The 16 NormalFloat4 levels of QLoRA (fp32, ascending, from -1 to 1, index 7 is 0.0).

    Pretrained weights are roughly normal, so levels at equal-probability quantiles of N(0, 1)
    put the same expected number of weights in each bin. A symmetric set of 16 quantiles has
    no exact zero, so NF4 is built from two halves: 8 positive levels at the quantiles
    ``linspace(offset, 0.5, 9)[:-1]`` and 7 negative ones at ``linspace(offset, 0.5, 8)[:-1]``
    (mirrored), plus 0; then everything is divided by the largest, mapping to ``[-1, 1]``.
    ``offset = 0.9677083`` as in bitsandbytes' ``create_normal_map``. The quantile function is
    ``torch.special.ndtri``, evaluated in fp64 so that the fp32 result agrees with bitsandbytes'
    published table to 1.2e-7, one fp32 ulp (bitsandbytes evaluates scipy's quantile in fp64 at
    fp32 probabilities and normalizes in fp32).
    """
    positive = torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive]).sort().values
    return (levels / levels.max()).float()


def nearest_level(normalized: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index (uint8) of the nearest entry of the ascending ``levels`` for each value: a binary
    search over the midpoints between neighbours. A value exactly on a midpoint takes the lower
    level, as bitsandbytes' comparison tree does."""
    midpoints = (levels[1:] + levels[:-1]) / 2
    return torch.bucketize(normalized.contiguous(), midpoints.to(normalized.device)).to(torch.uint8)


def lloyd_max_levels(values: torch.Tensor, count: int = 16, iterations: int = 50) -> torch.Tensor:
    """The ``count`` levels (fp32, ascending) that minimise the mean squared error of rounding
    ``values`` to the nearest level: Lloyd's algorithm (1-D k-means), started at the quantiles
    ``(i + 1/2) / count`` of the values. Each step assigns every value to its nearest level
    (:func:`nearest_level`) and moves each level to the mean of its values; the error never rises.

    NF4's levels have equal *probability* (each code used equally often), which maximises the
    information per code, not the accuracy: the MSE-optimal (Lloyd-Max) levels of the same data
    sit closer to the tails, and have no exact 0 or +-1.
    """
    _check_float_tensor("values", values)
    if isinstance(count, bool) or not isinstance(count, int) or not 2 <= count <= 256:
        raise ValueError(f"count={count!r}: expected an integer from 2 to 256 (codes of at most 8 bits)")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
        raise ValueError(f"iterations={iterations!r}: expected a non-negative integer")
    flat = values.detach().float().reshape(-1)
    levels = torch.quantile(flat, (torch.arange(count, dtype=torch.float32, device=flat.device) + 0.5) / count)
    for _ in range(iterations):
        nearest = nearest_level(flat, levels).long()
        sums = torch.zeros_like(levels).index_add_(0, nearest, flat)
        counts = torch.bincount(nearest, minlength=count).to(levels.dtype)
        levels = torch.where(counts > 0, sums / counts.clamp(min=1), levels).sort().values
    return levels


def nf4_encode(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)`` of each block (the last dim): codebook indices (uint8) of the values
    divided by their block's absmax, and that absmax (fp32; an all-zero block keeps absmax 0)."""
    absmax = blocks.abs().amax(dim=-1)
    normalized = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))[..., None]
    return nearest_level(normalized, nf4_codebook().to(blocks.device)), absmax


@dataclass(frozen=True)
class NF4Tensor:
    """Blockwise NF4 storage of a tensor (flattened, in blocks of ``block_size`` values).

    ``packed_codes``: codebook indices, two per byte (:func:`pack_int4`), ``ceil(numel / 2)``
    bytes. Without double quantization ``absmax`` holds each block's fp32 absmax. With it,
    ``absmax`` is ``None`` and the absmax values are stored as ``absmax_codes`` (int8),
    ``absmax_scales`` (fp32, one per ``double_quant_block`` absmax values) and ``absmax_offset``
    (their fp32 mean): ``absmax = absmax_codes * absmax_scales + absmax_offset``.
    """

    packed_codes: torch.Tensor
    absmax: torch.Tensor | None
    absmax_codes: torch.Tensor | None
    absmax_scales: torch.Tensor | None
    absmax_offset: torch.Tensor | None
    block_size: int
    double_quant_block: int | None
    shape: torch.Size
    dtype: torch.dtype

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        names = ("packed_codes", "absmax", "absmax_codes", "absmax_scales", "absmax_offset")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @property
    def storage_bytes(self) -> int:
        """Bytes of every tensor the format stores, measured (not computed from a formula)."""
        return sum(t.numel() * t.element_size() for t in self.stored_tensors().values())

    def block_absmax(self) -> torch.Tensor:
        """fp32 absmax of each block (rebuilt from its 8-bit codes when double quantized)."""
        if self.absmax is not None:
            return self.absmax
        num_blocks = self.absmax_codes.numel()
        scales = self.absmax_scales.repeat_interleave(self.double_quant_block)[:num_blocks]
        return self.absmax_codes.float() * scales + self.absmax_offset


def nf4_quantize(x: torch.Tensor, block_size: int = 64, double_quant: bool = False, double_quant_block: int = 256) -> NF4Tensor:
    """NF4 as QLoRA / bitsandbytes store weights: flatten, cut into blocks of ``block_size``,
    divide each block by its absmax (so it lies in ``[-1, 1]``), and store the index of the
    nearest :func:`nf4_codebook` level. The last block may be partial (its missing values count
    as zeros, which cannot change an absmax).

    ``double_quant``: the fp32 absmax values (32 bits per 64 weights = 0.5 bit/weight) are
    quantized too. As the QLoRA paper describes, they are all positive, so their mean is
    subtracted first and the centered values are quantized symmetrically in blocks of
    ``double_quant_block`` (256) with one fp32 scale each. The paper (and bitsandbytes) use an
    8-bit *float* code for that step (bitsandbytes' dynamic map); here it is the linear
    symmetric int8 of :func:`quantize` (absmax / 127), which costs the same 8 bits and is
    accurate to 1/254 of the largest deviation from the mean. Storage: 4 + 8/64 + 32/(64*256)
    = 4.127 bits per weight, plus one fp32 mean.
    """
    _check_float_tensor("x", x)
    for name, value in (("block_size", block_size), ("double_quant_block", double_quant_block)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive integer")
    if block_size % 2:
        raise ValueError(f"block_size={block_size}: must be even so that no byte holds codes of two blocks")
    flat = x.detach().float().reshape(-1)
    blocks = nn.functional.pad(flat, (0, (-flat.numel()) % block_size)).reshape(-1, block_size)
    codes, absmax = nf4_encode(blocks)
    packed = pack_int4(codes.reshape(-1)[: flat.numel() + flat.numel() % 2])
    if not double_quant:
        return NF4Tensor(packed, absmax, None, None, None, block_size, None, x.shape, x.dtype)
    offset = absmax.mean()
    centered = absmax - offset
    padded = nn.functional.pad(centered, (0, (-centered.numel()) % double_quant_block))
    second = quantize(padded, 8, symmetric=True, granularity="group", group_size=double_quant_block)
    return NF4Tensor(packed, None, second.codes[: absmax.numel()], second.scale, offset,
                     block_size, double_quant_block, x.shape, x.dtype)


def nf4_dequantize(t: NF4Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``codebook[code] * absmax of its block``, in ``dtype`` (default: the original dtype)."""
    if not isinstance(t, NF4Tensor):
        raise TypeError(f"t: expected an NF4Tensor, got {type(t).__name__}")
    numel = math.prod(t.shape)
    codes = unpack_int4(t.packed_codes)[:numel].long()
    absmax = t.block_absmax().repeat_interleave(t.block_size)[:numel]
    values = nf4_codebook().to(codes.device)[codes] * absmax
    return values.reshape(t.shape).to(t.dtype if dtype is None else dtype)


# ============================================================================ LLM.int8()
def inject_outlier_features(x: torch.Tensor, num_features: int = 2, magnitude: float = 20.0,
                            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of activations ``x [..., d]`` in which ``num_features`` feature dimensions are
    ``magnitude`` times larger, for every token; returns ``(x_with_outliers, feature_indices)``.

    This is the pattern Dettmers et al. (LLM.int8(), 2022) found in transformers beyond ~6.7B
    parameters: a handful of hidden dimensions carry values up to ~20x the rest, in almost every
    token. One such value per row ruins a per-row int8 scale for all the others.
    """
    if not 0 < num_features <= x.shape[-1]:
        raise ValueError(f"num_features={num_features}: expected 1 to {x.shape[-1]} (x's last dim)")
    generator = torch.Generator().manual_seed(seed)
    features = torch.randperm(x.shape[-1], generator=generator)[:num_features].sort().values.to(x.device)
    out = x.clone()
    out[..., features] = out[..., features] * magnitude
    return out, features


def int8_mixed_matmul(x: torch.Tensor, weight: torch.Tensor, threshold: float = 6.0) -> tuple[torch.Tensor, torch.Tensor]:
    """LLM.int8()'s mixed-precision decomposition of ``y = x @ weight^T``; returns ``(y, outlier_columns)``.

    1. Input features (columns of ``x``, i.e. of ``weight``) where ``|x| > threshold`` in *any*
       row are outliers; their part of the product is computed in ``x``'s own (16/32-bit) dtype.
    2. The rest is quantized vector-wise: each row of ``x`` and each output row of ``weight``
       gets an absmax int8 scale (:func:`quantize` with ``granularity="channel"``).
    3. ``int8 @ int8^T`` accumulates exactly in int32 (:func:`int8_matmul_int32`), and each
       entry is rescaled by ``scale_x[row] * scale_w[col]``.

    ``threshold=float("inf")`` gives plain vector-wise int8 (no outliers), the baseline that
    outlier features break. ``y`` is returned in ``x``'s dtype.
    """
    _check_float_tensor("x", x)
    _check_float_tensor("weight", weight)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight: expected shape [d_out, {x.shape[-1]}] (x's last dim), got {tuple(weight.shape)}")
    rows = x.reshape(-1, x.shape[-1])
    outlier = (rows.abs() > threshold).any(dim=0)
    regular = ~outlier
    y = torch.zeros(rows.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    if regular.any():
        qx = quantize(rows[:, regular], 8, granularity="channel", axis=-1)
        qw = quantize(weight[:, regular], 8, granularity="channel", axis=-1)
        accumulated = int8_matmul_int32(qx.codes, qw.codes)
        y += accumulated.float() * qx.scale * qw.scale.T
    if outlier.any():
        y += (rows[:, outlier] @ weight[:, outlier].to(x.dtype).T).float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0]), outlier.nonzero().squeeze(1)


def smoothquant_scales(x: torch.Tensor, weight: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """SmoothQuant's per-input-feature smoothing factors (Xiao et al., 2022): fp32 ``s [d_in]`` with
    ``s_j = max|x_j|^alpha / max|w_j|^(1 - alpha)``, over the tokens of ``x [..., d_in]`` and the
    output rows of ``weight [d_out, d_in]``.

    ``y = x W^T = (x / s) (W * s)^T`` exactly, but ``x / s`` has its outlier features shrunk and
    ``W * s`` takes them on: ``alpha`` says how much of the range moves into the weights (0: none of
    the activations' range is moved, the weight's columns are equalised instead; 1: every activation
    feature ends with the same max, 1). The paper uses 0.5 for most models. A feature that is zero in
    ``x`` or in the weight gets ``s_j = 1``.
    """
    _check_float_tensor("x", x)
    _check_float_tensor("weight", weight)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight: expected shape [d_out, {x.shape[-1]}] (x's last dim), got {tuple(weight.shape)}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha={alpha!r}: expected a number from 0 to 1")
    x_max = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
    w_max = weight.detach().abs().amax(dim=0).float().to(x_max.device)
    used = (x_max > 0) & (w_max > 0)
    tiny = torch.finfo(torch.float32).tiny  # keeps 0 ** negative powers finite where ``used`` is False
    scales = x_max.clamp(min=tiny).pow(alpha) / w_max.clamp(min=tiny).pow(1 - alpha)
    return torch.where(used, scales, torch.ones_like(scales))


def smoothquant_search(weight: torch.Tensor, calibration_inputs: torch.Tensor, bits: int = 8, act_bits: int = 8,
                       grid: int = 20) -> tuple[torch.Tensor, float]:
    """SmoothQuant with its migration strength searched: the ``alpha`` among ``grid + 1`` points of
    [0, 1] whose :func:`smoothquant_scales` give the least relative output error of the layer in
    W``bits``A``act_bits`` on ``calibration_inputs [..., d_in]``: ``W * s`` round-to-nearest with
    one scale per output row, ``x / s`` with one scale for the whole tensor (both symmetric).
    ``alpha = 0`` only equalises the weight's columns; the search includes it, so the result is
    never worse than that. Returns ``(s, alpha)``, ``s`` fp32 ``[d_in]``."""
    _check_bits(bits)
    _check_bits(act_bits)
    if isinstance(grid, bool) or not isinstance(grid, int) or grid < 1:
        raise ValueError(f"grid={grid!r}: expected a positive integer")
    _check_float_tensor("calibration_inputs", calibration_inputs)
    _check_float_tensor("weight", weight)
    if weight.dim() != 2 or calibration_inputs.shape[-1] != weight.shape[1]:
        raise ValueError(f"calibration_inputs, weight: expected [..., d_in] and [d_out, d_in], got "
                         f"{tuple(calibration_inputs.shape)} and {tuple(weight.shape)}")
    X = calibration_inputs.detach().reshape(-1, calibration_inputs.shape[-1]).float()
    W = weight.detach().float()
    best = None
    for step in range(grid + 1):
        alpha = step / grid
        s = smoothquant_scales(X, W, alpha)
        w_hat = dequantize(quantize(W * s, bits, True, "channel"), torch.float32) / s
        x_hat = dequantize(quantize(X / s, act_bits, True, "tensor"), torch.float32) * s
        exact = X.double() @ W.double().T
        error = ((x_hat.double() @ w_hat.double().T - exact).norm() / exact.norm()).item()
        if best is None or error < best[0]:
            best = (error, s, alpha)
    return best[1], best[2]


def int8_matmul_int32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b^T`` of int8 matrices with int32 accumulation, as int8 tensor cores compute it.

    Each product is at most 127 * 127 < 2^14, so sums of up to 2^17 of them fit in int32. On
    the CPU torch multiplies int32 matrices directly; elsewhere an fp64 matmul is exact (every
    partial sum is an integer below 2^53) and the cast to int32 wraps on overflow exactly like
    int32 accumulation would.
    """
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"a, b: expected int8 tensors, got {a.dtype} and {b.dtype}")
    if a.device.type == "cpu":
        return a.to(torch.int32) @ b.to(torch.int32).T
    return (a.double() @ b.double().T).to(torch.int64).to(torch.int32)


# ============================================================================ GPTQ
def gptq_quantize(weight: torch.Tensor, calibration_inputs: torch.Tensor, bits: int, group_size: int | None = None,
                  symmetric: bool = True, damp: float = 0.01, block_size: int = 128, act_order: bool = False) -> QuantizedTensor:
    """GPTQ (Frantar et al., 2022): quantize ``weight [d_out, d_in]`` so that the layer's output
    on ``calibration_inputs [..., d_in]`` changes as little as possible.

    Round-to-nearest minimizes each weight's own error. GPTQ minimizes the layer's output error
    ``||X W^T - X W_hat^T||^2``, whose Hessian with respect to a row of ``W`` is ``H = 2 X^T X``
    (the same for every row). It quantizes one column (input feature) at a time and spreads the
    rounding error ``e`` onto the columns not yet quantized, the optimal (OBS) update
    ``W[:, j:] -= e / Hinv[j, j] * Hinv[j, j:]``, with ``Hinv`` the upper Cholesky factor of
    ``H^-1`` (one factorisation replaces the paper's repeated inverse updates).

    * ``damp``: ``damp * mean(diag H)`` is added to the diagonal, so ``H`` is safely invertible.
    * Dead inputs (a feature that is zero in every calibration row, ``H[j, j] == 0``) cannot
      affect the output: their weights are set to 0 and ``H[j, j]`` to 1.
    * Lazy batch updates: inside a block of ``block_size`` columns the updates touch only the
      block; the rest of ``W`` gets the block's accumulated errors in one matmul afterwards.
      (Same result, far less memory traffic.)
    * ``group_size``: a group's scale is computed when the quantizer reaches its first column,
      from the weights as updated so far. Blocks are aligned to whole groups for that.
      ``None``: one scale per output row, from the original weights.
    * ``act_order`` (the reference code's ``--act-order``): quantize the columns in order of
      decreasing ``H[j, j]``, the inputs with the most energy first, while the most columns are
      left to absorb their errors; the codes come back in the original order. One scale per row
      only: with groups the permuted groups would need an index per column (GPTQ's ``g_idx``),
      which a :class:`QuantizedTensor` does not store.

    ``H`` is built as ``2 X^T X / rows``: dividing by the number of rows changes neither the
    solution nor the relative damping, and keeps the numbers independent of how much data was
    used. Returns a :class:`QuantizedTensor` (``granularity`` ``"group"`` or ``"channel"``,
    ``axis=1``), like :func:`quantize` of ``weight`` along its input axis.
    """
    granularity = "channel" if group_size is None else "group"
    _check_quantize_args(weight, bits, granularity, group_size, -1)
    if weight.dim() != 2:
        raise ValueError(f"weight: expected a matrix [d_out, d_in], got shape {tuple(weight.shape)}")
    d_out, d_in = weight.shape
    _check_float_tensor("calibration_inputs", calibration_inputs)
    if calibration_inputs.shape[-1] != d_in:
        raise ValueError(f"calibration_inputs: expected shape [..., {d_in}] (weight's d_in), got {tuple(calibration_inputs.shape)}")
    if not damp >= 0:
        raise ValueError(f"damp={damp}: expected >= 0")
    if block_size < 1:
        raise ValueError(f"block_size={block_size}: expected a positive integer")
    if act_order:
        if group_size is not None:
            raise ValueError(f"act_order=True: needs group_size=None (one scale per row), got group_size={group_size}")
        X = calibration_inputs.detach().reshape(-1, d_in).float()
        order = torch.argsort(X.pow(2).sum(dim=0), descending=True, stable=True).to(weight.device)  # diag(H) up to 2 / rows
        q = gptq_quantize(weight[:, order], calibration_inputs.reshape(-1, d_in)[:, order.to(calibration_inputs.device)], bits,
                          None, symmetric, damp, block_size)
        codes = torch.empty_like(q.codes)
        codes[:, order] = q.codes
        return QuantizedTensor(codes, q.scale, q.zero_point, bits, symmetric, granularity, None, 1, weight.shape, weight.dtype)

    W = weight.detach().float().clone()
    X = calibration_inputs.detach().reshape(-1, d_in).float().to(W.device)
    H = 2.0 * X.T @ X / max(X.shape[0], 1)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * torch.diag(H).mean() * torch.eye(d_in, device=W.device)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    group = d_in if group_size is None else group_size
    if group_size is not None:
        block_size = max(group, block_size // group * group)
    codes = torch.zeros(d_out, d_in, dtype=torch.int8 if symmetric else torch.uint8, device=W.device)
    scales = torch.zeros(d_out, d_in // group, device=W.device)
    zeros = None if symmetric else torch.zeros_like(scales)
    scale, zero = _scale_and_zero(W, bits, symmetric)  # the per-row scale of granularity "channel"

    for start in range(0, d_in, block_size):
        end = min(start + block_size, d_in)
        W_block = W[:, start:end].clone()
        errors = torch.zeros_like(W_block)
        Hinv_block = Hinv[start:end, start:end]
        for i in range(end - start):
            column = start + i
            if column % group == 0:
                if group_size is not None:
                    scale, zero = _scale_and_zero(W_block[:, i : i + group], bits, symmetric)
                scales[:, column // group] = scale
                if zeros is not None:
                    zeros[:, column // group] = zero
            w = W_block[:, i]
            q = _encode(w, scale, zero, bits, symmetric)
            codes[:, column] = q
            error = (w - _decode(q, scale, zero)) / Hinv_block[i, i]
            W_block[:, i:] -= error[:, None] * Hinv_block[i, i:][None, :]
            errors[:, i] = error
        W[:, end:] -= errors @ Hinv[start:end, end:]

    return QuantizedTensor(codes, scales, None if symmetric else zeros.to(torch.uint8), bits, symmetric,
                           granularity, group_size, 1, weight.shape, weight.dtype)


def awq_quantize(weight: torch.Tensor, calibration_inputs: torch.Tensor, bits: int, group_size: int | None = None,
                 grid: int = 20) -> tuple[QuantizedTensor, torch.Tensor, float]:
    """AWQ (Lin et al., 2023): activation-aware scales for weight-only quantization.

    The weights that meet large activations matter most. AWQ multiplies input column ``j`` of the
    weight by ``s_j = mean|x_j|^alpha`` before round-to-nearest (and divides the input by it, which
    a deployment folds into the layer before): ``x W^T = (x / s) (W * s)^T``, but the scaled-up
    columns now get relatively finer steps. ``alpha`` is searched on ``grid + 1`` points of [0, 1]
    for the least layer-output error (:func:`layer_output_error`) on ``calibration_inputs``;
    ``alpha = 0`` is plain round-to-nearest, so AWQ is never worse than it there. As in AWQ's code
    the scales are normalised by ``sqrt(max s * min s)``.

    Returns ``(q, s, alpha)``: ``q`` the symmetric :func:`quantize` of ``weight * s`` (one scale per
    row, or per ``group_size`` inputs), ``s`` fp32 ``[d_in]``; the weight it stands for is
    ``dequantize(q) / s``.
    """
    granularity = "channel" if group_size is None else "group"
    _check_quantize_args(weight, bits, granularity, group_size, -1)
    if weight.dim() != 2:
        raise ValueError(f"weight: expected a matrix [d_out, d_in], got shape {tuple(weight.shape)}")
    _check_float_tensor("calibration_inputs", calibration_inputs)
    if calibration_inputs.shape[-1] != weight.shape[1]:
        raise ValueError(f"calibration_inputs: expected shape [..., {weight.shape[1]}] (weight's d_in), "
                         f"got {tuple(calibration_inputs.shape)}")
    if isinstance(grid, bool) or not isinstance(grid, int) or grid < 1:
        raise ValueError(f"grid={grid!r}: expected a positive integer")
    W = weight.detach().float()
    X = calibration_inputs.detach().reshape(-1, W.shape[1]).float()
    mean_abs = X.abs().mean(dim=0).clamp(min=torch.finfo(torch.float32).tiny)  # a dead input keeps a finite scale
    best = None
    for step in range(grid + 1):
        alpha = step / grid
        s = mean_abs.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        q = quantize(W * s, bits, True, granularity, group_size)
        error = layer_output_error(X, W, dequantize(q, torch.float32) / s)
        if best is None or error < best[0]:
            best = (error, q, s, alpha)
    return best[1], best[2], best[3]


def layer_output_error(inputs: torch.Tensor, weight: torch.Tensor, quantized_weight: torch.Tensor) -> float:
    """Relative output error of a linear layer, ``||X W^T - X W_hat^T||_F / ||X W^T||_F``:
    what GPTQ minimizes, on the inputs ``X [..., d_in]`` the layer really sees."""
    X = inputs.reshape(-1, inputs.shape[-1]).double()
    exact = X @ weight.double().T
    return ((exact - X @ quantized_weight.double().T).norm() / exact.norm()).item()


@torch.no_grad()
def capture_linear_inputs(model: nn.Module, token_ids: torch.Tensor, names=None) -> dict[str, torch.Tensor]:
    """Run ``model(token_ids)`` once and return, for each :class:`labkit.nn.Linear` (or
    :class:`QuantLinear`) whose qualified name is in ``names`` (default: all), its input
    flattened to ``[tokens, d_in]`` (fp32): the activations GPTQ calibrates on."""
    captured, hooks = {}, []

    def keep_input(name):
        def hook(module, args, output):
            captured[name] = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        return hook

    for name, module in model.named_modules():
        if isinstance(module, (Linear, QuantLinear)) and (names is None or name in names):
            hooks.append(module.register_forward_hook(keep_input(name)))
    try:
        model(token_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def calibration_tokens(task: ArithmeticTask, num_sequences: int = 64, context_length: int = 32, seed: int = 0,
                       split: str = "train", device=None) -> torch.Tensor:
    """``[num_sequences, context_length]`` token windows of ``task``'s ``split`` (train: the
    data the model has seen, as GPTQ's calibration set usually is), drawn from a private
    generator so the caller's random stream is untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        x, _ = get_batch(task.tokens(split), num_sequences, context_length, device or "cpu")
    return x


# ============================================================================ QuantLinear
METHODS = {"int8": ("int", 8), "int4": ("int", 4), "int": ("int", None), "nf4": ("nf4", 4)}


class QuantLinear(nn.Module):
    """A bias-free linear layer ``y = x W^T`` whose weight ``[d_out, d_in]`` is stored quantized.

    Buffers (what the state dict and a checkpoint hold):

    * ``qweight`` - ``uint8 [d_out, ceil(d_in * bits / 8)]``: each row's codes packed by
      :func:`pack_bits` (two per byte at 4 bits, low nibble first; one per byte at 8 bits).
      Integer codes are two's complement if symmetric, unsigned if not; NF4 codes are indices
      into :func:`nf4_codebook`.
    * ``scales`` - ``[d_out, groups]`` in ``scale_dtype`` (fp16 by default): one per output row
      and group of ``group_size`` input features (``group_size=None``: one per row). If
      ``group_size`` does not divide ``d_in`` the last group is shorter.
    * ``zeros`` - ``uint8 [d_out, groups]`` zero points, asymmetric integer formats only.
    * ``codebook`` (NF4 only) - the 16 levels; a non-persistent buffer, since the format defines
      it (it is not stored per layer, as in bitsandbytes).
    * ``input_scale`` (AWQ and SmoothQuant only) - ``[d_in]`` in ``scale_dtype``: the factors
      ``s`` of :func:`awq_quantize` / :func:`smoothquant_scales`. The codes are those of
      ``W * s`` and ``forward`` divides its input by ``s``; a deployment folds ``1 / s`` into the
      layer before (a norm's weight, or the rows of the previous linear layer), so there it costs
      nothing. Here it is kept with the layer, and counted.

    ``act_bits`` (an int, or ``None`` for weight-only): the input (after the division by ``s``)
    is quantized too, symmetric round-to-nearest with one scale for the whole input tensor,
    computed from the tensor itself (dynamic per-tensor scaling, as in W8A8 inference). The
    matmul then runs on the dequantized operands, which equals an integer matmul with int32
    accumulation times the two scales, up to fp32 rounding.

    ``forward``: dequantize the weight and multiply in the input's dtype (memory-bound decoding
    would rather never materialize ``W``); with ``use_triton=True`` (4- and 8-bit formats) it
    calls ``labkit.kernels.quant_matmul``, which dequantizes tiles in registers, if Triton is
    usable here. Build one with :meth:`from_linear`.
    """

    def __init__(self, d_in: int, d_out: int, method: str = "int4", bits: int | None = None, group_size: int | None = None,
                 symmetric: bool = True, scale_dtype: torch.dtype = torch.float16, use_triton: bool = False, device=None,
                 input_scale: bool = False, act_bits: int | None = None):
        super().__init__()
        self.fmt, self.bits = _method_format(method, bits)
        if self.fmt == "nf4" and not symmetric:
            raise ValueError("symmetric=False: NF4 has no zero point (its codebook is fixed)")
        for name, value in (("d_in", d_in), ("d_out", d_out)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
            raise ValueError(f"group_size={group_size!r}: expected a positive integer or None (one scale per row)")
        if scale_dtype not in FLOAT_DTYPES:
            raise TypeError(f"scale_dtype: expected float32, float16 or bfloat16, got {scale_dtype}")
        if use_triton:
            if self.bits not in (4, 8):
                raise ValueError(f"use_triton=True: the kernel reads 4- and 8-bit formats, not {self.bits}-bit")
            if self.bits == 4 and d_in % 2:
                raise ValueError(f"use_triton=True: 4-bit rows must hold whole bytes, so d_in={d_in} must be even")
        if act_bits is not None:
            _check_bits(act_bits)
        self.d_in, self.d_out, self.symmetric, self.use_triton, self.act_bits = d_in, d_out, symmetric, use_triton, act_bits
        self.group_size = group_size if group_size is not None and group_size < d_in else None
        num_groups = math.ceil(d_in / self.group_size) if self.group_size else 1
        self.register_buffer("qweight", torch.zeros(d_out, math.ceil(d_in * self.bits / 8), dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.ones(d_out, num_groups, dtype=scale_dtype, device=device))
        self.register_buffer("zeros", None if symmetric else torch.zeros(d_out, num_groups, dtype=torch.uint8, device=device))
        self.register_buffer("codebook", nf4_codebook().to(device) if self.fmt == "nf4" else None, persistent=False)
        self.register_buffer("input_scale", torch.ones(d_in, dtype=scale_dtype, device=device) if input_scale else None)

    @property
    def group(self) -> int:
        """Input features per scale (``d_in`` when there is one scale per row)."""
        return self.group_size or self.d_in

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Module, method: str = "int4", group_size: int | None = None, *, bits: int | None = None,
                    symmetric: bool = True, gptq_inputs: torch.Tensor | None = None, damp: float = 0.01,
                    scale_dtype: torch.dtype = torch.float16, use_triton: bool = False, input_scale: torch.Tensor | None = None,
                    act_bits: int | None = None) -> "QuantLinear":
        """Quantize ``linear.weight`` (``[d_out, d_in]``; ``labkit.nn.Linear`` or a bias-free
        ``torch.nn.Linear``): ``method`` ``"int8"``, ``"int4"``, ``"int"`` (with ``bits`` 2..8)
        or ``"nf4"``, round-to-nearest, or GPTQ (integer formats) when ``gptq_inputs``
        (the layer's inputs ``[..., d_in]``) are given. ``input_scale`` (positive ``[d_in]``,
        AWQ's or SmoothQuant's factors ``s``): the codes are those of ``weight * s`` (``s`` as
        stored, in ``scale_dtype``) and the layer divides its input by ``s``. ``act_bits``:
        quantize the input too (see the class)."""
        weight = getattr(linear, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(f"linear: expected a module with a 2-D weight, got {type(linear).__name__}")
        if getattr(linear, "bias", None) is not None:
            raise ValueError("linear: has a bias; QuantLinear is bias-free like labkit.nn.Linear")
        d_out, d_in = weight.shape
        layer = cls(d_in, d_out, method, bits, group_size, symmetric, scale_dtype, use_triton, device=weight.device,
                    input_scale=input_scale is not None, act_bits=act_bits)
        if gptq_inputs is not None and layer.fmt != "int":
            raise ValueError(f"gptq_inputs: GPTQ here quantizes to integer grids; method={method!r} is not one")
        weight = weight.detach().float()
        if input_scale is not None:
            if (not isinstance(input_scale, torch.Tensor) or input_scale.shape != (d_in,)
                    or not torch.isfinite(input_scale).all() or not (input_scale > 0).all()):
                raise ValueError(f"input_scale: expected {d_in} positive finite factors (one per input feature)")
            layer.input_scale.copy_(input_scale.to(scale_dtype))
            if not (layer.input_scale > 0).all() or not torch.isfinite(layer.input_scale).all():
                raise ValueError(f"input_scale: not representable in scale_dtype={scale_dtype}; use torch.float32")
            weight = weight * layer.input_scale.float().to(weight.device)
            if gptq_inputs is not None:
                gptq_inputs = gptq_inputs / layer.input_scale.float().to(gptq_inputs.device)
        # A last group shorter than group_size is padded with zero weights (and zero inputs for
        # GPTQ): zeros change neither an absmax nor a min/max range that always contains 0.
        padded = nn.functional.pad(weight, (0, (-d_in) % layer.group))
        if layer.fmt == "nf4":
            codes, scales = nf4_encode(padded.reshape(d_out, -1, layer.group))
            codes, zeros = codes.reshape(d_out, -1), None
        else:
            granularity = "group" if layer.group_size else "channel"
            if gptq_inputs is not None:
                inputs = nn.functional.pad(gptq_inputs.reshape(-1, d_in).float(), (0, (-d_in) % layer.group))
                q = gptq_quantize(padded, inputs, layer.bits, layer.group_size, symmetric, damp)
            else:
                q = quantize(padded, layer.bits, symmetric, granularity, layer.group_size, axis=-1)
            codes, scales, zeros = q.codes, q.scale, q.zero_point
        layer.qweight.copy_(pack_bits(codes[:, :d_in].contiguous(), layer.bits))
        stored_scales = scales.reshape(d_out, -1).to(scale_dtype)
        if not torch.isfinite(stored_scales).all():
            raise ValueError(f"scale_dtype={scale_dtype}: the weight's scales overflow it; use torch.float32")
        layer.scales.copy_(stored_scales)
        if zeros is not None:
            layer.zeros.copy_(zeros.reshape(d_out, -1))
        return layer

    def codes(self) -> torch.Tensor:
        """The unpacked codes ``[d_out, d_in]`` (int8 if signed, uint8 otherwise)."""
        signed = self.fmt == "int" and self.symmetric
        return unpack_bits(self.qweight, self.bits, self.d_in, signed)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[d_out, d_in]`` the stored codes represent, computed in fp32."""
        codes = self.codes()
        if self.fmt == "nf4":
            values = self.codebook[codes.long()]
        else:
            values = codes.float()
            if self.zeros is not None:
                values = values - self._per_column(self.zeros).float()
        return (values * self._per_column(self.scales).float()).to(dtype)

    def _per_column(self, per_group: torch.Tensor) -> torch.Tensor:
        return per_group.repeat_interleave(self.group, dim=1)[:, : self.d_in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.d_in:
            raise ValueError(f"x: last dim must be d_in={self.d_in}, got shape {tuple(x.shape)}")
        if self.input_scale is not None:
            x = x / self.input_scale.to(x.dtype)
        if self.act_bits is not None:
            x = dequantize(quantize(x, self.act_bits, True, "tensor"), x.dtype)
        if self.use_triton and _triton_usable():
            from labkit.kernels.quant_matmul import quant_matmul

            return quant_matmul(x, **self.kernel_operands())
        return x @ self.dequantized_weight(x.dtype).T

    def kernel_operands(self) -> dict:
        """Keyword arguments of ``labkit.kernels.quant_matmul`` for this layer's weight."""
        if self.fmt == "nf4":
            return dict(qweight=self.qweight, scales=self.scales, fmt="nf4", group_size=self.group, codebook=self.codebook)
        qweight = self.qweight.view(torch.int8) if self.bits == 8 and self.symmetric else self.qweight
        return dict(qweight=qweight, scales=self.scales, fmt=f"int{self.bits}", group_size=self.group, zeros=self.zeros)

    @property
    def storage_bytes(self) -> int:
        return state_dict_bytes(self)

    def extra_repr(self) -> str:
        kind = "nf4" if self.fmt == "nf4" else f"int{self.bits}{'' if self.symmetric else ' asymmetric'}"
        extra = (", input_scale" if self.input_scale is not None else "") + (f", act_bits={self.act_bits}" if self.act_bits else "")
        return f"d_in={self.d_in}, d_out={self.d_out}, {kind}, group_size={self.group_size}, scales={self.scales.dtype}{extra}"


def _method_format(method: str, bits: int | None) -> tuple[str, int]:
    if method not in METHODS:
        raise ValueError(f"method={method!r}: expected one of {sorted(METHODS)}")
    fmt, fixed_bits = METHODS[method]
    if fixed_bits is None:
        if bits is None:
            raise ValueError("bits: method='int' needs bits (2 to 8)")
        _check_bits(bits)
        return fmt, bits
    if bits is not None and bits != fixed_bits:
        raise ValueError(f"bits={bits}: method={method!r} is {fixed_bits}-bit")
    return fmt, fixed_bits


def _triton_usable() -> bool:
    from labkit import kernels

    return kernels.available()[0]


# ============================================================================ the KV cache
class QuantizedKVCache:
    """A KV cache (the interface of :class:`labkit.nn.KVCache`) that stores keys and values as
    ``bits``-bit symmetric integer codes, packed (:func:`pack_bits`), with one fp16 scale per
    token and head (the absmax over ``head_dim``).

    ``update`` quantizes the new keys and values once, as they are written, and returns the whole
    cache dequantized: attention then reads exactly what a quantized cache holds. :attr:`nbytes`
    is measured from the buffers: ``ceil(head_dim * bits / 8) + 2`` bytes per token, head and K or V,
    against ``4 * head_dim`` in fp32.
    """

    def __init__(self, bits: int, num_layers: int, batch_size: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 device=None):
        _check_bits(bits)
        sizes = dict(num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads, max_seq_len=max_seq_len,
                     head_dim=head_dim)
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        shape = (num_layers, batch_size, num_kv_heads, max_seq_len)
        self.bits, self.head_dim, self.num_layers, self.max_seq_len = bits, head_dim, num_layers, max_seq_len
        self.codes = {kind: torch.zeros(*shape, math.ceil(head_dim * bits / 8), dtype=torch.uint8, device=device) for kind in "kv"}
        self.scales = {kind: torch.ones(shape, dtype=torch.float16, device=device) for kind in "kv"}
        self._lengths = [0] * num_layers

    @classmethod
    def for_model(cls, model: nn.Module, batch_size: int, bits: int, max_seq_len: int | None = None) -> "QuantizedKVCache":
        """An empty cache shaped for ``model`` (a :class:`labkit.model.TransformerLM`), on its device."""
        cfg = model.config
        return cls(bits, cfg.num_layers, batch_size, cfg.kv_heads, max_seq_len or cfg.context_length, cfg.dim_per_head,
                   device=model.token_embeddings.weight.device)

    def length(self, layer_idx: int = 0) -> int:
        """Number of positions cached for ``layer_idx``."""
        return self._lengths[layer_idx]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize and append ``k, v [batch, num_kv_heads, new, head_dim]``; return every cached
        position of layer ``layer_idx``, dequantized, in ``k``'s dtype."""
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx={layer_idx}: expected 0 <= layer_idx < {self.num_layers}")
        expected = (*self.scales["k"].shape[1:3], self.head_dim)
        if k.dim() != 4 or (k.shape[0], k.shape[1], k.shape[3]) != expected or k.shape != v.shape:
            raise ValueError(f"k, v: expected equal shapes [batch={expected[0]}, num_kv_heads={expected[1]}, new, "
                             f"head_dim={expected[2]}], got {tuple(k.shape)} and {tuple(v.shape)}")
        start = self._lengths[layer_idx]
        end = start + k.shape[2]
        if end > self.max_seq_len:
            raise ValueError(f"QuantizedKVCache overflow: {start} cached + {k.shape[2]} new > max_seq_len={self.max_seq_len}")
        cached = []
        for kind, new in (("k", k), ("v", v)):
            q = quantize(new.detach().float(), self.bits, True, "channel", axis=-1)
            self.codes[kind][layer_idx, :, :, start:end] = pack_bits(q.codes, self.bits)
            self.scales[kind][layer_idx, :, :, start:end] = q.scale.squeeze(-1).to(torch.float16)
            codes = unpack_bits(self.codes[kind][layer_idx, :, :, :end], self.bits, self.head_dim, signed=True)
            cached.append((codes.float() * self.scales[kind][layer_idx, :, :, :end, None].float()).to(k.dtype))
        self._lengths[layer_idx] = end
        return cached[0], cached[1]

    append = update

    @property
    def nbytes(self) -> int:
        """Bytes of the code and scale buffers (allocated up front for ``max_seq_len``)."""
        return sum(t.numel() * t.element_size() for t in (*self.codes.values(), *self.scales.values()))


# ============================================================================ whole models
@dataclass
class QuantizationReport:
    """What :func:`quantize_model` did, with byte counts measured from the state dicts."""

    method: str
    bits: int
    group_size: int | None
    quantized_layers: list[str]
    bytes_before: int
    bytes_after: int
    weight_bytes_before: int  # the quantized layers' weights, as they were
    weight_bytes_after: int  # their buffers now: codes, scales, zeros
    quantized_parameters: int
    act_bits: int | None = None  # None: weight-only

    @property
    def bits_per_parameter(self) -> float:
        """Measured bits per weight of the quantized layers (codes and scales)."""
        return 8 * self.weight_bytes_after / self.quantized_parameters

    @property
    def compression(self) -> float:
        return self.bytes_before / self.bytes_after


QUANTIZE_MODEL_METHODS = ("rtn", "gptq", "nf4", "awq", "smoothquant")
CALIBRATED_METHODS = ("gptq", "awq", "smoothquant")


@torch.no_grad()
def quantize_model(model: nn.Module, method: str = "rtn", bits: int = 4, group_size: int | None = None, symmetric: bool = True,
                   skip=("lm_head",), calibration: torch.Tensor | None = None, scale_dtype: torch.dtype = torch.float16,
                   use_triton: bool = False, damp: float = 0.01, act_bits: int | None = None) -> tuple[nn.Module, QuantizationReport]:
    """A copy of ``model`` whose :class:`labkit.nn.Linear` layers are :class:`QuantLinear`; the
    original is untouched. Returns ``(quantized_model, report)``.

    * ``method``: ``"rtn"`` (round to nearest, ``bits`` 2..8), ``"gptq"`` (needs
      ``calibration`` token ids ``[batch, seq]``), ``"nf4"`` (4 bits), ``"awq"`` (weight-only,
      :func:`awq_quantize`'s searched scales, symmetric) or ``"smoothquant"`` (W``bits``
      A``act_bits``, :func:`smoothquant_search`'s searched migration strength, one weight scale
      per row, symmetric); the last two need ``calibration`` too. Their factors ``s`` are kept
      as each layer's ``input_scale``.
    * ``act_bits``: also quantize each quantized layer's input, one dynamic scale per tensor
      (:class:`QuantLinear`); ``None`` is weight-only. SmoothQuant needs it.
    * ``skip``: layers left in full precision; an entry matches a layer's full name
      (``fnmatch`` patterns such as ``"layers.0.*"``) or its last component (``"w2"``). The LM
      head is skipped by default, as GPTQ and bitsandbytes do: it is small next to the blocks of
      a large model and its errors go straight into the logits.
    * GPTQ (and AWQ and SmoothQuant) go block by block, as in the GPTQ paper: each transformer
      block is calibrated on the inputs it receives from the blocks already quantized, so later layers correct for the
      errors of earlier ones (all layers of one block are calibrated on the same pass).
    * If the LM head shares its weight with the embedding (``tie_embeddings``) and is quantized,
      the embedding keeps the full-precision copy.
    """
    if method not in QUANTIZE_MODEL_METHODS:
        raise ValueError(f"method={method!r}: expected one of {QUANTIZE_MODEL_METHODS}")
    if method == "nf4" and bits != 4:
        raise ValueError(f"bits={bits}: NF4 is a 4-bit format")
    if method in CALIBRATED_METHODS and calibration is None:
        raise ValueError(f"calibration: method={method!r} needs token ids [batch, seq] to calibrate on")
    if method == "smoothquant" and act_bits is None:
        raise ValueError("act_bits: SmoothQuant smooths the activations for their quantization; give act_bits (8 for W8A8)")
    if method in ("awq", "smoothquant") and (group_size is not None or not symmetric):
        raise ValueError(f"method={method!r}: labkit's version is symmetric with one scale per row (group_size=None)")
    if isinstance(skip, str):
        skip = (skip,)
    quantized = copy.deepcopy(model)
    targets = [name for name, module in quantized.named_modules() if isinstance(module, Linear) and not _skipped(name, skip)]
    weight_bytes_before = sum(state_dict_bytes(quantized.get_submodule(n)) for n in targets)
    parameters = sum(quantized.get_submodule(n).weight.numel() for n in targets)
    bytes_before = state_dict_bytes(model)
    layer_method, layer_bits = ("nf4", None) if method == "nf4" else ("int", bits)

    def replace(names, inputs=None):
        for name in names:
            linear = quantized.get_submodule(name)
            input_scale = None
            if method == "awq":
                input_scale = awq_quantize(linear.weight, inputs[name], bits)[1]
            elif method == "smoothquant":
                input_scale = smoothquant_search(linear.weight, inputs[name], bits, act_bits)[0]
            layer = QuantLinear.from_linear(linear, layer_method, group_size, bits=layer_bits, symmetric=symmetric,
                                            gptq_inputs=inputs[name] if method == "gptq" else None, damp=damp,
                                            scale_dtype=scale_dtype, use_triton=use_triton, input_scale=input_scale,
                                            act_bits=act_bits)
            parent, _, child = name.rpartition(".")
            setattr(quantized.get_submodule(parent) if parent else quantized, child, layer)

    if method in CALIBRATED_METHODS:
        quantized.eval()
        for stage in _calibration_stages(targets):
            replace(stage, capture_linear_inputs(quantized, calibration, set(stage)))
    else:
        replace(targets)
    report = QuantizationReport(method, 4 if method == "nf4" else bits, group_size, targets, bytes_before,
                                state_dict_bytes(quantized), weight_bytes_before,
                                sum(state_dict_bytes(quantized.get_submodule(n)) for n in targets), parameters, act_bits)
    return quantized, report


def _skipped(name: str, skip) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) or name.rpartition(".")[2] == pattern for pattern in skip)


def _calibration_stages(names: list[str]) -> list[list[str]]:
    """Layers grouped by transformer block (``layers.{i}.*``), in order; others (the LM head) last."""
    stages: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 2 else name
        stages.setdefault(key, []).append(name)
    return list(stages.values())


# ============================================================================ evaluating the adder
# the adder's training context; estimate_loss draws the same batches for every model it compares
EVAL_CONFIG = TrainConfig(batch_size=64, context_length=32, eval_batches=2)


@torch.no_grad()
def evaluate_adder(model: nn.Module, task: ArithmeticTask, split: str = "val", max_examples: int | None = None) -> dict:
    """``{"accuracy", "loss"}``: exact-match accuracy of greedy answers
    (:meth:`ArithmeticTask.evaluate`) and mean next-token loss (:func:`labkit.train.estimate_loss`,
    on fixed batches) of ``model`` on ``task``'s ``split``. Pass ``labkit.pretrained.adder_task()``."""
    device = next(model.parameters()).device
    accuracy = task.evaluate(model, split, max_examples=max_examples, device=device)
    loss = estimate_loss(model, task.tokens(split), EVAL_CONFIG, device)
    return {"accuracy": accuracy, "loss": loss}


# The notebook's table: round to nearest from 8 down to 2 bits (per channel), group sizes at
# 4 and 3 bits, NF4 and GPTQ.
DEFAULT_SWEEP = (
    *(dict(method="rtn", bits=bits) for bits in (8, 6, 4, 3, 2)),
    dict(method="rtn", bits=4, group_size=32), dict(method="rtn", bits=4, group_size=16), dict(method="rtn", bits=3, group_size=16),
    dict(method="nf4", bits=4, group_size=64), dict(method="nf4", bits=4, group_size=16),
    *(dict(method="gptq", bits=bits) for bits in (4, 3, 2)), dict(method="gptq", bits=3, group_size=16),
)


def compare_quantizations(model: nn.Module, task: ArithmeticTask, configs=DEFAULT_SWEEP, calibration: torch.Tensor | None = None,
                          split: str = "val", max_examples: int | None = None, skip=("lm_head",)) -> list[dict]:
    """One row per configuration (plus the unquantized model first): method, bits, group size,
    activation bits (``"act"``: ``"-"`` for weight-only), measured bits per quantized weight,
    model bytes, accuracy and loss (:func:`evaluate_adder`). ``configs``: keyword dicts for
    :func:`quantize_model`; GPTQ, AWQ and SmoothQuant rows use ``calibration``
    (default: :func:`calibration_tokens` of ``task``)."""
    if calibration is None and any(c.get("method") in CALIBRATED_METHODS for c in configs):
        calibration = calibration_tokens(task, device=next(model.parameters()).device)
    float_bits = 8 * next(model.parameters()).element_size()
    rows = [{"method": "none", "bits": float_bits, "group": "-", "act": "-", "bits/param": float(float_bits), "bytes": state_dict_bytes(model),
             **evaluate_adder(model, task, split, max_examples)}]
    for config in configs:
        quantized, report = quantize_model(model, calibration=calibration, skip=skip, **config)
        rows.append({"method": report.method, "bits": report.bits, "group": report.group_size or "row", "act": report.act_bits or "-",
                     "bits/param": report.bits_per_parameter, "bytes": report.bytes_after,
                     **evaluate_adder(quantized, task, split, max_examples)})
    return rows


# ============================================================================ widget callback
def quantization_explorer(bits: int, symmetric: bool, granularity: str, group_size: int | None, outlier_magnitude: float,
                          seed: int = 0, rows: int = 4, cols: int = 64) -> dict:
    """What the quantization explorer plots: a ``[rows, cols]`` "weight" of N(0, 1) values whose
    entry ``[0, 0]`` is ``outlier_magnitude`` when that is non-zero (one outlier, as trained
    weights have), quantized with the chosen scheme.

    Returns ``values`` and ``dequantized`` (row 0, fp32 lists), ``levels`` (for each scale group
    of row 0: ``{"start", "stop", "levels"}``, the columns it covers and every value it can
    represent), ``error`` (``mse``, ``max_abs_error``, ``sqnr_db`` of the whole matrix),
    ``row0_error`` (the same for row 0, the row with the outlier), ``scales`` (row 0's) and
    ``bits_per_parameter`` (fp16 scales, 8-bit zero points when asymmetric).
    """
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=generator)
    if outlier_magnitude:
        weight[0, 0] = outlier_magnitude
    group_size = group_size if granularity == "group" else None
    q = quantize(weight, bits, symmetric, granularity, group_size, axis=-1)
    dequantized = dequantize(q, torch.float32)
    if granularity == "tensor":
        group_indices, span = [()], cols
    else:
        group_indices, span = [(0, g) for g in range(q.scale.shape[1])], group_size or cols
    levels = [{"start": i * span, "stop": (i + 1) * span, "levels": q.levels(index).tolist()} for i, index in enumerate(group_indices)]
    per_group = {"tensor": None, "channel": cols, "group": group_size}[granularity]
    return {
        "values": weight[0].tolist(),
        "dequantized": dequantized[0].tolist(),
        "levels": levels,
        "error": quantization_error(weight, dequantized),
        "row0_error": quantization_error(weight[0], dequantized[0]),
        "scales": [q.scale[index].item() for index in group_indices],
        "bits_per_parameter": bits_per_parameter(bits, per_group, 16, 0 if symmetric else 8),
    }


# ============================================================================ sizing a DeepSeek-V3-class model
# DeepSeek-V3's published config.json (github.com/deepseek-ai/DeepSeek-V3, config_671B.json /
# the Hugging Face config.json): the fields that decide its parameter count, under their names.
DEEPSEEK_V3 = dict(
    vocab_size=129280, hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=3, intermediate_size=18432,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=2048,
    num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, tie_word_embeddings=False,
)


def deepseek_v3_parameters(**overrides) -> dict[str, int]:
    """Parameter count of a DeepSeek-V3-style model (MLA attention, DeepSeekMoE FFN), by part,
    computed from its config (:data:`DEEPSEEK_V3`; pass any field to change it).

    The layers follow the reference implementation (``modeling_deepseek.py``), weights ``[out, in]``, no biases:

    * **MLA attention**, every layer: queries through a low-rank bottleneck, ``q_a_proj``
      ``[q_lora_rank, hidden]`` -> RMSNorm ``q_a_layernorm`` -> ``q_b_proj`` ``[heads * (nope + rope), q_lora_rank]``;
      keys and values compressed into one latent, ``kv_a_proj_with_mqa`` ``[kv_lora_rank + rope, hidden]`` (the extra
      ``rope`` columns are the one decoupled RoPE key shared by all heads) -> RMSNorm ``kv_a_layernorm`` ->
      ``kv_b_proj`` ``[heads * (nope + v_head_dim), kv_lora_rank]``; ``o_proj`` ``[hidden, heads * v_head_dim]``.
    * **FFN**: the first ``first_k_dense_replace`` layers a SwiGLU MLP of ``intermediate_size``
      (``gate_proj``, ``up_proj``, ``down_proj``); the others ``n_routed_experts`` routed SwiGLU
      experts and ``n_shared_experts`` shared ones of ``moe_intermediate_size``, plus the router
      ``gate`` (a ``[n_routed_experts, hidden]`` weight and the ``e_score_correction_bias`` of
      auxiliary-loss-free balancing, ``[n_routed_experts]``).
    * RMSNorms: two per layer (before attention and FFN) plus the two latent norms, and a final one;
      untied input embedding and LM head ``[vocab, hidden]``.

    The multi-token-prediction (MTP) module of the released checkpoint is not counted: with the
    defaults the total is DeepSeek-V3's published 671B (the checkpoint's 685B includes MTP).
    Returns ``embeddings, attention, dense_ffn, routed_experts, shared_experts, routers, norms,
    lm_head`` (each summed over all layers), ``total``, and ``active``: the parameters one
    token uses, i.e. the total minus the routed experts it is not sent to
    (``n_routed_experts - num_experts_per_tok`` per MoE layer).
    """
    unknown = set(overrides) - set(DEEPSEEK_V3)
    if unknown:
        raise ValueError(f"unknown config fields {sorted(unknown)}; expected some of {sorted(DEEPSEEK_V3)}")
    c = {**DEEPSEEK_V3, **overrides}
    may_be_zero = ("first_k_dense_replace", "n_shared_experts")
    for name, value in c.items():
        if name == "tie_word_embeddings":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name in may_be_zero else 1):
            raise ValueError(f"{name}={value!r}: expected a {'non-negative' if name in may_be_zero else 'positive'} integer")
    if not 0 <= c["first_k_dense_replace"] <= c["num_hidden_layers"]:
        raise ValueError(f"first_k_dense_replace={c['first_k_dense_replace']}: expected 0 to num_hidden_layers")
    if c["num_experts_per_tok"] > c["n_routed_experts"]:
        raise ValueError(f"num_experts_per_tok={c['num_experts_per_tok']}: more than n_routed_experts={c['n_routed_experts']}")
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    qk_head_dim = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attention = (hidden * c["q_lora_rank"] + c["q_lora_rank"] * heads * qk_head_dim  # q_a_proj, q_b_proj
                 + hidden * (c["kv_lora_rank"] + c["qk_rope_head_dim"])  # kv_a_proj_with_mqa
                 + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])  # kv_b_proj
                 + heads * c["v_head_dim"] * hidden)  # o_proj
    swiglu = lambda inner: 3 * hidden * inner  # noqa: E731  (gate_proj, up_proj, down_proj)
    dense_layers = c["first_k_dense_replace"]
    moe_layers = c["num_hidden_layers"] - dense_layers
    layers = c["num_hidden_layers"]
    expert = swiglu(c["moe_intermediate_size"])
    parts = {
        "embeddings": c["vocab_size"] * hidden,
        "attention": layers * attention,
        "dense_ffn": dense_layers * swiglu(c["intermediate_size"]),
        "routed_experts": moe_layers * c["n_routed_experts"] * expert,
        "shared_experts": moe_layers * c["n_shared_experts"] * expert,
        "routers": moe_layers * (c["n_routed_experts"] * hidden + c["n_routed_experts"]),
        "norms": layers * (2 * hidden + c["q_lora_rank"] + c["kv_lora_rank"]) + hidden,
        "lm_head": 0 if c["tie_word_embeddings"] else c["vocab_size"] * hidden,
    }
    parts["total"] = sum(parts.values())
    parts["active"] = parts["total"] - moe_layers * (c["n_routed_experts"] - c["num_experts_per_tok"]) * expert
    return parts
