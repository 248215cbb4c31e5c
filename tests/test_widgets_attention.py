"""The KV-cache calculator's options for today's attention (MLA latent, sliding window, paged blocks): the function
(labkit.attention.kv_calculator) and the widget's callback (labkit.widgets.attention.kv_calculator_report)."""
import labkit  # noqa: F401
import pytest
import torch

from labkit.attention import kv_bytes_per_token, kv_calculator
from labkit.attention_variants import DEEPSEEK_V3_MLA, mla_kv_bytes_per_token, mla_like
from labkit.model import PRESETS, ModelConfig
from labkit.widgets.attention import ATTENTION_CHOICES, kv_calculator_report, kv_calculator_widget


def test_mla_bytes_per_token_for_deepseek_v3_dims():
    # a ModelConfig with DeepSeek-V3's layers, heads and hidden size: MLA caches 576 elements per layer and token
    like_v3 = ModelConfig(vocab_size=129280, context_length=4096, d_model=7168, num_layers=61, num_heads=128, d_ff=18432)
    assert kv_bytes_per_token(like_v3, torch.bfloat16, kv_latent_dim=512, rope_head_dim=64) == 61 * 576 * 2
    assert kv_bytes_per_token(like_v3, "fp8", kv_latent_dim=512, rope_head_dim=64) == mla_kv_bytes_per_token(
        DEEPSEEK_V3_MLA, torch.float8_e4m3fn)
    # without the latent: MHA's 2 x 128 heads x 56 per layer
    assert kv_bytes_per_token(like_v3, torch.bfloat16) == 2 * 61 * 128 * 56 * 2


def test_calculator_mla_option_changes_cache_and_weights():
    gqa = kv_calculator("llama3-8b", batch_size=2, seq_len=8192)
    mla = kv_calculator("llama3-8b", attention="mla", batch_size=2, seq_len=8192, kv_latent_dim=512, rope_head_dim=64)
    assert mla.kv_bytes_per_token == 32 * 576 * 2
    assert mla.kv_bytes == 32 * 576 * 2 * 8192 * 2
    assert gqa.kv_bytes / mla.kv_bytes == pytest.approx(2 * 8 * 128 / 576)
    # MLA's projections replace q/k/v/o in every layer
    per_layer = mla_like(PRESETS["llama3-8b"], 512, 64).attention_parameters() - (2 * 4096 * 4096 + 2 * 4096 * 1024)
    assert mla.num_params == gqa.num_params + 32 * per_layer
    assert "576 elements per layer" in mla.summary()
    with pytest.raises(ValueError, match="kv_latent_dim"):
        kv_calculator("llama3-8b", attention="mla")
    with pytest.raises(ValueError, match="kv_latent_dim"):
        kv_calculator("llama3-8b", attention="gqa", kv_latent_dim=512)
    with pytest.raises(ValueError, match="kv_latent_dim"):
        kv_calculator("llama3-8b", attention="mla", kv_latent_dim=0)


def test_calculator_sliding_window_caps_the_cache_at_the_window():
    full = kv_calculator("qwen3-8b", seq_len=32768)
    windowed = kv_calculator("qwen3-8b", seq_len=32768, sliding_window=4096)
    short = kv_calculator("qwen3-8b", seq_len=1000, sliding_window=4096)
    assert windowed.cached_tokens == 4096 and windowed.kv_bytes == full.kv_bytes // 8
    assert short.cached_tokens == 1000 and short.kv_bytes == kv_calculator("qwen3-8b", seq_len=1000).kv_bytes
    assert windowed.num_params == full.num_params  # the window changes no weight
    assert "4,096 of 32,768 tokens kept" in windowed.summary()


def test_calculator_paged_blocks_round_each_sequence_up():
    est = kv_calculator("llama3-8b", batch_size=3, seq_len=1000, block_size=16)
    assert est.cached_tokens == 1008 and est.kv_bytes == 3 * 1008 * kv_bytes_per_token(PRESETS["llama3-8b"])
    assert "63 blocks" in est.summary() and "8 unused" in est.summary()
    assert "7,192 unused" in est.summary()  # contiguous preallocation to context_length 8192
    exact = kv_calculator("llama3-8b", seq_len=1024, block_size=16)
    assert exact.cached_tokens == 1024
    both = kv_calculator("llama3-8b", seq_len=10000, sliding_window=4000, block_size=128)
    assert both.cached_tokens == 4096  # 4000 kept, in 32 blocks of 128


@pytest.mark.parametrize("bad", [dict(sliding_window=0), dict(block_size=-16), dict(block_size=2.5), dict(seq_len=0),
                                 dict(batch_size=True)])
def test_calculator_rejects_bad_options_naming_them(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        kv_calculator("llama3-8b", **bad)


def test_report_callback_shows_the_options():
    assert "mla" in ATTENTION_CHOICES
    plain = kv_calculator_report("qwen3-8b", "as published", 1, 32768, "bf16", 80)
    assert "144 KiB per token" in plain and "4.83 GB" in plain and "MLA" not in plain
    mla = kv_calculator_report("qwen3-8b", "mla", 1, 32768, "bf16", 80, kv_latent_dim=512, rope_head_dim=64)
    assert f"{36 * 576 * 2 / 1024:.4g} KiB per token" in mla and "latent 512 + RoPE key 64" in mla
    # the latent applies only with MLA; 0 switches the window and the paging off
    assert kv_calculator_report("qwen3-8b", "gqa", kv_latent_dim=256) == kv_calculator_report("qwen3-8b", "gqa")
    windowed = kv_calculator_report("qwen3-8b", sliding_window=4096, block_size=16)
    assert "sliding window 4,096" in windowed and "paged in blocks of 16: 256 blocks" in windowed
    assert kv_calculator_report("qwen3-8b", sliding_window=-1).startswith("cannot size this model: sliding_window=-1")
    custom = kv_calculator_report("custom", "mla", 2, 1024, "fp8", 24, num_layers=2, d_model=256, num_heads=4,
                                  num_kv_heads=2, head_dim=64, d_ff=512, vocab_size=100, kv_latent_dim=128, rope_head_dim=32)
    assert f"{2 * 160 / 1024:.4g} KiB per token" in custom


def test_widget_builds_with_the_new_controls():
    box = kv_calculator_widget()
    assert box is not None
    names = {getattr(child, "description", "") for child in box.widget.children}
    assert {"MLA latent", "MLA RoPE key", "sliding window", "paged blocks"} <= names
