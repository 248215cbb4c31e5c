"""labkit.norms: the chapter-02 experiments, each against an independent reference."""
import labkit  # noqa: F401  (first: switches Triton to its interpreter on CPU)

import math

import numpy as np
import pytest
import torch

from labkit import norms
from labkit.data import ArithmeticTask
from labkit.model import TransformerLM, tiny_config
from labkit.nn import BatchNorm, GLU, RMSNorm
from labkit.train import TrainConfig, cross_entropy, train


# ----------------------------------------------------------------------------- which axis
@pytest.mark.parametrize("distribution", norms.DISTRIBUTIONS)
def test_each_norm_normalizes_its_own_axis(distribution):
    x = norms.make_batch(distribution, batch=4, seq=8, d_model=16)
    table = norms.compare_norms(x)
    ln, rms, bn = table["layernorm"], table["rmsnorm"], table["batchnorm"]
    # LayerNorm: every token has mean 0 and std ~1 (eps shifts it below 1 by at most eps/2)
    assert ln["token |mean| max"] < 1e-5 and ln["token std min"] > 0.99 and ln["token std max"] < 1 + 1e-5
    # RMSNorm: every token has RMS ~1, its mean is not removed
    assert rms["token rms min"] > 0.99 and rms["token rms max"] < 1 + 1e-5
    # BatchNorm: every feature has mean 0 and std ~1 over the batch
    assert bn["feature |mean| max"] < 1e-5 and bn["feature std min"] > 0.99 and bn["feature std max"] < 1 + 1e-5


def test_axis_statistics_against_numpy():
    x = norms.make_batch("feature offsets", batch=2, seq=3, d_model=5, seed=1)
    rows = x.reshape(-1, 5).numpy().astype(np.float64)
    stats = norms.axis_statistics(x)
    assert stats["token |mean| max"] == pytest.approx(np.abs(rows.mean(1)).max(), rel=1e-5)
    assert stats["token rms max"] == pytest.approx(np.sqrt((rows**2).mean(1)).max(), rel=1e-5)
    assert stats["feature std min"] == pytest.approx(rows.std(0).min(), rel=1e-5)
    assert stats["feature |mean| max"] > 1.0  # the offsets are there


def test_rmsnorm_keeps_the_mean_layernorm_removes():
    x = norms.make_batch("feature offsets", seed=2)
    table = norms.compare_norms(x)
    assert table["rmsnorm"]["token |mean| max"] > 0.1 > table["layernorm"]["token |mean| max"]


def test_make_batch_distributions():
    base = norms.make_batch("gaussian", seed=3)
    assert base.shape == (4, 8, 16)
    outliers = norms.make_batch("outlier features", seed=3)
    assert outliers[..., :2].std() > 10 * outliers[..., 2:].std()
    scales = norms.axis_statistics(norms.make_batch("token scales", seed=3))
    assert scales["token rms max"] / scales["token rms min"] > 10
    with pytest.raises(ValueError, match="distribution="):
        norms.make_batch("uniform")
    with pytest.raises(ValueError, match="kind="):
        norms.make_norm("groupnorm", 4)


@pytest.mark.parametrize("change", ["batchmates", "padding"])
def test_only_batchnorm_in_training_depends_on_the_batch(change):
    assert norms.batch_dependence("batchnorm", change) > 0.05
    assert norms.batch_dependence("batchnorm", change, training=False) == 0.0
    assert norms.batch_dependence("layernorm", change) == 0.0
    assert norms.batch_dependence("rmsnorm", change) == 0.0


def test_batchnorm_running_statistics_match_torch_over_steps():
    ours, ref = BatchNorm(6, momentum=0.2), torch.nn.BatchNorm1d(6, momentum=0.2)
    gen = torch.Generator().manual_seed(4)
    for _ in range(5):
        x = torch.randn(3, 7, 6, generator=gen) * 2 + 1
        out = ours(x)
        expected = ref(x.reshape(-1, 6)).reshape(x.shape)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.running_mean, ref.running_mean)
    torch.testing.assert_close(ours.running_var, ref.running_var)
    ours.eval(), ref.eval()
    x = torch.randn(2, 6, generator=gen)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- deep stacks
