"""labkit.precision against PyTorch's own dtypes and casts, exhaustively where the space is small."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit  # noqa: F401  (sets up Triton's interpreter before anything imports triton)
from labkit import precision as P

TORCH_FORMATS = ["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
SMALL_TORCH_FORMATS = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]


def torch_values(codes: torch.Tensor, fmt: P.FloatFormat) -> torch.Tensor:
    """What torch's dtype says the bit patterns mean."""
    storage = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[fmt.bits]
    signed = codes.long()
    if storage is not torch.uint8:
        signed = torch.where(signed >= 1 << (fmt.bits - 1), signed - (1 << fmt.bits), signed)
    return signed.to(storage).view(fmt.torch_dtype).double()


def torch_codes(x: torch.Tensor, fmt: P.FloatFormat) -> torch.Tensor:
    storage = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[fmt.bits]
    return x.to(fmt.torch_dtype).view(storage).long() & ((1 << fmt.bits) - 1)


def assert_same_values(got: torch.Tensor, expected: torch.Tensor):
    assert torch.equal(torch.isnan(got), torch.isnan(expected))
    keep = ~torch.isnan(expected)
    assert torch.equal(got[keep], expected[keep])
    assert torch.equal(torch.signbit(got[keep]), torch.signbit(expected[keep]))  # -0.0 too


# ----------------------------------------------------------------------------- formats
@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_derived_properties_match_torch_finfo(name):
    fmt, info = P.get_format(name), torch.finfo(P.get_format(name).torch_dtype)
    assert fmt.max == info.max
    assert fmt.min_normal == info.smallest_normal
    assert fmt.eps == info.eps
    assert fmt.bits == info.bits
    assert fmt.min_subnormal == info.smallest_normal * info.eps  # one mantissa step above 0


def test_published_fp8_ranges():
    assert P.get_format("fp8_e4m3").max == 448 and P.get_format("fp8_e5m2").max == 57344
    assert math.isnan(P.decode(0x7F, "fp8_e4m3").item()) and math.isnan(P.decode(0xFF, "fp8_e4m3").item())
    assert P.decode(0x7C, "fp8_e5m2").item() == math.inf


def test_e4m3fn_has_exactly_two_nan_codes_like_torch():
    codes = torch.arange(256)
    ours = P.decode(codes, "fp8_e4m3").isnan()
    theirs = codes.to(torch.uint8).view(torch.float8_e4m3fn).float().isnan()
    assert torch.equal(ours, theirs)
    assert codes[ours].tolist() == [0x7F, 0xFF]  # S.1111.111 for either sign
    assert P.encode(torch.tensor([math.nan, -math.nan]), "fp8_e4m3").tolist() == [0x7F, 0xFF]


@pytest.mark.parametrize("name", list(P.FORMATS))
def test_values_per_binade_counts_every_positive_finite_value(name):
    fmt = P.get_format(name)
    counts = P.values_per_binade(fmt)
    if fmt.bits <= 16:
        values = P.all_values(fmt)
        positive = values[torch.isfinite(values) & (values > 0)]
        binades, listed = torch.unique(torch.floor(torch.log2(positive)).long(), return_counts=True)
        assert counts == dict(zip(binades.tolist(), listed.tolist()))
    else:  # fp32: the positive finite codes are 1 .. 0x7F7FFFFF, read off torch's own bit patterns
        top = torch.tensor(torch.finfo(torch.float32).max).view(torch.int32).item()
        assert sum(counts.values()) == top
        one, two = torch.tensor([1.0, 2.0]).view(torch.int32).tolist()
        assert counts[0] == two - one
        assert min(counts) == math.floor(math.log2(fmt.min_subnormal)) and max(counts) == math.floor(math.log2(fmt.max))


