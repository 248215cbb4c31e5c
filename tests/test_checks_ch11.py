"""The chapter-11 graders accept independent right solutions and reject the realistic wrong ones (with a hint that
names the mistake), through a handle too (bytes results cross labkit.grade's wire through a harness), and refuse
labkit's and third-party implementations while they grade."""
from collections import Counter, defaultdict

import numpy as np
import pytest

import labkit.checks
from labkit.checks import CheckFailed, DelegationRefused, _remote
from labkit.checks import ch11_tokenization as checks  # the graders unwrapped (labkit.checks.X refuse delegation)
from labkit.checks._core import DELEGATES

P = (1 << 61) - 1


# ----------------------------------------------------------------------------- the graders' references
def test_merge_step_reference_gives_train_bpes_merges(tmp_path):
    from labkit.tokenizer import train_bpe

    steps = 120
    words = checks._words_of(checks._CORPUS)
    counts = checks._count_pairs(words)
    ours = []
    for _ in range(steps):
        pair, words, counts = checks._reference_step(words, counts)
        ours.append(pair)
    assert tuple(ours) == checks._trained(256 + steps)
    path = tmp_path / "corpus.txt"
    path.write_text(checks._CORPUS, encoding="utf-8")
    assert [tuple(m) for m in train_bpe(path, 256 + steps, [])[1]] == ours


def test_encode_reference_is_labkits_tokenizer():
    from labkit.tokenizer import _PRETOKEN, Tokenizer, train_bpe

    merges = list(checks._trained(256 + 120))
    vocab = {i: bytes([i]) for i in range(256)}
    for a, b in merges:
        if a + b not in vocab.values():
            vocab[len(vocab)] = a + b
    tok = Tokenizer(vocab, merges)
    text = checks._CORPUS + " Lowest newer theses: the tokenizer's résumé, 東京タワー 🙂🙂 and 12345 thousand"
    for piece in _PRETOKEN.findall(text):
        ids = tok._bpe(piece.encode())
        assert [tok.vocab[i] for i in ids] == checks._encode_reference(piece.encode(), merges), piece
    assert train_bpe  # the merges come from it (checks._trained)


def test_signature_reference_is_exact_and_labkits():
    from labkit.datapipe import minhash_permutations, minhash_signatures, shingles

    for text, num_perm, seed in ((checks._CORPUS, 32, 0), ("a b c d e f g", 5, 4), ("", 3, 1)):
        x = shingles(text)
        a, b = minhash_permutations(num_perm, seed)
        got = checks._signature_reference(x, a, b)
        assert got.dtype == np.uint64 and np.array_equal(got, minhash_signatures([x], num_perm, seed)[0])
        exact = [min(((int(ak) * int(xi) + int(bk)) % P for xi in x.tolist()), default=P) for ak, bk in zip(a, b)]
        assert got.tolist() == exact


# ----------------------------------------------------------------------------- bpe_merge_step: right answers
def _merge(word, pair):
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def recount_step(word_counts, pair_counts):
    """An independent right answer: merge every word, then count the pairs afresh (new dicts)."""
    pair = max(pair_counts.items(), key=lambda kv: (kv[1], kv[0]))[0]
    new_words = {_merge(w, pair): n for w, n in word_counts.items()}
    counts = Counter()
    for w, n in new_words.items():
        for p in zip(w, w[1:]):
            counts[p] += n
    return pair, new_words, counts


def in_place_step(word_counts, pair_counts):
    """Another: incremental, updating the given dicts in place (only the words with the pair) and returning them."""
    best = max(pair_counts.values())
    pair = max(p for p, c in pair_counts.items() if c == best)
    for word in [w for w in word_counts if any(q == pair for q in zip(w, w[1:]))]:
        n = word_counts.pop(word)
        new = _merge(word, pair)
        for p in zip(word, word[1:]):
            pair_counts[p] -= n
            if pair_counts[p] == 0:
                del pair_counts[p]
        for p in zip(new, new[1:]):
            pair_counts[p] = pair_counts.get(p, 0) + n
        word_counts[new] = word_counts.get(new, 0) + n
    return pair, word_counts, pair_counts


def neighbour_step(word_counts, pair_counts):
    """Another: a defaultdict of deltas from each merged occurrence's neighbours (labkit's train_bpe's way)."""
    pair = max(pair_counts, key=lambda p: (pair_counts[p], p))
    delta = defaultdict(int)
    words = {}
    for w, n in word_counts.items():
        new = _merge(w, pair)
        if new != w:
            for p in zip(w, w[1:]):
                delta[p] -= n
            for p in zip(new, new[1:]):
                delta[p] += n
        words[new] = n
    counts = dict(pair_counts)
    for p, d in delta.items():
        counts[p] = counts.get(p, 0) + d
        if counts[p] == 0:
            del counts[p]
    return pair, words, counts