def test_deep_stack_without_norm_vanishes_and_explodes_like_the_closed_form():
    vanish = norms.deep_stack("none", num_layers=32, gain=1.0)
    explode = norms.deep_stack("none", num_layers=32, gain=2.0)
    # ReLU keeps half the second moment: E[h^2] scales by gain^2 / 2 per layer (Glorot std 1/sqrt(d))
    ratio_vanish = vanish.activation_std[-1] / vanish.activation_std[15]
    ratio_explode = explode.activation_std[-1] / explode.activation_std[15]
    assert math.log(ratio_vanish) == pytest.approx(16 * math.log(math.sqrt(0.5)), rel=0.35)
    assert math.log(ratio_explode) == pytest.approx(16 * math.log(math.sqrt(2.0)), rel=0.35)
    assert vanish.gradient_norm[0] < 1e-3 * vanish.gradient_norm[-1]
    assert explode.gradient_norm[0] > 1e3 * explode.gradient_norm[-1]


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_per_token_norms_keep_the_stack_stable_at_any_gain(norm):
    low, high = norms.deep_stack(norm, gain=1.0), norms.deep_stack(norm, gain=2.0)
    assert max(low.activation_std) / min(low.activation_std) < 1.5
    assert max(low.gradient_norm) / min(low.gradient_norm) < 10
    # the norm divides out the weights' scale: identical outputs and gradients
    np.testing.assert_allclose(low.activation_std, high.activation_std, rtol=1e-4)
    np.testing.assert_allclose(low.gradient_norm, high.gradient_norm, rtol=1e-3)


def test_deep_stack_validates():
    with pytest.raises(ValueError, match="activation="):
        norms.deep_stack(activation="swish")
    with pytest.raises(ValueError, match="gain="):
        norms.deep_stack(gain=0.0)


def test_post_norm_block_matches_a_hand_written_post_ln():
    torch.manual_seed(0)
    config = tiny_config(16, num_layers=1, norm="layernorm")
    model = norms.build_lm(config, "post")
    block = model.layers[0]
    x = torch.randn(2, 5, config.d_model)
    h = block.ln1(x + block.attn(x))
    torch.testing.assert_close(block(x), block.ln2(h + block.ffn(h)))
    assert isinstance(model.ln_final, torch.nn.Identity)
    with pytest.raises(ValueError, match="placement="):
        norms.build_lm(config, "middle")


def test_output_and_sandwich_blocks_match_hand_written_orders():
    torch.manual_seed(0)
    config = tiny_config(16, num_layers=1)
    x = torch.randn(2, 5, config.d_model)
    output = norms.build_lm(config, "output")
    block = output.layers[0]
    h = x + block.ln1(block.attn(x))   # OLMo 2: the norm on the sublayer's output, inside the residual branch
    torch.testing.assert_close(block(x), h + block.ln2(block.ffn(h)))
    sandwich = norms.build_lm(config, "sandwich")
    block = sandwich.layers[0]
    with torch.no_grad():
        block.ln1_out.weight.fill_(2.0)  # the output norms are modules of their own
    h = x + block.ln1_out(block.attn(block.ln1(x)))
    torch.testing.assert_close(block(x), h + block.ln2_out(block.ffn(block.ln2(h))))
    assert not isinstance(output.ln_final, torch.nn.Identity) and not isinstance(sandwich.ln_final, torch.nn.Identity)


def test_post_ln_last_layers_get_larger_gradients_than_pre_ln():
    pre = norms.block_gradient_norms("pre", num_layers=8, seq=16)
    post = norms.block_gradient_norms("post", num_layers=8, seq=16)
    assert len(pre) == len(post) == 8
    # Xiong et al. 2020: the last layer's gradient is ~sqrt(L) larger with Post-LN
    assert post[-1] > 2 * pre[-1]


def test_pre_ln_gradients_match_a_manual_backward():
    torch.manual_seed(5)
    config = tiny_config(64, context_length=16, d_model=64, num_layers=2, norm="layernorm")
    model = TransformerLM(config)
    tokens = torch.randint(0, 64, (8, 17))
    cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    expected = [math.sqrt(sum(p.grad.norm().item() ** 2 for p in b.ffn.parameters())) for b in model.layers]
    assert norms.block_gradient_norms("pre", num_layers=2, seq=16, seed=5) == pytest.approx(expected, rel=1e-5)

