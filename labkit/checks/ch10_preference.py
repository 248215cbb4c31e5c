"""Graders for chapter 10 (preference learning).

* ``sequence_logprobs(fn)``: ``fn(model, prompt_ids, response_ids, response_mask)`` -> ``[batch]`` float32,
  the summed log-probabilities of the response tokens (prompt not scored, padding masked), as
  :func:`labkit.preference.sequence_logprobs`;
* ``bradley_terry_loss(fn)``: ``fn(r_chosen, r_rejected)`` -> the mean ``-log sigmoid(r_chosen - r_rejected)``;
* ``dpo_loss(fn)``: ``fn(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
  beta)`` -> ``(loss, chosen_rewards, rejected_rewards, margins, accuracy)`` as :func:`labkit.preference.dpo_loss`;
* ``grpo_advantages(fn)``: ``fn(rewards, group_size)`` -> float32 ``[n]``, each reward normalised within its
  group of ``group_size`` consecutive responses, as :func:`labkit.preference.grpo_advantages`;
* ``k3_kl(fn)``: ``fn(logps, ref_logps, mask)`` -> ``[n]``, the mean over each response's real tokens of the k3
  estimate of ``KL(pi || pi_ref)``, the per-response KL term of GRPO's objective.

Each grader builds its own models and tensors (several seeds, shapes, dtypes, right padding, huge
margins), keeps its own copies, calls the learner's code twice, checks types, dtypes, shapes and gradients,
and names the typical mistake when it recognises one: prompt tokens scored, logits not shifted, the mean
instead of the sum, padding scored, the margin's sign flipped, beta outside the sigmoid, an unstable
``log(sigmoid(.))``, a reference that receives gradients, rewards logged with gradients or without beta.
"""
from __future__ import annotations

import torch

from labkit import preference as P
from labkit.checks._core import call_on_copies, call_twice, expect_differentiable, expect_dtype, fail, passed, results
from labkit.model import TransformerLM, tiny_config

__all__ = ["sequence_logprobs", "bradley_terry_loss", "dpo_loss", "grpo_advantages", "k3_kl"]


def _max_error(got: torch.Tensor, expected: torch.Tensor) -> str:
    return f"max abs error {(got.detach().double() - expected.detach().double()).abs().max().item():.3g}"


def _close(got: torch.Tensor, expected: torch.Tensor, tol: float) -> bool:
    got, expected = got.detach().double().cpu(), expected.detach().double().cpu()
    return got.shape == expected.shape and bool(torch.allclose(got, expected, rtol=tol, atol=tol))


def _show(t: torch.Tensor, n: int = 4) -> str:
    values = t.detach().double().flatten()[:n].tolist()
    return "[" + ", ".join(f"{v:.4g}" for v in values) + (", ...]" if t.numel() > n else "]")


# ----------------------------------------------------------------------------- sequence_logprobs
def _model(seed: int, vocab: int, dtype=torch.float32) -> TransformerLM:
    torch.manual_seed(seed)
    model = TransformerLM(tiny_config(vocab, d_model=32, num_layers=1, num_heads=2, d_ff=48, context_length=24))
    return model.to(dtype).eval()


def _lp_cases():
    """(tried, seed, vocab, batch, prompt_len, lengths of the responses, dtype)."""
    return [
        ("batch 3, prompt 5, responses of lengths 4, 2, 3 (right-padded)", 0, 15, 5, (4, 2, 3), torch.float32),
        ("batch 4, prompt 1, responses of lengths 1, 6, 6, 3", 1, 11, 1, (1, 6, 6, 3), torch.float32),
        ("batch 2, prompt 7, responses of length 5 (no padding)", 2, 20, 7, (5, 5), torch.float32),
        ("batch 5, prompt 3, responses of lengths 2, 1, 4, 4, 3", 3, 15, 3, (2, 1, 4, 4, 3), torch.float32),
        ("a bfloat16 model, batch 3, prompt 4, responses of lengths 3, 1, 2", 4, 13, 4, (3, 1, 2), torch.bfloat16),
        ("batch 1, prompt 2, a response of length 3 (a batch of one is still a batch)", 5, 12, 2, (3,), torch.float32),
    ]


