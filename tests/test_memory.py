import pytest
import torch

import labkit  # noqa: F401
from labkit.memory import (
    SavedTensorMeter,
    accumulated_gradients,
    activation_checkpointing,
    activation_terms,
    adamw_mixed_precision_bytes,
    estimate_training_memory,
    measure_peak,
    model_state_bytes,
    optimizer_state_bytes,
    tensor_bytes,
    training_step_flops,
    zero_memory_per_device,
)
from labkit.model import ModelConfig, TransformerLM
from labkit.nn import Linear
from labkit.train import AdamW, cross_entropy

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


# ----------------------------------------------------------------------------- the meter, on hand-counted graphs
def test_meter_counts_sigmoid_output_and_product_operands():
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensorMeter() as meter:
        s = torch.sigmoid(x)  # saves its output: 32 floats
        y = s * (x + 1)  # saves s (already counted) and x + 1 (new): 32 floats
    assert meter.activation_bytes == 2 * 32 * 4
    y.sum().backward()
    assert meter.activation_bytes == 0  # the graph freed what it saved
    assert meter.peak_bytes == 2 * 32 * 4


def test_meter_counts_one_storage_for_views_and_excludes_parameters():
    lin = Linear(8, 12)
    x = torch.randn(5, 8)
    with SavedTensorMeter(lin) as meter:
        qkv = lin(x)  # saves x (5*8 floats) and the weight (a parameter: excluded)
        q, k, v = qkv.chunk(3, dim=-1)  # three views of one storage
        qk = q * k  # saves q and k: one storage of 5*12 floats
        out = qk * v  # saves qk (5*4 floats, new) and v (the qkv storage again)
    assert meter.activation_bytes == (5 * 8 + 5 * 12 + 5 * 4) * 4
    out.sum().backward()


def test_meter_without_model_excludes_leaf_parameters_and_their_views():
    w = torch.nn.Parameter(torch.randn(8, 3))
    x = torch.randn(2, 8, dtype=torch.float32)
    with SavedTensorMeter() as meter:
        y = x @ w.T.T  # saves x (for w's gradient) and a view of w (excluded)
    assert meter.activation_bytes == 2 * 8 * 4
    y.sum().backward()


def test_meter_counts_dtype_sizes():
    x = torch.randn(16, requires_grad=True, dtype=torch.bfloat16)
    with SavedTensorMeter() as meter:
        y = torch.exp(x)
    assert meter.activation_bytes == 16 * 2


def test_meter_rejects_non_module():
    with pytest.raises(TypeError, match="model"):
        SavedTensorMeter(model="gpt")


# ----------------------------------------------------------------------------- estimator vs meter on TransformerLM
CONFIGS = [
    dict(),
    dict(num_kv_heads=2, d_model=48, d_ff=96),
    dict(num_kv_heads=1, qk_norm=True, head_dim=8),
    dict(norm="layernorm", activation="gelu", num_layers=3),
    dict(norm="none", activation="relu", tie_embeddings=True),
]


def _config(**overrides) -> ModelConfig:
    fields = dict(vocab_size=19, context_length=32, d_model=32, num_layers=2, num_heads=4, d_ff=64)
    fields.update(overrides)
    return ModelConfig(**fields)


