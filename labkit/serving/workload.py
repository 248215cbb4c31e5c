"""Workloads for the engine and what to measure on them.

* :func:`mixed_workload`: a seeded stream of requests with mixed prompt lengths, mixed output lengths (mostly short
  answers, a fraction of long ones: the mix where static batching waits for its longest member) and Poisson
  arrivals at an offered load (requests per second; ``None``: all at once);
* :func:`serve`: feeds a workload to an :class:`~labkit.serving.engine.Engine` by the clock (a request is added
  when its arrival time has come) and steps until all are done;
* :class:`ServeMetrics` (:func:`metrics`): tokens/s, time to first token and time per output token (median and
  p99), queueing time;
* :func:`compare_batching`: the same workload through static batching, continuous batching, and continuous
  batching with chunked prefill, on the same model and pool;
* :func:`decode_cost`: the time of one decode step against the batch size, split by a straight-line fit into a
  fixed cost per step (Python, per-op overhead) and a cost per token (the work that grows with the batch);
* :func:`kv_usage`: per step, KV slots holding a token vs slots the paged pool hands out vs what reserving each
  running request a contiguous max-length buffer would take.
"""
from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass

from labkit.model import TransformerLM
from labkit.serving.blocks import blocks_for
from labkit.serving.engine import Engine, RequestOutput, StepTrace

__all__ = ["WorkloadRequest", "mixed_workload", "ServeResult", "serve", "ServeMetrics", "metrics",
           "compare_batching", "DecodeCost", "decode_cost", "KVUsage", "kv_usage", "percentile"]


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload: ``prompt_ids``, ``max_new_tokens`` and ``arrival`` (seconds after the start)."""

    prompt_ids: tuple
    max_new_tokens: int
    arrival: float


def mixed_workload(num_requests: int, vocab_size: int, rate: float | None = None, prompt_len: tuple = (4, 32),
                   short_output: tuple = (2, 8), long_output: tuple = (48, 64), long_fraction: float = 0.1,
                   shared_prefix_len: int = 0, seed: int = 0) -> list[WorkloadRequest]:
    """``num_requests`` requests drawn with Python's ``random`` seeded by ``seed`` (the same integers on every
    machine): prompt lengths uniform in ``prompt_len`` (inclusive), random token ids below ``vocab_size``; output
    lengths uniform in ``long_output`` with probability ``long_fraction``, else in ``short_output``; arrivals a
    Poisson process of ``rate`` requests/s (exponential gaps; ``None``: all arrive at 0). With
    ``shared_prefix_len`` every prompt starts with the same that many tokens (a system prompt), which prefix
    caching can share."""
    for name, value in (("num_requests", num_requests), ("vocab_size", vocab_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0):
        raise ValueError(f"rate={rate!r}: expected requests per second > 0, or None (all arrive at once)")
    for name, span in (("prompt_len", prompt_len), ("short_output", short_output), ("long_output", long_output)):
        if (not isinstance(span, tuple) or len(span) != 2 or not all(isinstance(v, int) for v in span)
                or not 1 <= span[0] <= span[1]):
            raise ValueError(f"{name}={span!r}: expected a tuple (low, high) of integers, 1 <= low <= high")
    if not 0 <= long_fraction <= 1:
        raise ValueError(f"long_fraction={long_fraction!r}: expected a fraction in [0, 1]")
    if isinstance(shared_prefix_len, bool) or not isinstance(shared_prefix_len, int) or shared_prefix_len < 0:
        raise ValueError(f"shared_prefix_len={shared_prefix_len!r}: expected an integer >= 0")
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(shared_prefix_len)]
    requests, clock = [], 0.0
    for _ in range(num_requests):
        prompt = prefix + [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_len))]
        span = long_output if rng.random() < long_fraction else short_output
        requests.append(WorkloadRequest(tuple(prompt), rng.randint(*span), clock))
        if rate is not None:
            clock += rng.expovariate(rate)
    return requests


@dataclass(frozen=True)
class ServeResult:
    """What :func:`serve` returns: the ``outputs`` (in request order), the ``seconds`` from start to the last
    finish, and the engine's per-step ``trace``."""

    outputs: tuple
    seconds: float
    trace: tuple


