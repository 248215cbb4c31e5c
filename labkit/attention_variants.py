"""Attention at today's frontier (chapter 03): what current models do to the KV cache and to attention logits.

* **Multi-head latent attention** (DeepSeek-V2/V3): keys and values are rebuilt from one small latent per token,
  so the cache holds the latent plus one shared RoPE key (:class:`MultiHeadLatentAttention`, :class:`MLAKVCache`);
  at decode time the up-projections are absorbed into the query and the output (``absorb=True``).
* **Sliding-window attention** (Mistral, Gemma 2/3): each query sees the last ``window`` keys only, so the cache is
  a ring buffer of ``window`` slots however long the sequence (:func:`sliding_window_mask`, :class:`RingKVCache`).
* **Paged KV cache** (vLLM's PagedAttention): the cache lives in fixed-size blocks of a shared pool, found through a
  block table per sequence (:class:`BlockAllocator`, :class:`PagedKVCache`); :func:`simulate_kv_waste` measures what
  contiguous preallocation wastes.
* **QK-norm** (Qwen3, OLMo 2): RMSNorm on each head's queries and keys bounds the attention logits; :func:`qk_norm_logit_growth`
  trains a tiny model with and without it and records the largest logit per step.
"""
from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import dataclass

import torch
from torch import nn

from labkit.data import ArithmeticTask
from labkit.kernels.paged_attention import paged_attention_varlen
from labkit.model import ModelConfig, TransformerLM, tiny_config
from labkit.nn import (
    Linear,
    MultiHeadSelfAttention,
    RMSNorm,
    RoPE,
    causal_mask,
    grouped_query_attention,
    scaled_dot_product_attention,
)
from labkit.quant import DEEPSEEK_V3
from labkit.runtime import run_seed
from labkit.train import TrainConfig, train


def _check_int(minimum: int = 1, **values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}={value!r}: expected an integer >= {minimum}")


# ============================================================================ multi-head latent attention
@dataclass(frozen=True)
class MLAConfig:
    """The dimensions of multi-head latent attention (DeepSeek-V2 paper, arXiv 2405.04434, section 2.1), in its notation:

    ``d_model`` (d), ``num_heads`` (n_h), ``kv_latent_dim`` (d_c, the compressed KV latent), ``q_latent_dim``
    (d_c', the compressed query; ``None``: queries are projected directly, as in DeepSeek-V2-Lite),
    ``qk_nope_head_dim`` (d_h, the per-head query/key part without position), ``qk_rope_head_dim`` (d_h^R, the
    decoupled RoPE part; one such key per token is shared by all heads), ``v_head_dim`` and ``num_layers``."""

    d_model: int
    num_heads: int
    kv_latent_dim: int
    q_latent_dim: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_layers: int = 1

    def __post_init__(self):
        _check_int(d_model=self.d_model, num_heads=self.num_heads, kv_latent_dim=self.kv_latent_dim,
                   qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                   v_head_dim=self.v_head_dim, num_layers=self.num_layers)
        if self.q_latent_dim is not None:
            _check_int(q_latent_dim=self.q_latent_dim)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim}: RoPE rotates pairs, so it must be even")

    @property
    def cache_elements_per_layer(self) -> int:
        """Elements one token leaves in one layer's cache: its latent and its RoPE key (576 for DeepSeek-V3)."""
        return self.kv_latent_dim + self.qk_rope_head_dim

    def attention_parameters(self) -> int:
        """Parameters of one :class:`MultiHeadLatentAttention` layer (counted on the ``meta`` device, norms included)."""
        return sum(p.numel() for p in MultiHeadLatentAttention(self, max_seq_len=1, device="meta").parameters())


# DeepSeek-V3's published dimensions: the technical report (arXiv 2412.19437, section 4.2: n_h = 128 heads of d_h = 128,
# d_c = 512, d_c' = 1536, d_h^R = 64, 61 layers, hidden 7168) and its config.json, which labkit.quant.DEEPSEEK_V3 copies.
DEEPSEEK_V3_MLA = MLAConfig(
    d_model=DEEPSEEK_V3["hidden_size"], num_heads=DEEPSEEK_V3["num_attention_heads"],
    kv_latent_dim=DEEPSEEK_V3["kv_lora_rank"], q_latent_dim=DEEPSEEK_V3["q_lora_rank"],
    qk_nope_head_dim=DEEPSEEK_V3["qk_nope_head_dim"], qk_rope_head_dim=DEEPSEEK_V3["qk_rope_head_dim"],
    v_head_dim=DEEPSEEK_V3["v_head_dim"], num_layers=DEEPSEEK_V3["num_hidden_layers"],
)


