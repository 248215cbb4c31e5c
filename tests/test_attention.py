"""labkit.attention: the torch FlashAttention, the KV cache and its calculators, MHA -> GQA/MQA
conversion and uptraining, decode timing, the attention explorer."""
import math

import labkit  # noqa: F401
import pytest
import torch
import torch.nn.functional as F

from labkit.attention import (
    KVCache,
    UptrainingResult,
    attention_explorer,
    attention_map,
    bytes_per_element,
    convert_and_uptrain,
    convert_kv_heads,
    decode_speed,
    flash_attention_torch,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_calculator,
    model_kv_cache_bytes,
    online_softmax_update,
    plain_attention,
    prefill_and_decode_times,
    saved_for_backward_bytes,
    uptraining_table,
    with_kv_heads,
)
from labkit.data import ArithmeticTask
from labkit.model import PRESETS, TransformerLM, generate, tiny_config
from labkit.pretrained import adder_task, load_tiny_adder
from labkit.runtime import triton_mode
from labkit.train import TrainConfig, estimate_loss, train


def sdpa64(q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2]) if causal else None
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), torch.logsumexp(scores, -1)


# ----------------------------------------------------------------------------- flash_attention_torch
@pytest.mark.parametrize(
    "heads,kv_heads,num_q,num_k,head_dim,causal,block_q,block_k",
    [
        (2, 2, 37, 37, 32, True, 16, 16),  # ragged self-attention, several blocks each way
        (4, 1, 1, 50, 64, True, 64, 16),  # MQA decode step
        (4, 2, 10, 45, 16, True, 4, 8),  # GQA, Nq < Nk, diagonal crosses key blocks
        (2, 1, 30, 17, 128, False, 8, 5),  # Nq > Nk without a mask
    ],
)
def test_flash_attention_torch_matches_sdpa(heads, kv_heads, num_q, num_k, head_dim, causal, block_q, block_k):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, num_q, head_dim, generator=gen)
    k = torch.randn(2, kv_heads, num_k, head_dim, generator=gen)
    v = torch.randn(2, kv_heads, num_k, head_dim, generator=gen)
    out, lse = flash_attention_torch(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    expected, expected_lse = sdpa64(q, k, v, causal)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-5)


