"""Graders for chapter 03 (attention and the KV cache)."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from labkit import attention as _attention
from labkit import nn as _nn
from labkit.checks._core import (as_tensor, assert_close, call, call_kernel, call_on_copies, call_twice, expect_device, expect_dtype,
                                 expect_jit_kernel, fail, kernel_device, other_device, passed, results, same_values)
from labkit.model import PRESETS, ModelConfig

__all__ = ["causal_mask", "flash_attention_kernel", "flash_attention_torch", "kv_bytes_per_token", "online_softmax_update"]


def causal_mask(fn) -> None:
    """Grade ``fn(num_queries, num_keys) -> bool [num_queries, num_keys]``, bottom-right aligned, for
    square, decode (1 query), ``Nq < Nk``, ``Nq > Nk`` (the first queries see no key) and long masks."""
    for num_q, num_k in [(4, 4), (1, 6), (3, 7), (6, 6), (2, 9), (1, 1), (5, 3), (4, 1), (300, 300), (1, 513), (257, 600)]:
        tried = f"causal_mask({num_q}, {num_k})"
        got = as_tensor(call(fn, tried, num_q, num_k), tried)
        expected = _nn.causal_mask(num_q, num_k)
        if got.shape != expected.shape:
            fail(tried, f"shape {tuple(got.shape)}", f"shape {tuple(expected.shape)}", "one row per query, one column per key")
        if got.dtype != torch.bool:
            fail(tried, f"dtype {got.dtype}", "torch.bool", "return a boolean mask (True = may attend), e.g. with a comparison")
        if torch.equal(got, expected):
            continue
        if torch.equal(got, ~expected):
            hint = "the mask is inverted: True must mean 'may attend' (torch's convention)"
        elif num_q > num_k and torch.equal(got, torch.ones(num_q, num_k, dtype=torch.bool).tril()):
            hint = ("with more queries than keys the keys are the LAST num_keys positions: query i sees keys "
                    "j <= i + (num_keys - num_queries), a negative offset, so the first queries see no key at all "
                    "(do not clamp the offset at 0)")
        elif torch.equal(got, torch.ones(num_q, num_k, dtype=torch.bool).tril()):
            hint = ("this is top-left aligned; with fewer queries than keys the queries are the LAST "
                    "positions, so query i sees keys j <= i + num_keys - num_queries")
        elif torch.equal(got, torch.ones(num_q, num_k, dtype=torch.bool).tril(num_k - num_q - 1)):
            hint = "a token must be allowed to attend to itself: use <=, not <"
        else:
            hint = "query i may attend to keys j <= i + (num_keys - num_queries)"
        bad = (got != expected).nonzero()[0].tolist()
        if num_q * num_k > 100:
            fail(tried, f"mask[{bad[0]}, {bad[1]}] = {bool(got[bad[0], bad[1]])}", f"{bool(expected[bad[0], bad[1]])}", hint)
        fail(tried, f"\n{got.int()}", f"\n{expected.int()}", hint)
    passed("causal_mask", "bottom-right aligned for square, decode (1 query), Nq < Nk, Nq > Nk and 600-key masks")


def kv_bytes_per_token(fn) -> None:
    """Grade ``fn(config: ModelConfig, dtype: torch.dtype) -> int``: KV-cache bytes per token."""
    custom = ModelConfig(vocab_size=1000, context_length=128, d_model=512, num_layers=6, num_heads=8, num_kv_heads=2,
                         head_dim=96, d_ff=1024)  # head_dim != d_model / num_heads on purpose
    cases = [("qwen3-8b", PRESETS["qwen3-8b"], torch.bfloat16), ("llama2-7b (MHA: num_kv_heads=None)", PRESETS["llama2-7b"], torch.float16),
             ("gemma-2b", PRESETS["gemma-2b"], torch.float32), ("llama2-70b", PRESETS["llama2-70b"], torch.float8_e4m3fn),
             ("llama3-8b (head_dim=None)", PRESETS["llama3-8b"], torch.float8_e5m2), ("qwen3-8b", PRESETS["qwen3-8b"], torch.int8),
             ("gemma-2b", PRESETS["gemma-2b"], torch.float64),
             ("custom (head_dim=96, d_model=512, 8 heads, 2 KV heads)", custom, torch.bfloat16)]
    for name, config, dtype in cases:
        tried = f"kv_bytes_per_token({name}, {dtype})"
        got = call(fn, tried, config, dtype,
                   hint="use config.kv_heads and config.dim_per_head (config.num_kv_heads and config.head_dim may be "
                        "None, meaning 'as many as the query heads' and 'd_model / num_heads'), and "
                        "torch.empty((), dtype=dtype).element_size() (torch.finfo fails for integer dtypes like int8)")
        if isinstance(got, bool) or not isinstance(got, int):
            kind = f"a {type(got).__name__}" + (f" ({got!r})" if isinstance(got, float) else "")
            fail(tried, kind, "a Python int (bytes)",
                 "bytes are a whole number: return an int, e.g. with element_size() (an int) rather than bits / 8 "
                 "(a float) or a tensor")
        expected = _attention.kv_bytes_per_token(config, dtype)
        if got == expected:
            continue
        size = dtype.itemsize
        layers, kv, hd, heads = config.num_layers, config.kv_heads, config.dim_per_head, config.num_heads
        mistakes = [
            (layers * kv * hd * size, "count both K and V: a factor of 2"),
            (2 * layers * heads * hd * size, "the cache stores K/V heads (num_kv_heads), not query heads"),
            (2 * kv * hd * size, "every layer has its own cache: multiply by num_layers"),
            (2 * layers * kv * (config.d_model // heads) * size, "use the head dim (config.head_dim may differ from d_model / num_heads)"),
            (2 * layers * kv * hd * size * 8, "bytes, not bits: element_size() is already in bytes"),
            (2 * layers * kv * hd, "multiply by the bytes per element of dtype"),
        ]
        hint = " or ".join(h for value, h in mistakes if value == got and value != expected)
        fail(tried, got, expected, hint or "2 (K and V) x layers x KV heads x head_dim x bytes per element")
    passed("kv_bytes_per_token", "MHA, GQA and MQA models in fp64/fp32/fp16/bf16/fp8/int8, as an int")


def online_softmax_update(fn) -> None:
    """Grade ``fn(running_max, running_sum, acc, scores, values) -> (new_max, new_sum, new_acc)``:
    three blocks folded one by one, leading shapes ``[B]`` and ``[B, H]``, float64 and float32,
    blocks of up to 300 keys, masked keys, a row whose first block is entirely masked (from the
    state ``(-inf, 0, 0)``), a row masked in every block (its state must stay ``(-inf, 0, 0)``), a
    later block with every key of a row masked, scores up to about ±1200 (exp overflows float64
    beyond ~709.8), on CUDA when there is one; the state passed in must not change."""
    gen = torch.Generator().manual_seed(3)
    device = other_device(None)
    specs = [((2,), 3, 4, 5, 1.0, torch.float64, "cpu"), ((2,), 1, 7, 2, 3.0, torch.float64, "cpu"),
             ((2,), 4, 5, 3, 400.0, torch.float64, "cpu"), ((2, 3), 5, 6, 4, 2.0, torch.float32, "cpu"),
             ((1, 2), 3, 300, 8, 5.0, torch.float32, "cpu"), ((2,), 2, 8, 3, 30.0, torch.float32, "cpu")]
    if device is not None:
        specs.append(((2, 2), 4, 64, 16, 3.0, torch.float32, device))
    names = ("new_max", "new_sum", "new_acc")
    hints = ("the new max is max(running_max, max of this block's scores)",
             "rescale the old sum by exp(running_max - new_max), then add sum(exp(scores - new_max))",
             "rescale the old acc by exp(running_max - new_max), then add exp(scores - new_max) @ values")
    for lead, rows, block, dim, magnitude, dtype, dev in specs:
        scores = (torch.randn(*lead, rows, 3 * block, generator=gen, dtype=torch.float64) * magnitude).to(dtype)
        values = torch.randn(*lead, 3 * block, dim, generator=gen, dtype=torch.float64).to(dtype)
        first = (0,) * len(lead)
        scores[first + (0, block + 1)] = float("-inf")  # a masked key
        scores[first + (rows - 1, slice(2 * block, 3 * block))] = float("-inf")  # a whole block masked for one row
        scores[first + (0, slice(0, block))] = float("-inf")  # row 0 sees nothing in the first block, then keys
        if rows >= 3:
            scores[first + (1,)] = float("-inf")  # row 1 sees no key at all
        scores, values = scores.to(dev), values.to(dev)
        state = (torch.full((*lead, rows), float("-inf"), dtype=dtype, device=dev),
                 torch.zeros(*lead, rows, dtype=dtype, device=dev), torch.zeros(*lead, rows, dim, dtype=dtype, device=dev))
        tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
        peak = scores[torch.isfinite(scores)].abs().max().item()
        for b in range(3):
            cols = slice(b * block, (b + 1) * block)
            shape = lambda *tail: "[" + ", ".join(str(n) for n in (*lead, *tail)) + "]"  # noqa: E731
            tried = (f"online_softmax_update(state after {b} block(s), scores {shape(rows, block)} in {dtype}"
                     f"{' on ' + str(dev) if dev != 'cpu' else ''} (|scores| up to {peak:.0f}"
                     f"{', every key of row 0 -inf' if b == 0 else ', one -inf' if b == 1 else ', every key of the last row -inf'}"
                     f"{', every key of row 1 -inf' if rows >= 3 else ''}), "
                     f"values {shape(block, dim)})")
            got = call_on_copies(fn, tried, *state, scores[..., cols], values[..., cols, :],
                                 mutation_hint="return new tensors: updating the state passed in (acc.mul_(...), "
                                               "running_sum += ...) changes the caller's copy, which FlashAttention "
                                               "may still need")
            got = results(got, names, tried)
            expected = _attention.online_softmax_update(*state, scores[..., cols], values[..., cols, :])
            for name, g in zip(names, got):
                expect_device(g, dev, name, tried)
            broken = [~torch.isfinite(g) for g in got[1:] if isinstance(g, torch.Tensor)]
            if any(b.any() for b in broken):
                nothing_seen = torch.isneginf(expected[0]).cpu()  # rows with no visible key so far
                bad_sum = broken[0].cpu()
                if bad_sum.shape == nothing_seen.shape and bad_sum.any() and (bad_sum <= nothing_seen).all():
                    fail(tried, "NaN in the rows that have seen only masked keys (running max -inf, block max -inf)",
                         "such a row keeps the state (-inf, 0, 0)",
                         "exp(-inf - (-inf)) is NaN: where the new max is -inf, shift the exponents by 0 instead "
                         "(torch.where(new_max == -inf, 0, new_max)), so both exp terms are exp(-inf) = 0")
                if len(broken) == 2 and not bad_sum.any() and broken[1].any():
                    fail(tried, "a finite new_sum but inf or NaN in new_acc", "finite values",
                         "acc is the UNnormalised sum of exp(score - max) * value: divide by the sum only once, after "
                         "the last block (a row that has seen no key has sum 0)")
                fail(tried, "inf or NaN", "finite values",
                     f"exponentiate scores minus the running max: these scores reach {peak:.0f}, and exp overflows "
                     "beyond ~709.8 in float64 (~88.7 in float32); every shifted exponent must be <= 0")
            for name, g, e, hint in zip(names, got, expected, hints):
                assert_close(g, e, f"{tried} -> {name}", hint, **tol)
            state = expected
        seen = state[1] > 0  # the row that sees no key has no softmax: its state stays (-inf, 0, 0)
        final = state[2][seen] / state[1][seen][..., None]
        assert_close(final, (torch.softmax(scores, dim=-1) @ values)[seen], "acc / sum after all blocks", "", **tol)
    passed("online_softmax_update", "three blocks folded for [B] and [B, H] leading shapes in fp64/fp32, masked keys, "
                                    "a fully masked first block, a row masked everywhere (state stays (-inf, 0, 0)), "
                                    "300-key blocks, scores up to ~1200 without overflow")


class _LargestIntermediate(TorchFunctionMode):
    """Records the largest number of elements any torch function or tensor method returned while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _reference_attention(q, k, v, causal: bool, scale: float):
    """fp64 attention with the bottom-right causal mask, and the log-sum-exp of each query's scores."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = q.double() @ k.transpose(-2, -1) * scale
    if causal:
        scores = scores.masked_fill(~_nn.causal_mask(q.shape[-2], k.shape[-2], device=q.device), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def flash_attention_torch(fn) -> None:
    """Grade ``fn(q, k, v, causal, block_q, block_k, scale) -> (out, lse)``, FlashAttention-2's forward in torch tiles:
    q ``[B, Hq, Nq, D]``, k and v ``[B, Hkv, Nk, D]`` (query head ``h`` reads K/V head ``h // (Hq/Hkv)``), the causal
    mask bottom-right aligned, ``out`` in q's dtype and ``lse`` (the log-sum-exp of each query's scaled scores) in
    fp32. Tries lengths that are not multiples of the blocks, causal with ``Nq < Nk``, ``Nq > Nk`` without a mask,
    GQA and MQA, scores in the hundreds, fp16/bf16, an explicit ``scale``, blocks larger than the sequence, 300 keys
    (where no operation may build the whole ``Nq x Nk`` score matrix) and 8 query heads on one K/V head (where K/V
    must be read in place, not copied per query head), the other device when there is one; twice, on copies."""
    gen = torch.Generator().manual_seed(11)
    device = other_device(None)
    # (B, Hq, Hkv, Nq, Nk, D, causal, block_q, block_k, magnitude, dtype, scale, device)
    specs = [(1, 2, 2, 40, 40, 16, False, 16, 16, 1.0, torch.float32, None, "cpu"),
             (2, 2, 2, 70, 70, 8, True, 32, 16, 1.0, torch.float32, None, "cpu"),
             (1, 2, 2, 5, 77, 16, True, 16, 32, 1.0, torch.float32, None, "cpu"),
             (1, 2, 2, 50, 20, 8, False, 16, 16, 1.0, torch.float32, None, "cpu"),
             (1, 4, 2, 33, 65, 16, True, 16, 16, 1.0, torch.float32, None, "cpu"),
             (2, 4, 1, 17, 17, 8, True, 8, 8, 1.0, torch.float32, None, "cpu"),
             (1, 2, 2, 48, 48, 16, True, 16, 16, 12.0, torch.float32, None, "cpu"),
             (1, 2, 2, 36, 36, 16, False, 16, 16, 1.0, torch.float32, 0.3, "cpu"),
             (1, 2, 1, 20, 20, 16, True, 128, 128, 1.0, torch.float16, None, "cpu"),
             (1, 2, 2, 24, 40, 16, True, 16, 16, 1.0, torch.bfloat16, None, "cpu"),
             (1, 2, 2, 300, 300, 16, True, 64, 64, 1.0, torch.float32, None, "cpu"),
             (1, 8, 1, 64, 256, 8, True, 16, 16, 1.0, torch.float32, None, "cpu")]
    if device is not None:
        specs.append((1, 4, 2, 65, 129, 32, True, 32, 32, 1.0, torch.float16, None, device))
    names = ("out", "lse")
    for batch, hq, hkv, nq, nk, dim, causal, block_q, block_k, magnitude, dtype, scale, dev in specs:
        q = (torch.randn(batch, hq, nq, dim, generator=gen) * magnitude).to(dtype).to(dev)
        k = (torch.randn(batch, hkv, nk, dim, generator=gen) * magnitude).to(dtype).to(dev)
        v = torch.randn(batch, hkv, nk, dim, generator=gen).to(dtype).to(dev)
        tried = (f"flash_attention_torch(q [{batch}, {hq}, {nq}, {dim}], k/v [{batch}, {hkv}, {nk}, {dim}] in {dtype}"
                 f"{' on ' + str(dev) if dev != 'cpu' else ''}, causal={causal}, block_q={block_q}, block_k={block_k}, "
                 f"scale={scale}{f', |q|, |k| ~{magnitude:g}' if magnitude != 1 else ''})")
        meter = _LargestIntermediate()
        with meter:
            out, lse = call_twice(fn, tried, (q, k, v, causal, block_q, block_k, scale), names)
        expected_out, expected_lse = _reference_attention(q, k, v, causal, 1 / dim**0.5 if scale is None else scale)
        for name, got in (("out", out), ("lse", lse)):
            expect_device(got, dev, name, tried)
        expect_dtype(out, dtype, "out", tried, "return out in q's dtype (compute in fp32, cast at the end)")
        expect_dtype(lse, torch.float32, "lse", tried, "keep lse in fp32: the backward recomputes P = exp(S - lse) from it")
        if lse.shape != expected_lse.shape:
            fail(tried, f"lse of shape {tuple(lse.shape)}", f"shape {tuple(expected_lse.shape)}", "one log-sum-exp per query row")
        loose = dtype in (torch.float16, torch.bfloat16)
        tol = dict(rtol=2e-2, atol=2e-2) if loose else dict(rtol=1e-4, atol=1e-4)
        hint = ("query i sees keys j <= i + Nk - Nq (bottom-right); rescale acc AND the running sum by "
                "exp(old max - new max) whenever the max grows; query head h reads K/V head h // (Hq // Hkv) "
                "(consecutive query heads share a K/V head: k.repeat would pair them wrongly); multiply the scores "
                "by `scale` when it is given")
        assert_close(out.float().cpu(), expected_out.to(torch.float32).cpu(), f"{tried} -> out", hint, **tol)
        assert_close(lse.cpu(), expected_lse.to(torch.float32).cpu(), f"{tried} -> lse",
                     "lse = running max + log(running sum): the log of the softmax denominator of the scaled scores, "
                     "max included", **(dict(rtol=1e-2, atol=1e-2) if loose else dict(rtol=1e-4, atol=1e-4)))
        limit = 3 * max(q.numel(), k.numel(), batch * hq * block_q * block_k) // 2
        if nq * nk > 4 * max(nq, nk) * dim and meter.largest > limit:
            copied = batch * hq * nq * nk > meter.largest >= k.numel() * (hq // hkv) > limit
            fail(tried, f"an intermediate tensor of {meter.largest:,} elements", f"none above ~{limit:,} (the inputs or "
                 f"one {block_q} x {block_k} tile of scores per head)",
                 "K/V copied for every query head (repeat_interleave) throws away what GQA saves: view q as "
                 "[B, Hkv, Hq // Hkv, Nq, D] (q.unflatten(1, ...)) and let each K/V tile [B, Hkv, 1, keys, D] broadcast"
                 if copied else
                 "compute scores one block_q x block_k tile at a time; the point of FlashAttention is never to hold the "
                 "Nq x Nk matrix")
    passed("flash_attention_torch", "ragged lengths, causal Nq < Nk (bottom-right), Nq > Nk unmasked, GQA and MQA with "
                                    "K/V read in place, large scores, fp16/bf16, explicit scale, blocks longer than the "
                                    "sequence, no full score matrix")


# (what, B, Hq, Hkv, Nq, Nk, D, causal, |q|,|k| scale, dtype, scale, BLOCK_M, BLOCK_N, query blocks launched
#  (None: all), and the hint for what this case adds)
_KERNEL_CASES = [
    ("one query block, keys in 3 blocks with a ragged tail (Nk = 40, BLOCK_N = 16)", 1, 2, 2, 16, 40, 16, False, 1.0,
     torch.float32, None, 16, 16, None,
     "keys offs_n >= seq_k are padding: load K and V with mask=(offs_n < seq_k) and other=0.0, and give their "
     "scores -inf with tl.where (a score of 0 would still get weight exp(0 - m))"),
    ("causal, Nq = Nk = 40 (3 query blocks, the last ragged)", 1, 2, 2, 40, 40, 16, True, 1.0, torch.float32, None,
     16, 16, None,
     "when CAUSAL, query row i sees key j only if j <= i + (seq_k - seq_q); store only the rows < seq_q"),
    ("causal, Nq = 5 < Nk = 45 (decoding after a cache: bottom-right)", 1, 2, 2, 5, 45, 16, True, 1.0, torch.float32,
     None, 16, 16, None,
     "the causal mask is bottom-right aligned: the queries are the LAST seq_q positions, so row i sees keys "
     "j <= i + seq_k - seq_q, and the key loop runs to min(seq_k, (pid_m + 1) * BLOCK_M + seq_k - seq_q)"),
    ("causal, Nq = 36 > Nk = 20 (rows 0..15 see no key; block 0's first key block is fully masked for them)",
     1, 2, 2, 36, 20, 16, True, 1.0, torch.float32, None, 32, 16, None,
     "a row whose keys so far are all masked has m = -inf and a block max -inf: exp2(-inf - (-inf)) is NaN, so "
     "shift by 0 where the new max is -inf (m_safe = tl.where(m_new == float('-inf'), 0.0, m_new)); a row that "
     "sees no key at all ends with l = 0: store out = 0 (divide by 1 where l == 0) and lse = -inf"),
    ("GQA (Hq = 4, Hkv = 2), causal, D = 24 in a 32-lane tile, explicit scale 0.3", 1, 4, 2, 33, 33, 24, True, 1.0,
     torch.float32, 0.3, 16, 16, None,
     "query head h reads K/V head h // group_size; the lanes d >= head_dim are padding (mask them in every load "
     "and the store); multiply the scores by sm_scale as given"),
    ("MQA (Hkv = 1), batch 2, no mask, Nq = 20 < Nk = 24", 2, 4, 1, 20, 24, 16, False, 1.0, torch.float32, None,
     16, 16, None,
     "every head of batch b starts at b * stride_qb + h * stride_qh (and K/V at b * stride_kb + (h // group_size) * "
     "stride_kh): program_id(1) is b * num_heads + h"),
    ("large scores (|q|, |k| ~ 8: scores in the hundreds)", 1, 2, 2, 16, 48, 32, False, 8.0, torch.float32, None,
     16, 16, None,
     "subtract the running max before tl.exp2 so that no exponent is positive, and rescale l and acc by "
     "exp2(m_old - m_new) when the max grows"),
    ("fp16, causal, BLOCK_M = 32 != BLOCK_N = 16", 1, 2, 1, 48, 48, 32, True, 1.0, torch.float16, None, 32, 16, None,
     "accumulate in fp32 (tl.zeros(..., dtype=tl.float32)) and cast only the stored output to Out's dtype "
     "(out.to(Out.dtype.element_ty))"),
    ("the causal loop bound: only query block 0 launched (Nq = 48, Nk = 64), keys from 32 on hold NaN", 1, 2, 2, 48,
     64, 16, True, 1.0, torch.float32, None, 16, 16, 1,
     "a causal program must stop its key loop at min(seq_k, (pid_m + 1) * BLOCK_M + seq_k - seq_q): the keys "
     "after that are masked for every one of its rows, and reading them is the work the causal mask saves (here "
     "they hold NaN, and 0 * NaN = NaN in p @ v)"),
]

_KERNEL_HINT = ("program (pid_m, b * num_heads + h) owns query rows pid_m * BLOCK_M + tl.arange(0, BLOCK_M); load the "
                "q tile once, then for each block of BLOCK_N keys: s = tl.dot(q, tl.trans(k)) * sm_scale * log2(e), "
                "-inf where masked, m_new = max(m, row max of s), alpha = exp2(m - m_new), p = exp2(s - m_new), "
                "l = l * alpha + row sum of p, acc = acc * alpha + p @ v (both rescaled whenever the max grows); finally out = acc / l and "
                "lse = (m + log2 l) * ln 2")
_SENTINEL = 1234.5  # in Out's and LSE's padding: a store without its mask overwrites it


def _padded(values: torch.Tensor, rows: int, lanes: int, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, view)``: ``values`` ``[B, H, N, D]`` inside a ``[B, H, N + rows, D + lanes]`` buffer of
    ``fill``, so that each head's rows and each row's lanes are followed by ``fill`` (strides != shape)."""
    b, h, n, d = values.shape
    buffer = torch.full((b, h, n + rows, d + lanes), fill, dtype=values.dtype, device=values.device)
    view = buffer[:, :, :n, :d]
    view.copy_(values)
    return buffer, view


