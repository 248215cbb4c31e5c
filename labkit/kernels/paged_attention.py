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

Torch path (:func:`paged_attention_reference`, what the public function runs off the GPU): per sequence, gather its
blocks into a contiguous ``[num_kv_heads, length, head_dim]`` (one indexing op for all sequences), place its query
rows in a padded ``[num_seqs, num_heads, rows, head_dim]`` batch and run one masked SDPA (``enable_gqa``); decode rows
(one per sequence) and prefill chunks are batched separately so one long chunk does not pad every decode row to its
length.
"""
from __future__ import annotations

import math

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
def _sequences_of(seq_index, positions):
    """``(sequences, keys_per_seq, row_of_token)``: the distinct sequences the tokens touch, how many key positions
    each needs (its largest query position + 1) and each token's index into ``sequences``."""
    sequences, row_of_token = torch.unique(seq_index, return_inverse=True)
    keys_per_seq = torch.zeros(len(sequences), dtype=torch.long, device=positions.device)
    keys_per_seq.scatter_reduce_(0, row_of_token, positions.long() + 1, reduce="amax")
    return sequences, keys_per_seq, row_of_token


def _attend_padded(q, k_pool, v_pool, tables, keys_per_seq, token_seq, token_pos, scale):
    """Attention of the tokens ``q [n, Hq, D]`` (token ``i`` of sequence ``token_seq[i]`` of ``tables``, at
    ``token_pos[i]``) with one gather and one SDPA: sequences' rows padded to the longest, keys to the longest."""
    num_seqs, block_size = tables.shape[0], k_pool.shape[2]
    num_keys = int(keys_per_seq.max())
    tables = tables[:, : -(-num_keys // block_size)].clamp(0, k_pool.shape[0] - 1)  # padding entries: any value,
    # [S, blocks, Hkv, bs, D] -> [S, Hkv, blocks * bs, D], cut to the longest sequence's keys
    k = k_pool[tables].transpose(1, 2).flatten(2, 3)[:, :, :num_keys]
    v = v_pool[tables].transpose(1, 2).flatten(2, 3)[:, :, :num_keys]
    key_pos = torch.arange(num_keys, device=q.device)
    written = (key_pos[None, :] < keys_per_seq[:, None])[:, None, :, None]  # and slots past a sequence's keys may
    k, v = torch.where(written, k, 0.0), torch.where(written, v, 0.0)  # hold anything (even NaN): never let them in
    # each token's row within its sequence: its rank among the tokens of that sequence
    order = torch.argsort(token_seq, stable=True)
    counts = torch.bincount(token_seq, minlength=num_seqs)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(token_seq)
    rank[order] = torch.arange(len(token_seq), device=q.device) - starts[token_seq[order]]
    rows = int(counts.max())
    q_padded = q.new_zeros((num_seqs, rows, q.shape[1], q.shape[2]))
    q_padded[token_seq, rank] = q
    pos_padded = torch.zeros((num_seqs, rows), dtype=torch.long, device=q.device)  # padding rows see key 0: no NaN
    pos_padded[token_seq, rank] = token_pos
    visible = key_pos[None, None, :] <= pos_padded[:, :, None]  # [S, rows, keys]
    out = F.scaled_dot_product_attention(q_padded.transpose(1, 2), k, v, attn_mask=visible[:, None], scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2)[token_seq, rank]


def paged_attention_reference(q, k_pool, v_pool, block_tables, seq_index, positions, scale: float | None = None):
    """:func:`paged_attention_varlen` in PyTorch (gathers each sequence's blocks, then one batched attention per
    kind of row: decode rows together, prefill chunks together); same contract, no input checks."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    positions, seq_index = positions.long(), seq_index.long()
    sequences, keys_per_seq, row_of_token = _sequences_of(seq_index, positions)
    tables = block_tables[sequences].long()
    out = torch.empty_like(q)
    rows_per_seq = torch.bincount(row_of_token, minlength=len(sequences))
    decode_row = rows_per_seq[row_of_token] == 1
    for tokens in (decode_row, ~decode_row):
        if not tokens.any():
            continue
        seqs_here, token_seq = torch.unique(row_of_token[tokens], return_inverse=True)
        out[tokens] = _attend_padded(q[tokens], k_pool, v_pool, tables[seqs_here], keys_per_seq[seqs_here],
                                     token_seq, positions[tokens], scale)
    return out


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
    scale = _validate(q, k_pool, v_pool, block_tables, seq_index, positions, scale)
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
def _validate(q, k_pool, v_pool, block_tables, seq_index, positions, scale) -> float:
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool), ("block_tables", block_tables),
                    ("seq_index", seq_index), ("positions", positions)):
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
    if block_tables.dim() != 2 or block_tables.dtype not in INDEX_DTYPES:
        raise ValueError(f"block_tables: expected int32/int64 [num_seqs, max_blocks_per_seq], "
                         f"got {block_tables.dtype} of shape {tuple(block_tables.shape)}")
    for name, t in (("seq_index", seq_index), ("positions", positions)):
        if t.dim() != 1 or t.dtype not in INDEX_DTYPES or t.shape[0] != q.shape[0]:
            raise ValueError(f"{name}: expected int32/int64 [tokens={q.shape[0]}], "
                             f"got {t.dtype} of shape {tuple(t.shape)}")
    devices = {t.device for t in (q, k_pool, v_pool, block_tables, seq_index, positions)}
    if len(devices) > 1:
        raise ValueError(f"q, k_pool, v_pool, block_tables, seq_index, positions: expected one device, got {devices}")
    if q.shape[0] == 0:
        raise ValueError("q: expected at least one query token, got 0")
    num_seqs, max_blocks = block_tables.shape
    if int(seq_index.min()) < 0 or int(seq_index.max()) >= num_seqs:
        raise ValueError(f"seq_index: expected values in [0, {num_seqs}) (rows of block_tables), "
                         f"got [{int(seq_index.min())}, {int(seq_index.max())}]")
    block_size = k_pool.shape[2]
    if int(positions.min()) < 0 or int(positions.max()) >= max_blocks * block_size:
        raise ValueError(f"positions: expected values in [0, {max_blocks * block_size}) (max_blocks_per_seq * "
                         f"block_size), got [{int(positions.min())}, {int(positions.max())}]")
    sequences, keys_per_seq, _ = _sequences_of(seq_index.long(), positions)
    used = torch.arange(max_blocks, device=q.device)[None, :] * block_size < keys_per_seq[:, None]
    entries = block_tables[sequences][used]
    if int(entries.min()) < 0 or int(entries.max()) >= k_pool.shape[0]:
        raise ValueError(f"block_tables: the blocks the tokens read must be in [0, num_blocks={k_pool.shape[0]}), "
                         f"got [{int(entries.min())}, {int(entries.max())}]")
    if scale is None:
        return 1.0 / math.sqrt(q.shape[2])
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale={scale!r}: expected a positive number (default 1/sqrt(head_dim))")
    return float(scale)


def paged_attention_varlen(q, k_pool, v_pool, block_tables, seq_index, positions, scale: float | None = None):
    """Causal attention of a packed ragged batch of query tokens over a paged KV cache, read through block tables.

    q ``[T, num_heads, head_dim]``; k_pool/v_pool ``[num_blocks, num_kv_heads, block_size, head_dim]`` (one layer of
    ``PagedKVCache.k``/``.v``; ``num_heads % num_kv_heads == 0``); block_tables ``[num_seqs, max_blocks_per_seq]``
    int32/int64 (entries past a sequence's last block unused); seq_index ``[T]`` the row of block_tables of each token;
    positions ``[T]`` its absolute position: it sees key positions ``0 .. positions[t]``. ``scale`` defaults to
    ``1/sqrt(head_dim)``. Returns ``[T, num_heads, head_dim]`` in q's dtype. On CUDA (Triton compiled, fp32/fp16/bf16)
    labkit's kernel reads the blocks in place; elsewhere :func:`paged_attention_reference` computes the same in
    PyTorch."""
    scale = _validate(q, k_pool, v_pool, block_tables, seq_index, positions, scale)
    if q.is_cuda and triton_mode() == "compiled" and q.dtype in SUPPORTED_DTYPES:
        return _launch(q, k_pool, v_pool, block_tables, seq_index, positions, scale)
    return paged_attention_reference(q, k_pool, v_pool, block_tables, seq_index, positions, scale)