@pytest.mark.parametrize("right", [recount_step, in_place_step, neighbour_step])
def test_bpe_merge_step_accepts_independent_solutions(right, capsys):
    checks.bpe_merge_step(right)
    labkit.checks.bpe_merge_step(right)  # and under refusal, whose grader's reference runs labkit's train_bpe
    assert capsys.readouterr().out.count("✓ bpe_merge_step:") == 2


# ----------------------------------------------------------------------------- bpe_merge_step: wrong answers
def _choose(rule):
    def step(word_counts, pair_counts):
        pair = rule(pair_counts)
        return (pair, *recount_step_with(word_counts, pair)[1:])
    return step


def recount_step_with(word_counts, pair):
    new_words = {_merge(w, pair): n for w, n in word_counts.items()}
    counts = Counter()
    for w, n in new_words.items():
        for p in zip(w, w[1:]):
            counts[p] += n
    return pair, new_words, dict(counts)


def _incremental(word_counts, pair_counts, weight=lambda n: n, decrement=True, add=True, drop_zero=True,
                 drop_pair=True, merge=_merge):
    pair = max(pair_counts, key=lambda p: (pair_counts[p], p))
    counts = dict(pair_counts)
    words = {}
    for w, n in word_counts.items():
        new = merge(w, pair)
        if new != w:
            if decrement:
                for p in zip(w, w[1:]):
                    if p != pair or drop_pair:
                        counts[p] = counts.get(p, 0) - weight(n)
            if add:
                for p in zip(new, new[1:]):
                    counts[p] = counts.get(p, 0) + weight(n)
            if not decrement and drop_pair:
                counts.pop(pair, None)
        words[new] = n
    if drop_zero:
        counts = {p: c for p, c in counts.items() if c != 0}
    return pair, words, counts


def merge_from_the_right(word, pair):
    out, i = [], len(word) - 1
    while i >= 0:
        if i >= 1 and (word[i - 1], word[i]) == pair:
            out.insert(0, pair[0] + pair[1])
            i -= 2
        else:
            out.insert(0, word[i])
            i -= 1
    return tuple(out)


def merge_overlapping(word, pair):  # i += 1 after a merge: (a, a, a) -> (aa, aa)
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(pair[0] + pair[1])
            i += 1
            if i == len(word) - 1:
                break
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def merge_first_only(word, pair):
    for i in range(len(word) - 1):
        if (word[i], word[i + 1]) == pair:
            return word[:i] + (pair[0] + pair[1],) + word[i + 2:]
    return word


def smallest_tie(word_counts, pair_counts):
    best = max(pair_counts.values())
    return recount_step_with(word_counts, min(p for p, c in pair_counts.items() if c == best))


def first_seen(word_counts, pair_counts):
    return recount_step_with(word_counts, max(pair_counts, key=pair_counts.get))


def last_seen(word_counts, pair_counts):
    best, chosen = 0, None
    for p, c in pair_counts.items():
        if c >= best:  # >= : a later pair of the same count wins
            best, chosen = c, p
    return recount_step_with(word_counts, chosen)


def by_joined_bytes(word_counts, pair_counts):
    return recount_step_with(word_counts, max(pair_counts, key=lambda p: (pair_counts[p], p[0] + p[1])))


def by_sorted_items(word_counts, pair_counts):  # sorted by (-count, pair): the smallest of the tied pairs
    return recount_step_with(word_counts, sorted(pair_counts.items(), key=lambda kv: (-kv[1], kv[0]))[0][0])


def least_frequent(word_counts, pair_counts):
    return recount_step_with(word_counts, min(pair_counts, key=lambda p: (pair_counts[p], p)))


def unweighted(word_counts, pair_counts):
    return _incremental(word_counts, pair_counts, weight=lambda n: 1)


def unweighted_recount(word_counts, pair_counts):
    pair, words, _ = recount_step(word_counts, pair_counts)
    return pair, words, dict(Counter(p for w in words for p in zip(w, w[1:])))


def not_decremented(word_counts, pair_counts):
    return _incremental(word_counts, pair_counts, decrement=False)


def not_added(word_counts, pair_counts):
    return _incremental(word_counts, pair_counts, add=False)


def keeps_zeros(word_counts, pair_counts):
    return _incremental(word_counts, pair_counts, drop_zero=False)


def keeps_the_merged_pair(word_counts, pair_counts):
    pair, words, counts = recount_step(word_counts, pair_counts)
    return pair, words, {**counts, pair: pair_counts[pair]}


def across_words(word_counts, pair_counts):
    pair, words, _ = recount_step(word_counts, pair_counts)
    flat = [(t, n) for w, n in words.items() for t in w]  # one token stream: pairs straddle the words
    counts = Counter()
    for (t1, n1), (t2, _) in zip(flat, flat[1:]):
        counts[(t1, t2)] += n1
    return pair, words, counts


