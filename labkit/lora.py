"""Chapter 05, LoRA and parameter-efficient fine-tuning: what full fine-tuning costs, and how to
adapt a model by training a few low-rank matrices instead.

Everything is written out in PyTorch so it can be read line by line:

* **The layer** - :class:`LoRALinear` wraps a frozen linear layer ``W0`` (a
  :class:`labkit.nn.Linear`, a ``torch.nn.Linear`` or a 4-bit :class:`labkit.quant.QuantLinear`)
  and adds ``scaling * B A x`` with ``A: [r, d_in]`` (Kaiming-uniform) and ``B: [d_out, r]``
  (zeros), ``scaling = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA): Hugging Face PEFT's
  conventions and names.
* **A model** - :func:`apply_lora` wraps the layers whose names match ``targets`` (or
  ``"all-linear"``) and freezes everything else; :func:`merge_lora` / :func:`unmerge_lora` fold
  ``scaling * B A`` into ``W0`` and back; :func:`merge_and_unload` leaves plain layers
  (:func:`merge_and_requantize`: into a 4-bit base, and what that costs);
  :func:`lora_state_dict` / :func:`load_lora_state_dict` save and swap adapters;
  :func:`trainable_parameters` and :func:`lora_parameter_count` count.
* **Variants** - :class:`DoRALinear` (DoRA, Liu et al., 2024: a trained magnitude per output feature times
  the normalised direction ``W0 + scaling * B A``; ``apply_lora(..., use_dora=True)``) and
  :func:`loraplus_param_groups` (LoRA+, Hayou et al., 2024: ``B`` at a larger learning rate than ``A``).
* **Memory** - :func:`finetune_memory`: weights, gradients, optimizer states, master weights,
  activations, adapters and quantization scales of full fine-tuning, LoRA and QLoRA, predicted from
  a :class:`~labkit.model.ModelConfig` (activations: chapter 07's :func:`labkit.memory.activation_terms`
  for full fine-tuning, :func:`lora_activation_terms` when the base is frozen), and
  :func:`measure_training_memory`, the same bytes measured on a real step.
* **QLoRA** - over a :class:`~labkit.quant.QuantLinear` base the weight is dequantized on the fly
  and again in the backward pass (never stored in 16/32 bits); :func:`apply_lora` turns the
  quantized layers it leaves without adapters into :class:`FrozenQuantLinear`, which does the same.
* **Experiments** - :func:`subtraction_task` (the new task), :func:`finetune` (supervised
  fine-tuning on the answers), :func:`finetune_run` (one row of the chapter's comparison),
  :func:`answer_loss`, :func:`update_spectrum`, and :func:`rank_explorer`, the widget's callback.
"""
from __future__ import annotations

import contextlib
import copy
import fnmatch
import math
from dataclasses import dataclass

import torch
from torch import nn

from labkit.data import ArithmeticTask
from labkit.hardware import timeit
from labkit.memory import (DTYPES, OPTIMIZER_STATES, SavedTensorMeter, activation_terms, model_state_bytes,
                           optimizer_state_bytes, tensor_bytes)
from labkit.model import ModelConfig, TransformerLM
from labkit.nn import Linear
from labkit.quant import QuantLinear
from labkit.runtime import run_seed
from labkit.train import AdamW, clip_grad_norm, cross_entropy, lr_cosine_schedule

ALL_LINEAR = "all-linear"
DEFAULT_TARGETS = ("q_proj", "v_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "output_proj")
MLP = ("w1", "w2", "w3")
OUTPUT_LAYER = "lm_head"

# LLaMA-65B (Touvron et al., 2023, Table 2): the model QLoRA fine-tuned on one 48 GB GPU. labkit's
# TransformerLM builds it exactly (RMSNorm, SwiGLU, RoPE, untied embeddings): 65.29B parameters.
LLAMA_65B = ModelConfig(vocab_size=32000, context_length=2048, d_model=8192, num_layers=80, num_heads=64, d_ff=22016)


# ============================================================================ the layer
class _FrozenQuantMatmul(torch.autograd.Function):
    """``x @ dequant(W)^T`` for a frozen quantized layer, recomputing the dequantization in the
    backward pass: only the 4-bit codes are kept, never a 16/32-bit copy of ``W`` (as
    bitsandbytes' 4-bit matmul does). No tensor is saved for backward."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return layer(x)

    @staticmethod
    def backward(ctx, grad):
        weight = ctx.layer.dequantized_weight(grad.dtype)  # [d_out, d_in]
        return grad @ weight, None


class FrozenQuantLinear(QuantLinear):
    """A :class:`labkit.quant.QuantLinear` that never keeps its dequantized weight for the backward
    pass: when the input requires a gradient, ``forward`` goes through the same recomputing matmul as
    a QLoRA adapter's base. (A plain ``QuantLinear`` computes ``x @ dequant(W)^T`` with autograd,
    which saves the full-precision ``dequant(W)`` of every layer the gradient flows through.)
    :func:`apply_lora` gives the quantized layers it does not adapt this class; their buffers and
    state-dict keys are unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return _FrozenQuantMatmul.apply(x, self)  # its forward runs without grad: the branch below
        return super().forward(x)


def _linear_shape(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, (Linear, QuantLinear)):
        return module.d_in, module.d_out
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    raise TypeError(f"base: expected labkit.nn.Linear, labkit.quant.QuantLinear or torch.nn.Linear, got {type(module).__name__}")


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, (Linear, QuantLinear, nn.Linear))


