"""Chapter 00: what a tensor is in memory, why initialization scale matters, what autograd records and
keeps, and what a training step costs in FLOPs and bytes."""
from __future__ import annotations

import math
import warnings
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from labkit.nn import ACTIVATIONS


def tensor_layout(t: torch.Tensor, base: torch.Tensor | None = None) -> dict:
    """How ``t`` sits in memory: shape, strides (elements to skip per index step), storage
    offset, contiguity, bytes of the storage it views, and whether it shares that storage
    with ``base`` (a view) or owns a separate one (a copy)."""
    layout = {
        "shape": tuple(t.shape),
        "stride": t.stride(),
        "offset": t.storage_offset(),
        "contiguous": t.is_contiguous(),
        "storage_bytes": t.untyped_storage().nbytes(),
    }
    if base is not None:
        layout["shares_storage"] = t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    return layout


def element_address(t: torch.Tensor, index: tuple[int, ...]) -> int:
    """Position in the underlying storage of ``t[index]``: ``offset + sum(i * stride)``."""
    if len(index) != t.dim():
        raise ValueError(f"index: expected {t.dim()} indices for a tensor of shape {tuple(t.shape)}, got {len(index)}")
    for i, (k, n) in enumerate(zip(index, t.shape)):
        if not 0 <= k < n:
            raise ValueError(f"index: index[{i}]={k} out of range for size {n}")
    return t.storage_offset() + sum(k * s for k, s in zip(index, t.stride()))


INIT_ACTIVATIONS = {"linear": lambda x: x, "tanh": torch.tanh, **ACTIVATIONS}


def second_moment_gain(activation: str, points: int = 101) -> float:
    """The weight scale ``s`` that keeps a layer's mean square at 1: with unit-Gaussian pre-activations ``z``,
    ``s = 1 / sqrt(E[f(z)^2])`` (He et al.'s argument, which gives sqrt(2) for ReLU), the expectation taken by
    Gauss-Hermite quadrature with ``points`` nodes (exact for polynomials of degree < 2 * points)."""
    if activation not in INIT_ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {sorted(INIT_ACTIVATIONS)}")
    nodes, weights = np.polynomial.hermite_e.hermegauss(points)  # weight exp(-z^2 / 2)
    values = INIT_ACTIVATIONS[activation](torch.from_numpy(nodes)).numpy()
    return float(1 / np.sqrt((weights * values**2).sum() / weights.sum()))


def recommended_gain(activation: str) -> tuple[float, str]:
    """``(gain, source)``: ``torch.nn.init.calculate_gain`` where PyTorch defines a gain for ``activation``
    (linear 1, ReLU sqrt(2), tanh 5/3, sigmoid 1), otherwise the :func:`second_moment_gain` (SiLU, GELU)."""
    if activation not in INIT_ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {sorted(INIT_ACTIVATIONS)}")
    if activation in ("linear", "relu", "tanh", "sigmoid"):
        return torch.nn.init.calculate_gain(activation), "torch.nn.init.calculate_gain"
    return second_moment_gain(activation), "second-moment gain"


@dataclass
class InitStatistics:
    """Per-layer root-mean-square of activations (forward) and of their gradients (backward)."""

    scale: float
    activation: str
    activation_rms: list[float]
    gradient_rms: list[float]


def init_statistics(scale: float, depth: int = 32, width: int = 256, activation: str = "tanh", batch: int = 512, seed: int = 0) -> InitStatistics:
    """Push a random batch through ``depth`` linear layers whose weights are drawn from
    ``N(0, scale^2 / width)`` (``scale = 1`` is LeCun init; ``sqrt(2)`` is He init, made for ReLU),
    each followed by ``activation`` (or none: ``"linear"``), and record the root-mean-square of every
    layer's output and of the gradient that flows back into it.

    For a linear stack each layer multiplies the RMS by ``scale``, so it grows or shrinks
    like ``scale ** depth``: the reason initialization scale matters.
    """
    if not scale > 0:
        raise ValueError(f"scale={scale}: expected a positive number")
    if activation not in INIT_ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {sorted(INIT_ACTIVATIONS)}")
    act = INIT_ACTIVATIONS[activation]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, width, generator=gen, requires_grad=True)
    outputs = []
    h = x
    for _ in range(depth):
        w = torch.randn(width, width, generator=gen) * (scale / math.sqrt(width))
        h = act(h @ w.T)
        h.retain_grad()
        outputs.append(h)
    # a loss whose gradient w.r.t. the last layer is unit-variance noise
    (h * torch.randn(h.shape, generator=gen)).sum().backward()
    return InitStatistics(
        scale=scale,
        activation=activation,
        activation_rms=[o.pow(2).mean().sqrt().item() for o in outputs],
        gradient_rms=[o.grad.pow(2).mean().sqrt().item() for o in outputs],
    )


