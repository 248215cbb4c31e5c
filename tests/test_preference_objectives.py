"""labkit.preference's variants of the objectives: IPO and Dr. GRPO against the formulas TRL publishes, and the
exact expected updates (GRPO's on a categorical policy, a KL estimator's used as a loss) against brute force and
closed forms."""
import labkit  # noqa: F401

import copy
import itertools
import math

import numpy as np
import pytest
import torch

from labkit import preference as P
from labkit.pretrained import adder_task


def finite_difference(f, x, eps=1e-6):
    grad = torch.zeros_like(x)
    for i in range(x.numel()):
        step = torch.zeros_like(x).view(-1)
        step[i] = eps
        step = step.view_as(x)
        grad.view(-1)[i] = (f(x + step) - f(x - step)) / (2 * eps)
    return grad


# ----------------------------------------------------------------------------- IPO
def test_ipo_loss_is_trls_squared_gap_minimised_at_half_inverse_beta():
    gen = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(7, generator=gen, dtype=torch.float64) * 3 for _ in range(4))
    beta = 0.25
    out = P.dpo_loss(pc, pr, rc, rr, beta, loss_type="ipo")
    logits = (pc - pr) - (rc - rr)  # TRL: pi_logratios - ref_logratios
    assert out.loss.item() == pytest.approx(((logits - 1 / (2 * beta)) ** 2).mean().item(), rel=1e-12)
    torch.testing.assert_close(out.margins, beta * logits)  # the logged quantities are DPO's
    pc_ = pc.clone().requires_grad_(True)
    P.dpo_loss(pc_, pr, rc, rr, beta, loss_type="ipo").loss.backward()
    torch.testing.assert_close(pc_.grad, finite_difference(lambda x: P.dpo_loss(x, pr, rc, rr, beta, loss_type="ipo").loss, pc))
    # at h = 1 / (2 beta) the gradient vanishes; DPO's never does at a finite gap
    at_target = (pr + (rc - rr) + 1 / (2 * beta)).requires_grad_(True)
    P.dpo_loss(at_target, pr, rc, rr, beta, loss_type="ipo").loss.backward()
    assert at_target.grad.abs().max().item() < 1e-12
    at_target.grad = None
    P.dpo_loss(at_target, pr, rc, rr, beta).loss.backward()
    assert (at_target.grad < 0).all()
    with pytest.raises(ValueError, match="loss_type"):
        P.dpo_loss(pc, pr, rc, rr, beta, loss_type="hinge")
    with pytest.raises(ValueError, match="label_smoothing"):
        P.dpo_loss(pc, pr, rc, rr, beta, label_smoothing=0.1, loss_type="ipo")


# ----------------------------------------------------------------------------- Dr. GRPO
def test_dr_grpo_advantages_and_loss_match_trls_formulas():
    gen = torch.Generator().manual_seed(1)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv = P.grpo_advantages(rewards, 4, scale_rewards=False)
    torch.testing.assert_close(adv, rewards - rewards.view(2, 4).mean(1).repeat_interleave(4))
    n, width = 8, 5
    logps = (-torch.rand(n, width, generator=gen, dtype=torch.float64) * 2).requires_grad_(True)
    old = logps.detach() + 0.3 * torch.randn(n, width, generator=gen, dtype=torch.float64)
    ref = logps.detach() + 0.3 * torch.randn(n, width, generator=gen, dtype=torch.float64)
    mask = torch.arange(width)[None] < torch.tensor([5, 1, 3, 2, 4, 5, 2, 3])[:, None]
    advantages = torch.randn(n, generator=gen, dtype=torch.float64)
    beta, clip = 0.1, 0.2
    # TRL's per-token loss, written out: -(min(rho A, clip(rho) A) - beta k3)
    rho = torch.exp(logps - old)
    k3 = torch.exp(ref - logps) - (ref - logps) - 1
    a = advantages[:, None]
    per_token_loss = -(torch.minimum(rho * a, torch.clamp(rho, 1 - clip, 1 + clip) * a) - beta * k3)
    trl_grpo = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    trl_dr_grpo = (per_token_loss * mask).sum() / (per_token_loss.size(0) * width)  # max_completion_length = width
    for loss_type, expected in (("grpo", trl_grpo), ("dr_grpo", trl_dr_grpo)):
        got = P.grpo_loss(logps, old, ref, mask, advantages, beta, clip, loss_type=loss_type).loss
        assert got.item() == pytest.approx(expected.item(), rel=1e-12)
        grad, = torch.autograd.grad(got, logps)
        expected_grad, = torch.autograd.grad(expected, logps, retain_graph=True)
        torch.testing.assert_close(grad, expected_grad)
    with pytest.raises(ValueError, match="loss_type"):
        P.grpo_loss(logps, old, ref, mask, advantages, loss_type="dapo")


def brute_force_expected_gradient(logits, rewards, lengths, group_size, loss_type, scale_rewards):
    """Every ordered group of responses, its probability the product of its members', its update written out by
    hand: at rho = 1 the objective's gradient is sum_i w_i grad log pi(o_i), w_i = A_i / (G |o_i|) (GRPO) or
    A_i / (G T_max) (Dr. GRPO), and grad log softmax(logits)[k] = e_k - pi."""
    pi = np.exp(logits - np.logaddexp.reduce(logits))
    rewards, lengths = np.asarray(rewards, dtype=float), np.asarray(lengths)
    total = np.zeros(len(pi))
    for group in itertools.product(range(len(pi)), repeat=group_size):
        r = rewards[list(group)]
        adv = r - r.mean()
        if scale_rewards:
            adv = adv / (r.std(ddof=1) + 1e-4)
        divisor = lengths[list(group)] if loss_type == "grpo" else np.full(group_size, lengths.max())
        grad = sum(a / (group_size * d) * (np.eye(len(pi))[k] - pi) for a, d, k in zip(adv, divisor, group))
        total += np.prod(pi[list(group)]) * grad
    return total


