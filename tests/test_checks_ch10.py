"""The chapter-10 graders accept labkit's code and plain solutions, and reject the typical wrong answers
with a hint that names the mistake."""
import labkit  # noqa: F401

import pytest
import torch
import torch.nn.functional as F

from labkit.checks import ch10_preference as checks  # the graders unwrapped: delegating to labkit is refused by the package-level ones (test_checks_refusal.py)
from labkit import preference as P
from labkit.checks import CheckFailed


# ----------------------------------------------------------------------------- sequence_logprobs
def logprobs(model, prompt_ids, response_ids, response_mask, *, mistake=None):
    """A learner's sequence_logprobs; ``mistake`` swaps in one typical error."""
    full = torch.cat([prompt_ids, response_ids], 1)
    n = prompt_ids.shape[1]
    if mistake == "no shift":
        logits = model(full)[:, n:]
    else:
        logits = model(full[:, :-1])
        logits = logits if mistake == "prompt" else logits[:, n - 1:]
    if mistake == "no float":
        logp = torch.log_softmax(logits, -1)
    else:
        logp = torch.log_softmax(logits.float(), -1)
    targets = full[:, 1:] if mistake == "prompt" else response_ids
    token = logp.gather(-1, targets[:, :, None]).squeeze(-1)
    if mistake == "prompt":
        mask = torch.cat([torch.ones_like(prompt_ids[:, 1:], dtype=torch.bool), response_mask], 1)
    else:
        mask = response_mask
    if mistake == "padding":
        return token.sum(1)
    total = (token * mask).sum(1)
    if mistake == "mean":
        return total / mask.sum(1)
    if mistake == "detach":
        return total.detach()
    if mistake == "batch mean":
        return total.mean()
    return total


def test_sequence_logprobs_accepts_labkit_and_a_plain_solution(capsys):
    checks.sequence_logprobs(P.sequence_logprobs)
    checks.sequence_logprobs(logprobs)
    assert capsys.readouterr().out.count("✓ sequence_logprobs:") == 2


@pytest.mark.parametrize("mistake, words", [
    ("prompt", "score the response only"),
    ("no shift", "shift by one"),
    ("mean", "return the sum"),
    ("padding", "mask out the padding"),
    ("detach", "DPO backpropagates"),
    ("no float", "float32"),
    ("batch mean", "one number per sequence"),
])
def test_sequence_logprobs_rejects_typical_mistakes(mistake, words):
    with pytest.raises(CheckFailed, match=words):
        checks.sequence_logprobs(lambda *a: logprobs(*a, mistake=mistake))


def test_sequence_logprobs_rejects_state_and_unanswered():
    calls = []

    def stateful(*args):
        calls.append(1)
        return P.sequence_logprobs(*args) + len(calls) * 1e-3

    with pytest.raises(CheckFailed, match="keep state"):
        checks.sequence_logprobs(stateful)

    def unanswered(*args):
        raise NotImplementedError("write it")

    with pytest.raises(CheckFailed, match="raise NotImplementedError"):
        checks.sequence_logprobs(unanswered)


# ----------------------------------------------------------------------------- bradley_terry_loss
def test_bradley_terry_loss_accepts_labkit_and_plain_solutions(capsys):
    checks.bradley_terry_loss(P.bradley_terry_loss)
    checks.bradley_terry_loss(lambda c, r: -F.logsigmoid(c - r).mean())
    checks.bradley_terry_loss(lambda c, r: F.softplus(r - c).mean())
    assert capsys.readouterr().out.count("✓ bradley_terry_loss:") == 3


@pytest.mark.parametrize("wrong, words", [
    (lambda c, r: -F.logsigmoid(r - c).mean(), "sign is flipped"),
    (lambda c, r: -F.logsigmoid(c - r).sum(), "not .sum"),
    (lambda c, r: -torch.log(torch.sigmoid(c - r)).mean(), "logsigmoid"),
    (lambda c, r: -torch.sigmoid(c - r).mean(), "take the log"),
    (lambda c, r: -F.logsigmoid(c - r), "scalar"),
    (lambda c, r: (-F.logsigmoid(c - r).mean()).detach(), "differentiable|requires_grad=False"),
    (lambda c, r: -F.logsigmoid(c.float() - r.float()).mean(), "dtype"),
    (lambda c, r: (F.softplus(-c) + F.softplus(r)).mean(), "difference"),
    (lambda c, r: float(-F.logsigmoid(c - r).mean()), "torch.Tensor|Tensor"),
])
def test_bradley_terry_loss_rejects_typical_mistakes(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        checks.bradley_terry_loss(wrong)


def test_bradley_terry_loss_rejects_mutation():
    def in_place(c, r):
        c -= r
        return -F.logsigmoid(c).mean()

    with pytest.raises(CheckFailed, match="modified"):
        checks.bradley_terry_loss(in_place)


# ----------------------------------------------------------------------------- dpo_loss
def dpo(pc, pr, rc, rr, beta, *, mistake=None):
    """A learner's dpo_loss; ``mistake`` swaps in one typical error."""
    if mistake != "ref grad":
        rc, rr = rc.detach(), rr.detach()
    h = (pc - rc) - (pr - rr)
    if mistake == "no ref":
        h = pc - pr
    if mistake == "sign":
        loss = -F.logsigmoid(-beta * h).mean()
    elif mistake == "beta outside":
        loss = -beta * F.logsigmoid(h).mean()
    elif mistake == "no beta":
        loss = -F.logsigmoid(h).mean()
    elif mistake == "sum":
        loss = -F.logsigmoid(beta * h).sum()
    elif mistake == "log sigmoid":
        loss = -torch.log(torch.sigmoid(beta * h)).mean()
    else:
        loss = -F.logsigmoid(beta * h).mean()
    chosen, rejected = (pc - rc), (pr - rr)
    if mistake != "rewards without beta":
        chosen, rejected = beta * chosen, beta * rejected
    if mistake != "rewards with grad":
        chosen, rejected = chosen.detach(), rejected.detach()
    margins = chosen - rejected
    accuracy = (chosen >= rejected).to(pc.dtype).mean() if mistake == "ties win" else (chosen > rejected).to(pc.dtype).mean()
    return loss, chosen, rejected, margins, accuracy


def test_dpo_loss_accepts_labkit_and_a_plain_solution(capsys):
    checks.dpo_loss(P.dpo_loss)
    checks.dpo_loss(dpo)
    assert capsys.readouterr().out.count("✓ dpo_loss:") == 2


@pytest.mark.parametrize("mistake, words", [
    ("sign", "sign is flipped"),
    ("beta outside", "beta belongs inside the sigmoid"),
    ("no beta", "by beta inside the sigmoid"),
    ("sum", "not .sum"),
    ("log sigmoid", "logsigmoid"),
    ("no ref", "subtract the reference"),
    ("ref grad", "reference model is frozen"),
    ("rewards with grad", "detach"),
    ("rewards without beta", "multiply by beta"),
    ("ties win", "a tie is not a win"),
])
def test_dpo_loss_rejects_typical_mistakes(mistake, words):
    with pytest.raises(CheckFailed, match=words):
        checks.dpo_loss(lambda *a: dpo(*a, mistake=mistake))


def test_dpo_loss_rejects_a_loss_only_answer():
    with pytest.raises(CheckFailed, match="return loss, chosen_rewards"):
        checks.dpo_loss(lambda *a: dpo(*a)[0])
