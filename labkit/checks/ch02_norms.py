"""Graders for chapter 02 (norms and activations)."""
from __future__ import annotations

import torch

from labkit.checks._core import as_tensor, assert_close, call, fail, passed

__all__ = ["rmsnorm", "reduction_dims", "rmsnorm_backward", "softmax"]


def _rmsnorm_expected(x, weight, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _cases(seed: int = 0):
    """(description, x, weight, eps): non-zero means (so subtracting it is caught), weights that
    are not ones, ragged widths, a tiny-valued row where eps dominates, fp16."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for shape, eps, dtype in [((3, 8), 1e-5, torch.float32), ((2, 5, 16), 1e-6, torch.float32), ((4, 1), 1e-5, torch.float32),
                              ((2, 3, 33), 1e-5, torch.float16)]:
        x = (torch.randn(shape, generator=gen) * 2 + 1).to(dtype)
        weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
        cases.append((f"x of shape {shape} ({dtype}), eps={eps}", x, weight, eps))
    tiny = torch.full((2, 6), 1e-3) * torch.randn(2, 6, generator=gen).sign()
    cases.append(("x with entries of size 1e-3 (mean(x^2) = 1e-6), eps=0.01", tiny, torch.ones(6), 1e-2))
    return cases


def rmsnorm(fn) -> None:
    """Grade ``fn(x, weight, eps)`` = RMSNorm over the last axis, output in ``x.dtype``."""
    for tried, x, weight, eps in _cases():
        got = call(fn, tried, x.clone(), weight.clone(), eps)
        tol = dict(rtol=2e-3, atol=2e-3) if x.dtype == torch.float16 else dict(rtol=1e-4, atol=1e-5)
        assert_close(got, _rmsnorm_expected(x, weight, eps), tried,
                     "divide each row (last axis) by sqrt(mean(x**2) + eps) and multiply by weight; "
                     "RMSNorm does not subtract the mean, and eps goes inside the square root", **tol)
    passed("rmsnorm", f"matches the reference on {len(_cases())} inputs, including fp16 and an eps-dominated row")


def reduction_dims(fn) -> None:
    """Grade ``fn(norm, ndim)`` -> the dims (a tuple, any order, negative allowed) over which
    ``norm`` in ``{"batchnorm", "layernorm", "rmsnorm"}`` computes its statistics, for a
    features-last input with ``ndim`` dimensions (e.g. ``[batch, seq, d_model]``)."""
    hints = {
        "batchnorm": "BatchNorm averages each feature over every position of the batch: all dims except the last",
        "layernorm": "LayerNorm (in transformers) normalizes each token over its own features: only the last dim",
        "rmsnorm": "RMSNorm, like LayerNorm, works on each token's features: only the last dim",
    }
    for ndim in (2, 3, 4):
        for norm, hint in hints.items():
            tried = f"reduction_dims({norm!r}, ndim={ndim})"
            got = call(fn, tried, norm, ndim)
            try:
                dims = sorted({int(d) % ndim for d in got})
                count = len(list(got))
            except Exception:
                fail(tried, repr(got), "a tuple of ints", "return the dims as a tuple, e.g. (0, 1)")
            expected = list(range(ndim - 1)) if norm == "batchnorm" else [ndim - 1]
            if dims != expected or count != len(expected):
                fail(tried, tuple(got), tuple(expected), hint)
    passed("reduction_dims", "right axes for BatchNorm, LayerNorm and RMSNorm on 2-D, 3-D and 4-D inputs")


def rmsnorm_backward(fn) -> None:
    """Grade ``fn(x, weight, dy, eps)`` -> ``(dx, dweight)``, the gradients of
    ``(rmsnorm(x, weight, eps) * dy).sum()``, tried on fp32 inputs."""
    gen = torch.Generator().manual_seed(1)
    for shape, eps in [((3, 8), 1e-5), ((2, 4, 16), 1e-2), ((5, 1), 1e-5)]:
        x = torch.randn(shape, generator=gen) * 2 + 0.5
        weight = torch.rand(shape[-1], generator=gen) + 0.5
        dy = torch.randn(shape, generator=gen)
        tried = f"x, dy of shape {shape}, eps={eps}"
        got = call(fn, tried, x.clone(), weight.clone(), dy.clone(), eps)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            fail(tried, type(got).__name__, "a pair (dx, dweight)", "return both gradients: dx, dweight")
        xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
        (_rmsnorm_expected(xr, wr, eps) * dy).sum().backward()
        assert_close(as_tensor(got[0], tried + " -> dx"), xr.grad, tried + " -> dx",
                     "dx = rstd * (g - x_hat * mean(g * x_hat)) with g = dy * weight and x_hat = x * rstd: "
                     "the second term is there because every output of the row depends on rstd, hence on all of x",
                     rtol=1e-4, atol=1e-5)
        assert_close(as_tensor(got[1], tried + " -> dweight"), wr.grad, tried + " -> dweight",
                     "dweight = sum of dy * x_hat over every position (all dims but the last)", rtol=1e-4, atol=1e-5)
    passed("rmsnorm_backward", "dx and dweight match autograd on 3 shapes")


def softmax(fn) -> None:
    """Grade ``fn(x)`` = softmax over the last axis: right axis, stable for huge logits, and
    probability 0 for ``-inf`` (masked) entries."""
    gen = torch.Generator().manual_seed(2)
    masked = torch.randn(3, 6, generator=gen)
    masked[:, 4:] = float("-inf")
    cases = [
        ("x of shape (3, 5)", torch.randn(3, 5, generator=gen), "sum over the last dim (dim=-1), not over dim 0"),
        ("x of shape (2, 4, 7)", torch.randn(2, 4, 7, generator=gen), "normalize over the last dim, whatever the rank"),
        ("x with logits around 1000 (exp overflows fp32 beyond ~88)", torch.randn(2, 6, generator=gen) + 1000.0,
         "subtract each row's max before exp: the result is unchanged and every exponent is <= 0"),
        ("x with -inf (masked) entries", masked, "exp(-inf) = 0: masked entries must get probability 0"),
    ]
    for tried, x, hint in cases:
        got = call(fn, tried, x.clone())
        assert_close(got, torch.softmax(x, dim=-1), tried, hint, rtol=1e-5, atol=1e-6)
    passed("softmax", "right axis, stable for huge logits, and masked entries get 0")