@pytest.mark.parametrize("loss_type,scale_rewards", [("grpo", True), ("grpo", False), ("dr_grpo", False), ("dr_grpo", True)])
def test_expected_grpo_gradient_matches_a_sum_over_every_ordered_group(loss_type, scale_rewards):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, generator=gen, dtype=torch.float64)
    rewards, lengths = [1.0, 0.0, 0.5, 0.0], [3, 1, 4, 2]
    got = P.expected_grpo_gradient(logits, rewards, lengths, 4, loss_type=loss_type, scale_rewards=scale_rewards)
    expected = brute_force_expected_gradient(logits.numpy(), rewards, lengths, 4, loss_type, scale_rewards)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-12)  # advantages are float32


def test_dr_grpo_expected_gradient_is_the_policy_gradient_of_the_expected_reward():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, generator=gen, dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)  # exact in float32 too
    lengths = [2, 7, 3, 5, 1]
    group = 6
    pi = torch.softmax(logits, -1)
    grad_j = pi * (rewards - (pi * rewards).sum())  # d/dlogits of sum_k pi_k r_k
    got = P.expected_grpo_gradient(logits, rewards, lengths, group, loss_type="dr_grpo", scale_rewards=False)
    torch.testing.assert_close(got, (group - 1) / (group * max(lengths)) * grad_j, rtol=1e-6, atol=1e-12)  # float32 advantages
    grpo = P.expected_grpo_gradient(logits, rewards, lengths, group, loss_type="grpo", scale_rewards=False)
    assert (grpo / grad_j).std() > 0.1  # with 1/|o| it is not parallel to the policy gradient
    with pytest.raises(ValueError, match="lengths"):
        P.expected_grpo_gradient(logits, rewards, [2, 7, 3, 5, 0], group)
    with pytest.raises(TypeError, match="logits"):
        P.expected_grpo_gradient(logits[None], rewards, lengths, group)


# ----------------------------------------------------------------------------- KL estimators as losses
def test_expected_kl_loss_gradient_closed_forms():
    gen = torch.Generator().manual_seed(4)
    logits, ref_logits = torch.randn(3, 9, generator=gen) * 2, torch.randn(3, 9, generator=gen) * 2
    p, q = torch.softmax(logits.double(), -1), torch.softmax(ref_logits.double(), -1)
    forward_kl = (p * (p / q).log()).sum(-1, keepdim=True)
    # d/dlogits KL(p || q) = p (log(p / q) - KL(p || q));  d/dlogits KL(q || p) = p - q
    torch.testing.assert_close(P.expected_kl_loss_gradient(logits, ref_logits, "k2"), p * ((p / q).log() - forward_kl))
    torch.testing.assert_close(P.expected_kl_loss_gradient(logits, ref_logits, "k3"), p - q)
    torch.testing.assert_close(P.expected_kl_loss_gradient(logits, ref_logits, "k1"), torch.zeros_like(p))
    assert P.expected_kl_loss_gradient(logits, ref_logits).dtype == torch.float64
    with pytest.raises(ValueError, match="one shape"):
        P.expected_kl_loss_gradient(logits, ref_logits[:2])
    with pytest.raises(ValueError, match="estimator"):
        P.expected_kl_loss_gradient(logits, ref_logits, "k4")


def test_k3_in_the_loss_sampled_follows_the_reverse_kl():
    """The same as a Monte Carlo run of what GRPO does: sample tokens, backpropagate the mean k3."""
    p_logits, q_logits = torch.tensor([1.0, -0.5, 0.3, 2.0]), torch.tensor([0.0, 1.0, -1.0, 0.5])
    theta = p_logits.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)
    draws = torch.multinomial(logp.exp().detach(), 400_000, replacement=True, generator=torch.Generator().manual_seed(0))
    every = torch.ones(len(draws), 1, dtype=torch.bool)
    k3 = P.kl_estimate(logp[draws][:, None], torch.log_softmax(q_logits, -1)[draws][:, None], every, "k3")
    sampled, = torch.autograd.grad(k3.mean(), theta)
    reverse_kl_grad = torch.softmax(p_logits.double(), -1) - torch.softmax(q_logits.double(), -1)
    torch.testing.assert_close(sampled.double(), reverse_kl_grad, atol=5e-3, rtol=0)


# ----------------------------------------------------------------------------- plumbing
def test_train_grpo_and_train_dpo_take_the_variants():
    task = adder_task()
    early = P.load_early_adder()
    policy = copy.deepcopy(early).requires_grad_(True)
    log = P.train_grpo(policy, early, task, P.verifiable_reward(task), steps=2, prompts_per_step=4, group_size=4,
                       loss_type="dr_grpo", scale_rewards=False, progress=False)
    assert len(log["loss"]) == 2 and all(math.isfinite(v) for v in log["loss"])
    assert any(not torch.equal(a, b) for a, b in zip(policy.parameters(), early.parameters()))
    pairs = P.make_preference_pairs(task, "train", "concise", max_pairs=32)
    dpo_policy = copy.deepcopy(early).requires_grad_(True)
    log = P.train_dpo(dpo_policy, early, pairs, steps=3, lr=1e-3, beta=0.5, loss_type="ipo", progress=False)
    # the IPO loss at the start (policy = reference, h = 0) is (0 - 1/(2 beta))^2 = 1
    assert log["loss"][0] == pytest.approx(1.0, abs=1e-5)
