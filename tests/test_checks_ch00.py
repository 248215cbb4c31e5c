"""The chapter-00 graders accept labkit's answers and independent plain solutions, and reject the
realistic wrong ones (with a hint that names the mistake)."""
import numpy as np
import pytest
import torch

from labkit.checks import CheckFailed  # noqa: E402
from labkit.checks import ch00_foundations as checks  # the graders unwrapped: delegating to labkit is refused by the package-level ones (test_checks_refusal.py)
from labkit.data import get_batch
from labkit.train import cross_entropy


def test_reference_answers_pass(capsys):
    checks.get_batch(get_batch)
    checks.cross_entropy(cross_entropy)
    assert capsys.readouterr().out.count("✓") == 2


# ----------------------------------------------------------------------------- get_batch
def plain_get_batch(dataset, batch_size, context_length, device):
    """An independent right answer: one start per row, a slice per window."""
    starts = torch.randint(len(dataset) - context_length, (batch_size,)).tolist()
    rows = [np.asarray(dataset[s : s + context_length + 1], dtype=np.int64) for s in starts]
    windows = torch.tensor(np.stack(rows), device=device)
    return windows[:, :-1], windows[:, 1:]


def test_get_batch_accepts_an_independent_solution(capsys):
    checks.get_batch(plain_get_batch)
    assert "✓ get_batch:" in capsys.readouterr().out


def _windows(dataset, starts, context_length, shift=1, convert=lambda w: torch.from_numpy(w.astype(np.int64))):
    x = torch.stack([convert(np.asarray(dataset[s : s + context_length])) for s in starts])
    y = torch.stack([convert(np.asarray(dataset[s + shift : s + shift + context_length])) for s in starts])
    return x, y


def _starts(dataset, batch_size, context_length):
    return torch.randint(0, len(dataset) - context_length, (batch_size,)).tolist()


def no_shift(dataset, batch_size, context_length, device):
    return _windows(dataset, _starts(dataset, batch_size, context_length), context_length, shift=0)


def misses_last_start(dataset, batch_size, context_length, device):
    starts = torch.randint(0, len(dataset) - context_length - 1, (batch_size,)).tolist()
    return _windows(dataset, starts, context_length)


def float_tokens(dataset, batch_size, context_length, device):
    x, y = get_batch(dataset, batch_size, context_length, device)
    return x.float(), y.float()


def always_first_window(dataset, batch_size, context_length, device):
    return tuple(t.to(device) for t in _windows(dataset, [0] * batch_size, context_length))


def ignores_device(dataset, batch_size, context_length, device):
    return _windows(dataset, _starts(dataset, batch_size, context_length), context_length)


def keeps_dataset_dtype(dataset, batch_size, context_length, device):
    # right for an int64 dataset, but a uint16 token file gives uint16 tokens
    x, y = _windows(dataset, _starts(dataset, batch_size, context_length), context_length,
                    convert=lambda w: torch.from_numpy(w.astype(w.dtype)))
    return x.to(device), y.to(device)


def through_int16(dataset, batch_size, context_length, device):
    x, y = _windows(dataset, _starts(dataset, batch_size, context_length), context_length,
                    convert=lambda w: torch.from_numpy(w.astype(np.int16)).long())
    return x.to(device), y.to(device)


def reseeds(dataset, batch_size, context_length, device):
    torch.manual_seed(0)
    return plain_get_batch(dataset, batch_size, context_length, device)


def shuffles_dataset(dataset, batch_size, context_length, device):
    if dataset.flags.writeable:
        dataset[:] = dataset[::-1].copy()  # "augmentation" in place: the caller's array is changed
    return plain_get_batch(dataset, batch_size, context_length, device)


def returns_list(dataset, batch_size, context_length, device):
    return list(plain_get_batch(dataset, batch_size, context_length, device))


@pytest.mark.parametrize("wrong, hint", [
    (no_shift, "next"),
    (misses_last_start, "last valid start"),
    (float_tokens, "int64"),
    (always_first_window, "new random windows"),
    (ignores_device, "requested device"),
    (keeps_dataset_dtype, "whatever the dataset's dtype"),
    (through_int16, "overflows int16"),
    (reseeds, "do not reseed"),
    (shuffles_dataset, "leave the dataset unchanged"),
    (returns_list, "a tuple"),
])
def test_get_batch_grader_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.get_batch(wrong)


# ----------------------------------------------------------------------------- cross_entropy
def plain_cross_entropy(logits, targets):
    """An independent right answer: fp32 log-softmax by hand, flattened."""
    z = logits.float().reshape(-1, logits.shape[-1])
    z = z - z.max(dim=-1, keepdim=True).values
    log_probs = z - z.exp().sum(dim=-1, keepdim=True).log()
    return -log_probs[torch.arange(z.shape[0], device=z.device), targets.reshape(-1)].mean()


def test_cross_entropy_accepts_an_independent_solution(capsys):
    checks.cross_entropy(plain_cross_entropy)
    checks.cross_entropy(lambda logits, targets: torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))
    assert capsys.readouterr().out.count("✓ cross_entropy:") == 2


def unstable(logits, targets):
    probs = logits.exp() / logits.exp().sum(-1, keepdim=True)
    return -probs.gather(-1, targets.unsqueeze(-1)).log().mean()


def unstable_only_in_16_bit(logits, targets):  # stable in fp32 thanks to the max, but exp of fp16 overflows
    if logits.dtype == torch.float16:
        return -(logits.exp() / logits.exp().sum(-1, keepdim=True)).gather(-1, targets.unsqueeze(-1)).log().mean()
    return cross_entropy(logits, targets)


def summed(logits, targets):
    return cross_entropy(logits, targets) * targets.numel()


def wrong_axis(logits, targets):
    log_probs = logits - logits.logsumexp(dim=0, keepdim=True)
    return -log_probs.gather(-1, targets.unsqueeze(-1)).mean()


def only_2d(logits, targets):  # written for [N, vocab]: dim=1 is the vocab only for 2-D logits
    log_probs = logits - logits.logsumexp(dim=1, keepdim=True) if logits.dim() > 1 else logits - logits.logsumexp(0)
    return -log_probs.gather(-1, targets.unsqueeze(-1)).mean()


def in_place(logits, targets):
    logits -= logits.max(dim=-1, keepdim=True).values.detach()
    return (logits.exp().sum(-1).log() - logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)).mean()


def detached(logits, targets):
    return torch.tensor(cross_entropy(logits, targets).item())


def on_cpu(logits, targets):
    return cross_entropy(logits.cpu(), targets.cpu())


def raises(logits, targets):
    raise RuntimeError("not implemented")


@pytest.mark.parametrize("wrong, hint", [
    (unstable, "subtract each row's max"),
    (unstable_only_in_16_bit, "fp16|fp32"),
    (summed, "divide the summed loss"),
    (wrong_axis, "LAST dim"),
    (only_2d, "whatever the rank"),
    (in_place, "in place"),
    (detached, "backward"),
    (raises, "not implemented"),
])
def test_cross_entropy_grader_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.cross_entropy(wrong)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: on the CPU there is no other device to end up on")
def test_cross_entropy_grader_rejects_a_loss_left_on_the_cpu():
    with pytest.raises(CheckFailed, match="device"):
        checks.cross_entropy(on_cpu)
