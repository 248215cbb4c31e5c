"""Graders for chapter 02 (norms and activations)."""
from __future__ import annotations

import torch

from labkit.checks._core import (as_tensor, assert_close, call, call_on_copies, expect_device, expect_differentiable, fail,
                                 other_device, passed)

__all__ = ["rmsnorm", "reduction_dims", "rmsnorm_backward", "softmax"]


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