def _lp_inputs(seed, vocab, prompt_len, lengths):
    gen = torch.Generator().manual_seed(100 + seed)
    width = max(lengths)
    prompt = torch.randint(vocab, (len(lengths), prompt_len), generator=gen)
    response = torch.randint(vocab, (len(lengths), width), generator=gen)
    mask = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
    return prompt, response, mask


def _lp_variants(model, prompt, response, mask) -> dict:
    """The reference and the typical wrong answers, each with the hint that names it."""
    with torch.no_grad():
        full = torch.cat([prompt, response], 1)
        P_len = prompt.shape[1]
        logps_all = torch.log_softmax(model(full[:, :-1]).float(), -1).gather(-1, full[:, 1:, None]).squeeze(-1)
        response_logps = logps_all[:, P_len - 1:]
        right = (response_logps * mask).sum(1)
        unshifted = torch.log_softmax(model(full).float(), -1)[:, P_len:].gather(-1, response[:, :, None]).squeeze(-1)
        full_mask = torch.cat([torch.ones_like(prompt[:, 1:], dtype=torch.bool), mask], 1)
    return {
        "right": right,
        "prompt tokens scored": ((logps_all * full_mask).sum(1),
                                 "score the response only: log p(response | prompt) leaves out the prompt's own tokens "
                                 "(the logits from position prompt_len - 1 on predict the response)"),
        "not shifted": ((unshifted * mask).sum(1),
                        "the logits at position i predict token i + 1: response token j (at position prompt_len + j) is "
                        "scored by the logits at position prompt_len + j - 1 - shift by one"),
        "mean": (right / mask.sum(1),
                 "return the sum over the response's tokens, log p(y|x) = sum_t log p(y_t | x, y_<t); the mean per token "
                 "is a different (length-normalised) score"),
        "padding scored": (response_logps.sum(1),
                           "mask out the padding: multiply the token log-probabilities by response_mask (or zero them "
                           "where it is False) before summing"),
    }


def sequence_logprobs(fn) -> None:
    """Grade ``fn(model, prompt_ids, response_ids, response_mask)`` -> ``[batch]`` float32: the sum of
    ``log p(response_t | prompt, response_<t)`` over each response's real tokens (``response_mask`` True),
    differentiable with respect to the model's parameters."""
    for tried, seed, vocab, prompt_len, lengths, dtype in _lp_cases():
        model = _model(seed, vocab, dtype)
        prompt, response, mask = _lp_inputs(seed, vocab, prompt_len, lengths)
        call_tried = f"sequence_logprobs(model, prompt_ids, response_ids, response_mask) with {tried}"
        variants = _lp_variants(model, prompt, response, mask)
        expected = variants.pop("right")
        (got,) = call_twice(fn, call_tried, (model, prompt, response, mask), ("the log-probabilities",))
        if got.shape != expected.shape:
            fail(call_tried, f"shape {tuple(got.shape)}", f"shape {tuple(expected.shape)}, one number per sequence",
                 "sum over the response's tokens (dim=1), and do not average over the batch")
        expect_dtype(got, torch.float32, "the result", call_tried,
                     "compute log_softmax in float32 (logits.float()): log-probabilities summed in bfloat16 lose digits")
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        if not _close(got, expected, tol):
            hint = next((h for name, (value, h) in variants.items() if _close(got, value, tol)),
                        "log_softmax over the vocabulary, gather the response token's entry, mask, sum over positions")
            fail(call_tried, _show(got), f"{_show(expected)} ({_max_error(got, expected)})", hint)
        if dtype == torch.float32:
            trainable = _model(seed, vocab).requires_grad_(True)
            out = call_on_copies(fn, call_tried + " with a model that requires grad", trainable, prompt, response, mask)
            expect_differentiable(out, "the result", call_tried,
                                  "do not compute it under torch.no_grad() or .detach() it: DPO backpropagates through it")
            out.sum().backward()
            if trainable.lm_head.weight.grad is None or trainable.lm_head.weight.grad.abs().max() == 0:
                fail(call_tried + "; .sum().backward()", "no gradient in model.lm_head.weight", "a gradient",
                     "compute the result from the model's logits without detaching them")
    passed("sequence_logprobs", "response tokens only, shifted by one, summed, padding masked, float32 and differentiable "
                                "(fp32 and bf16 models, prompts of 1 to 7 tokens)")


