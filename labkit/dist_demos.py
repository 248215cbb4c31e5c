"""Per-rank functions that chapter 07 hands to :func:`labkit.dist.launch`.

Each runs inside one rank (the process group is already set up) and returns plain values
(tensors, numbers) that ``launch`` collects from every rank.
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist

from labkit.dist import (CommMeter, DDPBucketed, DDPIndividual, ShardedOptimizer, ShardedOptimizerBroadcast, rank_device,
                         ring_all_reduce)
from labkit.memory import optimizer_state_bytes


def _rank_values(rank: int, numel: int, device) -> torch.Tensor:
    """Easy-to-follow numbers: rank r holds 10*(r+1) + [0, 1, 2, ...]."""
    return (10.0 * (rank + 1) + torch.arange(numel, dtype=torch.float32)).to(device)


def collectives(rank: int, world_size: int, numel: int = 4) -> dict[str, tuple]:
    """Run each collective once and return ``{name: (before, after)}`` as this rank saw it.

    ``broadcast``/``reduce`` use rank 0 as root; ``all_gather`` returns the gathered list
    stacked; ``reduce_scatter`` starts from ``world_size`` chunks per rank (stacked)."""
    device = rank_device()
    out = {}
    t = _rank_values(rank, numel, device)
    before = t.clone()
    dist.broadcast(t, src=0)
    out["broadcast"] = (before, t)

    t = _rank_values(rank, numel, device)
    before = t.clone()
    dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)  # only the root's result is defined
    out["reduce"] = (before, t if rank == 0 else None)

    t = _rank_values(rank, numel, device)
    before = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    out["all_reduce"] = (before, t)

    t = _rank_values(rank, numel, device)
    gathered = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(gathered, t)
    out["all_gather"] = (t, torch.stack(gathered))

    chunks = [_rank_values(rank, numel, device) + 100 * c for c in range(world_size)]
    result = torch.empty_like(chunks[0])
    dist.reduce_scatter(result, chunks, op=dist.ReduceOp.SUM)
    out["reduce_scatter"] = (torch.stack(chunks), result)
    return out


def ring_vs_all_reduce(rank: int, world_size: int, numel: int = 1000) -> dict:
    """Our ring all-reduce and ``dist.all_reduce`` on the same random tensor (seeded per rank)."""
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(numel, generator=gen).to(rank_device())
    ours, theirs = ring_all_reduce(x.clone()), x.clone()
    dist.all_reduce(theirs)
    return {"ring": ours, "all_reduce": theirs, "max_abs_diff": (ours - theirs).abs().max().item()}


def _toy_setup(seed: int, global_batch: int, seq_len: int, num_layers: int = 2):
    """A tiny TransformerLM and a fixed global batch, identical on every rank."""
    from labkit.model import TransformerLM, tiny_config

    torch.manual_seed(seed)
    config = tiny_config(vocab_size=16, context_length=seq_len, d_model=32, num_layers=num_layers, num_heads=4, d_ff=64)
    model = TransformerLM(config).to(rank_device())
    tokens = torch.randint(0, 16, (global_batch, seq_len + 1)).to(rank_device())
    return model, tokens[:, :-1], tokens[:, 1:]


def _local_slice(rank: int, world_size: int, global_batch: int) -> slice:
    """This rank's rows of the global batch. Equal slices only: the mean of the ranks' mean losses is
    then the mean over the whole batch, so the averaged gradient is the full batch's."""
    if global_batch % world_size:
        raise ValueError(f"global_batch={global_batch}: must split evenly over world_size={world_size} ranks")
    return slice(rank * global_batch // world_size, (rank + 1) * global_batch // world_size)


def _train(model, wrapper, optimizer, x, y, steps: int) -> list[float]:
    from labkit.train import cross_entropy

    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = cross_entropy(wrapper(x), y)
        loss.backward()
        if hasattr(wrapper, "finish_gradient_synchronization"):
            wrapper.finish_gradient_synchronization()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _reference(base, x, y, steps: int, optimizer_cls, **opt_kwargs):
    """Single-process training on the full batch, ``steps`` steps, computed on rank 0 only (every
    rank would compute the same) and broadcast: the trained model, the per-step losses and the
    bytes of the optimizer's state."""
    reference = copy.deepcopy(base)
    summary = torch.zeros(steps + 1, dtype=torch.float64, device=rank_device())  # losses, then state bytes
    if dist.get_rank() == 0:
        optimizer = optimizer_cls(reference.parameters(), **opt_kwargs)
        losses = _train(reference, reference, optimizer, x, y, steps)
        summary = torch.tensor([*losses, optimizer_state_bytes(optimizer)], dtype=torch.float64, device=rank_device())
    for tensor in [*reference.parameters(), summary]:
        dist.broadcast(tensor.data, src=0)
    return reference, summary[:-1].tolist(), int(summary[-1])


def _max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


class _SummingDDP(DDPIndividual):
    """The classic DDP bug, for contrast: all-reduce the gradients but forget to divide by the
    number of ranks, so every step uses ``world_size`` times the mean gradient."""

    def finish_gradient_synchronization(self) -> None:
        super().finish_gradient_synchronization()
        for p in self._unique_params():
            if p.grad is not None:
                p.grad.mul_(self.world_size)


def data_parallel(rank: int, world_size: int, steps: int = 3, global_batch: int = 8, seq_len: int = 16, bucket_size_mb: float = 0.01,
                  lr: float = 0.5, seed: int = 0) -> dict:
    """Train the same tiny model for ``steps`` plain-SGD steps several ways and compare parameters
    with single-process training on the full batch (the reference, computed on rank 0 and broadcast): our
    :class:`DDPIndividual` and :class:`DDPBucketed`, ``torch.nn.parallel.DistributedDataParallel``
    (each rank on its ``1/world_size`` slice of the batch) and, as a control, a DDP that sums the
    gradients instead of averaging them. SGD, because its step is proportional to the gradient:
    Adam(W) divides the gradient by its own running scale, so a summing DDP would match too.
    Returns the max parameter difference to the reference for each, and how many buckets the
    bucketed version used, and what this rank sent per step with each of labkit's DDPs (counted by
    :class:`labkit.dist.CommMeter`: torch's DDP calls its collectives from C++, unseen)."""

    base, x, y = _toy_setup(seed, global_batch, seq_len)
    local = _local_slice(rank, world_size, global_batch)
    reference, _, _ = _reference(base, x, y, steps, torch.optim.SGD, lr=lr)
    out = {"params": sum(p.numel() for p in base.parameters()), "sent_per_step": {}, "calls_per_step": {}}
    for name, wrap in [("DDPIndividual", DDPIndividual), ("DDPBucketed", lambda m: DDPBucketed(m, bucket_size_mb)),
                       ("torch DDP", torch.nn.parallel.DistributedDataParallel), ("summing DDP (a bug)", _SummingDDP)]:
        model = copy.deepcopy(base)
        wrapper = wrap(model)
        with CommMeter() as meter:
            _train(model, wrapper, torch.optim.SGD(model.parameters(), lr=lr), x[local], y[local], steps)
        out[name] = _max_param_diff(model, reference)
        if name in ("DDPIndividual", "DDPBucketed"):
            out["sent_per_step"][name] = {op: sent / steps for op, sent in meter.sent.items()}
            out["calls_per_step"][name] = {op: calls / steps for op, calls in meter.calls.items()}
        if name == "DDPBucketed":
            out["buckets"] = len(wrapper.buckets)
    return out


def gradient_accumulation(rank: int, world_size: int, micro_batches: int = 4, global_batch: int = 16, seq_len: int = 16,
                          bucket_size_mb: float = 0.01, seed: int = 0) -> dict:
    """One training step's gradient from ``micro_batches`` micro-batches per rank, with :class:`DDPBucketed`
    all-reducing after every micro-batch or only after the last one (inside ``no_sync`` before it), and with
    PyTorch's DDP and its ``no_sync``; each against the full batch's mean gradient on one process. Returns the
    largest gradient difference of each way and what this rank sent with labkit's (``CommMeter``)."""
    from labkit.train import cross_entropy

    base, x, y = _toy_setup(seed, global_batch, seq_len)
    local = _local_slice(rank, world_size, global_batch)
    micro_x, micro_y = x[local].chunk(micro_batches), y[local].chunk(micro_batches)
    if len({len(m) for m in micro_x}) != 1 or len(micro_x) != micro_batches:
        raise ValueError(f"micro_batches={micro_batches}: must split each rank's {len(x[local])} rows evenly")
    reference = copy.deepcopy(base)
    cross_entropy(reference(x), y).backward()
    out = {"micro_batches": micro_batches, "grad_bytes": sum(p.numel() * p.element_size() for p in base.parameters())}
    for name in ("all-reduce every micro-batch", "no_sync until the last", "torch DDP no_sync"):
        model = copy.deepcopy(base)
        ddp = torch.nn.parallel.DistributedDataParallel(model) if name.startswith("torch") else DDPBucketed(model, bucket_size_mb)
        with CommMeter() as meter:
            for k, (xm, ym) in enumerate(zip(micro_x, micro_y)):
                last = k == micro_batches - 1
                with ddp.no_sync() if name != "all-reduce every micro-batch" and not last else contextlib.nullcontext():
                    (cross_entropy(ddp(xm), ym) / micro_batches).backward()  # the mean over this rank's rows
                if hasattr(ddp, "finish_gradient_synchronization") and (last or name == "all-reduce every micro-batch"):
                    ddp.finish_gradient_synchronization()
        out[name] = {"max_grad_diff": max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())),
                     "sent": sum(meter.sent.values()), "calls": dict(meter.calls)}
    return out


