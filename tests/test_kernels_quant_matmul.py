"""labkit.kernels.quant_matmul against its PyTorch reference (and labkit.quant's own dequantization):
every format, both kernels (GEMV for one row, tiled for more), ragged K and N, all input dtypes."""
import labkit  # noqa: F401  (first: switches Triton to its interpreter on CPU)

import math

import pytest
import torch

from labkit import kernels
from labkit import quant as Q
from labkit.nn import Linear

ok, why = kernels.available()
pytestmark = pytest.mark.skipif(not ok, reason=why)
if ok:
    from labkit.kernels.quant_matmul import dequantize_weight_reference, launch_settings, quant_matmul, quant_matmul_reference
DEVICE = labkit.device()
# outputs are sums of K ~unit products, |y| up to ~5: fp16 rounds to 11 bits, bf16 to 8 (the interpreter
# truncates fp32 -> bf16; on the GPU the tiled kernel also rounds the weight tile to bf16 for tl.dot)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=4e-3), torch.bfloat16: dict(rtol=2e-2, atol=4e-2)}
# (method, symmetric, group size): signed int4, unsigned int4 + zeros, NF4, int8 per row, asymmetric int8
FORMATS = [("int4", True, 64), ("int4", False, 43), ("nf4", True, 32), ("int8", True, None), ("int8", False, 16)]
# (x shape, N): one row (GEMV), several rows (tiled), a 3-D batch; N and K ragged against every tile size
SHAPES = [((1, 172), 37), ((5, 172), 70), ((2, 3, 300), 130)]


def quantized_layer(method, symmetric, group_size, d_in, d_out, seed=0):
    torch.manual_seed(seed)
    layer = Q.QuantLinear.from_linear(Linear(d_in, d_out), method, group_size, symmetric=symmetric, scale_dtype=torch.float32)
    return layer.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("x_shape, N", SHAPES)