# ----------------------------------------------------------------------------- autograd from the inside
def _check_tensor(value, name: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")


def _check_callable(fn, name: str = "fn") -> None:
    if not callable(fn):
        raise TypeError(f"{name}: expected a function to call (e.g. a lambda), got {type(fn).__name__}")


def _check_module(model, name: str = "model") -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{name}: expected a torch.nn.Module, got {type(model).__name__}")


def _shape_text(t: torch.Tensor) -> str:
    return f"[{', '.join(map(str, t.shape))}]"


def _saved_by(node) -> list[tuple[str, torch.Tensor]]:
    """The tensors a graph node keeps for its backward: built-in nodes expose them as ``_saved_<arg>``
    attributes (``None`` where autograd decided it does not need that input, e.g. a matmul's weight
    when nothing upstream needs the input's gradient); a custom ``autograd.Function`` as
    ``saved_tensors``. Raises RuntimeError once backward has freed them."""
    if hasattr(node, "saved_tensors"):  # a custom Function's node is its ctx
        return [(f"ctx[{i}]", t) for i, t in enumerate(node.saved_tensors)]
    found = []
    for attr in dir(node):
        if attr.startswith("_saved_") and not attr.endswith(("_sizes", "_strides")):  # sizes are tuples of ints, not tensors
            arg, value = attr[len("_saved_"):], getattr(node, attr)
            if isinstance(value, torch.Tensor):
                found.append((arg, value))
            elif isinstance(value, (list, tuple)):  # e.g. the index tensors of t[idx]
                found.extend((f"{arg}[{i}]", t) for i, t in enumerate(value) if isinstance(t, torch.Tensor))
    return found


def autograd_graph(tensor: torch.Tensor, names: dict | None = None, saved: bool = False) -> list[str]:
    """The graph autograd recorded to compute ``tensor``, one line per node, indented by depth.

    ``tensor.grad_fn`` is the node that will run first in backward (``MulBackward0``: the
    derivative of a ``*``); its ``next_functions`` are the nodes of its inputs, and so on down to
    ``AccumulateGrad`` nodes: the leaves (parameters) whose ``.grad`` backward fills. A leaf is
    labelled with its name in ``names`` (a ``{name: tensor}`` mapping, e.g.
    ``dict(model.named_parameters())``) and its shape. Inputs that need no gradient have no node.

    A node reached a second time (a tensor used by two ops) is printed once more as
    ``"<name> (shared, see above)"`` and not expanded again, so the list grows with the number of
    nodes, not with the number of paths through the graph. With ``saved=True`` each line also says
    which tensors the node keeps for backward (e.g. ``MmBackward0  saves self [3, 4] float32``);
    that needs the graph alive, i.e. before ``backward()`` frees it.
    """
    _check_tensor(tensor, "tensor")
    if tensor.grad_fn is None:
        raise ValueError("tensor: has no grad_fn: it is a leaf, or was computed without gradient tracking, "
                         "so autograd recorded no graph for it")
    if names is not None:
        if not isinstance(names, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in names.items()):
            raise TypeError("names: expected a dict {name: tensor}, e.g. dict(model.named_parameters())")
    label = {id(t): name for name, t in (names or {}).items()}
    lines, seen = [], set()
    stack = [(tensor.grad_fn, 0)]  # explicit stack, not recursion: a deep model's graph is thousands of nodes deep
    while stack:
        node, depth = stack.pop()
        kind = type(node).__name__
        pad = "  " * depth
        if node in seen:
            lines.append(f"{pad}{kind} (shared, see above)")
            continue
        seen.add(node)
        if kind == "AccumulateGrad":
            leaf = node.variable
            lines.append(f"{pad}AccumulateGrad: {label.get(id(leaf), 'leaf')} {_shape_text(leaf)}")
            continue
        text = f"{pad}{kind}"
        if saved:
            try:
                kept = _saved_by(node)
                text += "".join(f"  saves {arg} {_shape_text(t)} {str(t.dtype).removeprefix('torch.')}" for arg, t in kept)
            except RuntimeError:  # backward already ran and freed them
                text += "  (saved tensors freed by backward)"
        lines.append(text)
        children = [child for child, _ in node.next_functions if child is not None]
        stack.extend((child, depth + 1) for child in reversed(children))  # first input printed first
    return lines


def saved_tensor_bytes(fn, model: torch.nn.Module | None = None) -> int:
    """Bytes of the tensors autograd saves for backward while computing ``fn()``: what the
    forward pass leaves in memory until backward runs (the activations).

    Measured with :class:`labkit.memory.SavedTensorMeter` (``torch.autograd.graph.saved_tensors_hooks``
    sees every tensor an op saves): each storage counted once (views of one buffer are one
    allocation) and parameters left out, because they are model state and exist anyway:
    ``model``'s parameters if given, otherwise every leaf tensor that requires grad. ``fn`` must
    return its output (e.g. the loss): the output holds the graph, and the graph what it saved;
    the count is taken while it is alive, then the output is dropped, freeing the graph. (A tensor
    saved and freed again inside ``fn``, e.g. by a backward it runs, is not in the count.)
    """
    from labkit.memory import SavedTensorMeter

    _check_callable(fn)
    with SavedTensorMeter(model) as meter:
        result = fn()
    if result is None:
        raise ValueError("fn: returned None; return the output (e.g. the loss), which keeps the graph and what it saved alive")
    held = meter.activation_bytes
    del result
    return held


class StableSoftplus(torch.autograd.Function):
    """``softplus(x) = log(1 + e^x)`` with a hand-written backward.

    Forward as ``max(x, 0) + log1p(e^{-|x|})``: the exponent is never positive, so it cannot
    overflow (the naive ``log(1 + exp(x))`` is ``inf`` in fp32 from ``x ≈ 89``). Backward:
    ``d softplus / dx = sigmoid(x)``, from the one tensor it saves, ``x``; autograd, left to
    differentiate the four ops of the forward itself, would keep more (see the chapter).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)  # through save_for_backward, so saved_tensors_hooks (and the meter) see it
        return x.clamp_min(0) + torch.log1p(torch.exp(-x.abs()))

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad_output * torch.sigmoid(x)  # torch.sigmoid is itself stable at both ends


def softplus(x: torch.Tensor) -> torch.Tensor:
    """:class:`StableSoftplus` applied to a floating-point tensor ``x``."""
    _check_tensor(x, "x")
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got {x.dtype}")
    return StableSoftplus.apply(x)


@dataclass(frozen=True)
class HookRecord:
    """One call of a module hook. Forward: ``inputs`` / ``outputs`` are the module's input and
    output shapes. Backward: ``inputs`` are the shapes of the gradients arriving at the module's
    outputs (``grad_output``) and ``outputs`` those it sends on to its inputs (``grad_input``).
    ``None`` marks an argument that is not a tensor, or a gradient not computed (an input that
    needs none, like token ids)."""

    module: str
    phase: str  # "forward" | "backward"
    inputs: tuple
    outputs: tuple


def _shapes(values) -> tuple:
    values = values if isinstance(values, tuple) else (values,)
    return tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in values)


def record_module_shapes(model: torch.nn.Module, fn, names) -> list[HookRecord]:
    """Call ``fn()`` (e.g. a forward and a ``backward()``) with a forward hook
    (``register_forward_hook``) and a backward hook (``register_full_backward_hook``) on each of
    ``model``'s submodules named in ``names`` (names as in ``model.named_modules()``), and return what
    they saw, in the order they fired. The hooks are removed afterwards, even if ``fn`` raises."""
    _check_module(model)
    _check_callable(fn)
    if isinstance(names, str):
        names = [names]
    modules = dict(model.named_modules())
    names = list(names)
    if not names:
        raise ValueError("names: expected at least one submodule name, e.g. ['lm_head']")
    for name in names:
        if name not in modules:
            raise ValueError(f"names: {name!r} is not a submodule of the model (see model.named_modules())")
    records: list[HookRecord] = []
    handles = []
    for name in names:
        module = modules[name]
        handles.append(module.register_forward_hook(
            lambda mod, inputs, output, _name=name: records.append(HookRecord(_name, "forward", _shapes(inputs), _shapes(output)))))
        handles.append(module.register_full_backward_hook(
            lambda mod, grad_input, grad_output, _name=name: records.append(HookRecord(_name, "backward", _shapes(grad_output), _shapes(grad_input)))))
    try:
        with warnings.catch_warnings():
            # A module none of whose inputs needs a gradient (the embedding: its input is token ids) still gets
            # its backward hook, with grad_input (None,); PyTorch warns about exactly that, which is expected here.
            warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect to module outputs")
            fn()
    finally:
        for handle in handles:
            handle.remove()
    return records


def _aten_recorder():
    """A ``TorchDispatchMode`` that counts the ATen ops that reach the dispatcher, per ``phase``.

    The dispatcher is the layer below autograd where every tensor operation, forward or backward,
    becomes one call of an ATen operator (``aten.mm``, ``aten.mul``, ...) before a kernel runs:
    what the device actually executes, after Python and autograd are gone. Only the ``aten``
    namespace is counted (the optimizer's ``profiler`` markers do no computation)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class AtenRecorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.phase = "all"
            self.counts: dict[str, Counter] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "aten":
                self.counts.setdefault(self.phase, Counter())[f"aten.{func.overloadpacket.__name__}"] += 1
            return func(*args, **(kwargs or {}))

    return AtenRecorder()


def record_aten_ops(fn) -> Counter:
    """How many times each ATen op ran while calling ``fn()`` (forward, backward, anything):
    ``Counter({'aten.mm': 3, ...})``, from a ``TorchDispatchMode`` (see :func:`training_step_ops`)."""
    _check_callable(fn)
    with _aten_recorder() as recorder:
        fn()
    return recorder.counts.get("all", Counter())


def training_step_ops(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> dict[str, Counter]:
    """The ATen ops of one training step of ``model`` (a language model: ``model(x)`` gives logits)
    on the batch ``(x, y)``, by phase: ``"forward"`` (model and ``labkit.train.cross_entropy``),
    ``"backward"`` (``loss.backward()``) and ``"optimizer"`` (``optimizer.step()``).

    This takes a real step: the model's weights and the optimizer's state change (pass copies to
    keep the originals). ``labkit.train.train`` also clips the gradient norm and sets the learning
    rate in between; those are left out here."""
    from labkit.train import cross_entropy

    _check_module(model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _check_batch(x, y)
    with _aten_recorder() as recorder:
        recorder.phase = "forward"
        loss = cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        recorder.phase = "backward"
        loss.backward()
        recorder.phase = "optimizer"
        optimizer.step()
    return {phase: recorder.counts.get(phase, Counter()) for phase in ("forward", "backward", "optimizer")}


# ----------------------------------------------------------------------------- resource accounting
def _check_batch(x, y) -> None:
    _check_tensor(x, "x")
    _check_tensor(y, "y")
    if x.shape != y.shape or x.dim() != 2:
        raise ValueError(f"x, y: expected two [batch, seq] tensors of token ids of one shape, got {tuple(x.shape)} and {tuple(y.shape)}")


def _check_config(config) -> None:
    from labkit.model import ModelConfig

    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected a labkit.model.ModelConfig, got {type(config).__name__}")
    if config.moe is not None:
        # a token runs through top_k of the experts, not all their weights: the count is per active parameter
        raise ValueError("config.moe: the closed form here is for a dense model (labkit.moe counts mixture-of-experts FLOPs)")


def _positive_int(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r}: expected a positive integer")


def matmul_parameters(config) -> int:
    """The parameters of ``TransformerLM(config)`` that multiply activations in a matmul: per layer
    the four attention projections (q and output ``d x heads*head_dim``, k and v ``d x kv_heads*head_dim``)
    and the three GLU matrices (``3 d d_ff``), and the LM head (``d x vocab``). That is the
    non-embedding parameter count (``model.num_params(non_embedding=True)``) less the norms' gains,
    which only scale elementwise: the ``N`` of the ``2N`` FLOPs per token of a forward pass."""
    _check_config(config)
    d, hd = config.d_model, config.dim_per_head
    attention = d * config.num_heads * hd * 2 + d * config.kv_heads * hd * 2
    ffn = 3 * d * config.d_ff
    return config.num_layers * (attention + ffn) + d * config.vocab_size


def forward_flops(config, batch_size: int, seq_len: int) -> dict[str, int]:
    """FLOPs of the matmuls in one forward pass of ``TransformerLM(config)`` over ``batch_size``
    sequences of ``seq_len`` tokens (``D = batch_size * seq_len`` tokens), in closed form.

    A matmul ``[m, k] @ [k, n]`` is ``m n k`` multiply-adds, ``2 m n k`` FLOPs. Every weight
    matrix meets every token once: ``"weights" = 2 N D`` with ``N`` = :func:`matmul_parameters`.
    Attention adds two matmuls per layer whose size grows with the context, not with the weights:
    the scores ``Q K^T`` and the weighted sum ``P V``, each ``2 * seq_len * heads * head_dim`` FLOPs
    per token (``2 * seq_len * d_model`` for the usual ``heads * head_dim = d_model``):
    ``"attention" = 4 * num_layers * D * seq_len * heads * head_dim``. labkit's attention computes
    the whole ``seq x seq`` score matrix and masks the upper half, so that is what runs (a causal
    kernel could skip about half). Norms, RoPE, the activation and the softmax are elementwise,
    ``O(D d)``: not counted (``torch.utils.flop_counter`` does not count them either).
    ``"total"`` is the sum. Backward does two matmuls per forward matmul (gradient of the input
    and of the weight), so a training step is ``3 * total``: ``6 N D`` plus 3x the attention.
    """
    _check_config(config)
    _positive_int(batch_size, "batch_size")
    _positive_int(seq_len, "seq_len")
    if seq_len > config.context_length:
        raise ValueError(f"seq_len={seq_len}: exceeds config.context_length={config.context_length}")
    tokens = batch_size * seq_len
    weights = 2 * matmul_parameters(config) * tokens
    attention = 4 * config.num_layers * tokens * seq_len * config.num_heads * config.dim_per_head
    return {"weights": weights, "attention": attention, "total": weights + attention}


def measured_flops(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, int]:
    """FLOPs of ``model`` on the batch ``(x, y)`` as ``torch.utils.flop_counter.FlopCounterMode``
    counts them, op by op as they run (matmuls, convolutions, attention kernels; nothing elementwise):
    ``"forward"`` (model and ``labkit.train.cross_entropy``), ``"step"`` (forward + backward, by
    :func:`labkit.memory.training_step_flops`) and ``"backward"``, their difference. No optimizer
    step is taken, and the gradients are reset to ``None`` afterwards."""
    from torch.utils.flop_counter import FlopCounterMode

    from labkit.memory import training_step_flops
    from labkit.train import cross_entropy

    _check_module(model)
    _check_batch(x, y)
    with FlopCounterMode(display=False) as counter:
        loss = cross_entropy(model(x), y)
    del loss  # frees the graph: only the forward was wanted
    forward = counter.get_total_flops()
    step = training_step_flops(model, x, y)
    return {"forward": forward, "backward": step - forward, "step": step}


def training_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of the model state training keeps, measured on the real tensors: ``"params"`` (every
    parameter's storage once: tied weights count once), ``"grads"`` (the ``.grad`` tensors that
    exist now: none before the first backward, or after ``zero_grad(set_to_none=True)``),
    ``"optimizer_states"`` (the tensors in ``optimizer.state``: AdamW creates its two moments at its
    first step) and ``"total"``. The counting is :func:`labkit.memory.tensor_bytes` and
    :func:`labkit.memory.optimizer_state_bytes`; the keys match :class:`labkit.memory.MemoryBreakdown`'s,
    so a prediction by :func:`labkit.memory.model_state_bytes` compares key by key."""
    from labkit.memory import optimizer_state_bytes, tensor_bytes

    _check_module(model)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    params = list(model.parameters())
    state = {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer_states": optimizer_state_bytes(optimizer) if optimizer is not None else 0,
    }
    return {**state, "total": sum(state.values())}
