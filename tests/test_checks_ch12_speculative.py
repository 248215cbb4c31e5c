"""Chapter 12's speculative accept/reject grader accepts labkit's answer and an independent one, and rejects the
realistic wrong ones with a hint that names the mistake."""
import pytest
import torch

from labkit.checks import CheckFailed, DelegationRefused
from labkit.checks import ch12_serving as checks  # unwrapped; the refusal wrapper is tested below
from labkit.checks._core import refuse_delegation
from labkit.serving.speculative import speculative_accept


def test_labkits_answer_passes(capsys):
    checks.speculative_accept(speculative_accept)
    assert "✓ speculative_accept:" in capsys.readouterr().out


def loop_answer(q, p, tokens, generator):
    """An independent right answer: one uniform per position drawn lazily, the ratio written as a division."""
    for i, x in enumerate(tokens.tolist()):
        u = torch.rand((), generator=generator, dtype=torch.float64)
        if q[i, x] > 0 and u >= p[i, x] / q[i, x]:
            residual = torch.clamp(p[i] - q[i], min=0)
            return torch.cat([tokens[:i], torch.multinomial(residual / residual.sum(), 1, generator=generator)])
    return torch.cat([tokens, torch.multinomial(p[len(tokens)], 1, generator=generator)])


def test_an_independent_answer_passes(capsys):
    checks.speculative_accept(loop_answer)
    assert "✓ speculative_accept:" in capsys.readouterr().out


def test_the_exact_outcome_distribution_sums_to_one_and_matches_a_closed_form():
    gen = torch.Generator().manual_seed(0)
    q, p = checks._random_probs(2, 3, gen), checks._random_probs(3, 3, gen)
    outcomes = checks.exact_outcomes(q, p)
    assert sum(outcomes.values()) == pytest.approx(1.0, abs=1e-12)
    # the first emitted token is distributed exactly as the target's p_0 (the point of the rule)
    for t in range(3):
        assert sum(pr for o, pr in outcomes.items() if o[0] == t) == pytest.approx(float(p[0, t]), abs=1e-12)
    # accepting both drafts: P = sum over x0, x1 of min(p0, q0)(x0) min(p1, q1)(x1)
    both = sum(pr for o, pr in outcomes.items() if len(o) == 3)
    alpha = torch.minimum(p[:2], q).double().sum(-1)
    assert both == pytest.approx(float(alpha[0] * alpha[1]), abs=1e-12)
    assert all(pr > 0 and 1 <= len(o) <= 3 for o, pr in outcomes.items())


def test_the_chi_square_false_alarm_rate_is_as_stated():
    """Under the exact distribution the p-value is uniform: about 1 in 10 of 200 seeded runs fall below 0.1."""
    expected = {(0,): 0.2, (1,): 0.3, (2,): 0.5}
    low = 0
    for seed in range(200):
        draws = torch.multinomial(torch.tensor([0.2, 0.3, 0.5]), 600, replacement=True, generator=torch.Generator().manual_seed(seed))
        counts = {(t,): int((draws == t).sum()) for t in range(3)}
        low += checks.chi_square_p_value(counts, expected, 600) < 0.1
    assert 8 <= low <= 35  # binomial(200, 0.1): mean 20, these bounds hold with probability > 1 - 1e-4


# ----------------------------------------------------------------------------- realistic mistakes
def correction_from_target(q, p, tokens, generator):
    """Draws the replacement from p_n instead of max(0, p_n - q_n): over-represents what the draft already proposed."""
    u = torch.rand(len(tokens), generator=generator)
    for i, x in enumerate(tokens.tolist()):
        if u[i] * q[i, x] >= p[i, x]:
            return torch.cat([tokens[:i], torch.multinomial(p[i], 1, generator=generator)])
    return torch.cat([tokens, torch.multinomial(p[-1], 1, generator=generator)])


def deterministic_accept(q, p, tokens, generator):
    """Accepts when p(x) >= q(x), rejects otherwise: no coin flip."""
    for i, x in enumerate(tokens.tolist()):
        if p[i, x] < q[i, x]:
            residual = (p[i] - q[i]).clamp(min=0)
            return torch.cat([tokens[:i], torch.multinomial(residual, 1, generator=generator)])
    return torch.cat([tokens, torch.multinomial(p[-1], 1, generator=generator)])


