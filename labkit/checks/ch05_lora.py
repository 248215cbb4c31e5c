"""Graders for chapter 05 (LoRA and parameter-efficient fine-tuning).

* ``LoRALinear(cls)``: the learner's class ``cls(base, r, alpha, dropout=0.0, use_rslora=False)``,
  the layer of :class:`labkit.lora.LoRALinear`: ``lora_A`` ``[r, d_in]`` (Kaiming-uniform),
  ``lora_B`` ``[d_out, r]`` (zeros), base frozen, ``forward(x) = base(x) + scaling * B A dropout(x)``;
* ``merge_lora(fn)`` and ``unmerge_lora(fn)``: ``fn(model)`` folds every
  :class:`labkit.lora.LoRALinear` of ``model`` into its base weight (and sets ``merged``), or
  takes it out again, as :func:`labkit.lora.merge_lora` / :func:`labkit.lora.unmerge_lora`;
* ``lora_parameter_count(fn)``: ``fn(config, r, targets)``, the adapters' parameter count,
  :func:`labkit.lora.lora_parameter_count` for ``targets`` given as a tuple of layer names;
* ``lora_targets(fn)``: ``fn(model, targets, r, alpha)`` wraps the linear layers whose last name component is one
  of ``targets`` in :class:`labkit.lora.LoRALinear` and freezes the rest, as :func:`labkit.lora.apply_lora`.

Each grader builds its own inputs (non-square layers, several ranks and dtypes, dropout switched
on), calls the learner's code twice where that must not change anything, and names the typical
mistake when one is recognised: B initialised randomly, the scaling upside down (``r / alpha``), the
base left trainable, dropout after ``A`` instead of on the adapter's input, the update transposed, dropout at
merge time, merging twice, a new Parameter assigned instead of the weight updated in place, bf16 arithmetic, a
graph recorded into the frozen weight, layers matched by substring, the base or the adapters frozen wrongly.
"""
from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from labkit import lora as L
from labkit.checks._core import call, fail, passed
from labkit.model import ModelConfig, TransformerLM
from labkit.nn import Linear

__all__ = ["LoRALinear", "merge_lora", "unmerge_lora", "lora_parameter_count", "lora_targets"]


def _close(got: torch.Tensor, expected: torch.Tensor, tol: float) -> bool:
    got, expected = got.detach().double(), expected.detach().double()
    return got.shape == expected.shape and bool(torch.allclose(got, expected, rtol=tol, atol=tol * (1 + expected.abs().max().item())))


def _max_error(got: torch.Tensor, expected: torch.Tensor) -> str:
    return f"max abs error {(got.detach().double() - expected.detach().double()).abs().max().item():.3g}"


# ----------------------------------------------------------------------------- the layer
def _layer_cases():
    """(tried, make_base, r, alpha, use_rslora, dtype): non-square labkit and torch layers, fp32 and bf16."""
    return [
        ("base = labkit.nn.Linear(24, 10), r=4, alpha=8", lambda: Linear(24, 10), 4, 8, False, torch.float32),
        ("base = torch.nn.Linear(16, 40) with a bias, r=2, alpha=16", lambda: nn.Linear(16, 40), 2, 16, False, torch.float32),
        ("base = labkit.nn.Linear(32, 12) in bfloat16, r=8, alpha=4", lambda: Linear(32, 12, dtype=torch.bfloat16), 8, 4, False, torch.bfloat16),
        ("base = labkit.nn.Linear(20, 30), r=1, alpha=3", lambda: Linear(20, 30), 1, 3, False, torch.float32),
        ("base = labkit.nn.Linear(24, 10), r=4, alpha=8, use_rslora=True", lambda: Linear(24, 10), 4, 8, True, torch.float32),
    ]


