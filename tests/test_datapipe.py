"""labkit.datapipe (chapter 11's data pipeline): cleaning, exact and MinHash/LSH deduplication
(checked against exact big-integer arithmetic, the estimator's theory, and datasketch), packing
token ids into a memmap (round trip through the tokenizer), and the resumable data loader."""
from __future__ import annotations

import inspect
import itertools
import pickle
import random
import string
import time

import datasketch
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit import datapipe as dp
from labkit.data import get_batch
from labkit.datapipe import Document
from labkit.tokenizer import Tokenizer, train_bpe

EOT = "<|endoftext|>"
P = (1 << 61) - 1
# datasketch 2.0 needs the scheme of given hash values named; "legacy" stores them as uint64
# without a range check (labkit's are 61-bit). Before 2.0 legacy was the only scheme.
DS_SCHEME = {"scheme": "legacy"} if "scheme" in inspect.signature(datasketch.MinHash).parameters else {}


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus() -> list[Document]:
    return dp.corpus_documents()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    """A small BPE trained on the help topics, with the end-of-text special token."""
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("bpe") / "train.txt"
    path.write_text(EOT.join(topics[k] for k in sorted(topics))[:60_000], encoding="utf-8")
    vocab, merges = train_bpe(path, 400, [EOT])
    return Tokenizer(vocab, merges, [EOT])


def random_words(rng: random.Random, n: int, vocab: int = 3000) -> list[str]:
    return ["w" + "".join(rng.choice(string.ascii_lowercase) for _ in range(3)) + str(rng.randrange(vocab)) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------


def test_corpus_is_real_and_sorted_by_source(corpus):
    from pydoc_data.topics import topics

    sources = [d.source for d in corpus]
    assert sources == sorted(sources)
    help_docs = {d.source.removeprefix("pydoc:"): d.text for d in corpus if d.source.startswith("pydoc:")}
    assert help_docs == dict(topics)
    licences = [d for d in corpus if d.source.startswith("license:")]
    assert licences, "every test environment installs packages that ship licence files"
    # MIT's wording is in many of them: the duplication deduplication is for
    assert sum("Permission is hereby granted" in d.text for d in licences) >= 2
    assert not any(d.source.endswith((".py", ".pyc")) for d in licences)
    assert dp.corpus_documents(licenses=False) == [d for d in corpus if d.source.startswith("pydoc:")]
    with pytest.raises(TypeError, match="topics"):
        dp.corpus_documents(topics="yes")


def test_document_checks_types():
    with pytest.raises(TypeError, match="text"):
        Document("a", b"bytes")
    with pytest.raises(TypeError, match="source"):
        Document(3, "text")


# ---------------------------------------------------------------------------------------------
# Normalisation and filters
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, form, expected",
    [
        ("cafe\u0301", "NFC", "café"),
        ("\ufb01le", "NFKC", "file"),  # ligature folded
        ("\ufb01le", "NFC", "\ufb01le"),  # NFC keeps compatibility characters
        ("\uff21\uff22 x\u00a0y", "NFKC", "AB x y"),  # full-width letters, no-break space
        ("a \t  b   \r\nc\rd", "NFKC", "a b\nc\nd"),
        ("\n\n  \nx\n\n\n\n\ny  \n\n", "NFKC", "x\n\ny"),
        ("def f():\n    return  1\n", "NFKC", "def f():\n    return 1"),  # indentation kept
        ("\ufeffBOM\x00 and\x07 bell", "NFKC", "BOM and bell"),
        ("   \n\t \u2028 ", "NFKC", ""),
        ("", "NFKC", ""),
        ("日本語　テキスト 🙂👍🏽", "NFKC", "日本語 テキスト 🙂👍🏽"),  # ideographic space is a compatibility space
    ],
)
def test_normalize_examples(raw, form, expected):
    assert dp.normalize(raw, form) == expected


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ae \t\n\r\x00\ufeff\u00a0\u0301\u0308\ufb01\uff21\u2028Åﬀ。日x")), max_size=40))
def test_normalize_is_a_fixed_point(text):
    once = dp.normalize(text)
    assert dp.normalize(once) == once
    assert once == once.strip("\n") and "\n\n\n" not in once and "\r" not in once


def test_normalize_rejects_bad_arguments():
    with pytest.raises(TypeError, match="text"):
        dp.normalize(b"bytes")
    with pytest.raises(ValueError, match="form"):
        dp.normalize("x", form="NFD")


def test_filters_say_why():
    assert dp.LengthFilter(min_chars=5)("abcdefg") is None
    assert "min_chars=5" in dp.LengthFilter(min_chars=5)("abc")
    assert "max_chars=4" in dp.LengthFilter(min_chars=0, max_chars=4)("abcdefg")
    assert dp.AlphaFilter(0.6)("Ordinary English words.") is None
    assert dp.AlphaFilter(0.6)("日本語のテキストです") is None  # letters of any script
    assert "letter ratio" in dp.AlphaFilter(0.6)("1234 5678 = 0x1f; 9.9 // 12")
    assert dp.AlphaFilter(0.6)(" \n ") == "no visible characters"
    repeated = "\n".join(["click here"] * 5 + ["one line", "another"])
    assert "repeats" in dp.RepetitionFilter(0.3)(repeated)
    assert dp.RepetitionFilter(0.3)("a\nb\nc\na") is None  # 1 of 4 lines repeats: 0.25
    assert dp.RepetitionFilter(0.3)("") is None


