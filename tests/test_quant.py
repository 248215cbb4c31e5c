"""labkit.quant: uniform quantizers against their error bound and torch's own quantize ops, NF4 against
bitsandbytes' published table, bit packing exhaustively, LLM.int8(), GPTQ on the shipped adder's real
activations, QuantLinear and quantize_model."""
import labkit  # noqa: F401  (first: switches Triton to its interpreter on CPU)

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit import quant as Q
from labkit.nn import Linear
from labkit.pretrained import adder_task, load_tiny_adder

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# bitsandbytes.functional's NF4 table (the values its CUDA kernels hard-code), as published.
BITSANDBYTES_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
]


@pytest.fixture(scope="module")
def adder():
    model, _ = load_tiny_adder()
    task = adder_task()
    calibration = Q.calibration_tokens(task, num_sequences=64, context_length=32)
    return model, task, calibration


@pytest.fixture(scope="module")
def adder_activations(adder):
    model, _, calibration = adder
    return Q.capture_linear_inputs(model, calibration)


def torch_quantize_ops():
    """torch.quantize_per_* warn that they are deprecated; the tests use them only as a reference."""
    return warnings.catch_warnings(action="ignore", category=UserWarning)


# ----------------------------------------------------------------------------- error bound
def per_value_scale(q: Q.QuantizedTensor) -> torch.Tensor:
    """The scale that applies to each value of the original tensor."""
    if q.granularity == "tensor":
        return q.scale.expand(q.shape)
    moved = q.scale.movedim(q.axis, -1)
    return moved.repeat_interleave(q.shape[q.axis] // moved.shape[-1], dim=-1).movedim(-1, q.axis)


def assert_within_half_a_step(x: torch.Tensor, q: Q.QuantizedTensor):
    x64 = x.double()
    error = (x64 - Q.dequantize(q, torch.float32).double()).abs()
    # half a step, plus fp32 rounding: x * (1/scale) is off by ~2 ulps of a code (< 2^-16 steps),
    # and scale * (q - z) by 1 ulp of the result
    bound = per_value_scale(q).double() * (0.5 + 2**-14) + 2**-23 * x64.abs()
    worst = (error - bound).argmax()
    value, err, limit = (t.flatten()[worst].item() for t in (x64, error, bound))
    assert (error <= bound).all(), f"x={value} has error {err} > {limit}"


@st.composite
def quantize_cases(draw):
    """(x, bits, symmetric, granularity, group_size, axis): shapes, dtypes and values including
    exact ties, huge and subnormal magnitudes, all-zero and constant slices."""
    shape = tuple(draw(st.lists(st.integers(1, 8), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    bits = draw(st.integers(2, 8))
    symmetric = draw(st.booleans())
    granularity = draw(st.sampled_from(Q.GRANULARITIES))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    group_size = None
    if granularity == "group":
        size = shape[axis]
        group_size = draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
    kind = draw(st.sampled_from(["normal", "ties", "extreme", "constant", "zeros"]))
    n = math.prod(shape)
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    finfo = torch.finfo(dtype)
    if kind == "normal":
        x = torch.randn(n, generator=gen) * 10.0 ** draw(st.integers(-3, 3))
    elif kind == "ties":
        # odd multiples of half a step: with absmax at qmax steps, scale is exactly the step
        qmax = 2 ** (bits - 1) - 1
        step = 2.0 ** draw(st.integers(-8, 4))
        x = (torch.randint(-qmax, qmax, (n,), generator=gen) + 0.5) * step
        x[0] = qmax * step
    elif kind == "extreme":
        magnitude = draw(st.sampled_from([finfo.max / 2, finfo.max, finfo.tiny, finfo.tiny * 2**-4]))
        x = torch.randn(n, generator=gen).sign() * magnitude * torch.rand(n, generator=gen)
        x[0] = magnitude
    elif kind == "constant":
        x = torch.full((n,), draw(st.floats(-1e3, 1e3, allow_nan=False, width=16)))
    else:
        x = torch.zeros(n)
    return x.reshape(shape).to(dtype), bits, symmetric, granularity, group_size, axis


@settings(max_examples=150, deadline=None)
@given(quantize_cases())
def test_every_value_is_within_half_a_step(case):
    x, bits, symmetric, granularity, group_size, axis = case
    q = Q.quantize(x, bits, symmetric, granularity, group_size, axis)
    qmin, qmax = Q.code_range(bits, symmetric)
    assert q.codes.shape == x.shape and q.codes.dtype == (torch.int8 if symmetric else torch.uint8)
    assert int(q.codes.min()) >= qmin and int(q.codes.max()) <= qmax
    assert (q.scale > 0).all() and torch.isfinite(q.scale).all()
    assert_within_half_a_step(x, q)
    out = Q.dequantize(q)
    assert out.dtype == x.dtype and out.shape == x.shape


@pytest.mark.parametrize("symmetric", [True, False])
def test_zero_is_exact_and_zero_rows_do_not_divide_by_zero(symmetric):
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.3, 0.0, -1.7, 2.2], [5.0, 5.0, 5.0, 5.0], [-2.0, -1.0, -3.0, 0.0]])
    q = Q.quantize(x, 3, symmetric, "channel")
    out = Q.dequantize(q)
    assert torch.equal(out[x == 0], torch.zeros(int((x == 0).sum())))
    assert torch.equal(out[0], torch.zeros(4)) and q.scale[0].item() == 1.0
    assert torch.allclose(out[2], x[2])  # a constant row: the range [0, 5] puts 5 on the grid's end


def test_ties_round_half_to_even():
    q = Q.quantize(torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5]), 8)  # scale exactly 1
    assert q.scale.item() == 1.0
    assert q.codes.tolist() == [127, 0, 2, 2, 0, -2, -2]


def test_symmetric_grid_mirrors_and_skips_the_most_negative_code():
    x = torch.linspace(-3, 3, 101)
    q = Q.quantize(x, 4)
    assert torch.equal(Q.quantize(-x, 4).codes, -q.codes)
    assert q.codes.min() == -7 and q.codes.max() == 7  # -8 is never produced
    assert len(q.levels()) == 15 and len(Q.quantize(x, 4, symmetric=False).levels()) == 16


