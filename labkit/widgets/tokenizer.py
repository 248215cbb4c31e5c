"""Chapter 11 widget: the BPE explorer.

A vocabulary-size slider over a byte-level BPE (:func:`labkit.tokenizer.train_bpe`) trained once on the chapter's
corpus (the cleaned, deduplicated :func:`labkit.datapipe.prepare_documents` of :func:`labkit.datapipe.corpus_documents`,
or any text): it shows the first and the last merges of the chosen vocabulary, the compression (bytes per token) on
the training text and on held-out text, a sample's tokens coloured one by one (the id on hover), and bytes per
token against the vocabulary size.

Training happens once, to the slider's maximum (:class:`BPEExplorer`): merges are learned in order, and training
to a smaller size stops at a prefix of the same list, so the vocabulary of size ``256 + len(specials) + k`` *is*
the first ``k`` merges (the tests check this against :func:`labkit.tokenizer.train_bpe`). The bytes per token of the
corpus at every size come from one replay of the merges over the corpus's distinct pre-tokens, weighted by their
counts; a slider change then only looks those up and encodes the sample with the prefix. :func:`bpe_explorer_view`
computes everything the explorer shows (the tests call it), :func:`show_bpe_explorer` is the widget's callback
(shows it and returns the data), :func:`bpe_explorer_widget` builds the widget.
"""
from __future__ import annotations

import functools
import html
import os
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import matplotlib.pyplot as plt

from labkit.datapipe import EOT, Document
from labkit.tokenizer import _PRETOKEN, Tokenizer, _check_special_tokens, _special_pattern, merge_pair, train_bpe
from labkit.widgets import drawn

DEFAULT_MAX_VOCAB = 4096  # trained once (about 1 s on the chapter's corpus); every smaller vocabulary is a prefix
DEFAULT_VOCAB = 1024
SLIDER_STEP = 64
MERGES_SHOWN = 8
MAX_MERGES_SHOWN = 100
MAX_SAMPLE_CHARS = 10_000  # the coloured sample is one HTML span per token
HELDOUT_EVERY = 10  # of the corpus's documents, every 10th is held out of training
# Prose, code, digits, non-ASCII (whose bytes a small vocabulary splits) and the characters HTML must escape.
DEFAULT_SAMPLE = ('Tokenizers read bytes, not characters: "naïve café" costs more tokens than "naive cafe".\n'
                  'if len(ids) <= 1024 and ratio > 3.5: print(f"{name!r} & friends")  # 2024-06-30\n')
TOKEN_COLORS = ("#cfe8ff", "#ffe0b3", "#d4f4d4", "#f9d0e6", "#e6dcff", "#fff3a8")


def readable(token: bytes) -> str:
    """``token`` as text one can read: valid UTF-8 as its characters, every other byte as ``\\xNN``; characters
    that do not print (newline, tab, other controls) as their Python escapes, a backslash as ``\\\\``."""
    if not isinstance(token, bytes):
        raise TypeError(f"token={token!r}: expected bytes")
    out = []
    for ch in token.decode("utf-8", errors="surrogateescape"):  # a byte that is not UTF-8 becomes U+DC80..U+DCFF
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:
            out.append(f"\\x{code - 0xDC00:02x}")
        elif ch == "\\":
            out.append("\\\\")
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)


def _special_count(specials: list[str]) -> str:
    return f"{len(specials)} special token{'' if len(specials) == 1 else 's'}"


def _pretoken_counts(text: str, specials: list[str]) -> tuple[Counter, int]:
    """How often each pre-token occurs in ``text`` and how many special tokens it holds: the pieces
    :meth:`labkit.tokenizer.Tokenizer.encode` cuts it into (and ``train_bpe`` counts)."""
    split = _special_pattern(specials, keep=True)
    parts = split.split(text) if split else [text]
    counts: Counter = Counter()
    for part in parts[::2]:  # split() puts the specials it matched at the odd indices
        counts.update(_PRETOKEN.findall(part))
    return counts, len(parts) // 2