def test_flash_attention_torch_keeps_dtype_and_rejects_bad_input():
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    out, lse = flash_attention_torch(q, q, q, causal=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    with pytest.raises(ValueError, match="multiple of K/V heads"):
        flash_attention_torch(torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
    with pytest.raises(ValueError, match="block_q"):
        flash_attention_torch(q, q, q, block_q=0)
    with pytest.raises(ValueError, match="bottom-right"):
        flash_attention_torch(torch.randn(1, 2, 9, 16), q.float(), q.float(), causal=True)


def test_online_softmax_update_over_two_blocks_equals_softmax():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 5, 12, generator=gen, dtype=torch.float64) * 30  # large: exp would overflow unshifted
    values = torch.randn(3, 12, 4, generator=gen, dtype=torch.float64)
    m = torch.full((3, 5), float("-inf"), dtype=torch.float64)
    s, acc = torch.zeros(3, 5, dtype=torch.float64), torch.zeros(3, 5, 4, dtype=torch.float64)
    m, s, acc = online_softmax_update(m, s, acc, scores[..., :7], values[:, :7])
    m, s, acc = online_softmax_update(m, s, acc, scores[..., 7:], values[:, 7:])
    torch.testing.assert_close(acc / s[..., None], torch.softmax(scores, -1) @ values)
    torch.testing.assert_close(m + s.log(), torch.logsumexp(scores, -1))


def test_online_softmax_update_survives_a_fully_masked_first_block_and_a_row_masked_everywhere():
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(3, 8, generator=gen, dtype=torch.float64)
    values = torch.randn(8, 2, generator=gen, dtype=torch.float64)
    scores[0, :4] = float("-inf")  # row 0: its first block entirely masked, its second not
    scores[1] = float("-inf")      # row 1: masked in every block
    state = (torch.full((3,), float("-inf"), dtype=torch.float64), torch.zeros(3, dtype=torch.float64),
             torch.zeros(3, 2, dtype=torch.float64))
    after_first = online_softmax_update(*state, scores[:, :4], values[:4])
    assert after_first[0][0] == float("-inf") and after_first[1][0] == 0 and (after_first[2][0] == 0).all()
    m, s, acc = online_softmax_update(*after_first, scores[:, 4:], values[4:])
    assert torch.isfinite(s).all() and torch.isfinite(acc).all()
    torch.testing.assert_close(acc[[0, 2]] / s[[0, 2], None], torch.softmax(scores[[0, 2]], -1) @ values)
    assert m[1] == float("-inf") and s[1] == 0 and (acc[1] == 0).all()


# ----------------------------------------------------------------------------- memory of attention
def test_flash_saves_only_output_and_lse_while_plain_attention_saves_n_squared():
    from labkit.kernels.flash_attention import flash_attention

    device = "cuda" if triton_mode() == "compiled" else "cpu"  # where the kernel runs
    batch, heads, n, d = 1, 2, 48, 16
    q, k, v = (torch.randn(batch, heads, n, d, device=device, requires_grad=True) for _ in range(3))
    flash = saved_for_backward_bytes(lambda *t: flash_attention(*t, causal=True), q, k, v)
    assert flash == batch * heads * n * d * 4 + batch * heads * n * 4  # out (fp32) + lse (fp32)
    plain = saved_for_backward_bytes(lambda *t: plain_attention(*t, causal=True), q, k, v)
    assert plain >= 2 * batch * heads * n * n * 4  # at least the scores and the probabilities


# ----------------------------------------------------------------------------- KV cache
def test_kv_cache_append_length_overflow_and_reset():
    cache = KVCache(num_layers=2, batch_size=1, num_kv_heads=2, max_seq_len=5, head_dim=4)
    k = torch.randn(1, 2, 3, 4)
    k_all, v_all = cache.append(0, k, -k)
    assert cache.length(0) == 3 and cache.length(1) == 0 and torch.equal(k_all, k) and torch.equal(v_all, -k)
    k_all, _ = cache.update(0, k[:, :, :2], k[:, :, :2])
    assert k_all.shape == (1, 2, 5, 4) and torch.equal(k_all[:, :, 3:], k[:, :, :2])
    with pytest.raises(ValueError, match="overflow"):
        cache.append(0, k[:, :, :1], k[:, :, :1])
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        cache.append(1, torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4))
    cache.reset()
    assert cache.length(0) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_cache_bytes_equals_a_filled_cache(dtype):
    config = tiny_config(15, num_kv_heads=2, context_length=40)
    model = TransformerLM(config).to(dtype)
    cache = KVCache.for_model(model, batch_size=3, max_seq_len=40)
    with torch.no_grad():
        model(torch.randint(0, 15, (3, 40)), kv_cache=cache)
    assert cache.length(config.num_layers - 1) == 40
    assert cache.nbytes == kv_cache_bytes(config.num_layers, 2, config.dim_per_head, 40, 3, dtype)
    assert cache.nbytes == model_kv_cache_bytes(config, 40, 3, dtype)
    assert cache.nbytes == (cache.k.untyped_storage().nbytes() + cache.v.untyped_storage().nbytes())


def test_kv_bytes_seed_numbers_for_qwen3_8b():
    qwen = PRESETS["qwen3-8b"]
    # 2 (K and V) x 36 layers x 8 KV heads x 128 dims x 2 bytes (bf16) = 144 KiB per token
    assert kv_bytes_per_token(qwen) == 2 * 36 * 8 * 128 * 2 == 147456
    assert model_kv_cache_bytes(qwen, seq_len=32768, batch_size=1) == 147456 * 32768  # 4.5 GiB
    assert kv_bytes_per_token(qwen, "fp8") == 147456 // 2
    assert kv_bytes_per_token(with_kv_heads(qwen, "mha")) == 4 * 147456
    assert kv_bytes_per_token(with_kv_heads(qwen, "mqa")) == 147456 // 8


