import math

import pytest
import torch
import torch.nn.functional as F

from labkit import nn as lnn

SHAPES = [(3, 7), (2, 5, 33), (1, 1, 4, 16)]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_linear_matches_f_linear_and_init_scale():
    layer = lnn.Linear(300, 200)
    assert layer.weight.shape == (200, 300)
    x = torch.randn(4, 9, 300)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
    std = math.sqrt(2 / 500)
    # a normal cut at +-3 sigma keeps std * sqrt(1 - 6 phi(3) / (Phi(3) - Phi(-3)))
    phi3 = math.exp(-4.5) / math.sqrt(2 * math.pi)
    truncated_std = std * math.sqrt(1 - 6 * phi3 / math.erf(3 / math.sqrt(2)))
    assert layer.weight.std().item() == pytest.approx(truncated_std, rel=0.02)
    assert layer.weight.abs().max() <= 3 * std + 1e-6


def test_linear_wrong_input_dim():
    with pytest.raises(ValueError, match="d_in=4"):
        lnn.Linear(4, 2)(torch.randn(3, 5))


def test_embedding_lookup_and_errors():
    emb = lnn.Embedding(10, 6)
    ids = torch.tensor([[1, 9], [0, 3]])
    torch.testing.assert_close(emb(ids), F.embedding(ids, emb.weight))
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        emb(torch.tensor([10]))
    with pytest.raises(TypeError, match="integer"):
        emb(torch.tensor([1.0]))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rmsnorm_matches_torch(shape, dtype):
    norm = lnn.RMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    expected = F.rms_norm(x.double(), (shape[-1],), norm.weight.double(), eps=1e-5).to(dtype)
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm(x), expected, **tol)


@pytest.mark.parametrize("shape", SHAPES)
def test_layernorm_matches_torch(shape):
    norm = lnn.LayerNorm(shape[-1])
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-1, 1)
    x = torch.randn(shape) * 2 + 5
    torch.testing.assert_close(norm(x), F.layer_norm(x, (shape[-1],), norm.weight, norm.bias, 1e-5))


def test_norms_reject_wrong_hidden_size():
    for norm in (lnn.RMSNorm(8), lnn.LayerNorm(8), lnn.BatchNorm(8)):
        with pytest.raises(ValueError, match="last dim must be 8"):
            norm(torch.randn(4, 7))


def test_batchnorm_matches_torch_over_train_and_eval_steps():
    ours, ref = lnn.BatchNorm(6, momentum=0.2), torch.nn.BatchNorm1d(6, momentum=0.2)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        ours.bias.uniform_(-1, 1)
        ref.weight.copy_(ours.weight)
        ref.bias.copy_(ours.bias)
    for step in range(5):
        x = torch.randn(4, 10, 6) * (step + 1) + step
        # torch's BatchNorm1d wants channels second: [N, C, L]
        torch.testing.assert_close(ours(x), ref(x.transpose(1, 2)).transpose(1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.running_mean, ref.running_mean)
    torch.testing.assert_close(ours.running_var, ref.running_var)
    ours.eval(), ref.eval()
    x = torch.randn(3, 6)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)


def test_batchnorm_needs_more_than_one_value_in_training():
    with pytest.raises(ValueError, match="more than one"):
        lnn.BatchNorm(4)(torch.randn(1, 4))


def test_activations_match_torch():
    x = torch.linspace(-8, 8, 1001, dtype=torch.float64)
    torch.testing.assert_close(lnn.silu(x), F.silu(x))
    torch.testing.assert_close(lnn.gelu(x), F.gelu(x))
    torch.testing.assert_close(lnn.gelu(x, "tanh"), F.gelu(x, approximate="tanh"))
    torch.testing.assert_close(lnn.relu(x), F.relu(x))
    with pytest.raises(ValueError, match="approximate"):
        lnn.gelu(x, "fast")


def test_softmax_is_stable_and_matches_torch():
    x = torch.randn(4, 9) * 50
    x[0] += 1e4
    torch.testing.assert_close(lnn.softmax(x, dim=-1), torch.softmax(x, dim=-1))
    torch.testing.assert_close(lnn.softmax(x, dim=0), torch.softmax(x, dim=0))
    assert torch.isfinite(lnn.softmax(x)).all()


@pytest.mark.parametrize("activation", sorted(lnn.ACTIVATIONS))
def test_glu_family_formula(activation):
    ffn = lnn.GLU(16, 40, activation)
    x = torch.randn(2, 3, 16)
    act = {"silu": F.silu, "gelu": F.gelu, "sigmoid": torch.sigmoid, "relu": F.relu}[activation]
    expected = F.linear(act(F.linear(x, ffn.w1.weight)) * F.linear(x, ffn.w3.weight), ffn.w2.weight)
    torch.testing.assert_close(ffn(x), expected)
    with pytest.raises(ValueError, match="activation"):
        lnn.GLU(4, 8, "tanh")


def test_swiglu_is_glu_with_silu():
    ffn = lnn.SwiGLU(8, 24)
    assert [n for n, _ in ffn.named_parameters()] == ["w1.weight", "w2.weight", "w3.weight"]
    assert ffn.activation == "silu"