def replay_token_counts(vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]], texts: list[str],
                        special_tokens: list[str] | None = None) -> list[list[int]]:
    """``counts[t][k]``: how many tokens text ``t`` encodes to with the first ``k`` merges (``k = 0 .. len(merges)``),
    as :class:`labkit.tokenizer.Tokenizer` with ``merges[:k]`` would encode it, for every ``k`` in one pass.

    The texts' distinct pre-tokens are merged step by step, as training did, each counted as often as it occurs;
    an index from each pair to the pre-tokens holding it visits only those a merge changes. Applying merge ``k`` to
    every occurrence is what the encoder does too, unless the merged token is part of an earlier merge (a merge
    that repeats a token ``train_bpe`` already has, which adds no id): then the encoder may go on merging, so the
    pre-tokens that merge touched are encoded afresh with ``merges[:k + 1]``.
    """
    specials = _check_special_tokens(special_tokens)
    id_of: dict[bytes, int] = {}
    for i, token in sorted(vocab.items()):
        id_of.setdefault(token, i)
    per_text = [_pretoken_counts(text, specials) for text in texts]
    words_of = list(dict.fromkeys(w for counts, _ in per_text for w in counts))
    raw = [w.encode("utf-8") for w in words_of]
    words = [list(r) for r in raw]  # byte b is token id b
    freqs = [[counts.get(w, 0) for counts, _ in per_text] for w in words_of]
    totals = [sum(len(word) * f[t] for word, f in zip(words, freqs)) + n_special for t, (_, n_special) in enumerate(per_text)]
    where: dict[tuple[int, int], set[int]] = defaultdict(set)
    for w, word in enumerate(words):
        for pair in zip(word, word[1:]):
            where[pair].add(w)
    parts_so_far: set[bytes] = set()  # every token that is one half of a merge seen so far
    out = [[total] for total in totals]
    for k, (left, right) in enumerate(merges):
        a, b, new = id_of[left], id_of[right], id_of[left + right]
        again = (left + right) in parts_so_far  # the encoder may merge further with merges[:k + 1]
        parts_so_far.update((left, right))
        encoder = Tokenizer(vocab, merges[: k + 1], specials) if again and where.get((a, b)) else None
        for w in where.pop((a, b), ()):
            word = words[w]
            if encoder is not None:
                merged = list(encoder._bpe(raw[w]))
            else:
                merged = merge_pair(word, a, b, new)
            old_pairs, new_pairs = set(zip(word, word[1:])), set(zip(merged, merged[1:]))
            for p in old_pairs - new_pairs:
                if p in where:
                    where[p].discard(w)
            for p in new_pairs - old_pairs:
                where[p].add(w)
            for t in range(len(texts)):
                totals[t] += (len(merged) - len(word)) * freqs[w][t]
            words[w] = merged
        for t, total in enumerate(totals):
            out[t].append(total)
    return out


