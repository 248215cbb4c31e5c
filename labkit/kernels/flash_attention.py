"""FlashAttention-2 in Triton: exact attention without ever storing the N x N score matrix.

Shapes: q ``[B, Hq, Nq, D]``, k and v ``[B, Hkv, Nk, D]`` with ``Hq % Hkv == 0``. Query head
``h`` reads K/V head ``h // (Hq // Hkv)`` straight from memory, so GQA and MQA never build
repeated K/V copies.

Forward: one program per (block of ``BLOCK_M`` queries, batch x query head). It streams K/V
in blocks of ``BLOCK_N`` keys and keeps, per query row, the running max ``m``, the running sum
``l`` of ``exp(s - m)`` and an unnormalised output accumulator; when a new block raises the
max, the old sum and accumulator are rescaled by ``exp(m_old - m_new)`` (the online softmax).
It writes the output and the row's log-sum-exp ``lse = m + log(l)`` (4 bytes per row) - all
the backward pass keeps besides q, k, v and the output.

Backward (FlashAttention-2): ``delta = rowsum(dO * O)``; then ``P = exp(S - lse)`` is
recomputed tile by tile, ``dV += P^T dO``, ``dS = P * (dO V^T - delta)``, ``dK += dS^T Q``,
``dQ += dS K``. One kernel owns a K/V block and loops over every query block of every query
head in its group (dK, dV); another owns a query block and loops over the keys (dQ). Each
output tile has exactly one writer, so no atomics and the result is deterministic.

Causal masking is bottom-right aligned: query ``i`` sees keys ``j <= i + Nk - Nq``. With
``Nq == Nk`` that is the usual lower triangle; with fewer queries than keys (decoding with a KV
cache: the queries are the *last* ``Nq`` positions) the newest query sees every key.

Exponentials use ``exp2`` with ``log2(e)`` folded into the scale (the GPU's fast instruction). A row
that sees no key at all (only in the kernel: ``causal`` with ``Nq > Nk``, which the public functions
refuse) gets output 0 and ``lse = -inf``. :func:`launch_forward_kernel` launches any kernel with the
forward kernel's signature (chapter 03's exercise grades a learner's through it).
On the GPU the matmuls take fp16/bf16 operands with fp32 accumulation (tensor cores); under
Triton's CPU interpreter, whose bf16 arithmetic is wrong, every tile is upcast to fp32 at load.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from labkit.kernels._common import check_kernel_tensor
from labkit.runtime import triton_mode

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E); the kernels inline it as a literal
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128


# ----------------------------------------------------------------------------- reference
def attention_reference(q, k, v, causal: bool = False, scale: float | None = None):
    """Plain attention with the kernel's contract, in fp32: ``(out in q.dtype, lse fp32 [B, Hq, Nq])``.

    Materialises the full score matrix (the memory FlashAttention saves) and repeats K/V heads.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k32 = k.float().repeat_interleave(group, dim=1)
    v32 = v.float().repeat_interleave(group, dim=1)
    scores = (q.float() @ k32.transpose(-2, -1)) * scale
    if causal:
        nq, nk = q.shape[-2], k.shape[-2]
        visible = torch.arange(nk, device=q.device)[None, :] <= torch.arange(nq, device=q.device)[:, None] + (nk - nq)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse[..., None]) @ v32
    return out.to(q.dtype), lse