def test_sinusoidal_positions_match_the_closed_form():
    pe = norms.sinusoidal_positions(7, 6)
    for pos in range(7):
        for i in range(3):
            angle = pos / 10000 ** (2 * i / 6)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


@pytest.mark.parametrize("ffn", norms.FFN_KINDS)
def test_encoder_block_matches_a_hand_written_post_and_pre_ln(ffn):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    ln = lambda t: torch.nn.functional.layer_norm(t, (16,), eps=1e-5)  # weight 1, bias 0 at init

    def attention(block, t):  # softmax(q k^T / sqrt(d_head)) v per head, no mask (an encoder)
        heads = lambda w: (t @ w.weight.T).view(2, 5, 4, 4).transpose(1, 2)
        q, k, v = heads(block.q), heads(block.k), heads(block.v)
        weights = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)
        return (weights @ v).transpose(1, 2).reshape(2, 5, 16) @ block.out.weight.T

    def feed_forward(block, t):
        hidden = t @ block.w1.weight.T
        hidden = torch.relu(hidden) if ffn == "relu" else torch.nn.functional.silu(hidden) * (t @ block.w3.weight.T)
        return hidden @ block.w2.weight.T

    post, pre = norms.EncoderBlock(16, 4, ffn, "post"), norms.EncoderBlock(16, 4, ffn, "pre")
    h = ln(x + attention(post, x))
    torch.testing.assert_close(post(x), ln(h + feed_forward(post, h)))
    h = x + attention(pre, ln(x))
    torch.testing.assert_close(pre(x), h + feed_forward(pre, ln(h)))
    # d_ff: 4 d for ReLU; SwiGLU's 3 matrices get the same parameter count (labkit.norms.swiglu_d_ff)
    assert post.w1.weight.shape == ((64, 16) if ffn == "relu" else (norms.swiglu_d_ff(16), 16))
    # Xavier-uniform: bound sqrt(6 / (fan_in + fan_out))
    assert post.w2.weight.abs().max().item() <= math.sqrt(6 / sum(post.w2.weight.shape))


def test_ffn_gradient_profile_averages_single_seed_profiles():
    one, two = (norms.ffn_gradient_profile("post", num_layers=3, seq=8, seeds=(s,)) for s in (0, 1))
    both = norms.ffn_gradient_profile("post", num_layers=3, seq=8, seeds=(0, 1))
    assert both.gradient_norm == pytest.approx([(a + b) / 2 for a, b in zip(one.gradient_norm, two.gradient_norm)], rel=1e-6)
    assert both.stream_std == pytest.approx([(a + b) / 2 for a, b in zip(one.stream_std, two.stream_std)], rel=1e-6)
    # Post-LN: every block after the first reads a LayerNorm output, std 1 (up to eps)
    assert both.stream_std[1:] == pytest.approx([1.0, 1.0], abs=1e-3)
    assert both.last_over_first == both.gradient_norm[-1] / both.gradient_norm[0]


def test_ffn_gradient_profile_has_xiong_et_als_shape_and_labkits_reversal():
    """Xiong et al. 2020, Figure 3: Post-LN's FFN gradients grow towards the output in their
    ReLU encoder; with SwiGLU and no added positions (labkit's LM) the trend reverses."""
    paper = norms.ffn_gradient_profile("post", "relu", "sinusoidal")
    labkit_like = norms.ffn_gradient_profile("post", "swiglu", "none")
    pre = norms.ffn_gradient_profile("pre", "relu", "sinusoidal")
    assert paper.last_over_first > 1.05 and labkit_like.last_over_first < 0.9
    assert pre.last_over_first < 0.75  # Pre-LN: ~1 / std of a growing residual stream
    assert pre.stream_std == sorted(pre.stream_std) and paper.gradient_norm[-1] > 1.5 * pre.gradient_norm[-1]


