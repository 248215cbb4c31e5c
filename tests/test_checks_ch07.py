import pytest

import labkit  # noqa: F401
from labkit.checks import ch07_memory as checks  # the graders unwrapped: delegating to labkit is refused by the package-level ones (test_checks_refusal.py)
from labkit.checks import CheckFailed
from labkit.dist import bucket_plan, gradient_collective, ring_allreduce_step, ring_chunk
from labkit.memory import adamw_mixed_precision_bytes


def test_adamw_bytes_accepts_reference(capsys):
    checks.adamw_mixed_precision_bytes(adamw_mixed_precision_bytes)
    checks.adamw_mixed_precision_bytes(lambda n: 16 * n)
    assert "✓ adamw_mixed_precision_bytes" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,hint", [
    (lambda n: 12 * n, "master"),  # forgot the fp32 master weights
    (lambda n: 18 * n, "main_grad"),  # fp32 gradients: a real recipe, but not this exercise's
    (lambda n: 8 * n, "two fp32 moments"),
    (lambda n: 16 * n + 1, "add bytes"),
    (lambda n: "16N", "return an int"),
    (lambda n: 1 / 0, "ZeroDivisionError"),
    (lambda n: 16.0 * n, "integer arithmetic"),  # a float
    (lambda n: n * 128 / 8, "integer arithmetic"),  # bits / 8 is a float too
])
def test_adamw_bytes_rejects_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.adamw_mixed_precision_bytes(wrong)


def plain_ring_step(buffers, step):
    """An independent right answer: who receives what, computed from the receiver's side."""
    n = len(buffers)
    out = [[chunk.clone() for chunk in rank] for rank in buffers]
    for receiver in range(n):
        sender = (receiver - 1) % n
        chunk = ring_chunk(sender, step, n)
        incoming = buffers[sender][chunk]
        out[receiver][chunk] = buffers[receiver][chunk] + incoming if step < n - 1 else incoming.clone()
    return out


def test_ring_step_accepts_reference(capsys):
    checks.ring_allreduce_step(ring_allreduce_step)
    checks.ring_allreduce_step(plain_ring_step)
    assert capsys.readouterr().out.count("✓ ring_allreduce_step") == 2


def _shallow_copy(buffers, step):  # the untouched chunks are the input's own tensors
    n = len(buffers)
    new = [list(b) for b in buffers]
    for sender in range(n):
        c, receiver = ring_chunk(sender, step, n), (sender + 1) % n
        new[receiver][c] = buffers[receiver][c] + buffers[sender][c] if step < n - 1 else buffers[sender][c] * 1
    return new


def _forwards_without_copy(buffers, step):  # all-gather hands the sender's tensor itself to the receiver
    n = len(buffers)
    new = [[c.clone() for c in b] for b in buffers]
    for sender in range(n):
        c, receiver = ring_chunk(sender, step, n), (sender + 1) % n
        new[receiver][c] = buffers[receiver][c] + buffers[sender][c] if step < n - 1 else buffers[sender][c]
    return new


def _sums_in_fp32(buffers, step):
    return [[c.float() for c in b] for b in ring_allreduce_step(buffers, step)]


def _only_three_ranks(buffers, step):  # a schedule hard-coded for the notebook's 3-rank example
    n = len(buffers)
    new = [[c.clone() for c in b] for b in buffers]
    for sender in range(n):
        c, receiver = (sender - step) % 3 % n, (sender + 1) % n
        new[receiver][c] = buffers[receiver][c] + buffers[sender][c] if step < n - 1 else buffers[sender][c].clone()
    return new


@pytest.mark.parametrize("wrong,hint", [
    (_shallow_copy, "shares its memory"),
    (_forwards_without_copy, "shares its memory"),
    (_sums_in_fp32, "dtype"),
    (_only_three_ranks, "chunk"),
])
def test_ring_step_rejects_realistic_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.ring_allreduce_step(wrong)


def _ring_variant(add_in_gather=False, overwrite_in_reduce=False, direction=1, chunk_offset=0, in_place=False):
    def step_fn(buffers, step):
        n = len(buffers)
        new = buffers if in_place else [[c.clone() for c in b] for b in buffers]
        old = [[c.clone() for c in b] for b in buffers]
        for sender in range(n):
            chunk, receiver = (ring_chunk(sender, step, n) + chunk_offset) % n, (sender + direction) % n
            reduce = step < n - 1
            if (reduce and not overwrite_in_reduce) or (not reduce and add_in_gather):
                new[receiver][chunk] = old[receiver][chunk] + old[sender][chunk]
            else:
                new[receiver][chunk] = old[sender][chunk].clone()
        return new
    return step_fn