# ----------------------------------------------------------------------------- bradley_terry_loss
def _bt_cases():
    gen = torch.Generator().manual_seed(10)
    return [
        ("8 pairs, float32", torch.randn(8, generator=gen), torch.randn(8, generator=gen)),
        ("1 pair, float64", torch.randn(1, generator=gen, dtype=torch.float64), torch.randn(1, generator=gen, dtype=torch.float64)),
        ("33 pairs, float32, rewards of size ~5", torch.randn(33, generator=gen) * 5, torch.randn(33, generator=gen) * 5),
        ("4 pairs, float32, margins of -200, 150, -1000, 3 (a confident wrong reward model)",
         torch.tensor([0.0, 150.0, -500.0, 3.0]), torch.tensor([200.0, 0.0, 500.0, 0.0])),
        ("16 pairs, bfloat16", torch.randn(16, generator=gen).bfloat16(), torch.randn(16, generator=gen).bfloat16()),
    ]


def bradley_terry_loss(fn) -> None:
    """Grade ``fn(r_chosen, r_rejected)`` -> a scalar tensor, ``mean(-log sigmoid(r_chosen - r_rejected))``,
    finite for any margin, in the rewards' dtype, differentiable."""
    for tried, rc, rr in _bt_cases():
        call_tried = f"bradley_terry_loss(r_chosen, r_rejected) with {tried}"
        d = rc.double() - rr.double()
        expected = torch.nn.functional.softplus(-d).mean()
        (got,) = call_twice(fn, call_tried, (rc, rr), ("the loss",))
        if got.dim() != 0:
            fail(call_tried, f"a tensor of shape {tuple(got.shape)}", "a scalar (0-dim) tensor",
                 "average the per-pair losses over the batch: .mean()")
        expect_dtype(got, rc.dtype, "the loss", call_tried, "keep the rewards' dtype")
        tol = 1e-5 if rc.dtype != torch.bfloat16 else 2e-2
        if not torch.isfinite(got).all():
            fail(call_tried, f"{got.item()}", f"{expected.item():.6g}",
                 "log(sigmoid(d)) underflows to log(0) = -inf for a large negative margin: use "
                 "torch.nn.functional.logsigmoid(d) (or -softplus(-d)), which is exact there")
        if not _close(got, expected, tol):
            candidates = {
                "the margin's sign is flipped: the loss is -log sigmoid(r_chosen - r_rejected), small when the chosen "
                "response scores higher": torch.nn.functional.softplus(d).mean(),
                "average over the pairs (.mean()), not .sum(): the loss should not grow with the batch size":
                    torch.nn.functional.softplus(-d).sum(),
                "take the log: -log sigmoid(d) is the negative log-likelihood, -sigmoid(d) is not":
                    -torch.sigmoid(d).mean(),
                "the loss is -log sigmoid(r_chosen - r_rejected): the rewards enter only through their difference":
                    (torch.nn.functional.softplus(-rc.double()) + torch.nn.functional.softplus(rr.double())).mean(),
            }
            hint = next((h for h, v in candidates.items() if _close(got, v, tol)),
                        "-logsigmoid(r_chosen - r_rejected).mean()")
            fail(call_tried, f"{got.item():.6g}", f"{expected.item():.6g}", hint)
    rc = torch.randn(6, generator=torch.Generator().manual_seed(3), requires_grad=True)
    rr = torch.randn(6, generator=torch.Generator().manual_seed(4))
    tried = "bradley_terry_loss(r_chosen, r_rejected).backward() with r_chosen requiring grad"
    got = call_on_copies(fn, tried, rc, rr, return_inputs=True)
    out, (rc_in, _) = got
    expect_differentiable(out, "the loss", tried, "build the loss from r_chosen with torch ops (no .item(), no .detach())")
    out.backward()
    expected_grad = -torch.sigmoid(-(rc - rr)).detach() / 6
    if rc_in.grad is None or not _close(rc_in.grad, expected_grad, 1e-5):
        fail(tried, "d loss / d r_chosen = " + (_show(rc_in.grad) if rc_in.grad is not None else "None"),
             _show(expected_grad), "-logsigmoid(r_chosen - r_rejected).mean(): its gradient is -sigmoid(-(r_c - r_r)) / n")
    passed("bradley_terry_loss", "mean -log sigmoid(r_chosen - r_rejected), stable for margins of +-1000, in fp64/fp32/bf16, "
                                 "with the right gradient")


