"""A LLaMA-style decoder-only transformer in one readable file.

``TransformerLM(config)``: token embedding -> ``num_layers`` pre-norm blocks
(``x + attn(ln1(x))``, then ``x + ffn(ln2(x))``) -> final norm -> LM head.
State-dict keys read like the architecture: ``token_embeddings.weight``,
``layers.{i}.ln1.weight``, ``layers.{i}.attn.{q,k,v,output}_proj.weight``,
``layers.{i}.ln2.weight``, ``layers.{i}.ffn.{w1,w2,w3}.weight``, ``ln_final.weight``,
``lm_head.weight``. With ``ModelConfig(moe=MoEConfig(...))`` the FFN of the MoE layers is a
:class:`labkit.experts.MoELayer` instead (``layers.{i}.ffn.router.weight``,
``layers.{i}.ffn.experts.{w1,w2,w3}``, ...).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from labkit.experts import MoEConfig, MoELayer, active_parameter_count
from labkit.nn import GLU, Embedding, KVCache, Linear, MultiHeadSelfAttention, RoPE
from labkit.nn import make_norm as norm_layer

NORMS = ("rmsnorm", "layernorm", "none")  # BatchNorm mixes tokens of a batch: not offered for the LM


@dataclass
class ModelConfig:
    vocab_size: int
    context_length: int
    d_model: int
    num_layers: int
    num_heads: int
    d_ff: int
    rope_theta: float = 10000.0
    num_kv_heads: int | None = None
    head_dim: int | None = None  # default d_model // num_heads
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm" | "none"
    norm_eps: float = 1e-5
    activation: str = "silu"  # gate activation of the GLU feed-forward (silu = SwiGLU)
    qk_norm: bool = False
    tie_embeddings: bool = False  # lm_head shares the token-embedding matrix
    use_triton: bool = False  # route RMSNorm, SwiGLU and attention through labkit.kernels
    moe: MoEConfig | None = None  # mixture-of-experts FFN in some or all layers (None: dense)

    def __post_init__(self):
        for name in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        kv = self.kv_heads
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by num_heads={self.num_heads}")
        if kv <= 0 or self.num_heads % kv:
            raise ValueError(f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}")
        if self.norm not in NORMS:
            raise ValueError(f"norm={self.norm!r}: expected one of {NORMS}")
        if isinstance(self.moe, dict):  # dataclasses.asdict() of a saved config
            self.moe = MoEConfig(**self.moe)
        if self.moe is not None:
            if not isinstance(self.moe, MoEConfig):
                raise TypeError(f"moe: expected a labkit.experts.MoEConfig or None, got {type(self.moe).__name__}")
            if not any(self.moe.is_moe_layer(i) for i in range(self.num_layers)):
                raise ValueError(f"moe: first_dense={self.moe.first_dense}, every={self.moe.every} leaves no MoE layer "
                                 f"among num_layers={self.num_layers}")

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s FFN is a mixture of experts."""
        return self.moe is not None and self.moe.is_moe_layer(layer_idx)


