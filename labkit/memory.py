"""What fills memory in training, predicted and measured.

Training memory per device is model state (parameters, gradients, optimizer states and, in
mixed precision, fp32 master weights) plus activations: the tensors autograd saves during the
forward pass to compute the backward pass. Model state depends only on the parameter count and
the dtypes; activations grow with batch x sequence, and with sequence^2 wherever attention
scores are materialised: then they dominate at long context. A fused attention
(``scaled_dot_product_attention``, FlashAttention) never stores the scores, and selective
recomputation (Korthikanti et al., 2022) rebuilds them in backward; either leaves the linear part.

- :class:`SavedTensorMeter` measures activations exactly, on any device: it sees every tensor
  autograd saves (``torch.autograd.graph.saved_tensors_hooks``), counts each storage once and
  leaves parameters out.
- :func:`activation_terms` / :func:`estimate_training_memory` predict the same bytes from a
  :class:`~labkit.model.ModelConfig` by walking labkit's own ``TransformerLM`` forward op by op,
  for each attention implementation in :data:`ATTENTION` (switched on a model by
  :func:`attention_implementation`); :func:`korthikanti_activation_bytes` is the paper's formula.
- :func:`zero_memory_per_device` is the ZeRO paper's model-state accounting.
- :func:`measure_peak` and :func:`allocator_stats` read PyTorch's CUDA caching allocator;
  :class:`CachingAllocatorSimulator` replays its documented rules on any machine, and
  :func:`replay_allocations` runs the same requests on either.
"""
from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass, field, fields

import torch

from labkit.model import ModelConfig, count_parameters

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Optimizer states per parameter: Adam(W) keeps two moments (m, v), SGD with momentum one.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}
# How attention's core (scores -> softmax -> weighted sum of V) keeps what backward needs:
# "materialized": labkit's attention (labkit.nn.scaled_dot_product_attention) saves the
#     [batch, heads, seq, seq] scores, their exp and the probabilities;
# "selective": the same core under torch.utils.checkpoint (Korthikanti et al.'s selective
#     recomputation): only q, k, v are kept and backward recomputes the core, one layer at a time;
# "sdpa": torch.nn.functional.scaled_dot_product_attention (a fused, FlashAttention-style kernel):
#     keeps q, k, v, its output and one fp32 logsumexp per query row, never a score matrix.
ATTENTION = ("materialized", "selective", "sdpa")


def _dtype(value, name: str = "param_dtype") -> torch.dtype:
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    raise ValueError(f"{name}={value!r}: expected one of {sorted(DTYPES)} or the matching torch dtype")


# ----------------------------------------------------------------------------- measuring
class _Saved:
    """What the pack hook hands to autograd instead of the tensor: when autograd frees the
    graph node that saved it, this object dies and the meter stops counting the storage."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedTensorMeter:
    """Count the bytes autograd keeps for the backward pass (the activations).

    ``with SavedTensorMeter(model) as meter: loss = loss_fn(model(x), y)`` then
    ``meter.activation_bytes`` is what is held right now: each storage counted once (``q``,
    ``k``, ``v`` views of one buffer are one allocation), parameters left out (they are model
    state, not activations; pass ``model`` to exclude exactly its parameters, otherwise leaf
    tensors that require grad are excluded). A tensor an op saved only until the next op freed
    it (e.g. behind a ``.detach()``) stops counting when autograd frees it; after
    ``loss.backward()`` the count returns to zero. ``peak_bytes`` is the most held at once.
    Works on any device; tensors a custom ``autograd.Function`` stores as ``ctx`` attributes
    (instead of ``save_for_backward``) are invisible to it.
    """

    def __init__(self, model: torch.nn.Module | None = None):
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module or None, got {type(model).__name__}")
        self.model = model
        self._live: dict[tuple, list] = {}  # storage key -> [nbytes, number of live saves]
        self._param_keys: set = set()
        self.peak_bytes = 0
        self._current = 0
        self._hooks = None

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        storage = t.untyped_storage()
        return (t.device.type, t.device.index, storage.data_ptr(), storage.nbytes())

    def _is_parameter(self, t: torch.Tensor) -> bool:
        if self.model is not None:
            return self._key(t) in self._param_keys
        base = t._base if t._base is not None else t
        return base.is_leaf and base.requires_grad

    def _pack(self, t: torch.Tensor):
        if self._is_parameter(t):
            return t
        key = self._key(t)
        entry = self._live.setdefault(key, [key[3], 0])
        if entry[1] == 0:
            self._current += entry[0]
            self.peak_bytes = max(self.peak_bytes, self._current)
        entry[1] += 1
        saved = _Saved(t.detach())  # detached: holding a saved output with its grad_fn would be a reference cycle
        weakref.finalize(saved, self._release, key)
        return saved

    def _release(self, key: tuple) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self._current -= entry[0]
            del self._live[key]

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    @property
    def activation_bytes(self) -> int:
        """Bytes of saved tensors still held by the autograd graph."""
        return self._current

    def __enter__(self) -> "SavedTensorMeter":
        if self.model is not None:
            self._param_keys = {self._key(p) for p in self.model.parameters()}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None


# ----------------------------------------------------------------------------- activation checkpointing
def autocast_weight_copies(model: torch.nn.Module, run, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """``{parameter name: bytes}`` of the ``dtype`` copies of ``model``'s weights that autograd saves for
    backward while ``run()`` runs under ``torch.autocast`` (on the model's device, in ``dtype``).

    Autocast casts an fp32 weight for each matmul (and caches the copy for the region, so a weight used
    twice is cast once); the matmul saves that copy for its backward, so it stays allocated from the
    forward pass until backward frees it, beside the fp32 weight. A saved tensor counts as the copy of
    a parameter when it holds exactly that parameter's values cast to ``dtype`` (or their transpose,
    for ``x @ W.T``); each storage is counted once. ``run``'s result (e.g. the loss) is dropped, and
    with it the saved tensors."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not callable(run):
        raise TypeError(f"run: expected a function of no arguments, got {type(run).__name__}")
    params = [(name, p) for name, p in model.named_parameters() if p.is_floating_point() and p.dtype != dtype]
    copies: dict[str, int] = {}
    seen: set[int] = set()

    def pack(t: torch.Tensor):
        if t.dtype == dtype and t.untyped_storage().data_ptr() not in seen:
            views = [t] + ([t.mT] if t.dim() == 2 else [])
            for name, p in params:
                if any(v.shape == p.shape and torch.equal(v, p.detach().to(dtype)) for v in views):
                    seen.add(t.untyped_storage().data_ptr())
                    copies[name] = t.untyped_storage().nbytes()
                    break
        return t

    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type, dtype=dtype), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return copies