# ----------------------------------------------------------------------------- dpo_loss
DPO_NAMES = ("loss", "chosen_rewards", "rejected_rewards", "margins", "accuracy")


def _dpo_cases():
    gen = torch.Generator().manual_seed(20)

    def logps(n, scale=3.0, dtype=torch.float32):
        return tuple((-(torch.rand(n, generator=gen) * scale * 4) - torch.rand(n, generator=gen)).to(dtype) for _ in range(4))

    pc, pr, rc, rr = logps(6)
    pc[0], pr[0] = rc[0], rr[0]  # a tie: h = 0, not counted as an accurate pair
    big = (torch.tensor([-400.0, -20.0, -3.0]), torch.tensor([-10.0, -600.0, -2.0]),
           torch.tensor([-12.0, -25.0, -3.0]), torch.tensor([-11.0, -30.0, -2.5]))
    return [
        ("6 pairs, float32, beta = 0.1 (pair 0 a tie: policy = reference)", (pc, pr, rc, rr), 0.1),
        ("9 pairs, float64, beta = 0.5", logps(9, dtype=torch.float64), 0.5),
        ("1 pair, float32, beta = 2.0", logps(1), 2.0),
        ("3 pairs, float32, beta = 1.0, summed log-probs of -600 to -2 (huge margins)", big, 1.0),
        ("12 pairs, bfloat16, beta = 0.25", logps(12, dtype=torch.bfloat16), 0.25),
    ]


def _dpo_reference(pc, pr, rc, rr, beta):
    pc, pr, rc, rr = (t.double() for t in (pc, pr, rc, rr))
    h = (pc - rc) - (pr - rr)
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    return (torch.nn.functional.softplus(-beta * h).mean(), chosen, rejected, chosen - rejected,
            (chosen > rejected).double().mean(), h)


