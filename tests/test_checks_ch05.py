"""The chapter-05 graders accept labkit's code and a learner's plain solutions, and reject the
typical wrong answers with a hint that names the mistake."""
import labkit  # noqa: F401

import math

import pytest
import torch
from torch import nn

from labkit.checks import ch05_lora as checks  # the graders unwrapped: delegating to labkit is refused by the package-level ones (test_checks_refusal.py)
from labkit import lora as L
from labkit.checks import CheckFailed


# ----------------------------------------------------------------------------- LoRALinear
def make_lora(*, b_init="zeros", a_init="kaiming", scaling=None, freeze=True, transpose_a=False, dropout_on="input",
              rslora=True, detach=False):
    """A learner's class; the keyword arguments swap in one mistake at a time."""

    class LoRA(nn.Module):
        def __init__(self, base, r, alpha, dropout=0.0, use_rslora=False):
            super().__init__()
            self.base = base
            if freeze:
                base.requires_grad_(False)
            d_out, d_in = base.weight.shape
            kw = dict(dtype=base.weight.dtype, device=base.weight.device)
            self.lora_A = nn.Parameter(torch.empty((d_in, r) if transpose_a else (r, d_in), **kw))
            if a_init == "kaiming":
                nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            elif a_init == "randn":
                nn.init.normal_(self.lora_A)
            else:
                nn.init.zeros_(self.lora_A)
            self.lora_B = nn.Parameter(torch.zeros(d_out, r, **kw) if b_init == "zeros" else torch.randn(d_out, r, **kw) * 0.01)
            if scaling is not None:
                self.scaling = scaling(alpha, r)
            elif use_rslora and rslora:
                self.scaling = alpha / math.sqrt(r)
            else:
                self.scaling = alpha / r
            self.dropout = nn.Dropout(dropout)

        def forward(self, x):
            A, B = (self.lora_A.detach(), self.lora_B.detach()) if detach else (self.lora_A, self.lora_B)
            A = A.T if transpose_a else A
            if dropout_on == "output":
                return self.dropout(self.base(x) + self.scaling * (x @ A.T) @ B.T)
            if dropout_on == "adapter_output":  # the update dropped instead of the adapter's input
                return self.base(x) + self.dropout(self.scaling * (x @ A.T) @ B.T)
            if dropout_on == "middle":  # A x dropped
                return self.base(x) + self.scaling * self.dropout(x @ A.T) @ B.T
            if dropout_on == "mask":  # a hand-made mask without the 1 / (1 - p) rescaling, applied always
                p = self.dropout.p
                mask = (torch.rand_like(x) > p).to(x.dtype) if p > 0 else torch.ones_like(x)
                return self.base(x) + self.scaling * ((x * mask) @ A.T) @ B.T
            return self.base(x) + self.scaling * (self.dropout(x) @ A.T) @ B.T

    return LoRA


def test_lora_linear_accepts_labkit_and_a_plain_class(capsys):
    checks.LoRALinear(L.LoRALinear)
    checks.LoRALinear(make_lora())
    assert capsys.readouterr().out.count("✓ LoRALinear:") == 2


@pytest.mark.parametrize("wrong, words", [
    (make_lora(b_init="random"), "initialise B to zeros"),
    (make_lora(scaling=lambda alpha, r: r / alpha), "alpha / r"),
    (make_lora(scaling=lambda alpha, r: 1.0), "multiply the update by scaling"),
    (make_lora(freeze=False), "requires_grad_\\(False\\)"),
    (make_lora(transpose_a=True), "transposed"),
    (make_lora(a_init="zeros"), "no gradient ever reaches"),
    (make_lora(a_init="randn"), "kaiming_uniform_"),
    (make_lora(rslora=False), "alpha / sqrt\\(r\\)"),
    (make_lora(dropout_on="output"), "adapter's input only"),
    (make_lora(dropout_on="mask"), "eval mode"),
    (make_lora(dropout_on="adapter_output"), "dropout belongs on the adapter's input"),
    (make_lora(dropout_on="middle"), "dropout belongs on the adapter's input"),
    (make_lora(detach=True), "gradients for both adapters"),
])
def test_lora_linear_rejects_typical_mistakes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.LoRALinear(wrong)


