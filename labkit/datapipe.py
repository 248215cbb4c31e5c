"""Chapter 11's data pipeline: from raw documents to the batches a training loop consumes.

Every stage works offline, on a real corpus that ships with every Python installation:

* :func:`corpus_documents`: CPython's English help topics and the licence files of the installed
  packages, as :class:`Document` records (``source``, ``text``), sorted by source;
* cleaning: :func:`normalize` (Unicode NFKC, line endings, whitespace) and quality filters that each
  say why they reject a document (:class:`LengthFilter`, :class:`AlphaFilter`,
  :class:`RepetitionFilter`), composed by :func:`clean` with a report of what each removed;
* exact deduplication, :func:`exact_dedup`: a hash of the normalised text, first occurrence kept;
* near-duplicate detection built here: word :func:`shingles`, :func:`minhash_signatures` with
  universal hashing modulo the Mersenne prime 2^61 - 1, :func:`jaccard_estimate`,
  :func:`lsh_candidates` (banding), and :func:`near_duplicates`, which verifies candidates with the
  exact Jaccard similarity and clusters them with union-find;
* packing, :func:`pack`: documents tokenized (in worker processes for large inputs) into one flat
  file of token ids, each document followed by the end-of-text token, in the narrowest dtype
  (:func:`token_dtype`); :class:`PackedTokens` / :func:`read_tokens` map it back read-only, and
  chapter 00's :func:`labkit.data.get_batch` samples from it directly;
* feeding the model: :class:`TokenWindows` (a map-style ``Dataset`` of ``(x, y)`` windows),
  :class:`ResumableSampler` (seed, epoch, position; a resumed run sees the same next batch),
  :func:`make_loader`, :func:`loader_throughput` and :func:`time_blocked_on_data`;
* :func:`records_to_documents`: how a streamed Hugging Face data set enters the same pipeline.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import itertools
import json
import math
import multiprocessing
import os
import re
import time
import unicodedata
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from labkit.tokenizer import Tokenizer

EOT = "<|endoftext|>"  # GPT-2's end-of-text token, the separator `pack` writes after each document

# ---------------------------------------------------------------------------------------------
# Argument checks (labkit's convention: the message names the argument and what was expected)
# ---------------------------------------------------------------------------------------------


def _check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    # bool is an int subclass, but True as a count is always a mistake
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r}: expected an int")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value}: expected an int >= {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value}: expected an int <= {maximum}")
    return value


def _check_fraction(name: str, value, *, open_low: bool = False) -> float:
    if not isinstance(value, (int, float, np.floating)) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: expected a number")
    value = float(value)
    if not (0.0 < value <= 1.0 if open_low else 0.0 <= value <= 1.0):
        raise ValueError(f"{name}={value}: expected a number in {'(0' if open_low else '[0'}, 1]")
    return value


def _check_seconds(name: str, value) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: expected a number of seconds")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value}: expected a finite number of seconds >= 0")
    return float(value)


# ---------------------------------------------------------------------------------------------
# The corpus
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    """One document and where it came from (``source``), so every stage's report can name what it
    removed and a packed token can be traced back to its file."""

    source: str
    text: str

    def __post_init__(self):
        if not isinstance(self.source, str):
            raise TypeError(f"source={self.source!r}: expected a str")
        if not isinstance(self.text, str):
            raise TypeError(f"text: expected a str, got {type(self.text).__name__} (source {self.source!r})")


def _as_documents(documents, name: str = "documents") -> list[Document]:
    """Accept Documents or plain strings (named ``doc0``, ``doc1``, ... by position), so a list of
    strings can be fed to any stage directly."""
    if isinstance(documents, (str, bytes, Document)) or not isinstance(documents, Iterable):
        raise TypeError(f"{name}: expected an iterable of Document or str, got {type(documents).__name__}")
    out = []
    for i, doc in enumerate(documents):
        if isinstance(doc, Document):
            out.append(doc)
        elif isinstance(doc, str):
            out.append(Document(f"doc{i}", doc))
        else:
            raise TypeError(f"{name}[{i}]: expected a Document or str, got {type(doc).__name__}")
    return out


# Licence files as projects name them (LICENSE, LICENSE.txt, LICENCE, COPYING.rst, NOTICE,
# LICENSE-MIT, LICENSE_APACHE, ...). Upper case only: lower-case names such as
# jupyterlab_server's licenses_app.py are code, not licence texts.
_LICENSE_NAME = re.compile(r"(?:LICEN[CS]E|COPYING|NOTICE)S?(?:[._-][\w.-]*)?")
_NOT_TEXT_SUFFIXES = {".py", ".pyc", ".pyi", ".so", ".pyd", ".dll", ".dylib", ".json", ".html", ".htm", ".xml"}
_MAX_LICENSE_BYTES = 1 << 20  # a "licence" bigger than this is a bundle of something else


def corpus_documents(topics: bool = True, licenses: bool = True) -> list[Document]:
    """A real corpus every Python installation already has, so the chapter needs no download.

    * CPython's help topics (``pydoc_data.topics.topics``, what ``help("FORMATTING")`` shows):
      about 80 documents of English prose and grammar, source ``"pydoc:<topic>"``;
    * the licence files (``LICENSE*``, ``LICENCE*``, ``COPYING*``, ``NOTICE*``) of every installed
      distribution, found through ``importlib.metadata``, source ``"license:<name>-<version>/<path>"``.
      Most packages ship a copy of the same few licences (MIT, BSD, Apache-2.0), often with only the
      copyright line changed: a realistic mix of exact and near duplicates for deduplication.

    Sorted by source, so the same installation always gives the same corpus in the same order
    (``importlib.metadata`` lists distributions in ``sys.path`` order, which varies). The licence
    part depends on what is installed, so its size differs between machines. Files that are not
    UTF-8, missing although listed in a distribution's RECORD, or over 1 MiB are skipped; a
    distribution found twice (two ``sys.path`` entries) counts once per distinct text.
    """
    if not isinstance(topics, bool) or not isinstance(licenses, bool):
        raise TypeError(f"topics={topics!r}, licenses={licenses!r}: expected booleans")
    found: dict[tuple[str, str], Document] = {}
    if topics:
        try:
            from pydoc_data.topics import topics as help_topics
        except ImportError:  # some distributions' minimal Pythons leave pydoc_data out
            help_topics = {}
        for name, text in help_topics.items():
            found[(f"pydoc:{name}", text)] = Document(f"pydoc:{name}", text)
    if licenses:
        for dist in importlib.metadata.distributions():
            name = dist.metadata.get("Name") or "unknown"
            for file in dist.files or ():
                if not _LICENSE_NAME.fullmatch(file.name) or Path(file.name).suffix.lower() in _NOT_TEXT_SUFFIXES:
                    continue
                path = Path(dist.locate_file(file))
                try:
                    if path.stat().st_size > _MAX_LICENSE_BYTES:
                        continue
                    text = path.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                source = f"license:{name}-{dist.version}/{file.as_posix()}"
                found[(source, text)] = Document(source, text)
    return [found[key] for key in sorted(found)]


# ---------------------------------------------------------------------------------------------
# Cleaning: normalisation and quality filters
# ---------------------------------------------------------------------------------------------

_NORMAL_FORMS = ("NFC", "NFKC")
_LINE_BREAKS = re.compile(r"\r\n|[\r\x0b\x0c\x85\u2028\u2029]")
# Control characters (category Cc) other than tab and newline, and the byte-order mark: invisible,
# and they would make copies of a text that differ only in them hash differently.
_INVISIBLE = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f\ufeff]")
_INNER_SPACE = re.compile(r"(?<=\S)[^\S\n]+(?=\S)")
_TRAILING_SPACE = re.compile(r"[^\S\n]+$", re.MULTILINE)
_BLANK_LINES = re.compile(r"\n{3,}")


def normalize(text: str, form: str = "NFKC") -> str:
    """Canonical text, so that copies differing only in encoding details become identical.

    1. Line breaks (``\\r\\n``, ``\\r``, U+2028, ...) become ``\\n``; other control characters
       and the byte-order mark are removed. This comes first: removing a character between a
       letter and a combining accent after composing would leave a composable pair behind, and
       normalising twice would then change the text again.
    2. Unicode normalisation: ``"NFC"`` composes ``e`` + U+0301 into ``é`` (same text, other code
       points); ``"NFKC"`` (the default) also folds compatibility characters: the ligature ``ﬁ``
       to ``fi``, full-width ``Ａ`` to ``A``, the no-break space to a space.
    3. Whitespace: runs of spaces and tabs between words become one space, trailing spaces are
       removed, three or more newlines become two (one blank line), and blank lines at the start
       and end are removed. Leading indentation is kept, because in code it is meaning (the help
       topics hold Python examples); column alignment inside a line is lost.

    The result is a fixed point: ``normalize(normalize(t)) == normalize(t)``. A text of only
    whitespace becomes ``""``.
    """
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, got {type(text).__name__}")
    if form not in _NORMAL_FORMS:
        raise ValueError(f"form={form!r}: expected one of {_NORMAL_FORMS}")
    text = _INVISIBLE.sub("", _LINE_BREAKS.sub("\n", text))
    text = unicodedata.normalize(form, text)
    text = _INNER_SPACE.sub(" ", text)
    text = _TRAILING_SPACE.sub("", text)
    text = _BLANK_LINES.sub("\n\n", text)
    return text.strip("\n")


@dataclass(frozen=True)
class LengthFilter:
    """Reject documents shorter than ``min_chars`` (a stub such as "See LICENSE.txt" teaches a
    model nothing) or longer than ``max_chars`` (usually a data dump, not prose)."""

    min_chars: int = 200
    max_chars: int = 1_000_000
    name = "length"

    def __post_init__(self):
        _check_int("min_chars", self.min_chars, 0)
        _check_int("max_chars", self.max_chars, 1)
        if self.max_chars < self.min_chars:
            raise ValueError(f"max_chars={self.max_chars}: expected >= min_chars={self.min_chars}")

    def __call__(self, text: str) -> str | None:
        if len(text) < self.min_chars:
            return f"{len(text)} characters < min_chars={self.min_chars}"
        if len(text) > self.max_chars:
            return f"{len(text)} characters > max_chars={self.max_chars}"
        return None


@dataclass(frozen=True)
class AlphaFilter:
    """Reject documents whose non-whitespace characters are mostly not letters (tables of numbers,
    base64, minified code): Gopher's rule of thumb that natural language is mostly letters.
    Letters of any script count (``str.isalpha``), so Chinese or Greek prose passes."""

    min_ratio: float = 0.6
    name = "alpha"

    def __post_init__(self):
        _check_fraction("min_ratio", self.min_ratio)

    def __call__(self, text: str) -> str | None:
        visible = [c for c in text if not c.isspace()]
        if not visible:
            return "no visible characters"
        ratio = sum(c.isalpha() for c in visible) / len(visible)
        if ratio < self.min_ratio:
            return f"letter ratio {ratio:.2f} < min_ratio={self.min_ratio}"
        return None


@dataclass(frozen=True)
class RepetitionFilter:
    """Reject boilerplate: documents in which more than ``max_duplicate_lines`` of the non-blank
    lines repeat an earlier line of the same document (menus, log spam, a template filled in many
    times). Repeated text makes a model memorise instead of generalise (Gopher uses 0.3)."""

    max_duplicate_lines: float = 0.3
    name = "repetition"

    def __post_init__(self):
        _check_fraction("max_duplicate_lines", self.max_duplicate_lines)

    def __call__(self, text: str) -> str | None:
        lines = [line.strip() for line in text.split("\n") if line.strip()]
        if not lines:
            return None  # nothing to repeat; empty documents are LengthFilter's business
        fraction = 1 - len(set(lines)) / len(lines)
        if fraction > self.max_duplicate_lines:
            return f"{fraction:.2f} of lines are repeats > max_duplicate_lines={self.max_duplicate_lines}"
        return None


def default_filters() -> list[Callable[[str], str | None]]:
    """The filters :func:`clean` applies when given none: length, then letters, then repetition."""
    return [LengthFilter(), AlphaFilter(), RepetitionFilter()]


def _filter_name(f) -> str:
    return getattr(f, "name", None) or getattr(f, "__name__", None) or type(f).__name__


@dataclass
class CleanReport:
    """What :func:`clean` did: ``removed`` maps each filter's name to how many documents it was the
    first to reject (so the counts add up to ``documents - kept``); ``rejections`` lists
    ``(source, filter name, reason)`` for each."""

    documents: int
    kept: int
    removed: dict[str, int]
    rejections: list[tuple[str, str, str]] = field(repr=False)


@dataclass
class CleanResult:
    kept: list[Document]
    report: CleanReport


def clean(documents, filters: Sequence[Callable[[str], str | None]] | None = None, form: str = "NFKC") -> CleanResult:
    """Normalise every document (:func:`normalize`), then keep those no filter rejects.

    A filter is any callable taking the normalised text and returning ``None`` to keep it or a
    string saying why not; its report name is its ``name`` attribute (or function name). Filters
    run in order and the first rejection counts, so cheap filters go first. The kept documents
    carry their normalised text, which is what exact deduplication then compares.
    """
    docs = _as_documents(documents)
    filters = default_filters() if filters is None else list(filters)
    for i, f in enumerate(filters):
        if not callable(f):
            raise TypeError(f"filters[{i}]={f!r}: expected a callable text -> reason or None")
    names = [_filter_name(f) for f in filters]
    if len(set(names)) != len(names):
        raise ValueError(f"filters: names {names} repeat; the report counts by name")
    removed = dict.fromkeys(names, 0)
    rejections, kept = [], []
    for doc in docs:
        text = normalize(doc.text, form)
        for f, name in zip(filters, names):
            reason = f(text)
            if reason is not None:
                removed[name] += 1
                rejections.append((doc.source, name, str(reason)))
                break
        else:
            kept.append(Document(doc.source, text))
    return CleanResult(kept, CleanReport(len(docs), len(kept), removed, rejections))


# ---------------------------------------------------------------------------------------------
# Exact deduplication
# ---------------------------------------------------------------------------------------------


def text_hash(text: str, form: str = "NFKC") -> bytes:
    """128-bit BLAKE2b digest of the normalised text: the key of exact deduplication. Hashing
    instead of comparing texts keeps one small key per document (a streaming pass over billions
    of documents keeps a set of digests, not the texts); at 128 bits, a collision among even
    10^12 documents has probability about 10^-15."""
    return hashlib.blake2b(normalize(text, form).encode("utf-8"), digest_size=16).digest()


@dataclass
class DedupResult:
    """Documents kept (first occurrences, in input order) and ``duplicates``: ``(removed index,
    index of the kept document it duplicates)`` pairs, indices into the input."""

    kept: list[Document]
    duplicates: list[tuple[int, int]]

    @property
    def removed(self) -> int:
        return len(self.duplicates)


def exact_dedup(documents, form: str = "NFKC") -> DedupResult:
    """Drop every document whose normalised text (:func:`text_hash`) was seen before, keeping the
    first occurrence: copies of the same licence that differ only in line endings, trailing spaces
    or Unicode form are one document. Cleaned documents are normalised already; normalising again
    changes nothing, so raw documents can be passed too."""
    docs = _as_documents(documents)
    first: dict[bytes, int] = {}
    kept, duplicates = [], []
    for i, doc in enumerate(docs):
        key = text_hash(doc.text, form)
        if key in first:
            duplicates.append((i, first[key]))
        else:
            first[key] = i
            kept.append(doc)
    return DedupResult(kept, duplicates)


# ---------------------------------------------------------------------------------------------
# Near duplicates: shingles, MinHash, LSH, verification and clustering
# ---------------------------------------------------------------------------------------------

MERSENNE_61 = (1 << 61) - 1  # p of the universal hash (a*x + b) mod p, and the "empty set" value
_P = np.uint64(MERSENNE_61)
_M29 = np.uint64((1 << 29) - 1)
_M32 = np.uint64((1 << 32) - 1)
_S29, _S32, _S61 = np.uint64(29), np.uint64(32), np.uint64(61)  # shift counts of the same dtype, so numpy stays in uint64
_WORD = re.compile(r"\w+")
_GOLDEN32 = np.uint32(0x9E3779B1)  # 2^32 / golden ratio, odd: multiplying by it is a bijection mod 2^32
# Shingles permuted at a time: 512 x 128 uint64 = 512 KiB per buffer, which stays in cache (measured
# 5-10x slower at 4096 rows, whose 4 MiB buffers do not)
_MINHASH_ROWS = 512


def hash32(data: str | bytes) -> int:
    """A 32-bit hash of a string (its UTF-8 bytes): the first 4 bytes of BLAKE2b, little-endian.
    A cryptographic hash, so it is the same on every machine and Python run (Python's ``hash`` of a
    str is salted per process) and distinct shingles rarely collide (1 in 2^32 per pair)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"data: expected str or bytes, got {type(data).__name__}")
    return int.from_bytes(hashlib.blake2b(data, digest_size=4).digest(), "little")


