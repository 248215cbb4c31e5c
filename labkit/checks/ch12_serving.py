"""Graders for chapter 12: ``block_manager`` (a block allocator with reference counts and copy-on-write),
``plan_step`` (one scheduler iteration under a token budget) and ``speculative_accept`` (speculative decoding's
accept/reject step, graded statistically).

``block_manager(cls)`` builds ``cls(num_blocks, block_size)`` and drives it through seeded random sequences of
``add_sequence``/``grow``/``fork``/``free`` beside labkit's :class:`labkit.serving.blocks.BlockManager`. Block ids
may differ (any free block will do), so it compares what does not depend on them: free-block counts, the length
of each block table, which table positions share a block, each block's reference count (also against the tables
themselves) and the copies queued. It also keeps a pretend K/V pool: every slot ``grow`` returns is written with
its sequence's token after the queued copies are applied, and every live sequence must then read back exactly its
own tokens through its table; a write into a block another sequence holds (no copy-on-write) shows up there. A
``grow`` the pool cannot satisfy must raise ``PoolExhaustedError`` and change nothing; once every sequence is freed,
every block must be free with refcount 0.

``plan_step(fn)`` compares ``fn(running, waiting, free_blocks, block_size, max_batch_tokens, max_num_seqs,
chunked_prefill)`` with labkit's :func:`labkit.serving.scheduler.plan_step` on hand-made edge cases and seeded
random states (decodes, unfinished chunks, cached prefixes, shared blocks, a pool too small, a budget of 1): the
scheduled requests with their token counts, in order, the preempted ones, in order, and the admitted ones; the
input lists must be left as they were. A wrong plan is named by the mistake that gives it where one does.

``speculative_accept(draft_probs, target_probs, draft_tokens, generator) -> tokens`` is one step of speculative
decoding's rule (Leviathan et al. 2023, Chen et al. 2023): accept draft token ``x_i`` with probability
``min(1, p_i(x_i) / q_i(x_i))`` in order; at the first rejection emit a token from ``max(0, p_i - q_i)``
normalised and stop; if all ``k`` are accepted emit a bonus token from ``p_k``. The grader first tries
cases whose answer is certain (one-hot distributions as in greedy decoding, a draft token the target gives
probability 0, ``p == q``, ``k = 0``), checks the returned tensor (int64, 1-D, the accepted prefix of the
draft tokens, then one token), that the inputs are left alone and that all randomness comes from
``generator`` (equal seeds give equal tokens whatever torch's global generator holds). Then it runs the
step many times with draft tokens drawn from ``q`` and compares how often each possible output occurs with
the exact probabilities, ``prod_{j<n} min(p_j, q_j)(x_j) * max(0, p_n - q_n)(t)`` (``p_k(t)`` when ``n = k``),
by a chi-square test. The seeds are fixed; a correct answer that draws its random numbers in another order
than labkit's fails that test with probability ``FALSE_FAILURE_RATE`` (one in a million) per case.

Each grader is a *probe* and a *judge*, as chapter 05's ``LoRALinear``: the probe drives the learner's objects
where they live (an allocator method by method, a ``StepPlan`` read field by field, ``torch.Generator`` objects made
there from the grader's seeds) and records what came back as data; the judge decides, from that record, against the
grader's own reference. In a notebook both run in the kernel; under ``labkit.grade`` the probe runs in the learner's
process (``labkit.checks._remote.apply``) and the judge in the grading process, so a forged record passes only if
it is what a right answer does. A probe may stop early at an exception (with the usual message); it never passes.
"""
from __future__ import annotations

import copy
import itertools
import random

import torch

from labkit.attention_variants import PoolExhaustedError
from labkit.checks._core import as_tensor, call, call_on_copies, copy_of, fail, passed
from labkit.serving.blocks import BlockManager, blocks_for
from labkit.serving.scheduler import SeqState
from labkit.serving.scheduler import plan_step as _reference_plan

__all__ = ["block_manager", "plan_step", "speculative_accept"]


# ============================================================================ where the learner's code runs
def _run(probe, learner, *args):
    """``probe(learner, *args)``, run where ``learner`` lives: under ``labkit.grade`` (``learner`` a Remote handle)
    in the learner's process, where its objects can be driven method by method; here otherwise. The probe only
    records what the learner's code did (it may stop early at an exception, with the usual message); the
    verdict is a judge's, here, from that record against the grader's own reference, so a forged record passes
    only if it is what a right answer does."""
    from labkit.checks._remote import apply

    return apply(probe, learner, *args)


def _judged(judge, what: str, *args) -> None:
    """Run ``judge(*args)``; a record it cannot read (one a probe did not make) is a failure, not a crash."""
    try:
        judge(*args)
    except (TypeError, KeyError, IndexError, AttributeError, ValueError) as err:
        fail(f"{what}, as it ran where your code lives", f"an incomplete record of what it did ({type(err).__name__})",
             "the record the grader's probe makes", "run the grader cell as it is: it records what your code does")


def _raised(tried: str, kind: str, message: str) -> None:
    """Fail as :func:`labkit.checks._core.call` fails for an exception of type ``kind`` raised where the learner's
    code ran."""
    from labkit.checks._remote import _exception

    def raising():
        raise _exception(kind, message, "", kind == "NotImplementedError")

    call(raising, tried)


