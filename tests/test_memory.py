import pytest
import torch

import labkit  # noqa: F401
from labkit.memory import (
    ATTENTION,
    CachingAllocatorSimulator,
    MiB,
    SavedTensorMeter,
    accumulated_gradients,
    activation_checkpointing,
    activation_terms,
    adamw_mixed_precision_bytes,
    attention_implementation,
    estimate_training_memory,
    korthikanti_activation_bytes,
    replay_allocations,
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


def _metered(model, x, y, checkpointing=False, attention="materialized"):
    from contextlib import nullcontext

    with activation_checkpointing(model) if checkpointing else nullcontext(), attention_implementation(model, attention):
        with SavedTensorMeter(model) as meter:
            loss = cross_entropy(model(x), y)
        measured = meter.activation_bytes
        loss.backward()
    return measured


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overrides", CONFIGS)
def test_estimated_activations_match_the_meter(overrides, dtype, attention):
    torch.manual_seed(0)
    config = _config(**overrides)
    model = TransformerLM(config, dtype=dtype)
    batch, seq = 3, 11
    x, y = torch.randint(0, config.vocab_size, (2, batch, seq))  # two storages, as the estimate counts them
    est = estimate_training_memory(config, batch, seq, param_dtype=DTYPE_NAMES[dtype], attention=attention)
    assert est.activations == _metered(model, x, y, attention=attention)
    assert (est.recompute > 0) == (attention == "selective")


@pytest.mark.parametrize("attention", ["selective", "sdpa"])
def test_attention_implementations_give_the_same_loss_and_gradients(attention):
    torch.manual_seed(0)
    config = _config(num_kv_heads=2)
    model = TransformerLM(config)
    x, y = torch.randint(0, config.vocab_size, (2, 2, 9))
    cross_entropy(model(x), y).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with attention_implementation(model, attention):
        cross_entropy(model(x), y).backward()
    for g, p in zip(reference, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)
    assert "_attend" not in model.layers[0].attn.__dict__  # the block restored the model
    with pytest.raises(ValueError, match="attention"):
        with attention_implementation(model, "flash2"):
            pass
    with pytest.raises(ValueError, match="attention"):
        activation_terms(config, 2, 9, attention="flash2")


def test_selective_recompute_rebuilds_one_layers_attention_core():
    config = _config(num_kv_heads=2)
    b, s, p = 2, 9, 4
    full = activation_terms(config, b, s)
    selective = activation_terms(config, b, s, attention="selective")
    rebuilt = selective.pop("recompute_block")
    heads, group = config.num_heads, config.num_heads // config.kv_heads
    core = b * heads * s * s * 3 * p + b * heads * s * 2 * p + group * s * s  # scores, exp, probs; row max, sum; mask
    assert sum(full.values()) - sum(selective.values()) == config.num_layers * core
    assert rebuilt == core and full["recompute_block"] == 0  # one layer's core exists again during backward


class PaperGPTLayer(torch.nn.Module):
    """The GPT layer Korthikanti et al. count: LayerNorm, fused QKV, softmax attention with
    dropout, a 4h GeLU MLP, dropout after both projections (bool masks, as on GPUs)."""

    def __init__(self, hidden, heads, dtype, selective=False):
        super().__init__()
        nn = torch.nn
        self.h, self.a, self.selective = hidden, heads, selective
        self.ln1, self.ln2 = nn.LayerNorm(hidden, dtype=dtype), nn.LayerNorm(hidden, dtype=dtype)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden, dtype=dtype), nn.Linear(hidden, hidden, dtype=dtype)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden, dtype=dtype), nn.Linear(4 * hidden, hidden, dtype=dtype)

    @staticmethod
    def dropout(t):
        return torch.native_dropout(t, 0.1, True)[0]  # keeps a 1-byte mask

    def core(self, q, k, v):
        s, b, _ = q.shape
        heads = lambda t: t.reshape(s, b, self.a, -1).permute(1, 2, 0, 3)  # noqa: E731
        scores = (heads(q) @ heads(k).transpose(-2, -1)) * (self.h // self.a) ** -0.5
        probs = self.dropout(torch.softmax(scores, -1))
        return (probs @ heads(v)).permute(2, 0, 1, 3).reshape(s, b, self.h)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        ctx = checkpoint(self.core, q, k, v, use_reentrant=True) if self.selective else self.core(q, k, v)
        x = x + self.dropout(self.proj(ctx))
        return x + self.dropout(self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x)))))


