"""labkit.precision's simulated FP8 training (Fp8Recipe, Fp8Linear, use_fp8) against labkit's own
bit-level quantizer (encode/decode, independent of torch's float8 casts) and hand-made histories."""
import pytest
import torch

import labkit  # noqa: F401  (sets up Triton's interpreter before anything imports triton)
from labkit import precision as P
from labkit.data import ArithmeticTask
from labkit.model import TransformerLM, tiny_config
from labkit.nn import Linear
from labkit.train import TrainConfig


def read_back(x, scale, fmt):
    """x / scale in fmt and back, through labkit's encode/decode (float64)."""
    return P.dequantize(P.quantize(x, scale, fmt), scale, fmt).reshape(x.shape)


def layer(recipe, d_in=16, d_out=8, seed=0):
    torch.manual_seed(seed)
    return P.Fp8Linear(Linear(d_in, d_out), recipe)


CURRENT = {"hybrid": P.Fp8Recipe("fp8_e4m3", "fp8_e5m2", "current"), "e4m3": P.Fp8Recipe("fp8_e4m3", "fp8_e4m3", "current")}


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_cast_is_labkits_quantizer_and_saturates(fmt):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-20, 20, (4096,), generator=g).float())
    x[:3] = torch.tensor([1e30, -1e30, 0.0])
    scale = 0.37
    assert torch.equal(P.fp8_cast(x, scale, fmt).double(), P.decode(P.quantize(x, scale, fmt), fmt))
    assert P.fp8_cast(x, scale, fmt)[:2].tolist() == [P.get_format(fmt).max, -P.get_format(fmt).max]  # no inf, no NaN