def mla_kv_bytes_per_token(config: MLAConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """KV-cache bytes one more token costs (per sequence) with MLA: ``num_layers * (d_c + d_h^R)`` elements."""
    if not isinstance(config, MLAConfig):
        raise TypeError(f"config: expected an MLAConfig, got {type(config).__name__}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype, got {dtype!r}")
    return config.num_layers * config.cache_elements_per_layer * dtype.itemsize


def mla_like(config: ModelConfig, kv_latent_dim: int = 512, rope_head_dim: int = 64) -> MLAConfig:
    """MLA in place of ``config``'s attention: the same heads and head size (as the key/value parts), a KV latent of
    ``kv_latent_dim`` and a decoupled RoPE key of ``rope_head_dim``; queries projected directly (no query latent)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected a labkit.model.ModelConfig, got {type(config).__name__}")
    return MLAConfig(d_model=config.d_model, num_heads=config.num_heads, kv_latent_dim=kv_latent_dim, q_latent_dim=None,
                     qk_nope_head_dim=config.dim_per_head, qk_rope_head_dim=rope_head_dim,
                     v_head_dim=config.dim_per_head, num_layers=config.num_layers)


def dense_attention_parameters(config: ModelConfig) -> int:
    """Parameters of one :class:`labkit.nn.MultiHeadSelfAttention` layer of ``config`` (MHA/GQA/MQA), counted on ``meta``."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected a labkit.model.ModelConfig, got {type(config).__name__}")
    attn = MultiHeadSelfAttention(config.d_model, config.num_heads, config.num_kv_heads, head_dim=config.head_dim,
                                  qk_norm=config.qk_norm, device="meta")
    return sum(p.numel() for p in attn.parameters())


class MLAKVCache:
    """The MLA cache: per layer, token and sequence one row ``[latent (d_c) | RoPE key (d_h^R)]``, nothing per head.

    ``update(layer_idx, latent, rope_key)`` (``[batch, new, d_c]`` and ``[batch, new, d_h^R]``) appends and returns
    the rows cached so far, ``[batch, length, d_c + d_h^R]`` (a view). Rows are kept whole because in the absorbed
    decode path each row *is* the key all heads share (and its first ``d_c`` entries the value)."""

    def __init__(self, num_layers: int, batch_size: int, max_seq_len: int, kv_latent_dim: int, rope_head_dim: int,
                 dtype=torch.float32, device=None):
        _check_int(num_layers=num_layers, batch_size=batch_size, max_seq_len=max_seq_len, kv_latent_dim=kv_latent_dim,
                   rope_head_dim=rope_head_dim)
        self.rows = torch.zeros(num_layers, batch_size, max_seq_len, kv_latent_dim + rope_head_dim, dtype=dtype, device=device)
        self.num_layers, self.max_seq_len, self.kv_latent_dim = num_layers, max_seq_len, kv_latent_dim
        self._lengths = [0] * num_layers

    @classmethod
    def for_config(cls, config: MLAConfig, batch_size: int, max_seq_len: int, dtype=torch.float32, device=None) -> "MLAKVCache":
        """An empty cache for ``config`` (``device="meta"`` sizes DeepSeek-V3's without allocating it)."""
        return cls(config.num_layers, batch_size, max_seq_len, config.kv_latent_dim, config.qk_rope_head_dim, dtype, device)

    @property
    def elements_per_token_per_layer(self) -> int:
        return self.rows.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def length(self, layer_idx: int = 0) -> int:
        """Number of positions cached for ``layer_idx``."""
        return self._lengths[layer_idx]

    def update(self, layer_idx: int, latent: torch.Tensor, rope_key: torch.Tensor) -> torch.Tensor:
        """Append the new tokens' latents and RoPE keys; return every cached row of the layer (``ValueError`` on overflow)."""
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx={layer_idx}: expected 0 <= layer_idx < {self.num_layers}")
        batch, rope_dim = self.rows.shape[1], self.rows.shape[-1] - self.kv_latent_dim
        if latent.dim() != 3 or latent.shape[0] != batch or latent.shape[-1] != self.kv_latent_dim or \
                rope_key.shape != (*latent.shape[:2], rope_dim):
            raise ValueError(f"latent, rope_key: expected [batch={batch}, new, {self.kv_latent_dim}] and [batch={batch}, new, "
                             f"{rope_dim}], got {tuple(latent.shape)} and {tuple(rope_key.shape)}")
        start, new = self._lengths[layer_idx], latent.shape[1]
        if start + new > self.max_seq_len:
            raise ValueError(f"MLAKVCache overflow: {start} cached + {new} new > max_seq_len={self.max_seq_len}")
        self.rows[layer_idx, :, start : start + new, : self.kv_latent_dim] = latent
        self.rows[layer_idx, :, start : start + new, self.kv_latent_dim :] = rope_key
        self._lengths[layer_idx] = start + new
        return self.rows[layer_idx, :, : start + new]