def _base_output(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return base(x)


def _reference(base, x, A, B, scaling) -> torch.Tensor:
    """In the adapter's dtype, like labkit: ``base(x) + scaling * (x A^T) B^T``, in fp64 here."""
    weight = base.weight.detach().double()
    out = x.double() @ weight.T + (0 if getattr(base, "bias", None) is None else base.bias.detach().double())
    return out + scaling * (x.double() @ A.detach().double().T) @ B.detach().double().T


def LoRALinear(cls) -> None:  # noqa: N802  (named after the class the learner writes)
    """Grade the learner's LoRA layer class. Its layers are exercised where the class lives (under
    ``labkit.grade`` that is the learner's process: parameters are edited in place, backward is run) by
    :func:`_probe_layers` and :func:`_probe_dropout`, which stop at the first mistake they recognise and name
    it; the verdict is :func:`_judge_layers`'s and :func:`_judge_dropout`'s, here, from what the probes saw:
    they recompute every property a pass needs against the grader's own reference."""
    from labkit.checks._remote import Remote, apply

    def run(probe, *args):
        return apply(probe, cls, *args) if isinstance(cls, Remote) else probe(cls, *args)

    inputs = _layer_inputs()
    _judge_layers(inputs, run(_probe_layers, inputs))
    _judge_dropout(run(_probe_dropout))
    passed("LoRALinear", "zero-initialised B, frozen base, alpha / r scaling (alpha / sqrt(r) with rsLoRA), "
                         "dropout on the adapter only, in fp32 and bf16, over labkit and torch layers")


def _case_base(case: int) -> nn.Module:
    """Case ``case``'s base layer, the same one wherever it is built (seeded)."""
    torch.manual_seed(0)
    return _layer_cases()[case][1]()


def _layer_inputs() -> list[dict]:
    """Per case: its index, the input ``x`` and the non-zero ``lora_A``, ``lora_B`` the grader writes in."""
    gen = torch.Generator().manual_seed(5)
    inputs = []
    for case, (_, _, r, _, _, dtype) in enumerate(_layer_cases()):
        d_out, d_in = _case_base(case).weight.shape
        x = torch.randn(3, 5, d_in, generator=gen).to(dtype)
        A = ((torch.rand(r, d_in, generator=gen) * 2 - 1) / math.sqrt(d_in)).to(dtype)
        B = (torch.randn(d_out, r, generator=gen) * 0.5).to(dtype)
        inputs.append({"case": case, "x": x, "A": A, "B": B})
    return inputs


def _scaling(r: int, alpha: float, rslora: bool) -> float:
    return alpha / math.sqrt(r) if rslora else alpha / r


def _probe_layers(cls, inputs: list[dict]) -> list[dict]:
    """Build ``cls(base, r, alpha, dropout=0.0, use_rslora=False)`` for every case of ``inputs`` and exercise
    it: an ``nn.Module`` with parameters ``lora_A`` ``[r, d_in]`` (Kaiming-uniform, ``|A| <= 1/sqrt(d_in)``) and
    ``lora_B`` ``[d_out, r]`` (zeros) in the base weight's dtype, the base frozen, and
    ``forward(x) = base(x) + scaling * (dropout(x) @ A^T) @ B^T`` with ``scaling = alpha / r`` (``alpha /
    sqrt(r)`` if ``use_rslora``). Fails with a named mistake where it recognises one; returns what each
    layer did (its fresh adapters, its outputs, its gradients) for :func:`_judge_layers`."""
    seen = []
    for item in inputs:
        tried, _, r, alpha, rslora, dtype = _layer_cases()[item["case"]]
        base = _case_base(item["case"])
        d_out, d_in = base.weight.shape
        w0 = base.weight.detach().clone()
        call_tried = f"{cls.__name__ if hasattr(cls, '__name__') else 'cls'}({tried})"
        layer = call(cls, call_tried, base, r, alpha, **({"use_rslora": True} if rslora else {}))
        if not isinstance(layer, nn.Module):
            fail(call_tried, f"a {type(layer).__name__}", "an nn.Module", "subclass torch.nn.Module and call super().__init__() first")
        A, B = getattr(layer, "lora_A", None), getattr(layer, "lora_B", None)
        for name, p, shape in (("lora_A", A, (r, d_in)), ("lora_B", B, (d_out, r))):
            if not isinstance(p, nn.Parameter):
                fail(call_tried, f"layer.{name} is {type(p).__name__}", "an nn.Parameter",
                     f"self.{name} = nn.Parameter(torch.empty(...)): a plain tensor is neither trained nor saved")
            if tuple(p.shape) != shape:
                hint = (f"{name} is {'[r, d_in]' if name == 'lora_A' else '[d_out, r]'} (PEFT's convention): "
                        + ("you built it transposed" if tuple(p.shape) == shape[::-1] else "check which side is the rank"))
                fail(call_tried, f"layer.{name} of shape {tuple(p.shape)}", f"shape {shape}", hint)
            if p.dtype != dtype:
                fail(call_tried, f"layer.{name} of dtype {p.dtype}", f"dtype {dtype}, the base weight's",
                     "create the adapters with the base weight's dtype and device")
        record = {"A": A.detach().clone(), "B": B.detach().clone(),
                  "trainable_base": [n for n, p in base.named_parameters() if p.requires_grad],
                  "trainable_adapters": bool(A.requires_grad and B.requires_grad)}
        if record["trainable_base"]:
            fail(call_tried, f"the base's {record['trainable_base']} still require grad", "a frozen base: only lora_A and lora_B train",
                 "base.requires_grad_(False): the point of LoRA is that W0 gets no gradient and no optimizer state")
        if not record["trainable_adapters"]:
            fail(call_tried, "lora_A or lora_B does not require grad", "both adapters trainable", "leave requires_grad=True on the adapters")
        if B.detach().abs().max() != 0:
            fail(call_tried, f"lora_B with values up to {B.detach().abs().max().item():.3g}", "lora_B all zeros",
                 "initialise B to zeros (and A randomly): then B A = 0 and the wrapped layer starts exactly as the base "
                 "model; a random B changes the pretrained model before any training")
        bound = 1 / math.sqrt(d_in)
        a_max = A.detach().float().abs().max().item()
        if a_max == 0 or A.detach().float().std().item() == 0:
            fail(call_tried, "lora_A all zeros (or constant)", "a random lora_A",
                 "with A = 0 and B = 0 no gradient ever reaches either (dL/dB needs A x, dL/dA needs B): init A randomly")
        if a_max > bound * 1.01:
            fail(call_tried, f"lora_A with values up to {a_max:.3g}", f"Kaiming-uniform values within 1/sqrt(d_in) = {bound:.3g}",
                 "nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5)), as torch.nn.Linear and PEFT initialise it")
        x = item["x"].clone()
        layer.eval()
        got0 = call(layer, f"{call_tried}; layer(x) right after construction, x of shape {tuple(x.shape)}", x)
        if not torch.equal(x, item["x"]):
            fail(call_tried + "; layer(x)", "x was modified", "the input unchanged", "do not modify x in place")
        if not isinstance(got0, torch.Tensor) or got0.shape != (3, 5, d_out) or got0.dtype != dtype:
            fail(call_tried + "; layer(x)", f"{type(got0).__name__} {tuple(getattr(got0, 'shape', ()))} {getattr(got0, 'dtype', '')}",
                 f"a {dtype} tensor of shape (3, 5, {d_out})", "return base(x) plus the update, in x's dtype")
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        if not _close(got0, _base_output(base, x), tol):
            fail(call_tried + "; layer(x) before training", _max_error(got0, _base_output(base, x)) + " from base(x)",
                 "exactly base(x): with B = 0 the update is zero", "forward(x) = base(x) + scaling * (x @ A.T) @ B.T")
        with torch.no_grad():  # now a non-zero adapter
            A.copy_(item["A"])
            B.copy_(item["B"])
        scaling = _scaling(r, alpha, rslora)
        got = call(layer, f"{call_tried}; with random lora_A, lora_B: layer(x)", x)
        expected = _reference(base, x, A, B, scaling)
        if not _close(got, expected, tol):
            candidates = {
                f"scaling = r / alpha = {r / alpha:g}": "the scaling is alpha / r: alpha sets the update's size, r is divided out",
                "no scaling": f"multiply the update by scaling = alpha / r = {alpha / r:g}",
                f"scaling = alpha / sqrt(r) = {alpha / math.sqrt(r):g}": f"without use_rslora the scaling is alpha / r = {alpha / r:g}",
                f"scaling = alpha / r = {alpha / r:g}": f"with use_rslora=True the scaling is alpha / sqrt(r) = {alpha / math.sqrt(r):g}",
            }
            values = {f"scaling = r / alpha = {r / alpha:g}": r / alpha, "no scaling": 1.0,
                      f"scaling = alpha / sqrt(r) = {alpha / math.sqrt(r):g}": alpha / math.sqrt(r),
                      f"scaling = alpha / r = {alpha / r:g}": alpha / r}
            hint = next((candidates[k] for k, s in values.items() if s != scaling and _close(got, _reference(base, x, A, B, s), tol)),
                        "forward(x) = base(x) + scaling * (x @ A.T) @ B.T: A first (d_in -> r), then B (r -> d_out)")
            fail(f"{call_tried}; with random lora_A, lora_B: layer(x)", _max_error(got, expected),
                 f"base(x) + {scaling:g} * B A x", hint)
        again = call(layer, f"{call_tried}; layer(x) a second time", x)
        if not torch.equal(again, got):
            fail(f"{call_tried}; layer(x) twice in eval mode", "a different output the second time", "the same output",
                 "does forward change state or apply dropout in eval mode?")
        layer.train()
        x_grad = x.detach().clone().requires_grad_()
        out = call(layer, f"{call_tried}; layer(x).sum().backward()", x_grad)
        out.float().sum().backward()
        if base.weight.grad is not None:
            fail(f"{call_tried}; backward", "a gradient in base.weight.grad", "no gradient for the frozen base weight",
                 "freeze the base (base.requires_grad_(False)) before using it")
        if B.grad is None or B.grad.abs().max() == 0 or A.grad is None:
            fail(f"{call_tried}; backward", "no gradient for lora_A or lora_B", "gradients for both adapters",
                 "compute the update from self.lora_A and self.lora_B (not detached copies) inside forward")
        if not torch.equal(base.weight.detach(), w0):
            fail(call_tried, "the base weight changed", "the base weight untouched", "forward must not write into base.weight")
        record.update(got0=got0.detach().clone(), got=got.detach().clone(), again=again.detach().clone(),
                      base_grad=base.weight.grad is not None, A_grad=A.grad.detach().clone(), B_grad=B.grad.detach().clone(),
                      base_unchanged=torch.equal(base.weight.detach(), w0))
        seen.append(record)
    return seen


def _tensor_like(value, shape: tuple, dtype: torch.dtype) -> bool:
    return isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(shape) and value.dtype == dtype


def _judge_layers(inputs: list[dict], seen) -> None:
    """The verdict on :func:`_probe_layers`'s record: every property of a LoRA layer, recomputed here."""
    if not isinstance(seen, list) or len(seen) != len(inputs) or not all(isinstance(r, dict) for r in seen):
        fail("LoRALinear: the layers built and run where the class lives", "an incomplete record of what they did",
             f"one record per case ({len(inputs)})", "run the grader cell as it is: it records what your layers do")
    for item, record in zip(inputs, seen):
        tried, _, r, alpha, rslora, dtype = _layer_cases()[item["case"]]
        base = _case_base(item["case"])
        d_out, d_in = base.weight.shape
        x, tol, scaling = item["x"], (1e-5 if dtype == torch.float32 else 2e-2), _scaling(r, alpha, rslora)

        def need(ok: bool, what: str) -> None:
            if not ok:
                fail(f"LoRALinear({tried}), as it ran where the class lives", f"not {what}", what,
                     "the grader cell in your notebook says what is wrong; fix that and run it again")

        A0, B0 = record.get("A"), record.get("B")
        need(_tensor_like(A0, (r, d_in), dtype) and _tensor_like(B0, (d_out, r), dtype),
             f"lora_A [r, d_in] and lora_B [d_out, r] in {dtype}")
        need(record.get("trainable_base") == [] and record.get("trainable_adapters") is True, "a frozen base, trainable adapters")
        need(bool(B0.abs().max() == 0), "lora_B initialised to zeros")
        a = A0.float()
        need(bool(a.abs().max() > 0 and a.std() > 0 and a.abs().max() <= 1.01 / math.sqrt(d_in)),
             "a random, Kaiming-uniform lora_A")
        expected0 = _base_output(base, x)
        need(_tensor_like(record.get("got0"), expected0.shape, dtype) and _close(record["got0"], expected0, tol),
             "base(x) right after construction")
        expected = _reference(base, x, item["A"], item["B"], scaling)
        need(_tensor_like(record.get("got"), expected.shape, dtype) and _close(record["got"], expected, tol),
             f"base(x) + {scaling:g} * B A x with the grader's lora_A and lora_B")
        need(isinstance(record.get("again"), torch.Tensor) and torch.equal(record["again"], record["got"]),
             "the same output on a second call in eval mode")
        need(record.get("base_grad") is False and record.get("base_unchanged") is True, "a base weight untouched and without a gradient")
        # d sum(out) / dA = scaling * outer(B^T 1, sum of x's rows); d sum(out) / dB = scaling * outer(1, A sum of x's rows)
        rows = x.double().reshape(-1, d_in).sum(0)
        A64, B64 = item["A"].double(), item["B"].double()
        need(_tensor_like(record.get("A_grad"), (r, d_in), dtype) and _close(record["A_grad"], scaling * torch.outer(B64.sum(0), rows), tol)
             and _tensor_like(record.get("B_grad"), (d_out, r), dtype)
             and _close(record["B_grad"], scaling * torch.outer(torch.ones(d_out, dtype=torch.float64), A64 @ rows), tol),
             "the gradients of layer(x).sum() for lora_A and lora_B")


def _dropout_case() -> tuple[str, nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The base (16 -> 12), the input, and a non-zero ``lora_A`` [4, 16] and ``lora_B`` [12, 4] (r = 4 < d, scaling
    alpha / r = 2, dropout 0.5). Each row of ``x`` has a single non-zero entry, so dropout on the adapter's input
    keeps or drops a row's whole update, while dropout anywhere after ``A`` (on ``A x``, on the update, on the
    output) drops parts of it: with ``A`` and ``B`` not the identity and ``r < d`` the placements differ."""
    torch.manual_seed(1)
    base = Linear(16, 12)
    gen = torch.Generator().manual_seed(2)
    x = torch.zeros(64, 16)
    x[torch.arange(64), torch.arange(64) % 16] = torch.rand(64, generator=gen) + 0.5
    A = (torch.rand(4, 16, generator=gen) * 2 - 1) / 4
    B = torch.randn(12, 4, generator=gen) * 0.5
    return "(labkit.nn.Linear(16, 12), r=4, alpha=8, dropout=0.5) with random lora_A, lora_B", base, x, A, B


_DROPOUT_SCALING = 8 / 4


def _dropout_rows(update: torch.Tensor, full: torch.Tensor) -> tuple[bool, float]:
    """Whether every row of ``update`` is either zero or ``2 * full``'s row (dropout 0.5 on the input of a row
    with one non-zero entry), and the fraction of rows kept."""
    zero = (update.abs() <= 1e-6).all(dim=1)
    doubled = torch.isclose(update, 2 * full, rtol=1e-4, atol=1e-5).all(dim=1)
    return bool((zero | doubled).all()), doubled.float().mean().item()


def _probe_dropout(cls) -> dict:
    """With dropout 0.5 and the grader's non-zero adapters, the update in eval mode must be ``scaling * B A x``,
    and in training each row's update (its input has one non-zero entry) either dropped or doubled (1 / (1 - p));
    the base path never dropped. Returns both outputs for :func:`_judge_dropout`."""
    tried, base, x, A, B = _dropout_case()
    tried = getattr(cls, "__name__", "cls") + tried
    layer = call(cls, tried, base, 4, 8, dropout=0.5)
    with torch.no_grad():
        layer.lora_A.copy_(A)
        layer.lora_B.copy_(B)
    full = _DROPOUT_SCALING * (x @ A.T) @ B.T
    layer.eval()
    eval_out = call(layer, tried + "; eval mode", x)
    update = eval_out - _base_output(base, x)
    if not _close(update, full, 1e-5):
        fail(tried + "; eval mode: layer(x) - base(x)", _max_error(update, full) + " from scaling * B A x",
             "scaling * B A x (no dropout in eval mode)",
             "use nn.Dropout (it does nothing in eval mode), not a hand-made mask applied always")
    layer.train()
    out = call(layer, tried + "; train mode", x).detach()
    update = out - _base_output(base, x)
    if (out.abs() < 1e-7).float().mean() > 0.2:
        fail(tried + "; train mode: layer(x)", "zeros in the layer's output itself", "base(x) never dropped",
             "dropout belongs on the adapter's input only: base(x) + scaling * B A dropout(x), never on base(x)")
    rows_ok, kept = _dropout_rows(update, full)
    if not rows_ok:
        fail(tried + "; train mode: layer(x) - base(x), for inputs with one non-zero entry per row",
             "rows of the update partly dropped", "each row's update either 0 (its input entry dropped) or 2 * scaling * B A x",
             "dropout belongs on the adapter's input: scaling * B A dropout(x). Dropout on A x, on the update or on the "
             "output drops parts of a row instead; nn.Dropout(p) also rescales the kept values by 1 / (1 - p)")
    if not 0.2 < kept < 0.8:
        fail(tried + "; train mode: layer(x) - base(x)", "no row dropped" if kept >= 0.8 else "every row dropped",
             "about half of the rows' updates zero (p = 0.5)", "apply self.lora_dropout to the adapter's input x: dropout(x) @ A.T")
    return {"eval": eval_out.detach().clone(), "train": out.clone()}


def _judge_dropout(seen) -> None:
    """The verdict on :func:`_probe_dropout`'s record, recomputed here."""
    tried, base, x, A, B = _dropout_case()
    expected, full = _base_output(base, x), _DROPOUT_SCALING * (x @ A.T) @ B.T
    ok = isinstance(seen, dict) and all(_tensor_like(seen.get(k), (64, 12), torch.float32) for k in ("eval", "train"))
    if ok:
        rows_ok, kept = _dropout_rows(seen["train"] - expected, full)
        ok = _close(seen["eval"] - expected, full, 1e-5) and rows_ok and 0.2 < kept < 0.8
    if not ok:
        fail(f"LoRALinear{tried}, as it ran where the class lives", "not dropout on the adapter's input only",
             "layer(x) - base(x) = scaling * B A x in eval mode, and in training each row's update 0 or doubled",
             "the grader cell in your notebook says what is wrong; fix that and run it again")


