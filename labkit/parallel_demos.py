"""Per-rank functions that chapter 08 hands to :func:`labkit.dist.launch` (or runs under
torchrun through :mod:`labkit.distrun`).

Each runs inside one rank (the process group is already set up), builds the same small model on
every rank from one seed, runs the parallel version next to the single-process one, and returns
plain values: largest differences, what the :class:`~labkit.parallel.CommMeter` counted, what the
formulas predict, measured events and activation bytes.
"""
from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
from torch import nn

from labkit.dist import collective_bytes_sent, rank_device
from labkit.memory import SavedTensorMeter
from labkit.model import TransformerBlock, TransformerLM, tiny_config
from labkit.parallel import (
    ColumnParallelLinear,
    CommMeter,
    PipelineStage,
    RowParallelLinear,
    TensorParallelAttention,
    TensorParallelBlock,
    TensorParallelSwiGLU,
    allgather_context_attention,
    context_parallel_positions,
    finish_gradient_synchronization,
    pipeline_comm,
    ring_attention,
    ring_attention_comm,
    run_pipeline,
    sequence_shard,
    tensor_parallel_comm,
    tensor_parallel_model,
    vocab_parallel_cross_entropy,
)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def _reference_slice(tp_module: nn.Module, name: str, reference: nn.Module) -> dict[str, torch.Tensor]:
    """``{parameter name: the reference's gradient of what this rank holds}``: a row slice for a
    column-parallel layer, a column slice for a row-parallel one, the whole gradient otherwise."""
    out = {}
    for module_name, module in tp_module.named_modules():
        full = reference.get_submodule(module_name) if module_name else reference
        for pname, param in module.named_parameters(recurse=False):
            grad = getattr(full, pname).grad
            if isinstance(module, ColumnParallelLinear):
                grad = grad[module.rank * module.d_out_local:(module.rank + 1) * module.d_out_local]
            elif isinstance(module, RowParallelLinear):
                grad = grad[:, module.rank * module.d_in_local:(module.rank + 1) * module.d_in_local]
            out[f"{module_name}.{pname}".lstrip(".")] = grad
    return out


def _sgd(module: nn.Module, lr: float) -> None:
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p -= lr * p.grad


def _compare_tp(kind: str, reference: nn.Module, parallel: nn.Module, x: torch.Tensor, grad_out: torch.Tensor, rank: int,
                world: int, sequence_parallel: bool, lr: float) -> dict:
    """Forward, backward and one SGD step of ``reference`` (on the whole input) and ``parallel``
    (on this rank's input: the whole one, or its sequence shard); returns the largest
    differences (after the step: relative to the largest output), the meter's counts per pass
    and this rank's saved activation bytes."""
    shard = (lambda t: sequence_shard(t, rank, world)) if sequence_parallel else (lambda t: t)
    x_ref = x.clone().requires_grad_()
    y_ref = reference(x_ref)
    (y_ref * grad_out).sum().backward()
    x_tp = shard(x).clone().requires_grad_()
    with CommMeter() as forward_meter, SavedTensorMeter(parallel) as saved:
        y_tp = parallel(x_tp)
    with CommMeter() as backward_meter:
        (y_tp * shard(grad_out)).sum().backward()
    with CommMeter() as sync_meter:
        parallel.finish_gradient_synchronization() if hasattr(parallel, "finish_gradient_synchronization") else None
    expected = _reference_slice(parallel, "", reference)
    grads = {name: _max_diff(p.grad, expected[name]) for name, p in parallel.named_parameters()}
    _sgd(reference, lr)
    _sgd(parallel, lr)
    with torch.no_grad():  # relative: the step changes the weights by a lot, and the outputs with them
        expected_after = shard(reference(x))
        after = _max_diff(parallel(shard(x)), expected_after) / expected_after.abs().max().item()
    return {"kind": kind, "output": _max_diff(y_tp, shard(y_ref)), "input_grad": _max_diff(x_tp.grad, shard(x_ref.grad)),
            "weight_grad": max(grads.values()), "after_step": after,
            "forward": forward_meter.summary(), "backward": backward_meter.summary(), "gradient_sync": sync_meter.summary(),
            "saved_bytes": saved.peak_bytes,
            "local_params": sum(p.numel() for p in parallel.parameters()),
            "full_params": sum(p.numel() for p in reference.parameters())}