def serve(engine: Engine, workload: list[WorkloadRequest], sleep=time.sleep) -> ServeResult:
    """Run ``workload`` through ``engine`` in real time: each request is added once the engine's clock has passed
    its arrival (and is timed from its arrival, not from when it was added); the engine steps while it has work and
    waits (``sleep``) for the next arrival when idle. Returns a :class:`ServeResult`."""
    if not isinstance(engine, Engine):
        raise TypeError(f"engine: expected a labkit.serving.Engine, got {type(engine).__name__}")
    if not all(isinstance(r, WorkloadRequest) for r in workload):
        raise TypeError("workload: expected a list of WorkloadRequest (see mixed_workload)")
    pending = sorted(range(len(workload)), key=lambda i: workload[i].arrival)  # indices, in arrival order
    order, outputs = {}, {}
    first_step = len(engine.trace)
    start = engine.clock()
    index = 0
    while index < len(pending) or engine.has_unfinished:
        now = engine.clock() - start
        while index < len(pending) and workload[pending[index]].arrival <= now:
            request = workload[pending[index]]
            request_id = engine.add_request(list(request.prompt_ids), request.max_new_tokens,
                                            arrival_time=start + request.arrival)
            order[request_id] = pending[index]
            index += 1
        if engine.has_unfinished:
            for output in engine.step():
                outputs[order[output.request_id]] = output
        elif index < len(pending):
            sleep(max(0.0, workload[pending[index]].arrival - (engine.clock() - start)))
    last = max((o.finish_time for o in outputs.values()), default=start)
    return ServeResult(tuple(outputs[i] for i in range(len(workload))), last - start, tuple(engine.trace[first_step:]))


