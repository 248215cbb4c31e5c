"""Block-scaled number formats (chapter 01): OCP MX, NVFP4 and DeepSeek-V3's fine-grained FP8 scaling.

One scale per tensor must fit the tensor's largest entry, so an outlier pushes every ordinary
entry towards the format's subnormals (chapter 01, section 8). Block scaling gives every small
block of consecutive values its own scale:

* **OCP MX** (*OCP Microscaling Formats (MX) Specification v1.0*, 2023): 32 consecutive values
  share one **E8M0** scale, a bare 8-bit exponent (bias 127, values ``2^-127 .. 2^127``, code
  ``0xFF`` NaN, no zero, no sign; spec §5.4.1). Elements: MXFP8 (E4M3 or E5M2), MXFP6 (E3M2 or
  E2M3), MXFP4 (E2M1).
* **NVFP4** (NVIDIA, *Pretraining Large Language Models with NVFP4*, 2025): 16 FP4 (E2M1) values
  share an FP8 **E4M3** scale, and the whole tensor has one more fp32 scale,
  ``amax(tensor) / (6 * 448)``, that puts the largest block scale at E4M3's max.
* **DeepSeek-V3** (*DeepSeek-V3 Technical Report*, 2024, §3.3.2): FP8 E4M3 with an fp32 scale
  ``amax / 448`` per 1x128 tile of activations and per 128x128 block of weights.

A scheme is a :class:`BlockFormat`; :data:`BLOCK_FORMATS` names them. :func:`quantize_blocks`
returns the element codes and the scales (a :class:`BlockQuantized`), :func:`dequantize_blocks`
reads them back, :func:`bits_per_value` counts the scales' bits too. The element codes come from
:func:`labkit.formats.encode` (round to nearest even, saturating), so every element format here is
the one the rest of the chapter decodes bit by bit. :func:`e8m0_exponent` shows why an MX scale is
rounded *up* to a power of two, and :func:`simulated_accumulation` why DeepSeek-V3 copies the
tensor cores' partial sums to fp32 every 128 products. ``labkit.kernels.block_quantize`` is the
Triton version of :func:`quantize_blocks` (same codes and scales, bit for bit).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labkit import precision as P

# E8M0, the MX scale (OCP MX v1.0 §5.4.1): 8 exponent bits, bias 127, no mantissa, no sign.
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT = -127, 127
SCALE_KINDS = ("e8m0", "fp32", "e4m3+fp32")
ROUNDINGS = ("up", "ocp", "down")
# NVFP4's tensor scale maps the tensor's amax onto the largest value a block can hold: the largest
# E2M1 element (6) times the largest E4M3 block scale (448).
NVFP4_TENSOR_RANGE = 6.0 * 448.0


@dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: ``element`` values in ``block = (rows, cols)`` tiles that share one
    scale of kind ``scale``: ``"e8m0"`` (a power of two, MX), ``"fp32"`` (``amax / element max``,
    DeepSeek-V3) or ``"e4m3+fp32"`` (an E4M3 block scale times one fp32 scale per tensor, NVFP4).
    A block of one row runs along the last dimension of any tensor; a taller block needs a 2-D one."""

    name: str
    element: str
    block: tuple[int, int]
    scale: str

    def __post_init__(self):
        P.get_format(self.element)
        if self.scale not in SCALE_KINDS:
            raise ValueError(f"scale={self.scale!r}: expected one of {SCALE_KINDS}")
        if (not isinstance(self.block, tuple) or len(self.block) != 2
                or not all(isinstance(b, int) and b > 0 and b & (b - 1) == 0 for b in self.block)):
            raise ValueError(f"block={self.block!r}: expected (rows, cols), both powers of two")

    @property
    def element_format(self) -> P.FloatFormat:
        return P.get_format(self.element)

    @property
    def block_values(self) -> int:
        """Values that share one scale."""
        return self.block[0] * self.block[1]

    @property
    def scale_bits(self) -> int:
        return 32 if self.scale == "fp32" else 8

    @property
    def tensor_scale_bits(self) -> int:
        return 32 if self.scale == "e4m3+fp32" else 0

    @property
    def storage(self) -> P.BlockScaling:
        """The same scheme as chapter 01's :class:`labkit.precision.BlockScaling` (bit accounting)."""
        return P.BlockScaling(self.name, self.element, self.block_values, self.scale_bits, self.tensor_scale_bits)


