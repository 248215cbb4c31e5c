"""Block-scaled formats (labkit.block_formats) against the OCP MX v1.0 tables, torch's casts and
closed forms."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit  # noqa: F401
from labkit import block_formats as B
from labkit import precision as P

MX = list(B.MX_FORMATS)


# ----------------------------------------------------------------------------- spec tables
# OCP MX v1.0, §5.3 (element data types): exponent bias, emax, max normal, min normal, min subnormal.
OCP_ELEMENTS = {
    "mxfp8_e4m3": (7, 8, 448.0, 2.0**-6, 2.0**-9),
    "mxfp8_e5m2": (15, 15, 57344.0, 2.0**-14, 2.0**-16),
    "mxfp6_e3m2": (3, 4, 28.0, 0.25, 0.0625),
    "mxfp6_e2m3": (1, 2, 7.5, 1.0, 0.125),
    "mxfp4_e2m1": (1, 2, 6.0, 1.0, 0.5),
}


@pytest.mark.parametrize("name", MX)
def test_mx_element_formats_match_the_ocp_table(name):
    bias, emax, max_normal, min_normal, min_subnormal = OCP_ELEMENTS[name]
    fmt = B.get_block_format(name)
    element = fmt.element_format
    assert (element.bias, B.element_emax(element), element.max, element.min_normal, element.min_subnormal) == \
        (bias, emax, max_normal, min_normal, min_subnormal)
    assert fmt.block == (1, 32) and fmt.scale == "e8m0" and fmt.scale_bits == 8


def test_e2m1_has_exactly_the_eight_magnitudes_of_the_spec():
    values = P.all_values("fp4_e2m1")
    assert sorted(set(values.abs().tolist())) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert not values.isnan().any() and torch.isfinite(values).all()  # E2M1 has no inf or NaN


def test_fp6_elements_have_no_specials_and_the_right_max():
    for name, top in [("fp6_e3m2", 28.0), ("fp6_e2m3", 7.5)]:
        values = P.all_values(name)
        assert torch.isfinite(values).all() and values.max().item() == top and values.numel() == 64


def test_nvfp4_and_deepseek_specs():
    nv = B.get_block_format("nvfp4")
    assert (nv.element, nv.block, nv.scale, nv.scale_bits, nv.tensor_scale_bits) == ("fp4_e2m1", (1, 16), "e4m3+fp32", 8, 32)
    assert B.NVFP4_TENSOR_RANGE == 6 * 448
    assert B.get_block_format("deepseek_1x128").block == (1, 128)
    assert B.get_block_format("deepseek_128x128").block == (128, 128)


def test_bits_per_value():
    assert B.bits_per_value("mxfp4_e2m1") == 4.25
    assert B.bits_per_value("nvfp4") == 4.5
    assert B.bits_per_value("mxfp8_e4m3") == B.bits_per_value("mxfp8_e5m2") == 8.25
    assert B.bits_per_value("mxfp6_e2m3") == 6.25
    assert B.bits_per_value("deepseek_1x128") == 8 + 32 / 128
    assert B.bits_per_value("deepseek_128x128") == 8 + 32 / 128**2
    for ours, chapters in [("mxfp8_e4m3", "mxfp8"), ("mxfp6_e2m3", "mxfp6"), ("mxfp4_e2m1", "mxfp4"), ("nvfp4", "nvfp4")]:
        assert B.bits_per_value(ours) == P.BLOCK_SCALINGS[chapters].bits_per_value
    # one tensor: a started block pays a whole scale, NVFP4's tensor scale is spread over the tensor
    assert B.bits_per_value("nvfp4", (1, 16)) == 4 + 8 / 16 + 32 / 16
    assert B.bits_per_value("mxfp4_e2m1", (3, 33)) == (99 * 4 + 3 * 2 * 8) / 99
    assert B.bits_per_value("deepseek_128x128", (129, 128)) == (129 * 128 * 8 + 2 * 32) / (129 * 128)
    assert 8 * P.storage_bytes(2**20, "nvfp4") == B.bits_per_value("nvfp4", (2**20,)) * 2**20
    with pytest.raises(ValueError, match="shape"):
        B.bits_per_value("nvfp4", (0, 4))
    with pytest.raises(ValueError, match="2-D"):
        B.bits_per_value("deepseek_128x128", (4, 128, 128))


# ----------------------------------------------------------------------------- E8M0
def test_e8m0_decode_matches_torch_for_every_code():
    codes = torch.arange(256)
    ours = B.e8m0_decode(codes)
    theirs = codes.to(torch.uint8).view(torch.float8_e8m0fnu).double()
    assert torch.equal(ours[:255], theirs[:255]) and ours[255].isnan() and theirs[255].isnan()
    assert ours[0].item() == 2.0**-127 and ours[254].item() == 2.0**127 and ours[127].item() == 1.0


def test_e8m0_encode_round_trips_and_matches_torch_cast():
    powers = torch.ldexp(torch.ones(255, dtype=torch.float64), torch.arange(-127, 128).double())
    codes = B.e8m0_encode(powers)
    assert torch.equal(codes, torch.arange(255, dtype=torch.uint8))
    assert torch.equal(powers.float().to(torch.float8_e8m0fnu).view(torch.uint8), codes)
    assert B.e8m0_encode(torch.tensor([math.nan])).item() == B.E8M0_NAN
    for bad in [0.0, 3.0, -1.0, 2.0**-128, 2.0**128, math.inf]:
        with pytest.raises(ValueError, match="powers of two"):
            B.e8m0_encode(torch.tensor([bad], dtype=torch.float64))


def log2_scale(amax: float, fmt: str, rounding: str) -> float:
    """The three roundings written with float64 logarithms (fine away from exact powers of two)."""
    element = B.get_block_format(fmt).element_format
    exponent = {"up": math.ceil(math.log2(amax / element.max)), "ocp": math.floor(math.log2(amax)) - B.element_emax(element),
                "down": math.floor(math.log2(amax / element.max))}[rounding]
    return 2.0 ** min(max(exponent, -127), 127)


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("rounding", B.ROUNDINGS)
def test_e8m0_scale_against_logarithms(fmt, rounding):
    g = torch.Generator().manual_seed(1)
    amax = torch.exp2(torch.empty(2000, dtype=torch.float64).uniform_(-100, 100, generator=g)).float()
    ours = B.e8m0_scale(amax, fmt, rounding)
    assert ours.dtype == torch.float32 and ours.shape == amax.shape
    expected = torch.tensor([log2_scale(a, fmt, rounding) for a in amax.double().tolist()], dtype=torch.float32)
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("fmt", MX)
def test_e8m0_roundings_put_amax_where_they_promise(fmt):
    element = B.get_block_format(fmt).element_format
    g = torch.Generator().manual_seed(2)
    amax = torch.exp2(torch.empty(5000).uniform_(-60, 60, generator=g))
    amax = torch.cat([amax, element.max * torch.exp2(torch.arange(-20, 21).float())])  # exact boundaries
    ratio = {r: amax.double() / B.e8m0_scale(amax, fmt, r).double() for r in B.ROUNDINGS}
    assert (ratio["up"] <= element.max).all() and (ratio["up"] > element.max / 2).all()  # never clips
    emax = B.element_emax(element)
    assert (ratio["ocp"] >= 2.0**emax).all() and (ratio["ocp"] < 2.0 ** (emax + 1)).all()  # amax in the top binade
    assert (ratio["down"] >= element.max).all() and (ratio["down"] < 2 * element.max).all()  # clips unless exact
    exact = amax[-41:]
    for r in B.ROUNDINGS:  # amax = max * 2^j: every rounding gives 2^j
        assert torch.equal(B.e8m0_scale(exact, fmt, r), exact / element.max)


@pytest.mark.parametrize("fmt", MX)
def test_e8m0_exponent_is_exact_one_float_either_side_of_every_boundary(fmt):
    """amax = max * 2^k and its float32 neighbours: the exponent is ceil(log2(amax / max)) of the real ratio
    (math.log2 of the float64 ratio gets these right; fp32's log2 does not), clamped to -127..127."""
    element = B.get_block_format(fmt).element_format
    k = torch.arange(-150, 128, dtype=torch.float64)
    boundary = (element.max * torch.exp2(k)).float()
    boundary = boundary[torch.isfinite(boundary) & (boundary > 0)]
    amax = torch.cat([boundary, torch.nextafter(boundary, torch.tensor(math.inf)), torch.nextafter(boundary, torch.tensor(0.0))])
    amax = torch.cat([amax[torch.isfinite(amax)], torch.tensor([0.0])])
    ours = B.e8m0_exponent(amax, fmt)
    assert ours.dtype == torch.int32 and ours.shape == amax.shape
    expected = [min(max(math.ceil(math.log2(a / element.max)), -127), 127) if a > 0 else 0 for a in amax.double().tolist()]
    assert ours.tolist() == expected
    assert torch.equal(B.e8m0_scale(amax, fmt), torch.exp2(ours.double()).float())
    fp32_log = torch.ceil(torch.log2(amax / element.max)).clamp(-127, 127)
    assert (fp32_log[amax > 0] != ours[amax > 0]).sum() > 100  # why the exponent is computed from the bits


def test_e8m0_scale_edge_cases():
    scale = B.e8m0_scale(torch.tensor([0.0, 1e-40, 3e38, 6.0, 6.5]), "mxfp4_e2m1")
    assert scale.tolist() == [1.0, 2.0**-127, 2.0**126, 1.0, 2.0]  # zero -> 1, clamp at 2^-127
    assert B.e8m0_scale(6.5, "fp4_e2m1", "ocp").item() == 1.0  # an element format name works too
    with pytest.raises(ValueError, match="rounding"):
        B.e8m0_scale(torch.ones(2), "mxfp4_e2m1", "nearest")
    with pytest.raises(ValueError, match="non-negative"):
        B.e8m0_scale(torch.tensor([-1.0]), "mxfp4_e2m1")
    with pytest.raises(ValueError, match="fmt"):
        B.e8m0_scale(torch.ones(2), "mxfp5")


# ----------------------------------------------------------------------------- quantize / dequantize
def on_grid_blocks(fmt: str, blocks: int, generator) -> torch.Tensor:
    """Rows of MX blocks whose values are element values times a power of two, each block holding
    the element max: they must round-trip exactly."""
    element = B.get_block_format(fmt).element_format
    values = P.all_values(element)
    values = values[torch.isfinite(values)]
    picks = values[torch.randint(0, values.numel(), (blocks, 32), generator=generator)]
    picks[:, 0] = element.max * torch.where(torch.rand(blocks, generator=generator) < 0.5, -1.0, 1.0)
    powers = torch.exp2(torch.randint(-30, 30, (blocks, 1), generator=generator).double())
    return (picks * powers).float().reshape(-1, 64)


@pytest.mark.parametrize("fmt", MX)
def test_values_on_the_grid_round_trip_exactly(fmt):
    x = on_grid_blocks(fmt, 40, torch.Generator().manual_seed(3))
    q = B.quantize_blocks(x, fmt)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == x.shape and q.scales.shape == (20, 2)
    assert torch.equal(B.dequantize_blocks(q), x.double())


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp8_codes_equal_torch_float8_casts(fmt, dtype):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(7, 3, 96, generator=g) * torch.exp2(torch.randint(-8, 8, (7, 3, 1), generator=g).float())).to(dtype)
    q = B.quantize_blocks(x, fmt)
    scaled = x.float() / B.expand_scales(q.scales, fmt, tuple(x.shape))
    assert scaled.abs().max().item() <= q.fmt.element_format.max  # rounded up: torch's cast never overflows here
    assert torch.equal(q.codes, scaled.to(q.fmt.element_format.torch_dtype).view(torch.uint8))