def test_group_and_channel_layouts():
    x = torch.randn(6, 3, 8)
    q = Q.quantize(x, 4, granularity="group", group_size=4, axis=-1)
    assert q.scale.shape == (6, 3, 2)
    expected = x.abs().reshape(6, 3, 2, 4).amax(-1) / 7
    torch.testing.assert_close(q.scale, expected)
    q = Q.quantize(x, 4, symmetric=False, granularity="channel", axis=0)
    assert q.scale.shape == (1, 3, 8) and q.zero_point.shape == (1, 3, 8)
    assert Q.quantize(x, 4).scale.shape == ()


# ----------------------------------------------------------------------------- torch's quantize ops
@pytest.mark.parametrize("symmetric", [True, False])
def test_8bit_codes_equal_torch_quantize_per_tensor(symmetric):
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(1)) * 3 + (0 if symmetric else 1.0)
    q = Q.quantize(x, 8, symmetric)
    zero = 0 if symmetric else int(q.zero_point)
    with torch_quantize_ops():
        theirs = torch.quantize_per_tensor(x, q.scale.item(), zero, torch.qint8 if symmetric else torch.quint8)
    assert torch.equal(theirs.int_repr(), q.codes)
    assert torch.equal(theirs.dequantize(), Q.dequantize(q))


@pytest.mark.parametrize("symmetric", [True, False])
def test_8bit_codes_equal_torch_quantize_per_channel(symmetric):
    weight = torch.randn(48, 80, generator=torch.Generator().manual_seed(2)) * torch.rand(48, 1) * 4
    q = Q.quantize(weight, 8, symmetric, "channel", axis=-1)  # statistics over d_in: one scale per output row
    zero = torch.zeros(48, dtype=torch.long) if symmetric else q.zero_point[:, 0].long()
    with torch_quantize_ops():
        # torch names the axis that *keeps* one scale per index: the rows
        theirs = torch.quantize_per_channel(weight, q.scale[:, 0].double(), zero, 0, torch.qint8 if symmetric else torch.quint8)
    assert torch.equal(theirs.int_repr(), q.codes)
    assert torch.equal(theirs.dequantize(), Q.dequantize(q))


# ----------------------------------------------------------------------------- error measures
def test_sqnr_gains_6_02_db_per_bit_on_uniform_data():
    x = torch.rand(200_000, generator=torch.Generator().manual_seed(0)) * 2 - 1
    for bits in range(2, 9):
        measured = Q.quantization_error(x, Q.quantize(x, bits, symmetric=False))["sqnr_db"]
        # uniform data, 2^b - 1 steps over its range: SQNR = 20 log10(2^b - 1) = 6.02 b + 20 log10(1 - 2^-b);
        # measured within 0.025 dB over several seeds
        assert abs(measured - 20 * math.log10(2**bits - 1)) < 0.1, bits
        if bits >= 6:
            assert abs(measured - 6.02 * bits) < 0.2, bits


def test_quantization_error_numbers():
    x = torch.tensor([1.0, -2.0, 3.0, 0.0])
    err = Q.quantization_error(x, torch.tensor([1.0, -2.0, 2.0, 0.5]))
    assert err["mse"] == pytest.approx(1.25 / 4) and err["max_abs_error"] == 1.0
    assert err["sqnr_db"] == pytest.approx(10 * math.log10(14 / 1.25))
    assert Q.sqnr_db(x, x) == math.inf


# ----------------------------------------------------------------------------- storage
def test_bits_per_parameter_matches_qlora():
    assert Q.bits_per_parameter(4, 64, scale_bits=32) == 4.5
    assert Q.bits_per_parameter(4, 64, scale_bits=8, double_quant_block=256) == 4 + 8 / 64 + 32 / (64 * 256)
    assert round(Q.bits_per_parameter(4, 64, scale_bits=8, double_quant_block=256), 3) == 4.127
    assert Q.bits_per_parameter(4, 128, scale_bits=16, zero_point_bits=4) == 4 + 20 / 128  # a GPTQ checkpoint
    assert Q.bits_per_parameter(8) == 8.0


@pytest.mark.parametrize("double_quant", [False, True])
def test_bits_per_parameter_equals_measured_nf4_storage(double_quant):
    numel = 64 * 256 * 3
    t = Q.nf4_quantize(torch.randn(numel), 64, double_quant=double_quant)
    if double_quant:
        predicted = Q.bits_per_parameter(4, 64, scale_bits=8, double_quant_block=256, double_quant_scale_bits=32)
        assert 8 * t.storage_bytes == predicted * numel + 32  # + the one fp32 mean
    else:
        assert 8 * t.storage_bytes == Q.bits_per_parameter(4, 64, scale_bits=32) * numel


def test_pack_int4_round_trips_every_byte():
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for signed in (False, True):
        codes = Q.unpack_int4(every_byte, signed=signed)
        assert codes.dtype == (torch.int8 if signed else torch.uint8) and codes.shape == (512,)
        assert torch.equal(Q.pack_int4(codes), every_byte)


def test_pack_int4_round_trips_every_code_pair_low_nibble_first():
    for signed, values in ((True, range(-8, 8)), (False, range(16))):
        dtype = torch.int8 if signed else torch.uint8
        pairs = torch.tensor([[a, b] for a in values for b in values], dtype=dtype)
        packed = Q.pack_int4(pairs)
        assert packed.shape == (256, 1)
        assert torch.equal(Q.unpack_int4(packed, signed=signed), pairs)
        low = pairs[:, 0].to(torch.int32) & 0xF
        assert torch.equal((packed[:, 0] & 0xF).to(torch.int32), low)  # the first code is the low nibble
    assert Q.pack_int4(torch.tensor([-1, 3], dtype=torch.int8)).item() == 0x3F  # two's complement nibble


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("signed", [False, True])
def test_pack_bits_round_trip_and_size(bits, signed):
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    codes = torch.randint(lo, hi + 1, (5, 37), generator=torch.Generator().manual_seed(bits)).to(torch.int8 if signed else torch.uint8)
    packed = Q.pack_bits(codes, bits)
    assert packed.shape == (5, math.ceil(37 * bits / 8)) and packed.dtype == torch.uint8
    assert torch.equal(Q.unpack_bits(packed, bits, 37, signed), codes)


def test_pack_bits_bit_stream_agrees_with_nibbles():
    codes = torch.randint(-8, 8, (3, 9), generator=torch.Generator().manual_seed(0)).to(torch.int8)  # odd: the bit-stream path
    padded = torch.cat([codes, torch.zeros(3, 1, dtype=torch.int8)], dim=1)
    assert torch.equal(Q.pack_bits(codes, 4), Q.pack_int4(padded))