def dpo_loss(fn) -> None:
    """Grade ``fn(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta)``
    -> ``(loss, chosen_rewards, rejected_rewards, margins, accuracy)``: ``loss = mean(-log sigmoid(beta * h))``,
    ``h = (pi_c - ref_c) - (pi_r - ref_r)``; the implicit rewards ``beta * (pi - ref)`` per pair, detached;
    ``margins`` their difference; ``accuracy`` the fraction of pairs with ``chosen_rewards > rejected_rewards``
    (a scalar). The reference is a constant: no gradient may reach it."""
    for tried, (pc, pr, rc, rr), beta in _dpo_cases():
        call_tried = f"dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta) with {tried}"
        loss_ref, chosen_ref, rejected_ref, margins_ref, acc_ref, h = _dpo_reference(pc, pr, rc, rr, beta)
        loss, chosen, rejected, margins, accuracy = call_twice(fn, call_tried, (pc, pr, rc, rr, beta), DPO_NAMES)
        tol = 1e-5 if pc.dtype != torch.bfloat16 else 3e-2
        if loss.dim() != 0:
            fail(call_tried, f"loss of shape {tuple(loss.shape)}", "a scalar loss", "average the per-pair losses: .mean()")
        if not torch.isfinite(loss):
            fail(call_tried, f"loss = {loss.item()}", f"{loss_ref.item():.6g}",
                 "log(sigmoid(x)) underflows for a large negative x: use torch.nn.functional.logsigmoid")
        for name, got, want in (("chosen_rewards", chosen, chosen_ref), ("rejected_rewards", rejected, rejected_ref),
                                ("margins", margins, margins_ref)):
            if got.shape != want.shape:
                fail(call_tried, f"{name} of shape {tuple(got.shape)}", f"shape {tuple(want.shape)}, one per pair",
                     "return the per-pair rewards (TRL logs their mean, but the loss needs each pair's)")
            if not _close(got, want, tol):
                hint = ("the implicit reward is beta * (policy log-prob - reference log-prob): multiply by beta"
                        if _close(got, want / beta, tol) else
                        "margins = chosen_rewards - rejected_rewards" if name == "margins" else
                        f"{name} = beta * (policy_{name.split('_')[0]}_logps - ref_{name.split('_')[0]}_logps)")
                fail(call_tried, f"{name} = {_show(got)}", f"{_show(want)} ({_max_error(got, want)})", hint)
        if not _close(loss, loss_ref, tol):
            candidates = {
                "the margin's sign is flipped: the loss is -log sigmoid(beta * h) with h = (pi_c - ref_c) - (pi_r - ref_r), "
                "small when the chosen response gained more than the rejected one": torch.nn.functional.softplus(beta * h).mean(),
                "beta belongs inside the sigmoid: -log sigmoid(beta * h), not -beta * log sigmoid(h)":
                    beta * torch.nn.functional.softplus(-h).mean(),
                "scale the log-ratio difference by beta inside the sigmoid: -log sigmoid(beta * h)":
                    torch.nn.functional.softplus(-h).mean(),
                "average over the pairs (.mean()), not .sum()": torch.nn.functional.softplus(-beta * h).sum(),
                "subtract the reference: h = (pi_c - ref_c) - (pi_r - ref_r), not pi_c - pi_r":
                    torch.nn.functional.softplus(-beta * (pc.double() - pr.double())).mean(),
            }
            hint = next((hh for hh, v in candidates.items() if _close(loss, v, tol)),
                        "-logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))).mean()")
            fail(call_tried, f"loss = {loss.item():.6g}", f"{loss_ref.item():.6g}", hint)
        if accuracy.dim() != 0 or not _close(accuracy, acc_ref, 1e-6):
            fail(call_tried, f"accuracy = {_show(accuracy)}", f"{acc_ref.item():.4g} (a scalar)",
                 "accuracy = (chosen_rewards > rejected_rewards).float().mean(): strictly greater, so a tie is not a win")
    _grade_dpo_gradients(fn)
    passed("dpo_loss", "-log sigmoid(beta * h) with detached implicit rewards, margins and accuracy (ties lose), "
                       "stable for margins of hundreds of nats, no gradient into the reference, fp64/fp32/bf16")


def _grade_dpo_gradients(fn) -> None:
    gen = torch.Generator().manual_seed(30)
    pc, pr, rc, rr = (-(torch.rand(5, generator=gen) * 10) for _ in range(4))
    beta = 0.3
    policy_c, policy_r = pc.clone().requires_grad_(True), pr.clone().requires_grad_(True)
    ref_c, ref_r = rc.clone().requires_grad_(True), rr.clone().requires_grad_(True)
    tried = ("dpo_loss(...) with reference log-probabilities that still require grad (computed without "
             "torch.no_grad()), then loss.backward()")
    out, inputs = call_on_copies(fn, tried, policy_c, policy_r, ref_c, ref_r, beta, return_inputs=True)
    loss, chosen, rejected, margins, _ = results(out, DPO_NAMES, tried)
    expect_differentiable(loss, "the loss", tried, "build the loss from the policy log-probabilities without detaching them")
    for name, t in (("chosen_rewards", chosen), ("rejected_rewards", rejected), ("margins", margins)):
        if t.requires_grad:
            fail(tried, f"{name} with requires_grad=True", f"{name} detached",
                 "the implicit rewards are logged, not optimised: .detach() them (TRL does)")
    loss.backward()
    pc_in, pr_in, rc_in, rr_in = inputs[:4]
    for name, t in (("ref_chosen_logps", rc_in), ("ref_rejected_logps", rr_in)):
        if t.grad is not None and t.grad.abs().max() > 0:
            fail(tried, f"a gradient in {name}.grad", "no gradient for the reference",
                 "the reference model is frozen: detach the reference log-probabilities inside the loss "
                 "(and compute them under torch.no_grad()), or the reference drifts with the policy")
    h = (pc - rc) - (pr - rr)
    expected = -beta * torch.sigmoid(-beta * h) / 5
    if pc_in.grad is None or not _close(pc_in.grad, expected, 1e-5) or not _close(pr_in.grad, -expected, 1e-5):
        fail(tried, "d loss / d policy_chosen_logps = " + (_show(pc_in.grad) if pc_in.grad is not None else "None"),
             _show(expected), "the loss's gradient is -beta * sigmoid(-beta h) / n for the chosen log-probs and its negative "
                              "for the rejected ones: build it from the policy log-probs with torch ops")