class BPEExplorer:
    """A byte-level BPE trained once, to ``max_vocab_size`` tokens, on ``train_text``, with what the explorer
    needs at every smaller size: the merges (a prefix), a :class:`labkit.tokenizer.Tokenizer` and the bytes per
    token of ``train_text`` and ``heldout_text`` (replayed once, :func:`replay_token_counts`).

    ``special_tokens`` (default GPT-2's ``<|endoftext|>``, which separates documents) take ids after the 256
    bytes, so the smallest vocabulary is ``256 + len(special_tokens)``. Training stops early if the text runs out
    of pairs to merge; :attr:`max_vocab_size` is then what it reached. :attr:`seconds` times training and replay.
    """

    def __init__(self, train_text: str, heldout_text: str = "", max_vocab_size: int = DEFAULT_MAX_VOCAB,
                 special_tokens: list[str] | tuple[str, ...] | None = (EOT,)):
        if not isinstance(train_text, str) or not train_text:
            raise ValueError("train_text: expected a non-empty str")
        if not isinstance(heldout_text, str):
            raise TypeError(f"heldout_text: expected a str, got {type(heldout_text).__name__}")
        self.special_tokens = _check_special_tokens(list(special_tokens) if special_tokens is not None else None)
        self.min_vocab_size = 256 + len(self.special_tokens)
        if not isinstance(max_vocab_size, int) or isinstance(max_vocab_size, bool):
            raise TypeError(f"max_vocab_size={max_vocab_size!r}: expected an int")
        if max_vocab_size < self.min_vocab_size:
            raise ValueError(f"max_vocab_size={max_vocab_size}: expected at least {self.min_vocab_size} "
                             f"(256 bytes + {_special_count(self.special_tokens)})")
        self.train_text, self.heldout_text = train_text, heldout_text
        self.seconds: dict[str, float] = {}
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="labkit-bpe-") as folder:
            path = Path(folder) / "train.txt"
            path.write_text(train_text, encoding="utf-8")
            self.vocab, self.merges = train_bpe(path, max_vocab_size, self.special_tokens)
        self.seconds["train"] = time.perf_counter() - start
        self.max_vocab_size = len(self.vocab)
        # merges needed for each vocabulary size: a merge that repeats a token adds no id (see train_bpe)
        self._merge_count = [0]
        known = set(self.vocab[i] for i in range(self.min_vocab_size))
        for k, (left, right) in enumerate(self.merges, 1):
            if left + right not in known:
                known.add(left + right)
                self._merge_count.append(k)
        start = time.perf_counter()
        texts = [train_text] + ([heldout_text] if heldout_text else [])
        self._tokens_after = replay_token_counts(self.vocab, self.merges, texts, self.special_tokens)
        self.seconds["replay"] = time.perf_counter() - start
        self.train_bytes = len(train_text.encode("utf-8"))
        self.heldout_bytes = len(heldout_text.encode("utf-8"))
        self._tokenizers: dict[int, Tokenizer] = {}

    @classmethod
    def from_documents(cls, documents, heldout_every: int = HELDOUT_EVERY, **kwargs) -> BPEExplorer:
        """Train on ``documents`` (:class:`labkit.datapipe.Document` or str), every ``heldout_every``-th one
        (the 10th, 20th, ...) held out; documents joined by the first special token (``<|endoftext|>``), as packed."""
        texts = []
        for i, doc in enumerate(documents):
            if not isinstance(doc, (Document, str)):
                raise TypeError(f"documents[{i}]: expected a Document or str, got {type(doc).__name__}")
            texts.append(doc.text if isinstance(doc, Document) else doc)
        if not isinstance(heldout_every, int) or isinstance(heldout_every, bool) or heldout_every < 2:
            raise ValueError(f"heldout_every={heldout_every!r}: expected an int >= 2")
        specials = _check_special_tokens(list(kwargs.get("special_tokens", (EOT,)) or ()))
        sep = specials[0] if specials else "\n\n"
        train = [t for i, t in enumerate(texts) if i % heldout_every != heldout_every - 1]
        heldout = [t for i, t in enumerate(texts) if i % heldout_every == heldout_every - 1]
        return cls(sep.join(train), sep.join(heldout), **kwargs)

    @classmethod
    def from_text(cls, text: str, heldout_fraction: float = 0.1, **kwargs) -> BPEExplorer:
        """Train on ``text`` but its last ``heldout_fraction`` (cut at the first whitespace there), held out."""
        if not isinstance(text, str) or not text:
            raise ValueError("text: expected a non-empty str")
        if not isinstance(heldout_fraction, (int, float)) or isinstance(heldout_fraction, bool) or not 0 <= heldout_fraction < 1:
            raise ValueError(f"heldout_fraction={heldout_fraction!r}: expected a number in [0, 1)")
        cut = len(text) - int(len(text) * heldout_fraction)
        while 0 < cut < len(text) and not text[cut].isspace():
            cut += 1
        if cut == 0:
            cut = len(text)
        return cls(text[:cut], text[cut:], **kwargs)

    @classmethod
    def from_path(cls, path: str | os.PathLike, heldout_fraction: float = 0.1, **kwargs) -> BPEExplorer:
        """:meth:`from_text` of the UTF-8 file ``path``."""
        if not Path(path).is_file():
            raise ValueError(f"path={str(path)!r}: no such file")
        return cls.from_text(Path(path).read_text(encoding="utf-8"), heldout_fraction, **kwargs)

    def check_vocab_size(self, vocab_size) -> int:
        """``vocab_size`` if this explorer has that vocabulary, else a ValueError naming the range."""
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
            raise TypeError(f"vocab_size={vocab_size!r}: expected an int")
        if not self.min_vocab_size <= vocab_size <= self.max_vocab_size:
            raise ValueError(f"vocab_size={vocab_size}: expected an int in [{self.min_vocab_size}, {self.max_vocab_size}] "
                             f"(256 bytes + {_special_count(self.special_tokens)}, up to the {self.max_vocab_size} "
                             "tokens this explorer trained)")
        return vocab_size

    def merge_count(self, vocab_size: int) -> int:
        """How many merges (of :attr:`merges`) make the vocabulary of ``vocab_size`` tokens."""
        return self._merge_count[self.check_vocab_size(vocab_size) - self.min_vocab_size]

    def merges_for(self, vocab_size: int) -> list[tuple[bytes, bytes]]:
        """The merges of the vocabulary of ``vocab_size`` tokens: the first :meth:`merge_count` of :attr:`merges`."""
        return self.merges[: self.merge_count(vocab_size)]

    def vocab_for(self, vocab_size: int) -> dict[int, bytes]:
        """The vocabulary of ``vocab_size`` tokens: ids below ``vocab_size``."""
        return {i: self.vocab[i] for i in range(self.check_vocab_size(vocab_size))}

    def tokenizer(self, vocab_size: int) -> Tokenizer:
        """A :class:`labkit.tokenizer.Tokenizer` of the vocabulary of ``vocab_size`` tokens (the last few kept)."""
        if vocab_size not in self._tokenizers:
            if len(self._tokenizers) >= 8:
                self._tokenizers.pop(next(iter(self._tokenizers)))
            self._tokenizers[vocab_size] = Tokenizer(self.vocab_for(vocab_size), self.merges_for(vocab_size), self.special_tokens)
        return self._tokenizers[vocab_size]

    def token_counts(self, vocab_size: int) -> tuple[int, int | None]:
        """Tokens of the training text and of the held-out text (None without one) at ``vocab_size``."""
        k = self.merge_count(vocab_size)
        return self._tokens_after[0][k], (self._tokens_after[1][k] if self.heldout_text else None)

    def bytes_per_token(self, vocab_size: int) -> tuple[float, float | None]:
        """UTF-8 bytes per token of the training text and of the held-out text (None without one)."""
        train, heldout = self.token_counts(vocab_size)
        return self.train_bytes / train, (self.heldout_bytes / heldout if heldout else None)

    def curve(self) -> dict:
        """Bytes per token at every vocabulary size: ``{"vocab_size": [...], "train": [...], "heldout": [...] or None}``."""
        sizes = list(range(self.min_vocab_size, self.max_vocab_size + 1))
        ks = self._merge_count
        train = [self.train_bytes / self._tokens_after[0][k] for k in ks]
        heldout = [self.heldout_bytes / self._tokens_after[1][k] for k in ks] if self.heldout_text else None
        return {"vocab_size": sizes, "train": train, "heldout": heldout}

    def slider_sizes(self, step: int = SLIDER_STEP) -> list[int]:
        """The vocabulary sizes the slider offers: the smallest, the multiples of ``step`` between, the largest."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ValueError(f"step={step!r}: expected a positive int")
        first = -(-(self.min_vocab_size + 1) // step) * step
        return sorted({self.min_vocab_size, *range(first, self.max_vocab_size, step), self.max_vocab_size})

    def __repr__(self) -> str:
        return (f"BPEExplorer({self.max_vocab_size} tokens, {len(self.merges)} merges, trained on {self.train_bytes:,} bytes, "
                f"{self.heldout_bytes:,} held out)")


@functools.cache
def default_explorer(max_vocab_size: int = DEFAULT_MAX_VOCAB) -> BPEExplorer:
    """The chapter's explorer, built once per session: the corpus of :func:`labkit.datapipe.corpus_documents`,
    cleaned and deduplicated (:func:`labkit.datapipe.prepare_documents`), every 10th document held out.
    ``seconds["corpus"]`` is the time reading and preparing it took."""
    from labkit import datapipe

    start = time.perf_counter()
    documents, _ = datapipe.prepare_documents(datapipe.corpus_documents())
    corpus_seconds = time.perf_counter() - start
    explorer = BPEExplorer.from_documents(documents, max_vocab_size=max_vocab_size)
    explorer.seconds["corpus"] = corpus_seconds
    return explorer


def token_spans(tokenizer: Tokenizer, text: str) -> list[tuple[str, list[int]]]:
    """``text`` cut where its tokens end: ``(piece, ids)`` pairs whose pieces concatenate to ``text``. A piece is one
    token, unless tokens split a character's UTF-8 bytes between them: those tokens share one piece."""
    ids = tokenizer.encode(text)
    spans, pending, data = [], [], b""
    for i in ids:
        pending.append(i)
        data += tokenizer.vocab[i]
        try:
            piece = data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # this token ends inside a character: the next one completes it
        spans.append((piece, pending))
        pending, data = [], b""
    if pending:  # cannot happen for a str (valid UTF-8), kept for safety
        spans.append((data.decode("utf-8", errors="replace"), pending))
    return spans