def test_filters_reject_bad_arguments():
    with pytest.raises(ValueError, match="min_chars"):
        dp.LengthFilter(min_chars=-1)
    with pytest.raises(ValueError, match="max_chars"):
        dp.LengthFilter(min_chars=10, max_chars=5)
    with pytest.raises(TypeError, match="min_chars"):
        dp.LengthFilter(min_chars=2.5)
    with pytest.raises(ValueError, match="min_ratio"):
        dp.AlphaFilter(1.5)
    with pytest.raises(TypeError, match="min_ratio"):
        dp.AlphaFilter("high")
    with pytest.raises(ValueError, match="max_duplicate_lines"):
        dp.RepetitionFilter(-0.1)


def test_clean_counts_what_each_filter_removed():
    good = "The quick brown fox jumps over the lazy dog, then rests in the warm sun."
    docs = [
        Document("empty", ""),
        Document("blank", "  \n\t\n "),
        Document("short", "tiny"),
        Document("digits", "3.14159 2.71828 1.41421 1.73205 2.23606 0.57721 1.61803 4.66920"),
        Document("spam", "\n".join(["Buy now!"] * 6 + ["Some other text here."])),
        Document("good", good + "\r\n\r\n\r\n  "),
        Document("unicode", "Grüße aus Köln: naïve façade, café crème und ein schönes Frühstück."),
        "A plain string document, long enough to pass every one of the filters.",
    ]
    filters = [dp.LengthFilter(min_chars=20), dp.AlphaFilter(0.6), dp.RepetitionFilter(0.3)]
    result = dp.clean(docs, filters)
    report = result.report
    assert report.documents == 8 and report.kept == 3
    assert report.removed == {"length": 3, "alpha": 1, "repetition": 1}
    assert sum(report.removed.values()) == report.documents - report.kept
    assert [r[:2] for r in report.rejections] == [
        ("empty", "length"), ("blank", "length"), ("short", "length"), ("digits", "alpha"), ("spam", "repetition")
    ]
    assert [d.source for d in result.kept] == ["good", "unicode", "doc7"]
    assert result.kept[0].text == good  # normalised: trailing blank lines gone

    def no_fox(text):
        return "mentions a fox" if "fox" in text else None

    assert dp.clean(docs, [*filters, no_fox]).report.removed["no_fox"] == 1
    assert dp.clean(docs).report.documents == 8  # default filters
    with pytest.raises(ValueError, match="repeat"):
        dp.clean(docs, [dp.LengthFilter(), dp.LengthFilter(5)])
    with pytest.raises(TypeError, match="filters"):
        dp.clean(docs, ["not callable"])
    with pytest.raises(TypeError, match="documents"):
        dp.clean("one string")
    with pytest.raises(TypeError, match=r"documents\[1\]"):
        dp.clean(["ok", 42])


# ---------------------------------------------------------------------------------------------
# Exact deduplication
# ---------------------------------------------------------------------------------------------


def test_exact_dedup_keeps_first_occurrence():
    a = "MIT License (café edition)\n\nPermission is hereby granted, free of charge."
    b = "BSD 3-Clause License\n\nRedistribution and use in source and binary forms."
    docs = [a, a.replace("\n", "\r\n") + "  \n", b, a.replace("é", "e\u0301"), b, "other"]
    result = dp.exact_dedup(docs)
    assert [d.source for d in result.kept] == ["doc0", "doc2", "doc5"]
    assert result.duplicates == [(1, 0), (3, 0), (4, 2)]
    assert result.removed == 3
    assert dp.text_hash("café") == dp.text_hash("cafe\u0301") != dp.text_hash("cafe")
    assert len(dp.text_hash("x")) == 16


def test_exact_dedup_matches_a_naive_dict_on_random_documents():
    rng = random.Random(0)
    pool = ["".join(rng.choice("ab \n") for _ in range(rng.randint(0, 8))) for _ in range(15)]
    docs = [rng.choice(pool) for _ in range(200)]
    first: dict[str, int] = {}
    expected = []
    for i, text in enumerate(docs):
        key = dp.normalize(text)
        if key in first:
            expected.append((i, first[key]))
        else:
            first[key] = i
    result = dp.exact_dedup(docs)
    assert result.duplicates == expected
    assert [d.source for d in result.kept] == [f"doc{i}" for i in sorted(first.values())]


def test_corpus_pipeline_finds_exact_and_near_duplicates(corpus):
    kept, report = dp.prepare_documents(corpus)
    assert report.documents == len(corpus)
    assert report.documents - sum(report.cleaned.removed.values()) - report.exact_removed - report.near_removed == report.kept == len(kept)
    # licence copies: identical files in several packages, and MIT texts differing in the copyright line
    assert report.exact_removed >= 1 and report.near_removed >= 1
    for cluster in report.near.clusters:
        assert cluster == sorted(cluster) and len(cluster) >= 2


# ---------------------------------------------------------------------------------------------
# Shingles and MinHash
# ---------------------------------------------------------------------------------------------


