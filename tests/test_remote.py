"""labkit.checks._remote: a grader's calls through a handle behave like direct calls (results, in-place edits,
aliasing, gradients, module state), what comes back cannot run code when read, and the graders run on handles
give the same verdicts as on the functions themselves. The learner's side runs here through a transport that
passes the bytes to ``_remote.handle`` (labkit.grade's goes through the kernel; tests/test_grade_attacks.py)."""
from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import torch

import labkit  # noqa: F401
from labkit import checks
from labkit.checks import _remote
from labkit.checks._remote import Remote, RemoteFailure


class LocalTransport(_remote.Transport):
    """The learner's side in this process, with its own namespace; every request and reply crosses as bytes."""

    def __init__(self, **namespace):
        self.namespace, self.requests = namespace, 0

    def exchange(self, request: bytes) -> bytes:
        self.requests += 1
        return _remote.handle(request, self.namespace)


def handle(name="fn", exercise="", **namespace):
    return Remote(LocalTransport(**namespace), name, exercise)


def test_results_come_back_as_values_of_the_same_types():
    def fn(x, n):
        return {"sum": x.sum(), "shape": x.shape, "n": n + 1, "items": (1.5, "s", None, True),
                "array": np.arange(3, dtype=np.int16), "dtype": x.dtype, "device": x.device, "scalar": np.float32(2)}

    got = handle(fn=fn)(torch.ones(2, 3), 4)
    assert got["sum"].item() == 6 and got["shape"] == torch.Size([2, 3]) and got["n"] == 5
    assert got["items"] == (1.5, "s", None, True) and got["dtype"] == torch.float32 and got["device"] == torch.device("cpu")
    assert got["array"].dtype == np.int16 and got["array"].tolist() == [0, 1, 2] and got["scalar"].dtype == np.float32


def test_objects_that_are_not_data_come_back_inert_with_their_type_name():
    class Sneaky:
        def __reduce__(self):  # a pickle that would run code in the grading process
            return (print, ("pwned",))

    got = handle(fn=lambda: (Sneaky(), len))()
    assert type(got[0]).__name__ == "Sneaky" and isinstance(got[0], _remote.Opaque)
    assert type(got[1]).__name__ == "builtin_function_or_method"


def test_a_reply_that_would_run_code_is_refused():
    class Payload:
        def __reduce__(self):
            return (exec, ("import sys; sys.exit(3)",))

    forged = io.BytesIO()
    pickle.dump({"status": "ok", "value": {"result": Payload(), "after": []}}, forged)
    with pytest.raises(RemoteFailure, match="unreadable"):
        _remote.read_reply(forged.getvalue())


def test_exceptions_keep_their_type_name_and_not_implemented_is_recognised():
    def raises_value():
        raise ValueError("bad shape")

    def not_answered():
        raise NotImplementedError("not answered yet: write fn")

    class Custom(Exception):
        pass

    def custom():
        raise Custom("mine")

    with pytest.raises(ValueError, match="bad shape"):
        handle(fn=raises_value)()
    with pytest.raises(NotImplementedError, match="not answered yet"):
        handle(fn=not_answered)()
    with pytest.raises(_remote.RemoteError) as info:
        handle(fn=custom)()
    assert type(info.value).__name__ == "Custom"
    with pytest.raises(NameError, match="not defined"):
        handle("missing")()


def test_in_place_edits_and_aliases_show_in_the_graders_tensors():
    def edits(x, y):
        x.add_(1)
        y.as_strided((2,), (1,), 4).fill_(7)  # past the view: the sentinel tests of kernel graders see it
        return x[0]

    buffer = torch.zeros(8)
    x, y = torch.zeros(3), buffer[:2]
    out = handle(fn=edits)(x, y)
    assert x.tolist() == [1, 1, 1] and buffer[4:6].tolist() == [7, 7]
    assert out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # the result aliases x, as there
    fresh = handle(fn=lambda x: x.clone())(x)
    assert fresh.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_gradients_flow_back_through_the_learner_process():
    def fn(x, w):
        return (x * w).sum(-1), x.detach() * 2

    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    y, detached = handle(fn=fn)(x, w)
    assert y.requires_grad and not detached.requires_grad
    y.sum().backward()
    assert torch.allclose(x.grad, w.detach().expand(3, 4)) and torch.allclose(w.grad, x.detach().sum(0))


def test_gradients_reach_the_parameters_of_a_module_argument():
    model = torch.nn.Linear(3, 2)
    loss = handle(fn=lambda m, x: m(x).pow(2).sum())(model, torch.randn(4, 3))
    loss.backward()
    assert model.weight.grad is not None and model.weight.grad.abs().sum() > 0 and model.bias.grad is not None


def test_a_module_argument_comes_back_with_its_parameters_flags_and_attributes():
    def merge(model):
        with torch.no_grad():
            model.weight += 1
        model.merged = True
        model.bias = torch.nn.Parameter(torch.zeros(2))  # replaced: not the object it was
        model.eval()

    model = torch.nn.Linear(3, 2)
    weight, bias = model.weight, model.bias
    before = weight.detach().clone()
    handle(fn=merge)(model)
    assert model.weight is weight and torch.equal(weight.detach(), before + 1)
    assert model.bias is not bias and model.merged is True and not model.training


def test_describe_names_the_learners_object_and_its_bases():
    class Mine(torch.nn.Module):
        pass

    described = handle(cls=Mine, name="cls").describe()
    assert described["kind"] == "class" and described["name"] == "Mine"
    assert "torch.nn.modules.module.Module" in described["bases"]


@pytest.mark.parametrize("exercise, right, wrong", [
    ("get_batch", "labkit.data.get_batch", lambda d, b, c, dev: (torch.zeros(b, c, dtype=torch.long),) * 2),
    ("cross_entropy", None, lambda logits, targets: logits.mean()),
    ("causal_mask", "labkit.nn.causal_mask", lambda n, m=None: torch.ones(n, m or n, dtype=torch.bool)),
    ("rmsnorm", None, lambda x, w, eps: x * w),
    ("adamw_step", "labkit.train.AdamW", lambda groups, step: None),
])
def test_graders_on_handles_give_the_verdicts_they_give_on_functions(exercise, right, wrong):
    from labkit.checks._core import _resolve_dotted

    grader = getattr(checks, exercise)
    with pytest.raises(checks.CheckFailed):
        grader(handle(fn=wrong, exercise=exercise))
    if right is not None:
        # labkit's own answer, sent as the learner's: refused there, so it cannot pass through a handle either
        with pytest.raises(checks.CheckFailed, match="write it yourself"):
            grader(handle(fn=_resolve_dotted(right)[2], exercise=exercise))


def test_a_right_answer_passes_through_a_handle(capsys):
    import torch.nn.functional as F  # noqa: N812

    def my_cross_entropy(logits, targets):
        shifted = logits.float() - logits.float().max(-1, keepdim=True).values
        log_probs = shifted - shifted.exp().sum(-1, keepdim=True).log()
        return -log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).mean().to(logits.dtype)

    checks.cross_entropy(handle(fn=my_cross_entropy, exercise="cross_entropy"))
    assert "✓ cross_entropy" in capsys.readouterr().out
    with pytest.raises(checks.CheckFailed, match="write it yourself"):
        checks.cross_entropy(handle(fn=lambda logits, targets: F.cross_entropy(logits.flatten(0, -2), targets.flatten()),
                                    exercise="cross_entropy"))