def tokens_html(spans: list[tuple[str, list[int]]], vocab: dict[int, bytes]) -> str:
    """The coloured sample: one ``<span class="bpe-token">`` per piece of :func:`token_spans`, background colours
    cycling so that neighbours differ, the text HTML-escaped, the id(s) and bytes in the ``title`` (on hover)."""
    out = []
    for n, (piece, ids) in enumerate(spans):
        color = TOKEN_COLORS[n % len(TOKEN_COLORS)]
        if len(ids) == 1:
            title = f"id {ids[0]}: '{readable(vocab[ids[0]])}'"
            style = f"background:{color}"
        else:
            title = (f"ids {' '.join(map(str, ids))}: one character split over {len(ids)} tokens "
                     + " + ".join(f"'{readable(vocab[i])}'" for i in ids))
            style = f"background:{color};outline:1px dashed #c00"
        out.append(f'<span class="bpe-token" data-ids="{" ".join(map(str, ids))}" title="{html.escape(title, quote=True)}" '
                   f'style="{style};border-radius:2px;margin-right:1px">{html.escape(piece, quote=True)}</span>')
    return ('<div class="bpe-sample" style="white-space:pre-wrap;font-family:monospace;line-height:1.9">'
            + "".join(out) + "</div>")


def _merge_rows(merges: list[tuple[bytes, bytes]], start: int) -> list[tuple[int, str, str, str]]:
    return [(start + n, readable(a), readable(b), readable(a + b)) for n, (a, b) in enumerate(merges)]