def test_shingles_ignore_case_punctuation_and_wrapping_but_not_order():
    a = dp.shingles("Permission is hereby granted, free of charge, to any person")
    assert np.array_equal(a, dp.shingles("permission IS hereby\ngranted free of   charge to any person!"))
    assert not np.array_equal(a, dp.shingles("is permission hereby granted free of charge to any person"))
    assert a.dtype == np.uint32 and np.all(np.diff(a.astype(np.int64)) > 0)  # sorted, unique
    assert len(a) == 10 - 5 + 1
    assert len(dp.shingles("only three words", n=5)) == 1  # shorter than n: one shingle
    assert len(dp.shingles("")) == 0 and len(dp.shingles(" \n\t ")) == 0 and len(dp.shingles("!!! ...")) == 0
    assert len(dp.shingles("naïve café 日本語 テキスト", n=2)) == 3
    with pytest.raises(ValueError, match="n="):
        dp.shingles("x", n=0)
    with pytest.raises(TypeError, match="text"):
        dp.shingles(123)


def test_shingle_count_is_the_number_of_distinct_ngrams():
    rng = random.Random(1)
    for n in (1, 2, 3, 5):
        words = [rng.choice(["a", "b", "c", "d"]) for _ in range(200)]
        distinct = {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}
        assert len(dp.shingles(" ".join(words), n)) == len(distinct)


def test_minhash_equals_exact_big_integer_arithmetic():
    rng = random.Random(2)
    values = [0, 1, 2**32 - 1, *(rng.randrange(2**32) for _ in range(1500))]  # more than one block of rows
    a, b = dp.minhash_permutations(64, seed=5)
    assert np.all((a >= 1) & (a < P)) and np.all(b < P)
    expected = [min((int(ak) * x + int(bk)) % P for x in values) for ak, bk in zip(a, b)]
    assert dp.minhash_signature(np.array(values, dtype=np.uint64), 64, seed=5).tolist() == expected
    assert dp.minhash_signature(values, 64, seed=5).tolist() == expected  # a list of ints
    assert dp.minhash_signature(values + values[:10], 64, seed=5).tolist() == expected  # repeats change nothing


def test_minhash_batch_equals_one_at_a_time_and_is_deterministic():
    rng = np.random.default_rng(3)
    sets = [rng.integers(0, 2**32, size=k, dtype=np.uint64) for k in (5, 0, 700, 1, 300)]
    sigs = dp.minhash_signatures(sets, num_perm=32, seed=7)
    assert sigs.shape == (5, 32) and sigs.dtype == np.uint64
    for s, sig in zip(sets, sigs):
        assert np.array_equal(dp.minhash_signature(s, 32, seed=7), sig)
    assert np.array_equal(sigs, dp.minhash_signatures(sets, num_perm=32, seed=7))
    assert not np.array_equal(sigs, dp.minhash_signatures(sets, num_perm=32, seed=8))
    assert np.all(sigs[1] == P)  # the empty set
    assert dp.jaccard_estimate(sigs[1], sigs[1]) == 1.0 and dp.jaccard_estimate(sigs[0], sigs[1]) == 0.0
    words = ["alpha", "beta", b"gamma"]
    assert np.array_equal(dp.minhash_signature(words), dp.minhash_signature([dp.hash32(w) for w in words]))
    assert dp.minhash_signatures([]).shape == (0, 128)


def test_minhash_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_perm"):
        dp.minhash_signature([1], num_perm=0)
    with pytest.raises(TypeError, match="num_perm"):
        dp.minhash_signature([1], num_perm=2.0)
    with pytest.raises(ValueError, match="seed"):
        dp.minhash_signature([1], seed=-1)
    with pytest.raises(ValueError, match=r"2\^32"):
        dp.minhash_signature([2**32])
    with pytest.raises(ValueError, match=r"2\^32"):
        dp.minhash_signature(np.array([-1]))
    with pytest.raises(TypeError, match="shingles"):
        dp.minhash_signature(["a", 1])
    with pytest.raises(TypeError, match="shingle_sets"):
        dp.minhash_signatures(np.zeros((2, 3), np.uint32))
    with pytest.raises(TypeError, match=r"shingle_sets\[0\]"):
        dp.minhash_signatures([np.zeros((2, 3), np.uint32)])
    with pytest.raises(ValueError, match="sig_a"):
        dp.jaccard_estimate(np.zeros(3), np.zeros(4))


def set_pair(rng: random.Random, union: int, common: int) -> tuple[set[int], set[int]]:
    """Two sets of random 32-bit values with |A ∪ B| = union and |A ∩ B| = common."""
    values = rng.sample(range(2**32), union)
    only_a = (union - common) // 2
    return set(values[: common + only_a]), set(values[:common]) | set(values[common + only_a :])


def test_jaccard_estimates_of_labkit_and_datasketch_are_within_the_estimators_error():
    rng = random.Random(4)
    num_perm = 256
    z_labkit, z_datasketch = [], []
    for trial in range(60):
        union = rng.randint(50, 400)
        a, b = set_pair(rng, union, rng.randint(0, union))
        true = dp.jaccard(a, b)
        assert true == len(a & b) / len(a | b)
        ours = dp.jaccard_estimate(dp.minhash_signature(list(a), num_perm, trial), dp.minhash_signature(list(b), num_perm, trial))
        theirs = []
        for s in (a, b):
            m = datasketch.MinHash(num_perm=num_perm, seed=trial)
            m.update_batch([x.to_bytes(4, "little") for x in s])
            theirs.append(m)
        theirs = theirs[0].jaccard(theirs[1])
        sigma = (true * (1 - true) / num_perm) ** 0.5
        for estimate, zs in ((ours, z_labkit), (theirs, z_datasketch)):
            assert abs(estimate - true) <= 4.5 * sigma + 1e-9, (trial, true, estimate)
            if sigma:
                zs.append(((estimate - true) / sigma) ** 2)
    # the spread matches the theory, sqrt(J (1 - J) / num_perm): mean z^2 of 60 pairs is 1 +- 0.18
    assert 0.5 < np.mean(z_labkit) < 1.6 and 0.5 < np.mean(z_datasketch) < 1.6