# ----------------------------------------------------------------------------- merging
class _Block(nn.Module):
    def __init__(self, layers: dict):
        super().__init__()
        for name, layer in layers.items():
            setattr(self, name, layer)


def _model(seed: int, dtype=torch.float32) -> tuple[nn.Module, dict]:
    """A nested model with labkit LoRALinear layers: non-square and square, several ranks, rsLoRA,
    dropout 0.1, in training mode (so that a dropout applied at merge time is random)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 100)
    layers = {
        "wide": L.LoRALinear(Linear(12, 20, dtype=dtype), r=3, alpha=6, dropout=0.1),
        "square": L.LoRALinear(Linear(16, 16, dtype=dtype), r=4, alpha=16, dropout=0.1),
        "narrow": L.LoRALinear(Linear(20, 6, dtype=dtype), r=2, alpha=4, dropout=0.1, use_rslora=True),
    }
    model = _Block({"attn": _Block({"q_proj": layers["wide"], "v_proj": layers["square"]}), "ffn": _Block({"w2": layers["narrow"]}),
                    "head": Linear(6, 4, dtype=dtype)})
    with torch.no_grad():
        for layer in layers.values():
            layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=gen).to(dtype) * 0.3)
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen).to(dtype) * 0.3)
    model.train()
    named = {"attn.q_proj": layers["wide"], "attn.v_proj": layers["square"], "ffn.w2": layers["narrow"]}
    return model, named


def _eval_outputs(named: dict, inputs: dict) -> dict:
    out = {}
    for name, layer in named.items():
        was = layer.training
        layer.eval()
        with torch.no_grad():
            out[name] = layer(inputs[name])
        layer.train(was)
    return out


def _merge_hint(layer, got_weight, w0) -> str:
    A, B, s = layer.lora_A.detach().double(), layer.lora_B.detach().double(), layer.scaling
    delta = got_weight.double() - w0.double()
    right = s * B @ A
    if torch.allclose(delta, torch.zeros_like(delta), atol=1e-7):
        return "add the update into base.weight itself (in place, under torch.no_grad()), not into a copy"
    if delta.shape == right.T.shape and torch.allclose(delta, right.T, atol=1e-4):
        return "the update B A is [d_out, d_in], the shape of W (labkit's weight is [d_out, d_in]): no transpose"
    if torch.allclose(delta, 2 * right, atol=1e-4):
        return "you merged twice: skip layers whose `merged` flag is already True"
    if torch.allclose(delta, right / s, atol=1e-4):
        return f"scale the update: W0 + scaling * B A, scaling = {s:g} (layer.scaling)"
    if torch.allclose(delta, right * (layer.r / layer.alpha) / s, atol=1e-4):
        return "the scaling is alpha / r (use layer.scaling), not r / alpha"
    p = getattr(layer.lora_dropout, "p", 0.0)
    if p and (torch.allclose(delta, right * (1 - p), atol=1e-4) or torch.allclose(delta, right / (1 - p), atol=1e-4)
              or ((delta.abs() < 1e-7) & (right.abs() > 1e-4)).any()):
        return ("no dropout at merge time: dropout is training noise on the adapter's input, the merged layer must "
                "compute what the unmerged one computes in eval mode: W0 + scaling * B A")
    return "W <- W0 + layer.scaling * layer.lora_B @ layer.lora_A, for every LoRALinear of the model"


def _right_in_eval_mode(fn, dtype, tol) -> bool:
    model, named = _model(0 if dtype == torch.float32 else 1, dtype)
    model.eval()
    w0 = {n: layer.base.weight.detach().clone() for n, layer in named.items()}
    try:
        fn(model)
    except Exception:  # noqa: BLE001  (only a diagnosis; the real call already ran)
        return False
    return all(_close(layer.base.weight, (w0[n].float() + layer.delta_weight()).to(dtype), tol) for n, layer in named.items())


_BF16_ROUNDED_TWICE = 0.05  # bf16 arithmetic rounds B A, the scaling and the sum: ~30% of these weights differ


def _check_weight(tried: str, name: str, layer, weight_before, held, expected: torch.Tensor, adapters, tol: float,
                  hint_if_off) -> None:
    """The checks merging and unmerging share: ``layer.base.weight`` is still the Parameter object it was (and
    ``held``, an optimizer's reference to it, sees the new values), frozen and outside any autograd graph, the
    adapters unchanged, the values ``expected`` (computed in fp32, rounded once to the weight's dtype)."""
    weight = layer.base.weight
    A, B = adapters
    if not (torch.equal(layer.lora_A.detach(), A) and torch.equal(layer.lora_B.detach(), B)):
        fail(tried, f"{name}'s lora_A or lora_B changed", "the adapters kept as they were",
             "keep A and B as they are: unmerging, merging again and swapping adapters need them")
    if weight is not weight_before:
        fail(tried, f"{name}.base.weight is a new tensor object", "the same Parameter, updated in place",
             "update the weight in place (weight.copy_(...) or weight += ... under torch.no_grad()): an optimizer "
             "(or a tied module) that holds the old Parameter never sees a new one assigned in its place")
    if weight.shape != expected.shape or weight.dtype != expected.dtype:
        fail(tried, f"{name}.base.weight of shape {tuple(weight.shape)}, {weight.dtype}",
             f"shape {tuple(expected.shape)}, {expected.dtype}", "B A is [d_out, d_in], like W; keep the weight's dtype")
    if weight.requires_grad or weight.grad_fn is not None:
        fail(tried, f"{name}.base.weight requires grad" + (f" and has grad_fn {type(weight.grad_fn).__name__}" if weight.grad_fn else ""),
             "the base weight still frozen, a leaf outside any graph",
             "update it under torch.no_grad(): outside it, an in-place update from the trainable adapters records their "
             "graph into the frozen weight (it then requires grad and keeps B and A alive)" if weight.grad_fn is not None else
             "update it in place under torch.no_grad() (weight += ...), without making it trainable: W0 stays frozen")
    if not _close(weight, expected, tol):
        fail(tried, f"{name}.base.weight off by {_max_error(weight, expected)}", "the weight +/- scaling * B A", hint_if_off())
    if expected.dtype != torch.float32 and (weight != expected).float().mean().item() > _BF16_ROUNDED_TWICE:
        fail(tried, f"{(weight != expected).float().mean().item():.0%} of {name}.base.weight's entries differ from "
                    f"(W.float() +/- scaling * B.float() @ A.float()).to({expected.dtype}) in their last bits",
             "the update computed in fp32 and rounded once",
             "compute in fp32: weight.float(), B.float() @ A.float(), then .to(weight.dtype) once; in bf16 every op "
             "(the product, the scaling, the sum) rounds, and merging then unmerging no longer returns W0")
    if not torch.equal(held.detach(), weight.detach()):
        fail(tried, f"an optimizer holding {name}.base.weight sees other values", "the optimizer's tensor updated",
             "update the Parameter itself in place, not a copy of it")


def _held_by_optimizer(named: dict) -> dict:
    """The base weights as an optimizer's parameter groups hold them (a reference taken before the call)."""
    weights = [layer.base.weight for layer in named.values()]
    optimizer = torch.optim.SGD(weights, lr=0.0)
    return dict(zip(named, optimizer.param_groups[0]["params"]))


def merge_lora(fn) -> None:
    """Grade ``fn(model)``: for every :class:`labkit.lora.LoRALinear` in ``model`` (nested anywhere)
    that is not merged yet, ``base.weight <- base.weight + scaling * lora_B @ lora_A`` in place (the same
    Parameter object, under no_grad, computed in fp32 and rounded once to the weight's dtype) and
    ``merged = True``; the adapters unchanged; afterwards ``layer(x)`` in eval mode equals what it was
    before. A second call changes nothing."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        model, named = _model(0 if dtype == torch.float32 else 1, dtype)
        tried = (f"merge_lora(model) on a model with LoRALinear layers attn.q_proj (12 -> 20, r=3), attn.v_proj (16 -> 16, r=4) "
                 f"and ffn.w2 (20 -> 6, r=2, rsLoRA), dropout 0.1, in training mode, {dtype}")
        gen = torch.Generator().manual_seed(3)
        inputs = {n: torch.randn(4, layer.d_in, generator=gen).to(dtype) for n, layer in named.items()}
        before = _eval_outputs(named, inputs)
        w0 = {n: layer.base.weight.detach().clone() for n, layer in named.items()}
        objects = {n: layer.base.weight for n, layer in named.items()}
        held = _held_by_optimizer(named)
        adapters = {n: (layer.lora_A.detach().clone(), layer.lora_B.detach().clone()) for n, layer in named.items()}
        for attempt in ("", " (called a second time)"):
            call(fn, tried + attempt, model, hint="lora_B @ lora_A is [d_out, d_in], the shape of W: a transposed update "
                 "does not fit a non-square layer (and run that call yourself to read the traceback)")
            for name, layer in named.items():
                A, B = adapters[name]
                expected = (w0[name].float() + layer.scaling * (B.float() @ A.float())).to(dtype)

                def hint_if_off(layer=layer, name=name):
                    if not attempt and _right_in_eval_mode(fn, dtype, tol):
                        return ("no dropout at merge time: your merge is right when the model is in eval mode but not in "
                                "training mode, so it goes through the dropout; the merged layer must compute what the "
                                "unmerged one computes in eval mode: W0 + scaling * B A")
                    return _merge_hint(layer, layer.base.weight.detach(), w0[name])

                _check_weight(tried + attempt, name, layer, objects[name], held[name], expected, adapters[name], tol, hint_if_off)
                if layer.merged is not True:
                    fail(tried + attempt, f"{name}.merged is {layer.merged!r}", "True",
                         "set layer.merged = True: forward then skips the adapter, which the weight now contains "
                         "(otherwise the update is counted twice)")
        after = _eval_outputs(named, inputs)
        for name in named:
            if not _close(after[name], before[name], 10 * tol):
                fail(tried + f"; {name}(x) in eval mode after merging", _max_error(after[name], before[name]),
                     "the same output as before merging", "merged, forward is base(x) alone: is `merged` honoured?")
    passed("merge_lora", "W0 + scaling * B A into the same Parameter, in place and without a graph, for every adapter "
                         "(nested, non-square, rsLoRA), in fp32 rounded once; merged set, no dropout, idempotent; "
                         "outputs unchanged in fp32 and bf16")


def _unmerge_hint(layer, weight, w0) -> str:
    delta = weight.detach().double() - w0.double()
    right = layer.delta_weight().double()
    if torch.allclose(delta, right, atol=1e-3) or torch.allclose(delta, 2 * right, atol=1e-3):
        return "subtract the update: W <- W - scaling * B A (and set merged = False)"
    if torch.allclose(delta, -right, atol=1e-3):
        return "you unmerged twice: only unmerge layers whose `merged` flag is True"
    return "W <- W - layer.scaling * layer.lora_B @ layer.lora_A, no transpose, no dropout"


def unmerge_lora(fn) -> None:
    """Grade ``fn(model)``: for every merged :class:`labkit.lora.LoRALinear` in ``model``,
    ``base.weight <- base.weight - scaling * lora_B @ lora_A`` in place (the same Parameter, frozen and
    without a grad_fn afterwards, computed in fp32) and ``merged = False``, the adapters kept (layers not
    merged are left alone); the weights return to what they were before merging."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        model, named = _model(2 if dtype == torch.float32 else 3, dtype)
        w0 = {n: layer.base.weight.detach().clone() for n, layer in named.items()}
        L.merge_lora(model)
        merged = {n: layer.base.weight.detach().clone() for n, layer in named.items()}
        objects = {n: layer.base.weight for n, layer in named.items()}
        held = _held_by_optimizer(named)
        adapters = {n: (layer.lora_A.detach().clone(), layer.lora_B.detach().clone()) for n, layer in named.items()}
        tried = f"unmerge_lora(model) on a model whose three LoRALinear layers were merged by labkit.lora.merge_lora, {dtype}"
        for attempt in ("", " (called a second time)"):
            call(fn, tried + attempt, model)
            for name, layer in named.items():
                expected = (merged[name].float() - layer.delta_weight()).to(dtype)
                if layer.base.weight.shape != w0[name].shape:
                    fail(tried + attempt, f"{name}.base.weight of shape {tuple(layer.base.weight.shape)}",
                         f"shape {tuple(w0[name].shape)}", "B A is [d_out, d_in], like W: no transpose")
                _check_weight(tried + attempt, name, layer, objects[name], held[name], expected, adapters[name], tol,
                              lambda layer=layer, name=name: _unmerge_hint(layer, layer.base.weight, w0[name]))
                if not _close(layer.base.weight, w0[name], tol):
                    fail(tried + attempt, f"{name}.base.weight off by {_max_error(layer.base.weight, w0[name])} from the original",
                         "the weight as it was before merging", _unmerge_hint(layer, layer.base.weight, w0[name]))
                if layer.merged is not False:
                    fail(tried + attempt, f"{name}.merged is {layer.merged!r}", "False",
                         "set layer.merged = False, so that forward adds the adapter again")
    model, named = _model(4)
    call(fn, "unmerge_lora(model) on a model that was never merged", model)
    for name, layer in named.items():
        if layer.merged:
            fail("unmerge_lora(model) on a model that was never merged", f"{name}.merged became True", "False", "only flip merged layers")
    fresh, _ = _model(4)
    for (name, layer), (_, reference) in zip(named.items(), L.lora_layers(fresh).items()):
        if not torch.equal(layer.base.weight, reference.base.weight):
            fail("unmerge_lora(model) on a model that was never merged", f"{name}.base.weight changed", "the weights untouched",
                 "skip layers whose `merged` flag is False: there is nothing to take out")
        if not (torch.equal(layer.lora_A, reference.lora_A) and torch.equal(layer.lora_B, reference.lora_B)):
            fail("unmerge_lora(model) on a model that was never merged", f"{name}'s adapters changed", "the adapters untouched",
                 "keep A and B as they are: unmerging only takes the update out of the weight")
    passed("unmerge_lora", "every merged adapter taken out of the same Parameter again (fp32 arithmetic, bf16 weights too), "
                           "frozen and graph-free, adapters kept, flags reset, unmerged layers left alone")


# ----------------------------------------------------------------------------- choosing the layers
class _Attention(nn.Module):
    """Hugging Face-style names: ``q_proj, k_proj, v_proj, o_proj``, or a fused ``kv_proj`` (whose name ends in ``v_proj``)."""

    def __init__(self, d: int, fused: bool):
        super().__init__()
        self.q_proj = nn.Linear(d, d, bias=False)
        if fused:
            self.kv_proj = nn.Linear(d, 2 * d, bias=False)
        else:
            self.k_proj, self.v_proj = nn.Linear(d, d, bias=True), nn.Linear(d, d, bias=True)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, h):
        k, v = self.kv_proj(h).chunk(2, -1) if hasattr(self, "kv_proj") else (self.k_proj(h), self.v_proj(h))
        return self.o_proj(torch.tanh(self.q_proj(h) * k) + v)


class _MLP(nn.Module):
    """``gate_proj, up_proj, down_proj``, or a fused ``gate_up_proj`` (Phi-3's; its name contains ``up_proj``)."""

    def __init__(self, d: int, d_ff: int, fused: bool):
        super().__init__()
        if fused:
            self.gate_up_proj = nn.Linear(d, 2 * d_ff, bias=False)
        else:
            self.gate_proj, self.up_proj = nn.Linear(d, d_ff, bias=False), nn.Linear(d, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d, bias=False)

    def forward(self, h):
        gate, up = self.gate_up_proj(h).chunk(2, -1) if hasattr(self, "gate_up_proj") else (self.gate_proj(h), self.up_proj(h))
        return self.down_proj(nn.functional.silu(gate) * up)


class _HFStyleLM(nn.Module):
    """A two-block language model with Hugging Face's layer names: block 0 plain, block 1 with fused projections."""

    def __init__(self, vocab: int = 20, d: int = 16, d_ff: int = 24):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.ModuleDict({"self_attn": _Attention(d, fused=i == 1), "mlp": _MLP(d, d_ff, fused=i == 1)})
                                    for i in range(2))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed_tokens(tokens)
        for block in self.layers:
            h = h + block["self_attn"](h)
            h = h + block["mlp"](h)
        return self.lm_head(self.norm(h))