@pytest.mark.parametrize("method, symmetric, group_size", FORMATS)
def test_matches_reference(method, symmetric, group_size, x_shape, N, dtype):
    layer = quantized_layer(method, symmetric, group_size, x_shape[-1], N)
    x = torch.randn(x_shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    operands = layer.kernel_operands()
    y = quant_matmul(x, **operands)
    assert y.dtype == dtype and y.shape == (*x_shape[:-1], N)
    expected = quant_matmul_reference(x.float(), **operands)
    torch.testing.assert_close(y.float(), expected, **TOL[dtype])


@pytest.mark.parametrize("method, symmetric, group_size", FORMATS)
def test_reference_is_the_layers_dequantized_weight(method, symmetric, group_size):
    layer = quantized_layer(method, symmetric, group_size, 172, 9)
    torch.testing.assert_close(dequantize_weight_reference(**layer.kernel_operands()), layer.dequantized_weight(), rtol=0, atol=0)


@pytest.mark.parametrize("fmt, zeros", [("int4", False), ("int4", True), ("nf4", False)])
@pytest.mark.parametrize("rows", [1, 3])
def test_every_byte_decodes_like_the_reference(fmt, zeros, rows):
    qweight = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16).to(DEVICE)  # K = 32
    gen = torch.Generator().manual_seed(2)
    scales = (torch.rand(16, 2, generator=gen) + 0.5).to(DEVICE)
    operands = dict(qweight=qweight, scales=scales, fmt=fmt, group_size=16,
                    zeros=torch.randint(0, 16, (16, 2), generator=gen).to(torch.uint8).to(DEVICE) if zeros else None,
                    codebook=Q.nf4_codebook().to(DEVICE) if fmt == "nf4" else None)
    x = torch.eye(32)[:rows].to(DEVICE)  # unit rows read the weight's columns out one by one
    torch.testing.assert_close(quant_matmul(x, **operands), quant_matmul_reference(x, **operands), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(quant_matmul(x, **operands).T, dequantize_weight_reference(**operands)[:, :rows], rtol=1e-6, atol=1e-6)


def test_both_scale_paths_agree():
    # group 64 with a 64-wide tile needs one scale per row per tile; group 48 makes each element look its own up
    for group_size in (64, 48):
        settings = launch_settings(4, 20, 192, group_size)
        assert settings["ONE_GROUP_PER_TILE"] == (group_size == 64 and settings["BLOCK_K"] <= 64)
        layer = quantized_layer("int4", True, group_size, 192, 20, seed=3)
        x = torch.randn(4, 192, generator=torch.Generator().manual_seed(4)).to(DEVICE)
        operands = layer.kernel_operands()
        torch.testing.assert_close(quant_matmul(x, **operands), quant_matmul_reference(x, **operands), **TOL[torch.float32])


def test_gemv_for_one_row_and_tiles_for_more():
    assert launch_settings(1, 4096, 4096, 128)["kernel"] == "gemv"
    assert launch_settings(8, 4096, 4096, 128)["kernel"] == "tiled"
    assert launch_settings(1, 4096, 4096, 64)["BLOCK_K"] == 64  # shrunk to the group: one scale per row per tile


def test_quant_linear_routes_through_the_kernel():
    layer = quantized_layer("nf4", True, 64, 128, 24)
    fast = Q.QuantLinear(128, 24, "nf4", group_size=64, scale_dtype=torch.float32, use_triton=True).to(DEVICE)
    fast.load_state_dict(layer.state_dict())
    x = torch.randn(2, 7, 128, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    torch.testing.assert_close(fast(x), layer(x), **TOL[torch.float32])


def test_quantized_adder_runs_on_the_kernel():
    from labkit.pretrained import adder_task, load_tiny_adder

    model, _ = load_tiny_adder(device=DEVICE)
    plain, _ = Q.quantize_model(model, "rtn", bits=8, group_size=32)
    fast, _ = Q.quantize_model(model, "rtn", bits=8, group_size=32, use_triton=True)
    tokens = torch.from_numpy(adder_task().tokens("val")[:64].reshape(2, 32)).to(DEVICE)
    torch.testing.assert_close(fast(tokens), plain(tokens), rtol=1e-4, atol=1e-4)


def test_empty_batch():
    layer = quantized_layer("int4", True, 32, 64, 8)
    assert quant_matmul(torch.empty(0, 64, device=DEVICE), **layer.kernel_operands()).shape == (0, 8)


def _operands(**changes):
    base = dict(x=torch.ones(2, 8, device=DEVICE), qweight=torch.zeros(3, 4, dtype=torch.uint8, device=DEVICE),
                scales=torch.ones(3, 2, device=DEVICE), fmt="int4", group_size=4, zeros=None, codebook=None)
    base.update(changes)
    return base


@pytest.mark.parametrize(
    "changes, error, words",
    [
        (dict(x=[1.0] * 8), TypeError, "x: expected a torch.Tensor"),
        (dict(x=torch.ones(2, 8, dtype=torch.int32)), TypeError, "x: expected dtype"),
        (dict(x=torch.ones(2, 8, dtype=torch.float64)), TypeError, "x: expected dtype"),
        (dict(x=torch.ones(())), ValueError, r"x: expected shape \[..., K\]"),
        (dict(fmt="int3"), ValueError, "fmt='int3'"),
        (dict(x=torch.ones(2, 7), qweight=torch.zeros(3, 3, dtype=torch.uint8)), ValueError, "x: K=7 input features must be even"),
        (dict(qweight=torch.zeros(3, 4, dtype=torch.int8)), TypeError, "qweight: expected dtype"),
        (dict(qweight=torch.zeros(3, 8, dtype=torch.uint8)), ValueError, r"qweight: expected shape \[N, 4\]"),
        (dict(qweight=torch.zeros(4, 3, dtype=torch.uint8).T), ValueError, "qweight: must be contiguous"),
        (dict(fmt="int8", qweight=torch.zeros(3, 8, dtype=torch.uint8)), TypeError, "qweight: expected dtype"),
        (dict(fmt="int8", qweight=torch.zeros(3, 4, dtype=torch.int8)), ValueError, r"qweight: expected shape \[N, 8\]"),
        (dict(group_size=0), ValueError, "group_size=0"),
        (dict(group_size=3), ValueError, r"scales: expected shape \(3, 3\)"),
        (dict(scales=torch.ones(3, 2, dtype=torch.float64)), TypeError, "scales: expected dtype"),
        (dict(zeros=torch.zeros(3, 2, dtype=torch.int32)), TypeError, "zeros: expected dtype"),
        (dict(zeros=torch.zeros(3, 1, dtype=torch.uint8)), ValueError, "zeros: expected shape"),
        (dict(fmt="nf4"), ValueError, "codebook: fmt='nf4' needs"),
        (dict(fmt="nf4", codebook=torch.ones(15)), ValueError, r"codebook: expected shape \(16,\)"),
        (dict(fmt="nf4", codebook=torch.ones(16), zeros=torch.zeros(3, 2, dtype=torch.uint8)), ValueError, "zeros: nf4 has no zero points"),
        (dict(codebook=torch.ones(16)), ValueError, "codebook: only fmt='nf4'"),
    ],
)
def test_bad_input_is_named(changes, error, words):
    moved = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in changes.items()}
    with pytest.raises(error, match=words):
        quant_matmul(**_operands(**moved))


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter's device rule")
def test_wrong_device_is_named():
    with pytest.raises(ValueError, match="x: Triton's interpreter runs on the CPU"):
        quant_matmul(**_operands(x=torch.ones(2, 8, device="meta")))


def test_bench_correctness_check_reports_small_errors():
    from labkit.bench.quant import check_correctness

    rows = check_correctness(DEVICE)
    assert {r["format"] for r in rows} == {"int4", "nf4", "int8"}
    assert all(r["max rel error"] < 1e-5 for r in rows), rows
    assert math.isclose(rows[0]["weight bytes"] / (rows[0]["N"] * rows[0]["K"]), 0.5 + 2 / 128)  # int4 + fp16 scale per 128
