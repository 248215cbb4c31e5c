"""Graders for chapter 00: ``get_batch`` and ``cross_entropy``.

``get_batch`` is tried on int64, int32 and uint16 token arrays (a uint16 ``np.memmap``, like a real
token file, with ids above 32767), on the CPU and on another device (CUDA when there is one, else
``"meta"``), called repeatedly (it must draw new windows each call) and checked for changing the
dataset. ``cross_entropy`` is tried on ranks 1 to 5, fp32/fp16/bf16 logits (fp16 logits in the
ten thousands), huge fp32 logits, on CUDA when there is one, must leave its inputs alone and must be
differentiable (the training loop calls ``.backward()`` on it).
"""
from __future__ import annotations

import os
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

from labkit.checks._core import (as_tensor, call, call_on_copies, expect_device, expect_differentiable, fail, other_device,
                                 passed, results)

__all__ = ["get_batch", "cross_entropy"]

_DATASET_HINT = ("the dataset may be any 1-D integer numpy array (int64, int32, or a uint16 np.memmap as token files "
                 "are): slice it, convert with torch.from_numpy(window.astype(np.int64)), and leave it unchanged")


def _get_batch_once(fn, dataset, base, batch_size, context_length, device, tried):
    hint = ("with len(dataset) == context_length + 1 there is exactly one window, starting at 0: "
            "the last valid start is len(dataset) - context_length - 1")
    out = call_on_copies(fn, tried, dataset, batch_size, context_length, device, hint=hint,
                         mutation_hint="leave the dataset unchanged: sample start positions, do not shuffle or "
                                       "overwrite the array (it may be a read-only token file)")
    if not isinstance(out, tuple):
        fail(tried, f"a {type(out).__name__}", "a tuple (x, y) of two tensors", "return x, y")
    x, y = results(out, ("x", "y"), tried)
    for name, t in (("x", x), ("y", y)):
        if tuple(t.shape) != (batch_size, context_length):
            fail(tried, f"{name}.shape {tuple(t.shape)}", f"({batch_size}, {context_length})",
                 "one row per sequence, context_length tokens each")
        if t.dtype != torch.long:
            fail(tried, f"{name}.dtype {t.dtype}", "torch.int64",
                 f"token ids index an embedding table and the loss's targets: convert to int64 whatever the dataset's "
                 f"dtype ({dataset.dtype} here), e.g. torch.from_numpy(window.astype(np.int64))")
        expect_device(t, device, name, tried, f"move the batch to the requested device ({device!r}): .to(device)")
    if torch.device(device).type == "meta":
        return None
    x, y = x.cpu(), y.cpu()
    n = len(dataset)
    for name, t in (("x", x), ("y", y)):
        pos = t - base
        if (pos % 7 != 0).any() or (pos < 0).any() or (pos >= 7 * n).any():
            bad = t[(pos % 7 != 0) | (pos < 0) | (pos >= 7 * n)][0].item()
            fail(tried, f"{name} holds the value {bad}, which is not in the dataset",
                 f"token ids from the dataset (here {base} + 7 * position)",
                 f"keep the ids as they are: a {dataset.dtype} id above 32767 overflows int16 (and above 127, int8); "
                 "convert to int64")
    pos_x, pos_y = (x - base) // 7, (y - base) // 7
    if not torch.equal(pos_x[:, 1:], pos_x[:, :-1] + 1):
        fail(tried, f"x[0] = positions {pos_x[0].tolist()} of the dataset", "consecutive tokens of the dataset in each row",
             "take a contiguous slice dataset[start : start + context_length]")
    if torch.equal(pos_y, pos_x):
        fail(tried, "y == x", "y shifted by one token: y[:, t] = dataset[start + t + 1]", "y holds the *next* token for every position of x")
    if not torch.equal(pos_y, pos_x + 1):
        fail(tried, f"x[0] = positions {pos_x[0].tolist()}, y[0] = positions {pos_y[0].tolist()}",
             "y[:, t] = dataset[start + t + 1]", "slice y from start + 1 to start + context_length + 1")
    return pos_x[:, 0]


