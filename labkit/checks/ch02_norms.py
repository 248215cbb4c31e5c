"""Graders for chapter 02 (norms and activations)."""
from __future__ import annotations

import torch

from labkit.checks._core import (as_tensor, assert_close, call, call_kernel, call_on_copies, expect_device, expect_differentiable,
                                 expect_jit_kernel, fail, kernel_device, other_device, passed, same_values)
from labkit.norms import launch_rmsnorm_backward_kernel, launch_rmsnorm_kernel

__all__ = ["rmsnorm", "reduction_dims", "rmsnorm_backward", "rmsnorm_kernel", "rmsnorm_backward_kernel", "softmax"]


def _rmsnorm_expected(x, weight, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _cases(seed: int = 0):
    """(description, x, weight, eps): non-zero means (so subtracting it is caught), weights that
    are not ones, ragged widths, a tiny-valued row where eps dominates, fp16/bf16, a bf16 x with an
    fp32 weight, fp16 values whose squares overflow fp16, rank 5, long rows, another device."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    specs = [((3, 8), 1e-5, torch.float32, None, 1.0), ((2, 5, 16), 1e-6, torch.float32, None, 1.0),
             ((4, 1), 1e-5, torch.float32, None, 1.0), ((2, 3, 33), 1e-5, torch.float16, None, 1.0),
             ((2, 2, 2, 3, 12), 1e-5, torch.float32, None, 1.0), ((3, 1000), 1e-5, torch.bfloat16, None, 1.0),
             ((2, 40), 1e-5, torch.float16, None, 300.0), ((4, 24), 1e-5, torch.bfloat16, torch.float32, 1.0)]
    for shape, eps, dtype, wdtype, scale in specs:
        x = ((torch.randn(shape, generator=gen) * 2 + 1) * scale).to(dtype)
        weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(wdtype or dtype)
        what = f"x of shape {shape} ({dtype}{f', |x| ~ {scale:g}: x**2 overflows fp16' if scale > 1 else ''})"
        cases.append((f"rmsnorm({what}, weight ({weight.dtype}), eps={eps})", x, weight, eps))
    tiny = torch.full((2, 6), 1e-3) * torch.randn(2, 6, generator=gen).sign()
    cases.append(("rmsnorm(x with entries of size 1e-3 (mean(x^2) = 1e-6), weight ones, eps=0.01)", tiny, torch.ones(6), 1e-2))
    device = other_device(None)
    if device is not None:
        cases.append((f"rmsnorm(x of shape (4, 64) on {device}, eps=1e-5)", torch.randn(4, 64, generator=gen).to(device),
                      (torch.rand(64, generator=gen) + 0.5).to(device), 1e-5))
    return cases


def rmsnorm(fn) -> None:
    """Grade ``fn(x, weight, eps)`` = RMSNorm over the last axis, math in fp32, output in ``x.dtype``
    on ``x.device``, inputs unchanged, differentiable."""
    cases = _cases()
    for tried, x, weight, eps in cases:
        got = as_tensor(call_on_copies(fn, tried, x, weight, eps), tried)
        expect_device(got, x.device, "the output", tried)
        if got.dtype != x.dtype:
            fail(tried, f"output of dtype {got.dtype}", f"output of dtype {x.dtype} (x's dtype)",
                 "do the math in fp32 (x.float()) and cast the result back with .to(x.dtype): the output follows x, "
                 "whatever the weight's dtype")
        sixteen = x.dtype in (torch.float16, torch.bfloat16)
        tol = dict(rtol=2e-2 if x.dtype == torch.bfloat16 else 2e-3, atol=2e-2 if x.dtype == torch.bfloat16 else 2e-3) \
            if sixteen else dict(rtol=1e-4, atol=1e-5)
        hint = ("divide each row (last axis) by sqrt(mean(x**2) + eps) and multiply by weight; RMSNorm does not "
                "subtract the mean, and eps goes inside the square root")
        if sixteen and not torch.isfinite(got).all():
            hint = "x**2 overflows 16 bits (fp16 max 65504): compute in fp32 (x.float()), then cast back"
        assert_close(got, _rmsnorm_expected(x, weight, eps), tried, hint + (" (16-bit x: compute in fp32)" if sixteen else ""), **tol)
    tried, x, weight, eps = cases[1]
    x = x.clone().requires_grad_()
    tried = tried[:-1] + ", x.requires_grad=True)"
    out = as_tensor(call(fn, tried, x, weight.clone(), eps), tried)
    expect_differentiable(out, "output", tried, "the model trains through RMSNorm: use torch ops on x, no .detach(), "
                                                ".item(), .numpy() or torch.no_grad()")
    passed("rmsnorm", f"matches the reference on {len(cases)} inputs: ranks 2-5, fp32/fp16/bf16 (mixed with an fp32 "
                      "weight), fp16 values whose squares overflow, an eps-dominated row")


def reduction_dims(fn) -> None:
    """Grade ``fn(norm, ndim)`` -> the dims (a tuple, any order, negative allowed) over which
    ``norm`` in ``{"batchnorm", "layernorm", "rmsnorm"}`` computes its statistics, for a
    features-last input with ``ndim`` dimensions (e.g. ``[batch, seq, d_model]``)."""
    hints = {
        "batchnorm": "BatchNorm averages each feature over every position of the batch: all dims except the last",
        "layernorm": "LayerNorm (in transformers) normalizes each token over its own features: only the last dim",
        "rmsnorm": "RMSNorm, like LayerNorm, works on each token's features: only the last dim",
    }
    for ndim in (2, 3, 4, 5):
        for norm, hint in hints.items():
            tried = f"reduction_dims({norm!r}, ndim={ndim})"
            got = call(fn, tried, norm, ndim)
            if not isinstance(got, tuple) or any(isinstance(d, bool) or not isinstance(d, int) for d in got):
                fail(tried, repr(got), "a tuple of Python ints",
                     "return the dims as a tuple of ints, e.g. (0, 1): tensor.mean(dim=...) takes a tuple, not a list "
                     "of tensors or a range")
            dims = sorted({d % ndim for d in got})
            expected = list(range(ndim - 1)) if norm == "batchnorm" else [ndim - 1]
            if dims != expected or len(got) != len(expected):
                fail(tried, tuple(got), tuple(expected), hint)
    passed("reduction_dims", "right axes for BatchNorm, LayerNorm and RMSNorm on 2-D to 5-D inputs")


def rmsnorm_backward(fn) -> None:
    """Grade ``fn(x, weight, dy, eps)`` -> ``(dx, dweight)``, the gradients of
    ``(rmsnorm(x, weight, eps) * dy).sum()``, on fp32 inputs of rank 2 to 4, without autograd: the
    grader calls it under ``torch.no_grad()`` on tensors that do not require grad."""
    gen = torch.Generator().manual_seed(1)
    for shape, eps in [((3, 8), 1e-5), ((2, 4, 16), 1e-2), ((5, 1), 1e-5), ((2, 2, 3, 300), 1e-5)]:
        x = torch.randn(shape, generator=gen) * 2 + 0.5
        weight = torch.rand(shape[-1], generator=gen) + 0.5
        dy = torch.randn(shape, generator=gen)
        tried = f"rmsnorm_backward(x, dy of shape {shape}, eps={eps}) under torch.no_grad()"
        with torch.no_grad():
            got = call_on_copies(fn, tried, x, weight, dy, eps,
                                 hint="the gradients are computed without autograd (the grader runs your function under "
                                      "torch.no_grad()): write dx and dweight with the formulas of section 5, no .backward()")
        if not isinstance(got, tuple) or len(got) != 2:
            fail(tried, type(got).__name__, "a tuple (dx, dweight)", "return both gradients: dx, dweight")
        dx, dw = as_tensor(got[0], tried + " -> dx"), as_tensor(got[1], tried + " -> dweight")
        if tuple(dw.shape) != tuple(weight.shape):
            fail(tried + " -> dweight", f"shape {tuple(dw.shape)}", f"shape {tuple(weight.shape)} (weight's)",
                 "dweight = sum of dy * x_hat over EVERY position (all dims but the last), whatever the rank")
        xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
        (_rmsnorm_expected(xr, wr, eps) * dy).sum().backward()
        assert_close(dx, xr.grad, tried + " -> dx",
                     "dx = rstd * (g - x_hat * mean(g * x_hat)) with g = dy * weight and x_hat = x * rstd: "
                     "the second term is there because every output of the row depends on rstd, hence on all of x",
                     rtol=1e-4, atol=1e-5)
        assert_close(dw, wr.grad, tried + " -> dweight",
                     "dweight = sum of dy * x_hat over every position (all dims but the last)", rtol=1e-4, atol=1e-5)
    passed("rmsnorm_backward", "dx and dweight match autograd on 4 shapes (rank 2 to 4), computed without autograd")


def softmax(fn) -> None:
    """Grade ``fn(x)`` = softmax over the last axis: right axis, stable for huge logits, probability 0
    for ``-inf`` (masked) entries, output in ``x.dtype`` on ``x.device``, ``x`` unchanged. A row that
    is entirely ``-inf`` has no softmax: NaN (torch's answer) or zeros (a kernel's) are both accepted."""
    gen = torch.Generator().manual_seed(2)
    masked = torch.randn(3, 6, generator=gen)
    masked[:, 4:] = float("-inf")
    all_masked = torch.randn(3, 300, generator=gen) * 5
    all_masked[1] = float("-inf")
    all_masked[2, ::2] = float("-inf")
    cases = [
        ("x of shape (3, 5)", torch.randn(3, 5, generator=gen), "sum over the last dim (dim=-1), not over dim 0"),
        ("x of shape (2, 4, 7)", torch.randn(2, 4, 7, generator=gen), "normalize over the last dim, whatever the rank"),
        ("x with logits around 1000 (exp overflows fp32 beyond ~88.7)", torch.randn(2, 6, generator=gen) + 1000.0,
         "subtract each row's max before exp: the result is unchanged and every exponent is <= 0"),
        ("x with -inf (masked) entries", masked, "exp(-inf) = 0: masked entries must get probability 0"),
        ("x of shape (2, 1, 3, 2, 9)", torch.randn(2, 1, 3, 2, 9, generator=gen), "the last dim, whatever the rank"),
        ("x of shape (3, 300) with one row entirely -inf and one half -inf", all_masked,
         "subtract the row max, exponentiate, divide by the row sum; a fully masked row may come out NaN or 0"),
        ("x of shape (4, 50) in bfloat16", torch.randn(4, 50, generator=gen).bfloat16(), "the output keeps x's dtype"),
        ("x of shape (2, 20) in float16 with logits up to 6e4", (torch.randn(2, 20, generator=gen) * 2e4).clamp(-6e4, 6e4).half(),
         "subtract each row's max before exp: exp overflows fp16 beyond ~11"),
    ]
    device = other_device(None)
    if device is not None:
        cases.append((f"x of shape (4, 512) on {device}", torch.randn(4, 512, generator=gen).to(device), "stay on x's device"))
    for what, x, hint in cases:
        tried = f"softmax({what})"
        got = as_tensor(call_on_copies(fn, tried, x, mutation_hint="do not change x in place (x -= max, x.exp_()): "
                                                                   "write new tensors, the caller still needs the scores"), tried)
        expect_device(got, x.device, "the output", tried)
        expected = torch.softmax(x.float(), dim=-1).to(x.dtype)
        dead = torch.isinf(x).all(dim=-1, keepdim=True) & (x < 0).all(dim=-1, keepdim=True)
        if dead.any() and got.shape == expected.shape:
            rows = dead.expand_as(expected)
            ok = got[rows].isnan().all() or (got[rows] == 0).all()
            if not ok:
                fail(tried, f"{got[rows][:4].tolist()} in the fully masked row", "NaN (torch) or 0 (a kernel) there",
                     "a row with nothing to attend to has no softmax: leave it NaN or make it 0, nothing else")
            got = torch.where(rows, torch.zeros((), dtype=got.dtype, device=got.device), got)
            expected = torch.where(rows, torch.zeros((), dtype=expected.dtype, device=expected.device), expected)
        tol = dict(rtol=1e-2, atol=4e-3) if x.dtype in (torch.float16, torch.bfloat16) else dict(rtol=1e-5, atol=1e-6)
        assert_close(got, expected, tried, hint, **tol)
    passed("softmax", "right axis on ranks 2-5, stable for huge fp32 and fp16 logits, masked entries get 0, "
                      "output in x's dtype, x unchanged")


# ----------------------------------------------------------------------------- the Triton RMSNorm kernel
def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


POISON, SENTINEL = float("nan"), 12.5  # read beyond a row: NaN; the output's padding must keep 12.5


def _poisoned(values: torch.Tensor, row_stride: int, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, view)``: ``values`` ``[rows, width]`` stored with ``row_stride`` (>= width) in a buffer
    whose padding between and after the rows holds ``fill``."""
    rows, width = values.shape
    buffer = torch.full(((rows - 1) * row_stride + width + 64,), fill, dtype=values.dtype, device=values.device)
    view = buffer.as_strided((rows, width), (row_stride, 1))
    view.copy_(values)
    return buffer, view


def _kernel_cases(device: str, gen: torch.Generator):
    """(what, x, weight, eps, x_row_stride, y_row_stride, hint): ragged widths (1, odd, 1025 with a 2048-lane
    block), x rows with padding (a slice of wider rows, every other row), fp32/fp16/bf16 (a bf16 x with an fp32
    weight), fp16 values whose squares overflow, an eps-dominated row, a long bf16 row."""
    specs = [  # rows, width, dtype, weight dtype, eps, |x| scale, x row stride (None: contiguous), y row stride
        (4, 8, torch.float32, None, 1e-5, 1.0, None, None),
        (3, 1, torch.float32, None, 1e-5, 1.0, 3, 2),
        (5, 33, torch.float16, None, 1e-5, 1.0, 40, 35),
        (6, 100, torch.bfloat16, None, 1e-6, 1.0, 200, 100),
        (3, 1025, torch.float32, None, 1e-5, 1.0, None, 1030),
        (2, 40, torch.float16, None, 1e-5, 300.0, 41, 40),
        (4, 24, torch.bfloat16, torch.float32, 1e-5, 1.0, 30, 24),
        (3, 3000, torch.bfloat16, None, 1e-5, 1.0, 3001, 3000),
    ]
    cases = []
    for rows, width, dtype, wdtype, eps, scale, x_stride, y_stride in specs:
        x = ((torch.randn(rows, width, generator=gen) * 2 + 1) * scale).to(dtype).to(device)
        weight = (torch.rand(width, generator=gen) + 0.5).to(wdtype or dtype).to(device)
        layout = "contiguous rows" if x_stride is None else f"row stride {x_stride}"
        what = (f"x [{rows}, {width}] {_short(dtype)} ({layout}{f', |x| ~ {scale:g}' if scale > 1 else ''}), "
                f"weight {_short(weight.dtype)}, eps={eps}")
        cases.append((what, x, weight, eps, x_stride or width, y_stride or width))
    tiny = (torch.full((2, 6), 1e-3) * torch.randn(2, 6, generator=gen).sign()).to(device)
    cases.append(("x [2, 6] fp32 with entries of size 1e-3 (mean(x^2) = 1e-6), weight ones, eps=0.01",
                  tiny, torch.ones(6, device=device), 1e-2, 8, 6))
    return cases


def _run_rows(kernel, tried: str, x, weight, eps, x_stride: int, y_stride: int, fill: float) -> torch.Tensor:
    """Launch ``kernel`` on ``x`` stored with ``x_stride`` in a buffer padded with ``fill`` (weight too) into a
    ``y`` padded with :data:`SENTINEL`; fail if it writes outside y's rows or changes x or weight; return y."""
    x_buffer, x_rows = _poisoned(x, x_stride, fill)
    w_buffer, w_view = _poisoned(weight[None, :], weight.shape[0], fill)
    y_buffer, y_rows = _poisoned(torch.full_like(x, SENTINEL), y_stride, SENTINEL)
    x_before, w_before = x_buffer.clone(), w_buffer.clone()
    call_kernel(launch_rmsnorm_kernel, tried, kernel, x_rows, w_view[0], y_rows, eps,
                hint="run the launch yourself and read the traceback: the kernel's parameters are (X, W, Y, "
                     "x_row_stride, y_row_stride, n_cols, eps, BLOCK_SIZE: tl.constexpr)")
    if not same_values(x_buffer, x_before) or not same_values(w_buffer, w_before):
        fail(tried, "x or weight changed by the kernel", "the inputs left as they were",
             "store only through Y: the kernel must not write to X or W")
    outside = torch.ones_like(y_buffer, dtype=torch.bool)
    outside.as_strided(y_rows.shape, y_rows.stride()).fill_(False)
    if not (y_buffer[outside] == SENTINEL).all():
        fail(tried, "values written past the end of a row of Y (the lanes >= n_cols of the block)",
             "only the n_cols entries of each row written",
             "BLOCK_SIZE is the next power of two >= n_cols, so the last lanes are padding: pass mask=cols < n_cols "
             "to tl.store as well as to tl.load")
    return y_rows.float()


def _check_rows(kernel, tried: str, x, weight, eps, x_stride: int, y_stride: int) -> None:
    got = _run_rows(kernel, tried, x, weight, eps, x_stride, y_stride, POISON)
    sixteen = x.dtype in (torch.float16, torch.bfloat16)
    if torch.isnan(got).any():
        if torch.isfinite(_run_rows(kernel, tried, x, weight, eps, x_stride, y_stride, 0.0)).all():
            fail(tried, "NaN in the output (finite when the memory after each row holds 0 instead of NaN)",
                 "finite values whatever lies beyond the rows",
                 "the kernel reads past the row: load x and weight with mask=cols < n_cols and other=0.0, so padded "
                 "lanes read 0 and add nothing to the sum of squares; and step from row to row by x_row_stride "
                 "(rows need not be contiguous), not by n_cols")
        fail(tried, "NaN in the output (also with zeros after each row)", "finite values",
             "upcast right after loading with .to(tl.float32) and compute in fp32 (16-bit products and sums lose "
             "precision, and Triton's CPU interpreter computes bf16 arithmetic wrongly)" if sixteen else
             "look for 0/0 or sqrt of a negative number: y = x / sqrt(sum(x*x) / n_cols + eps) * w")
    if (sixteen and torch.isinf(got).any()) or (x.dtype == torch.float16 and (got == 0).all()):
        fail(tried, "inf or 0 in the output", "finite values",
             "x**2 overflows 16 bits (fp16 max 65504): upcast right after loading with .to(tl.float32)")
    # one rounding of the fp32 result to 16 bits (the interpreter truncates bf16: up to one unit in the last place)
    tol = dict(rtol=8e-3, atol=1e-5) if x.dtype == torch.bfloat16 else dict(rtol=1e-3, atol=1e-5) if sixteen \
        else dict(rtol=1e-5, atol=1e-6)
    hint = ("y = x / sqrt(sum(x*x) / n_cols + eps) * w with the sum over the n_cols real entries (not BLOCK_SIZE), "
            "eps inside the square root, the weight loaded with the same mask, and the math in fp32 "
            "(.to(tl.float32) after each load; 16-bit products and sums lose precision)")
    assert_close(got, _rmsnorm_expected(x, weight, eps).float(), tried + " -> y", hint, **tol)


def _address_space(numel: int, dtype: torch.dtype, device: str):
    """A tensor of ``numel`` elements of which only the pages written are ever backed by memory: on the CPU a
    mapping of a sparse temporary file (no machine refuses it), on a GPU a plain allocation (None if it does not
    fit)."""
    if device != "cpu":
        try:
            return torch.empty(numel, dtype=dtype, device=device)
        except torch.OutOfMemoryError:
            return None
    import os
    import tempfile

    with tempfile.NamedTemporaryFile(prefix="labkit-offsets-") as backing:
        os.truncate(backing.name, numel * torch.empty((), dtype=dtype).element_size())
        return torch.from_file(backing.name, shared=True, size=numel, dtype=dtype)  # the mapping outlives the name


def _overflow_launch(kernel, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``kernel`` launched on ``x``'s 3 rows placed 2**30 elements apart in 8 GiB of address space (NaN where a
    wrapped int32 offset lands); returns ``y``, or None where the space cannot be had (a GPU without 8 GiB free).
    Under ``labkit.grade`` it runs where the learner's kernel is, so the buffer never crosses processes: only
    ``x``, ``weight`` and ``y`` do."""
    stride, width = 2**30, x.shape[1]
    big = _address_space(2 * 2**31 + width, x.dtype, x.device.type)
    if big is None:
        return None
    big[:width] = POISON
    x_rows = big[2**31:].as_strided(tuple(x.shape), (stride, 1))
    x_rows.copy_(x)
    y = torch.full(tuple(x.shape), SENTINEL, dtype=x.dtype, device=x.device)
    launch_rmsnorm_kernel(kernel, x_rows, weight, y, eps)
    return y


def _overflow_case(kernel, device: str, gen: torch.Generator) -> None:
    """Rows 2**30 elements apart: row 2 starts at element 2**31, past int32. A kernel that computes
    ``row * x_row_stride`` in int32 wraps to 2**31 elements *before* X; the buffer reaches there too (NaN),
    so the wrong read returns NaN instead of crashing. 8 GiB of address space, a few pages touched (skipped
    only on a GPU without 8 GiB free)."""
    width = 64
    x = (torch.randn(3, width, generator=gen) + 0.5).to(torch.bfloat16).to(device)
    weight = (torch.rand(width, generator=gen) + 0.5).to(torch.bfloat16).to(device)
    tried = f"rmsnorm_kernel on x [3, {width}] bf16 with row stride 2**30 (row 2 starts 2**31 elements after X)"
    y = call_kernel(_overflow_launch, tried, kernel, x, weight, 1e-5, hint="run the launch yourself")
    if y is None:
        return
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or not torch.isfinite(y.float()).all() \
            or not torch.allclose(y.float(), _rmsnorm_expected(x, weight, 1e-5).float(), rtol=8e-3, atol=1e-5):
        fail(tried, "a wrong (NaN) row 2", "row 2 normalized like the others",
             "row * x_row_stride = 2**31 overflows int32 and wraps to a negative offset: make the row index int64 "
             "first, tl.program_id(0).to(tl.int64)")


def rmsnorm_kernel(kernel) -> None:
    """Grade a ``@triton.jit`` RMSNorm forward ``kernel(X, W, Y, x_row_stride, y_row_stride, n_cols, eps,
    BLOCK_SIZE: tl.constexpr)``, launched by :func:`labkit.norms.launch_rmsnorm_kernel` (one program per row,
    ``BLOCK_SIZE`` the next power of two >= ``n_cols``): ragged widths (1, 33, 1025), padded rows (row stride !=
    width), fp32/fp16/bf16, fp16 values whose squares overflow, an eps-dominated row; NaN after each row of ``x``
    and of ``weight`` (an unmasked load reads it), a sentinel after each row of ``y`` (an unmasked store
    overwrites it); a row 2**31 elements into X (int32 offsets wrap)."""
    device = kernel_device("rmsnorm_kernel")
    if device is None:
        return
    expect_jit_kernel(kernel, "rmsnorm_kernel")
    gen = torch.Generator().manual_seed(5)
    cases = _kernel_cases(device, gen)
    for what, x, weight, eps, x_stride, y_stride in cases:
        _check_rows(kernel, f"rmsnorm_kernel on {what}, y row stride {y_stride}", x, weight, eps, x_stride, y_stride)
    _overflow_case(kernel, device, gen)
    passed("rmsnorm_kernel", f"matches the reference on {len(cases)} launches: widths 1 to 3000 (1025 in a 2048-lane "
                             f"block), padded rows, fp32/fp16/bf16, fp16 squares that overflow, an eps-dominated row, "
                             f"masked tails (NaN past each row, Y's padding untouched); int64 row offsets (a row 2**31 "
                             f"elements in)")


# ----------------------------------------------------------------------------- the Triton RMSNorm backward kernel
def _padded_rows(values: torch.Tensor, row_stride: int, extra_rows: int, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, view)``: ``values [rows, width]`` stored with ``row_stride`` in a buffer whose padding (between
    the rows, and ``extra_rows`` whole rows plus a block after the last) holds ``fill``, so that reading past a row
    or past the last row finds ``fill`` inside the buffer."""
    rows, width = values.shape
    buffer = torch.full(((rows + extra_rows) * row_stride + 2 * width + 64,), fill, dtype=values.dtype, device=values.device)
    view = buffer.as_strided((rows, width), (row_stride, 1))
    view.copy_(values)
    return buffer, view


def _backward_cases(device: str, gen: torch.Generator):
    """(what, x, weight, dy, eps, programs, (dy, x, dx) row strides): widths 1, 8, 24, 33, 100 and 257 (most of them
    ragged: masked lanes), row counts that do not split evenly over the programs (a program with fewer rows, one with none),
    strided rows, fp16 rows (a loss-scaled fp16 dy whose products with the weight overflow fp16) and an fp32
    weight with fp16 rows. (No bf16: Triton's interpreter computes bf16 arithmetic wrongly.)"""
    specs = [  # rows, width, dtype, weight dtype, eps, dy scale, programs, (dy, x, dx) row strides or None
        (4, 8, torch.float32, None, 1e-5, 1.0, 2, None),
        (7, 33, torch.float32, None, 1e-5, 1.0, 3, (35, 40, 36)),
        (3, 1, torch.float32, None, 1e-2, 1.0, 2, (2, 3, 1)),
        (5, 100, torch.float16, None, 1e-5, 1.0, 4, (100, 128, 101)),
        (6, 257, torch.float16, None, 1e-6, 16384.0, 4, (260, 257, 300)),
        (5, 24, torch.float16, torch.float32, 1e-5, 1.0, 2, (30, 24, 25)),
    ]
    cases = []
    for rows, width, dtype, wdtype, eps, dy_scale, programs, strides in specs:
        # a loss-scaled dy comes with larger rows here, so that the right dx (~ rstd * dy * w) still fits fp16
        x = ((torch.randn(rows, width, generator=gen) * 2 + 0.5) * (8 if dy_scale > 1 else 1)).to(dtype).to(device)
        weight = (torch.rand(width, generator=gen) * 2 + 0.5).to(wdtype or dtype).to(device)
        dy = (torch.randn(rows, width, generator=gen) * dy_scale).to(dtype).to(device)
        strides = strides or (width, width, width)
        layout = "contiguous rows" if strides == (width,) * 3 else f"row strides dy {strides[0]}, x {strides[1]}, dx {strides[2]}"
        what = (f"x, dy [{rows}, {width}] {_short(dtype)} ({layout}{f', dy ~ {dy_scale:g} (loss-scaled)' if dy_scale > 1 else ''}), "
                f"weight {_short(weight.dtype)}, eps={eps}, {programs} programs")
        cases.append((what, x, weight, dy, eps, programs, strides))
    return cases


def _block_size(n_cols: int) -> int:
    """The BLOCK_SIZE the launchers pass: the next power of two >= ``n_cols``."""
    return 1 << (n_cols - 1).bit_length()


def _backward_run(kernel, tried: str, x, weight, dy, eps, programs: int, strides, fill: float):
    """Launch ``kernel`` on padded copies (padding = ``fill``); check it left the inputs alone and wrote nothing
    outside dx's rows and DW_PARTIAL; return ``(dx, dw_partial)`` in fp32."""
    n_rows, n_cols = x.shape
    spare = -(-n_rows // programs) + 1   # whole rows of padding: a loop that runs past n_rows stays in the buffer
    rstd = torch.rsqrt(x.float().pow(2).mean(dim=-1) + eps)   # what the forward kernel stored
    dy_buffer, dy_rows = _padded_rows(dy, strides[0], spare, fill)
    x_buffer, x_rows = _padded_rows(x, strides[1], spare, fill)
    w_buffer, w_view = _padded_rows(weight[None, :], n_cols, 0, fill)
    r_buffer, r_view = _padded_rows(rstd[None, :], n_rows, 0, fill)
    dx_buffer, dx_rows = _padded_rows(torch.full_like(x, SENTINEL), strides[2], spare, SENTINEL)
    partial = torch.full((programs * n_cols + 2 * n_cols + 64,), SENTINEL, dtype=torch.float32, device=x.device)
    partial[: programs * n_cols] = POISON   # the launcher hands over uninitialized memory: every program must store its row
    dw_partial = partial[: programs * n_cols].view(programs, n_cols)
    before = [b.clone() for b in (dy_buffer, x_buffer, w_buffer, r_buffer)]
    call_kernel(launch_rmsnorm_backward_kernel, tried, kernel, dy_rows, x_rows, w_view[0], r_view[0], dx_rows, dw_partial,
                hint="run the launch yourself and read the traceback: the kernel's parameters are (DY, X, W, RSTD, DX, "
                     "DW_PARTIAL, dy_row_stride, x_row_stride, dx_row_stride, n_rows, n_cols, rows_per_program, "
                     "BLOCK_SIZE: tl.constexpr)")
    if not all(same_values(b, a) for b, a in zip(before, (dy_buffer, x_buffer, w_buffer, r_buffer))):
        fail(tried, "dy, x, weight or rstd changed by the kernel", "the inputs left as they were",
             "store only through DX and DW_PARTIAL: the kernel must not write to DY, X, W or RSTD")
    outside = torch.ones_like(dx_buffer, dtype=torch.bool)
    outside.as_strided(dx_rows.shape, dx_rows.stride()).fill_(False)
    if not (dx_buffer[outside] == SENTINEL).all():
        # an unmasked store of the last row reaches at most BLOCK_SIZE past its start; row n_rows reaches further
        past_rows = (dx_buffer[(n_rows - 1) * strides[2] + _block_size(n_cols):] != SENTINEL).any()
        fail(tried, "values written outside dx's rows" + (" (past the last row)" if past_rows else " (the lanes >= n_cols)"),
             "only the n_cols entries of the n_rows rows written",
             "the last program's rows end at n_rows, not at (pid + 1) * rows_per_program: loop over range(row_start, "
             "min(row_start + rows_per_program, n_rows))" if past_rows else
             "BLOCK_SIZE is the next power of two >= n_cols: pass mask=cols < n_cols to every tl.store, not only to tl.load")
    if not (partial[programs * n_cols:] == SENTINEL).all():
        fail(tried, "values written past the end of DW_PARTIAL", f"only its {programs} rows of n_cols written",
             "store the partial with mask=cols < n_cols, at DW_PARTIAL + pid * n_cols + cols")
    return dx_rows.float(), dw_partial.clone()


def _program_partials(x, dy, eps, programs: int) -> torch.Tensor:
    """The fp32 ``[programs, n_cols]`` partial sums of ``dy * x_hat`` each program owes, in float64."""
    n_rows = x.shape[0]
    per = -(-n_rows // programs)
    x64, dy64 = x.double(), dy.double()
    terms = dy64 * x64 * torch.rsqrt(x64.pow(2).mean(dim=-1, keepdim=True) + eps)
    return torch.stack([terms[p * per: (p + 1) * per].sum(dim=0) for p in range(programs)]).float()


def _check_backward(kernel, tried: str, x, weight, dy, eps, programs: int, strides) -> None:
    n_rows, n_cols = x.shape
    sixteen = x.dtype == torch.float16
    dx, partial = _backward_run(kernel, tried, x, weight, dy, eps, programs, strides, POISON)
    upcast = ("upcast every load with .to(tl.float32) and compute in fp32: with 16-bit rows dy * w overflows fp16 "
              "(max 65504) when dy is loss-scaled")
    if not torch.isfinite(dx).all() or not torch.isfinite(partial).all():
        dx0, partial0 = _backward_run(kernel, tried, x, weight, dy, eps, programs, strides, 0.0)
        where = "dx" if not torch.isfinite(dx).all() else "DW_PARTIAL"
        if torch.isfinite(dx0).all() and torch.isfinite(partial0).all():
            fail(tried, f"NaN in {where} (finite when the memory after each row holds 0 instead of NaN)",
                 "finite values whatever lies beyond the rows",
                 "the kernel reads past a row or past the last row: load with mask=cols < n_cols and other=0.0, step "
                 "from row to row by each tensor's own row stride (not n_cols), and stop the row loop at n_rows")
        if where == "DW_PARTIAL" and torch.isfinite(dx).all():
            fail(tried, "NaN left in DW_PARTIAL (it arrives uninitialized)", "every program's row of DW_PARTIAL stored",
                 "each program stores its partial sum at DW_PARTIAL + pid * n_cols + cols, zeros if it got no rows "
                 "(with more programs than the rows need, the last ones get none)")
        fail(tried, f"inf or NaN in {where}", "finite values",
             upcast if sixteen else "look for a division by zero: rstd comes from RSTD, one fp32 value per row")
    # expected: autograd through the reference RMSNorm, on fp32 copies (the kernel's math is fp32)
    x32, w32 = x.float().requires_grad_(), weight.float().requires_grad_()
    (_rmsnorm_expected(x32, w32, eps) * dy.float()).sum().backward()
    scale = x32.grad.abs().max().item()
    tol = dict(rtol=2e-3, atol=2e-3 * scale) if sixteen else dict(rtol=1e-4, atol=1e-5 * max(scale, 1.0))
    owed = _program_partials(x, dy, eps, programs)
    per = -(-n_rows // programs)
    for p in range(programs):
        if torch.allclose(partial[p], owed[p], rtol=1e-4, atol=1e-4 * owed.abs().max().item()):
            continue
        mine = slice(p * per, min((p + 1) * per, n_rows))
        rows = f"rows {mine.start} to {mine.stop - 1}" if mine.start < n_rows else "no rows"
        x64, dy64 = x[mine].double(), dy[mine].double()
        x_hat = x64 * torch.rsqrt(x64.pow(2).mean(dim=-1, keepdim=True) + eps)
        near = lambda wrong: wrong.numel() > 0 and torch.allclose(partial[p].double(), wrong, rtol=1e-3, atol=1e-3)
        if near((dy64 * x64).sum(dim=0)):
            hint = "dweight sums dy * x_hat, the NORMALIZED row x_hat = x * rstd, not dy * x"
        elif near((dy64 * x_hat)[-1:].sum(dim=0)):
            hint = "the partial holds only the program's last row: accumulate dw_acc += dy * x_hat over all its rows"
        else:
            hint = ("program pid's partial is the sum of dy * x_hat over ITS rows, pid * rows_per_program up to "
                    "min((pid + 1) * rows_per_program, n_rows), accumulated in fp32 and stored at DW_PARTIAL + pid * "
                    "n_cols + cols")
        fail(tried + f" -> DW_PARTIAL row {p} (program {p}: {rows})",
             f"{[round(v, 4) for v in partial[p][:4].tolist()]}...", f"{[round(v, 4) for v in owed[p][:4].tolist()]}...",
             hint)
    assert_close(dx, x32.grad, tried + " -> dx",
                 "dx = rstd * (g - x_hat * mean(g * x_hat)) with g = dy * w and x_hat = x * rstd, the mean over the "
                 "n_cols real entries (tl.sum / n_cols, not BLOCK_SIZE); the second term is there because every "
                 "output of the row depends on rstd" + (". " + upcast if sixteen else ""), **tol)
    assert_close(partial.sum(dim=0), w32.grad, tried + " -> DW_PARTIAL.sum(0)",
                 "the partials must add up to dweight = sum over all rows of dy * x_hat", rtol=1e-4, atol=1e-4 * scale)


def rmsnorm_backward_kernel(kernel) -> None:
    """Grade a ``@triton.jit`` RMSNorm backward ``kernel(DY, X, W, RSTD, DX, DW_PARTIAL, dy_row_stride,
    x_row_stride, dx_row_stride, n_rows, n_cols, rows_per_program, BLOCK_SIZE: tl.constexpr)``, launched by
    :func:`labkit.norms.launch_rmsnorm_backward_kernel` (a program per row of ``DW_PARTIAL``, each taking
    ``rows_per_program`` consecutive rows): dx against autograd through the reference RMSNorm, each program's row
    of ``DW_PARTIAL`` against the sum it owes, and their sum against autograd's dweight; ragged widths, uneven row
    counts (a program with no rows), strided rows, fp16 rows with a loss-scaled dy; NaN after every row of the
    inputs and in the uninitialized ``DW_PARTIAL``, a sentinel around dx's rows."""
    device = kernel_device("rmsnorm_backward_kernel")
    if device is None:
        return
    expect_jit_kernel(kernel, "rmsnorm_backward_kernel")
    gen = torch.Generator().manual_seed(6)
    cases = _backward_cases(device, gen)
    for what, x, weight, dy, eps, programs, strides in cases:
        _check_backward(kernel, f"rmsnorm_backward_kernel on {what}", x, weight, dy, eps, programs, strides)
    passed("rmsnorm_backward_kernel", f"dx and dweight match autograd on {len(cases)} launches: ragged widths 1 to "
                                      f"257 (masked lanes), row counts that split unevenly over 2-4 programs (one with no "
                                      f"rows), strided rows, fp32/fp16 (a loss-scaled fp16 dy), each program's partial "
                                      f"checked; masked tails (NaN past every row, dx's padding untouched)")
