"""Weight-only quantized matmul ``y = x @ dequant(W)^T``: the weight stays packed in memory and is
dequantized tile by tile in registers, never written out at full precision.

Why it pays: decoding one token multiplies a ``[1, K]`` activation by every weight matrix, so
the time goes into *reading the weights*, and a 4-bit weight is a quarter of the bytes of a
16-bit one. The kernel reads codes and scales, turns them into fp32 values in registers and
accumulates in fp32.

Weight formats (``W`` is ``[N, K]``: N output features, K input features; ``group_size`` input
features share a scale, the last group may be shorter):

* ``"int4"``: ``qweight`` uint8 ``[N, K/2]``, two codes per byte, feature ``2i`` in the low
  nibble. Without ``zeros`` the nibbles are signed (4-bit two's complement, ``w = s * q``);
  with ``zeros`` (uint8 ``[N, groups]``) unsigned, ``w = s * (q - z)``.
* ``"nf4"``: the same packing; each nibble indexes ``codebook`` (fp32 ``[16]``, passed in as a
  tensor): ``w = s * codebook[q]`` (the per-group absmax ``s``).
* ``"int8"``: ``qweight`` int8 ``[N, K]`` (``w = s * q``), or uint8 with ``zeros``.
* ``scales``: ``[N, ceil(K / group_size)]``, fp32/fp16/bf16.

Two kernels:

* **GEMV** (at most :data:`GEMV_MAX_ROWS` rows of ``x``: decoding). One program per block of
  ``BLOCK_N`` output features and row of ``x``; it loops over K, and each step is an
  elementwise multiply and a row sum. The weight is read once; the work is pure bandwidth.
* **Tiled** (more rows: prefill, batched decoding). One program per ``[BLOCK_M, BLOCK_N]``
  output tile; each K step dequantizes a ``[BLOCK_N, BLOCK_K]`` weight tile once and feeds it to
  ``tl.dot`` for all ``BLOCK_M`` rows. On the GPU the dot takes fp16/bf16 operands (tensor
  cores); under Triton's CPU interpreter, whose bf16 dot is wrong, both operands are fp32.

A 4-bit tile arrives as bytes ``[BLOCK_N, BLOCK_K/2]``; its low and high nibbles are split and
interleaved back (``tl.join`` + ``tl.reshape``) into ``[BLOCK_N, BLOCK_K]`` in feature order,
so every format shares the rest of the code. When a K tile lies inside one group (``group_size``
is a multiple of ``BLOCK_K``, which the launcher arranges for power-of-two groups) each row
loads one scale per tile; otherwise each element looks up its own group's scale.
Forward only: a quantized weight is not trained.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels._common import SUPPORTED_DTYPES, as_rows, check_kernel_tensor
from labkit.runtime import triton_mode

FORMATS = ("int4", "nf4", "int8")
GEMV_MAX_ROWS = 1  # decode: one token per sequence


# ----------------------------------------------------------------------------- reference
def dequantize_weight_reference(qweight: torch.Tensor, scales: torch.Tensor, fmt: str, group_size: int,
                                zeros: torch.Tensor | None = None, codebook: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 weight ``[N, K]`` that the kernel's operands stand for (pure PyTorch)."""
    if fmt == "int8":
        codes = qweight.to(torch.int32)
    else:
        nibbles = torch.stack([qweight & 0xF, qweight >> 4], dim=-1).flatten(-2).to(torch.int32)
        codes = nibbles if zeros is not None or fmt == "nf4" else (nibbles ^ 8) - 8
    num_features = codes.shape[1]
    per_column = lambda t: t.repeat_interleave(group_size, dim=1)[:, :num_features].float()  # noqa: E731
    values = codebook.float()[codes.long()] if fmt == "nf4" else codes.float()
    if zeros is not None:
        values = values - per_column(zeros)
    return values * per_column(scales)