def test_exact_jaccard():
    assert dp.jaccard(set(), set()) == 1.0
    assert dp.jaccard({1, 2}, {2, 3}) == pytest.approx(1 / 3)
    assert dp.jaccard(np.array([1, 2, 2, 3]), np.array([3, 4])) == pytest.approx(1 / 4)
    assert dp._sorted_jaccard(np.array([1, 5, 9]), np.array([0, 5, 9, 12])) == pytest.approx(2 / 5)
    assert dp._sorted_jaccard(np.array([], np.uint32), np.array([1], np.uint32)) == 0.0


# ---------------------------------------------------------------------------------------------
# LSH
# ---------------------------------------------------------------------------------------------


def clustered_signatures(seed: int, n: int = 60, num_perm: int = 32) -> np.ndarray:
    """Signatures in a few families, each member a copy of its family's with some entries
    replaced: many band collisions, partial ones too (where the test's interest is)."""
    rng = np.random.default_rng(seed)
    families = rng.integers(0, P, size=(6, num_perm), dtype=np.uint64)
    sigs = families[rng.integers(0, 6, size=n)].copy()
    replace = rng.random((n, num_perm)) < 0.15
    sigs[replace] = rng.integers(0, P, size=int(replace.sum()), dtype=np.uint64)
    return sigs


def naive_candidates(sigs: np.ndarray, bands: int, rows: int) -> set[tuple[int, int]]:
    pairs = set()
    for band in range(bands):
        buckets: dict[tuple, list[int]] = {}
        for i, sig in enumerate(sigs):
            buckets.setdefault(tuple(sig[band * rows : (band + 1) * rows].tolist()), []).append(i)
        for members in buckets.values():
            pairs.update(itertools.combinations(members, 2))
    return pairs


@pytest.mark.parametrize("bands, rows", [(2, 16), (4, 8), (8, 4), (16, 2), (5, 6), (32, 1)])
def test_lsh_candidates_equal_datasketch_minhashlsh(bands, rows):
    sigs = clustered_signatures(bands * 100 + rows)
    ours = dp.lsh_candidates(sigs, bands, rows)
    assert ours.dtype == np.int64 and ours.shape[1] == 2
    assert np.all(ours[:, 0] < ours[:, 1])
    ours_set = set(map(tuple, ours.tolist()))
    assert len(ours_set) == len(ours) and ours.tolist() == sorted(ours.tolist())

    lsh = datasketch.MinHashLSH(threshold=0.5, num_perm=sigs.shape[1], params=(bands, rows))
    minhashes = [datasketch.MinHash(num_perm=sigs.shape[1], hashvalues=sig, **DS_SCHEME) for sig in sigs]
    for i, m in enumerate(minhashes):
        lsh.insert(i, m)
    theirs = {(min(i, j), max(i, j)) for i, m in enumerate(minhashes) for j in lsh.query(m) if j != i}
    assert ours_set == theirs == naive_candidates(sigs, bands, rows)
    assert 0 < len(ours_set) < len(sigs) * (len(sigs) - 1) // 2  # neither nothing nor everything


def test_lsh_candidates_edge_cases_and_bad_arguments():
    sigs = clustered_signatures(9)
    assert set(map(tuple, dp.lsh_candidates(sigs, 1, 8).tolist())) == naive_candidates(sigs, 1, 8)  # one band
    assert dp.lsh_candidates(sigs[:1], 4, 8).shape == (0, 2)
    assert dp.lsh_candidates(np.zeros((0, 8), np.uint64), 2, 4).shape == (0, 2)
    same = np.tile(sigs[:1], (4, 1))
    assert dp.lsh_candidates(same, 2, 4).tolist() == [list(p) for p in itertools.combinations(range(4), 2)]
    with pytest.raises(ValueError, match="exceeds num_perm"):
        dp.lsh_candidates(sigs, 5, 7)
    with pytest.raises(ValueError, match="bands"):
        dp.lsh_candidates(sigs, 0, 4)
    with pytest.raises(ValueError, match="signatures"):
        dp.lsh_candidates(sigs[0], 2, 4)


def test_candidate_probability_matches_simulation():
    """1 - (1 - s^r)^b, checked end to end: real MinHash signatures of set pairs with Jaccard
    exactly s, through lsh_candidates, counted."""
    bands, rows, trials = 8, 4, 1200
    rng = random.Random(6)
    for s in (0.3, 0.5, 0.7, 0.9):
        common = round(50 * s)  # |A ∪ B| = 50, so J is exactly s
        sets = [x for _ in range(trials) for x in set_pair(rng, 50, common)]
        sigs = dp.minhash_signatures([np.array(sorted(x), np.uint64) for x in sets], bands * rows, seed=11)
        pairs = set(map(tuple, dp.lsh_candidates(sigs, bands, rows).tolist()))
        found = sum((2 * k, 2 * k + 1) in pairs for k in range(trials)) / trials
        expected = dp.candidate_probability(s, bands, rows)
        assert expected == pytest.approx(1 - (1 - s**rows) ** bands)
        sigma = (expected * (1 - expected) / trials) ** 0.5
        assert abs(found - expected) <= 4 * sigma + 0.01, (s, found, expected)
    curve = dp.candidate_probability(np.linspace(0, 1, 11), bands, rows)
    assert curve[0] == 0 and curve[-1] == 1 and np.all(np.diff(curve) > 0)
    with pytest.raises(ValueError, match="s="):
        dp.candidate_probability(1.5, 2, 2)


