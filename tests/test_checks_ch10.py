"""The chapter-10 graders accept labkit's code and plain solutions, and reject the typical wrong answers
with a hint that names the mistake."""
import labkit  # noqa: F401

import re

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


def test_sequence_logprobs_rejects_squeezing_a_batch_of_one():
    def squeezed(model, prompt_ids, response_ids, response_mask):
        return logprobs(model, prompt_ids, response_ids, response_mask).squeeze()

    with pytest.raises(CheckFailed, match="batch of one"):
        checks.sequence_logprobs(squeezed)


# ----------------------------------------------------------------------------- grpo_advantages
def advantages(rewards, group_size, *, mistake=None):
    """A learner's grpo_advantages; ``mistake`` swaps in one typical error."""
    if rewards.numel() % group_size and mistake != "no check":
        raise ValueError(f"rewards: {rewards.numel()} is not a multiple of group_size={group_size}")
    r = rewards.float() if mistake != "no float" else rewards.to(torch.float64)
    if mistake == "global":
        return (r - r.mean()) / (r.std() + 1e-4)
    groups = r.view(group_size, -1) if mistake == "strided" else r.view(-1, group_size)
    dim = 0 if mistake == "strided" else 1
    centred = groups - groups.mean(dim, keepdim=True)
    if mistake == "no std":
        return centred.reshape(-1)
    std = groups.std(dim, keepdim=True, unbiased=mistake != "population std")
    if mistake == "no eps":
        return (centred / std).reshape(-1)
    return (centred / (std + 1e-4)).reshape(-1)


def test_grpo_advantages_accepts_labkit_and_a_plain_solution(capsys):
    checks.grpo_advantages(P.grpo_advantages)
    checks.grpo_advantages(advantages)
    checks.grpo_advantages(lambda r, g: (lambda x: ((x - x.mean(1, keepdim=True)) / (x.var(1, keepdim=True) + 0).sqrt()
                                                   .add(1e-4)).flatten())(r.float().reshape(-1, g)) if r.numel() % g == 0
                           else (_ for _ in ()).throw(ValueError("ragged")))
    assert capsys.readouterr().out.count("✓ grpo_advantages:") == 3


@pytest.mark.parametrize("mistake, words", [
    ("global", "within each prompt's group"),
    ("strided", "consecutive"),
    ("population std", "sample standard deviation"),
    ("no std", "Dr. GRPO"),
    ("no eps", "std 0"),
    ("no float", "float32"),
    ("no check", "ValueError"),
])
def test_grpo_advantages_rejects_typical_mistakes(mistake, words):
    with pytest.raises(CheckFailed, match=re.escape(words)):
        checks.grpo_advantages(lambda r, g: advantages(r, g, mistake=mistake))


# ----------------------------------------------------------------------------- k3_kl
def k3(logps, ref_logps, mask, *, mistake=None):
    """A learner's k3_kl; ``mistake`` swaps in one typical error."""
    ref = ref_logps if mistake == "ref grad" else ref_logps.detach()
    log_ratio = ref - logps
    per_token = {"k1": -log_ratio, "k2": log_ratio ** 2 / 2,
                 "reversed": torch.exp(-log_ratio) + log_ratio - 1}.get(mistake, torch.exp(log_ratio) - log_ratio - 1)
    if mistake == "times mask":
        masked = per_token * mask
    else:
        masked = torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype))
    total = masked.sum(1)
    if mistake == "sum":
        return total
    if mistake == "padded length":
        return total / mask.shape[1]
    if mistake == "no clamp":
        return total / mask.sum(1)
    if mistake == "detach":
        return (total / mask.sum(1).clamp_min(1)).detach()
    if mistake == "batch mean":
        return masked.sum() / mask.sum()
    return total / mask.sum(1).clamp_min(1)


def test_k3_kl_accepts_a_plain_solution_and_labkits_estimate_turned_into_a_mean(capsys):
    checks.k3_kl(k3)
    # the unwrapped grader (no refusal): labkit's per-sequence sum divided by the lengths is the same number
    checks.k3_kl(lambda lp, ref, m: P.kl_estimate(torch.where(m, lp, ref), ref.detach(), m, "k3") / m.sum(1).clamp_min(1))
    assert capsys.readouterr().out.count("✓ k3_kl:") == 2


@pytest.mark.parametrize("mistake, words", [
    ("k1", "this is k1"),
    ("k2", "this is k2"),
    ("reversed", "other direction"),
    ("sum", "not the sum"),
    ("padded length", "not over the padded length"),
    ("no clamp", "empty response"),
    ("times mask", "inf * 0"),
    ("detach", "requires_grad=False"),
    ("batch mean", "one estimate per response"),
    ("ref grad", "no gradient for the reference"),
])
def test_k3_kl_rejects_typical_mistakes(mistake, words):
    with pytest.raises(CheckFailed, match=re.escape(words)):
        checks.k3_kl(lambda lp, ref, m: k3(lp, ref, m, mistake=mistake))


def test_the_new_graders_refuse_labkits_answers():
    from labkit import checks as graded
    from labkit.checks import DelegationRefused

    with pytest.raises(DelegationRefused, match="grpo_advantages"):
        graded.grpo_advantages(lambda r, g: P.grpo_advantages(r, g))
    with pytest.raises(DelegationRefused, match="kl_estimate"):
        graded.k3_kl(lambda lp, ref, m: P.kl_estimate(lp, ref, m, "k3") / m.sum(1).clamp_min(1))