@pytest.mark.parametrize("kwargs,hint", [
    (dict(add_in_gather=True), "OVERWRITES"),
    (dict(overwrite_in_reduce=True), "ADDS"),
    (dict(direction=-1), "direction"),
    (dict(chunk_offset=1), "chunk index"),
    (dict(in_place=True), "modified"),
])
def test_ring_step_rejects_mistakes(kwargs, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.ring_allreduce_step(_ring_variant(**kwargs))


def test_gradient_collective_accepts_reference(capsys):
    checks.gradient_collective(gradient_collective)
    # ZeRO-1 may all-reduce the gradients too (labkit's ShardedOptimizerBroadcast): both are accepted, with a note
    checks.gradient_collective(lambda s: "all_reduce" if s in ("ddp", "zero1") else "reduce_scatter")
    checks.gradient_collective(lambda s: "all_reduce" if s == "ddp" else "reduce_scatter_tensor")
    out = capsys.readouterr().out
    assert out.count("✓ gradient_collective") == 3
    assert "ZeRO-1 with all_reduce" in out and "ZeRO-1 with reduce_scatter" in out


@pytest.mark.parametrize("wrong,hint", [
    (lambda s: "all_reduce", "ZeRO-2"),  # ZeRO-2/3 reduce-scatter
    (lambda s: {"ddp": "all_gather"}.get(s, gradient_collective(s)), "full averaged gradient"),
    (lambda s: "allreduce" if s == "ddp" else gradient_collective(s), "torch.distributed's names"),
    (lambda s: "all_gather" if s == "zero1" else gradient_collective(s), "ZeRO-1 shards"),
    (lambda s: __import__("torch").distributed.all_reduce, "a str"),
])
def test_gradient_collective_rejects_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.gradient_collective(wrong)


# ----------------------------------------------------------------------------- exercise 4: the bucket plan
def plain_bucket_plan(params, bucket_cap_bytes):
    """An independent right answer: the trainable indices reversed first, then cut where a bucket would overflow."""
    order = [i for i in range(len(params) - 1, -1, -1) if params[i].requires_grad]
    plan = []
    for i in order:
        nbytes = params[i].nelement() * params[i].element_size()
        last = plan[-1] if plan else None
        if last and params[last[0]].dtype == params[i].dtype and sum(params[j].nbytes for j in last) + nbytes <= bucket_cap_bytes:
            last.append(i)
        else:
            plan.append([i])
    return plan


def test_bucket_plan_accepts_labkits_and_an_independent_answer(capsys):
    checks.bucket_plan(bucket_plan)
    checks.bucket_plan(plain_bucket_plan)
    checks.bucket_plan(lambda params, cap: tuple(tuple(b) for b in bucket_plan(params, cap)))  # tuples are lists too
    assert capsys.readouterr().out.count("✓ bucket_plan") == 3


def _greedy(order="reverse", cap_test="over", dtype_split=True, frozen=False, count_opener=True,
            in_place=False, indices=True):
    """A learner's greedy loop with one of the realistic mistakes switched on."""
    def plan(params, cap):
        items = list(enumerate(params))
        if in_place:
            params.reverse()
            items = [(len(params) - 1 - k, p) for k, p in enumerate(params)]
        elif order == "reverse":
            items = items[::-1]
        buckets, size, dtype = [], 0, None
        for i, p in items:
            if not frozen and not p.requires_grad:
                continue
            nbytes = p.numel() * p.element_size()
            if cap_test == "over":
                full = size + nbytes > cap
            elif cap_test == "exclusive":
                full = size + nbytes >= cap
            else:  # "after": closes a bucket only once it is already past the cap
                full = size > cap
            opens = buckets and full or not buckets or (dtype_split and p.dtype != dtype)
            if opens:
                buckets.append([])
                size, dtype = 0, p.dtype
                if not count_opener:
                    buckets[-1].append(i if indices else p)
                    continue
            buckets[-1].append(i if indices else p)
            size += nbytes
        return buckets
    return plan


def _flushes_the_current_bucket(params, cap):  # appends the (still empty) current bucket before an oversized one
    buckets, current, size = [], [], 0
    for i in range(len(params) - 1, -1, -1):
        p = params[i]
        if not p.requires_grad:
            continue
        nbytes = p.numel() * p.element_size()
        if size + nbytes > cap or (current and params[current[0]].dtype != p.dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    return buckets + [current] if current else buckets


def _torchs_rule(params, cap):  # DDP's own rule: add first, close at >= cap, one open bucket per dtype
    import torch
    trainable = [i for i in range(len(params) - 1, -1, -1) if params[i].requires_grad]
    assignment, _ = torch.distributed._compute_bucket_assignment_by_size([params[i] for i in trainable], [cap])
    return [[trainable[k] for k in bucket] for bucket in assignment]


@pytest.mark.parametrize("wrong,hint", [
    (_greedy(order="forward"), "forward \\(registration\\) order"),
    (_greedy(cap_test="after"), "over the cap"),
    (_greedy(cap_test="exclusive"), "the cap is inclusive"),
    (_greedy(dtype_split=False), "mixes"),
    (_greedy(frozen=True), "requires_grad=False"),
    (_greedy(count_opener=False), "opens a bucket"),
    (_flushes_the_current_bucket, "is empty"),
    (_greedy(in_place=True), "params.reverse\\(\\)"),
    (_greedy(indices=False), "not the tensor itself"),
    (lambda params, cap: [[i] for i in range(len(params) - 1, -1, -1) if params[i].requires_grad], "still fits"),
    (lambda params, cap: [[i for i in range(len(params) - 1, -1, -1) if params[i].requires_grad]], "over the cap|mixes"),
    (_torchs_rule, "over the cap|in reverse registration order"),
    (lambda params, cap: None, "forget `return`"),
])
def test_bucket_plan_rejects_realistic_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.bucket_plan(wrong)


def test_bucket_plan_refuses_labkits_and_torchs_bucketing():
    import torch

    import labkit.checks
    from labkit.checks._core import DelegationRefused
    from labkit.dist import bucket_parameters

    for delegating in (lambda params, cap: bucket_plan(params, cap), lambda params, cap: _torchs_rule(params, cap),
                       lambda params, cap: bucket_parameters(params, cap / 2**20)):
        with pytest.raises(DelegationRefused, match="write it yourself"):
            labkit.checks.bucket_plan(delegating)
    assert torch.distributed._compute_bucket_assignment_by_size([torch.zeros(4)], [8])[0] == [[0]]  # restored after


# ----------------------------------------------------------------------------- exercises 5 and 6: a bucketed DDP and ZeRO-1
# The right answers are the notebook's own %%writefile cells; each mistake is a small edit of them, written to a file
# (the grader's ranks import it), as a learner's cell would be.
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from labkit.student import exercise_text, skeleton, split_cell_magic  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "07_memory_distributed.ipynb"


def notebook_cell(cell_id: str) -> str:
    cells = json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]
    return "".join(next(c for c in cells if c.get("id") == cell_id)["source"])


def learner_class(tmp_path, cell_id: str, class_name: str, edits=(), student=False):
    """The class of the notebook's exercise cell ``cell_id`` after ``edits`` ((old, new) text replacements, each
    of which must apply), or of its student skeleton, written to a file and imported as the notebook does."""
    source = notebook_cell(cell_id)
    if student:
        source = skeleton(source, exercise_text([{"cell_type": "markdown", "source": "**Exercise 4.** Write it."}], 1))
    source = split_cell_magic(source)[1]
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new)
    path = tmp_path / f"{cell_id.replace('-', '_')}_{abs(hash(tuple(edits))) % 10**8}.py"
    path.write_text(source)
    return getattr(checks.import_file(path), class_name)