def _merges_table(title: str, rows: list[tuple[int, str, str, str]]) -> str:
    body = "".join(f"<tr><td>{rank}</td><td>'{html.escape(a)}' + '{html.escape(b)}'</td><td>&rarr; '{html.escape(m)}'</td></tr>"
                   for rank, a, b, m in rows)
    return (f'<div style="margin-right:24px"><b>{html.escape(title)}</b><table style="border-collapse:separate;'
            f'border-spacing:10px 0;white-space:pre;font-family:monospace;font-size:90%">{body}</table></div>')


def bpe_explorer_view(explorer: BPEExplorer | None = None, vocab_size: int = DEFAULT_VOCAB, sample: str | None = None,
                      merges_shown: int = MERGES_SHOWN) -> dict:
    """Everything the explorer shows for the vocabulary of ``vocab_size`` tokens of ``explorer`` (default: the
    chapter's, :func:`default_explorer`), as a dict:

    * ``vocab_size``, ``num_merges`` (merges in this vocabulary), ``special_tokens`` (how many), ``min_vocab_size``,
      ``max_vocab_size``;
    * ``first_merges`` and ``last_merges``: ``(rank, left, right, merged)`` of its first and last ``merges_shown``
      merges (ranks from 1), each token :func:`readable`;
    * ``train_bytes``, ``train_tokens``, ``train_bytes_per_token`` and the same of the held-out text (None without);
    * ``sample`` (default :data:`DEFAULT_SAMPLE`), its ``ids``, ``sample_bytes_per_token`` and ``spans`` (:func:`token_spans`);
    * ``tokens_html`` (:func:`tokens_html`) and ``html``, the whole panel: numbers, merges and the coloured sample.
    """
    explorer = explorer if explorer is not None else default_explorer()
    vocab_size = explorer.check_vocab_size(vocab_size)
    sample = DEFAULT_SAMPLE if sample is None else sample
    if not isinstance(sample, str):
        raise TypeError(f"sample: expected a str, got {type(sample).__name__}")
    if len(sample) > MAX_SAMPLE_CHARS:
        raise ValueError(f"sample: {len(sample):,} characters; expected at most {MAX_SAMPLE_CHARS:,} (one HTML span per token)")
    if not isinstance(merges_shown, int) or isinstance(merges_shown, bool) or not 1 <= merges_shown <= MAX_MERGES_SHOWN:
        raise ValueError(f"merges_shown={merges_shown!r}: expected an int in [1, {MAX_MERGES_SHOWN}]")
    merges = explorer.merges_for(vocab_size)
    tokenizer = explorer.tokenizer(vocab_size)
    spans = token_spans(tokenizer, sample)
    ids = [i for _, span_ids in spans for i in span_ids]
    train_tokens, heldout_tokens = explorer.token_counts(vocab_size)
    train_bpt, heldout_bpt = explorer.bytes_per_token(vocab_size)
    sample_bytes = len(sample.encode("utf-8"))
    shown = min(merges_shown, len(merges))
    data = {
        "vocab_size": vocab_size, "num_merges": len(merges), "special_tokens": len(explorer.special_tokens),
        "min_vocab_size": explorer.min_vocab_size, "max_vocab_size": explorer.max_vocab_size,
        "first_merges": _merge_rows(merges[:shown], 1),
        "last_merges": _merge_rows(merges[len(merges) - shown:], len(merges) - shown + 1) if shown else [],
        "train_bytes": explorer.train_bytes, "train_tokens": train_tokens, "train_bytes_per_token": train_bpt,
        "heldout_bytes": explorer.heldout_bytes if explorer.heldout_text else None, "heldout_tokens": heldout_tokens,
        "heldout_bytes_per_token": heldout_bpt,
        "sample": sample, "ids": ids, "spans": spans,
        "sample_bytes_per_token": sample_bytes / len(ids) if ids else None,
    }
    data["tokens_html"] = tokens_html(spans, tokenizer.vocab)
    data["html"] = explorer_html(data)
    return data


