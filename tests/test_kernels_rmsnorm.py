"""labkit.kernels.rmsnorm against the PyTorch reference and autograd, on ragged shapes and all dtypes."""
import labkit  # noqa: F401  (first: switches Triton to its interpreter on CPU)

import pytest
import torch

from labkit.kernels.rmsnorm import rmsnorm, rmsnorm_backward_reference, rmsnorm_reference

DEVICE = labkit.device()
# fp16 rounds to 11 bits, bf16 to 8 (and the interpreter truncates fp32 -> bf16 instead of rounding)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
SHAPES = [(3, 1), (2, 3, 7), (4, 1000), (2, 4097), (1, 2, 1, 33)]


def make_inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3 + 0.5).to(DEVICE, dtype)
    weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(DEVICE, dtype)
    dy = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    return x, weight, dy


def fp32_autograd(x, weight, dy, eps):
    x32 = x.float().requires_grad_()
    w32 = weight.float().requires_grad_()
    rmsnorm_reference(x32, w32, eps).backward(dy.float())
    return x32.grad, w32.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_backward_match_autograd(shape, dtype):
    x, weight, dy = make_inputs(shape, dtype)
    x.requires_grad_()
    weight.requires_grad_()
    y = rmsnorm(x, weight, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.float(), rmsnorm_reference(x.detach().float(), weight.detach().float()), **TOL[dtype])
    y.backward(dy)
    dx_ref, dw_ref = fp32_autograd(x.detach(), weight.detach(), dy, 1e-5)
    assert x.grad.dtype == dtype and weight.grad.dtype == dtype
    torch.testing.assert_close(x.grad.float(), dx_ref, **TOL[dtype])
    # dweight sums over rows, so its error grows with the row count
    rows = x.numel() // shape[-1]
    tol = {k: v * rows for k, v in TOL[dtype].items()}
    torch.testing.assert_close(weight.grad.float(), dw_ref, **tol)


def test_closed_form_backward_matches_autograd():
    x, weight, dy = make_inputs((5, 2, 37), torch.float32)
    dx, dw = rmsnorm_backward_reference(x, weight, dy, eps=1e-3)
    x64, w64 = x.double().requires_grad_(), weight.double().requires_grad_()
    (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-3) * w64).backward(dy.double())
    torch.testing.assert_close(dx, x64.grad.float())
    torch.testing.assert_close(dw, w64.grad.float())


def test_matches_torch_rms_norm_with_mixed_weight_dtype():
    x, _, _ = make_inputs((6, 129), torch.float32, seed=1)
    weight = torch.rand(129, dtype=torch.float64).to(DEVICE) + 0.5
    expected = torch.nn.functional.rms_norm(x, (129,), weight.float(), eps=1e-6)
    torch.testing.assert_close(rmsnorm(x, weight.float(), 1e-6), expected, rtol=1e-5, atol=1e-5)


def test_eps_matters_for_tiny_rows():
    x = torch.full((2, 8), 1e-4, device=DEVICE)
    weight = torch.ones(8, device=DEVICE)
    torch.testing.assert_close(rmsnorm(x, weight, 1e-2), rmsnorm_reference(x, weight, 1e-2))
    assert rmsnorm(x, weight, 1e-2).max() < 0.01  # eps dominates mean(x^2) = 1e-8


def test_strided_input_and_gradient():
    base, weight, _ = make_inputs((7, 2, 20), torch.float32, seed=2)
    x = base.transpose(0, 1).requires_grad_()  # rows are not contiguous in memory
    dy = torch.randn(20, 7, device=DEVICE).T.unsqueeze(0).expand(2, 7, 20)  # non-contiguous gradient
    y = rmsnorm(x, weight)
    torch.testing.assert_close(y, rmsnorm_reference(x.detach(), weight))
    y.backward(dy)
    dx_ref, _ = fp32_autograd(x.detach(), weight, dy, 1e-5)
    torch.testing.assert_close(x.grad, dx_ref, rtol=1e-5, atol=1e-5)


def test_saves_only_the_inverse_rms_per_row():
    x, weight, _ = make_inputs((4, 3, 50), torch.float16, seed=3)
    y = rmsnorm(x.requires_grad_(), weight.requires_grad_())
    saved = y.grad_fn.saved_tensors
    extra = [t for t in saved if t.data_ptr() not in (x.data_ptr(), weight.data_ptr())]
    assert len(extra) == 1 and extra[0].shape == (12,) and extra[0].dtype == torch.float32


def test_many_rows_use_per_program_partial_sums():
    x, weight, dy = make_inputs((37, 9), torch.float32, seed=4)  # rows do not split evenly over programs
    weight.requires_grad_()
    rmsnorm(x, weight).backward(dy)
    _, dw_ref = fp32_autograd(x, weight.detach(), dy, 1e-5)
    torch.testing.assert_close(weight.grad, dw_ref, rtol=1e-5, atol=1e-5)


def test_empty_batch():
    x = torch.empty(0, 16, device=DEVICE)
    assert rmsnorm(x, torch.ones(16, device=DEVICE)).shape == (0, 16)


@pytest.mark.parametrize(
    "x, weight, eps, error, words",
    [
        ([1.0, 2.0], torch.ones(2, device=DEVICE), 1e-5, TypeError, "x: expected a torch.Tensor"),
        (torch.ones(2, 4, dtype=torch.int32, device=DEVICE), torch.ones(4, device=DEVICE), 1e-5, TypeError, "x: expected dtype"),
        (torch.ones(2, 4, dtype=torch.float64, device=DEVICE), torch.ones(4, device=DEVICE), 1e-5, TypeError, "x: expected dtype"),
        (torch.ones(2, 4, device=DEVICE), torch.ones(5, device=DEVICE), 1e-5, ValueError, "weight: expected shape (4,)"),
        (torch.ones(2, 4, device=DEVICE), torch.ones(1, 4, device=DEVICE), 1e-5, ValueError, "weight: expected shape (4,)"),
        (torch.ones(2, 4, device=DEVICE), torch.ones(4, device=DEVICE), 0.0, ValueError, "eps=0.0"),
        (torch.ones(2, 0, device=DEVICE), torch.ones(0, device=DEVICE), 1e-5, ValueError, "last dim is 0"),
        (torch.ones((), device=DEVICE), torch.ones(1, device=DEVICE), 1e-5, ValueError, "scalar"),
        (torch.ones(1, 70000, device=DEVICE), torch.ones(70000, device=DEVICE), 1e-5, ValueError, "maximum of 65536"),
    ],
)
def test_bad_input_is_named(x, weight, eps, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        rmsnorm(x, weight, eps)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter's device rule")
def test_wrong_device_is_named():
    with pytest.raises(ValueError, match="x: Triton's interpreter runs on the CPU"):
        rmsnorm(torch.ones(2, 4, device="meta"), torch.ones(4, device="meta"))