def test_choose_bands_is_the_most_selective_split_with_enough_recall():
    for threshold, num_perm in [(0.8, 128), (0.5, 64), (0.9, 256), (0.7, 100)]:
        bands, rows = dp.choose_bands(threshold, num_perm)
        assert bands * rows <= num_perm
        assert dp.candidate_probability(threshold, bands, rows) >= 0.99
        bigger = rows + 1
        assert num_perm // bigger == 0 or dp.candidate_probability(threshold, num_perm // bigger, bigger) < 0.99
    with pytest.raises(ValueError, match="threshold"):
        dp.choose_bands(0.0)


# ---------------------------------------------------------------------------------------------
# Near duplicates
# ---------------------------------------------------------------------------------------------


def planted_near_duplicates(seed: int, groups: int = 20, copies: int = 3, words: int = 300):
    """Documents in groups: an original and copies with 1% of words replaced (Jaccard of 5-gram
    shingles about 0.9), plus unrelated documents, shuffled."""
    rng = random.Random(seed)
    docs, group_of = [], []
    for g in range(groups + 10):
        base = random_words(rng, words)
        members = [base] if g >= groups else [base] + [list(base) for _ in range(copies)]
        for variant in members[1:]:
            for i in rng.sample(range(words), words // 100):
                variant[i] = "changed" + str(rng.randrange(10**6))
        for m in members:
            docs.append(" ".join(m))
            group_of.append(g)
    order = list(range(len(docs)))
    rng.shuffle(order)
    return [docs[i] for i in order], [group_of[i] for i in order]


def test_near_duplicates_finds_planted_clusters():
    docs, group_of = planted_near_duplicates(7)
    docs = docs + ["", "   \n "]  # no words: never near duplicates
    result = dp.near_duplicates(docs, threshold=0.8)
    expected = {}
    for i, g in enumerate(group_of):
        expected.setdefault(g, []).append(i)
    assert result.clusters == sorted((m for m in expected.values() if len(m) > 1), key=lambda m: m[0])
    assert len(result.kept) == len(docs) - 20 * 3 and result.removed == sorted(i for c in result.clusters for i in c[1:])
    assert [d.text for d in result.kept][-2:] == ["", "   \n "]
    for i, j, similarity in result.pairs:
        assert similarity >= 0.8
        assert similarity == pytest.approx(dp.jaccard(dp.shingles(docs[i]), dp.shingles(docs[j])))
    assert result.candidates >= len(result.pairs)
    assert (result.bands, result.rows) == dp.choose_bands(0.8, 128)
    again = dp.near_duplicates(docs, threshold=0.8)
    assert again.clusters == result.clusters and again.pairs == result.pairs
    assert dp.near_duplicates(docs, threshold=0.97).clusters == []  # the copies are ~0.9 similar


def test_near_duplicate_clusters_are_transitive():
    rng = random.Random(8)
    w = random_words(rng, 130)
    a, b, c = (" ".join(w[k : k + 100]) for k in (0, 5, 10))  # sliding windows: A ~ B ~ C
    ja_b = dp.jaccard(dp.shingles(a), dp.shingles(b))
    ja_c = dp.jaccard(dp.shingles(a), dp.shingles(c))
    assert ja_c < 0.85 < ja_b
    result = dp.near_duplicates([a, "unrelated words here, " * 3, c, b], threshold=0.85)
    assert result.clusters == [[0, 2, 3]]
    assert [d.source for d in result.kept] == ["doc0", "doc1"]


def test_near_duplicates_rejects_bad_arguments():
    with pytest.raises(ValueError, match="threshold"):
        dp.near_duplicates(["a"], threshold=0)
    with pytest.raises(ValueError, match="threshold"):
        dp.near_duplicates(["a"], threshold=1.2)
    with pytest.raises(ValueError, match="both or neither"):
        dp.near_duplicates(["a"], bands=4)
    with pytest.raises(ValueError, match="exceeds num_perm"):
        dp.near_duplicates(["a"], num_perm=16, bands=4, rows=5)
    with pytest.raises(ValueError, match="ngram"):
        dp.near_duplicates(["a"], ngram=0)


def test_minhash_of_thousands_of_documents_takes_well_under_a_second():
    rng = np.random.default_rng(10)
    sets = [rng.integers(0, 2**32, size=60, dtype=np.uint64).astype(np.uint32) for _ in range(3000)]
    start = time.perf_counter()
    sigs = dp.minhash_signatures(sets, num_perm=128)
    dp.lsh_candidates(sigs, *dp.choose_bands(0.8, 128))
    seconds = time.perf_counter() - start
    # ~0.15 s measured on a loaded 2-core machine; the bound leaves room for a slower one
    assert seconds < 2.0, seconds


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------


def test_token_dtype_boundary():
    assert dp.token_dtype(1) == np.uint16
    assert dp.token_dtype(50257) == np.uint16  # GPT-2
    assert dp.token_dtype(65536) == np.uint16  # every id <= 65535
    assert dp.token_dtype(65537) == np.uint32  # id 65536 needs 17 bits
    assert dp.token_dtype(128256) == np.uint32  # Llama 3
    assert dp.token_dtype(2**32) == np.uint32
    with pytest.raises(ValueError, match="vocab_size"):
        dp.token_dtype(2**32 + 1)
    with pytest.raises(ValueError, match="vocab_size"):
        dp.token_dtype(0)
    with pytest.raises(TypeError, match="vocab_size"):
        dp.token_dtype(True)


PACK_DOCS = [
    "Hello, world! It's a test: don't panic.\n\n  Indented line\twith tab.",
    "",
    "   \n",
    "Grüße aus Köln, café crème — 25°C, ½ price…",
    "日本語のテキストと中文文本，还有한국어.",
    "Emoji: 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "x",
]


def test_pack_round_trips_through_the_tokenizer(tokenizer, tmp_path):
    path = tmp_path / "train.bin"
    eot = tokenizer.encode(EOT)[0]
    report = dp.pack([Document(f"d{i}", t) for i, t in enumerate(PACK_DOCS)], tokenizer, path)
    packed = dp.PackedTokens(path)
    expected = [i for t in PACK_DOCS for i in (*tokenizer.encode(t), eot)]
    assert packed.tokens.tolist() == expected
    assert report.tokens == len(packed) == len(expected) and report.documents == packed.num_documents == len(PACK_DOCS)
    assert report.dtype == "uint16" == packed.dtype.name and packed.eot_id == eot
    assert report.bytes_on_disk == path.stat().st_size == 2 * len(expected)
    assert report.tokens_per_second > 0 and report.workers == 1
    assert [tokenizer.decode(d) for d in packed.documents()] == PACK_DOCS
    assert tokenizer.decode(packed.tokens).split(EOT) == [*PACK_DOCS, ""]
    assert isinstance(dp.read_tokens(path), np.memmap)
    with pytest.raises(ValueError, match="read-only"):
        dp.read_tokens(path)[0] = 1
    assert not list(tmp_path.glob("*.part"))


def test_pack_in_worker_processes_writes_the_same_file(tokenizer, tmp_path, monkeypatch):
    rng = random.Random(12)
    docs = [" ".join(random_words(rng, rng.randint(0, 40))) for _ in range(60)] + PACK_DOCS
    dp.pack(docs, tokenizer, tmp_path / "one.bin", workers=1)
    monkeypatch.setattr(dp, "_CHUNK_CHARS", 500)  # many chunks, so their order matters
    report = dp.pack(iter(docs), tokenizer, tmp_path / "two.bin", workers=2, min_parallel_chars=0)
    assert report.workers == 2 and report.documents == len(docs)
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes()


def test_pack_uses_uint32_when_ids_need_it(tmp_path):
    vocab = {i: bytes([i]) for i in range(256)} | {70_000: EOT.encode()}
    tok = Tokenizer(vocab, [], [EOT])
    report = dp.pack(["ab", "c"], tok, tmp_path / "wide.bin")
    assert report.dtype == "uint32" and report.bytes_on_disk == 4 * 5
    assert dp.read_tokens(tmp_path / "wide.bin").tolist() == [97, 98, 70_000, 99, 70_000]


def test_pack_rejects_bad_arguments(tokenizer, tmp_path):
    path = tmp_path / "x.bin"
    with pytest.raises(TypeError, match="tokenizer"):
        dp.pack(["a"], "gpt2", path)
    with pytest.raises(ValueError, match="does not exist"):
        dp.pack(["a"], tokenizer, tmp_path / "missing" / "x.bin")
    with pytest.raises(ValueError, match="eot_id"):
        dp.pack(["a"], tokenizer, path, eot_id=10**6)
    with pytest.raises(ValueError, match="eot_id"):
        dp.pack(["a"], Tokenizer({i: bytes([i]) for i in range(256)}, []), path)
    with pytest.raises(ValueError, match="workers"):
        dp.pack(["a"], tokenizer, path, workers=0)
    with pytest.raises(TypeError, match="documents"):
        dp.pack("a string", tokenizer, path)
    with pytest.raises(TypeError, match=r"documents\[1\]"):
        dp.pack(["a", 3], tokenizer, path)
    with pytest.raises(ValueError, match="empty"):
        dp.pack([], tokenizer, path)
    with pytest.raises(ValueError, match="end-of-text"):
        dp.pack(["fine", f"one{EOT}two"], tokenizer, path)
    assert not list(tmp_path.iterdir())  # nothing left behind
    with pytest.raises(ValueError, match="written by pack"):
        dp.PackedTokens(path)


def test_packed_file_with_wrong_size_is_refused(tokenizer, tmp_path):
    path = tmp_path / "t.bin"
    dp.pack(["abc def"], tokenizer, path)
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(ValueError, match="metadata"):
        dp.PackedTokens(path)


@pytest.fixture
def packed(tokenizer, tmp_path):
    from pydoc_data.topics import topics

    path = tmp_path / "topics.bin"
    dp.pack([topics[k] for k in sorted(topics)[:6]], tokenizer, path)
    return path


def test_get_batch_of_chapter_00_reads_the_memmap(packed):
    tokens = dp.read_tokens(packed)
    torch.manual_seed(0)
    x, y = get_batch(tokens, 8, 16, "cpu")
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    windows = np.lib.stride_tricks.sliding_window_view(np.asarray(tokens, dtype=np.int64), 17)
    for row in torch.cat([x, y[:, -1:]], dim=1).numpy():
        assert (windows == row).all(axis=1).any()


# ---------------------------------------------------------------------------------------------
# Dataset, sampler, loader
# ---------------------------------------------------------------------------------------------


def test_token_windows(packed):
    tokens = dp.read_tokens(packed)
    ds = dp.TokenWindows(packed, block_size=8)
    assert len(ds) == (len(tokens) - 9) // 8 + 1
    for i in (0, 1, len(ds) - 1):
        x, y = ds[i]
        assert x.dtype == torch.long and x.tolist() == tokens[8 * i : 8 * i + 8].tolist()
        assert y.tolist() == tokens[8 * i + 1 : 8 * i + 9].tolist()
    overlapping = dp.TokenWindows(dp.PackedTokens(packed), block_size=8, stride=3)
    assert len(overlapping) == (len(tokens) - 9) // 3 + 1 and overlapping[2][0].tolist() == tokens[6:14].tolist()
    in_memory = dp.TokenWindows(np.arange(20), block_size=4)
    assert len(in_memory) == 4 and in_memory[3][1].tolist() == [13, 14, 15, 16]
    assert len(dp.TokenWindows(np.arange(5), 4)) == 1
    assert len(pickle.dumps(ds)) < 1000  # the path travels to workers, not the tokens
    assert pickle.loads(pickle.dumps(ds))[1][0].tolist() == ds[1][0].tolist()
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ValueError, match="block_size"):
        dp.TokenWindows(packed, block_size=0)
    with pytest.raises(ValueError, match="at least"):
        dp.TokenWindows(np.arange(4), block_size=4)
    with pytest.raises(TypeError, match="source"):
        dp.TokenWindows(np.zeros((3, 3), np.int64), block_size=2)