def test_bytes_per_element_and_errors():
    assert bytes_per_element(torch.bfloat16) == 2 and bytes_per_element("int4") == 0.5
    assert kv_cache_bytes(1, 1, 2, 3, 1, "int4") == 6
    with pytest.raises(ValueError, match="dtype"):
        bytes_per_element("fp7")
    with pytest.raises(ValueError, match="seq_len"):
        kv_cache_bytes(1, 1, 1, -1)
    with pytest.raises(TypeError, match="ModelConfig"):
        model_kv_cache_bytes("qwen3-8b", 10)


def test_kv_calculator_weights_cache_and_fit():
    est = kv_calculator("llama3-8b", batch_size=4, seq_len=8192, gpu_gb=80)
    assert est.num_params == 8030261248
    assert est.weight_bytes == 2 * 8030261248
    assert est.kv_bytes == 2 * 32 * 8 * 128 * 8192 * 4 * 2
    assert est.fits and "fits" in est.summary()
    too_big = kv_calculator("llama2-70b", seq_len=4096, gpu_gb=80)
    assert not too_big.fits and "NOT" in too_big.summary()
    # switching to MHA grows the cache 8x and the K/V projections with it
    mha = kv_calculator("llama3-8b", attention="mha", batch_size=4, seq_len=8192)
    assert mha.kv_bytes == 4 * est.kv_bytes and mha.num_params == est.num_params + 32 * 2 * 4096 * 4096 * 3 // 4
    with pytest.raises(ValueError, match="kv_latent_dim"):  # MLA needs its latent size
        kv_calculator("llama3-8b", attention="mla")
    mla = kv_calculator("llama3-8b", attention="mla", kv_latent_dim=512, seq_len=8192)
    assert mla.kv_bytes_per_token == 32 * (512 + 64) * 2 and mla.kv_bytes < est.kv_bytes
    with pytest.raises(ValueError, match="config"):
        kv_calculator("gpt-5")


# ----------------------------------------------------------------------------- MHA -> GQA/MQA conversion
def _kv_weights(model):
    return [(layer.attn.k_proj.weight, layer.attn.v_proj.weight) for layer in model.layers]


@pytest.mark.parametrize("overrides", [{}, dict(qk_norm=True, tie_embeddings=True)])
def test_convert_kv_heads_to_the_same_count_is_the_identity_and_a_copy(overrides):
    torch.manual_seed(0)
    model = TransformerLM(tiny_config(15, **overrides)).eval()
    ids = torch.randint(0, 15, (2, 11))
    same = convert_kv_heads(model, 4)
    assert not same.training and same.config.kv_heads == 4
    with torch.no_grad():
        assert torch.equal(same(ids), model(ids))
        same.layers[0].attn.k_proj.weight.add_(1.0)  # shares no tensor with the original
        assert not torch.equal(same(ids), model(ids))
    assert convert_kv_heads(model.train(), 2).training


