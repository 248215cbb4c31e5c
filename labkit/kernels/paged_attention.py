"""Paged attention over a ragged batch: every query token reads its sequence's keys and values through a block table.

A serving engine packs the tokens it schedules in one step (one row per decoding request, a chunk of rows per request
being prefilled) into ``q [T, num_heads, head_dim]``. The KV cache is a pool of fixed-size blocks
``[num_blocks, num_kv_heads, block_size, head_dim]`` (one layer of ``labkit.attention_variants.PagedKVCache``); row
``s`` of ``block_tables`` lists the blocks of sequence ``s`` in order, so its position ``p`` lives in block
``block_tables[s, p // block_size]`` at offset ``p % block_size``. Token ``t`` belongs to sequence ``seq_index[t]``,
sits at absolute position ``positions[t]`` and attends causally to key positions ``0 .. positions[t]`` (its own key
and value are in the pool already).

Kernel (vLLM's PagedAttention, decode-style): one program per (query token, K/V head). It loads the token's query
rows of every query head in the K/V head's group once, then walks the sequence's logical blocks
``0 .. positions[t] // block_size``: it reads the block's physical index from the block table and loads that K/V block
straight from the pool, in place (no gathered copy of the sequence is ever made), folding it into an online softmax
(running max ``m``, running sum ``l`` of ``exp(s - m)`` and an unnormalised accumulator, rescaled by
``exp(m_old - m_new)`` when the max grows; ``exp2`` with ``log2(e)`` folded into the scale). The group's query heads
share each K/V block load, which is GQA's saving. Scores are a broadcast multiply-and-sum, not ``tl.dot``: a decode
row has one query per head, far below a tensor-core tile, and any power-of-two block size works. Every tile is upcast
to fp32 at load (accurate, and what Triton's CPU interpreter computes correctly for bf16).

Torch path (:func:`paged_attention_reference`, what the public function runs off the GPU): per sequence, one
``index_select`` over the pool's rows gathers its keys (and one its values) as ``[num_kv_heads, length, head_dim]``
(slots past a sequence's own keys re-read its key 0, so they are finite, and the mask hides them: no zeroed copy);
its query rows go in a padded ``[num_seqs, num_heads, rows, head_dim]`` batch and one masked SDPA (``enable_gqa``)
runs for all; decode rows (one per sequence) and prefill chunks are batched separately so one long chunk does not
pad every decode row to its length.

Checks: :func:`paged_attention_varlen` checks everything a learner can get wrong (arguments named in the error), the
value ranges in one host sync. An engine step's layers share one batch's tables: :class:`PagedAttentionPlan` checks
them and computes the torch path's gather indices and masks once; its ``attend`` per layer checks only shapes,
dtypes and devices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labkit.kernels._common import SUPPORTED_DTYPES, check_kernel_tensor
from labkit.runtime import triton_installed, triton_mode

if triton_installed():
    import triton
    import triton.language as tl
else:  # the torch path still runs; the kernel's definition below needs only the names (labkit.kernels' stand-ins)
    from labkit.kernels import tl, triton

INDEX_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------- torch path
@dataclass(frozen=True)
class _RowGroup:
    """One batched SDPA of the torch path over ``num_seqs = visible.shape[0]`` sequences: ``slots``
    ``[num_seqs * num_kv_heads * keys]`` index the pool viewed as ``[num_blocks * num_kv_heads * block_size,
    head_dim]`` (one gather gives K or V as ``[num_seqs, num_kv_heads, keys, head_dim]``), ``visible``
    ``[num_seqs, 1, rows, keys]`` is the causal mask. Decode rows (``rank`` None): sequence ``i`` is token
    ``tokens[i]``'s (``tokens`` None: the whole batch, in order). Prefill chunks: token ``tokens[i]`` is query row
    ``rank[i]`` of sequence ``token_seq[i]``."""

    tokens: torch.Tensor | None
    token_seq: torch.Tensor | None
    rank: torch.Tensor | None
    slots: torch.Tensor
    visible: torch.Tensor
    rows: int


def _row_groups(block_tables, seq_index, positions, num_kv_heads: int, block_size: int) -> tuple:
    """The torch path's index work for one batch (it depends on neither q nor the pools' contents): decode rows (the
    one token of a sequence) in one group, prefill chunks in another, so one long chunk does not pad every decode row
    to its length. A group's keys run to its longest sequence's; the slots past a sequence's own keys read its key 0
    (written, so finite) and the mask hides them: no copy of K/V is ever zeroed."""
    device = seq_index.device
    seq_index, positions = seq_index.long(), positions.long()
    num_tokens, num_rows = seq_index.shape[0], block_tables.shape[0]
    keys_per_seq = torch.zeros(num_rows, dtype=torch.long, device=device)
    keys_per_seq.scatter_reduce_(0, seq_index, positions + 1, reduce="amax")
    rows_per_seq = torch.bincount(seq_index, minlength=num_rows)
    rows_host, keys_host = torch.stack([rows_per_seq, keys_per_seq]).tolist()  # one sync: the groups' shapes
    head_offsets = torch.arange(num_kv_heads, device=device)[None, :, None] * block_size

    def slots_and_mask(seqs, lengths, num_keys):
        """Pool rows of sequences ``seqs``' first ``num_keys`` keys (key 0 again past a sequence's ``lengths``)."""
        key_pos = torch.arange(num_keys, device=device)
        written = key_pos[None, :] < lengths[:, None]
        source = key_pos * written
        blocks = block_tables[seqs].long().gather(1, source // block_size)
        slots = (blocks * (num_kv_heads * block_size) + source % block_size)[:, None, :] + head_offsets
        return slots.reshape(-1), key_pos, written

    groups = []
    decode_seqs = [s for s, r in enumerate(rows_host) if r == 1]
    if decode_seqs:
        if len(decode_seqs) == num_tokens:  # every token decodes: the SDPA batch is the token order
            tokens, seqs, token_pos = None, seq_index, positions
        else:
            tokens = torch.nonzero(rows_per_seq[seq_index] == 1).squeeze(1)
            seqs, token_pos = seq_index[tokens], positions[tokens]
        slots, _, written = slots_and_mask(seqs, token_pos + 1, max(keys_host[s] for s in decode_seqs))
        groups.append(_RowGroup(tokens, None, None, slots, written[:, None, None, :], 1))
    prefill_seqs = [s for s, r in enumerate(rows_host) if r > 1]
    if prefill_seqs:
        seqs = torch.tensor(prefill_seqs, dtype=torch.long, device=device)
        tokens = torch.nonzero(rows_per_seq[seq_index] > 1).squeeze(1)
        slot_of_seq = torch.empty(num_rows, dtype=torch.long, device=device)
        slot_of_seq[seqs] = torch.arange(len(prefill_seqs), device=device)
        token_seq = slot_of_seq[seq_index[tokens]]
        # each token's row within its sequence: its rank among the tokens of that sequence
        order = torch.argsort(token_seq, stable=True)
        counts = torch.bincount(token_seq, minlength=len(prefill_seqs))
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(token_seq)
        rank[order] = torch.arange(len(token_seq), device=device) - starts[token_seq[order]]
        rows = max(rows_host[s] for s in prefill_seqs)
        slots, key_pos, _ = slots_and_mask(seqs, keys_per_seq[seqs], max(keys_host[s] for s in prefill_seqs))
        pos_padded = torch.zeros((len(prefill_seqs), rows), dtype=torch.long, device=device)  # padding rows see key 0
        pos_padded[token_seq, rank] = positions[tokens]
        visible = key_pos[None, None, :] <= pos_padded[:, :, None]  # [S, rows, keys]
        groups.append(_RowGroup(tokens, token_seq, rank, slots, visible[:, None], rows))
    return tuple(groups)


def _attend_groups(q, k_pool, v_pool, groups, scale: float):
    """The torch path over precomputed :func:`_row_groups`: per group one gather of K, one of V and one SDPA."""
    num_heads, head_dim = q.shape[1:]
    # pool rows [num_blocks * num_kv_heads * block_size, head_dim] (a view: the engine's pools are contiguous)
    k_rows = (k_pool if k_pool.is_contiguous() else k_pool.contiguous()).view(-1, head_dim)
    v_rows = (v_pool if v_pool.is_contiguous() else v_pool.contiguous()).view(-1, head_dim)
    out = None
    for group in groups:
        num_seqs = group.visible.shape[0]
        kv_shape = (num_seqs, k_pool.shape[1], group.visible.shape[-1], head_dim)
        k = k_rows.index_select(0, group.slots).view(kv_shape)
        v = v_rows.index_select(0, group.slots).view(kv_shape)
        if group.rank is None:  # decode rows: one query per sequence
            q_padded = (q if group.tokens is None else q[group.tokens])[:, :, None]
        else:
            q_padded = q.new_zeros((num_seqs, group.rows, num_heads, head_dim))
            q_padded[group.token_seq, group.rank] = q[group.tokens]
            q_padded = q_padded.transpose(1, 2)
        attended = F.scaled_dot_product_attention(q_padded, k, v, attn_mask=group.visible, scale=scale,
                                                  enable_gqa=True)
        if group.rank is None and group.tokens is None:  # the whole batch: nothing to scatter
            return attended[:, :, 0]
        out = torch.empty_like(q) if out is None else out
        if group.rank is None:
            out[group.tokens] = attended[:, :, 0]
        else:
            out[group.tokens] = attended.transpose(1, 2)[group.token_seq, group.rank]
    return out


def paged_attention_reference(q, k_pool, v_pool, block_tables, seq_index, positions, scale: float | None = None):
    """:func:`paged_attention_varlen` in PyTorch (gathers each sequence's keys and values, then one batched attention
    per kind of row: decode rows together, prefill chunks together); same contract, no input checks."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    groups = _row_groups(block_tables, seq_index, positions, k_pool.shape[1], k_pool.shape[2])
    return _attend_groups(q, k_pool, v_pool, groups, scale)


