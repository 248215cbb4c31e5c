"""Grouped matmul for mixture-of-experts layers: every expert's ``Y_e = X_e @ W_e^T`` in one launch.

After routing, the tokens are *sorted by expert*: rows ``offsets[e] .. offsets[e+1]`` of
``x [M, K]`` belong to expert ``e`` (``group_sizes[e]`` rows, possibly 0), and ``weight`` is the
stacked expert weights ``[E, N, K]`` (``Linear``'s ``[d_out, d_in]`` per expert). The naive way
launches one matmul per expert from a Python loop: ``E`` launches, each too small to fill a GPU
when the expert got few tokens. Here one launch covers all experts.

**Tile map.** Each expert's segment is cut into ``ceil(group_sizes[e] / BLOCK_M)`` row tiles.
Before the launch, a few torch ops (no Python loop over experts) list every tile with its expert
and first row: ``tile_ends = cumsum(tiles per expert)``; tile ``t`` belongs to expert
``searchsorted(tile_ends, t, right=True)``. Program ``(t, n)`` reads its expert and rows from
that map, then computes an ordinary ``[BLOCK_M, BLOCK_N]`` output tile of ``X_e @ W_e^T``,
masking rows past its segment's end. An empty expert has no tiles; one expert holding every
token simply owns every tile. The last tile of each segment is partly masked, so the padding
waste is at most one tile per expert.

**Backward** (``torch.autograd.Function``): ``dX_e = dY_e @ W_e`` is the same kernel with the
weight read through other strides (the kernel takes any ``[E, R, C]`` strides, so no transpose
is copied). ``dW_e = dY_e^T @ X_e`` reduces over the segment's rows: one program per
``(expert, N tile, K tile)`` loops over its expert's rows (a data-dependent loop bound), so an
empty expert writes zeros and no atomics are needed. (With very skewed routing that loop is
long for one expert; production kernels split it, this one keeps the idea visible.)

Accumulation is fp32. On the GPU ``tl.dot`` takes fp16/bf16 operands (tensor cores); under
Triton's CPU interpreter, whose bf16 dot is wrong, both operands are upcast to fp32 after load.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels._common import as_rows, check_kernel_tensor
from labkit.runtime import triton_mode


# ----------------------------------------------------------------------------- references
def grouped_matmul_reference(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """The loop the kernel replaces: one ``torch.matmul`` per expert segment, fp32 math, output in ``x.dtype``."""
    sizes = [int(s) for s in group_sizes.tolist()]
    outs = [segment.float() @ weight[e].float().T for e, segment in enumerate(x.split(sizes))]
    return torch.cat(outs).to(x.dtype) if outs else x.new_empty(0, weight.shape[1])


def tile_map(group_sizes: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tile_expert, tile_row, segment_start, segment_end)`` for segments of ``group_sizes`` rows
    cut into tiles of ``block_m`` rows, built with torch ops on ``group_sizes``' device.

    ``tile_expert[t]`` is the expert of tile ``t`` and ``tile_row[t]`` its first row of ``x``;
    ``segment_start/end[e]`` bound expert ``e``'s rows. Experts with no rows own no tiles.
    """
    sizes = group_sizes.to(torch.int64)
    segment_end = torch.cumsum(sizes, 0)
    segment_start = segment_end - sizes
    tiles = (sizes + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles, 0)
    num_tiles = int(tile_ends[-1]) if len(tile_ends) else 0
    t = torch.arange(num_tiles, device=sizes.device)
    tile_expert = torch.searchsorted(tile_ends, t, right=True)  # first expert whose tiles end after t
    first_tile = tile_ends - tiles
    tile_row = segment_start[tile_expert] + (t - first_tile[tile_expert]) * block_m
    return tile_expert.to(torch.int32), tile_row.to(torch.int64), segment_start, segment_end


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _grouped_matmul_kernel(
    X, B, Y, TILE_EXPERT, TILE_ROW, SEGMENT_END,
    R, C, x_row_stride, b_expert_stride, b_r_stride, b_c_stride, y_row_stride,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``Y[rows of tile] = X[rows] @ B[expert]``, where ``B[e]`` is an ``[R, C]`` matrix read through
    strides (forward: ``B[e] = W[e]^T``; backward: ``B[e] = W[e]``). Reduction over ``R``."""
    tile = tl.program_id(0)
    expert = tl.load(TILE_EXPERT + tile).to(tl.int64)
    row_start = tl.load(TILE_ROW + tile)
    row_end = tl.load(SEGMENT_END + expert)
    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < row_end, offs_n < C  # rows past the segment belong to the next expert
    x_rows = X + offs_m[:, None] * x_row_stride
    b_expert = B + expert * b_expert_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r_start in range(0, R, BLOCK_K):
        offs_r = r_start + tl.arange(0, BLOCK_K)
        r_mask = offs_r < R
        x = tl.load(x_rows + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        b = tl.load(b_expert + offs_r[:, None] * b_r_stride + offs_n[None, :] * b_c_stride,
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), b.to(tl.float32), acc, input_precision=INPUT_PRECISION)
        else:
            acc = tl.dot(x, b, acc, input_precision=INPUT_PRECISION)
    y = Y + offs_m[:, None] * y_row_stride + offs_n[None, :]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _grouped_weight_grad_kernel(
    DY, X, DW, SEGMENT_START, SEGMENT_END,
    N, K, dy_row_stride, x_row_stride, dw_expert_stride, dw_row_stride,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``DW[e][n tile, k tile] = DY[rows of e, n tile]^T @ X[rows of e, k tile]``, looping over e's rows."""
    expert = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask, k_mask = offs_n < N, offs_k < K
    start = tl.load(SEGMENT_START + expert)
    end = tl.load(SEGMENT_END + expert)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m_start in range(start, end, BLOCK_M):  # an empty expert runs no steps and writes zeros
        offs_m = m_start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        dy = tl.load(DY + offs_m[:, None] * dy_row_stride + offs_n[None, :], mask=m_mask[:, None] & n_mask[None, :], other=0.0)
        x = tl.load(X + offs_m[:, None] * x_row_stride + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(tl.trans(dy.to(tl.float32)), x.to(tl.float32), acc, input_precision=INPUT_PRECISION)
        else:
            acc = tl.dot(tl.trans(dy), x, acc, input_precision=INPUT_PRECISION)
    dw = DW + expert * dw_expert_stride + offs_n[:, None] * dw_row_stride + offs_k[None, :]
    tl.store(dw, acc.to(DW.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])


# ----------------------------------------------------------------------------- launchers
def launch_settings() -> dict:
    """Tile sizes. The interpreter pays per program and per loop step, so it gets big tiles; the
    GPU gets 64-row tiles (an expert's last tile is partly empty, so smaller M tiles waste less)."""
    if triton_mode() == "interpreter":
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4)


def _dot_flags(dtype: torch.dtype) -> dict:
    upcast = triton_mode() == "interpreter" or dtype == torch.float32
    return dict(UPCAST=upcast, INPUT_PRECISION="ieee")


def _grid(num_row_tiles: int, C: int, settings: dict) -> tuple[int, int]:
    return num_row_tiles, triton.cdiv(C, settings["BLOCK_N"])


def _check_group_sizes(group_sizes, experts: int | None = None, values: bool = True) -> None:
    """``group_sizes``: an int32/int64 ``[E]`` tensor of non-negative rows per expert (``E = experts`` if given;
    the counts' signs checked only with ``values``, which reads them back from the device)."""
    if not isinstance(group_sizes, torch.Tensor):
        raise TypeError(f"group_sizes: expected a torch.Tensor of rows per expert, got {type(group_sizes).__name__}")
    if group_sizes.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"group_sizes: expected an int32 or int64 tensor, got {group_sizes.dtype}")
    if group_sizes.dim() != 1 or (experts is not None and group_sizes.shape[0] != experts):
        expected = f"({experts},), one count per expert of weight" if experts is not None else "[E], one count per expert"
        raise ValueError(f"group_sizes: expected shape {expected}, got {tuple(group_sizes.shape)}")
    if values and len(group_sizes) and int(group_sizes.min()) < 0:
        raise ValueError(f"group_sizes: counts must be non-negative, got {group_sizes.tolist()}")