def test_block_scaled_storage_matches_the_published_bit_counts():
    # OCP MX v1.0: 32 elements share one 8-bit E8M0 scale; NVIDIA NVFP4: 16 FP4 elements share an
    # FP8 E4M3 scale, plus one fp32 scale per tensor.
    assert P.BLOCK_SCALINGS["mxfp4"].bits_per_value == 4.25
    assert P.BLOCK_SCALINGS["nvfp4"].bits_per_value == 4.5
    assert P.BLOCK_SCALINGS["mxfp8"].bits_per_value == 8.25
    billion = 10**9
    assert P.storage_bytes(billion, "fp4_e2m1") == billion / 2
    assert P.storage_bytes(billion, "mxfp4") == billion / 2 + billion / 32
    assert P.storage_bytes(billion, "nvfp4", num_tensors=7) == billion / 2 + billion / 16 + 7 * 4
    assert P.storage_bytes(33, "mxfp4") == (33 * 4 + 2 * 8) / 8  # a started block pays a whole scale
    assert P.storage_bytes(10, "bf16") == 20
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="num_values"):
            P.storage_bytes(bad, "mxfp4")
    with pytest.raises(ValueError, match="scheme"):
        P.storage_bytes(10, "fp3")
    with pytest.raises(ValueError, match="num_tensors"):
        P.storage_bytes(10, "nvfp4", num_tensors=0)


# OCP Microscaling Formats (MX) v1.0, section 5.3.3, table "FP6/FP4 element data types".
OCP_MX = {
    "fp6_e3m2": dict(bias=3, max=28.0, min_normal=0.25, max_subnormal=0.1875, min_subnormal=0.0625),
    "fp6_e2m3": dict(bias=1, max=7.5, min_normal=1.0, max_subnormal=0.875, min_subnormal=0.125),
    "fp4_e2m1": dict(bias=1, max=6.0, min_normal=1.0, max_subnormal=0.5, min_subnormal=0.5),
}


@pytest.mark.parametrize("name", sorted(OCP_MX))
def test_mx_element_formats_match_ocp_table(name):
    fmt, spec = P.get_format(name), OCP_MX[name]
    assert (fmt.bias, fmt.max, fmt.min_normal, fmt.min_subnormal) == (spec["bias"], spec["max"], spec["min_normal"], spec["min_subnormal"])
    values = P.all_values(fmt)
    assert not values.isnan().any() and not values.isinf().any()  # no inf/NaN encodings
    subnormals = values[(values > 0) & (values < fmt.min_normal)]
    assert subnormals.max().item() == spec["max_subnormal"]


def test_fp4_values_are_the_spec_list():
    values = P.all_values("fp4_e2m1")
    assert values[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert values[8:].tolist() == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def test_fp6_e2m3_positive_values():
    expected = [k / 8 for k in range(8)] + [(1 + k / 8) * 2**e for e in range(3) for k in range(8)]
    assert P.all_values("fp6_e2m3")[:32].tolist() == expected


def test_get_format_rejects_unknown_names():
    with pytest.raises(ValueError, match="fp8_e4m3"):
        P.get_format("fp7")
    with pytest.raises(ValueError, match="exponent_bits"):
        P.FloatFormat("bad", 0, 3, 1)
    with pytest.raises(ValueError, match="specials"):
        P.FloatFormat("bad", 4, 3, 7, "fnuz")


# ----------------------------------------------------------------------------- decode
@pytest.mark.parametrize("name", SMALL_TORCH_FORMATS)
def test_decode_every_code_matches_torch(name):
    fmt = P.get_format(name)
    codes = torch.arange(1 << fmt.bits)
    assert_same_values(P.decode(codes, fmt), torch_values(codes, fmt))
    assert_same_values(P.all_values(fmt), torch_values(codes, fmt))


def test_decode_fp32_random_codes_and_twos_complement():
    fmt = P.get_format("fp32")
    codes = torch.randint(0, 1 << 32, (200_000,), generator=torch.Generator().manual_seed(0))
    assert_same_values(P.decode(codes, fmt), torch_values(codes, fmt))
    half = torch.randn(1000).half()
    assert_same_values(P.decode(half.view(torch.int16), "fp16"), half.double())


def test_decode_rejects_bad_codes():
    with pytest.raises(TypeError, match="codes"):
        P.decode(torch.tensor([1.0]), "fp16")
    with pytest.raises(ValueError, match="codes"):
        P.decode(torch.tensor([256]), "fp8_e4m3")


# ----------------------------------------------------------------------------- encode
def random_fp32_inputs(n: int, seed: int = 0) -> torch.Tensor:
    """A million-ish fp32 values with every hard case: raw bit patterns (all classes, NaNs,
    infs, fp32 subnormals), log-uniform magnitudes across every format's range, exact ties
    between neighbouring values of the small formats, their overflow edges, and ±0/±inf/NaN."""
    g = torch.Generator().manual_seed(seed)
    bit_patterns = torch.randint(-(1 << 31), 1 << 31, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    log_uniform = torch.exp2(torch.empty(n).uniform_(-30, 20, generator=g)) * torch.randn(n, generator=g).sign()
    parts = [bit_patterns, log_uniform]
    for name in SMALL_TORCH_FORMATS:
        values = P.all_values(name)
        values = values[torch.isfinite(values)].unique()
        ties = (values[1:] + values[:-1]) / 2  # exact midpoints (representable in fp32)
        fmt = P.get_format(name)
        edges = torch.tensor([fmt.max, fmt.max + P.ulp(fmt.max, fmt).item() / 2, fmt.max * 1.0001, fmt.min_subnormal / 2,
                              fmt.min_subnormal * 0.75, fmt.min_subnormal / 2 * 1.001, fmt.min_normal])
        parts += [ties.float(), edges.float(), -edges.float()]
    parts.append(torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan]))
    return torch.cat(parts)


