"""labkit.attention_variants: MLA (absorbed == naive, DeepSeek-V3's 576-element cache), sliding-window attention with
a ring buffer (== full attention with a banded mask), the paged KV cache (== contiguous, allocation, waste), QK-norm."""
import math

import labkit  # noqa: F401
import pytest
import torch
import torch.nn.functional as F

from labkit.attention_variants import (
    DEEPSEEK_V3_MLA,
    BlockAllocator,
    MLAConfig,
    MLAKVCache,
    MultiHeadLatentAttention,
    PagedKVCache,
    PoolExhaustedError,
    RingKVCache,
    SlidingWindowAttention,
    dense_attention_parameters,
    greedy_decode_with_cache,
    mla_kv_bytes_per_token,
    mla_like,
    paged_attention,
    qk_norm_logit_growth,
    simulate_kv_waste,
    sliding_window_mask,
    with_sliding_window,
)
from labkit.model import PRESETS, TransformerLM, generate, tiny_config
from labkit.nn import KVCache, MultiHeadSelfAttention, RoPE
from labkit.quant import deepseek_v3_parameters

SMALL_MLA = MLAConfig(d_model=48, num_heads=4, kv_latent_dim=24, q_latent_dim=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                      v_head_dim=12, num_layers=2)


# ============================================================================ MLA
def test_deepseek_v3_dimensions_are_the_published_ones():
    c = DEEPSEEK_V3_MLA
    assert (c.d_model, c.num_heads, c.kv_latent_dim, c.q_latent_dim, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
            c.num_layers) == (7168, 128, 512, 1536, 128, 64, 128, 61)
    assert c.cache_elements_per_layer == 576
    assert mla_kv_bytes_per_token(c) == 61 * 576 * 2  # bf16: 70,272 bytes, ~68.6 KiB per token
    assert mla_kv_bytes_per_token(c, torch.float8_e4m3fn) == 61 * 576


def test_mla_cache_for_deepseek_v3_holds_576_elements_per_token_and_layer():
    cache = MLAKVCache.for_config(DEEPSEEK_V3_MLA, batch_size=2, max_seq_len=4096, dtype=torch.bfloat16, device="meta")
    assert cache.elements_per_token_per_layer == 576
    assert cache.rows.shape == (61, 2, 4096, 576)
    assert cache.nbytes == 2 * 4096 * mla_kv_bytes_per_token(DEEPSEEK_V3_MLA)
    # the same model's attention with full per-head K and V would cache 2 * 128 * (128 + 64) = 49,152 elements per layer
    assert 2 * 128 * (128 + 64) / 576 > 85


def test_mla_attention_parameters_match_deepseek_v3_published_count():
    # labkit.quant counts DeepSeek-V3's attention from modeling_deepseek.py (norms counted apart): 671B in total
    per_layer = deepseek_v3_parameters()["attention"] // DEEPSEEK_V3_MLA.num_layers
    latent_norms = DEEPSEEK_V3_MLA.q_latent_dim + DEEPSEEK_V3_MLA.kv_latent_dim
    assert DEEPSEEK_V3_MLA.attention_parameters() == per_layer + latent_norms


@pytest.mark.parametrize("config", [SMALL_MLA, MLAConfig(32, 2, 16, None, 8, 4, 10, 1)])
def test_mla_absorbed_path_equals_naive_path(config):
    torch.manual_seed(0)
    mla = MultiHeadLatentAttention(config, max_seq_len=64).double()
    x = torch.randn(3, 11, config.d_model, dtype=torch.float64)
    naive, absorbed = mla(x), mla(x, absorb=True)
    assert naive.shape == (3, 11, config.d_model)
    torch.testing.assert_close(absorbed, naive, rtol=1e-10, atol=1e-12)


