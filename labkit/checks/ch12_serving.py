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
"""
from __future__ import annotations

import itertools
import random

import torch

from labkit.attention_variants import PoolExhaustedError
from labkit.checks._core import as_tensor, call, call_on_copies, fail, passed
from labkit.serving.blocks import BlockManager, blocks_for
from labkit.serving.scheduler import SeqState
from labkit.serving.scheduler import plan_step as _reference_plan

__all__ = ["block_manager", "plan_step", "speculative_accept"]


# ============================================================================ exercise 1: the block manager
def _canonical(tables: dict) -> dict:
    """Tables with block ids renamed by first appearance (sequences in sorted order): equal exactly when two
    allocators share the same table positions, whatever ids they picked."""
    names: dict = {}
    return {seq: [names.setdefault(b, len(names)) for b in tables[seq]] for seq in sorted(tables, key=str)}


def _state(manager, seqs, tried: str, who: str = "your allocator") -> tuple:
    tables = getattr(manager, "block_tables", None)
    if not isinstance(tables, dict):
        fail(tried, f"block_tables is a {type(tables).__name__}", "a dict seq_id -> list of block ids",
             "keep chapter 03's BlockAllocator attributes: block_tables, lengths, num_free_blocks")
    tables = {s: list(tables.get(s, [])) for s in seqs}
    free = manager.num_free_blocks
    return tables, free


def _check_refcounts(manager, tables: dict, num_blocks: int, tried: str) -> None:
    held: dict = {}
    for table in tables.values():
        for block in table:
            held[block] = held.get(block, 0) + 1
    for block in range(num_blocks):
        got = call(manager.refcount, tried + f"; then refcount({block})", block)
        if got != held.get(block, 0):
            fail(tried + f"; then refcount({block})", got, f"{held.get(block, 0)} (the number of block tables holding "
                 f"block {block})", "a block's refcount is how many tables hold it: +1 when a table takes it (grow, "
                 "fork), -1 when one lets go (free, or a copy-on-write that swaps it for a private copy)")
    free_expected = num_blocks - len(held)
    if manager.num_free_blocks != free_expected:
        fail(tried, f"num_free_blocks {manager.num_free_blocks}", f"{free_expected} ({len(held)} of {num_blocks} "
             f"blocks are in some table)", "a block goes back to the free list when its refcount reaches 0, not before "
             "and not later")


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


def _run_ops(cls, num_blocks: int, block_size: int, ops: list, label: str) -> int:
    mine = call(cls, f"{label}: cls(num_blocks={num_blocks}, block_size={block_size})", num_blocks, block_size)
    ref = BlockManager(num_blocks, block_size, prefix_caching=False)
    pool: dict = {}  # (block, offset) -> the (seq_id, position) written there
    tried, seqs, copies_seen = label, [], 0
    for op in ops:
        tried = f"{label}: ... {op[0]}{op[1:]}"
        if op[0] == "add":
            call(mine.add_sequence, tried, op[1])
            ref.add_sequence(op[1])
            seqs.append(op[1])
        elif op[0] == "fork":
            call(mine.fork, tried, op[1], op[2])
            ref.fork(op[1], op[2])
            seqs.append(op[2])
        elif op[0] == "free":
            call(mine.free, tried, op[1])
            ref.free(op[1])
            seqs.remove(op[1])
        else:
            seq, count = op[1], op[2]
            try:
                ref.grow(seq, count)
            except PoolExhaustedError:
                before = _state(mine, seqs, tried)
                lengths_before = dict(getattr(mine, "lengths", {}))
                try:
                    mine.grow(seq, count)
                except PoolExhaustedError:
                    pass
                except Exception as err:
                    fail(tried, f"{type(err).__name__}: {err}", "PoolExhaustedError",
                         "raise labkit.attention_variants.PoolExhaustedError when the free list holds too few blocks")
                else:
                    fail(tried, "no error", f"PoolExhaustedError (only {ref.num_free_blocks} blocks are free)",
                         "count the blocks the tokens need (a copy-on-write needs one too) before taking any")
                if _state(mine, seqs, tried) != before or dict(getattr(mine, "lengths", {})) != lengths_before:
                    fail(tried, "the tables, lengths or free list changed", "nothing changed by a failed grow",
                         "check that enough blocks are free first, then take them: a failed grow must change nothing")
                continue
            start = ref.lengths[seq] - count
            slots = call(mine.grow, tried, seq, count)
            if not isinstance(slots, list) or len(slots) != count:
                fail(tried, repr(slots)[:80], f"a list of {count} (block, offset) slots",
                     "return the slot of every new token, as chapter 03's BlockAllocator.grow does")
            copies = call(mine.take_copies, tried + "; then take_copies()")
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
            table = mine.block_tables[seq]
            for i, slot in enumerate(slots):
                position = start + i
                expected_slot = (table[position // block_size], position % block_size)
                if tuple(slot) != expected_slot:
                    fail(tried, f"slot {tuple(slot)} for position {position}", f"{expected_slot} (block table "
                         f"{table})", "position p lives in block_tables[seq][p // block_size] at offset "
                                      "p % block_size")
                pool[expected_slot] = (seq, position)
        tables, _ = _state(mine, seqs, tried)
        ref_tables = {s: ref.block_tables[s] for s in seqs}
        if _canonical(tables) != _canonical(ref_tables):
            fail(tried, f"block tables {_canonical(tables)} (ids renamed by first appearance)",
                 f"{_canonical(ref_tables)}",
                 "fork shares every block of the parent; grow adds blocks only when the last one is full, and "
                 "replaces a shared block it writes into by a private copy; other tables keep theirs")
        _check_refcounts(mine, tables, num_blocks, tried)
        for s in seqs:
            length = ref.lengths[s]
            for position in range(length):
                slot = (tables[s][position // block_size], position % block_size)
                owner = pool.get(slot)
                if owner is None or owner[1] != position or not _same_lineage(owner[0], s, ops):
                    fail(tried, f"sequence {s} reads position {position} from slot {slot}, written by "
                                f"{'nobody' if owner is None else f'sequence {owner[0]} at position {owner[1]}'}",
                         f"its own token at position {position}",
                         "a write into a block another sequence also holds changes that sequence's K/V: copy the "
                         "block first (copy-on-write), and queue the copy so its earlier contents come along")
    if mine.num_free_blocks != num_blocks:
        fail(tried, f"num_free_blocks {mine.num_free_blocks} after every sequence was freed", str(num_blocks),
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


def block_manager(cls) -> None:
    """Grade ``cls(num_blocks, block_size)``: chapter 03's block allocator (``add_sequence``, ``grow(seq_id,
    num_tokens) -> slots``, ``free``, ``block_tables``, ``lengths``, ``num_free_blocks``) with reference counts
    (``refcount(block)``), ``fork(parent_id, child_id)`` sharing every block, and copy-on-write: a ``grow`` whose
    first slot lies in a block with refcount > 1 first swaps it for a fresh block and queues ``(shared, fresh)``,
    returned (and forgotten) by ``take_copies()``."""
    if not isinstance(cls, type):
        fail("block_manager(cls)", f"a {type(cls).__name__}", "a class", "hand in the class itself, not an instance")
    rng = random.Random(0)
    copies = 0
    cases = [(6, 4, [("add", 0), ("grow", 0, 6), ("fork", 0, 1), ("grow", 1, 1), ("grow", 0, 1), ("grow", 0, 20),
                     ("free", 0), ("grow", 1, 2), ("free", 1)])]
    cases += [(rng.choice([4, 8, 16]), rng.choice([1, 2, 4]), None) for _ in range(30)]
    for index, (num_blocks, block_size, ops) in enumerate(cases):
        ops = ops or _ops(rng, num_blocks, 40)
        copies += _run_ops(cls, num_blocks, block_size, ops, f"case {index} (num_blocks={num_blocks}, "
                                                             f"block_size={block_size})")
    passed("block_manager", f"{len(cases)} random sequences of add/grow/fork/free agree with labkit's BlockManager "
                            f"(tables, refcounts, free blocks; {copies} copy-on-writes), no write reached another "
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


def plan_step(fn) -> None:
    """Grade ``fn(running, waiting, free_blocks, block_size, max_batch_tokens, max_num_seqs, chunked_prefill)
    -> StepPlan``: one iteration of labkit's scheduler (:mod:`labkit.serving.scheduler`): running requests first,
    oldest first (a decode takes 1 token, an unfinished prefill the rest of its prompt cut to the budget),
    preempting the newest running request while the blocks needed are not free; then, if nothing was preempted,
    waiting requests in order (whole prompts, or chunks with ``chunked_prefill``) until one does not fit."""
    if not callable(fn):
        fail("plan_step(fn)", f"a {type(fn).__name__}", "a function", "hand in the function itself")
    cases = _plan_cases()
    for running, waiting, free, block_size, budget, max_seqs, chunked in cases:
        args = (running, waiting, free, block_size, budget, max_seqs, chunked)
        tried = (f"plan_step(running={running}, waiting={waiting}, free_blocks={free}, block_size={block_size}, "
                 f"max_batch_tokens={budget}, max_num_seqs={max_seqs}, chunked_prefill={chunked})")
        running_copy, waiting_copy = list(running), list(waiting)
        got = _plan_of(call(fn, tried, *args), tried)
        if running != running_copy or waiting != waiting_copy:
            fail(tried, "the running or waiting list was changed", "the inputs left as they were",
                 "plan on copies (list(running)): the engine carries the plan out itself")
        again = _plan_of(call(fn, tried + " (called a second time)", *args), tried)
        expected = _plan_of(_reference_plan(*args), tried)
        if got != expected or again != got:
            hint = "decodes and unfinished prefills first, then waiting requests in order; see the policy above"
            for variant, variant_hint in _wrong_variants():
                if _plan_of(variant(*args), tried) == got:
                    hint = variant_hint
                    break
            fail(tried, f"scheduled {got[0]}, preempted {got[1]}, admitted {got[2]}",
                 f"scheduled {expected[0]}, preempted {expected[1]}, admitted {expected[2]}", hint)
    passed("plan_step", f"{len(cases)} states (decodes, chunks, cached prefixes, shared blocks, full pools, budgets "
                        "of 1, chunked and not) planned exactly as labkit's scheduler plans them, inputs untouched")

FALSE_FAILURE_RATE = 1e-6
TRIALS = 2000  # per statistical case: the usual mistakes then reach p-values below 1e-30 (measured), far past the bound
_HINT_RULE = ("for i in 0..k-1: accept x = draft_tokens[i] if u_i < p_i(x) / q_i(x) (u_i uniform in [0, 1) from "
              "`generator`); at the first rejection draw the last token from max(0, p_i - q_i) normalised and stop; "
              "if all k were accepted draw a bonus token from p_k = target_probs[k]")


def speculative_accept(fn) -> None:
    """Grade ``fn(draft_probs [k, V], target_probs [k + 1, V], draft_tokens [k] int64, generator) -> int64 [n + 1]``."""
    for case in _certain_cases():
        _check_certain(fn, *case)
    _check_uses_only_the_generator(fn)
    gen = torch.Generator().manual_seed(12)
    for vocab, k, dtype in ((4, 3, torch.float32), (3, 2, torch.float64)):
        q = _random_probs(k, vocab, gen).to(dtype)
        p = _random_probs(k + 1, vocab, gen).to(dtype)
        _check_distribution(fn, q, p, seed=vocab * 100 + k)
    passed("speculative_accept", "certain cases (greedy one-hot rows, p == q, a token the target never picks, k = 0) "
                                 "and the exact distribution of the emitted tokens over "
                                 f"{2 * TRIALS} random steps (chi-square, V = 4 and 3, k = 3 and 2, fp32 and fp64)")


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


def _check_certain(fn, description, q, p, draft_tokens, expected, allowed_extra, hint):
    tokens = torch.tensor(draft_tokens, dtype=torch.long)
    for seed in range(4):
        tried = f"{_describe(q, p, tokens)}: {description} (generator seeded {seed})"
        out = _call(fn, q, p, tokens, torch.Generator().manual_seed(seed), tried, hint)
        if expected is not None and out.tolist() != expected:
            fail(tried, out.tolist(), expected, hint)
        if allowed_extra is not None and (len(out) != 1 or int(out[0]) not in allowed_extra):
            fail(tried, out.tolist(), f"one token from {sorted(allowed_extra)}, where max(0, p_0 - q_0) > 0", hint)


def _call(fn, q, p, tokens, generator, tried, hint: str = _HINT_RULE) -> torch.Tensor:
    raised_hint = (hint + "; torch.multinomial raises on negative weights or a zero sum: the residual is "
                   "(p - q).clamp(min=0), and when p == q nothing is ever rejected")
    out = as_tensor(call_on_copies(fn, tried, q, p, tokens, generator, hint=raised_hint,
                                   mutation_hint="leave draft_probs, target_probs and draft_tokens unchanged: "
                                                 "compute max(0, p - q) into a new tensor (no in-place clamp_)"), tried)
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
    if not 0 <= int(out[n]) < p.shape[1]:
        fail(tried, out.tolist(), f"token ids in [0, {p.shape[1]})", "draw the last token with torch.multinomial(..., 1)")
    return out


def _check_uses_only_the_generator(fn) -> None:
    gen = torch.Generator().manual_seed(5)
    q, p = _random_probs(3, 5, gen), _random_probs(4, 5, gen)
    outs = []
    for step in range(12):
        tokens = torch.multinomial(q, 1, generator=gen)[:, 0]
        tried = f"{_describe(q, p, tokens)} twice with generators seeded {step}, torch's global generator reseeded between"
        got = []
        for global_seed in (step, step + 1000):
            state = torch.random.get_rng_state()
            torch.manual_seed(global_seed)
            try:
                got.append(_call(fn, q, p, tokens, torch.Generator().manual_seed(step), tried))
            finally:
                torch.random.set_rng_state(state)
        if not torch.equal(got[0], got[1]):
            fail(tried, f"{got[0].tolist()} then {got[1].tolist()}", "the same tokens both times",
                 "draw every random number from `generator`: torch.rand(k, generator=generator) and "
                 "torch.multinomial(..., 1, generator=generator), never torch's global generator")
        outs.append(tuple(got[0].tolist()))
    if len(set(outs)) == 1:
        fail(f"{_describe(q, p, tokens)} with 12 generator seeds", f"always {list(outs[0])}", "outputs that vary with the seed",
             "accept or reject at random (u < p/q with u uniform), not by a fixed comparison")


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


def _check_distribution(fn, q, p, seed: int) -> None:
    k, vocab = q.shape
    gen = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, ...], int] = {}
    tried = f"{TRIALS} steps with {_describe(q, p)}, draft tokens drawn from draft_probs, one generator seeded {seed}"
    drafts = torch.multinomial(q.float(), TRIALS, replacement=True, generator=gen).T  # [TRIALS, k], row j ~ q_j
    for tokens in drafts:
        out = tuple(_call(fn, q, p, tokens.contiguous(), gen, tried).tolist())
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
