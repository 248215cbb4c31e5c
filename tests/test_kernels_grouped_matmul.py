"""labkit.kernels.grouped_matmul against a loop of torch.matmul over the experts (and torch._grouped_mm where
it runs here): forward and backward, ragged segments, empty experts, one expert holding every row, all dtypes."""
import labkit  # noqa: F401  (first: switches Triton to its interpreter on CPU)

import pytest
import torch

from labkit import kernels

ok, why = kernels.available()
pytestmark = pytest.mark.skipif(not ok, reason=why)
if ok:
    from labkit.kernels.grouped_matmul import (grouped_matmul, grouped_matmul_reference, launch_grid, launch_settings, tile_map,
                                               tiles_written)
DEVICE = labkit.device()
# outputs are sums of K ~unit products (|y| up to ~40 for K=200): fp16 keeps 11 bits, bf16 8 (and the interpreter
# truncates fp32 -> bf16 on store); dW sums over a segment's rows, so its absolute error grows with them
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.float16: dict(rtol=2e-3, atol=2e-2), torch.bfloat16: dict(rtol=2e-2, atol=2e-1)}
# rows per expert: ragged with an empty expert, everything in one expert, tiny segments, empty first and last,
# one expert only; segments longer than a 64-row tile, K and N ragged against 128-wide tiles (two K steps for K=200)
GROUPS = [([30, 0, 77, 5], 72, 50), ([0, 0, 131, 0], 40, 150), ([1, 2, 3, 4], 200, 24), ([0, 65, 0], 33, 17), ([19], 16, 16)]