@pytest.mark.parametrize("name", SMALL_TORCH_FORMATS)
def test_encode_matches_torch_cast_on_a_million_values(name):
    fmt = P.get_format(name)
    x = random_fp32_inputs(500_000)
    assert x.numel() >= 1_000_000
    got, expected = P.encode(x, fmt), torch_codes(x, fmt)
    nan = torch.isnan(x)
    assert torch.isnan(P.decode(got[nan], fmt)).all()
    # torch releases before pytorch/pytorch#178817 turned float8_e4m3fn overflow into NaN; later ones saturate, as encode does.
    old_torch_overflow = torch.isnan(P.decode(expected, fmt)) & ~nan
    assert (P.decode(got[old_torch_overflow], fmt).abs() == fmt.max).all()
    mismatch = (got != expected) & ~nan & ~old_torch_overflow
    assert not mismatch.any(), f"first mismatch at x={x[mismatch][:5].tolist()}"


def test_encode_fp32_matches_torch_cast_from_float64():
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(200_000, dtype=torch.float64, generator=g) * torch.exp2(torch.randint(-160, 140, (200_000,), generator=g)).double(),
                   torch.tensor([3.4028235677973366e38, 3.4028235e38 * 1.0000001, 1e-46, 7.006492321624085e-46])])
    fmt = P.get_format("fp32")
    assert torch.equal(P.encode(x, fmt), torch_codes(x, fmt))


def test_encode_overflow_rules():
    big = torch.tensor([1e6, -1e6, math.inf])
    assert P.decode(P.encode(big, "fp16"), "fp16").tolist() == [math.inf, -math.inf, math.inf]
    assert P.decode(P.encode(big, "fp16", saturate=True), "fp16").tolist() == [65504, -65504, 65504]
    assert P.decode(P.encode(big, "fp8_e4m3"), "fp8_e4m3").tolist() == [448, -448, 448]
    assert P.decode(P.encode(big, "fp8_e4m3", saturate=False), "fp8_e4m3").isnan().all()
    assert P.round_to(big, "fp4_e2m1").tolist() == [6, -6, 6]  # MX elements always saturate
    with pytest.raises(ValueError, match="saturate"):
        P.encode(big, "fp4_e2m1", saturate=False)
    with pytest.raises(ValueError, match="NaN"):
        P.encode(torch.tensor([math.nan]), "fp6_e3m2")
    assert P.round_to(torch.tensor([math.nan]), "fp8_e5m2").isnan().all()


def test_encode_rounds_ties_to_even():
    # 1 + eps/2 sits halfway between 1 and 1 + eps: the even mantissa (1.0) wins;
    # 1 + 3 eps/2 is halfway between 1 + eps and 1 + 2 eps: 1 + 2 eps wins.
    for name in ["fp16", "bf16", "fp8_e4m3", "fp4_e2m1"]:
        eps = P.get_format(name).eps
        assert P.round_to([1 + eps / 2, 1 + 1.5 * eps], name).tolist() == [1.0, 1 + 2 * eps]


def test_one_plus_a_thousandth():
    assert P.round_to(1 + 1e-3, "bf16").item() == 1.0
    assert P.round_to(1 + 1e-3, "fp16").item() == 1 + 2**-10
    assert (torch.tensor(1.0, dtype=torch.bfloat16) + 1e-3).item() == 1.0