# ----------------------------------------------------------------------------- kernel
@triton.jit
def _paged_attention_kernel(
    Q, K, V, Out, BlockTables, SeqIndex, Positions,
    stride_qt, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ot, stride_oh,
    stride_bt,
    group_size, block_size, head_dim, sm_scale,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    seq = tl.load(SeqIndex + token).to(tl.int64)
    pos = tl.load(Positions + token)
    offs_g = tl.arange(0, BLOCK_G)  # the query heads of this K/V head's group
    offs_s = tl.arange(0, BLOCK_S)  # slots of one block (block_size rounded up to a power of two)
    offs_d = tl.arange(0, BLOCK_D)
    g_valid, s_valid, d_valid = offs_g < group_size, offs_s < block_size, offs_d < head_dim
    heads = kv_head * group_size + offs_g
    q = tl.load(Q + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_valid[:, None] & d_valid[None, :], other=0.0).to(tl.float32)
    q = q * (sm_scale * 1.4426950408889634)  # log2(e): scores in base 2, so exp2 computes exp

    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for logical in range(0, pos // block_size + 1):
        physical = tl.load(BlockTables + seq * stride_bt + logical).to(tl.int64)
        key_pos = logical * block_size + offs_s
        visible = s_valid & (key_pos <= pos)
        kv_mask = visible[:, None] & d_valid[None, :]
        k = tl.load(K + physical * stride_kb + kv_head * stride_kh + offs_s[:, None] * stride_ks + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(V + physical * stride_vb + kv_head * stride_vh + offs_s[:, None] * stride_vs + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], 2)  # [BLOCK_G, BLOCK_S]
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: key 0 of block 0 is always visible
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=g_valid[:, None] & d_valid[None, :])


def paged_attention_triton(q, k_pool, v_pool, block_tables, seq_index, positions, scale: float | None = None):
    """:func:`paged_attention_varlen` through labkit's Triton kernel (compiled on CUDA, interpreted on the CPU)."""
    scale = _check_operands(q, k_pool, v_pool, scale)
    _check_plan_fits(PagedAttentionPlan(block_tables, seq_index, positions, *k_pool.shape[:3]), q, k_pool, v_pool)
    return _launch(q, k_pool, v_pool, block_tables, seq_index, positions, scale)


def _launch(q, k_pool, v_pool, block_tables, seq_index, positions, scale: float):
    if triton_mode() == "unavailable":
        raise ImportError("paged_attention_triton: Triton is not installed on this platform; "
                          "use paged_attention_varlen")
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        check_kernel_tensor(name, t)
    q, k_pool, v_pool = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_pool, v_pool))
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_pool.shape[1], k_pool.shape[2]
    group_size = num_heads // num_kv_heads
    _paged_attention_kernel[(num_tokens, num_kv_heads)](
        q, k_pool, v_pool, out, block_tables, seq_index.contiguous(), positions.contiguous(),
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        group_size, block_size, head_dim, scale,
        BLOCK_G=triton.next_power_of_2(group_size), BLOCK_S=triton.next_power_of_2(block_size),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out


# ----------------------------------------------------------------------------- public
def _check_operands(q, k_pool, v_pool, scale) -> float:
    """The checks of q, the pools and scale: shapes, dtypes and types only (no values read, no host sync).
    Returns the scale."""
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q: expected 3 dims [tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_pool.dim() != 4:
        raise ValueError(f"k_pool: expected 4 dims [num_blocks, num_kv_heads, block_size, head_dim], "
                         f"got shape {tuple(k_pool.shape)}")
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool: expected k_pool's shape {tuple(k_pool.shape)}, got {tuple(v_pool.shape)}")
    if not q.is_floating_point() or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise TypeError(f"q, k_pool, v_pool: expected one floating dtype, "
                        f"got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}")
    if k_pool.shape[3] != q.shape[2]:
        raise ValueError(f"q, k_pool: head_dim must match, got q {tuple(q.shape)} and k_pool {tuple(k_pool.shape)}")
    if q.shape[1] % k_pool.shape[1]:
        raise ValueError(f"q, k_pool: num_heads={q.shape[1]} must be a multiple of num_kv_heads={k_pool.shape[1]}")
    if q.shape[0] == 0:
        raise ValueError("q: expected at least one query token, got 0")
    if scale is None:
        return 1.0 / math.sqrt(q.shape[2])
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale={scale!r}: expected a positive number (default 1/sqrt(head_dim))")
    return float(scale)


def _check_indices(block_tables, seq_index, positions, num_blocks: int, block_size: int) -> None:
    """The checks of a batch's block tables, seq_index and positions; every range check shares one host sync."""
    for name, t in (("block_tables", block_tables), ("seq_index", seq_index), ("positions", positions)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if block_tables.dim() != 2 or block_tables.dtype not in INDEX_DTYPES or 0 in block_tables.shape:
        raise ValueError(f"block_tables: expected int32/int64 [num_seqs >= 1, max_blocks_per_seq >= 1], "
                         f"got {block_tables.dtype} of shape {tuple(block_tables.shape)}")
    for name, t in (("seq_index", seq_index), ("positions", positions)):
        if t.dim() != 1 or t.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name}: expected int32/int64 [tokens], got {t.dtype} of shape {tuple(t.shape)}")
    if seq_index.shape != positions.shape:
        raise ValueError(f"seq_index, positions: expected one entry per token each, "
                         f"got {seq_index.shape[0]} and {positions.shape[0]}")
    if seq_index.shape[0] == 0:
        raise ValueError("seq_index, positions: expected at least one token, got 0")
    devices = {t.device for t in (block_tables, seq_index, positions)}
    if len(devices) > 1:
        raise ValueError(f"block_tables, seq_index, positions: expected one device, got {devices}")
    num_seqs, max_blocks = block_tables.shape
    max_len = max_blocks * block_size
    # the blocks the tokens read (clamped indices: out-of-range ones are reported below, before these ranges)
    keys_per_seq = torch.zeros(num_seqs, dtype=torch.long, device=seq_index.device)
    keys_per_seq.scatter_reduce_(0, seq_index.long().clamp(0, num_seqs - 1), positions.long().clamp(0, max_len - 1) + 1,
                                 reduce="amax")
    read = torch.arange(max_blocks, device=seq_index.device)[None, :] * block_size < keys_per_seq[:, None]
    tables = block_tables.long()
    ranges = torch.stack([*torch.aminmax(seq_index.long()), *torch.aminmax(positions.long()),
                          torch.where(read, tables, num_blocks).amin(), torch.where(read, tables, -1).amax()])
    seq_lo, seq_hi, pos_lo, pos_hi, block_lo, block_hi = ranges.tolist()
    if seq_lo < 0 or seq_hi >= num_seqs:
        raise ValueError(f"seq_index: expected values in [0, {num_seqs}) (rows of block_tables), "
                         f"got [{seq_lo}, {seq_hi}]")
    if pos_lo < 0 or pos_hi >= max_len:
        raise ValueError(f"positions: expected values in [0, {max_len}) (max_blocks_per_seq * block_size), "
                         f"got [{pos_lo}, {pos_hi}]")
    if block_lo < 0 or block_hi >= num_blocks:
        raise ValueError(f"block_tables: the blocks the tokens read must be in [0, num_blocks={num_blocks}), "
                         f"got [{block_lo}, {block_hi}]")


class PagedAttentionPlan:
    """Everything :func:`paged_attention_varlen` works out from ``block_tables``, ``seq_index`` and ``positions``
    alone (their checks, and the torch path's gather indices and masks), done once and reused: an engine step's
    layers all attend through the same tables, so it builds one plan per step and calls :meth:`attend` per layer.
    ``num_blocks``, ``num_kv_heads``, ``block_size``: the pools' first three dims (``PagedKVCache.k.shape[1:4]``)."""

    def __init__(self, block_tables, seq_index, positions, num_blocks: int, num_kv_heads: int, block_size: int):
        for name, value in (("num_blocks", num_blocks), ("num_kv_heads", num_kv_heads), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an integer >= 1")
        _check_indices(block_tables, seq_index, positions, num_blocks, block_size)
        self.block_tables, self.seq_index, self.positions = block_tables, seq_index, positions
        self.pool_dims = (num_blocks, num_kv_heads, block_size)
        self._groups = None  # the torch path's, built on its first use (the kernel needs none)

    @property
    def num_tokens(self) -> int:
        return self.seq_index.shape[0]

    def attend(self, q, k_pool, v_pool, scale: float | None = None):
        """:func:`paged_attention_varlen` of ``q`` over one layer's pools, through this plan's tables; checks only
        shapes, dtypes and devices (no host sync)."""
        scale = _check_operands(q, k_pool, v_pool, scale)
        _check_plan_fits(self, q, k_pool, v_pool)
        if q.is_cuda and triton_mode() == "compiled" and q.dtype in SUPPORTED_DTYPES:
            return _launch(q, k_pool, v_pool, self.block_tables, self.seq_index, self.positions, scale)
        if self._groups is None:
            self._groups = _row_groups(self.block_tables, self.seq_index, self.positions, *self.pool_dims[1:])
        return _attend_groups(q, k_pool, v_pool, self._groups, scale)


def _check_plan_fits(plan: PagedAttentionPlan, q, k_pool, v_pool) -> None:
    if tuple(k_pool.shape[:3]) != plan.pool_dims:
        raise ValueError(f"k_pool: expected [num_blocks, num_kv_heads, block_size] = {plan.pool_dims} (the plan's), "
                         f"got shape {tuple(k_pool.shape)}")
    if q.shape[0] != plan.num_tokens:
        raise ValueError(f"q: expected {plan.num_tokens} tokens (seq_index's and positions' length), "
                         f"got shape {tuple(q.shape)}")
    devices = {t.device for t in (q, k_pool, v_pool, plan.seq_index)}
    if len(devices) > 1:
        raise ValueError(f"q, k_pool, v_pool, block_tables, seq_index, positions: expected one device, got {devices}")


def paged_attention_varlen(q, k_pool, v_pool, block_tables, seq_index, positions, scale: float | None = None):
    """Causal attention of a packed ragged batch of query tokens over a paged KV cache, read through block tables.

    q ``[T, num_heads, head_dim]``; k_pool/v_pool ``[num_blocks, num_kv_heads, block_size, head_dim]`` (one layer of
    ``PagedKVCache.k``/``.v``; ``num_heads % num_kv_heads == 0``); block_tables ``[num_seqs, max_blocks_per_seq]``
    int32/int64 (entries past a sequence's last block unused); seq_index ``[T]`` the row of block_tables of each token;
    positions ``[T]`` its absolute position: it sees key positions ``0 .. positions[t]``. ``scale`` defaults to
    ``1/sqrt(head_dim)``. Returns ``[T, num_heads, head_dim]`` in q's dtype. On CUDA (Triton compiled, fp32/fp16/bf16)
    labkit's kernel reads the blocks in place; elsewhere :func:`paged_attention_reference` computes the same in
    PyTorch. Several layers over the same tables: build one :class:`PagedAttentionPlan` and call its ``attend``."""
    _check_operands(q, k_pool, v_pool, scale)  # before the plan reads k_pool's shape
    return PagedAttentionPlan(block_tables, seq_index, positions, *k_pool.shape[:3]).attend(q, k_pool, v_pool, scale)