def make_inputs(sizes, K, N, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    M = sum(sizes)
    x = torch.randn(M, K, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(len(sizes), N, K, generator=gen).to(DEVICE, dtype)
    dy = torch.randn(M, N, generator=gen).to(DEVICE, dtype)
    return x, weight, torch.tensor(sizes, device=DEVICE), dy


def loop_autograd(x, weight, group_sizes, dy):
    """The per-expert loop of matmuls, in fp32, differentiated by autograd."""
    x32, w32 = x.float().requires_grad_(), weight.float().requires_grad_()
    y = grouped_matmul_reference(x32, w32, group_sizes)
    y.backward(dy.float())
    return y.detach(), x32.grad, w32.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sizes, K, N", GROUPS)
def test_forward_and_backward_match_the_loop(sizes, K, N, dtype):
    x, weight, group_sizes, dy = make_inputs(sizes, K, N, dtype)
    x.requires_grad_()
    weight.requires_grad_()
    y = grouped_matmul(x, weight, group_sizes)
    assert y.shape == (sum(sizes), N) and y.dtype == dtype
    y.backward(dy)
    y_ref, dx_ref, dw_ref = loop_autograd(x.detach(), weight.detach(), group_sizes, dy)
    torch.testing.assert_close(y.float(), y_ref, **TOL[dtype])
    assert x.grad.dtype == dtype and weight.grad.dtype == dtype
    torch.testing.assert_close(x.grad.float(), dx_ref, **TOL[dtype])
    longest = max(max(sizes), 1)
    torch.testing.assert_close(weight.grad.float(), dw_ref, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * longest ** 0.5)
    for e, size in enumerate(sizes):
        if size == 0:  # an expert that got no rows gets an exact zero gradient
            assert torch.count_nonzero(weight.grad[e]) == 0


def test_tile_map_lists_every_tile_of_every_segment():
    sizes = torch.tensor([0, 5, 64, 65, 0, 130, 1])
    tile_expert, tile_row, start, end = tile_map(sizes, 64)
    expected = [(e, s) for e, n in enumerate(sizes.tolist()) for s in range(int(start[e]), int(start[e]) + n, 64)]
    assert list(zip(tile_expert.tolist(), tile_row.tolist())) == expected
    assert end.tolist() == torch.cumsum(sizes, 0).tolist() and (end - start).tolist() == sizes.tolist()
    assert len(tile_map(torch.zeros(3, dtype=torch.int64), 64)[0]) == 0


def test_launch_grid_and_what_each_row_tile_writes():
    sizes, K, N = [37, 0, 5, 64, 1, 21], 48, 40
    x, weight, group_sizes, _ = make_inputs(sizes, K, N, torch.float32)
    small = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4)
    assert launch_grid(group_sizes, N, small) == (3 + 0 + 1 + 4 + 1 + 2, 2)
    assert launch_grid(group_sizes, N) == (len(tile_map(group_sizes, launch_settings()["BLOCK_M"])[0]), -(-N // launch_settings()["BLOCK_N"]))
    tile_expert, tile_row, _, end = tile_map(group_sizes, 16)
    written = tiles_written(x, weight, group_sizes, small)
    assert len(written) == len(tile_expert)
    for w, e, first in zip(written, tile_expert.tolist(), tile_row.tolist()):
        rows = (first, min(first + 16, int(end[e])))
        assert w["contiguous"] and w["rows"] == rows and w["cols"] == (0, N)
        torch.testing.assert_close(w["values"], x[rows[0]:rows[1]] @ weight[e].T, **TOL[torch.float32])
    with pytest.raises(TypeError, match="x"):
        tiles_written(torch.ones(3, 4, dtype=torch.int64, device=DEVICE), weight, group_sizes)
    with pytest.raises(ValueError, match="group_sizes: counts sum to"):
        tiles_written(x[:-1], weight, group_sizes)
    with pytest.raises(ValueError, match="weight: expected"):
        tiles_written(x, weight[:, :, :-1], group_sizes)
    with pytest.raises(TypeError, match="group_sizes"):
        launch_grid(group_sizes.float(), N)
    with pytest.raises(TypeError, match="group_sizes"):
        launch_grid(sizes, N)
    with pytest.raises(ValueError, match="group_sizes: counts must be non-negative"):
        launch_grid(torch.tensor([3, -1]), N)
    with pytest.raises(ValueError, match="group_sizes: expected shape"):
        launch_grid(group_sizes[None], N)
    with pytest.raises(ValueError, match="n_out"):
        launch_grid(group_sizes, -1)


def test_matches_torch_grouped_mm():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm")
    x, weight, group_sizes, _ = make_inputs([30, 0, 77, 5], 72, 48, torch.float32, seed=3)
    offsets = torch.cumsum(group_sizes, 0).to(torch.int32)
    try:
        theirs = torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm does not run here ({DEVICE}, fp32): {e}")
    torch.testing.assert_close(grouped_matmul(x, weight, group_sizes), theirs, **TOL[torch.float32])


def test_strided_weight_and_int32_counts():
    # a weight stored as [E, K, N] and viewed as [E, N, K]: the kernel reads it through its strides, no copy
    x, weight, group_sizes, dy = make_inputs([10, 23, 0, 40], 48, 36, torch.float32, seed=4)
    strided = weight.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    x.requires_grad_()
    strided.requires_grad_()
    y = grouped_matmul(x, strided, group_sizes.to(torch.int32))
    y.backward(dy)
    y_ref, dx_ref, dw_ref = loop_autograd(x.detach(), weight, group_sizes, dy)
    torch.testing.assert_close(y, y_ref, **TOL[torch.float32])
    torch.testing.assert_close(x.grad, dx_ref, **TOL[torch.float32])
    torch.testing.assert_close(strided.grad, dw_ref, rtol=1e-5, atol=1e-3)


def test_no_rows_at_all():
    x, weight, group_sizes, _ = make_inputs([0, 0], 16, 8, torch.float32)
    weight.requires_grad_()
    y = grouped_matmul(x.requires_grad_(), weight, group_sizes)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert torch.count_nonzero(weight.grad) == 0 and x.grad.shape == (0, 16)


def test_moe_layer_on_the_kernel_matches_the_pytorch_path():
    from labkit.experts import MoELayer

    torch.manual_seed(0)
    plain = MoELayer(32, 48, num_experts=4, top_k=2, capacity_factor=1.0).to(DEVICE)
    fast = MoELayer(32, 48, num_experts=4, top_k=2, capacity_factor=1.0, use_triton=True).to(DEVICE)
    fast.load_state_dict(plain.state_dict())
    x = torch.randn(3, 20, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = plain(xa), fast(xb)
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-5, atol=1e-5)
    for name in ("w1", "w2", "w3"):
        torch.testing.assert_close(getattr(fast.experts, name).grad, getattr(plain.experts, name).grad, rtol=1e-5, atol=1e-5)


def test_launch_settings_use_big_tiles_under_the_interpreter():
    settings = launch_settings()
    assert settings["BLOCK_M"] >= 16 and settings["BLOCK_N"] >= 16 and settings["BLOCK_K"] >= 16
    if DEVICE.type == "cpu":
        assert settings["BLOCK_N"] >= 128


def _args(**changes):
    base = dict(x=torch.ones(6, 8), weight=torch.ones(2, 4, 8), group_sizes=torch.tensor([2, 4]))
    base.update(changes)
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in base.items()}


@pytest.mark.parametrize(
    "changes, error, words",
    [
        (dict(x=[[1.0] * 8]), TypeError, "x: expected a torch.Tensor"),
        (dict(x=torch.ones(6, 8, dtype=torch.float64)), TypeError, "x: expected dtype"),
        (dict(x=torch.ones(2, 3, 8)), ValueError, r"x: expected \[M, K\]"),
        (dict(weight=torch.ones(4, 8)), ValueError, r"weight: expected \[E, N, K=8\]"),
        (dict(weight=torch.ones(2, 4, 7)), ValueError, r"weight: expected \[E, N, K=8\]"),
        (dict(weight=torch.ones(2, 4, 8, dtype=torch.float16)), TypeError, "weight: expected x's dtype"),
        (dict(weight=torch.ones(0, 4, 8)), ValueError, "weight: expected at least one expert"),
        (dict(group_sizes=[2, 4]), TypeError, "group_sizes: expected a torch.Tensor"),
        (dict(group_sizes=torch.tensor([2.0, 4.0])), TypeError, "group_sizes: expected an int32 or int64"),
        (dict(group_sizes=torch.tensor([6])), ValueError, r"group_sizes: expected shape \(2,\)"),
        (dict(group_sizes=torch.tensor([7, -1])), ValueError, "group_sizes: counts must be non-negative"),
        (dict(group_sizes=torch.tensor([2, 3])), ValueError, "group_sizes: counts sum to 5, but x has 6 rows"),
    ],
)
def test_bad_input_is_named(changes, error, words):
    with pytest.raises(error, match=words):
        grouped_matmul(**_args(**changes))


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter's device rule")
def test_wrong_device_is_named():
    with pytest.raises(ValueError, match="x: Triton's interpreter runs on the CPU"):
        grouped_matmul(**{**_args(), "x": torch.ones(6, 8, device="meta")})


def test_bench_suite_checks_correctness_on_cpu():
    from labkit.bench.moe import check_cpu, group_sizes

    assert group_sizes(2049, 8, "balanced").tolist() == [257] + [256] * 7
    skewed = group_sizes(2048, 8, "skewed")
    assert skewed.sum() == 2048 and skewed[0] > 2 * skewed[1] > 0
    if DEVICE.type == "cpu":
        for row in check_cpu():
            assert row["forward max error"] < 1e-4 and row["dX max error"] < 1e-4 and row["dW max error"] < 1e-3
