"""labkit.preference's PPO (InstructGPT's recipe): GAE against a direct sum of discounted TD residuals and its
limits, the per-token rewards, the value model's positions, the loss against its formulas and finite
differences, one PPO run on the adder, and what PPO costs beside GRPO (passes and bytes, counted)."""
import labkit  # noqa: F401

import copy

import pytest
import torch

from labkit import preference as P
from labkit.model import TransformerLM, tiny_config
from labkit.pretrained import adder_task


def ragged(n=5, width=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    lengths[0] = width  # one row without padding
    mask = torch.arange(width)[None] < lengths[:, None]
    rewards = torch.randn(n, width, generator=gen, dtype=torch.float64)
    values = torch.randn(n, width, generator=gen, dtype=torch.float64)
    return rewards, values, mask, lengths


def direct_gae(rewards, values, lengths, gamma, lam):
    """A_t = sum_{l >= 0} (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t, V past the end = 0."""
    out = torch.zeros_like(rewards)
    for i, n in enumerate(lengths.tolist()):
        v = values[i, :n].tolist() + [0.0]
        deltas = [rewards[i, t].item() + gamma * v[t + 1] - v[t] for t in range(n)]
        for t in range(n):
            out[i, t] = sum((gamma * lam) ** l * deltas[t + l] for l in range(n - t))
    return out


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 0.0), (0.7, 1.0)])
def test_gae_equals_the_discounted_sum_of_td_residuals(gamma, lam):
    rewards, values, mask, lengths = ragged()
    advantages, returns = P.gae_advantages(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages, direct_gae(rewards, values, lengths, gamma, lam), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns, (advantages + values) * mask)
    assert (advantages[~mask] == 0).all() and (returns[~mask] == 0).all()


def test_gae_limits_monte_carlo_at_lambda_one_and_td_at_zero():
    rewards, values, mask, lengths = ragged(seed=1)
    gamma = 0.9
    mc, _ = P.gae_advantages(rewards, values, mask, gamma, 1.0)
    for i, n in enumerate(lengths.tolist()):
        for t in range(n):
            discounted_return = sum(gamma ** l * rewards[i, t + l].item() for l in range(n - t))
            assert mc[i, t].item() == pytest.approx(discounted_return - values[i, t].item(), abs=1e-12)
    td, _ = P.gae_advantages(rewards, values, mask, gamma, 0.0)
    next_values = torch.nn.functional.pad((values * mask)[:, 1:], (0, 1))
    torch.testing.assert_close(td, ((rewards + gamma * next_values - values) * mask), rtol=1e-12, atol=1e-12)
    # padding holds anything: it changes nothing
    noisy_rewards, noisy_values = rewards.masked_fill(~mask, 1e4), values.masked_fill(~mask, -1e4)
    torch.testing.assert_close(P.gae_advantages(noisy_rewards, noisy_values, mask, gamma, 0.95)[0],
                               P.gae_advantages(rewards, values, mask, gamma, 0.95)[0])


def test_gae_rejects_bad_input():
    rewards, values, mask, _ = ragged()
    with pytest.raises(ValueError, match="rewards, values, mask"):
        P.gae_advantages(rewards, values[:, :-1], mask)
    with pytest.raises(ValueError, match="gamma"):
        P.gae_advantages(rewards, values, mask, gamma=1.5)
    with pytest.raises(ValueError, match="right padding"):
        P.gae_advantages(rewards, values, ~mask)