@functools.lru_cache(maxsize=1 << 17)
def _word_hash(word: str) -> int:
    """:func:`hash32` of a word, cached across documents: a corpus repeats a few tens of thousands
    of words millions of times, so most words of a document were hashed for an earlier one."""
    return hash32(word)


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finaliser, a bijection that spreads every input bit over the output;
    it turns the chained word hashes in :func:`shingles` into a well-mixed hash of the n-gram."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def shingles(text: str, n: int = 5) -> np.ndarray:
    """The set of word ``n``-grams of ``text``, as sorted unique 32-bit hashes (``uint32``).

    Words are runs of Unicode word characters (``\\w+``), lower-cased, so punctuation, case and
    line wrapping do not matter: two copies of a licence re-wrapped at another width have the same
    shingles. Word 5-grams (the default, as in Lee et al. 2022's deduplication of C4) are long
    enough that sharing many of them means sharing text, not just vocabulary. A text with fewer
    than ``n`` words is one shingle (all its words); a text with no words has none.

    Each word is hashed once (:func:`hash32`); an n-gram's hash chains its words' hashes through a
    multiply and :func:`_fmix32`, vectorised over all positions, which is order-sensitive ("a b"
    and "b a" differ) and costs a few numpy passes instead of one Python hash per n-gram.
    """
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, got {type(text).__name__}")
    n = _check_int("n", n, 1)
    words = _WORD.findall(text.lower())
    if not words:
        return np.empty(0, np.uint32)
    ids = np.array(list(map(_word_hash, words)), dtype=np.uint32)
    n = min(n, len(ids))
    m = len(ids) - n + 1
    h = _fmix32(ids[:m].copy())
    for i in range(1, n):
        h = _fmix32(h * _GOLDEN32 + ids[i : i + m])  # uint32 arithmetic wraps mod 2^32, as intended
    return np.unique(h)


