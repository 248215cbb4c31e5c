"""Graders for chapter 07 (memory and distributed training)."""
from __future__ import annotations

import numbers

import torch

from labkit.checks._core import assert_close, call, fail, passed
from labkit.dist import gradient_collective as _gradient_collective
from labkit.dist import ring_allreduce_step as _ring_allreduce_step
from labkit.memory import model_state_bytes

__all__ = ["adamw_mixed_precision_bytes", "ring_allreduce_step", "gradient_collective"]

_BYTES_HINTS = {
    12: "12 bytes/parameter is the optimizer part alone (fp32 master copy + m + v), or everything but the master "
        "weights: count bf16 weights (2) + bf16 gradients (2) + fp32 master weights (4) + fp32 m (4) + fp32 v (4)",
    8: "AdamW keeps two fp32 moments (m and v) and mixed precision keeps an fp32 master copy of the weights too",
    14: "the fp32 master weights are 4 bytes per parameter, and m and v are 4 bytes each as well",
    18: "in mixed precision the gradients come out of the bf16 backward pass: 2 bytes each, not 4",
    20: "the working weights and gradients are bf16 (2 bytes each); only the master copy and m, v are fp32",
    4: "that is one fp32 copy; count weights, gradients, master weights and both Adam moments",
}


def adamw_mixed_precision_bytes(fn) -> None:
    """Grades ``fn(num_params) -> bytes`` of model state in bf16 mixed-precision AdamW training."""
    for n in (1, 7, 1000, 123_457, 7_500_000_000):
        tried = f"fn({n})"
        got = call(fn, tried, n)
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if isinstance(got, bool) or not isinstance(got, numbers.Real):
            fail(tried, f"a {type(got).__name__}", "a number of bytes", "return an int (bytes), e.g. 16 * num_params")
        expected = model_state_bytes(n, "bf16", mixed_precision=True, optimizer="adamw").total
        if got != expected:
            ratio = got / n
            hint = _BYTES_HINTS.get(round(ratio)) if abs(ratio - round(ratio)) < 1e-9 else None
            fail(tried, f"{got:,} bytes ({ratio:.4g} per parameter)", f"{expected:,} bytes",
                 hint or "add bytes per parameter: weights, gradients, master weights, Adam's m and v, each in its dtype")
    passed("adamw_mixed_precision_bytes", "2 + 2 + 4 + 4 + 4 = 16 bytes per parameter")


def _buffers(world: int, numel: int, gen: torch.Generator) -> list[list[torch.Tensor]]:
    data = [torch.randn(numel, generator=gen) for _ in range(world)]
    return [list(d.tensor_split(world)) for d in data]


def ring_allreduce_step(fn) -> None:
    """Grades ``fn(buffers, step) -> new buffers``: one step of the ring all-reduce on every rank
    (``buffers[r][c]`` is rank ``r``'s copy of chunk ``c``)."""
    gen = torch.Generator().manual_seed(7)
    for world, numel in ((2, 6), (3, 10), (4, 13)):
        buffers = _buffers(world, numel, gen)
        for step in range(2 * (world - 1)):
            phase = "reduce-scatter" if step < world - 1 else "all-gather"
            tried = f"fn(buffers, step={step}) with {world} ranks ({phase} phase), chunks of sizes {[c.numel() for c in buffers[0]]}"
            snapshot = [[c.clone() for c in b] for b in buffers]
            got = call(fn, tried, buffers, step)
            if any(not torch.equal(a, b) for sa, sb in zip(snapshot, buffers) for a, b in zip(sa, sb)):
                fail(tried, "the input buffers were modified", "the input left as it was", "clone the chunks before adding into them")
            if not isinstance(got, (list, tuple)) or len(got) != world or any(not isinstance(b, (list, tuple)) or len(b) != world for b in got):
                fail(tried, f"a {type(got).__name__}", f"a list of {world} lists of {world} chunks", "return new buffers with the same layout")
            expected = _ring_allreduce_step(snapshot, step)
            for r in range(world):
                for c in range(world):
                    if not (isinstance(got[r][c], torch.Tensor) and got[r][c].shape == expected[r][c].shape
                            and torch.allclose(got[r][c], expected[r][c], rtol=1e-5, atol=1e-6)):
                        assert_close(got[r][c], expected[r][c], f"{tried}; rank {r}, chunk {c}", _ring_hint(step, world))
            buffers = expected
    passed("ring_allreduce_step", "2(N-1) steps leave the full sum on every rank")


def _ring_hint(step: int, world: int) -> str:
    if step < world - 1:
        return ("reduce-scatter: rank r sends chunk (r - step) mod N to rank r + 1, which ADDS it to its own copy "
                "(check the direction, the chunk index, and that you add rather than overwrite)")
    return ("all-gather: rank r sends chunk (r + 1 - (step - (N - 1))) mod N to rank r + 1, which OVERWRITES its copy "
            "with the finished sum (adding again would double count)")


_COLLECTIVE_HINTS = {
    "ddp": "every rank needs the full averaged gradient to take the same optimizer step",
    "zero1": "ZeRO-1 shards only optimizer states: gradients are still averaged in full on every rank",
    "zero2": "ZeRO-2 keeps only the gradient shard a rank updates: sum and scatter in one collective",
    "zero3": "ZeRO-3 shards parameters, gradients and states: each rank keeps the summed gradient of its shard only",
    "fsdp": "FSDP is ZeRO-3: parameters are all-gathered for compute, gradients reduced to shards",
}


def gradient_collective(fn) -> None:
    """Grades ``fn(strategy) -> name of the torch.distributed collective that synchronises gradients``."""
    for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
        tried = f"fn({strategy!r})"
        got = call(fn, tried, strategy)
        expected = _gradient_collective(strategy)
        if got != expected:
            fail(tried, repr(got), repr(expected), _COLLECTIVE_HINTS[strategy] + " (use torch.distributed's names, e.g. 'all_reduce')")
    passed("gradient_collective", "DDP and ZeRO-1 all-reduce gradients; ZeRO-2/3 and FSDP reduce-scatter them")