BLOCK_FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("mxfp8_e4m3", "fp8_e4m3", (1, 32), "e8m0"),  # OCP MX v1.0 §5 (table of MX-compliant formats)
        BlockFormat("mxfp8_e5m2", "fp8_e5m2", (1, 32), "e8m0"),
        BlockFormat("mxfp6_e3m2", "fp6_e3m2", (1, 32), "e8m0"),
        BlockFormat("mxfp6_e2m3", "fp6_e2m3", (1, 32), "e8m0"),
        BlockFormat("mxfp4_e2m1", "fp4_e2m1", (1, 32), "e8m0"),
        BlockFormat("nvfp4", "fp4_e2m1", (1, 16), "e4m3+fp32"),  # NVIDIA NVFP4: 16 values per E4M3 scale
        BlockFormat("deepseek_1x128", "fp8_e4m3", (1, 128), "fp32"),  # DeepSeek-V3 §3.3.2: activation tiles
        BlockFormat("deepseek_128x128", "fp8_e4m3", (128, 128), "fp32"),  # ... and weight blocks
    )
}
MX_FORMATS = tuple(name for name, f in BLOCK_FORMATS.items() if f.scale == "e8m0")


def get_block_format(fmt: str | BlockFormat) -> BlockFormat:
    """The :class:`BlockFormat` called ``fmt`` (a BlockFormat passes through)."""
    if isinstance(fmt, BlockFormat):
        return fmt
    if isinstance(fmt, str) and fmt in BLOCK_FORMATS:
        return BLOCK_FORMATS[fmt]
    raise ValueError(f"fmt={fmt!r}: expected a BlockFormat or one of {sorted(BLOCK_FORMATS)}")


def bits_per_value(fmt: str | BlockFormat, shape: tuple[int, ...] | None = None) -> float:
    """Bits per value, scales included. Without ``shape`` the large-tensor limit ``element bits +
    scale bits / block values`` (MXFP4 4 + 8/32 = 4.25, NVFP4 4 + 8/16 = 4.5); with ``shape`` the
    exact count for one tensor of that shape: a started block pays a whole scale, and NVFP4's
    32-bit tensor scale is spread over the tensor's values."""
    fmt = get_block_format(fmt)
    if shape is None:
        return fmt.storage.bits_per_value
    shape = tuple(shape)
    if not shape or not all(isinstance(s, int) and s > 0 for s in shape):
        raise ValueError(f"shape={shape!r}: expected a non-empty tuple of positive integers")
    blocks = math.prod(_scale_shape(shape, fmt))
    total = math.prod(shape) * fmt.element_format.bits + blocks * fmt.scale_bits + fmt.tensor_scale_bits
    return total / math.prod(shape)


# ----------------------------------------------------------------------------- E8M0 scales
def element_emax(element: str | P.FloatFormat) -> int:
    """``floor(log2(max))`` of an element format: the exponent of its largest binade (OCP MX's
    ``emax_elem``: E4M3 8, E5M2 15, E3M2 4, E2M3 2, E2M1 2)."""
    return math.frexp(P.get_format(element).max)[1] - 1


