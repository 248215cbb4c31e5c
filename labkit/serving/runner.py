"""One forward pass over a packed ragged batch: every token an engine step schedules (one per decoding request, a
chunk per request being prefilled), concatenated into one sequence of ``T`` tokens.

:func:`forward_packed` runs a :class:`labkit.model.TransformerLM`'s own modules on it: the embedding, norms, q/k/v/o
projections, MLP (or MoE) and LM head each run ONCE on ``[T, d_model]``, whatever mix of requests the tokens come
from. Only attention needs to know which request a token belongs to: each token's key and value are written into
its slot of the paged KV pool, then every query reads its own request's keys through that request's block table
(:func:`labkit.kernels.paged_attention.paged_attention_varlen`, through a :class:`~labkit.kernels.paged_attention.PagedAttentionPlan`
built once per step and shared by the layers). RoPE rotates by each token's absolute position, so
a token computes the same thing whether it comes in a prefill, a chunk or a decode. Logits are computed only for
the rows that need them (each request's last scheduled token): the LM head is the largest matmul of a small model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.attention_variants import PagedKVCache
from labkit.kernels.paged_attention import PagedAttentionPlan
from labkit.model import TransformerLM

__all__ = ["PackedBatch", "pack_batch", "forward_packed"]


@dataclass
class PackedBatch:
    """The inputs of one packed forward pass (all ``[T]`` int64 unless said otherwise):
    ``token_ids``; ``positions`` (absolute, within the token's request); ``seq_index`` (the token's row of
    ``block_tables``, int32 ``[num_seqs, max_blocks]``); ``slot_blocks``/``slot_offsets`` (where its K/V go);
    ``logits_rows`` ``[num_seqs]`` (the row of each request's last token: the only logits computed)."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    seq_index: torch.Tensor
    block_tables: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    logits_rows: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]


def pack_batch(chunks, block_size: int, device=None) -> PackedBatch:
    """Pack ``chunks`` (one ``(token_ids, start, block_table)`` per request: the tokens it computes this step, the
    absolute position of the first one, and its block table, already long enough for them) into a
    :class:`PackedBatch`. Built from Python lists with one tensor conversion per field."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r}: expected an integer >= 1")
    if not chunks:
        raise ValueError("chunks: expected at least one (token_ids, start, block_table), got none")
    ids, positions, seq_index, blocks, offsets, last_rows, tables = [], [], [], [], [], [], []
    for row, (token_ids, start, table) in enumerate(chunks):
        count = len(token_ids)
        if count == 0:
            raise ValueError(f"chunks[{row}]: expected at least one token")
        if -(-(start + count) // block_size) > len(table):
            raise ValueError(f"chunks[{row}]: block table of {len(table)} blocks is too short for positions "
                             f"{start}..{start + count - 1} (block_size={block_size})")
        ids.extend(token_ids)
        span = range(start, start + count)
        positions.extend(span)
        seq_index.extend([row] * count)
        blocks.extend(table[p // block_size] for p in span)
        offsets.extend(p % block_size for p in span)
        last_rows.append(len(ids) - 1)
        tables.append(table)
    width = max(len(t) for t in tables)
    padded = [list(t) + [0] * (width - len(t)) for t in tables]  # padding entries are never read

    def as_long(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    return PackedBatch(as_long(ids), as_long(positions), as_long(seq_index),
                       torch.tensor(padded, dtype=torch.int32, device=device), as_long(blocks), as_long(offsets),
                       as_long(last_rows))


@torch.no_grad()
def forward_packed(model: TransformerLM, cache: PagedKVCache, batch: PackedBatch) -> torch.Tensor:
    """Logits ``[num_seqs, vocab_size]`` (float32) of each request's last token in ``batch``, after writing every
    token's K/V into ``cache``'s pools (``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]``) at its
    slot. Runs ``model``'s modules in eval mode (and leaves the model's mode as it was)."""
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model: expected a labkit.model.TransformerLM, got {type(model).__name__}")
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a labkit.attention_variants.PagedKVCache, got {type(cache).__name__}")
    config = model.config
    layers, _, kv_heads, _, head_dim = cache.k.shape
    if (layers, kv_heads, head_dim) != (config.num_layers, config.kv_heads, config.dim_per_head):
        raise ValueError(f"cache: pools {tuple(cache.k.shape)} do not fit the model (num_layers={config.num_layers}, "
                         f"kv_heads={config.kv_heads}, head_dim={config.dim_per_head})")
    if not model.training:
        return _forward(model, cache, batch)
    model.eval()  # (a noisy MoE router differs in training mode); toggled only if needed: it walks every module
    try:
        return _forward(model, cache, batch)
    finally:
        model.train()


def _forward(model: TransformerLM, cache: PagedKVCache, batch: PackedBatch) -> torch.Tensor:
    num_tokens = batch.num_tokens
    positions = batch.positions
    x = model.token_embeddings(batch.token_ids)  # [T, d_model]
    # Every layer attends through the same block tables: their checks and gather indices are worked out once per step.
    plan = PagedAttentionPlan(batch.block_tables, batch.seq_index, positions, *cache.k.shape[1:4])
    for layer_idx, layer in enumerate(model.layers):
        attn = layer.attn
        h = layer.ln1(x)
        q = attn.q_proj(h).view(num_tokens, attn.num_heads, attn.head_dim)
        k = attn.k_proj(h).view(num_tokens, attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(h).view(num_tokens, attn.num_kv_heads, attn.head_dim)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        if attn.rope is not None:
            q, k = attn.rope(q, positions[:, None]), attn.rope(k, positions[:, None])  # one angle per token, all heads
        k_pool, v_pool = cache.k[layer_idx], cache.v[layer_idx]
        k_pool[batch.slot_blocks, :, batch.slot_offsets] = k  # advanced indices first: [T, kv_heads, head_dim]
        v_pool[batch.slot_blocks, :, batch.slot_offsets] = v
        out = plan.attend(q, k_pool, v_pool)
        x = x + attn.output_proj(out.reshape(num_tokens, attn.num_heads * attn.head_dim))
        x = x + layer.ffn(layer.ln2(x))
    last = x[batch.logits_rows]
    return model.lm_head(model.ln_final(last)).float()
