"""labkit.preference: log-probabilities vs a per-token loop, the losses vs closed forms and finite
differences, DPO and GRPO on tiny problems, the preference data, and the shipped early adder."""
import labkit  # noqa: F401

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch

from labkit import preference as P
from labkit.model import TransformerLM, tiny_config
from labkit.pretrained import RECIPE, adder_task, load_tiny_adder


@pytest.fixture(scope="module")
def task():
    return adder_task()


def small_model(seed=0, vocab=15):
    torch.manual_seed(seed)
    return TransformerLM(tiny_config(vocab, d_model=32, num_layers=1, num_heads=2, d_ff=48, context_length=16)).eval()


# ----------------------------------------------------------------------------- log-probabilities
def loop_logprobs(model, prompt, response, mask):
    """One sequence at a time, one token at a time: log softmax(model(prefix))[-1][next token]."""
    out = []
    for p, r, m in zip(prompt, response, mask):
        total = 0.0
        for j in range(int(m.sum())):
            prefix = torch.cat([p, r[:j]])
            logits = model(prefix[None])[0, -1].double()
            total += torch.log_softmax(logits, -1)[r[j]].item()
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)


def test_sequence_logprobs_matches_a_per_token_loop_with_padding():
    model = small_model()
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(15, (5, 4), generator=gen)
    response = torch.randint(15, (5, 6), generator=gen)
    lengths = torch.tensor([6, 1, 3, 5, 2])
    mask = torch.arange(6)[None] < lengths[:, None]
    with torch.no_grad():
        got = P.sequence_logprobs(model, prompt, response, mask)
        mean = P.sequence_logprobs(model, prompt, response, mask, average=True)
        tokens = P.token_logprobs(model, prompt, response, mask)
    expected = loop_logprobs(model, prompt, response, mask)
    assert got.dtype == torch.float32 and got.shape == (5,)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(mean.double(), expected / lengths, atol=1e-4, rtol=1e-5)
    assert (tokens[~mask] == 0).all()
    # what sits in the padding does not matter
    other = torch.where(mask, response, torch.randint(15, response.shape, generator=gen))
    with torch.no_grad():
        torch.testing.assert_close(P.sequence_logprobs(model, prompt, other, mask), got)


def test_sequence_logprobs_is_differentiable_and_validates():
    model = small_model()
    prompt, response = torch.randint(15, (2, 3)), torch.randint(15, (2, 4))
    P.sequence_logprobs(model, prompt, response).sum().backward()
    assert model.lm_head.weight.grad is not None
    with pytest.raises(ValueError, match="right padding"):
        P.sequence_logprobs(model, prompt, response, torch.tensor([[True, False, True, True]] * 2))
    with pytest.raises(TypeError, match="prompt_ids"):
        P.sequence_logprobs(model, prompt.float(), response)
    with pytest.raises(ValueError, match="response_mask"):
        P.sequence_logprobs(model, prompt, response, torch.ones(2, 3, dtype=torch.bool))


# ----------------------------------------------------------------------------- preference data
def test_pairs_are_ordered_by_the_true_reward_seeded_and_splits_disjoint(task):
    train = P.make_preference_pairs(task, "train", "correct", seed=3)
    again = P.make_preference_pairs(task, "train", "correct", seed=3)
    assert train.chosen_text == again.chosen_text and train.rejected_text == again.rejected_text
    assert P.make_preference_pairs(task, "train", "correct", seed=4).chosen_text != train.chosen_text
    val = P.make_preference_pairs(task, "val", "correct")
    assert not {tuple(p) for p in train.operands} & {tuple(p) for p in val.operands}
    assert (train.chosen_reward == 1).all() and (train.rejected_reward == 0).all()
    for (a, b), c, r in zip(train.operands[:50], train.chosen_text, train.rejected_text):
        assert c == task.answer(a, b) + ";" and len(r) == len(c) and sum(x != y for x, y in zip(c, r)) == 1