def _check_grouped_inputs(x, weight, group_sizes) -> None:
    """The forward's inputs, as :func:`grouped_matmul` documents them."""
    check_kernel_tensor("x", x)
    check_kernel_tensor("weight", weight)
    if x.dim() != 2:
        raise ValueError(f"x: expected [M, K] rows sorted by expert, got shape {tuple(x.shape)}")
    if weight.dim() != 3 or weight.shape[2] != x.shape[1]:
        raise ValueError(f"weight: expected [E, N, K={x.shape[1]}] (one [d_out, d_in] matrix per expert), got shape {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight: expected x's dtype {x.dtype}, got {weight.dtype}")
    if weight.shape[0] == 0:
        raise ValueError("weight: expected at least one expert, got E=0")
    _check_group_sizes(group_sizes, weight.shape[0], values=False)
    for name, t in (("weight", weight), ("group_sizes", group_sizes)):
        if t.device != x.device:
            raise ValueError(f"{name}: must be on x's device {x.device}, got {t.device}")
    total, smallest = (int(v) for v in torch.stack([group_sizes.sum(), group_sizes.min()]).tolist())  # one host sync
    if smallest < 0:
        raise ValueError(f"group_sizes: counts must be non-negative, got {group_sizes.tolist()}")
    if total != x.shape[0]:
        raise ValueError(f"group_sizes: counts sum to {total}, but x has {x.shape[0]} rows (every row belongs to one expert)")