def test_ffn_gradient_profile_validates():
    for kwargs, match in [(dict(placement="middle"), "placement="), (dict(placement="post", ffn="gelu"), "ffn="),
                          (dict(placement="post", positions="rope"), "positions="), (dict(placement="post", seeds=()), "seeds=")]:
        with pytest.raises(ValueError, match=match):
            norms.ffn_gradient_profile(**kwargs)


# ----------------------------------------------------------------------------- activations
def test_activation_derivatives_match_closed_forms():
    x = torch.linspace(-4, 4, 81, dtype=torch.float64)
    curves = norms.activation_curves(x)
    sig = torch.sigmoid(x)
    phi = torch.exp(-x**2 / 2) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
    torch.testing.assert_close(curves["silu"][1], sig * (1 + x * (1 - sig)))
    torch.testing.assert_close(curves["gelu"][1], cdf + x * phi)
    torch.testing.assert_close(curves["relu"][1], (x > 0).double())
    torch.testing.assert_close(curves["gelu"][0], torch.nn.functional.gelu(x))
    torch.testing.assert_close(curves["gelu (tanh)"][0], torch.nn.functional.gelu(x, approximate="tanh"))
    with pytest.raises(ValueError, match="names"):
        norms.activation_curves(x, ["elu"])


def test_swiglu_d_ff_equalizes_parameters():
    counts = norms.ffn_param_counts(768)
    assert counts["mlp params"] == 2 * 768 * 3072
    assert counts["swiglu d_ff"] == 2048
    assert counts["swiglu params"] == counts["mlp params"] == 3 * 768 * 2048
    assert norms.swiglu_d_ff(4096, multiple_of=256) == 11008  # LLaMA-7B's published hidden size
    assert norms.swiglu_d_ff(4096, multiple_of=256) >= 8 * 4096 / 3  # rounding up never loses capacity
    with pytest.raises(ValueError):
        norms.swiglu_d_ff(0)



def test_mlp_is_two_matrices_around_the_activation():
    torch.manual_seed(0)
    mlp = norms.MLP(6, 12, "gelu")
    x = torch.randn(2, 3, 6)
    expected = torch.nn.functional.gelu(x @ mlp.w1.weight.T) @ mlp.w2.weight.T
    assert torch.allclose(mlp(x), expected, atol=1e-6)
    assert sum(p.numel() for p in mlp.parameters()) == 2 * 6 * 12
    with pytest.raises(ValueError, match="activation"):
        norms.MLP(6, 12, "tanh")


def test_ffn_variant_lm_equal_parameters_and_shared_weights():
    models = {}
    for ffn in norms.FFN_VARIANTS:
        torch.manual_seed(3)
        models[ffn] = norms.ffn_variant_lm(15, ffn, d_model=48, num_layers=2, num_heads=4)
    gelu, swiglu = models["gelu"], models["swiglu"]
    assert gelu.num_params() == swiglu.num_params()
    assert all(isinstance(block.ffn, norms.MLP) and block.ffn.w1.d_out == 192 for block in gelu.layers)
    assert all(isinstance(block.ffn, GLU) and block.ffn.w1.d_out == 128 for block in swiglu.layers)
    # one seed: everything but the feed-forwards is the same
    shared = {name: p for name, p in swiglu.named_parameters() if ".ffn." not in name}
    assert shared and all(torch.equal(p, shared[name]) for name, p in gelu.named_parameters() if ".ffn." not in name)
    with pytest.raises(ValueError, match="ffn"):
        norms.ffn_variant_lm(15, "relu")
    with pytest.raises(ValueError, match="d_ff"):
        norms.ffn_variant_lm(15, "gelu", d_ff=100)