# ----------------------------------------------------------------------------- NF4
def test_nf4_codebook_matches_bitsandbytes_table():
    codebook = Q.nf4_codebook()
    assert codebook.dtype == torch.float32 and codebook.shape == (16,)
    torch.testing.assert_close(codebook, torch.tensor(BITSANDBYTES_NF4), rtol=0, atol=1e-6)
    assert codebook[7] == 0.0 and codebook[0] == -1.0 and codebook[15] == 1.0
    assert (codebook.diff() > 0).all()


def test_nf4_picks_the_nearest_level_of_each_block():
    x = torch.randn(5, 100, generator=torch.Generator().manual_seed(3))  # 500 values: the last block is partial
    t = Q.nf4_quantize(x, 64)
    assert t.packed_codes.numel() == 250 and t.absmax.numel() == 8
    flat = torch.nn.functional.pad(x.reshape(-1), (0, 12)).reshape(-1, 64)
    absmax = flat.abs().amax(1, keepdim=True)
    normalized = flat / absmax
    nearest = (normalized[..., None] - Q.nf4_codebook()).abs().argmin(-1)
    expected = (Q.nf4_codebook()[nearest] * absmax).reshape(-1)[:500].reshape(5, 100)
    torch.testing.assert_close(Q.nf4_dequantize(t), expected, rtol=0, atol=1e-6)
    # the largest value of each block is exact: it maps to +-1
    assert (Q.nf4_dequantize(t).reshape(-1)[x.reshape(-1).abs().argmax()] == x.reshape(-1)[x.reshape(-1).abs().argmax()])


def test_double_quantization_keeps_the_absmax_close():
    x = torch.randn(64 * 600, generator=torch.Generator().manual_seed(4))
    plain, double = Q.nf4_quantize(x), Q.nf4_quantize(x, double_quant=True)
    assert double.absmax is None and double.absmax_codes.dtype == torch.int8 and double.absmax_scales.numel() == 3
    exact = plain.block_absmax()
    deviation = (exact - exact.mean()).abs().max()
    assert (double.block_absmax() - exact).abs().max() <= deviation / 254 * 1.001
    err_plain = Q.quantization_error(x, plain)["sqnr_db"]
    assert Q.quantization_error(x, double)["sqnr_db"] > err_plain - 0.1


def test_nf4_matches_bitsandbytes_blockwise():
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is an optional reference, not a dependency")
    x = torch.randn(64 * 32, generator=torch.Generator().manual_seed(5))
    try:
        packed, state = bnb.functional.quantize_4bit(x, blocksize=64, quant_type="nf4")
        theirs = bnb.functional.dequantize_4bit(packed, state)
    except (RuntimeError, NotImplementedError, AssertionError) as err:
        pytest.skip(f"this bitsandbytes build cannot quantize on the CPU: {err}")
    ours = Q.nf4_quantize(x, 64)
    torch.testing.assert_close(ours.absmax, state.absmax.float())
    torch.testing.assert_close(Q.nf4_dequantize(ours), theirs.reshape(x.shape).float(), rtol=1e-6, atol=1e-6)
    their_codes = torch.stack([packed.reshape(-1) >> 4, packed.reshape(-1) & 0xF], -1).reshape(-1)  # first code high
    assert torch.equal(Q.unpack_int4(ours.packed_codes), their_codes)


# ----------------------------------------------------------------------------- LLM.int8()
def test_int32_accumulation_is_exact():
    gen = torch.Generator().manual_seed(6)
    a = torch.randint(-127, 128, (9, 300), generator=gen).to(torch.int8)
    b = torch.randint(-127, 128, (7, 300), generator=gen).to(torch.int8)
    result = Q.int8_matmul_int32(a, b)
    assert result.dtype == torch.int32
    assert torch.equal(result.long(), a.long() @ b.long().T)


def test_int8_mixed_matmul_keeps_outlier_features_in_full_precision():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(16, 256, generator=gen)
    weight = torch.randn(32, 256, generator=gen) * 0.05
    x_out, features = Q.inject_outlier_features(x, num_features=3, magnitude=40.0)
    exact = x_out @ weight.T
    y, outliers = Q.int8_mixed_matmul(x_out, weight, threshold=6.0)
    assert torch.equal(outliers, features)
    plain, none = Q.int8_mixed_matmul(x_out, weight, threshold=float("inf"))
    assert none.numel() == 0
    mixed_error = Q.quantization_error(exact, y)["sqnr_db"]
    plain_error = Q.quantization_error(exact, plain)["sqnr_db"]
    assert mixed_error > plain_error + 15  # measured ~24 dB apart
    clean, _ = Q.int8_mixed_matmul(x, weight)  # no outliers: int8 throughout, still close
    assert Q.quantization_error(x @ weight.T, clean)["sqnr_db"] > 35


def test_int8_mixed_matmul_all_outliers_is_the_float_matmul():
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(8)) + 10.0
    weight = torch.randn(5, 16)
    y, outliers = Q.int8_mixed_matmul(x, weight, threshold=0.0)
    assert outliers.numel() == 16 and y.shape == (2, 3, 5)
    torch.testing.assert_close(y, x @ weight.T)


def test_an_int8_kv_cache_gives_nearly_the_fp32_caches_keys_values_and_logits(adder):
    from labkit.nn import KVCache

    model, task, _ = adder
    tokens = Q.calibration_tokens(task, num_sequences=4, context_length=12)
    cache = Q.QuantizedKVCache.for_model(model, batch_size=4, bits=8, max_seq_len=12)
    with torch.no_grad():
        exact, quantized = model(tokens), model(tokens, kv_cache=cache)
    assert cache.length(0) == 12
    assert ((quantized - exact).norm() / exact.norm()).item() < 0.02
    cfg = model.config
    assert cache.nbytes == 2 * cfg.num_layers * 4 * cfg.kv_heads * 12 * (cfg.dim_per_head + 2)
    full = KVCache(1, 1, 2, 6, 8)
    small = Q.QuantizedKVCache(4, 1, 1, 2, 6, 8)
    k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    for step in (k, v):  # appended in two steps, like prefill then decoding
        expected, got = full.update(0, step, -step), small.update(0, step, -step)
        assert got[0].shape == expected[0].shape == (1, 2, small.length(0), 8)
        assert (got[0] - expected[0]).abs().max() <= expected[0].abs().amax(-1, keepdim=True).max() / 7 / 2 + 1e-3