@pytest.mark.parametrize("name", ["hybrid", "e4m3"])
def test_forward_and_backward_equal_a_quantize_dequantize_matmul(name):
    recipe = CURRENT[name]
    fp8 = layer(recipe)
    x = torch.randn(2, 5, 16, requires_grad=True)
    grad_out = torch.randn(2, 5, 8) * 1e-3
    y = fp8(x)
    y.backward(grad_out)
    xs, ws, gs = (P.amax_scale(t, f) for t, f in ((x, recipe.forward), (fp8.weight, recipe.forward), (grad_out, recipe.backward)))
    xq, wq, gq = read_back(x.detach(), xs, recipe.forward), read_back(fp8.weight.detach(), ws, recipe.forward), read_back(grad_out, gs, recipe.backward)
    torch.testing.assert_close(y.double(), xq @ wq.T, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(x.grad.double(), gq @ wq, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(fp8.weight.grad.double(), gq.reshape(-1, 8).T @ xq.reshape(-1, 16), rtol=1e-6, atol=1e-12)
    # the gradient really went through the backward format: the other FP8 format gives another dX
    other = "fp8_e4m3" if recipe.backward == "fp8_e5m2" else "fp8_e5m2"
    assert not torch.allclose(x.grad.double(), read_back(grad_out, P.amax_scale(grad_out, other), other) @ wq, rtol=1e-6, atol=0)


def test_under_autocast_the_output_is_the_fp32_product_rounded_to_bf16():
    fp8 = layer(CURRENT["hybrid"])
    x = torch.randn(3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8(x)
    assert y.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(y, fp8(x).to(torch.bfloat16))


def test_delayed_scaling_uses_the_largest_amax_of_the_history():
    recipe = P.Fp8Recipe(scaling="delayed", history_len=2)
    scaling = P.Fp8TensorScaling("fp8_e4m3", recipe)
    amaxes = [3.0, 100.0, 5.0, 7.0]
    scales = [scaling.cast(torch.tensor([a, -a / 2]))[1] for a in amaxes]
    assert scales[0] == 1.0  # no history yet
    assert scales[1] == pytest.approx(3.0 / 448)
    assert scales[2] == pytest.approx(100.0 / 448)  # max(3, 100)
    assert scales[3] == pytest.approx(100.0 / 448)  # max(100, 5): 3 has left the window
    assert list(scaling.history.amax_history) == [5.0, 7.0]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_a_tensor_that_outgrows_its_history_saturates_and_is_counted(fmt):
    scaling = P.Fp8TensorScaling(fmt, P.Fp8Recipe(forward=fmt, backward=fmt, scaling="delayed"))
    scaling.cast(torch.full((8,), 1.0))  # history: amax 1 -> the next scale is 1 / max
    spike = torch.tensor([0.5, 1.0, 1.03, 4.0, -100.0, 0.0, 1e-30, 2.0])
    values, scale = scaling.cast(spike)
    fmt_max = P.get_format(fmt).max
    assert scale == pytest.approx(1.0 / fmt_max)
    assert torch.isfinite(values).all()
    assert values[[3, 4, 7]].tolist() == [fmt_max, -fmt_max, fmt_max]  # clamped, as Transformer Engine's casts do
    nonzero, flushed, saturated = scaling.counts[-1]
    # 1.03 is above max but rounds to max anyway (within half an ulp): not an overflow
    assert (nonzero, flushed, saturated) == (7, 1, 3)


def test_use_fp8_converts_every_linear_but_the_head_and_keeps_the_parameters():
    torch.manual_seed(0)
    model = TransformerLM(tiny_config(20))
    keys, params = list(model.state_dict()), {name: p for name, p in model.named_parameters()}
    tokens = torch.randint(0, 20, (2, 12))
    reference = model(tokens)
    layers = P.use_fp8(model, P.Fp8Recipe())
    assert len(layers) == 2 * 7 and all(isinstance(m, P.Fp8Linear) for m in layers)
    assert isinstance(model.lm_head, Linear) and not isinstance(model.lm_head, P.Fp8Linear)
    assert list(model.state_dict()) == keys
    assert all(params[name] is p for name, p in model.named_parameters())
    model.eval()
    with torch.no_grad():
        out = model(tokens)  # delayed scaling's first cast uses scale 1; activations and weights fit E4M3's range
    assert P.relative_error(out, reference) < 0.1
    assert all(not s.counts for m in layers for s in (m.input_scaling, m.weight_scaling, m.grad_scaling))  # evaluation records nothing


def _train_tiny_adder(recipe, steps):
    """``train_fp8`` of a tiny model on 2-digit addition for ``steps`` steps (seed 0): its history and FP8 layers."""
    task = ArithmeticTask(num_digits=2, op="+", reverse_answer=True)
    config = TrainConfig(steps=steps, batch_size=4, context_length=16, warmup_iters=1, eval_every=steps, eval_batches=1)
    torch.manual_seed(0)
    return P.train_fp8(recipe, TransformerLM(tiny_config(task.vocab_size)), task.tokens("train"), task.tokens("val"),
                       config, progress=False)


def test_train_fp8_learns_and_counts_every_step():
    history, layers = _train_tiny_adder(P.Fp8Recipe(scaling="current"), steps=6)
    assert len(history.train_loss) == 6 and history.train_loss[-1] < history.train_loss[0]
    assert all(len(m.grad_scaling.counts) == 6 for m in layers)
    counts = P.fp8_cast_counts(layers, "grad")
    assert 0 <= counts["flushed"] < 0.01 and counts["saturated"] == 0  # current scaling never overflows
    assert P.fp8_cast_counts(layers, "grad", steps=slice(0, 1)).keys() == {"flushed", "saturated"}


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="backward"):
        P.Fp8Recipe(backward="fp16")
    with pytest.raises(ValueError, match="scaling"):
        P.Fp8Recipe(scaling="just-in-time")
    with pytest.raises(ValueError, match="history_len"):
        P.Fp8Recipe(history_len=0)
    with pytest.raises(ValueError, match="fmt"):
        P.fp8_cast(torch.ones(2), 1.0, "bf16")
    with pytest.raises(ValueError, match="scale"):
        P.fp8_cast(torch.ones(2), 0.0)
    with pytest.raises(TypeError, match="linear"):
        P.Fp8Linear(torch.nn.ReLU(), P.Fp8Recipe())
    with pytest.raises(TypeError, match="recipe"):
        P.Fp8Linear(Linear(4, 4), "hybrid")
    with pytest.raises(ValueError, match="d_in"):
        layer(P.Fp8Recipe())(torch.ones(2, 3))
    with pytest.raises(ValueError, match="model"):
        P.use_fp8(torch.nn.Sequential(torch.nn.ReLU()), P.Fp8Recipe())
    with pytest.raises(ValueError, match="operand"):
        P.fp8_cast_counts([], "activations")
    with pytest.raises(TypeError, match="steps"):
        P.fp8_cast_counts([], "grad", steps=3)


def test_a_training_step_records_every_operand_and_delayed_scaling_uses_the_history():
    # The forward casts record too (a Function's forward runs with gradients off, so the layer decides): after one
    # delayed step each operand has one count and one amax in its history, and the next step scales by that amax.
    _, layers = _train_tiny_adder(P.Fp8Recipe(scaling="delayed"), steps=2)
    for layer in layers:
        for scaling in (layer.input_scaling, layer.weight_scaling, layer.grad_scaling):
            assert len(scaling.counts) == 2 and len(scaling.history.amax_history) == 2
        amax = max(layer.weight_scaling.history.amax_history)
        assert layer.weight_scaling.history.scale == pytest.approx(amax / P.get_format("fp8_e4m3").max)
    assert P.fp8_cast_counts(layers, "weight")["flushed"] > 0  # scale 1 at the first step: small weights underflow