def test_nvfp4_scales_against_torch_and_the_recipe():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 160, generator=g) * torch.exp2(torch.randint(-6, 6, (64, 1), generator=g).float())
    x[3, 16:32] = 0  # an all-zero block
    q = B.quantize_blocks(x, "nvfp4")
    amax = x.abs().reshape(64, 10, 16).amax(-1)
    tensor_scale = (x.abs().max() / 2688.0).float()
    assert q.tensor_scale.item() == tensor_scale.item()
    raw = amax / 6.0 / tensor_scale
    assert torch.equal(q.scales, raw.to(torch.float8_e4m3fn).float())  # block scales: torch's E4M3 cast
    assert torch.equal(q.scale_codes, raw.to(torch.float8_e4m3fn).view(torch.uint8))
    assert q.scales[3, 1].item() == 0 and (q.codes[3, 16:32] == 0).all()
    restored = B.dequantize_blocks(q)
    assert (restored.abs().amax() - x.abs().max()).abs().item() <= 0.07 * x.abs().max().item()  # max maps near 6 * 448 * t


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_deepseek_scaling_equals_chapter_fake_quantize(block):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(256, 384, generator=g) * torch.exp2(torch.randint(-10, 10, (256, 1), generator=g).float())
    name = "deepseek_1x128" if block == (1, 128) else "deepseek_128x128"
    q = B.quantize_blocks(x, name)
    assert q.scales.shape == ((256, 3) if block == (1, 128) else (2, 3))
    assert torch.equal(B.dequantize_blocks(q), P.fake_quantize(x, "fp8_e4m3", block))


