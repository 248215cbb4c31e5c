"""Fused SwiGLU gate: ``c = silu(a) * b = a * sigmoid(a) * b``, forward and backward.

In a SwiGLU feed-forward ``w2(silu(w1 x) * w3 x)`` the two matmuls produce ``a = w1 x`` and
``b = w3 x``; PyTorch eager then runs ``sigmoid``, two multiplies (and keeps their outputs for
backward) as separate passes over memory. Fused, the forward reads ``a`` and ``b`` once and
writes ``c``; the backward recomputes ``sigmoid(a)`` instead of storing it:

``dc/da = b * sigmoid(a) * (1 + a * (1 - sigmoid(a)))`` and ``dc/db = silu(a)``.

The op is elementwise, so the tensors are treated as flat arrays cut into blocks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels._common import check_kernel_tensor

# The interpreter runs programs one after another, so it gets few, large blocks; a GPU gets
# many small ones to fill its SMs.
GPU_BLOCK_SIZE = 1024
INTERPRETER_BLOCK_SIZE = 65536


# ----------------------------------------------------------------------------- reference
def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch ``silu(a) * b`` in fp32, output in ``a.dtype``."""
    a32 = a.float()
    return (a32 * torch.sigmoid(a32) * b.float()).to(a.dtype)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _swiglu_forward_kernel(A, B, C, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    a = tl.load(A + offsets, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offsets, mask=mask, other=0.0).to(tl.float32)
    c = a * tl.sigmoid(a) * b
    tl.store(C + offsets, c.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(DC, A, B, DA, DB, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    dc = tl.load(DC + offsets, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offsets, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offsets, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    silu = a * sig
    da = dc * b * sig * (1.0 + a * (1.0 - sig))
    tl.store(DA + offsets, da.to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offsets, (dc * silu).to(DB.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launchers
def _grid(n_elements: int, device: torch.device) -> tuple[int, tuple[int]]:
    block = GPU_BLOCK_SIZE if device.type == "cuda" else INTERPRETER_BLOCK_SIZE
    return block, (triton.cdiv(n_elements, block),)


def _forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    c = torch.empty_like(a)
    if a.numel():
        block, grid = _grid(a.numel(), a.device)
        _swiglu_forward_kernel[grid](a, b, c, a.numel(), BLOCK_SIZE=block)
    return c


def _backward(dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dc = dc.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    if a.numel():
        block, grid = _grid(a.numel(), a.device)
        _swiglu_backward_kernel[grid](dc, a, b, da, db, a.numel(), BLOCK_SIZE=block)
    return da, db


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)  # sigmoid(a) is recomputed in backward, never stored
        return _forward(a, b)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        return _backward(dc, a, b)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` fused, differentiable in ``a`` and ``b``.

    ``a`` and ``b``: same shape, same dtype (fp32/fp16/bf16), same device; math in fp32,
    output in that dtype. Non-contiguous inputs are copied to contiguous memory first.
    """
    check_kernel_tensor("a", a)
    check_kernel_tensor("b", b)
    if a.shape != b.shape:
        raise ValueError(f"a, b: expected the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"a, b: expected the same dtype, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"a, b: expected the same device, got {a.device} and {b.device}")
    return SwiGLUFunction.apply(a.contiguous(), b.contiguous())