def test_ppo_token_rewards_put_the_kl_on_every_token_and_the_score_on_the_last():
    gen = torch.Generator().manual_seed(2)
    logps, ref_logps = -torch.rand(3, 4, generator=gen), -torch.rand(3, 4, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    scores = torch.tensor([1.0, 0.0, 0.5])
    beta = 0.1
    rewards = P.ppo_token_rewards(logps, ref_logps, mask, scores, beta)
    expected = -beta * (logps - ref_logps) * mask
    expected[0, 3] += 1.0
    expected[2, 0] += 0.5
    torch.testing.assert_close(rewards, expected)
    # summed over a response: its score minus beta times the k1 estimate of its KL
    torch.testing.assert_close(rewards.sum(1), scores - beta * P.kl_estimate(logps, ref_logps, mask, "k1"))
    with pytest.raises(ValueError, match="scores"):
        P.ppo_token_rewards(logps, ref_logps, mask, scores[:2], beta)
    with pytest.raises(ValueError, match="at least one real token"):
        P.ppo_token_rewards(logps, ref_logps, mask & False, scores, beta)


def small_model(seed=0, vocab=15):
    torch.manual_seed(seed)
    return TransformerLM(tiny_config(vocab, d_model=32, num_layers=1, num_heads=2, d_ff=48, context_length=16)).eval()


def test_value_model_reads_the_positions_that_predict_each_response_token():
    backbone = small_model()
    value_model = P.ValueModel(backbone)
    gen = torch.Generator().manual_seed(3)
    prompt, response = torch.randint(15, (3, 4), generator=gen), torch.randint(15, (3, 5), generator=gen)
    mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    values = value_model(prompt, response, mask)
    assert values.shape == (3, 5) and values.dtype == torch.float32 and (values[~mask] == 0).all()
    # V[:, t] depends on prompt + response_<t only: the value of the state before token t
    for t in range(5):
        prefix = torch.cat([prompt, response[:, :t]], dim=1)
        hidden = value_model.trunk(prefix)[:, -1]
        direct = value_model.head(hidden).squeeze(-1)
        torch.testing.assert_close(values[:, t][mask[:, t]], direct[mask[:, t]], rtol=1e-5, atol=1e-6)
    # its trunk is a copy: training it leaves the backbone alone, and the LM head is gone
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(value_model.trunk.parameters(), backbone.parameters()))
    assert isinstance(value_model.trunk.lm_head, torch.nn.Identity)
    with pytest.raises(TypeError, match="backbone"):
        P.ValueModel(torch.nn.Linear(2, 2))


def test_ppo_loss_matches_its_formula_and_its_gradients():
    gen = torch.Generator().manual_seed(4)
    n, width = 4, 3
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    old_logps = -torch.rand(n, width, generator=gen, dtype=torch.float64)
    logps = (old_logps + 0.4 * torch.randn(n, width, generator=gen, dtype=torch.float64)).requires_grad_(True)
    old_values = torch.randn(n, width, generator=gen, dtype=torch.float64)
    values = (old_values + 0.5 * torch.randn(n, width, generator=gen, dtype=torch.float64)).requires_grad_(True)
    advantages = torch.randn(n, width, generator=gen, dtype=torch.float64)
    returns = torch.randn(n, width, generator=gen, dtype=torch.float64)
    clip, value_clip, weight = 0.2, 0.3, 0.5

    def formula(lp, v):
        ratio = (lp - old_logps).exp()
        surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
        v_clipped = old_values + (v - old_values).clamp(-value_clip, value_clip)
        value = torch.maximum((v - returns) ** 2, (v_clipped - returns) ** 2)
        m = mask.double()
        return -(surrogate * m).sum() / m.sum() + weight * 0.5 * (value * m).sum() / m.sum()

    out = P.ppo_loss(logps, old_logps, values, old_values, advantages, returns, mask, clip, value_clip, weight)
    assert out.loss.item() == pytest.approx(formula(logps, values).item(), rel=1e-12)
    assert 0 < out.clip_fraction.item() < 1 and 0 < out.value_clip_fraction.item() < 1
    out.loss.backward()
    expected = torch.autograd.grad(formula(logps, values), (logps, values))
    torch.testing.assert_close(logps.grad, expected[0])
    torch.testing.assert_close(values.grad, expected[1])
    assert (logps.grad[~mask] == 0).all() and (values.grad[~mask] == 0).all()
    # without the value clip: plain squared error
    plain = P.ppo_loss(logps, old_logps, values, old_values, advantages, returns, mask, clip, None, 1.0)
    m = mask.double()
    assert plain.value_loss.item() == pytest.approx((0.5 * ((values - returns) ** 2 * m).sum() / m.sum()).item(), rel=1e-12)
    with pytest.raises(ValueError, match="one shape"):
        P.ppo_loss(logps, old_logps, values, old_values, advantages[:, :2], returns, mask)
    with pytest.raises(ValueError, match="value_clip"):
        P.ppo_loss(logps, old_logps, values, old_values, advantages, returns, mask, value_clip=0.0)