def from_the_right(word_counts, pair_counts):
    return _incremental(word_counts, pair_counts, merge=merge_from_the_right)


def overlapping(word_counts, pair_counts):
    return _incremental(word_counts, pair_counts, merge=merge_overlapping)


def first_occurrence_only(word_counts, pair_counts):
    return _incremental(word_counts, pair_counts, merge=merge_first_only)


def only_changed_words(word_counts, pair_counts):
    pair, words, counts = recount_step(word_counts, pair_counts)
    return pair, {w: n for w, n in words.items() if w not in word_counts}, counts


def str_tokens(word_counts, pair_counts):
    pair, words, counts = recount_step(word_counts, pair_counts)
    return pair, {tuple(t.decode("latin-1") for t in w): n for w, n in words.items()}, counts


def pair_as_list(word_counts, pair_counts):
    pair, words, counts = recount_step(word_counts, pair_counts)
    return list(pair), words, counts


def forgets_return(word_counts, pair_counts):
    in_place_step(word_counts, pair_counts)


def joined_words(word_counts, pair_counts):
    pair, words, counts = recount_step(word_counts, pair_counts)
    return pair, {b"".join(w): n for w, n in words.items()}, counts


@pytest.mark.parametrize("wrong, hint", [
    (smallest_tie, "not the smallest"),
    (by_sorted_items, "not the smallest"),
    (first_seen, "not the first seen"),
    (last_seen, "not the last seen"),
    (by_joined_bytes, "not by their joined bytes"),
    (least_frequent, "take the most frequent pair"),
    (unweighted, "weight each pair by its word's count"),
    (unweighted_recount, "weight each pair by its word's count"),
    (not_decremented, "destroys"),
    (not_added, "creates"),
    (keeps_zeros, "drops to 0"),
    (keeps_the_merged_pair, "occurs nowhere after the merge"),
    (across_words, "never cross pre-token boundaries"),
    (from_the_right, "left to right.*scanned from the right"),
    (overlapping, r"left to right without overlap: after merging at i, go on at i \+ 2"),
    (first_occurrence_only, "not only the first"),
    (only_changed_words, "keep every word"),
    (str_tokens, "tokens stay bytes"),
    (joined_words, "each word stays a tuple"),
    (pair_as_list, r"a tuple \(bytes, bytes\)"),
    (forgets_return, "did you forget `return`"),
])
def test_bpe_merge_step_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.bpe_merge_step(wrong)


def test_bpe_merge_step_says_what_was_tried():
    with pytest.raises(CheckFailed) as info:
        checks.bpe_merge_step(smallest_tie)
    message = str(info.value)
    assert "the greatest pair seen first" in message and "(b'x', b'b') (count 2)" in message
    assert "got:      pair (b'a', b'b')" in message


_cache: dict = {}


def keeps_state(word_counts, pair_counts):  # caches results, and the cached dicts are changed by a later step
    key = (tuple(word_counts.items()), tuple(pair_counts.items()))
    if key in _cache:
        pair, words, counts = _cache[key]
        counts[(b"q", b"q")] = 1
        return pair, words, counts
    _cache[key] = recount_step(word_counts, pair_counts)
    return _cache[key][0], dict(_cache[key][1]), dict(_cache[key][2])


def test_bpe_merge_step_rejects_state_kept_between_calls():
    _cache.clear()
    with pytest.raises(CheckFailed, match="keep state between calls"):
        checks.bpe_merge_step(keeps_state)


# ----------------------------------------------------------------------------- bpe_encode
def rank_encode(pretoken, merges):
    """An independent right answer: GPT-2's bpe(), merging the lowest-ranked bigram everywhere until none is a merge."""
    ranks = {}
    for i, m in enumerate(merges):
        ranks.setdefault(m, i)
    word = [bytes([c]) for c in pretoken]
    while len(word) > 1:
        bigram = min(zip(word, word[1:]), key=lambda p: ranks.get(p, float("inf")))
        if bigram not in ranks:
            break
        first, second = bigram
        new, i = [], 0
        while i < len(word):
            try:
                j = word.index(first, i)
            except ValueError:
                new.extend(word[i:])
                break
            new.extend(word[i:j])
            i = j
            if i < len(word) - 1 and word[i + 1] == second:
                new.append(first + second)
                i += 2
            else:
                new.append(word[i])
                i += 1
        word = new
    return word


def heap_free_encode(pretoken, merges):
    """Another: positions of the present merges, recomputed after each merge."""
    rank = {m: len(merges) - i for i, m in reversed(list(enumerate(merges)))}  # larger = earlier
    parts = [pretoken[i : i + 1] for i in range(len(pretoken))]
    while True:
        candidates = [(rank[p], p) for p in set(zip(parts, parts[1:])) if p in rank]
        if not candidates:
            return parts
        _, pair = max(candidates)
        out, i = [], 0
        while i < len(parts):
            if parts[i : i + 2] == list(pair):
                out.append(pair[0] + pair[1])
                i += 2
            else:
                out.append(parts[i])
                i += 1
        parts = out