def test_train_ffn_variants_is_the_train_loop_per_variant_and_seed(monkeypatch):
    task = ArithmeticTask()
    config = TrainConfig(steps=3, batch_size=4, context_length=16, eval_batches=2, warmup_iters=0)
    model_args = dict(context_length=16, d_model=24, num_layers=1, num_heads=2)
    runs = norms.train_ffn_variants(task, ["gelu", "swiglu"], [0, 1], config, **model_args)
    assert [(run.ffn, run.seed) for run in runs] == [("gelu", 0), ("swiglu", 0), ("gelu", 1), ("swiglu", 1)]
    assert len({run.num_params for run in runs}) == 1
    # each run is labkit's train loop on the variant, from seed (weights) and seed + 1 (batches)
    from dataclasses import replace
    torch.manual_seed(1)
    model = norms.ffn_variant_lm(task.vocab_size, "swiglu", **model_args)
    torch.manual_seed(2)
    expected = train(model, task.tokens("train"), task.tokens("val"), replace(config, eval_every=3), progress=False)
    assert runs[3].val_loss == expected.val_loss[-1]
    monkeypatch.setenv("LABKIT_SEED", "1")   # make spread: every seed shifted
    shifted = norms.train_ffn_variants(task, ["swiglu"], [0], config, **model_args)
    assert shifted[0].val_loss == runs[3].val_loss and shifted[0].seed == 0

# ----------------------------------------------------------------------------- training
def test_train_placements_is_the_train_loop_per_placement_and_warmup():
    task = ArithmeticTask()
    config = TrainConfig(steps=4, batch_size=4, context_length=16, eval_every=4, eval_batches=1, warmup_iters=0)
    histories = norms.train_placements(task, [("post", 0), ("post", 2), ("pre", 0)], config, seed=1, num_layers=2)
    torch.manual_seed(1)
    model = norms.build_lm(tiny_config(task.vocab_size, num_layers=2), "post")
    expected = train(model, task.tokens("train"), None, config, progress=False)
    assert histories["post", 0].train_loss == expected.train_loss
    assert histories["post", 2].lr[:3] == [0.0, config.max_lr / 2, config.max_lr]
    assert histories["post", 2].train_loss[0] == expected.train_loss[0]   # same weights, same first batch
    assert histories["pre", 0].train_loss != expected.train_loss and histories["pre", 0].val_loss == []


def test_attention_entropy_under_scaling_against_uniform_rows_and_qk_norm_invariance():
    seq = 16
    uniform = sum(math.log(i + 1) for i in range(1, seq)) / (seq - 1)  # zero logits: row i spreads over i + 1 keys
    assert norms.attention_entropy_under_scaling((0.0,), seq=seq)[0] == pytest.approx(uniform, rel=1e-5)
    plain = norms.attention_entropy_under_scaling((1.0, 4.0), seq=seq)
    assert plain[1] < plain[0] < uniform
    normed = norms.attention_entropy_under_scaling((1.0, 4.0), qk_norm=True, seq=seq)
    assert normed[0] == pytest.approx(normed[1], rel=1e-4)


def test_unigram_entropy():
    assert norms.unigram_entropy([0, 1, 2, 3]) == pytest.approx(math.log(4))
    assert norms.unigram_entropy([5, 5, 5]) == 0.0


def _losses_without_and_with_kernels(build, steps):
    """First training losses of ``build(vocab_size, use_triton)`` for False/True: same init, same batches."""
    task = ArithmeticTask()
    config = TrainConfig(steps=steps, batch_size=2, context_length=16, eval_every=steps, eval_batches=1)
    losses = []
    for use_triton in (False, True):
        torch.manual_seed(0)
        model = build(task.vocab_size, use_triton).to(labkit.device())  # the kernels run where Triton runs
        losses.append(train(model, task.tokens("train"), None, config, progress=False).train_loss)
    return losses


def test_triton_norms_and_swiglu_train_like_the_pytorch_path():
    def build(vocab_size, use_triton):
        model = TransformerLM(tiny_config(vocab_size, context_length=16))
        assert norms.use_triton_kernels(model, use_triton) == 2 * 2 + 1 + 2  # ln1, ln2 per block, final norm, ffn per block
        return model

    torch_losses, triton_losses = _losses_without_and_with_kernels(build, steps=3)
    np.testing.assert_allclose(triton_losses, torch_losses, rtol=1e-4)


def test_config_flag_switches_the_whole_model_to_triton():
    """``ModelConfig(use_triton=True)``: RMSNorm, SwiGLU *and* attention (flash_attention) kernels."""
    build = lambda vocab_size, use_triton: TransformerLM(tiny_config(vocab_size, context_length=16, use_triton=use_triton))  # noqa: E731
    torch_losses, triton_losses = _losses_without_and_with_kernels(build, steps=2)
    np.testing.assert_allclose(triton_losses, torch_losses, rtol=1e-4)