def test_lora_linear_rejects_plain_tensors_and_missing_arguments():
    class NoParameter(make_lora()):
        def __init__(self, base, r, alpha, dropout=0.0, use_rslora=False):
            super().__init__(base, r, alpha, dropout, use_rslora)
            A = self.lora_A.detach()
            del self.lora_A
            self.lora_A = A

    with pytest.raises(CheckFailed, match="nn.Parameter"):
        checks.LoRALinear(NoParameter)

    class NoDropoutArgument(make_lora()):
        def __init__(self, base, r, alpha, use_rslora=False):
            super().__init__(base, r, alpha, 0.0, use_rslora)

    with pytest.raises(CheckFailed, match="raised"):
        checks.LoRALinear(NoDropoutArgument)


# ----------------------------------------------------------------------------- merge_lora / unmerge_lora
def merge(model, *, transpose=False, dropout=False, set_flag=True, skip_merged=True, scaling=lambda layer: layer.scaling,
          sign=1, into_copy=False):
    """A learner's merge_lora (sign=-1 and the flag logic reversed: unmerge_lora); one mistake at a time."""
    for layer in L.lora_layers(model).values():
        if skip_merged and layer.merged == (sign == 1):
            continue
        with torch.no_grad():
            A = layer.lora_dropout(layer.lora_A) if dropout else layer.lora_A
            delta = scaling(layer) * (layer.lora_B.float() @ A.float())
            if transpose:
                delta = delta.T
            weight = layer.base.weight.detach().clone() if into_copy else layer.base.weight
            weight.copy_((weight.float() + sign * delta).to(weight.dtype))
        if set_flag:
            layer.merged = sign == 1


def unmerge(model, **kw):
    merge(model, sign=-1, **kw)


def test_merge_graders_accept_labkit_and_plain_solutions(capsys):
    checks.merge_lora(L.merge_lora)
    checks.merge_lora(merge)
    checks.unmerge_lora(L.unmerge_lora)
    checks.unmerge_lora(unmerge)
    out = capsys.readouterr().out
    assert out.count("✓ merge_lora:") == 2 and out.count("✓ unmerge_lora:") == 2


def _square_only_transpose(model):
    """Transposes the update where the shapes allow it (the square layer), merges the others right."""
    for layer in L.lora_layers(model).values():
        if not layer.merged:
            with torch.no_grad():
                delta = layer.delta_weight()
                if delta.shape[0] == delta.shape[1]:
                    delta = delta.T
                layer.base.weight.copy_((layer.base.weight.float() + delta).to(layer.base.weight.dtype))
            layer.merged = True


@pytest.mark.parametrize("wrong, words", [
    (lambda m: merge(m, transpose=True), "transposed update"),  # the non-square layers cannot even take it
    (_square_only_transpose, "no transpose"),
    (lambda m: merge(m, dropout=True), "no dropout at merge time"),
    (lambda m: merge(m, set_flag=False), "merged = True"),
    (lambda m: merge(m, skip_merged=False), "merged twice"),
    (lambda m: merge(m, scaling=lambda layer: layer.r / layer.alpha), "alpha / r"),
    (lambda m: merge(m, scaling=lambda layer: 1.0), "scale the update"),
    (lambda m: merge(m, into_copy=True), "not into a copy"),
])
def test_merge_lora_rejects_typical_mistakes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.merge_lora(wrong)


def test_merge_lora_rejects_a_trainable_merged_weight_and_changed_adapters():
    def trainable(model):
        L.merge_lora(model)
        for layer in L.lora_layers(model).values():
            layer.base.weight.requires_grad_(True)

    with pytest.raises(CheckFailed, match="without making it trainable"):
        checks.merge_lora(trainable)

    def zeroes_adapters(model):
        L.merge_lora(model)
        for layer in L.lora_layers(model).values():
            with torch.no_grad():
                layer.lora_B.zero_()

    with pytest.raises(CheckFailed, match="keep A and B"):
        checks.merge_lora(zeroes_adapters)


@pytest.mark.parametrize("wrong, words", [
    (lambda m: merge(m, sign=1, skip_merged=False, set_flag=False), "subtract the update"),  # adds instead
    (lambda m: unmerge(m, skip_merged=False, set_flag=True), "unmerged twice|only flip merged layers|skip layers"),
    (lambda m: unmerge(m, set_flag=False), "merged = False"),
    (lambda m: unmerge(m, transpose=True), "no transpose|raised"),
])
def test_unmerge_lora_rejects_typical_mistakes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.unmerge_lora(wrong)


