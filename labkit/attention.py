"""Attention as a serving system sees it: the KV cache and what it costs.

(Chapter 03 adds the tiled FlashAttention reference and the KV-cache calculators here.)
"""
from __future__ import annotations

import torch


class KVCache:
    """Preallocated K/V buffers, one pair per layer, each ``[batch, num_kv_heads, max_seq_len, head_dim]``.

    ``update(layer_idx, k, v)`` writes the new keys/values after the ones already cached and
    returns views of everything cached so far; the length advances once the last layer has
    written (all layers see the same positions in one forward pass).
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_seq_len: int, head_dim: int, dtype=torch.float32, device=None):
        for name, value in dict(num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads, max_seq_len=max_seq_len, head_dim=head_dim).items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        shape = (num_layers, batch_size, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_layers, self.max_seq_len = num_layers, max_seq_len
        self._lengths = [0] * num_layers

    @classmethod
    def for_model(cls, model, batch_size: int, max_seq_len: int | None = None) -> "KVCache":
        cfg = model.config
        weight = model.token_embeddings.weight
        return cls(cfg.num_layers, batch_size, cfg.kv_heads, max_seq_len or cfg.context_length, cfg.dim_per_head, dtype=weight.dtype, device=weight.device)

    def length(self, layer_idx: int = 0) -> int:
        """Number of positions cached for ``layer_idx``."""
        return self._lengths[layer_idx]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx={layer_idx}: expected 0 <= layer_idx < {self.num_layers}")
        expected = self.k.shape[1:3] + self.k.shape[4:]
        if k.dim() != 4 or (k.shape[0], k.shape[1], k.shape[3]) != tuple(expected) or k.shape != v.shape:
            raise ValueError(
                f"k, v: expected equal shapes [batch={expected[0]}, num_kv_heads={expected[1]}, new, head_dim={expected[2]}], "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        start, new = self._lengths[layer_idx], k.shape[2]
        if start + new > self.max_seq_len:
            raise ValueError(f"KVCache overflow: {start} cached + {new} new > max_seq_len={self.max_seq_len}")
        self.k[layer_idx, :, :, start : start + new] = k
        self.v[layer_idx, :, :, start : start + new] = v
        self._lengths[layer_idx] = start + new
        return self.k[layer_idx, :, :, : start + new], self.v[layer_idx, :, :, : start + new]

    @property
    def nbytes(self) -> int:
        """Bytes the cache buffers occupy (allocated up front for ``max_seq_len``)."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