def test_use_triton_kernels_switches_back():
    model = TransformerLM(tiny_config(16, activation="gelu"))
    assert norms.use_triton_kernels(model) == 5  # gelu GLUs have no fused kernel
    assert all(m.use_triton for m in model.modules() if isinstance(m, RMSNorm))
    norms.use_triton_kernels(model, False)
    assert not any(m.use_triton for m in model.modules() if isinstance(m, (RMSNorm, GLU)))


# ----------------------------------------------------------------------------- bytes
def test_count_op_bytes_counts_reads_and_writes():
    a, b = torch.randn(10, 20), torch.randn(10, 20)
    total, ops = norms.count_op_bytes(torch.add, a, b)
    assert total == 3 * 200 * 4 and [name for name, _ in ops] == ["add"]
    total, _ = norms.count_op_bytes(lambda t: t.view(20, 10).T, a)
    assert total == 0  # views move nothing


def test_rmsnorm_bytes_minimum_and_eager_traffic():
    n_rows, n_cols = 8, 256
    counts = norms.rmsnorm_bytes(n_rows, n_cols, torch.bfloat16, num_programs=4)
    assert counts["forward minimum"] == 2 * n_rows * n_cols * 2 + n_cols * 2
    assert counts["forward kernel"] - counts["forward minimum"] == 4 * n_rows
    assert counts["backward kernel"] - counts["backward minimum"] == 4 * n_rows + 2 * 4 * n_cols * 4
    x = torch.randn(n_rows, n_cols, dtype=torch.bfloat16)
    eager, ops = norms.count_op_bytes(RMSNorm(n_cols, dtype=torch.bfloat16), x)
    # eager makes ~9 passes: upcast, square, mean, multiply, ... each a round trip to memory
    assert len(ops) >= 6 and eager > 5 * counts["forward minimum"]
    with pytest.raises(ValueError):
        norms.rmsnorm_bytes(0, 4)


# ----------------------------------------------------------------------------- widget callbacks
def test_norm_explorer_view_reports_the_norms_statistics():
    import matplotlib

    matplotlib.use("Agg")
    table, fig = norms.norm_explorer_view("rmsnorm", "token scales")
    assert table["input"] == norms.axis_statistics(norms.make_batch("token scales"))
    assert table["rmsnorm"]["token rms min"] == pytest.approx(1.0, abs=1e-3)
    assert len(fig.axes) == 4  # two heatmaps and their colorbars
    assert "rmsnorm" in norms.format_table(table)


def test_format_table_rounds_and_hides_rounding_noise():
    text = norms.format_table({"a": {"x": 1.23456, "y": 5.96e-08, "z": -2e-7, "w": 0.0}, "bb": {"x": 1e-6, "y": -3.0, "z": 1.0, "w": 2.0}})
    header, first, second = text.splitlines()
    assert header.split() == ["x", "y", "z", "w"]
    assert first.split() == ["a", "1.23", "<1e-06", "<1e-06", "<1e-06"]
    assert second.split() == ["bb", "1e-06", "-3", "1", "2"]


def test_activation_explorer_view_glu_is_gate_times_b():
    import matplotlib

    matplotlib.use("Agg")
    curves, fig = norms.activation_explorer_view("silu", up=-1.5)
    torch.testing.assert_close(curves["glu"], torch.nn.functional.silu(curves["a"]) * -1.5)
    a = curves["a"]
    torch.testing.assert_close(curves["df"], torch.sigmoid(a) * (1 + a * (1 - torch.sigmoid(a))))
    assert len(fig.axes[0].lines) == 4


def test_deep_stack_view_runs_the_experiment():
    import matplotlib

    matplotlib.use("Agg")
    stats, fig = norms.deep_stack_view("layernorm", gain=0.5, num_layers=8)
    assert stats.activation_std == norms.deep_stack("layernorm", num_layers=8, gain=0.5).activation_std
    assert len(fig.axes) == 2