@pytest.mark.parametrize("k_shape, words", [((1, 2, 3, 4), "head_dim"), ((1, 2, 7, 8), "overflow")])
def test_quantized_kv_cache_rejects_wrong_shapes_and_overflow(k_shape, words):
    cache = Q.QuantizedKVCache(8, 1, 1, 2, 6, 8)
    with pytest.raises(ValueError, match=words):
        cache.update(0, torch.randn(k_shape), torch.randn(k_shape))


def test_lloyd_max_levels_lower_the_error_of_their_start_and_fit_uniform_data_evenly():
    values = torch.rand(40_000, generator=torch.Generator().manual_seed(3)) * 2 - 1
    start = Q.lloyd_max_levels(values, 8, iterations=0)  # the quantiles it starts from
    fitted = Q.lloyd_max_levels(values, 8)
    assert fitted.dtype == torch.float32 and torch.equal(fitted, fitted.sort().values)
    assert mse_of(values, fitted) <= mse_of(values, start)
    torch.testing.assert_close(fitted, torch.linspace(-7 / 8, 7 / 8, 8), atol=0.02, rtol=0)  # uniform: bin centres
    normal = torch.randn(40_000, generator=torch.Generator().manual_seed(4))
    normal = normal / normal.abs().max()
    assert mse_of(normal, Q.lloyd_max_levels(normal, 16)) < mse_of(normal, Q.nf4_codebook())


def mse_of(values, levels):
    return (levels[Q.nearest_level(values, levels).long()] - values).pow(2).mean().item()


@pytest.mark.parametrize("kwargs, words", [(dict(count=1), "count"), (dict(count=300), "count"),
                                           (dict(iterations=-1), "iterations")])