def test_convert_kv_heads_averages_each_groups_heads():
    torch.manual_seed(1)
    model = TransformerLM(tiny_config(15))
    head_dim = model.config.dim_per_head
    for kv_heads in (2, 1):
        group = 4 // kv_heads
        for (k_old, v_old), (k_new, v_new) in zip(_kv_weights(model), _kv_weights(convert_kv_heads(model, kv_heads))):
            for old, new in ((k_old, k_new), (v_old, v_new)):
                for j in range(kv_heads):
                    heads = [old[h * head_dim:(h + 1) * head_dim] for h in range(j * group, (j + 1) * group)]
                    torch.testing.assert_close(new[j * head_dim:(j + 1) * head_dim], sum(heads) / group)
    # pooling in two stages (MHA -> GQA-2 -> MQA) equals pooling at once: groups have equal sizes
    for pair_a, pair_b in zip(_kv_weights(convert_kv_heads(convert_kv_heads(model, 2), 1)), _kv_weights(convert_kv_heads(model, 1))):
        for a, b in zip(pair_a, pair_b):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_convert_kv_heads_keeps_the_logits_when_each_groups_heads_are_identical(kv_heads):
    torch.manual_seed(2)
    model = TransformerLM(tiny_config(15)).eval()
    head_dim, group = model.config.dim_per_head, 4 // kv_heads
    ids = torch.randint(0, 15, (3, 13))
    with torch.no_grad():
        # with distinct heads, pooling changes the model (which is why it must be uptrained)
        assert not torch.allclose(convert_kv_heads(model, kv_heads)(ids), model(ids), atol=1e-3)
        for weights in _kv_weights(model):
            for w in weights:  # every query head of a group reads a copy of the group's first K/V head
                for h in range(4):
                    first = (h // group) * group
                    w[h * head_dim:(h + 1) * head_dim] = w[first * head_dim:(first + 1) * head_dim]
        torch.testing.assert_close(convert_kv_heads(model, kv_heads)(ids), model(ids), atol=1e-5, rtol=1e-5)


def test_convert_kv_heads_shrinks_parameters_and_kv_cache():
    model = TransformerLM(tiny_config(15))
    cfg = model.config
    for kv_heads in (2, 1):
        converted = convert_kv_heads(model, kv_heads)
        dropped_rows = 2 * (4 - kv_heads) * cfg.dim_per_head  # K and V rows that went away, per layer
        assert model.num_params() - converted.num_params() == cfg.num_layers * dropped_rows * cfg.d_model
        assert kv_bytes_per_token(converted.config, torch.float32) == 2 * cfg.num_layers * kv_heads * cfg.dim_per_head * 4
        assert KVCache.for_model(converted, 1, 8).nbytes * 4 // kv_heads == KVCache.for_model(model, 1, 8).nbytes


def test_convert_kv_heads_rejects_bad_arguments():
    model = TransformerLM(tiny_config(15))
    for bad in (3, 8, 0, -2, 2.0, True, None):
        with pytest.raises(ValueError, match="num_kv_heads"):
            convert_kv_heads(model, bad)
    with pytest.raises(ValueError, match="must divide the model's 2 K/V heads"):
        convert_kv_heads(convert_kv_heads(model, 2), 4)
    with pytest.raises(TypeError, match="TransformerLM"):
        convert_kv_heads(model.layers[0].attn, 2)


def test_convert_and_uptrain_measures_before_and_after_the_papers_recipe():
    model, _ = load_tiny_adder()
    task = adder_task()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = TrainConfig(steps=3, batch_size=4, context_length=20, warmup_iters=1, eval_batches=2)
    rows = convert_and_uptrain(model, task, config, {"MHA": 4, "MQA": 1}, seed=5)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the source model is left alone
    mha, mqa = rows
    assert (mha.name, mha.num_kv_heads, mqa.name, mqa.num_kv_heads) == ("MHA", 4, "MQA", 1)
    val = task.tokens("val")
    # MHA "conversion" is the identity: its numbers before uptraining are the shipped model's
    assert mha.converted_loss == estimate_loss(model, val, config, "cpu")
    assert mha.converted_accuracy == task.evaluate(model, "val") > 0.99
    assert mqa.converted_loss == estimate_loss(convert_kv_heads(model, 1), val, config, "cpu")
    assert (mha.num_params, mqa.num_params) == (model.num_params(), convert_kv_heads(model, 1).num_params())
    assert (mha.kv_bytes_per_token, mqa.kv_bytes_per_token) == (2 * 2 * 4 * 16 * 4, 2 * 2 * 1 * 16 * 4)
    # uptraining = labkit.train.train from the converted weights with the global RNG seeded
    reference = convert_kv_heads(model, 1)
    torch.manual_seed(5)
    train(reference, task.tokens("train"), None, config, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), mqa.model.state_dict().values()))
    for row in rows:
        assert not row.model.training
        assert row.uptrained_loss == estimate_loss(row.model, val, config, "cpu")
        assert row.uptrained_accuracy == task.evaluate(row.model, "val")
    with pytest.raises(TypeError, match="config"):
        convert_and_uptrain(model, task, dict(steps=3), {"MHA": 4})
    with pytest.raises(TypeError, match="task"):
        convert_and_uptrain(model, "2-digit addition", config, {"MHA": 4})
    with pytest.raises(TypeError, match="model"):
        convert_and_uptrain(model.state_dict(), task, config, {"MHA": 4})
    with pytest.raises(ValueError, match="variants"):
        convert_and_uptrain(model, task, config, {})
    with pytest.raises(ValueError, match="num_kv_heads"):
        convert_and_uptrain(model, task, config, {"GQA": 3})