def e8m0_exponent(amax, fmt: str | BlockFormat, rounding: str = "up") -> torch.Tensor:
    """The E8M0 exponent ``e`` (int32, ``amax``'s shape and device) of blocks whose largest magnitudes
    are ``amax``: the block's scale is ``2^e`` (:func:`e8m0_scale`). ``fmt`` is an MX format (or any block
    format's element type, or an element format).

    The ideal scale ``amax / max`` (``max`` = the element format's largest value) is rarely a power
    of two, and E8M0 holds only powers of two, so it must be rounded:

    * ``"up"``: ``ceil(log2(amax / max))``. ``amax / scale <= max``: nothing clips; the price is up to
      one binade of the element range left unused. NVIDIA's MXFP8 recipe (Mishra et al., *Recipes for
      Pre-training LLMs with MXFP8*, 2025) and cuBLAS's "RCEIL" compute the scale this way.
    * ``"ocp"``: ``floor(log2(amax)) - emax_elem``, the OCP MX v1.0 conversion (§6.3). It puts
      amax in the element's top binade ``[2^emax, 2^(emax+1))``, which reaches past ``max`` when
      ``max`` is not ``2^(emax+1) - ulp`` (E2M1: 6 < 8, E4M3: 448 < 512): a block whose amax has a
      larger significand than ``max`` (E2M1: above 1.5, E4M3: above 1.75) saturates its largest
      entries to ``max`` (the spec clamps values beyond max normal when it converts the elements).
    * ``"down"``: ``floor(log2(amax / max))``, the other naive rounding: ``amax / scale`` lands in
      ``[max, 2 max)``, so every block whose amax is not ``max`` times a power of two clips.

    The exponent is computed exactly from amax's bits: with ``amax = s * 2^b`` and ``max = s_max *
    2^emax`` (significands in ``[1, 2)``), ``log2(amax / max) = b - emax + log2(s / s_max)`` and the last
    term lies in ``(-1, 1)``, so comparing ``s`` with ``s_max`` decides the rounding. An fp32 logarithm
    instead misplaces amax values one float above ``max * 2^k`` (``amax / max`` rounds to ``2^k``, whose
    ceil is ``k``, not ``k + 1``). Then clamped to E8M0's ``-127 .. 127``; an all-zero block (amax 0) gets
    exponent 0 (scale 1). (Exercise 5 of chapter 01.)
    """
    element = _element_of(fmt)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r}: expected one of {ROUNDINGS}")
    amax = torch.as_tensor(amax, dtype=torch.float32) if not isinstance(amax, torch.Tensor) else amax
    if amax.is_complex() or not amax.is_floating_point():
        raise TypeError(f"amax: expected a floating-point tensor of block amaxes, got {amax.dtype}")
    amax64 = amax.detach().to(device="cpu", dtype=torch.float64)
    if not torch.isfinite(amax64).all() or (amax64 < 0).any():
        raise ValueError("amax: expected finite, non-negative block amaxes (max |x| per block)")
    fraction, exponent = torch.frexp(amax64)  # amax = fraction * 2^exponent, fraction in [0.5, 1)
    significand, binade = 2 * fraction, exponent.long() - 1  # amax = significand * 2^binade
    max_significand = element.max / 2.0 ** element_emax(element)
    scale_exponent = binade - element_emax(element)  # "ocp"
    if rounding == "up":
        scale_exponent = scale_exponent + (significand > max_significand).long()
    elif rounding == "down":
        scale_exponent = scale_exponent - (significand < max_significand).long()
    scale_exponent = torch.where(amax64 > 0, scale_exponent, 0).clamp(E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT)
    return scale_exponent.to(device=amax.device, dtype=torch.int32)


def e8m0_scale(amax, fmt: str | BlockFormat, rounding: str = "up") -> torch.Tensor:
    """The power-of-two scale (fp32, ``amax``'s device) ``2^e8m0_exponent(amax, fmt, rounding)`` of blocks
    whose largest magnitudes are ``amax`` (see :func:`e8m0_exponent` for the three roundings). ``2^-127``
    is an fp32 subnormal, exactly representable."""
    exponent = e8m0_exponent(amax, fmt, rounding)
    return torch.ldexp(torch.ones(exponent.shape, dtype=torch.float64), exponent.cpu().double()).float().to(exponent.device)


def e8m0_encode(scales: torch.Tensor) -> torch.Tensor:
    """The E8M0 codes (uint8, ``exponent + 127``) of power-of-two ``scales`` in ``[2^-127, 2^127]``
    (NaN -> 0xFF); anything else raises, because E8M0 cannot hold it."""
    s = scales.detach().double().cpu() if isinstance(scales, torch.Tensor) else torch.as_tensor(scales, dtype=torch.float64)
    fraction, exponent = torch.frexp(s)
    finite = torch.isfinite(s)
    power_of_two = finite & (fraction == 0.5) & (exponent - 1 >= E8M0_MIN_EXPONENT) & (exponent - 1 <= E8M0_MAX_EXPONENT)
    if not (power_of_two | s.isnan()).all():
        raise ValueError("scales: E8M0 holds only powers of two from 2^-127 to 2^127 (and NaN)")
    codes = torch.where(s.isnan(), E8M0_NAN, exponent.long() - 1 + E8M0_BIAS)
    return codes.to(torch.uint8)