def test_widgets_build():
    from labkit.widgets import norms as norm_widgets

    for make in (norm_widgets.norm_explorer, norm_widgets.activation_explorer, norm_widgets.deep_stack_explorer):
        assert callable(make())


def test_bench_suite_checks_correctness_without_a_gpu(capsys):
    from labkit.bench import norms as bench_norms

    if torch.cuda.is_available():
        pytest.skip("with a GPU the suite times the kernels instead")
    bench_norms.main()
    out = capsys.readouterr().out
    assert "timings need a GPU" in out
    rows = bench_norms.check_cpu()
    assert [r["op"] for r in rows] == ["rmsnorm", "softmax", "swiglu"]
    assert all(r["forward max error"] < 1e-5 and r["backward max error"] < 1e-5 for r in rows)


@pytest.mark.parametrize("name,up", [("silu", 2.0), ("relu", -2.0), ("gelu", 2.0), ("sigmoid", -2.0)])
def test_activation_explorer_limits_never_clip_a_curve(name, up):
    import matplotlib

    matplotlib.use("Agg")
    curves, fig = norms.activation_explorer_view(name, up=up)
    low, high = fig.axes[0].get_ylim()
    for key in ("f", "df", "glu"):
        assert low < curves[key].min().item() and curves[key].max().item() < high
    assert curves["glu"].max().item() > 5 or curves["glu"].min().item() < -2 or name == "sigmoid"  # the old fixed (-2, 5) clipped these


def test_batchnorm_leaks_the_future_token_per_token_norms_do_not():
    assert norms.future_token_leak("batchnorm") > 0.1
    assert norms.future_token_leak("layernorm") == 0.0 and norms.future_token_leak("rmsnorm") == 0.0
    # independent: torch's BatchNorm1d over (batch x seq) positions sees the same leak
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 16, generator=gen)
    changed = x.clone()
    changed[:, -1] += 5.0
    bn = torch.nn.BatchNorm1d(16).train()
    with torch.no_grad():
        moved = (bn(x.reshape(-1, 16)).reshape(4, 8, 16) - bn(changed.reshape(-1, 16)).reshape(4, 8, 16))[:, :-1]
    assert moved.abs().max() > 0.1


def test_truncated_normal_variance_matches_torch_init_and_compounds_over_depth():
    assert norms.truncated_normal_variance(3.0) == pytest.approx(0.97334, abs=1e-5)
    assert norms.truncated_normal_variance(2.0) == pytest.approx(0.77374, abs=1e-5)
    samples = torch.empty(2_000_000)
    torch.nn.init.trunc_normal_(samples, 0.0, 1.0, -3.0, 3.0, generator=torch.Generator().manual_seed(0))
    assert samples.var().item() == pytest.approx(norms.truncated_normal_variance(3.0), abs=2e-3)
    with pytest.raises(ValueError, match="cut"):
        norms.truncated_normal_variance(0.0)


def test_relu_stack_without_norm_is_exactly_homogeneous_in_the_gain():
    # no biases and ReLU(g z) = g ReLU(z): with the same seed, gain 2 is gain 1 times exactly 2^k at layer k
    one, two = norms.deep_stack("none", gain=1.0), norms.deep_stack("none", gain=2.0)
    for k, (a, b) in enumerate(zip(one.activation_std, two.activation_std), start=1):
        assert b / a == pytest.approx(2.0**k, rel=1e-5)


def test_llama_style_rmsnorm_rounds_differently_from_labkits_in_bf16():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=gen).bfloat16()
    weight = (torch.rand(512, generator=gen) + 0.5).bfloat16()
    layer = RMSNorm(512, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(weight)
        ours, llama = layer(x), norms.rmsnorm_llama_style(x, weight)
    # independent: Hugging Face's LlamaRMSNorm.forward, written out
    x32 = x.float()
    hf = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(llama, hf) and llama.dtype == torch.bfloat16
    differ = (ours != llama).float().mean().item()
    assert 0.05 < differ < 0.6  # a large share of entries differ ...
    torch.testing.assert_close(ours.float(), llama.float(), rtol=2**-7, atol=0)  # ... by about one bf16 rounding