def test_mla_naive_path_equals_an_independent_per_head_reference():
    """The paper's equations written out with torch's own attention, per head."""
    torch.manual_seed(1)
    c = SMALL_MLA
    mla = MultiHeadLatentAttention(c, max_seq_len=32).double()
    x = torch.randn(2, 9, c.d_model, dtype=torch.float64)
    positions = torch.arange(9)
    c_q = mla.q_norm(x @ mla.w_dq.weight.T)
    c_kv = mla.kv_norm(x @ mla.w_dkv.weight.T)
    k_rope = mla.rope(x @ mla.w_kr.weight.T, positions)
    heads = []
    for h in range(c.num_heads):
        def rows(w, size):
            return w.weight[h * size:(h + 1) * size]
        q = torch.cat([c_q @ rows(mla.w_uq, c.qk_nope_head_dim).T,
                       mla.rope(c_q @ rows(mla.w_qr, c.qk_rope_head_dim).T, positions)], dim=-1)
        k = torch.cat([c_kv @ rows(mla.w_uk, c.qk_nope_head_dim).T, k_rope], dim=-1)
        v = c_kv @ rows(mla.w_uv, c.v_head_dim).T
        heads.append(F.scaled_dot_product_attention(q, k, v, is_causal=True))
    expected = torch.cat(heads, dim=-1) @ mla.w_o.weight.T
    torch.testing.assert_close(mla(x), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("absorb", [False, True])
def test_mla_decoding_through_the_latent_cache_equals_the_full_forward(absorb):
    torch.manual_seed(2)
    mla = MultiHeadLatentAttention(SMALL_MLA, max_seq_len=64).double()
    x = torch.randn(2, 13, SMALL_MLA.d_model, dtype=torch.float64)
    full = mla(x)
    cache = MLAKVCache.for_config(SMALL_MLA, batch_size=2, max_seq_len=13, dtype=torch.float64)
    outs = [mla(x[:, :5], kv_cache=cache, absorb=absorb)]  # prefill, then one token at a time
    outs += [mla(x[:, t:t + 1], kv_cache=cache, absorb=absorb) for t in range(5, 13)]
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-12)
    assert cache.length() == 13 and cache.nbytes == 2 * 2 * 13 * (24 + 8) * 8  # layers x batch x positions x row x fp64
    with pytest.raises(ValueError, match="overflow"):
        mla(x[:, :1], kv_cache=cache)


def test_mla_forward_backward_reaches_every_weight():
    torch.manual_seed(3)
    mla = MultiHeadLatentAttention(SMALL_MLA, max_seq_len=16)
    x = torch.randn(2, 7, SMALL_MLA.d_model, requires_grad=True)
    mla(x).square().mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for name, p in mla.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_mla_bad_inputs_raise_naming_the_argument():
    with pytest.raises(ValueError, match="kv_latent_dim"):
        MLAConfig(48, 4, 0, None, 16, 8, 12)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        MLAConfig(48, 4, 24, None, 16, 7, 12)
    with pytest.raises(ValueError, match="q_latent_dim"):
        MLAConfig(48, 4, 24, -1, 16, 8, 12)
    with pytest.raises(TypeError, match="config"):
        MultiHeadLatentAttention(PRESETS["qwen3-8b"], max_seq_len=8)
    with pytest.raises(TypeError, match="dtype"):
        mla_kv_bytes_per_token(SMALL_MLA, "bf16")
    with pytest.raises(ValueError, match="x"):
        MultiHeadLatentAttention(SMALL_MLA, 8)(torch.randn(2, 3, 47))
    cache = MLAKVCache.for_config(SMALL_MLA, 1, 4)
    with pytest.raises(ValueError, match="latent, rope_key"):
        cache.update(0, torch.randn(1, 2, 24), torch.randn(1, 2, 9))


def test_mla_like_and_dense_attention_parameters():
    cfg = PRESETS["llama3-8b"]
    mla = mla_like(cfg, 512, 64)
    assert (mla.num_heads, mla.qk_nope_head_dim, mla.v_head_dim, mla.q_latent_dim) == (32, 128, 128, None)
    # q, k, v, o of GQA 32 / 8 heads of 128
    assert dense_attention_parameters(cfg) == 4096 * 4096 * 2 + 2 * 4096 * 8 * 128
    # q (nope + rope), W_DKV, W_KR, W_UK, W_UV, W_O and the latent norm
    assert mla.attention_parameters() == (4096 * 32 * 192 + 4096 * 512 + 4096 * 64 + 2 * 512 * 4096 + 4096 * 4096 + 512)