# ============================================================================ exercise 1: the block manager
def _canonical(tables: dict) -> dict:
    """Tables with block ids renamed by first appearance (sequences in sorted order): equal exactly when two
    allocators share the same table positions, whatever ids they picked."""
    names: dict = {}
    return {seq: [names.setdefault(b, len(names)) for b in tables[seq]] for seq in sorted(tables, key=str)}


def _ops(rng: random.Random, num_blocks: int, steps: int) -> list:
    ops, live, next_id = [], [], 0
    for _ in range(steps):
        choice = rng.random()
        if not live or choice < 0.15:
            ops.append(("add", next_id))
            live.append(next_id)
            next_id += 1
        elif choice < 0.35 and len(live) < 6:
            ops.append(("fork", rng.choice(live), next_id))
            live.append(next_id)
            next_id += 1
        elif choice < 0.47:
            victim = rng.choice(live)
            live.remove(victim)
            ops.append(("free", victim))
        else:
            ops.append(("grow", rng.choice(live), rng.choice([1, 1, 1, 2, 3, 5, num_blocks])))
    return ops + [("free", s) for s in live]


def _block_cases() -> list:
    """(num_blocks, block_size, ops): a hand-made case (fork, copy-on-write, a grow the pool cannot satisfy), then
    30 seeded random sequences of add/grow/fork/free."""
    rng = random.Random(0)
    cases = [(6, 4, [("add", 0), ("grow", 0, 6), ("fork", 0, 1), ("grow", 1, 1), ("grow", 0, 1), ("grow", 0, 20),
                     ("free", 0), ("grow", 1, 2), ("free", 1)])]
    sizes = [(rng.choice([4, 8, 16]), rng.choice([1, 2, 4])) for _ in range(30)]
    return cases + [(num_blocks, block_size, _ops(rng, num_blocks, 40)) for num_blocks, block_size in sizes]


def _case_label(index: int, num_blocks: int, block_size: int) -> str:
    return f"case {index} (num_blocks={num_blocks}, block_size={block_size})"


def _snapshot(manager, num_blocks: int, tried: str) -> dict:
    """What an allocator shows: its block tables and lengths (copied), free blocks, every block's refcount."""
    tables = getattr(manager, "block_tables", None)
    if not isinstance(tables, dict):
        return {"tables": f"a {type(tables).__name__}"}
    seen = call(lambda: {"tables": {s: list(t) for s, t in tables.items()},
                         "lengths": dict(getattr(manager, "lengths", {})), "free": manager.num_free_blocks}, tried)
    seen["refcounts"] = [call(manager.refcount, tried + f"; then refcount({block})", block)
                         for block in range(num_blocks)]
    return seen


def _probe_block_manager(cls, cases: list) -> list:
    """Per case: build ``cls(num_blocks, block_size)``, then run the operations, recording after construction and
    after each operation a :func:`_snapshot`, with what ``grow`` returned (its slots, then ``take_copies()``) or
    raised (a PoolExhaustedError ends that grow, any other exception the record)."""
    records = []
    for index, (num_blocks, block_size, ops) in enumerate(cases):
        label = _case_label(index, num_blocks, block_size)
        mine = call(cls, f"{label}: cls(num_blocks={num_blocks}, block_size={block_size})", num_blocks, block_size)
        events = [_snapshot(mine, num_blocks, label)]
        records.append(events)
        for op in ops:
            tried = f"{label}: ... {op[0]}{op[1:]}"
            event = {}
            if op[0] == "add":
                call(mine.add_sequence, tried, op[1])
            elif op[0] == "fork":
                call(mine.fork, tried, op[1], op[2])
            elif op[0] == "free":
                call(mine.free, tried, op[1])
            else:
                try:
                    event["slots"] = copy_of(mine.grow(op[1], op[2]))
                except Exception as err:  # the learner's code may raise anything; the judge says what was expected
                    event["raised"] = (type(err).__name__, str(err)[:500], isinstance(err, PoolExhaustedError))
                    if not isinstance(err, PoolExhaustedError):
                        events.append(event)
                        return records
                else:
                    event["copies"] = copy_of(call(mine.take_copies, tried + "; then take_copies()"))
            event.update(_snapshot(mine, num_blocks, tried))
            events.append(event)
    return records


def _tables_of(event: dict, seqs: list, tried: str) -> dict:
    tables = event["tables"]
    if not isinstance(tables, dict):
        fail(tried, f"block_tables is {tables}", "a dict seq_id -> list of block ids",
             "keep chapter 03's BlockAllocator attributes: block_tables, lengths, num_free_blocks")
    return {s: list(tables.get(s, [])) for s in seqs}


def _check_refcounts(event: dict, tables: dict, num_blocks: int, tried: str) -> None:
    held: dict = {}
    for table in tables.values():
        for block in table:
            held[block] = held.get(block, 0) + 1
    for block in range(num_blocks):
        got = event["refcounts"][block]
        if got != held.get(block, 0):
            fail(tried + f"; then refcount({block})", got, f"{held.get(block, 0)} (the number of block tables holding "
                 f"block {block})", "a block's refcount is how many tables hold it: +1 when a table takes it (grow, "
                 "fork), -1 when one lets go (free, or a copy-on-write that swaps it for a private copy)")
    free_expected = num_blocks - len(held)
    if event["free"] != free_expected:
        fail(tried, f"num_free_blocks {event['free']}", f"{free_expected} ({len(held)} of {num_blocks} "
             f"blocks are in some table)", "a block goes back to the free list when its refcount reaches 0, not before "
             "and not later")