@pytest.mark.parametrize("right", [rank_encode, heap_free_encode])
def test_bpe_encode_accepts_independent_solutions(right, capsys):
    checks.bpe_encode(right)
    labkit.checks.bpe_encode(right)
    assert capsys.readouterr().out.count("✓ bpe_encode:") == 2


def _merge_all(parts, pair):
    return list(_merge(tuple(parts), pair))


def longest_match(pretoken, merges):
    vocab = {a + b for a, b in merges}
    out, i = [], 0
    while i < len(pretoken):
        j = max((j for j in range(i + 1, len(pretoken) + 1) if j == i + 1 or pretoken[i:j] in vocab))
        out.append(pretoken[i:j])
        i = j
    return out


def leftmost_first(pretoken, merges):
    parts = [pretoken[i : i + 1] for i in range(len(pretoken))]
    merged = True
    while merged:
        merged = False
        for i in range(len(parts) - 1):
            if (parts[i], parts[i + 1]) in merges:
                parts[i : i + 2] = [parts[i] + parts[i + 1]]
                merged = True
                break
    return parts


def latest_first(pretoken, merges):
    return rank_encode(pretoken, merges[::-1])


def one_merge(pretoken, merges):
    parts = [pretoken[i : i + 1] for i in range(len(pretoken))]
    present = [p for p in zip(parts, parts[1:]) if p in merges]
    return _merge_all(parts, min(present, key=merges.index)) if present else parts


def one_pass(pretoken, merges):
    parts = [pretoken[i : i + 1] for i in range(len(pretoken))]
    for pair in merges:
        parts = _merge_all(parts, pair)
    return parts


def one_pass_first_occurrence(pretoken, merges):
    parts = [pretoken[i : i + 1] for i in range(len(pretoken))]
    for pair in merges:
        for i in range(len(parts) - 1):
            if (parts[i], parts[i + 1]) == pair:
                parts[i : i + 2] = [pair[0] + pair[1]]
                break
    return parts


def first_occurrence_each_time(pretoken, merges):
    ranks = {m: i for i, m in enumerate(merges)}
    parts = [pretoken[i : i + 1] for i in range(len(pretoken))]
    while True:
        present = [(ranks[p], i) for i, p in enumerate(zip(parts, parts[1:])) if p in ranks]
        if not present:
            return parts
        _, i = min(present)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def characters(pretoken, merges):
    ranks = {m: i for i, m in enumerate(merges)}
    parts = [c.encode() for c in pretoken.decode("utf-8")]
    while len(parts) > 1:
        pair = min(zip(parts, parts[1:]), key=lambda p: ranks.get(p, float("inf")))
        if pair not in ranks:
            break
        parts = _merge_all(parts, pair)
    return parts


def int_tokens(pretoken, merges):
    return list(pretoken) if len(rank_encode(pretoken, merges)) == len(pretoken) else rank_encode(pretoken, merges)


def str_token_encode(pretoken, merges):
    return [t.decode("latin-1") for t in rank_encode(pretoken, merges)]


def empty_token(pretoken, merges):
    return rank_encode(pretoken, merges) or [b""]


def overlapping_encode(pretoken, merges):
    ranks = {m: i for i, m in enumerate(merges)}
    parts = [pretoken[i : i + 1] for i in range(len(pretoken))]
    while len(parts) > 1:
        pair = min(zip(parts, parts[1:]), key=lambda p: ranks.get(p, float("inf")))
        if pair not in ranks:
            break
        parts = list(merge_overlapping(tuple(parts), pair))
    return parts


@pytest.mark.parametrize("wrong, hint", [
    (longest_match, "longest vocabulary match"),
    (leftmost_first, "in the order they appear in the word"),
    (latest_first, "not the latest"),
    (one_merge, "not just once"),
    (one_pass, "one pass over merges in their order is not enough"),
    (one_pass_first_occurrence, "not only the first"),
    (first_occurrence_each_time, "before choosing the next pair"),
    (characters, "not characters"),
    (int_tokens, "indexing bytes gives an int"),
    (str_token_encode, "bytes, not str"),
    (empty_token, r"empty pre-token has no tokens: return \[\]"),
    (overlapping_encode, "join back to the pre-token"),
    (lambda pretoken, merges: None, "did you forget `return`"),
])
def test_bpe_encode_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.bpe_encode(wrong)