def ddp_overlap(rank: int, world_size: int, bucket_sizes_mb=(0.002, 0.01, 1.0), global_batch: int = 8, seq_len: int = 16,
                seed: int = 0) -> dict:
    """One backward under :class:`DDPBucketed` per bucket size (after one warm-up step), placed on a timeline:
    when each parameter's gradient arrived (a post-accumulate-grad hook that runs before DDPBucketed's), when
    each bucket's asynchronous all-reduce was called (:class:`CommMeter`'s ``times``), when ``backward()``
    returned, and how many all-reduces gloo had already finished by then. Per bucket size: ``bucket_bytes``
    (in the plan's order), ``grads_after_launch`` (how many gradients backward still produced after each
    bucket's last one, i.e. after its all-reduce was called: the compute it can overlap), the all-reduce
    calls' bytes in call order, and times in ms from the start of backward."""
    import time

    from labkit.train import cross_entropy

    base, x, y = _toy_setup(seed, global_batch, seq_len)
    local = _local_slice(rank, world_size, global_batch)
    out = {}
    for bucket_mb in bucket_sizes_mb:
        model = copy.deepcopy(base)
        params = list(model.parameters())
        index = {id(p): i for i, p in enumerate(params)}
        arrivals: list[tuple[int, float]] = []
        for i, p in enumerate(params):  # registered first, so it runs before DDPBucketed's hook may call the all-reduce
            p.register_post_accumulate_grad_hook(lambda _, i=i: arrivals.append((i, time.perf_counter())))
        ddp = DDPBucketed(model, bucket_mb)
        for _ in range(2):  # the first backward warms up; the second is the one recorded
            model.zero_grad(set_to_none=True)
            arrivals.clear()
            loss = cross_entropy(ddp(x[local]), y[local])
            with CommMeter() as meter:
                start = time.perf_counter()
                loss.backward()
                end = time.perf_counter()
                completed = sum(handle.is_completed() for handle, _ in ddp._pending.values())
                ddp.finish_gradient_synchronization()
        order = [i for i, _ in arrivals]
        plan = [[index[id(p)] for p in bucket] for bucket in ddp.buckets]
        last_arrival = [max(order.index(i) for i in bucket) for bucket in plan]
        ms = lambda t: (t - start) * 1e3
        out[bucket_mb] = {
            "bucket_bytes": [sum(params[i].numel() * params[i].element_size() for i in bucket) for bucket in plan],
            "grads_after_launch": [len(order) - 1 - position for position in last_arrival],
            "call_bytes": [nbytes for op, nbytes in meter.events if op == "all_reduce"],
            "call_ms": [ms(t) for (op, _), t in zip(meter.events, meter.times) if op == "all_reduce"],
            "arrival_ms": [ms(t) for _, t in arrivals], "backward_ms": ms(end), "completed_at_backward_end": completed,
            "gradients": len(order),
        }
    return out