def tensor_parallel_layers(rank: int, world_size: int, batch: int = 2, seq: int = 8, d_model: int = 32, num_heads: int = 8,
                           num_kv_heads: int = 4, d_ff: int = 64, lr: float = 0.1, seed: int = 0) -> dict:
    """The tensor-parallel SwiGLU, attention (with QK-norm and GQA) and whole block, and the
    block with sequence parallelism, each against the single-process module: forward,
    backward and after an SGD step (see :func:`_compare_tp`), plus the predicted
    communication (:func:`labkit.parallel.tensor_parallel_comm`) next to the measured."""
    device = rank_device()
    torch.manual_seed(seed)
    config = tiny_config(vocab_size=16, context_length=seq, d_model=d_model, num_layers=1, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, d_ff=d_ff, qk_norm=True)
    from labkit.nn import RoPE

    rope = RoPE(config.rope_theta, config.dim_per_head, seq, device=device)
    block = TransformerBlock(config, rope).to(device)
    with torch.no_grad():  # norms with weights other than 1, so that wrong norm gradients would show
        for p in block.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, seq, d_model, generator=gen).to(device)
    grad_out = torch.randn(batch, seq, d_model, generator=gen).to(device)
    cases = {
        "mlp": (block.ffn, lambda m: TensorParallelSwiGLU(m), False),
        "attention": (block.attn, lambda m: TensorParallelAttention(m), False),
        "block": (block, lambda m: TensorParallelBlock(m), False),
        "block_sp": (block, lambda m: TensorParallelBlock(m, sequence_parallel=True), True),
    }
    out = {}
    for kind, (module, make, sp) in cases.items():
        reference = copy.deepcopy(module)
        out[kind] = _compare_tp(kind, reference, make(copy.deepcopy(module)), x, grad_out, rank, world_size, sp, lr)
    element = x.element_size()
    out["predicted"] = {"sublayer": tensor_parallel_comm(batch, seq, d_model, world_size, element, sublayers=1),
                        "block": tensor_parallel_comm(batch, seq, d_model, world_size, element),
                        "block_sp": tensor_parallel_comm(batch, seq, d_model, world_size, element, sequence_parallel=True)}
    with SavedTensorMeter(block) as single:
        block(x.clone().requires_grad_())
    out["single_process_saved_bytes"] = single.peak_bytes
    return out


def _toy_batch(seed: int, batch: int, seq: int, vocab: int, device):
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def tensor_parallel_training(rank: int, world_size: int, steps: int = 3, batch: int = 4, seq: int = 16, seed: int = 0) -> dict:
    """A tiny ``TransformerLM`` trained ``steps`` AdamW steps with every block tensor-parallel
    (:func:`labkit.parallel.tensor_parallel_model`) and in one process: the losses per step."""
    from labkit.train import AdamW, cross_entropy

    device = rank_device()
    torch.manual_seed(seed)
    config = tiny_config(vocab_size=16, context_length=seq, d_model=32, num_layers=2, num_heads=4, d_ff=64)
    model = TransformerLM(config).to(device)
    x, y = _toy_batch(seed, batch, seq, 16, device)
    runs = {}
    for name, m in (("single", model), ("tensor_parallel", tensor_parallel_model(model))):
        m = copy.deepcopy(m) if name == "single" else m
        optimizer = AdamW(m.parameters(), lr=1e-2)
        losses = []
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = cross_entropy(m(x), y)
            loss.backward()
            finish_gradient_synchronization(m)
            optimizer.step()
            losses.append(loss.item())
        runs[name] = losses
    return {"losses": runs["tensor_parallel"], "reference_losses": runs["single"],
            "local_param_elements": sum(p.numel() for p in tensor_parallel_model(model).parameters()),
            "full_param_elements": model.num_params()}