@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("s,b,h,a", [(16, 2, 32, 4), (12, 3, 48, 6)])
def test_korthikanti_formula_is_what_their_layer_saves(s, b, h, a, dtype, recompute):
    torch.manual_seed(0)
    layer = PaperGPTLayer(h, a, dtype, selective=recompute == "selective")
    x = torch.randn(s, b, h, dtype=dtype, requires_grad=True)
    with SavedTensorMeter(layer) as meter:
        out = layer(x)
    measured = meter.activation_bytes
    out.float().sum().backward()
    # the paper leaves out LayerNorm's per-row mean and 1/std (two norms x two values per row)
    stat_bytes = torch.native_layer_norm(x[:1].detach(), (h,), None, None, 1e-5)[1].element_size()
    assert measured == korthikanti_activation_bytes(s, b, h, a, recompute=recompute) + 2 * 2 * s * b * stat_bytes


def test_korthikanti_formula_values():
    # GPT-3 175B (s=2048, h=12288, a=96): 5as/h = 80, so the attention core is 80/114 of a layer's activations
    s, h, a = 2048, 12288, 96
    assert korthikanti_activation_bytes(s, 1, h, a) == s * h * (34 + 80)
    assert korthikanti_activation_bytes(s, 2, h, a, num_layers=3, recompute="selective") == 3 * 34 * s * 2 * h
    with pytest.raises(ValueError, match="recompute"):
        korthikanti_activation_bytes(s, 1, h, a, recompute="full")
    with pytest.raises(ValueError, match="heads"):
        korthikanti_activation_bytes(s, 1, h, 0)


def test_qwen3_at_4k_tokens_activations_dominate_only_with_materialised_scores():
    from labkit.model import PRESETS

    est = {att: estimate_training_memory(PRESETS["qwen3-8b"], 1, 4096, param_dtype="bf16", mixed_precision=True, attention=att)
           for att in ATTENTION}
    assert est["materialized"].activations > est["materialized"].model_state
    assert est["sdpa"].activations < est["sdpa"].model_state / 2
    assert est["selective"].activations < est["sdpa"].activations


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
    assert est.activations == measured
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
    assert est.activations > est.model_state  # with ZeRO-3 over 64 GPUs, the activations of 4k tokens dominate


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
    _, flash, _ = memory_figure("qwen3-8b", attention="sdpa")
    assert flash == estimate_training_memory(PRESETS["qwen3-8b"], 1, 4096, param_dtype="bf16", mixed_precision=True, attention="sdpa")
    with pytest.raises(ValueError, match="attention"):
        memory_figure(attention="flash")


# ----------------------------------------------------------------------------- the caching allocator, simulated
def _run(ops, **options):
    return replay_allocations(CachingAllocatorSimulator(**options), ops)