def _metered(model, x, y, checkpointing=False):
    from contextlib import nullcontext

    with activation_checkpointing(model) if checkpointing else nullcontext():
        with SavedTensorMeter(model) as meter:
            loss = cross_entropy(model(x), y)
        measured = meter.activation_bytes
        loss.backward()
    return measured


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overrides", CONFIGS)
def test_estimated_activations_match_the_meter(overrides, dtype):
    torch.manual_seed(0)
    config = _config(**overrides)
    model = TransformerLM(config, dtype=dtype)
    batch, seq = 3, 11
    x, y = torch.randint(0, config.vocab_size, (2, batch, seq))
    est = estimate_training_memory(config, batch, seq, param_dtype=DTYPE_NAMES[dtype])
    measured = _metered(model, x, y)
    assert est.activations == pytest.approx(measured, rel=0.01)
    assert est.recompute == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpointed_activations_match_the_meter_and_keep_gradients(dtype):
    torch.manual_seed(0)
    config = _config(num_layers=3)
    model = TransformerLM(config, dtype=dtype)
    x, y = torch.randint(0, config.vocab_size, (2, 2, 9))
    est = estimate_training_memory(config, 2, 9, param_dtype=DTYPE_NAMES[dtype], activation_checkpointing=True)
    measured = _metered(model, x, y, checkpointing=True)
    grads_ckpt = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    full = _metered(model, x, y)
    assert est.activations == pytest.approx(measured, rel=0.01)
    assert measured < full
    block = activation_terms(config, 2, 9, DTYPE_NAMES[dtype])
    per_block = sum(v for k, v in block.items() if k.startswith(("attn", "ffn"))) // config.num_layers
    assert est.recompute == per_block
    for g, p in zip(grads_ckpt, model.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_recompute_cost_is_one_extra_forward_of_every_block():
    torch.manual_seed(0)
    config = _config()
    model = TransformerLM(config)
    b, s = 2, 8
    x, y = torch.randint(0, config.vocab_size, (2, b, s))
    plain = training_step_flops(model, x, y)
    ckpt = training_step_flops(model, x, y, checkpointing=True)
    n, d, h, hd, f = b * s, config.d_model, config.num_heads, config.dim_per_head, config.d_ff
    block_forward = 2 * n * d * (3 * h * hd) + 2 * n * h * hd * d + 2 * 2 * b * h * s * s * hd + 3 * 2 * n * d * f
    assert ckpt - plain == config.num_layers * block_forward


@pytest.mark.parametrize("dtype,mixed", [("fp32", False), ("bf16", False), ("bf16", True), ("fp16", True)])
def test_model_state_is_exact(dtype, mixed):
    torch.manual_seed(0)
    config = _config()
    store_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    model = TransformerLM(config, dtype=store_dtype)
    est = estimate_training_memory(config, 2, 8, param_dtype=dtype, mixed_precision=mixed)
    assert est.params == tensor_bytes(model.parameters())
    x, y = torch.randint(0, config.vocab_size, (2, 2, 8))
    cross_entropy(model(x), y).backward()
    assert est.grads == tensor_bytes(p.grad for p in model.parameters())
    if mixed:  # fp32 master copy, and the optimizer steps on it
        master = [p.detach().float().requires_grad_() for p in model.parameters()]
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.float()
        opt = AdamW(master)
        assert est.master_weights == tensor_bytes(master)
    else:
        opt = AdamW(model.parameters())
        assert est.master_weights == 0
    opt.step()
    assert est.optimizer_states == optimizer_state_bytes(opt)
    assert est.total == est.params + est.grads + est.optimizer_states + est.master_weights + est.activations


def test_adamw_mixed_precision_is_16_bytes_per_parameter():
    assert adamw_mixed_precision_bytes(1000) == 16_000
    b = model_state_bytes(7, "bf16", mixed_precision=True)
    assert (b.params, b.grads, b.master_weights, b.optimizer_states) == (14, 14, 28, 56)
    assert model_state_bytes(10, "fp32", optimizer="sgd").total == 80
    assert model_state_bytes(10, "fp32", optimizer="sgd_momentum").total == 120


def test_zero_paper_table():
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, 64 devices, K = 12.
    got = [round(zero_memory_per_device(7.5e9, 64, stage) / 1e9, 1) for stage in range(4)]
    assert got == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_sharding_follows_the_zero_formula(stage):
    n, world = 64_000, 8
    b = model_state_bytes(n, "bf16", mixed_precision=True, zero_stage=stage, world_size=world)
    assert b.total == zero_memory_per_device(n, world, stage)


def test_zero_stages_do_not_touch_activations():
    config = _config()
    a = estimate_training_memory(config, 2, 8, zero_stage=0, world_size=4)
    b = estimate_training_memory(config, 2, 8, zero_stage=3, world_size=4)
    assert a.activations == b.activations and b.model_state < a.model_state


def test_presets_estimate():
    from labkit.model import PRESETS

    est = estimate_training_memory(PRESETS["llama2-70b"], 1, 4096, param_dtype="bf16", mixed_precision=True, zero_stage=3, world_size=64)
    assert est.model_state == pytest.approx(16 * 68.98e9 / 64, rel=1e-3)
    assert est.activations > est.model_state  # at 4k tokens activations dominate


def test_gradient_accumulation_gives_the_full_batch_gradient():
    torch.manual_seed(0)
    config = _config()
    model = TransformerLM(config)
    x, y = torch.randint(0, config.vocab_size, (2, 8, 6))
    full = accumulated_gradients(model, x, y, 1)
    accumulated = accumulated_gradients(model, x, y, 4)
    for a, b in zip(full, accumulated):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(param_dtype="fp8"), "param_dtype"),
    (dict(param_dtype="fp32", mixed_precision=True), "mixed_precision"),
    (dict(zero_stage=4), "zero_stage"),
    (dict(optimizer="lion"), "optimizer"),
    (dict(world_size=0), "world_size"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate_training_memory(_config(), 2, 8, **kwargs)


def test_bad_sizes():
    with pytest.raises(ValueError, match="seq_len"):
        estimate_training_memory(_config(), 2, 64)
    with pytest.raises(ValueError, match="batch_size"):
        estimate_training_memory(_config(), 0, 8)
    with pytest.raises(TypeError, match="config"):
        estimate_training_memory({"d_model": 8}, 2, 8)
    with pytest.raises(ValueError, match="accumulation_steps"):
        accumulated_gradients(TransformerLM(_config()), torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long), 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_measure_peak_needs_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        measure_peak(lambda: None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_measure_peak_on_cuda():
    numel = 2**20
    peak = measure_peak(lambda: torch.empty(numel, device="cuda").add_(1))
    assert peak >= numel * 4


def test_memory_calculator_callback():
    import matplotlib

    matplotlib.use("Agg")
    from labkit.model import PRESETS
    from labkit.widgets.memory import memory_figure

    fig, breakdown, fits = memory_figure("llama2-70b", 1, 4096, "bf16 mixed (fp32 master)", "adamw", True, 3, 64, 80)
    expected = estimate_training_memory(PRESETS["llama2-70b"], 1, 4096, param_dtype="bf16", mixed_precision=True,
                                        activation_checkpointing=True, zero_stage=3, world_size=64)
    assert breakdown == expected and fits == (expected.total <= 80e9)
    assert len(fig.axes[0].patches) == 6  # params, grads, master, optimizer, activations, recompute
    _, _, fits_one_gpu = memory_figure("llama2-70b", 1, 4096, "bf16 mixed (fp32 master)", "adamw", False, 0, 1, 80)
    assert not fits_one_gpu
    with pytest.raises(ValueError, match="model"):
        memory_figure("gpt-5")
    with pytest.raises(ValueError, match="precision"):
        memory_figure(precision="int4")