@contextlib.contextmanager
def activation_checkpointing(model: torch.nn.Module):
    """Inside this block every ``model.layers[i]`` runs under ``torch.utils.checkpoint``:
    the forward pass keeps only each block's input and the backward pass recomputes the block
    (one extra forward of every block, in exchange for not storing its activations)."""
    from torch.utils.checkpoint import checkpoint

    layers = getattr(model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"model: expected a model with a `layers` ModuleList (e.g. TransformerLM), got {type(model).__name__}")
    for layer in layers:
        original = layer.forward
        # The reentrant variant keeps the block input through save_for_backward, so the meter sees it.
        layer.forward = lambda *args, _f=original, **kw: checkpoint(_f, *args, use_reentrant=True, **kw)
    try:
        yield model
    finally:
        for layer in layers:
            del layer.forward  # the instance attribute shadowed the class method


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, attention: str):
    """Inside this block every attention layer of ``model`` (a ``TransformerLM``) computes its
    core the ``attention`` way (see :data:`ATTENTION`): ``"materialized"`` leaves labkit's own
    attention; ``"selective"`` wraps it in ``torch.utils.checkpoint`` (keeps q, k, v; backward
    recomputes the scores); ``"sdpa"`` calls ``torch.nn.functional.scaled_dot_product_attention``
    with ``is_causal=True`` (for training: as many queries as keys)."""
    from torch.utils.checkpoint import checkpoint

    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}: expected one of {ATTENTION}")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not all(hasattr(layer, "attn") for layer in layers):
        raise TypeError(f"model: expected a model with a `layers` ModuleList of blocks with `.attn` (e.g. TransformerLM), got {type(model).__name__}")
    if any(layer.attn.use_triton for layer in layers) and attention != "materialized":
        raise ValueError("model uses the Triton kernels (use_triton=True): they replace the attention already")

    def sdpa(q, k, v, _attn):
        if q.shape[-2] != k.shape[-2]:
            raise ValueError(f"attention='sdpa' is for training (as many queries as keys), got {q.shape[-2]} queries and {k.shape[-2]} keys")
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=_attn.num_heads != _attn.num_kv_heads)

    for layer in layers:
        original = layer.attn._attend
        if attention == "selective":
            # reentrant: the checkpoint keeps q, k, v through save_for_backward, so the meter sees them
            layer.attn._attend = lambda q, k, v, _f=original: checkpoint(_f, q, k, v, use_reentrant=True)
        elif attention == "sdpa":
            layer.attn._attend = lambda q, k, v, _a=layer.attn: sdpa(q, k, v, _a)
    try:
        yield model
    finally:
        for layer in layers:
            layer.attn.__dict__.pop("_attend", None)  # the instance attribute shadowed the class method