# ----------------------------------------------------------------------------- lora_parameter_count
def count(config, r, targets, *, product=False, per_block=False, square=False, kv_like_q=False, head=False):
    d, kv, heads, hd, ff = config.d_model, config.kv_heads, config.num_heads, config.dim_per_head, config.d_ff
    shapes = {"q_proj": (d, heads * hd), "k_proj": (d, kv * hd), "v_proj": (d, kv * hd), "output_proj": (heads * hd, d),
              "w1": (d, ff), "w3": (d, ff), "w2": (ff, d)}
    if square:
        shapes = dict.fromkeys(shapes, (d, d))
    if kv_like_q:
        shapes["k_proj"] = shapes["v_proj"] = (d, heads * hd)
    per_layer = sum(r * d_in * d_out if product else r * (d_in + d_out) for name, (d_in, d_out) in shapes.items() if name in targets)
    total = per_layer * (1 if per_block else config.num_layers)
    return total + (r * (d + config.vocab_size) if head else 0)


def test_lora_parameter_count_accepts_labkit_and_a_plain_solution(capsys):
    checks.lora_parameter_count(L.lora_parameter_count)
    checks.lora_parameter_count(count)
    checks.lora_parameter_count(lambda c, r, t: float(count(c, r, t)))  # a float holding a whole number is fine
    assert capsys.readouterr().out.count("✓ lora_parameter_count:") == 3


@pytest.mark.parametrize("wrong, words", [
    (lambda c, r, t: count(c, r, t, product=True), "not r \\* d_in \\* d_out"),
    (lambda c, r, t: count(c, r, t, per_block=True), "multiply by num_layers"),
    (lambda c, r, t: count(c, r, t, square=True), "not every layer is d_model x d_model"),
    (lambda c, r, t: count(c, r, t, kv_like_q=True), "grouped-query attention"),
    (lambda c, r, t: count(c, r, t, head=True), "LM head"),
    (lambda c, r, t: str(count(c, r, t)), "an int"),
])
def test_lora_parameter_count_rejects_typical_mistakes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.lora_parameter_count(wrong)


def test_head_dim_mistake_is_named():
    def d_model_wide_attention(config, r, targets):
        d = config.d_model
        total = count(config, r, targets)
        width = config.num_heads * config.dim_per_head
        for name in targets:  # q_proj and output_proj taken as d_model x d_model
            if name in ("q_proj", "output_proj"):
                total += config.num_layers * r * (d - width)
        return total

    with pytest.raises(CheckFailed, match="need not be d_model"):
        checks.lora_parameter_count(d_model_wide_attention)


def test_the_lora_verdict_comes_from_the_judge_not_from_the_probe():
    # Under labkit.grade the probe runs in the learner's process and could be replaced there: the judge,
    # in the grading process, recomputes every property from the record and rejects one that was tampered with.
    inputs = checks._layer_inputs()
    honest = checks._probe_layers(L.LoRALinear, inputs)
    checks._judge_layers(inputs, honest)
    tampered = {"got": lambda t: t * 1.5, "B": lambda t: t + 1, "A_grad": lambda t: t * 2, "got0": lambda t: t + 0.1,
                "trainable_base": lambda v: ["weight"]}
    for key, change in tampered.items():
        records = [dict(record) for record in honest]
        records[-1][key] = change(records[-1][key])
        with pytest.raises(CheckFailed, match="as it ran where the class lives"):
            checks._judge_layers(inputs, records)
    for forged in ([], honest[:-1], None, [{}] * len(inputs)):
        with pytest.raises(CheckFailed):
            checks._judge_layers(inputs, forged)
    seen = checks._probe_dropout(L.LoRALinear)
    checks._judge_dropout(seen)
    for forged in ({"eval": seen["eval"], "train": seen["eval"]}, {"eval": seen["train"], "train": seen["train"]}, {}):
        with pytest.raises(CheckFailed, match="dropout"):
            checks._judge_dropout(forged)


