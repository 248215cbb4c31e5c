import numpy as np
import pytest
import torch

import labkit.checks as checks
from labkit.data import get_batch
from labkit.train import cross_entropy


def test_reference_answers_pass(capsys):
    checks.get_batch(get_batch)
    checks.cross_entropy(cross_entropy)
    assert capsys.readouterr().out.count("✓") == 2


def _windows(dataset, batch_size, context_length, starts, shift=1):
    x = torch.stack([torch.from_numpy(dataset[s : s + context_length].astype(np.int64)) for s in starts])
    y = torch.stack([torch.from_numpy(dataset[s + shift : s + shift + context_length].astype(np.int64)) for s in starts])
    return x, y


def no_shift(dataset, batch_size, context_length, device):
    starts = torch.randint(0, len(dataset) - context_length, (batch_size,)).tolist()
    return _windows(dataset, batch_size, context_length, starts, shift=0)


def misses_last_start(dataset, batch_size, context_length, device):
    starts = torch.randint(0, len(dataset) - context_length - 1, (batch_size,)).tolist()
    return _windows(dataset, batch_size, context_length, starts)


def float_tokens(dataset, batch_size, context_length, device):
    x, y = get_batch(dataset, batch_size, context_length, device)
    return x.float(), y.float()


def always_first_window(dataset, batch_size, context_length, device):
    return _windows(dataset, batch_size, context_length, [0] * batch_size)


@pytest.mark.parametrize("wrong, hint", [
    (no_shift, "next"),
    (misses_last_start, "last valid start"),
    (float_tokens, "long"),
    (always_first_window, "every start"),
])
def test_get_batch_grader_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.get_batch(wrong)


def unstable(logits, targets):
    probs = logits.exp() / logits.exp().sum(-1, keepdim=True)
    return -probs.gather(-1, targets.unsqueeze(-1)).log().mean()


def summed(logits, targets):
    return cross_entropy(logits, targets) * targets.numel()


def wrong_axis(logits, targets):
    log_probs = logits - logits.logsumexp(dim=0, keepdim=True)
    return -log_probs.gather(-1, targets.unsqueeze(-1)).mean()


def raises(logits, targets):
    raise RuntimeError("not implemented")


@pytest.mark.parametrize("wrong, hint", [
    (unstable, "subtract each row's max"),
    (summed, "divide the summed loss"),
    (wrong_axis, "axis"),
    (raises, "not implemented"),
])
def test_cross_entropy_grader_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.cross_entropy(wrong)