def test_concise_pairs_prefer_no_padding_not_shortness(task):
    pairs = P.make_preference_pairs(task, "train", "concise", max_pairs=400)
    for (a, b), c, r in zip(pairs.operands, pairs.chosen_text, pairs.rejected_text):
        assert P.answer_value(task, c) == a + b
        if a + b < 100:  # padded: concise vs padded, both right
            assert c == str(a + b)[::-1] + ";" and r == task.answer(a, b) + ";"
            assert P.true_reward(task, a, b, r, "concise") == 0.5
        else:  # no padding to drop: the right answer vs a shorter wrong one
            assert c == task.answer(a, b) + ";" and len(r) < len(c) and P.answer_value(task, r) != a + b
    ids = pairs.chosen_ids[pairs.chosen_mask.sum(1) < pairs.chosen_ids.shape[1]]
    assert len(ids)  # responses of several lengths: padding exercised
    assert task.tokenizer.decode(pairs.chosen_ids[0][pairs.chosen_mask[0]]) == pairs.chosen_text[0]


def test_label_noise_flips_about_that_fraction(task):
    pairs = P.make_preference_pairs(task, "train", "correct", noise=0.3, seed=1)
    assert abs(pairs.flipped.float().mean().item() - 0.3) < 0.03
    assert (pairs.chosen_reward[pairs.flipped] == 0).all() and (pairs.chosen_reward[~pairs.flipped] == 1).all()
    with pytest.raises(ValueError, match="noise"):
        P.make_preference_pairs(task, noise=1.5)
    with pytest.raises(ValueError, match="preference"):
        P.make_preference_pairs(task, preference="polite")


def test_true_reward_and_answer_parsing(task):
    assert P.answer_value(task, "240;") == 42 and P.answer_value(task, "24;") == 42 and P.answer_value(task, "24") is None
    assert P.answer_value(task, "2400;") is None and P.answer_value(task, ";") is None
    assert P.true_reward(task, 7, 35, "240;") == 1.0 and P.true_reward(task, 7, 35, "241;") == 0.0
    assert P.true_reward(task, 7, 35, "24;", "concise") == 1.0 and P.true_reward(task, 7, 35, "240;", "concise") == 0.5
    assert P.concise_answer(task, 0, 0) == "0;" and P.concise_answer(task, 99, 99) == "891;"


def test_response_mask_stops_after_the_first_terminator():
    ids = torch.tensor([[1, 14, 2, 14], [1, 2, 3, 4], [14, 1, 1, 1]])
    assert P.response_mask_from_stop(ids, 14).tolist() == [[True, True, False, False], [True] * 4, [True, False, False, False]]


# ----------------------------------------------------------------------------- Bradley-Terry
def finite_difference(f, x, eps=1e-6):
    grad = torch.zeros_like(x)
    for i in range(x.numel()):
        d = torch.zeros_like(x).view(-1)
        d[i] = eps
        grad.view(-1)[i] = (f(x + d.view_as(x)) - f(x - d.view_as(x))) / (2 * eps)
    return grad


def test_bradley_terry_loss_closed_form_gradient_and_stability():
    gen = torch.Generator().manual_seed(0)
    rc, rr = torch.randn(7, generator=gen, dtype=torch.float64), torch.randn(7, generator=gen, dtype=torch.float64)
    expected = np.mean([math.log(1 + math.exp(-(c - r))) for c, r in zip(rc.tolist(), rr.tolist())])
    assert P.bradley_terry_loss(rc, rr).item() == pytest.approx(expected, rel=1e-12)
    rc.requires_grad_(True)
    P.bradley_terry_loss(rc, rr).backward()
    torch.testing.assert_close(rc.grad, finite_difference(lambda x: P.bradley_terry_loss(x, rr), rc.detach()))
    torch.testing.assert_close(rc.grad, -torch.sigmoid(-(rc - rr)).detach() / 7)  # d/dc of log(1 + e^-(c-r)) / n
    big = P.bradley_terry_loss(torch.tensor([200.0, -200.0]), torch.tensor([0.0, 0.0]))
    assert math.isfinite(big.item()) and big.item() == pytest.approx(100.0)
    assert P.bradley_terry_probability(0.0).item() == 0.5
    with pytest.raises(ValueError):
        P.bradley_terry_loss(torch.zeros(3), torch.zeros(2))