@pytest.mark.parametrize("fmt", list(B.BLOCK_FORMATS))
def test_round_trip_error_is_half_an_element_ulp(fmt):
    """Every element lands within half a step of its format's grid, relative to its block scale."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(130, 200, generator=g) * torch.exp2(torch.randint(-12, 12, (130, 1), generator=g).float())
    q = B.quantize_blocks(x, fmt)
    f = q.fmt
    divisor = B.expand_scales(q.scales.double(), f, tuple(x.shape)) * (q.tensor_scale.double() if q.tensor_scale is not None else 1.0)
    scaled = x.double() / divisor
    in_range = scaled.abs() <= f.element_format.max
    error = (B.dequantize_blocks(q) - x.double()).abs() / divisor
    assert (error[in_range] <= P.ulp(scaled[in_range], f.element_format) / 2 + 1e-12).all()


def test_per_block_beats_per_tensor_on_outliers():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(128, 512, generator=g)
    x.view(-1)[torch.randperm(x.numel(), generator=g)[:16]] = 1e5
    ordinary = x.abs() < 100
    per_tensor = B.quantization_error(x, "fp8_e4m3", where=ordinary)
    per_block = B.quantization_error(x, "mxfp8_e4m3", where=ordinary)
    assert per_tensor["flushed"] > 0.05 and per_block["flushed"] < 16 * 32 / x.numel()  # only the outliers' blocks
    assert per_block["rel_error_where"] < per_tensor["rel_error_where"] / 1.5


def test_clipping_by_rounding():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(9))
    clipped = {r: B.clipped_fraction(x, "mxfp4_e2m1", r) for r in B.ROUNDINGS}
    assert clipped["up"] == 0 < clipped["ocp"] < clipped["down"]


def test_mx_quantize_returns_element_values_and_scales():
    x = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(10)).bfloat16()
    values, scales = B.mx_quantize(x, "mxfp6_e2m3")
    assert values.dtype == scales.dtype == torch.float32 and values.shape == x.shape and scales.shape == (3, 4, 2)
    q = B.quantize_blocks(x, "mxfp6_e2m3")
    assert torch.equal((values.double() * B.expand_scales(scales.double(), "mxfp6_e2m3", tuple(x.shape))), B.dequantize_blocks(q))
    with pytest.raises(ValueError, match="MX format"):
        B.mx_quantize(x, "nvfp4")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=100), st.sampled_from(list(B.BLOCK_FORMATS)[:7]))
def test_quantize_blocks_any_values(values, fmt):
    x = torch.tensor(values, dtype=torch.float32)
    q = B.quantize_blocks(x, fmt)
    restored = B.dequantize_blocks(q)
    assert restored.shape == x.shape and torch.isfinite(restored).all()
    # nothing grows past amax by more than half an element step (and NVFP4's E4M3 scale rounding)
    growth = (1 + q.fmt.element_format.eps / 2) * (1 + 2.0**-4 if fmt == "nvfp4" else 1)
    assert (restored.abs() <= x.abs().max().double() * growth).all()
    assert torch.equal(restored.sign(), torch.where(restored == 0, 0.0, x.double().sign()))


def test_input_validation():
    with pytest.raises(ValueError, match="inf or NaN"):
        B.quantize_blocks(torch.tensor([1.0, math.inf]), "mxfp4_e2m1")
    with pytest.raises(TypeError, match="fp32/fp16/bf16"):
        B.quantize_blocks(torch.arange(4), "mxfp4_e2m1")
    with pytest.raises(ValueError, match="at least one dimension"):
        B.quantize_blocks(torch.tensor(1.0), "mxfp4_e2m1")
    with pytest.raises(ValueError, match="2-D"):
        B.quantize_blocks(torch.ones(2, 128, 128), "deepseek_128x128")
    with pytest.raises(ValueError, match="only E8M0"):
        B.quantize_blocks(torch.ones(16), "nvfp4", rounding="ocp")
    with pytest.raises(ValueError, match="fmt"):
        B.get_block_format("mxint8")
    with pytest.raises(ValueError, match="powers of two"):
        B.BlockFormat("odd", "fp8_e4m3", (1, 24), "e8m0")
    with pytest.raises(TypeError, match="BlockQuantized"):
        B.dequantize_blocks(torch.ones(3))


# ----------------------------------------------------------------------------- torch's own MX / NVFP4 support
def test_torch_float4_e2m1_matches_our_decode_where_torch_can_convert():
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2 dtype")
    packed = torch.arange(256, dtype=torch.uint8)  # every pair of E2M1 codes, low nibble first
    try:
        theirs = packed.view(torch.float4_e2m1fn_x2).to(torch.float32)
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"torch {torch.__version__} has float4_e2m1fn_x2 but cannot convert it here: {str(err)[:80]}")
    low, high = P.decode(packed.long() & 0xF, "fp4_e2m1"), P.decode(packed.long() >> 4, "fp4_e2m1")
    assert torch.equal(theirs.double().reshape(-1), torch.stack([low, high], -1).reshape(-1))


def test_torch_scaled_mm_block_modes_where_available():
    F = torch.nn.functional
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        pytest.skip("this torch has no torch.nn.functional.scaled_mm with scaling recipes")
    device = labkit.device()
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(128, 256, generator=g), torch.randn(128, 256, generator=g)  # b as [N, K]
    qa, qb = B.quantize_blocks(a, "mxfp8_e4m3"), B.quantize_blocks(b, "mxfp8_e4m3")
    try:
        out = F.scaled_mm(qa.codes.to(device).view(torch.float8_e4m3fn), qb.codes.to(device).view(torch.float8_e4m3fn).t(),
                          qa.scales.to(device).to(torch.float8_e8m0fnu), F.ScalingType.BlockWise1x32,
                          qb.scales.to(device).to(torch.float8_e8m0fnu), F.ScalingType.BlockWise1x32,
                          swizzle_a=F.SwizzleType.NO_SWIZZLE, swizzle_b=F.SwizzleType.NO_SWIZZLE, output_dtype=torch.float32)
    except (RuntimeError, ValueError, NotImplementedError) as err:
        pytest.skip(f"scaled_mm BlockWise1x32 is not available on {device}: {str(err).splitlines()[0][:100]}")
    expected = B.dequantize_blocks(qa) @ B.dequantize_blocks(qb).t()
    assert torch.allclose(out.double().cpu(), expected.cpu(), rtol=1e-4, atol=1e-3)


# ----------------------------------------------------------------------------- accumulation
def fp8_operands(m: int, k: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (P.round_to(torch.randn(m, k, generator=g), "fp8_e4m3").float(),
            P.round_to(torch.randn(k, n, generator=g), "fp8_e4m3").float())


def test_23_mantissa_bits_is_a_sequential_fp32_sum():
    a, b = fp8_operands(4, 300, 5, 12)
    ours = B.simulated_accumulation(a, b, 23)
    total = torch.zeros(4, 5)
    for k in range(300):
        total = total + torch.outer(a[:, k], b[k])  # FP8 products are exact in fp32
    assert torch.equal(ours, total.double())


def test_promotion_adds_fp32_partial_sums():
    a, b = fp8_operands(3, 256, 4, 13)
    ours = B.simulated_accumulation(a, b, 10, promote_every=128)
    chunks = [B.simulated_accumulation(a[:, i:i + 128], b[i:i + 128], 10) for i in (0, 128)]
    assert torch.equal(ours, (chunks[0].float() + chunks[1].float()).double())


def test_promotion_stops_the_error_growing_with_k():
    a, b = fp8_operands(16, 2048, 16, 14)
    ks = [128, 2048]
    plain = B.accumulation_errors(a, b, 13, None, ks)
    promoted = B.accumulation_errors(a, b, 13, 128, ks)
    assert plain[0] == promoted[0]  # identical before the first promotion
    assert plain[1] > 2.5 * plain[0]  # a random walk: about sqrt(16) = 4 times
    assert promoted[1] < 1.6 * promoted[0]
    with pytest.raises(ValueError, match="mantissa_bits"):
        B.accumulation_errors(a, b, 0, None, ks)
    with pytest.raises(ValueError, match="ks"):
        B.accumulation_errors(a, b, 13, None, [4096])


# ----------------------------------------------------------------------------- random Hadamard transform
@pytest.mark.parametrize("n", [1, 2, 4, 16, 64])
def test_hadamard_matrix_is_sylvesters_and_orthogonal(n):
    from scipy.linalg import hadamard

    h = B.hadamard_matrix(n)
    assert torch.equal(h, torch.tensor(hadamard(n), dtype=torch.float64))
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))


def test_random_hadamard_is_orthogonal_with_random_signs():
    g = torch.Generator().manual_seed(0)
    r = B.random_hadamard(16, g)
    torch.testing.assert_close(r @ r.T, torch.eye(16, dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.equal(r.abs(), torch.full((16, 16), 0.25, dtype=torch.float64))
    signs = (r / B.hadamard_matrix(16) * 4)[:, 0]  # one sign per row of H
    assert torch.equal(signs[:, None] * B.hadamard_matrix(16) / 4, r)
    assert set(signs.tolist()) == {-1.0, 1.0}
    assert not torch.equal(r, B.random_hadamard(16, g))  # another draw, other signs


def test_hadamard_transform_has_an_exact_inverse_and_keeps_a_gemm_exact():
    g = torch.Generator().manual_seed(1)
    r = B.random_hadamard(16, g)
    x = torch.randn(3, 5, 64, generator=g)
    y = B.hadamard_transform(x, r)
    torch.testing.assert_close(B.hadamard_transform(y, r, inverse=True), x.double(), rtol=0, atol=1e-14)
    torch.testing.assert_close(y.norm(), x.double().norm(), rtol=1e-14, atol=0)  # orthogonal: lengths kept
    blocks = x.double().reshape(3, 5, 4, 16)
    torch.testing.assert_close(y, (blocks @ r).reshape(x.shape), rtol=0, atol=1e-14)
    a, b = torch.randn(8, 64, generator=g), torch.randn(64, 4, generator=g)
    torch.testing.assert_close(B.hadamard_transform(a, r) @ B.hadamard_transform(b.t(), r).t(), a.double() @ b.double(), rtol=1e-12, atol=1e-12)
    # a lone spike is spread over its block at 1/4 of its size
    spike = torch.zeros(16)
    spike[3] = 100.0
    assert torch.equal(B.hadamard_transform(spike, r).abs(), torch.full((16,), 25.0, dtype=torch.float64))


def test_quantized_matmul_quantizes_rotated_operands_along_k():
    g = torch.Generator().manual_seed(2)
    r = B.random_hadamard(16, g)
    a, b = torch.randn(4, 32, generator=g), torch.randn(32, 6, generator=g)

    def stored(t):
        return B.dequantize_blocks(B.quantize_blocks(t, "nvfp4"))

    assert torch.equal(B.quantized_matmul(a, b, "nvfp4"), stored(a) @ stored(b.t()).t())
    rotated = stored(B.hadamard_transform(a, r).float()) @ stored(B.hadamard_transform(b.t(), r).float()).t()
    assert torch.equal(B.quantized_matmul(a, b, "nvfp4", r), rotated)
    assert P.relative_error(rotated, a.double() @ b.double()) < 0.3


def test_hadamard_bad_input_is_named():
    with pytest.raises(ValueError, match="n=12"):
        B.hadamard_matrix(12)
    with pytest.raises(ValueError, match="matrix"):
        B.hadamard_transform(torch.ones(16), torch.ones(4, 8))
    with pytest.raises(ValueError, match="x"):
        B.hadamard_transform(torch.ones(10), B.random_hadamard(16))
    with pytest.raises(ValueError, match="a, b"):
        B.quantized_matmul(torch.ones(4, 16), torch.ones(8, 4), "nvfp4")


@pytest.mark.parametrize("n", [0, -4, 12])
def test_random_hadamard_names_a_bad_size(n):
    with pytest.raises(ValueError, match="n="):
        B.random_hadamard(n)
