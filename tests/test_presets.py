"""labkit.model.PRESETS: real architectures whose parameter counts match the published figures."""
import time

import labkit  # noqa: F401
import pytest
import torch

from labkit.model import PRESETS, TransformerLM, count_parameters

# Published totals (Hugging Face model cards / safetensors metadata).
PUBLISHED = {
    "qwen3-8b": 8.19e9,  # Qwen3-8B: "8.2B"
    "llama3-8b": 8.03e9,  # Meta-Llama-3-8B
    "llama2-7b": 6.74e9,  # Llama-2-7b
    "llama2-70b": 68.98e9,  # Llama-2-70b ("70B")
    "gemma-2b": 2.51e9,  # gemma-2b
}


def closed_form_params(c) -> int:
    """Count from the architecture alone: embeddings, per-layer attention + GLU + norms."""
    head_dim = c.head_dim or c.d_model // c.num_heads
    kv = c.num_kv_heads or c.num_heads
    attn = c.d_model * head_dim * (2 * c.num_heads + 2 * kv) + (2 * head_dim if c.qk_norm else 0)
    layer = attn + 3 * c.d_model * c.d_ff + 2 * c.d_model
    embeddings = c.vocab_size * c.d_model * (1 if c.tie_embeddings else 2)
    return embeddings + c.num_layers * layer + c.d_model


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts(name):
    count = count_parameters(PRESETS[name])
    assert count == closed_form_params(PRESETS[name])
    assert count == pytest.approx(PUBLISHED[name], rel=2e-3)


def test_required_presets_and_their_attention_kinds():
    assert {"qwen3-8b", "llama3-8b", "llama2-70b"} <= PRESETS.keys()
    qwen = PRESETS["qwen3-8b"]
    assert (qwen.num_layers, qwen.d_model, qwen.num_heads, qwen.kv_heads, qwen.dim_per_head) == (36, 4096, 32, 8, 128)
    assert qwen.qk_norm and not qwen.tie_embeddings
    gemma = PRESETS["gemma-2b"]
    assert gemma.kv_heads == 1 and gemma.dim_per_head == 256 and gemma.tie_embeddings and gemma.activation == "gelu"
    assert PRESETS["llama2-7b"].kv_heads == PRESETS["llama2-7b"].num_heads  # MHA


def test_meta_build_allocates_nothing_and_is_fast():
    start = time.perf_counter()
    model = TransformerLM(PRESETS["llama2-70b"], device="meta")
    assert time.perf_counter() - start < 5.0
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.lm_head.weight is not model.token_embeddings.weight
    tied = TransformerLM(PRESETS["gemma-2b"], device="meta")
    assert tied.lm_head.weight is tied.token_embeddings.weight
    assert isinstance(tied.layers[0].attn.k_proj.weight, torch.nn.Parameter)
