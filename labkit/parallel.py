"""Splitting the model (chapter 08): tensor, sequence, pipeline and context parallelism, built
from ``torch.distributed`` calls and measured.

- :class:`CommMeter` (from :mod:`labkit.dist`, where chapter 07 first uses it) wraps the
  ``torch.distributed`` functions and counts, on this rank, the calls and bytes of every collective
  and point-to-point message; the ``*_comm`` functions below predict the same numbers from the sizes.
- Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): :class:`ColumnParallelLinear` keeps a
  slice of a weight's output features, :class:`RowParallelLinear` a slice of its input features;
  the ``f`` operator (:func:`copy_to_tensor_parallel`: identity forward, all-reduce backward) and
  the ``g`` operator (:func:`reduce_from_tensor_parallel`: all-reduce forward, identity backward)
  are autograd functions. :class:`TensorParallelSwiGLU` and :class:`TensorParallelAttention` (heads
  split across ranks) cost two all-reduces per layer forward and two backward;
  :class:`TensorParallelBlock` wraps a whole :class:`~labkit.model.TransformerBlock`.
- Sequence parallelism (Korthikanti et al. 2022): the same modules with ``sequence_parallel=True``
  run the norms on sequence shards and replace each all-reduce by an all-gather before the
  column-parallel layer and a reduce-scatter after the row-parallel one (the same bytes).
- Pipeline parallelism: :class:`PipelineStage` is a contiguous slice of a ``TransformerLM``;
  :func:`run_pipeline` executes a GPipe or 1F1B schedule over micro-batches with point-to-point
  sends of activations and gradients, recording when each rank computed what.
- Context parallelism: :func:`ring_attention` passes K/V blocks around a ring of sequence shards
  and folds them in with chapter 03's online softmax.

The per-rank functions the chapter runs are in :mod:`labkit.parallel_demos`; the layout
calculator is :mod:`labkit.parallel_plan`.
"""
from __future__ import annotations

import copy
import math
import time

import torch
import torch.distributed as dist
from torch import nn

from labkit.attention import online_softmax_update
from labkit.dist import CommMeter, collective_bytes_sent  # noqa: F401  (the meter lives with chapter 07's collectives)
from labkit.memory import SavedTensorMeter
from labkit.model import TransformerBlock, TransformerLM
from labkit.nn import ACTIVATIONS, GLU, MultiHeadSelfAttention, causal_mask, grouped_query_attention


# ============================================================================ tensor parallelism: f and g
def _group_rank_size(group) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("tensor parallelism needs a process group: run inside labkit.dist.launch or torchrun")
    return dist.get_rank(group), dist.get_world_size(group)


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's ``f``: identity forward; backward all-reduces the partial input gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward (sum the partial outputs); identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _all_gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    pieces = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(pieces, x.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def _reduce_scatter_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(f"x: dim {dim} of size {x.shape[dim]} must be divisible by the tensor-parallel size {world}")
    chunks = [c.contiguous() for c in x.chunk(world, dim=dim)]
    out = torch.empty_like(chunks[rank])
    dist.reduce_scatter(out, chunks, group=group)
    return out


class _GatherFromSequenceParallel(torch.autograd.Function):
    """Sequence parallelism's ``g``: all-gather the sequence shards forward, reduce-scatter the
    gradient backward (each rank's column-parallel weights produced a partial gradient of the
    whole gathered input; the sum of the rank's own shard is what it needs)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_along(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Sequence parallelism's ``ḡ``: reduce-scatter the partial outputs along the sequence
    forward (sum and keep this rank's shard), all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_along(grad, ctx.dim, ctx.group), None, None


def copy_to_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """``f``: identity forward, all-reduce of the gradient backward."""
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """``g``: all-reduce forward, identity backward."""
    return _ReduceFromTensorParallel.apply(x, group)


def gather_from_sequence_parallel(x: torch.Tensor, group=None, dim: int = -2) -> torch.Tensor:
    """All-gather sequence shards along ``dim`` (forward); reduce-scatter backward."""
    return _GatherFromSequenceParallel.apply(x, dim % x.dim(), group)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group=None, dim: int = -2) -> torch.Tensor:
    """Reduce-scatter along ``dim`` (forward); all-gather backward."""
    return _ReduceScatterToSequenceParallel.apply(x, dim % x.dim(), group)


def tp_collectives(layer: str, sequence_parallel: bool = False) -> tuple[str | None, str | None]:
    """``(forward, backward)``: the collective a tensor-parallel ``layer`` (``"column"`` or
    ``"row"``) runs at its boundary, by ``torch.distributed`` name, ``None`` for none.

    Column-parallel (output features split): its input is replicated, so forward needs nothing;
    backward, each rank's slice of the weight yields a *partial* input gradient: all-reduce (f).
    Row-parallel (input features split): each rank's output is a partial sum: all-reduce forward
    (g); the output gradient is replicated, so backward needs nothing. With sequence parallelism
    the input of a column layer arrives as sequence shards (all-gather forward, reduce-scatter
    backward) and a row layer's output leaves as shards (reduce-scatter forward, all-gather
    backward). The modules below are built exactly so; the chapter's tests check it with
    :class:`CommMeter`.
    """
    table = {("column", False): (None, "all_reduce"), ("row", False): ("all_reduce", None),
             ("column", True): ("all_gather", "reduce_scatter"), ("row", True): ("reduce_scatter", "all_gather")}
    if layer not in ("column", "row"):
        raise ValueError(f"layer={layer!r}: expected 'column' or 'row'")
    return table[(layer, bool(sequence_parallel))]


# ============================================================================ tensor-parallel layers
class ColumnParallelLinear(nn.Module):
    """``Y = X Wᵀ`` with ``W``'s rows (output features) split: rank ``r`` keeps rows
    ``r·d_out/N .. (r+1)·d_out/N - 1`` and returns its slice of ``Y`` (``[..., d_out/N]``).

    ``sync_input`` puts ``f`` in front (all-reduce of the input gradient in backward; with
    ``sequence_parallel``, an all-gather of the sequence shards instead). Layers that share one
    input (SwiGLU's ``w1``/``w3``, attention's q/k/v) take ``sync_input=False`` and let their
    parent apply ``f`` once.
    """

    def __init__(self, d_in: int, d_out: int, group=None, sync_input: bool = True, sequence_parallel: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.rank, self.world_size = _group_rank_size(group)
        if d_out % self.world_size:
            raise ValueError(f"d_out={d_out} must be divisible by the tensor-parallel size {self.world_size}")
        self.group, self.sync_input, self.sequence_parallel = group, sync_input, sequence_parallel
        self.d_in, self.d_out, self.d_out_local = d_in, d_out, d_out // self.world_size
        self.weight = nn.Parameter(torch.empty(self.d_out_local, d_in, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=math.sqrt(2.0 / (d_in + d_out)))

    @classmethod
    def from_linear(cls, linear: nn.Module, group=None, **kwargs) -> "ColumnParallelLinear":
        """This rank's slice of a full ``Linear`` (the same weights on every rank)."""
        weight = linear.weight
        layer = cls(weight.shape[1], weight.shape[0], group, device=weight.device, dtype=weight.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(weight[layer.rank * layer.d_out_local:(layer.rank + 1) * layer.d_out_local])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sync_input:
            x = gather_from_sequence_parallel(x, self.group) if self.sequence_parallel else copy_to_tensor_parallel(x, self.group)
        if x.shape[-1] != self.d_in:
            raise ValueError(f"x: last dim must be d_in={self.d_in}, got shape {tuple(x.shape)}")
        return x @ self.weight.T

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out} (this rank: {self.d_out_local}), sequence_parallel={self.sequence_parallel}"