class MultiHeadLatentAttention(nn.Module):
    """Causal multi-head latent attention, the DeepSeek-V2 paper's equations (9)-(19) with the RMSNorms DeepSeek-V3
    puts after both latents (report, section 2.1.1). For input ``h`` ``[batch, seq, d_model]``:

    * queries: ``c_Q = norm(W_DQ h)``, ``q_C = W_UQ c_Q`` (``n_h x d_h``), ``q_R = RoPE(W_QR c_Q)`` (``n_h x d_h^R``);
    * keys and values: ``c_KV = norm(W_DKV h)`` (``d_c``), ``k_C = W_UK c_KV``, ``v = W_UV c_KV`` (per head);
      ``k_R = RoPE(W_KR h)`` (``d_h^R``), one decoupled RoPE key shared by every head;
    * head ``i`` attends with ``q = [q_C,i ; q_R,i]`` and ``k = [k_C,i ; k_R]``, scale ``1/sqrt(d_h + d_h^R)``;
      ``output = W_O [o_1 ; ... ; o_n_h]``.

    RoPE is kept out of ``k_C`` because a rotation between ``W_UK`` and ``c_KV`` would stop ``W_UK`` from being
    absorbed into the query. Only ``c_KV`` and ``k_R`` go into the cache (:class:`MLAKVCache`).

    ``forward(x, token_positions=None, kv_cache=None, layer_idx=0, absorb=False)``: ``absorb=False`` rebuilds
    per-head keys and values from the latents (the training form); ``absorb=True`` is the decode form: ``W_UK`` is
    multiplied into the query (``q_C,i^T W_UK,i`` is a ``d_c`` vector), the heads attend to the cached rows directly
    (MQA with one key of ``d_c + d_h^R``), and ``W_UV`` is applied to the attention-weighted latent before ``W_O``,
    so per-head keys and values are never formed. Both give the same output."""

    def __init__(self, config: MLAConfig, max_seq_len: int, rope_theta: float = 10000.0, device=None, dtype=None):
        super().__init__()
        if not isinstance(config, MLAConfig):
            raise TypeError(f"config: expected an MLAConfig, got {type(config).__name__}")
        self.config = c = config
        heads = c.num_heads
        if c.q_latent_dim is None:
            self.w_dq, self.q_norm, q_source = None, None, c.d_model
        else:
            self.w_dq = Linear(c.d_model, c.q_latent_dim, device=device, dtype=dtype)
            self.q_norm = RMSNorm(c.q_latent_dim, device=device, dtype=dtype)
            q_source = c.q_latent_dim
        self.w_uq = Linear(q_source, heads * c.qk_nope_head_dim, device=device, dtype=dtype)
        self.w_qr = Linear(q_source, heads * c.qk_rope_head_dim, device=device, dtype=dtype)
        self.w_dkv = Linear(c.d_model, c.kv_latent_dim, device=device, dtype=dtype)
        self.kv_norm = RMSNorm(c.kv_latent_dim, device=device, dtype=dtype)
        self.w_uk = Linear(c.kv_latent_dim, heads * c.qk_nope_head_dim, device=device, dtype=dtype)
        self.w_uv = Linear(c.kv_latent_dim, heads * c.v_head_dim, device=device, dtype=dtype)
        self.w_kr = Linear(c.d_model, c.qk_rope_head_dim, device=device, dtype=dtype)
        self.w_o = Linear(heads * c.v_head_dim, c.d_model, device=device, dtype=dtype)
        self.rope = RoPE(rope_theta, c.qk_rope_head_dim, max_seq_len, device=device)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None, kv_cache: MLAKVCache | None = None,
                layer_idx: int = 0, absorb: bool = False) -> torch.Tensor:
        c = self.config
        if x.dim() != 3 or x.shape[-1] != c.d_model:
            raise ValueError(f"x: expected [batch, seq, d_model={c.d_model}], got shape {tuple(x.shape)}")
        batch, seq, _ = x.shape
        if token_positions is None:
            start = kv_cache.length(layer_idx) if kv_cache is not None else 0
            token_positions = torch.arange(start, start + seq, device=x.device)
        c_q = x if self.w_dq is None else self.q_norm(self.w_dq(x))
        q_nope = self.w_uq(c_q).view(batch, seq, c.num_heads, c.qk_nope_head_dim).transpose(1, 2)
        q_rope = self.rope(self.w_qr(c_q).view(batch, seq, c.num_heads, c.qk_rope_head_dim).transpose(1, 2),
                           token_positions.unsqueeze(-2))
        latent = self.kv_norm(self.w_dkv(x))  # [batch, seq, d_c]
        rope_key = self.rope(self.w_kr(x), token_positions)  # [batch, seq, d_h^R]
        if kv_cache is not None:
            rows = kv_cache.update(layer_idx, latent, rope_key)
        else:
            rows = torch.cat([latent, rope_key], dim=-1)
        latent, rope_key = rows[..., : c.kv_latent_dim], rows[..., c.kv_latent_dim :]
        mask = causal_mask(seq, rows.shape[1], device=x.device)
        if absorb:
            out = self._attend_absorbed(q_nope, q_rope, rows, mask)
        else:
            out = self._attend_naive(q_nope, q_rope, latent, rope_key, mask)
        return self.w_o(out.transpose(1, 2).reshape(batch, seq, c.num_heads * c.v_head_dim))

    def _attend_naive(self, q_nope, q_rope, latent, rope_key, mask) -> torch.Tensor:
        """Rebuild every head's keys and values from the latents, then ordinary attention."""
        c = self.config
        batch, num_keys = latent.shape[:2]
        k_nope = self.w_uk(latent).view(batch, num_keys, c.num_heads, c.qk_nope_head_dim).transpose(1, 2)
        v = self.w_uv(latent).view(batch, num_keys, c.num_heads, c.v_head_dim).transpose(1, 2)
        k_rope = rope_key[:, None].expand(batch, c.num_heads, num_keys, c.qk_rope_head_dim)  # shared by every head
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        return scaled_dot_product_attention(q, k, v, mask)  # scale 1/sqrt(d_h + d_h^R)

    def _attend_absorbed(self, q_nope, q_rope, rows, mask) -> torch.Tensor:
        """Attend to the cached rows themselves: ``q_C,i . (W_UK,i c_KV) = (W_UK,i^T q_C,i) . c_KV``."""
        c = self.config
        w_uk = self.w_uk.weight.view(c.num_heads, c.qk_nope_head_dim, c.kv_latent_dim)
        w_uv = self.w_uv.weight.view(c.num_heads, c.v_head_dim, c.kv_latent_dim)
        q_latent = torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk)  # W_UK absorbed into the query
        # the paper's scale is 1/sqrt(d_h + d_h^R); scaled_dot_product_attention divides by sqrt of the query width
        rescale = math.sqrt((c.kv_latent_dim + c.qk_rope_head_dim) / (c.qk_nope_head_dim + c.qk_rope_head_dim))
        q = torch.cat([q_latent, q_rope], dim=-1) * rescale
        keys = rows[:, None]  # one key head of d_c + d_h^R shared by all query heads: MQA over the cache
        values = rows[:, None, :, : c.kv_latent_dim]
        out_latent = grouped_query_attention(q, keys, values, mask)  # [batch, heads, seq, d_c]
        return torch.einsum("bhtc,hvc->bhtv", out_latent, w_uv)  # W_UV absorbed into the output side


