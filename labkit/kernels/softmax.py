"""Fused softmax over the last axis, forward and backward.

One program per row. A row that fits in one block is read once: max, exponentials, sum and
the normalized output all happen in registers. A longer row is processed block by block with
the *online* softmax: keep a running max ``m`` and a running sum ``d`` of ``exp(x - m)``; when a
new block raises the max to ``m'``, rescale the sum by ``exp(m - m')`` before adding the block's
terms (kept per lane and combined once at the end, so each step needs no cross-lane
reduction). A second sweep then writes ``exp(x - m) / d``. Backward: ``dx = y * (dy - sum(dy * y))``.

``-inf`` entries get probability 0. A row that is entirely ``-inf`` (a query that may attend to
nothing) has no defined softmax; here it gives **all zeros** (and a zero gradient), where
``torch.softmax`` gives NaN. ``+inf`` and NaN entries give NaN, as in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels._common import as_rows, check_kernel_tensor

# Longest row held in registers at once; longer rows are swept in blocks of this size.
MAX_BLOCK_SIZE = 16384


# ----------------------------------------------------------------------------- reference
def softmax_reference(x: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch softmax over the last axis with the kernel's conventions (fp32 math,
    output in ``x.dtype``, an all ``-inf`` row gives zeros)."""
    x32 = x.float()
    row_max = x32.amax(dim=-1, keepdim=True)
    row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    exp = torch.exp(x32 - row_max)
    total = exp.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, exp / total, torch.zeros_like(exp)).to(x.dtype)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _finite_or_zero(m):
    # the shift for a row whose max is -inf: any finite value works, exp(-inf - 0) = 0
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _softmax_forward_kernel(
    X, Y, x_row_stride, y_row_stride, n_cols,
    BLOCK_SIZE: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * x_row_stride
    y_row = Y + row * y_row_stride
    cols = tl.arange(0, BLOCK_SIZE)
    if SINGLE_BLOCK:
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        shift = _finite_or_zero(tl.max(x, axis=0))
        exp = tl.exp(x - shift)
        total = tl.sum(exp, axis=0)
        inv_total = 1.0 / tl.where(total > 0, total, float("inf"))  # an all -inf row -> 0
        tl.store(y_row + cols, (exp * inv_total).to(Y.dtype.element_ty), mask=mask)
    else:
        # per-lane running max and sum; lanes are combined once at the end
        lane_max = tl.full((BLOCK_SIZE,), float("-inf"), tl.float32)
        lane_sum = tl.zeros((BLOCK_SIZE,), tl.float32)
        for start in range(0, n_cols, BLOCK_SIZE):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(lane_max, x)
            shift = _finite_or_zero(new_max)
            lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
            lane_max = new_max
        shift = _finite_or_zero(tl.max(lane_max, axis=0))
        total = tl.sum(lane_sum * tl.exp(lane_max - shift), axis=0)
        inv_total = 1.0 / tl.where(total > 0, total, float("inf"))  # an all -inf row -> 0
        for start in range(0, n_cols, BLOCK_SIZE):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
            tl.store(y_row + start + cols, (tl.exp(x - shift) * inv_total).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_backward_kernel(
    DY, Y, DX, dy_row_stride, y_row_stride, dx_row_stride, n_cols,
    BLOCK_SIZE: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    dy_row = DY + row * dy_row_stride
    y_row = Y + row * y_row_stride
    dx_row = DX + row * dx_row_stride
    cols = tl.arange(0, BLOCK_SIZE)
    if SINGLE_BLOCK:
        mask = cols < n_cols
        dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32)
        dot = tl.sum(dy * y, axis=0)
        tl.store(dx_row + cols, (y * (dy - dot)).to(DX.dtype.element_ty), mask=mask)
    else:
        lane_dot = tl.zeros((BLOCK_SIZE,), tl.float32)
        for start in range(0, n_cols, BLOCK_SIZE):
            mask = start + cols < n_cols
            dy = tl.load(dy_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            lane_dot += dy * y
        dot = tl.sum(lane_dot, axis=0)
        for start in range(0, n_cols, BLOCK_SIZE):
            mask = start + cols < n_cols
            dy = tl.load(dy_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_row + start + cols, (y * (dy - dot)).to(DX.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launchers
def _settings(n_cols: int) -> tuple[int, bool, int]:
    block = min(triton.next_power_of_2(n_cols), MAX_BLOCK_SIZE)
    num_warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, n_cols <= block, num_warps


def _forward(x: torch.Tensor) -> torch.Tensor:
    x_rows = as_rows(x)
    n_rows, n_cols = x_rows.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows:
        block, single, num_warps = _settings(n_cols)
        _softmax_forward_kernel[(n_rows,)](
            x_rows, y, x_rows.stride(0), y.stride(0), n_cols,
            BLOCK_SIZE=block, SINGLE_BLOCK=single, num_warps=num_warps,
        )
    return y


def _backward(dy: torch.Tensor, y_rows: torch.Tensor) -> torch.Tensor:
    dy_rows = as_rows(dy)
    n_rows, n_cols = y_rows.shape
    dx = torch.empty((n_rows, n_cols), dtype=y_rows.dtype, device=y_rows.device)
    if n_rows:
        block, single, num_warps = _settings(n_cols)
        _softmax_backward_kernel[(n_rows,)](
            dy_rows, y_rows, dx, dy_rows.stride(0), y_rows.stride(0), dx.stride(0), n_cols,
            BLOCK_SIZE=block, SINGLE_BLOCK=single, num_warps=num_warps,
        )
    return dx


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y_rows = _forward(x)
        ctx.save_for_backward(y_rows)  # the backward needs only the output, not the input
        return y_rows.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        (y_rows,) = ctx.saved_tensors
        return _backward(dy, y_rows).view(dy.shape)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis of ``x`` (any leading shape, any row length), differentiable.

    fp32/fp16/bf16 input, fp32 math, output in ``x.dtype``. ``-inf`` entries get probability 0;
    a row that is entirely ``-inf`` gives all zeros (``torch.softmax`` gives NaN there).
    """
    check_kernel_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x: expected at least one dimension, got a scalar")
    if x.shape[-1] == 0:
        raise ValueError(f"x: last dim is 0, softmax over an empty row is undefined (shape {tuple(x.shape)})")
    return SoftmaxFunction.apply(x)