def test_allocator_rounds_requests_and_picks_pools_and_segment_sizes():
    sim = CachingAllocatorSimulator
    assert [sim.round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert sim.segment_size(MiB) == 2 * MiB  # small pool: 2 MiB segments
    assert sim.segment_size(MiB + 512) == 20 * MiB  # 1-10 MiB: a 20 MiB segment
    assert sim.segment_size(10 * MiB) == 10 * MiB and sim.segment_size(11 * MiB) == 12 * MiB  # own segment, 2 MiB steps
    rows = _run([("malloc", "a", 1000), ("malloc", "b", 3 * MiB), ("malloc", "c", 5 * MiB), ("malloc", "d", 50 * MiB)])
    assert rows[0][1:3] == (1024, 2 * MiB)
    assert rows[-1][3] == ["small segment    2 MiB: [# 1 KiB | . 2047 KiB]",
                           "large segment   20 MiB: [# 3 MiB | # 5 MiB | . 12 MiB]",  # split: the rest stays cached
                           "large segment   50 MiB: [# 50 MiB]"]


def test_freeing_caches_and_empty_cache_returns_only_free_segments():
    rows = _run([("malloc", "a", 3 * MiB), ("malloc", "d", 50 * MiB), ("free", "d"), ("malloc", "e", 40 * MiB),
                 ("free", "a"), ("empty_cache",), ("free", "e"), ("empty_cache",)])
    assert rows[2][1:3] == (3 * MiB, 70 * MiB)  # freed: still reserved (cached), not allocated
    assert rows[3][3][1] == "large segment   50 MiB: [# 40 MiB | . 10 MiB]"  # the cached block served it, split
    assert rows[5][1:3] == (40 * MiB, 50 * MiB)  # the free 20 MiB segment went back to the driver
    assert rows[7][1:3] == (0, 0)


def test_large_pool_does_not_split_off_a_remainder_of_1_mib_or_less():
    rows = _run([("malloc", "a", 12 * MiB), ("free", "a"), ("malloc", "b", 11 * MiB)])
    assert rows[-1][1:3] == (12 * MiB, 12 * MiB)  # 1 MiB left over: not split, counted as allocated


def test_fragmentation_and_expandable_segments_match_the_pytorch_devlog():
    # PyTorch devlog "When does fragmentation occur in the CUDA caching allocator?" (2026): 8x16 MiB, free, 4x32 MiB
    small_first = [("malloc", f"s{i}", 16 * MiB) for i in range(8)] + [("free", f"s{i}") for i in range(8)] + \
                  [("malloc", f"l{i}", 32 * MiB) for i in range(4)]
    large_first = [("malloc", f"l{i}", 32 * MiB) for i in range(4)] + [("free", f"l{i}") for i in range(4)] + \
                  [("malloc", f"s{i}", 16 * MiB) for i in range(8)]
    assert _run(small_first)[-1][2] == 256 * MiB  # blocks of different segments never merge
    assert _run(large_first)[-1][2] == 128 * MiB
    rows = _run(small_first, expandable_segments=True)
    assert [r[2] // MiB for r in rows[:8]] == [20, 40, 60, 80, 80, 100, 120, 140]  # 20 MiB pages mapped as needed
    assert rows[-1][2] == 140 * MiB and len(rows[-1][3]) == 1  # one segment: the 32 MiB requests fit in it


def test_max_split_size_keeps_big_blocks_whole():
    ops = [("malloc", "big", 100 * MiB), ("free", "big"), ("malloc", "small", 5 * MiB)]
    assert _run(ops)[-1][2] == 100 * MiB  # default: the 100 MiB block is split for the 5 MiB request
    assert _run(ops, max_split_size_mb=64)[-1][2] == 120 * MiB  # a block >= 64 MiB never serves a smaller request
    ops = [("malloc", "big", 100 * MiB), ("free", "big"), ("malloc", "b", 90 * MiB), ("free", "b"), ("malloc", "c", 70 * MiB)]
    rows = _run(ops, max_split_size_mb=64)
    assert rows[2][3] == ["large segment  100 MiB: [# 100 MiB]"]  # within 20 MiB: taken whole, not split
    assert rows[-1][2] == 170 * MiB  # 100 >= 70 + 20: too wasteful, a new segment


def test_at_capacity_the_allocator_frees_cached_segments_and_retries():
    # the devlog's 8x16 MiB freed, then 32 MiB requests, on a 160 MiB device: the first fits beside the cache
    # (128 + 32 MiB), the second does not, so the 8 free segments go back and the retry fits (32 + 32 MiB)
    sim = CachingAllocatorSimulator(capacity=160 * MiB)
    handles = [sim.malloc(16 * MiB) for _ in range(8)]
    for h in handles:
        sim.free(h)
    sim.malloc(32 * MiB)
    assert (sim.reserved, sim.num_alloc_retries) == (160 * MiB, 0)
    sim.malloc(32 * MiB)
    assert (sim.reserved, sim.allocated, sim.num_alloc_retries, sim.num_ooms) == (64 * MiB, 64 * MiB, 1, 0)


@pytest.mark.parametrize("expandable", [False, True])
def test_holes_between_live_blocks_end_in_out_of_memory(expandable):
    # 30 x 3 MiB fill 100 MiB: five 20 MiB segments of six blocks and a 2 MiB rest; or one expandable segment of
    # 5 pages, where blocks 12 and 25 find a 4 MiB free end and take it whole (a 1 MiB rest is not split off).
    # Every other one freed leaves holes of 3-4 MiB between live blocks, which no retry can merge
    sim = CachingAllocatorSimulator(capacity=100 * MiB, expandable_segments=expandable)
    handles = [sim.malloc(3 * MiB) for _ in range(30)]
    for h in handles[::2]:
        sim.free(h)
    live = (15 * 3 + expandable) * MiB  # block 25, live, holds 4 MiB
    with pytest.raises(torch.OutOfMemoryError, match=f"Tried to allocate 12.00 MiB.*{live // MiB}.00 MiB is allocated.*"
                                                     f"{100 - live // MiB}.00 MiB is reserved"):
        sim.malloc(12 * MiB)
    assert (sim.reserved, sim.allocated, sim.num_alloc_retries, sim.num_ooms) == (100 * MiB, live, 1, 1)
    assert len(sim.segments) == (1 if expandable else 5)  # the failed attempt left nothing behind


def test_allocator_rejects_bad_input():
    with pytest.raises(ValueError, match="max_split_size_mb"):
        CachingAllocatorSimulator(max_split_size_mb=20)
    with pytest.raises(ValueError, match="capacity"):
        CachingAllocatorSimulator(capacity=0)
    with pytest.raises(ValueError, match="nbytes"):
        CachingAllocatorSimulator().malloc(0)
    with pytest.raises(ValueError, match="handle"):
        CachingAllocatorSimulator().free(3)
    with pytest.raises(ValueError, match="ops"):
        _run([("free", "never allocated")])
    with pytest.raises(TypeError, match="allocator"):
        replay_allocations("cpu", [])


ALLOCATOR_SCENARIOS = [
    [("malloc", "a", 1000), ("malloc", "b", 3 * MiB), ("malloc", "c", 5 * MiB), ("malloc", "d", 50 * MiB), ("free", "d"),
     ("malloc", "e", 40 * MiB), ("free", "b"), ("empty_cache",)],
    [("malloc", f"s{i}", 16 * MiB) for i in range(8)] + [("free", f"s{i}") for i in range(8)] +
    [("malloc", f"l{i}", 32 * MiB) for i in range(4)],
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("ops", ALLOCATOR_SCENARIOS)
def test_simulation_matches_the_cuda_caching_allocator(ops):
    real = replay_allocations("cuda", ops)
    simulated = _run(ops)
    for r, s in zip(real, simulated):
        assert r[1:3] == s[1:3] and sorted(r[3]) == sorted(s[3]), (r, s)


def test_allocator_diagram_draws_each_segment():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.widgets.memory import allocator_diagram

    sim = CachingAllocatorSimulator()
    sim.malloc(3 * MiB)
    fig = allocator_diagram({"one": sim.snapshot(), "empty": []})
    assert len(fig.axes[0].patches) == 3  # two blocks and the segment's frame
    plt.close(fig)
    with pytest.raises(ValueError, match="snapshots"):
        allocator_diagram({})



MOE_CONFIGS = [  # every option activation_terms counts; layers 1 and 3 of 4 are MoE in the first
    dict(num_experts=4, top_k=2, d_ff=24, every=2),
    dict(num_experts=4, top_k=1, num_shared_experts=1, aux_loss_weight=0.0),
    dict(num_experts=8, top_k=2, d_ff=16, num_shared_experts=2, first_dense=1, z_loss_weight=1e-3),
    dict(num_experts=4, top_k=3, score="sigmoid", normalize_gates=False, bias_update_rate=1e-3),
]


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moe", MOE_CONFIGS)
def test_estimated_moe_activations_match_the_meter(moe, dtype, checkpointing):
    from labkit.experts import MoEConfig

    torch.manual_seed(0)
    config = _config(num_layers=4, moe=MoEConfig(**moe))
    model = TransformerLM(config, dtype=dtype)
    x, y = torch.randint(0, config.vocab_size, (2, 3, 11))
    est = estimate_training_memory(config, 3, 11, param_dtype=DTYPE_NAMES[dtype], activation_checkpointing=checkpointing)
    assert est.activations == _metered(model, x, y, checkpointing=checkpointing)


def test_moe_activations_of_a_pipeline_stage_follow_the_model_layers():
    from dataclasses import replace

    from labkit.experts import MoEConfig

    config = _config(num_layers=4, moe=MoEConfig(num_experts=4, every=2))  # layers 1 and 3 are MoE
    whole = activation_terms(config, 2, 8)
    halves = [activation_terms(replace(config, num_layers=2), 2, 8, first_layer=first) for first in (0, 2)]
    for name in ("moe: routed inputs", "ffn: gate/up/act/product"):
        assert halves[0][name] + halves[1][name] == whole[name]
    with pytest.raises(ValueError, match="first_layer"):
        activation_terms(config, 2, 8, first_layer=-1)


def test_activation_terms_refuse_moe_options_they_do_not_count():
    from labkit.experts import MoEConfig

    for option in ({"capacity_factor": 1.25}, {"router_noise": True}):
        with pytest.raises(ValueError, match="config.moe"):
            activation_terms(_config(moe=MoEConfig(num_experts=4, **option)), 1, 8)


def test_autocast_weight_copies_finds_the_saved_bf16_copy_of_every_matmul_weight():
    from labkit.memory import autocast_weight_copies

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), Linear(8, 16), torch.nn.LayerNorm(16), Linear(16, 4))
    x = torch.randint(0, 10, (3, 5))
    copies = autocast_weight_copies(model, lambda: model(x).float().square().mean())
    assert copies == {"1.weight": 2 * 16 * 8, "3.weight": 2 * 4 * 16}  # the embedding and the norm are not cast
    with pytest.raises(TypeError, match="model"):
        autocast_weight_copies(lambda: None, lambda: None)


def test_a_block_freed_on_its_stream_is_reused_at_once_unless_another_stream_was_recorded():
    sim = CachingAllocatorSimulator()
    x = sim.malloc(4 * MiB)
    where = sim.address(x)
    sim.free(x)  # a side stream may still read x: nothing tells the allocator
    assert sim.address(sim.malloc(4 * MiB)) == where  # handed out again at once

    sim = CachingAllocatorSimulator()
    x = sim.malloc(4 * MiB)
    where = sim.address(x)
    sim.record_stream(x, 1)
    sim.free(x)
    assert [b["state"] for b in sim.snapshot()[0]["blocks"]] == ["active_pending_free", "inactive"]
    assert sim.allocated == 0 and sim.reserved == 20 * MiB  # freed, not allocated, and not reusable yet
    y = sim.malloc(4 * MiB)
    assert sim.address(y) != where and sim.address(y)[0] == where[0]  # the rest of the segment
    sim.free(y)
    sim.stream_done(1)  # stream 1's work up to the free has finished: the event completes
    assert [b["state"] for b in sim.snapshot()[0]["blocks"]] == ["inactive"]  # merged with its free neighbour
    assert sim.address(sim.malloc(4 * MiB)) == where


def test_record_stream_on_the_allocating_stream_changes_nothing_and_every_recorded_stream_must_finish():
    sim = CachingAllocatorSimulator()
    x = sim.malloc(1000, stream=2)
    sim.record_stream(x, 2)
    sim.free(x)
    assert sim.snapshot()[0]["blocks"][0]["state"] == "inactive"
    x = sim.malloc(1000, stream=2)
    sim.record_stream(x, 0)
    sim.record_stream(x, 1)
    sim.free(x)
    sim.stream_done(0)
    assert sim.snapshot()[0]["blocks"][0]["state"] == "active_pending_free"
    sim.stream_done(1)
    assert sim.snapshot()[0]["blocks"][0]["state"] == "inactive"


@pytest.mark.parametrize("expandable", [False, True])
def test_free_blocks_serve_only_their_own_streams_requests(expandable):
    sim = CachingAllocatorSimulator(expandable_segments=expandable)
    sim.free(sim.malloc(4 * MiB, stream=0))
    y = sim.malloc(4 * MiB, stream=1)  # stream 0's cached 20 MiB are not offered to stream 1
    assert sim.reserved == 40 * MiB and len(sim.segments) == 2
    assert [seg["stream"] for seg in sim.snapshot()] == [0, 1]
    assert sim.address(y) == (2, 0)  # the start of the second segment made


def test_empty_cache_and_the_retry_at_capacity_wait_for_pending_blocks():
    sim = CachingAllocatorSimulator()
    x = sim.malloc(4 * MiB)
    sim.record_stream(x, 1)
    sim.free(x)
    sim.empty_cache()
    assert sim.reserved == 0
    sim = CachingAllocatorSimulator(capacity=20 * MiB)
    x = sim.malloc(12 * MiB)  # its own 12 MiB segment
    sim.record_stream(x, 1)
    sim.free(x)
    sim.malloc(8 * MiB)  # needs a 20 MiB segment: only after the pending one is released
    assert sim.num_alloc_retries == 1 and sim.num_ooms == 0 and sim.reserved == 20 * MiB


def test_stream_arguments_are_checked():
    sim = CachingAllocatorSimulator()
    with pytest.raises(ValueError, match="stream"):
        sim.malloc(512, stream=-1)
    x = sim.malloc(512)
    with pytest.raises(ValueError, match="stream"):
        sim.record_stream(x, True)
    sim.free(x)
    with pytest.raises(ValueError, match="handle"):
        sim.record_stream(x, 1)
    with pytest.raises(ValueError, match="handle"):
        sim.address(x)
    with pytest.raises(ValueError, match="stream"):
        sim.stream_done("side")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("record", [False, True])
def test_record_stream_defers_reuse_on_cuda(record):
    from labkit.memory import cuda_stream_reuse

    result = cuda_stream_reuse(record)
    assert result["reused_while_busy"] is (not record)
    assert result["reused_after_done"]


def test_cuda_stream_reuse_refuses_bad_arguments_before_asking_for_cuda():
    from labkit.memory import cuda_stream_reuse

    with pytest.raises(TypeError, match="record_stream"):
        cuda_stream_reuse("yes")
    with pytest.raises(ValueError, match="nbytes"):
        cuda_stream_reuse(True, nbytes=0)
    with pytest.raises(ValueError, match="busy_cycles"):
        cuda_stream_reuse(True, busy_cycles=1.5)

