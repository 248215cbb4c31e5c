"""Graders for chapter 03 (attention and the KV cache)."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from labkit import attention as _attention
from labkit import nn as _nn
from labkit.checks._core import (as_tensor, assert_close, call, call_kernel, call_on_copies, call_twice, expect_device, expect_dtype,
                                 expect_jit_kernel, fail, kernel_device, other_device, passed, results)
from labkit.model import PRESETS, ModelConfig

__all__ = ["causal_mask", "flash_attention_torch", "flash_attention_triton", "kv_bytes_per_token", "online_softmax_update"]


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
    blocks of up to 300 keys, masked keys, a later block with every key of a row masked, scores
    up to about ±1200 (exp overflows float64 beyond ~709.8), on CUDA when there is one; the state
    passed in must not change."""
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
                     f"{', one -inf' if b == 1 else ', every key of the last row -inf' if b == 2 else ''}), "
                     f"values {shape(block, dim)})")
            got = call_on_copies(fn, tried, *state, scores[..., cols], values[..., cols, :],
                                 mutation_hint="return new tensors: updating the state passed in (acc.mul_(...), "
                                               "running_sum += ...) changes the caller's copy, which FlashAttention "
                                               "may still need")
            got = results(got, names, tried)
            expected = _attention.online_softmax_update(*state, scores[..., cols], values[..., cols, :])
            for name, g in zip(names, got):
                expect_device(g, dev, name, tried)
            if any(not torch.isfinite(g).all() for g in got[1:]):
                fail(tried, "inf or NaN", "finite values",
                     f"exponentiate scores minus the running max: these scores reach {peak:.0f}, and exp overflows "
                     "beyond ~709.8 in float64 (~88.7 in float32); every shifted exponent must be <= 0")
            for name, g, e, hint in zip(names, got, expected, hints):
                assert_close(g, e, f"{tried} -> {name}", hint, **tol)
            state = expected
        final = state[2] / state[1][..., None]
        assert_close(final, torch.softmax(scores, dim=-1) @ values, "acc / sum after all blocks", "", **tol)
    passed("online_softmax_update", "three blocks folded for [B] and [B, H] leading shapes in fp64/fp32, masked keys "
                                    "and blocks, 300-key blocks, scores up to ~1200 without overflow")


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
    fp32. Tries lengths that are not multiples of the blocks, ``Nq < Nk`` and ``Nq > Nk``, GQA and MQA, scores in
    the hundreds, fp16/bf16, an explicit ``scale``, blocks larger than the sequence, 300 keys (where no operation may
    build the whole ``Nq x Nk`` score matrix), the other device when there is one; twice, on copies."""
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
             (1, 2, 2, 300, 300, 16, True, 64, 64, 1.0, torch.float32, None, "cpu")]
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
                "(repeat_interleave, not repeat); multiply the scores by `scale` when it is given")
        assert_close(out.float().cpu(), expected_out.to(torch.float32).cpu(), f"{tried} -> out", hint, **tol)
        assert_close(lse.cpu(), expected_lse.to(torch.float32).cpu(), f"{tried} -> lse",
                     "lse = running max + log(running sum): the log of the softmax denominator of the scaled scores, "
                     "max included", **(dict(rtol=1e-2, atol=1e-2) if loose else dict(rtol=1e-4, atol=1e-4)))
        limit = 2 * max(q.numel(), k.numel() * (hq // hkv), batch * hq * block_q * block_k)
        if nq * nk > 4 * max(nq, nk) * dim and meter.largest > limit:
            fail(tried, f"an intermediate tensor of {meter.largest:,} elements", f"none above ~{limit:,} (the inputs or "
                 f"one {block_q} x {block_k} tile of scores per head)",
                 "compute scores one block_q x block_k tile at a time; the point of FlashAttention is never to hold the "
                 "Nq x Nk matrix")
    passed("flash_attention_torch", "ragged lengths, Nq < Nk and Nq > Nk with the bottom-right mask, GQA and MQA, large "
                                    "scores, fp16/bf16, explicit scale, blocks longer than the sequence, no full score matrix")


# (what, B, Hq, Hkv, Nq, Nk, D, causal, |q|,|k| scale, dtype, scale, what this case adds and the hint for it)
_TRITON_CASES = [
    ("one key block", 1, 2, 2, 64, 64, 16, False, 1.0, torch.float32, None,
     "multiply the scores by sm_scale * log2(e) = sm_scale * 1.4426950408889634 and exponentiate with tl.exp2 "
     "(2**(x * log2 e) = e**x); use sm_scale as it is given (1/sqrt(D) or the caller's scale)"),
    ("three full key blocks", 1, 2, 2, 64, 192, 16, False, 2.0, torch.float32, None,
     "when a block raises the running max, rescale what was summed so far: alpha = tl.exp2(m_i - m_new), "
     "l_i = l_i * alpha + sum(p), acc = acc * alpha[:, None] + p @ v; and return the new max"),
    ("a ragged last key block (Nk = 150: keys 150..191 are zero padding)", 1, 2, 2, 40, 150, 16, False, 1.0,
     torch.float32, None,
     "in a MASKED block, keys offs_n >= seq_k are padding (loaded as zeros, score 0, not -inf): set their scores "
     "to -inf with tl.where before the max"),
    ("causal, Nq = Nk", 1, 2, 2, 100, 100, 16, True, 1.0, torch.float32, None,
     "when CAUSAL, query offs_m[i] sees key offs_n[j] only if offs_n[j] <= offs_m[i] + causal_offset; "
     "the other scores of a MASKED block get -inf"),
    ("causal with fewer queries than keys (Nq = 20, Nk = 150)", 1, 2, 2, 20, 150, 16, True, 1.0, torch.float32, None,
     "the causal mask is bottom-right aligned: the queries are the LAST Nq positions, so query i sees keys "
     "j <= i + causal_offset with causal_offset = Nk - Nq (top-left j <= i would hide most keys)"),
    ("more queries than keys, MQA (Hkv = 1), D = 64", 1, 4, 1, 130, 40, 64, False, 1.0, torch.float32, None,
     "nothing new in the update: the same masks and rescaling for any Nq, Nk"),
    ("GQA (Hq = 2 Hkv), causal, D = 24 (a 32-lane block), explicit scale 0.3", 2, 4, 2, 70, 90, 24, True, 1.0,
     torch.float32, 0.3,
     "use sm_scale, not a scale of your own: it is the caller's scale here, and the head dimension is 24 while the "
     "tiles are 32 wide"),
    ("large scores (|q|, |k| ~ 4: scores in the tens)", 1, 2, 2, 64, 150, 32, True, 4.0, torch.float32, None,
     "subtract the running max before tl.exp2 (p = tl.exp2(s - m_new[:, None])) so no exponent is positive"),
    ("fp16 inputs", 1, 2, 1, 50, 120, 32, True, 1.0, torch.float16, None,
     "cast p to v's dtype for the second tl.dot (p.to(v.dtype)); on a GPU the tiles stay 16-bit"),
    ("bf16 inputs", 1, 2, 2, 33, 77, 16, False, 1.0, torch.bfloat16, None,
     "cast p to v's dtype for the second tl.dot (p.to(v.dtype)); on a GPU the tiles stay 16-bit"),
]

_UPDATE_HINT = ("s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * (sm_scale * log2 e); if MASKED: "
                "-inf where offs_n >= seq_k or (CAUSAL) offs_n > offs_m + causal_offset; m_new = max(m_i, row max of "
                "s); alpha = exp2(m_i - m_new); p = exp2(s - m_new); l_i = l_i * alpha + row sum of p; acc = acc * "
                "alpha + p @ v; return (acc, m_new, l_i)")


def flash_attention_triton(block_update) -> None:
    """Grade a ``@triton.jit`` ``block_update(acc, m_i, l_i, q, k, v, offs_m, offs_n, seq_k, causal_offset,
    sm_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr) -> (acc, m_i, l_i)``,
    the per-key-block step of FlashAttention-2's forward, run inside labkit's kernel (its loop, loads, final
    ``acc / l_i`` and ``lse = (m_i + log2 l_i) * ln 2``): one block, several blocks, a ragged last block, causal
    with ``Nq = Nk`` and ``Nq < Nk`` (bottom-right), ``Nq > Nk``, GQA and MQA, head dims 16/24/32/64, an explicit
    scale, large scores, fp16/bf16; ``out`` and ``lse`` against fp64 torch (``torch.logsumexp``)."""
    device = kernel_device("flash_attention_triton")
    if device is None:
        return
    expect_jit_kernel(block_update, "block_update")
    from labkit.kernels.flash_attention import _forward

    gen = torch.Generator().manual_seed(13)
    for what, batch, hq, hkv, nq, nk, dim, causal, magnitude, dtype, scale, case_hint in _TRITON_CASES:
        q = (torch.randn(batch, hq, nq, dim, generator=gen) * magnitude).to(dtype).to(device)
        k = (torch.randn(batch, hkv, nk, dim, generator=gen) * magnitude).to(dtype).to(device)
        v = torch.randn(batch, hkv, nk, dim, generator=gen).to(dtype).to(device)
        sm_scale = 1 / dim**0.5 if scale is None else scale
        tried = (f"labkit's FlashAttention forward with your block_update: {what}; q [{batch}, {hq}, {nq}, {dim}], "
                 f"k/v [{batch}, {hkv}, {nk}, {dim}] {str(dtype).removeprefix('torch.')}, causal={causal}, "
                 f"sm_scale={sm_scale:.4g}")
        out, lse = call_kernel(_forward, tried, q, k, v, causal, sm_scale, block_update,
                               hint="it must return a tuple (acc, m_i, l_i) with the shapes it was given; run "
                                    "labkit.kernels.flash_attention._forward(q, k, v, causal, scale, block_update) "
                                    "yourself and read the traceback")
        expected_out, expected_lse = _reference_attention(q, k, v, causal, sm_scale)
        for name, got in (("out", out), ("lse", lse)):
            if not torch.isfinite(got).all():
                fail(f"{tried} -> {name}", f"inf or NaN in {name}", "finite values",
                     "return (acc, m_new, l_i): the new running max, not the old one (m_i starts at -inf), and "
                     "subtract it before tl.exp2 so no exponent is positive")
        loose = dtype != torch.float32
        tol = dict(rtol=2e-2, atol=2e-2) if loose else dict(rtol=1e-4, atol=1e-4)
        assert_close(out.float().cpu(), expected_out.float().cpu(), f"{tried} -> out", f"{case_hint}. In full: {_UPDATE_HINT}",
                     **tol)
        assert_close(lse.cpu(), expected_lse.float().cpu(), f"{tried} -> lse",
                     "out is right but lse is not: keep m_i in base-2 units (scores times sm_scale * log2 e, "
                     "tl.exp2, not tl.exp), since the kernel stores lse = (m_i + log2(l_i)) * ln 2, and return the "
                     "new max m_new as m_i", **tol)
    passed("flash_attention_triton", f"your update inside labkit's kernel matches torch on {len(_TRITON_CASES)} cases: "
                                     "one and several key blocks, a ragged tail, causal (bottom-right, Nq < Nk), "
                                     "Nq > Nk, GQA and MQA, D = 16..64, an explicit scale, large scores, fp16/bf16; "
                                     "out and lse")