def torch_tensor_parallel(rank: int, world_size: int, batch: int = 4, d_model: int = 16, d_ff: int = 32, seed: int = 0) -> dict:
    """labkit's :class:`~labkit.parallel.TensorParallelSwiGLU` vs PyTorch's own tensor
    parallelism (``parallelize_module`` with ``ColwiseParallel`` on ``w1``/``w3`` and
    ``RowwiseParallel`` on ``w2``, over a 1-D device mesh) on the same weights and input: the
    outputs, input gradients and this rank's weight gradients, and the collectives each ran
    (ours by :class:`CommMeter`, torch's by ``CommDebugMode``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from labkit.nn import GLU

    device = rank_device()
    torch.manual_seed(seed)
    glu = GLU(d_model, d_ff).to(device)

    class TorchSwiGLU(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2, self.w3 = (nn.Linear(i, o, bias=False, device=device) for i, o in
                                         ((d_model, d_ff), (d_ff, d_model), (d_model, d_ff)))

        def forward(self, x):
            return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))

    theirs = TorchSwiGLU()
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(theirs, name).weight.copy_(getattr(glu, name).weight)
    mesh = init_device_mesh(device.type, (world_size,))
    parallelize_module(theirs, mesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()})
    ours = TensorParallelSwiGLU(glu)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, d_model, generator=gen).to(device)
    grad_out = torch.randn(batch, d_model, generator=gen).to(device)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    with CommMeter() as meter_fwd:
        y_ours = ours(x_ours)
    with CommMeter() as meter_bwd:
        (y_ours * grad_out).sum().backward()
    with CommDebugMode() as debug_fwd:
        y_theirs = theirs(x_theirs)
    with CommDebugMode() as debug_bwd:
        (y_theirs * grad_out).sum().backward()

    def counts(mode):
        return {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}

    grad_diff = max(_max_diff(getattr(ours, n).weight.grad, getattr(theirs, n).weight.grad.to_local()) for n in ("w1", "w2", "w3"))
    return {"output": _max_diff(y_ours, y_theirs), "input_grad": _max_diff(x_ours.grad, x_theirs.grad), "weight_grad": grad_diff,
            "ours_forward": dict(meter_fwd.calls), "ours_backward": dict(meter_bwd.calls),
            "torch_forward": counts(debug_fwd), "torch_backward": counts(debug_bwd)}


def _pipeline_model(seed: int, config_overrides: dict, device):
    torch.manual_seed(seed)
    config = tiny_config(**{"vocab_size": 16, "context_length": 16, "d_model": 32, "num_layers": 4, "num_heads": 4, "d_ff": 64,
                            **config_overrides})
    return TransformerLM(config).to(device), config


def _micro_batches(batch: torch.Tensor, m: int) -> list[torch.Tensor]:
    """``m`` micro-batches, each in its own storage (as a data loader would hand them over): views
    of one batch would share a storage, which the activation meter then counts only once."""
    return [chunk.clone() for chunk in batch.chunk(m)]


def _shared_clock() -> float:
    """A ``time.perf_counter()`` value every rank agrees on (rank 0's, after a barrier); ranks on
    one machine share the clock (on Linux, CLOCK_MONOTONIC)."""
    dist.barrier()
    now = torch.tensor([time.perf_counter()], dtype=torch.float64)
    dist.broadcast(now, 0)
    return now.item()


def pipeline_training(rank: int, world_size: int, schedules=("gpipe", "1f1b"), micro_batches: int = 4, micro_batch: int = 2,
                      steps: int = 2, lr: float = 0.1, seed: int = 0, config_overrides: dict | None = None) -> dict:
    """Train a tiny ``TransformerLM`` cut into ``world_size`` stages (this rank: stage ``rank``)
    for ``steps`` SGD steps under each schedule, and the whole model in one process on the same
    batch (``micro_batches × micro_batch`` sequences). Per schedule: the losses (last stage), the
    largest difference of this stage's parameters from the reference's after training, the peak
    activation bytes and those of one micro-batch, the point-to-point traffic the meter counted
    and the prediction."""
    from labkit.train import cross_entropy

    device = rank_device()
    model, config = _pipeline_model(seed, config_overrides or {}, device)
    x, y = _toy_batch(seed, micro_batches * micro_batch, config.context_length, config.vocab_size, device)
    reference = copy.deepcopy(model)
    reference_losses = []
    for _ in range(steps):
        reference.zero_grad(set_to_none=True)
        loss = cross_entropy(reference(x), y)
        loss.backward()
        _sgd(reference, lr)
        reference_losses.append(loss.item())
    shape = (micro_batch, config.context_length, config.d_model)
    out = {"reference_losses": reference_losses}
    for schedule in schedules:
        stage = PipelineStage(model, rank, world_size)
        expected = PipelineStage(reference, rank, world_size)
        losses, runs = [], []
        with CommMeter() as meter:
            for _ in range(steps):
                stage.zero_grad(set_to_none=True)
                run = run_pipeline(stage, schedule, _micro_batches(x, micro_batches) if stage.is_first else None,
                                   _micro_batches(y, micro_batches) if stage.is_last else None, micro_batches, shape)
                _sgd(stage, lr)
                losses.append(run["loss"])
                runs.append(run)
        out[schedule] = {
            "losses": losses, "param_diff": max(_max_diff(p, q) for p, q in zip(stage.parameters(), expected.parameters())),
            "peak_activation_bytes": runs[-1]["peak_activation_bytes"],
            "activation_bytes_per_micro_batch": runs[-1]["activation_bytes_per_micro_batch"],
            "comm": meter.summary(), "events": runs[-1]["events"],
            "predicted": pipeline_comm(micro_batches, micro_batch, config.context_length, config.d_model,
                                       next(stage.parameters()).element_size()),
        }
    return out


def pipeline_timing(rank: int, world_size: int, micro_batch_counts=(1, 2, 4, 8), schedules=("gpipe", "1f1b"),
                    micro_batch: int = 8, seq: int = 32, d_model: int = 128, layers_per_stage: int = 2, seed: int = 0) -> dict:
    """Measured per-rank events of one training step under each schedule and micro-batch count,
    on a model whose blocks dominate the work (small vocabulary), so that the stages take about
    the same time. ``{(schedule, m): events}``; a warm-up step first (allocations, first calls)."""
    device = rank_device()
    model, config = _pipeline_model(seed, {"context_length": seq, "d_model": d_model, "num_heads": 4, "d_ff": 4 * d_model,
                                           "num_layers": layers_per_stage * world_size}, device)
    stage = PipelineStage(model, rank, world_size)
    shape = (micro_batch, seq, d_model)
    out = {}
    for schedule in schedules:
        for m in (micro_batch_counts[0],) + tuple(micro_batch_counts):  # the first run warms up
            x, y = _toy_batch(seed + m, m * micro_batch, seq, config.vocab_size, device)
            clock = _shared_clock()
            run = run_pipeline(stage, schedule, _micro_batches(x, m) if stage.is_first else None,
                               _micro_batches(y, m) if stage.is_last else None, m, shape, clock_start=clock)
            stage.zero_grad(set_to_none=True)
            out[(schedule, m)] = run["events"]
    return out


def torch_pipelining(rank: int, world_size: int, micro_batches: int = 4, micro_batch: int = 2, seed: int = 0) -> dict:
    """labkit's :func:`~labkit.parallel.run_pipeline` next to torch's own pipeline engine
    (``torch.distributed.pipelining``: ``PipelineStage`` with ``ScheduleGPipe`` and
    ``Schedule1F1B``) on copies of the same stage and batch: per schedule, the largest difference of
    the last stage's loss and of this stage's gradients, and the norm of labkit's gradients. torch scales the gradients by 1/m
    (``scale_grads``), as labkit divides each micro-batch's loss by m."""
    from torch.distributed.pipelining import PipelineStage as TorchPipelineStage
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from labkit.train import cross_entropy

    device = rank_device()
    model, config = _pipeline_model(seed, {}, device)
    x, y = _toy_batch(seed, micro_batches * micro_batch, config.context_length, config.vocab_size, device)
    shape = (micro_batch, config.context_length, config.d_model)
    out = {}
    for schedule, torch_schedule in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        ours = PipelineStage(model, rank, world_size)
        theirs = copy.deepcopy(ours)
        run = run_pipeline(ours, schedule, _micro_batches(x, micro_batches) if ours.is_first else None,
                           _micro_batches(y, micro_batches) if ours.is_last else None, micro_batches, shape)
        engine = torch_schedule(TorchPipelineStage(theirs, rank, world_size, device), n_microbatches=micro_batches,
                                loss_fn=cross_entropy)
        losses = []
        if rank == 0:
            engine.step(x)
        elif rank == world_size - 1:
            engine.step(target=y, losses=losses)
        else:
            engine.step()
        result = {"grad_diff": max(_max_diff(p.grad, q.grad) for p, q in zip(ours.parameters(), theirs.parameters())),
                  "grad_norm": torch.stack([p.grad.norm() for p in ours.parameters()]).norm().item()}
        if ours.is_last:
            result["loss_diff"] = abs(run["loss"] - torch.stack(losses).mean().item())
        out[schedule] = result
    return out


def _attention_inputs(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, seed: int):
    """The whole sequence's q, k, v (leaves that want gradients) and an output gradient, the same on every rank."""
    device = rank_device()
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, head_dim, generator=gen).to(device).requires_grad_()
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=gen).to(device).requires_grad_()
    v = torch.randn(batch, kv_heads, seq, head_dim, generator=gen).to(device).requires_grad_()
    grad_out = torch.randn(batch, heads, seq, head_dim, generator=gen).to(device)
    return q, k, v, grad_out