def _targets_cases():
    """(tried, targets, r, alpha): the model is :func:`_targets_model` of the case's index."""
    return [
        ("labkit's TransformerLM (d_model 24, 2 layers, GQA: 4 query heads, 2 KV heads, d_ff 40)", ("q_proj", "v_proj"), 2, 4),
        ("labkit's TransformerLM, the MLP's w2, the attention's output and the LM head (a list that names w2 twice)",
         ["w2", "output_proj", "lm_head", "w2"], 3, 6),
        ("a Hugging Face-style model (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj in block 0; "
         "q_proj, kv_proj, o_proj, gate_up_proj, down_proj in block 1)", ("v_proj", "up_proj", "o_proj"), 4, 8),
    ]


def _targets_model(case: int) -> nn.Module:
    """Case ``case``'s model, the same one wherever it is built (seeded)."""
    torch.manual_seed(7 + case)
    if case == 2:
        return _HFStyleLM()
    return TransformerLM(ModelConfig(vocab_size=20, context_length=16, d_model=24, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=40))


def _targets_tokens(case: int) -> torch.Tensor:
    return torch.randint(20, (3, 7), generator=torch.Generator().manual_seed(11 + case))


def _selected(model: nn.Module, targets) -> dict[str, nn.Module]:
    """The linear layers whose last name component is one of ``targets``, exactly (the contract)."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, (nn.Linear, Linear)) and name.rpartition(".")[2] in set(targets)}


def _closed_form(model: nn.Module, targets, r: int) -> int:
    """The adapters' parameters: r * (d_in + d_out) per selected layer."""
    return sum(r * (layer.weight.shape[0] + layer.weight.shape[1]) for layer in _selected(model, targets).values())