class RowParallelLinear(nn.Module):
    """``Y = X Wᵀ`` with ``W``'s columns (input features) split: rank ``r`` takes its slice of
    ``X`` (``[..., d_in/N]``, what a column-parallel layer produced) and computes a partial
    ``Y``; ``g`` sums the partials (all-reduce; with ``sequence_parallel`` a reduce-scatter that
    leaves each rank its sequence shard)."""

    def __init__(self, d_in: int, d_out: int, group=None, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.rank, self.world_size = _group_rank_size(group)
        if d_in % self.world_size:
            raise ValueError(f"d_in={d_in} must be divisible by the tensor-parallel size {self.world_size}")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.d_in, self.d_out, self.d_in_local = d_in, d_out, d_in // self.world_size
        self.weight = nn.Parameter(torch.empty(d_out, self.d_in_local, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=math.sqrt(2.0 / (d_in + d_out)))

    @classmethod
    def from_linear(cls, linear: nn.Module, group=None, **kwargs) -> "RowParallelLinear":
        """This rank's slice of a full ``Linear`` (the same weights on every rank)."""
        weight = linear.weight
        layer = cls(weight.shape[1], weight.shape[0], group, device=weight.device, dtype=weight.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(weight[:, layer.rank * layer.d_in_local:(layer.rank + 1) * layer.d_in_local])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.d_in_local:
            raise ValueError(f"x: last dim must be this rank's slice d_in/N={self.d_in_local}, got shape {tuple(x.shape)}")
        partial = x @ self.weight.T
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(partial, self.group)
        return reduce_from_tensor_parallel(partial, self.group)

    def extra_repr(self) -> str:
        return f"d_in={self.d_in} (this rank: {self.d_in_local}), d_out={self.d_out}, sequence_parallel={self.sequence_parallel}"


def _enter(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """The shared input of a tensor-parallel sublayer: ``f``, or the sequence all-gather."""
    return gather_from_sequence_parallel(x, group) if sequence_parallel else copy_to_tensor_parallel(x, group)


class TensorParallelSwiGLU(nn.Module):
    """A :class:`labkit.nn.GLU` (``w2(act(w1 x) · w3 x)``) split Megatron-style: ``w1`` and
    ``w3`` column-parallel (each rank computes ``d_ff/N`` hidden features, and the gate acts
    element-wise, so no communication is needed between them), ``w2`` row-parallel. One ``f``
    before (all-reduce in backward) and one ``g`` after (all-reduce in forward)."""

    def __init__(self, glu: GLU, group=None, sequence_parallel: bool = False):
        super().__init__()
        if not isinstance(glu, GLU):
            raise TypeError(f"glu: expected a labkit.nn.GLU, got {type(glu).__name__}")
        self.group, self.sequence_parallel, self.activation = group, sequence_parallel, glu.activation
        self.w1 = ColumnParallelLinear.from_linear(glu.w1, group, sync_input=False)
        self.w3 = ColumnParallelLinear.from_linear(glu.w3, group, sync_input=False)
        self.w2 = RowParallelLinear.from_linear(glu.w2, group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _enter(x, self.group, self.sequence_parallel)
        return self.w2(ACTIVATIONS[self.activation](self.w1(x)) * self.w3(x))


class TensorParallelAttention(MultiHeadSelfAttention):
    """A :class:`labkit.nn.MultiHeadSelfAttention` with its heads split across ranks: rank ``r``
    keeps query heads ``r·H/N ..`` and K/V heads ``r·H_kv/N ..`` (``q/k/v_proj`` column-parallel,
    so a rank's heads are whole and attention runs locally), ``output_proj`` row-parallel. The
    forward pass is the parent's, on this rank's heads, between ``f`` and ``g``."""

    def __init__(self, attn: MultiHeadSelfAttention, group=None, sequence_parallel: bool = False):
        if not isinstance(attn, MultiHeadSelfAttention):
            raise TypeError(f"attn: expected a labkit.nn.MultiHeadSelfAttention, got {type(attn).__name__}")
        _, world = _group_rank_size(group)
        if attn.num_heads % world or attn.num_kv_heads % world:
            raise ValueError(f"attn: num_heads={attn.num_heads} and num_kv_heads={attn.num_kv_heads} must be divisible by "
                             f"the tensor-parallel size {world} (each rank keeps whole heads)")
        weight = attn.q_proj.weight
        super().__init__(attn.d_model, attn.num_heads // world, attn.num_kv_heads // world, rope=attn.rope,
                         head_dim=attn.head_dim, qk_norm=attn.q_norm is not None, device="meta", dtype=weight.dtype,
                         use_triton=attn.use_triton)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.q_proj = ColumnParallelLinear.from_linear(attn.q_proj, group, sync_input=False)
        self.k_proj = ColumnParallelLinear.from_linear(attn.k_proj, group, sync_input=False)
        self.v_proj = ColumnParallelLinear.from_linear(attn.v_proj, group, sync_input=False)
        self.output_proj = RowParallelLinear.from_linear(attn.output_proj, group, sequence_parallel=sequence_parallel)
        if attn.q_norm is not None:  # per-head norms: replicated
            self.q_norm, self.k_norm = copy.deepcopy(attn.q_norm), copy.deepcopy(attn.k_norm)

    def forward(self, x: torch.Tensor, token_positions=None, kv_cache=None, layer_idx: int = 0) -> torch.Tensor:
        return super().forward(_enter(x, self.group, self.sequence_parallel), token_positions, kv_cache, layer_idx)

    def finish_gradient_synchronization(self) -> None:
        """QK-norm's weights are shared by all heads, and this rank saw only its own: sum their
        gradients over the ranks (a small all-reduce of ``2·head_dim`` values; no-op without QK-norm)."""
        for norm in (self.q_norm, self.k_norm):
            if norm is not None and norm.weight.grad is not None:
                dist.all_reduce(norm.weight.grad, group=self.group)


class TensorParallelBlock(nn.Module):
    """A :class:`labkit.model.TransformerBlock` under tensor parallelism: attention and SwiGLU
    split across the ranks of ``group``, norms replicated. With ``sequence_parallel`` the input
    and output are sequence shards ``[batch, seq/N, d_model]``: the norms and residual adds run on
    the shard. Call :meth:`finish_gradient_synchronization` after backward: it sums the gradients
    of the replicated weights that saw only part of the data on each rank (the norms' over the
    sequence shards under sequence parallelism; QK-norm's over the heads)."""

    def __init__(self, block: TransformerBlock, group=None, sequence_parallel: bool = False):
        super().__init__()
        if not isinstance(block, TransformerBlock) or not isinstance(block.ffn, GLU):
            raise TypeError(f"block: expected a dense labkit.model.TransformerBlock, got {type(block).__name__}")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn = TensorParallelAttention(block.attn, group, sequence_parallel)
        self.ffn = TensorParallelSwiGLU(block.ffn, group, sequence_parallel)

    def forward(self, x: torch.Tensor, token_positions=None, kv_cache=None, layer_idx: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), token_positions, kv_cache, layer_idx)
        return x + self.ffn(self.ln2(x))

    def finish_gradient_synchronization(self) -> None:
        self.attn.finish_gradient_synchronization()
        if self.sequence_parallel:  # each rank normalised only its shard of the tokens
            for p in list(self.ln1.parameters()) + list(self.ln2.parameters()):
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.group)


def tensor_parallel_model(model: TransformerLM, group=None) -> TransformerLM:
    """A copy of ``model`` whose blocks are :class:`TensorParallelBlock`s (embedding, final norm
    and LM head replicated: every rank computes them on the same input, so their gradients agree
    without communication). Train it like the original."""
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model: expected a labkit.model.TransformerLM, got {type(model).__name__}")
    tp = copy.deepcopy(model)
    tp.layers = nn.ModuleList(TensorParallelBlock(block, group) for block in model.layers)
    return tp


def finish_gradient_synchronization(model: nn.Module) -> None:
    """Call every tensor-parallel module's ``finish_gradient_synchronization`` (after backward,
    before the optimizer step)."""
    for module in model.modules():
        if isinstance(module, TensorParallelBlock):
            module.finish_gradient_synchronization()


# ============================================================================ vocabulary-parallel cross-entropy
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token ``logsumexp(z) - z[target]`` over a vocabulary split across the ranks (Megatron-LM):
    three all-reduces of one number per token (the max, the sum of exponentials, the target's
    logit, which lives on one rank), never the logits. Backward needs no communication: this
    rank's slice of ``softmax(z) - onehot(target)``."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        rank, shard = dist.get_rank(group), logits.shape[-1]
        logits = logits.float()
        peak = logits.amax(dim=-1)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        exps = torch.exp(logits - peak[..., None])
        total = exps.sum(dim=-1)
        dist.all_reduce(total, group=group)
        local = targets - rank * shard
        mine = (local >= 0) & (local < shard)
        target_logit = torch.where(mine, logits.gather(-1, local.clamp(0, shard - 1)[..., None]).squeeze(-1) - peak,
                                   torch.zeros_like(peak))
        dist.all_reduce(target_logit, group=group)
        ctx.save_for_backward(exps / total[..., None], local, mine)
        return torch.log(total) - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local.clamp(0, softmax.shape[-1] - 1)[..., None], -mine.to(softmax.dtype)[..., None])
        return grad_logits * grad[..., None], None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """The per-token cross-entropy of logits whose vocabulary is split across the ranks of
    ``group``: rank ``r`` holds ``logits[..., V/N]``, the columns ``r·V/N ..`` of the whole
    ``[..., V]`` (what a column-parallel LM head computes); ``targets`` (the whole vocabulary's
    ids, the same on every rank). Returns ``[...]`` float32 losses, the same on every rank, equal
    to ``cross_entropy(all logits, targets, reduction="none")``; its gradient reaches only this
    rank's logits. Sends 3 numbers per token where gathering the logits would send ``V``."""
    _group_rank_size(group)  # a process group, or a clear error
    if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets: expected a tensor of integer token ids, got {getattr(targets, 'dtype', type(targets).__name__)}")
    if logits.dim() < 1 or logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits, targets: expected logits [..., V/N] with the leading shape of targets, "
                         f"got {tuple(logits.shape)} and {tuple(targets.shape)}")
    return _VocabParallelCrossEntropy.apply(logits, targets.long(), group)


# ============================================================================ context parallelism: who computes what
def context_parallel_positions(seq_len: int, world_size: int, layout: str = "contiguous") -> list[list[int]]:
    """The token positions each rank of a context-parallel group holds: ``"contiguous"``, rank ``r``
    the ``r``-th ``seq_len/N`` positions; ``"zigzag"`` (Llama 3), the sequence cut into ``2N``
    chunks and rank ``r`` given chunks ``r`` and ``2N - 1 - r``, an early and a late one."""
    _check_positive_ints(seq_len=seq_len, world_size=world_size)
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"layout={layout!r}: expected 'contiguous' or 'zigzag'")
    pieces = world_size if layout == "contiguous" else 2 * world_size
    if seq_len % pieces:
        raise ValueError(f"seq_len={seq_len} must be divisible by {pieces} for the {layout} layout on {world_size} ranks")
    size = seq_len // pieces
    chunk = lambda c: list(range(c * size, (c + 1) * size))  # noqa: E731
    if layout == "contiguous":
        return [chunk(r) for r in range(world_size)]
    return [chunk(r) + chunk(2 * world_size - 1 - r) for r in range(world_size)]