def ring_attention_check(rank: int, world_size: int, batch: int = 2, heads: int = 4, kv_heads: int = 2, seq: int = 16,
                         head_dim: int = 8, causal: bool = True, seed: int = 0) -> dict:
    """:func:`labkit.parallel.ring_attention` on this rank's sequence shard vs full attention
    (:func:`labkit.attention.plain_attention`) on the whole sequence: output and q/k/v
    gradients of the shard, and the bytes sent (measured and predicted)."""
    from labkit.attention import plain_attention

    q, k, v, grad_out = _attention_inputs(batch, heads, kv_heads, seq, head_dim, seed)
    full = plain_attention(q, k, v, causal=causal)
    (full * grad_out).sum().backward()
    local = [sequence_shard(t.detach(), rank, world_size).clone().requires_grad_() for t in (q, k, v)]
    with CommMeter() as forward_meter:
        out = ring_attention(*local, causal=causal)
    with CommMeter() as backward_meter:
        (out * sequence_shard(grad_out, rank, world_size)).sum().backward()
    grads = [_max_diff(mine.grad, sequence_shard(t.grad, rank, world_size)) for mine, t in zip(local, (q, k, v))]
    return {"output": _max_diff(out, sequence_shard(full, rank, world_size)), "q_grad": grads[0], "k_grad": grads[1],
            "v_grad": grads[2], "forward": forward_meter.summary(), "backward": backward_meter.summary(),
            "predicted": ring_attention_comm(batch, seq, kv_heads, head_dim, world_size, q.element_size())}