def test_bucketed_ddp_accepts_the_notebooks_answer(tmp_path, capsys):
    checks.bucketed_ddp(learner_class(tmp_path, "ex4-file", "BucketedDDP"))
    out = capsys.readouterr().out
    assert "✓ bucketed_ddp" in out and "within 1e-4" in out


DDP_MISTAKES = {
    "forgets to divide": ([("            flat /= self.world_size\n", "")], "divide by the world size"),
    "all-reduces after backward": ([("self.pending.append((dist.all_reduce(flat, async_op=True), flat, bucket))",
                                     "self.pending.append((None, flat, bucket))"),
                                    ("            handle.wait()", "            dist.all_reduce(flat)")], "during backward"),
    "blocking all-reduce in the hook": ([("dist.all_reduce(flat, async_op=True)", "dist.all_reduce(flat, async_op=False)"),
                                         ("            handle.wait()", "            handle is None or handle.wait()")], "async_op=True"),
    "one all-reduce per parameter": ([("[[params[i] for i in bucket] for bucket in buckets]", "[[p] for p in reversed(params)]")],
                                     "one per bucket"),
    "one all-reduce for the whole model": ([("[[params[i] for i in bucket] for bucket in buckets]", "[params[::-1]]")],
                                           "one per bucket"),
    "never waits": ([("            handle.wait()\n", "")], "wait"),
    "no broadcast": ([("            dist.broadcast(p.data, src=0)", "            pass")], "broadcast rank 0's parameters"),
    "keeps the counts of the last step": ([("        self.ready = [0] * len(self.buckets)\n        # END", "        # END")],
                                          "reset the per-step state"),
    "never copies back": ([("                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))\n", "")],
                          "this rank's own gradient"),
    "all-reduces in fp32": ([("torch.cat([p.grad.reshape(-1) for p in bucket])", "torch.cat([p.grad.reshape(-1).float() for p in bucket])")],
                            "in its own dtype"),
}