def make_norm(config: ModelConfig, device=None, dtype=None) -> nn.Module:
    return norm_layer(config.norm, config.d_model, config.norm_eps, device, dtype, use_triton=config.use_triton)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x = x + attn(ln1(x)); x = x + ffn(ln2(x))``; ``ffn`` is a GLU, or an
    :class:`~labkit.experts.MoELayer` when ``config.is_moe_layer(layer_idx)``."""

    def __init__(self, config: ModelConfig, rope: RoPE | None = None, device=None, dtype=None, layer_idx: int = 0):
        super().__init__()
        self.ln1 = make_norm(config, device, dtype)
        self.attn = MultiHeadSelfAttention(
            config.d_model,
            config.num_heads,
            config.num_kv_heads,
            rope=rope,
            head_dim=config.head_dim,
            qk_norm=config.qk_norm,
            device=device,
            dtype=dtype,
            use_triton=config.use_triton,
        )
        self.ln2 = make_norm(config, device, dtype)
        if config.is_moe_layer(layer_idx):
            self.ffn = MoELayer.from_config(config.d_model, config.d_ff, config.moe, config.activation, device=device, dtype=dtype,
                                            use_triton=config.use_triton)
        else:
            self.ffn = GLU(config.d_model, config.d_ff, config.activation, device=device, dtype=dtype, use_triton=config.use_triton)

    def forward(self, x: torch.Tensor, token_positions=None, kv_cache=None, layer_idx: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), token_positions, kv_cache, layer_idx)
        return x + self.ffn(self.ln2(x))


class TransformerLM(nn.Module):
    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.token_embeddings = Embedding(config.vocab_size, config.d_model, device=device, dtype=dtype)
        # One RoPE table shared by every layer (a non-persistent buffer: not in the state dict).
        rope = RoPE(config.rope_theta, config.dim_per_head, config.context_length, device=device)
        self.layers = nn.ModuleList(TransformerBlock(config, rope, device, dtype, layer_idx=i) for i in range(config.num_layers))
        self.ln_final = make_norm(config, device, dtype)
        self.lm_head = Linear(config.d_model, config.vocab_size, device=device, dtype=dtype)
        if config.tie_embeddings:
            self.lm_head.weight = self.token_embeddings.weight

    def forward(self, token_ids: torch.Tensor, token_positions: torch.Tensor | None = None, kv_cache=None) -> torch.Tensor:
        """``token_ids`` ``[batch, seq]`` (or ``[seq]``) -> logits ``[batch, seq, vocab_size]``."""
        if token_ids.dim() not in (1, 2):
            raise ValueError(f"token_ids: expected [batch, seq] or [seq], got shape {tuple(token_ids.shape)}")
        seq = token_ids.shape[-1]
        past = kv_cache.length(0) if kv_cache is not None else 0
        if past + seq > self.config.context_length:
            raise ValueError(
                f"token_ids: sequence length {past + seq} (including {past} cached) exceeds "
                f"context_length={self.config.context_length}"
            )
        x = self.token_embeddings(token_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, token_positions, kv_cache, i)
        return self.lm_head(self.ln_final(x))

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (shared tensors counted once); ``non_embedding`` leaves out the
        token-embedding table, the usual convention in scaling-law papers."""
        total = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        if non_embedding and not self.config.tie_embeddings:
            total -= self.token_embeddings.weight.numel()
        return total


@torch.no_grad()
def generate(
    model: TransformerLM,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    use_cache: bool = True,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Continue ``prompt_ids`` (``[batch, prompt_len]`` or ``[prompt_len]``) by ``max_new_tokens``.

    ``temperature=0`` is greedy decoding. With ``use_cache`` the prompt is processed once
    (prefill) and every later step feeds only the newest token, reading earlier keys/values
    from a :class:`labkit.nn.KVCache`; without it, every step recomputes the whole prefix.
    Returns the prompt followed by the new tokens.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 0")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: expected >= 0 (0 = greedy)")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k={top_k}: expected a positive integer or None")
    squeeze = prompt_ids.dim() == 1
    ids = prompt_ids[None] if squeeze else prompt_ids
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"prompt_ids: expected a non-empty [batch, prompt_len] tensor, got shape {tuple(prompt_ids.shape)}")
    total = ids.shape[1] + max_new_tokens
    if total > model.config.context_length:
        raise ValueError(
            f"max_new_tokens={max_new_tokens}: prompt ({ids.shape[1]}) + new tokens exceeds "
            f"context_length={model.config.context_length}"
        )
    was_training = model.training
    model.eval()
    cache = KVCache.for_model(model, batch_size=ids.shape[0], max_seq_len=total) if use_cache else None
    step_input = ids
    for _ in range(max_new_tokens):
        logits = model(step_input, kv_cache=cache)[:, -1, :].float()
        next_id = _sample(logits, temperature, top_k, generator)
        ids = torch.cat([ids, next_id], dim=1)
        step_input = next_id if use_cache else ids
    model.train(was_training)
    return ids[0] if squeeze else ids


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None, generator) -> torch.Tensor:
    if temperature == 0.0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


def tiny_config(vocab_size: int, **overrides) -> ModelConfig:
    """The small LM that the chapters train on the built-in arithmetic task: a few seconds
    of CPU training. Override any field, e.g. ``tiny_config(v, norm="layernorm")``."""
    fields = dict(vocab_size=vocab_size, context_length=64, d_model=64, num_layers=2, num_heads=4, d_ff=172)
    fields.update(overrides)
    return ModelConfig(**fields)


