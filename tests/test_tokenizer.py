"""labkit.tokenizer against references: a naive BPE trainer written here (every pair recounted after
every merge), Hugging Face ``tokenizers``' trainer, and tiktoken's encoder, also with GPT-2's real ranks
(labkit/assets/gpt2, from openai-whisper)."""
import itertools
import json
import random
from collections import Counter
from pathlib import Path

import pytest
import regex
import tiktoken

from labkit import tokenizer as tk
from labkit.bench.tokenizer import hf_bpe_merges
from labkit.tokenizer import GPT2_PATTERN, GPT2_RANKS, Tokenizer, bytes_to_unicode, gpt2_tokenizer, read_ranks, train_bpe

EOT = "<|endoftext|>"
SAMPLES = [
    "Hello, world! It's a test: don't panic, we'll see.\n\n  Indented line\twith tab.   ",
    "Grüße aus Köln, café crème, naïve façade — 25°C, ½ price…",
    "日本語のテキストと中文文本，还有한국어.",
    "Emoji: 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷 and ZWJ\u200d, BOM \ufeff, NUL \x00 end",
    f"one{EOT}two {EOT}{EOT} three{EOT}",
    "",
    "   \n\n\n  x",
]


def pydoc_text(n_chars: int) -> str:
    """English prose that ships with Python (the help() topics), joined by end-of-text tokens."""
    from pydoc_data.topics import topics

    return EOT.join(topics[k] for k in sorted(topics))[:n_chars]


def random_corpus(seed: int, n_chars: int = 3000) -> str:
    """Small-alphabet words (so pairs tie and merges chain), assorted whitespace, contractions,
    digits, multi-byte characters and special tokens."""
    rng = random.Random(seed)
    pieces: list[str] = []
    while sum(map(len, pieces)) < n_chars:
        r = rng.random()
        if r < 0.6:
            pieces.append("".join(rng.choice("aabbc") for _ in range(rng.randint(1, 6))))
        elif r < 0.8:
            pieces.append(rng.choice([" ", " ", "  ", "\n", "\n\n", "\t", " \n"]))
        elif r < 0.93:
            pieces.append(rng.choice(["'s", "!", "..", "12", "é", "日本", "🙂", "'ll"]))
        else:
            pieces.append(EOT)
    return "".join(pieces)


def pretoken_counts(text: str, specials: list[str]) -> Counter:
    segments = regex.split("|".join(map(regex.escape, sorted(specials, key=len, reverse=True))), text) if specials else [text]
    return Counter(t for s in segments for t in regex.findall(GPT2_PATTERN, s))


def naive_bpe(text: str, vocab_size: int, specials: list[str], tie_break: str = "cs336"):
    """The reference: recount every pair of every pre-token after each merge, with symbols as bytes.

    ``tie_break="cs336"`` prefers the lexicographically greatest pair of bytes; ``"hf"`` prefers
    the pair with the smallest (left id, right id) in Hugging Face's numbering: the 256 byte
    characters sorted by the code point of their ``bytes_to_unicode`` character, then new tokens in
    creation order. Returns the merges and the steps at which more than one pair had the top count.
    """
    words = Counter({tuple(bytes([b]) for b in t.encode()): c for t, c in pretoken_counts(text, specials).items()})
    b2u = bytes_to_unicode()
    hf_id = {bytes([b]): i for i, b in enumerate(sorted(range(256), key=lambda b: b2u[b]))}
    merges, ties = [], []
    while len(hf_id) + len(specials) < vocab_size:
        pairs: Counter = Counter()
        for w, c in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += c
        if not pairs:
            break
        top = max(pairs.values())
        candidates = [p for p, c in pairs.items() if c == top]
        if tie_break == "cs336":
            best = max(candidates)
        else:
            best = min(candidates, key=lambda p: (hf_id[p[0]], hf_id[p[1]]))
        if len(candidates) > 1:
            ties.append(len(merges))
        merges.append(best)
        merged = best[0] + best[1]
        hf_id.setdefault(merged, len(hf_id))
        new: Counter = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] += c
        words = new
    return merges, ties