# ----------------------------------------------------------------------------- predicting activations
def activation_terms(config: ModelConfig, batch_size: int, seq_len: int, dtype="fp32", activation_checkpointing: bool = False,
                     *, attention: str = "materialized", first_layer: int = 0) -> dict[str, int]:
    """Bytes autograd saves in one forward pass of labkit's ``TransformerLM`` plus
    ``labkit.train.cross_entropy``, by where they come from, derived op by op from
    ``labkit/nn.py`` (the PyTorch path; ``use_triton=False``).

    Rules that set the sizes (``n = batch*seq`` rows, ``p`` bytes per element of ``dtype``):
    a matmul saves its input (``n*d_in*p``); RMSNorm computes in fp32, so it saves its input
    in fp32, the normalised fp32 tensor and ``1/rms`` per row (plus an fp32 copy of its
    weight when the model is not fp32); attention keeps q, k and v (each K/V head once) and
    materialises the ``[batch, heads, seq, seq]`` scores: the masked scores (kept by ``amax``),
    their exp and the probabilities, each ``batch*heads*seq^2*p``, plus a boolean causal mask
    per GQA group member; SwiGLU keeps the gate, ``sigmoid(gate)``, ``silu(gate)``, the up
    projection and their product (``5 n*d_ff*p``); RoPE keeps its cos/sin tables; the loss
    works in fp32 and keeps the logits and their exp (``2 n*vocab*4``). Token ids and targets
    are counted as two tensors (``get_batch`` returns them as views of one buffer, which the
    meter counts once). With ``activation_checkpointing`` a block keeps only its input; while
    the backward pass recomputes a block, its activations (``recompute_block``) exist again,
    one block at a time.

    ``attention`` (see :data:`ATTENTION`, and :func:`attention_implementation` to run a model
    that way) changes only the attention core: ``"selective"`` keeps q, k, v
    (``n*(heads + 2*kv_heads)*head_dim*p``) and no scores; the core of one layer is rebuilt
    during backward (``recompute_block``); ``"sdpa"`` keeps the same q, k, v plus its output
    (``n*heads*head_dim*p``) and a logsumexp per query row (``batch*heads*seq*4``).

    A mixture-of-experts layer (``config.moe``, dropless, see :class:`labkit.experts.MoELayer`)
    keeps, with ``k`` experts per token and ``R = n*k`` routed rows, instead of one FFN's
    activations: the router's fp32 input (the norm output itself in fp32) and, below fp32, an fp32
    copy of the router weight; the fp32 scores ``n*E*4``; the top-k indices and the dispatch
    order (``n*k*8 + 2*R*8``); the gates (``R*4``, plus ``n*k*4 + n*4`` when renormalised);
    the routed copies of the inputs ``R*d*p``; each expert's SwiGLU on its rows
    (``5 R*d_ff_expert*p``); the experts' outputs in fp32 to be weighted by the gates
    (``2 R*d*4``); the shared experts (one SwiGLU of ``shared*d_ff_expert`` on every token, and
    its input below fp32); and the balancing losses' work (``E*4`` for the auxiliary loss,
    ``n*E*4 + n*4`` for the z-loss, ``n*4`` for sigmoid scores). ``first_layer`` says which of the
    model's layers ``config`` holds (a pipeline stage's: layers ``first_layer ...``), which sets
    which of them are MoE layers.
    """
    _check_sizes(batch_size=batch_size, seq_len=seq_len)
    dt = _dtype(dtype, "dtype")
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}: expected one of {ATTENTION}")
    if config.use_triton:
        raise ValueError("config.use_triton=True: the estimate follows the PyTorch path of labkit.nn; the Triton kernels save different tensors")
    moe = config.moe
    if moe is not None and (moe.capacity_factor is not None or moe.router_noise):
        # dropped tokens make the routed rows data-dependent; the noise network saves its own fp32 work
        raise ValueError("config.moe: activation_terms counts dropless MoE layers without router noise "
                         f"(got capacity_factor={moe.capacity_factor}, router_noise={moe.router_noise})")
    if isinstance(first_layer, bool) or not isinstance(first_layer, int) or first_layer < 0:
        raise ValueError(f"first_layer={first_layer!r}: expected a non-negative integer")
    p, f32, low = dt.itemsize, 4, dt != torch.float32
    n, d, heads, kv, hd, ff, vocab = batch_size * seq_len, config.d_model, config.num_heads, config.kv_heads, config.dim_per_head, config.d_ff, config.vocab_size

    def norm(width: int, rows: int) -> int:
        weight_copy = width * f32 if low else 0  # weight.float() is a new tensor unless fp32
        if config.norm == "none":
            return 0
        # rmsnorm keeps x in fp32, x*inv_rms and inv_rms; layernorm computes x-mean twice
        # (once for the variance, once for y), keeps both, y and rstd.
        full_rows = 2 if config.norm == "rmsnorm" else 3
        return full_rows * rows * width * f32 + rows * f32 + weight_copy

    gate_saves = {"silu": 5, "gelu": 6, "relu": 4, "sigmoid": 3}[config.activation]
    attn = {
        "attn: norm": norm(d, n),
        "attn: q/k/v input": n * d * p,
        "attn: qk-norm": norm(hd, n * heads) + norm(hd, n * kv) if config.qk_norm else 0,
        "attn: rope cos/sin": 2 * 2 * seq_len * (hd // 2) * f32,
        "attn: output_proj input": n * heads * hd * p,
    }
    # the core as labkit computes it (labkit.nn.grouped_query_attention): the matmuls save q, k and v, each K/V head
    # once (a GQA group's queries are stacked, not K/V repeated), and the mask is repeated once per group member
    unrepeated_qkv = n * (heads + 2 * kv) * hd * p
    core = {
        "attn: q, k, v": unrepeated_qkv,
        "attn: scores, exp, probs": 3 * batch_size * heads * seq_len * seq_len * p,
        "attn: row max, row sum": 2 * batch_size * heads * seq_len * p,
        "attn: causal mask": (heads // kv) * seq_len * seq_len,
    }
    if attention == "materialized":
        attn.update(core)
    elif attention == "selective":
        attn["attn: q, k, v (core recomputed)"] = unrepeated_qkv
    else:
        attn["attn: q, k, v"] = unrepeated_qkv
        attn["attn: sdpa output, logsumexp"] = n * heads * hd * p + batch_size * heads * seq_len * f32
    dense_ffn = {"ffn: norm": norm(d, n), "ffn: w1/w3 input": n * d * p, "ffn: gate/up/act/product": gate_saves * n * ff * p}
    moe_layers = sum(config.is_moe_layer(first_layer + i) for i in range(config.num_layers))
    blocks = [({**attn, **dense_ffn}, config.num_layers - moe_layers)]
    if moe_layers:
        blocks.append(({**attn, **_moe_ffn_terms(moe, n, d, moe.d_ff or ff, norm(d, n), p, gate_saves)}, moe_layers))
    block_total = max(sum(block.values()) for block, count in blocks if count)
    terms = {"token ids": n * 8}
    if activation_checkpointing:
        terms["block inputs (checkpointed)"] = config.num_layers * n * d * p
    else:
        for block, count in blocks:
            for name, value in block.items():
                terms[name] = terms.get(name, 0) + count * value
    terms["final norm"] = norm(d, n)
    terms["lm_head input"] = n * d * p
    # cross_entropy works in fp32: gather keeps the fp32 logits, exp() its result, log() the row sums.
    terms["loss: logits, exp(logits), row sums, targets"] = 2 * n * vocab * f32 + n * f32 + n * 8
    # what exists again while backward recomputes: one whole block, or (selective) one layer's attention core
    # (its q, k, v are already held)
    core_rebuilt = sum(core.values()) - unrepeated_qkv if attention == "selective" else 0
    terms["recompute_block"] = block_total + core_rebuilt if activation_checkpointing else core_rebuilt
    return terms


def _moe_ffn_terms(moe, n: int, d: int, expert_ff: int, norm_bytes: int, p: int, gate_saves: int) -> dict[str, int]:
    """What one dropless MoE FFN saves (see :func:`activation_terms`), by where it comes from."""
    f32, routed, experts = 4, n * moe.top_k, moe.num_experts
    low = p != f32
    terms = {
        "ffn: norm": norm_bytes,
        "moe: router input (fp32), weight copy": n * d * f32 + (experts * d * f32 if low else 0),
        "moe: router scores": n * experts * f32,
        "moe: top-k indices, dispatch order": n * moe.top_k * 8 + 2 * routed * 8,
        "moe: gates": routed * f32 + ((n * moe.top_k + n) * f32 if moe.normalize_gates else 0),
        "moe: routed inputs": routed * d * p,
        "moe: experts' gate/up/act/product": gate_saves * routed * expert_ff * p,
        "moe: expert outputs (fp32, weighted)": 2 * routed * d * f32,
    }
    if moe.num_shared_experts:
        terms["moe: shared experts"] = gate_saves * n * moe.num_shared_experts * expert_ff * p + (n * d * p if low else 0)
    balancing = (experts * f32 if moe.aux_loss_weight else 0) + (n * experts * f32 + n * f32 if moe.z_loss_weight else 0)
    balancing += n * f32 if moe.score == "sigmoid" else 0
    if balancing:
        terms["moe: balancing losses, sigmoid scores"] = balancing
    return terms


def _check_sizes(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r}: expected a positive integer")


# ----------------------------------------------------------------------------- model state and the total
@dataclass
class MemoryBreakdown:
    """Bytes per device. ``activations`` is what the forward pass leaves saved for backward;
    ``recompute`` is the one block that activation checkpointing rebuilds during backward."""

    params: int
    grads: int
    optimizer_states: int
    master_weights: int
    activations: int
    recompute: int = 0

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer_states + self.master_weights

    @property
    def total(self) -> int:
        return self.model_state + self.activations + self.recompute

    def as_dict(self) -> dict[str, int]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "total": self.total}

    def table(self, unit: str = "GB") -> str:
        """Aligned text table in ``unit`` ('B', 'KB', 'MB', 'GB'; powers of 10^3), 4 significant digits."""
        scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}
        if unit not in scale:
            raise ValueError(f"unit={unit!r}: expected one of {list(scale)}")
        rows = self.as_dict()
        return "\n".join(f"{name:<17}{value / scale[unit]:>12.4g} {unit}" for name, value in rows.items())