def minhash_permutations(num_perm: int = 128, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The ``num_perm`` hash functions ``h_k(x) = (a_k x + b_k) mod p``, p = 2^61 - 1, as arrays
    ``a`` (in [1, p)) and ``b`` (in [0, p)) drawn from ``seed``. This is Carter and Wegman's
    universal family: for a random (a, b), two different 32-bit inputs collide with probability
    at most 1/p, and the minimum over a set is nearly equally likely to be any of its elements,
    which is what MinHash needs to estimate the Jaccard similarity. p is a Mersenne
    prime so that reducing modulo p needs only shifts and masks."""
    num_perm = _check_int("num_perm", num_perm, 1)
    seed = _check_int("seed", seed, 0)
    rng = np.random.default_rng(seed)
    a = rng.integers(1, MERSENNE_61, num_perm, dtype=np.uint64)
    b = rng.integers(0, MERSENNE_61, num_perm, dtype=np.uint64)
    return a, b


def _universal_hash(x: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``(a * x + b) mod p`` exactly, for uint64 ``x`` < 2^32 (a column) and ``a``, ``b`` < p (a
    row), without 128-bit integers.

    ``a * x`` reaches 2^93, so ``a`` is split as ``a_hi 2^32 + a_lo``: ``a_lo x`` < 2^64 fits, and
    ``t = a_hi x`` < 2^61 times 2^32 folds with 2^61 = 1 (mod p), ``t 2^32 = (t >> 29) 2^61 +
    (t mod 2^29) 2^32 = (t >> 29) + (t mod 2^29) 2^32``. A uint64 ``y`` reduces the same way,
    ``(y mod 2^61) + (y >> 61)``, which leaves at most one p to subtract, and
    ``min(y, y - p)`` does that in unsigned arithmetic (``y - p`` wraps to a huge value when
    ``y < p``). (datasketch's "legacy" scheme instead computes ``a * x + b`` in wrapping uint64
    arithmetic, which is not the universal family it names.)

    This is the hot loop of :func:`minhash_signatures`, so it works in place on two buffers:
    numpy passes over small blocks that stay in cache cost less than allocating a fresh array
    per operation (1.6x faster, measured on the course corpus).
    """
    low = x * (a & _M32)
    t = x * (a >> _S32)
    high = t >> _S29
    t &= _M29
    t <<= _S32
    high += t  # = a_hi x 2^32 (mod p), < 2^62
    y = low & _P
    low >>= _S61
    y += low
    y += high
    y += b  # < 2^61 + 8 + 2^62 + 2^61 < 2^64: no overflow
    low = y & _P
    y >>= _S61
    low += y  # < p + 8
    np.subtract(low, _P, out=y)
    return np.minimum(low, y, out=low)


def _as_shingle_array(shingle_set, name: str) -> np.ndarray:
    """A set of shingles as uint64 values < 2^32: hashes as an integer array (what
    :func:`shingles` returns), or str/bytes items hashed with :func:`hash32`."""
    if isinstance(shingle_set, np.ndarray):
        if shingle_set.ndim != 1 or (shingle_set.size and not np.issubdtype(shingle_set.dtype, np.integer)):
            raise TypeError(f"{name}: expected a 1-D integer array of 32-bit shingle hashes, got {shingle_set.dtype} {shingle_set.shape}")
        values = shingle_set
    else:
        if isinstance(shingle_set, (str, bytes)) or not isinstance(shingle_set, Iterable):
            raise TypeError(f"{name}: expected an array of shingle hashes or an iterable of str/bytes shingles")
        items = list(shingle_set)
        if all(isinstance(s, (str, bytes)) for s in items):
            values = np.fromiter((hash32(s) for s in items), np.uint64, len(items))
        elif all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in items):
            values = np.array(items, dtype=object)
        else:
            raise TypeError(f"{name}: expected shingles that are all str/bytes or all int hashes")
    # uint32 (what shingles returns) is in range by its type; anything else is checked.
    if values.dtype != np.uint32 and values.size and (int(values.min()) < 0 or int(values.max()) > 0xFFFFFFFF):
        raise ValueError(f"{name}: shingle hashes must lie in [0, 2^32); hash longer keys with hash32")
    # No np.unique: a repeated shingle cannot change a minimum, so a multiset gives the set's signature.
    return values.astype(np.uint64)


