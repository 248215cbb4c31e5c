"""The Triton FP8 scaled cast against PyTorch's float8 casts (interpreter on CPU, compiled on GPU)."""
import math

import pytest
import torch

import labkit
from labkit import kernels
from labkit import precision as P

ok, why = kernels.available()
pytestmark = pytest.mark.skipif(not ok, reason=why)
if ok:
    from labkit.kernels.fp8 import fp8_dequantize_reference, fp8_quantize_reference
DEVICE = labkit.device()
FORMATS = ["fp8_e4m3", "fp8_e5m2"]


def every_bf16_value() -> torch.Tensor:
    """All 2^16 bf16 bit patterns: every sign, exponent, mantissa, ±0, subnormals, ±inf, NaNs."""
    return torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(DEVICE)


def assert_codes_match_torch(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, fmt_name: str):
    """Equal to torch's cast where |x/scale| is in range; ±max beyond it; NaN kept."""
    fmt = P.get_format(fmt_name)
    scaled = x.float() / scale
    torch_codes = scaled.to(fmt.torch_dtype).view(torch.uint8)
    nan = torch.isnan(scaled)
    in_range = scaled.abs() <= fmt.max
    mismatch = (codes != torch_codes) & in_range
    assert not mismatch.any(), f"{int(mismatch.sum())} codes differ, e.g. x/scale={scaled[mismatch][:4].tolist()}"
    values = P.decode(codes.cpu(), fmt)
    assert values[nan.cpu()].isnan().all()
    beyond = ~in_range & ~nan
    expected = torch.where(scaled[beyond] > 0, fmt.max, -fmt.max).double().cpu()
    assert torch.equal(values[beyond.cpu()], expected)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 2.0**-12, 37.5])
def test_every_bf16_value_matches_torch_cast(fmt, scale):
    x = every_bf16_value()
    codes, used = kernels.fp8_quantize(x, fmt, scale=scale)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and used.item() == scale
    assert_codes_match_torch(x, codes, used, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_fp32_with_amax_scale(fmt):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 1000, 77, generator=g) * torch.exp2(torch.randint(-20, 20, (3, 1, 77), generator=g).float())).to(DEVICE)
    x[0, 0, :4] = torch.tensor([math.nan, math.inf, -math.inf, -0.0])
    codes, scale = kernels.fp8_quantize(x, fmt)
    assert scale.item() == torch.tensor(P.amax_scale(x.cpu(), fmt), dtype=torch.float32).item()
    assert_codes_match_torch(x, codes, scale, fmt)
    ref_codes, ref_scale = fp8_quantize_reference(x, fmt)
    finite = torch.isfinite(x)
    assert torch.equal(codes[finite], ref_codes[finite]) and ref_scale.item() == scale.item()
    torch_codes, torch_scale = P.fp8_quantize_torch(x, fmt)  # the fallback for machines without Triton
    assert torch.equal(torch_codes, codes) and torch_scale.item() == scale.item()
    assert P.decode(codes.cpu(), fmt).abs().nan_to_num(0).max().item() == P.get_format(fmt).max  # amax -> max


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ties_and_ragged_sizes(fmt, dtype):
    """Exact midpoints between neighbouring FP8 values (round half to even), at a size that is
    not a multiple of the block, in every input dtype."""
    values = P.all_values(fmt)
    values = values[torch.isfinite(values)].unique()
    ties = ((values[1:] + values[:-1]) / 2).to(dtype)
    keep = ties.double() == (values[1:] + values[:-1]) / 2  # ties exactly representable in dtype
    x = torch.cat([ties[keep], values.to(dtype)]).to(DEVICE)
    x = x.repeat(7)[: 16384 + 1001]
    codes, scale = kernels.fp8_quantize(x, fmt, scale=1.0)
    assert_codes_match_torch(x, codes, scale, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_every_code(fmt):
    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    got = kernels.fp8_dequantize(codes, 0.25, fmt)
    expected = fp8_dequantize_reference(codes, 0.25, fmt)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got.double().cpu(), P.decode(codes.cpu(), fmt) * 0.25, rtol=0, atol=0, equal_nan=True)


def test_round_trip_error_is_at_most_half_an_ulp():
    x = torch.randn(4097, device=DEVICE)
    codes, scale = kernels.fp8_quantize(x)
    restored = kernels.fp8_dequantize(codes, scale)
    bound = P.ulp((x / scale).cpu(), "fp8_e4m3").float().to(DEVICE) / 2 * scale
    assert ((restored - x).abs() <= bound * (1 + 1e-6)).all()


def test_non_contiguous_and_empty_inputs():
    x = torch.randn(64, 33, device=DEVICE).T  # non-contiguous view
    codes, scale = kernels.fp8_quantize(x)
    ref, ref_scale = fp8_quantize_reference(x)
    assert codes.shape == x.shape and torch.equal(codes, ref) and scale.item() == ref_scale.item()
    empty_codes, empty_scale = kernels.fp8_quantize(torch.empty(0, 4, device=DEVICE))
    assert empty_codes.shape == (0, 4) and empty_scale.item() == 1.0
    assert kernels.fp8_dequantize(empty_codes, 1.0).shape == (0, 4)
    zeros_codes, zeros_scale = kernels.fp8_quantize(torch.zeros(5, device=DEVICE))
    assert zeros_scale.item() == 1.0 and (zeros_codes == 0).all()


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(8, device=DEVICE)
    with pytest.raises(TypeError, match="x: expected dtype"):
        kernels.fp8_quantize(x.double())
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        kernels.fp8_quantize([1.0, 2.0])
    with pytest.raises(ValueError, match="fmt="):
        kernels.fp8_quantize(x, "fp16")
    with pytest.raises(ValueError, match="scale="):
        kernels.fp8_quantize(x, scale=0.0)
    with pytest.raises(ValueError, match="scale: expected a single number"):
        kernels.fp8_quantize(x, scale=torch.ones(2))
    with pytest.raises(TypeError, match="codes: expected dtype"):
        kernels.fp8_dequantize(x, 1.0)
