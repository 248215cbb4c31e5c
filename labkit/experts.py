"""Mixture-of-experts feed-forward: routers, balancing losses and the MoE layer.

A mixture-of-experts (MoE) layer replaces one feed-forward network by ``E`` of them (the
*experts*) and a *router* that sends each token to only ``k`` of them. Parameters grow with
``E``; the compute per token grows only with ``k``. One forward pass of :class:`MoELayer`:

1. **Route.** ``logits = x W_r^T`` (``[tokens, E]``, in fp32), ``scores = softmax(logits)``
   (or ``sigmoid``); each token picks its top-``k`` experts and gets gate weights
   (:func:`top_k_gating`; :func:`switch_gating` is top-1, :func:`noisy_top_k_gating` adds
   Shazeer et al.'s trainable noise).
2. **Dispatch** (:func:`dispatch`). The ``tokens * k`` (token, expert) assignments are sorted
   by expert, so each expert's tokens form one contiguous segment (the *permute*). With a
   ``capacity_factor`` an expert takes at most ``capacity = ceil(cf * tokens * k / E)`` of
   them, highest gate first; the rest are *dropped*.
3. **Compute.** Each expert (a SwiGLU, :class:`SwiGLUExperts`) runs on its segment: a loop of
   matmuls in PyTorch, or one launch of the Triton grouped GEMM (``use_triton``).
4. **Combine** (:func:`combine`). Each output row is scaled by its gate and written back to
   its token's slot (the *unpermute*); a token's output is the sum over its ``k`` slots. A
   dropped slot contributes 0, so a token that lost every slot leaves the layer unchanged:
   the block's residual connection carries it past.

**Balancing.** Left alone, a router tends to *collapse*: the experts that happen to get more
tokens early learn faster, get picked more, and the rest starve. Three remedies:
:func:`load_balancing_loss` (Switch Transformer, ``alpha * E * sum_i f_i P_i``),
:func:`router_z_loss` (ST-MoE: keeps logits small, for stability) and DeepSeek-V3's
*auxiliary-loss-free* balancing (:func:`update_expert_bias`: a per-expert bias added to the
scores for *selection only*, nudged after each step against the load error).

The layer adds its auxiliary losses to the *gradient* of whatever loss the training loop
backpropagates (DeepSeek's ``AddAuxiliaryLoss`` trick, :func:`attach_aux_loss`), so any loop
trains with them, ``labkit.train.train`` included; the value is kept in ``layer.aux_loss``
(:func:`moe_aux_loss` sums a model's) and per-step statistics in ``layer.stats``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import nn

from labkit.nn import ACTIVATIONS, GLU, Linear, _kernels_available

SCORE_FUNCTIONS = ("softmax", "sigmoid")
PRIORITIES = ("gate", "order")


# ----------------------------------------------------------------------------- routing
@dataclass
class Routing:
    """Where the router sends each token.

    ``logits`` ``[T, E]`` fp32 (after noise, if any); ``scores`` ``[T, E]``: softmax or sigmoid of
    the logits; ``probs`` ``[T, E]``: the scores normalised to sum to 1 per token (what the
    balancing loss and the entropy use; equal to ``scores`` for softmax); ``expert_index``
    ``[T, k]`` int64, best first; ``gates`` ``[T, k]`` fp32, the weights that combine the experts' outputs.
    """

    logits: torch.Tensor
    scores: torch.Tensor
    probs: torch.Tensor
    expert_index: torch.Tensor
    gates: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.expert_index.shape[0]

    @property
    def num_experts(self) -> int:
        return self.logits.shape[-1]

    @property
    def top_k(self) -> int:
        return self.expert_index.shape[-1]

    def dense_gates(self) -> torch.Tensor:
        """The gates as a ``[T, E]`` matrix, zero for experts a token is not sent to."""
        return torch.zeros_like(self.scores).scatter(-1, self.expert_index, self.gates)

    def tokens_per_expert(self) -> torch.Tensor:
        """``[E]`` int64: how many (token, slot) assignments each expert received (before any capacity)."""
        return torch.bincount(self.expert_index.reshape(-1), minlength=self.num_experts)


def softmax_gating(logits: torch.Tensor) -> torch.Tensor:
    """Dense softmax gating (the "soft" mixture of Jacobs et al. 1991): every expert runs and
    its output is weighted by ``softmax(logits)``. Returns the ``[T, E]`` weights in fp32."""
    _check_logits(logits)
    return torch.softmax(logits.float(), dim=-1)


def top_k_gating(logits: torch.Tensor, top_k: int, normalize: bool = True, score: str = "softmax",
                 bias: torch.Tensor | None = None, *, groups: int = 1, top_groups: int | None = None,
                 scale: float = 1.0) -> Routing:
    """Top-``k`` routing from router ``logits`` ``[T, E]``.

    ``scores = softmax(logits)`` (or ``sigmoid``, DeepSeek-V3's affinities); each token's experts
    are the ``top_k`` largest ``scores + bias`` (``bias`` ``[E]``, auxiliary-loss-free balancing:
    it changes *which* experts are chosen, never the gate values); the gates are the chosen
    experts' scores, renormalised to sum to 1 if ``normalize`` or left as they are (Switch's
    top-1, where a token's output shrinks when the router is unsure).

    ``normalize`` with softmax scores is Mixtral's and Qwen3's router (a softmax over the
    top-``k`` logits) and GShard's top-2 (both gates divided by their sum).

    **Group-limited routing** (DeepSeek-V2/V3, ``groups > 1``): the experts are split into ``groups``
    consecutive groups (one per node); a group's score is the sum of its ``top_k // top_groups``
    best selection scores, and each token chooses its ``top_k`` experts only within its ``top_groups``
    best groups, so it is sent to at most ``top_groups`` nodes. ``scale`` multiplies the gates after
    renormalising (V3's ``routed_scaling_factor``). DeepSeek-V3's router is ``score="sigmoid"``,
    ``groups=8``, ``top_groups=4``, ``scale=2.5`` with ``top_k=8`` of 256 experts.
    """
    _check_logits(logits)
    num_experts = logits.shape[-1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r}: expected an integer from 1 to the number of experts ({num_experts})")
    if score not in SCORE_FUNCTIONS:
        raise ValueError(f"score={score!r}: expected one of {SCORE_FUNCTIONS}")
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if score == "softmax" else torch.sigmoid(logits)
    probs = scores if score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    select = scores
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (num_experts,):
            raise ValueError(f"bias: expected a tensor of shape ({num_experts},), one per expert, got {getattr(bias, 'shape', bias)!r}")
        select = scores.detach() + bias.detach().float()
    if groups != 1 or top_groups is not None:
        select = _within_best_groups(select, top_k, groups, top_groups)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"scale={scale!r}: expected a positive finite number")
    expert_index = torch.topk(select, top_k, dim=-1).indices
    gates = scores.gather(-1, expert_index)
    if normalize:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return Routing(logits, scores, probs, expert_index, gates * scale if scale != 1 else gates)


def _within_best_groups(select: torch.Tensor, top_k: int, groups: int, top_groups: int | None) -> torch.Tensor:
    """``select`` with every expert outside each token's ``top_groups`` best groups set to ``-inf``."""
    num_tokens, num_experts = select.shape
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or num_experts % groups:
        raise ValueError(f"groups={groups!r}: expected a positive integer that divides the number of experts ({num_experts})")
    per_group = num_experts // groups
    if top_groups is None:
        top_groups = groups
    if isinstance(top_groups, bool) or not isinstance(top_groups, int) or not 1 <= top_groups <= groups:
        raise ValueError(f"top_groups={top_groups!r}: expected an integer from 1 to groups={groups}")
    if top_k > top_groups * per_group:
        raise ValueError(f"top_k={top_k}: more than the {top_groups * per_group} experts of the top_groups={top_groups} "
                         f"groups a token may use")
    by_group = select.detach().view(num_tokens, groups, per_group)
    group_score = by_group.topk(min(per_group, max(1, top_k // top_groups)), dim=-1).values.sum(-1)
    best = torch.zeros(num_tokens, groups, dtype=torch.bool, device=select.device)
    best.scatter_(1, group_score.topk(top_groups, dim=-1).indices, True)
    return select.masked_fill(~best.repeat_interleave(per_group, dim=1), -math.inf)


def switch_gating(logits: torch.Tensor) -> Routing:
    """Switch Transformer routing: each token to its single most likely expert, gate = that
    expert's probability (not renormalised to 1, so the router still gets a gradient)."""
    return top_k_gating(logits, 1, normalize=False)


def noisy_top_k_gating(x: torch.Tensor, w_gate: torch.Tensor, w_noise: torch.Tensor, top_k: int, training: bool = True,
                       generator: torch.Generator | None = None) -> Routing:
    """Noisy top-k gating (Shazeer et al. 2017, "Outrageously large neural networks").

    ``H(x) = x W_g + eps * softplus(x W_noise)`` with ``eps ~ N(0, 1)`` per token and expert (the
    noise only while ``training``); ``G(x) = softmax(KeepTopK(H(x), k))``, where KeepTopK sets all
    but the ``k`` largest to ``-inf``. The learned noise scale spreads tokens over experts early
    in training. ``w_gate``, ``w_noise``: ``[E, d_model]`` (labkit's ``Linear`` layout, so
    ``x W_g`` is ``x @ w_gate.T``). Returns a :class:`Routing` whose ``logits`` are ``H(x)``.
    """
    for name, w in (("w_gate", w_gate), ("w_noise", w_noise)):
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != x.shape[-1]:
            raise ValueError(f"{name}: expected [num_experts, d_model={x.shape[-1]}], got {getattr(w, 'shape', w)!r}")
    if w_noise.shape != w_gate.shape:
        raise ValueError(f"w_noise: expected the shape of w_gate {tuple(w_gate.shape)}, got {tuple(w_noise.shape)}")
    x32 = x.float().reshape(-1, x.shape[-1])
    logits = x32 @ w_gate.float().T
    if training:
        noise_std = nn.functional.softplus(x32 @ w_noise.float().T)
        eps = torch.randn(logits.shape, generator=generator, device=logits.device)
        logits = logits + eps * noise_std
    # softmax over the kept k logits == the top-k softmax probabilities renormalised to sum to 1
    return top_k_gating(logits, top_k, normalize=True)


@dataclass
class ExpertChoice:
    """Expert-choice routing: ``token_index`` ``[E, C]`` int64, the ``C`` tokens each expert chose
    (best first); ``gates`` ``[E, C]`` fp32, their softmax scores; ``num_tokens``."""

    token_index: torch.Tensor
    gates: torch.Tensor
    num_tokens: int

    def experts_per_token(self) -> torch.Tensor:
        """``[T]`` int64: how many experts chose each token (0 = the token skips the layer)."""
        return torch.bincount(self.token_index.reshape(-1), minlength=self.num_tokens)

    def expert_sets(self) -> torch.Tensor:
        """``[T, E]`` bool: True where expert ``e`` chose token ``t``."""
        chosen = torch.zeros(self.num_tokens, self.token_index.shape[0], dtype=torch.bool, device=self.token_index.device)
        experts = torch.arange(self.token_index.shape[0], device=self.token_index.device)[:, None].expand_as(self.token_index)
        chosen[self.token_index.reshape(-1), experts.reshape(-1)] = True
        return chosen


def expert_choice_gating(logits: torch.Tensor, capacity: int) -> ExpertChoice:
    """Expert-choice routing (Zhou et al. 2022): the *experts* pick tokens. ``scores =
    softmax(logits)`` over the experts, as in token choice; then each expert takes the ``capacity``
    tokens of the batch with the highest score for it (``TopK(S^T, C)``), so every expert computes
    exactly ``capacity`` rows (balanced by construction, nothing to drop) while a token may be
    taken by several experts or by none. A token's experts depend on the other tokens of the batch,
    the later ones included, which is why it does not fit autoregressive decoding as it is.
    The paper's ``capacity = T * c / E`` with ``c = 2``: on average two experts per token."""
    _check_logits(logits)
    num_tokens = logits.shape[0]
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= num_tokens:
        raise ValueError(f"capacity={capacity!r}: expected an integer from 1 to the number of tokens ({num_tokens})")
    scores = torch.softmax(logits.float(), dim=-1)
    gates, token_index = torch.topk(scores.T, capacity, dim=-1)
    return ExpertChoice(token_index, gates, num_tokens)


# ----------------------------------------------------------------------------- balancing
def load_balancing_loss(probs: torch.Tensor, expert_index: torch.Tensor, alpha: float = 0.01) -> torch.Tensor:
    """Switch Transformer auxiliary loss ``alpha * E * sum_i f_i * P_i``.

    ``f_i``: the fraction of the ``T * k`` assignments routed to expert ``i`` (token *counts*:
    not differentiable); ``P_i``: the mean router probability of expert ``i`` over the tokens
    (differentiable: the loss pushes probability away from overloaded experts). ``probs``
    ``[T, E]``, ``expert_index`` ``[T, k]``. At perfect balance ``f_i = P_i = 1/E`` and the loss is
    ``alpha``; if every token goes to one expert with certainty it is ``alpha * E``.
    """
    _check_logits(probs, "probs")
    if expert_index.dim() != 2 or expert_index.shape[0] != probs.shape[0]:
        raise ValueError(f"expert_index: expected [T={probs.shape[0]}, k], got shape {tuple(expert_index.shape)}")
    num_tokens, num_experts = probs.shape
    if num_tokens == 0:
        return probs.new_zeros((), dtype=torch.float32)
    counts = torch.bincount(expert_index.reshape(-1), minlength=num_experts).float()
    f = counts / expert_index.numel()
    P = probs.float().mean(dim=0)
    return alpha * num_experts * (f * P).sum()


def router_z_loss(logits: torch.Tensor, weight: float = 1e-3) -> torch.Tensor:
    """ST-MoE router z-loss ``weight * mean over tokens of logsumexp(logits)^2``: penalises large
    router logits, which make the softmax (and bf16 round-off in it) unstable."""
    _check_logits(logits)
    if logits.shape[0] == 0:
        return logits.new_zeros((), dtype=torch.float32)
    return weight * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def router_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the entropy (nats) of each token's router distribution ``probs`` ``[T, E]``:
    ``log E`` when the router cannot decide, 0 when it is certain."""
    if probs.shape[0] == 0:
        return probs.new_zeros((), dtype=torch.float32)
    p = probs.float()
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean()


@torch.no_grad()
def update_expert_bias(bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float = 1e-3) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing step, in place: ``bias_i += rate * sign(mean
    load - load_i)``: an overloaded expert's bias drops by ``rate``, an underloaded one's rises.
    The bias only shifts which experts are *selected*; gates and gradients never see it, so
    balancing costs the language-model loss nothing. Returns ``bias``."""
    if tokens_per_expert.shape != bias.shape:
        raise ValueError(f"tokens_per_expert: expected shape {tuple(bias.shape)} like bias, got {tuple(tokens_per_expert.shape)}")
    if not rate >= 0:
        raise ValueError(f"rate={rate!r}: expected a non-negative number")
    load = tokens_per_expert.float()
    bias += rate * torch.sign(load.mean() - load).to(bias.dtype)
    return bias


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, also sends gradient 1 into ``aux``, as if ``aux`` had been
    added to the loss (DeepSeek-V2/V3's ``AddAuxiliaryLoss``)."""

    @staticmethod
    def forward(ctx, out, aux):
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad_out.device)


def attach_aux_loss(out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """``out`` unchanged, but backpropagating any loss computed from it also backpropagates ``aux``
    (with weight 1). The reported loss stays the language-model loss. Under a loss scaler
    (fp16) the auxiliary gradient is not scaled with it; add ``moe_aux_loss(model)`` to the loss
    yourself there (layers built with ``attach_aux_loss=False``)."""
    return _AttachAuxLoss.apply(out, aux)


# ----------------------------------------------------------------------------- dispatch / combine
@dataclass
class Dispatch:
    """The routed assignments sorted by expert (after capacity).

    Row ``r`` of the permuted input is token ``token[r]``; ``slot[r] = token * k + j`` says which
    of the token's ``k`` choices it is; ``gates[r]`` its gate; ``group_sizes`` ``[E]`` the rows of
    each expert's segment; ``routed_per_expert`` ``[E]`` the assignments before capacity.
    """

    token: torch.Tensor
    slot: torch.Tensor
    gates: torch.Tensor
    group_sizes: torch.Tensor
    routed_per_expert: torch.Tensor
    capacity: int | None
    num_tokens: int
    top_k: int

    @property
    def num_dropped(self) -> int:
        return self.num_tokens * self.top_k - self.token.shape[0]

    @property
    def dropped_fraction(self) -> float:
        total = self.num_tokens * self.top_k
        return self.num_dropped / total if total else 0.0


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None) -> int | None:
    """Slots per expert: ``ceil(capacity_factor * num_tokens * top_k / num_experts)`` (GShard,
    Switch); ``None`` (dropless) when ``capacity_factor`` is ``None``. ``capacity_factor = 1``
    is exactly enough if the routing is perfectly balanced.

    Computed exactly, with the factor as written (``1.1`` is 11/10): in floats ``1.1 * 100 * 1 / 10``
    is 11.000000000000002, whose ceil would give 12 slots instead of 11."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens!r}: expected a non-negative integer")
    _check_positive_ints(num_experts=num_experts, top_k=top_k)
    _check_capacity_factor(capacity_factor)
    if capacity_factor is None:
        return None
    return math.ceil(Fraction(str(capacity_factor)) * num_tokens * top_k / num_experts)


def dispatch(routing: Routing, capacity: int | None = None, priority: str = "gate") -> Dispatch:
    """Sort the assignments by expert and apply ``capacity`` (``None``: keep all).

    Within an expert, the assignments kept are those with the highest ``priority``: ``"gate"``
    keeps the largest gate weights (batch-prioritised routing, Riquelme et al. 2021), ties in
    token order; ``"order"`` keeps every token's first choice before any second choice, in token
    order (GShard, Switch). Built from stable sorts, no loop over experts.
    """
    if priority not in PRIORITIES:
        raise ValueError(f"priority={priority!r}: expected one of {PRIORITIES}")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
        raise ValueError(f"capacity={capacity!r}: expected a non-negative integer or None")
    T, k, E = routing.num_tokens, routing.top_k, routing.num_experts
    expert = routing.expert_index.reshape(-1)  # assignment a = t * k + j
    gates = routing.gates.reshape(-1)
    device = expert.device
    if capacity is None:
        order = torch.arange(T * k, device=device)
    elif priority == "gate":
        order = torch.argsort(-gates.detach(), stable=True)
    else:  # slot-major: all first choices, then all second choices, ...
        order = torch.arange(T * k, device=device).view(T, k).T.reshape(-1)
    order = order[torch.argsort(expert[order], stable=True)]  # group by expert, keeping the priority order
    routed = torch.bincount(expert, minlength=E)
    if capacity is not None:
        segment_start = torch.cumsum(routed, 0) - routed
        position = torch.arange(T * k, device=device) - segment_start[expert[order]]
        order = order[position < capacity]
        kept = routed.clamp(max=capacity)
    else:
        kept = routed
    return Dispatch(token=order // k, slot=order, gates=gates[order], group_sizes=kept, routed_per_expert=routed,
                    capacity=capacity, num_tokens=T, top_k=k)


def combine(expert_out: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """Scale each expert output row by its gate and sum each token's slots: ``[T, d]`` in fp32.
    Dropped slots stay zero (every slot is written at most once: no atomics, deterministic)."""
    weighted = expert_out.float() * plan.gates[:, None]
    slots = weighted.new_zeros(plan.num_tokens * plan.top_k, expert_out.shape[-1]).index_copy(0, plan.slot, weighted)
    return slots.view(plan.num_tokens, plan.top_k, -1).sum(dim=1)


# ----------------------------------------------------------------------------- experts
def segment_matmul(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """``x[rows of e] @ weight[e]^T`` for each expert's segment, one ``torch.matmul`` per expert
    (the PyTorch path; :func:`labkit.kernels.grouped_matmul` does it in one launch)."""
    sizes = [int(s) for s in group_sizes.tolist()]
    # unbind: one view per expert with a single backward node (indexing weight[e] would build a
    # full-size zero gradient per expert)
    return torch.cat([segment @ w.T for segment, w in zip(x.split(sizes), weight.unbind(0))])


class SwiGLUExperts(nn.Module):
    """``num_experts`` SwiGLU feed-forwards ``w2(silu(w1 x) * w3 x)`` with their weights stacked:
    ``w1``, ``w3`` ``[E, d_ff, d_model]``, ``w2`` ``[E, d_model, d_ff]`` (expert ``e``'s matrices are
    ``w1[e]`` etc., laid out like ``labkit.nn.SwiGLU``'s ``w1.weight``), one tensor each so the
    grouped GEMM reads them without copying. Initialised like ``Linear``.

    ``forward(x_sorted, group_sizes)``: rows of ``x_sorted`` sorted by expert, ``group_sizes[e]``
    of them for expert ``e``.
    """

    def __init__(self, num_experts: int, d_model: int, d_ff: int, activation: str = "silu", device=None, dtype=None,
                 use_triton: bool = False):
        super().__init__()
        _check_positive_ints(num_experts=num_experts, d_model=d_model, d_ff=d_ff)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: expected one of {sorted(ACTIVATIONS)}")
        self.num_experts, self.d_model, self.d_ff = num_experts, d_model, d_ff
        self.activation, self.use_triton = activation, use_triton
        self.w1 = nn.Parameter(_linear_init(num_experts, d_ff, d_model, device, dtype))
        self.w2 = nn.Parameter(_linear_init(num_experts, d_model, d_ff, device, dtype))
        self.w3 = nn.Parameter(_linear_init(num_experts, d_ff, d_model, device, dtype))

    def forward(self, x_sorted: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        matmul = segment_matmul
        if self.use_triton and _kernels_available() and x_sorted.dtype in (torch.float32, torch.float16, torch.bfloat16):
            from labkit import kernels

            matmul = kernels.grouped_matmul
        hidden = ACTIVATIONS[self.activation](matmul(x_sorted, self.w1, group_sizes)) * matmul(x_sorted, self.w3, group_sizes)
        return matmul(hidden, self.w2, group_sizes)

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` alone on rows ``x`` (the per-token reference path)."""
        return (ACTIVATIONS[self.activation](x @ self.w1[e].T) * (x @ self.w3[e].T)) @ self.w2[e].T

    def params_per_expert(self) -> int:
        return 3 * self.d_model * self.d_ff

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, d_model={self.d_model}, d_ff={self.d_ff}"


def _linear_init(num_experts: int, d_out: int, d_in: int, device, dtype) -> torch.Tensor:
    weight = torch.empty(num_experts, d_out, d_in, device=device, dtype=dtype)
    std = math.sqrt(2.0 / (d_in + d_out))
    return nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


# ----------------------------------------------------------------------------- the layer
@dataclass
class MoEStats:
    """What one forward pass of a :class:`MoELayer` did (detached; ``as_dict()`` gives plain numbers).

    ``tokens_per_expert``: assignments each expert was routed (before capacity); ``kept_per_expert``:
    those it computed; ``dropped_fraction``: share of the ``T * k`` assignments dropped;
    ``router_entropy``: mean entropy (nats) of the tokens' router distributions (``log E`` =
    undecided, 0 = certain); ``load_imbalance``: max load / mean load (1 = perfectly balanced).
    """

    tokens_per_expert: torch.Tensor
    kept_per_expert: torch.Tensor
    dropped_fraction: float
    router_entropy: float
    load_imbalance: float
    capacity: int | None
    aux_loss: float = 0.0
    z_loss: float = 0.0

    def as_dict(self) -> dict:
        return {"tokens_per_expert": self.tokens_per_expert.tolist(), "kept_per_expert": self.kept_per_expert.tolist(),
                "dropped_fraction": self.dropped_fraction, "router_entropy": self.router_entropy,
                "load_imbalance": self.load_imbalance, "capacity": self.capacity, "aux_loss": self.aux_loss, "z_loss": self.z_loss}


@dataclass
class MoEConfig:
    """The MoE options of a :class:`labkit.model.ModelConfig` (``moe=MoEConfig(...)``).

    ``num_experts`` routed experts of hidden size ``d_ff`` (default: the model's ``d_ff``), ``top_k``
    per token; MoE layers are layer ``first_dense + every - 1`` and every ``every``-th after it
    (``every=1``: all layers from ``first_dense``; ``every=2``: every other layer, as in GShard and
    Switch; ``first_dense=3``: DeepSeek-V3's three dense layers first). The remaining fields are
    :class:`MoELayer`'s arguments of the same names.
    """

    num_experts: int
    top_k: int = 2
    d_ff: int | None = None
    every: int = 1
    first_dense: int = 0
    num_shared_experts: int = 0
    capacity_factor: float | None = None
    score: str = "softmax"
    normalize_gates: bool = True
    router_noise: bool = False
    priority: str = "gate"
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.0
    bias_update_rate: float = 0.0

    def __post_init__(self):
        _check_positive_ints(num_experts=self.num_experts, every=self.every)
        if self.d_ff is not None:
            _check_positive_ints(d_ff=self.d_ff)
        if isinstance(self.first_dense, bool) or not isinstance(self.first_dense, int) or self.first_dense < 0:
            raise ValueError(f"first_dense={self.first_dense!r}: expected a non-negative integer")
        _check_layer_args(self.num_experts, self.top_k, self.capacity_factor, self.num_shared_experts, self.score,
                          self.priority, self.aux_loss_weight, self.z_loss_weight, self.bias_update_rate)

    def is_moe_layer(self, layer_idx: int) -> bool:
        offset = layer_idx - self.first_dense
        return offset >= 0 and offset % self.every == self.every - 1

    def layer_kwargs(self) -> dict:
        return dict(num_experts=self.num_experts, top_k=self.top_k, capacity_factor=self.capacity_factor,
                    num_shared_experts=self.num_shared_experts, score=self.score, normalize_gates=self.normalize_gates,
                    router_noise=self.router_noise, priority=self.priority, aux_loss_weight=self.aux_loss_weight,
                    z_loss_weight=self.z_loss_weight, bias_update_rate=self.bias_update_rate)


class MoELayer(nn.Module):
    """Mixture-of-experts feed-forward with SwiGLU experts: a drop-in for ``labkit.nn.SwiGLU``.

    ``forward(x)``: ``x`` ``[..., d_model]`` -> ``[..., d_model]``; steps in the module docstring.

    * ``num_experts`` routed experts of hidden size ``d_ff``, ``top_k`` per token; ``score``
      ``"softmax"`` (Mixtral, Qwen3) or ``"sigmoid"`` (DeepSeek-V3); ``normalize_gates``
      renormalises the ``k`` gates to sum to 1; ``router_noise`` adds Shazeer's trainable noise
      while training (weights ``noise.weight``, initialised to zero as in the paper).
    * ``capacity_factor``: ``None`` = dropless, else each expert computes at most
      ``ceil(cf * tokens * k / E)`` assignments, kept by ``priority`` (:func:`dispatch`).
    * ``num_shared_experts``: always-on experts every token goes through (DeepSeekMoE), held
      as one SwiGLU of hidden size ``num_shared_experts * d_ff`` (``shared_experts``).
    * Balancing, active only in training mode: ``aux_loss_weight`` (Switch loss ``alpha``),
      ``z_loss_weight`` (ST-MoE uses 1e-3), ``bias_update_rate`` (DeepSeek-V3's ``gamma``, 1e-3
      there: after each training forward, ``expert_bias`` moves against the load error). With
      ``attach_aux_loss`` the losses ride along the output's gradient (:func:`attach_aux_loss`).

    Parameters: ``router.weight`` ``[E, d_model]``, ``experts.w1/w2/w3`` (:class:`SwiGLUExperts`),
    ``shared_experts.w1/w2/w3.weight``, ``noise.weight``; buffer ``expert_bias`` ``[E]`` (fp32).
    After each forward: ``stats`` (:class:`MoEStats`), ``aux_loss`` (a tensor, or None when no
    auxiliary loss is on), ``last_routing`` and ``last_dispatch``.
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int = 2, capacity_factor: float | None = None,
                 num_shared_experts: int = 0, *, score: str = "softmax", normalize_gates: bool = True,
                 router_noise: bool = False, priority: str = "gate", aux_loss_weight: float = 0.01,
                 z_loss_weight: float = 0.0, bias_update_rate: float = 0.0, activation: str = "silu",
                 attach_aux_loss: bool = True, device=None, dtype=None, use_triton: bool = False):
        super().__init__()
        _check_positive_ints(d_model=d_model, d_ff=d_ff, num_experts=num_experts)
        _check_layer_args(num_experts, top_k, capacity_factor, num_shared_experts, score, priority,
                          aux_loss_weight, z_loss_weight, bias_update_rate)
        self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, num_experts, top_k
        self.capacity_factor, self.num_shared_experts = capacity_factor, num_shared_experts
        self.score, self.normalize_gates, self.priority = score, normalize_gates, priority
        self.aux_loss_weight, self.z_loss_weight, self.bias_update_rate = aux_loss_weight, z_loss_weight, bias_update_rate
        self.attach = attach_aux_loss
        self.router = Linear(d_model, num_experts, device=device, dtype=dtype)
        self.noise = None
        if router_noise:
            self.noise = Linear(d_model, num_experts, device=device, dtype=dtype)
            nn.init.zeros_(self.noise.weight)
        self.experts = SwiGLUExperts(num_experts, d_model, d_ff, activation, device=device, dtype=dtype, use_triton=use_triton)
        self.shared_experts = None
        if num_shared_experts:
            self.shared_experts = GLU(d_model, num_shared_experts * d_ff, activation, device=device, dtype=dtype, use_triton=use_triton)
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
        self.aux_loss: torch.Tensor | None = None
        self.stats: MoEStats | None = None
        self.last_routing: Routing | None = None
        self.last_dispatch: Dispatch | None = None

    @classmethod
    def from_config(cls, d_model: int, d_ff: int, config: MoEConfig, activation: str = "silu", device=None, dtype=None,
                    use_triton: bool = False) -> "MoELayer":
        return cls(d_model, config.d_ff or d_ff, **config.layer_kwargs(), activation=activation, device=device, dtype=dtype,
                   use_triton=use_triton)

    # the steps, separately callable (expert parallelism reuses them around its all-to-all)
    def router_logits(self, flat: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` fp32 logits (plus Shazeer's noise while training), computed in fp32 even under autocast."""
        with torch.autocast(device_type=flat.device.type, enabled=False):
            flat32 = flat.float()
            logits = flat32 @ self.router.weight.float().T
            if self.noise is not None and self.training:
                noise_std = nn.functional.softplus(flat32 @ self.noise.weight.float().T)
                logits = logits + torch.randn_like(logits) * noise_std
        return logits

    def route(self, flat: torch.Tensor) -> tuple[Routing, Dispatch]:
        """Routing and dispatch plan for the ``[T, d_model]`` tokens ``flat``."""
        routing = top_k_gating(self.router_logits(flat), self.top_k, self.normalize_gates, self.score, bias=self.expert_bias)
        capacity = expert_capacity(flat.shape[0], self.num_experts, self.top_k, self.capacity_factor)
        return routing, dispatch(routing, capacity, self.priority)

    def finish(self, out: torch.Tensor, flat: torch.Tensor, routing: Routing, plan: Dispatch) -> torch.Tensor:
        """Add the shared experts, record losses and statistics, update the bias, attach the aux loss."""
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        training = self.training and torch.is_grad_enabled()
        aux = None
        lb = z = None
        if self.aux_loss_weight > 0:
            lb = load_balancing_loss(routing.probs, routing.expert_index, self.aux_loss_weight)
            aux = lb
        if self.z_loss_weight > 0:
            z = router_z_loss(routing.logits, self.z_loss_weight)
            aux = z if aux is None else aux + z
        self.aux_loss = aux
        self.last_routing, self.last_dispatch = routing, plan
        self.stats = _stats(routing, plan, lb, z)
        if training and self.bias_update_rate > 0:
            update_expert_bias(self.expert_bias, plan.routed_per_expert, self.bias_update_rate)
        if training and self.attach and aux is not None and aux.requires_grad:
            out = attach_aux_loss(out, aux)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"x: last dim must be d_model={self.d_model}, got shape {tuple(x.shape)}")
        flat = x.reshape(-1, self.d_model)
        routing, plan = self.route(flat)
        expert_out = self.experts(flat[plan.token], plan.group_sizes)  # permute, then every expert on its segment
        out = combine(expert_out, plan).to(x.dtype)  # unpermute, weighted by the gates
        return self.finish(out, flat, routing, plan).view(x.shape)

    def extra_repr(self) -> str:
        cf = "dropless" if self.capacity_factor is None else f"capacity_factor={self.capacity_factor}"
        return f"num_experts={self.num_experts}, top_k={self.top_k}, {cf}, score={self.score}"


def _stats(routing: Routing, plan: Dispatch, lb, z) -> MoEStats:
    with torch.no_grad():
        entropy = router_entropy(routing.probs)
        routed = plan.routed_per_expert
        mean = routed.float().mean()
        imbalance = (routed.max().float() / mean) if mean > 0 else mean.new_ones(())
        return MoEStats(routed.detach().cpu(), plan.group_sizes.detach().cpu(), plan.dropped_fraction, float(entropy),
                        float(imbalance), plan.capacity, 0.0 if lb is None else float(lb), 0.0 if z is None else float(z))


# ----------------------------------------------------------------------------- model helpers
def moe_layers(model: nn.Module) -> list[MoELayer]:
    """Every :class:`MoELayer` in ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the auxiliary losses the model's MoE layers computed in the last forward (None if none)."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def moe_stats(model: nn.Module) -> list[dict]:
    """``layer.stats.as_dict()`` of each MoE layer (after a forward pass)."""
    return [m.stats.as_dict() for m in moe_layers(model) if m.stats is not None]


def active_parameter_count(model: nn.Module) -> int:
    """Parameters one token uses: all of them minus, in each MoE layer, the ``E - k`` routed
    experts it is not sent to (shared tensors counted once)."""
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    inactive = sum((m.num_experts - m.top_k) * m.experts.params_per_expert() for m in moe_layers(model))
    return total - inactive


# ----------------------------------------------------------------------------- checks
def _check_logits(logits, name: str = "logits") -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {logits.dtype}")
    if logits.dim() != 2 or logits.shape[-1] == 0:
        raise ValueError(f"{name}: expected [tokens, num_experts] with num_experts > 0, got shape {tuple(logits.shape)}")


def _check_positive_ints(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r}: expected a positive integer")


def _check_capacity_factor(capacity_factor) -> None:
    if capacity_factor is not None and (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float))
                                        or not 0 < capacity_factor < math.inf):
        raise ValueError(f"capacity_factor={capacity_factor!r}: expected a positive finite number, or None for dropless routing")


def _check_layer_args(num_experts, top_k, capacity_factor, num_shared_experts, score, priority,
                      aux_loss_weight, z_loss_weight, bias_update_rate) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r}: expected an integer from 1 to num_experts={num_experts}")
    _check_capacity_factor(capacity_factor)
    if isinstance(num_shared_experts, bool) or not isinstance(num_shared_experts, int) or num_shared_experts < 0:
        raise ValueError(f"num_shared_experts={num_shared_experts!r}: expected a non-negative integer")
    if score not in SCORE_FUNCTIONS:
        raise ValueError(f"score={score!r}: expected one of {SCORE_FUNCTIONS}")
    if priority not in PRIORITIES:
        raise ValueError(f"priority={priority!r}: expected one of {PRIORITIES}")
    for name, value in (("aux_loss_weight", aux_loss_weight), ("z_loss_weight", z_loss_weight), ("bias_update_rate", bias_update_rate)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name}={value!r}: expected a non-negative number")