def test_sampler_orders_and_epochs():
    s = dp.ResumableSampler(10, seed=3)
    first = list(s)
    assert sorted(first) == list(range(10)) and first == s.order(0).tolist()
    assert s.position == 10 and len(s) == 10
    second = list(s)  # the next iteration starts the next epoch by itself
    assert s.epoch == 1 and second == s.order(1).tolist() and second != first
    assert dp.ResumableSampler(10, seed=3).order(1).tolist() == second
    assert dp.ResumableSampler(10, seed=4).order(0).tolist() != first
    assert list(dp.ResumableSampler(range(5), shuffle=False)) == [0, 1, 2, 3, 4]
    s.set_epoch(7)
    assert (s.epoch, s.position) == (7, 0) and list(s) == s.order(7).tolist()


def take(loader, n):
    """n batches from a loader, epoch after epoch (as a training loop does)."""
    def forever():
        while True:
            yield from loader

    return [torch.cat(batch, dim=1) for batch in itertools.islice(forever(), n)]


@pytest.mark.parametrize("stop", [3, 6, 7, 13])  # mid-epoch, the last full batch of epoch 0, epoch 1's first, later
def test_resumed_run_sees_the_same_next_batches(packed, stop):
    ds = dp.TokenWindows(dp.read_tokens(packed)[:300], block_size=8)  # 37 windows
    batch_size = 5
    assert len(ds) // batch_size == 7  # 7 batches an epoch (2 windows left over): the stops above assume it

    def loader(sampler):
        return dp.make_loader(ds, batch_size, sampler=sampler)

    uninterrupted = take(loader(dp.ResumableSampler(ds, seed=1)), stop + 5)
    sampler = dp.ResumableSampler(ds, seed=1)
    before = take(loader(sampler), stop)
    state = pickle.loads(pickle.dumps(sampler.state_dict()))  # as a checkpoint stores it
    resumed_sampler = dp.ResumableSampler(ds, seed=999)  # a fresh process; the seed comes from the state
    resumed_sampler.load_state_dict(state)
    after = take(loader(resumed_sampler), 5)
    for got, want in zip(before + after, uninterrupted):
        assert torch.equal(got, want)
    fresh = take(loader(dp.ResumableSampler(ds, seed=1)), stop + 1)[-1]
    assert torch.equal(fresh, uninterrupted[stop])


