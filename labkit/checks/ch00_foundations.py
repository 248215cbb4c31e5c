"""Graders for chapter 00: ``get_batch``, ``cross_entropy`` and ``adamw_step``.

``get_batch`` is tried on int64, int32 and uint16 token arrays (a uint16 ``np.memmap``, like a real
token file, with ids above 32767), on the CPU and on another device (CUDA when there is one, else
``"meta"``), called repeatedly (it must draw new windows each call) and checked for changing the
dataset. ``cross_entropy`` is tried on ranks 1 to 5, fp32/fp16/bf16 logits (fp16 logits in the
ten thousands), huge fp32 logits, on CUDA when there is one, must leave its inputs alone and must be
differentiable (the training loop calls ``.backward()`` on it).

``adamw_step(groups, step)`` updates, in place, the params and moments of every parameter group by one step of
``torch.optim.AdamW``; the grader steps its own copies with torch's AdamW and compares after each of several
consecutive steps: two groups with their own lr, betas, eps and weight decay (one with weight decay 0, like norms'
gains), 0-d to 3-d fp32 and fp64 params, one whose gradient is always zero (it still decays), then a new optimizer
from step 1 on CUDA when there is one, with params that require grad (the update must run under
``torch.no_grad()``). Each tensor must stay the same object with the same memory, dtype, device and shape, the
grads must be left alone, and what ``adamw_step`` returns is ignored. A wrong value is named by the mistake whose
step gives it (L2 regularisation, no or off-by-one bias correction, decay without lr or after the update, eps
inside the root, betas swapped, another group's hyper-parameters, ...). Under ``labkit.grade`` each call runs
through a labkit harness in the learner's process, which checks identities and memory there.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

from labkit.checks._core import (CheckFailed, as_tensor, assert_close, call, call_on_copies, copy_of, expect_device,
                                 expect_differentiable, fail, other_device, passed, results, same_values)

__all__ = ["get_batch", "cross_entropy", "adamw_step"]

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


# ----------------------------------------------------------------------------- adamw_step
_STATE = ("exp_avg", "exp_avg_sq", "params")   # what one step updates, in the order the grader reads it
_ADAMW_RULE = ("p *= 1 - lr * weight_decay; exp_avg = beta1 * exp_avg + (1 - beta1) * grad; "
               "exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad**2; "
               "p -= lr * (exp_avg / (1 - beta1**step)) / (sqrt(exp_avg_sq / (1 - beta2**step)) + eps)")
_NO_GRAD_HINT = ("the params require grad here, as a model's parameters do: an in-place op on them (p -= ..., p.mul_(...)) "
                 "outside torch.no_grad() raises; wrap the whole update in `with torch.no_grad():`")
_STEP_ZERO_HINT = ("the bias correction uses this step's number as given, 1 - beta**step with step = 1 at the first step: "
                   "1 - beta**(step - 1) is 1 - beta**0 = 0 there, a division by zero")


def _adamw_cases() -> list[tuple]:
    """(what, device, params require grad, number of steps, groups): per group its hyper-parameters and its
    params as (ndim, dtype, gradient scale); a scale of 0 is a parameter whose gradient is zero at every step."""
    f32, f64 = torch.float32, torch.float64
    first = [dict(lr=0.1, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.5,
                  params=[(2, f32, 1.0), (1, f64, 1e-3), (3, f32, 0.1), (1, f32, 0.0)]),
             dict(lr=0.03, betas=(0.85, 0.98), eps=1e-8, weight_decay=0.0, params=[(0, f32, 0.3), (1, f64, 1.0), (2, f32, 3e-3)])]
    fresh = [dict(lr=0.02, betas=(0.9, 0.99), eps=1e-5, weight_decay=0.0, params=[(1, f32, 1e-2), (2, f64, 1.0)]),
             dict(lr=0.05, betas=(0.7, 0.9), eps=1e-7, weight_decay=0.2, params=[(2, f32, 0.5), (1, f32, 1e-3)])]
    return [("", "cpu", False, 5, first),
            (", a new optimizer (its step count starts again at 1), params that require grad as a model's do",
             other_device(None) or "cpu", True, 3, fresh)]


def _adamw_call(fn, groups: list, step: int, requires_grad: bool, tried: str) -> str | None:
    """``fn(groups, step)`` where ``fn`` lives (under ``labkit.grade`` the learner's process, where a list of the
    caller's tensors cannot be compared by identity from here): fails if the call replaced a tensor in the
    groups, gave one new memory, or changed its dtype, device or shape; returns the type name of what ``fn``
    returned (None for None). With ``requires_grad`` the params require grad during the call."""
    held = [{key: list(group[key]) for key in _STATE} for group in groups]
    memory = [{key: [t.untyped_storage().data_ptr() for t in tensors] for key, tensors in h.items()} for h in held]
    layout = [{key: [(t.dtype, t.device, t.shape) for t in tensors] for key, tensors in h.items()} for h in held]
    params = [p for h in held for p in h["params"]]
    if requires_grad:
        for p in params:
            p.requires_grad_(True)
    try:
        result = fn(groups, step)
    finally:
        if requires_grad:
            for p in params:
                p.requires_grad_(False)
    returned = None if result is None else type(result).__name__
    ignored = f" (your function returned a {returned}: the caller ignores what it returns)" if returned else ""
    for gi, h in enumerate(held):
        group = groups[gi] if isinstance(groups, list) and gi < len(groups) else None
        for key, tensors in h.items():
            now = group.get(key) if isinstance(group, dict) else None
            for i, t in enumerate(tensors):
                name = f"group {gi}'s {key}[{i}]"
                example = {"params": "p.mul_(1 - lr * weight_decay), p.addcdiv_(...)",
                           "exp_avg": "exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)",
                           "exp_avg_sq": "exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)"}[key]
                lost = ("the model and the optimizer hold the original tensor, not this list, so they never see the new one"
                        if key == "params" else
                        "the optimizer keeps the original tensor from step to step, not this list, so the new one is lost")
                if not (isinstance(now, (list, tuple)) and i < len(now) and now[i] is t):
                    fail(tried, f"{name} is another object after the call (the list entry was replaced)",
                         "the same tensor, updated in place",
                         f"update the tensor in place ({example}) instead of assigning group['{key}'][{i}] = ...: "
                         + lost + ignored)
                dtype, device, shape = layout[gi][key][i]
                if t.dtype != dtype:
                    fail(tried, f"{name} of dtype {t.dtype}", f"{name} of dtype {dtype}, as it came",
                         "keep each tensor's dtype: compute in another precision if you like, then write the result "
                         "back into the tensor (t.copy_(result) casts to its dtype)")
                if t.device != device:
                    fail(tried, f"{name} on {t.device}", f"{name} on {device}, as it came",
                         "leave every tensor on its device: update it in place where it is")
                if t.shape != shape:
                    fail(tried, f"{name} of shape {tuple(t.shape)}", f"shape {tuple(shape)}, as it came",
                         "update each tensor elementwise, keeping its shape (0-d parameters too)")
                if t.untyped_storage().data_ptr() != memory[gi][key][i]:
                    fail(tried, f"{name} has new memory after the call (its data_ptr changed: `.data = ...` or .set_())",
                         "its values updated in its own memory",
                         f"write into the tensor itself ({example}, or t.copy_(new)): `t.data = new` swaps its memory, "
                         "and whatever holds a view of the old memory (a flat parameter buffer, a captured CUDA graph) "
                         "no longer sees the update")
    return returned


def _call_step(fn, groups: list, step: int, requires_grad: bool, tried: str) -> str | None:
    from labkit.checks._remote import apply

    try:
        return call(apply, tried, _adamw_call, fn, groups, step, requires_grad, tried)
    except CheckFailed as err:
        cause = err.__cause__
        if cause is None or isinstance(cause, (NotImplementedError, CheckFailed)):
            raise
        if isinstance(cause, ZeroDivisionError) and step == 1:
            hint = _STEP_ZERO_HINT
        elif requires_grad and ("requires grad" in str(cause) or "leaf Variable" in str(cause)):
            hint = _NO_GRAD_HINT
        else:
            raise
        raise CheckFailed(f"\n  tried:    {tried}\n  raised:   {type(cause).__name__}: {cause}\n  hint:     {hint}") from cause


def _adamw_math(p, g, m, v, step, lr, betas, eps, weight_decay, *, l2=False, decay="before", decay_lr=True,
                correct=(True, True), bias_step=None, eps_in_sqrt=False, eps_hat=False, swap_betas=False,
                keep_new=(False, False), square_of="grad"):
    """One step of AdamW from (p, g, m, v) in fp64, or of a mistaken version of it (the keywords): the grader's
    way to name what a wrong answer did. Returns the new (p, m, v)."""
    beta1, beta2 = (betas[1], betas[0]) if swap_betas else betas
    if l2:  # torch.optim.Adam's weight_decay: L2 regularisation through the gradient, no decoupled decay
        g, decay = g + weight_decay * p, "none"
    shrink = 1 - (lr if decay_lr else 1.0) * weight_decay
    if decay == "before":
        p = p * shrink
    w1 = 1 - beta1 if keep_new[0] else beta1   # lerp_(grad, beta1) keeps 1 - beta1 of the old value
    w2 = 1 - beta2 if keep_new[1] else beta2
    m = w1 * m + (1 - w1) * g
    v = w2 * v + (1 - w2) * (g * g if square_of == "grad" else m * m)
    t = step if bias_step is None else bias_step
    m_hat = m / (1 - beta1**t) if correct[0] else m
    v_hat = v / (1 - beta2**t) if correct[1] else v
    # eps_hat: the Adam paper's "efficient" form, lr * sqrt(1 - beta2**t) / (1 - beta1**t) * m / (sqrt(v) + eps)
    eps = eps / (1 - beta2**t) ** 0.5 if eps_hat else eps
    denom = (v_hat + eps).sqrt() if eps_in_sqrt else v_hat.sqrt() + eps
    p = p - lr * m_hat / denom
    if decay == "after":
        p = p * shrink
    return p, m, v


def _explained(got: list, wrong: list, right: list) -> float:
    """How much of what separates ``got`` from ``right`` the mistaken step ``wrong`` leaves unexplained: the largest
    difference got - wrong over the largest wrong - right, each tensor measured against its own size (0: ``got``
    is ``wrong``; inf: ``wrong`` does not change anything or does not fit at all). Lists of fp64 tensors; where
    ``wrong`` is not finite, ``got`` must not be either."""
    residual = effect = 0.0
    for a, w, r in zip(got, wrong, right):
        fa, fw = torch.isfinite(a), torch.isfinite(w)
        if not torch.equal(fa, fw):
            return float("inf")
        if not r.numel():
            continue
        scale = max(r.abs().max().item(), w[fw].abs().max().item() if bool(fw.any()) else 0.0, 1e-30)
        if not bool(fw.all()):
            effect = float("inf")
        if bool(fw.any()):
            residual = max(residual, (a[fa] - w[fw]).abs().max().item() / scale)
            effect = max(effect, (w[fw] - r[fw]).abs().max().item() / scale)
    return residual / effect if effect > 1e-12 else float("inf")


def _diagnose(got: list, before: list, grads: list, step: int, hp: dict, groups_hp: list, gi: int) -> str | None:
    """The hint of the mistake whose step of group ``gi``, from the state ``before`` the call, gives what the call
    left (``got``): per parameter of the group (p, exp_avg, exp_avg_sq) before and after, and its grad."""
    got = [t.detach().double().cpu() for state in got for t in state]
    before = [[t.detach().double().cpu() for t in state] for state in before]
    grads = [g.double().cpu() for g in grads]

    def stepped(**mistake) -> list:
        return [t for (p, m, v), g in zip(before, grads) for t in _adamw_math(p, g, m, v, step, **{**hp, **mistake})]

    right = stepped()
    prefix = "that is Adam with L2 regularisation (torch.optim.Adam's weight_decay, wd * p added to the gradient): "
    variants = [
        (dict(l2=True), prefix + "AdamW decouples the decay: leave the gradient alone and shrink the parameter itself, "
                                 "p *= 1 - lr * weight_decay, outside the moments"),
        (dict(correct=(False, False)), "divide by the bias corrections: m_hat = exp_avg / (1 - beta1**step), "
                                       "v_hat = exp_avg_sq / (1 - beta2**step) (at step 1 exp_avg holds only (1 - beta1) "
                                       "of the gradient)"),
        (dict(correct=(True, False)), "correct v as well as m: the denominator is sqrt(exp_avg_sq / (1 - beta2**step)) + eps"),
        (dict(bias_step=step - 1), _STEP_ZERO_HINT if step == 1 else
            "the bias correction uses this step's number as given, 1 - beta**step (step = 1 at the first step): do not "
            "subtract 1"),
        (dict(bias_step=step + 1), "the bias correction uses this step's number as given, 1 - beta**step (step = 1 at "
                                   "the first step): do not add 1, the caller counts from 1 already"),
        (dict(decay_lr=False), "decoupled weight decay is scaled by the learning rate: p *= 1 - lr * weight_decay, "
                               "not 1 - weight_decay"),
        (dict(decay="after"), "decay the parameter before the Adam update, as torch.optim.AdamW does: p *= 1 - lr * "
                              "weight_decay first, then p -= lr * m_hat / (sqrt(v_hat) + eps) (decaying after the "
                              "update shrinks the update too)"),
        (dict(eps_in_sqrt=True), "eps goes outside the square root: sqrt(v_hat) + eps, not sqrt(v_hat + eps)"),
        (dict(eps_hat=True), "that is the Adam paper's \"efficient\" form, lr * sqrt(1 - beta2**step) / (1 - beta1**step) * "
                             "exp_avg / (sqrt(exp_avg_sq) + eps), whose eps is not bias-corrected: torch.optim.AdamW adds "
                             "eps to the corrected root, m_hat / (sqrt(v_hat) + eps)"),
        (dict(swap_betas=True), "beta1 and beta2 are swapped: betas = (beta1, beta2), beta1 (the first, here "
                                f"{hp['betas'][0]:g}) averages the gradient into exp_avg, beta2 its square into exp_avg_sq"),
        (dict(square_of="moment"), "exp_avg_sq averages the squared gradient: exp_avg_sq = beta2 * exp_avg_sq + "
                                   "(1 - beta2) * grad**2, not exp_avg**2"),
    ]
    lerp = ("each moment keeps beta of its old value and takes 1 - beta of the new one: exp_avg = beta1 * exp_avg + "
            "(1 - beta1) * grad (with lerp_: exp_avg.lerp_(grad, 1 - beta1), not lerp_(grad, beta1))")
    variants += [(dict(keep_new=k), lerp) for k in ((True, False), (False, True), (True, True))]
    for gj, other in enumerate(groups_hp):
        if gj == gi:
            continue
        own = (f"each group has its own hyper-parameters (group {gi}: lr={hp['lr']:g}, "
               f"weight_decay={hp['weight_decay']:g}; group {gj}: lr={other['lr']:g}, weight_decay={other['weight_decay']:g}): "
               "read lr, betas, eps and weight_decay from the group being updated, inside the loop over groups")
        variants += [(dict(lr=other["lr"]), own), (dict(weight_decay=other["weight_decay"]), own), ({**other}, own)]
    counted = ("use the step argument as this step's number (here step={step}): your update matches step={t}. Do not "
               "count steps yourself: a new optimizer starts again at 1")
    variants += [(dict(bias_step=t), counted.format(step=step, t=t)) for t in range(1, 40) if abs(t - step) > 1]
    fits = [(_explained(got, stepped(**mistake), right), n) for n, (mistake, _) in enumerate(variants)]
    unexplained, best = min(fits)
    return variants[best][1] if unexplained < 0.1 else None  # the mistake accounts for (nearly) all of the error


def _adamw_trajectory(fn, case, gen: torch.Generator) -> None:
    from torch.optim.adamw import adamw as torch_adamw

    what, device, requires_grad, steps, specs = case
    hps = [{k: spec[k] for k in ("lr", "betas", "eps", "weight_decay")} for spec in specs]
    shapes = [[(tuple(int(n) for n in torch.randint(2, 7, (ndim,), generator=gen)), dtype, scale)
               for ndim, dtype, scale in spec["params"]] for spec in specs]
    params = [[torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device) for shape, dtype, _ in group]
              for group in shapes]
    exp_avg = [[torch.zeros_like(p) for p in group] for group in params]
    exp_avg_sq = [[torch.zeros_like(p) for p in group] for group in params]
    # the grader's own copies, stepped by torch's AdamW (torch.optim.adamw.adamw is what torch.optim.AdamW.step runs;
    # called directly it does not load torch._dynamo, which building a first optimizer does, ~2 s)
    ref = [[p.clone() for p in group] for group in params]
    ref_m = [[torch.zeros_like(p) for p in group] for group in params]
    ref_v = [[torch.zeros_like(p) for p in group] for group in params]
    ref_steps = [[torch.tensor(0.0) for _ in group] for group in params]
    described = "; ".join(
        f"group {gi}: lr={hp['lr']:g}, betas={hp['betas']}, eps={hp['eps']:g}, weight_decay={hp['weight_decay']:g}, params "
        + ", ".join(f"{shape} {str(dtype).removeprefix('torch.')}" + (" with zero gradients" if scale == 0 else "")
                    for shape, dtype, scale in group)
        for gi, (hp, group) in enumerate(zip(hps, shapes)))
    for step in range(1, steps + 1):
        grads = [[(torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)
                  for shape, dtype, scale in group] for group in shapes]
        kept = copy_of(grads)
        before = [[(p.clone(), m.clone(), v.clone()) for p, m, v in zip(*state)] for state in zip(params, exp_avg, exp_avg_sq)]
        for gi, hp in enumerate(hps):
            torch_adamw(ref[gi], kept[gi], ref_m[gi], ref_v[gi], [], ref_steps[gi], foreach=False, amsgrad=False,
                        beta1=hp["betas"][0], beta2=hp["betas"][1], lr=hp["lr"], weight_decay=hp["weight_decay"],
                        eps=hp["eps"], maximize=False)
        groups = [{"params": list(params[gi]), "grads": list(grads[gi]), "exp_avg": list(exp_avg[gi]),
                   "exp_avg_sq": list(exp_avg_sq[gi]), **hp} for gi, hp in enumerate(hps)]
        tried = (f"adamw_step(groups, step={step}), step {step} of {steps} consecutive steps on {device}{what}; "
                 f"{described}")
        returned = _call_step(fn, groups, step, requires_grad, tried)
        ignored = f" (your function returned a {returned}: the caller ignores what it returns)" if returned else ""
        for gi in range(len(hps)):
            for i, (grad, original) in enumerate(zip(grads[gi], kept[gi])):
                if not same_values(grad, original):
                    fail(tried, f"group {gi}'s grads[{i}] was changed by the call", "the grads left as they were",
                         "leave grads as they are (they are the model's .grad, which clipping, logging and the next "
                         "accumulation read): compute from them out of place (grad * grad, grad + ..., not grad.mul_(...))")
        afters = [list(zip(*state)) for state in zip(params, exp_avg, exp_avg_sq)]
        for gi in range(len(hps)):
            for i, after in enumerate(afters[gi]):
                expected = (ref[gi][i], ref_m[gi][i], ref_v[gi][i])
                for key in _STATE:  # the moments first: a wrong parameter often follows from a wrong moment
                    k = ("params", "exp_avg", "exp_avg_sq").index(key)
                    if not _close(after[k], expected[k]):
                        hint = _state_hint(key, i, gi, afters[gi], expected, before[gi], kept[gi], step, hps, ignored)
                        assert_close(after[k], expected[k], f"{tried}; then read group {gi}'s {key}[{i}] "
                                     f"(shape {tuple(after[k].shape)})", hint, *_tolerances(expected[k]))


def _tolerances(expected: torch.Tensor) -> tuple[float, float]:
    """(rtol, atol) for a state tensor: the rounding of its dtype, atol relative to the tensor's largest value
    (a moment of gradients of size 1e-3 is of size 1e-6)."""
    rtol, atol = (1e-9, 1e-12) if expected.dtype == torch.float64 else (1e-5, 1e-6)
    return rtol, atol * (expected.detach().abs().max().item() if expected.numel() else 0.0)


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    rtol, atol = _tolerances(expected)
    return bool(torch.isclose(got.detach().double().cpu(), expected.double().cpu(), rtol=rtol, atol=atol).all())


def _state_hint(key, i, gi, after, expected, before, grads, step, hps, ignored) -> str:
    """The hint for a wrong ``key`` (one of ``_STATE``) of parameter ``i`` of group ``gi``: left unchanged, or the
    mistake :func:`_diagnose` recognises in the whole group, or AdamW's rule. ``after`` and ``before`` hold the
    group's (p, exp_avg, exp_avg_sq) per parameter, ``expected`` this parameter's."""
    k = ("params", "exp_avg", "exp_avg_sq").index(key)
    grad = grads[i]
    got, e, b = (t.detach().double().cpu() for t in (after[i][k], expected[k], before[i][k]))
    hp = hps[gi]
    if torch.equal(got, b):
        if key == "params" and not grad.any() and hp["weight_decay"] > 0:
            return ("a parameter whose gradient is zero still decays: p *= 1 - lr * weight_decay whatever the gradient "
                    "(only the Adam part of the step is 0 then)")
        if key == "params":
            return ("update each parameter in place, inside torch.no_grad() (p.mul_(1 - lr * weight_decay), "
                    "p.addcdiv_(...), or p.copy_(new)): the model and the optimizer hold this very tensor, so `p = p - ...` "
                    "(a new tensor) leaves it as it was" + ignored)
        how = ("exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)" if key == "exp_avg"
               else "exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)")
        return (f"update {key} in place ({how}): the optimizer keeps these very tensors from step to step, so "
                f"`{key} = ...` (a new tensor) leaves them as they were" + ignored)
    hint = _diagnose(after, before, grads, step, hp, hps, gi)
    if hint is not None:
        return hint
    hint = "AdamW's step, per parameter: " + _ADAMW_RULE
    if torch.isnan(got).any() and not torch.isnan(e).any():
        return hint + (" (a NaN: is some denominator 0? 1 - beta**0 at step 1, or sqrt(v_hat) without + eps where "
                       "the gradient is 0)")
    if step > 1:
        done = "step 1 was" if step == 2 else f"steps 1 to {step - 1} were"
        return hint + (f" ({done} right: do the moments carry over, each step starting from the exp_avg and exp_avg_sq "
                       "the previous one left?)")
    return hint


def adamw_step(fn) -> None:
    """Grade ``fn(groups, step) -> None``: one AdamW step (``torch.optim.AdamW``'s update) over parameter groups,
    in place. Each group is a dict with lists ``params``, ``grads``, ``exp_avg``, ``exp_avg_sq`` (one tensor per
    parameter) and the group's ``lr``, ``betas``, ``eps``, ``weight_decay``; ``step`` counts from 1."""
    gen = torch.Generator().manual_seed(0)
    for case in _adamw_cases():
        _adamw_trajectory(fn, case, gen)
    passed("adamw_step", "matches torch.optim.AdamW over consecutive steps of two groups with their own lr and weight "
                         "decay (0-d to 3-d, fp32 and fp64, zero gradients), updating params and moments in place, "
                         "also when the params require grad")
