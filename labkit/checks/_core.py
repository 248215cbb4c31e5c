"""Shared machinery of the exercise graders."""
from __future__ import annotations

import torch

from labkit.checks._errors import CheckFailed
from labkit.checks._refusal import (DELEGATES, DelegationRefused, _delegate, _is_refused,  # noqa: F401
                                    _refusal_message, _resolve_dotted, _subclass_of_refused, refusing)


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
    wrong = ~torch.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
    if wrong.any():
        # an infinity where a finite value belongs (or the other sign of it) is the largest error there is
        diff = torch.where(wrong, (g - e).abs().nan_to_num(nan=float("inf")), torch.zeros_like(g))
        idx = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
        fail(tried, f"{g[idx].item():.6g} at index {idx}", f"{e[idx].item():.6g} (max abs error {diff.max().item():.3g})", hint)


def passed(name: str, detail: str) -> None:
    print(f"✓ {name}: {detail}")


# ----------------------------------------------------------------------------- shared grader helpers
MUTATION_HINT = ("work on new tensors: an in-place op (x -= m, x.clamp_(...), x.exp_(), out= ...) changes the "
                 "caller's tensor")


def other_device(fallback: str | None = "meta") -> str | None:
    """A device other than the CPU to try: ``"cuda"`` when it exists, else ``fallback`` (``"meta"``
    holds shapes and dtypes but no values, enough to see whether a result lands where it was asked)."""
    return "cuda" if torch.cuda.is_available() else fallback


def copy_of(value):
    """A deep copy of tensors, numpy arrays and (nested) lists/tuples/dicts of them."""
    import numpy as np

    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad) if value.is_leaf else value.detach().clone()
    if isinstance(value, np.ndarray):
        return value if not value.flags.writeable else np.array(value, copy=True)  # read-only: nothing can change it
    if isinstance(value, (list, tuple)):
        return type(value)(copy_of(v) for v in value)
    if isinstance(value, dict):
        return {k: copy_of(v) for k, v in value.items()}
    return value


def same_values(a, b) -> bool:
    """Exact equality of (nested) tensors/arrays, NaN equal to NaN; meta tensors compare shape and dtype."""
    import numpy as np

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return False
        if a.device.type == "meta":
            return True
        a, b = a.detach(), b.detach()
        if a.is_floating_point() or a.is_complex():
            return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
        return torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    return a == b


def call_on_copies(fn, tried: str, *args, hint: str = "run that call yourself and read the traceback",
                   mutation_hint: str = MUTATION_HINT, return_inputs: bool = False, **kwargs):
    """Call ``fn`` on copies of ``args`` (the grader keeps the originals for its reference) and fail
    if the call changed any of them. With ``return_inputs=True`` returns ``(result, copies)``, the
    objects ``fn`` received (to check that the result does not alias them)."""
    copies = [copy_of(a) for a in args]
    result = call(fn, tried, *copies, hint=hint, **kwargs)
    for i, (original, passed_in) in enumerate(zip(args, copies)):
        if not same_values(original, passed_in):
            fail(tried, f"argument {i + 1} was modified by the call", "the inputs left as they were", mutation_hint)
    return (result, copies) if return_inputs else result


def call_twice(fn, tried: str, args: tuple, names: tuple[str, ...], mutation_hint: str = MUTATION_HINT) -> tuple:
    """Call ``fn`` on copies of ``args`` twice (failing if it changes them); the results, checked to be
    a tuple of ``names`` tensors, must agree bit for bit. Returns the first call's results."""
    first = results(call_on_copies(fn, tried, *args, mutation_hint=mutation_hint), names, tried)
    again = results(call_on_copies(fn, tried + " (called a second time)", *args, mutation_hint=mutation_hint), names, tried)
    for name, a, b in zip(names, first, again):
        if not same_values(a.detach(), b.detach()):
            fail(tried + " (called twice)", f"a different {name} on the second call", "the same result for the same input",
                 "does your function keep state between calls, or depend on randomness?")
    return first


def storages(value) -> set:
    """The storage addresses of every tensor in a (nested) list/tuple/dict of tensors."""
    if isinstance(value, torch.Tensor):
        return {value.untyped_storage().data_ptr()} if value.device.type != "meta" else set()
    if isinstance(value, (list, tuple)):
        return set().union(*(storages(v) for v in value)) if value else set()
    if isinstance(value, dict):
        return storages(list(value.values()))
    return set()


def results(value, names: tuple[str, ...], tried: str, kind=torch.Tensor) -> tuple:
    """Check that ``value`` is a tuple (or list) of ``len(names)`` ``kind`` objects and return it as a tuple."""
    if len(names) > 1 and (not isinstance(value, (tuple, list)) or len(value) != len(names)):
        got = "None" if value is None else f"a {type(value).__name__}" + (f" of length {len(value)}" if isinstance(value, (tuple, list)) else "")
        fail(tried, got, f"a tuple ({', '.join(names)})",
             "your function returned None: did you forget `return`?" if value is None else f"return {', '.join(names)}")
    value = tuple(value) if len(names) > 1 else (value,)
    for name, v in zip(names, value):
        if v is None:
            fail(tried, f"{name} is None", f"a {kind.__name__}", "did you forget to `return` it?")
        if not isinstance(v, kind):
            fail(tried, f"{name} is a {type(v).__name__}", f"a {kind.__name__}", f"return {name} as a {kind.__name__}")
    return value


