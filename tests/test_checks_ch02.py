"""The chapter-02 graders accept the reference and reject the typical wrong answers."""
import labkit  # noqa: F401

import pytest
import torch

from labkit.checks import ch02_norms as checks  # the graders unwrapped: delegating to labkit is refused by the package-level ones (test_checks_refusal.py)
from labkit.checks import CheckFailed
from labkit.kernels.rmsnorm import rmsnorm_backward_reference, rmsnorm_reference
from labkit.nn import softmax as nn_softmax


def plain_rmsnorm(x, weight, eps):
    """An independent right answer: fp32 math, cast back to x's dtype."""
    x32 = x.to(torch.float32)
    return (x32 / torch.sqrt((x32 * x32).mean(dim=-1, keepdim=True) + eps) * weight.to(torch.float32)).to(x.dtype)


def test_rmsnorm_accepts_the_reference(capsys):
    checks.rmsnorm(rmsnorm_reference)
    checks.rmsnorm(plain_rmsnorm)
    assert capsys.readouterr().out.count("✓ rmsnorm") == 2


def _in_place_rmsnorm(x, w, eps):
    return x.mul_(torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).mul_(w)


def _detached_rmsnorm(x, w, eps):
    with torch.no_grad():
        return plain_rmsnorm(x, w, eps)


def _fp32_then_cast(body):
    return lambda x, w, eps: body(x.float(), w.float(), eps).to(x.dtype)


@pytest.mark.parametrize(
    "wrong, words",
    [
        (_fp32_then_cast(lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + eps) * w), "sqrt"),  # wrong axis
        (_fp32_then_cast(lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * w), "eps"),  # missing eps
        (_fp32_then_cast(lambda x, w, eps: x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps) * w), "eps"),  # eps outside sqrt
        (_fp32_then_cast(lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)), "weight"),  # no weight
        (_fp32_then_cast(lambda x, w, eps: torch.nn.functional.layer_norm(x, x.shape[-1:], w, eps=eps)), "mean"),  # LayerNorm
        (_fp32_then_cast(lambda x, w, eps: x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps) * w), "mean"),  # sum, not mean
        (lambda x, w, eps: x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * w.float(), "dtype"),
        (lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w, "overflows"),  # 16-bit math
        (lambda x, w, eps: (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w,
         "x's dtype"),  # bf16 x times an fp32 weight promotes to fp32
        (_in_place_rmsnorm, "modified"),
        (_detached_rmsnorm, "requires_grad"),
    ],
)
def test_rmsnorm_rejects_typical_mistakes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.rmsnorm(wrong)


def test_reduction_dims_accepts_right_answers_in_any_form(capsys):
    checks.reduction_dims(lambda norm, ndim: tuple(range(ndim - 1)) if norm == "batchnorm" else (-1,))
    checks.reduction_dims(lambda norm, ndim: tuple(range(ndim - 2, -1, -1)) if norm == "batchnorm" else (ndim - 1,))
    assert "✓ reduction_dims" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, words",
    [
        (lambda norm, ndim: (0,) if norm == "batchnorm" else (-1,), "all dims except the last"),  # BatchNorm1d on 2-D only
        (lambda norm, ndim: tuple(range(ndim - 1)) if norm == "batchnorm" else tuple(range(1, ndim)), "only the last dim"),
        (lambda norm, ndim: (-1,), "BatchNorm"),  # everything per token
        (lambda norm, ndim: None, "tuple"),
        (lambda norm, ndim: list(range(ndim - 1)) if norm == "batchnorm" else [ndim - 1], "tuple"),  # a list
        (lambda norm, ndim: range(ndim - 1) if norm == "batchnorm" else (-1,), "tuple"),  # a range
        (lambda norm, ndim: (0, 1, 2)[: ndim - 1] if norm == "batchnorm" else (-1,), "all dims except the last"),  # <= 4-D
    ],
)
def test_reduction_dims_rejects_wrong_axes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.reduction_dims(wrong)