def test_bpe_encode_names_each_mistake_where_it_first_shows():
    # the hand-made cases come in an order where each mistake first differs from the rule on a case that tells it
    # from every mistake not yet ruled out (a hint never names a mistake an earlier passed case excluded)
    names = [name for name, _, _ in checks._encode_variants(b"ab", [])]
    for k, name in enumerate(names):
        ruled_out = set()
        for pretoken, merges, _ in checks._encode_cases():
            expected = checks._encode_reference(pretoken, merges)
            variants = checks._encode_variants(pretoken, merges)
            got = variants[k][1]
            if got is None or got == expected:
                ruled_out.update(n for n, t, _ in variants if t is not None and t != expected)
                continue
            assert next(n for n, t, _ in variants if t == got and n not in ruled_out) == name
            break
        else:
            pytest.fail(f"no case tells {name!r} from the rule")


# ----------------------------------------------------------------------------- minhash_signature
def python_ints(shingles, a, b):
    """An independent right answer: exact big-integer arithmetic in object arrays."""
    if len(shingles) == 0:
        return np.full(len(a), P, dtype=np.uint64)
    h = (a.astype(object)[None, :] * shingles.astype(object)[:, None] + b.astype(object)[None, :]) % P
    return h.min(axis=0).astype(np.uint64)


def split_halves(shingles, a, b):
    """Another: uint64 only, a split into 32-bit halves and folded with 2^61 = 1 (mod p)."""
    p = np.uint64(P)
    if len(shingles) == 0:
        return np.full(len(a), p, dtype=np.uint64)
    x = shingles.astype(np.uint64)[:, None]
    low = x * (a & np.uint64(0xFFFFFFFF))
    t = x * (a >> np.uint64(32))
    high = (t >> np.uint64(29)) + ((t & np.uint64((1 << 29) - 1)) << np.uint64(32))

    def fold(y):
        return (y & p) + (y >> np.uint64(61))

    y = fold(fold(low) + fold(high) + b)
    return np.where(y >= p, y - p, y).min(axis=0)


def per_hash_loop(shingles, a, b):
    """Another: a Python loop over the hash functions."""
    xs = [int(v) for v in shingles]
    return np.array([min(((int(ak) * v + int(bk)) % P for v in xs), default=P) for ak, bk in zip(a, b)], dtype=np.uint64)


@pytest.mark.parametrize("right", [python_ints, split_halves, per_hash_loop])
def test_minhash_signature_accepts_independent_solutions(right, capsys):
    checks.minhash_signature(right)
    labkit.checks.minhash_signature(right)
    assert capsys.readouterr().out.count("✓ minhash_signature:") == 2


def _empty_ok(fn):
    def wrapped(shingles, a, b):
        return np.full(len(a), P, dtype=np.uint64) if len(shingles) == 0 else fn(shingles, a, b)
    return wrapped


@_empty_ok
def wraps_uint64(shingles, a, b):
    return ((a[None, :] * shingles.astype(np.uint64)[:, None] + b[None, :]) % np.uint64(P)).min(axis=0)


@_empty_ok
def wraps_int64(shingles, a, b):
    x = shingles.astype(np.int64)[:, None]
    return ((a.astype(np.int64) * x + b.astype(np.int64)) % P).min(axis=0).astype(np.uint64)


@_empty_ok
def in_float64(shingles, a, b):
    x = shingles.astype(np.float64)[:, None]
    return np.mod(a.astype(np.float64) * x + b.astype(np.float64), float(P)).min(axis=0).astype(np.uint64)


@_empty_ok
def maximum(shingles, a, b):
    return ((a.astype(object) * shingles.astype(object)[:, None] + b.astype(object)) % P).max(axis=0).astype(np.uint64)


@_empty_ok
def mod_2_32(shingles, a, b):
    return ((a.astype(object) * shingles.astype(object)[:, None] + b.astype(object)) % (1 << 32)).min(axis=0).astype(np.uint64)


@_empty_ok
def mod_2_64(shingles, a, b):
    return (a[None, :] * shingles.astype(np.uint64)[:, None] + b[None, :]).min(axis=0)


@_empty_ok
def not_reduced(shingles, a, b):
    return ((a.astype(object)[:, None] * shingles.astype(object)[None, :] + b.astype(object)[:, None]) % P).astype(np.uint64)


def empty_raises(shingles, a, b):
    return python_ints(shingles, a, b) if len(shingles) else (a[:, None] * shingles[None, :]).min(axis=1)


def empty_zeros(shingles, a, b):
    return python_ints(shingles, a, b) if len(shingles) else np.zeros(len(a), dtype=np.uint64)


def object_dtype(shingles, a, b):
    return python_ints(shingles, a, b).astype(object)


def int64_dtype(shingles, a, b):
    return python_ints(shingles, a, b).astype(np.int64)


def as_list(shingles, a, b):
    return python_ints(shingles, a, b).tolist()


def mutates_input(shingles, a, b):
    shingles.sort()  # "sets are sorted anyway"
    return python_ints(shingles, a, b)