# ----------------------------------------------------------------------------- ulp, neighbours
@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp4_e2m1"])
def test_ulp_is_the_gap_to_the_next_value(name):
    fmt = P.get_format(name)
    positive = P.all_values(fmt)[: fmt.max_code + 1]  # +0 .. +max in code order
    gaps = positive[1:] - positive[:-1]
    assert torch.equal(P.ulp(positive[:-1], fmt), gaps)


def test_neighbours_and_classify():
    assert P.neighbours(0x7E, "fp8_e4m3") == (416.0, None)
    assert P.neighbours(0x7B, "fp8_e5m2") == (49152.0, math.inf)
    assert P.neighbours(0x00, "fp16") == (-P.get_format("fp16").min_subnormal, P.get_format("fp16").min_subnormal)
    assert P.neighbours(0x7F, "fp8_e4m3") == (None, None)
    assert [P.classify(c, "fp8_e5m2") for c in (0x00, 0x01, 0x04, 0x7C, 0x7D)] == ["zero", "subnormal", "normal", "inf", "nan"]
    with pytest.raises(ValueError, match="code"):
        P.classify(256, "fp8_e4m3")


def test_explain_code_and_cast_table():
    text = P.explain_code(0x3C00, "fp16")
    assert "0 01111 0000000000" in text and "= 1  (normal)" in text and "0.999512 < value < 1.00098" in text
    rows = {r["format"]: r for r in P.cast_table(0.1)}
    assert rows["bf16"]["stored"] == torch.tensor(0.1).bfloat16().item()
    assert rows["fp16"]["stored"] == torch.tensor(0.1, dtype=torch.float64).half().item()
    assert rows["fp4_e2m1"]["stored"] == 0.0 and rows["fp4_e2m1"]["rel_error"] == 1.0
    assert math.isnan({r["format"]: r for r in P.cast_table(math.nan)}["fp4_e2m1"]["stored"])
    with pytest.raises(TypeError, match="value"):
        P.cast_table("0.1")


# ----------------------------------------------------------------------------- properties
finite_floats = st.floats(allow_nan=False, allow_infinity=False, width=64)
names = st.sampled_from(sorted(P.FORMATS))


@settings(max_examples=300, deadline=None)
@given(x=finite_floats, name=names)
def test_round_to_is_idempotent(x, name):
    once = P.round_to(x, name, saturate=True)
    assert torch.equal(P.round_to(once, name, saturate=True), once)


@settings(max_examples=300, deadline=None)
@given(x=finite_floats, y=finite_floats, name=names)
def test_round_to_is_monotonic(x, y, name):
    lo, hi = min(x, y), max(x, y)
    assert P.round_to(lo, name, saturate=True).item() <= P.round_to(hi, name, saturate=True).item()


@settings(max_examples=300, deadline=None)
@given(x=finite_floats, name=names)
def test_round_to_is_within_half_an_ulp(x, name):
    fmt = P.get_format(name)
    if abs(x) > fmt.max:
        return
    error = abs(P.round_to(x, fmt).item() - x)
    assert error <= P.ulp(x, fmt).item() / 2


# ----------------------------------------------------------------------------- mixed precision
def test_small_updates_vanish_in_bf16_but_not_with_fp32_master_weights():
    assert P.accumulate(1.0, 1e-3, 100, torch.bfloat16) == 1.0  # 1e-3 < ulp(1)/2 = 2^-8
    with_master = P.accumulate(1.0, 1e-3, 100, torch.bfloat16, master_dtype=torch.float32)
    assert with_master == torch.tensor(1.1).bfloat16().item()


def test_gradient_underflow():
    values = torch.tensor([1e-9, 1e-8, 1e-3, 0.0])
    assert P.gradient_underflow(values, "fp16") == pytest.approx(2 / 3)
    assert P.gradient_underflow(values, "fp16", scale=2.0**16) == 0.0


def grad_sequence():
    """Gradients that overflow at some steps (inf, NaN) and are fine at others."""
    pattern = [1.0, math.inf, 1.0, 1.0, 1.0, math.nan, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3e38, 1.0]
    return [torch.tensor([0.5, v]) for v in pattern]