def _probe_targets(fn) -> list[dict]:
    """Call ``fn(model, targets, r, alpha)`` on every case's model and exercise the result: which modules are now
    :class:`labkit.lora.LoRALinear` (each around the very layer that was there), which parameters train and how
    many, the output at init (``B = 0``: the model's own), and which parameters a backward pass reaches. Fails
    with a named mistake where it recognises one; returns what it saw for :func:`_judge_targets`."""
    seen = []
    for case, (what, targets, r, alpha) in enumerate(_targets_cases()):
        model = _targets_model(case)
        tried = f"lora_targets(model, {targets!r}, r={r}, alpha={alpha}) on {what}"
        tokens = _targets_tokens(case)
        with torch.no_grad():
            before = model(tokens)
        originals = {name: (module, module.weight.detach().clone()) for name, module in _selected(model, targets).items()}
        result = call(fn, tried, model, targets, r, alpha,
                      hint="run that call yourself and read the traceback (\"is already a LoRALinear\": a layer was "
                           "wrapped twice; select each layer once, by its exact name)")
        if result is not model:
            fail(tried, "None" if result is None else f"a {type(result).__name__} other than the model passed in",
                 "the model itself, modified in place", "wrap the layers inside the model you were given and `return model`")
        wrapped = {name: m for name, m in model.named_modules() if isinstance(m, L.LoRALinear)}
        after = dict(model.named_modules())
        own = [name for name in originals if name in after and not isinstance(after[name], (L.LoRALinear, nn.Linear, Linear))]
        if own:
            fail(tried, f"{own[0]} is a {type(after[own[0]]).__name__}", "labkit's L.LoRALinear around each selected layer",
                 "wrap with L.LoRALinear(layer, r, alpha): the graded part here is choosing the layers")
        extra, missing = sorted(set(wrapped) - set(originals)), sorted(set(originals) - set(wrapped))
        if extra:
            leaf = extra[0].rpartition(".")[2]
            near = next((t for t in targets if t in leaf), None)
            fail(tried, f"{extra[0]} wrapped", f"only the layers named exactly one of {list(targets)}: {sorted(originals)}",
                 f"'{leaf}' contains '{near}' but is another layer: compare the last component of the name "
                 "(name.rpartition('.')[2]) with the targets exactly, not by substring or endswith" if near else
                 "wrap only the linear layers whose last name component is one of the targets")
        if missing:
            fail(tried, f"{missing[0]} not wrapped" + (" (nothing was)" if not wrapped else ""),
                 f"every layer named one of {list(targets)}, in every block: {sorted(originals)}",
                 "named_modules() gives dotted paths ('layers.0.attn.q_proj'): compare their last component with the targets"
                 if not wrapped else "wrap every linear layer whose last name component is one of the targets, in every block")
        for name, layer in wrapped.items():
            base, w0 = originals[name]
            if (layer.r, layer.alpha) != (r, alpha):
                fail(tried, f"{name} with r={layer.r}, alpha={layer.alpha}", f"r={r}, alpha={alpha}", "pass r and alpha through")
            if layer.base is not base:
                same = isinstance(layer.base, type(base)) and layer.base.weight.shape == w0.shape and torch.equal(layer.base.weight.detach(), w0)
                if not same:
                    fail(tried, f"{name}.base is a new layer with other weights", f"the layer that was at {name}, wrapped",
                         "L.LoRALinear(model.get_submodule(name), r, alpha): wrap the existing layer; a new Linear has "
                         "fresh random weights, and the model forgets what it was trained to do")
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        adapters = {f"{name}.{k}" for name in wrapped for k in ("lora_A", "lora_B")}
        if trainable - adapters:
            fail(tried, f"{len(trainable - adapters)} other parameters still trainable, e.g. {sorted(trainable - adapters)[0]}",
                 "only the adapters' lora_A and lora_B trainable",
                 "freeze the whole model first (model.requires_grad_(False)), then wrap: LoRALinear freezes only its own base")
        if adapters - trainable:
            fail(tried, f"{sorted(adapters - trainable)[0]} frozen", "every adapter trainable",
                 "freeze before wrapping, not after: model.requires_grad_(False) after the wrap freezes the adapters too")
        count = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad)
        closed = _closed_form(_targets_model(case), targets, r)
        if count != closed:
            fail(tried, f"{count:,} trainable parameters", f"r * (d_in + d_out) summed over the selected layers = {closed:,}",
                 "one adapter per selected layer, nothing else trainable")
        model.train()
        out = call(model, tried + f"; model(tokens) right after, tokens {tuple(tokens.shape)}", tokens)
        if not _close(out, before, 1e-6):
            fail(tried + "; model(tokens) right after", _max_error(out, before) + " from the model before",
                 "exactly the model's output: every B is zero", "wrap the existing layers, in place, with L.LoRALinear")
        call(lambda: out.float().square().mean().backward(), tried + "; model(tokens).square().mean().backward()")
        grads = sorted(name for name, p in model.named_parameters() if p.grad is not None)
        reached = sorted(name for name in adapters if name.endswith("lora_B") and model.get_parameter(name).grad.abs().max() > 0)
        seen.append({"wrapped": sorted(wrapped), "trainable": sorted(trainable), "count": count, "out": out.detach().clone(),
                     "grads": grads, "reached": reached,
                     "bases_kept": all(torch.equal(layer.base.weight.detach(), originals[n][1]) for n, layer in wrapped.items())})
    return seen