def inverted_ratio(q, p, tokens, generator):
    """Accepts with probability q(x) / p(x)."""
    u = torch.rand(len(tokens), generator=generator)
    for i, x in enumerate(tokens.tolist()):
        if u[i] * p[i, x] >= q[i, x]:
            residual = (p[i] - q[i]).clamp(min=0)
            return torch.cat([tokens[:i], torch.multinomial(residual, 1, generator=generator)])
    return torch.cat([tokens, torch.multinomial(p[-1], 1, generator=generator)])


def accept_with_target_probability(q, p, tokens, generator):
    """Accepts with probability p(x), forgetting to divide by q(x)."""
    u = torch.rand(len(tokens), generator=generator)
    for i, x in enumerate(tokens.tolist()):
        if u[i] >= p[i, x]:
            residual = (p[i] - q[i]).clamp(min=0)
            return torch.cat([tokens[:i], torch.multinomial(residual, 1, generator=generator)])
    return torch.cat([tokens, torch.multinomial(p[-1], 1, generator=generator)])


def no_bonus_token(q, p, tokens, generator):
    out = speculative_accept(q, p, tokens, generator)
    return out[:-1] if len(out) == len(tokens) + 1 and len(tokens) else out


def bonus_from_last_draft_row(q, p, tokens, generator):
    """Off by one: the bonus comes from p_{k-1} instead of p_k."""
    out = speculative_accept(q, p, tokens, generator)
    if len(out) == len(tokens) + 1 and len(tokens):
        out = torch.cat([tokens, torch.multinomial(p[len(tokens) - 1], 1, generator=generator)])
    return out


def keeps_going_after_a_rejection(q, p, tokens, generator):
    """Replaces each rejected token and keeps checking the rest."""
    u = torch.rand(len(tokens), generator=generator)
    out = []
    for i, x in enumerate(tokens.tolist()):
        if u[i] * q[i, x] < p[i, x]:
            out.append(x)
        else:
            out.append(int(torch.multinomial((p[i] - q[i]).clamp(min=0), 1, generator=generator)))
    return torch.tensor(out + [int(torch.multinomial(p[-1], 1, generator=generator))])


def unclamped_residual(q, p, tokens, generator):
    """Samples from p - q without clamping: negative weights."""
    u = torch.rand(len(tokens), generator=generator)
    for i, x in enumerate(tokens.tolist()):
        if u[i] * q[i, x] >= p[i, x]:
            return torch.cat([tokens[:i], torch.multinomial(p[i] - q[i], 1, generator=generator)])
    return torch.cat([tokens, torch.multinomial(p[-1], 1, generator=generator)])


def global_rng(q, p, tokens, generator):
    """Ignores the generator."""
    return speculative_accept(q, p, tokens, None)


def one_uniform_for_all(q, p, tokens, generator):
    """Reuses one uniform for every position: acceptances become correlated."""
    u = torch.rand((), generator=generator)
    for i, x in enumerate(tokens.tolist()):
        if u * q[i, x] >= p[i, x]:
            residual = (p[i] - q[i]).clamp(min=0)
            return torch.cat([tokens[:i], torch.multinomial(residual, 1, generator=generator)])
    return torch.cat([tokens, torch.multinomial(p[-1], 1, generator=generator)])


def clamps_in_place(q, p, tokens, generator):
    """Computes the residual into the target's own tensor."""
    out = speculative_accept(q, p, tokens, generator)
    if len(out) <= len(tokens):
        p[len(out) - 1].sub_(q[len(out) - 1]).clamp_(min=0)
    return out


def returns_a_list(q, p, tokens, generator):
    return speculative_accept(q, p, tokens, generator).tolist()


def float_tokens(q, p, tokens, generator):
    return speculative_accept(q, p, tokens, generator).float()


def includes_the_rejected_token(q, p, tokens, generator):
    out = speculative_accept(q, p, tokens, generator)
    n = len(out) - 1
    return torch.cat([tokens[: n + 1], out[n:]]) if n < len(tokens) else out