def test_reward_model_reads_the_last_real_token_and_learns(task):
    backbone = small_model()
    rm = P.RewardModel(backbone)
    assert rm.trunk is not backbone and not any(p is q for p in rm.parameters() for q in backbone.parameters())
    prompt, response = torch.randint(15, (3, 6)), torch.randint(15, (3, 4))
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    with torch.no_grad():
        scores = rm(prompt, response, mask)
        for i in range(3):
            n = int(mask[i].sum())
            alone = rm(prompt[i:i + 1], response[i:i + 1, :n])
            torch.testing.assert_close(scores[i:i + 1], alone, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="TransformerLM"):
        P.RewardModel(torch.nn.Linear(2, 2))
    train = P.make_preference_pairs(task, "train", "concise", max_pairs=512)
    val = P.make_preference_pairs(task, "val", "concise", max_pairs=256)
    adder, _ = load_tiny_adder()
    rm = P.RewardModel(adder)
    log = P.train_reward_model(rm, train, steps=40, lr=1e-3, heldout=val, eval_every=20, progress=False)
    assert log["eval_step"] == [0, 20, 40] and log["eval_accuracy"][-1] > 0.9 > log["eval_accuracy"][0]


# ----------------------------------------------------------------------------- DPO
def test_dpo_loss_closed_form_logged_quantities_and_gradients():
    gen = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(6, generator=gen, dtype=torch.float64) * 3 for _ in range(4))
    beta, eps = 0.3, 0.1
    h = (pc - rc) - (pr - rr)
    out = P.dpo_loss(pc, pr, rc, rr, beta)
    expected = torch.log1p(torch.exp(-beta * h)).mean()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-12)
    torch.testing.assert_close(out.chosen_rewards, beta * (pc - rc))
    torch.testing.assert_close(out.rejected_rewards, beta * (pr - rr))
    torch.testing.assert_close(out.margins, beta * h)
    assert out.accuracy.item() == pytest.approx((h > 0).double().mean().item())
    smooth = P.dpo_loss(pc, pr, rc, rr, beta, label_smoothing=eps).loss
    expected_smooth = ((1 - eps) * torch.log1p(torch.exp(-beta * h)) + eps * torch.log1p(torch.exp(beta * h))).mean()
    assert smooth.item() == pytest.approx(expected_smooth.item(), rel=1e-12)
    # gradients vs finite differences, and the reference is a constant
    pc_, pr_ = pc.clone().requires_grad_(True), pr.clone().requires_grad_(True)
    rc_ = rc.clone().requires_grad_(True)
    P.dpo_loss(pc_, pr_, rc_, rr, beta, label_smoothing=eps).loss.backward()
    torch.testing.assert_close(pc_.grad, finite_difference(lambda x: P.dpo_loss(x, pr, rc, rr, beta, eps).loss, pc))
    torch.testing.assert_close(pr_.grad, finite_difference(lambda x: P.dpo_loss(pc, x, rc, rr, beta, eps).loss, pr))
    assert rc_.grad is None
    assert not out.chosen_rewards.requires_grad
    with pytest.raises(ValueError, match="beta"):
        P.dpo_loss(pc, pr, rc, rr, 0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        P.dpo_loss(pc, pr, rc, rr, 0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match="one shape"):
        P.dpo_loss(pc, pr[:3], rc, rr, 0.1)


def test_dpo_at_the_start_is_log_2_and_moves_chosen_above_rejected(task):
    model = small_model(vocab=task.vocab_size)
    pairs = P.make_preference_pairs(task, "train", "correct", max_pairs=64)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        c, r = P.pair_logprobs(model, pairs)
        start = P.dpo_loss(c, r, c, r, 0.1)
    assert start.loss.item() == pytest.approx(math.log(2)) and start.margins.abs().max() == 0
    model.requires_grad_(True)
    log = P.train_dpo(model, ref, pairs, steps=30, lr=3e-3, beta=0.5, batch_size=64, progress=False)
    # steps 1 and 2 log the policy before any update (the warm-up's first learning rate is 0): all ties, half a win
    assert log["margin"][:2] == [0.0, 0.0] and log["accuracy"][:2] == [0.5, 0.5] and log["accuracy"][-1] > 0.9
    with torch.no_grad():
        c1, r1 = P.pair_logprobs(model, pairs)
        rc, rr = P.pair_logprobs(ref, pairs)
        after = P.dpo_loss(c1, r1, rc, rr, 0.5)
    assert after.accuracy.item() > 0.9 and after.margins.mean() > 0.5 and log["loss"][-1] < math.log(2) - 0.2
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), small_model(vocab=task.vocab_size).state_dict().values()))