def test_lloyd_max_levels_rejects_bad_arguments(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Q.lloyd_max_levels(torch.randn(100), **kwargs)


def test_awq_is_never_worse_than_rounding_and_helps_with_outlier_features():
    gen = torch.Generator().manual_seed(11)
    x, weight = torch.randn(300, 32, generator=gen), torch.randn(16, 32, generator=gen) * 0.1
    x[:, [3, 17]] *= 15.0
    for group in (None, 8):
        q, s, alpha = Q.awq_quantize(weight, x, 4, group)
        awq_error = Q.layer_output_error(x, weight, Q.dequantize(q, torch.float32) / s)
        granularity = "group" if group else "channel"
        rtn_error = Q.layer_output_error(x, weight, Q.dequantize(Q.quantize(weight, 4, True, granularity, group)))
        assert s.shape == (32,) and 0 < alpha <= 1 and q.group_size == group
        assert awq_error < 0.8 * rtn_error
    x_tame = torch.randn(300, 32, generator=gen)
    q, s, alpha = Q.awq_quantize(weight, x_tame, 4)
    assert Q.layer_output_error(x_tame, weight, Q.dequantize(q, torch.float32) / s) <= \
        Q.layer_output_error(x_tame, weight, Q.dequantize(Q.quantize(weight, 4, True, "channel")))


def test_smoothquant_search_beats_no_smoothing_and_prefers_the_middle_with_outliers():
    gen = torch.Generator().manual_seed(12)
    x, weight = torch.randn(400, 32, generator=gen), torch.randn(16, 32, generator=gen) * 0.1
    x[:, [5, 20]] *= 30.0

    def w8a8_error(s):
        w_hat = Q.dequantize(Q.quantize(weight * s, 8, True, "channel")) / s
        x_hat = Q.dequantize(Q.quantize(x / s, 8, True, "tensor")) * s
        exact = x.double() @ weight.double().T
        return ((x_hat.double() @ w_hat.double().T - exact).norm() / exact.norm()).item()

    s, alpha = Q.smoothquant_search(weight, x, grid=10)
    assert s.shape == (32,) and 0 < alpha < 1
    assert torch.equal(s, Q.smoothquant_scales(x, weight, alpha))
    for other in (0.0, 0.3, 1.0):
        assert w8a8_error(s) <= w8a8_error(Q.smoothquant_scales(x, weight, other)) + 1e-12
    assert w8a8_error(s) < 0.6 * w8a8_error(torch.ones(32))
    with pytest.raises(ValueError, match="grid"):
        Q.smoothquant_search(weight, x, grid=0)
    with pytest.raises(ValueError, match="calibration_inputs, weight"):
        Q.smoothquant_search(weight, x[..., :-1])
    with pytest.raises(TypeError, match="calibration_inputs"):
        Q.smoothquant_search(weight, x.to(torch.int32))
    with pytest.raises(ValueError, match="bits"):
        Q.smoothquant_search(weight, x, act_bits=1)


def test_quant_linear_with_input_scale_and_activation_bits():
    gen = torch.Generator().manual_seed(13)
    linear = Linear(32, 16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(16, 32, generator=gen) * 0.1)
    x = torch.randn(5, 7, 32, generator=gen)
    s = torch.rand(32, generator=gen) + 0.5
    layer = Q.QuantLinear.from_linear(linear, "int8", input_scale=s)
    s_stored = s.half().float()
    assert layer.input_scale.dtype == torch.float16 and torch.equal(layer.input_scale.float(), s_stored)
    expected_codes = Q.quantize(linear.weight.detach() * s_stored, 8, True, "channel").codes
    assert torch.equal(layer.codes(), expected_codes)
    assert "input_scale" in layer.state_dict()
    torch.testing.assert_close(layer(x), (x / s_stored) @ layer.dequantized_weight().T)
    w8a8 = Q.QuantLinear.from_linear(linear, "int8", input_scale=s, act_bits=8)
    x_hat = Q.dequantize(Q.quantize(x / s_stored, 8, True, "tensor"))
    torch.testing.assert_close(w8a8(x), x_hat @ w8a8.dequantized_weight().T)
    assert "act_bits=8" in repr(w8a8) and "act_bits" not in repr(layer)
    for bad in (torch.zeros(32), torch.ones(31), -torch.ones(32)):
        with pytest.raises(ValueError, match="input_scale"):
            Q.QuantLinear.from_linear(linear, "int8", input_scale=bad)
    with pytest.raises(ValueError, match="bits"):
        Q.QuantLinear.from_linear(linear, "int8", act_bits=1)


def test_quantize_model_awq_and_smoothquant_keep_their_factors(adder):
    model, task, calibration = adder
    awq, report = Q.quantize_model(model, "awq", bits=4, calibration=calibration)
    layers = [awq.get_submodule(n) for n in report.quantized_layers]
    assert report.act_bits is None and all(layer.input_scale is not None and layer.act_bits is None for layer in layers)
    # the factors are stored (fp16, one per input feature): counted in the measured bits per weight
    assert report.bits_per_parameter > Q.quantize_model(model, "rtn", bits=4)[1].bits_per_parameter
    smooth, report = Q.quantize_model(model, "smoothquant", bits=8, act_bits=8, calibration=calibration)
    assert report.act_bits == 8 and all(smooth.get_submodule(n).act_bits == 8 for n in report.quantized_layers)
    rows = Q.compare_quantizations(model, task, [dict(method="smoothquant", bits=8, act_bits=8)], calibration=calibration,
                                   max_examples=100)
    assert rows[1]["act"] == 8 and rows[0]["act"] == "-" and rows[1]["accuracy"] >= 0.95


@pytest.mark.parametrize("kwargs, words", [(dict(grid=0), "grid"), (dict(calibration_inputs=torch.ones(5, 3)), "calibration"),
                                           (dict(bits=1), "bits")])
def test_awq_rejects_bad_arguments(kwargs, words):
    arguments = dict(weight=torch.randn(4, 8), calibration_inputs=torch.randn(10, 8), bits=4) | kwargs
    with pytest.raises(ValueError, match=words):
        Q.awq_quantize(**arguments)


def test_gptq_act_order_lowers_the_error_and_returns_codes_in_the_original_order(adder, adder_activations):
    model, _, _ = adder
    for name, inputs in adder_activations.items():
        weight = model.get_submodule(name).weight.detach()
        plain, ordered = Q.gptq_quantize(weight, inputs, 3), Q.gptq_quantize(weight, inputs, 3, act_order=True)
        assert torch.equal(plain.scale, ordered.scale)  # one scale per row, from the same weights
        error = {q: Q.layer_output_error(inputs, weight, Q.dequantize(q, torch.float32)) for q in (plain, ordered)}
        assert error[ordered] < error[plain], name
    order = torch.tensor([2, 0, 1])
    x = torch.randn(50, 3) * torch.tensor([1.0, 0.1, 10.0])  # feature 2 first, then 0, then 1
    w = torch.randn(4, 3)
    permuted = Q.gptq_quantize(w[:, order], x[:, order], 4)
    assert torch.equal(Q.gptq_quantize(w, x, 4, act_order=True).codes[:, order], permuted.codes)
    with pytest.raises(ValueError, match="act_order"):
        Q.gptq_quantize(w, x, 4, group_size=3, act_order=True)


def test_smoothquant_scales_follow_the_formula_and_leave_the_product_unchanged():
    gen = torch.Generator().manual_seed(9)
    x, weight = torch.randn(50, 12, generator=gen), torch.randn(7, 12, generator=gen)
    x[:, 3] *= 30.0   # an outlier feature
    x[:, 5] = 0.0     # a dead one
    for alpha in (0.0, 0.5, 1.0):
        s = Q.smoothquant_scales(x, weight, alpha)
        expected = x.abs().amax(0) ** alpha / weight.abs().amax(0) ** (1 - alpha)
        assert s[5] == 1.0 and s.dtype == torch.float32
        keep = torch.arange(12) != 5
        torch.testing.assert_close(s[keep], expected[keep])
        torch.testing.assert_close((x / s) @ (weight * s).T, x @ weight.T, rtol=1e-5, atol=1e-4)
    assert torch.allclose((x / Q.smoothquant_scales(x, weight, 1.0)).abs().amax(0)[keep], torch.ones(11))


@pytest.mark.parametrize("kwargs, words", [(dict(alpha=1.5), "alpha"), (dict(alpha=True), "alpha"),
                                           (dict(weight=torch.ones(3, 5)), "weight")])
def test_smoothquant_scales_rejects_bad_arguments(kwargs, words):
    arguments = dict(x=torch.ones(4, 6), weight=torch.ones(3, 6), alpha=0.5) | kwargs
    with pytest.raises(ValueError, match=words):
        Q.smoothquant_scales(**arguments)


# ----------------------------------------------------------------------------- GPTQ
@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_beats_round_to_nearest_on_the_adders_activations(adder, adder_activations, bits):
    model, _, _ = adder
    for name, inputs in adder_activations.items():
        weight = model.get_submodule(name).weight.detach()
        for group_size in (None, 16 if weight.shape[1] % 16 == 0 else 43):  # d_in is 64 or 172 = 4 * 43
            granularity = "group" if group_size else "channel"
            rtn = Q.dequantize(Q.quantize(weight, bits, True, granularity, group_size))
            gptq = Q.dequantize(Q.gptq_quantize(weight, inputs, bits, group_size))
            rtn_error, gptq_error = Q.layer_output_error(inputs, weight, rtn), Q.layer_output_error(inputs, weight, gptq)
            # measured: GPTQ's error is 40-70% of round-to-nearest's on every layer
            assert gptq_error < 0.8 * rtn_error, (name, group_size, gptq_error, rtn_error)


def test_gptq_with_uncorrelated_inputs_is_round_to_nearest():
    # H = 2 X^T X is diagonal, so no error can be compensated by another column
    weight = torch.randn(12, 32, generator=torch.Generator().manual_seed(9))
    inputs = torch.eye(32).repeat(3, 1) * 2.0
    for group_size in (None, 8):
        for symmetric in (True, False):
            gptq = Q.gptq_quantize(weight, inputs, 3, group_size, symmetric)
            rtn = Q.quantize(weight, 3, symmetric, "group" if group_size else "channel", group_size)
            assert torch.equal(gptq.codes, rtn.codes)
            torch.testing.assert_close(gptq.scale, rtn.scale)


def test_gptq_handles_dead_inputs_and_asymmetric_groups():
    gen = torch.Generator().manual_seed(10)
    weight = torch.randn(8, 24, generator=gen)
    inputs = torch.randn(200, 24, generator=gen)
    inputs[:, 5] = 0.0  # a feature that never fires
    q = Q.gptq_quantize(weight, inputs, 4, group_size=8, symmetric=False, block_size=5)
    assert q.codes.dtype == torch.uint8 and q.scale.shape == (8, 3) and q.zero_point.shape == (8, 3)
    w_hat = Q.dequantize(q)
    assert torch.isfinite(w_hat).all() and (w_hat[:, 5] == 0).all()
    rtn = Q.dequantize(Q.quantize(weight, 4, False, "group", 8))
    assert Q.layer_output_error(inputs, weight, w_hat) < Q.layer_output_error(inputs, weight, rtn)


# ----------------------------------------------------------------------------- QuantLinear and models
LAYER_CASES = [("int8", None, True, None), ("int8", None, False, 32), ("int4", None, True, 64), ("int4", None, False, 16),
               ("int", 3, True, 43), ("int", 2, False, None), ("int", 6, True, 50), ("nf4", None, True, 64)]


@pytest.mark.parametrize("method, bits, symmetric, group_size", LAYER_CASES)
def test_quant_linear_equals_linear_with_its_dequantized_weight(method, bits, symmetric, group_size):
    gen = torch.Generator().manual_seed(11)
    linear = Linear(172, 24)
    x = torch.randn(2, 5, 172, generator=gen)
    layer = Q.QuantLinear.from_linear(linear, method, group_size, bits=bits, symmetric=symmetric, scale_dtype=torch.float32)
    weight_hat = layer.dequantized_weight()
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight_hat))
    for dtype in (torch.float16, torch.bfloat16):
        y = layer(x.to(dtype))
        assert y.dtype == dtype
        torch.testing.assert_close(y, torch.nn.functional.linear(x.to(dtype), weight_hat.to(dtype)))
    # storage reads like the format: packed codes, one scale per (row, group), zeros if asymmetric
    groups = math.ceil(172 / group_size) if group_size else 1
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (24, math.ceil(172 * layer.bits / 8))
    assert layer.scales.shape == (24, groups)
    assert (layer.zeros is None) == symmetric
    assert set(layer.state_dict()) == {"qweight", "scales"} | (set() if symmetric else {"zeros"})
    if method != "nf4":  # integer grids: within half a step of the original weight
        step = layer._per_column(layer.scales).float()
        assert ((weight_hat - linear.weight.detach()).abs() <= step * (0.5 + 1e-5)).all()


