"""labkit.serving.sampling: every step against its closed form, samples against the exact distribution
(chi-square, fixed seeds), and the whole chain against Hugging Face's logits processors."""
import math

import pytest
import torch

from labkit.serving.sampling import SamplingParams, apply_penalties, next_token_probs, sample_next, top_k_filter, top_p_filter

# A correct sampler fails a chi-square test at this p-value for one seed in a million: the fixed seeds below
# make each test deterministic, and a failure means the sampler draws from another distribution.
FALSE_FAILURE_RATE = 1e-6
SAMPLES = 20_000


def chi_square_p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test of ``samples`` (token ids) against ``probs``. A sample outside
    the support fails outright (p = 0)."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = probs[support].double() * samples.numel()
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2).item()


def softmax_of(values: list[float]) -> list[float]:
    """Softmax in plain Python (an independent closed form), ``-inf`` giving 0."""
    finite = [v for v in values if v != -math.inf]
    top = max(finite)
    exps = [0.0 if v == -math.inf else math.exp(v - top) for v in values]
    return [e / sum(exps) for e in exps]


LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.5, -2.0])


# ----------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "1"),
    ("top_k", 0), ("top_k", 2.5), ("top_k", True), ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("frequency_penalty", float("inf")),
    ("presence_penalty", None), ("seed", -1), ("seed", 1.5), ("seed", 2**63),
])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_are_frozen_and_greedy_by_default():
    params = SamplingParams()
    assert params.greedy and not params.uses_history and params.make_generator() is None
    with pytest.raises(AttributeError):
        params.temperature = 1.0


def test_bad_inputs_name_the_argument():
    with pytest.raises(TypeError, match="logits"):
        next_token_probs(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="logits"):
        next_token_probs(torch.tensor([0.0, float("nan")]))
    with pytest.raises(ValueError, match="logits"):
        next_token_probs(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="previous_ids"):
        next_token_probs(LOGITS, SamplingParams(repetition_penalty=1.2), [0, 6])
    with pytest.raises(ValueError, match="previous_ids"):
        next_token_probs(LOGITS[None].repeat(2, 1), SamplingParams(repetition_penalty=1.2), [[0]])
    with pytest.raises(ValueError, match="params"):
        next_token_probs(LOGITS[None].repeat(2, 1), [SamplingParams()])
    with pytest.raises(ValueError, match="generator"):
        sample_next(LOGITS[None].repeat(2, 1), SamplingParams(temperature=1.0), generator=[torch.Generator()])


# ----------------------------------------------------------------------------- closed forms
def test_greedy_is_one_hot_at_the_first_argmax_and_draws_nothing():
    logits = torch.tensor([1.0, 3.0, 3.0, 0.0])
    assert next_token_probs(logits).tolist() == [0.0, 1.0, 0.0, 0.0]
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    assert sample_next(logits, SamplingParams(top_k=1, top_p=0.3), generator=generator).item() == 1
    assert torch.equal(generator.get_state(), state)


def test_temperature_is_softmax_of_scaled_logits():
    for t in (0.25, 1.0, 3.0):
        got = next_token_probs(LOGITS, SamplingParams(temperature=t))
        assert got.dtype == torch.float32
        assert got.tolist() == pytest.approx(softmax_of([v / t for v in LOGITS.tolist()]), abs=1e-6)


def test_top_k_keeps_the_k_largest_and_their_ties():
    values = LOGITS.tolist()  # sorted: 3.0, 2.0, 0.5, 0.5, -1.0, -2.0
    for k, kept in [(1, {3}), (2, {3, 0}), (3, {3, 0, 2, 4}), (6, set(range(6))), (50, set(range(6)))]:
        expected = softmax_of([v if i in kept else -math.inf for i, v in enumerate(values)])
        assert next_token_probs(LOGITS, SamplingParams(temperature=1.0, top_k=k)).tolist() == pytest.approx(expected, abs=1e-6)


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = torch.tensor(probs).log()
    for p, kept in [(0.45, 1), (0.75, 2), (0.85, 3), (0.97, 4), (1.0, 4)]:
        expected = [v / sum(probs[:kept]) if i < kept else 0.0 for i, v in enumerate(probs)]
        got = next_token_probs(logits, SamplingParams(temperature=1.0, top_p=p))
        assert got.tolist() == pytest.approx(expected, abs=1e-6), p


def test_top_k_and_top_p_filters_work_on_batches():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(1))
    for row, filtered in zip(logits, top_k_filter(logits, 3)):
        assert torch.equal(filtered, top_k_filter(row, 3))
    for row, filtered in zip(logits, top_p_filter(logits, 0.6)):
        assert torch.equal(filtered, top_p_filter(row, 0.6))


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits_once():
    got = apply_penalties(LOGITS, SamplingParams(repetition_penalty=2.0), [0, 1, 1, 5, 5, 5])
    assert got.tolist() == pytest.approx([1.0, -2.0, 0.5, 3.0, 0.5, -4.0])