def _kernel_reference(q, k, v, causal: bool, scale: float):
    """fp64 ``(out, lse)``; a row that sees no key has out 0 and lse -inf (the kernel's contract)."""
    out, lse = _reference_attention(q, k, v, causal, scale)
    return torch.where(torch.isneginf(lse)[..., None], 0.0, out), lse


def flash_attention_kernel(kernel) -> None:
    """Grade a ``@triton.jit`` FlashAttention-2 forward ``kernel(Q, K, V, Out, LSE, stride_qb, stride_qh,
    stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    num_heads, group_size, seq_q, seq_k, head_dim, sm_scale, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D)``, launched by
    :func:`labkit.kernels.flash_attention.launch_forward_kernel` on a grid ``(query blocks, B * Hq)``: ragged
    ``Nq``/``Nk``, causal (bottom-right) with ``Nq = Nk``, ``Nq < Nk`` and ``Nq > Nk`` (rows that see no key:
    out 0, lse -inf; a fully masked first key block), GQA and MQA, batch 2, ``D = 24`` in a 32-lane tile, an
    explicit scale, scores in the hundreds, fp16, ``BLOCK_M != BLOCK_N``; NaN after every row and lane of q, k, v
    (an unmasked load reads it), a sentinel after every row and lane of Out and LSE (an unmasked store
    overwrites it), and NaN in the keys a causal program must not read (only its query block launched).
    ``out`` and ``lse`` against fp64 torch."""
    device = kernel_device("flash_attention_kernel")
    if device is None:
        return
    expect_jit_kernel(kernel, "flash_attention_kernel")
    from labkit.kernels.flash_attention import launch_forward_kernel

    gen = torch.Generator().manual_seed(17)
    for (what, batch, hq, hkv, nq, nk, dim, causal, magnitude, dtype, scale, block_m, block_n, query_blocks,
         case_hint) in _KERNEL_CASES:
        q = (torch.randn(batch, hq, nq, dim, generator=gen) * magnitude).to(dtype).to(device)
        k = (torch.randn(batch, hkv, nk, dim, generator=gen) * magnitude).to(dtype).to(device)
        v = torch.randn(batch, hkv, nk, dim, generator=gen).to(dtype).to(device)
        sm_scale = 1 / dim**0.5 if scale is None else scale
        expected_out, expected_lse = _kernel_reference(q, k, v, causal, sm_scale)
        rows = nq if query_blocks is None else min(nq, query_blocks * block_m)
        if query_blocks is not None:  # keys no launched row can see hold NaN
            last = min(nk, query_blocks * block_m + nk - nq)
            k[:, :, last:], v[:, :, last:] = float("nan"), float("nan")
        (q_buf, q_in), (k_buf, k_in), (v_buf, v_in) = (_padded(t, 16, 8, float("nan")) for t in (q, k, v))
        out_buf, out = _padded(torch.full_like(q, _SENTINEL), 16, 8, _SENTINEL)
        lse_buf = torch.full((batch * hq * nq + 64,), _SENTINEL, dtype=torch.float32, device=device)
        lse = lse_buf[:batch * hq * nq].view(batch, hq, nq)
        before = [t.clone() for t in (q_buf, k_buf, v_buf)]
        tried = (f"flash_attention_kernel: {what}; q [{batch}, {hq}, {nq}, {dim}], k/v [{batch}, {hkv}, {nk}, {dim}] "
                 f"{str(dtype).removeprefix('torch.')}, causal={causal}, sm_scale={sm_scale:.4g}, BLOCK_M={block_m}, "
                 f"BLOCK_N={block_n}")
        call_kernel(launch_forward_kernel, tried, kernel, q_in, k_in, v_in, out, lse, causal, sm_scale, block_m,
                    block_n, query_blocks,
                    hint="the grader launches kernel[grid](Q, K, V, Out, LSE, 12 strides, num_heads, group_size, "
                         "seq_q, seq_k, head_dim, sm_scale, CAUSAL=..., BLOCK_M=..., BLOCK_N=..., BLOCK_D=...) through "
                         "labkit.kernels.flash_attention.launch_forward_kernel: keep that signature, and run the "
                         "launch yourself to read the traceback")
        if any(not same_values(b, a) for b, a in zip(before, (q_buf, k_buf, v_buf))):
            fail(tried, "q, k or v changed by the kernel", "the inputs left as they were",
                 "store only through Out and LSE")
        outside = torch.ones_like(out_buf, dtype=torch.bool)
        outside[:, :, :nq, :dim] = False
        if not (out_buf[outside] == _SENTINEL).all() or not (lse_buf[batch * hq * nq:] == _SENTINEL).all():
            fail(tried, "values written past the last query row or past head_dim (Out's padding, or after LSE)",
                 "only rows < seq_q and lanes < head_dim written",
                 "the last query block and the BLOCK_D lanes are padded: store with mask=(offs_m < seq_q)[:, None] & "
                 "(offs_d < head_dim)[None, :] for the output and mask=offs_m < seq_q for the lse")
        got_out, got_lse = out[:, :, :rows].float().cpu(), lse[:, :, :rows].cpu()
        want_out, want_lse = expected_out[:, :, :rows].float().cpu(), expected_lse[:, :, :rows].float().cpu()
        if (got_out == _SENTINEL).all(-1).any() or (got_lse == _SENTINEL).any():
            fail(tried, "rows of Out or LSE never written", "every row < seq_q written",
                 "each program stores its BLOCK_M rows of out and lse, including rows that see no key (out 0, "
                 "lse -inf); program_id(1) is b * num_heads + h, so batch b's rows start at b * stride_ob (and its "
                 "inputs at b * stride_qb, b * stride_kb)")
        if torch.isnan(got_out).any() or torch.isnan(got_lse).any():
            if query_blocks is None and not torch.isneginf(want_lse).any():
                hint = ("NaN lies after the last key and after head_dim in every row of q, k and v: load with "
                        "mask=(offs_n < seq_k)[:, None] & (offs_d < head_dim)[None, :] and other=0.0 (and the q tile "
                        "with offs_d < head_dim); query head h reads K/V head h // group_size (a head index past "
                        "Hkv reads outside K and V)")
            else:
                hint = case_hint
            fail(tried, "NaN in out or lse", "finite out (0 for a row that sees no key) and lse (-inf there)", hint)
        loose = dtype != torch.float32 or device != "cpu"  # fp16 tiles; tf32 products on a GPU
        tol = dict(rtol=2e-2, atol=2e-2) if loose else dict(rtol=1e-4, atol=1e-4)
        assert_close(got_out, want_out, f"{tried} -> out", f"{case_hint}. In full: {_KERNEL_HINT}", **tol)
        assert_close(got_lse, want_lse, f"{tried} -> lse",
                     "out is right but lse is not: lse is the natural log of the softmax denominator, max included: "
                     "with base-2 scores (times log2 e), lse = (m + tl.log2(l)) * ln 2; with natural-log scores, "
                     "m + tl.log(l)", **tol)
    passed("flash_attention_kernel", f"your kernel matches fp64 torch on {len(_KERNEL_CASES)} launches: ragged Nq/Nk, "
                                     "causal with Nq = Nk, Nq < Nk and Nq > Nk (rows with no key: out 0, lse -inf), "
                                     "GQA/MQA, batch 2, D = 24 in 32 lanes, explicit scale, large scores, fp16; masked "
                                     "loads (NaN past every row) and stores, and the causal loop bound (NaN past it)")