def zero1(rank: int, world_size: int, steps: int = 3, global_batch: int = 8, seq_len: int = 16, seed: int = 0) -> dict:
    """ZeRO-1 three ways against the unsharded AdamW on the full batch, ``steps`` steps: the paper's
    :class:`ShardedOptimizer` (no DDP: it reduce-scatters the gradients itself, steps its shard,
    all-gathers the parameters), the broadcast variant (:class:`DDPIndividual`'s all-reduce,
    then :class:`ShardedOptimizerBroadcast`) and PyTorch's ``ZeroRedundancyOptimizer`` after the same
    all-reduce. For each: the max parameter difference to the
    reference, the optimizer-state bytes this rank holds, and the calls and bytes this rank sent
    per step (:class:`labkit.dist.CommMeter`, ring algorithms). Top-level keys describe the
    paper's version; ``"broadcast variant"`` holds the same for the other, and
    ``"torch ZeroRedundancyOptimizer"`` for PyTorch's ZeRO-1, which ships the broadcast design."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from labkit.train import AdamW

    base, x, y = _toy_setup(seed, global_batch, seq_len)
    local = _local_slice(rank, world_size, global_batch)
    reference, _, unsharded_state_bytes = _reference(base, x, y, steps, AdamW, lr=1e-2)
    runs = {}
    for name in ("paper", "broadcast variant", "torch ZeroRedundancyOptimizer"):
        model = copy.deepcopy(base)
        if name == "paper":
            wrapper, optimizer = model, ShardedOptimizer(model.parameters(), AdamW, lr=1e-2)
            padded = optimizer.padded  # the flat buffer's elements: parameters + zero padding to a multiple of N
        elif name == "broadcast variant":
            wrapper = DDPIndividual(model)
            optimizer = ShardedOptimizerBroadcast(model.parameters(), AdamW, lr=1e-2)
        else:  # PyTorch's ZeRO-1: the broadcast design, beside a DDP's all-reduce
            wrapper = DDPIndividual(model)
            optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=AdamW, lr=1e-2)
        with CommMeter() as meter:
            _train(model, wrapper, optimizer, x[local], y[local], steps)
        local_optimizer = optimizer.optim if name == "torch ZeroRedundancyOptimizer" else optimizer.local_optimizer
        runs[name] = {"max_abs_diff": _max_param_diff(model, reference),
                      "state_bytes_sharded": optimizer_state_bytes(local_optimizer),
                      "sent_per_step": {op: sent / steps for op, sent in meter.sent.items()},
                      "calls_per_step": {op: calls / steps for op, calls in meter.calls.items()}}
    return {**runs["paper"], "broadcast variant": runs["broadcast variant"],
            "torch ZeroRedundancyOptimizer": runs["torch ZeroRedundancyOptimizer"], "state_bytes_unsharded": unsharded_state_bytes,
            "params": sum(p.numel() for p in base.parameters()), "padded": padded}


def zero1_mixed_precision(rank: int, world_size: int, steps: int = 2, global_batch: int = 8, seq_len: int = 16,
                          seed: int = 0) -> dict:
    """The paper's ZeRO-1 (:class:`ShardedOptimizer`) on the bf16 copy of the tiny model: the gradients are
    reduce-scattered and the parameters all-gathered in bf16, while each rank's master shard and AdamW's
    m and v stay fp32. Returns the per-step losses, the master shard's dtype and elements, the bytes of
    this rank's optimizer state and master shard, and what it sent per step."""
    from labkit.train import AdamW

    base, x, y = _toy_setup(seed, global_batch, seq_len)
    model = base.to(torch.bfloat16)
    local = _local_slice(rank, world_size, global_batch)
    optimizer = ShardedOptimizer(model.parameters(), AdamW, lr=1e-2)
    with CommMeter() as meter:
        losses = _train(model, model, optimizer, x[local], y[local], steps)
    shard = optimizer.master_shard
    return {"losses": losses, "param_dtype": str(next(model.parameters()).dtype), "master_dtype": str(shard.dtype),
            "shard_elements": shard.numel(), "padded": optimizer.padded, "master_bytes": shard.numel() * shard.element_size(),
            "state_bytes": optimizer_state_bytes(optimizer.local_optimizer),
            "sent_per_step": {op: sent / steps for op, sent in meter.sent.items()}}