def _judge_case(index: int, num_blocks: int, block_size: int, ops: list, events) -> int:
    """The verdict on one case's record, beside labkit's BlockManager and a pretend K/V pool; returns the number of
    copy-on-writes."""
    label = _case_label(index, num_blocks, block_size)
    if not isinstance(events, list) or not events:
        fail(label, "no record of it", "a record of every operation", "run the grader cell as it is")
    ref = BlockManager(num_blocks, block_size, prefix_caching=False)
    pool: dict = {}  # (block, offset) -> the (seq_id, position) written there
    tried, seqs, copies_seen, before = label, [], 0, events[0]
    for step, op in enumerate(ops, start=1):
        tried = f"{label}: ... {op[0]}{op[1:]}"
        if step >= len(events):
            fail(tried, "no record of it", "a record of every operation", "run the grader cell as it is")
        event = events[step]
        if op[0] == "add":
            ref.add_sequence(op[1])
            seqs.append(op[1])
        elif op[0] == "fork":
            ref.fork(op[1], op[2])
            seqs.append(op[2])
        elif op[0] == "free":
            ref.free(op[1])
            seqs.remove(op[1])
        else:
            seq, count = op[1], op[2]
            raised = event.get("raised")
            try:
                ref.grow(seq, count)
            except PoolExhaustedError:
                if raised is not None and raised[2] is not True:
                    fail(tried, f"{raised[0]}: {raised[1]}", "PoolExhaustedError",
                         "raise labkit.attention_variants.PoolExhaustedError when the free list holds too few blocks")
                if raised is None:
                    fail(tried, "no error", f"PoolExhaustedError (only {ref.num_free_blocks} blocks are free)",
                         "count the blocks the tokens need (a copy-on-write needs one too) before taking any")
                unchanged = (_tables_of(event, seqs, tried) == _tables_of(before, seqs, tried)
                             and event["free"] == before["free"] and event["lengths"] == before["lengths"])
                if not unchanged:
                    fail(tried, "the tables, lengths or free list changed", "nothing changed by a failed grow",
                         "check that enough blocks are free first, then take them: a failed grow must change nothing")
                before = event
                continue
            if raised is not None:
                _raised(tried, raised[0], raised[1])
            start = ref.lengths[seq] - count
            slots = event["slots"]
            if not isinstance(slots, list) or len(slots) != count:
                fail(tried, repr(slots)[:80], f"a list of {count} (block, offset) slots",
                     "return the slot of every new token, as chapter 03's BlockAllocator.grow does")
            copies = event["copies"]
            if not isinstance(copies, list):
                fail(tried + "; then take_copies()", type(copies).__name__, "a list of (source, destination) pairs",
                     "return the queued copies and forget them")
            for source, destination in copies:  # the engine copies whole blocks before the forward pass writes
                for offset in range(block_size):
                    if (source, offset) in pool:
                        pool[(destination, offset)] = pool[(source, offset)]
            expected_copies = len(ref.take_copies())
            if len(copies) != expected_copies:
                fail(tried + "; then take_copies()", f"{len(copies)} copies {copies}", f"{expected_copies}",
                     "copy a block only when the first new slot lies in a block whose refcount is > 1 (and queue "
                     "each copy once: take_copies forgets what it returns)" if len(copies) > expected_copies else
                     "copy-on-write: when the first new slot lies in a block another table also holds (refcount > 1), "
                     "take a free block, queue (shared, new) and put the new one in this table before writing")
            copies_seen += len(copies)
            table = _tables_of(event, [seq], tried)[seq]
            for i, slot in enumerate(slots):
                position = start + i
                block = position // block_size
                expected_slot = (table[block], position % block_size) if block < len(table) else None
                slot = tuple(slot) if isinstance(slot, (tuple, list)) else slot
                if slot != expected_slot:
                    fail(tried, f"slot {slot!r} for position {position}", f"{expected_slot} (block table {table})",
                         "position p lives in block_tables[seq][p // block_size] at offset p % block_size")
                pool[expected_slot] = (seq, position)
        tables = _tables_of(event, seqs, tried)
        ref_tables = {s: ref.block_tables[s] for s in seqs}
        if _canonical(tables) != _canonical(ref_tables):
            fail(tried, f"block tables {_canonical(tables)} (ids renamed by first appearance)",
                 f"{_canonical(ref_tables)}",
                 "fork shares every block of the parent; grow adds blocks only when the last one is full, and "
                 "replaces a shared block it writes into by a private copy; other tables keep theirs")
        _check_refcounts(event, tables, num_blocks, tried)
        for s in seqs:
            for position in range(ref.lengths[s]):
                slot = (tables[s][position // block_size], position % block_size)
                owner = pool.get(slot)
                if owner is None or owner[1] != position or not _same_lineage(owner[0], s, ops):
                    fail(tried, f"sequence {s} reads position {position} from slot {slot}, written by "
                                f"{'nobody' if owner is None else f'sequence {owner[0]} at position {owner[1]}'}",
                         f"its own token at position {position}",
                         "a write into a block another sequence also holds changes that sequence's K/V: copy the "
                         "block first (copy-on-write), and queue the copy so its earlier contents come along")
        before = event
    if before["free"] != num_blocks:
        fail(tried, f"num_free_blocks {before['free']} after every sequence was freed", str(num_blocks),
             "free must return every block whose refcount reaches 0")
    return copies_seen


def _same_lineage(writer, reader, ops) -> bool:
    """Whether ``reader`` inherits ``writer``'s tokens: it is ``writer`` or was forked (transitively) from it."""
    parents = {op[2]: op[1] for op in ops if op[0] == "fork"}
    while reader is not None:
        if reader == writer:
            return True
        reader = parents.get(reader)
    return False


def _judge_block_manager(cases: list, records, counted: list) -> None:
    """The verdict on :func:`_probe_block_manager`'s record, case by case; the copy-on-writes go into ``counted``."""
    if not isinstance(records, list):
        fail("block_manager: the allocators built and run where the class lives", "no record of what they did",
             f"one record per case ({len(cases)})", "run the grader cell as it is: it records what your allocator does")
    for index, (num_blocks, block_size, ops) in enumerate(cases):
        if index >= len(records):
            fail(_case_label(index, num_blocks, block_size), "no record of it", "a record of every case",
                 "run the grader cell as it is: it records what your allocator does")
        counted.append(_judge_case(index, num_blocks, block_size, ops, records[index]))


def block_manager(cls) -> None:
    """Grade ``cls(num_blocks, block_size)``: chapter 03's block allocator (``add_sequence``, ``grow(seq_id,
    num_tokens) -> slots``, ``free``, ``block_tables``, ``lengths``, ``num_free_blocks``) with reference counts
    (``refcount(block)``), ``fork(parent_id, child_id)`` sharing every block, and copy-on-write: a ``grow`` whose
    first slot lies in a block with refcount > 1 first swaps it for a fresh block and queues ``(shared, fresh)``,
    returned (and forgotten) by ``take_copies()``. The allocators are driven where the class lives
    (:func:`_probe_block_manager`); the verdict is :func:`_judge_block_manager`'s."""
    from labkit.checks._remote import Remote

    is_class = cls.describe().get("kind") == "class" if isinstance(cls, Remote) else isinstance(cls, type)
    if not is_class:
        what = cls.describe().get("type") if isinstance(cls, Remote) else type(cls).__name__
        fail("block_manager(cls)", f"a {what}", "a class", "hand in the class itself, not an instance")
    cases, copies = _block_cases(), []
    _judged(_judge_block_manager, "block_manager", cases, _run(_probe_block_manager, cls, cases), copies)
    passed("block_manager", f"{len(cases)} random sequences of add/grow/fork/free agree with labkit's BlockManager "
                            f"(tables, refcounts, free blocks; {sum(copies)} copy-on-writes), no write reached another "
                            "sequence's blocks, failed grows changed nothing, and every block came back")


# ============================================================================ exercise 2: one scheduler step
def _random_state(rng: random.Random, block_size: int):
    running, waiting, next_id = [], [], 0
    for _ in range(rng.randint(0, 6)):
        num_tokens = rng.randint(1, 40)
        decode = rng.random() < 0.7
        num_computed = num_tokens - 1 if decode else rng.randint(0, num_tokens - 1)
        num_blocks = blocks_for(num_computed, block_size)
        running.append(SeqState(next_id, num_tokens, num_computed, num_blocks, rng.randint(0, num_blocks) if
                                rng.random() < 0.3 else 0))
        next_id += 1
    for _ in range(rng.randint(0, 5)):
        num_tokens = rng.randint(1, 40)
        cached = rng.choice([0, 0, block_size * rng.randint(0, num_tokens // block_size)])
        waiting.append(SeqState(next_id, num_tokens, min(cached, num_tokens - 1), 0))
        next_id += 1
    return running, waiting


def _plan_cases() -> list:
    s = SeqState
    cases = [
        # (running, waiting, free_blocks, block_size, max_batch_tokens, max_num_seqs, chunked_prefill)
        ([s(0, 9, 8, 2), s(1, 5, 4, 1)], [s(2, 30, 0, 0), s(3, 4, 0, 0)], 20, 4, 12, 8, True),
        ([s(0, 9, 8, 2), s(1, 5, 4, 1)], [s(2, 30, 0, 0), s(3, 4, 0, 0)], 20, 4, 12, 8, False),
        ([s(0, 9, 8, 2), s(1, 13, 12, 3), s(2, 5, 4, 1, 1)], [s(3, 4, 0, 0)], 0, 4, 16, 8, True),
        ([s(0, 9, 8, 2)], [], 0, 4, 16, 8, True),
        ([s(0, 9, 8, 2), s(1, 5, 4, 1, 1)], [], 0, 4, 16, 8, True),  # preempting 1 frees nothing it shares
        ([], [s(0, 10, 0, 0), s(1, 3, 0, 0), s(2, 3, 0, 0)], 2, 4, 64, 8, True),
        ([s(0, 5, 4, 1), s(1, 7, 6, 2)], [s(2, 3, 0, 0)], 4, 4, 1, 8, True),
        ([s(0, 5, 4, 1), s(1, 7, 6, 2)], [s(2, 3, 0, 0), s(3, 2, 0, 0)], 4, 4, 64, 3, True),
        ([s(0, 20, 4, 1)], [s(1, 12, 8, 0)], 10, 4, 9, 8, True),
        ([], [], 5, 4, 8, 4, True),
    ]
    rng = random.Random(12)
    for _ in range(300):
        block_size = rng.choice([1, 2, 4, 16])
        running, waiting = _random_state(rng, block_size)
        free_blocks = rng.choice([0, 1, 2, rng.randint(0, 12)])
        cases.append((running, waiting, free_blocks, block_size, rng.choice([1, 3, 8, 16, 64]),
                      rng.choice([1, 2, 4, 8]), rng.random() < 0.6))
    return cases


def _plan_of(result, tried: str) -> tuple:
    for name in ("scheduled", "preempted", "admitted"):
        if not hasattr(result, name):
            fail(tried, f"a {type(result).__name__} without .{name}", "a StepPlan (scheduled, preempted, admitted)",
                 "return labkit.serving.scheduler.StepPlan(scheduled=..., preempted=..., admitted=...)")
    if not isinstance(result.scheduled, dict):
        fail(tried, f"scheduled is a {type(result.scheduled).__name__}", "a dict request_id -> tokens to compute",
             "plan.scheduled[request_id] = num_new_tokens, in the order you schedule them")
    return list(result.scheduled.items()), list(result.preempted), list(result.admitted)


def _wrong_variants() -> list:
    """Plans that realistic mistakes produce, with the hint that names each (checked in this order)."""
    def newest_not_oldest(running, waiting, *rest):
        return _reference_plan(list(reversed(running)), waiting, *rest)

    def all_blocks_freed(running, waiting, *rest):
        return _reference_plan([SeqState(r.request_id, r.num_tokens, r.num_computed, r.num_blocks) for r in running],
                               waiting, *rest)

    def always_chunked(running, waiting, free, bs, budget, seqs, chunked):
        return _reference_plan(running, waiting, free, bs, budget, seqs, True)

    def no_seq_limit(running, waiting, free, bs, budget, seqs, chunked):
        return _reference_plan(running, waiting, free, bs, budget, 10 ** 6, chunked)

    return [
        (newest_not_oldest, "serve running requests oldest first and preempt from the NEWEST end: the oldest "
                            "request has waited longest and must keep making progress"),
        (all_blocks_freed, "a preempted request frees only the blocks no one else holds: num_blocks - "
                           "num_shared_blocks"),
        (always_chunked, "with chunked_prefill=False a waiting request gets its whole remaining prompt or waits"),
        (no_seq_limit, "at most max_num_seqs requests may be running after the step (running ones count too)"),
    ]


def _plan_tried(args: tuple) -> str:
    running, waiting, free, block_size, budget, max_seqs, chunked = args
    return (f"plan_step(running={running}, waiting={waiting}, free_blocks={free}, block_size={block_size}, "
            f"max_batch_tokens={budget}, max_num_seqs={max_seqs}, chunked_prefill={chunked})")


def _seqs(states: list) -> list:
    """A list of SeqStates as data (anything else in it by its repr)."""
    return [(s.request_id, s.num_tokens, s.num_computed, s.num_blocks, s.num_shared_blocks) if isinstance(s, SeqState)
            else repr(s)[:80] for s in states]


def _probe_plan_step(fn, cases: list) -> list:
    """Per case: ``fn(*case)`` twice, each plan as data (:func:`_plan_of`), and the running and waiting lists as the
    first call left them."""
    records = []
    for args in cases:
        tried = _plan_tried(args)
        first = _plan_of(call(fn, tried, *args), tried)
        after = (_seqs(args[0]), _seqs(args[1]))
        again = _plan_of(call(fn, tried + " (called a second time)", *args), tried)
        records.append({"plan": copy_of(first), "after": after, "again": copy_of(again)})
    return records


def _judge_plan_step(cases: list, records) -> None:
    """The verdict on :func:`_probe_plan_step`'s record: every plan against labkit's scheduler, here."""
    if not isinstance(records, list) or len(records) != len(cases):
        fail("plan_step: your function called where it lives", "an incomplete record of what it returned",
             f"one record per state ({len(cases)})", "run the grader cell as it is: it records what your function does")
    for args, record in zip(cases, records):
        tried = _plan_tried(args)
        if record["after"] != (_seqs(args[0]), _seqs(args[1])):
            fail(tried, "the running or waiting list was changed", "the inputs left as they were",
                 "plan on copies (list(running)): the engine carries the plan out itself")
        got, again = record["plan"], record["again"]
        expected = _plan_of(_reference_plan(*args), tried)
        if got != expected or again != got:
            hint = "decodes and unfinished prefills first, then waiting requests in order; see the policy above"
            for variant, variant_hint in _wrong_variants():
                if _plan_of(variant(*args), tried) == got:
                    hint = variant_hint
                    break
            fail(tried, f"scheduled {got[0]}, preempted {got[1]}, admitted {got[2]}",
                 f"scheduled {expected[0]}, preempted {expected[1]}, admitted {expected[2]}", hint)


def plan_step(fn) -> None:
    """Grade ``fn(running, waiting, free_blocks, block_size, max_batch_tokens, max_num_seqs, chunked_prefill)
    -> StepPlan``: one iteration of labkit's scheduler (:mod:`labkit.serving.scheduler`): running requests first,
    oldest first (a decode takes 1 token, an unfinished prefill the rest of its prompt cut to the budget),
    preempting the newest running request while the blocks needed are not free; then, if nothing was preempted,
    waiting requests in order (whole prompts, or chunks with ``chunked_prefill``) until one does not fit. ``fn``
    is called where it lives (:func:`_probe_plan_step`); the verdict is :func:`_judge_plan_step`'s."""
    if not callable(fn):
        fail("plan_step(fn)", f"a {type(fn).__name__}", "a function", "hand in the function itself")
    cases = _plan_cases()
    _judged(_judge_plan_step, "plan_step", cases, _run(_probe_plan_step, fn, copy.deepcopy(cases)))
    passed("plan_step", f"{len(cases)} states (decodes, chunks, cached prefixes, shared blocks, full pools, budgets "
                        "of 1, chunked and not) planned exactly as labkit's scheduler plans them, inputs untouched")


FALSE_FAILURE_RATE = 1e-6
TRIALS = 2000  # per statistical case: the usual mistakes then reach p-values below 1e-30 (measured), far past the bound
_HINT_RULE = ("for i in 0..k-1: accept x = draft_tokens[i] if u_i < p_i(x) / q_i(x) (u_i uniform in [0, 1) from "
              "`generator`); at the first rejection draw the last token from max(0, p_i - q_i) normalised and stop; "
              "if all k were accepted draw a bonus token from p_k = target_probs[k]")


def speculative_accept(fn) -> None:
    """Grade ``fn(draft_probs [k, V], target_probs [k + 1, V], draft_tokens [k] int64, generator) -> int64 [n + 1]``.
    The steps run where ``fn`` lives, with generators made there from the grader's seeds (:func:`_probe_certain`,
    :func:`_probe_generator`, :func:`_probe_distribution`); each verdict is decided here from the tokens they
    returned."""
    for description, q, p, draft_tokens, expected, allowed_extra, hint in _certain_cases():
        tokens = torch.tensor(draft_tokens, dtype=torch.long)
        tried = f"{_describe(q, p, tokens)}: {description}"
        outs = _run(_probe_certain, fn, q, p, tokens, tried, hint)
        _judged(_judge_certain, "speculative_accept", outs, q, p, tokens, tried, expected, allowed_extra, hint)
    gen = torch.Generator().manual_seed(5)
    q, p = _random_probs(3, 5, gen), _random_probs(4, 5, gen)
    drafts = torch.stack([torch.multinomial(q, 1, generator=gen)[:, 0] for _ in range(12)])
    _judged(_judge_generator, "speculative_accept", _run(_probe_generator, fn, q, p, drafts), q, p, drafts)
    gen = torch.Generator().manual_seed(12)
    for vocab, k, dtype in ((4, 3, torch.float32), (3, 2, torch.float64)):
        q = _random_probs(k, vocab, gen).to(dtype)
        p = _random_probs(k + 1, vocab, gen).to(dtype)
        seed = vocab * 100 + k
        drawing = torch.Generator().manual_seed(seed)
        drafts = torch.multinomial(q.float(), TRIALS, replacement=True, generator=drawing).T  # [TRIALS, k], row j ~ q_j
        tried = f"{TRIALS} steps with {_describe(q, p)}, draft tokens drawn from draft_probs, one generator seeded {seed}"
        outs = _run(_probe_distribution, fn, q, p, drafts, drawing.get_state(), tried)
        _judged(_check_distribution, "speculative_accept", outs, q, p, drafts, tried)
    passed("speculative_accept", "certain cases (greedy one-hot rows, p == q, a token the target never picks, k = 0) "
                                 "and the exact distribution of the emitted tokens over "
                                 f"{2 * TRIALS} random steps (chi-square, V = 4 and 3, k = 3 and 2, fp32 and fp64)")


def _step(fn, q, p, tokens, generator, tried, hint: str = _HINT_RULE):
    """One step of the learner's code on copies of its inputs (failing if it changed them): what it returned, copied."""
    raised_hint = (hint + "; torch.multinomial raises on negative weights or a zero sum: the residual is "
                   "(p - q).clamp(min=0), and when p == q nothing is ever rejected")
    return copy_of(call_on_copies(fn, tried, q, p, tokens, generator, hint=raised_hint,
                                  mutation_hint="leave draft_probs, target_probs and draft_tokens unchanged: "
                                                "compute max(0, p - q) into a new tensor (no in-place clamp_)"))


def _check_step(out, vocab: int, tokens: torch.Tensor, tried: str) -> torch.Tensor:
    """The form every step's output must have: an int64 [n + 1] tensor, the accepted draft tokens, then one token."""
    out = as_tensor(out, tried)
    k = len(tokens)
    if out.dtype != torch.long or out.dim() != 1 or not 1 <= len(out) <= k + 1:
        fail(tried, f"{out.dtype} tensor of shape {tuple(out.shape)}", f"an int64 tensor of shape [n + 1] with 0 <= n <= {k}",
             "return the accepted draft tokens followed by ONE more token (the correction, or the bonus when all k "
             "are accepted), e.g. torch.cat([draft_tokens[:n], extra])")
    if out.device != tokens.device:
        fail(tried, f"a tensor on {out.device}", f"a tensor on {tokens.device}", "return the tokens on the inputs' device")
    n = len(out) - 1
    if not torch.equal(out[:n], tokens[:n]):
        fail(tried, out.tolist(), f"the first {n} tokens equal to draft_tokens[:{n}] = {tokens[:n].tolist()}",
             "every token before the last one is an accepted draft token, in order: stop at the first rejection")
    if not 0 <= int(out[n]) < vocab:
        fail(tried, out.tolist(), f"token ids in [0, {vocab})", "draw the last token with torch.multinomial(..., 1)")
    return out


# ----------------------------------------------------------------------------- certain answers
def _one_hot(ids: list[int], vocab: int, dtype=torch.float32) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids, dtype=torch.long), vocab).to(dtype).reshape(len(ids), vocab)


def _certain_cases():
    """(description, draft_probs, target_probs, draft_tokens, the one possible answer or None, allowed extra tokens,
    hint)."""
    v = 6
    greedy = ("with one-hot rows (greedy decoding) p_i(x) / q_i(x) is 1 where the target's argmax is the draft token "
              "and 0 elsewhere: accept while they agree; at the first disagreement emit the target's token and stop "
              "(the rejected draft token is not emitted)")
    yield ("greedy, the target agrees with all 3 draft tokens", _one_hot([1, 4, 2], v), _one_hot([1, 4, 2, 5], v),
           [1, 4, 2], [1, 4, 2, 5], None, "all k accepted: return the k draft tokens, then a bonus token from "
                                          "p_k = target_probs[k] (the row after the last draft token)")
    yield ("greedy, the target disagrees at position 1", _one_hot([1, 4, 2], v), _one_hot([1, 3, 2, 5], v),
           [1, 4, 2], [1, 3], None, greedy)
    yield ("greedy, the target disagrees at position 0", _one_hot([0], v), _one_hot([5, 2], v), [0], [5], None, greedy)
    yield ("k = 0: no draft tokens, one token from the target", torch.zeros(0, v), _one_hot([3], v), [], [3], None,
           "with k = 0 nothing is drafted: return one token drawn from target_probs[0]")
    same = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0, 0.0], [0.25, 0.25, 0.0, 0.0, 0.25, 0.25], [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    yield ("p == q (a draft identical to the target: every token is accepted)", same[:2], same, [3, 4], [3, 4, 5], None,
           "when the draft's distribution equals the target's, p(x) / q(x) = 1: every draft token must be accepted "
           "(accept with probability min(1, p(x) / q(x)), not p(x)), then the bonus token from p_k")
    never = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0, 0.0]])
    target = torch.tensor([[0.0, 0.3, 0.3, 0.4, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    yield ("draft token 0 has target probability 0 (it must be rejected)", never, target, [0], None, {2, 3},
           "a draft token with p(x) = 0 is always rejected (p / q = 0), and the replacement comes from max(0, p - q) "
           "normalised, which is 0 wherever the draft already put at least as much probability as the target")


def _probe_certain(fn, q, p, tokens, tried: str, hint: str) -> list:
    """The step with generators seeded 0..3, where ``fn`` lives."""
    return [_step(fn, q, p, tokens, torch.Generator().manual_seed(seed), f"{tried} (generator seeded {seed})", hint)
            for seed in range(4)]


def _judge_certain(outs, q, p, tokens, tried, expected, allowed_extra, hint) -> None:
    if not isinstance(outs, list) or len(outs) != 4:
        fail(tried, "an incomplete record of what your function returned", "one output per seed (4)",
             "run the grader cell as it is: it records what your function does")
    for seed, out in enumerate(outs):
        seeded = f"{tried} (generator seeded {seed})"
        out = _check_step(out, p.shape[1], tokens, seeded)
        if expected is not None and out.tolist() != expected:
            fail(seeded, out.tolist(), expected, hint)
        if allowed_extra is not None and (len(out) != 1 or int(out[0]) not in allowed_extra):
            fail(seeded, out.tolist(), f"one token from {sorted(allowed_extra)}, where max(0, p_0 - q_0) > 0", hint)


def _generator_tried(q, p, tokens, seed: int) -> str:
    return f"{_describe(q, p, tokens)} twice with generators seeded {seed}, torch's global generator reseeded between"


def _probe_generator(fn, q, p, drafts) -> list:
    """Per row of ``drafts`` (step ``i``): the step twice with generators seeded ``i``, torch's global generator
    seeded differently before each (and restored after), where ``fn`` lives."""
    outs = []
    for step, tokens in enumerate(drafts):
        pair = []
        for global_seed in (step, step + 1000):
            state = torch.random.get_rng_state()
            torch.manual_seed(global_seed)
            try:
                pair.append(_step(fn, q, p, tokens, torch.Generator().manual_seed(step), _generator_tried(q, p, tokens, step)))
            finally:
                torch.random.set_rng_state(state)
        outs.append(pair)
    return outs


def _judge_generator(outs, q, p, drafts) -> None:
    """Equal seeds must give equal tokens whatever torch's global generator holds, and the tokens must vary with
    the seed."""
    if not isinstance(outs, list) or len(outs) != len(drafts):
        fail(_generator_tried(q, p, drafts[0], 0), "an incomplete record of what your function returned",
             f"two outputs per step ({len(drafts)})", "run the grader cell as it is: it records what your function does")
    seen = []
    for step, (tokens, pair) in enumerate(zip(drafts, outs)):
        tried = _generator_tried(q, p, tokens, step)
        first, second = (_check_step(out, p.shape[1], tokens, tried) for out in pair)
        if not torch.equal(first, second):
            fail(tried, f"{first.tolist()} then {second.tolist()}", "the same tokens both times",
                 "draw every random number from `generator`: torch.rand(k, generator=generator) and "
                 "torch.multinomial(..., 1, generator=generator), never torch's global generator")
        seen.append(tuple(first.tolist()))
    if len(set(seen)) == 1:
        fail(f"{_describe(q, p, drafts[-1])} with {len(drafts)} generator seeds", f"always {list(seen[0])}",
             "outputs that vary with the seed", "accept or reject at random (u < p/q with u uniform), not by a fixed comparison")


# ----------------------------------------------------------------------------- the distribution
def _random_probs(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of probabilities, none below 0.05 (so every outcome of the statistical test is seen often enough)."""
    raw = torch.rand(rows, vocab, generator=gen, dtype=torch.float64) + 0.3
    return (raw / raw.sum(-1, keepdim=True)).float()


def exact_outcomes(q: torch.Tensor, p: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Every possible output of one step (draft tokens drawn from ``q``) and its exact probability."""
    q, p = q.double(), p.double()
    k, vocab = q.shape
    agree = torch.minimum(p[:k], q)
    residual = (p[:k] - q).clamp(min=0)
    out = {}
    for n in range(k + 1):
        last = p[k] if n == k else residual[n]
        for prefix in itertools.product(range(vocab), repeat=n):
            head = 1.0
            for j, x in enumerate(prefix):
                head *= float(agree[j, x])
            for t in range(vocab):
                if head * float(last[t]) > 0:
                    out[prefix + (t,)] = head * float(last[t])
    return out


def chi_square_p_value(counts: dict, expected: dict[tuple, float], trials: int, min_expected: float = 5.0) -> float:
    """Pearson's chi-square p-value of observed ``counts`` against ``expected`` probabilities; outcomes expected
    fewer than ``min_expected`` times are pooled into one cell. An outcome of probability 0 fails (p = 0)."""
    if any(outcome not in expected for outcome in counts):
        return 0.0
    cells, pooled_obs, pooled_exp = [], 0.0, 0.0
    for outcome, prob in expected.items():
        if prob * trials >= min_expected:
            cells.append((counts.get(outcome, 0), prob * trials))
        else:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += prob * trials
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)).item()


def _probe_distribution(fn, q, p, drafts, state, tried: str) -> list:
    """The step on every row of ``drafts``, with one generator (in ``state``) for all of them, where ``fn`` lives."""
    gen = torch.Generator()
    gen.set_state(state)
    return [_step(fn, q, p, tokens.contiguous(), gen, tried) for tokens in drafts]


def _check_distribution(outs, q, p, drafts, tried: str) -> None:
    k, vocab = q.shape
    if not isinstance(outs, list) or len(outs) != len(drafts):
        fail(tried, "an incomplete record of what your function returned", f"one output per step ({len(drafts)})",
             "run the grader cell as it is: it records what your function does")
    counts: dict[tuple[int, ...], int] = {}
    for tokens, out in zip(drafts, outs):
        out = tuple(_check_step(out, vocab, tokens, tried).tolist())
        counts[out] = counts.get(out, 0) + 1
    expected = exact_outcomes(q, p)
    p_value = chi_square_p_value(counts, expected, TRIALS)
    if p_value >= FALSE_FAILURE_RATE:
        return
    impossible = [o for o in counts if o not in expected]
    if impossible:
        fail(tried, f"the output {list(impossible[0])}, which has probability 0", "only outputs the rule can produce",
             "the correction token comes from max(0, p_n - q_n): never a token where the draft already gave at least the "
             "target's probability")
    observed_len = [sum(c for o, c in counts.items() if len(o) == n + 1) / TRIALS for n in range(k + 1)]
    expected_len = [sum(pr for o, pr in expected.items() if len(o) == n + 1) for n in range(k + 1)]
    first = [sum(c for o, c in counts.items() if o[0] == t) / TRIALS for t in range(vocab)]
    if max(abs(a - b) for a, b in zip(observed_len, expected_len)) > 0.03:
        hint = ("the number of accepted tokens is off: accept x with probability min(1, p(x) / q(x)), one fresh "
                "uniform per position, and stop at the first rejection")
    else:
        hint = ("how many tokens are accepted looks right, but which tokens come out does not: the correction is drawn "
                "from max(0, p_n - q_n) normalised (not from p_n or q_n), the bonus from p_k = target_probs[k]")
    fail(tried, f"outputs whose frequencies differ from the exact ones (chi-square p-value {p_value:.1e}): tokens "
                f"accepted 0..{k} with frequencies {_fmt(observed_len)}, the first emitted token {_fmt(first)}",
         f"accepted-count probabilities {_fmt(expected_len)} and the first token distributed as target_probs[0] = "
         f"{_fmt(p[0].tolist())} (a correct answer fails this test once in {1 / FALSE_FAILURE_RATE:.0e} seeds)", hint)


def _describe(q, p, tokens=None) -> str:
    k, vocab = p.shape[0] - 1, p.shape[1]
    text = f"k={k}, V={vocab}, {p.dtype} probabilities"
    return text + (f", draft_tokens={tokens.tolist()}" if tokens is not None else "")


def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"