def test_uptraining_table_rounds_every_row():
    model = TransformerLM(tiny_config(15))
    rows = [
        UptrainingResult("GQA", 2, 92864, 512, 3.83149, 0.00149, 1.04771, 0.91875, model),
    ]
    lines = uptraining_table(rows).splitlines()
    assert len(lines) == 2 and "converted: loss" in lines[0] and "uptrained: loss" in lines[0]
    assert lines[1].split() == ["GQA", "2", "92,864", "512", "|", "3.831", "0.1%", "|", "1.048", "91.9%"]


# ----------------------------------------------------------------------------- cached generation
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_cached_and_uncached_generation_are_token_identical(kv_heads):
    torch.manual_seed(kv_heads)
    model = TransformerLM(tiny_config(15, num_kv_heads=kv_heads))
    prompt = torch.randint(0, 15, (3, 5))
    cached = generate(model, prompt, 12, use_cache=True)
    uncached = generate(model, prompt, 12, use_cache=False)
    assert torch.equal(cached, uncached)


def test_decode_timing_helpers_report_positive_rates():
    model = TransformerLM(tiny_config(15))
    rows = decode_speed(model, [2, 4], prompt_len=3, repeats=1)
    assert [r["new_tokens"] for r in rows] == [2, 4]
    assert all(r["cached_tok_s"] > 0 and r["uncached_tok_s"] > 0 and r["speedup"] > 0 for r in rows)
    # cached: the prompt once, then one position per later step; uncached: the whole prefix at every step
    assert [(r["cached_positions"], r["uncached_positions"]) for r in rows] == [(3 + 1, 3 + 4), (3 + 3, 3 + 4 + 5 + 6)]
    times = prefill_and_decode_times(model, prompt_len=6, decode_steps=2, repeats=1)
    assert times["prefill_s"] > 0 and times["decode_step_s"] > 0 and times["prefill_tok_s"] > 0


# ----------------------------------------------------------------------------- attention explorer
def test_attention_map_reproduces_the_layer_output():
    torch.manual_seed(0)
    model = TransformerLM(tiny_config(15, num_kv_heads=2)).eval()
    ids = torch.randint(0, 15, (9,))
    captured = {}
    attn = model.layers[1].attn
    handle = attn.register_forward_hook(lambda mod, args, out: captured.update(x=args[0], out=out))
    with torch.no_grad():
        model(ids[None])
    handle.remove()
    weights = torch.stack([attention_map(model, ids, layer=1, head=h) for h in range(attn.num_heads)])
    assert torch.allclose(weights.sum(-1), torch.ones(4, 9)) and torch.all(weights.triu(1) == 0)
    # weights @ V, merged over heads and projected, must be exactly what the layer returned
    v = attn.v_proj(captured["x"]).view(1, 9, 2, attn.head_dim).transpose(1, 2).repeat_interleave(2, 1)[0]
    merged = (weights @ v).transpose(0, 1).reshape(9, -1)
    torch.testing.assert_close(attn.output_proj(merged), captured["out"][0], atol=1e-5, rtol=1e-5)
    unmasked = attention_map(model, ids, layer=1, head=0, causal=False)
    assert torch.all(unmasked[torch.ones(9, 9, dtype=torch.bool).triu(1)] > 0)


def test_attention_explorer_callback_and_errors():
    task = ArithmeticTask()
    model = TransformerLM(tiny_config(task.vocab_size))
    weights, labels = attention_explorer(model, task.tokenizer, "12+34=", layer=0, head=1)
    assert weights.shape == (6, 6) and labels == list("12+34=")
    with pytest.raises(ValueError, match="layer"):
        attention_explorer(model, task.tokenizer, "1+1=", layer=7)
    with pytest.raises(ValueError, match="head"):
        attention_explorer(model, task.tokenizer, "1+1=", head=9)
    with pytest.raises(ValueError, match="prompt"):
        attention_explorer(model, task.tokenizer, "")