# ----------------------------------------------------------------------------- grpo_advantages
GRPO_EPS = 1e-4  # labkit.preference.grpo_advantages' default: (r - mean) / (std + eps)


def _advantage_reference(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    groups = rewards.double().view(-1, group_size)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + GRPO_EPS)).reshape(-1)


def _advantage_mistakes(rewards: torch.Tensor, group_size: int) -> dict:
    """The typical wrong answers, each with the hint that names it."""
    r = rewards.double()
    groups = r.view(-1, group_size)
    centred = groups - groups.mean(1, keepdim=True)
    strided = r.view(group_size, -1)
    strided = ((strided - strided.mean(0, keepdim=True)) / (strided.std(0, keepdim=True) + GRPO_EPS)).reshape(-1)
    return {
        "normalise within each prompt's group, not over the whole batch: the baseline is the mean of the same "
        "prompt's other answers": (r - r.mean()) / (r.std() + GRPO_EPS),
        "the groups are consecutive: responses 0..G-1 answer prompt 0 (rewards.view(-1, group_size)), not every "
        "n-th response (view(group_size, -1))": strided,
        "use the sample standard deviation (torch.std's default, unbiased, as TRL's GRPOTrainer): not "
        "std(unbiased=False)": (centred / (groups.std(1, unbiased=False, keepdim=True) + GRPO_EPS)).reshape(-1),
        "divide by the group's standard deviation (+ eps): mean-centring alone is Dr. GRPO's variant, not the "
        "objective asked for here": centred.reshape(-1),
    }


def _advantage_cases():
    gen = torch.Generator().manual_seed(40)
    binary = torch.rand(32, generator=gen) < 0.5
    binary[:8], binary[8:16] = True, False  # a group all right and a group all wrong
    tied = torch.randn(15, generator=gen)
    tied[5:10] = 0.25  # a group of equal real-valued rewards
    return [
        ("3 prompts x 4 responses, float32 rewards", torch.randn(12, generator=gen), 4),
        ("4 prompts x 8 responses, bool rewards (right or not), group 0 all right, group 1 all wrong", binary, 8),
        ("2 prompts x 2 responses, int64 rewards", torch.tensor([1, 0, 3, 3]), 2),
        ("1 prompt x 16 responses, float64 rewards near 1000", 1000 + torch.randn(16, generator=gen, dtype=torch.float64), 16),
        ("3 prompts x 5 responses, float32, group 1 five equal rewards 0.25", tied, 5),
        ("6 prompts x 3 responses, float32 rewards of size ~50", 50 * torch.randn(18, generator=gen), 3),
    ]