def context_parallel_check(rank: int, world_size: int, batch: int = 2, heads: int = 4, kv_heads: int = 2, seq: int = 32,
                           head_dim: int = 8, seed: int = 0) -> dict:
    """:func:`labkit.parallel.allgather_context_attention` under both layouts vs full causal
    attention on the whole sequence: for each layout, the largest differences of this rank's
    output and q/k/v gradients, the score blocks this rank computed, and the all-gather's calls
    and bytes (forward) as the meter counted them."""
    from labkit.attention import plain_attention

    q, k, v, grad_out = _attention_inputs(batch, heads, kv_heads, seq, head_dim, seed)
    full = plain_attention(q, k, v, causal=True)
    (full * grad_out).sum().backward()
    results = {}
    for layout in ("contiguous", "zigzag"):
        positions = torch.tensor(context_parallel_positions(seq, world_size, layout)[rank], device=q.device)
        local = [t.detach().index_select(-2, positions).clone().requires_grad_() for t in (q, k, v)]
        with CommMeter() as forward_meter:
            out, blocks = allgather_context_attention(*local, layout=layout)
        (out * grad_out.index_select(-2, positions)).sum().backward()
        grads = [_max_diff(mine.grad, t.grad.index_select(-2, positions)) for mine, t in zip(local, (q, k, v))]
        results[layout] = {"output": _max_diff(out, full.index_select(-2, positions)), "q_grad": grads[0], "k_grad": grads[1],
                           "v_grad": grads[2], "blocks": blocks, "forward": forward_meter.summary(),
                           "kv_bytes_per_rank": 2 * k.element_size() * batch * kv_heads * (seq // world_size) * head_dim}
    return results


def expert_parallel_traffic(rank: int, world_size: int, tokens_per_rank: int = 48, d_model: int = 32, d_ff: int = 48,
                            num_experts: int = 4, top_k: int = 2, seed: int = 0) -> dict:
    """Chapter 04's :class:`~labkit.moe.ExpertParallelMoE` forward under the meter: its three
    all-to-alls (counts, dispatch, combine), and the bytes the layer computed from its splits."""
    from labkit.experts import MoELayer
    from labkit.moe import ExpertParallelMoE

    device = rank_device()
    torch.manual_seed(seed)
    layer = ExpertParallelMoE(MoELayer(d_model, d_ff, num_experts, top_k).to(device))
    x = torch.randn(tokens_per_rank, d_model, generator=torch.Generator().manual_seed(seed + 1 + rank)).to(device)
    with CommMeter() as meter:
        layer(x)
    return {"meter": meter.summary(), "exchange": layer.last_exchange}


def vocab_parallel_loss(rank: int, world_size: int, tokens: int = 24, d_model: int = 16, vocab: int = 64, seed: int = 0) -> dict:
    """An LM head split along the vocabulary (:class:`~labkit.parallel.ColumnParallelLinear`) and
    :func:`~labkit.parallel.vocab_parallel_cross_entropy` against ``torch.nn.functional.cross_entropy``
    on the whole head: the largest differences of the per-token losses, the hidden states' gradient
    and this rank's slice of the head's weight gradient, what the meter counted, and the bytes an
    all-gather of the logits would have handed over instead."""
    device = rank_device()
    torch.manual_seed(seed)
    head = nn.Linear(d_model, vocab, bias=False).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(tokens, d_model, generator=gen).to(device)
    targets = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    ours_hidden, torch_hidden = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    ours = ColumnParallelLinear.from_linear(head, sync_input=True)
    reference = copy.deepcopy(head)
    with CommMeter() as forward_meter:
        losses = vocab_parallel_cross_entropy(ours(ours_hidden), targets)
    with CommMeter() as backward_meter:
        losses.mean().backward()
    expected = nn.functional.cross_entropy(reference(torch_hidden), targets, reduction="none")
    expected.mean().backward()
    rows = slice(rank * ours.d_out_local, (rank + 1) * ours.d_out_local)
    logits_bytes = tokens * vocab * 4
    return {"loss": _max_diff(losses, expected), "hidden_grad": _max_diff(ours_hidden.grad, torch_hidden.grad),
            "weight_grad": _max_diff(ours.weight.grad, reference.weight.grad[rows]), "mean_loss": losses.mean().item(),
            "forward": forward_meter.summary(), "backward": backward_meter.summary(),
            "gather_logits_bytes": {"bytes": logits_bytes // world_size,
                                    "sent": collective_bytes_sent("all_gather", logits_bytes // world_size, world_size)},
            "tokens": tokens, "vocab": vocab}


def several(rank: int, world_size: int, demos: dict[str, dict]) -> dict:
    """Run several functions of this module in one launch (process start-up costs seconds):
    ``demos`` maps a function name to its keyword arguments; returns ``{name: result}`` and
    ``"seconds"``: ``{name: seconds it took on this rank}``."""
    unknown = [name for name in demos if name not in _DEMOS]
    if unknown:
        raise ValueError(f"demos: unknown {unknown}; expected names from {sorted(_DEMOS)}")
    results, seconds = {}, {}
    for name, kwargs in demos.items():
        start = time.perf_counter()
        results[name] = _DEMOS[name](rank, world_size, **kwargs)
        seconds[name] = time.perf_counter() - start
    return {**results, "seconds": seconds}


_DEMOS = {f.__name__: f for f in (tensor_parallel_layers, tensor_parallel_training, torch_tensor_parallel, pipeline_training,
                                  pipeline_timing, torch_pipelining, ring_attention_check, context_parallel_check, expert_parallel_traffic,
                                  vocab_parallel_loss)}
