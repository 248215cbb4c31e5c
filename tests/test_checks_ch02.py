"""The chapter-02 graders accept the reference and reject the typical wrong answers."""
import labkit  # noqa: F401

import pytest
import torch

from labkit import checks
from labkit.checks import CheckFailed
from labkit.kernels.rmsnorm import rmsnorm_backward_reference, rmsnorm_reference
from labkit.nn import softmax as nn_softmax


def test_rmsnorm_accepts_the_reference(capsys):
    checks.rmsnorm(rmsnorm_reference)
    assert capsys.readouterr().out.startswith("✓ rmsnorm")


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
    ],
)
def test_rmsnorm_rejects_typical_mistakes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.rmsnorm(wrong)


def test_reduction_dims_accepts_right_answers_in_any_form(capsys):
    checks.reduction_dims(lambda norm, ndim: tuple(range(ndim - 1)) if norm == "batchnorm" else (-1,))
    checks.reduction_dims(lambda norm, ndim: list(range(ndim - 2, -1, -1)) if norm == "batchnorm" else [ndim - 1])
    assert "✓ reduction_dims" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, words",
    [
        (lambda norm, ndim: (0,) if norm == "batchnorm" else (-1,), "all dims except the last"),  # BatchNorm1d on 2-D only
        (lambda norm, ndim: tuple(range(ndim - 1)) if norm == "batchnorm" else tuple(range(1, ndim)), "only the last dim"),
        (lambda norm, ndim: (-1,), "BatchNorm"),  # everything per token
        (lambda norm, ndim: None, "tuple"),
    ],
)
def test_reduction_dims_rejects_wrong_axes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.reduction_dims(wrong)


def test_rmsnorm_backward_accepts_the_closed_form(capsys):
    checks.rmsnorm_backward(rmsnorm_backward_reference)
    assert "✓ rmsnorm_backward" in capsys.readouterr().out


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
        (lambda x, w, dy, eps: rmsnorm_backward_reference(x, w, dy, eps)[0], "pair"),
    ],
)
def test_rmsnorm_backward_rejects_typical_mistakes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.rmsnorm_backward(wrong)


def test_softmax_accepts_stable_implementations(capsys):
    checks.softmax(lambda x: torch.softmax(x, dim=-1))
    checks.softmax(nn_softmax)
    assert "✓ softmax" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, words",
    [
        (lambda x: torch.exp(x) / torch.exp(x).sum(-1, keepdim=True), "max"),  # unstable
        (lambda x: torch.softmax(x, dim=0), "last dim"),  # wrong axis
        (lambda x: torch.softmax(x.nan_to_num(neginf=0.0), dim=-1), "probability 0"),  # mask ignored
        (lambda x: (x - x.amax(-1, keepdim=True)).exp(), "last dim"),  # not normalized
    ],
)
def test_softmax_rejects_typical_mistakes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.softmax(wrong)