def test_dpo_matches_trl_when_installed():
    trl = pytest.importorskip("trl", reason="Hugging Face TRL is not installed (pip install trl) - the comparison is skipped")
    import inspect

    from trl import DPOConfig, DPOTrainer

    if not hasattr(DPOTrainer, "dpo_loss"):
        pytest.skip(f"TRL {trl.__version__} computes the DPO loss inline in DPOTrainer._compute_loss: no standalone "
                    "dpo_loss(...) to call on given log-probabilities (TRL <= 0.2x has one)")
    gen = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(8, generator=gen) * 2 for _ in range(4))
    ours = P.dpo_loss(pc, pr, rc, rr, 0.2, label_smoothing=0.1)
    trainer = DPOTrainer.__new__(DPOTrainer)  # dpo_loss needs only the config's settings, not a model
    trainer.beta, trainer.label_smoothing, trainer.loss_type = 0.2, 0.1, "sigmoid"
    trainer.args = DPOConfig(output_dir="/tmp/trl-unused", beta=0.2, label_smoothing=0.1, report_to=[])
    trainer.reference_free, trainer.f_divergence_type = False, "reverse_kl"
    trainer.use_weighting, trainer.aux_loss_enabled = False, False
    trainer.accelerator = type("A", (), {"device": torch.device("cpu")})()
    params = inspect.signature(trainer.dpo_loss).parameters
    args = (pc, pr, rc, rr) if len(params) <= 5 else (pc, pr, rc, rr, "sigmoid")
    losses, chosen, rejected = trainer.dpo_loss(*args)[:3]
    torch.testing.assert_close(ours.loss, losses.mean())
    torch.testing.assert_close(ours.chosen_rewards, chosen)
    torch.testing.assert_close(ours.rejected_rewards, rejected)
    assert trl.__version__


# ----------------------------------------------------------------------------- GRPO
def test_grpo_advantages_are_group_normalised():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.5, 1.0, 0.5])
    adv = P.grpo_advantages(rewards, 4)
    for g in adv.view(3, 4):
        assert abs(g.mean().item()) < 1e-6
    assert adv[4:8].abs().max() == 0  # every answer of the group equally good: no signal
    group = rewards[:4]
    torch.testing.assert_close(adv[:4], (group - group.mean()) / (group.std() + 1e-4))
    with pytest.raises(ValueError, match="group_size"):
        P.grpo_advantages(rewards, 5)
    with pytest.raises(ValueError, match="group_size"):
        P.grpo_advantages(rewards, 1)