def e8m0_decode(codes) -> torch.Tensor:
    """Values (float64) of E8M0 codes 0..255: ``2^(code - 127)``, and NaN for 0xFF."""
    codes = torch.as_tensor(codes)
    if codes.is_floating_point() or codes.dtype == torch.bool:
        raise TypeError(f"codes: expected integer E8M0 codes, got {codes.dtype}")
    codes = codes.detach().cpu().long()
    if codes.numel() and (codes.min() < 0 or codes.max() > 255):
        raise ValueError("codes: E8M0 codes lie in 0..255")
    values = torch.ldexp(torch.ones(codes.shape, dtype=torch.float64), (codes - E8M0_BIAS).double())
    return torch.where(codes == E8M0_NAN, math.nan, values)


# ----------------------------------------------------------------------------- quantize / dequantize
@dataclass(frozen=True)
class BlockQuantized:
    """A tensor in a block format: ``codes`` (uint8, the input's shape; one element code per byte,
    unpacked), ``scales`` (fp32: shape ``(*x.shape[:-1], ceil(K / cols))`` for one-row blocks,
    ``(ceil(rows / r), ceil(K / cols))`` for taller ones) and, for NVFP4, ``tensor_scale``
    (0-d fp32). A value is ``element(code) * scale[block] * tensor_scale``."""

    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None
    fmt: BlockFormat

    @property
    def scale_codes(self) -> torch.Tensor:
        """The scales as stored: E8M0 codes (MX), E4M3 codes (NVFP4) or fp32 bit patterns."""
        if self.fmt.scale == "e8m0":
            return e8m0_encode(self.scales).to(self.scales.device)
        if self.fmt.scale == "e4m3+fp32":
            return P.encode(self.scales, "fp8_e4m3").to(torch.uint8).to(self.scales.device)
        return self.scales.view(torch.int32)


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``max |x|`` (fp32) over each ``block = (rows, cols)`` tile of ``x``'s last one or two
    dimensions; partial tiles at the ends count their own entries only."""
    rows, cols = block
    x2 = _as_blocked_2d(x, block)
    padded = F.pad(x2.detach().float().abs(), (0, -x2.shape[1] % cols, 0, -x2.shape[0] % rows))
    tiles = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    return tiles.amax(dim=(1, 3)).reshape(_scale_shape(tuple(x.shape), _any_format(block)))


def quantize_blocks(x: torch.Tensor, fmt: str | BlockFormat, rounding: str = "up") -> BlockQuantized:
    """Quantize ``x`` (finite fp32/fp16/bf16) to the block format ``fmt``.

    Each block's scale comes from its amax (:func:`block_amax`): :func:`e8m0_scale` with
    ``rounding`` for MX formats; ``amax / 448`` in fp32 for DeepSeek-V3; for NVFP4 the tensor scale
    ``t = amax(x) / 2688`` and the block scale ``E4M3(amax_block / 6 / t)`` (saturating). Then
    ``x / (block scale * tensor scale)``, divided in fp32 as on the GPU, is rounded to the element
    format (nearest even, saturating at ±max). An all-zero block gets scale 1 (NVFP4: the E4M3
    block scale 0, whose elements are 0).
    """
    fmt = get_block_format(fmt)
    _check_input(x)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r}: expected one of {ROUNDINGS}")
    if rounding != "up" and fmt.scale != "e8m0":
        raise ValueError(f"rounding={rounding!r}: only E8M0 (MX) scales are rounded to a power of two; {fmt.name} has {fmt.scale} scales")
    element = fmt.element_format
    amax = block_amax(x, fmt.block)
    tensor_scale = None
    if fmt.scale == "e8m0":
        scales = e8m0_scale(amax, fmt, rounding)
    elif fmt.scale == "fp32":
        scales = torch.where(amax > 0, amax / element.max, 1.0)
    else:
        tensor_amax = amax.max() if amax.numel() else torch.zeros((), device=x.device)
        tensor_scale = torch.where(tensor_amax > 0, tensor_amax / NVFP4_TENSOR_RANGE, 1.0)
        scales = P.round_to((amax / element.max) / tensor_scale, "fp8_e4m3", saturate=True).float().to(x.device)
    divisor = scales if tensor_scale is None else scales * tensor_scale
    # An NVFP4 block scale of 0 (an all-zero block, or one far below the tensor's amax) reads every
    # element back as 0: dividing by inf gives those elements the code of ±0.
    divisor = torch.where(divisor > 0, divisor, math.inf)
    scaled = x.float() / expand_scales(divisor, fmt, tuple(x.shape))
    codes = P.encode(scaled, element, saturate=True).to(torch.uint8).to(x.device)
    return BlockQuantized(codes, scales, tensor_scale, fmt)


def dequantize_blocks(q: BlockQuantized) -> torch.Tensor:
    """The values (float64, on the codes' device) that ``q`` stands for: element value x block scale
    (x tensor scale)."""
    if not isinstance(q, BlockQuantized):
        raise TypeError(f"q: expected a BlockQuantized (from quantize_blocks), got {type(q).__name__}")
    values = P.decode(q.codes, q.fmt.element).to(q.codes.device)
    scales = expand_scales(q.scales.double(), q.fmt, tuple(q.codes.shape))
    if q.tensor_scale is not None:
        scales = scales * q.tensor_scale.double()
    return values * scales


def expand_scales(scales: torch.Tensor, fmt: str | BlockFormat, shape: tuple[int, ...]) -> torch.Tensor:
    """Per-block ``scales`` repeated over their blocks: a tensor of ``shape``."""
    fmt = get_block_format(fmt)
    rows, cols = fmt.block
    if tuple(scales.shape) != _scale_shape(tuple(shape), fmt):
        raise ValueError(f"scales: expected shape {_scale_shape(tuple(shape), fmt)} for a tensor of shape {tuple(shape)}, got {tuple(scales.shape)}")
    expanded = scales.repeat_interleave(cols, dim=-1)[..., : shape[-1]]
    if rows > 1:
        expanded = expanded.repeat_interleave(rows, dim=0)[: shape[0]]
    return expanded


def mx_quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """MX quantization as two float32 tensors: ``(values, scales)`` with ``values`` the element
    values (``x / scale`` rounded to the element format, saturating; ``x``'s shape) and ``scales``
    the power-of-two block scales rounded up (:func:`e8m0_scale`), one per 32 values along the last
    dimension. ``values * scale`` is the stored tensor. (Exercise 5 of chapter 01.)"""
    fmt = get_block_format(fmt)
    if fmt.scale != "e8m0":
        raise ValueError(f"fmt={fmt.name!r}: expected an MX format, one of {MX_FORMATS}")
    q = quantize_blocks(x, fmt)
    return P.decode(q.codes, fmt.element).float().to(x.device), q.scales


# ----------------------------------------------------------------------------- measuring the error
def quantization_error(x: torch.Tensor, fmt: str | BlockFormat, where: torch.Tensor | None = None) -> dict:
    """What storing ``x`` (2-D) in ``fmt`` does: ``fmt`` a block format name, or an element format
    name for one amax scale per tensor (:func:`labkit.precision.fake_quantize`). Returns the
    norm-wise ``rel_error``, the same over the entries selected by the boolean mask ``where``
    (``rel_error_where``; e.g. the ordinary entries of a tensor with outliers) and the fraction of
    non-zero entries ``flushed`` to zero."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor, got {type(x).__name__ if not isinstance(x, torch.Tensor) else tuple(x.shape)}")
    if isinstance(fmt, str) and fmt in P.FORMATS:
        restored = P.fake_quantize(x, fmt)
    else:
        restored = dequantize_blocks(quantize_blocks(x, fmt)).cpu()
    exact = x.detach().double().cpu()
    where = torch.ones_like(exact, dtype=torch.bool) if where is None else where.cpu()
    if where.shape != exact.shape or where.dtype != torch.bool or not where.any():
        raise ValueError(f"where: expected a boolean mask of shape {tuple(exact.shape)} selecting at least one entry")
    nonzero = exact != 0
    return {"rel_error": P.relative_error(restored, exact), "rel_error_where": P.relative_error(restored[where], exact[where]),
            "flushed": ((restored == 0) & nonzero).double().sum().item() / max(1, int(nonzero.sum()))}


def clipped_fraction(x: torch.Tensor, fmt: str | BlockFormat, rounding: str = "up") -> float:
    """Fraction of the non-zero entries of ``x`` whose ``|x / scale|`` exceeds the element format's
    max, i.e. that saturate, with MX scales rounded by ``rounding`` (:func:`e8m0_scale`)."""
    fmt = get_block_format(fmt)
    q = quantize_blocks(x, fmt, rounding)
    ratio = x.detach().double().abs() / expand_scales(q.scales.double(), fmt, tuple(x.shape))
    nonzero = x != 0
    return ((ratio > fmt.element_format.max) & nonzero).double().sum().item() / max(1, int(nonzero.sum()))


# ----------------------------------------------------------------------------- random Hadamard transform
def hadamard_matrix(n: int) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix (entries ±1, float64; ``n`` a power of two):
    ``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``. Its rows are orthogonal: ``H H^T = n I``."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1 or n & (n - 1):
        raise ValueError(f"n={n!r}: expected a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)])
    return h


def random_hadamard(n: int = 16, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random Hadamard transform: ``diag(s) H_n / sqrt(n)`` with random signs ``s`` (float64). It is
    orthogonal (``R R^T = I``), so rotating both operands of a GEMM along K leaves the product unchanged:
    ``(A R)(R^T B) = A B``. NVIDIA's NVFP4 recipe (*Pretraining LLMs with NVFP4*, 2025) applies a 16x16 one
    to both inputs of the weight-gradient GEMM, with one fixed sign vector (Transformer Engine's
    ``get_rht_matrix``), before quantizing them to NVFP4."""
    matrix = hadamard_matrix(n)  # first: it checks n
    signs = torch.randint(0, 2, (n,), generator=generator).double() * 2 - 1
    return signs[:, None] * matrix / math.sqrt(n)


def hadamard_transform(x: torch.Tensor, matrix: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``x`` (float64) with every block of ``n`` consecutive values along its last dimension multiplied
    by ``matrix`` (``n x n``, orthogonal, e.g. :func:`random_hadamard`): ``block @ matrix``, or
    ``block @ matrix^T`` with ``inverse``, which undoes it."""
    if not isinstance(matrix, torch.Tensor) or matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"matrix: expected a square 2-D tensor, got {getattr(matrix, 'shape', matrix)}")
    n = matrix.shape[0]
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] % n:
        raise ValueError(f"x: expected a tensor whose last dimension is a multiple of {n}, got {getattr(x, 'shape', x)}")
    m = matrix.double().to(x.device)
    blocks = x.detach().double().reshape(*x.shape[:-1], x.shape[-1] // n, n)
    return (blocks @ (m.T if inverse else m)).reshape(x.shape)


def quantized_matmul(a: torch.Tensor, b: torch.Tensor, fmt: str | BlockFormat, transform: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (float64) with both operands stored in the block format ``fmt`` along K, the way a GEMM
    reads them: ``a`` ([M, K]) in blocks along its rows, ``b`` ([K, N]) along its columns. With
    ``transform`` (a :func:`random_hadamard` matrix) both are first rotated along K in blocks of its
    size, which leaves the exact product unchanged, and quantized rotated."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]):
        raise ValueError(f"a, b: expected tensors [M, K] and [K, N], got {getattr(a, 'shape', a)} and {getattr(b, 'shape', b)}")
    a_rows, b_columns = a, b.t()
    if transform is not None:
        a_rows, b_columns = hadamard_transform(a_rows, transform).float(), hadamard_transform(b_columns, transform).float()
    return dequantize_blocks(quantize_blocks(a_rows, fmt)) @ dequantize_blocks(quantize_blocks(b_columns, fmt)).t()


# ----------------------------------------------------------------------------- accumulation in a GEMM
def simulated_accumulation(a: torch.Tensor, b: torch.Tensor, mantissa_bits: int, promote_every: int | None = None) -> torch.Tensor:
    """``a @ b`` (float64 result) with the running sum over K kept in a float of ``mantissa_bits``
    mantissa bits (fp32's 8 exponent bits), rounded to nearest after every addition: a model of a
    tensor core's accumulator. The products themselves are exact (as they are for FP8 operands).
    With ``promote_every = N_C``, every ``N_C`` products the partial sum is added to an fp32
    accumulator and restarts from zero (DeepSeek-V3 §3.3.2: the H800's FP8 GEMMs keep "around 14
    bits" of the sum; copying partial sums to fp32 registers every N_C = 128 elements fixes it)."""
    return accumulation_errors(a, b, mantissa_bits, promote_every, [a.shape[1]], return_product=True)


def accumulation_errors(a: torch.Tensor, b: torch.Tensor, mantissa_bits: int, promote_every: int | None,
                        ks, return_product: bool = False):
    """The relative error (norm-wise, against the float64 product) of :func:`simulated_accumulation`
    over the first ``k`` columns of ``a`` / rows of ``b``, for each ``k`` in ``ks``, from one pass
    over K. With ``return_product=True``, the product over the whole K instead."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]):
        raise ValueError(f"a, b: expected tensors [M, K] and [K, N], got {getattr(a, 'shape', a)} and {getattr(b, 'shape', b)}")
    if not isinstance(mantissa_bits, int) or not 1 <= mantissa_bits <= 23:
        raise ValueError(f"mantissa_bits={mantissa_bits!r}: expected an integer from 1 to 23 (fp32 keeps 23)")
    if promote_every is not None and (not isinstance(promote_every, int) or promote_every <= 0):
        raise ValueError(f"promote_every={promote_every!r}: expected None or a positive integer")
    ks = sorted(set(int(k) for k in ks))
    if not ks or ks[0] < 1 or ks[-1] > a.shape[1]:
        raise ValueError(f"ks: expected K values from 1 to {a.shape[1]}")
    accumulator = P.FloatFormat(f"accumulator_e8m{mantissa_bits}", 8, mantissa_bits, 127)
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    partial = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    promoted = torch.zeros_like(partial, dtype=torch.float32)
    errors = {}
    for k in range(1, ks[-1] + 1):
        partial = P.round_to(partial + torch.outer(a64[:, k - 1], b64[k - 1]), accumulator, saturate=True)
        if promote_every is not None and k % promote_every == 0:
            promoted, partial = promoted + partial.float(), torch.zeros_like(partial)  # fp32 addition on the CUDA cores
        if k in ks and not return_product:
            exact = a64[:, :k] @ b64[:k]
            errors[k] = P.relative_error(promoted.double() + partial, exact)
    if return_product:
        return promoted.double() + partial
    return [errors[k] for k in ks]


# ----------------------------------------------------------------------------- helpers
def _check_input(x) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x: expected an fp32/fp16/bf16 tensor, got {type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype}")
    if x.dim() == 0:
        raise ValueError("x: expected at least one dimension (blocks run along the last one)")
    if not torch.isfinite(x).all():
        raise ValueError("x: contains inf or NaN; block formats here take finite values (an MX block with a NaN has a NaN scale)")


def _element_of(fmt) -> P.FloatFormat:
    """The element format of a block format, or an element format itself."""
    if isinstance(fmt, P.FloatFormat) or (isinstance(fmt, str) and fmt in P.FORMATS):
        return P.get_format(fmt)
    try:
        return get_block_format(fmt).element_format
    except ValueError:
        raise ValueError(f"fmt={fmt!r}: expected a block format ({sorted(BLOCK_FORMATS)}) or an element format ({sorted(P.FORMATS)})") from None


def _any_format(block: tuple[int, int]) -> BlockFormat:
    return BlockFormat("blocks", "fp8_e4m3", block, "fp32")


def _as_blocked_2d(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    if block[0] > 1:
        if x.dim() != 2:
            raise ValueError(f"x: {block[0]}x{block[1]} blocks tile a 2-D tensor, got shape {tuple(x.shape)}")
        return x
    if x.dim() == 0:
        raise ValueError("x: expected at least one dimension (blocks run along the last one)")
    return x.reshape(-1, x.shape[-1])


def _scale_shape(shape: tuple[int, ...], fmt: BlockFormat) -> tuple[int, ...]:
    rows, cols = fmt.block
    if rows > 1:
        if len(shape) != 2:
            raise ValueError(f"shape {shape}: {rows}x{cols} blocks tile a 2-D tensor")
        return (-(-shape[0] // rows), -(-shape[1] // cols))
    return (*shape[:-1], -(-shape[-1] // cols))
