"""Chapter 04, mixture of experts: routing, balancing, capacity, expert parallelism, and what
"46.7B parameters, 12.9B active" means.

The model-layer code lives in :mod:`labkit.experts` (routers, balancing losses, :class:`MoELayer`)
and is re-exported here, so the chapter imports one module. This module adds:

* **Sizes** of published MoE models: :data:`MOE_PRESETS` (Mixtral-8x7B, Qwen3-30B-A3B, built
  on the ``meta`` device) and DeepSeek-V3 (MLA attention: counted by the documented formula
  :func:`labkit.quant.deepseek_v3_parameters`, its MoE part cross-checked against a
  :class:`MoELayer` built with its sizes); :func:`moe_parameter_table` compares them with the
  published figures.
* **Expert parallelism**: :class:`ExpertParallelMoE` splits a layer's experts across the ranks
  of a process group and exchanges tokens with ``all_to_all_single`` (counts first, then the
  rows; gloo supports it on CPU); :func:`expert_parallel_rank` is the per-rank check that
  :func:`expert_parallel_demo` launches.
* **Experiments** on small models and the arithmetic task (a few seconds each on a CPU):
  :func:`dense_vs_moe`, :func:`balancing_experiment`, :func:`specialisation_experiment`,
  :func:`capacity_experiment`, :func:`capacity_training_experiment` (dropping during training) and the
  fine-grained and shared-expert layouts of :func:`granularity_configs`, trained side by side by
  :func:`train_variants`; and :func:`routing_explorer`, the widget's callback.
* **The grouped GEMM's work**: :func:`grouped_gemm_plan` counts its programs, tiles and padding
  against a padded batched matmul and a loop over the experts.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from labkit.data import ArithmeticTask, get_batch
from labkit.dist import launch, rank_device
from labkit.experts import (  # noqa: F401  (re-exported for the chapter)
    PRIORITIES,
    SCORE_FUNCTIONS,
    Dispatch,
    ExpertChoice,
    MoEConfig,
    MoELayer,
    MoEStats,
    Routing,
    SwiGLUExperts,
    active_parameter_count,
    attach_aux_loss,
    combine,
    dispatch,
    expert_capacity,
    expert_choice_gating,
    load_balancing_loss,
    moe_aux_loss,
    moe_layers,
    moe_stats,
    noisy_top_k_gating,
    router_entropy,
    router_z_loss,
    segment_matmul,
    softmax_gating,
    switch_gating,
    top_k_gating,
    update_expert_bias,
)
from labkit.hardware import GPU_DATASHEETS, timeit
from labkit.model import MOE_PRESETS, ModelConfig, TransformerLM, count_active_parameters, count_parameters
from labkit.quant import DEEPSEEK_V3, deepseek_v3_parameters
from labkit.runtime import run_seed
from labkit.train import TrainConfig, cross_entropy, train

# ============================================================================ sizes of published models
# Published totals and active (per-token) parameters, from each model's announcement.
PUBLISHED_PARAMETERS = {
    "mixtral-8x7b": dict(total=46.7e9, active=12.9e9, source="Jiang et al. 2024, Mixtral of Experts"),
    "qwen3-30b-a3b": dict(total=30.5e9, active=3.3e9, source="Qwen3 technical report / model card (2025)"),
    "deepseek-v3": dict(total=671e9, active=37e9, source="DeepSeek-V3 technical report (2024)"),
}


def deepseek_v3_moe_layer(device="meta", **overrides) -> MoELayer:
    """One of DeepSeek-V3's MoE FFNs as a :class:`MoELayer` (on ``meta`` by default: nothing is
    allocated): 256 routed experts of 2048 and 1 shared, top-8 of sigmoid scores, renormalised,
    balanced by the per-expert bias (V3's group-limited choice and its route scale of 2.5 are not
    modelled: they change no parameter count). ``overrides``: fields of :data:`labkit.quant.DEEPSEEK_V3`."""
    c = {**DEEPSEEK_V3, **overrides}
    return MoELayer(c["hidden_size"], c["moe_intermediate_size"], c["n_routed_experts"], c["num_experts_per_tok"],
                    num_shared_experts=c["n_shared_experts"], score="sigmoid", aux_loss_weight=0.0,
                    bias_update_rate=1e-3, device=device)


def deepseek_v3_counts() -> dict:
    """DeepSeek-V3's total and active parameters.

    Its attention is MLA (low-rank latent K/V), which ``TransformerLM`` does not build, so the
    whole model is counted by the formula :func:`labkit.quant.deepseek_v3_parameters` (one source
    of truth for its config, :data:`labkit.quant.DEEPSEEK_V3`). The MoE part is cross-checked:
    a :class:`MoELayer` with DeepSeek-V3's sizes, built on ``meta``, holds exactly the formula's
    routed experts + shared expert + router of one MoE layer (the bias of auxiliary-loss-free
    balancing is stored in the checkpoint, so it is counted, as the formula does).
    """
    parts = deepseek_v3_parameters()
    layer = deepseek_v3_moe_layer()
    moe_layer_count = DEEPSEEK_V3["num_hidden_layers"] - DEEPSEEK_V3["first_k_dense_replace"]
    built = sum(p.numel() for p in layer.parameters()) + layer.expert_bias.numel()
    formula = (parts["routed_experts"] + parts["shared_experts"] + parts["routers"]) // moe_layer_count
    return {"total": parts["total"], "active": parts["active"], "parts": parts, "moe_layer_built": built,
            "moe_layer_formula": formula, "moe_layer_matches": built == formula,
            "active_moe_layer_built": built - (layer.num_experts - layer.top_k) * layer.experts.params_per_expert()}


def moe_parameter_table() -> list[dict]:
    """Total vs active parameters of Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V3, computed here and
    as published. Mixtral and Qwen3 are built on ``meta`` from :data:`MOE_PRESETS`; DeepSeek-V3
    from its config by formula (see :func:`deepseek_v3_counts`)."""
    rows = []
    for name, config in MOE_PRESETS.items():
        moe = config.moe
        rows.append(dict(model=name, experts=moe.num_experts, top_k=moe.top_k, shared=moe.num_shared_experts,
                         total=count_parameters(config), active=count_active_parameters(config), counted="meta build"))
    ds = deepseek_v3_counts()
    rows.append(dict(model="deepseek-v3", experts=DEEPSEEK_V3["n_routed_experts"], top_k=DEEPSEEK_V3["num_experts_per_tok"],
                     shared=DEEPSEEK_V3["n_shared_experts"], total=ds["total"], active=ds["active"],
                     counted="formula (MLA attention), MoE layer checked on meta"))
    for row in rows:
        published = PUBLISHED_PARAMETERS[row["model"]]
        row.update(published_total=published["total"], published_active=published["active"],
                   active_fraction=row["active"] / row["total"])
    return rows


def ffn_flops_per_token(d_model: int, d_ff: int, num_experts: int = 1, top_k: int = 1) -> int:
    """Forward matmul FLOPs of one token in one FFN: ``2 * 3 * d_model * d_ff`` per expert it
    visits (SwiGLU's three matrices), ``top_k`` of them, plus the router's ``2 * d_model * E``
    (0 for a dense FFN: ``num_experts=1``)."""
    router = 2 * d_model * num_experts if num_experts > 1 else 0
    return 2 * 3 * d_model * d_ff * top_k + router


# ============================================================================ expert parallelism
class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with autograd: the backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (list(output_splits), list(input_splits)), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(output_splits), list(input_splits), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return out, None, None, None


class ExpertParallelMoE(nn.Module):
    """``layer``'s experts split across the ranks of ``group``: rank ``r`` holds experts
    ``r*E/W .. (r+1)*E/W - 1``; router (and shared experts) are replicated.

    Each rank routes its *own* tokens, then per step:

    1. sorts them by expert (so the rows for each destination rank are contiguous) and exchanges
       the per-expert **counts** with ``all_to_all_single`` (each rank learns how many rows it
       will receive for each of its experts, and from whom);
    2. **dispatch**: ``all_to_all_single`` of the rows (uneven splits);
    3. runs its local experts on what it received (regrouped by expert);
    4. **combine**: the reverse ``all_to_all_single`` sends each output row home, where it is
       weighted by its gate and summed per token as in :class:`MoELayer`.

    The output equals ``layer`` applied to the rank's tokens (capacity, too, is computed on the
    rank's tokens). Gradients flow back through both exchanges. ``last_exchange`` holds the
    bytes of the last forward (see :meth:`exchange_bytes`).
    """

    def __init__(self, layer: MoELayer, group=None):
        super().__init__()
        if not isinstance(layer, MoELayer):
            raise TypeError(f"layer: expected a labkit.experts.MoELayer, got {type(layer).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("ExpertParallelMoE needs a process group: run it inside labkit.dist.launch")
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        if layer.num_experts % self.world_size:
            raise ValueError(f"layer: num_experts={layer.num_experts} must be divisible by the world size {self.world_size}")
        self.num_experts, self.local_experts = layer.num_experts, layer.num_experts // self.world_size
        self.first_expert = self.rank * self.local_experts
        experts = layer.experts
        layer.experts = None  # copy everything but the experts, then keep only this rank's share of them
        try:
            self.inner = copy.deepcopy(layer)
        finally:
            layer.experts = experts
        local = SwiGLUExperts(self.local_experts, experts.d_model, experts.d_ff, experts.activation,
                              device=experts.w1.device, dtype=experts.w1.dtype, use_triton=experts.use_triton)
        with torch.no_grad():
            mine = slice(self.first_expert, self.first_expert + self.local_experts)
            for name in ("w1", "w2", "w3"):
                getattr(local, name).copy_(getattr(experts, name)[mine])
        self.inner.experts = local
        self.last_exchange: dict | None = None

    @property
    def experts(self) -> SwiGLUExperts:
        return self.inner.experts

    @property
    def router(self):
        return self.inner.router

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner, W, E_local = self.inner, self.world_size, self.local_experts
        if x.dim() == 0 or x.shape[-1] != inner.d_model:
            raise ValueError(f"x: last dim must be d_model={inner.d_model}, got shape {tuple(x.shape)}")
        flat = x.reshape(-1, inner.d_model)
        routing, plan = inner.route(flat)
        x_sorted = flat[plan.token]  # sorted by expert, hence by destination rank
        # 1. counts: rank r gets, from every rank, its row counts for r's experts
        counts = plan.group_sizes.to(torch.int64)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)
        send_splits = counts.view(W, E_local).sum(1).tolist()
        recv_splits = received_counts.view(W, E_local).sum(1).tolist()
        # 2. dispatch the rows; they arrive grouped by (source rank, local expert)
        received = _AllToAll.apply(x_sorted, recv_splits, send_splits, self.group)
        # 3. regroup by local expert, compute, restore the arrival order
        per_source = received_counts.view(W, E_local)
        expert_of_row = torch.arange(E_local, device=x.device).repeat(W).repeat_interleave(per_source.reshape(-1))
        perm = torch.argsort(expert_of_row, stable=True)
        y_local = self.inner.experts(received[perm], per_source.sum(0))
        y_arrival = y_local[torch.argsort(perm)]
        # 4. combine: send every row home
        y_sorted = _AllToAll.apply(y_arrival, send_splits, recv_splits, self.group)
        out = combine(y_sorted, plan).to(x.dtype)
        self.last_exchange = self.exchange_bytes(send_splits, recv_splits, inner.d_model, x.element_size(), counts)
        return inner.finish(out, flat, routing, plan).view(x.shape)

    def exchange_bytes(self, send_splits, recv_splits, d_model: int, element_size: int, counts: torch.Tensor) -> dict:
        """Bytes this rank's collectives moved in one forward, from the split sizes: ``*_sent`` to
        other ranks, ``*_received`` from them (the chunk a rank "sends" itself is a local copy,
        not traffic); ``rows_kept_here``; and ``predicted_bytes_sent``, the balanced-routing
        estimate ``2 * rows * (W - 1) / W * d_model * bytes`` (dispatch + combine)."""
        me, row = self.rank, d_model * element_size
        sent_rows = sum(s for r, s in enumerate(send_splits) if r != me)
        recv_rows = sum(s for r, s in enumerate(recv_splits) if r != me)
        count_bytes = counts.numel() // self.world_size * counts.element_size() * (self.world_size - 1)
        rows = sum(send_splits)
        return {"counts_sent": count_bytes, "dispatch_sent": sent_rows * row, "dispatch_received": recv_rows * row,
                "combine_sent": recv_rows * row, "combine_received": sent_rows * row,
                "total_sent": count_bytes + (sent_rows + recv_rows) * row, "rows_kept_here": send_splits[me],
                "rows_dispatched": rows,
                "predicted_bytes_sent": round(2 * rows * (self.world_size - 1) / self.world_size * row)}


def expert_parallel_rank(rank: int, world_size: int, tokens_per_rank: int = 48, d_model: int = 32, d_ff: int = 48,
                         num_experts: int = 4, top_k: int = 2, capacity_factor: float | None = None,
                         num_shared_experts: int = 0, seed: int = 0) -> dict:
    """Per-rank check (for :func:`labkit.dist.launch`): the same :class:`MoELayer` on every rank
    (same seed), each rank with its own ``tokens_per_rank`` tokens; the expert-parallel layer vs
    the full layer run locally on the same tokens. Returns the largest differences of the output,
    the input gradient, this rank's experts' weight gradients (the reference's summed over every
    rank's tokens) and the router gradient (all-reduced), and the bytes exchanged."""
    device = rank_device()
    torch.manual_seed(seed)
    layer = MoELayer(d_model, d_ff, num_experts, top_k, capacity_factor, num_shared_experts).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    x_all = torch.randn(world_size, tokens_per_rank, d_model, generator=gen).to(device)
    g_all = torch.randn(world_size, tokens_per_rank, d_model, generator=gen).to(device)
    # reference: the whole layer in this process, on every rank's tokens (gradients summed over them)
    reference = copy.deepcopy(layer)
    for r in range(world_size):
        xr = x_all[r].clone().requires_grad_()
        yr = reference(xr)
        (yr * g_all[r]).sum().backward()
        if r == rank:
            ref_out, ref_x_grad = yr.detach(), xr.grad
    ep = ExpertParallelMoE(layer)
    x = x_all[rank].clone().requires_grad_()
    y = ep(x)
    (y * g_all[rank]).sum().backward()
    router_grad = ep.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    mine = slice(ep.first_expert, ep.first_expert + ep.local_experts)
    expert_diff = max((getattr(ep.experts, n).grad - getattr(reference.experts, n).grad[mine]).abs().max().item()
                      for n in ("w1", "w2", "w3"))
    return {"output_max_diff": (y.detach() - ref_out).abs().max().item(),
            "input_grad_max_diff": (x.grad - ref_x_grad).abs().max().item(),
            "expert_grad_max_diff": expert_diff,
            "router_grad_max_diff": (router_grad - reference.router.weight.grad).abs().max().item(),
            "local_experts": list(range(ep.first_expert, ep.first_expert + ep.local_experts)),
            "tokens_per_expert": ep.inner.stats.tokens_per_expert.tolist(),
            "exchange": ep.last_exchange}


def expert_parallel_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """:func:`expert_parallel_rank` for each keyword dict in ``cases``, in one launch (starting the
    processes costs seconds; the cases cost milliseconds)."""
    return [expert_parallel_rank(rank, world_size, **case) for case in cases]


def expert_parallel_demo(world_size: int = 2, backend: str = "gloo", timeout: float = 120, **kwargs) -> dict:
    """Launch :func:`expert_parallel_rank` on ``world_size`` processes; return ``{rank: result}``
    plus ``"bytes_sent_total"`` (over all ranks) and ``"bytes_received_total"``, which must agree."""
    results = launch(expert_parallel_rank, world_size=world_size, backend=backend, timeout=timeout, quiet=True, **kwargs)
    out = dict(results)
    sent = sum(r["exchange"]["dispatch_sent"] + r["exchange"]["combine_sent"] for r in results.values())
    received = sum(r["exchange"]["dispatch_received"] + r["exchange"]["combine_received"] for r in results.values())
    out.update(bytes_sent_total=sent, bytes_received_total=received)
    return out


# ============================================================================ a task that mixes operations
class MixedArithmeticTask:
    """Examples of several :class:`~labkit.data.ArithmeticTask` operations shuffled together
    (``"3+4=70;"``, ``"8*7=65;"``, ...), with the operation of every token, so one can ask which
    experts each operation's tokens go to. Each op's splits are that task's splits (seeded)."""

    def __init__(self, num_digits: int = 1, ops: tuple[str, ...] = ("+", "-", "*"), reverse_answer: bool = True, seed: int = 0):
        if not ops or len(set(ops)) != len(ops):
            raise ValueError(f"ops={ops!r}: expected distinct operations")
        self.ops, self.seed = tuple(ops), seed
        self.tasks = [ArithmeticTask(num_digits=num_digits, op=op, reverse_answer=reverse_answer, seed=seed) for op in self.ops]
        self.tokenizer = self.tasks[0].tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def examples(self, split: str) -> list[tuple[int, int, int]]:
        """``(op index, a, b)`` of every example of ``split``, shuffled (seeded)."""
        examples = [(i, int(a), int(b)) for i, task in enumerate(self.tasks) for a, b in task.pairs(split)]
        order = np.random.default_rng(self.seed + 1).permutation(len(examples))
        return [examples[j] for j in order]

    def tokens_and_ops(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of all examples of ``split`` concatenated, and each token's op index."""
        tokens, ops = [], []
        for i, a, b in self.examples(split):
            text = self.tasks[i].format(a, b)
            tokens.extend(self.tokenizer.encode(text))
            ops.extend([i] * len(text))
        return np.asarray(tokens, dtype=np.int64), np.asarray(ops, dtype=np.int64)

    def tokens(self, split: str) -> np.ndarray:
        return self.tokens_and_ops(split)[0]


# ============================================================================ experiments
# The chapter's small models: a 2-layer LM of width 32 on 1-digit arithmetic with mixed ops (300 facts
# to memorise), trained for a few hundred steps: a few seconds per run on a CPU.
EXPERIMENT_MODEL = dict(context_length=32, d_model=32, num_layers=2, num_heads=4)
EXPERIMENT_TRAIN = TrainConfig(steps=200, batch_size=32, context_length=32, max_lr=1e-2, min_lr=1e-3, warmup_iters=10,
                               eval_every=200, eval_batches=4)


def experiment_task() -> MixedArithmeticTask:
    return MixedArithmeticTask(num_digits=1, ops=("+", "-", "*"))


def experiment_config(vocab_size: int, d_ff: int = 32, moe: MoEConfig | None = None, **overrides) -> ModelConfig:
    """The experiments' small LM (:data:`EXPERIMENT_MODEL`), dense or with ``moe``."""
    return ModelConfig(vocab_size=vocab_size, d_ff=d_ff, moe=moe, **{**EXPERIMENT_MODEL, **overrides})


def experiment_moe(num_experts: int, top_k: int, **options) -> MoEConfig:
    """The experiments' :class:`MoEConfig`: top-1 keeps Switch's unnormalised gate (the chosen
    expert's probability), top-``k`` renormalises the ``k`` gates as Mixtral does. Renormalised, a
    single gate is ``p / p = 1`` for every token, so the language-model loss would send the router
    no gradient and only a balancing loss would train it. ``options``: the other fields."""
    return MoEConfig(num_experts=num_experts, top_k=top_k, normalize_gates=top_k > 1, **options)


def _train_config(steps: int | None) -> TrainConfig:
    if steps is None:
        return EXPERIMENT_TRAIN
    return TrainConfig(**{**EXPERIMENT_TRAIN.__dict__, "steps": steps, "eval_every": steps})


def _train_model(config: ModelConfig, data: np.ndarray, steps: int | None, seed: int, callback=None):
    torch.manual_seed(run_seed(seed))
    model = TransformerLM(config)
    history = train(model, data, data, _train_config(steps), device="cpu", callback=callback, progress=False)
    return model, history


def fixed_batches(data: np.ndarray, batches: int = 4, batch_size: int = 32, context_length: int = 32,
                  seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``batches`` ``(x, y)`` batches drawn from a private ``seed``: the same every call, the global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [get_batch(data, batch_size, context_length, "cpu") for _ in range(batches)]


@torch.no_grad()
def fixed_batch_loss(model: nn.Module, data: np.ndarray, batches: int = 4, batch_size: int = 32, context_length: int = 32,
                     seed: int = 1234) -> float:
    """Mean cross-entropy over the :func:`fixed_batches` (the same batches every call)."""
    was_training = model.training
    model.eval()
    losses = [cross_entropy(model(x), y).item() for x, y in fixed_batches(data, batches, batch_size, context_length, seed)]
    model.train(was_training)
    return float(np.mean(losses))


def dense_vs_moe(num_experts: int = 8, top_k: int = 2, d_ff: int = 32, steps: int | None = None, seed: int = 0) -> dict:
    """Train a dense LM and an MoE LM with the same *active* FFN compute for the same steps on the
    mixed-op arithmetic facts; the MoE has ``num_experts`` experts of hidden size ``d_ff // top_k``,
    so a token's ``top_k`` experts cost what the dense FFN of ``d_ff`` costs (plus a tiny router).

    Returns ``{"dense": ..., "moe": ...}``, each with ``params``, ``active_params``,
    ``ffn_flops_per_token``, ``train_loss`` (per step), ``final_loss`` (on fixed batches of the
    facts) and ``seconds``.
    """
    if d_ff % top_k:
        raise ValueError(f"d_ff={d_ff}: must be divisible by top_k={top_k} (each expert gets d_ff // top_k)")
    task = experiment_task()
    data = task.tokens("train")
    expert_d_ff = d_ff // top_k
    variants = {"dense": (experiment_config(task.vocab_size, d_ff), ffn_flops_per_token(EXPERIMENT_MODEL["d_model"], d_ff)),
                "moe": (experiment_config(task.vocab_size, d_ff, experiment_moe(num_experts, top_k, d_ff=expert_d_ff)),
                        ffn_flops_per_token(EXPERIMENT_MODEL["d_model"], expert_d_ff, num_experts, top_k))}
    results = {}
    for name, (config, flops) in variants.items():
        # one training run, first call included: both variants pay the same one-off costs
        run = timeit(_train_model, config, data, steps, seed, warmup=0, repeats=1, number=1, cold=True)
        model, history = run.result
        results[name] = dict(params=model.num_params(), active_params=active_parameter_count(model), ffn_flops_per_token=flops,
                             train_loss=history.train_loss, final_loss=fixed_batch_loss(model, data),
                             seconds=run.median, model=model)
    return results


BALANCING = {
    "none": dict(aux_loss_weight=0.0),
    "aux loss": dict(aux_loss_weight=0.01),
    "aux-loss-free bias": dict(aux_loss_weight=0.0, bias_update_rate=1e-2),
}


def balancing_experiment(strategies=tuple(BALANCING), num_experts: int = 8, top_k: int = 1, steps: int | None = None,
                         seed: int = 0, d_ff: int = 32) -> dict:
    """Train the same MoE LM with each balancing strategy of :data:`BALANCING` (none, the Switch
    aux loss, DeepSeek-V3's bias) and record every step's expert utilisation.

    Returns ``{strategy: {...}}`` with ``utilisation`` (``[steps, E]``: each expert's share of the
    step's assignments, averaged over the MoE layers), ``imbalance`` (per step: max load / mean
    load, 1 = balanced), ``final_imbalance`` and ``final_utilisation`` (mean over the last 20
    steps), ``train_loss``, ``final_loss`` and ``model``. (The bias rate is 1e-2 rather than
    DeepSeek-V3's 1e-3 because these runs are 200 steps, not 14.8T tokens.)
    """
    unknown = [s for s in strategies if s not in BALANCING]
    if unknown:
        raise ValueError(f"strategies: unknown {unknown}; expected names from {list(BALANCING)}")
    task = experiment_task()
    data = task.tokens("train")
    results = {}
    for name in strategies:
        config = experiment_config(task.vocab_size, d_ff, experiment_moe(num_experts, top_k, **BALANCING[name]))
        utilisation = []
        holder = {}

        def record(step, loss, holder=holder, utilisation=utilisation):
            layers = moe_layers(holder["model"])
            shares = torch.stack([m.stats.tokens_per_expert.float() / m.stats.tokens_per_expert.sum() for m in layers])
            utilisation.append(shares.mean(0))

        torch.manual_seed(run_seed(seed))
        holder["model"] = model = TransformerLM(config)
        history = train(model, data, data, _train_config(steps), device="cpu", callback=record, progress=False)
        util = torch.stack(utilisation)
        imbalance = util.max(dim=1).values * num_experts
        tail = util[-20:].mean(0)
        results[name] = dict(utilisation=util, imbalance=imbalance.tolist(), final_utilisation=tail.tolist(),
                             final_imbalance=float(tail.max() * num_experts), train_loss=history.train_loss,
                             final_loss=fixed_batch_loss(model, data), model=model)
    return results


@torch.no_grad()
def routing_by_op(model: TransformerLM, task: MixedArithmeticTask, split: str = "train", context_length: int = 32,
                  answers_only: bool = False) -> torch.Tensor:
    """``[moe layers, ops, E]``: for each MoE layer and operation, the share of that op's tokens whose
    first-choice expert is ``e``. ``answers_only`` counts only the answer's characters (after ``=``)."""
    tokens, ops = task.tokens_and_ops(split)
    usable = len(tokens) // context_length * context_length
    x = torch.from_numpy(tokens[:usable]).view(-1, context_length)
    op = torch.from_numpy(ops[:usable]).view(-1)
    keep = torch.ones_like(op, dtype=torch.bool)
    if answers_only:
        eq = task.tokenizer.encode("=")[0]
        semi = task.tokenizer.encode(";")[0]
        flat = x.reshape(-1)
        # inside an answer: an '=' came after the last ';'
        seen_eq = torch.cumsum((flat == eq).long(), 0)
        seen_semi = torch.cumsum((flat == semi).long(), 0)
        keep = (seen_eq > seen_semi) & (flat != eq)
    was_training = model.training
    model.eval()
    model(x)
    model.train(was_training)
    layers = moe_layers(model)
    out = torch.zeros(len(layers), len(task.ops), layers[0].num_experts)
    for li, layer in enumerate(layers):
        first = layer.last_routing.expert_index[:, 0].cpu()
        for o in range(len(task.ops)):
            chosen = first[(op == o) & keep]
            out[li, o] = torch.bincount(chosen, minlength=layer.num_experts).float() / max(1, chosen.numel())
    return out


@torch.no_grad()
def routing_by_token(model: TransformerLM, task: MixedArithmeticTask, split: str = "train",
                     context_length: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``([moe layers, vocab, E], [vocab])``: for each MoE layer and input token id, the share of that
    token's occurrences whose first-choice expert is ``e``; and how often each token occurs."""
    tokens = task.tokens(split)
    usable = len(tokens) // context_length * context_length
    x = torch.from_numpy(tokens[:usable]).view(-1, context_length)
    was_training = model.training
    model.eval()
    model(x)
    model.train(was_training)
    flat = x.reshape(-1)
    layers = moe_layers(model)
    counts = torch.bincount(flat, minlength=task.vocab_size).float()
    out = torch.zeros(len(layers), task.vocab_size, layers[0].num_experts)
    for li, layer in enumerate(layers):
        first = layer.last_routing.expert_index[:, 0].cpu()
        joint = torch.zeros(task.vocab_size, layer.num_experts).index_put_((flat, first), torch.ones(len(flat)), accumulate=True)
        out[li] = joint / counts.clamp_min(1)[:, None]
    return out, counts


def specialisation_experiment(num_experts: int = 4, top_k: int = 1, steps: int | None = None, seed: int = 0,
                              d_ff: int = 32) -> dict:
    """Train an MoE LM (aux-loss balanced) on the mixed ``+ - *`` facts and ask what decides a
    token's expert: the operation it belongs to, or the token itself?

    Returns ``ops``; ``routing`` and ``routing_answers`` (``[layers, ops, E]`` from
    :func:`routing_by_op`: all tokens / answer tokens only); ``specialisation`` (per layer, the
    mutual information between op and first-choice expert over answer tokens, in bits: 0 = the
    op says nothing about the expert, ``log2(3)`` = each op has its own experts);
    ``routing_by_token`` (``[layers, vocab, E]``) and ``token_specialisation`` (per layer, the
    mutual information between the input token and its expert, tokens weighted by frequency);
    ``vocab`` (the characters); ``train_loss``, ``final_loss`` and ``model``. Like Mixtral's
    analysis (Jiang et al. 2024, section 5), expect routing to follow tokens much more than topics."""
    task = experiment_task()
    data = task.tokens("train")
    config = experiment_config(task.vocab_size, d_ff, experiment_moe(num_experts, top_k))
    model, history = _train_model(config, data, steps, seed)
    routing = routing_by_op(model, task)
    answers = routing_by_op(model, task, answers_only=True)
    by_token, counts = routing_by_token(model, task)
    present = counts > 0
    token_mi = [mutual_information_bits(m[present], counts[present]) for m in by_token]
    return dict(ops=task.ops, routing=routing, routing_answers=answers, specialisation=[mutual_information_bits(m) for m in answers],
                routing_by_token=by_token, token_specialisation=token_mi, vocab=task.tokenizer.alphabet,
                train_loss=history.train_loss, final_loss=fixed_batch_loss(model, data), model=model)


def mutual_information_bits(routing: torch.Tensor, op_weights: torch.Tensor | None = None) -> float:
    """Mutual information (bits) between op and expert from ``routing`` ``[ops, E]`` (rows: each op's
    expert distribution), with the ops weighted equally unless ``op_weights`` is given."""
    ops = routing.shape[0]
    w = torch.full((ops,), 1.0 / ops) if op_weights is None else op_weights / op_weights.sum()
    joint = routing * w[:, None]
    expert = joint.sum(0)
    ratio = joint / (w[:, None] * expert[None, :]).clamp_min(1e-30)
    terms = torch.where(joint > 0, joint * torch.log2(ratio.clamp_min(1e-30)), torch.zeros_like(joint))
    return float(terms.sum())


def capacity_experiment(capacity_factors=(0.25, 0.5, 0.75, 1.0, 1.25, 2.0, None), model: TransformerLM | None = None,
                        num_experts: int = 8, top_k: int = 2, steps: int | None = None, seed: int = 0,
                        priority: str | None = None) -> list[dict]:
    """Capacity factor vs dropped tokens vs loss: one MoE LM (trained dropless with the aux loss,
    unless ``model`` is given, e.g. one from :func:`balancing_experiment`) evaluated on the same
    fixed batches with each capacity factor (``None`` = dropless) and ``priority`` (``"gate"`` or
    ``"order"``, see :func:`dispatch`; ``None``: the layers' own). Returns one row per factor:
    ``capacity_factor``, ``capacity`` (slots per expert for a batch of 32x32 tokens),
    ``dropped_fraction`` (mean over the MoE layers and batches), ``dropped_by_choice`` (per choice
    ``j`` of a token's ``k``: the share of the ``j``-th choices dropped), ``dropped_by_quarter``
    (the share dropped of the assignments of each quarter of the batch's tokens, in batch order)
    and ``loss``."""
    if priority is not None and priority not in PRIORITIES:
        raise ValueError(f"priority={priority!r}: expected one of {PRIORITIES} or None")
    task = experiment_task()
    data = task.tokens("train")
    if model is None:
        config = experiment_config(task.vocab_size, 32, experiment_moe(num_experts, top_k, d_ff=32 // top_k))
        model, _ = _train_model(config, data, steps, seed)
    layers = moe_layers(model)
    if not layers:
        raise ValueError("model: has no MoE layers")
    saved = [(m.capacity_factor, m.priority) for m in layers]
    rows = []
    try:
        for cf in capacity_factors:
            for m in layers:
                m.capacity_factor = cf
                m.priority = priority or m.priority
            dropped = []

            def hook(module, args, output, dropped=dropped):
                plan = module.last_dispatch
                lost = torch.ones(plan.num_tokens * plan.top_k, dtype=torch.bool)
                lost[plan.slot] = False
                lost = lost.view(4, plan.num_tokens // 4, plan.top_k).float()  # quarters of the batch, in token order
                dropped.append((module.stats.dropped_fraction, lost.mean((0, 1)).numpy(), lost.mean((1, 2)).numpy()))

            handles = [m.register_forward_hook(hook) for m in layers]
            try:
                loss = fixed_batch_loss(model, data)
            finally:
                for h in handles:
                    h.remove()
            tokens = EXPERIMENT_TRAIN.batch_size * EXPERIMENT_TRAIN.context_length
            rows.append(dict(capacity_factor=cf, capacity=expert_capacity(tokens, layers[0].num_experts, layers[0].top_k, cf),
                             dropped_fraction=float(np.mean([d for d, _, _ in dropped])), loss=loss,
                             dropped_by_choice=np.mean([c for _, c, _ in dropped], axis=0).tolist(),
                             dropped_by_quarter=np.mean([q for _, _, q in dropped], axis=0).tolist()))
    finally:
        for m, (cf, kept_priority) in zip(layers, saved):
            m.capacity_factor, m.priority = cf, kept_priority
    return rows


def _train_variant_rank(rank: int, world_size: int, configs: dict, steps: int | None, seed: int) -> dict:
    """Rank ``rank`` of :func:`train_variants`: trains the ``rank``-th of ``configs`` (a plain
    function of the module, so that :func:`labkit.dist.launch` can run it in a forked process)."""
    return _train_variant(*list(configs.items())[rank], steps=steps, seed=seed)


def _train_variant(name: str, config: ModelConfig, steps: int | None, seed: int) -> dict:
    task = experiment_task()
    data = task.tokens("train")
    dropped, holder = [], {}

    def record(step, loss):
        layers = moe_layers(holder["model"])
        dropped.append(float(np.mean([m.stats.dropped_fraction for m in layers])) if layers else 0.0)

    torch.manual_seed(run_seed(seed))
    holder["model"] = model = TransformerLM(config)
    history = train(model, data, data, _train_config(steps), device="cpu", callback=record, progress=False)
    layers = moe_layers(model)
    saved = [m.capacity_factor for m in layers]
    final_loss = fixed_batch_loss(model, data)
    for m in layers:
        m.capacity_factor = None
    dropless_loss = fixed_batch_loss(model, data)
    for m, cf in zip(layers, saved):
        m.capacity_factor = cf
    return dict(name=name, params=model.num_params(), active_params=active_parameter_count(model),
                train_loss=history.train_loss, train_dropped=dropped, final_loss=final_loss,
                final_loss_dropless=dropless_loss)


def train_variants(configs: dict, steps: int | None = None, seed: int = 0, parallel: bool = True) -> dict:
    """Train the chapter's small LM once per ``{name: ModelConfig}`` of ``configs`` (same seed, so
    the same batches, and the same initial weights wherever the shapes agree), one variant per CPU
    core: with ``parallel`` each runs in its own process (:func:`labkit.dist.launch`, one rank per
    variant), else one after the other here. The results are the same either way.

    Returns ``{name: {...}}`` with ``params``, ``active_params``, ``train_loss`` (per step),
    ``train_dropped`` (per step: the share of the step's assignments its capacity dropped, mean
    over the MoE layers; 0 for a dense or dropless model), ``final_loss`` (on the fixed batches,
    with the capacity it trained with) and ``final_loss_dropless`` (the same model evaluated
    without a capacity).
    """
    if not isinstance(configs, dict) or not configs or not all(isinstance(c, ModelConfig) for c in configs.values()):
        raise TypeError(f"configs: expected a non-empty dict of name -> ModelConfig, got {configs!r}")
    if parallel and len(configs) > 1:
        results = launch(_train_variant_rank, world_size=len(configs), backend="gloo", quiet=True, configs=configs,
                         steps=steps, seed=seed)
        runs = [results[rank] for rank in range(len(configs))]
    else:
        runs = [_train_variant(name, config, steps, seed) for name, config in configs.items()]
    return {run.pop("name"): run for run in runs}


def capacity_training_experiment(capacity_factors=(0.5, 1.0), priority: str = "gate", num_experts: int = 8,
                                 top_k: int = 1, steps: int | None = None, seed: int = 0) -> dict:
    """Dropping *during training*: section 3's aux-loss MoE LM (:data:`BALANCING` ``"aux loss"``,
    ``num_experts`` experts, top-``top_k``, hidden size 32) trained with each capacity factor, the
    assignments over capacity dropped (they reach the next layer through the residual only) and
    kept by ``priority``. With the same ``seed`` and ``steps`` as :func:`balancing_experiment`, its
    ``"aux loss"`` run is the dropless twin: same initial weights, same batches.

    Returns ``{capacity_factor: run}``, runs as :func:`train_variants` gives them."""
    if priority not in PRIORITIES:
        raise ValueError(f"priority={priority!r}: expected one of {PRIORITIES}")
    if not capacity_factors or any(cf is None for cf in capacity_factors):
        raise ValueError(f"capacity_factors={capacity_factors!r}: expected capacity factors (the dropless run is balancing_experiment's)")
    vocab = experiment_task().vocab_size
    configs = {cf: experiment_config(vocab, 32, experiment_moe(num_experts, top_k, capacity_factor=cf, priority=priority,
                                                                 **BALANCING["aux loss"]))
               for cf in capacity_factors}
    return train_variants(configs, steps, seed)


def granularity_configs(d_ff: int = 32) -> dict:
    """The fine-grained and shared-expert variants of :func:`dense_vs_moe`'s MoE (8 experts of
    ``d_ff // 2``, top-2), at its total *and* active expert sizes: the same ``4 * d_ff`` hidden
    units in all, ``d_ff`` of them per token. ``"32 x 4, top-8"``: experts a quarter as wide,
    four times as many and as many per token (DeepSeekMoE's fine-grained segmentation);
    ``"1 shared + 31 x 4, top-7"``: one of them always on, outside the router (its shared expert
    isolation). Names follow ``d_ff=32``."""
    _check_counts(d_ff=d_ff)
    if d_ff % 8:
        raise ValueError(f"d_ff={d_ff}: must be divisible by 8 (fine-grained experts are d_ff // 8 wide)")
    vocab, narrow = experiment_task().vocab_size, d_ff // 8
    return {f"32 x {narrow}, top-8": experiment_config(vocab, d_ff, experiment_moe(32, 8, d_ff=narrow)),
            f"1 shared + 31 x {narrow}, top-7": experiment_config(vocab, d_ff, experiment_moe(31, 7, d_ff=narrow, num_shared_experts=1))}


def seed_band(curves, window: int = 10) -> dict:
    """Per-step ``mean``, ``low`` and ``high`` over seeds of loss ``curves`` (one equal-length
    sequence per seed), each curve first smoothed by a trailing mean over ``window`` steps (fewer
    at the start), so the band shows the spread between runs rather than one batch's noise;
    ``step`` counts from 1. numpy arrays."""
    runs = np.asarray(curves, dtype=np.float64)
    if runs.ndim != 2 or runs.shape[0] < 1 or runs.shape[1] < 1:
        raise ValueError(f"curves: expected one non-empty loss curve per seed, all the same length, got shape {runs.shape}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r}: expected a positive integer")
    sums = np.cumsum(runs, axis=1)
    ahead = np.concatenate([np.zeros((runs.shape[0], window)), sums[:, :-window]], axis=1)[:, : runs.shape[1]]
    counts = np.minimum(np.arange(1, runs.shape[1] + 1), window)
    smooth = (sums - ahead) / counts
    return dict(step=np.arange(1, runs.shape[1] + 1), mean=smooth.mean(0), low=smooth.min(0), high=smooth.max(0))


@torch.no_grad()
def router_roundoff(logits: torch.Tensor, scales=(1, 4, 16, 64), top_k: int = 1, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """What rounding the router logits to ``dtype`` does as they grow (ST-MoE's router instability):
    for each ``scale``, the logits ``scale * logits`` once in fp32 and once rounded to ``dtype``
    before the softmax (a router computed in bf16). Per scale: ``logsumexp`` (its mean over the
    tokens) and ``z_loss`` (:func:`router_z_loss` with weight 1, the mean squared logsumexp);
    ``logit_spacing``, the ``dtype`` spacing at the largest logit; ``gate_relative_error``, the
    largest relative error of the softmax probability of a token's fp32-chosen experts (Switch's
    top-1 gate is that probability), and ``changed_fraction``, the share of tokens whose top-``k``
    experts differ. An error ``delta`` in a logit is a relative error ``exp(delta) - 1`` in its
    probability, and bf16's spacing grows with the logits: so does the gates' error."""
    if not scales or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf for v in scales):
        raise ValueError(f"scales={scales!r}: expected positive finite numbers")
    logits = logits.float()
    rows = []
    for scale in scales:
        exact = logits * scale
        rounded = exact.to(dtype).float()
        ref, low = top_k_gating(exact, top_k), top_k_gating(rounded, top_k)
        same = (ref.expert_index.sort(-1).values == low.expert_index.sort(-1).values).all(-1)
        chosen_ref, chosen_low = ref.probs.gather(-1, ref.expert_index), low.probs.gather(-1, ref.expert_index)
        largest = exact.abs().max().to(dtype)
        spacing = torch.nextafter(largest, torch.tensor(math.inf, dtype=dtype)).float() - largest.float()
        rows.append(dict(scale=scale, logsumexp=float(torch.logsumexp(exact, -1).mean()),
                         z_loss=float(router_z_loss(exact, weight=1.0)), logit_spacing=float(spacing),
                         gate_relative_error=float(((chosen_low - chosen_ref).abs() / chosen_ref).max()),
                         changed_fraction=float((~same).float().mean())))
    return rows


@torch.no_grad()
def fixed_batch_routing(model: TransformerLM, seed: int = 1234) -> list[Routing]:
    """Each MoE layer's :class:`Routing` of one fixed batch (32 sequences of 32 tokens of the
    chapter's task, drawn from a private ``seed``), the model in eval mode; token ``t`` of a
    routing is sequence ``t // 32``, position ``t % 32`` (the first of :func:`fixed_batch_loss`'s batches)."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError("model: has no MoE layers")
    (x, _), = fixed_batches(experiment_task().tokens("train"), 1, EXPERIMENT_TRAIN.batch_size, EXPERIMENT_TRAIN.context_length, seed)
    was_training = model.training
    model.eval()
    model(x)
    model.train(was_training)
    return [layer.last_routing for layer in layers]


# ============================================================================ the grouped GEMM's tile map
def grouped_gemm_plan(group_sizes, n_out: int, block_m: int, block_n: int) -> dict:
    """The work of a grouped GEMM over experts' row segments (``group_sizes[e]`` rows for expert
    ``e``, in expert order, ``n_out`` output columns) cut into ``block_m x block_n`` output tiles,
    counted with a plain loop over the experts (the kernel builds the same map with a cumsum and
    a searchsorted, :func:`labkit.kernels.grouped_matmul.tile_map`), beside the two alternatives.

    Returns ``programs`` (one dict per program ``(t, j)`` of the launch grid, ``t`` the row tile,
    ``j`` the column tile: ``expert``, ``rows`` ``(first, end)`` of the rows it computes, ``cols``
    likewise, and ``padded_rows``, the rows of its tile past its segment's end, masked),
    ``grid`` ``(row tiles, column tiles)``, ``rows`` (the real rows, ``sum(group_sizes)``),
    ``tile_rows`` (row tiles x ``block_m``: what the tiles span) and ``padded_rows`` (their
    difference: under one tile per expert that has rows); for a padded batched matmul
    (``torch.bmm`` on ``[E, max(group_sizes), d]``), ``bmm_rows`` (``E x max``) and
    ``bmm_padded_rows``; and ``loop_launches``, the matmuls a loop over the experts with rows
    launches. Every count is exact."""
    sizes = [int(s) for s in (group_sizes.tolist() if isinstance(group_sizes, torch.Tensor) else group_sizes)]
    if not sizes or any(s < 0 for s in sizes):
        raise ValueError(f"group_sizes={sizes!r}: expected non-negative rows per expert, at least one expert")
    _check_counts(n_out=n_out, block_m=block_m, block_n=block_n)
    col_tiles = -(-n_out // block_n)
    programs, start, row_tile = [], 0, 0
    for expert, size in enumerate(sizes):
        for first in range(start, start + size, block_m):
            end = min(first + block_m, start + size)
            for j in range(col_tiles):
                programs.append(dict(program=(row_tile, j), expert=expert, rows=(first, end),
                                     cols=(j * block_n, min((j + 1) * block_n, n_out)), padded_rows=block_m - (end - first)))
            row_tile += 1
        start += size
    rows = sum(sizes)
    return dict(programs=programs, grid=(row_tile, col_tiles), rows=rows, tile_rows=row_tile * block_m,
                padded_rows=row_tile * block_m - rows, bmm_rows=len(sizes) * max(sizes),
                bmm_padded_rows=len(sizes) * max(sizes) - rows, loop_launches=sum(s > 0 for s in sizes))


# ============================================================================ inference: decoding reads the experts
def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of different experts ``tokens`` tokens use when each picks ``top_k`` of
    ``num_experts`` uniformly and independently: ``E * (1 - (1 - k/E)^tokens)`` (an expert is
    missed by one token with probability ``1 - k/E``)."""
    _check_counts(num_experts=num_experts, top_k=top_k, tokens=tokens)
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k}: at most num_experts={num_experts}")
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def decode_weight_reads(table: list[dict] | None = None, batch_sizes=(1, 2, 4, 8, 16, 32, 64, 256), bytes_per_param: int = 2,
                        gpu: str = "H100 SXM") -> list[dict]:
    """Weights one decoding step reads, per model of ``table`` (rows of :func:`moe_parameter_table`,
    computed if ``None``) and batch size ``B`` (``B`` sequences, one new token each), with uniform routing. Decoding is memory-bound:
    the step's time is about its bytes over the bandwidth.

    A routed expert's parameters over all MoE layers are ``(total - active) / (E - k)``; every
    other weight (attention, norms, router, shared experts, the embedding and the output layer,
    counted whole: an upper bound for the embedding, of which a step reads ``B`` rows) is read at
    every step. Each MoE layer reads :func:`expected_distinct_experts` of its experts once
    (the KV cache's reads, chapter 03, come on top). Per row: ``experts_read`` (per layer),
    ``bytes`` per step, ``bytes_per_token``, ``tokens_per_expert`` (rows each read expert
    multiplies: ``B k / experts_read``) and ``flop_per_byte`` of the expert matmuls
    (``2 * tokens_per_expert / bytes_per_param``), against ``ridge``, the ``gpu``'s bf16 FLOP/s
    over its bandwidth from :data:`labkit.hardware.GPU_DATASHEETS`, and ``compute_bound_batch``,
    the smallest ``B`` whose expert matmuls reach the ridge (``ridge * bytes / 2 * E / k``)."""
    _check_counts(bytes_per_param=bytes_per_param, **{f"batch_sizes[{i}]": b for i, b in enumerate(batch_sizes)})
    if gpu not in GPU_DATASHEETS:
        raise ValueError(f"gpu={gpu!r}: expected one of {sorted(GPU_DATASHEETS)}")
    peaks = GPU_DATASHEETS[gpu]
    ridge = peaks.tflops["bfloat16"] / peaks.bandwidth_tb_s  # FLOP per byte
    rows = []
    for model in moe_parameter_table() if table is None else table:
        E, k = model["experts"], model["top_k"]
        per_expert, rest = divmod(model["total"] - model["active"], E - k)
        if rest:
            raise ValueError(f"table: {model['model']}'s inactive parameters are not a whole number of its {E - k} unused experts")
        always = model["total"] - E * per_expert
        for B in batch_sizes:
            experts_read = expected_distinct_experts(E, k, B)
            step_bytes = (always + experts_read * per_expert) * bytes_per_param
            tokens_per_expert = B * k / experts_read
            rows.append(dict(model=model["model"], experts=E, top_k=k, batch=B, expert_params=per_expert, other_params=always,
                             experts_read=experts_read, bytes=step_bytes, bytes_per_token=step_bytes / B,
                             tokens_per_expert=tokens_per_expert, flop_per_byte=2 * tokens_per_expert / bytes_per_param,
                             ridge=ridge, compute_bound_batch=math.ceil(ridge * bytes_per_param / 2 * E / k)))
    return rows


def decode_distinct_experts(model: TransformerLM, batch_sizes=(1, 2, 4, 8, 16, 32)) -> list[dict]:
    """Different experts a *trained* router uses per decoding step: the routing of
    :func:`fixed_batch_routing` (32 sequences); a step of batch ``B`` is one position of ``B`` of
    the sequences (consecutive groups of ``B``). Per ``B``: ``measured`` (mean distinct experts per
    step and MoE layer, over every position and group) and ``uniform``
    (:func:`expected_distinct_experts`). Returns one row per ``B``."""
    sequences, length = EXPERIMENT_TRAIN.batch_size, EXPERIMENT_TRAIN.context_length
    bad = [b for b in batch_sizes if isinstance(b, bool) or not isinstance(b, int) or b < 1 or sequences % b]
    if bad:
        raise ValueError(f"batch_sizes: {bad} do not divide the {sequences} sequences")
    routings = fixed_batch_routing(model)
    rows = []
    for B in batch_sizes:
        per_layer = []
        for routing in routings:
            groups, k = sequences // B, routing.top_k
            chosen = routing.expert_index.view(groups, B, length, k).permute(0, 2, 1, 3).reshape(groups, length, B * k)
            used = torch.zeros(groups, length, routing.num_experts, dtype=torch.bool).scatter_(2, chosen, True)
            per_layer.append(used.sum(-1).float().mean())
        rows.append(dict(batch=B, measured=float(torch.stack(per_layer).mean()),
                         uniform=expected_distinct_experts(routings[0].num_experts, routings[0].top_k, B)))
    return rows


def _check_counts(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive integer")


# ============================================================================ the widget's callback
def routing_explorer(num_experts: int, top_k: int, capacity_factor: float | None, balance_weight: float, skew: float,
                     seed: int = 0, num_tokens: int = 512, d_model: int = 16, steps: int = 50, lr: float = 0.5) -> dict:
    """What routing does to a batch of ``num_tokens`` random tokens (fast: for a slider).

    The router's logits are ``x W^T + skew * preference``, where ``preference`` favours low-numbered
    experts (a ramp from +1 to -1: a router that has drifted towards some experts). Then
    ``steps`` steps of gradient descent on ``W`` minimise ``balance_weight`` times the Switch
    load-balancing loss (``balance_weight=0``: no balancing). Routing before and after, with
    ``capacity_factor`` (``None`` = dropless) applied.

    Returns ``tokens_per_expert_before`` / ``tokens_per_expert`` (assignments per expert, before
    and after balancing), ``kept_per_expert``, ``dropped_per_expert``, ``capacity``,
    ``dropped_fraction``, ``load_imbalance`` (max / mean load), ``aux_loss`` (the Switch loss with
    alpha=1, i.e. ``E * sum f_i P_i``: 1 when balanced), ``z_loss`` (alpha=1), ``router_entropy``
    (nats) and ``max_entropy`` (``log E``), ``gates`` (``[min(32, tokens), E]`` dense gate matrix of
    the first tokens, for a heatmap) and ``aux_loss_history``.
    """
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r}: expected a positive integer")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r}: expected an integer from 1 to num_experts={num_experts}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor!r}: expected a positive number or None (dropless)")
    if not balance_weight >= 0:
        raise ValueError(f"balance_weight={balance_weight!r}: expected a non-negative number")
    if not math.isfinite(skew):
        raise ValueError(f"skew={skew!r}: expected a finite number")
    gen = torch.Generator().manual_seed(run_seed(seed))
    x = torch.randn(num_tokens, d_model, generator=gen)
    weight = (torch.randn(num_experts, d_model, generator=gen) * 0.3).requires_grad_()
    preference = torch.linspace(1.0, -1.0, num_experts) if num_experts > 1 else torch.zeros(1)

    def logits_of(w):
        return x @ w.T + skew * preference

    with torch.no_grad():
        before = top_k_gating(logits_of(weight), top_k).tokens_per_expert()
    history = []
    if balance_weight > 0:
        optimizer = torch.optim.SGD([weight], lr=lr)
        for _ in range(steps):
            routing = top_k_gating(logits_of(weight), top_k)
            loss = balance_weight * load_balancing_loss(routing.probs, routing.expert_index, alpha=1.0)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            history.append(loss.item() / balance_weight)
    with torch.no_grad():
        logits = logits_of(weight)
        routing = top_k_gating(logits, top_k)
        plan = dispatch(routing, expert_capacity(num_tokens, num_experts, top_k, capacity_factor))
        probs = routing.probs
        routed = plan.routed_per_expert
        return dict(
            tokens_per_expert_before=before.tolist(), tokens_per_expert=routed.tolist(), kept_per_expert=plan.group_sizes.tolist(),
            dropped_per_expert=(routed - plan.group_sizes).tolist(), capacity=plan.capacity,
            dropped_fraction=plan.dropped_fraction, load_imbalance=float(routed.max() / routed.float().mean()),
            aux_loss=float(load_balancing_loss(probs, routing.expert_index, alpha=1.0)),
            z_loss=float(router_z_loss(logits, weight=1.0)), router_entropy=float(router_entropy(probs)),
            max_entropy=math.log(num_experts),
            gates=routing.dense_gates()[:32], aux_loss_history=history,
        )
