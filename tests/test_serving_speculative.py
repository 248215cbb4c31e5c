"""labkit.serving.speculative: the accept/reject rule leaves the target's distribution unchanged (chi-square over
whole sequences of a Markov chain, fixed seeds), greedy speculative decoding equals greedy decoding token for
token, the counts add up, and the chapter's shipped target/draft pair does what the chapter says."""
import dataclasses
import itertools
import math

import pytest
import torch

from labkit.checks.ch12_serving import chi_square_p_value
from labkit.model import TransformerLM, generate, tiny_config
from labkit.nn import KVCache
from labkit.serving import speculative
from labkit.serving.sampling import SamplingParams, sample_next
from labkit.serving.speculative import expected_tokens_per_pass, speculative_accept, speculative_generate

# a correct implementation fails a chi-square test below at this p-value for one seed in a million
FALSE_FAILURE_RATE = 1e-6


# ----------------------------------------------------------------------------- the KV cache rolls back
def test_kv_cache_crop_forgets_the_tail_and_later_updates_overwrite_it():
    cache = KVCache(num_layers=2, batch_size=1, num_kv_heads=1, max_seq_len=8, head_dim=2)
    old = torch.arange(10.0).reshape(1, 1, 5, 2)
    for layer in range(2):
        cache.update(layer, old, old)
    cache.crop(3)
    assert cache.length(0) == cache.length(1) == 3
    new = -torch.ones(1, 1, 2, 2)
    k, v = cache.update(0, new, new)
    assert torch.equal(k, torch.cat([old[:, :, :3], new], dim=2))
    for bad in (-1, 4, 2.0, True):
        with pytest.raises(ValueError, match="length"):
            cache.crop(bad)


# ----------------------------------------------------------------------------- the rule
def chain(start: int, tables_p: torch.Tensor, tables_q: torch.Tensor, length: int, k: int, gen: torch.Generator):
    """``length`` tokens of a first-order Markov chain (target ``tables_p[prev]``, draft ``tables_q[prev]``)
    decoded speculatively with :func:`speculative_accept`, exactly as the decoding loop uses it."""
    seq = [start]
    while len(seq) - 1 < length:
        steps = min(k, length - len(seq))
        drafts, q_rows = [], []
        for _ in range(steps):
            row = tables_q[drafts[-1] if drafts else seq[-1]]
            q_rows.append(row)
            drafts.append(int(torch.multinomial(row, 1, generator=gen)))
        p_rows = torch.stack([tables_p[t] for t in ([seq[-1]] + drafts)])
        q = torch.stack(q_rows) if q_rows else torch.zeros(0, tables_p.shape[1])
        seq += speculative_accept(q, p_rows, torch.tensor(drafts, dtype=torch.long), gen).tolist()
    return tuple(seq[1:])


def test_speculative_sampling_leaves_the_target_distribution_unchanged():
    gen = torch.Generator().manual_seed(0)
    vocab, length, trials = 3, 3, 2000
    tables_p = torch.softmax(2 * torch.randn(vocab, vocab, generator=gen), -1)
    tables_q = torch.softmax(2 * torch.randn(vocab, vocab, generator=gen), -1)  # a poor draft: many rejections
    exact = {}
    for seq in itertools.product(range(vocab), repeat=length):
        prob, prev = 1.0, 0
        for t in seq:
            prob, prev = prob * float(tables_p[prev, t]), t
        exact[seq] = prob
    counts = {}
    for _ in range(trials):
        seq = chain(0, tables_p, tables_q, length, k=2, gen=gen)
        counts[seq] = counts.get(seq, 0) + 1
    assert chi_square_p_value(counts, exact, trials) > FALSE_FAILURE_RATE
    # and the draft's own distribution is far away: the test can tell them apart
    draft_exact = {s: math.prod(float(tables_q[a, b]) for a, b in zip((0,) + s, s)) for s in exact}
    assert chi_square_p_value(counts, draft_exact, trials) < FALSE_FAILURE_RATE


def test_rule_inputs_are_checked():
    q, p = torch.full((2, 4), 0.25), torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match="draft_probs"):
        speculative_accept(q[:1], p, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="draft_tokens"):
        speculative_accept(q, p, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="draft_tokens"):
        speculative_accept(q, p, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="target_probs"):
        speculative_accept(q, p[0], torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="draft_tokens"):
        speculative_accept(q, p, [0, 1])


