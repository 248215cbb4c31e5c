import pytest

import labkit  # noqa: F401
from labkit import checks
from labkit.checks import CheckFailed
from labkit.dist import gradient_collective, ring_allreduce_step, ring_chunk
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
    # ZeRO-1 may reduce-scatter the gradients too (ZeRO paper, section 7.2.1): both are accepted, with a note
    checks.gradient_collective(lambda s: "all_reduce" if s == "ddp" else "reduce_scatter")
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
