"""Choosing a 3-D layout (chapter 08): for a model and a cluster, the memory per GPU and the
communication per step of every split into tensor (TP) × pipeline (PP) × context (CP) × data (DP)
parallelism, with the experts of a mixture-of-experts model split (EP) across the DP ranks,
flagging what does not fit, next to published layouts.

Memory is chapter 07's estimator applied to what one GPU holds: model state by
:func:`labkit.memory.model_state_bytes` (ZeRO over the DP ranks) for this GPU's share of the
parameters, activations by :func:`labkit.memory.activation_terms` for this GPU's slice of the
model (its stage's layers, ``1/TP`` of the heads and of ``d_ff``, ``1/CP`` of the sequence), times
the micro-batches its stage holds at once (1F1B: ``PP - stage``). With TP = PP = CP = 1 it is
exactly :func:`labkit.memory.estimate_training_memory`. Expert parallelism (Megatron-Core,
DeepSpeed-MoE) gives each of ``EP`` ranks of a DP group ``1/EP`` of every MoE layer's routed experts;
their optimizer state is sharded over the ``DP/EP`` ranks that hold the same experts (the
expert-data-parallel group), and their gradients are all-reduced there. Communication counts the bytes each GPU
sends per step with ring collectives (:func:`labkit.parallel.collective_bytes_sent`), and the time
assumes no overlap with compute (an upper bound).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from labkit.memory import MemoryBreakdown, _dtype, activation_terms, model_state_bytes
from labkit.model import MOE_PRESETS, PRESETS, ModelConfig, config_from
from labkit.parallel import _check_positive_ints, bubble_fraction, collective_bytes_sent, split_layers

GB = 1e9


@dataclass(frozen=True)
class Interconnect:
    """How the GPUs talk: ``gpus_per_node`` share a fast intra-node fabric (NVLink) of
    ``intra_node`` bytes/s per GPU and direction; across nodes each GPU has ``inter_node`` bytes/s
    (its NIC) on ``fabric`` (InfiniBand, or RoCE: RDMA over Ethernet)."""

    name: str
    gpus_per_node: int
    intra_node: float
    inter_node: float
    fabric: str = "InfiniBand"


# NVIDIA's published figures: NVLink 4 gives an H100/H200 SXM 900 GB/s in total (450 GB/s each way);
# a DGX H100/H200 node has one 400 Gb/s (50 GB/s) ConnectX-7 InfiniBand port per GPU. Meta trained Llama 3 405B
# on its RoCE cluster: 400 Gb/s RDMA over Converged Ethernet per GPU (Llama 3 paper, section 3.3.1).
INTERCONNECTS = {
    "nvlink+ib": Interconnect("8 GPUs per node, NVLink 4 (450 GB/s per GPU each way), 400 Gb/s InfiniBand per GPU", 8, 450e9, 50e9),
    "nvlink+roce": Interconnect("8 GPUs per node, NVLink 4 (450 GB/s per GPU each way), 400 Gb/s RoCE per GPU", 8, 450e9, 50e9,
                                "RoCE"),
    "pcie+ethernet": Interconnect("8 GPUs per node, PCIe 5 (64 GB/s), 100 Gb/s Ethernet per node (1.6 GB/s per GPU)", 8, 64e9, 12.5e9 / 8,
                                  "Ethernet"),
}
GPU_MEMORY_GB = {"H100 SXM (80 GB)": 80, "H200 SXM (141 GB)": 141, "A100 (40 GB)": 40, "A100 (80 GB)": 80}
H100_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak of an H100/H200 SXM

# Llama 3 models (Hugging Face config.json): added here for the calculator, beside labkit.model.PRESETS
# and the mixture-of-experts presets.
PLAN_PRESETS: dict[str, ModelConfig] = {
    **PRESETS,
    **MOE_PRESETS,
    "llama3-70b": ModelConfig(vocab_size=128256, context_length=8192, d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                              d_ff=28672, rope_theta=500_000.0),
    "llama3-405b": ModelConfig(vocab_size=128256, context_length=131072, d_model=16384, num_layers=126, num_heads=128,
                               num_kv_heads=8, d_ff=53248, rope_theta=500_000.0),
}

# Layouts the Llama 3 team reported for training Llama 3 405B on H100 80 GB GPUs ("The Llama 3 Herd
# of Models", Dubey et al. 2024, Table 4): 16M tokens per step in every row.
PUBLISHED_LAYOUTS = [
    {"model": "llama3-405b", "gpus": 8192, "tp": 8, "cp": 1, "pp": 16, "dp": 64, "seq_len": 8192, "tokens_per_step": 16 * 2**20,
     "interconnect": "nvlink+roce", "source": "Llama 3 (Dubey et al. 2024), Table 4"},
    {"model": "llama3-405b", "gpus": 16384, "tp": 8, "cp": 1, "pp": 16, "dp": 128, "seq_len": 8192, "tokens_per_step": 16 * 2**20,
     "interconnect": "nvlink+roce", "source": "Llama 3 (Dubey et al. 2024), Table 4"},
    {"model": "llama3-405b", "gpus": 16384, "tp": 8, "cp": 16, "pp": 16, "dp": 8, "seq_len": 131072, "tokens_per_step": 16 * 2**20,
     "interconnect": "nvlink+roce", "source": "Llama 3 (Dubey et al. 2024), Table 4 (long-context stage)"},
]


@dataclass
class LayoutPlan:
    """One TP × PP × CP × DP layout (``ep``: how many of the DP ranks split the experts of a MoE
    model): the worst stage's memory per GPU, whether it fits, and the bytes each GPU sends per
    step along each dimension (``comm_bytes``; ``"ep"`` for MoE models) with the time that takes
    on its link (``comm_seconds``), the pipeline bubble, and a no-overlap step-time estimate."""

    tp: int
    pp: int
    cp: int
    dp: int
    micro_batches: int
    memory: MemoryBreakdown
    worst_stage: int
    fits: bool
    comm_bytes: dict[str, float]
    comm_seconds: dict[str, float]
    links: dict[str, str]
    bubble: float
    compute_seconds: float
    step_seconds: float
    notes: list[str] = field(default_factory=list)
    ep: int = 1

    @property
    def layout(self) -> str:
        experts = f" (EP{self.ep})" if self.ep > 1 else ""
        return f"TP{self.tp} x PP{self.pp} x CP{self.cp} x DP{self.dp}{experts}"

    def row(self) -> dict:
        """A flat dict for :func:`labkit.show.print_table`."""
        return {"layout": self.layout, "m": self.micro_batches, "GB/GPU": round(self.memory.total / GB, 1),
                "fits": "yes" if self.fits else "NO", "bubble": f"{self.bubble:.0%}",
                **{f"{k} GB": round(v / GB, 2) for k, v in self.comm_bytes.items()},
                "TP link": self.links["tp"], "step s": round(self.step_seconds, 1)}


def _norm_params(config: ModelConfig) -> int:
    return {"rmsnorm": 1, "layernorm": 2, "none": 0}[config.norm] * config.d_model


def _local_kv_heads(config: ModelConfig, tp: int) -> int:
    """K/V heads per TP rank: split when there are enough, else replicated (one per rank)."""
    return max(1, config.kv_heads // tp)


def stage_parameter_split(config: ModelConfig, tp: int, num_layers: int, first: bool, last: bool, *, first_layer: int = 0,
                          ep: int = 1) -> tuple[int, int]:
    """Parameters one GPU holds, as ``(replicated across EP, routed experts)``: the model's
    layers ``first_layer ... first_layer + num_layers - 1`` with ``1/tp`` of every weight matrix
    (norms and routers replicated), plus ``1/tp`` of the embedding on the first stage and of the
    LM head (and the final norm) on the last (Megatron's vocabulary-parallel embedding and head);
    of each MoE layer's routed experts it holds ``num_experts / ep``, each split by TP as a dense
    FFN is (the shared experts too)."""
    d, hd, heads, ff = config.d_model, config.dim_per_head, config.num_heads // tp, config.d_ff // tp
    kv = _local_kv_heads(config, tp)
    attn = 2 * d * heads * hd + 2 * d * kv * hd + (2 * hd if config.qk_norm else 0)
    moe_layers = sum(config.is_moe_layer(first_layer + i) for i in range(num_layers))
    dense = num_layers * (2 * _norm_params(config) + attn) + (num_layers - moe_layers) * 3 * d * ff
    experts = 0
    if moe_layers:
        moe = config.moe
        expert_ff = (moe.d_ff or config.d_ff) // tp
        dense += moe_layers * (moe.num_experts * d * (2 if moe.router_noise else 1) + 3 * d * moe.num_shared_experts * expert_ff)
        experts = moe_layers * (moe.num_experts // ep) * 3 * d * expert_ff
    vocab = math.ceil(config.vocab_size / tp) * d
    if first:
        dense += vocab
    if last:
        dense += _norm_params(config) + (0 if config.tie_embeddings and first else vocab)
    return dense, experts


def stage_parameters(config: ModelConfig, tp: int, num_layers: int, first: bool, last: bool, *, first_layer: int = 0,
                     ep: int = 1) -> int:
    """Parameters one GPU holds (see :func:`stage_parameter_split`)."""
    return sum(stage_parameter_split(config, tp, num_layers, first, last, first_layer=first_layer, ep=ep))


def _expert_ff(config: ModelConfig) -> int | None:
    return None if config.moe is None else config.moe.d_ff or config.d_ff


def _sum_breakdowns(a: MemoryBreakdown, b: MemoryBreakdown) -> MemoryBreakdown:
    return MemoryBreakdown(**{name: a.as_dict()[name] + b.as_dict()[name] for name in a.as_dict() if name != "total"})


def _check_layout(config: ModelConfig, tp: int, pp: int, cp: int, seq_len: int, ep: int = 1, dp: int = 1) -> None:
    if config.moe is None and ep != 1:
        raise ValueError(f"ep={ep}: expert parallelism needs a mixture-of-experts model (config.moe is None)")
    if config.moe is not None:
        if config.moe.num_experts % ep or dp % ep:
            raise ValueError(f"ep={ep}: must divide num_experts={config.moe.num_experts} and dp={dp} (the experts are split across DP ranks)")
        if _expert_ff(config) % tp:
            raise ValueError(f"tp={tp}: must divide the experts' d_ff={_expert_ff(config)}")
    if config.num_heads % tp or (config.kv_heads % tp and tp % config.kv_heads):
        raise ValueError(f"tp={tp}: must divide num_heads={config.num_heads}, and divide or be a multiple of "
                         f"num_kv_heads={config.kv_heads}")
    if config.d_ff % tp:
        raise ValueError(f"tp={tp}: must divide d_ff={config.d_ff}")
    if pp > config.num_layers:
        raise ValueError(f"pp={pp}: more stages than num_layers={config.num_layers}")
    if seq_len % cp:
        raise ValueError(f"cp={cp}: must divide seq_len={seq_len}")


def stage_memory(config: ModelConfig, tp: int, pp: int, cp: int, dp: int, stage: int, micro_batches: int, micro_batch: int,
                 seq_len: int, *, param_dtype="bf16", zero_stage: int = 1, activation_checkpointing: bool = False,
                 sequence_parallel: bool = True, flash_attention: bool = True, schedule: str = "1f1b", ep: int = 1) -> MemoryBreakdown:
    """Memory of one GPU of pipeline stage ``stage`` (see the module docstring).

    Its slice of the model is a ``ModelConfig`` with this stage's layers, ``heads/tp`` heads,
    ``d_ff/tp`` and ``vocab/tp``, whose activations for ``micro_batch`` sequences of
    ``seq_len/cp`` tokens chapter 07's :func:`~labkit.memory.activation_terms` counts; then
    ``sequence_parallel`` divides the norms' and matmul inputs' terms by ``tp`` (Megatron keeps
    the sequence shard and all-gathers it again in backward), ``flash_attention`` counts a fused
    attention (chapter 07's ``attention="sdpa"``: its output and a log-sum-exp per row instead of
    the scores), and the stage holds ``min(pp - stage, m)``
    micro-batches at once under 1F1B (``m`` under GPipe). A MoE layer's activations are counted
    for all the micro-batch's tokens on every TP rank (with balanced routing each GPU computes as
    many routed rows as it sends away), not divided by sequence parallelism: an upper bound.
    """
    _check_layout(config, tp, pp, cp, seq_len, ep, dp)
    if schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"schedule={schedule!r}: expected '1f1b' or 'gpipe'")
    counts = split_layers(config.num_layers, pp)
    layers, first_layer = counts[stage], sum(counts[:stage])
    first, last = stage == 0, stage == pp - 1
    mixed = _dtype(param_dtype) != _dtype("fp32")
    dense, experts = stage_parameter_split(config, tp, layers, first, last, first_layer=first_layer, ep=ep)
    if ep == 1:  # every DP rank holds every expert: one flat buffer, sharded over all of DP
        state = model_state_bytes(dense + experts, param_dtype, mixed_precision=mixed, zero_stage=zero_stage, world_size=dp)
    else:
        state = _sum_breakdowns(model_state_bytes(dense, param_dtype, mixed_precision=mixed, zero_stage=zero_stage, world_size=dp),
                                model_state_bytes(experts, param_dtype, mixed_precision=mixed, zero_stage=zero_stage,
                                                  world_size=dp // ep))
    local = replace(config, num_layers=layers, num_heads=config.num_heads // tp, num_kv_heads=_local_kv_heads(config, tp),
                    head_dim=config.dim_per_head, d_ff=config.d_ff // tp, vocab_size=math.ceil(config.vocab_size / tp),
                    context_length=max(config.context_length, seq_len),
                    moe=None if config.moe is None else replace(config.moe, d_ff=_expert_ff(config) // tp))
    tokens = seq_len // cp
    terms = activation_terms(local, micro_batch, tokens, param_dtype, activation_checkpointing,
                             attention="sdpa" if flash_attention else "materialized", first_layer=first_layer)
    if sequence_parallel and tp > 1:
        for name in ("attn: norm", "ffn: norm", "attn: q/k/v input", "ffn: w1/w3 input", "block inputs (checkpointed)", "final norm"):
            if name in terms:
                terms[name] //= tp
    if not first:
        terms.pop("token ids", None)
    if not last:
        for name in ("final norm", "lm_head input", "loss: logits, exp(logits), row sums, targets"):
            terms.pop(name, None)
    recompute = terms.pop("recompute_block")
    in_flight = micro_batches if schedule == "gpipe" else min(pp - stage, micro_batches)
    state.activations = in_flight * sum(terms.values())
    state.recompute = recompute
    return state


def parallel_plan(config: ModelConfig | str, gpus: int, gpu_memory: float, interconnect: Interconnect | str = "nvlink+ib", *,
                  seq_len: int = 4096, tokens_per_step: int = 4 * 2**20, micro_batch: int = 1, tp=None, pp=None, cp=(1,), ep=None,
                  param_dtype="bf16", zero_stage: int = 1, activation_checkpointing: bool = False, sequence_parallel: bool = True,
                  flash_attention: bool = True, schedule: str = "1f1b", gpu_flops: float = H100_BF16_FLOPS,
                  mfu: float = 0.4) -> list[LayoutPlan]:
    """Every layout ``TP × PP × CP × DP = gpus`` of ``config`` (a ``ModelConfig`` or a name in
    :data:`PLAN_PRESETS`) with ``tp`` in the powers of two that divide the heads (or the given
    values), ``pp`` in the powers of two up to the layers, ``cp`` as given, ``ep`` (MoE models) in
    the powers of two that divide the experts and DP (or the given values; 1 for dense models), and
    a whole number of micro-batches per step (``tokens_per_step / (seq_len · micro_batch · dp)``).

    Returns :class:`LayoutPlan`s, those that fit in ``gpu_memory`` GB first, each group by
    estimated step time. Memory: :func:`stage_memory` of the worst stage. Communication per GPU
    and step (bytes it sends): TP, 4 all-reduces per layer and micro-batch (6 with activation
    checkpointing, whose recomputed forward repeats them); CP, the ring attention's K/V blocks
    (``cp - 1`` forward, twice that backward); PP, one activation per micro-batch forward and one
    gradient back, of which each TP rank sends its ``1/tp`` (Megatron's scatter/gather, Narayanan
    et al. 2021 §4.1: the next stage all-gathers the pieces over NVLink); EP, per MoE layer and micro-batch the all-to-alls that send the routed tokens
    to their experts and back, in forward and again in backward (and in the recomputed forward
    with activation checkpointing), each TP rank dispatching ``1/tp`` of the tokens
    (Megatron-Core's all-to-all dispatcher); DP, the gradient all-reduce, of the routed experts
    over the ``DP/EP`` ranks that hold the same ones (ZeRO-3 adds the parameter all-gathers). Each
    dimension's traffic runs on NVLink while its group fits in a node (TP innermost, then CP, EP,
    PP, DP), else on the inter-node fabric (InfiniBand or RoCE). Step time: compute (6 FLOPs per active parameter and token, 8
    with recomputation) at ``mfu`` of ``gpu_flops``, stretched by the bubble, plus all
    communication (no overlap: an upper bound).
    """
    config = config_from(config, PLAN_PRESETS)
    if isinstance(interconnect, str):
        if interconnect not in INTERCONNECTS:
            raise ValueError(f"interconnect={interconnect!r}: expected an Interconnect or one of {sorted(INTERCONNECTS)}")
        interconnect = INTERCONNECTS[interconnect]
    _check_positive_ints(gpus=gpus, seq_len=seq_len, tokens_per_step=tokens_per_step, micro_batch=micro_batch)
    if not gpu_memory > 0:
        raise ValueError(f"gpu_memory={gpu_memory!r}: expected GB per GPU, a positive number")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu!r}: expected a fraction in (0, 1]")
    powers = [2**i for i in range(int(math.log2(gpus)) + 1)]
    tps = [t for t in (tp if tp is not None else powers) if _valid_tp(config, t)]
    pps = [p for p in (pp if pp is not None else powers) if p <= config.num_layers]
    if config.moe is None and ep is not None and any(e != 1 for e in ep):
        raise ValueError(f"ep={ep!r}: expert parallelism needs a mixture-of-experts model (config.moe is None)")
    eps = [1] if config.moe is None else [e for e in (ep if ep is not None else powers) if config.moe.num_experts % e == 0]
    plans = []
    for t in tps:
        for p in pps:
            for c in cp:
                if gpus % (t * p * c) or seq_len % c:
                    continue
                d = gpus // (t * p * c)
                sequences = tokens_per_step // seq_len
                if sequences % (d * micro_batch) or sequences == 0:
                    continue
                for e in eps:
                    if d % e:
                        continue
                    plans.append(_plan(config, t, p, c, d, sequences // (d * micro_batch), gpu_memory, interconnect, seq_len,
                                       micro_batch, param_dtype, zero_stage, activation_checkpointing, sequence_parallel,
                                       flash_attention, schedule, gpu_flops, mfu, tokens_per_step, e))
    return sorted(plans, key=lambda plan: (not plan.fits, plan.step_seconds))


def _valid_tp(config: ModelConfig, tp: int) -> bool:
    return (config.num_heads % tp == 0 and config.d_ff % tp == 0 and (config.kv_heads % tp == 0 or tp % config.kv_heads == 0)
            and (config.moe is None or _expert_ff(config) % tp == 0))


def _plan(config, tp, pp, cp, dp, m, gpu_memory, net: Interconnect, seq_len, micro_batch, param_dtype, zero_stage, checkpointing,
          sequence_parallel, flash_attention, schedule, gpu_flops, mfu, tokens_per_step, ep=1) -> LayoutPlan:
    stages = [stage_memory(config, tp, pp, cp, dp, s, m, micro_batch, seq_len, param_dtype=param_dtype, zero_stage=zero_stage,
                           activation_checkpointing=checkpointing, sequence_parallel=sequence_parallel,
                           flash_attention=flash_attention, schedule=schedule, ep=ep) for s in range(pp)]
    worst = max(range(pp), key=lambda s: stages[s].total)
    p = _dtype(param_dtype).itemsize
    counts = split_layers(config.num_layers, pp)
    layers = max(counts)
    activation = micro_batch * (seq_len // cp) * config.d_model * p
    passes = 6 if checkpointing else 4
    kv_block = 2 * micro_batch * _local_kv_heads(config, tp) * (seq_len // cp) * config.dim_per_head * p
    splits = [stage_parameter_split(config, tp, n, s == 0, s == pp - 1, first_layer=sum(counts[:s]), ep=ep) for s, n in enumerate(counts)]
    dense_here, experts_here = max(splits, key=sum)
    dp_factor = 3 if zero_stage == 3 else 2  # ZeRO-3 all-gathers the parameters in forward and again in backward
    expert_dp = dp // ep
    comm = {
        "tp": passes * layers * m * collective_bytes_sent("all_reduce", activation, tp),
        "cp": 3 * (cp - 1) * kv_block * layers * m,
        "pp": (2 * m * activation / tp if pp > 1 else 0),  # Megatron's scatter/gather: each TP rank sends 1/tp
        "dp": dp_factor * ((dp - 1) / dp * dense_here + (expert_dp - 1) / expert_dp * experts_here) * p,
    }
    nested = {"tp": tp, "cp": tp * cp, "ep": tp * cp * ep, "pp": tp * cp * ep * pp, "dp": tp * cp * pp * dp}
    if config.moe is not None:
        moe_layers = max(sum(config.is_moe_layer(sum(counts[:s]) + i) for i in range(n)) for s, n in enumerate(counts))
        comm["ep"] = passes * moe_layers * m * expert_parallel_comm(micro_batch * (seq_len // cp), config.moe.top_k, config.d_model,
                                                                    ep, p, tp)
    links = {k: "NVLink" if nested[k] <= net.gpus_per_node else net.fabric for k in comm}
    seconds = {k: comm[k] / (net.intra_node if links[k] == "NVLink" else net.inter_node) for k in comm}
    dense_total, experts_total = stage_parameter_split(config, 1, config.num_layers, True, True)
    active = dense_total + (experts_total * config.moe.top_k // config.moe.num_experts if config.moe else 0)
    flops = (8 if checkpointing else 6) * active * tokens_per_step / (tp * pp * cp * dp)
    compute = flops / (gpu_flops * mfu)
    bubble = bubble_fraction(pp, m)
    notes = []
    if tp > net.gpus_per_node:
        notes.append(f"TP={tp} spans nodes: its all-reduces cross {net.fabric}")
    return LayoutPlan(tp, pp, cp, dp, m, stages[worst], worst, stages[worst].total <= gpu_memory * GB, comm, seconds, links, bubble,
                      compute, compute / (1 - bubble) + sum(seconds.values()), notes, ep)


def tp_compute_to_comm(config: ModelConfig | str, tp: int, bandwidth: float, gpu_flops: float = H100_BF16_FLOPS, mfu: float = 0.4,
                       bytes_per_element: int = 2) -> float:
    """How many times longer a GPU of a ``tp``-way tensor-parallel group spends on one dense layer's
    matmuls (forward and backward) than on its 4 ring all-reduces, at ``mfu`` of ``gpu_flops`` and
    ``bandwidth`` bytes/s per GPU and direction. The tokens cancel: per token a rank computes
    ``6·P/tp`` FLOPs (``P``: the layer's parameters) and sends ``4 · 2(tp-1)/tp · d_model`` elements,
    so the ratio is ``6·P·bandwidth / (8·(tp-1)·d_model·bytes·mfu·gpu_flops)``. Below 1 the
    all-reduces (not overlapped) cost more than the work they split: TP no longer pays."""
    config = config_from(config, PLAN_PRESETS)
    if config.moe is not None:
        raise ValueError("config: expected a dense model (a MoE layer's expert matmuls depend on the routing)")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 2:
        raise ValueError(f"tp={tp!r}: expected an integer >= 2 (one rank sends nothing)")
    if not bandwidth > 0 or not gpu_flops > 0 or not 0 < mfu <= 1:
        raise ValueError(f"bandwidth={bandwidth!r}, gpu_flops={gpu_flops!r}, mfu={mfu!r}: expected positive numbers, mfu at most 1")
    layer = stage_parameter_split(config, 1, 1, False, False)[0]
    compute = 6 * layer / tp / (mfu * gpu_flops)
    comm = 4 * collective_bytes_sent("all_reduce", config.d_model * bytes_per_element, tp) / bandwidth
    return compute / comm


def expert_parallel_comm(tokens: int, top_k: int, d_model: int, ep: int, bytes_per_element: int, tp: int = 1) -> float:
    """Bytes one GPU sends in one all-to-all of a MoE layer (dispatch or combine) when its
    ``tokens`` each go to ``top_k`` experts spread evenly over ``ep`` ranks: of its ``tokens · k``
    routed rows of ``d_model`` elements, the ``(ep - 1)/ep`` that live elsewhere; with TP each
    rank of a TP group dispatches ``1/tp`` of the tokens."""
    _check_positive_ints(tokens=tokens, top_k=top_k, d_model=d_model, ep=ep, bytes_per_element=bytes_per_element, tp=tp)
    return collective_bytes_sent("all_to_all", tokens * top_k * d_model * bytes_per_element / tp, ep)



def published_layout_plan(layout: dict, gpu_memory: float = 80, **assumptions) -> LayoutPlan:
    """The :class:`LayoutPlan` of one of :data:`PUBLISHED_LAYOUTS` (its model, GPU count,
    TP/PP/CP, sequence length and tokens per step), under ``assumptions`` (keywords of
    :func:`parallel_plan`)."""
    plans = parallel_plan(layout["model"], layout["gpus"], gpu_memory, seq_len=layout["seq_len"],
                          tokens_per_step=layout["tokens_per_step"], tp=[layout["tp"]], pp=[layout["pp"]], cp=(layout["cp"],),
                          ep=[layout.get("ep", 1)], interconnect=layout["interconnect"], **assumptions)
    if len(plans) != 1 or plans[0].dp != layout["dp"]:
        raise ValueError(f"layout: {layout} is not a whole-numbered layout of its GPUs")
    return plans[0]


def strategy_memory(config: ModelConfig | str, gpus: int, seq_len: int = 4096, micro_batch: int = 1, **assumptions) -> dict[str, MemoryBreakdown]:
    """Memory per GPU of one model on ``gpus`` GPUs split each way on its own: pure data
    parallelism (DDP, ZeRO-1, ZeRO-3) and the largest TP, PP and TP × PP that the model allows.
    ``{label: MemoryBreakdown}`` (worst stage); each label names everything its layout includes:
    the plain TP with DDP over the rest, then with ZeRO-1 over the data-parallel ranks, then with
    sequence parallelism (SP) too, as the combined layouts use them."""
    config = PLAN_PRESETS[config] if isinstance(config, str) else config
    tp = max(t for t in (1, 2, 4, 8) if _valid_tp(config, t) and gpus % t == 0)
    pp = max(p for p in (1, 2, 4, 8, 16) if p <= config.num_layers and gpus % p == 0)
    both = max(p for p in (1, 2, 4, 8, 16) if p <= config.num_layers and gpus % (tp * p) == 0)
    # label -> (tp, pp, ZeRO stage over the data-parallel ranks, sequence parallelism)
    choices = {"DDP": (1, 1, 0, False), "ZeRO-1": (1, 1, 1, False), "ZeRO-3": (1, 1, 3, False),
               f"TP{tp} + DDP": (tp, 1, 0, False), f"TP{tp} + ZeRO-1": (tp, 1, 1, False),
               f"TP{tp} + SP + ZeRO-1": (tp, 1, 1, True),
               f"PP{pp} + ZeRO-1": (1, pp, 1, False), f"TP{tp} x PP{both} + SP + ZeRO-1": (tp, both, 1, True)}
    out = {}
    for label, (t, p, zero, sp) in choices.items():
        dp = gpus // (t * p)
        out[label] = max((stage_memory(config, t, p, 1, dp, s, p, micro_batch, seq_len, zero_stage=zero, sequence_parallel=sp,
                                       **assumptions) for s in range(p)), key=lambda b: b.total)
    return out


def mesh_groups(sizes: dict[str, int]) -> dict[str, list[list[int]]]:
    """The rank groups of a device mesh of ``sizes`` (``{name: size}``, outermost first, as
    ``init_device_mesh(..., mesh_shape, mesh_dim_names)`` takes them): the ranks are laid out row
    by row, so the last dimension varies fastest. ``{name: [group, ...]}``, each group the ranks
    that differ only along ``name`` (they run that dimension's collectives together). Put TP last
    and its groups are consecutive ranks, the GPUs of one node."""
    if not sizes or not all(isinstance(n, str) for n in sizes):
        raise ValueError(f"sizes={sizes!r}: expected {{dimension name: size}}, outermost first")
    _check_positive_ints(**sizes)
    names, shape = list(sizes), list(sizes.values())
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    groups = {}
    for axis, name in enumerate(names):
        others = [range(n) if i != axis else range(1) for i, n in enumerate(shape)]
        groups[name] = [[sum(c * s for c, s in zip(coords, strides)) + k * strides[axis] for k in range(shape[axis])]
                        for coords in itertools.product(*others)]
    return groups