def test_expected_tokens_per_pass_is_the_geometric_sum():
    assert expected_tokens_per_pass(0.0, 4) == 1.0
    assert expected_tokens_per_pass(1.0, 4) == 5.0
    assert expected_tokens_per_pass(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    with pytest.raises(ValueError, match="acceptance"):
        expected_tokens_per_pass(1.5, 3)
    with pytest.raises(ValueError, match="k="):
        expected_tokens_per_pass(0.5, -1)


# ----------------------------------------------------------------------------- the loop
@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target = TransformerLM(tiny_config(16, context_length=48)).eval()
    draft = TransformerLM(tiny_config(16, context_length=48, num_layers=1, d_model=16, num_heads=2, d_ff=32)).eval()
    return target, draft


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("prompt_len", [1, 6])
def test_greedy_speculative_equals_greedy_decoding(models, k, prompt_len):
    target, draft = models
    prompt = torch.randint(0, 16, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
    expected = generate(target, prompt, 25, temperature=0.0)
    ids, stats = speculative_generate(target, draft, prompt, 25, k=k)
    assert torch.equal(ids, expected)
    assert stats.new_tokens == 25 == sum(n + 1 for n in stats.accepted_per_step)
    assert stats.target_passes == len(stats.accepted_per_step)
    assert stats.draft_passes == stats.drafted and stats.accepted == sum(stats.accepted_per_step)


def test_a_perfect_draft_is_always_accepted(models):
    target, _ = models
    prompt = torch.tensor([3, 1, 4])
    for sampling in (None, SamplingParams(temperature=1.0, top_k=5)):
        ids, stats = speculative_generate(target, target, prompt, 23, k=3, sampling=sampling, seed=1)
        assert stats.acceptance_rate == 1.0
        assert stats.target_passes == math.ceil(23 / 4)  # k + 1 tokens per target pass
    assert stats.tokens_per_target_pass == pytest.approx(23 / 6)


def test_greedy_with_penalties_equals_plain_decoding_with_the_same_penalties(models):
    target, draft = models
    params = SamplingParams(repetition_penalty=1.8, presence_penalty=0.5)
    ids = [2, 7]
    with torch.no_grad():
        for _ in range(20):
            ids.append(int(sample_next(target(torch.tensor([ids]))[0, -1], params, ids)))
    got, _ = speculative_generate(target, draft, torch.tensor(ids[:2]), 20, k=3, sampling=params)
    assert got.tolist() == ids


def test_sampling_is_reproducible_per_seed_and_keeps_the_input_rank(models):
    target, draft = models
    prompt = torch.tensor([[5, 9, 2]])
    params = SamplingParams(temperature=1.0, seed=11)
    first, _ = speculative_generate(target, draft, prompt, 15, k=2, sampling=params)
    again, _ = speculative_generate(target, draft, prompt, 15, k=2, sampling=params)
    other, _ = speculative_generate(target, draft, prompt, 15, k=2, sampling=params, seed=12)
    assert first.shape == (1, 18) and torch.equal(first, again) and not torch.equal(first, other)
    none, stats = speculative_generate(target, draft, prompt[0], 0, k=2)
    assert torch.equal(none, prompt[0]) and stats.target_passes == 0


def test_bad_arguments_are_named(models):
    target, draft = models
    prompt = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="k="):
        speculative_generate(target, draft, prompt, 5, k=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(target, draft, prompt, 47, k=2)
    with pytest.raises(ValueError, match="prompt_ids"):
        speculative_generate(target, draft, torch.zeros(2, 3, dtype=torch.long), 5)
    with pytest.raises(TypeError, match="sampling"):
        speculative_generate(target, draft, prompt, 5, sampling={"temperature": 1.0})
    with pytest.raises(ValueError, match="vocab_size"):
        speculative_generate(target, TransformerLM(tiny_config(17)), prompt, 5)


# ----------------------------------------------------------------------------- the chapter's models
@pytest.fixture(scope="module")
def zen():
    target, drafts, log = speculative.load_zen_pair()
    return target, drafts, log, speculative.zen_tokenizer()


def test_the_target_recites_the_zen_of_python(zen):
    target, _, _, tok = zen
    text = speculative.zen_text()
    prompt = "Beautiful is"
    start = text.index(prompt)
    out = tok.decode(generate(target, torch.tensor(tok.encode(prompt)), 110, temperature=0.0))
    assert out == text[start : start + len(prompt) + 110]


def test_drafts_improve_with_training_and_the_best_agrees_at_least_70_percent(zen):
    target, drafts, _, tok = zen
    ids = generate(target, torch.tensor(tok.encode("Beautiful is")), 110, temperature=0.0)
    agreement = [speculative.greedy_agreement(target, drafts[step], ids) for step in speculative.DRAFT_SNAPSHOTS]
    assert agreement == sorted(agreement) and agreement[0] < 0.5 and agreement[-1] >= 0.7
    assert drafts[speculative.DRAFT_SNAPSHOTS[-1]].num_params() * 10 < target.num_params()


def test_speculative_decoding_of_the_zen_needs_fewer_target_passes(zen):
    target, drafts, _, tok = zen
    prompt = torch.tensor(tok.encode("Beautiful is"))
    draft = drafts[speculative.DRAFT_SNAPSHOTS[-1]]
    ids, stats = speculative_generate(target, draft, prompt, 110, k=4)
    assert torch.equal(ids, generate(target, prompt, 110, temperature=0.0))
    assert stats.tokens_per_target_pass >= 2.0  # plain decoding: 1.0


def test_the_asset_is_small_and_a_stale_one_is_refused(tmp_path):
    assert speculative.ASSET.stat().st_size <= 1_000_000
    payload = torch.load(speculative.ASSET, weights_only=False)
    payload["recipe"] = dataclasses.asdict(dataclasses.replace(speculative.RECIPE, steps=1))
    path = tmp_path / "old.pt"
    torch.save(payload, path)
    with pytest.raises(RuntimeError, match="python -m labkit.serving.speculative"):
        speculative.load_zen_pair(path=path)


def test_retraining_runs_the_recipe_and_round_trips(tmp_path, monkeypatch):
    monkeypatch.setattr(speculative, "RECIPE", dataclasses.replace(speculative.RECIPE, steps=2, eval_every=2, batch_size=2))
    monkeypatch.setattr(speculative, "DRAFT_SNAPSHOTS", (1, 2))
    target, drafts, log = speculative.train_zen_pair()
    assert sorted(drafts) == [1, 2] and log["target"]["val_step"] == [2]
    path = tmp_path / "pair.pt"
    speculative.save_zen_pair(target, drafts, log, path)
    loaded, loaded_drafts, _ = speculative.load_zen_pair(path=path)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), target.state_dict().values()))
    assert torch.equal(loaded_drafts[2].lm_head.weight, drafts[2].lm_head.weight)