# Published architectures (the models' Hugging Face config.json files), for sizing weights and
# KV caches: build one on the ``meta`` device to count parameters without allocating memory,
# e.g. ``TransformerLM(PRESETS["qwen3-8b"], device="meta").num_params()``.
PRESETS: dict[str, ModelConfig] = {
    # Qwen3-8B: GQA 32 query / 8 KV heads, QK-norm, untied embeddings; 8.19B parameters.
    "qwen3-8b": ModelConfig(
        vocab_size=151936, context_length=40960, d_model=4096, num_layers=36, num_heads=32, num_kv_heads=8,
        head_dim=128, d_ff=12288, rope_theta=1_000_000.0, norm_eps=1e-6, qk_norm=True,
    ),
    # Llama-3-8B: GQA 32 / 8, 128k-token vocabulary; 8.03B parameters.
    "llama3-8b": ModelConfig(
        vocab_size=128256, context_length=8192, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        d_ff=14336, rope_theta=500_000.0,
    ),
    # Llama-2-7B: plain MHA (32 KV heads), the baseline GQA was invented to shrink; 6.74B parameters.
    "llama2-7b": ModelConfig(
        vocab_size=32000, context_length=4096, d_model=4096, num_layers=32, num_heads=32, d_ff=11008,
    ),
    # Llama-2-70B: GQA 64 / 8; 68.98B parameters.
    "llama2-70b": ModelConfig(
        vocab_size=32000, context_length=4096, d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8,
        d_ff=28672,
    ),
    # Gemma-2B: MQA (one KV head of dim 256), GeGLU, tied embeddings; 2.51B parameters. (Gemma's
    # GELU is the tanh approximation and it scales embeddings by sqrt(d_model); neither changes
    # the parameter count or the KV cache.)
    "gemma-2b": ModelConfig(
        vocab_size=256000, context_length=8192, d_model=2048, num_layers=18, num_heads=8, num_kv_heads=1,
        head_dim=256, d_ff=16384, norm_eps=1e-6, activation="gelu", tie_embeddings=True,
    ),
}


def count_parameters(config: ModelConfig) -> int:
    """Parameters of ``TransformerLM(config)``, counted on the ``meta`` device (no memory used),
    so it works for a 70B-parameter preset on a laptop."""
    return TransformerLM(config, device="meta").num_params()


def count_active_parameters(config: ModelConfig) -> int:
    """Parameters one token uses in ``TransformerLM(config)`` (built on ``meta``): the total minus
    the routed experts each MoE layer does not send it to; equal to the total for a dense model."""
    return active_parameter_count(TransformerLM(config, device="meta"))



def config_from(config, presets: dict[str, ModelConfig]) -> ModelConfig:
    """``config`` itself if it is a :class:`ModelConfig`, else the entry of ``presets`` it names."""
    if isinstance(config, str):
        if config not in presets:
            raise ValueError(f"config={config!r}: expected a ModelConfig or one of {sorted(presets)}")
        return presets[config]
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected a labkit.model.ModelConfig or a preset name, got {type(config).__name__}")
    return config

# Published mixture-of-experts architectures (Hugging Face config.json files), kept apart from
# PRESETS (whose every entry chapter 03 tabulates as a dense model). DeepSeek-V3 is not here:
# its MLA attention is not a TransformerLM option (labkit.moe counts it from its config; labkit.attention_variants
# builds MLA itself).
MOE_PRESETS: dict[str, ModelConfig] = {
    # Mixtral-8x7B: Mistral-7B's attention (GQA 32 / 8) and 8 SwiGLU experts of 14336, top-2 with
    # renormalised softmax gates; published 46.7B total, 12.9B active parameters.
    "mixtral-8x7b": ModelConfig(
        vocab_size=32000, context_length=32768, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        d_ff=14336, rope_theta=1_000_000.0, moe=MoEConfig(num_experts=8, top_k=2),
    ),
    # Qwen3-30B-A3B: 48 layers, GQA 32 / 4 heads of 128, QK-norm, 128 fine-grained experts of 768,
    # top-8 (norm_topk_prob), no shared expert; published 30.5B total, 3.3B active.
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936, context_length=40960, d_model=2048, num_layers=48, num_heads=32, num_kv_heads=4,
        head_dim=128, d_ff=6144, rope_theta=1_000_000.0, norm_eps=1e-6, qk_norm=True,
        moe=MoEConfig(num_experts=128, top_k=8, d_ff=768),
    ),
}