def fsdp(rank: int, world_size: int, steps: int = 3, global_batch: int = 8, seq_len: int = 16, lr: float = 0.5, seed: int = 0) -> dict:
    """PyTorch FSDP2 (``fully_shard`` on every block and the whole model) vs the unsharded
    model trained on the full batch, both with plain SGD (its step scales with the gradient, so
    a wrongly scaled gradient shows): per-step losses (the global mean over ranks) and the
    parameter elements this rank stores."""
    from torch.distributed.fsdp import fully_shard

    from labkit.train import cross_entropy

    base, x, y = _toy_setup(seed, global_batch, seq_len)
    local = _local_slice(rank, world_size, global_batch)
    _, ref_losses, _ = _reference(base, x, y, steps, torch.optim.SGD, lr=lr)
    model = copy.deepcopy(base)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses, sent = [], {}
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with CommMeter() as meter:  # FSDP2's own collectives, called through torch.distributed
            loss = cross_entropy(model(x[local]), y[local])
            loss.backward()  # FSDP reduce-scatters the gradients: each rank gets its shard, averaged
        for op, nbytes in meter.sent.items():
            sent[op] = sent.get(op, 0.0) + nbytes / steps
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    local_elems = sum(p.to_local().numel() for p in model.parameters())
    layer_shards = sum(p.to_local().numel() * p.element_size() for layer in model.layers for p in layer.parameters())
    return {"losses": losses, "reference_losses": ref_losses, "local_param_elements": local_elems,
            "full_param_elements": sum(p.numel() for p in base.parameters()), "sent_per_step": sent,
            "shard_bytes": sum(p.to_local().numel() * p.element_size() for p in model.parameters()),
            "layer_shard_bytes": layer_shards}