def quant_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, fmt: str, group_size: int,
                           zeros: torch.Tensor | None = None, codebook: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(W)^T`` in fp32, returned in ``x.dtype``: the kernel's contract."""
    weight = dequantize_weight_reference(qweight, scales, fmt, group_size, zeros, codebook)
    return (x.float() @ weight.T).to(x.dtype)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _dequantized_tile(
    QW, S, Z, CODEBOOK, offs_n, n_mask, k_start, K, qw_row_stride, s_row_stride,
    PACKED: tl.constexpr, SIGNED_NIBBLES: tl.constexpr, USE_CODEBOOK: tl.constexpr, HAS_ZEROS: tl.constexpr,
    GROUP_SIZE: tl.constexpr, ONE_GROUP_PER_TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """fp32 weight tile ``[BLOCK_N, BLOCK_K]`` for features ``k_start ..``; 0 outside ``N x K``."""
    offs_k = k_start + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    rows = offs_n.to(tl.int64)[:, None]
    if PACKED:
        offs_byte = k_start // 2 + tl.arange(0, BLOCK_K // 2)
        byte_mask = n_mask[:, None] & (offs_byte < K // 2)[None, :]
        packed = tl.load(QW + rows * qw_row_stride + offs_byte[None, :], mask=byte_mask, other=0).to(tl.int32)
        # low nibble = even feature, high nibble = odd feature: join makes [.., 2] pairs, reshape lays them out in order
        codes = tl.reshape(tl.join(packed & 0xF, (packed >> 4) & 0xF), (BLOCK_N, BLOCK_K))
        if SIGNED_NIBBLES:
            codes = (codes ^ 8) - 8  # 4-bit two's complement: 8..15 -> -8..-1
    else:
        codes = tl.load(QW + rows * qw_row_stride + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0).to(tl.int32)
    if USE_CODEBOOK:
        values = tl.load(CODEBOOK + codes)  # 16 fp32 levels, a gather that stays in L1
    else:
        values = codes.to(tl.float32)
    tile_mask = n_mask[:, None] & k_mask[None, :]
    if ONE_GROUP_PER_TILE:
        group = k_start // GROUP_SIZE
        scale = tl.load(S + offs_n.to(tl.int64) * s_row_stride + group, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if HAS_ZEROS:
            values -= tl.load(Z + offs_n.to(tl.int64) * s_row_stride + group, mask=n_mask, other=0).to(tl.float32)[:, None]
    else:
        groups = (offs_k // GROUP_SIZE)[None, :]
        scale = tl.load(S + rows * s_row_stride + groups, mask=tile_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            values -= tl.load(Z + rows * s_row_stride + groups, mask=tile_mask, other=0).to(tl.float32)
    # masked lanes have scale 0, so they contribute nothing whatever their code decoded to
    return values * scale


@triton.jit
def _quant_gemv_kernel(
    X, QW, S, Z, CODEBOOK, Y, N, K, x_row_stride, qw_row_stride, s_row_stride, y_row_stride,
    PACKED: tl.constexpr, SIGNED_NIBBLES: tl.constexpr, USE_CODEBOOK: tl.constexpr, HAS_ZEROS: tl.constexpr,
    GROUP_SIZE: tl.constexpr, ONE_GROUP_PER_TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        x = tl.load(X + row * x_row_stride + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        w = _dequantized_tile(QW, S, Z, CODEBOOK, offs_n, n_mask, k_start, K, qw_row_stride, s_row_stride,
                              PACKED, SIGNED_NIBBLES, USE_CODEBOOK, HAS_ZEROS, GROUP_SIZE, ONE_GROUP_PER_TILE, BLOCK_N, BLOCK_K)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(Y + row * y_row_stride + offs_n, acc.to(Y.dtype.element_ty), mask=n_mask)


@triton.jit
def _quant_matmul_tiled_kernel(
    X, QW, S, Z, CODEBOOK, Y, M, N, K, x_row_stride, qw_row_stride, s_row_stride, y_row_stride,
    PACKED: tl.constexpr, SIGNED_NIBBLES: tl.constexpr, USE_CODEBOOK: tl.constexpr, HAS_ZEROS: tl.constexpr,
    GROUP_SIZE: tl.constexpr, ONE_GROUP_PER_TILE: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = X + offs_m.to(tl.int64)[:, None] * x_row_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        w = _dequantized_tile(QW, S, Z, CODEBOOK, offs_n, n_mask, k_start, K, qw_row_stride, s_row_stride,
                              PACKED, SIGNED_NIBBLES, USE_CODEBOOK, HAS_ZEROS, GROUP_SIZE, ONE_GROUP_PER_TILE, BLOCK_N, BLOCK_K)
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision=INPUT_PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w).to(x.dtype), acc, input_precision=INPUT_PRECISION)
    y = Y + offs_m.to(tl.int64)[:, None] * y_row_stride + offs_n[None, :]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# ----------------------------------------------------------------------------- launcher
def _block_k(default: int, K: int, group_size: int) -> int:
    """``default`` (a power of two), shrunk to the group size when that is a smaller power of two
    (so each K tile needs one scale per row) and to K's power of two."""
    block = min(default, max(16, triton.next_power_of_2(K)))
    if group_size < block and group_size >= 16 and group_size & (group_size - 1) == 0:
        block = group_size
    return block


def launch_settings(M: int, N: int, K: int, group_size: int) -> dict:
    """Tile sizes for this problem. The interpreter pays per program and per loop step, so it gets
    big tiles; the GPU gets tiles small enough to put several programs on every SM."""
    interpreter = triton_mode() == "interpreter"
    if M <= GEMV_MAX_ROWS:
        block_n = min(128 if interpreter else 16, triton.next_power_of_2(N))
        settings = dict(kernel="gemv", BLOCK_N=max(block_n, 16), BLOCK_K=_block_k(512 if interpreter else 256, K, group_size), num_warps=4)
    else:
        settings = dict(kernel="tiled", BLOCK_M=min(64, max(16, triton.next_power_of_2(M))),
                        BLOCK_N=min(128 if interpreter else 32, max(16, triton.next_power_of_2(N))),
                        BLOCK_K=_block_k(256 if interpreter else 128, K, group_size), num_warps=4)
    settings["ONE_GROUP_PER_TILE"] = group_size % settings["BLOCK_K"] == 0 or group_size >= K
    return settings


def _check_operands(x, qweight, scales, fmt, group_size, zeros, codebook) -> tuple[int, int]:
    """Validate everything before launching; return ``(N, K)``."""
    check_kernel_tensor("x", x)
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}: expected one of {FORMATS}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x: expected shape [..., K] with K > 0 input features, got {tuple(x.shape)}")
    K = x.shape[-1]
    packed = fmt in ("int4", "nf4")
    if fmt == "int8":
        code_dtype = torch.uint8 if zeros is not None else torch.int8
        why = "with zeros (unsigned codes)" if zeros is not None else "without zeros (signed codes)"
    else:
        code_dtype, why = torch.uint8, "(two 4-bit codes per byte)"
    check_kernel_tensor("qweight", qweight, dtypes=(code_dtype,))
    if packed and K % 2:
        raise ValueError(f"x: K={K} input features must be even for {fmt} (two codes per byte)")
    if qweight.dim() != 2 or qweight.shape[1] != (K // 2 if packed else K):
        raise ValueError(f"qweight: expected shape [N, {K // 2 if packed else K}] for {fmt} {why} and K={K}, got {tuple(qweight.shape)}")
    N = qweight.shape[0]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r}: expected a positive integer (input features per scale)")
    num_groups = triton.cdiv(K, group_size)
    check_kernel_tensor("scales", scales, dtypes=SUPPORTED_DTYPES)
    if tuple(scales.shape) != (N, num_groups):
        raise ValueError(f"scales: expected shape ({N}, {num_groups}) = [N, ceil(K / group_size)], got {tuple(scales.shape)}")
    if zeros is not None:
        if fmt == "nf4":
            raise ValueError("zeros: nf4 has no zero points (its codebook is symmetric around an exact 0)")
        check_kernel_tensor("zeros", zeros, dtypes=(torch.uint8,))
        if zeros.shape != scales.shape:
            raise ValueError(f"zeros: expected shape {tuple(scales.shape)} like scales, got {tuple(zeros.shape)}")
    if fmt == "nf4":
        if codebook is None:
            raise ValueError("codebook: fmt='nf4' needs the 16 levels as an fp32 tensor")
        check_kernel_tensor("codebook", codebook, dtypes=(torch.float32,))
        if tuple(codebook.shape) != (16,):
            raise ValueError(f"codebook: expected shape (16,), got {tuple(codebook.shape)}")
    elif codebook is not None:
        raise ValueError(f"codebook: only fmt='nf4' takes a codebook, got one with fmt={fmt!r}")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("codebook", codebook)):
        if t is None:
            continue
        if t.device != x.device:
            raise ValueError(f"{name}: must be on x's device {x.device}, got {t.device}")
        if not t.is_contiguous():
            # a weight is packed once: copying it on every call would cost the very bytes the kernel saves
            raise ValueError(f"{name}: must be contiguous")
    return N, K


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, fmt: str, group_size: int,
                 zeros: torch.Tensor | None = None, codebook: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(W)^T`` for ``x [..., K]`` (fp32/fp16/bf16) and a packed weight ``[N, K]``
    (formats in the module docstring); fp32 accumulation, output ``[..., N]`` in ``x.dtype``."""
    N, K = _check_operands(x, qweight, scales, fmt, group_size, zeros, codebook)
    x_rows = as_rows(x)
    M = x_rows.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M and N:
        settings = launch_settings(M, N, K, group_size)
        # unused pointers still need a tensor; scales is a harmless stand-in the kernel never reads
        operands = (x_rows, qweight, scales, zeros if zeros is not None else scales, codebook if codebook is not None else scales, y)
        flags = dict(PACKED=fmt != "int8", SIGNED_NIBBLES=fmt == "int4" and zeros is None, USE_CODEBOOK=fmt == "nf4",
                     HAS_ZEROS=zeros is not None, GROUP_SIZE=group_size, ONE_GROUP_PER_TILE=settings["ONE_GROUP_PER_TILE"],
                     BLOCK_N=settings["BLOCK_N"], BLOCK_K=settings["BLOCK_K"], num_warps=settings["num_warps"])
        strides = (x_rows.stride(0), qweight.stride(0), scales.stride(0), y.stride(0))
        if settings["kernel"] == "gemv":
            grid = (triton.cdiv(N, settings["BLOCK_N"]), M)
            _quant_gemv_kernel[grid](*operands, N, K, *strides, **flags)
        else:
            interpreter = triton_mode() == "interpreter"
            grid = (triton.cdiv(M, settings["BLOCK_M"]), triton.cdiv(N, settings["BLOCK_N"]))
            _quant_matmul_tiled_kernel[grid](
                *operands, M, N, K, *strides, **flags, BLOCK_M=settings["BLOCK_M"],
                UPCAST=interpreter or x.dtype == torch.float32, INPUT_PRECISION="ieee",
            )
    return y.view(*x.shape[:-1], N)
