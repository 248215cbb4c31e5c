"""Per-rank functions that chapter 07 hands to :func:`labkit.dist.launch`.

Each runs inside one rank (the process group is already set up) and returns plain values
(tensors, numbers) that ``launch`` collects from every rank.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from labkit.dist import DDPBucketed, DDPIndividual, ShardedOptimizer, rank_device, ring_all_reduce
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


def _toy_setup(seed: int, global_batch: int, seq_len: int):
    """A tiny TransformerLM and a fixed global batch, identical on every rank."""
    from labkit.model import TransformerLM, tiny_config

    torch.manual_seed(seed)
    config = tiny_config(vocab_size=16, context_length=seq_len, d_model=32, num_layers=2, num_heads=4, d_ff=64)
    model = TransformerLM(config).to(rank_device())
    tokens = torch.randint(0, 16, (global_batch, seq_len + 1)).to(rank_device())
    return model, tokens[:, :-1], tokens[:, 1:]


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


def _max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def data_parallel(rank: int, world_size: int, steps: int = 3, global_batch: int = 8, seq_len: int = 16, bucket_size_mb: float = 0.01, seed: int = 0) -> dict:
    """Train the same tiny model for ``steps`` AdamW steps four ways and compare parameters:
    single-process on the full batch (the reference, run on every rank), our
    :class:`DDPIndividual` and :class:`DDPBucketed`, and ``torch.nn.parallel.DistributedDataParallel``
    (each rank on its ``1/world_size`` slice of the batch). Returns the max parameter
    difference to the reference for each, and how many buckets the bucketed version used."""
    from labkit.train import AdamW

    base, x, y = _toy_setup(seed, global_batch, seq_len)
    local = slice(rank * global_batch // world_size, (rank + 1) * global_batch // world_size)
    reference = copy.deepcopy(base)
    _train(reference, reference, AdamW(reference.parameters(), lr=1e-2), x, y, steps)
    out = {"params": sum(p.numel() for p in base.parameters())}
    for name, wrap in [("DDPIndividual", DDPIndividual), ("DDPBucketed", lambda m: DDPBucketed(m, bucket_size_mb)),
                       ("torch DDP", torch.nn.parallel.DistributedDataParallel)]:
        model = copy.deepcopy(base)
        wrapper = wrap(model)
        _train(model, wrapper, AdamW(model.parameters(), lr=1e-2), x[local], y[local], steps)
        out[name] = _max_param_diff(model, reference)
        if name == "DDPBucketed":
            out["buckets"] = len(wrapper.buckets)
    return out


def zero1(rank: int, world_size: int, steps: int = 3, global_batch: int = 8, seq_len: int = 16, seed: int = 0) -> dict:
    """DDP + :class:`ShardedOptimizer` (ZeRO-1) vs the unsharded optimizer: max parameter
    difference after ``steps`` steps, and the optimizer-state bytes this rank holds in each case."""
    from labkit.train import AdamW

    base, x, y = _toy_setup(seed, global_batch, seq_len)
    local = slice(rank * global_batch // world_size, (rank + 1) * global_batch // world_size)
    reference = copy.deepcopy(base)
    full_opt = AdamW(reference.parameters(), lr=1e-2)
    _train(reference, reference, full_opt, x, y, steps)
    model = copy.deepcopy(base)
    ddp = DDPIndividual(model)
    sharded = ShardedOptimizer(model.parameters(), AdamW, lr=1e-2)
    _train(model, ddp, sharded, x[local], y[local], steps)
    return {"max_abs_diff": _max_param_diff(model, reference),
            "state_bytes_unsharded": optimizer_state_bytes(full_opt),
            "state_bytes_sharded": optimizer_state_bytes(sharded.local_optimizer)}


def fsdp(rank: int, world_size: int, steps: int = 3, global_batch: int = 8, seq_len: int = 16, seed: int = 0) -> dict:
    """PyTorch FSDP2 (``fully_shard`` on every block and the whole model) vs the unsharded
    model trained on the full batch: per-step losses (the global mean over ranks) and the
    parameter elements this rank stores."""
    from torch.distributed.fsdp import fully_shard

    from labkit.train import AdamW, cross_entropy

    base, x, y = _toy_setup(seed, global_batch, seq_len)
    local = slice(rank * global_batch // world_size, (rank + 1) * global_batch // world_size)
    reference = copy.deepcopy(base)
    ref_losses = _train(reference, reference, AdamW(reference.parameters(), lr=1e-2), x, y, steps)
    model = copy.deepcopy(base)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = cross_entropy(model(x[local]), y[local])
        loss.backward()  # FSDP reduce-scatters the gradients: each rank gets its shard, averaged
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    local_elems = sum(p.to_local().numel() for p in model.parameters())
    return {"losses": losses, "reference_losses": ref_losses, "local_param_elements": local_elems,
            "full_param_elements": sum(p.numel() for p in base.parameters())}


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


_DEMOS = {f.__name__: f for f in (hello, collectives, ring_vs_all_reduce, data_parallel, zero1, fsdp)}
