"""labkit.kernels.swiglu against the PyTorch reference and autograd."""
import labkit  # noqa: F401  (first: switches Triton to its interpreter on CPU)

import pytest
import torch
import torch.nn.functional as F

from labkit.kernels.swiglu import INTERPRETER_BLOCK_SIZE, swiglu, swiglu_reference

DEVICE = labkit.device()
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def make_inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a, b, dc = (torch.randn(shape, generator=gen) * 3 for _ in range(3))
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype), dc.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (3, 7), (2, 3, 1000), (2, 4097), (INTERPRETER_BLOCK_SIZE + 5,)])
def test_forward_and_backward_match_autograd(shape, dtype):
    a, b, dc = make_inputs(shape, dtype)
    a.requires_grad_()
    b.requires_grad_()
    c = swiglu(a, b)
    assert c.dtype == dtype and c.shape == a.shape
    a32, b32 = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    expected = F.silu(a32) * b32
    torch.testing.assert_close(c.float(), expected.detach(), **TOL[dtype])
    c.backward(dc)
    expected.backward(dc.float())
    torch.testing.assert_close(a.grad.float(), a32.grad, **TOL[dtype])
    torch.testing.assert_close(b.grad.float(), b32.grad, **TOL[dtype])


def test_reference_and_non_contiguous_inputs():
    a, b, _ = make_inputs((6, 10), torch.float32, seed=1)
    torch.testing.assert_close(swiglu(a.T, b.T), swiglu_reference(a.T, b.T))
    torch.testing.assert_close(swiglu_reference(a, b), F.silu(a) * b)


# Triton's interpreter evaluates tl.sigmoid(a) as 1 / (1 + exp(-a)) in numpy: exp(100) overflows
# to inf with a warning and the result is the exact limit 0, which is what this test checks.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_saturated_gate():
    a = torch.tensor([-100.0, -20.0, 0.0, 20.0, 100.0], device=DEVICE)
    b = torch.full_like(a, 2.0)
    torch.testing.assert_close(swiglu(a, b), F.silu(a) * b)


@pytest.mark.parametrize(
    "a, b, error, words",
    [
        (torch.ones(3, device=DEVICE), [1.0, 1.0, 1.0], TypeError, "b: expected a torch.Tensor"),
        (torch.ones(3, device=DEVICE), torch.ones(4, device=DEVICE), ValueError, "a, b: expected the same shape"),
        (torch.ones(3, device=DEVICE), torch.ones(3, dtype=torch.float16, device=DEVICE), TypeError, "a, b: expected the same dtype"),
        (torch.ones(3, dtype=torch.float64, device=DEVICE), torch.ones(3, dtype=torch.float64, device=DEVICE), TypeError, "a: expected dtype"),
    ],
)
def test_bad_input_is_named(a, b, error, words):
    with pytest.raises(error, match=words):
        swiglu(a, b)