def plain_rmsnorm_backward(x, w, dy, eps):
    """An independent right answer, in float64 and with sums instead of means."""
    n = x.shape[-1]
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    rstd = 1 / torch.sqrt((x64 ** 2).sum(-1, keepdim=True) / n + eps)
    x_hat, g = x64 * rstd, dy64 * w64
    dx = rstd * g - x_hat * rstd * (g * x_hat).sum(-1, keepdim=True) / n
    return dx.to(x.dtype), (dy64 * x_hat).flatten(0, -2).sum(0).to(w.dtype)


def test_rmsnorm_backward_accepts_the_closed_form(capsys):
    checks.rmsnorm_backward(rmsnorm_backward_reference)
    checks.rmsnorm_backward(plain_rmsnorm_backward)
    assert capsys.readouterr().out.count("✓ rmsnorm_backward") == 2


def _with_autograd(x, w, dy, eps):  # what the exercise forbids
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    (rmsnorm_reference(x, w, eps) * dy).sum().backward()
    return x.grad, w.grad


def _scales_dy_in_place(x, w, dy, eps):
    g = dy.mul_(w)  # overwrites the caller's dy
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = x * rstd
    return rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True)), (g / w * x_hat).flatten(0, -2).sum(0)


def _dweight_over_dim0(x, w, dy, eps):  # right for 2-D x only
    dx, _ = rmsnorm_backward_reference(x, w, dy, eps)
    return dx, (dy * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).sum(dim=0)


def _without_projection(x, w, dy, eps):
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return rstd * dy * w, (dy * x * rstd).reshape(-1, x.shape[-1]).sum(0)


def _dweight_per_row(x, w, dy, eps):
    dx, _ = rmsnorm_backward_reference(x, w, dy, eps)
    return dx, (dy * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).sum(0)


@pytest.mark.parametrize(
    "wrong, words",
    [
        (_without_projection, "second term"),
        (_dweight_per_row, "dweight"),
        (lambda x, w, dy, eps: rmsnorm_backward_reference(x, w, dy, eps)[0], "tuple"),
        (_with_autograd, "without autograd"),
        (_scales_dy_in_place, "modified"),
        (_dweight_over_dim0, "EVERY position"),
    ],
)
def test_rmsnorm_backward_rejects_typical_mistakes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.rmsnorm_backward(wrong)


def test_softmax_accepts_stable_implementations(capsys):
    checks.softmax(lambda x: torch.softmax(x, dim=-1))
    checks.softmax(nn_softmax)
    checks.softmax(plain_softmax)
    assert capsys.readouterr().out.count("✓ softmax") == 3


def plain_softmax(x):
    """An independent right answer: fp32 math, -inf rows to 0, cast back."""
    z = x.float()
    peak = z.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)
    e = (z - peak).exp()
    return (e / e.sum(dim=-1, keepdim=True).clamp(min=1e-30)).to(x.dtype)


def _in_place_softmax(x):
    x -= x.amax(dim=-1, keepdim=True)
    return x.exp_().div_(x.sum(dim=-1, keepdim=True))


def _uniform_when_all_masked(x):
    return torch.softmax(x.clamp(min=-1e9), dim=-1)


@pytest.mark.parametrize(
    "wrong, words",
    [
        (lambda x: torch.exp(x) / torch.exp(x).sum(-1, keepdim=True), "max"),  # unstable
        (lambda x: torch.softmax(x, dim=0), "last dim"),  # wrong axis
        (lambda x: torch.softmax(x.nan_to_num(neginf=0.0), dim=-1), "probability 0"),  # mask ignored
        (lambda x: (x - x.amax(-1, keepdim=True)).exp(), "last dim"),  # not normalized
        (_in_place_softmax, "do not change x"),
        (lambda x: torch.softmax(x.float(), dim=-1), "dtype"),  # fp32 output for bf16 x
        (_uniform_when_all_masked, "leave it NaN"),  # a fully masked row becomes uniform
        (lambda x: torch.softmax(x.reshape(-1, x.shape[-1])[:, None], -1).reshape(x.shape) if x.dim() <= 3
         else torch.softmax(x, dim=3), "rank"),
    ],
)
def test_softmax_rejects_typical_mistakes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.softmax(wrong)