def _judge_targets(seen) -> None:
    """The verdict on :func:`_probe_targets`'s record, recomputed here on the grader's own copies of the models."""
    cases = _targets_cases()
    if not isinstance(seen, list) or len(seen) != len(cases) or not all(isinstance(s, dict) for s in seen):
        fail("lora_targets: the models as they were wrapped where your function lives", "an incomplete record",
             f"one record per case ({len(cases)})", "run the grader cell as it is: it records what your function does")
    for case, ((what, targets, r, alpha), record) in enumerate(zip(cases, seen)):
        model = _targets_model(case)
        names = sorted(_selected(model, targets))
        adapters = sorted(f"{n}.{k}" for n in names for k in ("lora_A", "lora_B"))
        with torch.no_grad():
            expected = model(_targets_tokens(case))
        lora_bs = [a for a in adapters if a.endswith("lora_B")]
        checks = {
            f"exactly the layers {names} wrapped": record.get("wrapped") == names,
            "only their adapters trainable": record.get("trainable") == adapters,
            f"{_closed_form(model, targets, r):,} trainable parameters": record.get("count") == _closed_form(model, targets, r),
            "the model's own output at init": _tensor_like(record.get("out"), expected.shape, expected.dtype)
                                              and _close(record["out"], expected, 1e-6),
            "gradients in the adapters only, every lora_B reached": record.get("grads") == adapters and record.get("reached") == lora_bs,
            "the pretrained weights kept": record.get("bases_kept") is True,
        }
        for want, ok in checks.items():
            if not ok:
                fail(f"lora_targets(model, {targets!r}, r={r}, alpha={alpha}) on {what}, as it ran where your function lives",
                     f"not {want}", want, "the grader cell in your notebook says what is wrong; fix that and run it again")