def percentile(values, q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear between closest ranks (numpy's default)."""
    values = sorted(values)
    if not values:
        raise ValueError("values: expected at least one value")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q!r}: expected a percentile in [0, 100]")
    rank = (len(values) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (rank - low)


@dataclass(frozen=True)
class ServeMetrics:
    """Throughput and latency of one served workload (seconds): ``tokens_per_s`` (generated tokens / wall time
    from start to the last finish), ``ttft_median``/``ttft_p99`` (time to first token), ``tpot_median``/
    ``tpot_p99`` (time per output token after the first), ``queueing_median``, with the counts they come from."""

    num_requests: int
    generated_tokens: int
    seconds: float
    tokens_per_s: float
    ttft_median: float
    ttft_p99: float
    tpot_median: float
    tpot_p99: float
    queueing_median: float


def metrics(result: ServeResult) -> ServeMetrics:
    """:class:`ServeMetrics` of a :func:`serve` result."""
    if not isinstance(result, ServeResult):
        raise TypeError(f"result: expected a ServeResult (from serve), got {type(result).__name__}")
    outputs: tuple[RequestOutput, ...] = result.outputs
    tokens = sum(len(o.output_ids) for o in outputs)
    ttft = [o.ttft for o in outputs]
    tpot = [o.tpot for o in outputs if len(o.output_ids) > 1] or [0.0]
    return ServeMetrics(len(outputs), tokens, result.seconds, tokens / result.seconds, statistics.median(ttft),
                        percentile(ttft, 99), statistics.median(tpot), percentile(tpot, 99),
                        statistics.median(o.queueing_time for o in outputs))


def compare_batching(model: TransformerLM, workload: list[WorkloadRequest], block_size: int, num_blocks: int,
                     max_batch_tokens: int, max_num_seqs: int, prefix_caching: bool = False) -> dict:
    """Serve ``workload`` three ways on ``model`` with the same pool and batch limits: ``"static"`` (batches of up
    to ``max_num_seqs``, each waiting for its longest), ``"continuous"`` (iteration-level batching, whole-prompt
    prefills) and ``"continuous + chunked prefill"``. Returns name -> :class:`ServeResult`. Each engine first
    serves one request untimed, so one-off costs (first calls into torch's kernels) are not charged to it."""
    setups = {"static": dict(batching="static", chunked_prefill=False),
              "continuous": dict(chunked_prefill=False),
              "continuous + chunked prefill": dict(chunked_prefill=True)}
    results = {}
    for name, options in setups.items():
        engine = Engine(model, block_size, num_blocks, max_batch_tokens, max_num_seqs=max_num_seqs,
                        prefix_caching=prefix_caching, **options)
        engine.add_request(list(workload[0].prompt_ids), 2)
        engine.run()
        results[name] = serve(engine, workload)
    return results


@dataclass(frozen=True)
class DecodeCost:
    """Decode-step times (medians, seconds) per batch size, and the least-squares line ``step = fixed + per_token *
    batch`` through them: ``fixed`` is what a step costs whatever its size (overhead), ``per_token`` what each
    request adds. :attr:`crossover` is the batch size from which the growing part outweighs the fixed one."""

    batch_sizes: tuple
    step_seconds: tuple
    fixed: float
    per_token: float

    @property
    def per_token_seconds(self) -> tuple:
        """Each batch size's step time divided by the tokens it produced."""
        return tuple(t / b for t, b in zip(self.step_seconds, self.batch_sizes))

    @property
    def crossover(self) -> float:
        """``fixed / per_token``: at larger batches most of a step's time grows with the batch."""
        return self.fixed / self.per_token if self.per_token > 0 else math.inf


def decode_cost(model: TransformerLM, batch_sizes=(1, 2, 4, 8, 16, 32), prompt_len: int = 16, steps: int = 10,
                block_size: int = 16) -> DecodeCost:
    """Time ``steps`` decode steps of the engine (after the prefill and one untimed step) at each batch size: that
    many requests of ``prompt_len`` tokens decoding together. Returns a :class:`DecodeCost` (median step times and
    their straight-line fit)."""
    sizes = tuple(batch_sizes)
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise ValueError(f"batch_sizes={batch_sizes!r}: expected positive integers")
    for name, value in (("prompt_len", prompt_len), ("steps", steps), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    medians = []
    for batch in sizes:
        per_request = blocks_for(prompt_len + steps + 2, block_size)
        engine = Engine(model, block_size, batch * per_request, batch * prompt_len, max_num_seqs=batch,
                        prefix_caching=False)
        for i in range(batch):
            engine.add_request([(i + t) % model.config.vocab_size for t in range(prompt_len)], steps + 3)
        engine.step()  # the prefill
        engine.step()  # one untimed decode
        seconds = []
        for _ in range(steps):  # every request is still decoding: each step is a full batch of decodes
            engine.step()
            seconds.append(engine.trace[-1].seconds)
        medians.append(statistics.median(seconds))
    mean_b, mean_t = statistics.fmean(sizes), statistics.fmean(medians)
    spread = sum((b - mean_b) ** 2 for b in sizes)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in zip(sizes, medians)) / spread if spread else 0.0
    return DecodeCost(sizes, tuple(medians), mean_t - slope * mean_b, slope)


@dataclass(frozen=True)
class KVUsage:
    """KV-cache slots at one step: ``used`` (holding a token), ``paged`` (blocks in use * block_size) and
    ``contiguous`` (each running request given ``max_len`` slots up front), for ``running`` requests."""

    step: int
    running: int
    used: int
    paged: int
    contiguous: int


def kv_usage(trace, block_size: int, max_len: int) -> list[KVUsage]:
    """Per step of ``trace`` (:class:`~labkit.serving.engine.StepTrace` s), the slots a paged cache of
    ``block_size`` hands out vs a contiguous reservation of ``max_len`` slots per running request (what a server
    that preallocates for the longest possible sequence, e.g. the model's context length, reserves)."""
    for name, value in (("block_size", block_size), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    if not all(isinstance(t, StepTrace) for t in trace):
        raise TypeError("trace: expected StepTrace entries (engine.trace or ServeResult.trace)")
    return [KVUsage(t.step, len(t.running), t.filled_slots, t.blocks_in_use * block_size, len(t.running) * max_len)
            for t in trace]