# ----------------------------------------------------------------------------- widgets
def test_widget_callbacks():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.widgets.attention import kv_calculator_report, plot_attention, show_attention

    task = ArithmeticTask()
    model = TransformerLM(tiny_config(task.vocab_size))
    weights = show_attention(model, task.tokenizer, "12+34=", layer=1, head=3, causal=False)
    assert weights.shape == (6, 6)
    with pytest.raises(ValueError, match="weights"):
        plot_attention(torch.ones(3, 3), ["a", "b"])
    plt.close("all")
    report = kv_calculator_report("qwen3-8b", "as published", 1, 32768, "bf16", 80)
    assert "144 KiB per token" in report and "4.83 GB" in report and "fits" in report
    custom = kv_calculator_report("custom", "as published", 2, 1024, "fp8", 24, num_layers=2, d_model=256, num_heads=4,
                                  num_kv_heads=2, head_dim=64, d_ff=512, vocab_size=100)
    assert f"{2 * 2 * 2 * 64 * 1 / 1024:.4g} KiB per token" in custom
    assert kv_calculator_report("custom", num_heads=6, num_kv_heads=4).startswith("cannot size this model")


def test_widgets_build():
    from labkit.widgets.attention import attention_explorer_widget, kv_calculator_widget

    task = ArithmeticTask()
    model = TransformerLM(tiny_config(task.vocab_size))
    assert attention_explorer_widget(model, task.tokenizer, "1+2=") is not None
    assert kv_calculator_widget() is not None


def test_saved_for_backward_bytes_needs_leaf_inputs():
    q = torch.randn(1, 1, 4, 8, requires_grad=True) * 2  # not a leaf: the meter would count it
    with pytest.raises(ValueError, match="inputs\\[0\\]"):
        saved_for_backward_bytes(lambda t: t.exp(), q)


def test_split_k_attention_combines_its_chunks_exactly():
    from labkit.attention import split_k_attention

    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 8, 1, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 301, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    scores = (q.unflatten(1, (2, 4)) @ k[:, :, None].transpose(-2, -1) / 4).flatten(1, 2)
    for splits in (1, 7, 301):
        out, lse = split_k_attention(q, k, v, splits)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
    with pytest.raises(ValueError, match="num_splits"):
        split_k_attention(q, k, v, 0)


def test_decode_speed_alternates_pairs_and_reports_each_ratio():
    model = TransformerLM(tiny_config(15))
    rows = decode_speed(model, [3], prompt_len=2, repeats=3)
    assert len(rows[0]["speedups"]) == 3 and rows[0]["speedup"] == sorted(rows[0]["speedups"])[1]
    with pytest.raises(ValueError, match="repeats"):
        decode_speed(model, [3], repeats=0)


def test_decode_step_profile_counts_flops_against_closed_forms():
    from torch.utils.flop_counter import FlopCounterMode

    from labkit.attention import DECODE_PARTS, decode_step_profile
    from labkit.nn import Linear

    torch.manual_seed(0)
    config = tiny_config(15, num_kv_heads=2)
    model = TransformerLM(config)
    short, long = decode_step_profile(model, 4, repeats=1), decode_step_profile(model, 40, repeats=1)
    assert set(short.ops) == set(DECODE_PARTS) and short.ops == long.ops and short.computing_ops == long.computing_ops
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear))
    assert long.flops["matmuls (Linear)"] == 2 * linear_params
    # q.k and p.v for every query head over the cached positions and the new one
    per_position = 4 * config.num_layers * config.num_heads * config.dim_per_head
    assert (short.flops["attention over the cache"], long.flops["attention over the cache"]) == (5 * per_position, 41 * per_position)
    assert all(long.computing_ops[p] <= long.ops[p] for p in DECODE_PARTS) and long.step_seconds > 0
    # torch's own FLOP counter agrees on the whole step
    cache = KVCache.for_model(model, 1, 41)
    prompt = torch.randint(0, 15, (1, 41))
    with torch.no_grad():
        model(prompt[:, :40], kv_cache=cache)
        with FlopCounterMode(display=False) as counter:
            model(prompt[:, 40:], kv_cache=cache)
    assert counter.get_total_flops() == sum(long.flops.values())
    with pytest.raises(ValueError, match="cached"):
        decode_step_profile(model, 0)
