"""Graders refuse an answer that calls labkit's own implementation of the exercise (or a built-in the exercise
rules out), however it holds it; the grader's own reference still runs, and everything is restored after."""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

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


def _with_torchs_adamw(groups, step):
    for group in groups:
        optimizer = torch.optim.AdamW(group["params"], lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                      weight_decay=group["weight_decay"])
        for p, grad in zip(group["params"], group["grads"]):
            p.grad = grad
        optimizer.step()


def _with_torchs_adam(groups, step):
    torch.optim.Adam([p for group in groups for p in group["params"]], weight_decay=0.0)


def _with_labkits_adamw(groups, step):
    from labkit.train import AdamW

    AdamW([{"params": group["params"], "lr": group["lr"]} for group in groups])


def _with_torchs_functional_adamw(groups, step):
    from torch.optim.adamw import adamw

    for group in groups:
        adamw(group["params"], group["grads"], group["exp_avg"], group["exp_avg_sq"], [],
              [torch.tensor(float(step - 1)) for _ in group["params"]], foreach=False, amsgrad=False,
              beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"], weight_decay=group["weight_decay"],
              eps=group["eps"], maximize=False)


def _with_torchs_fused_adamw(groups, step):
    for group in groups:
        torch._fused_adamw_(group["params"], group["grads"], group["exp_avg"], group["exp_avg_sq"], [],
                            [torch.tensor(float(step)) for _ in group["params"]], lr=group["lr"], beta1=group["betas"][0],
                            beta2=group["betas"][1], weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False,
                            maximize=False)


@pytest.mark.parametrize("answer, name", [
    (_with_torchs_adamw, "torch.optim.AdamW"),
    (_with_torchs_adam, "torch.optim.Adam"),
    (_with_labkits_adamw, "labkit.train.AdamW"),
    (_with_torchs_functional_adamw, "torch.optim.adamw.adamw"),
    (_with_torchs_fused_adamw, "torch._fused_adamw_"),
])
def test_adamw_step_refuses_torchs_and_labkits_optimizers(answer, name):
    from labkit.train import AdamW

    with pytest.raises(DelegationRefused, match=rf"(?s)your code called {re.escape(name)}\n.*expected: your own adamw_step, "
                                                rf".*write it yourself: `{re.escape(name)}`"):
        checks.adamw_step(answer)
    with pytest.raises(DelegationRefused, match="AdamW"):  # labkit's class handed in as the answer itself
        checks.adamw_step(AdamW)


def test_adamw_steps_grader_runs_torchs_adamw_while_refusing_it_and_restores_it(capsys):
    # the grader's reference is torch.optim.adamw.adamw, itself refused while it grades; torch's own calls inside
    # (adamw -> adam -> _single_tensor_adam) come from torch and run
    from torch.optim.adamw import adamw

    from labkit.train import AdamW, TrainConfig, make_optimizer

    init, functional = torch.optim.AdamW.__init__.__code__, adamw.__code__

    def right(groups, step):
        with torch.no_grad():
            for group in groups:
                lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
                for p, g, m, v in zip(group["params"], group["grads"], group["exp_avg"], group["exp_avg_sq"]):
                    p.mul_(1 - lr * wd)
                    m.lerp_(g, 1 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                    p.addcdiv_(m, (v / (1 - b2**step)).sqrt() + eps, value=-lr / (1 - b1**step))

    checks.adamw_step(right)
    assert "✓ adamw_step" in capsys.readouterr().out
    assert torch.optim.AdamW.__init__.__code__ is init and adamw.__code__ is functional
    with _core.refusing("adamw_step"):
        layer = torch.nn.Linear(3, 2)
        make_optimizer(layer, TrainConfig())  # labkit's own code builds its AdamW
        with pytest.raises(DelegationRefused):
            torch.optim.AdamW(layer.parameters())
    for optimizer_cls in (torch.optim.AdamW, AdamW):  # and both build and step as before afterwards
        layer = torch.nn.Linear(3, 2)
        optimizer = optimizer_cls(layer.parameters(), lr=0.1)
        layer(torch.ones(1, 3)).sum().backward()
        before = layer.weight.detach().clone()
        optimizer.step()
        assert not torch.equal(layer.weight.detach(), before)
