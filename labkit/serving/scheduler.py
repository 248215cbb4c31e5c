"""One scheduler iteration of continuous batching (Orca's iteration-level scheduling, vLLM's scheduler), as a pure
function of plain data: :func:`plan_step` reads the requests' states and the free blocks and returns which requests
compute how many tokens this step, and which are preempted. The engine (:mod:`labkit.serving.engine`) then carries
the plan out on the real block manager and model.

The policy, in order:

1. **Running requests first**, oldest first: a decode needs 1 token, an unfinished (chunked) prefill the rest of
   its prompt, cut to the token budget left. If the blocks it needs are not free, the NEWEST running request is
   preempted (the blocks only it holds are freed; it recomputes everything later) until they are, or until the
   request itself is the newest and is preempted.
2. **Then waiting requests**, first come first served, unless a request was preempted this step (the pool is
   tight: admitting more would only preempt again): each gets its whole prompt, or with ``chunked_prefill`` as
   much of it as the budget leaves; admission stops at the first request that does not fit (no overtaking, so
   a long prompt is never starved), or at ``max_num_seqs`` running requests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from labkit.serving.blocks import blocks_for

__all__ = ["SeqState", "StepPlan", "plan_step"]


@dataclass(frozen=True)
class SeqState:
    """What the scheduler knows of one request: ``num_tokens`` it has (prompt plus generated so far),
    ``num_computed`` of them already in the KV cache, ``num_blocks`` KV blocks it holds, ``num_shared_blocks`` of
    which other requests hold too (a shared prompt prefix: preempting this request does not free those)."""

    request_id: int
    num_tokens: int
    num_computed: int
    num_blocks: int
    num_shared_blocks: int = 0

    def __post_init__(self):
        for name in ("num_tokens", "num_computed", "num_blocks", "num_shared_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r}: expected an integer >= 0")
        if self.num_computed >= self.num_tokens:
            raise ValueError(f"num_computed={self.num_computed}: expected < num_tokens={self.num_tokens} (a request "
                             f"always has at least one token whose K/V is not cached yet: the one it feeds next)")
        if self.num_shared_blocks > self.num_blocks:
            raise ValueError(f"num_shared_blocks={self.num_shared_blocks}: expected <= num_blocks={self.num_blocks}")


@dataclass
class StepPlan:
    """One step's decisions: ``scheduled`` maps request id -> tokens to compute (in the order they were scheduled:
    running requests, then newly admitted ones); ``preempted`` lists the running requests sent back to the front
    of the queue (newest first, as they were chosen); ``admitted`` the waiting requests that start running."""

    scheduled: dict = field(default_factory=dict)
    preempted: list = field(default_factory=list)
    admitted: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this step (the forward pass's packed length)."""
        return sum(self.scheduled.values())


def plan_step(running: list[SeqState], waiting: list[SeqState], free_blocks: int, block_size: int,
              max_batch_tokens: int, max_num_seqs: int, chunked_prefill: bool = True) -> StepPlan:
    """Plan one iteration: which of ``running`` (oldest first) and ``waiting`` (queue order) requests compute how
    many tokens, under ``max_batch_tokens`` tokens in all and ``free_blocks`` free KV blocks of ``block_size``
    slots, with at most ``max_num_seqs`` requests running; preempt the newest running requests when blocks run
    out (see the module's docstring for the policy). A request computing ``n`` tokens needs
    ``ceil((num_computed + n) / block_size) - num_blocks`` new blocks. Nothing is modified."""
    for name, value in (("block_size", block_size), ("max_batch_tokens", max_batch_tokens),
                        ("max_num_seqs", max_num_seqs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    if isinstance(free_blocks, bool) or not isinstance(free_blocks, int) or free_blocks < 0:
        raise ValueError(f"free_blocks={free_blocks!r}: expected an integer >= 0")
    plan, budget, candidates = StepPlan(), max_batch_tokens, list(running)
    index = 0
    while index < len(candidates) and budget > 0:
        seq = candidates[index]
        num_new = min(seq.num_tokens - seq.num_computed, budget)
        needed = blocks_for(seq.num_computed + num_new, block_size) - seq.num_blocks
        while needed > free_blocks and candidates[-1] is not seq:
            victim = candidates.pop()
            free_blocks += victim.num_blocks - victim.num_shared_blocks
            plan.preempted.append(victim.request_id)
        if needed > free_blocks:  # it is the newest itself: it makes room for the older ones
            candidates.pop()
            plan.preempted.append(seq.request_id)
            break
        plan.scheduled[seq.request_id] = num_new
        free_blocks -= needed
        budget -= num_new
        index += 1
    if plan.preempted:
        return plan
    num_running = len(candidates)
    for seq in waiting:
        if budget == 0 or num_running >= max_num_seqs:
            break
        remaining = seq.num_tokens - seq.num_computed
        if remaining > budget and not chunked_prefill:
            break
        num_new = min(remaining, budget)
        needed = blocks_for(seq.num_computed + num_new, block_size) - seq.num_blocks
        if needed > free_blocks:
            break
        plan.scheduled[seq.request_id] = num_new
        plan.admitted.append(seq.request_id)
        free_blocks -= needed
        budget -= num_new
        num_running += 1
    return plan
