"""Graders for chapter 07 (memory and distributed training)."""
from __future__ import annotations

import importlib.util
import json
import numbers
import random
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from labkit.checks._core import (CheckFailed, assert_close, call, call_on_copies, expect_device, expect_new_buffer, fail,
                                 other_device, passed)
from labkit.dist import gradient_collective as _gradient_collective
from labkit.dist import ring_allreduce_step as _ring_allreduce_step
from labkit.memory import model_state_bytes, optimizer_state_bytes

__all__ = ["adamw_mixed_precision_bytes", "ring_allreduce_step", "gradient_collective", "bucket_plan", "bucketed_ddp",
           "zero1_optimizer",
           "exercise_folder", "import_file"]

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

    For ZeRO-1 both ``"reduce_scatter"`` (each rank receives only the summed shard it updates:
    the ZeRO paper, labkit's ``ShardedOptimizer``) and ``"all_reduce"`` (every rank gets the full
    averaged gradient and uses its shard, labkit's ``ShardedOptimizerBroadcast``) are right.
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
            "ShardedOptimizerBroadcast); reduce_scatter would send each rank only its shard, half the traffic"
            if zero1 == "all_reduce" else
            "ZeRO-1 with reduce_scatter: each rank receives only the summed shard it updates (the ZeRO paper, labkit's "
            "ShardedOptimizer); "
            "all_reduce would also work, at twice the gradient traffic")
    passed("gradient_collective", f"DDP all-reduces gradients; ZeRO-2/3 and FSDP reduce-scatter them; {note}")


