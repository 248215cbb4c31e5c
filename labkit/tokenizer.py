"""Byte-level BPE: GPT-2's tokenizer, trained from scratch and used to encode text.

The interface is Stanford CS336's assignment 1, so its code and tests run against this module:
``train_bpe(input_path, vocab_size, special_tokens) -> (vocab, merges)`` and
``Tokenizer(vocab, merges, special_tokens)`` with ``encode``, ``decode``, ``encode_iterable`` and
``from_files``, which reads GPT-2's ``vocab.json`` / ``merges.txt``.

Byte-level means the alphabet is the 256 byte values: every string encodes (no unknown token),
and a merge may join bytes that are only part of a UTF-8 character. Text is first cut into
pre-tokens by GPT-2's regex (words with their leading space, numbers, punctuation runs,
whitespace), and merges never cross a pre-token: " dog" and " dog." share the token for " dog".
"""
from __future__ import annotations

import functools
import heapq
import json
import multiprocessing
import os
import sys
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Iterator
from pathlib import Path

import regex

# GPT-2's pre-tokenizer: contractions, then an optional space followed by letters, by digits, or by
# other symbols, then whitespace. `\s+(?!\S)` leaves a run's last space to the word after it.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_PRETOKEN = regex.compile(GPT2_PATTERN)

# Where text can be cut in two and each half pre-tokenized alone with the same result as the whole:
# between a non-space character and a space. No GPT-2 pre-token holds a non-space followed by a
# space (a leading space comes first, never last), and the pattern only ever looks one character
# past a match inside a whitespace run, which this cut leaves whole on its right.
_CUT = regex.compile(r"(?<=\S)(?=\s)")
_LAST_CUT = regex.compile(r"(?r)(?<=\S)(?=\s)")

# Counting pre-tokens in several processes pays off from about this size; below it starting them costs more.
_PARALLEL_MIN_BYTES = 1 << 20
# How much of the file is read at a time when looking for a place to cut it into chunks.
_CUT_WINDOW_BYTES = 1 << 16
# Tokenizer caches each pre-token's ids; cleared when it reaches this size, so a long stream's cache stays bounded.
_CACHE_LIMIT = 1 << 18
_NOT_A_MERGE = float("inf")  # the rank of a pair that no merge joins


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character, used to store byte tokens as text.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, NBSP, soft hyphen)
    are shifted to U+0100 onwards, so a token is never whitespace and ``merges.txt`` can separate
    a merge's two halves with a space (a leading space shows as "Ġ", U+0120).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


def _check_special_tokens(special_tokens, name: str = "special_tokens") -> list[str]:
    if special_tokens is None:
        return []
    if isinstance(special_tokens, (str, bytes)) or not isinstance(special_tokens, Iterable):
        raise TypeError(f"{name}={special_tokens!r}: expected a list of strings")
    tokens = list(special_tokens)
    for token in tokens:
        if not isinstance(token, str):
            raise TypeError(f"{name}: {token!r} is a {type(token).__name__}, expected str")
        if not token:
            raise ValueError(f"{name}: the empty string cannot be a special token")
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise ValueError(f"{name}: {repeated} given more than once")
    return tokens


def _special_pattern(special_tokens: list[str], keep: bool) -> regex.Pattern | None:
    """A regex matching any special token, longest first, so that of two overlapping specials
    ("<|endoftext|>" and "<|endoftext|><|endoftext|>") the longer one wins where both match.
    ``keep`` wraps it in a group, so ``split`` keeps the specials it splits on."""
    if not special_tokens:
        return None
    alternatives = "|".join(regex.escape(t) for t in sorted(special_tokens, key=len, reverse=True))
    return regex.compile(f"({alternatives})" if keep else alternatives)