def grpo_advantages(fn) -> None:
    """Grade ``fn(rewards, group_size)`` -> float32 ``[n]``: ``rewards`` ``[n]`` (bool, integer or float) hold
    ``n / group_size`` groups of consecutive responses to one prompt; each reward becomes
    ``(r - mean of its group) / (std of its group + 1e-4)`` (sample std); a group of equal rewards gets 0
    (finite); a length that is not a multiple of ``group_size`` raises ``ValueError``."""
    for tried, rewards, group_size in _advantage_cases():
        call_tried = f"grpo_advantages(rewards, group_size={group_size}) with {tried}"
        expected = _advantage_reference(rewards, group_size)
        (got,) = call_twice(fn, call_tried, (rewards, group_size), ("the advantages",))
        if got.shape != expected.shape:
            fail(call_tried, f"shape {tuple(got.shape)}", f"shape {tuple(expected.shape)}, one advantage per response",
                 "return the advantages flat, in the rewards' order (reshape(-1) after normalising the [groups, G] view)")
        expect_dtype(got, torch.float32, "the advantages", call_tried,
                     "convert the rewards to float32 first (rewards.float()): bool or integer rewards cannot be averaged, "
                     "and the loss is computed in float32")
        if not torch.isfinite(got).all():
            fail(call_tried, f"{_show(got, 8)} (not finite)", _show(expected, 8),
                 "a group whose rewards are all equal has std 0: add eps to the std before dividing, so its advantages "
                 "are 0 (that group teaches nothing) instead of 0/0 = NaN")
        if not _close(got, expected, 1e-3):
            hint = next((h for h, value in _advantage_mistakes(rewards, group_size).items() if _close(got, value, 1e-3)),
                        "per group: (r - r.mean()) / (r.std() + 1e-4), the groups being rewards.view(-1, group_size)")
            fail(call_tried, _show(got, 8), f"{_show(expected, 8)} ({_max_error(got, expected)})", hint)
    tried = "grpo_advantages(rewards of length 10, group_size=4)"
    try:
        fn(torch.zeros(10), 4)
    except ValueError:
        pass
    except Exception as err:  # the learner's code may raise anything
        fail(tried, f"{type(err).__name__}: {err}", "a ValueError that names rewards and group_size",
             "check rewards.numel() % group_size == 0 yourself and raise ValueError with a message")
    else:
        fail(tried, "a result", "a ValueError: 10 rewards cannot form groups of 4",
             "check rewards.numel() % group_size == 0 and raise ValueError otherwise (view(-1, 4) raises a RuntimeError)")
    passed("grpo_advantages", "normalised within groups of consecutive responses (sample std + eps), 0 for groups of equal "
                              "rewards, float32 from bool/int/float rewards, ValueError on a ragged batch")