# ============================================================================ sliding window
def _band_reference(num_queries, num_keys, window):
    """Independent: absolute positions, query at p sees keys at j with p - window < j <= p."""
    mask = torch.zeros(num_queries, num_keys, dtype=torch.bool)
    for i in range(num_queries):
        p = num_keys - num_queries + i
        for j in range(num_keys):
            mask[i, j] = p - window < j <= p
    return mask


@pytest.mark.parametrize("shape", [(7, 7, 3), (1, 9, 4), (3, 10, 2), (5, 5, 5), (4, 6, 100), (2, 9, 1)])
def test_sliding_window_mask_is_banded_and_bottom_right_aligned(shape):
    assert torch.equal(sliding_window_mask(*shape), _band_reference(*shape))


def test_sliding_window_mask_with_a_long_window_is_the_causal_mask():
    from labkit.nn import causal_mask

    assert torch.equal(sliding_window_mask(5, 8, 8), causal_mask(5, 8))
    with pytest.raises(ValueError, match="window"):
        sliding_window_mask(3, 3, 0)


def _windowed_attention(window, num_kv_heads=2, seed=0):
    torch.manual_seed(seed)
    rope = RoPE(10000.0, 8, 128)
    return SlidingWindowAttention(32, 4, window, num_kv_heads=num_kv_heads, rope=rope).double()