def fsdp_inside(rank: int, world_size: int, global_batch: int = 8, seq_len: int = 16, seed: int = 0) -> dict:
    """One FSDP2 training step (plain SGD) with ``reshard_after_forward=True`` (``"zero3"``: each block's full
    parameters are freed after its forward and gathered again for its backward), ``False`` (``"zero2"``,
    ZeRO-2-like: gathered once, kept until backward is done), and ZeRO-3 with ``MixedPrecisionPolicy(param_dtype=
    torch.bfloat16, reduce_dtype=torch.float32)`` (``"zero3 bf16"``: fp32 shards, bf16 all-gathers and compute,
    fp32 reduce-scatters), taken apart per unit (every block, then the root with the
    embedding, the final norm and the output layer, at FSDP2's default for the root). Returns per setting: the bytes of this rank's shards
    (``shard``, per unit), what it holds between forward and backward (its shards plus the full parameters of
    every unit still unsharded then, in the policy's dtype, read from whether the unit's parameters are DTensors), the bytes of its
    gradients after backward, and ``CommMeter``'s calls and bytes sent in forward and in backward."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from labkit.train import cross_entropy

    base, x, y = _toy_setup(seed, global_batch, seq_len)
    local = _local_slice(rank, world_size, global_batch)
    nbytes = lambda t: t.numel() * t.element_size()
    out = {}
    settings = {"zero3": dict(reshard_after_forward=True), "zero2": dict(reshard_after_forward=False),
                "zero3 bf16": dict(reshard_after_forward=True,
                                   mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))}
    for setting, options in settings.items():
        model = copy.deepcopy(base)
        for layer in model.layers:
            fully_shard(layer, **options)
        fully_shard(model, mp_policy=options.get("mp_policy", MixedPrecisionPolicy()))  # the root keeps FSDP2's default resharding: gathered in forward, kept for backward, which needs it first
        unit = lambda name: ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
        full, shard = {}, {}
        for name, p in model.named_parameters():  # DTensors report their full size, to_local() this rank's shard
            full[unit(name)] = full.get(unit(name), 0) + nbytes(p)
            shard[unit(name)] = shard.get(unit(name), 0) + nbytes(p.to_local())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with CommMeter() as forward:
            loss = cross_entropy(model(x[local]), y[local])
        # an unsharded unit's module holds plain tensors (in the policy's param_dtype) in place of its DTensor shards
        unsharded = sorted({unit(name) for name, p in model.named_parameters() if not isinstance(p, DTensor)})
        unsharded_bytes = sum(nbytes(p) for p in model.parameters() if not isinstance(p, DTensor))
        with CommMeter() as backward:
            loss.backward()
        grads = sum(nbytes(p.grad.to_local()) for p in model.parameters())
        optimizer.step()
        out[setting] = {
            "full": full, "shard": shard, "unsharded_after_forward": unsharded,
            "held_after_forward": sum(shard.values()) + unsharded_bytes, "grad_bytes": grads,
            "forward": {op: {"calls": forward.calls[op], "sent": forward.sent[op]} for op in forward.calls},
            "backward": {op: {"calls": backward.calls[op], "sent": backward.sent[op]} for op in backward.calls},
        }
    return out


def fsdp_prefetch(rank: int, world_size: int, num_layers: int = 4, global_batch: int = 8, seq_len: int = 16, seed: int = 0) -> dict:
    """When FSDP2 issues each unit's all-gather, relative to each block's compute, in one forward and backward
    (ZeRO-3: every block and the root ``fully_shard``-ed), with FSDP2's default prefetching (``"default"``) and with
    explicit forward prefetching, ``blocks[i].set_modules_to_forward_prefetch([blocks[i + 1]])`` (``"explicit"``).
    Returns per setting ``events``, in call order: ``("all_gather", bytes)`` and ``("reduce_scatter", bytes)`` as
    ``CommMeter`` sees them, ``("forward", i)`` when block i's forward starts (a forward pre-hook, after FSDP2's own,
    which gathers the block and issues its prefetches) and ``("backward", i)`` when its backward starts (a hook on
    the block's output gradient, after FSDP2's pre-backward hook); and ``gathers_at_forward[i]`` and
    ``gathers_at_backward[i]``: how many all-gathers of that pass were issued when block i's forward (its backward)
    started."""
    from torch.distributed.fsdp import fully_shard

    from labkit.train import cross_entropy

    if num_layers < 2:
        raise ValueError(f"num_layers={num_layers}: prefetching needs a next block, so at least 2")
    base, x, y = _toy_setup(seed, global_batch, seq_len, num_layers=num_layers)
    local = _local_slice(rank, world_size, global_batch)
    out = {}
    for setting in ("default", "explicit"):
        model = copy.deepcopy(base)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        blocks = list(model.layers)
        if setting == "explicit":
            for block, following in zip(blocks, blocks[1:]):
                block.set_modules_to_forward_prefetch([following])
        marks = []  # (number of collectives called so far, event)
        with CommMeter() as meter:
            def mark(event):
                marks.append((len(meter.events), event))

            def mark_backward(i, output):
                # registered on the block's output after FSDP2's own pre-backward hook, so it runs after that one
                output.register_hook(lambda _: mark(("backward", i)))

            for i, block in enumerate(blocks):
                block.register_forward_pre_hook(lambda *_, i=i: mark(("forward", i)))
                block.register_forward_hook(lambda _module, _args, output, i=i: mark_backward(i, output))
            loss = cross_entropy(model(x[local]), y[local])
            in_forward = len(meter.events)
            loss.backward()
        events, done = [], 0
        for position, event in marks:
            events += meter.events[done:position] + [event]
            done = position
        events += meter.events[done:]
        count = lambda position, start: sum(op == "all_gather" for op, _ in meter.events[start:position])
        out[setting] = {
            "events": events,
            "gathers_at_forward": [count(n, 0) for n, (phase, _) in marks if phase == "forward"],
            "gathers_at_backward": {i: count(n, in_forward) for n, (phase, i) in marks if phase == "backward"},
        }
    return out


def fail_on_rank(rank: int, world_size: int, bad_rank: int = 1) -> int:
    """Raises on ``bad_rank`` after printing a line; the other ranks wait in a collective."""
    print(f"rank {rank} starting")
    if rank == bad_rank:
        raise ValueError(f"rank {rank} hit a bug")
    dist.barrier()
    return rank


def hang_on_rank(rank: int, world_size: int, bad_rank: int = 1) -> int:
    """``bad_rank`` never joins the collective (it sleeps), so every rank is stuck."""
    import time

    print(f"rank {rank} starting")
    if rank == bad_rank:
        time.sleep(3600)
    dist.barrier()
    return rank


def hello(rank: int, world_size: int) -> str:
    """Each rank prints and returns who it is; the sum over ranks checks the group works."""
    t = torch.tensor([float(rank)], device=rank_device())
    dist.all_reduce(t)
    print(f"hello from rank {rank} of {world_size} (backend {dist.get_backend()})")
    return f"rank {rank}: sum of ranks = {t.item():g}"


def several(rank: int, world_size: int, demos: dict[str, dict]) -> dict:
    """Run several demos of this module in one launch (process start-up costs seconds):
    ``demos`` maps a function name to its keyword arguments; returns ``{name: result}``."""
    unknown = [name for name in demos if name not in _DEMOS]
    if unknown:
        raise ValueError(f"demos: unknown {unknown}; expected names from {sorted(_DEMOS)}")
    return {name: _DEMOS[name](rank, world_size, **kwargs) for name, kwargs in demos.items()}


_DEMOS = {f.__name__: f for f in (hello, collectives, ring_vs_all_reduce, data_parallel, ddp_overlap, gradient_accumulation, zero1,
                                  zero1_mixed_precision, fsdp, fsdp_inside, fsdp_prefetch)}


# ----------------------------------------------------------------------------- drawing the collectives
_COLLECTIVE_CAPTIONS = {
    "broadcast": "rank 0's tensor copied to every rank",
    "reduce": "the sum lands on the root (rank 0) only",
    "all_reduce": "the sum lands on every rank",
    "all_gather": "every rank gets every rank's tensor, in rank order",
    "reduce_scatter": "chunk r, summed over ranks, lands on rank r",
}


def plot_collectives(results: dict):
    """One panel per collective, from ``launch(collectives)`` results (``{rank: {name: (before,
    after)}}``): each rank's tensor before (left) and after (right), one cell per value, every
    value written out. A cell's colour says where its value came from: the colour of the rank
    whose input held it, or dark grey for a sum over ranks; chunks of stacked tensors are
    separated by gaps. Readable up to about 8 ranks."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    from labkit.dist import COLLECTIVES

    ranks = sorted(results)
    if not ranks or any(set(COLLECTIVES) - set(results[r]) for r in ranks):
        raise ValueError(f"results: expected {{rank: {{name: (before, after)}}}} for every collective in {COLLECTIVES}")
    colors = plt.cm.tab10.colors
    sum_color = "#3b3b3b"

    def rows(t):
        return [] if t is None else [c.tolist() for c in (t if t.dim() == 2 else t[None])]

    widths = [max(sum(len(c) for c in rows(results[r][n][side])) + len(rows(results[r][n][side])) for r in ranks for n in COLLECTIVES)
              for side in (0, 1)]
    fig, axes = plt.subplots(len(COLLECTIVES), 1, figsize=(max(9.0, 0.36 * (sum(widths) + 8)), len(COLLECTIVES) * (0.42 * len(ranks) + 0.6)))
    for ax, name in zip(axes, COLLECTIVES):
        origin = {v: r for r in ranks for chunk in rows(results[r][name][0]) for v in chunk}  # input value -> its rank
        for row, rank in enumerate(ranks):
            y = -row
            ax.text(-0.4, y + 0.4, f"rank {rank}", ha="right", va="center", fontsize=10)
            for side, x0 in ((0, 0.0), (1, widths[0] + 2.0)):
                tensor = results[rank][name][side]
                if tensor is None:
                    ax.text(x0, y + 0.4, "undefined (not the root)", ha="left", va="center", fontsize=9, color="gray", style="italic")
                    continue
                x = x0
                for chunk in rows(tensor):
                    for v in chunk:
                        src = origin.get(v)
                        color = sum_color if src is None else colors[src % len(colors)]
                        ax.add_patch(Rectangle((x, y), 0.95, 0.8, facecolor=color, edgecolor="white"))
                        ax.text(x + 0.475, y + 0.4, f"{v:g}", ha="center", va="center", fontsize=8.5, color="white")
                        x += 1
                    x += 0.5  # gap between chunks
        arrow_x = widths[0] + 0.6
        ax.annotate("", xy=(arrow_x + 1.0, -len(ranks) / 2 + 0.9), xytext=(arrow_x, -len(ranks) / 2 + 0.9),
                    arrowprops=dict(arrowstyle="->", lw=1.5))
        ax.set_xlim(-3.2, widths[0] + widths[1] + 2.5)
        ax.set_ylim(-len(ranks) + 0.8, 1.0)
        ax.set_title(f"{name}: {_COLLECTIVE_CAPTIONS[name]}", fontsize=11, loc="left")
        ax.axis("off")
    legend = [Patch(color=colors[r % len(colors)], label=f"from rank {r}") for r in ranks] + [Patch(color=sum_color, label="sum over ranks")]
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=10, frameon=False)
    fig.suptitle("each rank's tensor before (left) and after (right) the collective", fontsize=12)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    return fig
