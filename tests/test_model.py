import pytest
import torch

from labkit.model import ModelConfig, TransformerLM, generate, tiny_config


def _config(**overrides):
    fields = dict(vocab_size=50, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48)
    fields.update(overrides)
    return ModelConfig(**fields)


def test_state_dict_keys_read_like_the_architecture():
    model = TransformerLM(_config(num_layers=1))
    assert list(model.state_dict()) == [
        "token_embeddings.weight",
        "layers.0.ln1.weight",
        "layers.0.attn.q_proj.weight",
        "layers.0.attn.k_proj.weight",
        "layers.0.attn.v_proj.weight",
        "layers.0.attn.output_proj.weight",
        "layers.0.ln2.weight",
        "layers.0.ffn.w1.weight",
        "layers.0.ffn.w2.weight",
        "layers.0.ffn.w3.weight",
        "ln_final.weight",
        "lm_head.weight",
    ]


@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
def test_num_params_closed_form(num_kv_heads):
    cfg = _config(num_kv_heads=num_kv_heads)
    V, d, L, f = cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.d_ff
    kv_dim = cfg.kv_heads * (d // cfg.num_heads)
    per_layer = 2 * d + 2 * d * d + 2 * d * kv_dim + 3 * d * f
    assert TransformerLM(cfg).num_params() == 2 * V * d + L * per_layer + d
    assert TransformerLM(cfg).num_params(non_embedding=True) == V * d + L * per_layer + d


def test_tied_embeddings_share_one_tensor():
    model = TransformerLM(_config(tie_embeddings=True))
    assert model.lm_head.weight is model.token_embeddings.weight
    assert model.num_params() == TransformerLM(_config()).num_params() - 50 * 32


def test_forward_shape_and_causality():
    torch.manual_seed(0)
    model = TransformerLM(_config())
    ids = torch.randint(0, 50, (3, 10))
    logits = model(ids)
    assert logits.shape == (3, 10, 50)
    changed = ids.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 50
    # positions before the change must not see it
    torch.testing.assert_close(model(changed)[:, :6], logits[:, :6])
    assert not torch.allclose(model(changed)[:, 6:], logits[:, 6:])
    assert model(ids[0]).shape == (10, 50)


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm", "none"])
def test_norm_variants_build_and_run(norm):
    model = TransformerLM(_config(norm=norm))
    assert torch.isfinite(model(torch.randint(0, 50, (2, 5)))).all()


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(d_model=30), "d_model=30 must be divisible by num_heads=4"),
        (dict(num_kv_heads=3), "num_kv_heads=3"),
        (dict(norm="batchnorm"), "norm="),
        (dict(vocab_size=0), "vocab_size"),
    ],
)
def test_bad_config(overrides, match):
    with pytest.raises(ValueError, match=match):
        _config(**overrides)


def test_bad_inputs():
    model = TransformerLM(_config())
    with pytest.raises(ValueError, match="context_length=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="token_ids"):
        model(torch.tensor([[0, 50]]))
    with pytest.raises(ValueError, match="token_ids"):
        model(torch.zeros(1, 2, 3, dtype=torch.long))


@pytest.mark.parametrize("num_kv_heads", [None, 1])
def test_cached_generation_equals_uncached(num_kv_heads):
    torch.manual_seed(0)
    model = TransformerLM(_config(num_kv_heads=num_kv_heads, context_length=32))
    prompt = torch.randint(0, 50, (2, 5))
    with_cache = generate(model, prompt, 20, use_cache=True)
    without = generate(model, prompt, 20, use_cache=False)
    assert torch.equal(with_cache, without)
    assert torch.equal(with_cache[:, :5], prompt)


def test_sampling_is_reproducible_and_respects_top_k():
    model = TransformerLM(_config(context_length=32))
    prompt = torch.randint(0, 50, (1, 3))
    a = generate(model, prompt, 10, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(1))
    b = generate(model, prompt, 10, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    # with top_k=1 sampling is greedy
    greedy = generate(model, prompt, 10)
    assert torch.equal(generate(model, prompt, 10, temperature=1.0, top_k=1), greedy)


def test_generate_errors():
    model = TransformerLM(_config())
    with pytest.raises(ValueError, match="context_length"):
        generate(model, torch.zeros(1, 10, dtype=torch.long), 10)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, torch.zeros(1, 2, dtype=torch.long), 1, temperature=-1)


def test_tiny_config_overrides():
    cfg = tiny_config(15, norm="layernorm")
    assert cfg.vocab_size == 15 and cfg.norm == "layernorm"


def test_config_from_takes_a_config_or_a_preset_name():
    from labkit.model import PRESETS, config_from

    assert config_from("qwen3-8b", PRESETS) is PRESETS["qwen3-8b"]
    assert config_from(PRESETS["gemma-2b"], {}) is PRESETS["gemma-2b"]
    with pytest.raises(ValueError, match="config='gpt-5'"):
        config_from("gpt-5", PRESETS)
    with pytest.raises(TypeError, match="ModelConfig"):
        config_from(8, PRESETS)
