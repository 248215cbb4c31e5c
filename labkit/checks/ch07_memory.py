"""Graders for chapter 07 (memory and distributed training)."""
from __future__ import annotations

import numbers

import torch

from labkit.checks._core import (assert_close, call, call_on_copies, expect_device, expect_new_buffer, fail, other_device,
                                 passed)
from labkit.dist import gradient_collective as _gradient_collective
from labkit.dist import ring_allreduce_step as _ring_allreduce_step
from labkit.memory import model_state_bytes

__all__ = ["adamw_mixed_precision_bytes", "ring_allreduce_step", "gradient_collective"]

_BYTES_HINTS = {
    12: "12 bytes/parameter is the optimizer part alone (fp32 master copy + m + v), or everything but the master "
        "weights: count bf16 weights (2) + bf16 gradients (2) + fp32 master weights (4) + fp32 m (4) + fp32 v (4)",
    8: "AdamW keeps two fp32 moments (m and v) and mixed precision keeps an fp32 master copy of the weights too",
    14: "the fp32 master weights are 4 bytes per parameter, and m and v are 4 bytes each as well",
    18: "18 bytes/parameter is a real recipe, fp32 gradient accumulation (Megatron-LM's main_grad: 2 + 4 + 4 + 4 + 4); "
        "this exercise keeps the gradients in bf16 as the backward pass produces them (2 bytes), beside the fp32 "
        "master weights: 2 + 2 + 4 + 4 + 4",
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
        if not isinstance(got, numbers.Integral):
            fail(tried, f"{got!r} (a {type(got).__name__})", "an int number of bytes",
                 "bytes are whole: use integer arithmetic (16 * num_params), not 16.0 * num_params or a division")
        expected = model_state_bytes(n, "bf16", mixed_precision=True, optimizer="adamw").total
        if got != expected:
            ratio = got / n
            hint = _BYTES_HINTS.get(round(ratio)) if abs(ratio - round(ratio)) < 1e-9 else None
            fail(tried, f"{got:,} bytes ({ratio:.4g} per parameter)", f"{expected:,} bytes",
                 hint or "add bytes per parameter: weights, gradients, master weights, Adam's m and v, each in its dtype")
    passed("adamw_mixed_precision_bytes", "2 + 2 + 4 + 4 + 4 = 16 bytes per parameter")


def _buffers(world: int, numel: int, gen: torch.Generator, dtype=torch.float32, device="cpu") -> list[list[torch.Tensor]]:
    data = [torch.randn(numel, generator=gen).to(dtype=dtype, device=device) for _ in range(world)]
    return [list(d.tensor_split(world)) for d in data]


def ring_allreduce_step(fn) -> None:
    """Grades ``fn(buffers, step) -> new buffers``: one step of the ring all-reduce on every rank
    (``buffers[r][c]`` is rank ``r``'s copy of chunk ``c``), for 2 to 5 ranks, uneven chunks, fp32,
    bf16 and fp64 chunks (the result keeps their dtype), on CUDA when there is one. The input must
    be left as it was, and every returned chunk must be a new tensor (no storage shared with the input)."""
    gen = torch.Generator().manual_seed(7)
    device = other_device(None)
    cases = [(2, 6, torch.float32, "cpu"), (3, 10, torch.float32, "cpu"), (4, 13, torch.float32, "cpu"),
             (5, 23, torch.bfloat16, "cpu"), (3, 7, torch.float64, "cpu")]
    if device is not None:
        cases.append((4, 300, torch.float32, device))
    for world, numel, dtype, dev in cases:
        buffers = _buffers(world, numel, gen, dtype, dev)
        for step in range(2 * (world - 1)):
            phase = "reduce-scatter" if step < world - 1 else "all-gather"
            tried = (f"ring_allreduce_step(buffers, step={step}) with {world} ranks ({phase} phase), {dtype} chunks of sizes "
                     f"{[c.numel() for c in buffers[0]]}{' on ' + str(dev) if dev != 'cpu' else ''}")
            inputs = [[c.clone() for c in b] for b in buffers]
            got, (passed_in, _) = call_on_copies(fn, tried, inputs, step, return_inputs=True,
                                 mutation_hint="clone the chunks before adding into them: new[r][c] = old[r][c] + "
                                               "old[s][c] makes a new tensor, new[r][c] += ... changes the input")
            if not isinstance(got, (list, tuple)) or len(got) != world or any(not isinstance(b, (list, tuple)) or len(b) != world for b in got):
                fail(tried, f"a {type(got).__name__}", f"a list of {world} lists of {world} chunks", "return new buffers with the same layout")
            expected = _ring_allreduce_step(buffers, step)
            for r in range(world):
                for c in range(world):
                    g = got[r][c]
                    if not (isinstance(g, torch.Tensor) and g.shape == expected[r][c].shape and g.dtype == expected[r][c].dtype
                            and g.device == expected[r][c].device
                            and torch.allclose(g.double().cpu(), expected[r][c].double().cpu(), rtol=1e-5, atol=1e-6)):
                        if isinstance(g, torch.Tensor):
                            expect_device(g, dev, f"rank {r}'s chunk {c}", tried)
                        assert_close(g, expected[r][c], f"{tried}; rank {r}, chunk {c}", _ring_hint(step, world),
                                     rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
                    expect_new_buffer(g, passed_in, f"rank {r}'s chunk {c}", tried,
                                      "return new buffers: copy the chunks you keep or forward (c.clone()); a chunk that "
                                      "aliases the input changes when the caller (or the next step) writes into the input")
            buffers = expected
    passed("ring_allreduce_step", "2(N-1) steps leave the full sum on every rank, for 2 to 5 ranks, in fp32/bf16/fp64, "
                                  "with new buffers")


def _ring_hint(step: int, world: int) -> str:
    if step < world - 1:
        return ("reduce-scatter: rank r sends chunk (r - step) mod N to rank r + 1, which ADDS it to its own copy "
                "(check the direction, the chunk index, and that you add rather than overwrite)")
    return ("all-gather: rank r sends chunk (r + 1 - (step - (N - 1))) mod N to rank r + 1, which OVERWRITES its copy "
            "with the finished sum (adding again would double count)")


_COLLECTIVE_HINTS = {
    "ddp": "every rank needs the full averaged gradient to take the same optimizer step",
    "zero1": "ZeRO-1 shards the optimizer states: either all-reduce the full gradient, or reduce-scatter it, since each "
             "rank only updates its own shard",
    "zero2": "ZeRO-2 keeps only the gradient shard a rank updates: sum and scatter in one collective",
    "zero3": "ZeRO-3 shards parameters, gradients and states: each rank keeps the summed gradient of its shard only",
    "fsdp": "FSDP is ZeRO-3: parameters are all-gathered for compute, gradients reduced to shards",
}
_ALIASES = {"reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter"}


def gradient_collective(fn) -> None:
    """Grades ``fn(strategy) -> name of the torch.distributed collective that synchronises gradients``.

    For ZeRO-1 both ``"all_reduce"`` (every rank gets the full averaged gradient and uses its
    shard, labkit's ``ShardedOptimizer``) and ``"reduce_scatter"`` (each rank receives only the
    summed shard it updates, half the traffic: ZeRO paper section 7.2.1) are right.
    ``"reduce_scatter_tensor"`` counts as ``"reduce_scatter"``."""
    zero1 = None
    for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
        tried = f"gradient_collective({strategy!r})"
        got = call(fn, tried, strategy)
        if not isinstance(got, str):
            fail(tried, f"a {type(got).__name__}", "the collective's name as a str, e.g. 'all_reduce'",
                 "return the name of the torch.distributed function, not the function itself")
        name = _ALIASES.get(got, got)
        accepted = ("all_reduce", "reduce_scatter") if strategy == "zero1" else (_gradient_collective(strategy),)
        if name not in accepted:
            fail(tried, repr(got), " or ".join(repr(a) for a in accepted),
                 _COLLECTIVE_HINTS[strategy] + " (use torch.distributed's names, e.g. 'all_reduce')")
        if strategy == "zero1":
            zero1 = name
    note = ("ZeRO-1 with all_reduce: every rank gets the full gradient and uses its shard (simple, like labkit's "
            "ShardedOptimizer); reduce_scatter would send each rank only its shard, half the traffic"
            if zero1 == "all_reduce" else
            "ZeRO-1 with reduce_scatter: each rank receives only the summed shard it updates (ZeRO paper 7.2.1); "
            "all_reduce would also work, at twice the gradient traffic")
    passed("gradient_collective", f"DDP all-reduces gradients; ZeRO-2/3 and FSDP reduce-scatter them; {note}")
