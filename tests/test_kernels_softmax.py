"""labkit.kernels.softmax against torch.softmax and autograd: ragged shapes, all dtypes, huge
values, -inf entries, all -inf rows, and rows longer than one block (online softmax)."""
import labkit  # noqa: F401  (first: switches Triton to its interpreter on CPU)

import pytest
import torch

from labkit.kernels.softmax import MAX_BLOCK_SIZE, softmax, softmax_reference

DEVICE = labkit.device()
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=2e-3, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=1e-3)}
LONG = MAX_BLOCK_SIZE + 3616  # two blocks, the second one ragged


def make_inputs(shape, dtype, scale=3.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * scale).to(DEVICE, dtype)
    dy = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    return x, dy


def torch_grad(x, dy):
    x32 = x.float().requires_grad_()
    torch.softmax(x32, dim=-1).backward(dy.float())
    return x32.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 1), (2, 3, 7), (4, 1000), (2, 4097), (2, LONG)])
def test_forward_and_backward_match_torch(shape, dtype):
    x, dy = make_inputs(shape, dtype)
    x.requires_grad_()
    y = softmax(x)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.float(), torch.softmax(x.detach().float(), dim=-1), **TOL[dtype])
    y.backward(dy)
    torch.testing.assert_close(x.grad.float(), torch_grad(x.detach(), dy), **TOL[dtype])


@pytest.mark.parametrize("n_cols", [50, LONG])
def test_huge_values_do_not_overflow(n_cols):
    x, _ = make_inputs((3, n_cols), torch.float32, scale=1e4, seed=1)
    x[:, -1] = 3e38  # exp would overflow without subtracting the max
    y = softmax(x)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, torch.softmax(x, dim=-1))


def test_max_in_a_later_block_rescales_the_running_sum():
    x, dy = make_inputs((2, LONG), torch.float32, seed=2)
    x[0, -5] = 80.0  # row 0: the max arrives in the second block
    x[1, :MAX_BLOCK_SIZE] = float("-inf")  # row 1: the whole first block is -inf
    x.requires_grad_()
    y = softmax(x)
    torch.testing.assert_close(y, torch.softmax(x.detach(), dim=-1))
    y.backward(dy)
    torch.testing.assert_close(x.grad, torch_grad(x.detach(), dy))


@pytest.mark.parametrize("n_cols", [9, LONG])
def test_minus_inf_entries_and_all_minus_inf_rows(n_cols):
    x, dy = make_inputs((3, n_cols), torch.float32, seed=3)
    x[0, ::2] = float("-inf")  # a causal-mask-like row
    x[1] = float("-inf")  # attends to nothing
    x.requires_grad_()
    y = softmax(x)
    assert (y[0, ::2] == 0).all()
    torch.testing.assert_close(y[[0, 2]], torch.softmax(x.detach()[[0, 2]], dim=-1))
    assert (y[1] == 0).all(), "an all -inf row is documented to give zeros"
    torch.testing.assert_close(y, softmax_reference(x.detach()))
    y.backward(dy)
    assert (x.grad[1] == 0).all()
    torch.testing.assert_close(x.grad[[0, 2]], torch_grad(x.detach()[[0, 2]], dy[[0, 2]]))


def test_strided_input():
    base, _ = make_inputs((30, 4), torch.float16, seed=4)
    x = base.T  # the softmax axis is strided in memory
    torch.testing.assert_close(softmax(x).float(), torch.softmax(x.float(), dim=-1), **TOL[torch.float16])


def test_reference_matches_torch():
    x, _ = make_inputs((5, 11), torch.float32, seed=5)
    torch.testing.assert_close(softmax_reference(x), torch.softmax(x, dim=-1))


@pytest.mark.parametrize(
    "x, error, words",
    [
        ([1.0, 2.0], TypeError, "x: expected a torch.Tensor"),
        (torch.ones(2, 3, dtype=torch.int64, device=DEVICE), TypeError, "x: expected dtype"),
        (torch.ones((), device=DEVICE), ValueError, "scalar"),
        (torch.ones(2, 0, device=DEVICE), ValueError, "last dim is 0"),
    ],
)
def test_bad_input_is_named(x, error, words):
    with pytest.raises(error, match=words):
        softmax(x)
