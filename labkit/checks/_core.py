"""Shared machinery of the exercise graders."""
from __future__ import annotations

import torch


class CheckFailed(AssertionError):
    """An exercise answer is wrong; the message says what was tried, got, expected, and a hint."""


def fail(tried: str, got, expected, hint: str) -> None:
    raise CheckFailed(f"\n  tried:    {tried}\n  got:      {got}\n  expected: {expected}\n  hint:     {hint}")


def call(fn, tried: str, *args, hint: str = "run that call yourself and read the traceback", **kwargs):
    """Call the learner's function; an exception becomes a CheckFailed that says where."""
    try:
        return fn(*args, **kwargs)
    except CheckFailed:
        raise
    except Exception as err:  # the learner's code may raise anything
        if isinstance(err, NotImplementedError):
            hint = "write your answer in place of the `raise NotImplementedError(...)` line, then run the cell again"
        raise CheckFailed(f"\n  tried:    {tried}\n  raised:   {type(err).__name__}: {err}\n  hint:     {hint}") from err


def as_tensor(value, tried: str) -> torch.Tensor:
    if value is None:
        fail(tried, "None", "a torch.Tensor", "your function returned None: did you forget `return`?")
    if not isinstance(value, torch.Tensor):
        fail(tried, f"a {type(value).__name__}", "a torch.Tensor", "return a tensor, not a Python number or list")
    return value


def assert_close(got: torch.Tensor, expected: torch.Tensor, tried: str, hint: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    got = as_tensor(got, tried)
    if got.shape != expected.shape:
        fail(tried, f"shape {tuple(got.shape)}", f"shape {tuple(expected.shape)}", hint)
    if got.dtype != expected.dtype:
        fail(tried, f"dtype {got.dtype}", f"dtype {expected.dtype}", "keep the input's dtype in the output")
    g, e = got.detach().double().cpu(), expected.detach().double().cpu()
    if torch.isnan(g).any() and not torch.isnan(e).any():
        fail(tried, "NaN in the output", "finite values", hint)
    if not torch.allclose(g, e, rtol=rtol, atol=atol, equal_nan=True):
        diff = (g - e).abs()
        idx = tuple(int(i) for i in torch.nonzero(diff == diff.nan_to_num(0).max())[0]) if diff.numel() else ()
        fail(tried, f"{g[idx].item():.6g} at index {idx}", f"{e[idx].item():.6g} (max abs error {diff.nan_to_num(0).max().item():.3g})", hint)


def passed(name: str, detail: str) -> None:
    print(f"✓ {name}: {detail}")