# ----------------------------------------------------------------------------- forward
@triton.jit
def _load_tile(base, rows, row_stride, offs_d, mask, UPCAST: tl.constexpr):
    """A ``[rows, BLOCK_D]`` tile of one head (zeros where ``mask`` is False), upcast to fp32
    under the interpreter."""
    tile = tl.load(base + rows[:, None] * row_stride + offs_d[None, :], mask=mask, other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _attention_block_update(
    acc, m_i, l_i, q, k, v, offs_m, offs_n, seq_k, causal_offset, sm_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """Fold one block of keys into the online softmax of a block of queries; returns ``(acc, m_i, l_i)``.

    ``m_i`` and the scores are in base-2 units (``s * log2(e)``), so ``exp2`` computes ``exp``; ``MASKED``
    blocks hold keys past ``seq_k`` or (``CAUSAL``) above the bottom-right diagonal, which get ``-inf``."""
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * (sm_scale * 1.4426950408889634)
    if MASKED:
        visible = (offs_n < seq_k)[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = m_new
    if MASKED:  # a row that has seen no key yet keeps m = -inf: shift by 0 there, since exp2(-inf - -inf) is NaN
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - shift)
    p = tl.exp2(s - shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _forward_key_blocks(
    acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
    offs_m, offs_d, d_valid, lo, hi, seq_k, causal_offset, sm_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """Online-softmax update over the key blocks ``[lo, hi)``: load each K/V block (zeros past ``seq_k``) and
    fold it in with :func:`_attention_block_update`. ``MASKED=False`` is the fast path for blocks that are
    entirely inside the sequence and entirely visible."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = d_valid[None, :]
        if MASKED:
            kv_mask = kv_mask & (offs_n < seq_k)[:, None]
        k = _load_tile(k_base, offs_n, stride_kn, offs_d, kv_mask, UPCAST)
        v = _load_tile(v_base, offs_n, stride_vn, offs_d, kv_mask, UPCAST)
        acc, m_i, l_i = _attention_block_update(acc, m_i, l_i, q, k, v, offs_m, offs_n, seq_k, causal_offset,
                                                sm_scale, MASKED, CAUSAL, INPUT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _flash_attention_forward_kernel(
    Q, K, V, Out, LSE,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    num_heads, group_size, seq_q, seq_k, head_dim, sm_scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr = False, INPUT_PRECISION: tl.constexpr = "ieee",
):
    start_m = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1)
    batch = (batch_head // num_heads).to(tl.int64)  # int64: offsets overflow int32 on long sequences
    head = batch_head % num_heads
    kv_head = (head // group_size).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < head_dim  # BLOCK_D is head_dim rounded up to a power of two
    m_valid = offs_m < seq_q

    q_base = Q + batch * stride_qb + head.to(tl.int64) * stride_qh
    k_base = K + batch * stride_kb + kv_head * stride_kh
    v_base = V + batch * stride_vb + kv_head * stride_vh
    q = _load_tile(q_base, offs_m, stride_qm, offs_d, m_valid[:, None] & d_valid[None, :], UPCAST)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    causal_offset = seq_k - seq_q
    full_blocks_end = (seq_k // BLOCK_N) * BLOCK_N
    hi = seq_k
    if CAUSAL:
        # every row of this block sees keys j <= start_m + causal_offset; later keys need the mask
        full_blocks_end = tl.minimum(full_blocks_end, ((start_m + causal_offset + 1) // BLOCK_N) * BLOCK_N)
        hi = tl.minimum(seq_k, start_m + BLOCK_M + causal_offset)
    acc, m_i, l_i = _forward_key_blocks(
        acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, d_valid,
        0, full_blocks_end, seq_k, causal_offset, sm_scale,
        False, CAUSAL, BLOCK_N, UPCAST, INPUT_PRECISION,
    )
    acc, m_i, l_i = _forward_key_blocks(
        acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, d_valid,
        full_blocks_end, hi, seq_k, causal_offset, sm_scale,
        True, CAUSAL, BLOCK_N, UPCAST, INPUT_PRECISION,
    )
    # a row that saw no key (causal, Nq > Nk) has l_i = 0 and acc = 0: its output is 0, its lse -inf
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_base = Out + batch * stride_ob + head.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], out.to(Out.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # base 2 -> natural log
    tl.store(LSE + batch_head.to(tl.int64) * seq_q + offs_m, lse, mask=m_valid)


# ----------------------------------------------------------------------------- backward
@triton.jit
def _flash_attention_backward_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    num_heads, num_kv_heads, group_size, seq_q, seq_k, head_dim, scale, scale_log2,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    batch_kv_head = tl.program_id(1)
    batch = (batch_kv_head // num_kv_heads).to(tl.int64)
    kv_head = (batch_kv_head % num_kv_heads).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < head_dim
    n_valid = offs_n < seq_k
    kv_mask = n_valid[:, None] & d_valid[None, :]
    k = _load_tile(K + batch * stride_kb + kv_head * stride_kh, offs_n, stride_kn, offs_d, kv_mask, UPCAST)
    v = _load_tile(V + batch * stride_vb + kv_head * stride_vh, offs_n, stride_vn, offs_d, kv_mask, UPCAST)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)

    causal_offset = seq_k - seq_q
    lo = 0
    if CAUSAL:
        # query i sees key j only if i >= j - causal_offset: earlier query blocks contribute nothing
        lo = (tl.maximum(0, start_n - causal_offset) // BLOCK_M) * BLOCK_M
    for group_member in range(0, group_size):
        head = kv_head * group_size + group_member
        q_base = Q + batch * stride_qb + head * stride_qh
        do_base = DO + batch * stride_dob + head * stride_doh
        row_base = (batch * num_heads + head) * seq_q
        for start_m in range(lo, seq_q, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_valid = offs_m < seq_q
            q_mask = m_valid[:, None] & d_valid[None, :]
            q = _load_tile(q_base, offs_m, stride_qm, offs_d, q_mask, UPCAST)
            do = _load_tile(do_base, offs_m, stride_dom, offs_d, q_mask, UPCAST)
            lse_log2 = tl.load(LSE + row_base + offs_m, mask=m_valid, other=0.0) * 1.4426950408889634
            delta = tl.load(DELTA + row_base + offs_m, mask=m_valid, other=0.0)
            # work with transposed tiles [keys, queries] so dk and dv accumulate without transposes
            s_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * scale_log2
            visible = n_valid[:, None] & m_valid[None, :]
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :] + causal_offset)
            p_t = tl.where(visible, tl.exp2(s_t - lse_log2[None, :]), 0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
    out_offsets = batch_kv_head.to(tl.int64) * seq_k * head_dim + offs_n[:, None] * head_dim + offs_d[None, :]
    tl.store(DK + out_offsets, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_offsets, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _flash_attention_backward_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    num_heads, group_size, seq_q, seq_k, head_dim, scale, scale_log2,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1)
    batch = (batch_head // num_heads).to(tl.int64)
    head = (batch_head % num_heads).to(tl.int64)
    kv_head = head // group_size
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < head_dim
    m_valid = offs_m < seq_q
    q_mask = m_valid[:, None] & d_valid[None, :]
    q = _load_tile(Q + batch * stride_qb + head * stride_qh, offs_m, stride_qm, offs_d, q_mask, UPCAST)
    do = _load_tile(DO + batch * stride_dob + head * stride_doh, offs_m, stride_dom, offs_d, q_mask, UPCAST)
    row_base = batch_head.to(tl.int64) * seq_q
    lse_log2 = tl.load(LSE + row_base + offs_m, mask=m_valid, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + row_base + offs_m, mask=m_valid, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    causal_offset = seq_k - seq_q
    hi = seq_k
    if CAUSAL:
        hi = tl.minimum(seq_k, start_m + BLOCK_M + causal_offset)
    k_base = K + batch * stride_kb + kv_head * stride_kh
    v_base = V + batch * stride_vb + kv_head * stride_vh
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < seq_k
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = _load_tile(k_base, offs_n, stride_kn, offs_d, kv_mask, UPCAST)
        v = _load_tile(v_base, offs_n, stride_vn, offs_d, kv_mask, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale_log2
        visible = m_valid[:, None] & n_valid[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
        p = tl.where(visible, tl.exp2(s - lse_log2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    out_offsets = row_base * head_dim + offs_m[:, None] * head_dim + offs_d[None, :]
    tl.store(DQ + out_offsets, (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


# ----------------------------------------------------------------------------- launchers
def _launch_settings(q: torch.Tensor, seq_q: int, seq_k: int, kernel: str, mode: str | None = None) -> dict:
    """Tile sizes and precision flags for ``kernel`` ("forward", "dkdv" or "dq") where Triton runs in ``mode``
    (``labkit.runtime.triton_mode()`` by default: "interpreter" or "compiled").

    The interpreter pays per program and per loop step, so it gets big tiles clipped to the
    sequence. On the GPU the tiles follow the Triton fused-attention tutorial: the forward and
    dQ kernels own many query rows and stream thin key tiles; the dK/dV kernel owns many keys
    and streams thin query tiles. fp32 tiles are twice the bytes, so they are halved.
    """
    head_dim = q.shape[-1]
    settings = dict(BLOCK_D=_block_d(head_dim))
    if (mode or triton_mode()) == "interpreter":
        settings.update(
            BLOCK_M=min(64, max(16, triton.next_power_of_2(seq_q))),
            BLOCK_N=min(64, max(16, triton.next_power_of_2(seq_k))),
            UPCAST=True, INPUT_PRECISION="ieee",
        )
        return settings
    wide = q.dtype != torch.float32
    block_m, block_n = {"forward": (128, 64), "dkdv": (32, 128), "dq": (128, 32)}[kernel]
    if not wide:
        block_m, block_n = (block_m // 2, block_n) if block_m > block_n else (block_m, block_n // 2)
    settings.update(
        BLOCK_M=block_m, BLOCK_N=block_n,
        # fp32 inputs stay fp32 (no tf32 rounding); fp16/bf16 feed the tensor cores directly
        UPCAST=False, INPUT_PRECISION="tf32" if wide else "ieee",
        num_warps=8 if kernel == "forward" and head_dim > 64 else 4,
        num_stages=3 if wide and head_dim <= 64 else 2,
    )
    return settings


def _block_d(head_dim: int) -> int:
    """The tile width for ``head_dim``: the next power of two, at least 16 (``tl.dot``'s smallest)."""
    return max(16, triton.next_power_of_2(head_dim))


def forward_tiles(q: torch.Tensor, seq_k: int, mode: str | None = None) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` of the forward kernel for queries like ``q`` (any device, ``meta`` too) and ``seq_k``
    keys, where Triton runs in ``mode`` (here by default; "compiled" gives a GPU's tiles)."""
    settings = _launch_settings(q, q.shape[2], seq_k, "forward", mode)
    return settings["BLOCK_M"], settings["BLOCK_N"]


def forward_traffic(q_shape: tuple, num_kv_heads: int, seq_k: int, causal: bool, block_m: int, block_n: int,
                    element_size: int) -> dict[str, int]:
    """The bytes labkit's forward kernel moves between global memory (HBM) and the chip, from its loop bounds:
    ``{"loaded", "stored"}``. Each program loads its query tile once and every K and V tile its rows can see (so
    K and V are read once per query block: ``2 N^2 D / BLOCK_M`` elements for ``N`` queries and keys), and stores
    its output rows and their fp32 lse; nothing of size ``N x N`` ever leaves the chip."""
    batch, num_heads, seq_q, head_dim = q_shape
    kv_keys = 0  # keys loaded (from K and from V) by the programs of one query head
    for start_m in range(0, seq_q, block_m):
        end = min(seq_k, start_m + block_m + seq_k - seq_q) if causal else seq_k
        kv_keys += sum(min(block_n, seq_k - start_n) for start_n in range(0, max(end, 0), block_n))
    rows = batch * num_heads * seq_q
    return dict(loaded=(rows * head_dim + 2 * batch * num_heads * kv_keys * head_dim) * element_size,
                stored=rows * head_dim * element_size + rows * 4)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def launch_forward_kernel(kernel, q, k, v, out, lse, causal: bool, scale: float, block_m: int, block_n: int,
                          query_blocks: int | None = None, **options) -> None:
    """Launch a FlashAttention forward ``kernel(Q, K, V, Out, LSE, stride_qb, stride_qh, stride_qm, stride_kb,
    stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, num_heads,
    group_size, seq_q, seq_k, head_dim, sm_scale, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D)`` (the last four
    ``tl.constexpr``) on q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nk, D]`` and out like q (any strides with a dense
    last dim), writing ``lse`` (fp32, contiguous ``[B, Hq, Nq]``). Grid ``(query blocks, B * Hq)``: program
    ``(i, b * Hq + h)`` owns rows ``i * BLOCK_M ...`` of query head ``h`` in batch ``b``; ``query_blocks`` launches
    only the first ones (every program is independent). ``options`` go to the launch (labkit's kernel: its
    ``UPCAST``/``INPUT_PRECISION`` and ``num_warps``/``num_stages``)."""
    batch, num_heads, seq_q, head_dim = q.shape
    grid = (triton.cdiv(seq_q, block_m) if query_blocks is None else query_blocks, batch * num_heads)
    kernel[grid](
        q, k, v, out, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(out),
        num_heads, num_heads // k.shape[1], seq_q, k.shape[2], head_dim, scale,
        CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block_d(head_dim), **options,
    )


def _forward(q, k, v, causal: bool, scale: float):
    """``(out, lse)`` from labkit's forward kernel."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    settings = _launch_settings(q, q.shape[2], k.shape[2], "forward")
    del settings["BLOCK_D"]  # the launcher derives it from the head dim
    launch_forward_kernel(_flash_attention_forward_kernel, q, k, v, out, lse, causal, scale,
                          settings.pop("BLOCK_M"), settings.pop("BLOCK_N"), **settings)
    return out, lse


def _backward(q, k, v, out, lse, grad_out, causal: bool, scale: float):
    batch, num_heads, seq_q, head_dim = q.shape
    num_kv_heads, seq_k = k.shape[1], k.shape[2]
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    # delta_i = sum_d dO_id O_id = sum_j P_ij dP_ij: the softmax-backward term, one number per row
    delta = (grad_out.float() * out.float()).sum(dim=-1).contiguous()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    common = (*_strides(q), *_strides(k), *_strides(v), *_strides(grad_out))
    group_size = num_heads // num_kv_heads
    settings = _launch_settings(q, seq_q, seq_k, "dkdv")
    _flash_attention_backward_dkdv_kernel[(triton.cdiv(seq_k, settings["BLOCK_N"]), batch * num_kv_heads)](
        q, k, v, grad_out, lse, delta, dk, dv, *common,
        num_heads, num_kv_heads, group_size, seq_q, seq_k, head_dim, scale, scale * LOG2E,
        CAUSAL=causal, **settings,
    )
    settings = _launch_settings(q, seq_q, seq_k, "dq")
    _flash_attention_backward_dq_kernel[(triton.cdiv(seq_q, settings["BLOCK_M"]), batch * num_heads)](
        q, k, v, grad_out, lse, delta, dq, *common,
        num_heads, group_size, seq_q, seq_k, head_dim, scale, scale * LOG2E,
        CAUSAL=causal, **settings,
    )
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        out, lse = _forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, grad_out, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def _validate(q, k, v, causal, scale) -> float:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_kernel_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v: expected one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k, v: expected the same shape [B, Hkv, Nk, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q, k: batch and head_dim must match, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q, k: query heads Hq={q.shape[1]} must be a multiple of K/V heads Hkv={k.shape[1]}")
    if not MIN_HEAD_DIM <= q.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim={q.shape[3]} is not supported; expected {MIN_HEAD_DIM} <= head_dim <= {MAX_HEAD_DIM}")
    if q.shape[2] == 0 or k.shape[2] == 0 or q.shape[0] == 0:
        raise ValueError(f"q, k: expected non-empty batch and sequences, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if causal and q.shape[2] > k.shape[2]:
        raise ValueError(
            f"causal=True with Nq={q.shape[2]} > Nk={k.shape[2]}: causal masking is bottom-right aligned, "
            f"so the first {q.shape[2] - k.shape[2]} queries would see no key"
        )
    if scale is None:
        return 1.0 / math.sqrt(q.shape[3])
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale={scale!r}: expected a positive number (default 1/sqrt(head_dim))")
    return float(scale)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # any [B, H, N, D] view works (e.g. a transposed [B, N, H, D] projection) as long as D is dense
    return t if t.stride(-1) == 1 else t.contiguous()


def flash_attention_with_lse(q, k, v, causal: bool = False, scale: float | None = None):
    """``(out, lse)``: attention output in q's dtype and the fp32 log-sum-exp ``[B, Hq, Nq]`` of
    each query's scaled, masked scores. Differentiable in q, k, v (not through lse).

    q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nk, D]``, ``Hq % Hkv == 0``, ``16 <= D <= 128``, any
    ``Nq``/``Nk``, fp32/fp16/bf16. ``causal`` is bottom-right aligned (query ``i`` sees keys
    ``j <= i + Nk - Nq``) and needs ``Nq <= Nk``. ``scale`` defaults to ``1/sqrt(D)``.
    """
    scale = _validate(q, k, v, causal, scale)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    return FlashAttentionFunction.apply(q, k, v, bool(causal), scale)


def flash_attention(q, k, v, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Attention output ``softmax(q k^T * scale [+ causal mask]) v`` in q's dtype; see
    :func:`flash_attention_with_lse` for the contract."""
    return flash_attention_with_lse(q, k, v, causal, scale)[0]