@pytest.mark.parametrize("kwargs", [dict(), dict(init_scale=1024.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=2)])
def test_loss_scaler_makes_the_same_decisions_as_grad_scaler(kwargs):
    kwargs = {"init_scale": 2.0**16, "growth_interval": 3, **kwargs}
    ours_param, torch_param = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    ours_opt, torch_opt = torch.optim.SGD([ours_param], lr=0.1), torch.optim.SGD([torch_param], lr=0.1)
    ours, reference = P.DynamicLossScaler(**kwargs), torch.amp.GradScaler("cpu", **kwargs)
    reference.scale(torch.tensor(1.0))  # GradScaler creates its scale tensor lazily
    for grad in grad_sequence():
        for param, scale in ((ours_param, ours.scale), (torch_param, reference.get_scale())):
            param.grad = grad * scale  # what backward of a scaled loss would leave
        ours.unscale_(ours_opt)
        reference.unscale_(torch_opt)
        torch.testing.assert_close(ours_param.grad, torch_param.grad, rtol=0, atol=0, equal_nan=True)
        ours.step(ours_opt)
        reference.step(torch_opt)
        ours.update()
        reference.update()
        assert ours.scale == reference.get_scale()
        assert ours.growth_tracker == reference._get_growth_tracker()
        assert torch.equal(ours_param.data, torch_param.data)
    assert ours.skipped_steps == 3


def test_loss_scaler_misuse_is_a_clear_error():
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.ones(1)
    scaler = P.DynamicLossScaler()
    with pytest.raises(RuntimeError, match="update"):
        scaler.update()
    scaler.unscale_([p])
    with pytest.raises(RuntimeError, match="already"):
        scaler.unscale_([p])
    with pytest.raises(ValueError, match="backoff_factor"):
        P.DynamicLossScaler(backoff_factor=2.0)


def test_update_scale_rule():
    assert P.update_scale(8.0, 5, True) == (4.0, 0)
    assert P.update_scale(8.0, 0, False, growth_interval=2) == (8.0, 1)
    assert P.update_scale(8.0, 1, False, growth_interval=2) == (16.0, 0)


# ----------------------------------------------------------------------------- FP8 scaling
def test_amax_scale_maps_amax_onto_the_format_max():
    x = torch.tensor([0.5, -3.0, 1.0, math.nan, math.inf])
    assert P.amax_scale(x, "fp8_e4m3") == 3.0 / 448
    assert P.amax_scale(x, "fp8_e5m2", margin=2) == 3.0 / 57344 * 4
    assert P.amax_scale(torch.zeros(3)) == 1.0
    codes = P.quantize(x[:3], P.amax_scale(x), "fp8_e4m3")
    assert P.decode(codes, "fp8_e4m3").abs().max().item() == 448
    with pytest.raises(ValueError, match="margin"):
        P.amax_scale(x, margin=-1)


def test_quantize_matches_torch_scaled_cast():
    x = torch.randn(10_000) * 5
    scale = P.amax_scale(x)
    expected = (x / torch.tensor(scale, dtype=torch.float32)).to(torch.float8_e4m3fn).view(torch.uint8).long()
    assert torch.equal(P.quantize(x, scale), expected)
    restored = P.dequantize(P.quantize(x, scale), scale)
    assert ((restored - x).abs() <= x.abs() * 2**-4 + 2**-9 * scale + 1e-12).all()  # half an ulp


def test_scaling_report_sees_clipping_and_underflow():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    good = P.scaling_report(x, P.amax_scale(x))
    too_small = P.scaling_report(x, P.amax_scale(x) / 64)
    too_big = P.scaling_report(x, P.amax_scale(x) * 2**16)
    assert good["clipped"] == 0 and good["flushed"] < 1e-3 and good["rel_error"] < 0.05
    assert too_small["clipped"] > 0.1 and too_small["rel_error"] > good["rel_error"]
    assert too_big["flushed"] > 0.1 and too_big["rel_error"] > good["rel_error"]


def test_delayed_scaling_uses_the_history_before_this_step():
    recipe = P.DelayedScaling(history_len=2, fmt="fp8_e4m3")
    _, first = recipe(torch.tensor([4.0]))
    assert first == 1.0  # no history yet
    _, second = recipe(torch.tensor([1.0]))
    assert second == 4.0 / 448
    codes, third = recipe(torch.tensor([100.0]))  # a spike: clipped with the old scale
    assert third == 4.0 / 448 and P.decode(codes, "fp8_e4m3").item() == 448
    assert recipe.scale == 100.0 / 448
    recipe(torch.tensor([1.0]))
    recipe(torch.tensor([1.0]))
    assert recipe.scale == 1.0 / 448  # the spike has left the window