def test_quant_linear_loads_its_state_dict():
    layer = Q.QuantLinear.from_linear(Linear(64, 10), "int4", 16, symmetric=False)
    fresh = Q.QuantLinear(64, 10, "int4", group_size=16, symmetric=False)
    fresh.load_state_dict(layer.state_dict())
    x = torch.randn(3, 64)
    assert torch.equal(fresh(x), layer(x))


def test_quant_linear_from_gptq_inputs_lowers_the_output_error(adder, adder_activations):
    model, _, _ = adder
    linear = model.get_submodule("layers.0.ffn.w2")  # d_in 172: a ragged last group of 172 - 2 * 64
    inputs = adder_activations["layers.0.ffn.w2"]
    rtn = Q.QuantLinear.from_linear(linear, "int", 64, bits=3)
    gptq = Q.QuantLinear.from_linear(linear, "int", 64, bits=3, gptq_inputs=inputs)
    assert gptq.scales.shape == (64, 3)
    errors = [Q.layer_output_error(inputs, linear.weight, layer.dequantized_weight()) for layer in (rtn, gptq)]
    assert errors[1] < 0.8 * errors[0]


def test_quantize_model_counts_state_dict_bytes_and_leaves_the_original(adder):
    model, _, _ = adder
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantized, report = Q.quantize_model(model, "rtn", bits=4, group_size=32)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(isinstance(m, Linear) for n, m in model.named_modules() if n.endswith(("_proj", "w1", "w2", "w3")))
    assert isinstance(quantized.lm_head, Linear) and "lm_head" not in report.quantized_layers
    assert len(report.quantized_layers) == 14
    assert all(isinstance(quantized.get_submodule(n), Q.QuantLinear) for n in report.quantized_layers)
    measured = lambda m: sum(t.numel() * t.element_size() for t in m.state_dict().values())  # noqa: E731
    assert report.bytes_before == measured(model) and report.bytes_after == measured(quantized)
    layers = [quantized.get_submodule(n) for n in report.quantized_layers]
    assert report.weight_bytes_after == sum(measured(layer) for layer in layers)
    # 4-bit codes plus an fp16 scale per 32 weights (a ragged last group in w2: 172 = 5 * 32 + 12)
    assert 4.5 <= report.bits_per_parameter < 4.6
    assert report.bytes_after < report.bytes_before


def test_quantize_model_skip_patterns_and_errors(adder):
    model, _, calibration = adder
    _, report = Q.quantize_model(model, "nf4", group_size=64, skip=("lm_head", "w2", "layers.1.*"))
    kept = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.output_proj", "ffn.w1", "ffn.w3")
    assert report.quantized_layers == [f"layers.0.{n}" for n in kept]
    with pytest.raises(ValueError, match="calibration"):
        Q.quantize_model(model, "gptq", bits=3)
    with pytest.raises(ValueError, match="method='hqq'"):
        Q.quantize_model(model, "hqq")
    with pytest.raises(ValueError, match="calibration"):
        Q.quantize_model(model, "awq")
    with pytest.raises(ValueError, match="act_bits"):
        Q.quantize_model(model, "smoothquant", bits=8, calibration=calibration)
    with pytest.raises(ValueError, match="group_size"):
        Q.quantize_model(model, "awq", group_size=32, calibration=calibration)
    with pytest.raises(ValueError, match="bits=3: NF4"):
        Q.quantize_model(model, "nf4", bits=3)


def test_gptq_beats_round_to_nearest_in_accuracy_at_3_bits(adder):
    model, task, calibration = adder
    results = {}
    for method in ("rtn", "gptq"):
        quantized, _ = Q.quantize_model(model, method, bits=3, calibration=calibration)
        results[method] = Q.evaluate_adder(quantized, task)
    # measured on the val split: RTN 0.83, GPTQ 0.94 (per-channel scales)
    assert results["gptq"]["accuracy"] > results["rtn"]["accuracy"] + 0.05
    assert results["gptq"]["loss"] < results["rtn"]["loss"]
    eight_bit, _ = Q.quantize_model(model, "rtn", bits=8)
    assert Q.evaluate_adder(eight_bit, task)["accuracy"] >= 0.97