# ----------------------------------------------------------------------------- k3_kl
def _k3_per_token(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    log_ratio = ref_logps - logps
    return torch.exp(log_ratio) - log_ratio - 1


def _k3_inputs(seed: int, lengths: tuple[int, ...], dtype, pad_value: float | None):
    gen = torch.Generator().manual_seed(50 + seed)
    width = max(max(lengths), 1)
    logps = (-torch.rand(len(lengths), width, generator=gen, dtype=torch.float64) * 3).to(dtype)
    ref = (logps.double() + 0.5 * torch.randn(len(lengths), width, generator=gen, dtype=torch.float64)).clamp_max(0).to(dtype)
    mask = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
    if pad_value is not None:
        logps = logps.masked_fill(~mask, pad_value)
    return logps, ref, mask


def _k3_reference(logps, ref, mask):
    per_token = torch.where(mask, _k3_per_token(logps.double(), ref.double()), 0.0)
    return per_token.sum(1) / mask.sum(1).clamp_min(1)


def _k3_mistakes(logps, ref, mask) -> dict:
    lp, rf, m = logps.double(), ref.double(), mask.double()
    lengths = m.sum(1).clamp_min(1)
    mean = lambda per_token: (torch.where(mask, per_token, 0.0)).sum(1) / lengths  # noqa: E731
    return {
        "this is k1 (log pi - log pi_ref): unbiased but negative for some samples; k3 is "
        "exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1": mean(lp - rf),
        "the ratio is pi_ref / pi: k3 = exp(ref_logps - logps) - (ref_logps - logps) - 1, the estimate of "
        "KL(pi || pi_ref) from samples of pi (you wrote the other direction)": mean(torch.exp(lp - rf) - (lp - rf) - 1),
        "this is k2, (log pi - log pi_ref)^2 / 2: biased; k3 = r - log r - 1 with r = pi_ref / pi": mean((lp - rf) ** 2 / 2),
        "average over each response's real tokens (mask.sum(dim=1)), not over the padded length": (
            torch.where(mask, _k3_per_token(lp, rf), 0.0)).sum(1) / lp.shape[1],
        "the mean over the response's tokens, not the sum (labkit's kl_estimate sums; GRPO's objective averages "
        "1/|o_i| sum_t)": torch.where(mask, _k3_per_token(lp, rf), 0.0).sum(1),
    }


def _k3_cases():
    return [
        ("3 responses of lengths 4, 2, 3, float32, padding log-probs 0", 0, (4, 2, 3), torch.float32, 0.0),
        ("5 responses of lengths 1, 6, 6, 3, 2, float64", 1, (1, 6, 6, 3, 2), torch.float64, None),
        ("2 responses of lengths 5, 5 (no padding), float32", 2, (5, 5), torch.float32, None),
        ("4 responses of lengths 3, 0, 2, 4 (the second one empty), float32", 3, (3, 0, 2, 4), torch.float32, None),
        ("3 responses of lengths 2, 4, 1, float32, padding log-probs -1e4 (a large negative fill)",
         4, (2, 4, 1), torch.float32, -1e4),
    ]


def k3_kl(fn) -> None:
    """Grade ``fn(logps, ref_logps, mask)`` -> ``[n]`` in ``logps``' dtype: per response, the mean over its real
    tokens (``mask`` True) of ``k3 = exp(ref - logp) - (ref - logp) - 1``; 0 for a response without tokens;
    padding positions may hold any finite number and must not change the result; differentiable in ``logps``,
    with no gradient into the reference."""
    for tried, seed, lengths, dtype, pad_value in _k3_cases():
        logps, ref, mask = _k3_inputs(seed, lengths, dtype, pad_value)
        call_tried = f"k3_kl(logps, ref_logps, mask) with {tried}"
        expected = _k3_reference(logps, ref, mask)
        (got,) = call_twice(fn, call_tried, (logps, ref, mask), ("the KL estimates",))
        if got.shape != expected.shape:
            fail(call_tried, f"shape {tuple(got.shape)}", f"shape {tuple(expected.shape)}, one estimate per response",
                 "reduce over the token dimension only (dim=1): GRPO weights each response's KL like its advantage")
        expect_dtype(got, dtype, "the result", call_tried, "keep logps' dtype")
        if not torch.isfinite(got).all():
            fail(call_tried, f"{_show(got, 8)} (not finite)", _show(expected, 8),
                 "padding and empty responses: exp(ref - logp) can overflow at a padded position and inf * 0 is NaN, and "
                 "an empty response divides 0 by 0; select the real tokens with torch.where(mask, k3, 0) and divide "
                 "by mask.sum(dim=1).clamp_min(1)")
        if not _close(got, expected, 1e-5):
            hint = next((h for h, value in _k3_mistakes(logps, ref, mask).items() if _close(got, value, 1e-5)),
                        "k3 = exp(ref - logp) - (ref - logp) - 1 per token, zero at padding, averaged over each "
                        "response's real tokens")
            fail(call_tried, _show(got, 8), f"{_show(expected, 8)} ({_max_error(got, expected)})", hint)
    _grade_k3_gradients(fn)
    passed("k3_kl", "exp(ref - logp) - (ref - logp) - 1 averaged over each response's real tokens, 0 for an empty one, "
                    "padding ignored even at -1e4, gradient into logps only, fp32/fp64")


def _grade_k3_gradients(fn) -> None:
    logps, ref, mask = _k3_inputs(5, (3, 1, 4), torch.float32, 0.0)
    policy, reference = logps.clone().requires_grad_(True), ref.clone().requires_grad_(True)
    tried = ("k3_kl(logps, ref_logps, mask).sum().backward() with both logps and ref_logps requiring grad (a reference "
             "computed without torch.no_grad())")
    out, inputs = call_on_copies(fn, tried, policy, reference, mask, return_inputs=True)
    (out,) = results(out, ("the KL estimates",), tried)
    expect_differentiable(out, "the result", tried, "build it from logps with torch ops: the KL penalty is optimised")
    out.sum().backward()
    policy_in, reference_in = inputs[:2]
    if reference_in.grad is not None and reference_in.grad.abs().max() > 0:
        fail(tried, "a gradient in ref_logps.grad", "no gradient for the reference",
             "the reference is a constant of the objective: use ref_logps.detach() inside")
    lengths = mask.sum(1, keepdim=True).float()
    expected = torch.where(mask, 1 - torch.exp(ref - logps), 0.0) / lengths
    if policy_in.grad is None or not _close(policy_in.grad, expected, 1e-5):
        fail(tried, "d / d logps = " + (_show(policy_in.grad, 8) if policy_in.grad is not None else "None"),
             _show(expected, 8), "the gradient of the mean k3 in logp is (1 - exp(ref - logp)) / length at real tokens "
                                 "and 0 at padding: compute k3 from logps without detaching them")