# ----------------------------------------------------------------------------- measured in the notebook
@pytest.fixture(scope="module")
def tiny_model_batch():
    from labkit.data import ArithmeticTask, get_batch
    from labkit.model import TransformerLM, tiny_config

    torch.manual_seed(0)
    task = ArithmeticTask()
    model = TransformerLM(tiny_config(task.vocab_size, d_model=32, num_layers=1, d_ff=64))
    x, y = get_batch(task.tokens("train"), 4, 16, "cpu")
    return task, model, x, y


def test_fp16_gradients_underflow_and_loss_scaling_recovers_them(tiny_model_batch):
    _, model, x, y = tiny_model_batch
    plain = P.autocast_gradient_error(model, x, y, torch.float16)
    assert plain["underflow"] == 0 and plain["rel_error"] < 1e-2
    tiny = P.autocast_gradient_error(model, x, y, torch.float16, loss_multiplier=2.0**-20)
    assert tiny["underflow"] > 0.9  # gradients below fp16's 2^-24 become 0
    scaled = P.autocast_gradient_error(model, x, y, torch.float16, loss_multiplier=2.0**-20, loss_scale=2.0**16)
    assert scaled["underflow"] < 0.01 and scaled["rel_error"] < 0.05
    assert P.autocast_gradient_error(model, x, y, torch.bfloat16, loss_multiplier=2.0**-20)["underflow"] == 0  # bf16 has fp32's range
    assert all(p.grad is None for p in model.parameters())


def test_train_in_precision_runs_every_mode(tiny_model_batch):
    from labkit.model import TransformerLM
    from labkit.train import TrainConfig

    task, model, _, _ = tiny_model_batch
    config = TrainConfig(steps=3, batch_size=4, context_length=16, eval_every=3, eval_batches=1, warmup_iters=1)
    losses = {}
    for mode in P.PRECISION_MODES:
        torch.manual_seed(0)
        fresh = TransformerLM(model.config)
        scaler = P.DynamicLossScaler(growth_interval=1) if mode == "fp16+scaler" else None
        history, used, trace = P.train_in_precision(mode, fresh, task.tokens("train"), task.tokens("val"), config, scaler=scaler, progress=False)
        assert len(history.train_loss) == 3 and all(p.dtype == torch.float32 for p in fresh.parameters())  # fp32 master weights
        losses[mode] = history.train_loss[0]
        if mode == "fp16+scaler":
            assert used is scaler and trace == [2.0**17, 2.0**18, 2.0**19]  # grows every good step
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)
    assert losses["fp16"] == pytest.approx(losses["fp32"], rel=2e-3)
    with pytest.raises(ValueError, match="mode"):
        P.train_in_precision("fp8", model, task.tokens("train"), None, config)
    with pytest.raises(ValueError, match="scaler"):
        P.train_in_precision("bf16", model, task.tokens("train"), None, config, scaler=P.DynamicLossScaler())


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_matmul_equals_torch_scaled_pipeline(fmt):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(48, 80, generator=g), torch.randn(80, 33, generator=g)
    dtype = P.get_format(fmt).torch_dtype
    sa, sb = a.abs().max() / P.get_format(fmt).max, b.abs().max() / P.get_format(fmt).max
    expected = torch._scaled_mm((a / sa).to(dtype), (b.t() / sb).to(dtype).t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    got = P.fp8_matmul(a, b, fmt)
    assert torch.equal(got, expected)
    assert P.relative_error(got, a @ b) < {"fp8_e4m3": 0.06, "fp8_e5m2": 0.12}[fmt]
    with pytest.raises(ValueError, match="a, b"):
        P.fp8_matmul(a, a)


def test_fake_quantize_per_tensor_and_per_tile_equal_torch_casts():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 256, generator=g) * torch.logspace(-4, 2, 4).unsqueeze(1)
    x[2, 128:] = 0.0  # an all-zero tile gets scale 1 and stays zero
    dtype = torch.float8_e4m3fn
    scale = x.abs().max() / 448
    # same codes; the read-back values may differ by the scale's fp32 rounding (1e-7), never by a code (6%)
    torch.testing.assert_close(P.fake_quantize(x), ((x / scale).to(dtype).float() * scale).double(), rtol=1e-6, atol=0)
    got = P.fake_quantize(x, block=(1, 128))
    for r in range(4):
        for c in (0, 128):
            tile = x[r, c:c + 128]
            s = tile.abs().max() / 448 if tile.abs().max() > 0 else torch.tensor(1.0)
            torch.testing.assert_close(got[r, c:c + 128], (tile / s).to(dtype).double() * s.double(), rtol=1e-6, atol=0)
    blocks = P.fake_quantize(x.t().contiguous(), block=(128, 2))
    assert blocks.shape == (256, 4)
    with pytest.raises(ValueError, match="block"):
        P.fake_quantize(x, block=(1, 100))
    with pytest.raises(ValueError, match="x"):
        P.fake_quantize(x.flatten())