def explorer_summary(data: dict) -> str:
    """The compression line: bytes per token on the training text, the held-out text and the sample."""
    parts = [f"training text {data['train_bytes_per_token']:.3f} ({data['train_bytes']:,} bytes, {data['train_tokens']:,} tokens)"]
    if data["heldout_bytes_per_token"] is not None:
        parts.append(f"held out {data['heldout_bytes_per_token']:.3f} ({data['heldout_bytes']:,} bytes, "
                     f"{data['heldout_tokens']:,} tokens)")
    if data["sample_bytes_per_token"] is not None:
        parts.append(f"sample {data['sample_bytes_per_token']:.3f} ({len(data['ids'])} tokens)")
    return (f"{data['vocab_size']:,} tokens = 256 bytes + {data['special_tokens']} special + "
            f"{data['vocab_size'] - 256 - data['special_tokens']:,} from {data['num_merges']:,} merges. Bytes per token: "
            + "; ".join(parts))


def explorer_html(data: dict) -> str:
    """The explorer's panel (what :func:`bpe_explorer_view` puts in ``data["html"]``)."""
    if data["num_merges"]:
        merges = ('<div style="display:flex;flex-wrap:wrap">'
                  + _merges_table(f"first {len(data['first_merges'])} merges", data["first_merges"])
                  + _merges_table(f"last {len(data['last_merges'])} merges (of {data['num_merges']:,})", data["last_merges"])
                  + "</div>")
    else:
        merges = "<div>no merges yet: every token is a single byte (or a special token)</div>"
    return (f'<div class="bpe-explorer"><div>{html.escape(explorer_summary(data))}</div>{merges}'
            f'<div style="margin-top:6px"><b>the sample, token by token</b> (hover for the id)</div>{data["tokens_html"]}</div>')