def get_batch(fn) -> None:
    """Grade ``fn(dataset, batch_size, context_length, device) -> (x, y)``."""
    # Token i of a dataset is base + 7*i, so every value tells where in the dataset it came from.
    device = other_device()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tokens.bin")
        memmap = np.memmap(path, dtype=np.uint16, mode="w+", shape=(3500,))
        memmap[:] = 40000 + 7 * np.arange(3500)
        memmap.flush()
        del memmap
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        cases = [
            (np.arange(50, dtype=np.int64) * 7 + 3, 3, "int64 array of 50 tokens", 4, 8, "cpu"),
            (np.arange(300, dtype=np.int64) * 7 + 3, 3, "int64 array of 300 tokens", 16, 1, "cpu"),
            (np.arange(12, dtype=np.int64) * 7 + 3, 3, "int64 array of 12 tokens", 3, 11, "cpu"),
            (np.arange(200, dtype=np.int32) * 7 + 5, 5, "int32 array of 200 tokens", 5, 9, torch.device("cpu")),
            (tokens, 40000, "uint16 np.memmap of 3500 tokens with ids 40000..64493 (read-only)", 8, 300, "cpu"),
            (np.arange(100, dtype=np.int64) * 7 + 3, 3, "int64 array of 100 tokens", 4, 6, device),
            (tokens, 40000, "uint16 np.memmap of 3500 tokens (read-only)", 2, 16, device),
        ]
        for dataset, base, what, batch_size, context_length, dev in cases:
            if dev is None:
                continue
            tried = f"get_batch({what}, batch_size={batch_size}, context_length={context_length}, device={dev!r})"
            _get_batch_once(fn, dataset, base, batch_size, context_length, dev, tried)
        tried = "get_batch(uint16 np.memmap of 3500 tokens, batch_size=16, context_length=8, device='cpu') called twice"
        first = _get_batch_once(fn, tokens, 40000, 16, 8, "cpu", tried)
        second = _get_batch_once(fn, tokens, 40000, 16, 8, "cpu", tried)
        if torch.equal(first, second):
            fail(tried, f"the same start positions {first.tolist()[:6]}... on both calls", "new random windows on every call",
                 "do not reseed inside the function (torch.manual_seed / np.random.seed): draw the starts from the "
                 "global RNG, which the caller seeds once")
        del tokens
    _check_uniform_starts(fn)
    passed("get_batch", "int64/int32/uint16-memmap datasets, the requested device, new windows each call, "
                        "the one-token shift and uniform start positions are right")


def _check_uniform_starts(fn) -> None:
    context_length, n = 4, 8  # valid starts: 0, 1, 2, 3 (the window and its target must fit)
    dataset = np.arange(n, dtype=np.int64)
    tried = f"get_batch(dataset of {n} tokens, batch_size=400, context_length={context_length}, 'cpu') repeatedly"
    counts = np.zeros(n, dtype=np.int64)
    for _ in range(5):
        x, _ = results(call_on_copies(fn, tried, dataset, 400, context_length, "cpu"), ("x", "y"), tried)
        counts += np.bincount(x[:, 0].cpu().long().numpy().clip(0, n - 1), minlength=n)[:n]
    valid = n - context_length
    seen = [int(s) for s in np.nonzero(counts)[0]]
    if seen != list(range(valid)):
        fail(tried, f"start positions {seen}", f"every start in 0..{valid - 1}",
             "the last valid start is len(dataset) - context_length - 1; torch.randint's upper bound is exclusive")
    expected = counts.sum() / valid
    if np.abs(counts[:valid] - expected).max() > 0.2 * expected:
        fail(tried, f"start counts {counts[:valid].tolist()}", f"about {expected:.0f} each", "draw every start position with equal probability")


# ----------------------------------------------------------------------------- cross_entropy
def _reference_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.detach().double().reshape(-1, logits.shape[-1]).cpu(), targets.reshape(-1).cpu())