def test_fp8_matmul_report_sees_outliers_that_the_norm_hides():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
    gaussian = P.fp8_matmul_report(a, b)
    # independent: the torch pipeline with per-tensor scales, product in float64
    sa, sb = a.abs().max() / 448, b.abs().max() / 448
    a8 = (a / sa).to(torch.float8_e4m3fn).double() * sa.double()
    b8 = (b / sb).to(torch.float8_e4m3fn).double() * sb.double()
    assert gaussian["rel_error"] == pytest.approx(P.relative_error(a8 @ b8, a.double() @ b.double()), rel=1e-6)
    assert gaussian["rel_error"] == pytest.approx(P.relative_error(P.fp8_matmul(a, b), a @ b), rel=0.05)
    outliers = a.clone()
    outliers.view(-1)[torch.randperm(a.numel(), generator=g)[:8]] = 1e5
    clean_rows = ~(outliers.abs() > 100).any(dim=1)
    per_tensor = P.fp8_matmul_report(outliers, b, rows=clean_rows)
    tiles = P.fp8_matmul_report(outliers, b, rows=clean_rows, a_block=(1, 128), b_block=(128, 128))
    expected_flushed = ((outliers / (1e5 / 448)).to(torch.float8_e4m3fn).float() == 0).double().mean().item()
    assert per_tensor["flushed_a"] == pytest.approx(expected_flushed)
    assert per_tensor["flushed_a"] > 0.05 and tiles["flushed_a"] < 0.01
    assert per_tensor["rel_error"] < 1.5 * gaussian["rel_error"]  # the outliers dominate the norm ...
    assert per_tensor["rows_rel_error"] > 2 * gaussian["rows_rel_error"]  # ... of an output whose ordinary rows got worse
    assert tiles["rows_rel_error"] == pytest.approx(gaussian["rows_rel_error"], rel=0.1)
    with pytest.raises(ValueError, match="rows"):
        P.fp8_matmul_report(a, b, rows=torch.zeros(256, dtype=torch.bool))


# ----------------------------------------------------------------------------- widgets (callbacks are the functions above)
def test_value_ranges_plot_shows_every_format_and_its_range():
    import matplotlib

    matplotlib.use("Agg")
    from labkit.widgets import precision as W

    fig = W.plot_value_ranges()
    full, zoom = fig.axes[:2]
    labels = [t.get_text().split(" ")[0] for t in full.get_yticklabels()]
    assert sorted(labels) == sorted(P.FORMATS)  # fp32 and fp6_e2m3 included
    for row, name in enumerate(reversed(labels)):
        fmt = P.get_format(name)
        bars = [p for p in full.patches if abs(p.get_y() + p.get_height() / 2 - (len(labels) - 1 - row)) < 1e-9]
        assert min(p.get_x() for p in bars) == math.floor(math.log2(fmt.min_subnormal))
        assert max(p.get_x() + p.get_width() for p in bars) == math.floor(math.log2(fmt.max)) + 1
    assert zoom.get_xlim() == (-26, 17)
    matplotlib.pyplot.close(fig)