def write(tmp_path: Path, text: str, name: str = "corpus.txt") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 500-token tokenizer trained on ~130 kB of English."""
    path = write(tmp_path_factory.mktemp("bpe"), pydoc_text(130_000))
    vocab, merges = train_bpe(path, 500, [EOT])
    return Tokenizer(vocab, merges, [EOT])


# --- training -----------------------------------------------------------------------------------


def test_handout_example_hand_checked(tmp_path):
    # CS336's example corpus. GPT-2's regex makes the pre-tokens "low", " low" x4, " lower" x2,
    # " widest" x3, " newest" x6. Counts: (e,s) and (s,t) 9 each, tied: the greatest pair, (s,t),
    # wins; then (e,st) 9; (o,w) beats (l,o) at 7; (l,ow) 7; at 6 the greatest of (w,est), (n,e),
    # (e,w), (' ',n), (' ',low) is (w,est); then (n,e); (ne,west); (' ',newest) beats (' ',low) as
    # b"newest" > b"low". The first seven are the handout's own (it splits on whitespace only).
    text = "low low low low low lower lower widest widest widest newest newest newest newest newest newest"
    vocab, merges = train_bpe(write(tmp_path, text), 256 + 1 + 12, [EOT])
    expected = [(b"s", b"t"), (b"e", b"st"), (b"o", b"w"), (b"l", b"ow"), (b"w", b"est"), (b"n", b"e"),
                (b"ne", b"west"), (b" ", b"newest"), (b" ", b"low")]
    assert merges[: len(expected)] == expected
    assert merges == naive_bpe(text, 256 + 1 + 12, [EOT])[0]
    assert vocab[256] == EOT.encode() and [vocab[i] for i in range(257, 266)] == [a + b for a, b in expected]
    assert all(vocab[i] == bytes([i]) for i in range(256)) and len(vocab) == 269


@pytest.mark.parametrize("seed", range(4))
def test_fast_trainer_equals_naive_reference(tmp_path, seed):
    text = random_corpus(seed)
    vocab, merges = train_bpe(write(tmp_path, text), 256 + 1 + 120, [EOT])
    assert merges == naive_bpe(text, 256 + 1 + 120, [EOT])[0]
    assert len(vocab) == len(set(vocab.values())) == 256 + 1 + 120
    assert all(EOT.encode() not in t for i, t in vocab.items() if i != 256)  # no merge spans a special


def test_training_stops_when_nothing_is_left_to_merge(tmp_path):
    vocab, merges = train_bpe(write(tmp_path, "abab abab"), 1000, [])
    assert merges == [(b"a", b"b"), (b"ab", b"ab"), (b" ", b"abab")] and len(vocab) == 259


def test_parallel_counting_equals_one_process(tmp_path, monkeypatch):
    # Mostly specials with spaces in them, so that most cuts between a non-space and a space fall
    # inside one, where the chunker must not cut. Small windows make it search across window ends.
    specials = [EOT, "<| sep |>", "<| sep |><| sep |>"]
    rng = random.Random(0)
    text = "".join(rng.choice([*specials, "<| sep |>", " ab", "cd", "\n", "  ", "é"]) for _ in range(1500))
    path = write(tmp_path, text)
    monkeypatch.setattr(tk, "_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(tk, "_CUT_WINDOW_BYTES", 100)
    assert len(tk._chunk_bounds(path, path.stat().st_size, 32, specials)) > 25
    assert tk._count_pretokens(path, specials, 8) == tk._count_pretokens(path, specials, 1) == pretoken_counts(text, specials)


@pytest.mark.parametrize("seed", range(3))
def test_every_safe_cut_leaves_pretokens_unchanged(seed):
    """The claim both the chunker and encode_iterable rest on, checked at every candidate cut."""
    specials = [EOT, "<| sep |>", "a b"]
    text = random_corpus(seed, 600).replace("c", "<| sep |>")
    whole = pretoken_counts(text, specials)
    for m in tk._CUT.finditer(text):
        if not tk._straddled(text, m.start(), specials):
            assert pretoken_counts(text[: m.start()], specials) + pretoken_counts(text[m.start() :], specials) == whole


def test_same_merges_as_hugging_face_up_to_ties(tmp_path):
    # HF's trainer pops pairs from a heap ordered by count and then by the smaller (left id, right
    # id), its ids being the byte characters in code-point order then new tokens by age; CS336
    # breaks ties by the greatest pair of bytes. So the two agree merge for merge until the first
    # step where two pairs share the top count; after it the choices, and the counts that follow
    # them, drift apart (pairs that overlap in a word cannot both be merged). The naive reference
    # with HF's tie rule reproduces HF exactly, which shows the tie rule is the only difference.
    text = pydoc_text(40_000)
    vocab_size = 256 + 1 + 150
    ours = train_bpe(write(tmp_path, text), vocab_size, [EOT])[1]
    hf = hf_bpe_merges(text, vocab_size)  # Hugging Face's trainer, configured as ours (labkit.bench.tokenizer)
    naive_hf, ties = naive_bpe(text, vocab_size, [EOT], tie_break="hf")
    assert hf == naive_hf
    first_tie = ties[0]
    assert first_tie > 10 and ours[:first_tie] == hf[:first_tie]
    assert ours != hf  # if this fails, the corpus no longer exercises a tie
    assert ours == naive_bpe(text, vocab_size, [EOT])[0]


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((300, [EOT]), None, None),
        ((256, [EOT]), ValueError, "vocab_size=256"),
        (("300", [EOT]), TypeError, "vocab_size"),
        ((300, [b"<|endoftext|>"]), TypeError, "special_tokens"),
        ((300, EOT), TypeError, "special_tokens"),
        ((300, [""]), ValueError, "special_tokens"),
        ((300, [EOT, EOT]), ValueError, "more than once"),
    ],
)
def test_train_bpe_argument_errors(tmp_path, args, error, match):
    path = write(tmp_path, "some text")
    if error is None:
        train_bpe(path, *args)
        return
    with pytest.raises(error, match=match):
        train_bpe(path, *args)


def test_train_bpe_file_errors(tmp_path):
    with pytest.raises(ValueError, match="input_path"):
        train_bpe(tmp_path / "missing.txt", 300, [])
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9 latin-1")
    with pytest.raises(ValueError, match="not UTF-8 text"):
        train_bpe(bad, 300, [])


# --- encoding and decoding ----------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_roundtrip(trained, text):
    ids = trained.encode(text)
    assert trained.decode(ids) == text
    assert all(isinstance(i, int) and i in trained.vocab for i in ids)


def test_special_tokens_are_atomic_and_longest_first(trained):
    eot = trained.encode(EOT)
    assert eot == [256] and trained.encode(f"a{EOT}{EOT}b").count(256) == 2
    double = Tokenizer(trained.vocab, trained.merges, [EOT, EOT + EOT])
    ids = double.encode(f"a{EOT}{EOT}b{EOT}")
    assert ids.count(256) == 1 and len(ids) == 4 and double.decode(ids) == f"a{EOT}{EOT}b{EOT}"
    plain = Tokenizer(trained.vocab, trained.merges)  # undeclared: the text of a special is ordinary text
    assert 256 not in plain.encode(EOT) and plain.decode(plain.encode(EOT)) == EOT


def test_decode_replaces_invalid_utf8(trained):
    ids = trained.encode("é")  # two bytes, c3 a9, unless a merge joined them
    lone = [i for i in range(256) if trained.vocab[i] == b"\xc3"]
    assert trained.decode(lone) == "\ufffd" and trained.decode(lone + ids) == "\ufffdé"
    assert trained.decode([]) == ""
    with pytest.raises(ValueError, match="not a token id"):
        trained.decode([len(trained.vocab) + 5])


def test_save_and_from_files_round_trip(trained, tmp_path):
    trained.save(tmp_path / "vocab.json", tmp_path / "merges.txt")
    loaded = Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt", [EOT])
    assert loaded.vocab == trained.vocab and loaded.merges == trained.merges
    for text in SAMPLES:
        assert loaded.encode(text) == trained.encode(text)
    b2u = bytes_to_unicode()  # GPT-2's format: a space shows as Ġ, and a space separates a merge's halves
    lines = (tmp_path / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("#version") and lines[1] == " ".join("".join(map(b2u.get, half)) for half in trained.merges[0])
    assert json.loads((tmp_path / "vocab.json").read_text(encoding="utf-8"))["Ġ"] == 32


def test_bytes_to_unicode_is_gpt2s():
    b2u = bytes_to_unicode()
    assert len(set(b2u.values())) == 256 and b2u[ord("A")] == "A" and b2u[ord(" ")] == "Ġ" and b2u[ord("\n")] == "Ċ"
    assert not any(c.isspace() for c in b2u.values())


def test_tokenizer_errors(trained, tmp_path):
    with pytest.raises(ValueError, match="single bytes"):
        Tokenizer({0: b"a"}, [])
    with pytest.raises(TypeError, match="vocab"):
        Tokenizer({0: "a"}, [])
    with pytest.raises(ValueError, match=r"merges\[0\]"):
        Tokenizer({i: bytes([i]) for i in range(256)}, [(b"a", b"b")])
    with pytest.raises(TypeError, match="special_tokens"):
        Tokenizer(trained.vocab, trained.merges, [1])
    with pytest.raises(TypeError, match="text"):
        trained.encode(b"bytes")
    (tmp_path / "vocab.json").write_text(json.dumps({"\u2603": 0}), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b c\n", encoding="utf-8")
    with pytest.raises(ValueError, match="bytes_to_unicode"):
        Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    trained.save(tmp_path / "vocab.json", tmp_path / "other.txt")
    with pytest.raises(ValueError, match="merges.txt:2"):
        Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt")


def test_encode_iterable_equals_encode_of_joined_text(trained):
    # Pieces cut anywhere, also inside "\n\n\n" (one GPT-2 pre-token) and inside a special token.
    specials = [EOT, "<| sep |>"]
    tok = Tokenizer(trained.vocab, trained.merges, specials)
    text = "".join(SAMPLES) + " a<| sep |>b \n\n\n c" + pydoc_text(3000)
    rng = random.Random(0)
    cuts = sorted(rng.sample(range(len(text)), 300))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    assert list(tok.encode_iterable(pieces)) == tok.encode(text)
    assert list(tok.encode_iterable(text.splitlines(keepends=True))) == tok.encode(text)
    assert list(tok.encode_iterable(iter(text))) == tok.encode(text)  # one character at a time
    assert list(tok.encode_iterable([])) == []


def test_encode_iterable_is_lazy(trained):
    pulled = []

    def lines():
        for n in itertools.count():
            if n == 5:
                raise AssertionError("read past the lines the first ids need")
            pulled.append(n)
            yield f"line {n} of a file that never ends\n"

    first = list(itertools.islice(trained.encode_iterable(lines()), 5))
    assert first == trained.encode("line 0 of a file")[:5] and len(pulled) <= 2


# --- against tiktoken -----------------------------------------------------------------------------


def tiktoken_of(tok: Tokenizer, name: str) -> tiktoken.Encoding:
    specials = {t: tok.encode(t)[0] for t in tok.special_tokens}
    ranks = {t: i for i, t in tok.vocab.items() if i not in specials.values()}
    return tiktoken.Encoding(name=name, pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def test_encode_equals_tiktoken_with_our_ranks(trained):
    # tiktoken merges by the rank of the merged token, not of the merge; for ranks that come from
    # BPE training the two orders give the same ids, which this checks on text it was not trained on.
    enc = tiktoken_of(trained, "labkit-500")
    held_out = [*SAMPLES, pydoc_text(200_000)[130_000:180_000], random_corpus(7)]
    for text in held_out:
        assert trained.encode(text) == enc.encode(text, allowed_special="all")


def test_encode_equals_tiktoken_gpt2(tmp_path):
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(GPT2_RANKS))
    assert len(ranks) == 50256 and read_ranks() == ranks  # labkit reads the ranks file as tiktoken does
    enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: 50256})
    tok = gpt2_tokenizer()
    assert tok.encode("Hello, world!") == [15496, 11, 995, 0] and tok.encode(" ") == [220]
    tok.save(tmp_path / "vocab.json", tmp_path / "merges.txt")
    head = (tmp_path / "merges.txt").read_text(encoding="utf-8").splitlines()[:6]
    assert head == ["#version: 0.2", "Ġ t", "Ġ a", "h e", "i n", "r e"]  # as GPT-2's own merges.txt begins
    assert Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt", [EOT]).merges == tok.merges
    for text in [*SAMPLES, pydoc_text(60_000)]:
        assert tok.encode(text) == enc.encode(text, allowed_special="all")