def causal_attention_work(seq_len: int, world_size: int, layout: str = "contiguous") -> list[int]:
    """Query-key pairs each rank scores under a causal mask when it holds the queries of
    :func:`context_parallel_positions` and sees every key: a query at position ``t`` attends to
    ``t + 1`` keys. Contiguous shards leave the last rank about ``2N - 1`` times the first's work;
    the zig-zag layout gives every rank the same."""
    return [sum(t + 1 for t in positions) for positions in context_parallel_positions(seq_len, world_size, layout)]


# ============================================================================ predicted communication
def _check_positive_ints(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r}: expected a positive integer")


def tensor_parallel_comm(batch: int, seq: int, d_model: int, tp: int, bytes_per_element: int, sequence_parallel: bool = False,
                         sublayers: int = 2) -> dict[str, dict[str, dict]]:
    """Predicted collectives of one tensor-parallel transformer layer (``sublayers`` = 2:
    attention and MLP; 1 for one of them), per rank: ``{"forward"|"backward": {op: {"calls",
    "bytes", "sent"}}}``, with ``bytes`` the tensor argument as :class:`CommMeter` counts it and
    ``sent`` the ring algorithm's bytes (:func:`collective_bytes_sent`).

    Each sublayer's boundary activation is ``M = batch·seq·d_model·bytes_per_element``. Without
    sequence parallelism: one all-reduce of ``M`` forward (g) and one backward (f) per sublayer.
    With it: an all-gather of the ``M/tp`` shard and a reduce-scatter of ``M``, each way; each
    sends ``(tp-1)/tp·M``, so together exactly what the all-reduce sent.
    """
    _check_positive_ints(batch=batch, seq=seq, d_model=d_model, tp=tp, bytes_per_element=bytes_per_element, sublayers=sublayers)
    full = batch * seq * d_model * bytes_per_element
    if sequence_parallel:
        if seq % tp:
            raise ValueError(f"seq={seq} must be divisible by tp={tp} for sequence parallelism")
        ops = {"all_gather": full // tp, "reduce_scatter": full}
    else:
        ops = {"all_reduce": full}
    per_pass = {op: {"calls": sublayers, "bytes": sublayers * size, "sent": sublayers * collective_bytes_sent(op, size, tp)}
                for op, size in ops.items()}
    return {"forward": per_pass, "backward": copy.deepcopy(per_pass)}


def tp_comm_bytes(batch: int, seq: int, d_model: int, tp: int, bytes_per_element: int) -> float:
    """Bytes one rank sends per training step (forward and backward) for one tensor-parallel
    transformer layer, with ring all-reduces: 4 all-reduces (2 forward, 2 backward) of the
    ``batch·seq·d_model`` activation, each sending ``2(tp-1)/tp`` of it."""
    comm = tensor_parallel_comm(batch, seq, d_model, tp, bytes_per_element)
    return sum(op["sent"] for passes in comm.values() for op in passes.values())


def bubble_fraction(num_stages: int, micro_batches: int) -> float:
    """Idle fraction of a synchronous pipeline (GPipe or 1F1B) with equal stages:
    ``(p - 1) / (m + p - 1)`` for ``p`` stages and ``m`` micro-batches. The schedule lasts
    ``m + p - 1`` slots per direction, and each stage works in ``m`` of them."""
    _check_positive_ints(num_stages=num_stages, micro_batches=micro_batches)
    return (num_stages - 1) / (micro_batches + num_stages - 1)


def pipeline_comm(micro_batches: int, micro_batch: int, seq: int, d_model: int, bytes_per_element: int) -> dict:
    """Point-to-point traffic of one interior pipeline stage per step: it receives and sends one
    activation ``micro_batch·seq·d_model`` per micro-batch forward, and the same-sized gradient
    backward. ``{"sends", "bytes_sent"}`` per stage boundary and direction (the first stage only
    sends forward, the last only backward)."""
    _check_positive_ints(micro_batches=micro_batches, micro_batch=micro_batch, seq=seq, d_model=d_model,
                         bytes_per_element=bytes_per_element)
    message = micro_batch * seq * d_model * bytes_per_element
    return {"message_bytes": message, "sends": micro_batches, "bytes_sent": micro_batches * message}


def ring_attention_comm(batch: int, seq: int, kv_heads: int, head_dim: int, cp: int, bytes_per_element: int) -> dict:
    """Bytes one rank sends in a ring-attention forward: ``cp - 1`` steps, each passing on a K/V
    block of ``2·batch·kv_heads·(seq/cp)·head_dim`` elements (the backward pass sends as much
    again, in the other direction)."""
    _check_positive_ints(batch=batch, seq=seq, kv_heads=kv_heads, head_dim=head_dim, cp=cp, bytes_per_element=bytes_per_element)
    if seq % cp:
        raise ValueError(f"seq={seq} must be divisible by cp={cp}")
    block = 2 * batch * kv_heads * (seq // cp) * head_dim * bytes_per_element
    return {"steps": cp - 1, "block_bytes": block, "bytes_sent": (cp - 1) * block}


# ============================================================================ pipeline parallelism
def split_layers(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as even as possible, with any extra layer going to the interior
    stages first: the first stage also holds the embedding and the last the LM head and loss
    (Llama 3 405B's 126 layers on 16 stages: 7 on the first and last, 8 on the others)."""
    _check_positive_ints(num_layers=num_layers, num_stages=num_stages)
    if num_stages > num_layers:
        raise ValueError(f"num_stages={num_stages} exceeds num_layers={num_layers}: every stage needs a layer")
    counts = [num_layers // num_stages] * num_stages
    extra = num_layers % num_stages
    order = list(range(1, num_stages - 1)) + [0, num_stages - 1] if num_stages > 2 else list(range(num_stages))
    for stage in order[:extra]:
        counts[stage] += 1
    return counts


class PipelineStage(nn.Module):
    """Stage ``stage`` of ``num_stages`` of a ``TransformerLM``: its slice of the blocks, plus
    the token embedding on the first stage and the final norm and LM head on the last. The
    stages, applied one after the other, compute the model's forward pass."""

    def __init__(self, model: TransformerLM, stage: int, num_stages: int):
        super().__init__()
        if not isinstance(model, TransformerLM):
            raise TypeError(f"model: expected a labkit.model.TransformerLM, got {type(model).__name__}")
        if model.config.tie_embeddings and num_stages > 1:
            raise ValueError("model: tied embeddings would live on two stages; use tie_embeddings=False")
        if not (isinstance(stage, int) and 0 <= stage < num_stages):
            raise ValueError(f"stage={stage!r}: expected 0 <= stage < num_stages={num_stages}")
        counts = split_layers(model.config.num_layers, num_stages)
        start = sum(counts[:stage])
        self.stage, self.num_stages, self.first_layer = stage, num_stages, start
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.token_embeddings = copy.deepcopy(model.token_embeddings) if self.is_first else None
        self.layers = nn.ModuleList(copy.deepcopy(model.layers[i]) for i in range(start, start + counts[stage]))
        self.ln_final = copy.deepcopy(model.ln_final) if self.is_last else None
        self.lm_head = copy.deepcopy(model.lm_head) if self.is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or the previous stage's activation -> the next activation
        (last stage: logits)."""
        if self.is_first:
            x = self.token_embeddings(x)
        for offset, layer in enumerate(self.layers):
            x = layer(x, None, None, self.first_layer + offset)
        return self.lm_head(self.ln_final(x)) if self.is_last else x


def gpipe_schedule(num_stages: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """GPipe: every micro-batch forward, then every micro-batch backward. ``[("F", i)...,
    ("B", i)...]``; a stage holds the activations of all ``m`` micro-batches at once."""
    _check_schedule_args(num_stages, micro_batches, stage)
    return [("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)]


def one_f_one_b_schedule(num_stages: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """1F1B (PipeDream-Flush): ``p - stage - 1`` warm-up forwards, then alternate one forward and
    one backward, then the remaining backwards. The same bubble as GPipe, but stage ``s`` never
    holds more than ``p - s`` micro-batches' activations."""
    _check_schedule_args(num_stages, micro_batches, stage)
    warmup = min(num_stages - stage - 1, micro_batches)
    actions = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while forward < micro_batches:
        actions += [("F", forward), ("B", backward)]
        forward, backward = forward + 1, backward + 1
    return actions + [("B", i) for i in range(backward, micro_batches)]


def interleaved_one_f_one_b_schedule(num_stages: int, micro_batches: int, stage: int, chunks: int = 2) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): each rank holds ``chunks`` model
    chunks of ``L/(chunks·p)`` layers (rank ``s``'s chunk ``c`` is virtual stage ``c·p + s``), so a
    micro-batch passes every rank ``chunks`` times and each pass is ``chunks`` times shorter.
    ``[("F"|"B", micro_batch, chunk), ...]``. Micro-batches go in rounds of ``p``: forwards run
    chunk 0 of a round's ``p`` micro-batches, then chunk 1, ...; backwards the chunks in reverse.
    ``2(p - s - 1) + (chunks - 1)·p`` warm-up forwards, then one forward and one backward, then the
    remaining backwards. Needs ``micro_batches`` a multiple of ``p``; the bubble shrinks to
    ``(p-1)/(chunks·m)`` of the compute time (:func:`interleaved_bubble_fraction`)."""
    _check_schedule_args(num_stages, micro_batches, stage)
    _check_positive_ints(chunks=chunks)
    if micro_batches % num_stages:
        raise ValueError(f"micro_batches={micro_batches}: the interleaved schedule needs a multiple of num_stages={num_stages}")
    p, passes = num_stages, chunks * micro_batches

    def pass_number(k: int, forward: bool) -> tuple[int, int]:  # the k-th forward (backward) pass: (micro-batch, chunk)
        chunk = (k // p) % chunks
        return (k // (p * chunks)) * p + k % p, chunk if forward else chunks - 1 - chunk

    warmup = min(2 * (p - stage - 1) + (chunks - 1) * p, passes)
    actions = [("F", *pass_number(k, True)) for k in range(warmup)]
    for k in range(passes - warmup):
        actions += [("F", *pass_number(warmup + k, True)), ("B", *pass_number(k, False))]
    return actions + [("B", *pass_number(k, False)) for k in range(passes - warmup, passes)]


def zero_bubble_schedule(num_stages: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the backward pass split into
    ``"B"`` (the input's gradient, which the previous stage waits for) and ``"W"`` (the weights'
    gradient, which nobody waits for). 1F1B's order of forwards and ``B``s, with stage ``s``
    delaying its ``W``s by ``s`` micro-batches: the ``B``s then reach the first stage sooner,
    and the late ``W``s fill the tail where 1F1B idles. Every stage holds at most ``p``
    micro-batches (forwarded, weight gradient not yet computed), 1F1B's first stage's peak. With
    forward, ``B`` and ``W`` equally long the bubble is a third of 1F1B's
    (:func:`zero_bubble_fraction`)."""
    _check_schedule_args(num_stages, micro_batches, stage)
    warmup = min(num_stages - stage - 1, micro_batches)
    actions = [("F", i) for i in range(warmup)]
    weights = 0
    for i in range(micro_batches):
        if warmup + i < micro_batches:
            actions.append(("F", warmup + i))
        actions.append(("B", i))
        if i >= stage:
            actions.append(("W", weights))
            weights += 1
    return actions + [("W", i) for i in range(weights, micro_batches)]


def interleaved_bubble_fraction(num_stages: int, micro_batches: int, chunks: int) -> float:
    """Idle fraction of the interleaved 1F1B step with equal stages: the fill and drain last
    ``(p-1)/chunks`` slots instead of ``p - 1``, so ``(p-1) / (chunks·m + p - 1)`` of the step
    (``(p-1)/(chunks·m)`` of the compute time, Narayanan et al. 2021)."""
    _check_positive_ints(num_stages=num_stages, micro_batches=micro_batches, chunks=chunks)
    return (num_stages - 1) / (chunks * micro_batches + num_stages - 1)


def zero_bubble_fraction(num_stages: int, micro_batches: int, forward_time: float = 1.0, input_grad_time: float = 1.0,
                         weight_grad_time: float = 1.0) -> float:
    """Idle fraction of ZB-H1 with equal stages: each stage idles ``(p-1)(T_F + T_B - T_W)`` of a
    step that computes ``m (T_F + T_B + T_W)`` (Qi et al. 2023, section 2.1; 1F1B idles
    ``(p-1)(T_F + T_B + T_W)``). Holds for ``T_W <= T_B`` and ``m >= p``."""
    _check_positive_ints(num_stages=num_stages, micro_batches=micro_batches)
    idle = (num_stages - 1) * (forward_time + input_grad_time - weight_grad_time)
    return idle / (micro_batches * (forward_time + input_grad_time + weight_grad_time) + idle)


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}
# What simulate_schedule can time besides: an interleaved schedule needs model chunks, a zero-bubble one a
# backward split in two; run_pipeline runs only the two above.
SIMULATED_SCHEDULES = {**SCHEDULES, "interleaved-1f1b": interleaved_one_f_one_b_schedule, "zb-h1": zero_bubble_schedule}


def _check_schedule_args(num_stages, micro_batches, stage) -> None:
    _check_positive_ints(num_stages=num_stages, micro_batches=micro_batches)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage!r}: expected an integer in [0, {num_stages})")


def run_pipeline(stage: PipelineStage, schedule: str, inputs: list[torch.Tensor] | None, targets: list[torch.Tensor] | None,
                 micro_batches: int, activation_shape: tuple, loss_fn=None, group=None, clock_start: float | None = None) -> dict:
    """Run one training step's forward and backward passes of ``stage`` (this rank is stage
    ``stage.stage``; ranks ``0..p-1`` of the default group are the stages in order) under
    ``schedule`` (``"gpipe"`` or ``"1f1b"``).

    ``inputs``: the micro-batches of token ids (first stage; None elsewhere); ``targets``: the
    micro-batches of targets (last stage). Activations ``activation_shape`` and their gradients
    travel with ``isend``/``irecv`` (tag ``i`` forward, ``m + i`` backward, so messages never
    pair up wrongly); each micro-batch's loss is divided by ``m``, so the accumulated gradients
    are those of the mean loss over the whole batch. Returns ``{"loss"`` (last stage: the mean
    loss; else None), ``"events"``: ``[(kind, micro_batch, start, end)]`` in seconds since
    ``clock_start`` (a ``time.perf_counter()`` value every rank shares; default: now),
    ``"peak_activation_bytes"`` (the most bytes autograd held at once, by
    :class:`~labkit.memory.SavedTensorMeter`), ``"activation_bytes_per_micro_batch"``}.
    """
    from labkit.train import cross_entropy

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: expected one of {sorted(SCHEDULES)}")
    rank, p = stage.stage, stage.num_stages
    actions = SCHEDULES[schedule](p, micro_batches, rank)
    loss_fn = loss_fn or cross_entropy
    device = next(stage.parameters()).device
    dtype = next(stage.parameters()).dtype
    start = time.perf_counter() if clock_start is None else clock_start
    stage_inputs, outputs, pending_sends, events = {}, {}, [], []
    total_loss, per_micro_batch = 0.0, None
    with SavedTensorMeter(stage) as meter:
        for kind, i in actions:
            if kind == "F":
                if stage.is_first:
                    x = inputs[i]
                else:
                    x = torch.empty(activation_shape, device=device, dtype=dtype)
                    dist.recv(x, rank - 1, group=group, tag=i)
                    x.requires_grad_()
                t0 = time.perf_counter()
                y = stage(x)
                if stage.is_last:
                    y = loss_fn(y, targets[i]) / micro_batches
                    total_loss += y.item()
                t1 = time.perf_counter()
                if per_micro_batch is None:
                    per_micro_batch = meter.activation_bytes
                if not stage.is_last:
                    pending_sends.append(dist.isend(y.detach().contiguous(), rank + 1, group=group, tag=i))
                stage_inputs[i], outputs[i] = x, y
            else:
                y, x = outputs.pop(i), stage_inputs.pop(i)
                if stage.is_last:
                    grad = None
                else:
                    grad = torch.empty_like(y)
                    dist.recv(grad, rank + 1, group=group, tag=micro_batches + i)
                t0 = time.perf_counter()
                torch.autograd.backward(y, grad)
                t1 = time.perf_counter()
                if not stage.is_first:
                    pending_sends.append(dist.isend(x.grad.contiguous(), rank - 1, group=group, tag=micro_batches + i))
                del y, x
            events.append((kind, i, t0 - start, t1 - start))
        for handle in pending_sends:
            handle.wait()
    return {"loss": total_loss if stage.is_last else None, "events": events, "peak_activation_bytes": meter.peak_bytes,
            "activation_bytes_per_micro_batch": per_micro_batch}


def peak_in_flight(actions, chunks: int = 1) -> float:
    """The most micro-batches whose activations one stage holds at once under its ``actions``
    (``[(kind, micro_batch[, chunk]), ...]`` or the events of one stage), in units of one
    micro-batch through the whole stage: a forward adds ``1/chunks``, and the pass that frees it
    removes as much, the backward, or ``"W"`` where the backward is split (B keeps what W needs)."""
    _check_positive_ints(chunks=chunks)
    actions = [a[:1] for a in actions]
    freeing = "W" if any(kind == "W" for kind, in actions) else "B"
    held = most = 0
    for kind, in actions:
        held += 1 if kind == "F" else -1 if kind == freeing else 0
        most = max(most, held)
    return most / chunks


def measured_bubble(events_by_rank: dict[int, list]) -> float:
    """Idle fraction of a pipeline run from its per-rank events: ``1 - busy / (p · makespan)``,
    the makespan running from the first event's start to the last event's end over all ranks."""
    if not events_by_rank or not all(events_by_rank.values()):
        raise ValueError("events_by_rank: expected {rank: [(kind, micro_batch, start, end), ...]} with events on every rank")
    start = min(e[2] for events in events_by_rank.values() for e in events)
    end = max(e[3] for events in events_by_rank.values() for e in events)
    busy = sum(e[3] - e[2] for events in events_by_rank.values() for e in events)
    return 1.0 - busy / (len(events_by_rank) * (end - start))


class ScheduleDeadlock(RuntimeError):
    """A pipeline schedule in which no stage can go on: ``waiting`` maps each stage that still has
    work to ``(action, dependency)``, its next action and the ``(kind, stage, micro_batch)`` it waits for."""

    def __init__(self, waiting: dict[int, tuple]):
        self.waiting = waiting
        super().__init__("the schedule deadlocks: " + "; ".join(
            f"stage {s} waits at {a[0]}{a[1]} for stage {d[1]}'s {d[0]}{d[2]}" for s, (a, d) in waiting.items()))


def simulate_schedule(schedule, num_stages: int, micro_batches: int, forward_time=1.0, backward_time=2.0,
                      weight_grad_time: float | None = None, chunks: int = 1, pass_times: dict | None = None) -> dict[int, list]:
    """The events :func:`run_pipeline` would record if every pass took exactly its time and
    messages were free: each action starts when its stage is free and its input has arrived.

    ``schedule``: a name in :data:`SIMULATED_SCHEDULES`, or ``{stage: [action, ...]}`` for every
    stage, an action being ``(kind, micro_batch)`` or, with model chunks, ``(kind, micro_batch,
    chunk)``; rank ``s``'s chunk ``c`` is virtual stage ``c·p + s`` of ``chunks·p``. A forward
    ``"F"`` needs the previous virtual stage's forward of its micro-batch; a backward ``"B"`` the
    next one's ``"B"`` (the last one: its own forward); a weight gradient ``"W"`` (zero-bubble
    schedules, which split the backward) its own ``"B"``.

    ``forward_time`` and ``backward_time`` (the whole backward): one stage's passes over one
    micro-batch, a number or one per stage; a chunk's pass takes ``1/chunks`` of its stage's. Where
    a schedule has ``"W"`` actions, ``"B"`` takes ``backward_time - weight_grad_time`` and ``"W"``
    ``weight_grad_time`` (default: half the backward, as Qi et al. assume). ``pass_times``:
    ``{(stage, kind, micro_batch[, chunk]): duration}`` for single passes (see :func:`replay_timeline`).

    Returns ``{stage: [(kind, micro_batch, start, end[, chunk])]}``; :func:`measured_bubble` of it
    is :func:`bubble_fraction` for GPipe and 1F1B, :func:`interleaved_bubble_fraction` and
    :func:`zero_bubble_fraction` for the others. Raises :class:`ScheduleDeadlock` when no stage can go on."""
    _check_positive_ints(num_stages=num_stages, micro_batches=micro_batches, chunks=chunks)
    if isinstance(schedule, str):
        if schedule not in SIMULATED_SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: expected one of {sorted(SIMULATED_SCHEDULES)} or {{stage: actions}}")
        if chunks > 1 and schedule != "interleaved-1f1b":
            raise ValueError(f"chunks={chunks}: only 'interleaved-1f1b' splits a stage into model chunks")
        extra = {"chunks": chunks} if schedule == "interleaved-1f1b" else {}
        plans = {s: list(SIMULATED_SCHEDULES[schedule](num_stages, micro_batches, s, **extra)) for s in range(num_stages)}
    elif isinstance(schedule, dict) and sorted(schedule) == list(range(num_stages)):
        plans = {s: [tuple(a) for a in schedule[s]] for s in range(num_stages)}
    else:
        raise TypeError(f"schedule: expected a name in {sorted(SIMULATED_SCHEDULES)} or {{stage: actions}} for stages 0..{num_stages - 1}")
    for s, actions in plans.items():
        for action in actions:
            if not (len(action) in (2, 3) and action[0] in ("F", "B", "W") and all(isinstance(n, int) for n in action[1:])
                    and (len(action) == 2 or 0 <= action[2] < chunks)):
                raise ValueError(f"schedule: stage {s}'s action {action!r}: expected (kind, micro_batch) or (kind, micro_batch, chunk) "
                                 f"with kind 'F', 'B' or 'W' and chunk < chunks={chunks}")
    split = any(a[0] == "W" for actions in plans.values() for a in actions)
    per_stage = {}
    for name, value in (("forward_time", forward_time), ("backward_time", backward_time)):
        values = [value] * num_stages if isinstance(value, (int, float)) else list(value)
        if len(values) != num_stages or not all(v > 0 for v in values):
            raise ValueError(f"{name}={value!r}: expected a positive number or one per stage ({num_stages})")
        per_stage[name] = values
    weight = [b / 2 if weight_grad_time is None else weight_grad_time for b in per_stage["backward_time"]]
    if split and not all(0 < w < b for w, b in zip(weight, per_stage["backward_time"])):
        raise ValueError(f"weight_grad_time={weight_grad_time!r}: expected a part of the backward, between 0 and backward_time")
    times = {s: {"F": per_stage["forward_time"][s] / chunks,
                 "B": (per_stage["backward_time"][s] - (weight[s] if split else 0)) / chunks, "W": weight[s] / chunks}
             for s in range(num_stages)}
    pass_times = pass_times or {}
    last = chunks * num_stages - 1
    done: dict[tuple, float] = {}
    free = [0.0] * num_stages
    events = {s: [] for s in range(num_stages)}
    while any(plans.values()):
        waiting, progressed = {}, False
        for s in range(num_stages):
            if not plans[s]:
                continue
            action = plans[s][0]
            kind, i = action[:2]
            virtual = s + num_stages * (action[2] if len(action) == 3 else 0)
            dependency = {"F": ("F", virtual - 1, i) if virtual > 0 else None,
                          "B": ("B", virtual + 1, i) if virtual < last else ("F", virtual, i), "W": ("B", virtual, i)}[kind]
            if dependency is not None and dependency not in done:
                waiting[s] = (action, dependency)
                continue
            begin = max(free[s], done.get(dependency, 0.0))
            end = begin + pass_times.get((s, *action), times[s][kind])
            done[(kind, virtual, i)], free[s] = end, end
            events[s].append((kind, i, begin, end, *action[2:]))
            plans[s].pop(0)
            progressed = True
        if not progressed:
            raise ScheduleDeadlock(waiting)
    return events


def replay_timeline(events_by_rank: dict[int, list]) -> dict[int, list]:
    """The timeline of a measured pipeline run (``{rank: [(kind, micro_batch, start, end), ...]}``,
    as :func:`run_pipeline` records it) with every pass as long as it was measured, in the same
    order, but messages and everything between the passes free: :func:`simulate_schedule` with
    each pass's own duration. Every pass of it starts as early as the run's passes could have
    (a measured start is never earlier: it waited at least as long for the same passes), so its
    :func:`measured_bubble` is at most the run's; the difference is what the time between the
    passes cost (messages, Python), and the replay's excess over the formula what unequal passes cost."""
    if not events_by_rank or sorted(events_by_rank) != list(range(len(events_by_rank))):
        raise ValueError("events_by_rank: expected {rank: events} for ranks 0..p-1")
    plans, durations = {}, {}
    for rank, events in events_by_rank.items():
        ordered = sorted(events, key=lambda e: e[2])
        plans[rank] = [(e[0], e[1], *e[4:]) for e in ordered]
        durations.update({(rank, e[0], e[1], *e[4:]): e[3] - e[2] for e in ordered})
    micro_batches = sum(1 for e in events_by_rank[0] if e[0] == "F")
    return simulate_schedule(plans, len(plans), max(micro_batches, 1), pass_times=durations)


def plot_timeline(events_by_rank: dict[int, list], title: str = "", ax=None):
    """One row per rank, one box per forward (light), backward (dark) and weight-gradient (medium)
    pass, labelled with its micro-batch, odd model chunks hatched: the pipeline's timeline, with
    the bubble as white space."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * len(events_by_rank)))
    colors = plt.cm.tab10.colors
    alpha = {"F": 0.45, "B": 0.95, "W": 0.7}
    for rank, events in events_by_rank.items():
        for kind, i, start, end, *chunk in events:
            ax.barh(rank, end - start, left=start, height=0.8, color=colors[i % 10], alpha=alpha[kind], ec="white",
                    hatch="///" if chunk and chunk[0] % 2 else None)
            ax.text((start + end) / 2, rank, f"{kind}{i}", ha="center", va="center", fontsize=6)
    ax.set_yticks(list(events_by_rank))
    ax.set_yticklabels([f"stage {r}" for r in events_by_rank])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(title, fontsize=10)
    return ax


# ============================================================================ context parallelism: ring attention
class _RingShift(torch.autograd.Function):
    """Send ``x`` to the next rank of the ring and return what the previous rank sent; the
    backward pass sends the gradient the other way round."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _shift(x, +1, group)

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad, -1, ctx.group), None


def _shift(x: torch.Tensor, direction: int, group) -> torch.Tensor:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(x)
    requests = [dist.isend(x.contiguous(), (rank + direction) % world, group=group),
                dist.irecv(received, (rank - direction) % world, group=group)]
    for request in requests:
        request.wait()
    return received


def _check_sequence_shards(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """This rank's shards of a context-parallel attention: ``q [B, H, S, D]``, ``k, v [B, Hkv, S, D]``, Hkv dividing H."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: expected [batch, heads, seq_shard, head_dim], got {getattr(t, 'shape', type(t).__name__)}")
    if k.shape != v.shape or q.shape[1] % k.shape[1] or q.shape[-2] != k.shape[-2]:
        raise ValueError(f"q, k, v: expected q [B, H, S, D] and k, v [B, Hkv, S, D] with Hkv dividing H, "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, group=None) -> torch.Tensor:
    """Attention over a sequence split across the ranks of ``group``: rank ``r`` holds the
    ``r``-th contiguous shard of queries, keys and values (``[batch, heads, seq/N, head_dim]``;
    K/V may have fewer heads, GQA). The K/V block travels around the ring for ``N - 1`` steps;
    each rank folds every block it sees into a running softmax with
    :func:`labkit.attention.online_softmax_update`, so the result equals full attention on the
    whole sequence, and no rank ever holds more than two K/V blocks. Under ``causal``, blocks
    from later shards are passed on without being computed (all their scores are masked).
    Differentiable: the backward pass runs the ring in reverse."""
    _check_sequence_shards(q, k, v)
    rank, world = _group_rank_size(group)
    scale = 1.0 / math.sqrt(q.shape[-1])
    group_size = q.shape[1] // k.shape[1]

    def scores_with(kv):
        return q @ kv[0].repeat_interleave(group_size, dim=1).transpose(-2, -1) * scale

    kv = torch.stack((k, v))  # one message per step: the backward pass then shifts K and V together too
    scores = scores_with(kv)
    if causal:  # own block: the diagonal one
        scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], device=q.device), float("-inf"))
    running_max = scores.amax(dim=-1)
    p = torch.exp(scores - running_max[..., None])
    running_sum, acc = p.sum(dim=-1), p @ kv[1].repeat_interleave(group_size, dim=1)
    for step in range(1, world):
        kv = _RingShift.apply(kv, group)
        source = (rank - step) % world
        if causal and source > rank:
            # keys from later positions, entirely masked: nothing to compute. The zero term keeps
            # the block in the autograd graph, because the backward pass passes each step's
            # gradients around the whole ring, and every rank has to take part in every step.
            acc = acc + 0 * kv.sum()
            continue
        running_max, running_sum, acc = online_softmax_update(running_max, running_sum, acc, scores_with(kv),
                                                              kv[1].repeat_interleave(group_size, dim=1))
    return acc / running_sum[..., None]


def context_parallel_chunks(world_size: int, layout: str = "zigzag") -> list[tuple[int, int]]:
    """The two chunks of the sequence cut into ``2N`` that each rank holds, in the order it holds
    them: ``"contiguous"``, rank ``r`` chunks ``2r`` and ``2r + 1`` (its ``r``-th ``seq/N``
    positions); ``"zigzag"`` (Llama 3), chunks ``r`` and ``2N - 1 - r``. The positions are
    :func:`context_parallel_positions`'."""
    _check_positive_ints(world_size=world_size)
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"layout={layout!r}: expected 'contiguous' or 'zigzag'")
    if layout == "contiguous":
        return [(2 * r, 2 * r + 1) for r in range(world_size)]
    return [(r, 2 * world_size - 1 - r) for r in range(world_size)]


def allgather_context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "zigzag",
                                group=None) -> tuple[torch.Tensor, int]:
    """Causal attention over a sequence split across the ranks of ``group`` the way Llama 3's
    context parallelism does it (Dubey et al. 2024, section 3.3.2): the sequence is cut into
    ``2N`` chunks, rank ``r`` holds the queries, keys and values of its two chunks
    (:func:`context_parallel_chunks`: chunks ``r`` and ``2N - 1 - r`` under ``"zigzag"``),
    concatenated in that order (``[batch, heads, seq/N, head_dim]``; K/V may have fewer heads,
    GQA). K and V are **all-gathered** once (one message of both; their gradients are
    reduce-scattered back in the backward pass), then each query chunk attends to the key chunks
    at or before it, the last one with the causal mask: exact causal attention on the whole
    sequence.

    Returns ``(output, blocks)``: this rank's output (``q``'s shape) and the number of
    chunk-by-chunk score blocks it computed (a query chunk ``c`` needs the ``c + 1`` key chunks
    ``0..c``). Under ``"zigzag"`` every rank computes ``2N + 1`` blocks; ``"contiguous"`` gives
    rank ``r`` ``4r + 3``."""
    _check_sequence_shards(q, k, v)
    if q.shape[-2] % 2:
        raise ValueError(f"q: this rank holds two chunks, so its sequence length must be even, got {q.shape[-2]}")
    rank, world = _group_rank_size(group)
    chunks = context_parallel_chunks(world, layout)
    size = q.shape[-2] // 2
    kv = gather_from_sequence_parallel(torch.stack((k, v)), group, dim=-2)  # [2, B, Hkv, seq, D], rank after rank
    kv_by_chunk = {c: kv[..., (2 * j + i) * size:(2 * j + i + 1) * size, :]
                   for j, held in enumerate(chunks) for i, c in enumerate(held)}
    outputs, blocks = [], 0
    for i, c in enumerate(chunks[rank]):
        k_seen, v_seen = torch.cat([kv_by_chunk[j] for j in range(c + 1)], dim=-2)  # key chunks 0..c
        # query chunk c holds the last `size` of these positions: the bottom-right causal mask
        outputs.append(grouped_query_attention(q[..., i * size:(i + 1) * size, :], k_seen, v_seen,
                                               causal_mask(size, (c + 1) * size, device=q.device)))
        blocks += c + 1
    return torch.cat(outputs, dim=-2), blocks


def sequence_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = -2) -> torch.Tensor:
    """Rank ``rank``'s contiguous shard of ``x`` along the sequence axis ``dim``."""
    if x.shape[dim] % world_size:
        raise ValueError(f"x: sequence length {x.shape[dim]} must be divisible by world_size={world_size}")
    return x.chunk(world_size, dim=dim)[rank]