def test_grpo_loss_equals_a_hand_computation():
    # two responses (one group of 2), lengths 2 and 1; numbers chosen so every term can be worked by hand
    logps = torch.tensor([[math.log(0.5), math.log(0.2)], [math.log(0.9), 0.0]], requires_grad=True)
    old = torch.tensor([[math.log(0.4), math.log(0.2)], [math.log(0.5), 0.0]])
    ref = torch.tensor([[math.log(0.5), math.log(0.1)], [math.log(0.9), 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    adv = P.grpo_advantages(torch.tensor([1.0, 0.0]), 2)  # +-1/sqrt(2) (sample std of {1, 0})
    a = 1 / math.sqrt(2) / (1 + 1e-4 * math.sqrt(2))
    beta, clip = 0.1, 0.2
    # response 1 (A = +a): ratios 0.5/0.4 = 1.25 -> min(1.25a, 1.2a) = 1.2a; 0.2/0.2 = 1 -> a
    # k3: ref/pi - log(ref/pi) - 1: token 1: 1 - 0 - 1 = 0; token 2: 0.5 - log 0.5 - 1
    k3_second = 0.5 - math.log(0.5) - 1
    first = ((1.2 * a - 0) + (a - beta * k3_second)) / 2
    # response 2 (A = -a): ratio 0.9/0.5 = 1.8 -> min(-1.8a, -1.2a) = -1.8a; k3 = 0
    second = -1.8 * a
    expected = -(first + second) / 2
    out = P.grpo_loss(logps, old, ref, mask, adv, beta, clip)
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.clip_fraction.item() == pytest.approx(2 / 3)  # tokens 1 of both responses are outside [0.8, 1.2]
    assert out.kl.item() == pytest.approx(k3_second / 3, rel=1e-6)
    out.loss.backward()
    # the clipped token of response 1 gets no gradient from the surrogate; its k3 is 0 and so is k3's slope there
    assert logps.grad[0, 0].item() == pytest.approx(0.0, abs=1e-7)
    assert logps.grad[1, 1].item() == 0.0  # padding


def test_kl_estimators():
    logp, ref = torch.tensor([[math.log(0.5), math.log(0.25)]]), torch.tensor([[math.log(0.25), math.log(0.25)]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert P.kl_estimate(logp, ref, mask, "k1").item() == pytest.approx(math.log(2))
    assert P.kl_estimate(logp, ref, mask, "k3").item() == pytest.approx(0.5 + math.log(2) - 1)
    assert (P.kl_estimate(torch.randn(5, 3), torch.randn(5, 3), torch.ones(5, 3), "k3") >= 0).all()
    # k3 is unbiased: the exact KL between two categoricals, from many samples
    p, q = torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.2, 0.5, 0.3])
    draws = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    est = P.kl_estimate(p.log()[draws][:, None], q.log()[draws][:, None], torch.ones(len(draws), 1), "k3").mean()
    assert est.item() == pytest.approx((p * (p / q).log()).sum().item(), rel=0.02)
    assert P.kl_estimate(logp, ref, mask, "k2").item() == pytest.approx(math.log(2) ** 2 / 2)
    with pytest.raises(ValueError, match="estimator"):
        P.kl_estimate(logp, ref, mask, "k4")


def test_grpo_step_improves_the_verifiable_reward(task):
    early = P.load_early_adder()
    policy = copy.deepcopy(early).requires_grad_(True)
    reward_fn = P.verifiable_reward(task)
    before = P.policy_report(policy, task, max_examples=256)["accuracy"]
    log = P.train_grpo(policy, early, task, reward_fn, steps=12, lr=3e-4, beta=0.04, prompts_per_step=16,
                       group_size=8, progress=False, evaluate=None)
    after = P.policy_report(policy, task, max_examples=256)["accuracy"]
    assert after > before + 0.05
    assert len(log["reward"]) == 12 and all(0 <= f <= 1 for f in log["informative_groups"])
    assert P.kl_to_reference(policy, early, task, max_examples=64) > 0


def test_verifiable_reward_scores_decoded_answers(task):
    prompts = P.encode_prompts(task, [(7, 35), (50, 50)])
    ids, mask = P.encode_responses(task, ["240;", "001;"])
    assert P.verifiable_reward(task)(prompts, ids, mask).tolist() == [1.0, 1.0]
    ids, mask = P.encode_responses(task, ["24;", "00;"])
    assert P.verifiable_reward(task, "concise")(prompts, ids, mask).tolist() == [1.0, 0.0]
    assert P.decode_operands(task, prompts) == [(7, 35), (50, 50)]


# ----------------------------------------------------------------------------- the shipped early adder
def test_early_adder_is_weak_but_not_hopeless(task):
    model = P.load_early_adder()
    accuracy = task.evaluate(model, "val")
    assert 0.1 < accuracy < 0.9  # the chapter's premise: room for a verifiable reward to teach


def test_early_adder_asset_records_its_recipe(tmp_path):
    payload = torch.load(P.EARLY_ASSET, weights_only=False)
    assert payload["recipe"] == dataclasses.asdict(RECIPE) and payload["stop_after"] == P.EARLY_STEPS
    assert P.EARLY_ASSET.stat().st_size < 1_000_000
    payload["stop_after"] = 10
    path = tmp_path / "old.pt"
    torch.save(payload, path)
    with pytest.raises(RuntimeError, match="python -m labkit.preference"):
        P.load_early_adder(path=path)


def test_early_adder_recipe_reproduces_the_asset_step_for_step(monkeypatch):
    """train_early_adder is the shipped adder's run stopped early: a few steps of it equal the same
    steps of the full recipe (the asset itself took EARLY_STEPS of them)."""
    monkeypatch.setattr(P, "EARLY_STEPS", 3)
    short = P.train_early_adder(progress=False)
    from labkit.train import train

    task = adder_task()
    torch.manual_seed(0)
    full = TransformerLM(tiny_config(task.vocab_size))
    train(full, task.tokens("train"), None, dataclasses.replace(RECIPE), device="cpu", stop_after=3, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(short.state_dict().values(), full.state_dict().values()))