# ----------------------------------------------------------------------------- merging: in place, fp32, frozen
def _new_parameter(model, sign=1):
    """Assigns a new nn.Parameter (an optimizer holding the old one sees nothing; nn.Parameter also trains)."""
    for layer in L.lora_layers(model).values():
        if layer.merged == (sign == 1):
            continue
        with torch.no_grad():
            merged = (layer.base.weight.float() + sign * layer.delta_weight()).to(layer.base.weight.dtype)
        layer.base.weight = nn.Parameter(merged, requires_grad=False)
        layer.merged = sign == 1


def _in_bf16(model, sign=1):
    """The arithmetic in the weight's dtype: every op rounds."""
    for layer in L.lora_layers(model).values():
        if layer.merged == (sign == 1):
            continue
        with torch.no_grad():
            layer.base.weight += sign * layer.scaling * (layer.lora_B @ layer.lora_A)
        layer.merged = sign == 1


def _without_no_grad(model, sign=1):
    """copy_ from the trainable adapters outside torch.no_grad(): the weight gets a grad_fn."""
    for layer in L.lora_layers(model).values():
        if layer.merged == (sign == 1):
            continue
        weight = layer.base.weight
        weight.copy_((weight.float() + sign * layer.scaling * layer.lora_B.float() @ layer.lora_A.float()).to(weight.dtype))
        layer.merged = sign == 1


def _unmerge_and_reset(model):
    """Takes the update out, then zeroes B "to start clean": the adapter is lost."""
    L.unmerge_lora(model)
    for layer in L.lora_layers(model).values():
        with torch.no_grad():
            layer.lora_B.zero_()


def _unmerge_trainable(model):
    L.unmerge_lora(model)
    for layer in L.lora_layers(model).values():
        layer.base.weight.requires_grad_(True)


