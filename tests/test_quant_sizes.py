"""labkit.quant.deepseek_v3_parameters: DeepSeek-V3's published size, and the same count from modules
laid out like the reference implementation (built on the meta device, so nothing is allocated)."""
import labkit  # noqa: F401

import pytest
import torch
from torch import nn

from labkit import quant as Q


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))


def linear(d_in, d_out):
    return nn.Linear(d_in, d_out, bias=False)


class MLP(nn.Module):
    def __init__(self, hidden, inner):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = linear(hidden, inner), linear(hidden, inner), linear(inner, hidden)


class MLA(nn.Module):
    """The modules of modeling_deepseek.DeepseekV3Attention (q_lora_rank set)."""

    def __init__(self, c):
        super().__init__()
        heads, nope, rope = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"]
        self.q_a_proj = linear(c["hidden_size"], c["q_lora_rank"])
        self.q_a_layernorm = RMSNorm(c["q_lora_rank"])
        self.q_b_proj = linear(c["q_lora_rank"], heads * (nope + rope))
        self.kv_a_proj_with_mqa = linear(c["hidden_size"], c["kv_lora_rank"] + rope)
        self.kv_a_layernorm = RMSNorm(c["kv_lora_rank"])
        self.kv_b_proj = linear(c["kv_lora_rank"], heads * (nope + c["v_head_dim"]))
        self.o_proj = linear(heads * c["v_head_dim"], c["hidden_size"])


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        hidden, inner = c["hidden_size"], c["moe_intermediate_size"]
        self.experts = nn.ModuleList(MLP(hidden, inner) for _ in range(c["n_routed_experts"]))
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(c["n_routed_experts"], hidden))
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(c["n_routed_experts"]))
        self.shared_experts = MLP(hidden, inner * c["n_shared_experts"])


class Layer(nn.Module):
    def __init__(self, c, moe):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(c["hidden_size"]), RMSNorm(c["hidden_size"])
        self.self_attn = MLA(c)
        self.mlp = MoE(c) if moe else MLP(c["hidden_size"], c["intermediate_size"])


def counted(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def modules_total(c) -> int:
    """embed_tokens + layers + norm + lm_head, counting one dense and one MoE layer and multiplying."""
    with torch.device("meta"):
        dense, moe = counted(Layer(c, moe=False)), counted(Layer(c, moe=True))
    dense_layers = c["first_k_dense_replace"]
    embeddings = c["vocab_size"] * c["hidden_size"]
    lm_head = 0 if c["tie_word_embeddings"] else embeddings
    return embeddings + dense_layers * dense + (c["num_hidden_layers"] - dense_layers) * moe + c["hidden_size"] + lm_head


def test_deepseek_v3_is_671b_without_its_mtp_module():
    parts = Q.deepseek_v3_parameters()
    assert parts["total"] == pytest.approx(671e9, rel=0.005)
    assert parts["active"] == pytest.approx(37e9, rel=0.02)  # "37B activated for each token"
    assert parts["total"] == sum(v for k, v in parts.items() if k not in ("total", "active"))
    assert parts["routed_experts"] > 0.97 * parts["total"]


def test_the_formula_counts_what_the_reference_modules_hold():
    assert Q.deepseek_v3_parameters()["total"] == modules_total(Q.DEEPSEEK_V3)
    small = dict(vocab_size=100, hidden_size=48, num_hidden_layers=4, first_k_dense_replace=1, intermediate_size=96,
                 n_routed_experts=6, n_shared_experts=2, num_experts_per_tok=2, moe_intermediate_size=16,
                 num_attention_heads=3, q_lora_rank=24, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                 v_head_dim=10, tie_word_embeddings=True)
    parts = Q.deepseek_v3_parameters(**small)
    assert parts["total"] == modules_total(small)
    assert parts["lm_head"] == 0
    assert parts["active"] == parts["total"] - 3 * (6 - 2) * 3 * 48 * 16


@pytest.mark.parametrize("overrides, words", [
    (dict(hidden=7168), "unknown config fields"),
    (dict(q_lora_rank=0), "q_lora_rank=0"),
    (dict(first_k_dense_replace=62), "first_k_dense_replace"),
    (dict(num_experts_per_tok=300), "num_experts_per_tok"),
    (dict(vocab_size=1.5), "vocab_size"),
])
def test_bad_configs_are_named(overrides, words):
    with pytest.raises(ValueError, match=words):
        Q.deepseek_v3_parameters(**overrides)