def cross_entropy(fn) -> None:
    """Grade ``fn(logits, targets) -> scalar mean loss`` (differentiable)."""
    gen = torch.Generator().manual_seed(0)
    cases = [((5, 11), 1.0, torch.float32), ((2, 3, 17), 3.0, torch.float32), ((1, 2), 1.0, torch.float32),
             ((4, 1000), 10.0, torch.float32), ((7,), 2.0, torch.float32), ((2, 2, 3, 9), 2.0, torch.float32),
             ((2, 1, 2, 3, 5), 1.0, torch.float32), ((3, 4, 50), 2.0, torch.bfloat16), ((6, 33), 3.0, torch.float16),
             ((4, 20), 2.0e3, torch.float16)]
    device = other_device(None)
    if device is not None:
        cases += [((3, 5, 40), 2.0, torch.float32), ((4, 64), 3.0, torch.bfloat16)]
    for i, (shape, scale, dtype) in enumerate(cases):
        dev = device if i >= len(cases) - 2 and device is not None else "cpu"
        logits = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).clamp(-6e4, 6e4).to(dtype)
        targets = torch.randint(0, shape[-1], shape[:-1], generator=gen)
        logits, targets = logits.to(dev), targets.to(dev)
        what = f"logits of shape {shape} in {dtype}" + (f" with |logits| up to {logits.abs().max().item():.3g}" if scale > 100 else "")
        tried = f"cross_entropy({what}, targets of shape {tuple(targets.shape)}" + (f", on {dev})" if dev != "cpu" else ")")
        _grade_loss(fn, logits, targets, tried, unstable_hint=(
            "exp of a 16-bit logit overflows beyond ~11 in fp16 (65504): subtract each row's max before exponentiating, "
            "or compute in fp32 (logits.float())") if dtype == torch.float16 else None)
    logits = torch.tensor([[1000.0, 0.0, -1000.0], [-50.0, 3000.0, 10.0]])
    targets = torch.tensor([0, 2])
    _grade_loss(fn, logits, targets, "cross_entropy(logits with entries of +-1000 and 3000, targets [0, 2])",
                unstable_hint="exp(1000) overflows (fp32 beyond ~88.7): subtract each row's max before exponentiating "
                              "(log-sum-exp trick)")
    passed("cross_entropy", "matches torch.nn.functional.cross_entropy on ranks 1-5, fp32/fp16/bf16, huge logits, "
                            "and gradients flow back to the logits")


def _grade_loss(fn, logits, targets, tried, unstable_hint=None) -> None:
    got = as_tensor(call_on_copies(fn, tried, logits, targets,
                                   mutation_hint="do not change logits in place (logits -= max, logits.exp_()): "
                                                 "write peak = logits.max(...); shifted = logits - peak"), tried)
    expected = _reference_loss(logits, targets)
    if got.dim() != 0:
        fail(tried, f"a tensor of shape {tuple(got.shape)}", "a scalar (0-dim) tensor", "average the per-position losses with .mean()")
    if not got.is_floating_point():
        fail(tried, f"a {got.dtype} tensor", "a floating-point loss", "do not round or cast the loss to an integer")
    expect_device(got, logits.device, "the loss", tried)
    value = got.detach().double().cpu()
    if not torch.isfinite(value):
        fail(tried, f"{value.item()}", f"{expected.item():.6g}",
             unstable_hint or "subtract each row's max before exponentiating (log-sum-exp trick)")
    ratio = value.item() / expected.item()
    if round(ratio) > 1 and abs(ratio - round(ratio)) < 1e-3:
        fail(tried, f"{value.item():.6g}", f"{expected.item():.6g}",
             f"that is {round(ratio)}x the mean: divide the summed loss by the number of positions")
    sixteen = logits.dtype in (torch.float16, torch.bfloat16)
    rtol, atol = (1e-2, 1e-2) if sixteen else (1e-4, 1e-5)
    if abs(value.item() - expected.item()) > atol + rtol * abs(expected.item()):
        fail(tried, f"{value.item():.6g}", f"{expected.item():.6g}",
             "loss = logsumexp(logits) - logits[target] over the LAST dim, averaged over every other position "
             "(flatten all leading dims, whatever the rank)" + ("; for 16-bit logits compute in fp32" if sixteen else ""))
    logits_in = logits.clone().requires_grad_()
    tried_grad = tried[:-1] + ", logits.requires_grad=True) then loss.backward()"
    loss = as_tensor(call(fn, tried_grad, logits_in, targets.clone(),
                          hint="an in-place op on logits fails on a tensor that requires grad: build new tensors"), tried_grad)
    expect_differentiable(loss, "loss", tried_grad,
                          "the training loop calls loss.backward(): build the loss from torch ops on logits, without "
                          ".item(), .detach(), .numpy() or torch.tensor(...) around the result")
    call(lambda: loss.backward(), tried_grad)
    grad = logits_in.grad
    ref_logits = logits.detach().double().cpu().requires_grad_()
    F.cross_entropy(ref_logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).cpu()).backward()
    scale = ref_logits.grad.abs().max().item()
    if grad is None or not torch.allclose(grad.double().cpu(), ref_logits.grad, rtol=1e-3,
                                          atol=(2e-2 if sixteen else 1e-5) * scale):
        fail(tried_grad, "no gradient" if grad is None else "logits.grad differs from softmax - one_hot",
             "logits.grad = (softmax(logits) - one_hot(targets)) / number of positions",
             "keep the loss connected to logits (the max you subtract may be detached; the rest must not be)"
             + ("; with 16-bit logits, compute in fp32 (logits.float()) and subtract each row's max: exp in fp16 "
                "loses the small probabilities" if sixteen else ""))