@_empty_ok
def forgets_b(shingles, a, b):
    return ((a.astype(object) * shingles.astype(object)[:, None]) % P).min(axis=0).astype(np.uint64)


@_empty_ok
def swaps_a_and_b(shingles, a, b):
    return python_ints(shingles, b, a)


@_empty_ok
def argmin(shingles, a, b):
    return ((a.astype(object) * shingles.astype(object)[:, None] + b.astype(object)) % P).argmin(axis=0).astype(np.uint64)


@pytest.mark.parametrize("wrong, hint", [
    (wraps_uint64, "93 bits.*Python ints"),
    (wraps_int64, "93 bits.*32-bit halves"),
    (in_float64, "float64"),
    (maximum, "not the maximum"),
    (mod_2_32, r"not modulo 2\^32"),
    (mod_2_64, r"not modulo 2\^64"),
    (not_reduced, "minimum over the shingles"),
    (empty_raises, "empty set has no minimum"),
    (empty_zeros, "empty set has no minimum"),
    (object_dtype, r"values are right: convert them with .astype\(np.uint64\)"),
    (int64_dtype, r"values are right: convert them with .astype\(np.uint64\)"),
    (as_list, "return a numpy array"),
    (mutates_input, "leave shingles, a and b unchanged"),
    (forgets_b, "add b"),
    (swaps_a_and_b, "swapped"),
    (argmin, "not the index"),
])
def test_minhash_signature_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.minhash_signature(wrong)


def test_minhash_overflow_changes_the_first_case():
    from labkit.datapipe import minhash_permutations, shingles

    x = shingles(checks._CORPUS)
    a, b = minhash_permutations(128, seed=0)
    assert (wraps_uint64(x, a, b) != python_ints(x, a, b)).mean() > 0.9
    assert (wraps_int64(x, a, b) != python_ints(x, a, b)).mean() > 0.9


# ----------------------------------------------------------------------------- through a handle (labkit.grade)
class _LocalTransport(_remote.Transport):
    def __init__(self, **namespace):
        self.namespace = namespace

    def exchange(self, request: bytes) -> bytes:
        return _remote.handle(request, self.namespace)


def _handle(fn, exercise):
    return _remote.Remote(_LocalTransport(fn=fn), "fn", exercise)


def test_bytes_do_not_cross_the_wire_by_themselves_but_the_harness_carries_them():
    class Mine:
        def __repr__(self):
            return "Mine()"

    result = ((b"s", b"t"), {(b"l", b"o", b"w"): 5}, Counter({(b"\xc3", b"\xa9"): 2}),
              np.array([P, 1 << 63], dtype=np.uint64), np.array([P], dtype=object), bytearray(b"x"), np.int64(3),
              [1.5, None, True, "s"], np.zeros((2, 3), dtype=np.complex64), Mine())
    plain = _remote.decode(_remote.encode(result))
    assert type(plain[0][0]).__name__ == "bytes" and isinstance(plain[0][0], _remote.Opaque)  # an inert stand-in
    handle = _remote.Remote(_LocalTransport(fn=lambda: result), "fn", "")
    wired = checks._call_wired(handle, "fn()")
    assert wired[:3] == result[:3] and type(wired[2]) is dict and wired[5] == bytearray(b"x")
    assert wired[3].dtype == np.uint64 and wired[3].tolist() == [P, 1 << 63]
    assert wired[4].dtype == object and wired[4].tolist() == [P]
    assert type(wired[6]) is np.int64 and wired[6] == 3 and wired[7] == [1.5, None, True, "s"]
    assert wired[8].shape == (2, 3) and wired[8].dtype == np.complex64  # shape and dtype only
    assert isinstance(wired[9], _remote.Opaque) and type(wired[9]).__name__ == "Mine" and repr(wired[9]) == "Mine()"


def _forged_harness(fn, *args):
    return '{"x": 1}'  # what the learner's process could send with the harness patched there


def test_a_result_that_is_not_the_harness_json_is_a_remote_failure(monkeypatch):
    monkeypatch.setattr(checks, "_on_wire", _forged_harness)
    with pytest.raises(_remote.RemoteFailure, match="unreadable result"):
        checks._call_wired(_remote.Remote(_LocalTransport(fn=lambda: 1), "fn", ""), "fn()")


@pytest.mark.parametrize("exercise, right", [
    ("bpe_merge_step", recount_step), ("bpe_merge_step", in_place_step),
    ("bpe_encode", rank_encode), ("minhash_signature", python_ints), ("minhash_signature", split_halves),
])
def test_right_answers_pass_through_a_handle(exercise, right, capsys):
    getattr(labkit.checks, exercise)(_handle(right, exercise))
    assert f"✓ {exercise}:" in capsys.readouterr().out


