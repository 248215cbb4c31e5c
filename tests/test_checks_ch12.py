"""The chapter-12 graders accept labkit's answers and independent plain solutions, and reject the realistic wrong
ones (with a hint that names the mistake)."""
import pytest

from labkit.attention_variants import BlockAllocator, PoolExhaustedError
from labkit.checks import CheckFailed
from labkit.checks import ch12_serving as checks  # unwrapped: delegating to labkit is refused by the package-level ones
from labkit.serving.blocks import BlockManager
from labkit.serving.scheduler import StepPlan
from labkit.serving.scheduler import plan_step as labkit_plan_step


def test_reference_answers_pass(capsys):
    checks.block_manager(BlockManager)
    checks.plan_step(labkit_plan_step)
    assert capsys.readouterr().out.count("✓") == 2


# ----------------------------------------------------------------------------- exercise 1: block manager
class PlainRefCounted(BlockAllocator):
    """An independent right answer, built on chapter 03's allocator as the exercise suggests."""

    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size)
        self.refs = [0] * num_blocks
        self.copies = []

    def refcount(self, block):
        return self.refs[block]

    def take_copies(self):
        out, self.copies = self.copies, []
        return out

    def fork(self, parent_id, child_id):
        self.add_sequence(child_id)
        self.block_tables[child_id] = list(self.block_tables[parent_id])
        self.lengths[child_id] = self.lengths[parent_id]
        for b in self.block_tables[child_id]:
            self.refs[b] += 1

    def grow(self, seq_id, num_tokens):
        table, length = self.block_tables[seq_id], self.lengths[seq_id]
        shared = length % self.block_size != 0 and self.refs[table[-1]] > 1
        new = -(-(length + num_tokens) // self.block_size) - len(table)
        if new + shared > self.num_free_blocks:
            raise PoolExhaustedError("pool full")
        if shared:
            fresh = self._free.pop()
            self.refs[table[-1]] -= 1
            self.copies.append((table[-1], fresh))
            table[-1] = fresh
            self.refs[fresh] = 1
        before = len(table)
        slots = super().grow(seq_id, num_tokens)
        for b in table[before:]:
            self.refs[b] = 1
        return slots

    def free(self, seq_id):
        for b in self.block_tables.pop(seq_id):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free.append(b)
        del self.lengths[seq_id]


def test_block_manager_accepts_an_independent_solution(capsys):
    checks.block_manager(PlainRefCounted)
    assert "✓ block_manager:" in capsys.readouterr().out


class NoCopyOnWrite(PlainRefCounted):
    def grow(self, seq_id, num_tokens):
        before = len(self.block_tables[seq_id])
        slots = BlockAllocator.grow(self, seq_id, num_tokens)
        for b in self.block_tables[seq_id][before:]:
            self.refs[b] = 1
        return slots


class CopyKeepsTheOldReference(PlainRefCounted):
    def grow(self, seq_id, num_tokens):
        table, length = self.block_tables[seq_id], self.lengths[seq_id]
        if length % self.block_size and self.refs[table[-1]] > 1:
            self.refs[table[-1]] += 1  # forgot to drop the shared block's count: it never comes back
        return super().grow(seq_id, num_tokens)


class FreeIgnoresRefcounts(PlainRefCounted):
    def free(self, seq_id):
        for b in self.block_tables.pop(seq_id):
            self.refs[b] = max(self.refs[b] - 1, 0)
            self._free.append(b)  # a block another table still holds goes back to the pool
        del self.lengths[seq_id]


class ForkWithoutReferences(PlainRefCounted):
    def fork(self, parent_id, child_id):
        self.add_sequence(child_id)
        self.block_tables[child_id] = list(self.block_tables[parent_id])
        self.lengths[child_id] = self.lengths[parent_id]


class CopiesEveryPartialBlock(PlainRefCounted):
    def grow(self, seq_id, num_tokens):
        table, length = self.block_tables[seq_id], self.lengths[seq_id]
        if length % self.block_size and self.refs[table[-1]] == 1 and self.num_free_blocks:
            self.refs[table[-1]] += 1  # pretend it is shared: copy even a private block
        return super().grow(seq_id, num_tokens)


class CopyWithoutQueueing(PlainRefCounted):
    def take_copies(self):
        self.copies = []
        return []  # the new block never receives the shared block's earlier tokens


class SwappedCopy(PlainRefCounted):
    def take_copies(self):
        return [(dst, src) for src, dst in super().take_copies()]


class ReservesBeforeChecking(PlainRefCounted):
    def grow(self, seq_id, num_tokens):
        table, length = self.block_tables[seq_id], self.lengths[seq_id]
        needed = -(-(length + num_tokens) // self.block_size) - len(table)
        while needed > 0 and self._free:  # takes what it can, then fails: a failed grow that changed the tables
            table.append(self._free.pop())
            self.refs[table[-1]] = 1
            needed -= 1
        if needed:
            raise PoolExhaustedError("pool full")
        return super().grow(seq_id, num_tokens)


class WrongError(PlainRefCounted):
    def grow(self, seq_id, num_tokens):
        try:
            return super().grow(seq_id, num_tokens)
        except PoolExhaustedError:
            raise ValueError("no room") from None


@pytest.mark.parametrize("wrong, hint", [
    (NoCopyOnWrite, "copy"), (CopyKeepsTheOldReference, "refcount"), (FreeIgnoresRefcounts, "refcount"),
    (ForkWithoutReferences, "refcount"), (CopiesEveryPartialBlock, "copy"), (CopyWithoutQueueing, "take_copies"),
    (SwappedCopy, "copy"), (ReservesBeforeChecking, "change nothing"), (WrongError, "PoolExhaustedError"),
])
def test_block_manager_rejects_realistic_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.block_manager(wrong)


def test_block_manager_wants_a_class():
    with pytest.raises(CheckFailed, match="class"):
        checks.block_manager(PlainRefCounted(4, 4))


# ----------------------------------------------------------------------------- exercise 2: plan_step
def blocks_for(n, size):
    return -(-n // size)


def plain_plan(running, waiting, free_blocks, block_size, max_batch_tokens, max_num_seqs, chunked_prefill=True):
    """An independent right answer."""
    plan = StepPlan()
    budget, queue = max_batch_tokens, list(running)
    i = 0
    while i < len(queue) and budget > 0:
        seq = queue[i]
        n = min(seq.num_tokens - seq.num_computed, budget)
        need = blocks_for(seq.num_computed + n, block_size) - seq.num_blocks
        while need > free_blocks and queue[-1] is not seq:
            victim = queue.pop()
            free_blocks += victim.num_blocks - victim.num_shared_blocks
            plan.preempted.append(victim.request_id)
        if need > free_blocks:
            queue.pop()
            plan.preempted.append(seq.request_id)
            break
        plan.scheduled[seq.request_id] = n
        free_blocks -= need
        budget -= n
        i += 1
    if plan.preempted:
        return plan
    count = len(queue)
    for seq in waiting:
        left = seq.num_tokens - seq.num_computed
        if budget == 0 or count >= max_num_seqs or (left > budget and not chunked_prefill):
            break
        n = min(left, budget)
        need = blocks_for(seq.num_computed + n, block_size) - seq.num_blocks
        if need > free_blocks:
            break
        plan.scheduled[seq.request_id] = n
        plan.admitted.append(seq.request_id)
        free_blocks -= need
        budget -= n
        count += 1
    return plan


def test_plan_step_accepts_an_independent_solution(capsys):
    checks.plan_step(plain_plan)
    assert "✓ plan_step:" in capsys.readouterr().out


def waiting_first(running, waiting, *rest):
    return plain_plan([], list(running) + list(waiting), *rest)


def preempts_oldest(running, waiting, *rest):
    return plain_plan(list(reversed(running)), waiting, *rest)


def admits_after_preempting(running, waiting, free_blocks, block_size, budget, max_seqs, chunked=True):
    plan = plain_plan(running, [], free_blocks, block_size, budget, max_seqs, chunked)
    if plan.preempted:
        used = sum(blocks_for(r.num_computed + n, block_size) - r.num_blocks for r in running
                   for rid, n in plan.scheduled.items() if rid == r.request_id)
        freed = sum(r.num_blocks - r.num_shared_blocks for r in running if r.request_id in plan.preempted)
        rest = plain_plan([], waiting, free_blocks + freed - used, block_size, budget - plan.num_tokens,
                          max_seqs - (len(running) - len(plan.preempted)), chunked)
        plan.scheduled.update(rest.scheduled)
        plan.admitted += rest.admitted
        return plan
    return plain_plan(running, waiting, free_blocks, block_size, budget, max_seqs, chunked)


def overtakes(running, waiting, free_blocks, block_size, budget, max_seqs, chunked=True):
    plan = plain_plan(running, [], free_blocks, block_size, budget, max_seqs, chunked)
    if plan.preempted:
        return plan
    for w in waiting:  # skips a request that does not fit and admits a later one
        sub = plain_plan([], [w], free_blocks, block_size, budget - plan.num_tokens,
                         max_seqs - len(running) - len(plan.admitted), chunked)
        if sub.scheduled:
            plan.scheduled.update(sub.scheduled)
            plan.admitted += sub.admitted
            free_blocks -= blocks_for(w.num_computed + sub.scheduled[w.request_id], block_size)
    return plan


def ignores_shared_blocks(running, waiting, *rest):
    from labkit.serving.scheduler import SeqState

    return plain_plan([SeqState(r.request_id, r.num_tokens, r.num_computed, r.num_blocks) for r in running],
                      waiting, *rest)


def always_chunks(running, waiting, free, bs, budget, seqs, chunked=True):
    return plain_plan(running, waiting, free, bs, budget, seqs, True)


def counts_only_admitted(running, waiting, free, bs, budget, seqs, chunked=True):
    return plain_plan(running, waiting, free, bs, budget, seqs + len(running), chunked)


def blocks_for_the_chunk_only(running, waiting, free, bs, budget, seqs, chunked=True):
    from labkit.serving.scheduler import SeqState

    # needs ceil(n / bs) blocks for n new tokens, forgetting the partly filled last block
    def fake(s):
        return SeqState(s.request_id, s.num_tokens, s.num_computed, blocks_for(s.num_computed, bs) * 0)

    return plain_plan([fake(r) for r in running], [fake(w) for w in waiting], free, bs, budget, seqs, chunked)


def budget_ignores_decodes(running, waiting, free, bs, budget, seqs, chunked=True):
    plan = plain_plan(running, [], free, bs, budget, seqs, chunked)
    if plan.preempted:
        return plan
    used = sum(blocks_for(r.num_computed + plan.scheduled[r.request_id], bs) - r.num_blocks
               for r in running if r.request_id in plan.scheduled)
    rest = plain_plan([], waiting, free - used, bs, budget, seqs - len(running), chunked)
    plan.scheduled.update(rest.scheduled)
    plan.admitted += rest.admitted
    return plan


def mutates_running(running, waiting, *rest):
    plan = plain_plan(running, waiting, *rest)
    running.sort(key=lambda r: -r.request_id)
    return plan


@pytest.mark.parametrize("wrong", [waiting_first, preempts_oldest, admits_after_preempting, overtakes,
                                   ignores_shared_blocks, always_chunks, counts_only_admitted,
                                   blocks_for_the_chunk_only, budget_ignores_decodes, mutates_running])
def test_plan_step_rejects_realistic_mistakes(wrong):
    with pytest.raises(CheckFailed):
        checks.plan_step(wrong)


@pytest.mark.parametrize("wrong, hint", [(preempts_oldest, "NEWEST"), (ignores_shared_blocks, "num_shared_blocks"),
                                         (always_chunks, "chunked_prefill=False"), (mutates_running, "left as")])
def test_plan_step_names_the_mistake(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.plan_step(wrong)


def test_plan_step_wants_a_plan():
    with pytest.raises(CheckFailed, match="StepPlan"):
        checks.plan_step(lambda *args: {"scheduled": {}})


# ----------------------------------------------------------------------------- under labkit.grade: probe and judge
def _handle(obj, exercise):
    """The learner's object behind a Remote handle whose requests cross as bytes (as in tests/test_remote.py)."""
    from labkit.checks import _remote

    class LocalTransport(_remote.Transport):
        def exchange(self, request: bytes) -> bytes:
            return _remote.handle(request, {"mine": obj})

    return _remote.Remote(LocalTransport(), "mine", exercise)


@pytest.mark.parametrize("exercise, right, wrong, words", [
    ("block_manager", PlainRefCounted, NoCopyOnWrite, "copy"),
    ("block_manager", PlainRefCounted, WrongError, "PoolExhaustedError"),
    ("plan_step", plain_plan, preempts_oldest, "NEWEST"),
    ("plan_step", plain_plan, mutates_running, "left as"),
])
def test_the_verdicts_are_the_same_through_a_handle(exercise, right, wrong, words, capsys):
    import labkit.checks as graded

    getattr(graded, exercise)(_handle(right, exercise))
    assert f"✓ {exercise}" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match=words):
        getattr(graded, exercise)(_handle(wrong, exercise))


def test_through_a_handle_an_instance_and_labkits_class_are_refused():
    import labkit.checks as graded
    from labkit.checks import DelegationRefused

    with pytest.raises(CheckFailed, match="the class itself"):
        graded.block_manager(_handle(PlainRefCounted(4, 4), "block_manager"))
    with pytest.raises(DelegationRefused, match="BlockManager"):
        graded.block_manager(_handle(BlockManager, "block_manager"))


def test_the_block_manager_verdict_comes_from_the_judge_not_from_the_probe():
    # Under labkit.grade the probe runs in the learner's process and could be replaced there: the judge, in the
    # grading process, replays every case beside labkit's BlockManager and rejects a record that was tampered with.
    import copy

    cases = checks._block_cases()
    honest = checks._probe_block_manager(PlainRefCounted, cases)
    checks._judge_block_manager(cases, honest, [])
    grow = next(i for i, op in enumerate(cases[0][2], start=1) if op[0] == "grow")

    def refcount(records):
        records[0][-1]["refcounts"][0] += 1

    def free(records):
        records[3][5]["free"] -= 1

    def table(records):
        records[0][grow]["tables"][0].append(5)

    def slots(records):
        records[0][grow]["slots"][0] = (9, 9)

    def copies(records):
        event = next(e for r in records for e in r if e.get("copies"))
        event["copies"] = []

    def failed_grow_succeeds(records):
        event = next(e for r in records for e in r if e.get("raised"))
        del event["raised"]

    def cut_short(records):
        records[5].pop()

    for tamper in (refcount, free, table, slots, copies, failed_grow_succeeds, cut_short):
        records = copy.deepcopy(honest)
        tamper(records)
        with pytest.raises(CheckFailed):
            checks._judge_block_manager(cases, records, [])
    for forged in ([], honest[:-1], None, [[{}]] * len(cases), [[{"tables": {}, "free": 0}]] * len(cases)):
        with pytest.raises(CheckFailed):
            checks._judged(checks._judge_block_manager, "block_manager", cases, forged, [])


def test_the_plan_step_verdict_comes_from_the_judge_not_from_the_probe():
    import copy

    cases = checks._plan_cases()
    honest = checks._probe_plan_step(plain_plan, copy.deepcopy(cases))
    checks._judge_plan_step(cases, honest)
    busy = next(i for i, r in enumerate(honest) if r["plan"][0])

    def count(records):
        (rid, n), *rest = records[busy]["plan"][0]
        records[busy]["plan"] = ([(rid, n + 1), *rest], *records[busy]["plan"][1:])

    def again(records):
        records[busy]["again"] = ([], [], [])

    def after(records):
        records[busy]["after"] = ([], [])

    for tamper in (count, again, after):
        records = copy.deepcopy(honest)
        tamper(records)
        with pytest.raises(CheckFailed):
            checks._judge_plan_step(cases, records)
    for forged in ([], honest[:-1], None, [{}] * len(cases), [{"plan": None, "again": None, "after": None}] * len(cases)):
        with pytest.raises(CheckFailed):
            checks._judged(checks._judge_plan_step, "plan_step", cases, forged)
