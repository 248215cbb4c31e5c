"""Graders for chapter 00: ``get_batch`` and ``cross_entropy``."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from labkit.checks._core import as_tensor, assert_close, call, fail, passed

__all__ = ["get_batch", "cross_entropy"]


def get_batch(fn) -> None:
    """Grade ``fn(dataset, batch_size, context_length, device) -> (x, y)``."""
    # Token i of this dataset is 7*i + 3, so every value tells where in the dataset it came from.
    for n, batch_size, context_length in [(50, 4, 8), (300, 16, 1), (12, 3, 11)]:
        dataset = np.arange(n, dtype=np.int64) * 7 + 3
        tried = f"fn(dataset of {n} tokens, batch_size={batch_size}, context_length={context_length}, device='cpu')"
        hint = ("with len(dataset) == context_length + 1 there is exactly one window, starting at 0: "
                "the last valid start is len(dataset) - context_length - 1")
        out = call(fn, tried, dataset, batch_size, context_length, "cpu", hint=hint)
        if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
            fail(tried, type(out).__name__, "a tuple (x, y) of two tensors", "return x, y")
        x, y = out
        for name, t in (("x", x), ("y", y)):
            if t.shape != (batch_size, context_length):
                fail(tried, f"{name}.shape {tuple(t.shape)}", f"({batch_size}, {context_length})", "one row per sequence, context_length tokens each")
            if t.dtype != torch.long:
                fail(tried, f"{name}.dtype {t.dtype}", "torch.int64", "token ids index an embedding table: convert with torch.from_numpy(...).long()")
            if t.device.type != "cpu":
                fail(tried, f"{name} on {t.device}", "on cpu", "move the batch to the requested device")
        pos_x, pos_y = (x - 3) // 7, (y - 3) // 7
        if not torch.equal(pos_x[:, 1:], pos_x[:, :-1] + 1):
            fail(tried, f"x[0] = {x[0].tolist()}", "consecutive tokens of the dataset in each row", "take a contiguous slice dataset[start : start + context_length]")
        if torch.equal(pos_y, pos_x):
            fail(tried, "y == x", "y shifted by one token: y[:, t] = dataset[start + t + 1]", "y holds the *next* token for every position of x")
        if not torch.equal(pos_y, pos_x + 1):
            fail(tried, f"x[0] = {x[0].tolist()}, y[0] = {y[0].tolist()}", "y[:, t] = dataset[start + t + 1]", "slice y from start + 1 to start + context_length + 1")
    _check_uniform_starts(fn)
    passed("get_batch", "shapes, dtypes, the one-token shift and uniform start positions are right")


def _check_uniform_starts(fn) -> None:
    context_length, n = 4, 8  # valid starts: 0, 1, 2, 3 (the window and its target must fit)
    dataset = np.arange(n, dtype=np.int64)
    tried = f"fn(dataset of {n} tokens, batch_size=400, context_length={context_length}, 'cpu') repeatedly"
    counts = np.zeros(n, dtype=np.int64)
    for _ in range(5):
        x, _ = call(fn, tried, dataset, 400, context_length, "cpu")
        counts += np.bincount(x[:, 0].numpy(), minlength=n)[:n]
    valid = n - context_length
    seen = [int(s) for s in np.nonzero(counts)[0]]
    if seen != list(range(valid)):
        fail(tried, f"start positions {seen}", f"every start in 0..{valid - 1}",
             "the last valid start is len(dataset) - context_length - 1; torch.randint's upper bound is exclusive")
    expected = counts.sum() / valid
    if np.abs(counts[:valid] - expected).max() > 0.2 * expected:
        fail(tried, f"start counts {counts[:valid].tolist()}", f"about {expected:.0f} each", "draw every start position with equal probability")


def cross_entropy(fn) -> None:
    """Grade ``fn(logits, targets) -> scalar mean loss``."""
    gen = torch.Generator().manual_seed(0)
    cases = [((5, 11), 1.0), ((2, 3, 17), 3.0), ((1, 2), 1.0), ((4, 1000), 10.0)]
    for shape, scale in cases:
        logits = torch.randn(shape, generator=gen) * scale
        targets = torch.randint(0, shape[-1], shape[:-1], generator=gen)
        tried = f"fn(logits of shape {shape}, targets of shape {tuple(targets.shape)})"
        got = call(fn, tried, logits, targets)
        expected = F.cross_entropy(logits.reshape(-1, shape[-1]), targets.reshape(-1))
        _compare_loss(got, expected, tried)
    logits = torch.tensor([[1000.0, 0.0, -1000.0], [-50.0, 3000.0, 10.0]])
    targets = torch.tensor([0, 2])
    tried = "fn(logits with entries of +-1000 and 3000, targets [0, 2])"
    got = call(fn, tried, logits, targets)
    expected = F.cross_entropy(logits, targets)
    if not isinstance(got, torch.Tensor) or not torch.isfinite(got).all():
        fail(tried, got, f"{expected.item():.6g}", "exp(1000) overflows: subtract each row's max before exponentiating (log-sum-exp trick)")
    _compare_loss(got, expected, tried)
    passed("cross_entropy", "matches torch.nn.functional.cross_entropy, also for huge logits")


def _compare_loss(got, expected: torch.Tensor, tried: str) -> None:
    got = as_tensor(got, tried)
    if got.dim() != 0:
        fail(tried, f"a tensor of shape {tuple(got.shape)}", "a scalar (0-dim) tensor", "average the per-position losses with .mean()")
    ratio = got.item() / expected.item()
    if round(ratio) > 1 and abs(ratio - round(ratio)) < 1e-4:
        fail(tried, f"{got.item():.6g}", f"{expected.item():.6g}",
             f"that is {round(ratio)}x the mean: divide the summed loss by the number of positions")
    assert_close(got, expected, tried, "loss = logsumexp(logits) - logits[target], averaged over every position; "
                 "check which axis you reduce over", rtol=1e-4, atol=1e-5)