def test_sampler_state_is_validated():
    s = dp.ResumableSampler(10)
    it = iter(s)
    next(it), next(it)
    assert s.state_dict() == {"num_items": 10, "seed": 0, "shuffle": True, "epoch": 0, "position": 2}
    assert s.state_dict(consumed=1)["position"] == 1
    with pytest.raises(ValueError, match="consumed"):
        s.state_dict(consumed=3)
    with pytest.raises(ValueError, match="saved for 10 items"):
        dp.ResumableSampler(11).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="lacks"):
        s.load_state_dict({"seed": 0})
    with pytest.raises(TypeError, match="state"):
        s.load_state_dict([1, 2])
    with pytest.raises(ValueError, match="num_items"):
        dp.ResumableSampler(0)
    with pytest.raises(TypeError, match="shuffle"):
        dp.ResumableSampler(3, shuffle="yes")


def test_loader_with_workers_gives_the_same_batches_and_resumes_from_consumed(packed):
    ds = dp.TokenWindows(packed, block_size=8)
    reference = take(dp.make_loader(ds, 4, sampler=dp.ResumableSampler(ds, seed=2)), 6)
    sampler = dp.ResumableSampler(ds, seed=2)
    loader = dp.make_loader(ds, 4, sampler=sampler, num_workers=1, prefetch_factor=2)
    assert loader.multiprocessing_context.get_start_method() in ("forkserver", "spawn")
    it = iter(loader)
    got = [torch.cat(next(it), dim=1) for _ in range(3)]
    # workers asked for indices ahead of the three batches used: save what was consumed
    assert sampler.position > 3 * 4
    state = sampler.state_dict(consumed=3 * 4)
    del it
    resumed = dp.ResumableSampler(ds)
    resumed.load_state_dict(state)
    got += take(dp.make_loader(ds, 4, sampler=resumed), 3)
    for a, b in zip(got, reference):
        assert torch.equal(a, b)


