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
    (lambda n: 18 * n, "bf16 backward"),  # fp32 gradients
    (lambda n: 8 * n, "two fp32 moments"),
    (lambda n: 16 * n + 1, "add bytes"),
    (lambda n: "16N", "return an int"),
    (lambda n: 1 / 0, "ZeroDivisionError"),
])
def test_adamw_bytes_rejects_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.adamw_mixed_precision_bytes(wrong)


def test_ring_step_accepts_reference(capsys):
    checks.ring_allreduce_step(ring_allreduce_step)
    assert "✓ ring_allreduce_step" in capsys.readouterr().out


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
    assert "✓ gradient_collective" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [
    lambda s: "all_reduce",  # ZeRO-2/3 reduce-scatter
    lambda s: {"ddp": "all_gather"}.get(s, gradient_collective(s)),
    lambda s: "allreduce" if s == "ddp" else gradient_collective(s),
    lambda s: "reduce_scatter" if s == "zero1" else gradient_collective(s),
])
def test_gradient_collective_rejects_mistakes(wrong):
    with pytest.raises(CheckFailed, match="expected"):
        checks.gradient_collective(wrong)