def test_compare_quantizations_rows(adder):
    model, task, calibration = adder
    rows = Q.compare_quantizations(model, task, [dict(method="rtn", bits=8), dict(method="gptq", bits=4)],
                                   calibration=calibration, max_examples=100)
    assert [r["method"] for r in rows] == ["none", "rtn", "gptq"]
    # per block: 4 attention [64, 64], w1 and w3 [172, 64], w2 [64, 172]; one fp16 scale per row
    parameters, rows_with_a_scale = 4 * 64 * 64 + 3 * 172 * 64, 4 * 64 + 2 * 172 + 64
    assert rows[1]["bits/param"] == pytest.approx(8 + 16 * rows_with_a_scale / parameters)
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["loss"] > 0 for r in rows)


# ----------------------------------------------------------------------------- widget callback
@pytest.mark.parametrize("granularity, group_size", [("tensor", None), ("channel", None), ("group", 16)])
def test_explorer_returns_what_a_plot_needs(granularity, group_size):
    data = Q.quantization_explorer(3, True, granularity, group_size, outlier_magnitude=0.0)
    assert len(data["values"]) == len(data["dequantized"]) == 64
    assert len(data["levels"]) == {"tensor": 1, "channel": 1, "group": 4}[granularity]
    assert all(len(group["levels"]) == 7 for group in data["levels"])
    assert set(data["error"]) == {"mse", "max_abs_error", "sqnr_db"}
    asym = Q.quantization_explorer(3, False, granularity, group_size, 0.0)
    assert len(asym["levels"][0]["levels"]) == 8 and asym["bits_per_parameter"] >= data["bits_per_parameter"]


