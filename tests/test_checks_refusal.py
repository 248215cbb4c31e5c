"""Graders refuse an answer that calls labkit's own implementation of the exercise (or a built-in the exercise
rules out), however it holds it; the grader's own reference still runs, and everything is restored after."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import labkit
from labkit import checks
from labkit.checks import _core
from labkit.checks._core import DELEGATES, DelegationRefused

GRADER_MODULES = [getattr(checks, name) for name in dir(checks) if name.startswith("ch") and name[2:4].isdigit()]


def graders() -> list[str]:
    return [name for module in GRADER_MODULES for name in module.__all__ if inspect.isfunction(getattr(module, name))]


def test_every_grader_with_a_labkit_function_of_its_name_refuses_it():
    """A new grader whose exercise labkit implements must list that implementation in DELEGATES."""
    skip = ("labkit.checks", "labkit.widgets", "labkit.grade", "labkit.bench", "labkit.distrun")
    implemented = {}
    for info in pkgutil.walk_packages(labkit.__path__, "labkit."):
        if info.name.startswith(skip):
            continue
        module = importlib.import_module(info.name)
        for name in graders():
            target = getattr(module, name, None)
            if (inspect.isfunction(target) or inspect.isclass(target)) and target.__module__.startswith("labkit"):
                implemented.setdefault(name, set()).add(f"{target.__module__}.{target.__qualname__}")
    for name, found in implemented.items():
        listed = {d for d in DELEGATES.get(name, ()) if d.startswith("labkit.")}
        resolved = {f"{t.__module__}.{t.__qualname__}" for t in (_core._resolve_dotted(d)[2] for d in listed)}
        assert found <= resolved, f"labkit.checks.{name}: labkit implements it as {sorted(found)}; list it in DELEGATES"


@pytest.mark.parametrize("name", sorted({d for ds in DELEGATES.values() for d in ds}))
def test_every_delegate_exists(name):
    assert _core._resolve_dotted(name)[2] is not None


def test_a_call_to_labkits_answer_is_refused_with_a_message_that_names_it():
    with pytest.raises(DelegationRefused, match=r"write it yourself: `labkit.data.get_batch` is labkit's answer"):
        checks.get_batch(lambda *args: labkit.data.get_batch(*args))
    with pytest.raises(DelegationRefused, match="get_batch"):  # handed in as the answer itself
        checks.get_batch(labkit.data.get_batch)


def test_a_reference_taken_before_grading_is_refused_too():
    taken = labkit.data.get_batch  # e.g. `from labkit.data import get_batch as mine` in the learner's cell
    with pytest.raises(DelegationRefused):
        checks.get_batch(lambda *args: taken(*args))


@pytest.mark.parametrize("answer, name", [
    (lambda logits, targets: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)), "cross_entropy"),
    (lambda logits, targets: (torch.logsumexp(logits, -1) - logits.gather(-1, targets[..., None])[..., 0]).mean(), "logsumexp"),
    (lambda logits, targets: (logits.logsumexp(-1) - logits.gather(-1, targets[..., None])[..., 0]).mean(), "logsumexp"),
])
def test_built_ins_the_exercise_rules_out_are_refused(answer, name):
    with pytest.raises(DelegationRefused, match=name):
        checks.cross_entropy(answer)


def test_softmax_graders_refuse_torch_softmax():
    with pytest.raises(DelegationRefused, match="softmax"):
        checks.softmax(lambda x, dim=-1: torch.softmax(x, dim))


def test_a_subclass_of_labkits_class_is_refused():
    class Mine(labkit.lora.LoRALinear):
        pass

    with pytest.raises(DelegationRefused, match="subclassed"):
        checks.LoRALinear(Mine)


def test_everything_is_restored_after_a_grader_and_labkit_keeps_working_inside_it():
    import numpy as np

    code = labkit.data.get_batch.__code__
    softmax, tensor_softmax = torch.softmax, torch.Tensor.softmax
    with pytest.raises(DelegationRefused):
        checks.get_batch(lambda *args: labkit.data.get_batch(*args))
    assert labkit.data.get_batch.__code__ is code and torch.softmax is softmax and torch.Tensor.softmax is tensor_softmax
    x, _ = labkit.data.get_batch(np.arange(100), 2, 8, "cpu")
    assert x.shape == (2, 8)
    with _core.refusing("get_batch"):
        # labkit's own code (here the grader's helpers) may still call it; the learner may not
        assert _core._delegate.__module__ == "labkit.checks._refusal"
        with pytest.raises(DelegationRefused):
            labkit.data.get_batch(np.arange(100), 2, 8, "cpu")
    assert labkit.data.get_batch(np.arange(100), 2, 8, "cpu")[0].shape == (2, 8)


def test_labkits_class_refuses_while_grading_and_builds_as_before_afterwards():
    # CI once failed here: the class refused through an assigned __new__, and deleting it afterwards left
    # CPython's constructor slot stale, so every later LoRALinear(base, r=...) raised a TypeError.
    from labkit.lora import LoRALinear

    def build():
        return LoRALinear(torch.nn.Linear(8, 6), r=2, alpha=4)

    before = build()
    with _core.refusing("LoRALinear"):
        with pytest.raises(DelegationRefused, match="LoRALinear"):
            build()
    for _ in range(2):
        layer = build()
        assert type(layer) is LoRALinear and layer.lora_A.shape == before.lora_A.shape == (2, 8)