@pytest.mark.parametrize("wrong, message", [
    (correction_from_target, "max\\(0, p"),
    (deterministic_accept, "min\\(1, p\\(x\\) / q\\(x\\)\\)"),
    (inverted_ratio, "greedy decoding"),
    (accept_with_target_probability, "min\\(1, p\\(x\\) / q\\(x\\)\\)"),
    (no_bonus_token, "ONE more token|bonus"),
    (bonus_from_last_draft_row, "bonus"),
    (keeps_going_after_a_rejection, "stop"),
    (unclamped_residual, "raised"),
    (global_rng, "global generator"),
    (one_uniform_for_all, "one fresh uniform|chi-square"),
    (clamps_in_place, "unchanged"),
    (returns_a_list, "torch.Tensor"),
    (float_tokens, "int64"),
    (includes_the_rejected_token, "rejected draft token is not emitted"),
])
def test_wrong_answers_are_rejected(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        checks.speculative_accept(wrong)


def test_delegating_to_labkit_is_refused():
    grader = refuse_delegation(checks.speculative_accept, "speculative_accept")
    with pytest.raises(DelegationRefused, match="speculative_accept"):
        grader(lambda *args: speculative_accept(*args))


# ----------------------------------------------------------------------------- under labkit.grade: probe and judge
def _handle(fn):
    """The learner's function behind a Remote handle whose requests cross as bytes (as in tests/test_remote.py)."""
    from labkit.checks import _remote

    class LocalTransport(_remote.Transport):
        def exchange(self, request: bytes) -> bytes:
            return _remote.handle(request, {"mine": fn})

    return _remote.Remote(LocalTransport(), "mine", "speculative_accept")


def test_the_verdicts_are_the_same_through_a_handle(capsys):
    import labkit.checks as graded

    graded.speculative_accept(_handle(loop_answer))
    assert "✓ speculative_accept:" in capsys.readouterr().out
    for wrong, message in ((correction_from_target, "max\\(0, p"), (one_uniform_for_all, "one fresh uniform|chi-square"),
                           (inverted_ratio, "greedy decoding"), (returns_a_list_of_my_own, "torch.Tensor")):
        with pytest.raises(CheckFailed, match=message):
            graded.speculative_accept(_handle(wrong))
    with pytest.raises(CheckFailed, match="labkit's answer to this exercise"):  # refused in the learner's process
        graded.speculative_accept(_handle(lambda *args: speculative_accept(*args)))


def returns_a_list_of_my_own(q, p, tokens, generator):
    return loop_answer(q, p, tokens, generator).tolist()


def test_the_verdicts_come_from_the_judge_not_from_the_probe():
    # Under labkit.grade the probes run in the learner's process and could be replaced there: the judges, in the
    # grading process, check every token a probe reports, so a forged record passes only if it is what a right
    # answer returns.
    description, q, p, draft, expected, _, hint = next(checks._certain_cases())
    tokens = torch.tensor(draft)
    outs = checks._probe_certain(loop_answer, q, p, tokens, description, hint)
    checks._judge_certain(outs, q, p, tokens, description, expected, None, hint)
    for forged in (outs[:3], [outs[0][:-1]] * 4, [torch.tensor(expected[:-1] + [0])] * 4, [expected] * 4, None):
        with pytest.raises(CheckFailed):
            checks._judged(checks._judge_certain, "speculative_accept", forged, q, p, tokens, description, expected, None, hint)

    gen = torch.Generator().manual_seed(5)
    q, p = checks._random_probs(3, 5, gen), checks._random_probs(4, 5, gen)
    drafts = torch.stack([torch.multinomial(q, 1, generator=gen)[:, 0] for _ in range(12)])
    pairs = checks._probe_generator(loop_answer, q, p, drafts)
    checks._judge_generator(pairs, q, p, drafts)
    for forged in ([[a, a.flip(0)] for a, _ in pairs], [pairs[0]] * 12, pairs[:-1]):
        with pytest.raises(CheckFailed):
            checks._judged(checks._judge_generator, "speculative_accept", forged, q, p, drafts)

    q, p = checks._random_probs(2, 3, gen), checks._random_probs(3, 3, gen)
    drawing = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(q, checks.TRIALS, replacement=True, generator=drawing).T
    outs = checks._probe_distribution(loop_answer, q, p, drafts, drawing.get_state(), "the distribution")
    checks._check_distribution(outs, q, p, drafts, "the distribution")
    always_accepted = [torch.cat([t, torch.tensor([0])]) for t in drafts]  # every draft accepted: too many tokens
    for forged in (always_accepted, outs[: len(outs) // 2] * 2, outs[:-1], [o.tolist() for o in outs]):
        with pytest.raises(CheckFailed):
            checks._judged(checks._check_distribution, "speculative_accept", forged, q, p, drafts, "the distribution")