def test_explorer_shows_an_outlier_ruining_a_shared_scale():
    clean = Q.quantization_explorer(4, True, "tensor", None, 0.0)
    spoiled = Q.quantization_explorer(4, True, "tensor", None, 50.0)
    grouped = Q.quantization_explorer(4, True, "group", 16, 50.0)
    # (MSE, not SQNR: the outlier's own energy would inflate the "signal")
    assert spoiled["error"]["mse"] > 20 * clean["error"]["mse"]  # measured 47x
    assert grouped["error"]["mse"] < spoiled["error"]["mse"] / 8  # measured 16x: it spoils only its own group
    assert spoiled["values"][0] == 50.0


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: Q.quantize(torch.ones(4), 1), ValueError, "bits=1"),
        (lambda: Q.quantize(torch.ones(4), 9), ValueError, "bits=9"),
        (lambda: Q.quantize(torch.ones(4), 4.0), TypeError, "bits=4.0"),
        (lambda: Q.quantize(torch.ones(4), 4, granularity="row"), ValueError, "granularity='row'"),
        (lambda: Q.quantize(torch.ones(4, 6), 4, granularity="group", group_size=4), ValueError, "group_size=4: must divide the size 6"),
        (lambda: Q.quantize(torch.ones(4, 6), 4, granularity="group"), ValueError, "group_size=None"),
        (lambda: Q.quantize(torch.ones(4, 6), 4, granularity="channel", group_size=2), ValueError, "group_size=2: only"),
        (lambda: Q.quantize(torch.ones(4, 6), 4, granularity="channel", axis=2), ValueError, "axis=2"),
        (lambda: Q.quantize(torch.ones(4, dtype=torch.int32), 4), TypeError, "x: expected dtype"),
        (lambda: Q.quantize(torch.ones(4, dtype=torch.float64), 4), TypeError, "x: expected dtype"),
        (lambda: Q.quantize([1.0, 2.0], 4), TypeError, "x: expected a torch.Tensor"),
        (lambda: Q.quantize(torch.tensor([1.0, float("nan")]), 4), ValueError, "x: contains NaN"),
        (lambda: Q.quantize(torch.ones(0), 4), ValueError, "x: is empty"),
        (lambda: Q.dequantize(torch.ones(3)), TypeError, "q: expected a QuantizedTensor"),
        (lambda: Q.pack_int4(torch.tensor([1, 2, 3], dtype=torch.uint8)), ValueError, "last dim must be even"),
        (lambda: Q.pack_int4(torch.tensor([1, 16], dtype=torch.uint8)), ValueError, r"codes: 4-bit unsigned codes must lie in \[0, 15\]"),
        (lambda: Q.pack_int4(torch.tensor([-9, 0], dtype=torch.int8)), ValueError, r"\[-8, 7\]"),
        (lambda: Q.pack_int4(torch.tensor([1, 2])), TypeError, "codes: expected int8"),
        (lambda: Q.unpack_int4(torch.tensor([1, 2], dtype=torch.int8)), TypeError, "packed: expected a uint8"),
        (lambda: Q.unpack_bits(torch.zeros(2, 3, dtype=torch.uint8), 3, 9, False), ValueError, "count=9"),
        (lambda: Q.bits_per_parameter(4, 0), ValueError, "group_size=0"),
        (lambda: Q.bits_per_parameter(4, None, double_quant_block=256), ValueError, "double_quant_block"),
        (lambda: Q.nf4_quantize(torch.ones(64), block_size=63), ValueError, "block_size=63"),
        (lambda: Q.gptq_quantize(torch.ones(4, 8), torch.ones(10, 6), 4), ValueError, r"calibration_inputs: expected shape \[..., 8\]"),
        (lambda: Q.gptq_quantize(torch.ones(4, 8), torch.ones(10, 8), 4, group_size=3), ValueError, "group_size=3"),
        (lambda: Q.int8_mixed_matmul(torch.ones(2, 8), torch.ones(3, 7)), ValueError, r"weight: expected shape \[d_out, 8\]"),
        (lambda: Q.QuantLinear(8, 4, "int5"), ValueError, "method='int5'"),
        (lambda: Q.QuantLinear(8, 4, "int"), ValueError, "bits: method='int' needs bits"),
        (lambda: Q.QuantLinear(8, 4, "int4", bits=3), ValueError, "bits=3: method='int4' is 4-bit"),
        (lambda: Q.QuantLinear(8, 4, "nf4", symmetric=False), ValueError, "NF4 has no zero point"),
        (lambda: Q.QuantLinear(8, 4, "int", bits=3, use_triton=True), ValueError, "4- and 8-bit"),
        (lambda: Q.QuantLinear(7, 4, "int4", use_triton=True), ValueError, "d_in=7 must be even"),
        (lambda: Q.QuantLinear(8, 4, group_size=0), ValueError, "group_size=0"),
        (lambda: Q.QuantLinear.from_linear(torch.nn.Linear(8, 4), "int4"), ValueError, "linear: has a bias"),
        (lambda: Q.QuantLinear.from_linear(Linear(8, 4), "nf4", gptq_inputs=torch.ones(3, 8)), ValueError, "gptq_inputs"),
        (lambda: Q.QuantLinear.from_linear(Linear(8, 4), "int4")(torch.ones(2, 9)), ValueError, "x: last dim must be d_in=8"),
    ],
)
def test_bad_arguments_are_named(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_capture_linear_inputs_returns_what_the_layer_saw(adder):
    model, task, _ = adder
    tokens = torch.from_numpy(task.tokens("val")[:64].reshape(2, 32))
    inputs = Q.capture_linear_inputs(model, tokens, names={"lm_head"})
    assert list(inputs) == ["lm_head"] and inputs["lm_head"].shape == (64, 64)
    logits = model(tokens)
    torch.testing.assert_close(inputs["lm_head"] @ model.lm_head.weight.T, logits.reshape(64, -1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_grid_past_the_largest_float_saturates(dtype):
    # x = +-max, 2 bits asymmetric: scale = 2 max / 3 and the zero point, round(1.5 +- rounding),
    # is 1 or 2, so one end level of the grid, +-4/3 max, lies beyond the format
    largest = torch.finfo(dtype).max
    x = torch.tensor([largest, -largest], dtype=dtype)
    q = Q.quantize(x, 2, symmetric=False)
    assert q.levels().abs().max() > largest
    assert torch.isfinite(Q.dequantize(q)).all()
    assert_within_half_a_step(x, q)


# ----------------------------------------------------------------------------- the full symmetric range, torchao
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_full_range_uses_the_lowest_code_and_a_half_step_larger_divisor(bits):
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    q = Q.quantize(weight, bits, True, "group", 32, full_range=True)
    half = 2 ** (bits - 1)
    assert q.code_range == (-half, half - 1)
    assert torch.equal(q.scale, weight.reshape(16, 2, 32).abs().amax(-1) / (half - 0.5))
    assert q.codes.min() >= -half and q.codes.max() <= half - 1
    assert len(q.levels((0, 0))) == 2**bits
    # every value within half a step, except +absmax, which is clipped by half a step to the top level
    per_value = q.scale.repeat_interleave(32, dim=1)
    assert ((Q.dequantize(q) - weight).abs() <= per_value * (0.5 + 1e-4)).all()  # fp32 rounding near 2^(b-1) steps
    default = Q.quantize(weight, bits, True, "group", 32)
    assert default.full_range is False and default.code_range == (-(half - 1), half - 1)


def test_full_range_is_symmetric_only_and_a_bool():
    x = torch.randn(8)
    with pytest.raises(ValueError, match="full_range"):
        Q.quantize(x, 4, symmetric=False, full_range=True)
    with pytest.raises(ValueError, match="full_range"):
        Q.quantize(x, 4, full_range=1)


def test_8bit_full_range_codes_equal_torch_quantize_per_channel():
    weight = torch.randn(48, 80, generator=torch.Generator().manual_seed(2)) * torch.rand(48, 1) * 4
    q = Q.quantize(weight, 8, True, "channel", full_range=True)
    with torch_quantize_ops():
        theirs = torch.quantize_per_channel(weight, q.scale[:, 0].double(), torch.zeros(48, dtype=torch.long), 0, torch.qint8)
    assert torch.equal(theirs.int_repr(), q.codes)


def _torchao():
    torchao_quantization = pytest.importorskip("torchao.quantization")
    from torchao.quantization.granularity import PerGroup
    return torchao_quantization, PerGroup


def _torchao_weight(weight, config):
    torchao_quantization, _ = _torchao()
    layer = torch.nn.Sequential(torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False))
    layer[0].weight.data = weight.clone()
    torchao_quantization.quantize_(layer, config)
    return layer


@pytest.mark.parametrize("bits, symmetric, group", [(8, True, None), (4, True, 32), (4, False, 32), (8, False, 16)])
def test_torchao_weight_only_codes_equal_labkit(adder, bits, symmetric, group):
    """torchao's weight-only configs on the adder's layer: the codes of Q.quantize (full range when symmetric,
    asymmetric codes shifted by 2^(b-1) because torchao stores them signed), scales equal up to fp32 rounding,
    and the quantized layer computes x times labkit's dequantized weight."""
    ao, PerGroup = _torchao()
    model, _, calibration = adder
    weight = model.layers[0].ffn.w1.weight.detach().cpu()
    x = Q.capture_linear_inputs(model, calibration, names=["layers.0.ffn.w1"])["layers.0.ffn.w1"].cpu()
    mapping = ao.MappingType.SYMMETRIC if symmetric else ao.MappingType.ASYMMETRIC
    if group is None:
        config = ao.Int8WeightOnlyConfig()
    else:
        config = ao.IntxWeightOnlyConfig(weight_dtype=getattr(torch, f"int{bits}"), granularity=PerGroup(group), mapping_type=mapping)
    layer = _torchao_weight(weight, config)
    theirs = layer[0].weight
    ours = Q.quantize(weight, bits, symmetric, "channel" if group is None else "group", group, full_range=symmetric)
    shift = 0 if symmetric else 2 ** (bits - 1)
    assert torch.equal(theirs.qdata.int() + shift, ours.codes.int())
    assert torch.allclose(theirs.scale.reshape(ours.scale.shape), ours.scale, rtol=1e-6, atol=0)
    if not symmetric:
        assert torch.equal(theirs.zero_point.reshape(ours.zero_point.shape).int() + shift, ours.zero_point.int())
    with torch.no_grad():
        out = layer(x)
    assert (out - x @ Q.dequantize(ours).T).abs().max() <= 1e-5 * out.abs().max()
    if symmetric:  # labkit's default, the restricted range, is a different grid
        assert not torch.equal(theirs.qdata, Q.quantize(weight, bits, True, "channel" if group is None else "group", group).codes)


def test_torchao_int4_weight_only_config_needs_a_gpu_library_on_cpu():
    """Int4WeightOnlyConfig's default packing needs mslk's GPU kernels: on a CPU-only machine it refuses."""
    ao, _ = _torchao()
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises((ImportError, NotImplementedError, AssertionError, RuntimeError)):
        _torchao_weight(torch.randn(16, 64), ao.Int4WeightOnlyConfig(group_size=32))