def model_state_bytes(num_params: int, param_dtype="fp32", mixed_precision: bool = False, optimizer: str = "adamw", zero_stage: int = 0, world_size: int = 1) -> MemoryBreakdown:
    """Parameters, gradients, optimizer states and master weights for ``num_params`` parameters.

    Mixed precision (``param_dtype`` bf16/fp16 with ``mixed_precision=True``) keeps 16-bit
    parameters and gradients for the forward/backward pass and an fp32 copy (master weights)
    plus fp32 optimizer states for the update: for AdamW ``2 + 2 + 4 + 4 + 4 = 16`` bytes per
    parameter. Without it, everything is in ``param_dtype``. ZeRO stage 1 shards optimizer
    states and master weights across ``world_size`` devices, stage 2 also gradients, stage 3
    also parameters (each shard ``ceil(num_params / world_size)`` elements, as a flat buffer
    padded to equal shards).
    """
    _check_sizes(num_params=num_params, world_size=world_size)
    dt = _dtype(param_dtype)
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r}: expected one of {sorted(OPTIMIZER_STATES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r}: expected 0, 1, 2 or 3")
    if mixed_precision and dt == torch.float32:
        raise ValueError("param_dtype='fp32' with mixed_precision=True: mixed precision keeps 16-bit parameters (bf16 or fp16) beside fp32 master weights")
    p = dt.itemsize
    state_bytes = 4 if mixed_precision else p
    shard = math.ceil(num_params / world_size)
    n_opt = shard if zero_stage >= 1 else num_params
    n_grad = shard if zero_stage >= 2 else num_params
    n_param = shard if zero_stage >= 3 else num_params
    return MemoryBreakdown(
        params=n_param * p,
        grads=n_grad * p,
        optimizer_states=OPTIMIZER_STATES[optimizer] * n_opt * state_bytes,
        master_weights=n_opt * 4 if mixed_precision else 0,
        activations=0,
    )


def adamw_mixed_precision_bytes(num_params: int) -> int:
    """Model-state bytes of AdamW training in bf16 mixed precision: ``16 * num_params``."""
    return model_state_bytes(num_params, "bf16", mixed_precision=True, optimizer="adamw").total


def estimate_training_memory(
    config: ModelConfig,
    batch_size: int,
    seq_len: int,
    *,
    param_dtype="fp32",
    mixed_precision: bool = False,
    optimizer: str = "adamw",
    activation_checkpointing: bool = False,
    attention: str = "materialized",
    zero_stage: int = 0,
    world_size: int = 1,
) -> MemoryBreakdown:
    """Predicted training memory per device for ``TransformerLM(config)``.

    ``batch_size`` is the micro-batch each device processes (data parallelism and ZeRO do not
    shrink activations; they shrink model state). Activations are computed in ``param_dtype``
    with the ``attention`` implementation of :data:`ATTENTION` (see :func:`activation_terms`
    for the term-by-term derivation).
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected a labkit.model.ModelConfig, got {type(config).__name__}")
    if seq_len > config.context_length:
        raise ValueError(f"seq_len={seq_len}: exceeds config.context_length={config.context_length}")
    state = model_state_bytes(count_parameters(config), param_dtype, mixed_precision, optimizer, zero_stage, world_size)
    terms = activation_terms(config, batch_size, seq_len, param_dtype, activation_checkpointing, attention=attention)
    state.recompute = terms.pop("recompute_block")
    state.activations = sum(terms.values())
    return state


def korthikanti_activation_bytes(seq_len: int, batch_size: int, hidden: int, heads: int, num_layers: int = 1,
                                 recompute: str = "none") -> int:
    """Activation bytes of ``num_layers`` GPT layers by Korthikanti et al. (2022), *Reducing
    Activation Recomputation in Large Transformer Models*, eq. (1) and section 5: per layer
    ``s*b*h*(34 + 5*a*s/h)`` bytes in 16-bit precision without recomputation, ``34*s*b*h`` with
    selective recomputation (``recompute="selective"``: the ``5*a*s^2*b`` attention core is
    rebuilt in backward). The 34 counts, in units of ``s*b*h`` bytes: the two LayerNorm inputs
    (2 + 2), the QKV input (2), Q and K (4), V (2), the output-projection input (2) and its
    dropout mask (1), the MLP input (2), the GeLU input (8), the second matmul's input (8) and
    its dropout mask (1); the ``5*a*s^2*b``: the softmax output (2), its dropout mask (1) and the
    dropped-out probabilities (2). Their GPT: a ``4h`` GeLU MLP, LayerNorm, dropout everywhere."""
    _check_sizes(seq_len=seq_len, batch_size=batch_size, hidden=hidden, heads=heads, num_layers=num_layers)
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute={recompute!r}: expected 'none' or 'selective'")
    s, b, h, a = seq_len, batch_size, hidden, heads
    core = 5 * a * s * s * b if recompute == "none" else 0
    return num_layers * (34 * s * b * h + core)


def zero_memory_per_device(num_params: float, world_size: int, stage: int, k: int = 12, bytes_per_param: int = 2) -> float:
    """Model-state bytes per device under ZeRO (Rajbhandari et al., 2020, Figure 1):
    ``bytes_per_param`` for the parameters and again for the gradients, ``k`` bytes of
    optimizer state per parameter (12 for mixed-precision Adam: fp32 master copy, momentum,
    variance). Stage 1 divides the optimizer states by ``world_size``, stage 2 the gradients
    too, stage 3 the parameters too."""
    if not num_params > 0:
        raise ValueError(f"num_params={num_params}: expected a positive number")
    _check_sizes(world_size=world_size)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r}: expected 0, 1, 2 or 3")
    psi, n = float(num_params), world_size
    params = bytes_per_param * psi / (n if stage >= 3 else 1)
    grads = bytes_per_param * psi / (n if stage >= 2 else 1)
    optimizer = k * psi / (n if stage >= 1 else 1)
    return params + grads + optimizer


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors an optimizer keeps in its state (measured, not predicted)."""
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in seen:
                seen.add(value.untyped_storage().data_ptr())
                total += value.untyped_storage().nbytes()
    return total


def tensor_bytes(tensors) -> int:
    """Bytes of a collection of tensors (e.g. ``model.parameters()``), shared storages once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


# ----------------------------------------------------------------------------- gradient accumulation
def accumulated_gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, accumulation_steps: int = 1) -> list[torch.Tensor]:
    """Gradients of the mean cross-entropy over the batch ``(x, y)``, computed in
    ``accumulation_steps`` equal micro-batches: each micro-batch loss is divided by the number
    of steps and backpropagated, and ``.grad`` adds them up, so the result equals one pass
    over the full batch while only one micro-batch's activations exist at a time."""
    from labkit.train import cross_entropy

    _check_sizes(accumulation_steps=accumulation_steps)
    if x.shape[0] % accumulation_steps:
        raise ValueError(f"accumulation_steps={accumulation_steps}: must divide the batch size {x.shape[0]}")
    model.zero_grad(set_to_none=True)
    for xb, yb in zip(x.chunk(accumulation_steps), y.chunk(accumulation_steps)):
        (cross_entropy(model(xb), yb) / accumulation_steps).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def training_step_flops(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, checkpointing: bool = False) -> int:
    """FLOPs of one forward + backward pass, counted op by op by ``torch.utils.flop_counter``
    (matmuls), with or without activation checkpointing: the difference is the recompute cost."""
    from torch.utils.flop_counter import FlopCounterMode

    from labkit.train import cross_entropy

    ctx = activation_checkpointing(model) if checkpointing else contextlib.nullcontext()
    with ctx, FlopCounterMode(display=False) as counter:
        cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


# ----------------------------------------------------------------------------- the allocator (CUDA)
def measure_peak(fn, device=None) -> int:
    """Peak bytes the CUDA caching allocator handed out while ``fn()`` ran, above what was
    allocated before (``torch.cuda.max_memory_allocated``). CUDA only: on CPU use
    :class:`SavedTensorMeter` or :func:`profile_memory`."""
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("measure_peak needs a CUDA device (it reads torch.cuda.max_memory_allocated); on CPU use SavedTensorMeter or profile_memory")
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def allocator_stats(device=None) -> dict[str, int]:
    """``allocated`` (bytes in live tensors) vs ``reserved`` (bytes the caching allocator holds
    from the driver, what ``nvidia-smi`` shows minus the CUDA context). CUDA only."""
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("allocator_stats needs a CUDA device; the CPU allocator keeps no such statistics")
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device)}


