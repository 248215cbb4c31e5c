"""The Triton FlashAttention kernel against torch's F.scaled_dot_product_attention in float64.

Under Triton's CPU interpreter the shapes stay small (a handful of programs, 64x64 tiles); they
still cover ragged lengths, several key blocks, decode (Nq=1), Nq < Nk, GQA and MQA.
"""
import math

import labkit  # noqa: F401  (switches Triton to the interpreter on CPU first)
import pytest
import torch
import torch.nn.functional as F

from labkit.kernels.flash_attention import attention_reference, flash_attention, flash_attention_with_lse
from labkit.runtime import triton_mode

DEVICE = "cuda" if triton_mode() == "compiled" else "cpu"
# (forward atol, gradient atol) per input dtype; rtol alike
TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 1e-2), torch.bfloat16: (2e-2, 6e-2)}


def bottom_right_mask(num_q: int, num_k: int) -> torch.Tensor:
    return torch.ones(num_q, num_k, dtype=torch.bool, device=DEVICE).tril(diagonal=num_k - num_q)


def sdpa_reference(q, k, v, causal: bool):
    """(out, lse) in float64 from torch's own attention, with an explicit boolean mask."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k_rep, v_rep = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)
    mask = bottom_right_mask(q.shape[2], k.shape[2]) if causal else None
    out = F.scaled_dot_product_attention(q64, k_rep, v_rep, attn_mask=mask)
    scores = q64 @ k_rep.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return out, torch.logsumexp(scores, dim=-1), (q64, k64, v64)


def make_qkv(batch, heads, kv_heads, num_q, num_k, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, num_q, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, num_k, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, num_k, head_dim, generator=gen)
    return [t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v)]


# batch, Hq, Hkv, Nq, Nk, head_dim, causal, dtype
FORWARD_CASES = [
    (1, 2, 2, 64, 64, 64, True, torch.float32),  # MHA, one exact block
    (2, 4, 2, 77, 77, 32, True, torch.float32),  # GQA 2, ragged self-attention, two query blocks
    (1, 4, 1, 1, 150, 64, True, torch.float16),  # MQA decode step: one query, three key blocks
    (1, 8, 2, 19, 100, 128, True, torch.bfloat16),  # GQA 4, Nq < Nk (cached prefill)
    (1, 4, 4, 130, 45, 32, False, torch.float16),  # non-causal, Nq > Nk
    (2, 2, 1, 33, 97, 48, False, torch.float32),  # MQA, head dim not a power of two
    (1, 2, 1, 50, 50, 128, False, torch.bfloat16),
]


@pytest.mark.parametrize("batch,heads,kv_heads,num_q,num_k,head_dim,causal,dtype", FORWARD_CASES)
def test_forward_matches_sdpa(batch, heads, kv_heads, num_q, num_k, head_dim, causal, dtype):
    q, k, v = make_qkv(batch, heads, kv_heads, num_q, num_k, head_dim, dtype)
    out, lse = flash_attention_with_lse(q, k, v, causal=causal)
    expected, expected_lse, _ = sdpa_reference(q, k, v, causal)
    atol = TOL[dtype][0]
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (batch, heads, num_q)
    torch.testing.assert_close(out.double(), expected.detach(), atol=atol, rtol=atol)
    torch.testing.assert_close(lse.double(), expected_lse.detach(), atol=1e-4, rtol=1e-5)


BACKWARD_CASES = [
    (1, 2, 1, 70, 70, 32, True, torch.float32),  # MQA, ragged, causal diagonal across two blocks
    (1, 4, 2, 1, 90, 64, True, torch.float16),  # decode step, GQA 2
    (1, 4, 1, 20, 75, 128, True, torch.bfloat16),  # GQA 4, Nq < Nk
    (2, 2, 2, 40, 66, 64, False, torch.float32),  # MHA, non-causal, ragged keys
]


@pytest.mark.parametrize("batch,heads,kv_heads,num_q,num_k,head_dim,causal,dtype", BACKWARD_CASES)
def test_backward_matches_sdpa(batch, heads, kv_heads, num_q, num_k, head_dim, causal, dtype):
    q, k, v = make_qkv(batch, heads, kv_heads, num_q, num_k, head_dim, dtype, seed=1)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    flash_attention(q, k, v, causal=causal).backward(grad_out)
    expected, _, leaves = sdpa_reference(q, k, v, causal)
    expected.backward(grad_out.double())
    atol = TOL[dtype][1]
    for name, got, ref in zip("qkv", (q, k, v), leaves):
        assert got.grad.dtype == dtype and got.grad.shape == got.shape, name
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=atol, rtol=atol, msg=lambda m, n=name: f"d{n}: {m}")


def test_reference_agrees_with_sdpa():
    q, k, v = make_qkv(1, 4, 2, 9, 23, 16, torch.float32)
    out, lse = attention_reference(q, k, v, causal=True)
    expected, expected_lse, _ = sdpa_reference(q, k, v, True)
    torch.testing.assert_close(out.double(), expected.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse.detach(), atol=1e-5, rtol=1e-5)


def test_custom_scale_and_strided_inputs():
    # a [B, N, H, D] projection viewed as [B, H, N, D] (what attention layers pass) needs no copy
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 40, 2, 32, generator=gen).to(DEVICE).transpose(1, 2)
    k = torch.randn(1, 40, 1, 32, generator=gen).to(DEVICE).transpose(1, 2)
    v = torch.randn(1, 40, 1, 32, generator=gen).to(DEVICE).transpose(1, 2)
    out = flash_attention(q, k, v, causal=True, scale=0.3)
    expected = F.scaled_dot_product_attention(
        q.double(), k.double().expand(-1, 2, -1, -1), v.double().expand(-1, 2, -1, -1), is_causal=True, scale=0.3
    )
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_attention_layer_uses_kernel_and_matches_torch_path():
    from labkit.attention import KVCache
    from labkit.nn import MultiHeadSelfAttention, RoPE

    torch.manual_seed(0)
    rope = RoPE(10000.0, 16, 64, device=DEVICE)
    torch_layer = MultiHeadSelfAttention(64, 4, num_kv_heads=2, rope=rope, device=DEVICE)
    triton_layer = MultiHeadSelfAttention(64, 4, num_kv_heads=2, rope=rope, device=DEVICE, use_triton=True)
    triton_layer.load_state_dict(torch_layer.state_dict())
    x = torch.randn(2, 21, 64, device=DEVICE)
    torch.testing.assert_close(triton_layer(x), torch_layer(x), atol=1e-5, rtol=1e-5)
    # decoding against a cache: Nq = 1 new query, bottom-right causal over all cached keys
    caches = [KVCache(1, 2, 2, 32, 16, device=DEVICE) for _ in range(2)]
    outs = [layer(x[:, :20], kv_cache=c) for layer, c in zip((torch_layer, triton_layer), caches)]
    outs += [layer(x[:, 20:], kv_cache=c) for layer, c in zip((torch_layer, triton_layer), caches)]
    torch.testing.assert_close(outs[3], outs[2], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "shapes,kwargs,error,match",
    [
        (((1, 2, 8, 32), (1, 2, 8, 16), (1, 2, 8, 16)), {}, ValueError, "head_dim must match"),
        (((1, 3, 8, 32), (1, 2, 8, 32), (1, 2, 8, 32)), {}, ValueError, "multiple of K/V heads"),
        (((1, 2, 8, 32), (1, 2, 8, 32), (1, 2, 9, 32)), {}, ValueError, "same shape"),
        (((1, 2, 8, 8), (1, 2, 8, 8), (1, 2, 8, 8)), {}, ValueError, "head_dim=8 is not supported"),
        (((1, 2, 8, 256), (1, 2, 8, 256), (1, 2, 8, 256)), {}, ValueError, "head_dim=256 is not supported"),
        (((2, 8, 32), (2, 8, 32), (2, 8, 32)), {}, ValueError, "expected 4 dims"),
        (((1, 2, 9, 32), (1, 2, 8, 32), (1, 2, 8, 32)), {"causal": True}, ValueError, "bottom-right"),
        (((1, 2, 8, 32), (1, 2, 8, 32), (1, 2, 8, 32)), {"scale": -1.0}, ValueError, "scale"),
    ],
)
def test_rejects_bad_input(shapes, kwargs, error, match):
    q, k, v = (torch.randn(s, device=DEVICE) for s in shapes)
    with pytest.raises(error, match=match):
        flash_attention(q, k, v, **kwargs)


def test_rejects_mixed_dtypes_and_unsupported_dtype():
    q = torch.randn(1, 2, 8, 32, device=DEVICE)
    with pytest.raises(TypeError, match="one dtype"):
        flash_attention(q, q.half(), q)
    with pytest.raises(TypeError, match="dtype"):
        flash_attention(q.double(), q.double(), q.double())
    with pytest.raises(ValueError, match="must be on|device"):
        flash_attention(q, q.to("meta"), q)


def test_transformer_with_use_triton_matches_and_generates_the_same_tokens():
    from labkit.model import TransformerLM, generate, tiny_config

    torch.manual_seed(0)
    reference = TransformerLM(tiny_config(15, num_kv_heads=2)).to(DEVICE)
    with_kernels = TransformerLM(tiny_config(15, num_kv_heads=2, use_triton=True)).to(DEVICE)
    with_kernels.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, 15, (2, 20), device=DEVICE)
    torch.testing.assert_close(with_kernels(tokens), reference(tokens), atol=1e-4, rtol=1e-4)
    prompt = tokens[:, :5]
    assert torch.equal(generate(with_kernels, prompt, 6), generate(reference, prompt, 6))


def test_the_forward_kernel_moves_exactly_the_bytes_its_loop_bounds_say():
    from labkit.kernels._common import InterpretedTraffic
    from labkit.kernels.flash_attention import flash_attention, forward_tiles, forward_traffic
    from labkit.runtime import triton_mode

    if triton_mode() != "interpreter":
        pytest.skip("memory operations are counted under Triton's interpreter")
    gen = torch.Generator().manual_seed(3)
    for q_shape, kv_heads, seq_k, causal in [((1, 2, 96, 32), 2, 96, False), ((2, 4, 40, 16), 2, 150, True)]:
        q = torch.randn(*q_shape, generator=gen)
        k, v = (torch.randn(q_shape[0], kv_heads, seq_k, q_shape[3], generator=gen) for _ in range(2))
        with InterpretedTraffic() as traffic:
            flash_attention(q, k, v, causal=causal)
        expected = forward_traffic(q_shape, kv_heads, seq_k, causal, *forward_tiles(q, seq_k), element_size=4)
        assert (traffic.loaded, traffic.stored) == (expected["loaded"], expected["stored"])
