"""Paged attention over a packed ragged batch (labkit.kernels.paged_attention): the Triton kernel (under the CPU
interpreter here: tiny sizes) and the torch path against an independent reference, one query token at a time: its
sequence's blocks gathered in logical order, torch SDPA with the causal offset mask, K/V heads repeated for GQA.

Block tables are random permutations of the pool (shuffled, non-contiguous blocks), padded with -1; batches mix
decode rows (one token of a sequence) with prefill chunks (several consecutive positions), in shuffled token order."""
import math

import labkit  # noqa: F401  (switches Triton to the interpreter on CPU first)
import pytest
import torch
import torch.nn.functional as F

from labkit.attention_variants import PagedKVCache, paged_attention
from labkit.kernels.paged_attention import (PagedAttentionPlan, paged_attention_reference, paged_attention_triton,
                                            paged_attention_varlen)
from labkit.runtime import triton_mode

KERNEL_DEVICE = "cuda" if triton_mode() == "compiled" else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def independent_reference(q, k_pool, v_pool, block_tables, seq_index, positions, scale=None):
    """Token by token, in float64: gather the token's sequence up to its position, then SDPA with the causal offset
    mask (the token is the last of ``positions[t] + 1`` positions; mask[i, j] = j <= i + offset)."""
    block_size, group = k_pool.shape[2], q.shape[1] // k_pool.shape[1]
    rows = []
    for t in range(q.shape[0]):
        length = int(positions[t]) + 1
        blocks = block_tables[int(seq_index[t])][: math.ceil(length / block_size)].long()
        k = k_pool[blocks].double().transpose(0, 1).flatten(1, 2)[:, :length].repeat_interleave(group, 0)
        v = v_pool[blocks].double().transpose(0, 1).flatten(1, 2)[:, :length].repeat_interleave(group, 0)
        mask = torch.ones(1, length, dtype=torch.bool).tril(diagonal=length - 1)
        rows.append(F.scaled_dot_product_attention(q[t].double()[:, None], k, v, attn_mask=mask, scale=scale)[:, 0])
    return torch.stack(rows)