def lora_targets(fn) -> None:
    """Grade ``fn(model, targets, r, alpha) -> model``: every linear layer (``torch.nn.Linear`` or
    ``labkit.nn.Linear``) whose last name component is exactly one of ``targets`` is replaced, in its parent,
    by ``L.LoRALinear(layer, r, alpha)`` around that very layer; every other parameter is frozen, the
    adapters train. Graded on labkit's TransformerLM and on a model with Hugging Face's names (fused
    ``kv_proj`` and ``gate_up_proj`` beside ``v_proj`` and ``up_proj``): the layers wrapped, the trainable
    parameters against ``r * (d_in + d_out)`` per layer, the output at init (``B = 0``) and where the
    gradients go. The learner's function runs where it lives (:func:`_probe_targets`), the verdict is
    :func:`_judge_targets`'s."""
    from labkit.checks._remote import Remote, apply

    _judge_targets(apply(_probe_targets, fn) if isinstance(fn, Remote) else _probe_targets(fn))
    passed("lora_targets", "exact names (fused kv_proj and gate_up_proj left alone), every block, the existing layers "
                           "wrapped in place, everything else frozen, r * (d_in + d_out) trainable per layer, the model "
                           "unchanged at init, gradients in the adapters only")


# ----------------------------------------------------------------------------- counting
def _count_cases():
    tiny = ModelConfig(vocab_size=15, context_length=64, d_model=64, num_layers=2, num_heads=4, d_ff=172)
    gqa = ModelConfig(vocab_size=1000, context_length=128, d_model=96, num_layers=3, num_heads=6, num_kv_heads=2, d_ff=256)
    qwen_like = ModelConfig(vocab_size=500, context_length=64, d_model=80, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=32, d_ff=200, qk_norm=True)
    mlp = ("w1", "w2", "w3")
    everything = ("q_proj", "k_proj", "v_proj", "output_proj", "w1", "w2", "w3")
    return [
        ("the chapter's tiny model (d_model 64, 2 layers, d_ff 172)", tiny, 8, ("q_proj", "v_proj")),
        ("the chapter's tiny model", tiny, 4, everything),
        ("GQA: d_model 96, 6 query heads, 2 KV heads of 16, 3 layers", gqa, 16, ("q_proj", "k_proj", "v_proj")),
        ("GQA, the MLP only (d_ff 256)", gqa, 2, mlp),
        ("head_dim 32 x 4 heads = 128 != d_model 80, 2 KV heads", qwen_like, 8, ("q_proj", "v_proj", "output_proj")),
        ("head_dim 32 x 4 heads, every linear layer but the LM head", qwen_like, 1, everything),
    ]