def test_frequency_and_presence_penalties_follow_openai():
    previous = torch.tensor([3, 3, 3, 2])
    got = apply_penalties(LOGITS, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), previous)
    assert got.tolist() == pytest.approx([2.0, -1.0, 0.5 - 0.5 - 0.25, 3.0 - 1.5 - 0.25, 0.5, -2.0])
    assert torch.equal(apply_penalties(LOGITS, SamplingParams(frequency_penalty=0.5), []), LOGITS)


def test_steps_run_in_order_penalties_temperature_top_k_top_p():
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.9, repetition_penalty=4.0)
    # penalised: [2, -1, 0.5, 0.75, 0.5, -2] -> / 0.5 -> top-3 {0, 3, 2/4 tied} -> nucleus of that
    scaled = [4.0, -2.0, 1.0, 1.5, 1.0, -4.0]
    top3 = softmax_of([v if i in (0, 2, 3, 4) else -math.inf for i, v in enumerate(scaled)])
    order = sorted(range(6), key=lambda i: -top3[i])
    kept, mass = set(), 0.0
    for i in order:
        if mass < 0.9:
            kept.add(i)
        mass += top3[i]
    expected = softmax_of([v if i in kept else -math.inf for i, v in enumerate(scaled)])
    assert next_token_probs(LOGITS, params, [3]).tolist() == pytest.approx(expected, abs=1e-6)
    # greedy applies the penalties too: token 3 (3.0 -> 0.75) loses to token 0
    assert sample_next(LOGITS, SamplingParams(repetition_penalty=4.0), [3]).item() == 0


# ----------------------------------------------------------------------------- samples
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.95, repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2),
])
def test_samples_follow_the_exact_distribution(params):
    previous = [0, 3, 3]
    probs = next_token_probs(LOGITS, params, previous)
    generator = torch.Generator().manual_seed(1234)
    samples = sample_next(LOGITS.expand(SAMPLES, -1), params, [previous] * SAMPLES, generator)
    assert samples.shape == (SAMPLES,) and samples.dtype == torch.int64
    assert chi_square_p_value(samples, probs) > FALSE_FAILURE_RATE


def test_chi_square_check_rejects_the_wrong_distribution():
    """The test above has power: samples at temperature 1 fail against temperature 0.8's distribution."""
    generator = torch.Generator().manual_seed(1234)
    samples = sample_next(LOGITS.expand(SAMPLES, -1), SamplingParams(temperature=1.0), generator=generator)
    assert chi_square_p_value(samples, next_token_probs(LOGITS, SamplingParams(temperature=0.8))) < FALSE_FAILURE_RATE


def test_per_request_seeds_reproduce_and_do_not_depend_on_the_batch():
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0, seed=8)]
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(2))

    def draw(rows, ps, steps=20):
        generators = [p.make_generator() for p in ps]
        return torch.stack([sample_next(rows, ps, generator=generators) for _ in range(steps)])

    together = draw(logits, params)
    alone = draw(logits[:1], params[:1])
    assert torch.equal(together, draw(logits, params))
    assert torch.equal(together[:, 0], alone[:, 0])
    assert not torch.equal(together[:, 0], together[:, 1])


def test_a_batch_equals_its_rows():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 9, generator=gen)
    params = [SamplingParams(), SamplingParams(temperature=0.9, top_k=4, repetition_penalty=1.3), SamplingParams(temperature=2.0, top_p=0.5)]
    previous = [[1, 2], [4, 4, 8], []]
    batch = next_token_probs(logits, params, previous)
    for row, p, h, got in zip(logits, params, previous, batch):
        assert torch.equal(got, next_token_probs(row, p, h))


# ----------------------------------------------------------------------------- Hugging Face
def test_matches_hugging_face_logits_processors():
    transformers = pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        vocab = int(torch.randint(2, 60, (1,), generator=gen))
        logits = torch.randn(vocab, generator=gen) * 3
        previous = torch.randint(0, vocab, (int(torch.randint(0, 12, (1,), generator=gen)),), generator=gen)
        t = 0.1 + 2 * float(torch.rand(1, generator=gen))
        k = int(torch.randint(1, vocab + 1, (1,), generator=gen))
        p = float(torch.rand(1, generator=gen)) * 0.99 + 0.01
        r = 0.5 + 1.5 * float(torch.rand(1, generator=gen))
        processors = transformers.LogitsProcessorList([
            transformers.RepetitionPenaltyLogitsProcessor(r), transformers.TemperatureLogitsWarper(t),
            transformers.TopKLogitsWarper(k), transformers.TopPLogitsWarper(p),
        ])
        expected = torch.softmax(processors(previous[None], logits[None].clone()), dim=-1)[0]
        got = next_token_probs(logits, SamplingParams(temperature=t, top_k=k, top_p=p, repetition_penalty=r), previous)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