def ragged_batch(seed, num_seqs=3, num_blocks=16, block_size=4, num_kv_heads=2, group=2, head_dim=8,
                 dtype=torch.float32, device="cpu"):
    """Pools, shuffled block tables padded with -1, and a shuffled mix of decode rows and prefill chunks."""
    gen = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen)
    v_pool = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen)
    blocks_per_seq = num_blocks // num_seqs
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((num_seqs, blocks_per_seq + 1), -1, dtype=torch.int32)
    seq_index, positions = [], []
    for s in range(num_seqs):
        owned = int(torch.randint(1, blocks_per_seq + 1, (1,), generator=gen))
        tables[s, :owned] = order[s * blocks_per_seq: s * blocks_per_seq + owned]
        end = int(torch.randint((owned - 1) * block_size + 1, owned * block_size + 1, (1,), generator=gen))
        chunk = 1 if s % 2 == 0 else int(torch.randint(2, end + 1, (1,), generator=gen))  # decode row or chunk
        seq_index += [s] * chunk
        positions += range(end - chunk, end)
    shuffle = torch.randperm(len(seq_index), generator=gen)
    seq_index, positions = torch.tensor(seq_index)[shuffle], torch.tensor(positions)[shuffle]
    q = torch.randn(len(seq_index), num_kv_heads * group, head_dim, generator=gen)
    tensors = [t.to(dtype) for t in (q, k_pool, v_pool)] + [tables, seq_index, positions]
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("group", [1, 2, 4])
def test_torch_path_equals_independent_reference(seed, group):
    batch = ragged_batch(seed, num_seqs=5, num_blocks=30, block_size=4, group=group, dtype=torch.float64)
    torch.testing.assert_close(paged_attention_varlen(*batch), independent_reference(*batch), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed,group,block_size,head_dim", [(0, 1, 4, 8), (1, 2, 4, 8), (2, 4, 8, 16), (3, 2, 3, 6)])
def test_kernel_equals_independent_reference(seed, group, block_size, head_dim):
    batch = ragged_batch(seed, num_seqs=3, num_blocks=12, block_size=block_size, group=group, head_dim=head_dim,
                         device=KERNEL_DEVICE)
    expected = independent_reference(*(t.cpu() for t in batch)).float()
    torch.testing.assert_close(paged_attention_triton(*batch).cpu(), expected, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(paged_attention_varlen(*batch).cpu(), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_and_torch_path_in_half_precision(dtype):
    batch = ragged_batch(5, dtype=dtype, device=KERNEL_DEVICE)
    expected = independent_reference(*(t.cpu() for t in batch))
    for out in (paged_attention_triton(*batch), paged_attention_reference(*batch)):
        assert out.dtype == dtype
        torch.testing.assert_close(out.cpu().double(), expected, rtol=TOL[dtype], atol=TOL[dtype])


def test_scale_and_unwritten_slots():
    """A custom scale; slots past a sequence's positions and blocks nobody owns hold NaN and must not leak in."""
    q, k_pool, v_pool, tables, seq_index, positions = ragged_batch(7, num_seqs=2, num_blocks=12)
    expected = independent_reference(q, k_pool, v_pool, tables, seq_index, positions, scale=0.3).float()
    lengths = torch.zeros(tables.shape[0], dtype=torch.long).scatter_reduce(0, seq_index, positions + 1, "amax")
    owned = set(tables[tables >= 0].tolist())
    for pool in (k_pool, v_pool):
        pool[[b for b in range(pool.shape[0]) if b not in owned]] = float("nan")
        for s, length in enumerate(lengths.tolist()):  # the unwritten tail of each sequence's last block
            last, offset = divmod(length, pool.shape[2])
            if offset:
                pool[int(tables[s, last]), :, offset:] = float("nan")
    for fn in (paged_attention_varlen, paged_attention_triton):
        torch.testing.assert_close(fn(q, k_pool, v_pool, tables, seq_index, positions, scale=0.3), expected,
                                   rtol=2e-5, atol=2e-5)


def test_single_sequence_equals_chapter_03_paged_attention():
    """Decoding one sequence from a PagedKVCache: the varlen op over the cache's pools and table equals
    labkit.attention_variants.paged_attention (GQA, a last block partly filled)."""
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(num_layers=1, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
    cache.add_sequence("other")
    cache.add_sequence("mine")
    for seq, n in (("other", 3), ("mine", 6), ("other", 5), ("mine", 5)):  # interleaved: non-contiguous blocks
        cache.append(seq, 0, torch.randn(2, n, 8, generator=gen), torch.randn(2, n, 8, generator=gen))
    length = cache.length("mine")
    q = torch.randn(4, 3, 8, generator=gen)  # the last 3 positions of "mine", 4 query heads on 2 K/V heads
    expected = paged_attention(q, cache, "mine")
    table = torch.tensor([cache.allocator.block_tables["mine"]], dtype=torch.int32)
    positions = torch.arange(length - 3, length)
    args = (q.transpose(0, 1), cache.k[0], cache.v[0], table, torch.zeros(3, dtype=torch.long), positions)
    for fn in (paged_attention_varlen, paged_attention_triton):
        torch.testing.assert_close(fn(*args).transpose(0, 1), expected, rtol=1e-5, atol=1e-6)


def decode_batch(seed, num_seqs, shuffled, block_size=4, num_kv_heads=2, group=2, head_dim=8):
    """A step where every token decodes (one per sequence, what the engine runs most): in sequence order or not."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 3 * num_seqs
    k_pool, v_pool = (torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen) for _ in range(2))
    tables = torch.randperm(num_blocks, generator=gen).view(num_seqs, 3).int()
    seq_index = torch.randperm(num_seqs, generator=gen) if shuffled else torch.arange(num_seqs)
    positions = torch.randint(0, 3 * block_size, (num_seqs,), generator=gen)
    q = torch.randn(num_seqs, num_kv_heads * group, head_dim, generator=gen)
    return [q, k_pool, v_pool, tables, seq_index, positions]


@pytest.mark.parametrize("shuffled", [False, True])
def test_decode_only_batches(shuffled):
    for seed in range(3):
        batch = decode_batch(seed, num_seqs=5, shuffled=shuffled)
        torch.testing.assert_close(paged_attention_varlen(*batch), independent_reference(*batch).float(),
                                   rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("make", [lambda seed: ragged_batch(seed, num_seqs=4, num_blocks=20),
                                  lambda seed: decode_batch(seed, num_seqs=4, shuffled=False),
                                  lambda seed: decode_batch(seed, num_seqs=4, shuffled=True)])
def test_plan_reused_across_layers_equals_checked_path(make):
    """One plan per step, its attend per layer (other pools, other queries, a scale): bit for bit the public,
    fully checked function's result."""
    for seed in range(3):
        q, k_pool, v_pool, tables, seq_index, positions = make(seed)
        plan = PagedAttentionPlan(tables, seq_index, positions, *k_pool.shape[:3])
        gen = torch.Generator().manual_seed(100 + seed)
        for layer in range(3):
            q_l, k_l, v_l = (torch.randn(t.shape, generator=gen) for t in (q, k_pool, v_pool))
            scale = None if layer < 2 else 0.3
            expected = paged_attention_varlen(q_l, k_l, v_l, tables, seq_index, positions, scale)
            assert torch.equal(plan.attend(q_l, k_l, v_l, scale), expected)
            assert torch.equal(paged_attention_reference(q_l, k_l, v_l, tables, seq_index, positions, scale), expected)


def test_plan_bad_inputs():
    q, k_pool, v_pool, tables, seq_index, positions = ragged_batch(0)
    plan = PagedAttentionPlan(tables, seq_index, positions, *k_pool.shape[:3])
    for args, name in (((q[:-1], k_pool, v_pool), "q"), ((q, k_pool[:-1], v_pool[:-1]), "k_pool"),
                       ((q, k_pool, v_pool[..., :4]), "v_pool"), ((q.double(), k_pool, v_pool), "q")):
        with pytest.raises((ValueError, TypeError), match=name):
            plan.attend(*args)
    for dims, name in (((0, 2, 4), "num_blocks"), ((16, 2.0, 4), "num_kv_heads"), ((16, 2, True), "block_size")):
        with pytest.raises(ValueError, match=name):
            PagedAttentionPlan(tables, seq_index, positions, *dims)
    with pytest.raises(ValueError, match="block_tables"):
        PagedAttentionPlan(tables, seq_index, positions, 3, 2, 4)  # fewer blocks than the tables name
    with pytest.raises(ValueError, match="block_tables"):
        PagedAttentionPlan(tables[:, :0], seq_index, positions, 16, 2, 4)


def test_bad_inputs():
    q, k_pool, v_pool, tables, seq_index, positions = ragged_batch(0)
    good = dict(q=q, k_pool=k_pool, v_pool=v_pool, block_tables=tables, seq_index=seq_index, positions=positions)
    bad = [
        (dict(q=q.numpy()), TypeError, "q"),
        (dict(q=q[0]), ValueError, "q"),
        (dict(k_pool=k_pool[0]), ValueError, "k_pool"),
        (dict(v_pool=v_pool[:, :1]), ValueError, "v_pool"),
        (dict(k_pool=k_pool.double(), v_pool=v_pool.double()), TypeError, "k_pool"),
        (dict(q=q[..., :4]), ValueError, "head_dim"),
        (dict(q=q[:, :3]), ValueError, "num_heads"),
        (dict(block_tables=tables.float()), ValueError, "block_tables"),
        (dict(seq_index=seq_index[:-1]), ValueError, "seq_index"),
        (dict(positions=positions.float()), ValueError, "positions"),
        (dict(seq_index=seq_index + 10), ValueError, "seq_index"),
        (dict(positions=positions + 1000), ValueError, "positions"),
        (dict(positions=positions - 1000), ValueError, "positions"),
        (dict(block_tables=tables.clamp(max=0) - 1), ValueError, "block_tables"),  # every used entry padding
    ]
    for change, error, name in bad:
        with pytest.raises(error, match=name):
            paged_attention_varlen(**{**good, **change})
    with pytest.raises(ValueError, match="scale"):
        paged_attention_varlen(**good, scale=-1.0)
    with pytest.raises(ValueError, match="q"):
        paged_attention_varlen(**{**good, "q": q[:0], "seq_index": seq_index[:0], "positions": positions[:0]})