def plot_compression(explorer: BPEExplorer, vocab_size: int | None = None, ax=None):
    """Bytes per token of the training and held-out text against the vocabulary size, ``vocab_size`` marked.
    Returns the axes."""
    curve = explorer.curve()
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 2.8))
    ax.plot(curve["vocab_size"], curve["train"], color="tab:blue", label="training text")
    if curve["heldout"] is not None:
        ax.plot(curve["vocab_size"], curve["heldout"], color="tab:orange", label="held out")
    if vocab_size is not None:
        train, heldout = explorer.bytes_per_token(explorer.check_vocab_size(vocab_size))
        ax.axvline(vocab_size, color="grey", lw=0.8, ls=":")
        ax.plot([vocab_size], [train], "o", color="tab:blue", ms=5)
        if heldout is not None:
            ax.plot([vocab_size], [heldout], "o", color="tab:orange", ms=5)
    ax.set_xscale("log", base=2)
    ticks = [2**p for p in range(8, 20) if explorer.min_vocab_size <= 2**p <= explorer.max_vocab_size]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("vocabulary size (tokens)")
    ax.set_ylabel("bytes per token")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax


def show_bpe_explorer(vocab_size: int = DEFAULT_VOCAB, sample: str | None = None, explorer: BPEExplorer | None = None,
                      merges_shown: int = MERGES_SHOWN, plot: bool = True) -> dict:
    """Callback of the explorer: show :func:`bpe_explorer_view`'s panel (and, if ``plot``, :func:`plot_compression`);
    returns the data."""
    from IPython.display import HTML, display

    explorer = explorer if explorer is not None else default_explorer()
    data = bpe_explorer_view(explorer, vocab_size, sample, merges_shown)
    display(HTML(data["html"]))
    if plot:
        plot_compression(explorer, vocab_size)
        plt.show()
    return data


def bpe_explorer_widget(explorer: BPEExplorer | None = None, vocab_size: int = DEFAULT_VOCAB, sample: str | None = None,
                        step: int = SLIDER_STEP):
    """A vocabulary-size slider (the sizes of :meth:`BPEExplorer.slider_sizes`) and a sample box over
    :func:`show_bpe_explorer`. ``explorer``: default the chapter's (:func:`default_explorer`, trained here once)."""
    import ipywidgets as widgets

    explorer = explorer if explorer is not None else default_explorer()
    sizes = explorer.slider_sizes(step)
    value = min(sizes, key=lambda s: abs(s - explorer.check_vocab_size(vocab_size)))
    return widgets.interact(
        drawn(show_bpe_explorer),
        vocab_size=widgets.SelectionSlider(options=sizes, value=value, description="vocab size", continuous_update=False),
        sample=widgets.Textarea(value=DEFAULT_SAMPLE if sample is None else sample, description="sample",
                                continuous_update=False, layout=widgets.Layout(width="90%", height="4.5em")),
        explorer=widgets.fixed(explorer), merges_shown=widgets.fixed(MERGES_SHOWN), plot=widgets.fixed(True),
    )


__all__ = ["BPEExplorer", "default_explorer", "replay_token_counts", "readable", "token_spans", "tokens_html",
           "bpe_explorer_view", "explorer_summary", "explorer_html", "plot_compression", "show_bpe_explorer",
           "bpe_explorer_widget"]