def lora_parameter_count(fn) -> None:
    """Grade ``fn(config, r, targets) -> int``: ``r * (d_in + d_out)`` summed over every layer of
    ``TransformerLM(config)`` named in ``targets`` (a tuple of names among ``q_proj, k_proj, v_proj,
    output_proj, w1, w2, w3``), in every one of the ``num_layers`` blocks. Mind grouped-query attention
    (``k_proj``/``v_proj`` output ``num_kv_heads * head_dim``) and ``head_dim`` (which may make
    ``num_heads * head_dim`` differ from ``d_model``)."""
    for tried, config, r, targets in _count_cases():
        tried = f"lora_parameter_count(config, r={r}, targets={targets}) for {tried}"
        got = call(fn, tried, config, r, targets)
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if isinstance(got, bool) or not isinstance(got, numbers.Integral):
            if isinstance(got, numbers.Real) and float(got).is_integer():
                got = int(got)
            else:
                fail(tried, f"a {type(got).__name__}: {got!r}", "an int", "return a whole number of parameters")
        expected = L.lora_parameter_count(config, r, targets)
        if got != expected:
            fail(tried, f"{got:,}", f"{expected:,}", _count_hint(config, r, targets, got))
    passed("lora_parameter_count", "r * (d_in + d_out) per adapted layer and block, with GQA and head_dim taken into account")


def _count_hint(config: ModelConfig, r: int, targets, got: int) -> str:
    shapes = {name.rpartition(".")[2]: (d_in, d_out) for name, d_in, d_out in L._layer_shapes(config, targets)
              if name.startswith("layers.0.")}
    layers, d = config.num_layers, config.d_model
    expected = L.lora_parameter_count(config, r, targets)

    def count(shape) -> int:  # the total if each targeted layer had shape(name, d_in, d_out)
        return layers * sum(r * sum(shape(n, d_in, d_out)) for n, (d_in, d_out) in shapes.items())

    if got == layers * sum(r * d_in * d_out for d_in, d_out in shapes.values()):
        return "an adapter is two thin matrices, A (r x d_in) and B (d_out x r): r * (d_in + d_out), not r * d_in * d_out"
    if got * layers == expected:
        return f"every one of the {layers} blocks has its own {', '.join(targets)}: multiply by num_layers"
    if got == expected + r * (d + config.vocab_size):
        return "the LM head is not among the targets: count only the layers named in targets"
    q_width = config.num_heads * config.dim_per_head
    if config.kv_heads != config.num_heads and got == count(lambda n, d_in, d_out: (d_in, q_width if n in ("k_proj", "v_proj") else d_out)):
        return "with grouped-query attention k_proj and v_proj output num_kv_heads * head_dim, fewer than q_proj"
    if got == count(lambda n, d_in, d_out: (d, d)):
        return ("not every layer is d_model x d_model: k_proj/v_proj output num_kv_heads * head_dim, w1/w3 output d_ff, "
                "w2 takes d_ff in, and q_proj/output_proj use num_heads * head_dim")
    if q_width != d and got == count(lambda n, d_in, d_out: (d if n == "output_proj" else d_in, d if n == "q_proj" else d_out)):
        return "the attention is num_heads * head_dim wide, which need not be d_model: q_proj outputs it, output_proj takes it in"
    return "sum r * (d_in + d_out) over the targeted layers of one block, times num_layers; look up each layer's shape in labkit/nn.py"
