"""Fused RMSNorm: ``y = x / sqrt(mean(x^2) + eps) * weight`` over the last axis, forward and backward.

Forward: one program per row. It loads the row once, accumulates ``mean(x^2)`` in fp32, writes
``y`` and keeps only the row's inverse RMS (4 bytes per row) for the backward pass, so the
normalized row itself is never stored.

Backward, with ``x_hat = x * rstd`` and ``g = dy * weight``:
``dx = rstd * (g - x_hat * mean(g * x_hat))`` and ``dweight = sum over rows of dy * x_hat``.
``dx`` is per row; ``dweight`` is a reduction over all rows, so each program accumulates a
partial sum over its own rows in fp32 and a final ``sum(dim=0)`` adds the partials, which
avoids atomics (and their non-determinism).

Every kernel upcasts to fp32 right after loading and casts on store: that is both the
accurate choice and the one Triton's CPU interpreter computes correctly for bf16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels._common import as_rows, check_kernel_tensor
# A row lives in registers as one block; beyond this the registers spill (use a looped kernel).
MAX_FUSED_SIZE = 65536


# ----------------------------------------------------------------------------- reference
def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Pure-PyTorch RMSNorm with the kernel's numerics: fp32 math, output in ``x.dtype``."""
    x32 = x.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x32 * inv_rms * weight.float()).to(x.dtype)


def rmsnorm_backward_reference(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, eps: float = 1e-5):
    """``(dx, dweight)`` from the closed form the backward kernel implements (fp32 math)."""
    x32, w32, dy32 = x.float(), weight.float(), dy.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    x_hat = x32 * rstd
    g = dy32 * w32
    dx = rstd * (g - x_hat * (g * x_hat).mean(dim=-1, keepdim=True))
    dweight = (dy32 * x_hat).reshape(-1, x.shape[-1]).sum(dim=0)
    return dx.to(x.dtype), dweight.to(weight.dtype)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _rmsnorm_forward_kernel(
    X, W, Y, RSTD,
    x_row_stride, y_row_stride, n_cols, eps,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride overflows int32 for big tensors
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols  # BLOCK_SIZE is a power of two >= n_cols; the tail lanes are padding
    x = tl.load(X + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    # padded lanes are 0, so they add nothing to the sum; divide by the true width
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * y_row_stride + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_backward_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,
    dy_row_stride, x_row_stride, dx_row_stride, n_rows, n_cols, rows_per_program,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        row64 = tl.cast(row, tl.int64)
        x = tl.load(X + row64 * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row64 * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row64)
        x_hat = x * rstd
        g = dy * w
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols))
        tl.store(DX + row64 * dx_row_stride + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dy * x_hat
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw_acc, mask=mask)


# ----------------------------------------------------------------------------- launchers
def launch_settings(n_cols: int) -> tuple[int, int]:
    """``(BLOCK_SIZE, num_warps)`` for a kernel that holds one row of ``n_cols`` in registers."""
    if n_cols < 1:
        raise ValueError("x: last dim is 0; there is nothing to normalize")
    block = triton.next_power_of_2(n_cols)
    if block > MAX_FUSED_SIZE:
        raise ValueError(f"x: last dim {n_cols} exceeds the fused kernel's maximum of {MAX_FUSED_SIZE} features")
    num_warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, num_warps


def _num_programs(device: torch.device, n_rows: int) -> int:
    if device.type == "cuda":
        workers = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        workers = 4  # the interpreter runs programs one after another; a few suffice
    return max(1, min(workers, n_rows))


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float):
    x_rows = as_rows(x)
    n_rows, n_cols = x_rows.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        block, num_warps = launch_settings(n_cols)
        _rmsnorm_forward_kernel[(n_rows,)](
            x_rows, weight, y, rstd, x_rows.stride(0), y.stride(0), n_cols, eps,
            BLOCK_SIZE=block, num_warps=num_warps,
        )
    return y.view(x.shape), x_rows, rstd


def _backward(dy: torch.Tensor, x_rows: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    dy_rows = as_rows(dy)
    n_rows, n_cols = x_rows.shape
    dx = torch.empty((n_rows, n_cols), dtype=x_rows.dtype, device=x_rows.device)
    num_programs = _num_programs(x_rows.device, n_rows)
    dw_partial = torch.zeros((num_programs, n_cols), dtype=torch.float32, device=x_rows.device)
    if n_rows:
        block, num_warps = launch_settings(n_cols)
        rows_per_program = triton.cdiv(n_rows, num_programs)
        _rmsnorm_backward_kernel[(num_programs,)](
            dy_rows, x_rows, weight, rstd, dx, dw_partial,
            dy_rows.stride(0), x_rows.stride(0), dx.stride(0), n_rows, n_cols, rows_per_program,
            BLOCK_SIZE=block, num_warps=num_warps,
        )
    return dx, dw_partial.sum(dim=0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, x_rows, rstd = _forward(x, weight, eps)
        ctx.save_for_backward(x_rows, weight, rstd)
        ctx.x_shape = x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x_rows, weight, rstd = ctx.saved_tensors
        dx, dweight = _backward(dy, x_rows, weight, rstd)
        return dx.view(ctx.x_shape), dweight, None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Fused RMSNorm over the last axis of ``x`` (any leading shape), differentiable in ``x`` and ``weight``.

    ``x``: fp32/fp16/bf16, last dim ``d`` up to 65536 (any ``d``, not only powers of two);
    ``weight``: ``[d]``, any supported dtype; math in fp32; output in ``x.dtype``.
    """
    check_kernel_tensor("x", x)
    check_kernel_tensor("weight", weight)
    if x.dim() == 0:
        raise ValueError("x: expected at least one dimension (the features), got a scalar")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight: expected shape ({x.shape[-1]},) to match x's last dim, got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight: must be on x's device {x.device}, got {weight.device}")
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps={eps!r}: expected a positive number")
    launch_settings(x.shape[-1])  # rejects rows too wide for one block before autograd records anything
    return RMSNormFunction.apply(x, weight.contiguous(), float(eps))