def test_make_loader_settings_and_bad_arguments(packed):
    ds = dp.TokenWindows(packed, block_size=8)
    loader = dp.make_loader(ds, 4)
    assert loader.pin_memory == torch.cuda.is_available() and loader.drop_last and loader.num_workers == 0
    assert dp.make_loader(ds, 4, num_workers=1, prefetch_factor=3).prefetch_factor == 3
    with pytest.raises(ValueError, match="batch_size"):
        dp.make_loader(ds, 0)
    with pytest.raises(ValueError, match="num_workers"):
        dp.make_loader(ds, 2, num_workers=-1)
    with pytest.raises(ValueError, match="prefetch_factor"):
        dp.make_loader(ds, 2, prefetch_factor=0)
    with pytest.raises(TypeError, match="dataset"):
        dp.make_loader([1, 2, 3], 2)
    with pytest.raises(TypeError, match="sampler"):
        dp.make_loader(ds, 2, sampler=[0, 1])
    with pytest.raises(TypeError, match="pin_memory"):
        dp.make_loader(ds, 2, pin_memory="auto")


def test_loader_throughput_counts_batches_and_tokens(packed):
    ds = dp.TokenWindows(packed, block_size=8)
    result = dp.loader_throughput(dp.make_loader(ds, 4), num_batches=5)
    assert result.batches == 5 and result.tokens == 5 * 4 * 8
    assert result.batches_per_second > 0 and result.tokens_per_second == pytest.approx(result.batches_per_second * 32)
    short = dp.make_loader(dp.TokenWindows(np.arange(40), 8), 2)  # 2 batches
    assert dp.loader_throughput(short, num_batches=10, warmup=1).batches == 1
    with pytest.raises(ValueError, match="warm-up"):
        dp.loader_throughput(short, num_batches=1, warmup=5)
    with pytest.raises(ValueError, match="num_batches"):
        dp.loader_throughput(short, num_batches=0)


def test_a_slow_loader_blocks_the_training_loop(packed):
    ds = dp.TokenWindows(packed, block_size=8)
    fast = dp.time_blocked_on_data(dp.make_loader(ds, 4), step=0.002, num_steps=6)
    slow = dp.time_blocked_on_data(dp.make_loader(dp.DelayedDataset(ds, 0.005), 4), step=0.002, num_steps=6)
    assert fast.steps == slow.steps == 6
    # slow: >= 20 ms waiting per 2 ms step (sleeps only ever overrun): ~0.9 blocked; fast: mostly stepping
    assert slow.fraction_blocked > 0.5 and slow.fraction_blocked > fast.fraction_blocked
    assert slow.waiting >= 6 * 4 * 0.005 and slow.computing >= 6 * 0.002
    calls = []
    report = dp.time_blocked_on_data(dp.make_loader(ds, 4), step=calls.append, num_steps=3, warmup=0)
    assert report.steps == len(calls) == 3 and calls[0][0].shape == (4, 8)
    with pytest.raises(ValueError, match="step"):
        dp.time_blocked_on_data(dp.make_loader(ds, 4), step=-1.0)
    with pytest.raises(TypeError, match="step"):
        dp.time_blocked_on_data(dp.make_loader(ds, 4), step="fast")
    with pytest.raises(ValueError, match="delay"):
        dp.DelayedDataset(ds, -1)


# ---------------------------------------------------------------------------------------------
# Streaming records (Hugging Face datasets' rows)
# ---------------------------------------------------------------------------------------------


def test_records_stream_into_the_pipeline(tokenizer, tmp_path):
    rows = ({"id": f"<urn:{i}>", "text": text, "url": "https://example.org"} for i, text in enumerate(PACK_DOCS))
    docs = dp.records_to_documents(rows, "text", source_field="id")
    assert not isinstance(docs, list)  # lazy
    report = dp.pack(docs, tokenizer, tmp_path / "stream.bin")
    assert report.documents == len(PACK_DOCS)
    endless = dp.records_to_documents({"text": str(i)} for i in itertools.count())
    assert [d.source for d in itertools.islice(endless, 3)] == ["hf:0", "hf:1", "hf:2"]
    with pytest.raises(ValueError, match="no field 'text'"):
        list(dp.records_to_documents([{"content": "x"}]))
    with pytest.raises(TypeError, match="records"):
        dp.records_to_documents({"text": "a dict, not rows"})
    with pytest.raises(TypeError, match=r"records\[0\]"):
        list(dp.records_to_documents(["a string row"]))
