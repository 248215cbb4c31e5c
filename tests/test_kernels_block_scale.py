"""The Triton block-scaled cast against labkit.block_formats.quantize_blocks and torch's casts
(interpreter on CPU, compiled on GPU): codes and scales equal bit for bit."""
import math

import pytest
import torch

import labkit
from labkit import block_formats as B
from labkit import kernels

ok, why = kernels.available()
pytestmark = pytest.mark.skipif(not ok, reason=why)
DEVICE = labkit.device()


def run_kernel(x, fmt, rounding="up"):
    f = B.get_block_format(fmt)
    return kernels.block_quantize(x, f.element, f.block, f.scale, rounding)


def assert_same_as_reference(x, fmt, rounding="up"):
    codes, scales, tensor_scale = run_kernel(x, fmt, rounding)
    q = B.quantize_blocks(x.cpu(), fmt, rounding)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and codes.device == x.device
    assert scales.dtype == torch.float32 and scales.shape == q.scales.shape
    mismatch = codes.cpu() != q.codes
    assert not mismatch.any(), f"{int(mismatch.sum())} codes differ, e.g. x = {x.cpu()[mismatch][:4].tolist()}"
    assert torch.equal(scales.cpu(), q.scales)
    if q.tensor_scale is None:
        assert tensor_scale is None
    else:
        assert tensor_scale.shape == () and tensor_scale.item() == q.tensor_scale.item()
    return codes, scales


def spread(shape, seed, dtype=torch.float32):
    """Gaussian rows whose magnitudes differ by up to 2^+-12, so blocks get very different scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-12, 12, (*shape[:-1], 1), generator=g).float())
    return x.to(dtype).to(DEVICE)


ONE_ROW = [name for name, f in B.BLOCK_FORMATS.items() if f.block[0] == 1]


@pytest.mark.parametrize("fmt", ONE_ROW)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 100), (2, 5, 77), (37, 257), (1000,)])
def test_one_row_blocks_on_ragged_shapes(fmt, dtype, shape):
    assert_same_as_reference(spread(shape, sum(shape), dtype), fmt)


@pytest.mark.parametrize("fmt", B.MX_FORMATS)
@pytest.mark.parametrize("rounding", B.ROUNDINGS)
def test_every_e8m0_rounding(fmt, rounding):
    assert_same_as_reference(spread((19, 300), 1), fmt, rounding)


@pytest.mark.parametrize("shape", [(128, 128), (300, 260), (5, 1000), (129, 1)])
def test_128x128_weight_blocks_with_ragged_edges(shape):
    assert_same_as_reference(spread(shape, 2), "deepseek_128x128")


@pytest.mark.parametrize("fmt", list(B.BLOCK_FORMATS))
def test_zero_blocks_tiny_and_huge_values(fmt):
    x = spread((4, 256), 3)
    x[0] = 0.0  # all-zero blocks: scale 1 (NVFP4: block scale 0)
    x[1, :128] *= 1e-30  # tiny blocks (E8M0's 2^-127 floor for MX)
    x[2] *= 1e30
    x[3, 5] = -0.0
    if B.get_block_format(fmt).block[0] > 1:
        x = torch.cat([x, spread((130, 256), 4)])
    assert_same_as_reference(x, fmt)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4_e2m1", "nvfp4"])
def test_masked_tails_do_not_read_past_the_tensor(fmt):
    """x is the front of a larger buffer full of huge values: a load past the end would change the
    last block's amax (the interpreter does not detect out-of-bounds accesses)."""
    buffer = torch.full((5000,), 1e30, device=DEVICE)
    buffer[:1001] = spread((1001,), 5)
    x = buffer[:1001]
    codes, scales = assert_same_as_reference(x, fmt)
    assert scales.abs().max().item() < 1e20


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2"])
def test_mxfp8_codes_equal_torch_casts(fmt):
    x = spread((64, 320), 6)
    codes, scales = assert_same_as_reference(x, fmt)
    element = B.get_block_format(fmt).element_format
    scaled = x / B.expand_scales(scales, fmt, tuple(x.shape))
    assert torch.equal(codes, scaled.to(element.torch_dtype).view(torch.uint8))


def test_nvfp4_block_scales_equal_torch_e4m3_cast():
    x = spread((16, 160), 7)
    codes, scales, tensor_scale = run_kernel(x, "nvfp4")
    raw = x.abs().reshape(16, 10, 16).amax(-1) / 6.0 / tensor_scale
    assert torch.equal(scales, raw.to(torch.float8_e4m3fn).float())


def test_empty_input():
    codes, scales, tensor_scale = run_kernel(torch.empty(3, 0, device=DEVICE), "mxfp4_e2m1")
    assert codes.shape == (3, 0) and scales.shape == (3, 0) and tensor_scale is None


def test_launcher_validates_inputs():
    x = torch.randn(4, 64, device=DEVICE)
    with pytest.raises(TypeError, match="dtype"):
        kernels.block_quantize(x.double(), "fp8_e4m3", (1, 32), "e8m0")
    with pytest.raises(ValueError, match="element"):
        kernels.block_quantize(x, "bf16", (1, 32), "e8m0")
    with pytest.raises(ValueError, match="scale"):
        kernels.block_quantize(x, "fp8_e4m3", (1, 32), "int8")
    with pytest.raises(ValueError, match="rounding"):
        kernels.block_quantize(x, "fp8_e4m3", (1, 128), "fp32", rounding="ocp")
    with pytest.raises(ValueError, match="block"):
        kernels.block_quantize(x, "fp8_e4m3", (1, 24), "e8m0")
    with pytest.raises(ValueError, match="2-D"):
        kernels.block_quantize(x.reshape(2, 2, 64), "fp8_e4m3", (128, 128), "fp32")
    with pytest.raises(ValueError, match="fp4_e2m1"):
        kernels.block_quantize(x, "fp8_e4m3", (1, 16), "e4m3+fp32")
    bad = x.clone()
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="inf or NaN"):
        kernels.block_quantize(bad, "fp8_e4m3", (1, 32), "e8m0")