def expect_device(t: torch.Tensor, device, name: str, tried: str, hint: str = "") -> None:
    want = torch.device(device)
    if t.device.type != want.type or (want.index is not None and t.device.index != want.index):
        fail(tried, f"{name} on {t.device}", f"{name} on {want}",
             hint or "create the result on the input's (or the requested) device: pass device=... to new tensors, "
                     "or call .to(device) before returning")


def expect_dtype(t: torch.Tensor, dtype, name: str, tried: str, hint: str) -> None:
    if t.dtype != dtype:
        fail(tried, f"{name} of dtype {t.dtype}", f"{name} of dtype {dtype}", hint)


def expect_new_buffer(out: torch.Tensor, inputs, name: str, tried: str, hint: str) -> None:
    """Fail if ``out`` shares storage with any tensor in ``inputs`` (a tensor or nested lists of them)."""
    if isinstance(out, torch.Tensor) and out.device.type != "meta" and out.untyped_storage().data_ptr() in storages(inputs):
        fail(tried, f"{name} shares its memory with an input tensor", f"{name} in a new buffer", hint)


def expect_differentiable(out: torch.Tensor, name: str, tried: str, hint: str) -> None:
    if not out.requires_grad:
        fail(tried, f"{name} with requires_grad=False (no autograd graph back to the inputs)",
             f"a {name} that .backward() can flow through", hint)


# ----------------------------------------------------------------------------- graders of learners' Triton kernels
def kernel_device(name: str) -> str | None:
    """Where the learner's Triton code runs here: ``"cuda"`` when Triton compiles, ``"cpu"`` under its
    interpreter; ``None`` (after saying so) where Triton is not installed, so that the grader skips and the
    chapter goes on."""
    from labkit.runtime import triton_installed, triton_mode

    if not triton_installed():
        print(f"– {name}: not graded here: Triton is not installed (it ships Linux wheels only); run this chapter "
              "on Linux (a CPU is enough: kernels then run in Triton's interpreter)")
        return None
    return "cuda" if triton_mode() == "compiled" else "cpu"


def expect_jit_kernel(kernel, name: str) -> None:
    from triton.runtime.jit import KernelInterface

    from labkit.checks._remote import Remote

    if isinstance(kernel, Remote):  # labkit.grade: the kernel stays in the learner's process
        if kernel.describe()["kind"] == "jit":
            return
        fail(f"{name}: checking what was passed", f"a {kernel.describe()['type']}", "a @triton.jit function",
             "decorate the kernel with @triton.jit and pass the decorated function itself (not a call of it)")
    if not isinstance(kernel, KernelInterface):
        fail(f"{name}: checking what was passed", f"a {type(kernel).__name__}", "a @triton.jit function",
             "decorate the kernel with @triton.jit and pass the decorated function itself (not a call of it)")


def _not_implemented_in(err: BaseException) -> NotImplementedError | None:
    """The ``NotImplementedError`` raised in the learner's kernel that caused ``err``, if one did: the
    interpreter wraps it (as a cause), a compile error on the GPU quotes the kernel's source line."""
    seen = err
    while seen is not None:
        if isinstance(seen, NotImplementedError):
            return seen
        seen = seen.__cause__ or seen.__context__
    if "NotImplementedError" in str(err):
        return NotImplementedError("not answered yet: the kernel still raises NotImplementedError")
    return None


def call_kernel(launch, tried: str, *args, hint: str):
    """:func:`call` for a launcher of the learner's ``@triton.jit`` code: an error that the kernel's
    ``raise NotImplementedError`` caused counts as "not answered yet", like in a plain function."""
    from labkit.checks._remote import apply

    def unwrapped(*launch_args):
        try:
            return apply(launch, *launch_args)  # where the learner's kernel is (labkit.grade: its process)
        except NotImplementedError:
            raise
        except Exception as err:  # the learner's kernel may fail to compile or run in any way
            if (cause := _not_implemented_in(err)) is not None:
                raise NotImplementedError(str(cause)) from err
            raise
    return call(unwrapped, tried, *args, hint=hint)


def refuse_delegation(grader, exercise: str):
    """``grader`` that refuses, while it runs, the delegates of ``exercise`` (and a learner's class derived
    from a refused class). Applied to every grader in ``labkit.checks``."""
    import functools

    @functools.wraps(grader)
    def graded(*args, **kwargs):
        from labkit.checks._remote import remote_handles

        if remote_handles((args, kwargs)):  # the learner's code runs elsewhere, under its own refusal
            for handle in remote_handles(args):
                described = handle.describe()
                same = f"{described.get('module')}.{described.get('qualname')}"
                for name in DELEGATES.get(exercise, ()):
                    if same == name or (described.get("kind") == "class" and name in described.get("bases", ())):
                        raise DelegationRefused(_refusal_message(exercise, name).replace(
                            "called", "subclassed" if same != name else "called"))
            return grader(*args, **kwargs)
        for arg in args:
            if (name := _is_refused(arg, exercise)) is not None:
                raise DelegationRefused(_refusal_message(exercise, name))
            if (name := _subclass_of_refused(arg, exercise)) is not None:
                raise DelegationRefused(_refusal_message(exercise, name).replace("called", "subclassed"))
        with refusing(exercise):
            return grader(*args, **kwargs)

    return graded