# ============================================================================ exercise 4: DDP's bucket plan
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _bucket_cases(rng: random.Random) -> list[dict]:
    """Models as (numel, dtype, requires_grad) per parameter, in registration order, and a cap in bytes."""
    def sizes(n):
        return [rng.randint(1, 40) for _ in range(n)]

    cases = []
    plain = [(n, "fp32", True) for n in sizes(rng.randint(7, 10))]
    cases.append(("an fp32 model, the cap between its largest parameter and its total", plain,
                  4 * rng.randint(max(n for n, _, _ in plain), sum(n for n, _, _ in plain) // 2)))
    exact = [(n, "fp32", True) for n in sizes(8)]
    cases.append(("an fp32 model whose last three parameters fill the cap exactly", exact, 4 * sum(n for n, _, _ in exact[-3:])))
    mixed = [(n, rng.choice(["fp32", "bf16"]) if i % 3 else "fp32", True) for i, n in enumerate(sizes(12))]
    mixed[-2:] = [(mixed[-2][0], "bf16", True), (mixed[-1][0], "fp32", True)]  # at least one dtype change at the end
    cases.append(("a model of fp32 and bf16 parameters, the cap larger than all of them", mixed, 4 * sum(n for n, _, _ in mixed)))
    cases.append(("a model of fp32 and bf16 parameters", mixed, 4 * max(n for n, _, _ in mixed) + 2 * rng.randint(0, 8)))
    frozen = [(n, "fp32", i % 3 != 1) for i, n in enumerate(sizes(10))]
    frozen[0] = (frozen[0][0], "fp32", False)  # a frozen embedding, and frozen parameters in between
    cases.append(("a model with frozen parameters (requires_grad=False)", frozen, 4 * sum(n for n, _, _ in frozen[-4:])))
    big = [(n, "fp32", True) for n in sizes(9)]
    cap = 4 * max(n for n, _, _ in big) * 2
    big[4] = (cap // 4 + rng.randint(5, 30), "fp32", True)  # one parameter larger than the cap, in the middle
    cases.append(("a model with one parameter larger than the cap", big, cap))
    small = [(n, rng.choice(["fp32", "fp16"]), True) for n in sizes(6)]
    cases.append(("a cap smaller than every parameter", small, 1))
    cases.append(("a cap larger than the whole model", plain, 4 * sum(n for n, _, _ in plain) + 4))
    cases.append(("a model with no trainable parameter", [(n, "fp32", False) for n in sizes(3)], 64))
    return cases


def _parameters(spec: list[tuple]) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(len(spec))
    return [torch.nn.Parameter(torch.randn(n, generator=gen).to(_DTYPES[d]), requires_grad=rg) for n, d, rg in spec]


def _plan_fault(plan, params: list[torch.Tensor], cap: int) -> str | None:
    """What is wrong with ``plan`` (indices into ``params``) as a bucket plan with byte cap ``cap``, or None."""
    nbytes = [p.numel() * p.element_size() for p in params]
    trainable = [i for i, p in enumerate(params) if p.requires_grad]
    flat = [i for bucket in plan for i in bucket]
    frozen = [i for i in flat if not params[i].requires_grad]
    if frozen:
        return (f"parameter {frozen[0]} (requires_grad=False) is in a bucket: a frozen parameter gets no gradient, so DDP "
                "has nothing to all-reduce for it; leave out every parameter with p.requires_grad False")
    if sorted(flat) != trainable:
        missing, twice = sorted(set(trainable) - set(flat)), sorted({i for i in flat if flat.count(i) > 1})
        return (f"every trainable parameter in exactly one bucket (missing {missing}, more than once {twice})")
    if flat != trainable[::-1]:
        if flat == trainable:
            return ("the buckets are in forward (registration) order: backward produces gradients roughly last layer "
                    "first, so walk the parameters in REVERSE order (the first bucket holds the last parameters)")
        return "read in order, the buckets must list the trainable parameters in reverse registration order, each once"
    for b, bucket in enumerate(plan):
        if not bucket:
            return (f"bucket {b} is empty: no bucket is empty (a parameter larger than the cap must not leave an "
                    "empty bucket before it: start a new bucket only when the current one holds something)")
        dtypes = sorted({str(params[i].dtype).replace("torch.", "") for i in bucket})
        if len(dtypes) > 1:
            return (f"bucket {b} mixes {' and '.join(dtypes)}: a bucket's gradients become one flat buffer and one "
                    "all-reduce, in one dtype, so a dtype change starts a new bucket")
        size = sum(nbytes[i] for i in bucket)
        if size > cap and len(bucket) > 1:
            over = [i for i in bucket if nbytes[i] > cap]
            if over:
                return (f"bucket {b} puts parameter {over[0]} ({nbytes[over[0]]} B, larger than the cap of {cap} B) with "
                        "others: a parameter larger than the cap gets a bucket of its own, and the NEXT parameter starts "
                        "a new bucket (count the bytes of the parameter that opens a bucket, too)")
            opener = (" (without its first parameter it would fit: count the bytes of the parameter that opens a "
                      "bucket too)" if size - nbytes[bucket[0]] <= cap else "")
            return (f"bucket {b} holds {size} B, over the cap of {cap} B: start a new bucket when adding the next "
                    f"parameter would take the bucket past the cap (check before adding it, not after){opener}")
    for b in range(len(plan) - 1):
        this, following = plan[b], plan[b + 1][0]
        if params[following].dtype == params[this[0]].dtype and sum(nbytes[i] for i in this) + nbytes[following] <= cap:
            return (f"bucket {b + 1}'s first parameter ({nbytes[following]} B) still fits into bucket {b} "
                    f"({sum(nbytes[i] for i in this)} B, same dtype, cap {cap} B): fill a bucket until the next parameter "
                    "would EXCEED the cap; the cap is inclusive (a bucket of exactly the cap is allowed)")
    return None


def _as_plan(got, tried: str) -> list[list[int]]:
    if not isinstance(got, (list, tuple)):
        fail(tried, f"a {type(got).__name__}", "a list of buckets, each a list of parameter indices",
             "return the plan, e.g. [[5, 4], [3, 2, 1]]" + (": did you forget `return`?" if got is None else ""))
    for bucket in got:
        if not isinstance(bucket, (list, tuple)):
            fail(tried, f"a bucket that is a {type(bucket).__name__}", "each bucket a list of indices", "return a list of lists")
        for i in bucket:
            if isinstance(i, torch.Tensor):
                fail(tried, "a bucket of tensors", "indices into params (ints)",
                     "return each parameter's position in params (enumerate(params)), not the tensor itself: indices "
                     "say which parameter is which, and can be sent to other ranks")
            if isinstance(i, bool) or not isinstance(i, numbers.Integral):
                fail(tried, f"a bucket holding {i!r}", "indices into params (ints)", "return each parameter's position in params")
    return [[int(i) for i in bucket] for bucket in got]


def bucket_plan(fn) -> None:
    """Grades ``fn(params, bucket_cap_bytes) -> list of buckets`` (lists of indices into ``params``): DDP's
    gradient buckets, as :func:`labkit.dist.bucket_plan` documents them, on random models with mixed dtypes,
    frozen parameters, a parameter larger than the cap, a cap smaller than every parameter and one larger
    than the model. ``params`` is left as it was; two calls give the same plan."""
    from labkit.dist import bucket_plan as reference

    for label, spec, cap in _bucket_cases(random.Random()):
        params = _parameters(spec)
        layout = ", ".join(f"{i}: {n}×{d}{'' if rg else ' frozen'}" for i, (n, d, rg) in enumerate(spec))
        tried = f"bucket_plan(params, bucket_cap_bytes={cap}) on {label} (params {layout})"
        given = list(params)
        flags = [p.requires_grad for p in params]
        got = _as_plan(call(fn, tried, given, cap), tried)
        if len(given) != len(params) or any(a is not b for a, b in zip(given, params)):
            fail(tried, "params reordered or changed by the call", "the caller's list left as it was",
                 "walk a reversed copy (reversed(params), params[::-1]): params.reverse() or .pop() change the caller's list")
        if [p.requires_grad for p in params] != flags:
            fail(tried, "requires_grad changed by the call", "the parameters left as they were", "only read p.requires_grad")
        fault = _plan_fault(got, params, cap)
        expected = reference(params, cap)
        if fault is not None or got != expected:
            fail(tried, repr(got), repr(expected), fault or "cut the reversed trainable parameters greedily by bytes and dtype")
        if _as_plan(call(fn, tried + " (a second time)", list(params), cap), tried) != got:
            fail(tried + " (called twice)", "a different plan on the second call", "the same plan for the same model",
                 "does your function keep state between calls?")
    passed("bucket_plan", "reverse registration order, trainable parameters only, one dtype per bucket, at most the cap "
                          "(inclusive) unless a parameter alone is larger; mixed dtypes, frozen and oversized parameters, "
                          "caps below and above every parameter")


# ============================================================================ exercises 5 and 6: DDP and ZeRO-1 on real ranks
# The learner's classes live in a file (the ranks are new processes: they can only run code they can import).
# Each grader launches ONE group of gloo ranks that runs every case (a launch costs seconds), collects
# measurements (parameters, gradients, what CommMeter counted, which handles were waited) and judges them here.
_FOLDER: list = []  # the TemporaryDirectory behind exercise_folder(), alive as long as this process


def exercise_folder() -> Path:
    """A temporary folder for the files an exercise writes (``%%writefile {folder}/my_ddp.py``), made
    once per process (notebook kernel) and deleted when it ends: nothing lands in the working tree."""
    if not _FOLDER:
        _FOLDER.append(tempfile.TemporaryDirectory(prefix="labkit-exercises-"))
    return Path(_FOLDER[0].name)


def import_file(path) -> types.ModuleType:
    """Import the Python file ``path`` as a module named after it (``my_ddp.py`` -> ``my_ddp``), afresh
    on every call (so an edited file is read again), and return the module."""
    path = Path(path)
    if path.suffix != ".py" or not path.is_file():
        raise ValueError(f"path={str(path)!r}: expected an existing .py file (did the %%writefile cell run?)")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # classes defined in it now name an importable module
    spec.loader.exec_module(module)
    return module


def _exercise_file(cls, exercise: str) -> tuple[str, str]:
    """The file and name of the learner's class, for the ranks to import."""
    if not isinstance(cls, type):
        fail(f"labkit.checks.{exercise}({cls!r})", f"a {type(cls).__name__}", "the class itself",
             "pass the class (e.g. my_ddp.BucketedDDP), not an instance or a string")
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    if cls.__module__ == "__main__" or not path or "<locals>" in cls.__qualname__:
        fail(f"labkit.checks.{exercise}({cls.__qualname__})", f"a class defined in {cls.__module__}", "a class from a file",
             "the ranks are new processes that import your class: write it into a file with the %%writefile cell "
             "and load that file with labkit.checks.import_file(...)")
    return str(path), cls.__qualname__


def _load_class(path: str, name: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[Path(path).stem] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


class _ReportErrors:
    """In a rank: if the learner's code raises, write what it was doing and the exception to a file the
    grader reads (the rank's traceback also reaches launch()'s error), then let it propagate."""

    def __init__(self, folder: str, rank: int):
        self.folder, self.rank, self.tried = Path(folder), rank, "importing the file"

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if error is not None:
            import traceback

            (self.folder / f"error_{self.rank}.json").write_text(json.dumps({
                "time": time.time(), "rank": self.rank, "tried": self.tried, "type": kind.__name__, "message": str(error),
                "where": "".join(traceback.format_exception(kind, error, tb)[-3:])}))
        return False


class _AllReduceLog:
    """Wraps ``dist.all_reduce`` (inside a :class:`CommMeter`) to note, per call, whether it came during
    backward and asynchronously, and hands back a handle that records its ``wait()``."""

    def __init__(self):
        self.in_backward = False
        self.calls: list[dict] = []

    def __enter__(self):
        import torch.distributed as dist

        original = dist.all_reduce

        def logged(*args, **kwargs):
            record = {"backward": self.in_backward, "async": bool(kwargs.get("async_op", args[3] if len(args) > 3 else False)),
                      "waited": False}
            self.calls.append(record)
            work = original(*args, **kwargs)
            return _WaitedWork(work, record) if work is not None else None

        self._original, dist.all_reduce = original, logged
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.all_reduce = self._original
        return False


class _WaitedWork:
    def __init__(self, work, record: dict):
        self._work, self._record = work, record

    def wait(self, *args, **kwargs):
        self._record["waited"] = True
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _mlp(widths: list[int], dtype: torch.dtype, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]).to(dtype)


def _batch(widths: list[int], batch: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, widths[0], generator=gen).to(dtype), torch.randn(batch, widths[-1], generator=gen).to(dtype)


def _grads_at(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of the mean squared error at ``model``'s parameters (on a copy: ``model`` is untouched)."""
    import copy

    twin = copy.deepcopy(model)
    twin.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(twin(x), y).backward()
    return [p.grad.detach().clone() for p in twin.parameters()]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def _ddp_rank(rank: int, world_size: int, path: str, name: str, cases: list[dict], report: str) -> list[dict]:
    """One rank of :func:`bucketed_ddp`: every case, measured."""
    import copy

    import torch.distributed as dist

    from labkit.dist import CommMeter, bucket_plan

    out = []
    with _ReportErrors(report, rank) as errors:
        cls = _load_class(path, name)
        for case in cases:
            dtype = getattr(torch, case["dtype"])
            reference = _mlp(case["widths"], dtype, case["seed"])  # rank 0's weights: every rank must start from them
            model = copy.deepcopy(reference) if rank == 0 else _mlp(case["widths"], dtype, case["seed"] + 1 + rank)
            x, y = _batch(case["widths"], case["batch"], dtype, case["seed"] + 99)
            rows = slice(rank * case["batch"] // world_size, (rank + 1) * case["batch"] // world_size)
            plan = bucket_plan(list(model.parameters()), case["bucket_cap_bytes"])
            errors.tried = f"{name}(model, buckets={plan}) {case['label']}"
            ddp = cls(model, plan)
            result = {"start_diff": (_flat(model.parameters()) - _flat(reference.parameters())).abs().max().item(),
                      "buckets": len(plan),
                      "numel": sum(p.numel() for p in model.parameters()), "steps": []}
            worst = torch.tensor([result["start_diff"]], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank must take the same branch (or they would hang)
            if worst.item() > 0:
                out.append(result)
                continue
            for step in range(case["steps"]):
                errors.tried = f"{name}: training step {step + 1} {case['label']}"
                expected, own = _grads_at(model, x, y), _grads_at(model, x[rows], y[rows])
                model.zero_grad(set_to_none=True)
                with CommMeter() as meter, _AllReduceLog() as log:
                    loss = torch.nn.functional.mse_loss(ddp(x[rows]), y[rows])
                    log.in_backward = True
                    loss.backward()
                    log.in_backward = False
                    ddp.finish_gradient_synchronization()
                grads = [p.grad for p in model.parameters()]
                result["steps"].append({
                    "calls": log.calls, "sent": dict(meter.sent), "missing": sum(g is None for g in grads),
                    "dtypes": sorted({str(g.dtype) for g in grads if g is not None}),
                    "grad": _flat(g if g is not None else torch.zeros_like(p) for g, p in zip(grads, model.parameters())),
                    "expected": _flat(expected), "own": _flat(own)})
                reference.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(reference(x), y).backward()
                with torch.no_grad():  # plain SGD by hand: the first torch.optim optimizer costs each rank ~2 s of imports
                    for p, q in zip(model.parameters(), reference.parameters()):
                        p -= case["lr"] * p.grad
                        q -= case["lr"] * q.grad
            result["param_diff"] = (_flat(model.parameters()) - _flat(reference.parameters())).abs().max().item()
            result["param_scale"] = _flat(reference.parameters()).abs().max().item()
            out.append(result)
    return out


_OPTIMIZERS = {"SGD": (torch.optim.SGD, {"lr": 0.1}), "SGD with momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
               "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.1})}


def _zero_rank(rank: int, world_size: int, path: str, name: str, cases: list[dict], report: str) -> list[dict]:
    """One rank of :func:`zero1_optimizer`: every case, measured."""
    import copy

    from labkit.dist import CommMeter

    out = []
    with _ReportErrors(report, rank) as errors:
        cls = _load_class(path, name)
        for case in cases:
            optimizer_cls, kwargs = _OPTIMIZERS[case["optimizer"]]
            model = _mlp(case["widths"], torch.float32, case["seed"])  # the same on every rank
            reference = copy.deepcopy(model)
            ref_optimizer = optimizer_cls(reference.parameters(), **kwargs)
            x, y = _batch(case["widths"], case["batch"], torch.float32, case["seed"] + 99)
            rows = slice(rank * case["batch"] // world_size, (rank + 1) * case["batch"] // world_size)
            errors.tried = f"{name}(model.parameters(), {optimizer_cls.__module__}.{optimizer_cls.__name__}, **{kwargs}) {case['label']}"
            zero = cls(list(model.parameters()), optimizer_cls, **kwargs)
            result = {"numel": sum(p.numel() for p in model.parameters()), "steps": []}
            for step in range(case["steps"]):
                errors.tried = f"{name}.step(), training step {step + 1} {case['label']}"
                before = _flat(model.parameters())
                expected, own = _grads_at(model, x, y), _grads_at(model, x[rows], y[rows])
                model.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
                grads = [p.grad.clone() for p in model.parameters()]
                with CommMeter() as meter:
                    zero.step()
                result["steps"].append({
                    "sent": dict(meter.sent), "calls": dict(meter.calls), "before": before, "after": _flat(model.parameters()),
                    "expected": _flat(expected), "own": _flat(own),
                    "grads_changed": any(p.grad is None or not torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))})
                reference.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(reference(x), y).backward()
                ref_optimizer.step()
            errors.tried = f"reading {name}'s .optimizer {case['label']}"
            inner = getattr(zero, "optimizer", None)
            stepped = [p for group in inner.param_groups for p in group["params"]] if isinstance(inner, torch.optim.Optimizer) else None
            result.update(
                optimizer=type(inner).__name__ if inner is not None else None,
                stepped=[(p.numel(), str(p.dtype), p.untyped_storage().nbytes()) for p in stepped] if stepped is not None else None,
                state_bytes=optimizer_state_bytes(inner) if stepped is not None else None,
                param_diff=(_flat(model.parameters()) - _flat(reference.parameters())).abs().max().item(),
                param_scale=_flat(reference.parameters()).abs().max().item(), final=_flat(model.parameters()))
            out.append(result)
    return out


def _run_ranks(rank_fn, cls, exercise: str, world_size: int, cases: list[dict], timeout: float = 40) -> dict:
    """Launch ``rank_fn`` for the learner's class on ``world_size`` gloo ranks; a learner's exception
    (on whichever rank raised first) or a hang becomes a CheckFailed."""
    from labkit.checks._remote import Remote, apply
    from labkit.dist import RankFailedError, launch

    if isinstance(cls, Remote):  # labkit.grade: the ranks start from the learner's kernel, their reports come back
        return apply(_run_ranks, rank_fn, cls, exercise, world_size, cases, timeout)
    path, name = _exercise_file(cls, exercise)
    with tempfile.TemporaryDirectory(prefix="labkit-grader-") as report:
        try:
            return launch(rank_fn, world_size=world_size, backend="gloo", timeout=timeout, quiet=True,
                          path=path, name=name, cases=cases, report=report)
        except RankFailedError as err:
            reports = [json.loads(f.read_text()) for f in Path(report).glob("error_*.json")]
            if not reports:
                hint = ("every rank must call the same collectives in the same order (a rank waiting in a collective the "
                        "others never call hangs), and every handle must be waited" if "did not finish" in str(err) else
                        "read the rank's traceback above")
                fail(f"labkit.checks.{exercise}({name}) on {world_size} gloo ranks", str(err).splitlines()[0] + "\n"
                     + "\n".join(str(err).splitlines()[1:])[-1500:], "every rank to finish", hint)
            first = min(reports, key=lambda r: r["time"])
            if first["type"] == "NotImplementedError":
                hint = ("write your answer in place of the `raise NotImplementedError(...)` line, run the %%writefile "
                        "cell and the import cell again, then this one")
            elif "size" in first["message"] or "shape" in first["message"]:
                hint = ("reduce_scatter_tensor's input must hold exactly world_size × the output's elements, and "
                        "all_gather_into_tensor's output world_size × the input's: pad the flat buffer with zeros to the "
                        "next multiple of the world size")
            else:
                hint = "run the failing call yourself: the lines above show where it raised"
            raise CheckFailed(f"\n  tried:    {first['tried']} (rank {first['rank']} of {world_size}, gloo)\n"
                              f"  raised:   {first['type']}: {first['message']}\n  where:    "
                              + first["where"].strip().replace("\n", "\n            ") + f"\n  hint:     {hint}") from None


def _relative_error(got: torch.Tensor, target: torch.Tensor) -> float:
    return ((got - target).abs().max() / target.abs().max().clamp_min(1e-12)).item()


def _closest(got: torch.Tensor, candidates: dict[str, torch.Tensor], tol: float) -> str | None:
    """The name of the candidate ``got`` equals (relative error below ``tol``), the closest first; None if none."""
    errors = {name: _relative_error(got, c) for name, c in candidates.items() if c.shape == got.shape}
    matches = sorted((e, name) for name, e in errors.items() if e < tol)
    return matches[0][1] if matches else None


def _ddp_cases(rng: random.Random, world: int) -> list[dict]:
    cases = []
    for dtype, steps, buckets in (("float32", 3, rng.randint(3, 5)), ("bfloat16", 1, rng.randint(2, 4)), ("float32", 2, 1)):
        widths = [rng.randint(3, 24) for _ in range(rng.randint(3, 5))]
        numel = sum(a * b + b for a, b in zip(widths, widths[1:]))
        size = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
        cap = 25 * 2**20 if buckets == 1 else int(numel * size / buckets * rng.uniform(0.9, 1.1))
        batch = world * rng.randint(2, 4)
        cases.append(dict(widths=widths, dtype=dtype, steps=steps, bucket_cap_bytes=cap, batch=batch, lr=0.2,
                          seed=rng.randrange(10**6),
                          label=f"({world} ranks, {dtype} MLP of widths {widths}: {numel} parameters, a batch of {batch} "
                                f"rows split over the ranks, {steps} SGD step(s))"))
    return cases


def bucketed_ddp(cls) -> None:
    """Grades the learner's ``BucketedDDP(module, buckets)`` (a class in a file the notebook writes; ``buckets``
    is a bucket plan: lists of indices into ``list(module.parameters())``, as :func:`bucket_plan` returns them):
    on 4 gloo ranks, for fp32 and bf16 MLPs of random widths and bucket caps, it must start every rank
    from rank 0's parameters, all-reduce each bucket of the plan (:func:`labkit.dist.bucket_plan`'s) once,
    asynchronously, from gradient hooks *during* backward, wait for every handle in
    ``finish_gradient_synchronization()``, leave the mean gradient (in the parameters' dtype) in each
    ``.grad``, send ``2(N-1)/N`` of the gradients' bytes per step, and train like one process on the
    whole batch (SGD, whose step shows a wrongly scaled gradient)."""
    world = 4
    cases = _ddp_cases(random.Random(), world)
    results = _run_ranks(_ddp_rank, cls, "bucketed_ddp", world, cases)
    name = cls.__qualname__
    for i, case in enumerate(cases):
        tried = f"{name}: {case['label']}"
        starts = {r: results[r][i]["start_diff"] for r in results}
        if any(starts.values()):
            rank = max(starts, key=starts.get)
            fail(tried, f"after {name}(...) rank {rank}'s parameters differ from rank 0's by up to {starts[rank]:.3g}",
                 "every rank starting from rank 0's parameters",
                 "broadcast rank 0's parameters in __init__ (dist.broadcast(p.data, src=0) for each parameter): the ranks "
                 "build their models independently")
        buckets, numel = results[0][i]["buckets"], results[0][i]["numel"]
        size = torch.tensor([], dtype=getattr(torch, case["dtype"])).element_size()
        tol = 1e-4 if case["dtype"] == "float32" else 5e-2
        for step in range(case["steps"]):
            at = f"{tried}, step {step + 1}"
            later = (" (right at step 1: does finish_gradient_synchronization reset the per-step state, e.g. the "
                     "count of ready gradients per bucket?)" if step else "")
            for rank in sorted(results):
                st = results[rank][i]["steps"][step]
                calls, during = st["calls"], sum(c["backward"] for c in st["calls"])
                if not calls:
                    fail(f"{at}, rank {rank}", "no call of dist.all_reduce", f"{buckets} (one per bucket)",
                         "all-reduce each bucket's flattened gradients with dist.all_reduce(flat, async_op=True) (the grader "
                         "counts calls made through torch.distributed, i.e. `dist.all_reduce(...)`)" + later)
                if during == 0:
                    fail(f"{at}, rank {rank}", f"{len(calls)} all-reduce call(s), all after backward had finished",
                         f"{buckets} launched during backward, from gradient hooks",
                         "register a hook on every parameter (p.register_post_accumulate_grad_hook(fn)) and launch a "
                         "bucket's all-reduce from it as soon as the bucket's last gradient is ready: communication then "
                         "overlaps with the rest of backward" + later)
                if not all(c["async"] for c in calls):
                    fail(f"{at}, rank {rank}", "a blocking dist.all_reduce(...) (async_op=False)", "async_op=True",
                         "a blocking all-reduce inside a hook stops backward until it is done: launch it with "
                         "async_op=True, keep the handle, and wait for it in finish_gradient_synchronization")
                if len(calls) != buckets or during != buckets:
                    fail(f"{at}, rank {rank}", f"{len(calls)} all-reduce call(s), {during} of them during backward",
                         f"{buckets}, one per bucket of the plan passed in, all during backward",
                         "group the parameters as the plan says (buckets[b] lists indices into list(module.parameters())), flatten "
                         "a bucket's gradients into one buffer and all-reduce it once, when its last gradient is ready "
                         "(the last bucket fills during backward too)" + later)
                if not all(c["waited"] for c in calls):
                    fail(f"{at}, rank {rank}", f"{sum(not c['waited'] for c in calls)} of {len(calls)} handles never waited",
                         "handle.wait() for every all-reduce before finish_gradient_synchronization returns",
                         "an async all-reduce may still be running when the optimizer reads the gradient: keep the handles "
                         "and call .wait() on each in finish_gradient_synchronization")
                if st["missing"]:
                    fail(f"{at}, rank {rank}", f"{st['missing']} parameter(s) with .grad None after finish", "every .grad set",
                         "copy each bucket's averaged values back into its parameters' .grad")
                if st["dtypes"] != [f"torch.{case['dtype']}"]:
                    fail(f"{at}, rank {rank}", f"gradients of dtype {st['dtypes']}", f"torch.{case['dtype']}",
                         "flatten and all-reduce the gradients in their own dtype (torch.cat keeps it); copy the result back "
                         "with p.grad.copy_(...)")
                world_sum = st["expected"] * world
                match = _closest(st["grad"], {"mean": st["expected"], "sum": world_sum, "own": st["own"],
                                              "twice": st["expected"] / world}, tol)
                if match != "mean":
                    hints = {"sum": "that is the SUM over the ranks: divide by the world size (the mean over the whole batch)",
                             "own": "that is this rank's own gradient: the all-reduced buffer never reached .grad (wait for "
                                    "the handle, then copy the flat buffer back into each parameter's .grad)",
                             "twice": "that is the mean divided by the world size once more: divide exactly once",
                             None: "wait for each bucket's all-reduce, divide the flat buffer by the world size and copy it "
                                   "back into its parameters' .grad in bucket order (torch._utils._unflatten_dense_tensors)"}
                    fail(f"{at}, rank {rank}", f".grad {hints[match].split(':')[0] if match else 'values'} "
                         f"(largest relative difference to the mean gradient {_relative_error(st['grad'], st['expected']):.3g})",
                         "the mean gradient over the whole batch (what one process computes)", hints[match] + later)
                expected_sent = 2 * (world - 1) / world * numel * size
                sent = sum(st["sent"].values())
                if abs(sent - expected_sent) > 0.5:
                    fail(f"{at}, rank {rank}", f"{sent:,.0f} bytes sent per step ({st['sent']})",
                         f"{expected_sent:,.0f} = 2(N-1)/N × {numel} gradients × {size} B (one ring all-reduce of each)",
                         "all-reduce every gradient exactly once, in its own dtype, and call no other collective per step")
        if case["dtype"] == "float32":
            diff, scale = results[0][i]["param_diff"], results[0][i]["param_scale"]
            if not diff <= 1e-4 * max(scale, 1.0):
                fail(tried, f"parameters after training up to {diff:.3g} away from one process's",
                     "the single-process parameters up to float rounding", "check the gradient averaging at every step")
    passed("bucketed_ddp", f"on {world} gloo ranks every bucket is all-reduced once, asynchronously, during backward; "
                           "SGD training matches one process (every parameter within 1e-4 of it; the difference is printed when it "
                           "is not); "
                           "2(N-1)/N of the gradient bytes sent per step")


def _zero_cases(rng: random.Random, world: int) -> list[dict]:
    cases = []
    plans = [("SGD", 2, rng.choice([1, 2])), ("SGD with momentum", 2, 0), ("AdamW", 2, rng.choice([1, 2])), ("SGD", 1, None)]
    for optimizer, steps, remainder in plans:
        if remainder is None:
            widths = [1, 1]  # 2 parameters on 3 ranks: a shard of 1 element, the last rank's all padding
        else:
            while True:
                widths = [rng.randint(2, 16) for _ in range(rng.randint(3, 4))]
                numel = sum(a * b + b for a, b in zip(widths, widths[1:]))
                if numel % world == remainder:
                    break
        numel = sum(a * b + b for a, b in zip(widths, widths[1:]))
        batch = world * rng.randint(2, 3)
        cases.append(dict(widths=widths, optimizer=optimizer, steps=steps, batch=batch, seed=rng.randrange(10**6),
                          label=f"({world} ranks, {optimizer}, MLP of widths {widths}: {numel} parameters, {numel % world} "
                                f"over a multiple of {world}, a batch of {batch} rows split over the ranks, {steps} step(s))"))
    return cases


def _zero_value_hint(st: dict, rank: int, world: int, lr: float, numel: int) -> str:
    """What a wrong first SGD step looks like it did."""
    from labkit.dist import flat_shard_layout

    _, shard = flat_shard_layout(numel, world)
    before, after, mean = st["before"], st["after"], st["expected"]
    right = before - lr * mean
    mine = torch.zeros(numel, dtype=torch.bool)
    mine[rank * shard:(rank + 1) * shard] = True
    candidates = {"sum": before - lr * world * mean, "own": before - lr * st["own"], "unchanged": before,
                  "grads": mean, "summed grads": world * mean, "own shard only": torch.where(mine, right, before)}
    hints = {
        "sum": "the parameters moved by the SUM of the ranks' gradients: divide the reduce-scattered shard by the world size",
        "own": "each rank stepped with its own gradient: step with the reduce-scattered (summed, then divided) shard",
        "unchanged": "the model's parameters did not change: copy the all-gathered flat parameters back into them "
                     "(p.copy_(...) for each parameter, in order)",
        "grads": "the parameters now hold the gradients: all-gather the updated parameter shard, not the gradient shard",
        "summed grads": "the parameters now hold the summed gradients: all-gather the updated parameter shard, not the gradients",
        "own shard only": "only this rank's own shard of the parameters changed: all-gather the updated shards of every "
                          "rank and copy the whole flat buffer back into the parameters",
    }
    match = _closest(after, candidates, 1e-5)
    if match:
        return hints[match]
    wrong = sorted({int(i) // shard for i in torch.nonzero((after - right).abs() > 1e-5 * right.abs().max()).flatten()})
    return (f"the elements of the shard(s) of rank(s) {wrong} are wrong (shards of {shard} elements): rank r owns elements "
            f"[r·S, (r+1)·S) of the flat parameters padded with zeros AT THE END to the next multiple of N; take the "
            "shard at that offset in __init__, step it with the reduce-scattered gradient shard, and copy the gathered "
            "buffer back parameter by parameter in order")


def zero1_optimizer(cls) -> None:
    """Grades the learner's paper-style ZeRO-1 ``ZeroOneOptimizer(params, optimizer_cls, **kwargs)`` (a class in a
    file the notebook writes): on 3 gloo ranks, for MLPs of random widths whose parameter count is, and is not, a
    multiple of 3 (down to 2 parameters on 3 ranks), with SGD, SGD with momentum and AdamW, each ``step()`` must
    reduce-scatter one flat, zero-padded gradient buffer, divide by the world size, step this rank's fp32 shard
    with ``self.optimizer`` (an ``optimizer_cls`` over one tensor of ``padded / N`` elements, so its state is 1/N),
    all-gather the parameters and copy them back, leave the gradients alone, send exactly ``2(N-1)/N`` of the
    padded buffer's bytes, and train like the unsharded optimizer on the whole batch."""
    from labkit.dist import flat_shard_layout

    world = 3
    cases = _zero_cases(random.Random(), world)
    results = _run_ranks(_zero_rank, cls, "zero1_optimizer", world, cases)
    name = cls.__qualname__
    for i, case in enumerate(cases):
        tried = f"{name}: {case['label']}"
        numel = results[0][i]["numel"]
        padded, shard = flat_shard_layout(numel, world)
        for step in range(case["steps"]):
            at = f"{tried}, step {step + 1}"
            for rank in sorted(results):
                st = results[rank][i]["steps"][step]
                if st["grads_changed"]:
                    fail(f"{at}, rank {rank}", "the parameters' .grad changed by step()", "the gradients left as they were",
                         "work on the flat copy (torch.cat makes one); an in-place op on p.grad changes the caller's gradients")
                calls = st["calls"]
                if calls.get("reduce_scatter") != 1 or calls.get("all_gather") != 1 or len(calls) != 2:
                    if calls.get("all_reduce"):
                        hint = ("all-reducing the gradients gives every rank the whole sum, of which it uses 1/N: "
                                "reduce-scatter the flat gradient buffer instead (dist.reduce_scatter_tensor)")
                    elif not calls.get("all_gather"):
                        hint = ("all-gather the updated shards (dist.all_gather_into_tensor) so that every rank gets the "
                                "whole updated model")
                    else:
                        hint = ("one dist.reduce_scatter_tensor of the flat gradient buffer and one "
                                "dist.all_gather_into_tensor of the updated shards per step, nothing else")
                    fail(f"{at}, rank {rank}", f"collective calls per step {calls or 'none'}",
                         "{'reduce_scatter': 1, 'all_gather': 1}", hint)
                if step == 0 and case["optimizer"] != "AdamW":
                    lr = _OPTIMIZERS[case["optimizer"]][1]["lr"]
                    right = st["before"] - lr * st["expected"]
                    if _relative_error(st["after"], right) > 1e-5:
                        fail(f"{at}, rank {rank}", f"parameters up to {(st['after'] - right).abs().max().item():.3g} away "
                             "from one SGD step with the mean gradient", "the parameters of the unsharded optimizer",
                             _zero_value_hint(st, rank, world, lr, numel))
                sent, expected_sent = sum(st["sent"].values()), 2 * (world - 1) / world * padded * 4
                if abs(sent - expected_sent) > 0.5:
                    fail(f"{at}, rank {rank}", f"{sent:,.0f} bytes sent per step ({st['sent']})",
                         f"{expected_sent:,.0f} = 2(N-1)/N × {padded} padded fp32 elements ({numel} parameters)",
                         f"pad the flat buffers with zeros to the NEXT multiple of the world size ({padded}), reduce-scatter "
                         f"the whole gradient buffer and all-gather shards of {shard} elements")
        for rank in sorted(results):
            r = results[rank][i]
            if r["stepped"] is None:
                fail(f"{tried}, rank {rank}", f"{name}.optimizer is {r['optimizer']}", f"a {case['optimizer'].split()[0]} optimizer",
                     "keep the optimizer of this rank's shard in self.optimizer = optimizer_cls([shard], **kwargs)")
            if r["stepped"] != [(shard, "torch.float32", shard * 4)]:
                fail(f"{tried}, rank {rank}", f"self.optimizer steps tensors of (elements, dtype, storage bytes) {r['stepped']}",
                     f"one fp32 tensor of {shard} = {padded}/{world} elements, in its own storage of {shard * 4} bytes",
                     "the optimizer steps only this rank's shard (so that its state is 1/N of the whole): a .clone() of "
                     "elements [rank·S, (rank+1)·S) of the padded flat fp32 parameters, not a view of a full-size buffer "
                     "and not the model's parameters")
            if not torch.equal(r["final"], results[0][i]["final"]):
                fail(f"{tried}, rank {rank}", "parameters different from rank 0's after training", "the same model on every rank",
                     "copy the whole all-gathered buffer (every rank's shard) back into the parameters")
        diff, scale = results[0][i]["param_diff"], results[0][i]["param_scale"]
        if not diff <= 1e-4 * max(scale, 1.0):
            fail(tried, f"parameters after training up to {diff:.3g} away from the unsharded optimizer's", "the same "
                 "parameters up to float rounding", "step with the mean gradient shard (reduce-scatter, then divide by the "
                 "world size) and hand the optimizer the same shard tensor at every step (its state belongs to it)")
    passed("zero1_optimizer", f"on {world} gloo ranks: reduce-scatter, step on a 1/N shard, all-gather, "
                              f"2(N-1)/N of the padded buffer sent per step; SGD, momentum and AdamW match the unsharded "
                              "optimizer (every parameter within 1e-4 of it)")