def test_relative_error_plot_follows_each_formats_overflow_rule():
    import matplotlib

    matplotlib.use("Agg")
    from labkit.widgets import precision as W

    fig = W.plot_relative_error(("fp16", "fp8_e4m3"), low=10, high=20, bins=40, per_bin=4)
    fp16, e4m3 = (line for line in fig.axes[0].lines if line.get_label().startswith("fp"))
    assert "inf" in fp16.get_label() and "saturates" in e4m3.get_label()
    x16, y16 = fp16.get_data()
    assert (y16[x16 > 65520] == 2**0.5).all()  # fp16 overflows to inf, as in section 3 (70000 -> inf)
    x8, y8 = e4m3.get_data()
    assert ((y8[x8 > 2**10] < 1) & (y8[x8 > 2**10] > 0.5)).all()  # E4M3 saturates at 448: |448 - x| / x < 1
    matplotlib.pyplot.close(fig)
    fig = W.plot_relative_error(("fp16", "fp8_e5m2"), low=10, high=20, bins=40, per_bin=4)
    fp16, e5m2 = (line for line in fig.axes[0].lines if line.get_label().startswith("fp"))
    (x16, y16), (x5, y5) = fp16.get_data(), e5m2.get_data()
    assert (y16[x16 > 65520] == 2**0.5).all() and (y5[x5 > 65520] == 2**1.0).all()  # two overflows, two levels
    matplotlib.pyplot.close(fig)


# ----------------------------------------------------------------------------- widgets (callbacks are the functions above)
def test_bit_explorer_round_trips_bits_values_and_formats():
    pytest.importorskip("ipywidgets")
    from labkit.widgets import precision as W

    assert W.bits_of(0x7E, 8) == [False, True, True, True, True, True, True, False]
    assert W.code_of(W.bits_of(0x3C00, 16)) == 0x3C00
    explorer = W.bit_explorer("fp8_e4m3", 1.0)
    (menu, value_box), bits, report = explorer.children[0].children, explorer.children[1].children, explorer.children[2]
    assert "code 0x38" in report.value and len(bits) == 8
    bits[-1].value = True  # click the last mantissa bit
    assert value_box.value == 1.125 and "code 0x39" in report.value
    value_box.value = 500.0  # saturates
    assert "= 448" in report.value
    menu.value = "fp16"
    assert len(explorer.children[1].children) == 16 and "= 500" in report.value


def test_cast_explorer_and_figures(capsys):
    pytest.importorskip("ipywidgets")
    import matplotlib

    matplotlib.use("Agg")
    from labkit.widgets import precision as W

    W.print_cast_table(0.1, ["bf16", "fp4_e2m1"])
    out = capsys.readouterr().out
    assert "0.100097656" in out and "fp4_e2m1" in out
    W.cast_explorer(0.5)
    for fig in (W.draw_bit_layouts(), W.plot_value_ranges(), W.plot_relative_error(bins=20, per_bin=8),
                W.plot_gradient_magnitudes(torch.randn(1000) * 1e-6)):
        matplotlib.pyplot.close(fig)


# ----------------------------------------------------------------------------- stochastic rounding
@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"])
def test_stochastic_round_lands_on_a_neighbour_and_is_unbiased(fmt):
    g = torch.Generator().manual_seed(0)
    f = P.get_format(fmt)
    x = (torch.rand(1000, generator=g, dtype=torch.float64) * 2 - 1) * f.max * 0.9
    x = torch.cat([x, x * 2.0**-20, P.round_to(x, fmt)])  # subnormals too, and values already in the format
    samples = torch.stack([P.stochastic_round(x, fmt, g) for _ in range(200)])
    assert torch.equal(P.round_to(samples, fmt), samples)  # every result is a value of the format
    spacing = P.ulp(x, fmt)
    assert ((samples - x).abs() < spacing).all()  # one of the two neighbours
    exact = P.round_to(x, fmt) == x
    assert (samples[:, exact] == x[exact]).all()  # representable values stay put
    mean_error = (samples.mean(0) - x) / spacing  # unbiased: the mean error shrinks like 1/sqrt(samples)
    assert mean_error.abs().max() < 0.25 and mean_error.mean().abs() < 0.01


def test_stochastic_round_saturates_and_refuses_non_finite_values():
    assert P.stochastic_round(torch.tensor([500.0, -1e4]), "fp8_e4m3").tolist() == [448.0, -448.0]
    assert P.stochastic_round(torch.tensor([-0.0, 0.0]), "bf16").tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="finite"):
        P.stochastic_round(torch.tensor([math.inf]), "bf16")