@pytest.mark.parametrize("wrong, words", [
    (_new_parameter, "same Parameter"),
    (_in_bf16, "compute in fp32"),
    (_without_no_grad, "grad_fn"),
])
def test_merge_lora_rejects_new_parameters_bf16_arithmetic_and_graphs(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.merge_lora(wrong)


@pytest.mark.parametrize("wrong, words", [
    (lambda m: _new_parameter(m, -1), "same Parameter"),
    (lambda m: _in_bf16(m, -1), "compute in fp32"),
    (lambda m: _without_no_grad(m, -1), "grad_fn"),
    (_unmerge_and_reset, "keep A and B"),
    (_unmerge_trainable, "without making it trainable"),
])
def test_unmerge_lora_rejects_new_parameters_bf16_arithmetic_graphs_and_lost_adapters(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.unmerge_lora(wrong)


# ----------------------------------------------------------------------------- delegation (the package-level graders)
def test_lora_linear_refuses_labkits_class_and_subclasses_of_it():
    import labkit.checks as graded
    from labkit.checks import DelegationRefused

    class Renamed(L.LoRALinear):
        pass

    class OwnForward(L.LoRALinear):
        def forward(self, x):
            return self.base(x) + self.scaling * (self.lora_dropout(x) @ self.lora_A.T) @ self.lora_B.T

    class Wrapper(nn.Module):  # builds labkit's layer inside: refused when it is instantiated
        def __init__(self, base, r, alpha, dropout=0.0, use_rslora=False):
            super().__init__()
            self.inner = L.LoRALinear(base, r, alpha, dropout, use_rslora)

    for answer in (L.LoRALinear, Renamed, OwnForward, Wrapper):
        with pytest.raises(DelegationRefused, match="LoRALinear"):
            graded.LoRALinear(answer)
    graded.LoRALinear(make_lora())


# ----------------------------------------------------------------------------- lora_targets
def targets(model, names, r, alpha, *, match="exact", freeze="before", fresh=False, per_target=False, linear_only=True):
    """A learner's lora_targets; the keyword arguments swap in one mistake at a time."""
    from labkit.nn import Linear

    def chosen(name, module, target_names):
        if linear_only and not isinstance(module, (nn.Linear, Linear)):
            return False
        leaf = name.rpartition(".")[2]
        return {"exact": leaf in target_names, "substring": any(t in name for t in target_names),
                "endswith": any(name.endswith(t) for t in target_names), "full name": name in target_names}[match]

    if freeze == "before":
        model.requires_grad_(False)
    groups = [[t] for t in names] if per_target else [list(names)]
    for group in groups:
        for name in [n for n, m in model.named_modules() if n and chosen(n, m, group)]:
            parent, _, child = name.rpartition(".")
            holder = model.get_submodule(parent)
            layer = getattr(holder, child)
            if fresh:  # a new layer of the same shape, the pretrained weight not copied
                layer = nn.Linear(layer.weight.shape[1], layer.weight.shape[0], bias=False)
            setattr(holder, child, L.LoRALinear(layer, r, alpha))
    if freeze == "after":
        model.requires_grad_(False)
    return model


def _own_wrapper(model, names, r, alpha):
    """Wraps the right layers, in a class of its own."""
    class Adapter(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base
            self.down = nn.Parameter(torch.zeros(r, base.weight.shape[1]))

        def forward(self, x):
            return self.base(x)

    model.requires_grad_(False)
    for name in [n for n, m in model.named_modules() if isinstance(m, nn.Module) and n.rpartition(".")[2] in set(names)]:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, Adapter(model.get_submodule(name)))
    return model


def test_lora_targets_accepts_a_plain_solution_and_labkits_matching(capsys):
    checks.lora_targets(targets)
    checks.lora_targets(lambda model, names, r, alpha: L.apply_lora(model, tuple(names), r, alpha))
    assert capsys.readouterr().out.count("✓ lora_targets:") == 2


@pytest.mark.parametrize("wrong, words", [
    (lambda *a: targets(*a, match="substring"), "not by substring or endswith"),
    (lambda *a: targets(*a, match="endswith"), "not by substring or endswith"),
    (lambda *a: targets(*a, match="full name"), "dotted paths"),
    (lambda *a: targets(*a, freeze=None), "freeze the whole model first"),
    (lambda *a: targets(*a, freeze="after"), "freeze before wrapping"),
    (lambda *a: targets(*a, fresh=True), "wrap the existing layer"),
    (lambda *a: targets(*a, per_target=True, linear_only=False), "wrapped twice"),  # by name only, one target at a time
    (lambda *a: (targets(*a), None)[1], "return model"),
    (lambda model, names, r, alpha: _own_wrapper(model, names, r, alpha), "wrap with L.LoRALinear"),
])
def test_lora_targets_rejects_typical_mistakes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.lora_targets(wrong)


def test_lora_targets_refuses_labkits_apply_lora_and_the_verdict_is_the_judges():
    import labkit.checks as graded
    from labkit.checks import DelegationRefused

    with pytest.raises(DelegationRefused, match="apply_lora"):
        graded.lora_targets(lambda model, names, r, alpha: L.apply_lora(model, tuple(names), r, alpha))
    graded.lora_targets(targets)
    honest = checks._probe_targets(targets)
    checks._judge_targets(honest)
    for key, change in {"wrapped": lambda v: v[:-1], "count": lambda v: v + 1, "out": lambda t: t + 1e-3,
                        "grads": lambda v: v + ["lm_head.weight"], "bases_kept": lambda v: False}.items():
        records = [dict(record) for record in honest]
        records[0][key] = change(records[0][key])
        with pytest.raises(CheckFailed, match="as it ran where your function lives"):
            checks._judge_targets(records)


# ----------------------------------------------------------------------------- through a handle (labkit.grade)
def _handle(fn, exercise):
    """The learner's function behind a Remote handle whose requests cross as bytes (as in tests/test_remote.py)."""
    from labkit.checks import _remote

    class LocalTransport(_remote.Transport):
        def exchange(self, request: bytes) -> bytes:
            return _remote.handle(request, {"fn": fn})

    return _remote.Remote(LocalTransport(), "fn", exercise)


@pytest.mark.parametrize("exercise, right, wrong, words", [
    ("merge_lora", merge, _new_parameter, "same Parameter"),
    ("unmerge_lora", unmerge, lambda m: _without_no_grad(m, -1), "requires grad"),
    ("lora_targets", targets, lambda *a: targets(*a, match="endswith"), "not by substring or endswith"),
])
def test_the_verdicts_are_the_same_through_a_handle(exercise, right, wrong, words, capsys):
    import labkit.checks as graded

    getattr(graded, exercise)(_handle(right, exercise))
    assert f"✓ {exercise}" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match=words):
        getattr(graded, exercise)(_handle(wrong, exercise))
