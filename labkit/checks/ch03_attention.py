"""Graders for chapter 03 (attention and the KV cache)."""
from __future__ import annotations

import torch

from labkit import attention as _attention
from labkit import nn as _nn
from labkit.checks._core import as_tensor, assert_close, call, fail, passed
from labkit.model import PRESETS, ModelConfig

__all__ = ["causal_mask", "kv_bytes_per_token", "online_softmax_update"]


def causal_mask(fn) -> None:
    """Grade ``fn(num_queries, num_keys) -> bool [num_queries, num_keys]``, bottom-right aligned."""
    for num_q, num_k in [(4, 4), (1, 6), (3, 7), (6, 6), (2, 9), (1, 1)]:
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
        elif torch.equal(got, torch.ones(num_q, num_k, dtype=torch.bool).tril()):
            hint = ("this is top-left aligned; with fewer queries than keys the queries are the LAST "
                    "positions, so query i sees keys j <= i + num_keys - num_queries")
        elif torch.equal(got, torch.ones(num_q, num_k, dtype=torch.bool).tril(num_k - num_q - 1)):
            hint = "a token must be allowed to attend to itself: use <=, not <"
        else:
            hint = "query i may attend to keys j <= i + (num_keys - num_queries)"
        fail(tried, f"\n{got.int()}", f"\n{expected.int()}", hint)
    passed("causal_mask", "bottom-right aligned for square, decode (1 query) and Nq < Nk masks")


def kv_bytes_per_token(fn) -> None:
    """Grade ``fn(config: ModelConfig, dtype: torch.dtype) -> int``: KV-cache bytes per token."""
    custom = ModelConfig(vocab_size=1000, context_length=128, d_model=512, num_layers=6, num_heads=8, num_kv_heads=2,
                         head_dim=96, d_ff=1024)  # head_dim != d_model / num_heads on purpose
    cases = [("qwen3-8b", PRESETS["qwen3-8b"], torch.bfloat16), ("llama2-7b", PRESETS["llama2-7b"], torch.float16),
             ("gemma-2b", PRESETS["gemma-2b"], torch.float32), ("llama2-70b", PRESETS["llama2-70b"], torch.float8_e4m3fn),
             ("custom (head_dim=96, d_model=512, 8 heads, 2 KV heads)", custom, torch.bfloat16)]
    for name, config, dtype in cases:
        tried = f"kv_bytes_per_token({name}, {dtype})"
        got = call(fn, tried, config, dtype)
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if not isinstance(got, (int, float)):
            fail(tried, f"a {type(got).__name__}", "an int (bytes)", "return a plain number of bytes")
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
    passed("kv_bytes_per_token", "MHA, GQA and MQA models in fp32/fp16/bf16/fp8")


def online_softmax_update(fn) -> None:
    """Grade ``fn(running_max, running_sum, acc, scores, values) -> (new_max, new_sum, new_acc)``."""
    gen = torch.Generator().manual_seed(3)
    for rows, block, dim, magnitude in [(3, 4, 5, 1.0), (1, 7, 2, 3.0), (4, 5, 3, 400.0)]:
        scores = torch.randn(2, rows, 3 * block, generator=gen, dtype=torch.float64) * magnitude
        values = torch.randn(2, 3 * block, dim, generator=gen, dtype=torch.float64)
        scores[0, 0, block + 1] = float("-inf")  # a masked key
        state = (torch.full((2, rows), float("-inf"), dtype=torch.float64),
                 torch.zeros(2, rows, dtype=torch.float64), torch.zeros(2, rows, dim, dtype=torch.float64))
        for b in range(3):
            cols = slice(b * block, (b + 1) * block)
            tried = (f"online_softmax_update(state after {b} block(s), scores [2, {rows}, {block}] "
                     f"(|scores| ~ {magnitude}, one -inf), values [2, {block}, {dim}])")
            got = call(fn, tried, *(t.clone() for t in state), scores[..., cols], values[:, cols])
            if not isinstance(got, (tuple, list)) or len(got) != 3:
                fail(tried, type(got).__name__, "a tuple (new_max, new_sum, new_acc)", "return all three running quantities")
            expected = _attention.online_softmax_update(*state, scores[..., cols], values[:, cols])
            names = ("new_max", "new_sum", "new_acc")
            hints = ("the new max is max(running_max, max of this block's scores)",
                     "rescale the old sum by exp(running_max - new_max), then add sum(exp(scores - new_max))",
                     "rescale the old acc by exp(running_max - new_max), then add exp(scores - new_max) @ values")
            if magnitude > 100 and any(not torch.isfinite(as_tensor(g, tried)).all() for g in got[1:]):
                fail(tried, "inf or NaN", "finite values",
                     "exponentiate scores minus the running max (exp(400) overflows even in float64)")
            for name, g, e, hint in zip(names, got, expected, hints):
                assert_close(g, e, f"{tried} -> {name}", hint, rtol=1e-9, atol=1e-9)
            state = expected
        final = state[2] / state[1][..., None]
        assert_close(final, torch.softmax(scores, dim=-1) @ values, "acc / sum after all blocks", "", rtol=1e-9, atol=1e-9)
    passed("online_softmax_update", "three blocks folded, masked keys, scores up to 400 without overflow")