def minhash_signatures(shingle_sets: Sequence, num_perm: int = 128, seed: int = 0) -> np.ndarray:
    """MinHash signatures of many shingle sets at once: a ``[len(shingle_sets), num_perm]`` uint64
    array whose entry ``[d, k]`` is the minimum of hash function ``k``
    (:func:`minhash_permutations`) over set ``d``.

    Two sets agree in entry ``k`` exactly when the element of their union that hash ``k`` ranks
    first lies in both. Were each hash a random permutation, that would happen with probability
    J = |A ∩ B| / |A ∪ B|, and the fraction of agreeing entries would estimate J with standard
    deviation sqrt(J (1 - J) / num_perm); the universal family comes close enough that the
    tests measure exactly that spread.

    All sets' shingles are concatenated and permuted in blocks of rows, and each set's minimum
    taken with ``np.minimum.reduceat``, so the cost is numpy passes over (shingles x num_perm),
    not a Python loop per document. An empty set's signature is all p = 2^61 - 1, a value no hash
    takes: two empty sets estimate J = 1, an empty and a non-empty one 0.
    """
    if isinstance(shingle_sets, (str, bytes, np.ndarray)) or not isinstance(shingle_sets, Sequence):
        raise TypeError("shingle_sets: expected a sequence (e.g. a list) of shingle sets, one per document")
    a, b = minhash_permutations(num_perm, seed)
    arrays = [_as_shingle_array(s, f"shingle_sets[{i}]") for i, s in enumerate(shingle_sets)]
    out = np.full((len(arrays), len(a)), _P, dtype=np.uint64)
    if not arrays:
        return out
    flat = np.concatenate(arrays)
    owner = np.repeat(np.arange(len(arrays)), [len(x) for x in arrays])
    for start in range(0, len(flat), _MINHASH_ROWS):
        x, docs = flat[start : start + _MINHASH_ROWS, None], owner[start : start + _MINHASH_ROWS]
        values = _universal_hash(x, a, b)
        # a block holds consecutive runs of rows of the same document; reduce each run to its minimum
        runs = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
        run_docs = docs[runs]
        out[run_docs] = np.minimum(out[run_docs], np.minimum.reduceat(values, runs, axis=0))
    return out


def minhash_signature(shingle_set, num_perm: int = 128, seed: int = 0) -> np.ndarray:
    """The MinHash signature (``num_perm`` uint64 values) of one set of shingles: an array of
    32-bit hashes (:func:`shingles`) or an iterable of str/bytes shingles. See
    :func:`minhash_signatures`, which does many sets at once."""
    return minhash_signatures([shingle_set], num_perm, seed)[0]


def _check_signatures(signatures, name: str = "signatures") -> np.ndarray:
    sig = np.asarray(signatures)
    if sig.ndim != 2 or not np.issubdtype(sig.dtype, np.integer):
        raise ValueError(f"{name}: expected a 2-D integer array [documents, num_perm], got {sig.dtype} {sig.shape}")
    return sig


def jaccard_estimate(sig_a, sig_b) -> float:
    """The fraction of positions where two MinHash signatures agree: an estimate of the Jaccard
    similarity of the two sets (signatures made with the same ``num_perm`` and ``seed``)."""
    a, b = np.asarray(sig_a), np.asarray(sig_b)
    if a.ndim != 1 or a.shape != b.shape or not a.size:
        raise ValueError(f"sig_a, sig_b: expected two 1-D signatures of equal, non-zero length, got shapes {a.shape} and {b.shape}")
    return float(np.count_nonzero(a == b) / a.size)


def jaccard(set_a, set_b) -> float:
    """The exact Jaccard similarity |A ∩ B| / |A ∪ B| of two sets (Python sets, or arrays of
    shingle hashes, duplicates ignored); 1.0 for two empty sets, which are equal."""
    if isinstance(set_a, (set, frozenset)) and isinstance(set_b, (set, frozenset)):
        union = len(set_a | set_b)
        return 1.0 if union == 0 else len(set_a & set_b) / union
    a, b = np.unique(np.asarray(set_a)), np.unique(np.asarray(set_b))
    union = len(np.union1d(a, b))
    return 1.0 if union == 0 else len(np.intersect1d(a, b, assume_unique=True)) / union