def lora_scaling(alpha: float, r: int, use_rslora: bool = False) -> float:
    """The factor in front of ``B A``: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA (Kalajdzievski,
    2023), which keeps the update's size from shrinking as the rank grows."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


class LoRALinear(nn.Module):
    """``y = W0 x + scaling * B (A dropout(x))`` around a frozen ``base`` layer (Hu et al., 2021).

    * ``lora_A``: ``[r, d_in]``, Kaiming-uniform (``a = sqrt(5)``, as ``torch.nn.Linear`` and PEFT
      initialise it); ``lora_B``: ``[d_out, r]``, zeros, so the wrapped layer computes exactly what
      ``base`` did until ``B`` is trained. The update ``B A`` has the shape of ``W0`` (``[d_out, d_in]``).
    * ``scaling = alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``): changing ``r`` at fixed
      ``alpha`` keeps the initial update size comparable, so the learning rate need not be retuned.
    * ``base`` is frozen (``requires_grad=False`` on its weight and bias); only ``lora_A`` and
      ``lora_B`` train. ``base`` may be a :class:`labkit.nn.Linear`, a ``torch.nn.Linear`` (bias
      allowed) or a :class:`labkit.quant.QuantLinear` (QLoRA): the 4-bit weight is dequantized on the
      fly in the forward pass and again in the backward pass, never stored in 16/32 bits.
    * ``adapter_dtype``: the adapters' dtype (default: the base weight's, fp32 over a quantized
      base). As in PEFT, the input is cast to it, the adapter path computed in it, and the sum cast
      back to the base output's dtype.
    * ``dropout`` applies to the adapter's input only, in training mode; the base path never sees it.
    * :meth:`merge` adds ``scaling * B A`` into the base weight (then ``forward`` is just the base
      layer, no extra latency); :meth:`unmerge` subtracts it again.
    """

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False,
                 adapter_dtype: torch.dtype | None = None):
        super().__init__()
        if isinstance(base, LoRALinear):
            raise TypeError("base: is already a LoRALinear; wrap the plain layer (or unload the adapter first)")
        d_in, d_out = _linear_shape(base)
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"r={r!r}: expected a positive integer (the adapter's rank)")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
            raise ValueError(f"alpha={alpha!r}: expected a positive number")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout!r}: expected a probability in [0, 1)")
        if isinstance(base, QuantLinear):
            device, default_dtype = base.qweight.device, torch.float32
        else:
            device, default_dtype = base.weight.device, base.weight.dtype
        dtype = default_dtype if adapter_dtype is None else adapter_dtype
        if not dtype.is_floating_point:
            raise TypeError(f"adapter_dtype={dtype}: expected a floating-point dtype")
        self.base = base
        base.requires_grad_(False)
        self.d_in, self.d_out, self.r, self.alpha, self.use_rslora = d_in, d_out, r, alpha, use_rslora
        self.scaling = lora_scaling(alpha, r, use_rslora)
        self.lora_A = nn.Parameter(torch.empty(r, d_in, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(d_out, r, device=device, dtype=dtype))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """``A`` Kaiming-uniform, ``B`` zero: the update ``B A`` starts at exactly zero."""
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    @property
    def quantized(self) -> bool:
        return isinstance(self.base, QuantLinear)

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized and torch.is_grad_enabled() and x.requires_grad:
            return _FrozenQuantMatmul.apply(x, self.base)
        return self.base(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_forward(x)
        if self.merged:
            return result
        x = x.to(self.lora_A.dtype)
        update = (self.lora_dropout(x) @ self.lora_A.T) @ self.lora_B.T * self.scaling
        return (result + update).to(result.dtype)

    def delta_weight(self) -> torch.Tensor:
        """``scaling * B A``, ``[d_out, d_in]`` like the base weight, computed in fp32."""
        return (self.lora_B.detach().float() @ self.lora_A.detach().float()) * self.scaling

    def adapter_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters this layer trains, by name: what :func:`lora_state_dict` saves."""
        return {"lora_A": self.lora_A, "lora_B": self.lora_B}

    def merged_weight(self, w0: torch.Tensor) -> torch.Tensor:
        """The weight of the merged layer, in fp32, from the base weight ``w0``: ``W0 + scaling * B A``."""
        return w0.float() + self.delta_weight()

    def unmerged_weight(self, merged: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`merged_weight`, in fp32."""
        return merged.float() - self.delta_weight()

    @torch.no_grad()
    def merge(self) -> None:
        """``W0 <- W0 + scaling * B A`` (in fp32, stored back in the weight's dtype); a no-op if merged.

        No dropout is involved: dropout is a training-time noise on the adapter's input, and the
        merged layer must compute what the unmerged one computes in eval mode."""
        if self.merged:
            return
        if self.quantized:
            raise ValueError("merge: the base is 4-bit; W0 + BA is not representable in its codes. "
                             "Use merge_and_unload(model), which replaces the layer by a full-precision one")
        weight = self.base.weight
        weight.copy_(self.merged_weight(weight).to(weight.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """``W0 <- W0 - scaling * B A``: back to the base weight (up to rounding in 16-bit dtypes)."""
        if not self.merged:
            return
        weight = self.base.weight
        weight.copy_(self.unmerged_weight(weight).to(weight.dtype))
        self.merged = False

    @torch.no_grad()
    def merged_linear(self, dtype: torch.dtype | None = None) -> nn.Module:
        """A plain layer computing what this one computes in eval mode: a :class:`labkit.nn.Linear`
        with ``W0 + scaling * B A`` (a quantized base is dequantized first), or for a
        ``torch.nn.Linear`` base a copy of it with the merged weight."""
        if self.quantized:
            merged = self.merged_weight(self.base.dequantized_weight(torch.float32))
            dtype = dtype or torch.float32
        else:
            merged = self.base.weight.float() if self.merged else self.merged_weight(self.base.weight)
            dtype = dtype or self.base.weight.dtype
        if isinstance(self.base, nn.Linear):
            layer = copy.deepcopy(self.base).to(dtype)
        else:
            layer = Linear(self.d_in, self.d_out, device=merged.device, dtype=dtype)
        layer.weight.copy_(merged.to(dtype))
        layer.requires_grad_(False)
        return layer

    def extra_repr(self) -> str:
        return (f"d_in={self.d_in}, d_out={self.d_out}, r={self.r}, alpha={self.alpha:g}, scaling={self.scaling:.4g}"
                f"{', rslora' if self.use_rslora else ''}{', merged' if self.merged else ''}")


class DoRALinear(LoRALinear):
    """DoRA, weight-decomposed low-rank adaptation (Liu et al., 2024): the adapted weight is split into a
    magnitude and a direction, ``W' = m * (W0 + scaling * B A) / ||W0 + scaling * B A||``, the norm taken
    per output feature (over each row of the ``[d_out, d_in]`` weight). ``m`` (``lora_magnitude_vector``,
    ``[d_out]``) trains beside ``A`` and ``B`` and starts at ``||W0||``, so the layer starts as ``base``.

    As the paper recommends (section 4.3) and PEFT does, the norm is treated as a constant in the backward
    pass (computed without gradient): the gradient reaches ``m`` and ``B A`` through the numerator only, and
    no ``[d_out, d_in]`` tensor is kept for backward. In the forward pass
    ``y = base(x) + (m / n - 1) W0 x' + (m / n) scaling B A x'`` (``x'`` the dropped-out input, ``n`` the
    norm), PEFT's form: with dropout off it is ``(m / n) (W0 + scaling B A) x`` plus the base's bias.
    It costs a ``d_out x d_in`` product ``B A`` per forward pass (plain LoRA never forms it) and ``d_out``
    more trainable parameters per layer. Merging folds ``m / n`` into the weight as well."""

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False,
                 adapter_dtype: torch.dtype | None = None):
        super().__init__(base, r, alpha, dropout, use_rslora, adapter_dtype)
        with torch.no_grad():
            norm = self._direction_norm(self._base_weight())
        self.lora_magnitude_vector = nn.Parameter(norm)
        self._merged_norm = None  # the norm at merge time, for unmerge

    def _base_weight(self) -> torch.Tensor:
        """``W0`` (dequantized over a 4-bit base) in the adapters' dtype, without gradient."""
        if self.quantized:
            weight = self.base.dequantized_weight(self.lora_A.dtype)
        else:
            weight = self.base.weight.to(self.lora_A.dtype)
        return weight.detach()

    @torch.no_grad()
    def _direction_norm(self, w0: torch.Tensor) -> torch.Tensor:
        """``||W0 + scaling * B A||`` per output feature, ``[d_out]``, as a constant (no gradient)."""
        return torch.linalg.vector_norm(w0 + self.scaling * (self.lora_B @ self.lora_A), dim=1)

    def adapter_parameters(self) -> dict[str, nn.Parameter]:
        return {**super().adapter_parameters(), "lora_magnitude_vector": self.lora_magnitude_vector}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_forward(x)
        if self.merged:
            return result
        x = x.to(self.lora_A.dtype)
        dropped = self.lora_dropout(x)
        w0 = self._base_weight()
        scale = self.lora_magnitude_vector / self._direction_norm(w0)  # [d_out]
        if isinstance(self.lora_dropout, nn.Identity):
            bias = getattr(self.base, "bias", None)
            base_out = result.to(x.dtype) if bias is None else (result - bias).to(x.dtype)  # W0 x
        else:
            base_out = dropped @ w0.T  # W0 x', as PEFT: the magnitude's correction sees the dropped input
        lora = (dropped @ self.lora_A.T) @ self.lora_B.T * self.scaling
        return (result + (scale - 1) * base_out + scale * lora).to(result.dtype)

    def merged_weight(self, w0: torch.Tensor) -> torch.Tensor:
        direction = w0.float() + self.delta_weight()
        norm = torch.linalg.vector_norm(direction, dim=1, keepdim=True)
        self._merged_norm = norm  # the merged weight's rows have norm m: n cannot be read back from it
        return self.lora_magnitude_vector.detach().float()[:, None] / norm * direction

    def unmerged_weight(self, merged: torch.Tensor) -> torch.Tensor:
        return merged.float() * (self._merged_norm / self.lora_magnitude_vector.detach().float()[:, None]) - self.delta_weight()


# ============================================================================ a model
def _matches(name: str, targets) -> bool:
    if targets == ALL_LINEAR:
        return name.rpartition(".")[2] != OUTPUT_LAYER
    if isinstance(targets, str):
        targets = (targets,)
    return any(fnmatch.fnmatchcase(name, t) or name.rpartition(".")[2] == t for t in targets)


def target_modules(model: nn.Module, targets=DEFAULT_TARGETS) -> list[str]:
    """Names of the linear layers of ``model`` that ``targets`` selects.

    ``targets``: ``"all-linear"`` (every linear layer except the output layer ``lm_head``, as
    PEFT's ``target_modules="all-linear"``), or a name or a sequence of them, each matching a
    layer's last name component (``"q_proj"``) or its full name as an ``fnmatch`` pattern
    (``"layers.1.*"``)."""
    if not (isinstance(targets, str) or (isinstance(targets, (tuple, list, set, frozenset)) and targets
                                           and all(isinstance(t, str) for t in targets))):
        raise TypeError(f"targets={targets!r}: expected {ALL_LINEAR!r}, a name or a non-empty sequence of names")
    wrapped = [name for name, module in model.named_modules() if isinstance(module, LoRALinear)]
    inside = lambda name: any(name.startswith(f"{w}.") or not w for w in wrapped)  # noqa: E731  (a LoRALinear's own base)
    return [name for name, module in model.named_modules()
            if name and (_is_linear(module) or isinstance(module, LoRALinear)) and not inside(name) and _matches(name, targets)]


def apply_lora(model: nn.Module, targets=DEFAULT_TARGETS, r: int = 8, alpha: float = 16, dropout: float = 0.0,
               use_rslora: bool = False, adapter_dtype: torch.dtype | None = None, use_dora: bool = False) -> nn.Module:
    """Freeze every parameter of ``model`` and wrap each linear layer selected by ``targets``
    (:func:`target_modules`) in a :class:`LoRALinear` (a :class:`DoRALinear` with ``use_dora``, PEFT's
    ``LoraConfig(use_dora=True)``). Modifies ``model`` in place (like PEFT's
    ``get_peft_model``) and returns it; ``copy.deepcopy`` the model first to keep the original.
    Raises if nothing matches or a selected layer already carries an adapter."""
    names = target_modules(model, targets)
    if not names:
        linears = [n for n, m in model.named_modules() if _is_linear(m)]
        raise ValueError(f"targets={targets!r}: no linear layer matches; the model's linear layers are {linears[:12]}"
                         f"{' ...' if len(linears) > 12 else ''}")
    wrapped = [n for n in names if isinstance(model.get_submodule(n), LoRALinear)]
    if wrapped:
        raise ValueError(f"{wrapped[0]}: already has a LoRA adapter")
    model.requires_grad_(False)
    for module in model.modules():
        if type(module) is QuantLinear:  # frozen 4-bit layers recompute their weight in backward (QLoRA)
            module.__class__ = FrozenQuantLinear
    for name in names:
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        layer = DoRALinear if use_dora else LoRALinear
        setattr(holder, child, layer(holder.get_submodule(child), r, alpha, dropout, use_rslora, adapter_dtype))
    return model


def loraplus_param_groups(model: nn.Module, lr: float, lr_ratio: float = 16.0) -> list[dict]:
    """Optimizer parameter groups for LoRA+ (Hayou et al., 2024): every adapter's ``B`` at ``lr_ratio * lr``,
    ``A`` at ``lr``. With ``B = 0`` at the start and ``A`` random, one learning rate for both is inefficient
    at large width; the paper's fix is a larger one for ``B`` (it suggests ratios around 16).
    As PEFT's ``create_loraplus_optimizer``, the other one-dimensional trainable parameters (DoRA's
    magnitudes, biases) go with ``B``, the remaining trainable ones with ``A``. Each group carries its
    ``lr``, for any ``torch.optim`` optimizer: ``AdamW(loraplus_param_groups(model, 1e-3))``."""
    if not lr > 0 or not lr_ratio > 0:
        raise ValueError(f"lr={lr!r}, lr_ratio={lr_ratio!r}: expected two positive numbers")
    adapters = lora_layers(model)
    if not adapters:
        raise ValueError("model: has no LoRA adapter; apply_lora(model, ...) first")
    b_ids = {id(layer.lora_B) for layer in adapters.values()}
    slow, fast = [], []
    for parameter in {id(p): p for p in model.parameters()}.values():
        if parameter.requires_grad:
            (fast if id(parameter) in b_ids or parameter.dim() == 1 else slow).append(parameter)
    return [{"params": slow, "lr": lr}, {"params": fast, "lr": lr * lr_ratio}]


# ============================================================================ IA3 and the map of PEFT methods
IA3_TARGETS = ("k_proj", "v_proj", "w2")  # PEFT's defaults for Llama: k_proj, v_proj and down_proj (labkit's w2)
IA3_FEEDFORWARD = ("w2",)


class IA3Linear(nn.Module):
    """(IA)^3, "infused adapter by inhibiting and amplifying inner activations" (Liu et al., 2022): a frozen
    linear layer whose output features (or, on a feed-forward layer, input features) are multiplied by a trained
    vector ``ia3_l``, initialised to ones, so the layer starts as ``base``. ``y = base(x) * l`` (``l``: ``[d_out]``)
    or, with ``feedforward``, ``y = base(x * l)`` (``l``: ``[d_in]``), as PEFT's ``IA3Config`` computes it.
    One number per feature and no rank: the fewest parameters of the adapter methods, and nothing to merge but a
    rescaling of ``W0``'s rows (or columns)."""

    def __init__(self, base: nn.Module, feedforward: bool = False):
        super().__init__()
        if isinstance(base, (LoRALinear, IA3Linear)):
            raise TypeError("base: already carries an adapter; wrap the plain layer")
        d_in, d_out = _linear_shape(base)
        weight = base.qweight if isinstance(base, QuantLinear) else base.weight
        dtype = torch.float32 if isinstance(base, QuantLinear) else weight.dtype
        self.base, self.feedforward, self.d_in, self.d_out = base, feedforward, d_in, d_out
        base.requires_grad_(False)
        self.ia3_l = nn.Parameter(torch.ones(d_in if feedforward else d_out, device=weight.device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.feedforward:
            return self.base(x * self.ia3_l.to(x.dtype))
        return self.base(x) * self.ia3_l.to(x.dtype)

    def adapter_parameters(self) -> dict[str, nn.Parameter]:
        return {"ia3_l": self.ia3_l}

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, scales the {'input' if self.feedforward else 'output'}"


def apply_ia3(model: nn.Module, targets=IA3_TARGETS, feedforward=IA3_FEEDFORWARD) -> nn.Module:
    """Freeze ``model`` and wrap each linear layer selected by ``targets`` (:func:`target_modules`) in an
    :class:`IA3Linear`, scaling the input of those also matched by ``feedforward`` and the output of the others
    (PEFT's ``IA3Config(target_modules, feedforward_modules)``). In place; returns ``model``."""
    names = target_modules(model, targets)
    if not names:
        raise ValueError(f"targets={targets!r}: no linear layer matches (a wrapped layer is no longer one)")
    model.requires_grad_(False)
    for name in names:
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        setattr(holder, child, IA3Linear(holder.get_submodule(child), feedforward=_matches(name, feedforward)))
    return model


def ia3_layers(model: nn.Module) -> dict[str, IA3Linear]:
    """Every :class:`IA3Linear` of ``model`` by name."""
    return {name: module for name, module in model.named_modules() if isinstance(module, IA3Linear)}


def peft_parameter_counts(config: ModelConfig, *, virtual_tokens: int = 10, bottleneck: int = 8, r: int = 4,
                          lora_targets=ALL_LINEAR, ia3_targets=IA3_TARGETS, ia3_feedforward=IA3_FEEDFORWARD) -> dict[str, int]:
    """Trainable parameters of the common PEFT methods on ``TransformerLM(config)``, exactly:

    * ``prompt tuning`` (Lester et al., 2021): ``virtual_tokens`` trained input embeddings, ``virtual_tokens * d_model``;
    * ``prefix tuning`` (Li and Liang, 2021; without its reparametrisation MLP, as PEFT stores it): a trained key and
      value per virtual token in every layer, ``virtual_tokens * num_layers * 2 * kv_heads * head_dim``;
    * ``IA3`` (Liu et al., 2022): one scale per output feature of ``ia3_targets`` (per input feature of
      ``ia3_feedforward``), in every block;
    * ``adapters (Houlsby)`` (Houlsby et al., 2019): two bottleneck MLPs per block (after attention and after the
      feed-forward), each ``d_model -> bottleneck -> d_model`` with biases, ``2 * (2 * d_model * bottleneck +
      bottleneck + d_model)`` per block;
    * ``LoRA r=<r>``: :func:`lora_parameter_count` of ``lora_targets``."""
    _check_positive_int(virtual_tokens=virtual_tokens, bottleneck=bottleneck, r=r)
    d, layers = config.d_model, config.num_layers
    ia3 = sum(d_in if _matches(name, ia3_feedforward) else d_out for name, d_in, d_out in _layer_shapes(config, ia3_targets))
    return {"prompt tuning": virtual_tokens * d,
            "prefix tuning": virtual_tokens * layers * 2 * config.kv_heads * config.dim_per_head,
            "IA3": ia3,
            "adapters (Houlsby)": layers * 2 * (2 * d * bottleneck + bottleneck + d),
            f"LoRA r={r}": lora_parameter_count(config, r, lora_targets)}


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Every :class:`LoRALinear` of ``model`` by name (``model`` itself under ``""`` if it is one)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LoRALinear)}


def merge_lora(model: nn.Module) -> nn.Module:
    """Merge every adapter into its base weight (:meth:`LoRALinear.merge`); returns ``model``."""
    for layer in lora_layers(model).values():
        layer.merge()
    return model


def unmerge_lora(model: nn.Module) -> nn.Module:
    """Undo :func:`merge_lora` (:meth:`LoRALinear.unmerge`); returns ``model``."""
    for layer in lora_layers(model).values():
        layer.unmerge()
    return model


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Replace every :class:`LoRALinear` by the plain layer it computes (:meth:`LoRALinear.merged_linear`),
    in place: the model is again an ordinary one, with no trace of the adapters (PEFT's
    ``merge_and_unload``). Over a quantized base the merged layer is full precision."""
    for name, layer in lora_layers(model).items():
        if not name:
            raise TypeError("model: is a LoRALinear itself; call its merged_linear()")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer.merged_linear())
    return model


@torch.no_grad()
def merge_and_requantize(model: nn.Module) -> tuple[nn.Module, dict[str, dict[str, float]]]:
    """What merging adapters into their 4-bit base costs (:meth:`LoRALinear.merge` refuses it): every adapter of
    ``model``, each over a :class:`labkit.quant.QuantLinear`, is folded into its layer's weight and the sum quantized
    again, ``W' = quant(dequant(W0) + scaling * B A)`` (DoRA: its merged weight), in the base's format, group size
    and scale dtype; the adapter layer is replaced, in place, by that :class:`~labkit.quant.QuantLinear`.

    Returns ``model`` and, per replaced layer, the Frobenius norms ``update`` (of what the adapter adds,
    ``W - dequant(W0)``, with ``W`` the exact merged weight) and ``error`` (of ``dequant(W') - W``, the
    requantization's rounding), and ``relative_error``, their ratio: near 1 and the merged 4-bit model has lost
    about as much as the adapter added. ``ValueError`` for an adapter over a full-precision layer (merge that
    with :func:`merge_lora`) or over a layer with AWQ/SmoothQuant input scales or quantized activations."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("model: has no LoRA adapters to merge")
    report = {}
    for name, layer in layers.items():
        if not name:
            raise TypeError("model: is a LoRALinear itself; wrap it in a module")
        base = layer.base
        if not isinstance(base, QuantLinear):
            raise ValueError(f"{name}: its base is full precision; merge it with merge_lora (no requantization needed)")
        if base.input_scale is not None or base.act_bits is not None:
            raise ValueError(f"{name}: a base with input scales or quantized activations is not requantized here")
        w0 = base.dequantized_weight(torch.float32)
        merged = layer.merged_weight(w0)
        plain = Linear(layer.d_in, layer.d_out, device=merged.device)
        plain.weight.copy_(merged)
        requantized = QuantLinear.from_linear(plain, "nf4" if base.fmt == "nf4" else "int", base.group_size,
                                              bits=None if base.fmt == "nf4" else base.bits, symmetric=base.symmetric,
                                              scale_dtype=base.scales.dtype)
        update = (merged - w0).norm().item()
        error = (requantized.dequantized_weight(torch.float32) - merged).norm().item()
        report[name] = {"update": update, "error": error, "relative_error": error / update if update else math.inf}
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, requantized.requires_grad_(False))
    return model, report


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters only, ``{"<layer>.lora_A": ..., "<layer>.lora_B": ...}``, as detached copies:
    a few KB where the model's state dict holds every weight. Load with :func:`load_lora_state_dict`."""
    state = {}
    for name, layer in lora_layers(model).items():
        prefix = f"{name}." if name else ""
        for key, parameter in layer.adapter_parameters().items():
            state[prefix + key] = parameter.detach().clone()
    return state


@torch.no_grad()
def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """Copy adapters saved by :func:`lora_state_dict` into ``model``'s adapters (same layers, same
    ranks), e.g. to swap one task's adapter for another's on the same base. The adapters must not
    be merged (the merged weight would keep the old update)."""
    layers = lora_layers(model)
    expected = set(lora_state_dict(model)) if layers else set()
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise KeyError(f"state: missing keys {missing[:4]}, unexpected keys {unexpected[:4]}")
    for name, layer in layers.items():
        if layer.merged:
            raise ValueError(f"{name or 'model'}: is merged; unmerge_lora(model) before loading another adapter")
        prefix = f"{name}." if name else ""
        for key, target in layer.adapter_parameters().items():
            source = state[prefix + key]
            if source.shape != target.shape:
                raise ValueError(f"{prefix + key}: shape {tuple(source.shape)}, the model's adapter is {tuple(target.shape)}")
            target.copy_(source)
    return model


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts (shared tensors once). ``total`` includes the weights
    of quantized layers (:class:`labkit.quant.QuantLinear` keeps them as buffers of codes)."""
    unique = {id(p): p for p in model.parameters()}.values()
    trainable = sum(p.numel() for p in unique if p.requires_grad)
    quantized = sum(m.d_in * m.d_out for m in model.modules() if isinstance(m, QuantLinear))
    return trainable, sum(p.numel() for p in unique) + quantized


_SHAPES: dict[str, tuple[int, list[tuple[str, int, int]]]] = {}  # repr(config) -> (parameters, every linear layer)


def _model_layout(config: ModelConfig) -> tuple[int, list[tuple[str, int, int]]]:
    """Parameter count and ``(name, d_in, d_out)`` of every linear layer of ``TransformerLM(config)``,
    built once per config on the meta device (no memory) and remembered."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected a labkit.model.ModelConfig, got {type(config).__name__}")
    key = repr(config)
    if key not in _SHAPES:
        model = TransformerLM(config, device="meta")
        layers = [(name, *_linear_shape(module)) for name, module in model.named_modules() if _is_linear(module)]
        _SHAPES[key] = (model.num_params(), layers)
    return _SHAPES[key]


def _layer_shapes(config: ModelConfig, targets) -> list[tuple[str, int, int]]:
    """``(name, d_in, d_out)`` of the linear layers of ``TransformerLM(config)`` that ``targets`` selects."""
    target_modules(nn.Module(), targets)  # validates targets
    return [layer for layer in _model_layout(config)[1] if _matches(layer[0], targets)]


def lora_parameter_count(config: ModelConfig, r: int, targets=DEFAULT_TARGETS) -> int:
    """Adapter parameters of ``TransformerLM(config)`` with rank-``r`` LoRA on ``targets``:
    ``r * (d_in + d_out)`` per adapted layer (``A`` is ``r x d_in``, ``B`` is ``d_out x r``).
    Mind grouped-query attention: ``k_proj`` and ``v_proj`` map ``d_model`` to
    ``num_kv_heads * head_dim``, not to ``d_model``."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"r={r!r}: expected a positive integer")
    return sum(r * (d_in + d_out) for _, d_in, d_out in _layer_shapes(config, targets))


# ============================================================================ memory: predicted
@dataclass
class FinetuneMemory:
    """Bytes on one device for one training step, by kind.

    ``weights``: the model's weights (trainable in full fine-tuning, frozen under LoRA; for QLoRA the
    4-bit codes plus the layers kept in ``weights_dtype``); ``quant_scales``: the quantization
    scales (QLoRA); ``adapters``: the LoRA matrices; ``grads``, ``optimizer_states`` and
    ``master_weights`` exist only for what trains; ``activations``: what autograd saves in the
    forward pass; ``recompute``: the one block that activation checkpointing rebuilds in backward.
    """

    method: str
    trainable_params: int
    weights: int
    quant_scales: int
    adapters: int
    grads: int
    optimizer_states: int
    master_weights: int
    activations: int
    recompute: int = 0

    KINDS = ("weights", "quant_scales", "adapters", "grads", "optimizer_states", "master_weights", "activations", "recompute")

    @property
    def model_state(self) -> int:
        return self.weights + self.quant_scales + self.adapters + self.grads + self.optimizer_states + self.master_weights

    @property
    def total(self) -> int:
        return self.model_state + self.activations + self.recompute

    def as_dict(self) -> dict[str, int]:
        return {**{k: getattr(self, k) for k in self.KINDS}, "total": self.total}

    def table(self, unit: str = "GB") -> str:
        """Aligned text table in ``unit`` ('B', 'KB', 'MB', 'GB'; powers of 10^3), 4 significant digits."""
        scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}
        if unit not in scale:
            raise ValueError(f"unit={unit!r}: expected one of {list(scale)}")
        return "\n".join(f"{name:<17}{value / scale[unit]:>12.4g} {unit}" for name, value in self.as_dict().items())


def _dtype(value, name: str) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    raise ValueError(f"{name}={value!r}: expected one of {sorted(DTYPES)} or the matching torch dtype")


FINETUNE_METHODS = ("full", "lora", "qlora")


def finetune_memory(model, method: str = "full", *, weights_dtype="bf16", optimizer: str = "adamw", master_weights: bool = False,
                    optimizer_dtype=None, r: int = 8, targets=DEFAULT_TARGETS, adapter_dtype=None, dropout: float = 0.0,
                    batch: int | None = None, seq: int | None = None, activation_checkpointing: bool = False,
                    block_size: int = 64, double_quant: bool = True, scale_bits: int = 32, device: str = "cpu") -> FinetuneMemory:
    """Predicted training memory of full fine-tuning, LoRA or QLoRA.

    * ``model``: a :class:`~labkit.model.ModelConfig` (or, for ``"full"`` without activations, a
      parameter count). ``weights_dtype``: the weights' dtype and the dtype the forward pass computes
      in (activations). ``optimizer`` as in chapter 07 (AdamW: 2 states per trained parameter),
      in ``optimizer_dtype`` (default: fp32 with ``master_weights``, else ``weights_dtype``).
      ``master_weights``: an fp32 copy of what trains (mixed precision).
    * ``"full"``: chapter 07's :func:`labkit.memory.model_state_bytes`: pure bf16 AdamW is
      2 + 2 + 2*2 = **8 bytes per parameter** (weights, gradients, m and v); mixed precision with fp32
      master weights and states 2 + 2 + 4 + 4*2 = **16**. Activations: :func:`labkit.memory.activation_terms`.
    * ``"lora"``: the base weights stay (frozen, no gradient, no optimizer state); rank-``r``
      adapters on ``targets`` (:func:`lora_parameter_count`) in ``adapter_dtype`` (default
      ``weights_dtype``) carry the gradients and the optimizer states (default dtype: fp32 with
      ``master_weights``, else ``adapter_dtype``). Activations: :func:`lora_activation_terms`.
    * ``"qlora"``: as ``"lora"``, but the blocks' linear layers are stored in 4-bit NF4 (two codes
      per byte) with one absmax per ``block_size`` weights of a row: ``scale_bits`` bits each, or
      with ``double_quant`` (QLoRA) an 8-bit code per absmax plus an fp32 scale per 256 of them and an
      fp32 offset per layer. Embeddings, norms and the LM head stay in ``weights_dtype`` (as
      bitsandbytes and :func:`labkit.quant.quantize_model` leave them). labkit's own
      :class:`~labkit.quant.QuantLinear` stores fp16 scales: ``double_quant=False, scale_bits=16``.
    * ``batch`` and ``seq`` (both or neither): the micro-batch whose activations are counted
      (``device`` only matters for the size of a dropout mask, see :func:`lora_activation_terms`).
    """
    if method not in FINETUNE_METHODS:
        raise ValueError(f"method={method!r}: expected one of {FINETUNE_METHODS}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r}: expected one of {sorted(OPTIMIZER_STATES)}")
    dt = _dtype(weights_dtype, "weights_dtype")
    if master_weights and dt == torch.float32 and method == "full":
        raise ValueError("master_weights=True with fp32 weights: the master copy is the fp32 copy of 16-bit weights")
    if (batch is None) != (seq is None):
        raise ValueError("batch, seq: give both (activations of one micro-batch) or neither (model state only)")
    is_config = isinstance(model, ModelConfig)
    if not is_config:
        if isinstance(model, bool) or not isinstance(model, int) or model < 1:
            raise TypeError(f"model: expected a labkit.model.ModelConfig or a positive parameter count, got {model!r}")
        if method != "full" or batch is not None:
            raise ValueError(f"model: a parameter count is enough for full fine-tuning's model state; method={method!r}"
                             f"{' with activations' if batch is not None else ''} needs the layer shapes: pass a ModelConfig")
    num_params = _model_layout(model)[0] if is_config else model
    states = OPTIMIZER_STATES[optimizer]

    def state_dtype(trained: torch.dtype) -> torch.dtype:
        if optimizer_dtype is not None:
            return _dtype(optimizer_dtype, "optimizer_dtype")
        return torch.float32 if master_weights else trained

    if method == "full":
        state = model_state_bytes(num_params, dt, mixed_precision=master_weights and dt != torch.float32, optimizer=optimizer)
        memory = FinetuneMemory(method, num_params, state.params, 0, 0, state.grads, states * num_params * state_dtype(dt).itemsize,
                                state.master_weights, 0)
        if batch is not None:
            terms = activation_terms(model, batch, seq, dt, activation_checkpointing)
            memory.recompute = terms.pop("recompute_block")
            memory.activations = sum(terms.values())
        return memory

    adapter_dt = dt if adapter_dtype is None else _dtype(adapter_dtype, "adapter_dtype")
    adapter_params = lora_parameter_count(model, r, targets)
    adapter_state = model_state_bytes(adapter_params, adapter_dt, mixed_precision=master_weights and adapter_dt != torch.float32,
                                      optimizer=optimizer)
    weights, scales = num_params * dt.itemsize, 0
    if method == "qlora":
        weights, scales = _qlora_weight_bytes(model, dt, block_size, double_quant, scale_bits)
    memory = FinetuneMemory(method, adapter_params, weights, scales, adapter_state.params, adapter_state.grads,
                            states * adapter_params * state_dtype(adapter_dt).itemsize, adapter_state.master_weights, 0)
    if batch is not None:
        terms = lora_activation_terms(model, batch, seq, targets, r, dt, adapter_dt, dropout, activation_checkpointing, device)
        memory.recompute = terms.pop("recompute_block")
        memory.activations = sum(terms.values())
    return memory


def _check_positive_int(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive integer")


def quantized_layer_shapes(config: ModelConfig) -> list[tuple[str, int, int]]:
    """The layers QLoRA stores in 4 bits: every linear layer of the blocks (not the LM head)."""
    return _layer_shapes(config, ALL_LINEAR)


def _qlora_weight_bytes(config: ModelConfig, dt: torch.dtype, block_size: int, double_quant: bool, scale_bits: int) -> tuple[int, int]:
    _check_positive_int(block_size=block_size, scale_bits=scale_bits)
    layers = quantized_layer_shapes(config)
    quantized = sum(d_in * d_out for _, d_in, d_out in layers)
    codes = sum(d_out * math.ceil(d_in / 2) for _, d_in, d_out in layers)  # two 4-bit codes per byte, per row
    scales = 0
    for _, d_in, d_out in layers:
        blocks = d_out * math.ceil(d_in / block_size)
        if double_quant:  # 8-bit absmax codes, an fp32 scale per 256 of them, one fp32 offset per layer
            scales += blocks + 4 * math.ceil(blocks / 256) + 4
        else:
            scales += math.ceil(blocks * scale_bits / 8)
    return codes + (_model_layout(config)[0] - quantized) * dt.itemsize, scales


# ---------------------------------------------------------------------------- activations with a frozen base
def lora_activation_terms(config: ModelConfig, batch_size: int, seq_len: int, targets=DEFAULT_TARGETS, r: int = 8,
                          dtype="fp32", adapter_dtype=None, dropout: float = 0.0,
                          activation_checkpointing: bool = False, device: str = "cpu") -> dict[str, int]:
    """Bytes autograd saves in one forward pass of ``TransformerLM(config)`` (plus
    ``labkit.train.cross_entropy``) when the base is frozen and rank-``r`` adapters sit on ``targets``.

    The same op-by-op accounting as chapter 07's :func:`labkit.memory.activation_terms`, with one
    more rule: **an op saves a tensor only if a gradient will need it.** ``x @ W^T`` saves ``x``
    only for ``W``'s gradient, so a frozen layer saves nothing of its input (``W`` itself is model
    state); and upstream of the first adapter nothing requires a gradient at all, so nothing is saved
    there. What is saved:

    * each adapter: its input (shared by adapters on the same input - ``q/k/v_proj``, ``w1/w3`` -
      unless dropout or a cast to ``adapter_dtype`` makes a copy per adapter), and ``A x``
      (``n*r``) for ``B``'s gradient; dropout also keeps its mask where its input requires a gradient:
      on CUDA a 1-byte boolean per element (the fused kernel), on CPU a scaled noise tensor in the
      input's dtype (``device``);
    * RMSNorm (frozen gain): its fp32 input and ``1/rms`` (not the normalised tensor, which only
      the gain's gradient needs), where its input requires a gradient;
    * attention: ``k`` for ``q``'s gradient and ``q`` for ``k``'s, RoPE's cos/sin tables, and
      (where the scores require a gradient) the masked scores, their exp, row max and row sum, and
      the causal mask; the probabilities for ``v``'s gradient and ``v`` for theirs;
    * SwiGLU: the gate and its sigmoid (for the gate's gradient), ``silu(gate)`` for ``up``'s and
      ``up`` for the gate's; the product only if ``w2`` has an adapter;
    * the loss, as in full fine-tuning (the targets; the embedding is frozen, so the token ids are
      not saved by it).

    ``n = batch*seq``. Follows labkit's LLaMA-style block (RMSNorm, SwiGLU, RoPE; QK-norm and GQA
    supported) on the PyTorch path. With ``activation_checkpointing`` each block keeps only its
    input (assumed to require a gradient, as PEFT arranges with ``enable_input_require_grads``) and
    ``recompute_block`` is the largest block's activations, rebuilt one block at a time.
    """
    _check_positive_int(batch_size=batch_size, seq_len=seq_len, r=r)
    if config.norm != "rmsnorm" or config.activation != "silu" or config.use_triton:
        raise ValueError("config: the estimate follows labkit's LLaMA-style block on the PyTorch path "
                         "(norm='rmsnorm', activation='silu', use_triton=False)")
    dt = _dtype(dtype, "dtype")
    adapter_dt = dt if adapter_dtype is None else _dtype(adapter_dtype, "adapter_dtype")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout!r}: expected a probability in [0, 1)")
    adapted = {name for name, _, _ in _layer_shapes(config, targets)}
    p, pa, f32 = dt.itemsize, adapter_dt.itemsize, 4
    b, s = batch_size, seq_len
    n, d, heads, kv, hd, ff, vocab = b * s, config.d_model, config.num_heads, config.kv_heads, config.dim_per_head, config.d_ff, config.vocab_size
    copies = dropout > 0 or pa != p  # each adapter then saves its own copy of the input
    mask_bytes = 1 if torch.device(device).type == "cuda" else pa

    def norm(width: int, rows: int, grad: bool) -> int:
        # x.float() (x itself in fp32), 1/rms, and the fp32 copy of the gain unless it is fp32
        return rows * width * f32 + rows * f32 + (width * f32 if p != f32 else 0) if grad else 0

    def adapters(names: list[str], d_in: int, grad_in: bool) -> int:
        """Saved by the adapters on one input of width d_in: the input (once if shared), A x per adapter."""
        present = [name for name in names if name in adapted]
        if not present:
            return 0
        inputs = len(present) * n * d_in * pa if copies else n * d_in * p
        masks = len(present) * n * d_in * mask_bytes if dropout > 0 and grad_in else 0
        return inputs + masks + len(present) * n * r * pa

    def block(i: int, grad: bool) -> tuple[dict[str, int], bool]:
        name = lambda short: f"layers.{i}.attn.{short}" if short in ATTENTION else f"layers.{i}.ffn.{short}"  # noqa: E731
        has = {short: name(short) in adapted for short in (*ATTENTION, *MLP)}
        t = {"attn: norm": norm(d, n, grad)}
        t["adapters: q/k/v input, A x"] = adapters([name(x) for x in ("q_proj", "k_proj", "v_proj")], d, grad)
        gq, gk, gv = grad or has["q_proj"], grad or has["k_proj"], grad or has["v_proj"]
        t["attn: qk-norm"] = norm(hd, n * heads, gq) + norm(hd, n * kv, gk) if config.qk_norm else 0
        t["attn: rope cos/sin"] = (gq + gk) * 2 * s * (hd // 2) * f32
        g_scores = gq or gk
        # q for k's grad, k for q's, v for the probs': each K/V head once (labkit.nn.grouped_query_attention stacks a
        # GQA group's queries instead of repeating K/V), and the causal mask once per group member
        t["attn: q, k, v"] = (gk * heads + gq * kv + g_scores * kv) * n * hd * p
        t["attn: scores, exp, probs"] = (2 * g_scores + gv) * b * heads * s * s * p
        t["attn: row max, row sum"] = 2 * b * heads * s * p if g_scores else 0
        t["attn: causal mask"] = (heads // kv) * s * s if g_scores else 0
        g_attn = g_scores or gv
        t["adapters: output_proj input, A x"] = adapters([name("output_proj")], heads * hd, g_attn)
        grad = grad or g_attn or has["output_proj"]
        t["ffn: norm"] = norm(d, n, grad)
        t["adapters: w1/w3 input, A x"] = adapters([name("w1"), name("w3")], d, grad)
        g_gate, g_up = grad or has["w1"], grad or has["w3"]
        t["ffn: gate/up/act"] = (2 * g_gate + g_up + g_gate) * n * ff * p  # gate, sigmoid; silu(gate); up
        g_product = g_gate or g_up
        t["adapters: w2 input, A x"] = adapters([name("w2")], ff, g_product)
        return t, grad or g_product or has["w2"]

    terms: dict[str, int] = {}
    grad = False  # the embedding is frozen: nothing upstream of the first adapter requires a gradient
    blocks = []
    for i in range(config.num_layers):
        block_terms, grad_out = block(i, True if activation_checkpointing else grad)
        blocks.append(block_terms)
        grad = grad or grad_out
    if activation_checkpointing:
        terms["block inputs (checkpointed)"] = config.num_layers * n * d * p
        grad = True
    else:
        for block_terms in blocks:
            for key, value in block_terms.items():
                terms[key] = terms.get(key, 0) + value
    terms["final norm"] = norm(d, n, grad)
    terms["adapters: lm_head input, A x"] = adapters([OUTPUT_LAYER], d, grad)
    if not (grad or OUTPUT_LAYER in adapted):
        raise ValueError(f"targets={targets!r}: no adapter feeds the loss, so nothing would train")
    # as in chapter 07: cross_entropy keeps the fp32 logits, exp(logits), the row sums and the targets
    full = activation_terms(config, batch_size, seq_len, dt)
    terms["loss: logits, exp(logits), row sums, targets"] = full["loss: logits, exp(logits), row sums, targets"]
    terms["recompute_block"] = max(sum(t.values()) for t in blocks) if activation_checkpointing else 0
    return terms


# ============================================================================ memory: measured
def measure_training_memory(model: nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer=None) -> dict[str, int]:
    """Bytes of the tensors one real training step allocates, by the kinds of :class:`FinetuneMemory`:

    ``weights`` (parameters that do not train, or all of them in full fine-tuning, plus the codes of
    quantized layers), ``quant_scales`` (their scales and zero points), ``adapters`` (the LoRA
    matrices), ``grads`` (every ``.grad`` after backward), ``optimizer_states`` (what the optimizer
    keeps after its step, :func:`labkit.memory.optimizer_state_bytes`) and ``activations``
    (:class:`labkit.memory.SavedTensorMeter` over the forward pass and the loss). One step of
    ``optimizer`` (default: labkit's AdamW with lr 0, so the weights do not change) on ``(x, y)``
    with the next-token loss; the gradients are freed afterwards.
    """
    params = list({id(p): p for p in model.parameters()}.values())
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("model: no parameter requires a gradient; there is nothing to train")
    optimizer = optimizer if optimizer is not None else AdamW(trainable, lr=0.0, weight_decay=0.0)
    was_training = model.training
    model.train()
    with SavedTensorMeter(model) as meter:
        loss = cross_entropy(model(x), y)
    activations = meter.activation_bytes
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    measured = {**_state_bytes(model, optimizer), "master_weights": 0, "activations": activations}
    optimizer.zero_grad(set_to_none=True)
    model.train(was_training)
    return {**measured, "total": sum(measured.values())}


# ============================================================================ fine-tuning
class SubtractionTask(ArithmeticTask):
    """Two-digit subtraction ``a - b`` with ``a >= b``, written like the adder's sums: ``"35-07=820;"``
    (the difference zero-padded to three digits and reversed, least significant first, the order in
    which borrows propagate). Pairs with ``a < b`` are left out of every split."""

    def pairs(self, split: str):
        pairs = super().pairs(split)
        return pairs[pairs[:, 0] >= pairs[:, 1]]


def subtraction_task() -> SubtractionTask:
    """The chapter's new task for the shipped adder: the same format and tokenizer, a new operator."""
    return SubtractionTask(num_digits=2, op="-", reverse_answer=True)


def _examples(task: ArithmeticTask, split: str, device) -> torch.Tensor:
    pairs = task.pairs(split)
    return torch.tensor([task.tokenizer.encode(task.format(a, b)) for a, b in pairs], device=device)


def _answer_loss(model: nn.Module, examples: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """Next-token loss on the answer and its ';' only: the prompt's random operands cannot be predicted."""
    logits = model(examples[:, :-1])
    return cross_entropy(logits[:, prompt_length - 1:], examples[:, prompt_length:])


@torch.no_grad()
def answer_loss(model: nn.Module, task: ArithmeticTask, split: str = "val", max_examples: int | None = None) -> float:
    """Mean loss of ``model`` on the answer tokens of ``task``'s ``split``: a graded measure of how
    well it still knows a task, where exact-match accuracy is all or nothing per example."""
    device = next(model.parameters()).device
    examples = _examples(task, split, device)[:max_examples]
    was_training = model.training
    model.eval()
    loss = _answer_loss(model, examples, task.prompt_length).item()
    model.train(was_training)
    return loss


def finetune(model: nn.Module, task: ArithmeticTask, steps: int = 300, lr: float = 1e-3, batch_size: int = 64, *,
             warmup_iters: int = 10, min_lr: float | None = None, weight_decay: float = 0.0, grad_clip: float = 1.0,
             betas=(0.9, 0.95), seed: int = 0, loraplus_lr_ratio: float | None = None) -> dict:
    """Supervised fine-tuning of ``model``'s trainable parameters (all of them for full fine-tuning,
    the adapters after :func:`apply_lora`) on ``task``'s training examples.

    Each step draws ``batch_size`` whole examples (a private generator seeded with ``seed``: every
    run sees the same batches), computes the loss on the answer tokens only (the prompt's operands are
    random and cannot be learned), clips the gradient norm, and takes an AdamW step with a cosine
    schedule from ``lr`` to ``min_lr`` (default ``lr / 10``). The model is left in eval mode.
    ``loraplus_lr_ratio``: LoRA+ (:func:`loraplus_param_groups`), the adapters' ``B`` on a schedule that
    many times higher.

    Returns ``loss`` (per step), ``seconds_per_step`` (steps after the first), ``trainable`` and
    ``memory``: the bytes measured on the first step (as :func:`measure_training_memory`: weights,
    quantization scales, adapters, gradients, optimizer states, activations and their total).
    """
    _check_positive_int(steps=steps, batch_size=batch_size)
    params = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
    if not params:
        raise ValueError("model: no parameter requires a gradient; there is nothing to fine-tune")
    device = params[0].device
    examples = _examples(task, "train", device)
    generator = torch.Generator().manual_seed(run_seed(seed))
    groups = params if loraplus_lr_ratio is None else loraplus_param_groups(model, lr, loraplus_lr_ratio)
    optimizer = AdamW(groups, lr=lr, betas=betas, weight_decay=weight_decay)
    lr_factors = [group["lr"] / lr if lr > 0 else 1.0 for group in optimizer.param_groups]
    min_lr = lr / 10 if min_lr is None else min_lr
    model.train()
    losses, memory = [], {}

    def train_step():
        step = len(losses)
        for group, factor in zip(optimizer.param_groups, lr_factors):
            group["lr"] = factor * lr_cosine_schedule(step, lr, min_lr, warmup_iters, steps)
        batch = examples[torch.randint(len(examples), (batch_size,), generator=generator).to(device)]
        meter = SavedTensorMeter(model) if step == 0 else contextlib.nullcontext()
        with meter:
            loss = _answer_loss(model, batch, task.prompt_length)
        if step == 0:
            memory["activations"] = meter.activation_bytes
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip_grad_norm(params, grad_clip)
        optimizer.step()
        if step == 0:
            memory.update(_state_bytes(model, optimizer))
        losses.append(loss.item())

    if steps > 1:  # the first step (which also measures memory) is the warm-up; each later step is one sample
        seconds = timeit(train_step, warmup=1, repeats=steps - 1, number=1).mean
    else:
        train_step()
        seconds = float("nan")
    model.eval()
    memory["total"] = sum(memory.values())
    return {"loss": losses, "seconds_per_step": seconds, "trainable": sum(p.numel() for p in params), "memory": memory}


def targets_label(targets) -> str:
    """The name the chapter's tables use for ``targets`` (a key of :data:`EXPLORER_TARGETS` when it is one)."""
    for label, patterns in EXPLORER_TARGETS.items():
        if targets == patterns or (not isinstance(targets, str) and tuple(targets) == patterns):
            return label
    return targets if isinstance(targets, str) else ", ".join(targets)


def finetune_run(base: nn.Module, new_task: ArithmeticTask, old_task: ArithmeticTask, targets=None, r: int = 8,
                 alpha: float = 16, *, lr: float, steps: int = 300, batch_size: int = 32, use_rslora: bool = False,
                 use_dora: bool = False, loraplus_lr_ratio: float | None = None, use_ia3: bool = False, seed: int = 0,
                 old_examples: int | None = None) -> tuple[nn.Module, dict]:
    """One row of the chapter's comparison: a copy of ``base`` fine-tuned on ``new_task`` with
    :func:`finetune`, in full (``targets=None``) or with rank-``r`` LoRA on ``targets`` (QLoRA when
    ``base`` holds quantized layers; DoRA with ``use_dora``; LoRA+ with ``loraplus_lr_ratio``), then
    measured on both tasks. ``use_ia3``: IA3 scales on ``targets`` instead of adapters (:func:`apply_ia3`;
    ``r`` and ``alpha`` unused). ``base`` is left untouched.

    ``torch.manual_seed(seed)`` before the adapters are created (``A``'s random init) and the same
    ``seed`` for the batches, so every run starts from the same point and sees the same examples.
    Returns the fine-tuned model and ``{"method" ("full", "LoRA", "QLoRA", "DoRA", "LoRA+" or "IA3"), "targets", "r",
    "alpha", "trainable", "new"
    (exact-match accuracy on new_task's validation split), "old" (on old_task's, its first
    ``old_examples`` pairs if given), "old_loss" (:func:`answer_loss` on the same old_task pairs),
    "final_loss" (mean of the last 20 steps), "memory" (bytes measured on the first step),
    "seconds_per_step"}``.
    """
    if targets is None and use_ia3:
        raise ValueError("use_ia3: give targets, the layers whose features IA3 scales (IA3_TARGETS: PEFT's defaults)")
    if targets is None and any(isinstance(m, QuantLinear) for m in base.modules()):
        raise ValueError("targets=None (full fine-tuning) of a quantized model: its 4-bit weights cannot train; give targets (QLoRA)")
    model = copy.deepcopy(base)
    torch.manual_seed(run_seed(seed))
    if targets is None:
        if use_dora or loraplus_lr_ratio is not None:
            raise ValueError("use_dora, loraplus_lr_ratio: apply to adapters; give targets")
        model.requires_grad_(True)
        method, label, rank = "full", "-", None
    elif use_ia3:
        if use_dora or use_rslora or loraplus_lr_ratio is not None:
            raise ValueError("use_ia3: IA3 trains scales, not adapters; use_dora, use_rslora and loraplus_lr_ratio do not apply")
        apply_ia3(model, targets)
        method, label, rank, alpha = "IA3", targets_label(targets), None, None
    else:
        apply_lora(model, targets, r, alpha, use_rslora=use_rslora, use_dora=use_dora)
        method = "QLoRA" if any(isinstance(m, QuantLinear) for m in model.modules()) else "LoRA"
        method = "DoRA" if use_dora else "LoRA+" if loraplus_lr_ratio is not None else method
        label, rank = targets_label(targets), r
    result = finetune(model, new_task, steps, lr, batch_size, seed=seed, loraplus_lr_ratio=loraplus_lr_ratio)
    row = {"method": method, "targets": label, "r": rank, "alpha": None if targets is None else alpha,
           "trainable": result["trainable"], "new": new_task.evaluate(model, "val"),
           "old": old_task.evaluate(model, "val", max_examples=old_examples),
           "old_loss": answer_loss(model, old_task, max_examples=old_examples), "final_loss": sum(result["loss"][-20:]) / len(result["loss"][-20:]),
           "memory": result["memory"], "seconds_per_step": result["seconds_per_step"]}
    return model, row


def _state_bytes(model: nn.Module, optimizer) -> dict[str, int]:
    """Measured model state by kind: weights (non-adapter parameters and quantized codes), quantization
    scales (and zero points), adapters, the ``.grad`` tensors, the optimizer's state."""
    params = list({id(p): p for p in model.parameters()}.values())
    lora_ids = {id(t) for layer in lora_layers(model).values() for t in layer.adapter_parameters().values()}
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    scales = [m.scales for m in quantized] + [m.zeros for m in quantized if m.zeros is not None]

    def nbytes(tensors: list) -> int:
        return tensor_bytes(tensors) if tensors else 0

    return {
        "weights": nbytes([p for p in params if id(p) not in lora_ids]) + nbytes([m.qweight for m in quantized]),
        "quant_scales": nbytes(scales),
        "adapters": nbytes([p for p in params if id(p) in lora_ids]),
        "grads": nbytes([p.grad for p in params if p.grad is not None]),
        "optimizer_states": optimizer_state_bytes(optimizer),
    }


# ============================================================================ is the update low-rank?
def lr_sweep(base: nn.Module, task: ArithmeticTask, lrs, targets=None, r: int = 8, alpha: float = 16, *,
             steps: int = 60, batch_size: int = 64, seed: int = 0) -> dict[float, float]:
    """Short runs of :func:`finetune` at each learning rate in ``lrs``, from a copy of ``base``: in full
    (``targets=None``) or with rank-``r`` LoRA on ``targets``, the adapters created after
    ``torch.manual_seed(seed)`` and the same batches in every run (as :func:`finetune_run`). Returns
    ``{lr: answer_loss on task's validation split}``: the loss of short runs is how learning rates are
    compared before paying for long ones. ``base`` is left untouched."""
    if not lrs or any(not lr > 0 for lr in lrs):
        raise ValueError(f"lrs={lrs!r}: expected one or more positive learning rates")
    losses = {}
    for lr in lrs:
        model = copy.deepcopy(base)
        torch.manual_seed(run_seed(seed))
        if targets is None:
            model.requires_grad_(True)
        else:
            apply_lora(model, targets, r, alpha)
        finetune(model, task, steps, lr, batch_size, seed=seed)
        losses[lr] = answer_loss(model, task)
    return losses


def first_step_update_rms(model: nn.Module, task: ArithmeticTask, lr: float = 1e-3, batch_size: int = 64,
                          seed: int = 0) -> dict[str, float]:
    """How far the first AdamW step moves each adapted (or, without adapters, each trained linear) layer's
    effective weight, per entry: ``RMS(W_after - W_before) / lr``, where ``W = W0 + scaling * B A``
    under LoRA. Adam's first step moves every trained parameter by about ``lr * sign(gradient)``, so a
    trained weight reads about 1; under LoRA only ``B`` moves (``A``'s gradient is zero while ``B = 0``)
    and the layer reads ``scaling * RMS(sign(grad_B) A)``. One batch of ``task``'s training examples;
    ``model`` is left untouched. DoRA layers are refused (their weight is not ``W0 + scaling * B A``)."""
    if not lr > 0:
        raise ValueError(f"lr={lr!r}: expected a positive learning rate")
    _check_positive_int(batch_size=batch_size)
    model = copy.deepcopy(model)
    adapters = lora_layers(model)
    if any(isinstance(layer, DoRALinear) for layer in adapters.values()):
        raise ValueError("model: has DoRA layers, whose weight is not W0 + scaling * B A")
    layers = adapters or {name: model.get_submodule(name) for name in target_modules(model, "all-linear")
                          if model.get_submodule(name).weight.requires_grad}
    if not layers:
        raise ValueError("model: no adapter and no trainable linear layer; the first step moves nothing")

    def weights():
        return {name: (layer.delta_weight() if name in adapters else layer.weight.detach().float()).clone()
                for name, layer in layers.items()}

    params = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
    device = params[0].device
    examples = _examples(task, "train", device)
    generator = torch.Generator().manual_seed(run_seed(seed))
    batch = examples[torch.randint(len(examples), (batch_size,), generator=generator).to(device)]
    before = weights()
    _answer_loss(model.train(), batch, task.prompt_length).backward()
    AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0).step()
    return {name: ((after - before[name]).square().mean().sqrt() / lr).item() for name, after in weights().items()}


@torch.no_grad()
def update_spectrum(w0: torch.Tensor, w1: torch.Tensor, ranks=(1, 2, 4, 8, 16)) -> dict:
    """Singular values of the update ``w1 - w0`` (fp64) and, for each rank ``r`` in ``ranks``, the
    fraction of its squared Frobenius norm that the best rank-``r`` approximation keeps
    (``sum(s[:r]^2) / sum(s^2)``, Eckart-Young): how much of a full fine-tuning update a rank-``r``
    adapter could express. Also ``relative_norm``: ``||w1 - w0|| / ||w0||``."""
    if w0.shape != w1.shape or w0.dim() != 2:
        raise ValueError(f"w0, w1: expected two matrices of the same shape, got {tuple(w0.shape)} and {tuple(w1.shape)}")
    delta = w1.double() - w0.double()
    s = torch.linalg.svdvals(delta)
    energy = s.pow(2).cumsum(0) / s.pow(2).sum()
    captured = {r: float(energy[min(r, len(s)) - 1]) for r in ranks}
    return {"singular_values": s, "captured": captured, "relative_norm": float(delta.norm() / w0.double().norm())}


# ============================================================================ widget callback
EXPLORER_TARGETS = {"attention (q, v)": DEFAULT_TARGETS, "attention (q, k, v, o)": ATTENTION, "all linear": ALL_LINEAR}


def rank_explorer(config: ModelConfig, rank: int, alpha: float, targets: str, runs: dict | None = None, *,
                  weights_dtype="bf16", batch: int = 1, seq: int = 512, activation_checkpointing: bool = True,
                  use_rslora: bool = False) -> dict:
    """What the rank explorer shows for ``TransformerLM(config)``: rank-``rank`` adapters on
    ``targets`` (a key of :data:`EXPLORER_TARGETS`), ``scaling``, trainable parameters and their
    fraction of the model, and the memory breakdown (:func:`finetune_memory`, micro-batch
    ``batch x seq``, with activation checkpointing by default) of full fine-tuning (mixed precision, fp32 master weights and AdamW states; plain
    fp32 AdamW if ``weights_dtype`` is fp32: 16 bytes per parameter either way),
    LoRA (``weights_dtype`` base and adapters, fp32 AdamW states) and QLoRA (NF4 with double
    quantization). ``runs``: the chapter's measured runs, ``{(targets_key, rank): row}``; the row for
    this choice is returned as ``measured`` (``None`` if it was not run)."""
    if targets not in EXPLORER_TARGETS:
        raise ValueError(f"targets={targets!r}: expected one of {list(EXPLORER_TARGETS)}")
    patterns = EXPLORER_TARGETS[targets]
    kwargs = dict(weights_dtype=weights_dtype, batch=batch, seq=seq, activation_checkpointing=activation_checkpointing)
    lora_kwargs = dict(r=rank, targets=patterns, optimizer_dtype="fp32", **kwargs)
    memory = {
        "full": finetune_memory(config, "full", master_weights=_dtype(weights_dtype, "weights_dtype") != torch.float32, **kwargs),
        "lora": finetune_memory(config, "lora", **lora_kwargs),
        "qlora": finetune_memory(config, "qlora", **lora_kwargs),
    }
    trainable = lora_parameter_count(config, rank, patterns)
    total = _model_layout(config)[0]
    return {"rank": rank, "alpha": alpha, "targets": targets, "scaling": lora_scaling(alpha, rank, use_rslora),
            "trainable": trainable, "total": total, "fraction": trainable / total, "memory": memory,
            "measured": (runs or {}).get((targets, rank))}