@pytest.mark.parametrize("mistake", DDP_MISTAKES)
def test_bucketed_ddp_rejects_mistakes(tmp_path, mistake):
    edits, hint = DDP_MISTAKES[mistake]
    with pytest.raises(CheckFailed, match=hint):
        checks.bucketed_ddp(learner_class(tmp_path, "ex4-file", "BucketedDDP", edits))


def test_an_unanswered_skeleton_says_so_from_the_ranks(tmp_path):
    for cell, name, grader in (("ex4-file", "BucketedDDP", checks.bucketed_ddp), ("ex5-file", "ZeroOneOptimizer", checks.zero1_optimizer)):
        with pytest.raises(CheckFailed, match="(?s)NotImplementedError: not answered yet.*write your answer in place"):
            grader(learner_class(tmp_path, cell, name, student=True))


def test_a_class_defined_in_the_notebook_is_sent_to_the_file():
    class BucketedDDP:
        pass

    with pytest.raises(CheckFailed, match="%%writefile"):
        checks.bucketed_ddp(BucketedDDP)
    with pytest.raises(CheckFailed, match="the class itself"):
        checks.zero1_optimizer("ZeroOneOptimizer")


def test_zero1_accepts_the_notebooks_answer(tmp_path, capsys):
    checks.zero1_optimizer(learner_class(tmp_path, "ex5-file", "ZeroOneOptimizer"))
    out = capsys.readouterr().out
    assert "✓ zero1_optimizer" in out and "within 1e-4" in out


ZERO_MISTAKES = {
    "forgets to divide": ([("self.shard.grad = grad_shard / self.world_size", "self.shard.grad = grad_shard")],
                          "divide the reduce-scattered shard by the world size"),
    "no padding": ([("self.shard_size = -(-self.numel // self.world_size)", "self.shard_size = self.numel // self.world_size")],
                   "pad the flat buffer"),
    "pads a chunk too many": ([("self.shard_size = -(-self.numel // self.world_size)",
                                "self.shard_size = self.numel // self.world_size + 1")], "NEXT multiple"),
    "steps the full parameters": ([("self.shard = flat[start:start + self.shard_size].clone()", "self.shard = flat.clone()"),
                                   ("        grad_shard = torch.empty(self.shard_size)\n", ""),
                                   ("dist.reduce_scatter_tensor(grad_shard, flat_grad)", "dist.all_reduce(flat_grad); grad_shard = flat_grad"),
                                   ("dist.all_gather_into_tensor(flat, self.shard)", "flat = self.shard.detach()")],
                                  "reduce-scatter the flat gradient buffer instead"),
    "no all-gather": ([("        flat = torch.empty(self.padded)\n        dist.all_gather_into_tensor(flat, self.shard)\n",
                        "        flat = torch.zeros(self.padded)\n"
                        "        flat[:self.numel] = torch.cat([p.reshape(-1) for p in self.params])\n"
                        "        flat[self.rank * self.shard_size:(self.rank + 1) * self.shard_size] = self.shard\n")],
                      "all-gather the updated shards"),
    "all-gathers the gradients": ([("dist.all_gather_into_tensor(flat, self.shard)", "dist.all_gather_into_tensor(flat, self.shard.grad)")],
                                  "not the gradient shard"),
    "shard index off by one": ([("start = self.rank * self.shard_size", "start = (self.rank + 1) % self.world_size * self.shard_size")],
                               "shard"),
    "divides the gradients in place": ([("        flat_grad = torch.zeros(self.padded)\n",
                                         "        for p in self.params:\n            p.grad /= self.world_size\n"
                                         "        flat_grad = torch.zeros(self.padded)\n"),
                                        ("self.shard.grad = grad_shard / self.world_size", "self.shard.grad = grad_shard")],
                                       "changes the caller's gradients"),
    "the shard is a view of the full buffer": ([("self.shard = flat[start:start + self.shard_size].clone()",
                                                 "self.shard = flat[start:start + self.shard_size]")], "own storage"),
    "no reduction": ([("dist.reduce_scatter_tensor(grad_shard, flat_grad)",
                       "grad_shard = flat_grad[self.rank * self.shard_size:(self.rank + 1) * self.shard_size] * self.world_size")],
                     "reduce_scatter_tensor of the flat gradient buffer"),
}


@pytest.mark.parametrize("mistake", ZERO_MISTAKES)
def test_zero1_rejects_mistakes(tmp_path, mistake):
    edits, hint = ZERO_MISTAKES[mistake]
    with pytest.raises(CheckFailed, match=hint):
        checks.zero1_optimizer(learner_class(tmp_path, "ex5-file", "ZeroOneOptimizer", edits))