def draw_tensor_parallel_mlp(world_size: int = 2):
    """The Megatron SwiGLU MLP split, drawn: ``f`` (identity forward) hands ``X`` (the same on
    every rank) to the column blocks of ``W1`` and ``W3``; each rank applies SwiGLU to its own
    slice ``H_r`` of the hidden features (element-wise: no communication); ``H_r`` times ``W2``'s
    matching row block gives a partial ``Z_r``; ``g`` sums the partials (all-reduce). Backward, ``g``
    passes ``∂Z`` on unchanged and ``f`` all-reduces the ranks' partial ``∂X``. One colour per rank."""
    import matplotlib.pyplot as plt

    _check_positive_ints(world_size=world_size)
    fig, ax = plt.subplots(figsize=(9.5, 3.2))
    colors = plt.cm.tab10.colors

    def box(x, y, w, h, color, label="", alpha=0.8):
        ax.add_patch(plt.Rectangle((x, y), w, h, color=color, alpha=alpha, ec="black", lw=0.6))
        if label:
            ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=8)

    box(0, 0, 1, 2, "#dddddd", "X\n(all ranks)")
    ax.text(1.3, 1.25, "f", ha="center", fontsize=10, color="purple")
    ax.text(1.3, 0.85, "×", ha="center", fontsize=14, va="center")
    width = 2.0 / world_size
    for r in range(world_size):
        # inside each block only its rank: the blocks are too narrow for more; the headings name them
        box(1.6 + r * width, 0, width, 2, colors[r], f"{r}")  # column blocks of W1 and W3 (as [d_in, d_ff])
        box(4.8 + r * width, 0, width, 2, colors[r], f"H{r}")
        box(7.4, 2 - (r + 1) * width, 2, width, colors[r], f"W2 rows {r}")  # row blocks of W2 (as [d_ff, d_in])
    ax.text(4.2, 1.25, "SwiGLU", ha="center", fontsize=8, va="center")
    ax.annotate("", xy=(4.7, 0.95), xytext=(3.7, 0.95), arrowprops=dict(arrowstyle="->"))
    ax.text(7.0, 1, "×", fontsize=14, va="center")
    ax.annotate("", xy=(10.9, 1), xytext=(9.6, 1), arrowprops=dict(arrowstyle="->"))
    ax.text(10.25, 1.25, "g: all-reduce\nΣ_r H_r W2_r", ha="center", fontsize=8, color="purple")
    box(11.0, 0, 1, 2, "#dddddd", "Z\n(all ranks)")
    ax.text(2.6, 2.5, "column-parallel", ha="center", fontsize=8)
    ax.text(2.6, 2.15, "W1, W3: column block of rank r", ha="center", fontsize=7)
    ax.text(5.8, 2.15, "hidden features of rank r", ha="center", fontsize=7)
    ax.text(8.4, 2.5, "row-parallel", ha="center", fontsize=8)
    ax.text(6.0, -0.45, "backward: g passes ∂Z on unchanged to every rank; f all-reduces the ranks' partial ∂X",
            ha="center", fontsize=8, color="purple")
    ax.set_xlim(-0.2, 12.2)
    ax.set_ylim(-0.7, 2.9)
    ax.axis("off")
    ax.set_title(f"tensor-parallel SwiGLU MLP on {world_size} ranks: one all-reduce forward (g), one backward (f)", fontsize=10)
    fig.tight_layout()
    return fig
