"""A small but real LLM inference engine: continuous batching over a paged KV cache.

``Engine(model, block_size, num_blocks, max_batch_tokens)`` serves many requests at once on a
:class:`labkit.model.TransformerLM`. Each :meth:`Engine.step` is one iteration (Orca, vLLM):

1. plan (:func:`labkit.serving.scheduler.plan_step`): which running requests decode, which prefill (a chunk),
   which waiting ones join, which are preempted, under the token budget and the free KV blocks;
2. carry the plan out on the :class:`labkit.serving.blocks.BlockManager`: free preempted requests' blocks, give
   joining requests their cached prompt prefix, reserve slots (copy-on-write where a slot lies in a shared block);
3. one packed forward pass over all scheduled tokens (:func:`labkit.serving.runner.forward_packed`), writing K/V
   into the pools of a :class:`labkit.attention_variants.PagedKVCache`;
4. sample the next token of every request whose tokens are all computed (:mod:`labkit.serving.sampling`); requests
   that reach ``max_new_tokens`` finish and free their blocks at once, so the next step can admit others.

``batching="static"`` turns the same machinery into the baseline every serving paper compares against (a
``generate`` call on a padded batch): a batch of up to ``max_num_seqs`` requests from the head of the queue is admitted
only when the previous batch has completely finished and when the pool can hold every member at the batch's longest
output; all prompts are prefilled in one pass; then every member decodes until the longest is done, the ones already
done computing padding tokens that are thrown away, and all outputs are released together.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from labkit.attention_variants import PagedKVCache
from labkit.model import TransformerLM
from labkit.serving.blocks import BlockManager, blocks_for
from labkit.serving.runner import forward_packed, pack_batch
from labkit.serving.sampling import SamplingParams, sample_next
from labkit.serving.scheduler import SeqState, StepPlan, plan_step

__all__ = ["Engine", "RequestOutput", "StepTrace", "EngineStats", "BATCHING"]

BATCHING = ("continuous", "static")


@dataclass
class _Request:
    request_id: int
    prompt_ids: list
    max_new_tokens: int
    sampling: SamplingParams
    arrival_time: float
    generator: torch.Generator | None
    output_ids: list = field(default_factory=list)
    padding_ids: list = field(default_factory=list)  # static batching: tokens computed after its own output ended
    num_to_sample: int = 0  # tokens to sample before it leaves: max_new_tokens, or its static batch's longest
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of the prompt, supplied by the prefix cache at the first admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def token_ids(self) -> list:
        return self.prompt_ids + self.output_ids + self.padding_ids


@dataclass(frozen=True)
class RequestOutput:
    """A finished request: its ``prompt_ids`` and generated ``output_ids`` (tuples of ints) and timings in seconds
    of the engine's clock: ``arrival_time``, ``first_scheduled_time`` (its first prefill), ``first_token_time``,
    ``finish_time``; ``num_cached_tokens`` of its prompt came from the prefix cache; ``num_preemptions``."""

    request_id: int
    prompt_ids: tuple
    output_ids: tuple
    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    finish_time: float
    num_cached_tokens: int
    num_preemptions: int

    @property
    def queueing_time(self) -> float:
        """Seconds from arrival to the first step that computed any of its tokens."""
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float:
        """Time to first token: seconds from arrival until its first generated token existed."""
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float:
        """Time per output token after the first: ``(finish - first token) / (tokens - 1)`` (0 for one token)."""
        n = len(self.output_ids)
        return (self.finish_time - self.first_token_time) / (n - 1) if n > 1 else 0.0


@dataclass(frozen=True)
class StepTrace:
    """What one :meth:`Engine.step` did: ``scheduled`` lists ``(request_id, "prefill" | "decode", tokens)`` in
    batch order (a prefill that has not reached the prompt's end is a chunk); ``preempted``, ``admitted`` and
    ``finished`` are request ids; the rest is the state after the step: requests ``running`` and ``waiting``,
    ``blocks_in_use``, ``filled_slots`` (K/V slots holding a token; a shared block's slots counted once) and the
    step's wall-clock ``seconds``."""

    step: int
    scheduled: tuple
    preempted: tuple
    admitted: tuple
    finished: tuple
    running: tuple
    waiting: int
    blocks_in_use: int
    filled_slots: int
    seconds: float

    @property
    def num_tokens(self) -> int:
        """Tokens the step's forward pass computed."""
        return sum(n for _, _, n in self.scheduled)

    def describe(self) -> str:
        """One line a person can read, e.g. ``step 3: decode 0,1 | prefill 2:16 | preempt - | blocks 9``."""
        decodes = ",".join(str(r) for r, kind, _ in self.scheduled if kind == "decode") or "-"
        prefills = ",".join(f"{r}:{n}" for r, kind, n in self.scheduled if kind == "prefill") or "-"
        preempted = ",".join(map(str, self.preempted)) or "-"
        finished = ",".join(map(str, self.finished)) or "-"
        return (f"step {self.step}: decode {decodes} | prefill {prefills} | preempt {preempted} | "
                f"finish {finished} | waiting {self.waiting} | blocks {self.blocks_in_use}")


@dataclass(frozen=True)
class EngineStats:
    """Counters since the engine was built: ``steps``, ``preemptions``, ``generated_tokens``, ``computed_tokens``
    (all tokens through the model, recomputation included), ``prefix_hit_rate`` (prompt tokens the prefix cache
    supplied / prompt tokens looked up), ``blocks_in_use`` now and ``peak_blocks_in_use``."""

    steps: int
    preemptions: int
    generated_tokens: int
    computed_tokens: int
    prefix_hit_rate: float
    blocks_in_use: int
    peak_blocks_in_use: int


class Engine:
    """Serve requests on ``model`` with continuous batching over a paged KV cache of ``num_blocks`` blocks of
    ``block_size`` token slots; each step computes at most ``max_batch_tokens`` tokens for at most
    ``max_num_seqs`` running requests. ``chunked_prefill`` lets a long prompt be split over steps (sharing each
    step with the decodes); ``prefix_caching`` shares the K/V blocks of identical prompt prefixes; ``batching``
    is ``"continuous"`` or ``"static"`` (the baseline: see the module docstring). ``device`` defaults to the
    model's; the pools take the model's dtype. ``clock`` (seconds) times the requests."""

    def __init__(self, model: TransformerLM, block_size: int, num_blocks: int, max_batch_tokens: int,
                 max_num_seqs: int = 32, chunked_prefill: bool = True, prefix_caching: bool = True, device=None,
                 batching: str = "continuous", clock=time.perf_counter):
        if not isinstance(model, TransformerLM):
            raise TypeError(f"model: expected a labkit.model.TransformerLM, got {type(model).__name__}")
        for name, value in (("block_size", block_size), ("num_blocks", num_blocks),
                            ("max_batch_tokens", max_batch_tokens), ("max_num_seqs", max_num_seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an integer >= 1")
        for name, value in (("chunked_prefill", chunked_prefill), ("prefix_caching", prefix_caching)):
            if not isinstance(value, bool):
                raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
        if batching not in BATCHING:
            raise ValueError(f"batching={batching!r}: expected one of {BATCHING}")
        if not callable(clock):
            raise TypeError(f"clock: expected a callable returning seconds, got {type(clock).__name__}")
        weight = model.token_embeddings.weight
        self.device = torch.device(device) if device is not None else weight.device
        if self.device != weight.device:
            model = model.to(self.device)
        self.model = model
        config = model.config
        self.context_length = config.context_length
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_batch_tokens, self.max_num_seqs = max_batch_tokens, max_num_seqs
        self.chunked_prefill, self.prefix_caching, self.batching = chunked_prefill, prefix_caching, batching
        self.clock = clock
        # the pools of chapter 03's PagedKVCache, its allocator replaced by the reference-counting manager
        self.cache = PagedKVCache(config.num_layers, num_blocks, block_size, config.kv_heads, config.dim_per_head,
                                  dtype=weight.dtype, device=self.device)
        self.blocks = self.cache.allocator = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []  # oldest first
        self._requests: dict[int, _Request] = {}
        self._next_id = 0
        self.trace: list[StepTrace] = []
        self._steps = self._preemptions = self._generated = self._computed = self._peak_blocks = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams | None = None,
                    arrival_time: float | None = None) -> int:
        """Queue a request: ``prompt_ids`` (a non-empty list of token ids or a 1-D integer tensor) continued by
        ``max_new_tokens`` tokens chosen per ``sampling`` (None: greedy). ``arrival_time`` (the engine's clock;
        default now) is what its queueing time and TTFT count from. Returns its request id. Raises ValueError
        for a request that could never run: longer than the model's context, needing more KV blocks than the
        whole pool, or (without chunked prefill) more tokens in one prefill than ``max_batch_tokens``."""
        prompt = _token_list(prompt_ids, self.model.config.vocab_size)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an integer >= 1")
        if sampling is None:
            sampling = SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling: expected a labkit.serving.sampling.SamplingParams or None, "
                            f"got {type(sampling).__name__}")
        if arrival_time is None:
            arrival_time = self.clock()
        if isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float)):
            raise TypeError(f"arrival_time: expected seconds (a float) or None, got {type(arrival_time).__name__}")
        total = len(prompt) + max_new_tokens
        if total > self.context_length:
            raise ValueError(f"max_new_tokens={max_new_tokens}: prompt ({len(prompt)}) + new tokens exceeds the "
                             f"model's context_length={self.context_length}")
        cached_at_most = total - 1  # the last generated token is never fed back
        if blocks_for(cached_at_most, self.block_size) > self.num_blocks:
            raise ValueError(f"prompt_ids, max_new_tokens: this request needs K/V for up to {cached_at_most} tokens, "
                             f"{blocks_for(cached_at_most, self.block_size)} blocks of {self.block_size}, and the "
                             f"whole pool has num_blocks={self.num_blocks}: it can never fit")
        if not self.chunked_prefill and self.batching == "continuous" and cached_at_most > self.max_batch_tokens:
            raise ValueError(f"prompt_ids, max_new_tokens: without chunked prefill a (re)computed prompt of up to "
                             f"{cached_at_most} tokens must fit max_batch_tokens={self.max_batch_tokens} in one step")
        request_id = self._next_id
        self._next_id += 1
        request = _Request(request_id, prompt, max_new_tokens, sampling, float(arrival_time),
                           sampling.make_generator(self.device), num_to_sample=max_new_tokens)
        self._requests[request_id] = request
        self.waiting.append(request)
        return request_id

    @property
    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def block_tables(self) -> dict:
        """Each running request's block table (request id -> its blocks, in order; a copy)."""
        return {r.request_id: list(self.blocks.block_tables[r.request_id]) for r in self.running}

    @property
    def stats(self) -> EngineStats:
        """The engine's counters (:class:`EngineStats`)."""
        return EngineStats(self._steps, self._preemptions, self._generated, self._computed, self.blocks.hit_rate,
                           self.blocks.num_used_blocks, self._peak_blocks)

    # ------------------------------------------------------------------ one iteration
    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration (plan, block bookkeeping, one packed forward pass, sampling); return the
        requests that finished in it (their outputs, in batch order). Appends a :class:`StepTrace` to ``trace``."""
        start = self.clock()
        plan = self._plan()
        for request_id in plan.preempted:  # newest first: each goes to the front, so the oldest ends up first
            request = self._requests[request_id]
            self.running.remove(request)
            self.blocks.free(request_id)
            request.num_computed = 0
            request.num_preemptions += 1
            self.waiting.appendleft(request)
        self._preemptions += len(plan.preempted)
        if not plan.scheduled:  # nothing to run (the plan may still have preempted: the next plan sees the room)
            return []
        for request_id in plan.admitted:
            request = self.waiting.popleft()
            self.blocks.add_sequence(request_id)
            request.num_computed = self.blocks.allocate_cached_prefix(request_id, request.token_ids)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = start
                request.num_cached_tokens = request.num_computed
            self.running.append(request)
        chunks, scheduled = [], []
        for request_id, num_new in plan.scheduled.items():
            request = self._requests[request_id]
            begin = request.num_computed
            tokens = request.token_ids[begin:begin + num_new]
            self.blocks.grow(request_id, num_new, tokens)
            chunks.append((tokens, begin, self.blocks.block_tables[request_id]))
            kind = "decode" if begin >= len(request.prompt_ids) and num_new == 1 else "prefill"
            scheduled.append((request_id, kind, num_new))
        for source, destination in self.blocks.take_copies():  # copy-on-write, before anything writes
            self.cache.k[:, destination] = self.cache.k[:, source]
            self.cache.v[:, destination] = self.cache.v[:, source]
        logits = forward_packed(self.model, self.cache, pack_batch(chunks, self.block_size, self.device))
        finished = self._advance(plan.scheduled, logits)
        self._steps += 1
        self._computed += plan.num_tokens
        self._peak_blocks = max(self._peak_blocks, self.blocks.num_used_blocks)
        outputs = [RequestOutput(r.request_id, tuple(r.prompt_ids), tuple(r.output_ids), r.arrival_time,
                                 r.first_scheduled_time, r.first_token_time, r.finish_time, r.num_cached_tokens,
                                 r.num_preemptions) for r in finished]
        self.trace.append(StepTrace(self._steps, tuple(scheduled), tuple(plan.preempted), tuple(plan.admitted),
                                    tuple(r.request_id for r in finished), tuple(r.request_id for r in self.running),
                                    len(self.waiting), self.blocks.num_used_blocks, self._filled_slots(),
                                    self.clock() - start))
        return outputs

    def run(self) -> list[RequestOutput]:
        """Step until every request has finished; return all outputs in the order they finished."""
        return list(self.stream())

    def stream(self):
        """Step until every request has finished, yielding each :class:`RequestOutput` as soon as it finishes."""
        while self.has_unfinished:
            yield from self.step()

    # ------------------------------------------------------------------ internals
    def _plan(self) -> StepPlan:
        if self.batching == "static":
            return self._plan_static()
        tables = self.blocks.block_tables
        running = [SeqState(r.request_id, len(r.token_ids), r.num_computed, len(tables[r.request_id]),
                            self.blocks.num_shared_blocks(r.request_id)) for r in self.running]
        room = self.max_num_seqs - len(self.running)  # no more than this many can join: look no further
        waiting = [SeqState(r.request_id, len(r.token_ids), self.blocks.cached_prefix_length(r.token_ids), 0)
                   for r in itertools.islice(self.waiting, max(room, 0))]
        return plan_step(running, waiting, self.blocks.num_free_blocks, self.block_size, self.max_batch_tokens,
                         self.max_num_seqs, self.chunked_prefill)

    def _plan_static(self) -> StepPlan:
        """A running static batch decodes every member; otherwise the next batch is formed from the queue's head:
        as many requests (up to ``max_num_seqs``) as the pool holds when each runs to the batch's longest output.
        All of a batch's prompts are prefilled in its first step (the token budget does not apply)."""
        if self.running:
            return StepPlan(scheduled={r.request_id: 1 for r in self.running})
        batch, longest = [], 0
        for request in itertools.islice(self.waiting, self.max_num_seqs):
            padded = max(longest, request.max_new_tokens)
            members = batch + [request]
            blocks = sum(blocks_for(len(r.prompt_ids) + padded - 1, self.block_size) for r in members)
            if blocks > self.num_blocks or max(len(r.prompt_ids) for r in members) + padded > self.context_length:
                break
            batch.append(request)
            longest = padded
        for request in batch:
            request.num_to_sample = longest
        return StepPlan(scheduled={r.request_id: len(r.token_ids) - self.blocks.cached_prefix_length(r.token_ids)
                                   for r in batch}, admitted=[r.request_id for r in batch])

    def _advance(self, scheduled: dict, logits: torch.Tensor) -> list[_Request]:
        """Count the computed tokens; every request now fully computed gets its next token; some finish."""
        ready, rows = [], []
        for row, (request_id, num_new) in enumerate(scheduled.items()):
            request = self._requests[request_id]
            request.num_computed += num_new
            if request.num_computed == len(request.token_ids):  # a chunk short of the prompt's end samples nothing
                ready.append(request)
                rows.append(row)
        if not ready:
            return []
        tokens = self._sample(logits[rows], ready)
        now, finished = self.clock(), []
        for request, token in zip(ready, tokens):
            if len(request.output_ids) < request.max_new_tokens:
                request.output_ids.append(token)
                self._generated += 1
            else:
                request.padding_ids.append(token)  # a static batch's finished member, padded to the longest
            if request.first_token_time is None:
                request.first_token_time = now
            if len(request.output_ids) + len(request.padding_ids) == request.num_to_sample:
                request.finish_time = now
                self.running.remove(request)
                self.blocks.free(request.request_id)
                finished.append(request)
        return finished

    def _filled_slots(self) -> int:
        """K/V slots holding a token, a slot of a shared block counted once."""
        filled: dict = {}
        size = self.block_size
        for request in self.running:
            length = self.blocks.lengths[request.request_id]
            for index, block in enumerate(self.blocks.block_tables[request.request_id]):
                filled[block] = max(filled.get(block, 0), min(size, length - index * size))
        return sum(filled.values())

    @staticmethod
    def _sample(logits: torch.Tensor, requests: list[_Request]) -> list[int]:
        params = [r.sampling for r in requests]
        if all(p.greedy and not p.uses_history for p in params):
            return logits.argmax(dim=-1).tolist()  # the whole batch at once: what sample_next does row by row
        history = [r.token_ids if p.uses_history else None for r, p in zip(requests, params)]
        return sample_next(logits, params, history, [r.generator for r in requests]).tolist()


def _token_list(prompt_ids, vocab_size: int) -> list:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 1 or prompt_ids.is_floating_point() or prompt_ids.is_complex():
            raise ValueError(f"prompt_ids: expected a 1-D integer tensor, got {prompt_ids.dtype} of shape "
                             f"{tuple(prompt_ids.shape)}")
        prompt_ids = prompt_ids.tolist()
    if not isinstance(prompt_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
        raise TypeError(f"prompt_ids: expected a list of int token ids or a 1-D integer tensor, "
                        f"got {type(prompt_ids).__name__}")
    if not prompt_ids:
        raise ValueError("prompt_ids: expected at least one token, got none")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise ValueError(f"prompt_ids: token ids must lie in [0, vocab_size={vocab_size}), got "
                         f"{min(prompt_ids)}..{max(prompt_ids)}")
    return list(prompt_ids)