def test_grpo_and_ppo_share_the_clipped_surrogate():
    ratios = torch.tensor([[0.5, 0.9, 1.0, 1.3]], dtype=torch.float64)
    for advantage in (1.0, -1.0):
        surrogate, clipped = P.clipped_surrogate(ratios.log(), torch.zeros_like(ratios), torch.tensor([[advantage]]), 0.2)
        bound = ratios.clamp(0.8, 1.2)
        torch.testing.assert_close(surrogate, torch.minimum(ratios * advantage, bound * advantage))
        assert clipped.tolist() == [[1.0, 0.0, 0.0, 1.0]]


def test_ppo_raises_the_verifiable_reward_and_counts_what_the_value_model_costs():
    task = adder_task()
    early = P.load_early_adder()
    policy = copy.deepcopy(early).requires_grad_(True)
    value_model = P.ValueModel(early)
    before = P.policy_report(policy, task, max_examples=256)["accuracy"]
    log = P.train_ppo(policy, value_model, early, task, P.verifiable_reward(task), steps=12, lr=3e-4, value_lr=1e-3,
                      beta=0.05, prompts_per_step=16, samples_per_prompt=8, updates=2, progress=False)
    after = P.policy_report(policy, task, max_examples=256)["accuracy"]
    assert after > before + 0.05
    assert log["value_error"][-1] < log["value_error"][0]
    assert len(log["reward"]) == 12 and all(0 <= f <= 1 for f in log["clip_fraction"])
    # one more step of each under the counter: PPO = GRPO's passes + the value model's
    prompts = P.encode_prompts(task, task.pairs("train")[:4])
    optimizer = torch.optim.AdamW([{"params": list(policy.parameters())}, {"params": list(value_model.parameters())}], lr=1e-5)
    models = {"policy": policy, "reference": early, "value model": value_model}
    with P.PassCounter(models) as ppo:
        P.ppo_step(policy, value_model, early, prompts, P.verifiable_reward(task), 2, optimizer=optimizer, task=task, updates=3)
    state = P.rl_state_bytes(models, optimizer)  # after PPO's step: every trained tensor has its gradient and moments
    with P.PassCounter(models) as grpo:
        P.grpo_step(policy, early, prompts, P.verifiable_reward(task), 2, optimizer=optimizer, task=task, updates=3)
    sampling = task.answer_width + 1  # one forward call per generated token (prefill, then the KV cache)
    assert grpo.counts["policy"] == ppo.counts["policy"] == {"forward, no graph": sampling + 1, "forward, graph": 3, "backward": 3}
    assert grpo.counts["reference"] == ppo.counts["reference"] == {"forward, no graph": 1, "forward, graph": 0, "backward": 0}
    assert grpo.counts["value model"] == {"forward, no graph": 0, "forward, graph": 0, "backward": 0}
    assert ppo.counts["value model"] == {"forward, no graph": 1, "forward, graph": 3, "backward": 3}
    # bytes: the value model is the trunk plus a d_model head, and AdamW keeps two moments per parameter
    value_params = early.num_params() - early.lm_head.weight.numel() + early.config.d_model
    assert state["value model"] == {"parameters": 4 * value_params, "gradients": 4 * value_params, "optimizer state": 8 * value_params}
    assert state["reference"] == {"parameters": 4 * early.num_params(), "gradients": 0, "optimizer state": 0}
    with pytest.raises(TypeError, match="value_model"):
        P.train_ppo(policy, early, early, task, P.verifiable_reward(task), steps=1)


@pytest.mark.parametrize("updates", [0, -1, True, 1.0])
def test_an_rl_step_without_updates_is_refused_by_name(updates):
    prompts = torch.zeros(2, 3, dtype=torch.long)  # checked before anything else is used
    with pytest.raises(ValueError, match="updates"):
        P.ppo_step(None, None, None, prompts, None, optimizer=None, task=None, updates=updates)
    with pytest.raises(ValueError, match="updates"):
        P.grpo_step(None, None, prompts, None, 2, optimizer=None, task=None, updates=updates)