MiB = 2**20


@dataclass
class _Block:
    size: int
    allocated: bool = False
    pending: set = field(default_factory=set)  # streams whose work must finish before a freed block is reused

    @property
    def reusable(self) -> bool:
        return not self.allocated and not self.pending


@dataclass
class _Segment:
    pool: str  # "small" or "large"
    blocks: list  # _Blocks in address order; together they cover the segment
    expandable: bool = False
    stream: int = 0  # the stream it was allocated for: its free blocks serve only that stream's requests
    number: int = 0  # the order of its cudaMalloc, an address for this simulation

    @property
    def size(self) -> int:
        return sum(b.size for b in self.blocks)


class CachingAllocatorSimulator:
    """A simulation of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``):
    it allocates no memory, it replays the allocator's documented rules on sizes, so they can be
    watched on any machine (on a GPU, :func:`cuda_allocator_layout` runs the same requests for
    real, and the unit tests compare the two).

    The rules: a request is rounded up to a multiple of 512 B. Requests of at most 1 MiB use the
    *small* pool, larger ones the *large* pool. A request takes the smallest cached free block of
    its pool that fits; if none fits, the allocator calls ``cudaMalloc`` for a new *segment*:
    2 MiB for a small request, 20 MiB for a request under 10 MiB, else the request rounded up
    to 2 MiB (its own segment). The block found is *split* when the rest is worth keeping (small
    pool: at least 512 B; large pool: more than 1 MiB): the rest stays cached as a free block.
    A freed block merges with free neighbours *of the same segment* and stays cached: the memory
    remains reserved (``memory_reserved``) but not allocated (``memory_allocated``). Blocks of
    different segments never merge, so a request can need a new segment although enough memory
    is free in total: that is fragmentation. ``empty_cache()`` returns the segments that are
    entirely free to the driver.

    ``max_split_size_mb`` (``PYTORCH_CUDA_ALLOC_CONF``, must be > 20): blocks of at least that
    size are never split, and a request smaller than it never takes one; a request at least
    that large takes a cached block only if the block is less than 20 MiB larger.
    ``expandable_segments=True``: each pool has one segment that grows by mapping pages (2 MiB
    small, 20 MiB large) at its end, so all its blocks are neighbours and can merge; in this
    simulation ``empty_cache()`` then unmaps the whole pages of the free block at the end of the
    segment (the real allocator also unmaps free pages inside it), and the two options cannot be
    combined.

    ``capacity`` (bytes, default unlimited) is the device's memory, as ``torch.cuda.set_per_process_memory_fraction``
    sets it: a ``cudaMalloc`` that would take ``reserved`` past it fails. The allocator then **frees its cached
    memory and retries**: it returns every entirely free segment to the driver (``release_cached_blocks``, what
    ``empty_cache()`` does), counts ``num_alloc_retries`` and tries once more; if that fails too it counts
    ``num_ooms`` and raises ``torch.OutOfMemoryError`` with the numbers PyTorch's message gives (with
    ``max_split_size_mb`` set, the real allocator first frees only the unsplittable cached blocks; this simulation
    frees all free segments at once). The counters have the names of ``torch.cuda.memory_stats()``'s.

    **Streams.** Every request is made on a ``stream`` (an int; 0 the default stream) and each segment belongs to
    the stream it was allocated for: its free blocks serve only that stream's requests (the real allocator keys
    its free blocks by stream), so a block freed on one stream is never handed to another, whose kernels could
    run at the same time. The allocator knows only the allocating stream. If another stream still uses the
    memory (a copy on a side stream, an NCCL collective), the block freed on its own stream would go to the next
    request there *while the other stream still reads it*; ``record_stream(handle, stream)``
    (``Tensor.record_stream``) tells it, and ``free`` then records an event on each such stream and leaves the
    block *pending* (``active_pending_free`` in a snapshot: not allocated, not reusable) until every event has
    completed. Streams here have no clock: ``stream_done(stream)`` says that all work queued on ``stream`` so
    far has finished, completing its events (the real allocator notices at its next request, querying the
    events); ``empty_cache()`` and the retry at capacity wait for every pending event first, as the real
    ``release_cached_blocks`` does (``synchronize_and_free_events``). ``address(handle)`` is where a live
    allocation lies: ``(segment number, offset)``.
    """

    MIN_BLOCK_SIZE = 512
    SMALL_SIZE = 1 * MiB
    SMALL_BUFFER = 2 * MiB
    LARGE_BUFFER = 20 * MiB
    MIN_LARGE_ALLOC = 10 * MiB
    ROUND_LARGE = 2 * MiB

    def __init__(self, max_split_size_mb: float | None = None, expandable_segments: bool = False, capacity: int | None = None):
        if max_split_size_mb is not None and (isinstance(max_split_size_mb, bool) or not isinstance(max_split_size_mb, (int, float))
                                              or not max_split_size_mb > self.LARGE_BUFFER // MiB):
            raise ValueError(f"max_split_size_mb={max_split_size_mb!r}: expected None or a number > 20 (as PyTorch requires)")
        if not isinstance(expandable_segments, bool):
            raise TypeError(f"expandable_segments: expected a bool, got {type(expandable_segments).__name__}")
        if expandable_segments and max_split_size_mb is not None:
            raise ValueError("max_split_size_mb with expandable_segments=True: this simulation models them one at a time")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0):
            raise ValueError(f"capacity={capacity!r}: expected None or a positive number of bytes (int)")
        self.capacity = math.inf if capacity is None else capacity
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.max_split_size = math.inf if max_split_size_mb is None else int(max_split_size_mb * MiB)
        self.expandable_segments = expandable_segments
        self.segments: list[_Segment] = []
        self._live: dict[int, _Block] = {}
        self._next_handle = 0
        self.cuda_malloc_calls = 0
        self._segments_made = 0

    # --- the sizes
    @classmethod
    def round_size(cls, nbytes: int) -> int:
        """A request rounded up to a multiple of 512 bytes (at least 512)."""
        return max(cls.MIN_BLOCK_SIZE, -(-nbytes // cls.MIN_BLOCK_SIZE) * cls.MIN_BLOCK_SIZE)

    @classmethod
    def segment_size(cls, size: int) -> int:
        """Bytes of the segment ``cudaMalloc`` gets for a (rounded) request no cached block serves."""
        if size <= cls.SMALL_SIZE:
            return cls.SMALL_BUFFER
        if size < cls.MIN_LARGE_ALLOC:
            return cls.LARGE_BUFFER
        return -(-size // cls.ROUND_LARGE) * cls.ROUND_LARGE

    # --- allocating and freeing
    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """Allocate ``nbytes`` (> 0) on ``stream``; returns a handle for :meth:`free`."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes={nbytes!r}: expected a positive integer")
        _check_stream(stream)
        size = self.round_size(nbytes)
        pool = "small" if size <= self.SMALL_SIZE else "large"
        found = self._cached_block(size, pool, stream) or self._new_memory(size, pool, stream)
        if found is None:  # cudaMalloc failed: free the cached segments and try once more
            self.empty_cache()
            self.num_alloc_retries += 1
            found = self._new_memory(size, pool, stream)
        if found is None:
            self.num_ooms += 1
            raise torch.OutOfMemoryError(
                f"Tried to allocate {size / MiB:.2f} MiB (simulated device capacity {self.capacity / MiB:.2f} MiB). Of the "
                f"allocated memory {self.allocated / MiB:.2f} MiB is allocated by PyTorch, and "
                f"{(self.reserved - self.allocated) / MiB:.2f} MiB is reserved by PyTorch but unallocated.")
        segment, index = found
        block = segment.blocks[index]
        remaining = block.size - size
        if remaining >= self.MIN_BLOCK_SIZE if pool == "small" else (size < self.max_split_size and remaining > self.SMALL_SIZE):
            block.size = size
            segment.blocks.insert(index + 1, _Block(remaining))
        block.allocated = True
        self._next_handle += 1
        self._live[self._next_handle] = block
        return self._next_handle

    def _cached_block(self, size: int, pool: str, stream: int):
        fits = [(b.size, s, i) for s, seg in enumerate(self.segments) if seg.pool == pool and seg.stream == stream
                for i, b in enumerate(seg.blocks) if b.reusable and b.size >= size]
        if not fits:
            return None
        best, s, i = min(fits)  # the smallest that fits (ties: the lowest address)
        if size < self.max_split_size <= best:  # an unsplittable block would be wasted on a smaller request
            return None
        if size >= self.max_split_size and best >= size + self.LARGE_BUFFER:
            return None
        return self.segments[s], i

    def _new_memory(self, size: int, pool: str, stream: int):
        """A new segment (or the expandable segment grown) for ``size``; None where ``capacity`` forbids it."""
        if not self.expandable_segments:
            if self.reserved + self.segment_size(size) > self.capacity:
                return None
            self.cuda_malloc_calls += 1
            self._segments_made += 1
            self.segments.append(_Segment(pool, [_Block(self.segment_size(size))], stream=stream, number=self._segments_made))
            return self.segments[-1], 0
        segment = next((seg for seg in self.segments if seg.pool == pool and seg.stream == stream), None)
        if segment is None:
            self._segments_made += 1
            segment = _Segment(pool, [], expandable=True, stream=stream, number=self._segments_made)
            self.segments.append(segment)
        if not segment.blocks or not segment.blocks[-1].reusable:
            segment.blocks.append(_Block(0))
        tail = segment.blocks[-1]  # the free end of the segment grows by whole pages
        page = self.SMALL_BUFFER if pool == "small" else self.LARGE_BUFFER
        growth = -(-(size - tail.size) // page) * page
        if self.reserved + growth > self.capacity:
            if tail.size == 0:
                segment.blocks.pop()
            if not segment.blocks:
                self.segments.remove(segment)
            return None
        tail.size += growth
        return segment, len(segment.blocks) - 1

    def free(self, handle: int) -> None:
        """Free an allocation: its block merges with free neighbours and stays cached; if other
        streams were recorded as using it, it waits (pending) until their work is done."""
        block = self._live_block(handle)
        del self._live[handle]
        block.allocated = False
        if block.pending:  # events recorded on the other streams: reuse waits for them
            return
        self._merge_free(block)

    def record_stream(self, handle: int, stream: int) -> None:
        """``Tensor.record_stream``: the allocation is also used by ``stream``'s queued work, so
        when it is freed it must not be reused before that work is done."""
        _check_stream(stream)
        block = self._live_block(handle)
        if stream != self._segment_of(block).stream:
            block.pending.add(stream)

    def stream_done(self, stream: int) -> None:
        """All work queued on ``stream`` so far has finished: its events complete, and blocks that
        waited only for them become free (and merge)."""
        _check_stream(stream)
        for segment in self.segments:
            for block in list(segment.blocks):
                if not block.allocated and stream in block.pending:
                    block.pending.discard(stream)
                    if not block.pending:
                        self._merge_free(block)

    def address(self, handle: int) -> tuple[int, int]:
        """``(segment number, byte offset)`` of a live allocation: equal addresses mean the same memory."""
        block = self._live_block(handle)
        segment = self._segment_of(block)
        offset = 0
        for b in segment.blocks:
            if b is block:
                return segment.number, offset
            offset += b.size
        raise AssertionError("unreachable: a live block lies in its segment")

    def _live_block(self, handle: int) -> _Block:
        if isinstance(handle, bool) or handle not in self._live:
            raise ValueError(f"handle={handle!r}: not a live allocation of this allocator")
        return self._live[handle]

    def _segment_of(self, block: _Block) -> _Segment:
        return next(seg for seg in self.segments if any(b is block for b in seg.blocks))

    def _merge_free(self, block: _Block) -> None:
        segment = self._segment_of(block)
        merged: list[_Block] = []
        for b in segment.blocks:
            if merged and b.reusable and merged[-1].reusable:
                merged[-1].size += b.size
            else:
                merged.append(b)
        segment.blocks = merged

    def empty_cache(self) -> None:
        """Return cached memory to the driver: every segment that is entirely free (expandable
        segments: the whole pages of the free block at their end), after waiting for every
        pending block's streams."""
        for stream in {st for seg in self.segments for b in seg.blocks for st in b.pending}:
            self.stream_done(stream)
        kept = []
        for segment in self.segments:
            if segment.expandable:
                tail = segment.blocks[-1] if segment.blocks and segment.blocks[-1].reusable else None
                if tail is not None:
                    page = self.SMALL_BUFFER if segment.pool == "small" else self.LARGE_BUFFER
                    tail.size %= page
                    if tail.size == 0:
                        segment.blocks.pop()
                if segment.blocks:
                    kept.append(segment)
            elif not all(b.reusable for b in segment.blocks):
                kept.append(segment)
        self.segments = kept

    # --- what it holds
    @property
    def allocated(self) -> int:
        """Bytes in allocated blocks (``torch.cuda.memory_allocated``: rounded, unsplit remainders included)."""
        return sum(b.size for seg in self.segments for b in seg.blocks if b.allocated)

    @property
    def reserved(self) -> int:
        """Bytes of all segments (``torch.cuda.memory_reserved``)."""
        return sum(seg.size for seg in self.segments)

    def snapshot(self) -> list[dict]:
        """The segments in ``torch.cuda.memory_snapshot()``'s format (the keys this simulation knows):
        ``segment_type``, ``total_size``, ``allocated_size``, ``stream``, ``blocks`` of ``size`` and ``state``
        (``active_allocated``, ``active_pending_free``: freed, waiting for other streams, or ``inactive``)."""
        def state(b: _Block) -> str:
            return "active_allocated" if b.allocated else "active_pending_free" if b.pending else "inactive"

        return [{"segment_type": seg.pool, "total_size": seg.size, "stream": seg.stream,
                 "allocated_size": sum(b.size for b in seg.blocks if b.allocated),
                 "blocks": [{"size": b.size, "state": state(b)} for b in seg.blocks]}
                for seg in self.segments]


def cuda_stream_reuse(record_stream: bool, nbytes: int = 4 * MiB, busy_cycles: int = 500_000_000) -> dict:
    """The simulator's stream scenario on the real CUDA caching allocator: a tensor made on the
    current stream is used by a side stream kept busy (``torch.cuda._sleep``), then freed; with
    ``record_stream`` it was recorded on the side stream (``Tensor.record_stream``). Returns
    ``reused_while_busy`` (the next request of its size got its address while the side stream was
    still running) and ``reused_after_done`` (after the side stream finished, a request got it)."""
    if not isinstance(record_stream, bool):
        raise TypeError(f"record_stream={record_stream!r}: expected True or False")
    for name, value in (("nbytes", nbytes), ("busy_cycles", busy_cycles)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive integer")
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_stream_reuse needs a CUDA device; CachingAllocatorSimulator shows the same on a CPU")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    where = x.data_ptr()
    side.wait_stream(torch.cuda.current_stream())  # the side stream starts after x exists
    with torch.cuda.stream(side):
        torch.cuda._sleep(busy_cycles)  # stands for a copy or collective reading x
        if record_stream:
            x.record_stream(side)
    del x
    y = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    reused_while_busy = y.data_ptr() == where and not side.query()
    del y
    side.synchronize()
    z = torch.empty(nbytes, dtype=torch.uint8, device="cuda")  # the request polls the events: x's block is free now
    reused_after_done = z.data_ptr() == where
    del z
    return dict(reused_while_busy=reused_while_busy, reused_after_done=reused_after_done)


def _check_stream(stream) -> None:
    if isinstance(stream, bool) or not isinstance(stream, int) or stream < 0:
        raise ValueError(f"stream={stream!r}: expected a non-negative integer (0: the default stream)")


def segment_layout(snapshot: list[dict]) -> list[str]:
    """One line per segment of a (real or simulated) ``memory_snapshot``: its pool, size and blocks
    (``#`` allocated, ``.`` cached free, ``~`` freed but pending: other streams may still use it), in MiB
    (KiB where not a whole MiB)."""
    def size(b: int) -> str:
        return f"{b // MiB} MiB" if b % MiB == 0 else f"{b / 1024:g} KiB"

    lines = []
    for seg in snapshot:
        marks = {"active_allocated": "#", "active_pending_free": "~"}
        blocks = " | ".join(marks.get(blk["state"], ".") + " " + size(blk["size"]) for blk in seg["blocks"])
        lines.append(f"{seg['segment_type']:<5} segment {size(seg['total_size']):>8}: [{blocks}]")
    return lines


def replay_allocations(allocator, ops) -> list[tuple[str, int, int, list[str]]]:
    """Run ``ops`` on ``allocator`` (a :class:`CachingAllocatorSimulator`, or ``"cuda"`` for the
    real caching allocator on the current GPU) and return, after each op, ``(op, allocated,
    reserved, segment lines)``. An op is ``("malloc", name, nbytes)``, ``("free", name)`` or
    ``("empty_cache",)``. On CUDA the numbers are those of the segments the ops created (the
    caching allocator is emptied first; memory other tensors hold is left out)."""
    real = allocator == "cuda"
    if real:
        if not torch.cuda.is_available():
            raise RuntimeError("replay_allocations('cuda', ...) needs a CUDA device; use a CachingAllocatorSimulator on CPU")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = {seg["address"] for seg in torch.cuda.memory_snapshot()}
    elif not isinstance(allocator, CachingAllocatorSimulator):
        raise TypeError(f"allocator: expected a CachingAllocatorSimulator or 'cuda', got {type(allocator).__name__}")
    live, rows = {}, []
    for op in ops:
        kind = op[0] if isinstance(op, tuple) and op else None
        if kind == "malloc" and len(op) == 3:
            live[op[1]] = torch.empty(op[2], dtype=torch.uint8, device="cuda") if real else allocator.malloc(op[2])
            label = f"malloc {op[1]} ({op[2]:,} B)"
        elif kind == "free" and len(op) == 2 and op[1] in live:
            handle = live.pop(op[1])
            if not real:
                allocator.free(handle)
            del handle
            label = f"free {op[1]}"
        elif op == ("empty_cache",):
            torch.cuda.empty_cache() if real else allocator.empty_cache()
            label = "empty_cache()"
        else:
            raise ValueError(f"ops: {op!r} is not ('malloc', name, nbytes), ('free', live name) or ('empty_cache',)")
        if real:
            torch.cuda.synchronize()
            snap = sorted((s for s in torch.cuda.memory_snapshot() if s["address"] not in before), key=lambda s: s["address"])
        else:
            snap = allocator.snapshot()
        allocated = sum(b["size"] for s in snap for b in s["blocks"] if b["state"] == "active_allocated")
        rows.append((label, allocated, sum(s["total_size"] for s in snap), segment_layout(snap)))
    return rows


def profile_memory(fn, row_limit: int = 8) -> str:
    """Run ``fn()`` under ``torch.profiler`` with memory profiling and return its table of the
    ops that allocated the most (``Self CPU Mem``/``Self CUDA Mem`` columns)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, profile_memory=True) as prof:
        fn()
    key = "self_cuda_memory_usage" if torch.cuda.is_available() else "self_cpu_memory_usage"
    return prof.key_averages().table(sort_by=key, row_limit=row_limit)