# ============================================================================ sliding-window attention
def sliding_window_mask(num_queries: int, num_keys: int, window: int, device=None) -> torch.Tensor:
    """Boolean ``[num_queries, num_keys]`` banded causal mask, bottom-right aligned like :func:`labkit.nn.causal_mask`:
    query ``i`` (at position ``p = i + num_keys - num_queries``) sees keys ``p - window < j <= p``, itself included."""
    _check_int(window=window)
    _check_int(0, num_queries=num_queries, num_keys=num_keys)
    offset = num_keys - num_queries
    q = torch.arange(num_queries, device=device)[:, None] + offset
    k = torch.arange(num_keys, device=device)[None, :]
    return (k <= q) & (k > q - window)


class RingKVCache:
    """A sliding-window KV cache: ``window`` slots per layer, written round-robin (position ``p`` goes to slot
    ``p % window``), so its size is the window however long the sequence grows (Mistral's rolling buffer cache).

    Same interface as :class:`labkit.nn.KVCache` (``update``, ``length``): ``length`` is the number of positions
    seen (the next token's position, for RoPE), not the number kept. ``update`` returns the keys the new queries may
    need, oldest first: the kept ones followed by the new ones (a copy); a single new token once the ring is full
    is written first and the ring itself is returned (a view, its slots out of order; that is harmless because
    all ``window`` of them are visible to the token and attention does not depend on the order of the keys)."""

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, window: int, head_dim: int,
                 dtype=torch.float32, device=None):
        _check_int(num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads, window=window, head_dim=head_dim)
        shape = (num_layers, batch_size, num_kv_heads, window, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_layers, self.window = num_layers, window
        self._lengths = [0] * num_layers

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def length(self, layer_idx: int = 0) -> int:
        """Positions seen so far by ``layer_idx`` (at most ``window`` of them are kept)."""
        return self._lengths[layer_idx]

    def _kept(self, buffer: torch.Tensor, length: int) -> torch.Tensor:
        """The last ``min(length, window)`` positions, oldest first."""
        if length <= self.window:
            return buffer[:, :, :length]
        return buffer.roll(-(length % self.window), dims=2)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """Add ``k, v`` ``[batch, num_kv_heads, new, head_dim]`` to the ring; return the keys and values to attend to."""
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx={layer_idx}: expected 0 <= layer_idx < {self.num_layers}")
        expected = (self.k.shape[1], self.k.shape[2], self.k.shape[4])
        if k.dim() != 4 or (k.shape[0], k.shape[1], k.shape[3]) != expected or k.shape != v.shape:
            raise ValueError(f"k, v: expected equal shapes [batch={expected[0]}, num_kv_heads={expected[1]}, new, "
                             f"head_dim={expected[2]}], got {tuple(k.shape)} and {tuple(v.shape)}")
        length, new = self._lengths[layer_idx], k.shape[2]
        k_ring, v_ring = self.k[layer_idx], self.v[layer_idx]
        self._lengths[layer_idx] = length + new
        if new == 1 and length >= self.window - 1:  # decode step on a full ring: overwrite the oldest slot
            k_ring[:, :, length % self.window] = k[:, :, 0]
            v_ring[:, :, length % self.window] = v[:, :, 0]
            return k_ring, v_ring
        k_all = torch.cat([self._kept(k_ring, length), k], dim=2)
        v_all = torch.cat([self._kept(v_ring, length), v], dim=2)
        kept = min(self.window, length + new)
        slots = torch.arange(length + new - kept, length + new, device=k.device) % self.window
        k_ring[:, :, slots] = k_all[:, :, -kept:]
        v_ring[:, :, slots] = v_all[:, :, -kept:]
        return k_all, v_all


class SlidingWindowAttention(MultiHeadSelfAttention):
    """:class:`labkit.nn.MultiHeadSelfAttention` whose queries see only the last ``window`` positions (banded mask).
    Works with a full :class:`labkit.nn.KVCache` or a :class:`RingKVCache` of ``window`` slots."""

    def __init__(self, d_model: int, num_heads: int, window: int, num_kv_heads: int | None = None, rope: RoPE | None = None,
                 head_dim: int | None = None, qk_norm: bool = False, device=None, dtype=None):
        _check_int(window=window)
        super().__init__(d_model, num_heads, num_kv_heads, rope, head_dim, qk_norm, device, dtype)
        self.window = window

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return grouped_query_attention(q, k, v, sliding_window_mask(q.shape[-2], k.shape[-2], self.window, device=q.device))


def with_sliding_window(model: TransformerLM, window: int) -> TransformerLM:
    """A copy of ``model`` whose every attention layer is a :class:`SlidingWindowAttention` of ``window`` (same weights)."""
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model: expected a labkit.model.TransformerLM, got {type(model).__name__}")
    _check_int(window=window)
    cfg = model.config
    weight = model.token_embeddings.weight
    windowed = copy.deepcopy(model)  # deep copy, not a rebuild: keeps the RoPE tables' dtype (not in the state dict)
    for layer in windowed.layers:
        attn = SlidingWindowAttention(cfg.d_model, cfg.num_heads, window, cfg.num_kv_heads, layer.attn.rope,
                                      cfg.head_dim, cfg.qk_norm, device=weight.device, dtype=weight.dtype)
        attn.load_state_dict(layer.attn.state_dict())
        layer.attn = attn
    return windowed


@torch.no_grad()
def greedy_decode_with_cache(model: TransformerLM, prompt_ids: torch.Tensor, max_new_tokens: int, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding of ``prompt_ids`` ``[batch, prompt_len]`` through ``kv_cache`` (any cache with ``update`` and
    ``length``: :class:`RingKVCache`, :class:`labkit.nn.KVCache`, a :class:`PagedKVCache` sequence view). Returns the
    ids (prompt + new) and the logits of every step, ``[batch, max_new_tokens, vocab]``, to compare caches exactly."""
    _check_int(0, max_new_tokens=max_new_tokens)
    if prompt_ids.dim() != 2 or prompt_ids.shape[1] == 0:
        raise ValueError(f"prompt_ids: expected a non-empty [batch, prompt_len] tensor, got shape {tuple(prompt_ids.shape)}")
    was_training = model.training
    model.eval()
    ids, step_input, step_logits = prompt_ids, prompt_ids, []
    for _ in range(max_new_tokens):
        logits = model(step_input, kv_cache=kv_cache)[:, -1].float()
        step_logits.append(logits)
        step_input = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, step_input], dim=1)
    model.train(was_training)
    if not step_logits:
        return ids, torch.zeros(ids.shape[0], 0, model.config.vocab_size, device=ids.device)
    return ids, torch.stack(step_logits, dim=1)


# ============================================================================ paged KV cache
class PoolExhaustedError(RuntimeError):
    """No free block is left in the pool (a server would now preempt or queue a sequence)."""


class BlockAllocator:
    """Bookkeeping of a paged KV cache: ``num_blocks`` blocks of ``block_size`` token slots, a free list, and per
    sequence a block table (its blocks, in order) and a length. A sequence gets a new block only when its last one is
    full, so at most ``block_size - 1`` slots per sequence are ever reserved and unused."""

    def __init__(self, num_blocks: int, block_size: int):
        _check_int(num_blocks=num_blocks, block_size=block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self.block_tables: dict = {}
        self.lengths: dict = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def add_sequence(self, seq_id) -> None:
        """Start an empty sequence (no block is taken until it has tokens)."""
        if seq_id in self.block_tables:
            raise ValueError(f"seq_id={seq_id!r}: this sequence is already in the cache")
        self.block_tables[seq_id], self.lengths[seq_id] = [], 0

    def grow(self, seq_id, num_tokens: int) -> list[tuple[int, int]]:
        """Reserve slots for ``num_tokens`` more tokens of ``seq_id``; returns their ``(block, offset)`` slots.
        Raises :class:`PoolExhaustedError` (reserving nothing) if the pool has too few free blocks."""
        self._check_seq(seq_id)
        _check_int(0, num_tokens=num_tokens)
        table, length = self.block_tables[seq_id], self.lengths[seq_id]
        needed = -(-(length + num_tokens) // self.block_size) - len(table)
        if needed > len(self._free):
            raise PoolExhaustedError(f"seq_id={seq_id!r} needs {needed} more block(s) of {self.block_size} tokens, "
                                     f"{len(self._free)} of {self.num_blocks} are free")
        table.extend(self._free.pop() for _ in range(needed))
        self.lengths[seq_id] = length + num_tokens
        return [(table[p // self.block_size], p % self.block_size) for p in range(length, length + num_tokens)]

    def free(self, seq_id) -> None:
        """Return every block of ``seq_id`` to the pool (the sequence finished)."""
        self._check_seq(seq_id)
        self._free.extend(reversed(self.block_tables.pop(seq_id)))
        del self.lengths[seq_id]

    def _check_seq(self, seq_id) -> None:
        if seq_id not in self.block_tables:
            raise ValueError(f"seq_id={seq_id!r}: not in the cache (add_sequence it first; known: {list(self.block_tables)})")


class PagedKVCache:
    """K/V blocks ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]`` shared by all sequences, with a
    :class:`BlockAllocator` deciding which blocks each sequence owns.

    ``append(seq_id, layer_idx, k, v)`` (``[num_kv_heads, new, head_dim]``) writes into the sequence's blocks (layer 0
    reserves the slots; every layer sees the same positions) and returns its keys and values gathered through the
    block table, ``[num_kv_heads, length, head_dim]``: :class:`labkit.nn.KVCache`'s interface hands attention whole
    K/V tensors, so ``sequence(seq_id)``, a one-sequence view with ``update``/``length`` that a model's attention can
    use directly, pays for that copy. :func:`paged_attention` does not: it reads the blocks in place through
    :func:`labkit.kernels.paged_attention.paged_attention_varlen` (``block_table(seq_id)`` is its table row)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype=torch.float32, device=None):
        _check_int(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)
        self.allocator = BlockAllocator(num_blocks, block_size)
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_layers = num_layers
        self._layer_lengths: dict = {}

    def add_sequence(self, seq_id) -> None:
        """Start an empty sequence ``seq_id``."""
        self.allocator.add_sequence(seq_id)
        self._layer_lengths[seq_id] = [0] * self.num_layers

    def free(self, seq_id) -> None:
        """The sequence finished: its blocks go back to the pool."""
        self.allocator.free(seq_id)
        del self._layer_lengths[seq_id]

    def length(self, seq_id, layer_idx: int = 0) -> int:
        """Positions of ``seq_id`` written in ``layer_idx``."""
        self.allocator._check_seq(seq_id)
        return self._layer_lengths[seq_id][layer_idx]

    def append(self, seq_id, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """Write ``k, v`` ``[num_kv_heads, new, head_dim]`` after ``seq_id``'s cached positions; return all of them."""
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx={layer_idx}: expected 0 <= layer_idx < {self.num_layers}")
        heads, head_dim = self.k.shape[2], self.k.shape[4]
        if k.dim() != 3 or k.shape[0] != heads or k.shape[2] != head_dim or k.shape != v.shape:
            raise ValueError(f"k, v: expected equal shapes [num_kv_heads={heads}, new, head_dim={head_dim}], "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        start, new = self.length(seq_id, layer_idx), k.shape[1]
        if layer_idx == 0:
            self.allocator.grow(seq_id, new)
        elif start + new > self.allocator.lengths[seq_id]:
            raise ValueError(f"layer_idx={layer_idx}: layer 0 reserved {self.allocator.lengths[seq_id]} positions, "
                             f"this layer would write up to {start + new}")
        size = self.allocator.block_size
        table = self.block_table(seq_id)
        positions = torch.arange(start, start + new, device=self.k.device)
        blocks, offsets = table[positions // size], positions % size
        self.k[layer_idx, blocks, :, offsets] = k.transpose(0, 1)  # advanced indices first: [new, heads, head_dim]
        self.v[layer_idx, blocks, :, offsets] = v.transpose(0, 1)
        self._layer_lengths[seq_id][layer_idx] = length = start + new
        return self._gather(self.k[layer_idx], table, length), self._gather(self.v[layer_idx], table, length)

    def block_table(self, seq_id) -> torch.Tensor:
        """The blocks of ``seq_id`` in order, as an int64 tensor on the pool's device."""
        self.allocator._check_seq(seq_id)
        return torch.tensor(self.allocator.block_tables[seq_id], dtype=torch.long, device=self.k.device)

    @staticmethod
    def _gather(pool: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
        blocks = pool[table]  # [num_blocks_of_seq, heads, block_size, head_dim]
        return blocks.transpose(0, 1).flatten(1, 2)[:, :length]

    def sequence(self, seq_id) -> "_SequenceView":
        """``seq_id`` as a cache a model's attention can use (``update``/``length``, batch of 1)."""
        self.allocator._check_seq(seq_id)
        return _SequenceView(self, seq_id)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


class _SequenceView:
    """One sequence of a :class:`PagedKVCache` behind :class:`labkit.nn.KVCache`'s interface (batch of 1)."""

    def __init__(self, cache: PagedKVCache, seq_id):
        self.cache, self.seq_id = cache, seq_id

    def length(self, layer_idx: int = 0) -> int:
        return self.cache.length(self.seq_id, layer_idx)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        if k.dim() != 4 or k.shape[0] != 1:
            raise ValueError(f"k: a paged sequence view holds one sequence, expected [1, heads, new, head_dim], got {tuple(k.shape)}")
        k_all, v_all = self.cache.append(self.seq_id, layer_idx, k[0], v[0])
        return k_all[None], v_all[None]


def paged_attention(q: torch.Tensor, cache: PagedKVCache, seq_id, layer_idx: int = 0) -> torch.Tensor:
    """Causal attention of ``q`` ``[num_heads, num_queries, head_dim]`` (the sequence's last positions) over the keys and
    values of ``seq_id`` in ``cache``, read through its block table (GQA when ``num_heads`` is a multiple of the cache's).

    One sequence of :func:`labkit.kernels.paged_attention.paged_attention_varlen`: on a GPU its Triton kernel reads the
    blocks in place; elsewhere its torch path gathers them first."""
    if q.dim() != 3:
        raise ValueError(f"q: expected [num_heads, num_queries, head_dim], got shape {tuple(q.shape)}")
    length, num_queries = cache.length(seq_id, layer_idx), q.shape[1]
    if not 0 < num_queries <= length:
        raise ValueError(f"q: expected 1..{length} queries (the last positions of {seq_id!r}), got {num_queries}")
    positions = torch.arange(length - num_queries, length, device=q.device)
    out = paged_attention_varlen(q.transpose(0, 1), cache.k[layer_idx], cache.v[layer_idx],
                                 cache.block_table(seq_id)[None], torch.zeros_like(positions), positions)
    return out.transpose(0, 1)


@dataclass
class KVWaste:
    """What a stream of requests reserves in KV-cache token slots (:func:`simulate_kv_waste`)."""

    lengths: list[int]  # each request's final length (prompt + generated tokens)
    max_len: int
    block_size: int
    used_slots: int  # sum of lengths: the slots holding a token
    contiguous_slots: int  # every request preallocated to max_len
    paged_slots: int  # blocks the allocator handed out, times block_size
    peak_blocks: int  # most blocks in use at once

    @property
    def contiguous_waste(self) -> float:
        """Fraction of contiguously reserved slots never written."""
        return 1 - self.used_slots / self.contiguous_slots

    @property
    def paged_waste(self) -> float:
        """Fraction of paged slots never written (only each sequence's last, partly filled block)."""
        return 1 - self.used_slots / self.paged_slots


def simulate_kv_waste(num_requests: int = 1000, max_len: int = 2048, block_size: int = 16, max_running: int = 32,
                      seed: int = 0) -> KVWaste:
    """Serve ``num_requests`` requests of lengths drawn uniformly from ``1..max_len`` (Python's ``random`` seeded with
    ``seed``: the same integers on every machine), ``max_running`` at a time, through a :class:`BlockAllocator`:
    each request arrives with a prompt (a random part of its length), grows by chunks of generated tokens, then is
    freed. Counts the slots reserved by paging against preallocating ``max_len`` contiguous slots per request.

    Closed form for uniform lengths: contiguous preallocation wastes ``(max_len - 1) / 2`` slots per request on
    average; paging wastes ``(-length) mod block_size``, on average ``(block_size - 1) / 2`` when ``block_size``
    divides ``max_len``."""
    _check_int(num_requests=num_requests, max_len=max_len, block_size=block_size, max_running=max_running)
    rng = random.Random(seed)
    lengths = [rng.randint(1, max_len) for _ in range(num_requests)]
    blocks_per_request = -(-max_len // block_size)
    allocator = BlockAllocator(max_running * blocks_per_request, block_size)
    running: dict[int, int] = {}  # request -> tokens still to generate
    paged_slots = peak_blocks = 0
    waiting = list(range(num_requests))
    while waiting or running:
        while waiting and len(running) < max_running:
            request = waiting.pop(0)
            prompt = rng.randint(1, lengths[request])
            allocator.add_sequence(request)
            allocator.grow(request, prompt)
            running[request] = lengths[request] - prompt
        for request in list(running):
            chunk = min(running[request], rng.randint(1, block_size))  # a few decode steps
            allocator.grow(request, chunk)
            running[request] -= chunk
            peak_blocks = max(peak_blocks, allocator.num_blocks - allocator.num_free_blocks)
            if running[request] == 0:
                paged_slots += len(allocator.block_tables[request]) * block_size
                allocator.free(request)
                del running[request]
    return KVWaste(lengths=lengths, max_len=max_len, block_size=block_size, used_slots=sum(lengths),
                   contiguous_slots=num_requests * max_len, paged_slots=paged_slots, peak_blocks=peak_blocks)


# ============================================================================ QK-norm
@dataclass
class LogitGrowth:
    """Largest attention logit (``q . k / sqrt(d)`` over every layer, head and allowed position) per training step."""

    steps: list[int]
    max_logit: list[float]  # without QK-norm
    max_logit_qk_norm: list[float]  # with QK-norm
    loss: list[float]
    loss_qk_norm: list[float]
    seconds: float  # CPU time of both runs


def _max_logit_recorder(model: TransformerLM, record: list[float]):
    """Forward hooks that append, per forward pass, the largest causal attention logit of any layer of ``model``."""
    step_max: list[float] = []

    def hook(attn, args, output):
        with torch.no_grad():
            q, k, _ = attn._project(args[0], None, None, 0)
            k = k.repeat_interleave(attn.num_heads // attn.num_kv_heads, dim=-3)
            scores = q @ k.transpose(-2, -1) / math.sqrt(attn.head_dim)
            allowed = causal_mask(q.shape[-2], k.shape[-2], device=q.device)
            step_max.append(scores.masked_fill(~allowed, float("-inf")).amax().item())
        if len(step_max) == len(model.layers):
            record.append(max(step_max))
            step_max.clear()

    return [layer.attn.register_forward_hook(hook) for layer in model.layers]


def qk_norm_logit_growth(steps: int = 40, lr: float = 3e-2, d_model: int = 32, batch_size: int = 8, seed: int = 0,
                         task: ArithmeticTask | None = None) -> LogitGrowth:
    """Train the same tiny model (:func:`labkit.model.tiny_config`, ``d_model`` wide) on the arithmetic task twice, at a
    constant, deliberately high learning rate ``lr`` (AdamW, no weight decay), without and with QK-norm, recording the
    largest attention logit each step. Without QK-norm nothing bounds ``|q| |k|``, and at a high learning rate the
    logits grow (the instability OLMo 2 and Qwen3 add QK-norm against); with it, ``q`` and ``k`` are rescaled to unit RMS
    before their gains, so a logit is at most ``sqrt(head_dim)`` times the product of the largest gains. Both runs start
    from ``seed`` (shifted by ``LABKIT_SEED``, :func:`labkit.runtime.run_seed`): the same weights, the same batches."""
    _check_int(steps=steps, d_model=d_model, batch_size=batch_size)
    if not lr > 0:
        raise ValueError(f"lr={lr!r}: expected a positive learning rate")
    task = task if task is not None else ArithmeticTask()
    if not isinstance(task, ArithmeticTask):
        raise TypeError(f"task: expected a labkit.data.ArithmeticTask, got {type(task).__name__}")
    data = task.tokens("train")
    config = TrainConfig(steps=steps, batch_size=batch_size, context_length=task.example_length * 2, max_lr=lr, min_lr=lr,
                         warmup_iters=0, weight_decay=0.0, eval_every=steps)
    curves, losses = {}, {}
    start = time.process_time()
    for qk_norm in (False, True):
        torch.manual_seed(run_seed(seed))
        model = TransformerLM(tiny_config(task.vocab_size, d_model=d_model, qk_norm=qk_norm))
        record: list[float] = []
        hooks = _max_logit_recorder(model, record)
        try:
            history = train(model, data, None, config, progress=False)
        finally:
            for hook in hooks:
                hook.remove()
        curves[qk_norm], losses[qk_norm] = record, history.train_loss
    return LogitGrowth(steps=list(range(1, steps + 1)), max_logit=curves[False], max_logit_qk_norm=curves[True],
                       loss=losses[False], loss_qk_norm=losses[True], seconds=time.process_time() - start)