def _straddled(text: str, i: int, special_tokens: list[str]) -> bool:
    """Whether an occurrence of a special token spans position ``i`` of ``text`` (starts before it, ends after)."""
    return any(text.startswith(t, j) for t in special_tokens for j in range(max(0, i - len(t) + 1), i))


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def train_bpe(
    input_path: str | os.PathLike,
    vocab_size: int,
    special_tokens: list[str],
    *,
    num_processes: int | None = None,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train a byte-level BPE tokenizer on the UTF-8 text file ``input_path``.

    Returns ``(vocab, merges)``: ``vocab`` maps ids 0..255 to the single bytes, the next ids to the
    special tokens (UTF-8), then one id per new token in the order merges created them;
    ``merges`` lists the merged pairs in that order. Each step merges the most frequent adjacent
    pair, counted within pre-tokens (GPT-2's regex) weighted by how often each pre-token occurs; a
    tie goes to the lexicographically greatest pair of bytes, as CS336 specifies. The text is split
    on the special tokens first, so no merge spans one. Training stops at ``vocab_size`` tokens, or
    earlier when no pre-token has two symbols left.

    Should a merge produce bytes that are already a token (``ab+c`` after ``a+bc``), it is listed in
    ``merges`` but adds no id, as in Hugging Face ``tokenizers``: a token is its bytes, so both
    spellings must be one symbol afterwards (``len(merges)`` then exceeds ``len(vocab) - 256 - len(specials)``).

    Pre-tokens are counted in ``num_processes`` processes (default: all cores) over chunks of the
    file cut where counting each alone changes nothing; a file under 1 MiB is counted in this one.
    """
    path = Path(input_path)
    if not path.is_file():
        raise ValueError(f"input_path={str(input_path)!r}: no such file")
    specials = _check_special_tokens(special_tokens)
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise TypeError(f"vocab_size={vocab_size!r}: expected an int")
    if vocab_size < 256 + len(specials):
        raise ValueError(
            f"vocab_size={vocab_size}: must be at least 256 (the bytes) + {len(specials)} (the special tokens)"
        )
    if num_processes is not None and (not isinstance(num_processes, int) or num_processes < 1):
        raise ValueError(f"num_processes={num_processes!r}: expected a positive int or None")
    counts = _count_pretokens(path, specials, num_processes or os.cpu_count() or 1)
    return _merge(counts, vocab_size, specials)


def _count_pretokens(path: Path, specials: list[str], num_processes: int) -> Counter[str]:
    """How often each pre-token occurs in the file, counted in parallel over chunks."""
    size = path.stat().st_size
    if num_processes == 1 or size < _PARALLEL_MIN_BYTES:
        return _count_chunk((str(path), 0, size, specials))
    # Several chunks per process: chunks differ in size (cuts move) and cores in load, and a
    # process that finishes early takes the next chunk.
    bounds = _chunk_bounds(path, size, 4 * num_processes, specials)
    jobs = [(str(path), start, end, specials) for start, end in zip(bounds, bounds[1:])]
    # fork on Linux: a spawned worker would re-import labkit, and with it torch (~1.5 s each), to
    # run a regex. Workers run no torch, so forking a parent that has torch threads is safe here.
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with context.Pool(min(num_processes, len(jobs))) as pool:
        total: Counter[str] = Counter()
        for counts in pool.imap_unordered(_count_chunk, jobs):
            total.update(counts)
    return total


def _chunk_bounds(path: Path, size: int, num_chunks: int, specials: list[str]) -> list[int]:
    """Byte offsets ``[0, ..., size]`` cutting the file into about ``num_chunks`` chunks, each cut
    at a place where pre-tokenizing the two sides apart gives the same pre-tokens as the whole:
    between a non-space and a space character, and inside no occurrence of a special token."""
    bounds = {0, size}
    with open(path, "rb") as f:
        for k in range(1, num_chunks):
            cut = _find_cut(f, k * size // num_chunks, specials)
            if cut is not None:
                bounds.add(cut)
    return sorted(bounds)


def _find_cut(f, guess: int, specials: list[str]) -> int | None:
    """The first safe cut (see ``_chunk_bounds``) near or after byte ``guess``, or None before the end of the file."""
    margin = max(map(len, specials), default=0)  # characters of context a straddle check needs on each side
    pos = max(0, guess - 4 * margin)  # a character is at most 4 bytes
    while True:
        f.seek(pos)
        raw = f.read(_CUT_WINDOW_BYTES)
        skip = 0
        while skip < min(3, len(raw)) and 0x80 <= raw[skip] < 0xC0:  # start on a character, not inside one
            skip += 1
        text = raw[skip:].decode("utf-8", errors="ignore")  # only a character cut off at the window's end is lost
        at_end = len(raw) < _CUT_WINDOW_BYTES
        lo = 0 if pos == 0 else margin
        hi = len(text) if at_end else len(text) - margin
        for m in _CUT.finditer(text, lo, max(lo, hi)):
            if not _straddled(text, m.start(), specials):
                return pos + skip + len(text[: m.start()].encode())
        if at_end:
            return None
        pos += max(1, len(raw) - 8 * margin - 4)  # overlap the next window by this one's unchecked end


def _count_chunk(job: tuple[str, int, int, list[str]]) -> Counter[str]:
    """Pre-token counts of bytes ``[start, end)`` of the file (a worker's job: a tuple, so it pickles)."""
    path, start, end, specials = job
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"input_path={path!r}: not UTF-8 text (byte {start + e.start})") from None
    split = _special_pattern(specials, keep=False)
    counts: Counter[str] = Counter()
    for segment in split.split(text) if split else [text]:
        counts.update(_PRETOKEN.findall(segment))
    return counts


class _Descending:
    """Heap key ordering byte pairs greatest first: ``heapq`` pops the smallest item, and a tie in
    count must go to the lexicographically greatest pair."""

    __slots__ = ("pair",)

    def __init__(self, pair: tuple[bytes, bytes]):
        self.pair = pair

    def __lt__(self, other: _Descending) -> bool:
        return self.pair > other.pair


def merge_pair(word, a, b, new) -> list:
    """``word`` (a sequence of symbols) with every non-overlapping ``a, b`` replaced by ``new``, left to right."""
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def _merge(
    counts: Counter[str], vocab_size: int, specials: list[str]
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """The merge loop. Recounting every pair after each merge costs the whole corpus per merge;
    instead pair counts are updated in place: only the pre-tokens that contain the merged pair
    change, found through an index from each pair to the pre-tokens holding it. The most
    frequent pair comes from a heap of (count, pair) entries; an entry whose count is no longer
    the pair's count is stale and skipped when popped, the current count having been pushed too."""
    vocab = {i: bytes([i]) for i in range(256)}
    for token in specials:
        vocab[len(vocab)] = token.encode("utf-8")
    id_of = {bytes([i]): i for i in range(256)}  # the symbols pre-tokens are made of (specials never occur in them)

    words = [list(word.encode("utf-8")) for word in counts]
    freqs = list(counts.values())
    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)
    for w, (word, freq) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freq
            where[pair].add(w)

    def entry(pair: tuple[int, int], count: int):
        return (-count, _Descending((vocab[pair[0]], vocab[pair[1]])), pair)

    heap = [entry(pair, count) for pair, count in pair_counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[bytes, bytes]] = []
    while heap and len(vocab) < vocab_size:
        neg_count, _, pair = heapq.heappop(heap)
        if pair_counts.get(pair) != -neg_count:
            continue  # stale
        a, b = pair
        merged = vocab[a] + vocab[b]
        new = id_of.get(merged)
        if new is None:
            new = id_of[merged] = len(vocab)
            vocab[new] = merged
        merges.append((vocab[a], vocab[b]))

        delta: dict[tuple[int, int], int] = defaultdict(int)
        for w in where.pop(pair):
            word, freq = words[w], freqs[w]
            out = merge_pair(word, a, b, new)
            old_pairs, new_pairs = list(zip(word, word[1:])), list(zip(out, out[1:]))
            for p in old_pairs:
                delta[p] -= freq
            for p in new_pairs:
                delta[p] += freq
            for p in set(old_pairs).difference(new_pairs):
                if p in where:
                    where[p].discard(w)
            for p in set(new_pairs).difference(old_pairs):
                where[p].add(w)
            words[w] = out
        for p, change in delta.items():
            if change:
                pair_counts[p] += change
                if pair_counts[p]:
                    heapq.heappush(heap, entry(p, pair_counts[p]))
                else:
                    del pair_counts[p]
                    where.pop(p, None)
    return vocab, merges


# ---------------------------------------------------------------------------------------------
# Encoding and decoding
# ---------------------------------------------------------------------------------------------


class Tokenizer:
    """Encode text to token ids with a BPE vocabulary and its merges, and decode ids back.

    ``vocab`` maps ids to bytes and must hold all 256 single bytes; ``merges`` is the ordered list
    of merged pairs (``train_bpe``'s output, or GPT-2's via ``from_files``). Special tokens are
    never split or merged; any not in ``vocab`` are appended to it.
    """

    def __init__(
        self,
        vocab: dict[int, bytes],
        merges: list[tuple[bytes, bytes]],
        special_tokens: list[str] | None = None,
    ):
        if not isinstance(vocab, dict) or not all(isinstance(i, int) and isinstance(t, bytes) for i, t in vocab.items()):
            raise TypeError("vocab: expected a dict from int ids to bytes")
        self.vocab = dict(vocab)
        self.special_tokens = _check_special_tokens(special_tokens)
        self._id_of: dict[bytes, int] = {}
        for i, token in sorted(self.vocab.items()):
            self._id_of.setdefault(token, i)  # a token listed twice encodes to its lower id
        missing = [b for b in range(256) if bytes([b]) not in self._id_of]
        if missing:
            raise ValueError(f"vocab: lacks {len(missing)} of the 256 single bytes (e.g. {bytes(missing[:3])!r})")
        for token in self.special_tokens:
            if token.encode("utf-8") not in self._id_of:
                new = max(self.vocab) + 1
                self.vocab[new] = token.encode("utf-8")
                self._id_of[self.vocab[new]] = new

        self.merges = [tuple(m) for m in merges]
        self._ranks: dict[tuple[bytes, bytes], int] = {}
        for rank, merge in enumerate(self.merges):
            if len(merge) != 2 or not all(isinstance(part, bytes) for part in merge):
                raise TypeError(f"merges[{rank}]={merge!r}: expected a pair of bytes")
            if merge[0] + merge[1] not in self._id_of:
                raise ValueError(f"merges[{rank}]={merge!r}: the merged token is not in vocab")
            self._ranks.setdefault(merge, rank)  # a pair merged twice (see train_bpe) keeps its first rank

        self._special_ids = {t: self._id_of[t.encode("utf-8")] for t in self.special_tokens}
        self._special_split = _special_pattern(self.special_tokens, keep=True)
        self._cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def from_files(
        cls, vocab_path: str | os.PathLike, merges_path: str | os.PathLike, special_tokens: list[str] | None = None
    ) -> Tokenizer:
        """Read GPT-2's format: ``vocab.json`` maps each token, written with ``bytes_to_unicode``'s
        characters, to its id; ``merges.txt`` has one merge per line, its two halves separated by a
        space, after an optional ``#version`` line."""
        decoder = {ch: byte for byte, ch in bytes_to_unicode().items()}

        def to_bytes(token: str, where: str) -> bytes:
            try:
                return bytes(decoder[ch] for ch in token)
            except KeyError as e:
                raise ValueError(f"{where}: token {token!r} has {e.args[0]!r}, not a bytes_to_unicode character") from None

        with open(vocab_path, encoding="utf-8") as f:
            vocab = {i: to_bytes(token, str(vocab_path)) for token, i in json.load(f).items()}
        merges = []
        with open(merges_path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if (n == 1 and line.startswith("#version")) or not line.strip():
                    continue
                halves = line.split()
                if len(halves) != 2:
                    raise ValueError(f"{merges_path}:{n}: expected two tokens separated by a space, got {line!r}")
                merges.append(tuple(to_bytes(h, f"{merges_path}:{n}") for h in halves))
        return cls(vocab, merges, special_tokens)

    def save(self, vocab_path: str | os.PathLike, merges_path: str | os.PathLike) -> None:
        """Write ``vocab.json`` and ``merges.txt`` in GPT-2's format, which ``from_files`` reads back."""
        if len(self._id_of) != len(self.vocab):
            raise ValueError("vocab: some ids share the same bytes, which vocab.json (token -> id) cannot hold")
        encoder = bytes_to_unicode()

        def to_text(token: bytes) -> str:
            return "".join(encoder[b] for b in token)

        with open(vocab_path, "w", encoding="utf-8") as f:
            json.dump({to_text(t): i for i, t in sorted(self.vocab.items())}, f, ensure_ascii=False, indent=0)
        with open(merges_path, "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n")
            f.writelines(f"{to_text(a)} {to_text(b)}\n" for a, b in self.merges)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: special tokens as their ids, every other span pre-tokenized with
        GPT-2's regex and each pre-token merged by BPE (its ids cached, as words recur)."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected str, got {type(text).__name__}")
        ids: list[int] = []
        parts = self._special_split.split(text) if self._special_split else [text]
        for k, part in enumerate(parts):
            if k % 2:  # split() puts the specials it matched at the odd indices
                ids.append(self._special_ids[part])
                continue
            for piece in _PRETOKEN.findall(part):
                piece_ids = self._cache.get(piece)
                if piece_ids is None:
                    if len(self._cache) >= _CACHE_LIMIT:
                        self._cache.clear()
                    piece_ids = self._cache[piece] = self._bpe(piece.encode("utf-8"))
                ids.extend(piece_ids)
        return ids

    def _bpe(self, token: bytes) -> tuple[int, ...]:
        """Merge the bytes of one pre-token: repeatedly apply the earliest-learned merge present
        (all its occurrences, left to right), as training did, until no adjacent pair is a merge."""
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 1:
            pair = min(zip(parts, parts[1:]), key=lambda p: self._ranks.get(p, _NOT_A_MERGE))
            if pair not in self._ranks:
                break
            out, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
                    out.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            parts = out
        return tuple(self._id_of[p] for p in parts)

    def encode_iterable(self, iterable: Iterable[str]) -> Iterator[int]:
        """Yield the ids of the concatenated strings (e.g. a file's lines) one by one, holding only a
        short tail of the text in memory: ids are exactly ``encode("".join(iterable))``'s.

        A string is encoded up to its last safe cut (a non-space before a space, inside no special
        token, with enough text after it to tell), and the rest waits for the next string. Cutting
        at each line end instead would split "\\n\\n" between lines, which GPT-2 encodes as one token.
        Only text with no space for a long stretch (one huge "word") is held whole.
        """
        margin = max(map(len, self.special_tokens), default=1) - 1  # a special starting before a cut may end after it
        pending = ""
        for piece in iterable:
            if not isinstance(piece, str):
                raise TypeError(f"iterable: expected strings, got {type(piece).__name__}")
            pending += piece
            end = len(pending) - margin
            while (m := _LAST_CUT.search(pending, 0, max(0, end))) and _straddled(pending, m.start(), self.special_tokens):
                end = m.start()
            if m:
                yield from self.encode(pending[: m.start()])
                pending = pending[m.start() :]
        yield from self.encode(pending)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``. A token may end inside a UTF-8 character, so the bytes of the ids
        are joined first and decoded once; bytes that are not valid UTF-8 (a sequence cut short)
        become U+FFFD instead of raising."""
        ids = list(ids.tolist() if hasattr(ids, "tolist") else ids)
        try:
            data = b"".join([self.vocab[i] for i in ids])
        except (KeyError, TypeError):
            bad = next(i for i in ids if not isinstance(i, Hashable) or i not in self.vocab)
            raise ValueError(f"ids: {bad!r} is not a token id of this vocabulary") from None
        return data.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# GPT-2's own tokenizer, from the ranks labkit ships
# ---------------------------------------------------------------------------------------------

GPT2_RANKS = Path(__file__).parent / "assets" / "gpt2" / "gpt2.tiktoken"  # openai-whisper's copy, MIT (README beside it)
GPT2_EOT = "<|endoftext|>"


def read_ranks(path: str | os.PathLike = GPT2_RANKS) -> dict[bytes, int]:
    """A tiktoken ranks file (one ``base64-token rank`` per line, as ``tiktoken.load.load_tiktoken_bpe``
    reads it): token bytes -> rank, which is also the token's id."""
    import base64

    ranks = {}
    for n, line in enumerate(Path(path).read_text(encoding="ascii").splitlines(), 1):
        if line:
            token, _, rank = line.partition(" ")
            if not rank.isdigit():
                raise ValueError(f"path={str(path)!r}: line {n} is not 'base64-token rank'")
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merges behind a ranks table, recovered as tiktoken's educational module does: a token's merge
    is the split into two that BPE with only the lower-ranked tokens leaves it in."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], rank))
            if ranks.get(parts[best] + parts[best + 1], rank) >= rank:
                raise ValueError(f"ranks: {token!r} (rank {rank}) cannot be built from lower-ranked tokens")
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        merges.append((parts[0], parts[1]))
    return merges


@functools.lru_cache(maxsize=1)
def _gpt2_vocab_and_merges() -> tuple[dict[int, bytes], tuple[tuple[bytes, bytes], ...]]:
    # recovering 50,000 merges takes a few seconds: once per process
    ranks = read_ranks()
    vocab = {i: t for t, i in ranks.items()} | {len(ranks): GPT2_EOT.encode()}
    return vocab, tuple(merges_from_ranks(ranks))


def gpt2_tokenizer() -> Tokenizer:
    """GPT-2's tokenizer (50,257 tokens: 50,256 merged from its ranks, ``<|endoftext|>`` = 50256),
    offline, encoding exactly as ``tiktoken``'s ``gpt2`` encoding does (tests/test_tokenizer.py).
    Each call returns a new tokenizer (with an empty pre-token cache)."""
    vocab, merges = _gpt2_vocab_and_merges()
    return Tokenizer(vocab, list(merges), [GPT2_EOT])