def _rope_reference(x, positions, theta):
    """Complex-number RoPE: pair (x[2i], x[2i+1]) is the complex number x[2i] + i x[2i+1]."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[..., None] * freqs
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


def test_rope_matches_complex_rotation_and_is_relative():
    rope = lnn.RoPE(10000.0, 16, 64)
    x = torch.randn(2, 5, 16)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 3, 9, 60, 1]])
    torch.testing.assert_close(rope(x, pos).double(), _rope_reference(x, pos, 10000.0), rtol=1e-5, atol=1e-5)
    q, k = torch.randn(16), torch.randn(16)
    dots = [rope(q[None], torch.tensor([m]))[0] @ rope(k[None], torch.tensor([m - 3]))[0] for m in (3, 10, 40)]
    torch.testing.assert_close(torch.stack(dots), dots[0].expand(3), rtol=1e-4, atol=1e-4)


def test_rope_errors():
    with pytest.raises(ValueError, match="even"):
        lnn.RoPE(10000.0, 7, 8)
    with pytest.raises(ValueError, match="max_seq_len"):
        lnn.RoPE(10000.0, 8, 8)(torch.randn(1, 8), torch.tensor([8]))


@pytest.mark.parametrize("q_len, k_len", [(5, 5), (1, 9), (4, 11)])
def test_sdpa_matches_torch_with_masks(q_len, k_len):
    q, k, v = torch.randn(2, 3, q_len, 8), torch.randn(2, 3, k_len, 8), torch.randn(2, 3, k_len, 6)
    torch.testing.assert_close(lnn.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    mask = lnn.causal_mask(q_len, k_len)
    torch.testing.assert_close(lnn.scaled_dot_product_attention(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    random_mask = torch.rand(q_len, k_len) > 0.3
    random_mask[:, 0] = True
    torch.testing.assert_close(lnn.scaled_dot_product_attention(q, k, v, random_mask), F.scaled_dot_product_attention(q, k, v, attn_mask=random_mask))


def test_causal_mask_is_bottom_right_aligned():
    mask = lnn.causal_mask(2, 4)
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert torch.equal(lnn.causal_mask(3, 3), torch.ones(3, 3, dtype=torch.bool).tril())


def test_sdpa_errors():
    with pytest.raises(ValueError, match="d_k"):
        lnn.scaled_dot_product_attention(torch.randn(2, 4), torch.randn(2, 5), torch.randn(2, 5))
    with pytest.raises(TypeError, match="boolean"):
        lnn.scaled_dot_product_attention(torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4), torch.ones(2, 2))


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("use_rope", [False, True])
def test_mhsa_matches_torch_sdpa_with_gqa(num_heads, num_kv_heads, use_rope):
    d_model, seq = 32, 7
    head_dim = d_model // num_heads
    rope = lnn.RoPE(10000.0, head_dim, 16) if use_rope else None
    attn = lnn.MultiHeadSelfAttention(d_model, num_heads, num_kv_heads, rope=rope)
    x = torch.randn(2, seq, d_model)
    q = F.linear(x, attn.q_proj.weight).view(2, seq, num_heads, head_dim).transpose(1, 2)
    k = F.linear(x, attn.k_proj.weight).view(2, seq, num_kv_heads, head_dim).transpose(1, 2)
    v = F.linear(x, attn.v_proj.weight).view(2, seq, num_kv_heads, head_dim).transpose(1, 2)
    if use_rope:
        pos = torch.arange(seq)
        q, k = rope(q, pos), rope(k, pos)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected = F.linear(out.transpose(1, 2).reshape(2, seq, d_model), attn.output_proj.weight)
    torch.testing.assert_close(attn(x), expected, rtol=1e-5, atol=1e-5)


def test_mhsa_shapes_and_errors():
    attn = lnn.MultiHeadSelfAttention(32, 8, 2)
    assert attn.k_proj.weight.shape == (8, 32) and attn.q_proj.weight.shape == (32, 32)
    with pytest.raises(ValueError, match="num_heads=4"):
        lnn.MultiHeadSelfAttention(30, 4)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        lnn.MultiHeadSelfAttention(32, 4, 3)
    with pytest.raises(ValueError, match="seq, d_model"):
        attn(torch.randn(32))


@pytest.mark.parametrize("num_heads, num_kv_heads, num_queries, num_keys", [(8, 2, 5, 9), (4, 1, 1, 17), (6, 3, 7, 7), (4, 4, 3, 6)])
def test_grouped_query_attention_equals_repeated_kv(num_heads, num_kv_heads, num_queries, num_keys):
    gen = torch.Generator().manual_seed(num_heads * 100 + num_keys)
    q = torch.randn(2, num_heads, num_queries, 16, generator=gen)
    k, v = (torch.randn(2, num_kv_heads, num_keys, 16, generator=gen) for _ in range(2))
    mask = lnn.causal_mask(num_queries, num_keys)
    group = num_heads // num_kv_heads
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask)
    torch.testing.assert_close(lnn.grouped_query_attention(q, k, v, mask), expected, atol=1e-5, rtol=1e-5)


def test_grouped_query_attention_errors():
    q, k = torch.randn(1, 6, 3, 8), torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match="dividing"):
        lnn.grouped_query_attention(q, k, k)
    with pytest.raises(ValueError, match="mask"):
        lnn.grouped_query_attention(torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8),
                                    torch.ones(1, 3, 3, dtype=torch.bool))


def test_rotate_half_permutation_maps_hugging_face_rope_to_interleaved():
    d, theta, positions = 16, 10000.0, torch.arange(7)
    x = torch.randn(3, 7, d, generator=torch.Generator().manual_seed(0))
    # Hugging Face Llama's convention: pairs (i, i + d/2), x * cos + rotate_half(x) * sin
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = (positions[:, None] * inv_freq[None, :]).float()
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)
    rotate_half = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
    hugging_face = x * cos + rotate_half * sin
    perm = lnn.rotate_half_permutation(d)
    ours = lnn.RoPE(theta, d, 16)(x[..., perm], positions)[..., perm.argsort()]
    torch.testing.assert_close(ours, hugging_face, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="even"):
        lnn.rotate_half_permutation(7)