def _sorted_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity of two sorted arrays of unique values (what :func:`shingles` returns):
    the intersection by binary search of ``a``'s values in ``b``, the union as
    ``|a| + |b| - |a ∩ b|``, so the two are never concatenated and sorted again."""
    if not len(a) or not len(b):
        return 1.0 if len(a) == len(b) else 0.0
    where = np.searchsorted(b, a)
    common = int(np.count_nonzero(b[np.minimum(where, len(b) - 1)] == a))
    return common / (len(a) + len(b) - common)


def candidate_probability(s, bands: int, rows: int):
    """Probability that two sets with Jaccard similarity ``s`` become LSH candidates:
    ``1 - (1 - s^rows)^bands``. A band matches when all its ``rows`` entries agree (``s^rows``);
    a pair is a candidate when at least one of ``bands`` independent bands matches. The S-shaped
    curve rises steepest near ``(1/bands)^(1/rows)``: pairs well above it are almost always found,
    pairs well below almost never, so only a few pairs need the exact check."""
    bands = _check_int("bands", bands, 1)
    rows = _check_int("rows", rows, 1)
    s_arr = np.asarray(s, dtype=float)
    if np.any((s_arr < 0) | (s_arr > 1)):
        raise ValueError(f"s={s!r}: expected similarities in [0, 1]")
    p = 1 - (1 - s_arr**rows) ** bands
    return float(p) if p.ndim == 0 else p


def choose_bands(threshold: float, num_perm: int = 128, min_probability: float = 0.99) -> tuple[int, int]:
    """``(bands, rows)`` with ``bands * rows <= num_perm``: the largest ``rows`` (the fewest false
    candidates) for which a pair exactly at ``threshold`` is still a candidate with probability
    >= ``min_probability``. A missed near duplicate stays in the training data; an extra candidate
    only costs one exact Jaccard computation, hence the bias towards recall."""
    threshold = _check_fraction("threshold", threshold, open_low=True)
    num_perm = _check_int("num_perm", num_perm, 1)
    min_probability = _check_fraction("min_probability", min_probability)
    best = (num_perm, 1)
    for rows in range(1, num_perm + 1):
        bands = num_perm // rows
        if candidate_probability(threshold, bands, rows) >= min_probability:
            best = (bands, rows)
    return best


def lsh_candidates(signatures, bands: int, rows: int) -> np.ndarray:
    """Candidate pairs of locality-sensitive hashing by banding: the signature's first
    ``bands * rows`` entries are cut into ``bands`` bands of ``rows`` entries, and two documents
    are a candidate pair when they are identical in at least one band (they fall into the same
    bucket of that band's table). Returns a ``[pairs, 2]`` int64 array of ``(i, j)``, ``i < j``,
    sorted and unique: comparing all n^2/2 pairs becomes comparing only the candidates.

    Buckets are exact band contents (grouped by ``np.unique`` over each band's bytes), not a hash
    of them, so two different band contents never share a bucket by accident (datasketch's
    ``MinHashLSH`` also keys its buckets by the band's bytes). A bucket of m identical bands
    yields m (m - 1) / 2 pairs, which is why exact copies are removed first.
    """
    sig = _check_signatures(signatures)
    bands = _check_int("bands", bands, 1)
    rows = _check_int("rows", rows, 1)
    if bands * rows > sig.shape[1]:
        raise ValueError(f"bands={bands}, rows={rows}: bands * rows = {bands * rows} exceeds num_perm = {sig.shape[1]}")
    n = sig.shape[0]
    found = []
    for band in range(bands):
        block = np.ascontiguousarray(sig[:, band * rows : (band + 1) * rows])
        keys = block.view(np.dtype((np.void, block.dtype.itemsize * rows))).ravel()
        _, bucket = np.unique(keys, return_inverse=True)
        order = np.argsort(bucket, kind="stable")  # members of a bucket end up adjacent, ascending
        sorted_bucket = bucket[order]
        starts = np.flatnonzero(np.r_[True, sorted_bucket[1:] != sorted_bucket[:-1]])
        sizes = np.diff(np.r_[starts, n])
        for start, size in zip(starts[sizes > 1], sizes[sizes > 1]):
            members = order[start : start + size]
            i, j = np.triu_indices(size, k=1)
            found.append(members[i] * n + members[j])  # one int per pair, so np.unique can merge bands
    if not found:
        return np.empty((0, 2), dtype=np.int64)
    codes = np.unique(np.concatenate(found).astype(np.int64))
    return np.stack([codes // n, codes % n], axis=1)


class _UnionFind:
    """Disjoint sets over 0..n-1 with path halving; the root of a set is its smallest member, so
    each cluster is represented by its first document."""

    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(self, i: int, j: int) -> None:
        ri, rj = self.find(i), self.find(j)
        if ri != rj:
            lo, hi = min(ri, rj), max(ri, rj)
            self.parent[hi] = lo


@dataclass
class NearDupResult:
    """What :func:`near_duplicates` found. ``clusters`` are lists of input indices (size >= 2,
    ascending; the first is the one kept); ``pairs`` are the candidate pairs whose exact Jaccard
    similarity reached the threshold, ``(i, j, similarity)``, among those checked (a pair already
    in one cluster is not checked: it would change no cluster); ``candidates`` counts the pairs LSH
    proposed; ``seconds`` times each stage."""

    kept: list[Document]
    clusters: list[list[int]]
    pairs: list[tuple[int, int, float]]
    candidates: int
    bands: int
    rows: int
    seconds: dict[str, float]

    @property
    def removed(self) -> list[int]:
        return sorted(i for cluster in self.clusters for i in cluster[1:])


def near_duplicates(
    documents,
    threshold: float = 0.8,
    *,
    num_perm: int = 128,
    bands: int | None = None,
    rows: int | None = None,
    ngram: int = 5,
    seed: int = 0,
) -> NearDupResult:
    """Find and remove near duplicates: documents whose word ``ngram`` shingle sets have Jaccard
    similarity >= ``threshold`` with another document.

    1. :func:`shingles` of each document; 2. :func:`minhash_signatures`; 3. :func:`lsh_candidates`
    with ``bands`` x ``rows`` (default :func:`choose_bands` for the threshold); 4. each candidate
    pair verified with the exact Jaccard similarity of its shingle sets, because the estimate
    from 128 permutations is off by ±0.035 (one standard deviation) near 0.8; 5. verified pairs
    joined by union-find into clusters, of which the first document (in input order) is kept.

    Clustering is transitive: if A ~ B and B ~ C, all three form one cluster even when A and C
    are less similar than the threshold (a chain of edits). Documents without shingles (no words)
    are never near duplicates of anything here; exact deduplication handles identical ones.
    """
    docs = _as_documents(documents)
    threshold = _check_fraction("threshold", threshold, open_low=True)
    num_perm = _check_int("num_perm", num_perm, 1)
    ngram = _check_int("ngram", ngram, 1)
    seed = _check_int("seed", seed, 0)
    if (bands is None) != (rows is None):
        raise ValueError(f"bands={bands}, rows={rows}: give both or neither")
    if bands is None:
        bands, rows = choose_bands(threshold, num_perm)
    bands, rows = _check_int("bands", bands, 1), _check_int("rows", rows, 1)
    if bands * rows > num_perm:
        raise ValueError(f"bands={bands}, rows={rows}: bands * rows = {bands * rows} exceeds num_perm={num_perm}")

    seconds = {}
    t0 = time.perf_counter()
    sets = [shingles(d.text, ngram) for d in docs]
    t1 = time.perf_counter()
    signatures = minhash_signatures(sets, num_perm, seed)
    t2 = time.perf_counter()
    has_words = np.array([len(s) > 0 for s in sets], dtype=bool)
    index = np.flatnonzero(has_words)  # empty sets all share the "empty" signature; leave them out
    candidates = index[lsh_candidates(signatures[index], bands, rows)] if len(index) else np.empty((0, 2), np.int64)
    t3 = time.perf_counter()
    uf = _UnionFind(len(docs))
    pairs = []
    for i, j in candidates.tolist():
        if uf.find(i) == uf.find(j):
            continue  # already joined through other pairs: a spanning forest gives the same clusters
        similarity = _sorted_jaccard(sets[i], sets[j])
        if similarity >= threshold:
            pairs.append((i, j, similarity))
            uf.union(i, j)
    t4 = time.perf_counter()
    seconds.update(shingles=t1 - t0, minhash=t2 - t1, lsh=t3 - t2, verify=t4 - t3)

    groups: dict[int, list[int]] = {}
    for i in range(len(docs)):
        groups.setdefault(uf.find(i), []).append(i)
    clusters = [members for members in groups.values() if len(members) > 1]
    clusters.sort(key=lambda c: c[0])
    dropped = {i for c in clusters for i in c[1:]}
    kept = [d for i, d in enumerate(docs) if i not in dropped]
    return NearDupResult(kept, clusters, pairs, len(candidates), bands, rows, seconds)


@dataclass
class PrepareReport:
    """One line per stage of :func:`prepare_documents`: documents in and out of each."""

    documents: int
    cleaned: CleanReport
    exact_removed: int
    near_removed: int
    kept: int
    near: NearDupResult = field(repr=False)


def prepare_documents(documents, *, filters=None, threshold: float = 0.8, **near_kwargs) -> tuple[list[Document], PrepareReport]:
    """The whole document pipeline in its usual order: :func:`clean` (so dedup compares clean
    text and does not spend time on junk), :func:`exact_dedup` (cheap, removes the bulk of the
    copies), then :func:`near_duplicates` (MinHash only has to look at what is left)."""
    docs = _as_documents(documents)
    cleaned = clean(docs, filters)
    exact = exact_dedup(cleaned.kept)
    near = near_duplicates(exact.kept, threshold, **near_kwargs)
    report = PrepareReport(len(docs), cleaned.report, exact.removed, len(near.removed), len(near.kept), near)
    return near.kept, report


# ---------------------------------------------------------------------------------------------
# Packing token ids into a file
# ---------------------------------------------------------------------------------------------


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id below ``vocab_size``: uint16 when every
    id < 2^16 (``vocab_size <= 65536``; GPT-2's 50257 tokens), else uint32 (Llama 3's 128256).
    Half the bytes on disk and half the bytes a batch reads from the page cache."""
    vocab_size = _check_int("vocab_size", vocab_size, 1)
    for dtype in (np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"vocab_size={vocab_size}: expected at most 2^32 tokens")


def _meta_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


# pack's worker processes: the tokenizer arrives once per worker (the pool's initializer), not once per chunk
_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_chunk(job: tuple[list[str], int, str]) -> np.ndarray:
    """A worker's job (a tuple, so that it pickles): :func:`_encode_texts` with the worker's tokenizer."""
    return _encode_texts(_worker_tokenizer, *job)


def _encode_texts(tokenizer: Tokenizer, texts: list[str], eot_id: int, dtype: str) -> np.ndarray:
    """Token ids of a chunk of documents, each followed by ``eot_id``, as one array of ``dtype``."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text))
        ids.append(eot_id)
    out = np.array(ids, dtype=dtype)
    # A document that spells the end-of-text token would split in two when read back; the count of
    # separators must be exactly one per document.
    if np.count_nonzero(out == eot_id) != len(texts):
        raise ValueError(f"documents: one of them contains the end-of-text token (id {eot_id}); remove it when cleaning")
    return out


def _chunks(texts: Iterator[str], chunk_chars: int) -> Iterator[list[str]]:
    """Group documents into chunks of about ``chunk_chars`` characters: a worker's unit of work,
    large enough that sending it costs little next to encoding it."""
    chunk, size = [], 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= chunk_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _start_method() -> str:
    """forkserver where there is one (Linux, macOS), else spawn. Never fork: pack and the data
    loader run after torch has started its thread pools, and a forked child of such a process
    can hang. A forkserver forks workers from a fresh single-threaded process instead."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


@dataclass
class PackReport:
    """What :func:`pack` wrote: ``tokens`` ids (``documents`` end-of-text separators among them) in
    ``bytes_on_disk`` bytes of ``dtype``, at ``tokens_per_second`` over the whole call."""

    path: str
    documents: int
    tokens: int
    dtype: str
    bytes_on_disk: int
    seconds: float
    tokens_per_second: float
    workers: int


# Below this many characters pack encodes in-process: it encodes ~1.5 M characters/s on one core, and
# starting workers (each imports labkit and torch) took 2-8 s on a busy 2-core machine.
_PARALLEL_MIN_CHARS = 8 << 20
_CHUNK_CHARS = 1 << 18


def pack(
    documents,
    tokenizer: Tokenizer,
    path: str | os.PathLike,
    eot_id: int | None = None,
    workers: int | None = None,
    *,
    min_parallel_chars: int = _PARALLEL_MIN_CHARS,
) -> PackReport:
    """Tokenize documents into one flat file of token ids, ``doc0 EOT doc1 EOT ...``, and return a
    :class:`PackReport`.

    The file is raw ids in :func:`token_dtype` (uint16 for GPT-2-sized vocabularies), with a JSON
    sidecar ``<path>.json`` recording dtype, length and separator, which :class:`PackedTokens`
    reads to open it as a read-only memmap: a training run then reads only the pages its batches
    touch, and every DataLoader worker shares one copy in the page cache. The separator after
    each document lets the model learn where a document ends, and tells it that the text after it
    is unrelated (``eot_id`` defaults to the tokenizer's ``<|endoftext|>``).

    ``documents`` may be any iterable (a stream: it is read once, chunk by chunk). Chunks of
    about 256 K characters are encoded in ``workers`` processes (default: all cores) when the
    input has at least ``min_parallel_chars`` characters; smaller inputs are encoded in this
    process, because each worker imports labkit and torch first (a second or more). Chunks are
    written in input order as they come back, so memory holds a few chunks, never the corpus.
    The file is written sequentially and read as a memmap afterwards (a memmap cannot grow).
    Workers start with forkserver or spawn, which import the calling script's main module again:
    a script (not a notebook) that packs in parallel needs an ``if __name__ == "__main__":``
    guard, as any such multiprocessing code does.
    """
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer: expected a labkit.tokenizer.Tokenizer, got {type(tokenizer).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path={path!r}: expected a str or os.PathLike")
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"path={str(path)!r}: directory {str(path.parent)!r} does not exist")
    vocab_size = max(tokenizer.vocab) + 1
    if eot_id is None:
        eot_bytes = EOT.encode()
        matches = [i for i, t in tokenizer.vocab.items() if t == eot_bytes]
        if EOT not in tokenizer.special_tokens or not matches:
            raise ValueError(f"eot_id=None: the tokenizer has no {EOT!r} special token; pass eot_id")
        eot_id = min(matches)
    eot_id = _check_int("eot_id", eot_id, 0)
    if eot_id not in tokenizer.vocab:
        raise ValueError(f"eot_id={eot_id}: not an id of the tokenizer's vocabulary")
    if workers is not None:
        workers = _check_int("workers", workers, 1)
    min_parallel_chars = _check_int("min_parallel_chars", min_parallel_chars, 0)
    if isinstance(documents, (str, bytes)) or not isinstance(documents, Iterable):
        raise TypeError(f"documents: expected an iterable of Document or str, got {type(documents).__name__}")

    def texts() -> Iterator[str]:
        for i, doc in enumerate(documents):
            if isinstance(doc, Document):
                yield doc.text
            elif isinstance(doc, str):
                yield doc
            else:
                raise TypeError(f"documents[{i}]: expected a Document or str, got {type(doc).__name__}")

    dtype = token_dtype(vocab_size)
    want = workers or os.cpu_count() or 1
    start = time.perf_counter()
    chunks = _chunks(texts(), _CHUNK_CHARS)
    # Read ahead up to min_parallel_chars: a stream that ends before it is small, and is encoded here.
    buffered, size = [], 0
    for chunk in chunks:
        buffered.append(chunk)
        size += sum(map(len, chunk))
        if size >= min_parallel_chars:
            break
    parallel = want > 1 and size >= min_parallel_chars and bool(buffered)
    jobs = ((chunk, eot_id, dtype.str) for chunk in itertools.chain(buffered, chunks))
    n_docs = n_tokens = 0

    def write(ids: np.ndarray, documents: int) -> None:
        nonlocal n_docs, n_tokens
        f.write(ids.tobytes())
        n_docs += documents
        n_tokens += len(ids)

    tmp = path.with_name(path.name + ".part")  # renamed at the end: a crash leaves no half file under the real name
    try:
        with open(tmp, "wb") as f:
            if parallel:
                # ProcessPoolExecutor, not multiprocessing.Pool: when a worker dies while starting
                # (e.g. a script without an `if __name__ == "__main__":` guard), Pool starts another
                # one forever and the call hangs; the executor raises BrokenProcessPool.
                context = multiprocessing.get_context(_start_method())
                with ProcessPoolExecutor(want, mp_context=context, initializer=_init_worker, initargs=(tokenizer,)) as pool:
                    pending: deque = deque()
                    for job in jobs:
                        pending.append((pool.submit(_encode_chunk, job), len(job[0])))
                        if len(pending) >= 2 * want:  # two chunks per worker in flight: busy workers, bounded memory
                            future, documents = pending.popleft()
                            write(future.result(), documents)  # in submission order: the file keeps input order
                    for future, documents in pending:
                        write(future.result(), documents)
            else:
                for job in jobs:
                    write(_encode_texts(tokenizer, *job), len(job[0]))
        if n_docs == 0:
            raise ValueError("documents: empty, nothing to pack")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    meta = {"dtype": dtype.name, "tokens": n_tokens, "documents": n_docs, "eot_id": eot_id, "vocab_size": vocab_size}
    _meta_path(path).write_text(json.dumps(meta, indent=1) + "\n")
    seconds = time.perf_counter() - start
    return PackReport(
        str(path), n_docs, n_tokens, dtype.name, path.stat().st_size, seconds,
        n_tokens / seconds if seconds > 0 else float("inf"), want if parallel else 1,
    )


class PackedTokens:
    """A file written by :func:`pack`, opened read-only: ``tokens`` is a ``np.memmap`` of its ids
    (pages are read from disk on first touch and shared through the page cache), with the
    ``dtype``, ``eot_id``, ``num_documents`` and ``vocab_size`` recorded beside it."""

    def __init__(self, path: str | os.PathLike):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path={path!r}: expected a str or os.PathLike")
        self.path = Path(path)
        meta_path = _meta_path(self.path)
        if not self.path.is_file() or not meta_path.is_file():
            raise ValueError(f"path={str(path)!r}: expected a file written by pack (with {meta_path.name} beside it)")
        meta = json.loads(meta_path.read_text())
        self.dtype = np.dtype(meta["dtype"])
        self.eot_id = int(meta["eot_id"])
        self.num_documents = int(meta["documents"])
        self.vocab_size = int(meta["vocab_size"])
        expected = int(meta["tokens"]) * self.dtype.itemsize
        if self.path.stat().st_size != expected:
            raise ValueError(f"path={str(path)!r}: {self.path.stat().st_size} bytes, but its metadata says {expected}")
        self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(int(meta["tokens"]),))

    def __len__(self) -> int:
        return len(self.tokens)

    def documents(self) -> Iterator[np.ndarray]:
        """Each document's ids (separator excluded), in the order they were packed."""
        ends = np.flatnonzero(self.tokens == self.eot_id)
        start = 0
        for end in ends:
            yield self.tokens[start:end]
            start = end + 1

    def __repr__(self) -> str:
        return f"PackedTokens({str(self.path)!r}, tokens={len(self)}, dtype={self.dtype.name}, documents={self.num_documents})"


def read_tokens(path: str | os.PathLike) -> np.memmap:
    """The token ids of a file written by :func:`pack`, as a read-only 1-D ``np.memmap``; it can
    be passed to :func:`labkit.data.get_batch` as is."""
    return PackedTokens(path).tokens


# ---------------------------------------------------------------------------------------------
# Feeding the model: Dataset, resumable Sampler, DataLoader, and measuring them
# ---------------------------------------------------------------------------------------------


class TokenWindows(Dataset):
    """Map-style dataset of training windows over a packed token file: item ``i`` is ``(x, y)``,
    LongTensors of ``block_size`` tokens starting at ``i * stride``, with ``y`` shifted one token
    ahead (the next-token targets), so one read of ``block_size + 1`` tokens serves both.

    ``stride`` defaults to ``block_size``: windows tile the data and an epoch sees each token
    once as an input (a smaller stride overlaps windows, more samples from the same tokens).
    Unlike :func:`labkit.data.get_batch`, which samples random positions with replacement, an
    epoch here is a permutation of fixed windows, which a sampler can shuffle reproducibly and
    resume mid-epoch.

    ``source`` is a path written by :func:`pack`, a :class:`PackedTokens`, or a 1-D integer array.
    Given a path, the memmap is opened lazily in each process, so a DataLoader worker receives
    the path, not a pickled copy of the tokens (pickling a memmap copies its data).
    """

    def __init__(self, source, block_size: int, stride: int | None = None):
        self.block_size = _check_int("block_size", block_size, 1)
        self.stride = self.block_size if stride is None else _check_int("stride", stride, 1)
        self._path: str | None = None
        self._tokens: np.ndarray | None = None
        if isinstance(source, PackedTokens):
            self._path, n = str(source.path), len(source)
        elif isinstance(source, (str, os.PathLike)):
            self._path, n = str(source), len(PackedTokens(source))
        else:
            data = np.asarray(source)
            if data.ndim != 1 or not np.issubdtype(data.dtype, np.integer):
                raise TypeError(f"source: expected a path, PackedTokens or 1-D integer array, got {data.dtype} {data.shape}")
            self._tokens, n = data, len(data)
        if n < self.block_size + 1:
            raise ValueError(f"source: {n} tokens, need at least block_size + 1 = {self.block_size + 1}")
        self._len = (n - self.block_size - 1) // self.stride + 1

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = read_tokens(self._path)
        return self._tokens

    def __getstate__(self):
        state = self.__dict__.copy()
        if self._path is not None:
            state["_tokens"] = None  # reopened in the receiving process
        return state

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index) -> tuple[torch.Tensor, torch.Tensor]:
        i = _check_int("index", index)
        if not 0 <= i < self._len:
            raise IndexError(f"index={i}: expected 0 <= index < {self._len}")
        start = i * self.stride
        window = torch.from_numpy(self.tokens[start : start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]


class ResumableSampler(Sampler[int]):
    """Shuffled (or sequential) indices ``0..num_items-1``, one permutation per epoch, that can be
    saved mid-epoch and resumed so the rest of the run sees exactly the same data in the same
    order as if it had never stopped.

    The state is three numbers: ``seed``, ``epoch`` and ``position`` (indices of this epoch already
    handed out). The permutation of an epoch is drawn from ``np.random.default_rng((seed, epoch))``,
    a function of the state alone, so nothing about the RNG needs saving. Iterating continues
    from ``position``; an iteration that starts with the epoch used up moves to the next epoch
    (no ``set_epoch`` call needed, though it exists, as on ``DistributedSampler``).

    With ``num_workers > 0`` a DataLoader asks for indices ahead of use (``prefetch_factor *
    num_workers`` batches), so the sampler's own position is ahead of what training consumed:
    save ``state_dict(consumed=steps_this_epoch * batch_size)`` then.
    """

    def __init__(self, num_items: int | Sized, seed: int = 0, shuffle: bool = True):
        if isinstance(num_items, Sized) and not isinstance(num_items, (str, bytes)):
            num_items = len(num_items)
        self.num_items = _check_int("num_items", num_items, 1)
        self.seed = _check_int("seed", seed, 0)
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle={shuffle!r}: expected a bool")
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    def order(self, epoch: int | None = None) -> np.ndarray:
        """The index order of ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else _check_int("epoch", epoch, 0)
        if not self.shuffle:
            return np.arange(self.num_items)
        return np.random.default_rng((self.seed, epoch)).permutation(self.num_items)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = _check_int("epoch", epoch, 0)
        self.position = 0

    def __iter__(self) -> Iterator[int]:
        if self.position >= self.num_items:
            self.epoch += 1
            self.position = 0
        order = self.order()
        while self.position < self.num_items:
            index = int(order[self.position])
            self.position += 1  # counted before the yield, so a state saved after taking it includes it
            yield index

    def __len__(self) -> int:
        # what the next iteration yields: the rest of this epoch, or a whole new one
        return self.num_items if self.position >= self.num_items else self.num_items - self.position

    def state_dict(self, consumed: int | None = None) -> dict:
        """The state to save in a checkpoint. ``consumed``: how many indices of the current epoch
        training has actually used, when the loader prefetches (see the class docstring)."""
        position = self.position
        if consumed is not None:
            position = _check_int("consumed", consumed, 0, self.position)
        return {"num_items": self.num_items, "seed": self.seed, "shuffle": self.shuffle, "epoch": self.epoch, "position": position}

    def load_state_dict(self, state: Mapping) -> None:
        if not isinstance(state, Mapping):
            raise TypeError(f"state: expected a dict from state_dict(), got {type(state).__name__}")
        missing = {"num_items", "seed", "shuffle", "epoch", "position"} - set(state)
        if missing:
            raise ValueError(f"state: lacks {sorted(missing)}")
        if state["num_items"] != self.num_items:
            raise ValueError(f"state: saved for {state['num_items']} items, this sampler has {self.num_items}")
        self.seed = _check_int("state['seed']", state["seed"], 0)
        self.shuffle = bool(state["shuffle"])
        self.epoch = _check_int("state['epoch']", state["epoch"], 0)
        self.position = _check_int("state['position']", state["position"], 0, self.num_items)


def make_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    sampler: Sampler | None = None,
    num_workers: int = 0,
    prefetch_factor: int = 2,
    pin_memory: bool | None = None,
    drop_last: bool = True,
) -> DataLoader:
    """A ``DataLoader`` set up for training on windows of tokens.

    * ``num_workers`` processes load batches while the model computes; each keeps
      ``prefetch_factor`` batches ready. Workers start with forkserver (or spawn), never fork,
      because the training process has run torch's thread pools by then.
    * ``pin_memory`` defaults to whether CUDA is available: batches in page-locked memory can be
      copied to the GPU asynchronously (``.to(device, non_blocking=True)``); without a GPU it
      would only cost a copy.
    * ``drop_last`` keeps every batch the same shape (a ragged last batch would recompile a
      compiled model and skew the loss average).
    """
    if not isinstance(dataset, Dataset):
        raise TypeError(f"dataset: expected a torch.utils.data.Dataset, got {type(dataset).__name__}")
    batch_size = _check_int("batch_size", batch_size, 1)
    num_workers = _check_int("num_workers", num_workers, 0)
    prefetch_factor = _check_int("prefetch_factor", prefetch_factor, 1)
    if sampler is not None and not isinstance(sampler, Sampler):
        raise TypeError(f"sampler: expected a torch.utils.data.Sampler, got {type(sampler).__name__}")
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    elif not isinstance(pin_memory, bool):
        raise TypeError(f"pin_memory={pin_memory!r}: expected a bool or None")
    extra = {"prefetch_factor": prefetch_factor, "multiprocessing_context": _start_method()} if num_workers else {}
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
        pin_memory=pin_memory, drop_last=drop_last, **extra,
    )


@dataclass
class LoaderThroughput:
    batches: int
    tokens: int
    seconds: float
    batches_per_second: float
    tokens_per_second: float


def _batch_tokens(batch) -> int:
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    return int(x.numel()) if hasattr(x, "numel") else 0


def _warmed_up(loader: Iterable, warmup: int) -> Iterator:
    """An iterator over ``loader`` past its first ``warmup`` batches (starting workers, filling caches)."""
    if not isinstance(loader, Iterable):
        raise TypeError(f"loader: expected an iterable of batches, got {type(loader).__name__}")
    it = iter(loader)
    for _ in range(warmup):
        if next(it, None) is None:
            raise ValueError(f"loader: ended during the {warmup} warm-up batches")
    return it


def loader_throughput(loader: Iterable, num_batches: int = 20, warmup: int = 1) -> LoaderThroughput:
    """How fast ``loader`` delivers batches when nothing else runs: ``num_batches`` timed after
    ``warmup`` untimed ones (the first batches include starting workers and filling caches).
    Tokens count the inputs ``x`` of each ``(x, y)`` batch. If the loader ends early, the rate is
    over the batches it gave."""
    num_batches = _check_int("num_batches", num_batches, 1)
    warmup = _check_int("warmup", warmup, 0)
    it = _warmed_up(loader, warmup)
    batches = tokens = 0
    start = time.perf_counter()
    for batch in itertools.islice(it, num_batches):
        batches += 1
        tokens += _batch_tokens(batch)
    seconds = time.perf_counter() - start
    if batches == 0:
        raise ValueError("loader: no batches left after the warm-up")
    return LoaderThroughput(batches, tokens, seconds, batches / seconds, tokens / seconds)


class DelayedDataset(Dataset):
    """``dataset`` with ``delay`` seconds of sleep per item: a stand-in for slow loading
    (decompression, tokenizing on the fly, a network file system) to see what it does to a
    training loop. Sleeping holds no core, so it models waiting on I/O, not on computation."""

    def __init__(self, dataset: Dataset, delay: float):
        if not isinstance(dataset, Dataset):
            raise TypeError(f"dataset: expected a torch.utils.data.Dataset, got {type(dataset).__name__}")
        self.dataset = dataset
        self.delay = _check_seconds("delay", delay)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        time.sleep(self.delay)
        return self.dataset[index]


@dataclass
class DataWaitReport:
    """A training loop's time split: ``waiting`` on the loader for the next batch versus
    ``computing`` the step; ``fraction_blocked = waiting / (waiting + computing)``."""

    steps: int
    waiting: float
    computing: float
    fraction_blocked: float


def time_blocked_on_data(loader: Iterable, step: float | Callable, num_steps: int = 20, warmup: int = 1) -> DataWaitReport:
    """Run ``num_steps`` training steps over ``loader`` and measure the fraction of time spent
    blocked waiting for data.

    ``step`` is the step's work: a callable taking the batch (a real forward and backward), or a
    number of seconds to sleep (a GPU step, during which the CPU is free for workers to load).
    The loop is the one training runs, ``batch = next(it)`` then ``step(batch)``: with
    ``num_workers=0`` loading and stepping take turns, so a slow loader shows up in full as
    waiting; with workers loading ahead, waiting falls towards
    ``max(0, time per batch / workers - step time)``. ``warmup`` batches (worker start-up)
    are taken before timing.
    """
    num_steps = _check_int("num_steps", num_steps, 1)
    warmup = _check_int("warmup", warmup, 0)
    if callable(step):
        work = step
    else:
        seconds = _check_seconds("step", step)

        def work(batch):
            time.sleep(seconds)

    it = _warmed_up(loader, warmup)
    waiting = computing = 0.0
    steps = 0
    for _ in range(num_steps):
        t0 = time.perf_counter()
        batch = next(it, None)
        t1 = time.perf_counter()
        if batch is None:
            break
        work(batch)
        t2 = time.perf_counter()
        waiting += t1 - t0
        computing += t2 - t1
        steps += 1
    if steps == 0:
        raise ValueError("loader: no batches left after the warm-up")
    total = waiting + computing
    return DataWaitReport(steps, waiting, computing, waiting / total if total > 0 else 0.0)


# ---------------------------------------------------------------------------------------------
# A streamed public data set
# ---------------------------------------------------------------------------------------------


def records_to_documents(records: Iterable[Mapping], text_field: str = "text", source_field: str | None = None, prefix: str = "hf") -> Iterator[Document]:
    """Turn rows of a data set (mappings such as Hugging Face ``datasets`` yields) into
    :class:`Document` records, lazily, so a stream of any length enters the same pipeline.

    With network access and ``pip install datasets``, a public web corpus is read without
    downloading it whole (``streaming=True`` fetches shards as they are iterated)::

        import itertools
        from datasets import load_dataset
        from labkit import datapipe

        stream = load_dataset("HuggingFaceFW/fineweb-edu", name="sample-10BT", split="train", streaming=True)
        stream = stream.shuffle(seed=0, buffer_size=10_000)  # approximate: shuffles within a buffer
        docs = datapipe.records_to_documents(itertools.islice(stream, 20_000), "text", source_field="id")
        kept, report = datapipe.prepare_documents(docs)        # clean, exact and near dedup
        datapipe.pack(kept, tokenizer, "fineweb.bin")           # or pack a stream directly:
        # datapipe.pack(datapipe.records_to_documents(stream), tokenizer, "fineweb.bin")

    Rows are dicts (here ``{"text": ..., "id": ..., "url": ...}``). Cleaning and exact
    deduplication need one document at a time (plus a set of digests), and :func:`pack` reads
    its input once, so those stages stream; near-duplicate detection compares all signatures,
    so it is run on a bounded slice (or shard by shard). The source of a document is
    ``"<prefix>:<row[source_field]>"`` or ``"<prefix>:<row number>"``.
    """
    if not isinstance(text_field, str) or (source_field is not None and not isinstance(source_field, str)):
        raise TypeError(f"text_field={text_field!r}, source_field={source_field!r}: expected str field names")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix={prefix!r}: expected a str")
    if isinstance(records, (str, bytes, Mapping)) or not isinstance(records, Iterable):
        raise TypeError(f"records: expected an iterable of mappings (rows), got {type(records).__name__}")

    def generate():
        for i, row in enumerate(records):
            if not isinstance(row, Mapping):
                raise TypeError(f"records[{i}]: expected a mapping, got {type(row).__name__}")
            if text_field not in row:
                raise ValueError(f"records[{i}]: has no field {text_field!r} (fields: {sorted(row)})")
            name = row[source_field] if source_field is not None else i
            yield Document(f"{prefix}:{name}", row[text_field])

    return generate()