def launch_grid(group_sizes: torch.Tensor, n_out: int, settings: dict | None = None) -> tuple[int, int]:
    """The forward launch's grid for ``group_sizes`` and ``n_out`` output columns: ``(row tiles of
    the tile map, column tiles)``, program ``(t, j)`` computing row tile ``t``, columns
    ``j * BLOCK_N ...``; ``settings`` as :func:`launch_settings` gives them (its default)."""
    _check_group_sizes(group_sizes)
    if not isinstance(n_out, int) or isinstance(n_out, bool) or n_out < 0:
        raise ValueError(f"n_out: expected a non-negative integer number of output columns, got {n_out!r}")
    settings = settings or launch_settings()
    return _grid(len(tile_map(group_sizes, settings["BLOCK_M"])[0]), n_out, settings)


def _segment_matmul(x_rows: torch.Tensor, b: torch.Tensor, b_strides: tuple[int, int, int], R: int, C: int,
                    tiles: tuple, settings: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[rows of e] = x_rows[rows of e] @ B[e]`` (``B[e]`` an ``[R, C]`` view given by ``b_strides``)."""
    tile_expert, tile_row, _, segment_end = tiles
    if out is None:
        out = torch.empty((x_rows.shape[0], C), dtype=x_rows.dtype, device=x_rows.device)
    if len(tile_expert) and C:
        grid = _grid(len(tile_expert), C, settings)
        _grouped_matmul_kernel[grid](
            x_rows, b, out, tile_expert, tile_row, segment_end,
            R, C, x_rows.stride(0), *b_strides, out.stride(0),
            **_dot_flags(x_rows.dtype), BLOCK_M=settings["BLOCK_M"], BLOCK_N=settings["BLOCK_N"],
            BLOCK_K=settings["BLOCK_K"], num_warps=settings["num_warps"],
        )
    return out


def _weight_grad(dy: torch.Tensor, x_rows: torch.Tensor, weight_shape, dtype, tiles: tuple, settings: dict) -> torch.Tensor:
    _, _, segment_start, segment_end = tiles
    E, N, K = weight_shape
    dw = torch.empty((E, N, K), dtype=dtype, device=x_rows.device)
    if N and K:
        block_n, block_k = min(settings["BLOCK_N"], 64), min(settings["BLOCK_K"], 64)
        if triton_mode() == "interpreter":
            block_n, block_k = settings["BLOCK_N"], settings["BLOCK_K"]
        grid = (E, triton.cdiv(N, block_n), triton.cdiv(K, block_k))
        _grouped_weight_grad_kernel[grid](
            dy, x_rows, dw, segment_start, segment_end,
            N, K, dy.stride(0), x_rows.stride(0), dw.stride(0), dw.stride(1),
            **_dot_flags(x_rows.dtype), BLOCK_M=settings["BLOCK_M"], BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=settings["num_warps"],
        )
    return dw


class GroupedMatmulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group_sizes):
        settings = launch_settings()
        x_rows = as_rows(x)
        tiles = tile_map(group_sizes, settings["BLOCK_M"])
        _, N, K = weight.shape
        # forward: B[e] = W[e]^T, an [K, N] matrix: step over K is W's stride(2), over N its stride(1)
        y = _segment_matmul(x_rows, weight, (weight.stride(0), weight.stride(2), weight.stride(1)), K, N, tiles, settings)
        ctx.save_for_backward(x_rows, weight, *tiles)
        ctx.settings = settings
        return y

    @staticmethod
    def backward(ctx, dy):
        x_rows, weight, *tiles = ctx.saved_tensors
        settings = ctx.settings
        dy = as_rows(dy)
        _, N, K = weight.shape
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # dX = dY @ W[e]: B[e] = W[e] itself, an [N, K] matrix
            dx = _segment_matmul(dy, weight, (weight.stride(0), weight.stride(1), weight.stride(2)), N, K, tiles, settings)
        if ctx.needs_input_grad[1]:
            dw = _weight_grad(dy, x_rows, weight.shape, weight.dtype, tiles, settings)
        return dx, dw, None


def tiles_written(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, settings: dict | None = None) -> list[dict]:
    """What the forward kernel's programs really write, row tile by row tile: for each row tile
    ``t`` of the tile map, the kernel is launched alone (its programs ``(t, 0), (t, 1), ...``,
    each with its column tile) into an output filled with NaN; the rows and columns it wrote
    are read back. Returns per tile ``tile``, ``rows`` and ``cols`` (``(first, end)`` of what
    was written; ``None`` if nothing), ``contiguous`` (the written cells form that rectangle
    exactly) and ``values``, the written block. For teaching and tests: one launch per tile.
    ``settings`` as :func:`launch_settings` gives them (its default); ``x`` is floating point."""
    _check_group_sizes(group_sizes, values=False)
    _check_grouped_inputs(x, weight, group_sizes.to(x.device) if isinstance(x, torch.Tensor) else group_sizes)
    group_sizes = group_sizes.to(x.device)
    settings = settings or launch_settings()
    x_rows = as_rows(x)
    tile_expert, tile_row, segment_start, segment_end = tile_map(group_sizes, settings["BLOCK_M"])
    _, N, K = weight.shape
    strides = (weight.stride(0), weight.stride(2), weight.stride(1))
    written = []
    for t in range(len(tile_expert)):
        out = torch.full((x_rows.shape[0], N), float("nan"), dtype=x_rows.dtype, device=x_rows.device)
        one_tile = (tile_expert[t:t + 1], tile_row[t:t + 1], segment_start, segment_end)
        _segment_matmul(x_rows, weight, strides, K, N, one_tile, settings, out=out)
        done = ~out.isnan()
        rows, cols = done.any(1).nonzero().flatten(), done.any(0).nonzero().flatten()
        if len(rows) == 0:
            written.append(dict(tile=t, rows=None, cols=None, contiguous=True, values=out[:0, :0]))
            continue
        r0, r1, c0, c1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
        written.append(dict(tile=t, rows=(r0, r1), cols=(c0, c1), contiguous=int(done.sum()) == (r1 - r0) * (c1 - c0),
                            values=out[r0:r1, c0:c1]))
    return written


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """``Y[rows of e] = X[rows of e] @ weight[e]^T`` for all experts ``e`` in one launch, differentiable
    in ``x`` and ``weight``.

    ``x``: ``[M, K]`` rows sorted by expert (fp32/fp16/bf16); ``weight``: ``[E, N, K]`` in ``x``'s
    dtype (any strides); ``group_sizes``: int32/int64 ``[E]``, rows per expert, non-negative,
    summing to ``M`` (zeros allowed). Returns ``[M, N]`` in ``x.dtype`` (fp32 accumulation).
    """
    _check_grouped_inputs(x, weight, group_sizes)
    return GroupedMatmulFunction.apply(x, weight, group_sizes)