def test_sliding_window_attention_equals_torch_attention_with_the_banded_mask():
    attn = _windowed_attention(window=5)
    x = torch.randn(2, 17, 32, dtype=torch.float64)
    q, k, v = attn._project(x, None, None, 0)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    heads = F.scaled_dot_product_attention(q, k, v, attn_mask=_band_reference(17, 17, 5))
    expected = attn.output_proj(heads.transpose(1, 2).reshape(2, 17, 32))
    torch.testing.assert_close(attn(x), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("window", [1, 3, 6])
@pytest.mark.parametrize("prefill", [1, 4, 9])
def test_ring_cache_decoding_equals_full_banded_attention_step_by_step(window, prefill):
    attn = _windowed_attention(window)
    x = torch.randn(2, 25, 32, dtype=torch.float64)  # far longer than the window
    full = attn(x)
    ring = RingKVCache(num_layers=1, batch_size=2, num_kv_heads=2, window=window, head_dim=8, dtype=torch.float64)
    outs = [attn(x[:, :prefill], kv_cache=ring)]
    t = prefill
    while t < 25:  # steps of one token, with an occasional chunk of 3
        n = 3 if t % 7 == 0 else 1
        outs.append(attn(x[:, t:t + n], kv_cache=ring))
        t += n
        torch.testing.assert_close(torch.cat(outs, dim=1), full[:, :t], rtol=1e-10, atol=1e-12)
    assert ring.length() == 25
    assert ring.k.shape[3] == window and ring.nbytes == 2 * 2 * 2 * window * 8 * 8  # the size is the window


def test_ring_cache_size_does_not_depend_on_the_length():
    sizes = set()
    for length in (10, 100, 1000):
        ring = RingKVCache(1, 1, 1, window=16, head_dim=4)
        for _ in range(length):
            ring.update(0, torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
        sizes.add(ring.nbytes)
        assert ring.length() == length
    assert sizes == {2 * 16 * 4 * 4}


def test_sliding_window_model_generation_with_ring_cache_equals_banded_full_recompute():
    torch.manual_seed(4)
    model = TransformerLM(tiny_config(15, context_length=64, num_kv_heads=2)).double().eval()
    window = 6
    windowed = with_sliding_window(model, window)
    prompt = torch.randint(0, 15, (2, 5))
    ring = RingKVCache(2, 2, 2, window, model.config.dim_per_head, dtype=torch.float64)
    ids, logits = greedy_decode_with_cache(windowed, prompt, 30, ring)
    # full recompute each step: no cache, the banded mask over the whole prefix
    assert torch.equal(ids, generate(windowed, prompt, 30, use_cache=False))
    full_logits = windowed(ids[:, :-1])[:, prompt.shape[1] - 1:].float()
    torch.testing.assert_close(logits, full_logits, rtol=1e-9, atol=1e-10)
    # and the window really changes the model once sequences outgrow it
    assert not torch.allclose(model(ids), windowed(ids))
    torch.testing.assert_close(windowed(ids[:, :window]), model(ids[:, :window]), rtol=1e-12, atol=1e-12)


def test_ring_cache_bad_inputs():
    with pytest.raises(ValueError, match="window"):
        RingKVCache(1, 1, 1, 0, 4)
    ring = RingKVCache(1, 1, 2, 4, 4)
    with pytest.raises(ValueError, match="k, v"):
        ring.update(0, torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
    with pytest.raises(ValueError, match="layer_idx"):
        ring.update(1, torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    with pytest.raises(ValueError, match="window"):
        SlidingWindowAttention(32, 4, window=0)
    with pytest.raises(TypeError, match="model"):
        with_sliding_window(MultiHeadSelfAttention(8, 2), 4)


# ============================================================================ paged KV cache
def test_block_allocator_allocates_on_block_boundaries_and_frees():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    alloc.add_sequence("a")
    assert alloc.grow("a", 3) == [(0, 0), (0, 1), (0, 2)]
    assert alloc.grow("a", 2) == [(0, 3), (1, 0)]
    alloc.add_sequence("b")
    assert alloc.grow("b", 4) == [(2, p) for p in range(4)]
    assert alloc.block_tables == {"a": [0, 1], "b": [2]} and alloc.num_free_blocks == 1
    with pytest.raises(PoolExhaustedError, match="needs 2 more block"):
        alloc.grow("b", 5)
    assert alloc.lengths["b"] == 4 and alloc.num_free_blocks == 1  # a failed grow reserves nothing
    alloc.free("a")
    assert alloc.num_free_blocks == 3
    assert alloc.grow("b", 5) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]  # a's freed blocks are reused
    with pytest.raises(ValueError, match="seq_id"):
        alloc.free("a")
    with pytest.raises(ValueError, match="seq_id"):
        alloc.add_sequence("b")
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.grow("b", -1)
    with pytest.raises(ValueError, match="block_size"):
        BlockAllocator(4, 0)


def test_paged_attention_equals_contiguous_attention_for_interleaved_sequences():
    torch.manual_seed(5)
    heads, kv_heads, d = 4, 2, 8
    paged = PagedKVCache(num_layers=2, num_blocks=12, block_size=4, num_kv_heads=kv_heads, head_dim=d, dtype=torch.float64)
    lengths = {"a": 13, "b": 6, "c": 9}
    contiguous = {s: KVCache(2, 1, kv_heads, n, d, dtype=torch.float64) for s, n in lengths.items()}
    for s in lengths:
        paged.add_sequence(s)
    written = dict.fromkeys(lengths, 0)
    while any(written[s] < n for s, n in lengths.items()):  # the sequences grow interleaved: their blocks mix in the pool
        for s, n in lengths.items():
            if written[s] == n:
                continue
            new = min(n - written[s], 1 + written[s] % 3)
            for layer in range(2):
                k, v = torch.randn(2, kv_heads, new, d, dtype=torch.float64).unbind(0)
                pk, pv = paged.append(s, layer, k, v)
                ck, cv = contiguous[s].update(layer, k[None], v[None])
                assert torch.equal(pk, ck[0]) and torch.equal(pv, cv[0])
                q = torch.randn(heads, new, d, dtype=torch.float64)
                mask = torch.ones(new, written[s] + new, dtype=torch.bool).tril(written[s])
                ref = F.scaled_dot_product_attention(q, ck[0].repeat_interleave(2, 0), cv[0].repeat_interleave(2, 0),
                                                     attn_mask=mask)
                torch.testing.assert_close(paged_attention(q, paged, s, layer), ref, rtol=1e-10, atol=1e-12)
            written[s] += new
    tables = paged.allocator.block_tables
    assert sorted(b for t in tables.values() for b in t) == list(range(4 + 2 + 3))  # no block shared, none lost
    assert any(t != sorted(t) or t != list(range(t[0], t[0] + len(t))) for t in tables.values())  # blocks not contiguous


def test_paged_cache_drives_a_model_like_the_contiguous_cache():
    torch.manual_seed(6)
    model = TransformerLM(tiny_config(15, num_kv_heads=2)).double().eval()
    paged = PagedKVCache(2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float64)
    prompt = torch.randint(0, 15, (1, 5))
    paged.add_sequence(0)
    ids, logits = greedy_decode_with_cache(model, prompt, 12, paged.sequence(0))
    ref_ids, ref_logits = greedy_decode_with_cache(model, prompt, 12, KVCache.for_model(model, 1, 17))
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-12)
    assert len(paged.allocator.block_tables[0]) == math.ceil(16 / 4)  # 16 positions written (the last token is not fed)
    paged.free(0)
    assert paged.allocator.num_free_blocks == 8
    with pytest.raises(ValueError, match="seq_id"):
        paged.sequence(0)


def test_paged_cache_errors():
    paged = PagedKVCache(2, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=4)
    paged.add_sequence("s")
    paged.append("s", 0, torch.randn(1, 8, 4), torch.randn(1, 8, 4))
    with pytest.raises(PoolExhaustedError):
        paged.append("s", 0, torch.randn(1, 1, 4), torch.randn(1, 1, 4))
    with pytest.raises(ValueError, match="layer_idx=1"):
        paged.append("s", 1, torch.randn(1, 9, 4), torch.randn(1, 9, 4))
    with pytest.raises(ValueError, match="k, v"):
        paged.append("s", 1, torch.randn(2, 1, 4), torch.randn(2, 1, 4))
    with pytest.raises(ValueError, match="one sequence"):
        paged.sequence("s").update(1, torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4))


def test_kv_waste_simulation_matches_the_closed_form():
    result = simulate_kv_waste(num_requests=4000, max_len=1024, block_size=16, seed=0)
    lengths = result.lengths
    assert len(lengths) == 4000 and 1 <= min(lengths) and max(lengths) <= 1024
    # exact: contiguous reserves max_len per request, paging rounds each length up to whole blocks
    assert result.used_slots == sum(lengths)
    assert result.contiguous_slots == 4000 * 1024
    assert result.paged_slots == sum(-(-n // 16) * 16 for n in lengths)
    # statistical, against the expectations for uniform lengths on 1..max_len (std error of the means ~0.3% and ~1%)
    n = len(lengths)
    assert (result.contiguous_slots - result.used_slots) / n == pytest.approx((1024 - 1) / 2, rel=0.03)
    assert (result.paged_slots - result.used_slots) / n == pytest.approx((16 - 1) / 2, rel=0.05)
    assert result.contiguous_waste == pytest.approx(1 - (1024 + 1) / 2 / 1024, abs=0.015)
    assert result.paged_waste < 0.02 < 0.45 < result.contiguous_waste
    assert result.peak_blocks <= 32 * 1024 // 16


def test_kv_waste_simulation_is_seeded_and_validates():
    assert simulate_kv_waste(200, 64, 8, seed=3) == simulate_kv_waste(200, 64, 8, seed=3)
    assert simulate_kv_waste(200, 64, 8, seed=3).lengths != simulate_kv_waste(200, 64, 8, seed=4).lengths
    # block_size 1: no internal fragmentation at all
    assert simulate_kv_waste(100, 64, 1).paged_waste == 0
    with pytest.raises(ValueError, match="block_size"):
        simulate_kv_waste(block_size=0)
    with pytest.raises(ValueError, match="num_requests"):
        simulate_kv_waste(num_requests=1.5)


# ============================================================================ QK-norm
def test_qk_norm_keeps_attention_logits_from_growing():
    result = qk_norm_logit_growth()
    assert len(result.max_logit) == len(result.max_logit_qk_norm) == len(result.steps) == 40
    assert all(math.isfinite(v) for v in result.max_logit + result.max_logit_qk_norm + result.loss + result.loss_qk_norm)
    # the claims the chapter makes, with margins far outside the spread across machines (see claim_spread.py)
    assert max(result.max_logit[-10:]) > 3 * max(result.max_logit_qk_norm[-10:])
    assert result.max_logit[-1] > 4 * result.max_logit[0]
    assert max(result.max_logit_qk_norm) < 20
    assert result.seconds < 20  # about 2 s of CPU time on one core


def test_qk_norm_logit_growth_validates():
    with pytest.raises(ValueError, match="lr"):
        qk_norm_logit_growth(lr=0)
    with pytest.raises(ValueError, match="steps"):
        qk_norm_logit_growth(steps=0)
    with pytest.raises(TypeError, match="task"):
        qk_norm_logit_growth(steps=1, task="adder")
