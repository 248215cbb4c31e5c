"""Run chapter 07's and 08's per-rank functions under torchrun, unchanged.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m labkit.distrun run tp --steps 3
    python -m torch.distributed.run --nnodes 2 --nproc-per-node 8 --node-rank 0 \\
        --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m labkit.distrun run ddp
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m labkit.distrun call labkit.parallel_demos:ring_attention_check

Each rank reads the environment torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT``) through :func:`labkit.dist.init_from_environment` (NCCL on GPUs,
gloo otherwise), the very function every rank of :func:`labkit.dist.launch` starts with, runs
``fn(rank, world_size, **kwargs)``, prints a one-line summary, saves its result with
``torch.save`` to ``--out DIR/result_RANK.pt`` if asked, and leaves through
:func:`labkit.dist.end_rank` (``os._exit``, after ``destroy_process_group``), which sidesteps
gloo's abort in its static destructors at interpreter exit.

This module is separate from :mod:`labkit.dist` because it runs the strategies of
:mod:`labkit.parallel_demos`, which import :mod:`labkit.parallel`, which imports
:mod:`labkit.dist`: inside ``labkit.dist`` that would be an import cycle.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from pathlib import Path

# strategy -> (module, function) of a per-rank function fn(rank, world_size, steps=...)
STRATEGIES = {
    "ddp": ("labkit.dist_demos", "data_parallel"),
    "zero1": ("labkit.dist_demos", "zero1"),
    "fsdp": ("labkit.dist_demos", "fsdp"),
    "tp": ("labkit.parallel_demos", "tensor_parallel_training"),
    "pp": ("labkit.parallel_demos", "pipeline_training"),
}


def resolve(target: str):
    """``"package.module:function"`` -> the function (it must be importable by every rank)."""
    module, sep, name = target.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"target={target!r}: expected 'package.module:function'")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"target={target!r}: {module} has no function {name!r}")
    return fn


def summary(strategy: str, result) -> str:
    """A line saying how the strategy's result compares with single-process training."""
    if strategy in ("ddp",):
        return "max parameter difference to one process: " + ", ".join(f"{k} {result[k]:.2e}" for k in ("DDPIndividual", "DDPBucketed", "torch DDP"))
    if strategy == "zero1":
        return f"max parameter difference to one process {result['max_abs_diff']:.2e}, optimizer state {result['state_bytes_sharded']:,} of {result['state_bytes_unsharded']:,} B"
    if strategy in ("fsdp", "tp"):
        return "losses " + " ".join(f"{v:.4f}" for v in result["losses"]) + " vs one process " + " ".join(f"{v:.4f}" for v in result["reference_losses"])
    if strategy == "pp":
        return "; ".join(f"{s}: parameter difference {result[s]['param_diff']:.2e}" for s in ("gpipe", "1f1b"))
    return f"returned {type(result).__name__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.distrun", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train with one strategy and compare with one process")
    run.add_argument("strategy", choices=sorted(STRATEGIES))
    run.add_argument("--steps", type=int, default=3)
    call = sub.add_parser("call", help="run any per-rank function fn(rank, world_size, **kwargs)")
    call.add_argument("target", help="package.module:function")
    call.add_argument("--kwargs", default="{}", help="keyword arguments as JSON")
    for p in (run, call):
        p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
        p.add_argument("--timeout", type=float, default=600, help="seconds a collective may wait")
        p.add_argument("--out", default=None, help="directory for result_RANK.pt")
    args = parser.parse_args(argv)

    import labkit  # noqa: F401  (Triton's mode is set before anything imports triton)
    import torch
    import torch.distributed as dist

    from labkit.dist import _to_cpu, end_rank, init_from_environment

    if args.command == "run":
        fn, kwargs, label = resolve(":".join(STRATEGIES[args.strategy])), {"steps": args.steps}, args.strategy
    else:
        fn, kwargs, label = resolve(args.target), json.loads(args.kwargs), args.target
    try:
        rank, world_size = init_from_environment(args.backend, args.timeout)
        try:
            result = fn(rank, world_size, **kwargs)
        finally:
            dist.destroy_process_group()
        line = summary(args.strategy, result) if args.command == "run" else f"returned {type(result).__name__}"
        sys.stdout.write(f"[rank {rank}/{world_size}] {label}: {line}\n")  # one write: ranks share the terminal
        if args.out is not None:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            torch.save(_to_cpu(result), Path(args.out) / f"result_{rank}.pt")
    except BaseException:
        traceback.print_exc()
        end_rank(1)
    end_rank(0)
    return 0  # not reached: end_rank leaves the process


if __name__ == "__main__":
    sys.exit(main())