@pytest.mark.parametrize("exercise, wrong, hint", [
    ("bpe_merge_step", first_seen, "not the first seen"),
    ("bpe_merge_step", not_decremented, "destroys"),
    ("bpe_merge_step", str_tokens, "tokens stay bytes"),
    ("bpe_encode", longest_match, "longest vocabulary match"),
    ("bpe_encode", characters, "not characters"),
    ("bpe_encode", int_tokens, "indexing bytes gives an int"),
    ("minhash_signature", wraps_uint64, "93 bits"),
    ("minhash_signature", object_dtype, "values are right"),
    ("minhash_signature", mutates_input, "leave shingles, a and b unchanged"),
    ("minhash_signature", empty_raises, "empty set has no minimum"),
])
def test_graders_give_the_same_verdicts_through_a_handle(exercise, wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        getattr(labkit.checks, exercise)(_handle(wrong, exercise))


# ----------------------------------------------------------------------------- delegation refused
def _train_bpe_step(word_counts, pair_counts):
    import os
    import tempfile

    from labkit.tokenizer import train_bpe

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "words.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(" ".join(b"".join(w).decode("utf-8", "replace") for w in word_counts))
        train_bpe(path, 257, [])
    return recount_step(word_counts, pair_counts)


def _labkits_merge_loop(word_counts, pair_counts):
    from labkit.tokenizer import _merge

    _merge(Counter({b"".join(w).decode("latin-1"): n for w, n in word_counts.items()}), 257, [])
    return recount_step(word_counts, pair_counts)


def _tiktokens_trainer(word_counts, pair_counts):
    from tiktoken._educational import bpe_train

    bpe_train("low lower", 257, r"\S+", visualise=None)
    return recount_step(word_counts, pair_counts)


@pytest.mark.parametrize("answer, name", [
    (_train_bpe_step, "labkit.tokenizer.train_bpe"),
    (_labkits_merge_loop, "labkit.tokenizer._merge"),
    (_tiktokens_trainer, "tiktoken._educational.bpe_train"),
])
def test_bpe_merge_step_refuses_labkits_and_tiktokens_trainers(answer, name):
    with pytest.raises(DelegationRefused, match=rf"your code called {name}\n"):
        labkit.checks.bpe_merge_step(answer)


_prebuilt = {}


def _with_labkits_tokenizer(pretoken, merges):
    from labkit.tokenizer import Tokenizer

    vocab = {i: bytes([i]) for i in range(256)}
    for a, b in merges:
        vocab.setdefault(len(vocab), a + b)
    return [Tokenizer(vocab, merges).vocab[i] for i in Tokenizer(vocab, merges)._bpe(pretoken)]


def _with_a_tokenizer_built_before(pretoken, merges):
    tok = _prebuilt["tok"]  # e.g. built in an earlier cell, before the grader ran
    return [tok.vocab[i] for i in tok._bpe(pretoken)]


def _with_tiktoken(pretoken, merges):
    import tiktoken

    ranks = {bytes([i]): i for i in range(256)}
    for a, b in merges:
        ranks.setdefault(a + b, len(ranks))
    enc = tiktoken.Encoding("mine", pat_str=r"[\s\S]+", mergeable_ranks=ranks, special_tokens={})
    return [enc.decode_single_token_bytes(t) for t in enc.encode_ordinary(pretoken.decode("utf-8", "replace"))]


def _with_tiktokens_educational(pretoken, merges):
    from tiktoken._educational import bpe_encode

    ranks = {bytes([i]): i for i in range(256)}
    for a, b in merges:
        ranks.setdefault(a + b, len(ranks))
    inverse = {r: t for t, r in ranks.items()}
    return [inverse[i] for i in bpe_encode(ranks, pretoken, visualise=None)]


def _with_hugging_face(pretoken, merges):
    from tokenizers import Tokenizer, models

    vocab = {bytes([i]).decode("latin-1"): i for i in range(256)}
    for a, b in merges:
        vocab.setdefault((a + b).decode("latin-1"), len(vocab))
    model = models.BPE(vocab, [(a.decode("latin-1"), b.decode("latin-1")) for a, b in merges])
    return [t.value.encode("latin-1") for t in Tokenizer(model).encode(pretoken.decode("latin-1")).tokens]


def _with_hugging_faces_model(pretoken, merges):
    from tokenizers import models

    vocab = {bytes([i]).decode("latin-1"): i for i in range(256)}
    for a, b in merges:
        vocab.setdefault((a + b).decode("latin-1"), len(vocab))
    model = models.BPE(vocab, [(a.decode("latin-1"), b.decode("latin-1")) for a, b in merges])
    return [t.value.encode("latin-1") for t in model.tokenize(pretoken.decode("latin-1"))]


@pytest.mark.parametrize("answer, name", [
    (_with_labkits_tokenizer, "labkit.tokenizer.Tokenizer"),
    (_with_a_tokenizer_built_before, "labkit.tokenizer.Tokenizer._bpe"),
    (_with_tiktoken, "tiktoken.Encoding"),
    (_with_tiktokens_educational, "tiktoken._educational.bpe_encode"),
    (_with_hugging_face, "tokenizers.Tokenizer.encode"),
    (_with_hugging_faces_model, "tokenizers.models.Model.tokenize"),
])
def test_bpe_encode_refuses_labkits_and_third_party_encoders(answer, name):
    import tokenizers

    from labkit.tokenizer import Tokenizer

    _prebuilt["tok"] = Tokenizer({i: bytes([i]) for i in range(256)}, [])
    originals = (Tokenizer.__init__.__code__, Tokenizer._bpe.__code__, tokenizers.Tokenizer.encode,
                 tokenizers.models.Model.tokenize)
    with pytest.raises(DelegationRefused, match=rf"(?s)your code called {name}\n.*write it yourself"):
        labkit.checks.bpe_encode(answer)
    assert originals == (Tokenizer.__init__.__code__, Tokenizer._bpe.__code__, tokenizers.Tokenizer.encode,
                         tokenizers.models.Model.tokenize)
    assert _prebuilt["tok"]._bpe(b"ab") == (97, 98)  # and all of them work again afterwards


def _with_labkits_signature(shingles, a, b):
    from labkit.datapipe import minhash_signature

    return minhash_signature(shingles, num_perm=len(a))


def _with_labkits_signatures(shingles, a, b):
    from labkit.datapipe import minhash_signatures

    return minhash_signatures([shingles], num_perm=len(a))[0]


def _with_labkits_hash(shingles, a, b):
    from labkit.datapipe import _universal_hash

    return _universal_hash(shingles.astype(np.uint64)[:, None], a, b).min(axis=0)


def _with_datasketch(shingles, a, b):
    import datasketch

    m = datasketch.MinHash(num_perm=len(a), permutations=(a, b))
    return m.hashvalues


@pytest.mark.parametrize("answer, name", [
    (_with_labkits_signature, "labkit.datapipe.minhash_signature"),
    (_with_labkits_signatures, "labkit.datapipe.minhash_signatures"),
    (_with_labkits_hash, "labkit.datapipe._universal_hash"),
    (_with_datasketch, "datasketch.MinHash"),
])
def test_minhash_signature_refuses_labkits_and_datasketchs(answer, name):
    with pytest.raises(DelegationRefused, match=rf"your code called {name}\n"):
        labkit.checks.minhash_signature(answer)


@pytest.mark.parametrize("exercise, labkits", [
    ("bpe_merge_step", "labkit.tokenizer.train_bpe"),
    ("bpe_encode", "labkit.tokenizer.Tokenizer"),
    ("minhash_signature", "labkit.datapipe.minhash_signature"),
])
def test_labkits_answer_handed_in_itself_is_refused_here_and_through_a_handle(exercise, labkits):
    from labkit.checks._core import _resolve_dotted

    target = _resolve_dotted(labkits)[2]
    with pytest.raises(DelegationRefused, match=exercise):
        getattr(labkit.checks, exercise)(target)
    with pytest.raises(CheckFailed, match="write it yourself"):
        getattr(labkit.checks, exercise)(_handle(target, exercise))


def test_a_third_party_delegate_that_is_not_installed_is_skipped(monkeypatch, capsys):
    # tokenizers, tiktoken and datasketch are test extras, not dependencies: a learner's install may lack them
    monkeypatch.setitem(DELEGATES, "minhash_signature",
                        (*DELEGATES["minhash_signature"], "not_an_installed_package.MinHash", "datasketch.NoSuchClass"))
    labkit.checks.minhash_signature(python_ints)
    assert "✓ minhash_signature:" in capsys.readouterr().out
    with pytest.raises(DelegationRefused, match="datasketch.MinHash"):
        labkit.checks.minhash_signature(_with_datasketch)


def test_bpe_merge_steps_tie_cases_each_tell_one_rule_apart():
    # case 0 separates the smallest and the last seen, case 2 the first seen, case 3 the joined-bytes comparison
    cases = checks._step_cases()
    names = [name for name, _, _ in checks._tie_variants({(b"a", b"b"): 1})]
    for k, name in enumerate(names):
        ruled_out = set()
        for _, words, counts in cases:
            counts = checks._count_pairs(words) if counts is None else counts
            right = checks._best_pair(counts)
            variants = checks._tie_variants(counts)
            if variants[k][1] == right:
                ruled_out.update(n for n, p, _ in variants if p != right)
                continue
            assert checks._tie_hint(variants[k][1], counts, ruled_out) == variants[k][2], name
            break
        else:
            pytest.fail(f"no case tells {name!r} from the rule")
