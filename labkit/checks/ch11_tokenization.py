"""Graders for chapter 11 (tokenization and the data pipeline): ``bpe_merge_step``, ``bpe_encode`` and
``minhash_signature``.

``bpe_merge_step(word_counts, pair_counts) -> (pair, word_counts, pair_counts)`` is one step of byte-level BPE
training (:func:`labkit.tokenizer.train_bpe`'s loop): ``word_counts`` maps each pre-token, a tuple of byte-string
tokens, to how often it occurs; ``pair_counts`` maps each adjacent pair of tokens to its number of occurrences
weighted by those counts. The step picks the most frequent pair (a tie goes to the lexicographically greatest pair,
compared as a tuple of two bytes), merges every non-overlapping occurrence of it, left to right, in every word, and
updates the pair counts (a pair whose count drops to 0 is deleted). The function may update the two dicts in place
and return them, or return new ones: the grader reads only what it returns. It is tried on hand-made states (ties
that the smallest, the first-seen or the joined-bytes comparison break otherwise, overlapping occurrences such as
``(a, a, a)``, words with a count above 1, words of one token), random states with multi-byte tokens, then on thirty
consecutive states of training on a small corpus, whose chosen pairs must be ``train_bpe``'s first thirty merges. A
wrong result is named by the mistake that gives it (the tie rule, overlaps, unweighted or stale neighbour counts,
zero counts kept, pairs counted across words, ...).

``bpe_encode(pretoken, merges) -> tokens`` splits one pre-token (bytes) as a trained BPE does: from single bytes,
it repeatedly takes the adjacent pair that comes first in ``merges`` (its rank: its index there) and merges every
occurrence of it at once, left to right, until no adjacent pair is a merge; the tokens, a list of bytes, join back to
the pre-token (``[]`` for ``b""``). It is tried on hand-made merges that tell the rank rule from the longest
vocabulary match, from merging the leftmost (or the latest-learned) pair first, from a single merge, from one pass
over the merges and from merging one occurrence at a time (the last two differ only for merges out of training
order: a merge may join a token that a later merge makes), on UTF-8 pre-tokens (``'é'`` is two bytes), on the
empty pre-token, and on pre-tokens of seen and unseen text with the merges :func:`labkit.tokenizer.train_bpe`
learns from a small corpus. The hand-made cases come in an order where a hint names only a mistake that agreed with
the rule on every case passed before (the tie cases of ``bpe_merge_step`` too).

``minhash_signature(shingles, a, b) -> signature`` is MinHash with the universal hashes of
:func:`labkit.datapipe.minhash_permutations`: entry k is the minimum over the shingles x of
``(a[k] * x + b[k]) mod (2^61 - 1)``, exact, as a uint64 array of shape ``(len(a),)``; an empty set gives
``2^61 - 1`` everywhere, as :func:`labkit.datapipe.minhash_signatures` does. It is tried on the
:func:`labkit.datapipe.shingles` of real text, with 1 to 128 hash functions, on extreme values of a, b and x (where
``a * x`` needs 93 bits, so uint64, int64 or float64 arithmetic gives other minima), on one shingle and on none.

Tokens are bytes, which ``labkit.grade``'s wire format (:func:`labkit.checks._remote.encode`) does not carry (they
would come back as inert stand-ins), and that format reads thousands of small objects slowly: under ``labkit.grade``
each call runs through a labkit harness in the learner's process that sends the result as one JSON string, bytes,
tuples, dicts with tuple keys and numpy arrays (uint64 and object ones too) tagged, which the grader turns back into
what the learner's function returned. The arguments need nothing of the kind: they cross as a trusted pickle.
"""
from __future__ import annotations

import functools
import os
import random
import re
import tempfile

import numpy as np

from labkit.checks._core import CheckFailed, call, call_on_copies, fail, passed

__all__ = ["bpe_merge_step", "bpe_encode", "minhash_signature"]


# ----------------------------------------------------------------------------- the wire: bytes in results
def _to_wire(value, depth: int = 0):
    """``value`` as JSON-ready data: labkit.grade's wire format carries str, numbers, containers and arrays but not
    bytes (they would come back as inert stand-ins), and reads many small objects slowly, so :func:`_on_wire` sends a
    result as one JSON string. Bytes, bytearrays, tuples, dicts (any keys), numpy arrays and scalars are tagged;
    anything else becomes its type name and repr."""
    if depth > 40:
        return {"o": type(value).__name__, "r": "<nested too deeply>"}
    if value is None or isinstance(value, (bool, str)) or type(value) in (int, float):
        return value
    if isinstance(value, bytes):
        return {"b": value.hex()}
    if isinstance(value, bytearray):
        return {"ba": bytes(value).hex()}
    if isinstance(value, np.ndarray):
        carried = value.dtype.kind in "biuf" or value.dtype == object
        values = [_to_wire(v, depth + 1) for v in value.ravel().tolist()] if carried and value.size <= 1 << 20 else None
        return {"a": str(value.dtype), "shape": [int(n) for n in value.shape], "v": values}
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return {"n": str(value.dtype), "v": value.item()}
    if isinstance(value, (int, float)):  # subclasses (an IntEnum)
        return int(value) if isinstance(value, int) else float(value)
    if type(value) is tuple and all(type(v) is bytes for v in value):  # a word or a pair: most of what is sent
        return {"tb": [v.hex() for v in value]}
    if isinstance(value, tuple):
        return {"t": [_to_wire(v, depth + 1) for v in value]}
    if isinstance(value, list):
        return [_to_wire(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {"d": [[_to_wire(k, depth + 1), _to_wire(v, depth + 1)] for k, v in value.items()]}
    try:
        text = repr(value)[:300]
    except Exception:  # noqa: BLE001  (a learner's __repr__ may raise anything)
        text = f"<{type(value).__name__} object>"
    return {"o": type(value).__name__, "r": text}


def _from_wire(value):
    """The value :func:`_to_wire` described (an inert stand-in for what was not data); raises on malformed input."""
    from labkit.checks._remote import Opaque, _named, _opaque_types

    if isinstance(value, list):
        return [_from_wire(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "b" in value:
        return bytes.fromhex(value["b"])
    if "ba" in value:
        return bytearray(bytes.fromhex(value["ba"]))
    if "tb" in value:
        return tuple(bytes.fromhex(v) for v in value["tb"])
    if "t" in value:
        return tuple(_from_wire(v) for v in value["t"])
    if "d" in value:
        out = {}
        for k, v in value["d"]:
            k = _from_wire(k)
            out[k if getattr(type(k), "__hash__", None) is not None else repr(k)] = _from_wire(v)
        return out
    if "a" in value:
        dtype, shape, values = np.dtype(value["a"]), tuple(int(n) for n in value["shape"]), value["v"]
        if values is None:  # not carried: its dtype and shape only (no memory for a shape the learner chose)
            return np.broadcast_to(np.zeros((), dtype=dtype if dtype != object else np.int8), shape)
        if dtype == object:
            out = np.empty(len(values), dtype=object)
            out[:] = [_from_wire(v) for v in values]
            return out.reshape(shape)
        return np.array(values, dtype=dtype).reshape(shape)
    if "n" in value:
        return np.dtype(value["n"]).type(value["v"])
    if "o" in value:
        return _named(_opaque_types, str(value["o"]), Opaque)(str(value.get("r", "")))
    raise ValueError(f"an untagged dict {sorted(value)[:3]}")


def _on_wire(fn, *args) -> str:
    """Run where the learner's function is (labkit.grade: the learner's process): its result as JSON."""
    import json

    return json.dumps(_to_wire(fn(*args)))


def _call_wired(fn, tried: str, *args, hint: str = "run that call yourself and read the traceback"):
    """``fn(*args)``, through :func:`_on_wire` where ``fn`` is a handle to the learner's process."""
    import json

    from labkit.checks._remote import Remote, RemoteFailure, apply

    if not isinstance(fn, Remote):
        return call(fn, tried, *args, hint=hint)
    reply = call(apply, tried, _on_wire, fn, *args, hint=hint)
    try:
        return _from_wire(json.loads(reply))
    except Exception as err:  # noqa: BLE001  (whatever the learner's process sent, it is not a result)
        raise RemoteFailure(f"an unreadable result ({type(err).__name__}: {str(err)[:200]})") from None


def _show(value, limit: int = 220) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...}" if text.endswith("}") else text[: limit - 4] + " ..."


def _integral(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


# ----------------------------------------------------------------------------- bpe_merge_step: references
def _merge_word(word: tuple, pair: tuple, *, first_only: bool = False) -> tuple:
    """``word`` with every non-overlapping occurrence of ``pair`` merged, left to right (the rule), or only the
    first occurrence (a mistake)."""
    a, b = pair
    merged = a + b
    out, i, done = [], 0, False
    while i < len(word):
        if not done and i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(merged)
            i += 2
            done = first_only
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _merge_rtl(word: tuple, pair: tuple) -> tuple:
    """The occurrences merged scanning from the right (a mistake: (a, a, a) gives (a, aa))."""
    a, b = pair
    out, i = [], len(word) - 1
    while i >= 0:
        if i >= 1 and word[i - 1] == a and word[i] == b:
            out.append(a + b)
            i -= 2
        else:
            out.append(word[i])
            i -= 1
    return tuple(reversed(out))


def _merge_overlapping(word: tuple, pair: tuple) -> tuple:
    """A mistake: after a merge at i, going on at i + 1, so that a token is used twice ((a, a, a) gives (aa, aa))."""
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


def _count_pairs(word_counts: dict, weighted: bool = True) -> dict:
    counts: dict = {}
    for word, n in word_counts.items():
        for p in zip(word, word[1:]):
            counts[p] = counts.get(p, 0) + (n if weighted else 1)
    return counts


def _has_pair(word: tuple, pair: tuple) -> bool:
    return any(p == pair for p in zip(word, word[1:]))


def _best_pair(pair_counts: dict) -> tuple:
    """The most frequent pair; a tie goes to the lexicographically greatest (CS336's rule, GPT-2's trainer)."""
    return max(pair_counts, key=lambda p: (pair_counts[p], p))


def _reference_step(word_counts: dict, pair_counts: dict) -> tuple[tuple, dict, dict]:
    pair = _best_pair(pair_counts)
    words: dict = {}
    for word, n in word_counts.items():
        new = _merge_word(word, pair) if _has_pair(word, pair) else word
        words[new] = words.get(new, 0) + n
    return pair, words, _count_pairs(words)


def _words_of(text: str) -> dict:
    """The pre-token counts of ``text`` (GPT-2's regex, as train_bpe counts them), as tuples of single bytes."""
    from labkit.tokenizer import _PRETOKEN

    counts: dict = {}
    for piece in _PRETOKEN.findall(text):
        word = tuple(bytes([c]) for c in piece.encode("utf-8"))
        counts[word] = counts.get(word, 0) + 1
    return counts


_CORPUS = """\
The tokenizer turns text into the integers a model reads. Byte-level BPE starts from the 256 byte values, so that
every string can be encoded, then merges the most frequent adjacent pair of tokens, again and again, until the
vocabulary has the size it was asked for. The merges are learned from a corpus; the same merges, applied in the
order they were learned, split new text. The newest and the lowest, the widest and the lower: low, lower, lowest.
Then the other one, then the thing they thought through, then there and then. These three theses were there.
Café, naïve, résumé and façade keep their accents; 東京 and 日本語 are three bytes a character; emoji 🙂 are four.
Numbers like 1234 and 2024 are pre-tokens of their own, and so is punctuation such as !!! or ... or ---.
Deduplication finds documents that are copies, or nearly copies, of each other: MinHash estimates how many
shingles two documents share, without comparing every pair of documents shingle by shingle.
"""


@functools.lru_cache(maxsize=4)
def _trained(vocab_size: int) -> tuple[tuple[bytes, bytes], ...]:
    """The merges labkit's train_bpe learns from the corpus above (grader's copy: a tuple)."""
    from labkit.tokenizer import train_bpe

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "corpus.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(_CORPUS)
        _, merges = train_bpe(path, vocab_size, [], num_processes=1)
    return tuple(tuple(m) for m in merges)


# ----------------------------------------------------------------------------- bpe_merge_step: the grader
_STEP_RULE = ("one step: pair = max(pair_counts, key=lambda p: (pair_counts[p], p)); in every word that has it, merge "
              "each occurrence left to right without overlap (after a merge at i, go on at i + 2); pair_counts then "
              "equals a fresh count of the new words' adjacent pairs, each weighted by its word's count, without zeros")
_LEFT_TO_RIGHT = ("merge the occurrences left to right without overlap: after merging at i, go on at i + 2, so "
                  "(b'a', b'a', b'a') with the pair (b'a', b'a') gives (b'aa', b'a')")
_WEIGHT_HINT = ("weight each pair by its word's count: a word that occurs n times adds (or, when the merge destroys "
                "the pair, removes) n per occurrence, not 1")
_NOT_DECREMENTED = ("update the neighbour pairs of each merged occurrence: in (x, A, B, y), merging (A, B) destroys "
                    "(x, A), (A, B) and (B, y): subtract the word's count from each ({key!r} occurred {old} times, "
                    "weighted, in the words that were merged)")
_NOT_ADDED = ("update the neighbour pairs of each merged occurrence: in (x, A, B, y), merging (A, B) creates "
              "(x, AB) and (AB, y): add the word's count to each (and if you subtract all of a word's old pairs, add "
              "all of its new pairs back: {key!r} occurs {new} times, weighted, in the merged words)")
_ACROSS = ("pairs never cross pre-token boundaries: count the adjacent pairs inside each word only (the last token of "
           "one word and the first of the next are not a pair), and merge inside each word")


def _tie_variants(pair_counts: dict) -> list[tuple[str, tuple, str]]:
    """(name, pair, hint) of each wrong way to pick the pair that the grader can name."""
    best = max(pair_counts.values())
    tied = [p for p in pair_counts if pair_counts[p] == best]
    rule = (f"max(pair_counts, key=lambda p: (pair_counts[p], p)) (the pairs tied at {best} here: "
            f"{', '.join(map(repr, sorted(tied)))})")
    return [
        ("smallest", min(tied), f"a tie in count goes to the lexicographically greatest pair, not the smallest: {rule}"),
        ("first seen", tied[0], "a tie in count goes to the lexicographically greatest pair, not the first seen (max "
                                f"with key=pair_counts.get keeps the first of the tied pairs in dict order): {rule}"),
        ("last seen", tied[-1], f"a tie in count goes to the lexicographically greatest pair, not the last seen in dict "
                                f"order: {rule}"),
        ("joined", max(pair_counts, key=lambda p: (pair_counts[p], p[0] + p[1])),
         "compare tied pairs as tuples of two bytes, not by their joined bytes: (b'ab', b'c') > (b'a', b'z') as tuples, "
         f"since b'ab' > b'a', though b'abc' < b'az': {rule}"),
    ]


def _tie_hint(got: tuple, pair_counts: dict, ruled_out: set) -> str:
    best = max(pair_counts.values())
    if got not in pair_counts:
        return "choose one of the pairs in pair_counts (its keys are the adjacent pairs that occur): " + _STEP_RULE
    if pair_counts[got] != best:
        return (f"take the most frequent pair: {got!r} has count {pair_counts[got]}, the largest count in pair_counts "
                f"is {best}")
    return next((hint for name, pair, hint in _tie_variants(pair_counts) if pair == got and name not in ruled_out),
                "a tie in count goes to the lexicographically greatest pair: max(pair_counts, key=lambda p: "
                "(pair_counts[p], p))")


def _step_results(value, tried: str) -> tuple:
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        got = "None" if value is None else f"a {type(value).__name__}" + (
            f" of length {len(value)}" if isinstance(value, (tuple, list)) else "")
        fail(tried, got, "a tuple (pair, word_counts, pair_counts)",
             "your function returned None: did you forget `return`?" if value is None
             else "return pair, word_counts, pair_counts (the dicts may be the ones you were given, updated)")
    pair, words, pairs = value
    if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(t, bytes) for t in pair)):
        fail(tried, f"pair = {_show(pair)}", "a tuple of two bytes, e.g. (b's', b't')",
             "return the chosen pair as the key it has in pair_counts: a tuple (bytes, bytes)")
    for name, d in (("word_counts", words), ("pair_counts", pairs)):
        if not isinstance(d, dict):
            fail(tried, f"{name} is a {type(d).__name__}", "a dict", f"return {name} as a dict (a Counter or defaultdict "
                 "is fine), the one you were given updated or a new one")
        for key, n in d.items():
            if not (isinstance(key, tuple) and all(isinstance(t, bytes) for t in key)) or (name == "pair_counts" and len(key) != 2):
                fail(tried, f"{name} has the key {_show(key)}",
                     "keys that are tuples of bytes tokens" + (" (two of them)" if name == "pair_counts" else ""),
                     "tokens stay bytes (the merged token is pair[0] + pair[1], not a str or a joined word), "
                     "and each word stays a tuple of them")
            if not _integral(n):
                fail(tried, f"{name}[{key!r}] = {n!r} ({type(n).__name__})", "an int count",
                     "counts are whole numbers: add and subtract the words' int counts")
    return pair, {k: int(v) for k, v in words.items()}, {k: int(v) for k, v in pairs.items()}


def _check_words(words: dict, original: dict, pair: tuple, expected: dict, tried: str) -> None:
    if words == expected:
        return
    joined = {b"".join(w): (w, n) for w, n in original.items()}
    got_joined: dict = {}
    for w, n in words.items():
        got_joined.setdefault(b"".join(w), []).append((w, n))
    for j, found in got_joined.items():
        if j not in joined:
            w = found[0][0]
            overlap = any(_merge_overlapping(v, pair) == w for v, _ in joined.values())
            across = not overlap and any(j == x + y for x in joined for y in joined if x != y)
            fail(tried + "; then read word_counts", f"the word {_show(w)}, which is no pre-token's bytes",
                 "the same words, each split differently where the pair was",
                 _ACROSS if across else "a merge keeps the word's bytes, b''.join(new_word) == b''.join(word): "
                                        + _LEFT_TO_RIGHT)
    for j, (w, n) in joined.items():
        e = _merge_word(w, pair) if _has_pair(w, pair) else w
        if j not in got_joined:
            fail(tried + "; then read word_counts", f"no entry for the word {_show(w)}", f"{_show(e)}: {n}",
                 "keep every word, those without the pair too, each with its count")
        (g, m), *more = got_joined[j]
        if more:
            fail(tried + "; then read word_counts", f"the word {_show(w)} twice, as {_show(g)} and {_show(more[0][0])}",
                 f"once, as {_show(e)}", "replace each word that has the pair by its merged form (remove the old key)")
        if g != e:
            if g == w:
                hint = f"merge the pair {pair!r} in every word that contains it"
            elif g == _merge_rtl(w, pair):
                hint = _LEFT_TO_RIGHT + " (you scanned from the right)"
            elif g == _merge_word(w, pair, first_only=True):
                hint = "merge every occurrence of the pair in the word, not only the first one"
            else:
                hint = _LEFT_TO_RIGHT
            fail(tried + "; then read word_counts", f"{_show(w)} became {_show(g)}", _show(e), hint)
        if m != n:
            fail(tried + "; then read word_counts", f"{_show(g)}: {m}", f"{_show(e)}: {n}",
                 "a word keeps its count: merging changes how it is split, not how often it occurs")


def _check_pairs(pairs: dict, pair_counts: dict, original: dict, pair: tuple, expected: dict, tried: str) -> None:
    tried = tried + "; then read pair_counts"
    zeros = [k for k, v in pairs.items() if v == 0]
    if zeros:
        fail(tried, f"{zeros[0]!r}: 0", "no entry for that pair",
             "delete a pair whose count drops to 0 (del pair_counts[p]): pair_counts holds the pairs that occur")
    if pairs == expected:
        return
    changed = {w: n for w, n in original.items() if _has_pair(w, pair)}
    merged = {_merge_word(w, pair): n for w, n in changed.items()}
    old, new = _count_pairs(changed), _count_pairs(merged)
    old_1, new_1 = _count_pairs(changed, weighted=False), _count_pairs(merged, weighted=False)
    unweighted = {k: pair_counts.get(k, 0) - old_1.get(k, 0) + new_1.get(k, 0) for k in {*pair_counts, *new_1}}
    recount_1 = _count_pairs({w: 1 for w in _new_words(original, pair)}, weighted=False)  # pair_counts recounted, unweighted
    inside = {p for w in _new_words(original, pair) for p in zip(w, w[1:])} | set(pair_counts)
    firsts = {w[0] for w in _new_words(original, pair) if w}
    lasts = {w[-1] for w in _new_words(original, pair) if w}
    extra = [k for k in pairs if k not in expected]
    missing = [k for k in expected if k not in pairs]
    wrong = [k for k in expected if k in pairs and pairs[k] != expected[k]]
    for k in extra + missing + wrong:
        g, e = pairs.get(k), expected.get(k)
        shown_g = "no entry" if g is None else f"{k!r}: {g}"
        shown_e = "no entry for that pair" if e is None else f"{k!r}: {e}"
        if g is not None and g > 0 and (g == unweighted.get(k) or g == recount_1.get(k)) and g != e:
            hint = _WEIGHT_HINT
        elif k == pair and g is not None:
            hint = (f"the merged pair {pair!r} occurs nowhere after the merge: delete it from pair_counts (its count "
                    "drops to 0)")
        elif k in old and g in (pair_counts.get(k), pair_counts.get(k, 0) + new.get(k, 0)) and (e or 0) < g:
            hint = _NOT_DECREMENTED.format(key=k, old=old[k])  # left as it was, or only the new pairs added
        elif k in new and (g or 0) in (pair_counts.get(k, 0), pair_counts.get(k, 0) - old.get(k, 0)) and (e or 0) > (g or 0):
            hint = _NOT_ADDED.format(key=k, new=new[k])  # left as it was, or only the destroyed pairs subtracted
        elif e is None and k not in inside and k[0] in lasts and k[1] in firsts:
            hint = _ACROSS
        else:
            hint = _STEP_RULE
        fail(tried, shown_g, shown_e, hint)


def _new_words(original: dict, pair: tuple) -> list:
    return [_merge_word(w, pair) if _has_pair(w, pair) else w for w in original]


def _grade_step(fn, word_counts: dict, tried: str, pair_counts: dict | None, ruled_out: set) -> tuple:
    """One graded call on (copies of) a state; returns the reference's next state. ``ruled_out`` holds the wrong
    tie rules that earlier (passed) cases excluded, so that a hint names only one that gives this pair."""
    pair_counts = _count_pairs(word_counts) if pair_counts is None else pair_counts
    exp_pair, exp_words, exp_pairs = _reference_step(word_counts, pair_counts)
    got = _call_wired(fn, tried, dict(word_counts), dict(pair_counts))
    pair, words, pairs = _step_results(got, tried)
    if pair != exp_pair:
        fail(tried, f"pair {pair!r}" + (f" (count {pair_counts[pair]})" if pair in pair_counts else " (not in pair_counts)"),
             f"{exp_pair!r} (count {pair_counts[exp_pair]})", _tie_hint(pair, pair_counts, ruled_out))
    ruled_out.update(name for name, p, _ in _tie_variants(pair_counts) if p != exp_pair)
    _check_words(words, word_counts, exp_pair, exp_words, tried)
    _check_pairs(pairs, pair_counts, word_counts, exp_pair, exp_pairs, tried)
    return exp_pair, exp_words, exp_pairs


def _in_order(pairs: list, counts: dict) -> dict:
    """``counts`` with ``pairs`` first, in that order (the dict order a first-seen tie-break would follow)."""
    return {**{p: counts[p] for p in pairs}, **counts}


def _step_cases() -> list[tuple[str, dict, dict | None]]:
    B = lambda *tokens: tuple(t.encode("latin-1") if isinstance(t, str) else t for t in tokens)  # noqa: E731
    # the tie cases, in this order, tell each wrong tie rule from the ones not yet ruled out (see _grade_step)
    tie3 = {B("x", "b"): 2, B("b", "c"): 2, B("a", "b"): 2, B("z", "q", "z"): 1, B("z",): 4}
    counts = _count_pairs(tie3)
    cases = [("a three-way tie at count 2, the greatest pair seen first, the smallest second", tie3,
              _in_order([(b"x", b"b"), (b"a", b"b"), (b"b", b"c")], counts))]
    low = {B(*"low"): 5, B(*"lower"): 2, B(*"widest"): 3, B(*"newest"): 6}  # CS336's example: (e, s) and (s, t) tie
    cases.append(("CS336's example, where (b'e', b's') and (b's', b't') tie at 9", low,
                  _in_order([(b"s", b"t")], _count_pairs(low))))
    cases.append(("a three-way tie at count 2, the middle pair seen first", tie3,
                  _in_order([(b"b", b"c"), (b"a", b"b"), (b"x", b"b")], counts)))
    joined = {B("a", "z"): 3, B("ab", "c"): 3, B("a", "b"): 1, B("c", "a", "b"): 1}
    cases.append(("(b'ab', b'c') and (b'a', b'z') tie at 3 (b'abc' < b'az', but (b'ab', b'c') > (b'a', b'z'))", joined,
                  _in_order([(b"ab", b"c"), (b"a", b"z")], _count_pairs(joined))))
    overlap = {B(*"aaa"): 3, B(*"aaaa"): 1, B(*"baaab"): 2, B(*"ab"): 1}
    cases.append(("overlapping occurrences of (b'a', b'a')", overlap, None))
    the = {B(" t", "h", "e"): 7, B(" t", "h", "a", "t"): 3, B("h", "e", "h", "e"): 2, B("o", "t", "h", "e", "r"): 4,
           B("h",): 9, B("h", "e"): 5, B(" t",): 2}
    cases.append(("(b'h', b'e') in words that occur 2 to 7 times, one word of a single token, one that is the pair", the, None))
    rng = random.Random(11)
    alphabet = [b"a", b"b", b"c", b"ab", b" a", b"\xc3", b"\xa9", b"ca"]
    for _ in range(20):
        words: dict = {}
        seen: set = set()
        size = rng.randint(2, 9)
        while len(words) < size:
            word = tuple(rng.choice(alphabet) for _ in range(rng.randint(1, 7)))
            if b"".join(word) not in seen:
                seen.add(b"".join(word))
                words[word] = rng.randint(1, 5)
        if _count_pairs(words):
            counts = _count_pairs(words)
            order = list(counts)
            rng.shuffle(order)
            cases.append(("a random state (multi-byte tokens, pair counts in shuffled order)", words,
                          {p: counts[p] for p in order}))
    return cases


def bpe_merge_step(fn) -> None:
    """Grade ``fn(word_counts, pair_counts) -> (pair, word_counts, pair_counts)``: one step of BPE training. The
    dicts map words (tuples of bytes tokens) to counts and adjacent pairs to weighted counts; ``fn`` may update them
    in place and return them, or return new ones."""
    ruled_out: set = set()
    for what, words, counts in _step_cases():
        tried = f"bpe_merge_step(word_counts={_show(words, 300)}, pair_counts=its weighted pair counts) [{what}]"
        _grade_step(fn, words, tried, counts, ruled_out)
        if what.startswith("CS336"):
            try:
                _grade_step(fn, words, tried + " (called a second time)", counts, ruled_out)
            except CheckFailed as err:
                got = next((line.strip() for line in str(err).splitlines() if line.strip().startswith("got:")), "got: ?")
                fail(tried + " (called twice)", f"a wrong result the second time ({got}), the first was right",
                     "the same result for the same input", "does your function keep state between calls (a global, a "
                     "cache, a default argument that is a dict) or hand out dicts that a later call changes?")
    steps = 30
    merges = _trained(256 + steps)
    words = _words_of(_CORPUS)
    counts = _count_pairs(words)
    for i in range(steps):
        tried = (f"bpe_merge_step on the state after {i} merges of training on a small corpus ({len(words)} distinct "
                 f"pre-tokens, {len(counts)} pairs), given your previous steps' results")
        pair, words, counts = _grade_step(fn, words, tried, counts, ruled_out)
        if pair != merges[i]:  # the reference and train_bpe agree (tests/test_checks_ch11.py); kept as a guard
            fail(tried, f"merge {pair!r}", f"train_bpe's merge {merges[i]!r}", _STEP_RULE)
    passed("bpe_merge_step", f"the tie rule, overlapping pairs, weighted and incremental pair counts are right, and "
                             f"{steps} steps give train_bpe's first {steps} merges")


# ----------------------------------------------------------------------------- bpe_encode: references
def _apply_all(parts: list, pair: tuple, first_only: bool = False) -> list:
    return list(_merge_word(tuple(parts), pair, first_only=first_only))


def _ranks(merges) -> dict:
    ranks: dict = {}
    for i, m in enumerate(merges):
        ranks.setdefault(tuple(m), i)
    return ranks


def _encode_reference(pretoken: bytes, merges, *, latest_first: bool = False, first_only: bool = False,
                      single_step: bool = False, start=None) -> list:
    """The rule (repeatedly merge every occurrence of the present pair of lowest rank), or a mistake: the highest
    rank first, the first occurrence only, one merge only, or another starting split (``start``)."""
    ranks = _ranks(merges)
    parts = list(start) if start is not None else [pretoken[i : i + 1] for i in range(len(pretoken))]
    while len(parts) > 1:
        present = [p for p in zip(parts, parts[1:]) if p in ranks]
        if not present:
            break
        pair = (max if latest_first else min)(present, key=ranks.__getitem__)
        parts = _apply_all(parts, pair, first_only)
        if single_step:
            break
    return parts


def _encode_greedy(pretoken: bytes, merges) -> list:
    """The longest vocabulary match, left to right (WordPiece's rule, not BPE's)."""
    vocab = {a + b for a, b in merges} | {bytes([c]) for c in range(256)}
    longest = max(map(len, vocab))
    parts, i = [], 0
    while i < len(pretoken):
        n = next(n for n in range(min(longest, len(pretoken) - i), 0, -1) if pretoken[i : i + n] in vocab)
        parts.append(pretoken[i : i + n])
        i += n
    return parts


def _encode_leftmost(pretoken: bytes, merges) -> list:
    """Merging the leftmost adjacent pair that is a merge, whatever its rank, until none is."""
    ranks = _ranks(merges)
    parts = [pretoken[i : i + 1] for i in range(len(pretoken))]
    while True:
        i = next((i for i in range(len(parts) - 1) if (parts[i], parts[i + 1]) in ranks), None)
        if i is None:
            return parts
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def _encode_one_pass(pretoken: bytes, merges, first_only: bool = False) -> list:
    """One pass over the merges in their order, each applied to the split the previous ones left."""
    parts = [pretoken[i : i + 1] for i in range(len(pretoken))]
    for m in merges:
        parts = _apply_all(parts, tuple(m), first_only)
    return parts


def _characters(pretoken: bytes) -> list | None:
    try:
        return [c.encode("utf-8") for c in pretoken.decode("utf-8")]
    except UnicodeDecodeError:
        return None


_RANK_RULE = ("BPE encodes by rank: from single bytes, find the adjacent pair whose merge comes first in merges (the "
              "lowest index), merge all its occurrences left to right, and repeat until no adjacent pair is in merges")


def _encode_variants(pretoken: bytes, merges) -> list[tuple[str, list | None, str]]:
    """(name, tokens, hint) of each mistake the grader can name, on this pre-token and these merges."""
    chars = _characters(pretoken)
    return [
        ("no merges", [pretoken[i : i + 1] for i in range(len(pretoken))], "apply the merges: " + _RANK_RULE),
        ("characters", _encode_reference(pretoken, merges, start=chars) if chars is not None and len(chars) < len(pretoken)
         else None,
         "start from single bytes, not characters: a pre-token is UTF-8 bytes ('é' is the two bytes b'\\xc3\\xa9'), "
         "so begin with [pretoken[i:i+1] for i in range(len(pretoken))], and a merge may join part of a character"),
        ("longest match", _encode_greedy(pretoken, merges),
         "that is the longest vocabulary match, left to right, not BPE: " + _RANK_RULE + " (a merge learned earlier "
         "wins wherever it is, and may keep a longer token from forming)"),
        ("leftmost first", _encode_leftmost(pretoken, merges),
         "do not merge pairs in the order they appear in the word: " + _RANK_RULE),
        ("latest first", _encode_reference(pretoken, merges, latest_first=True),
         "the merge learned first (the lowest index in merges) goes first, not the latest: " + _RANK_RULE),
        ("one merge", _encode_reference(pretoken, merges, single_step=True),
         "keep merging until no adjacent pair is in merges, not just once: " + _RANK_RULE),
        ("one pass, first occurrence", _encode_one_pass(pretoken, merges, first_only=True),
         "merge every occurrence of the pair, not only the first: (b'a', b'b') in b'abab' gives [b'ab', b'ab']; "
         "and " + _RANK_RULE),
        ("one pass", _encode_one_pass(pretoken, merges),
         "one pass over merges in their order is not enough: a merge may join a token that a later merge makes (these "
         "merges are not in training order), and it applies once that token exists. " + _RANK_RULE),
        ("first occurrence", _encode_reference(pretoken, merges, first_only=True),
         "merge every occurrence of the chosen pair at once, left to right, before choosing the next pair (here "
         "merging one occurrence lets a lower-ranked pair form first): " + _RANK_RULE),
    ]


def _check_encode(fn, pretoken: bytes, merges: list, tried: str, ruled_out: set) -> list:
    """One graded call. ``ruled_out`` holds the mistakes that earlier (passed) cases excluded: a hint names only a
    mistake that gives this result and agreed with the rule wherever the function was right."""
    expected = _encode_reference(pretoken, merges)
    got = _call_wired(fn, tried, pretoken, [tuple(m) for m in merges])
    if not isinstance(got, (list, tuple)):
        fail(tried, "None" if got is None else f"a {type(got).__name__}", "a list of bytes tokens",
             "your function returned None: did you forget `return`?" if got is None else "return the tokens as a list of bytes")
    got = list(got)
    for t in got:
        if not isinstance(t, bytes):
            if _integral(t):
                hint = ("indexing bytes gives an int: the single-byte tokens are pretoken[i:i+1] (or bytes([b])), "
                        "and a merged token is a + b")
            elif isinstance(t, str):
                hint = "tokens are bytes, not str: work on the pre-token's bytes and do not decode them"
            else:
                hint = "each token is a bytes object (bytes, not bytearray or a list of ints)"
            fail(tried, f"the token {_show(t)} ({type(t).__name__})", "bytes tokens", hint)
    variants = _encode_variants(pretoken, merges)
    if got == expected:
        ruled_out.update(name for name, tokens, _ in variants if tokens is not None and tokens != expected)
        return got
    if not pretoken:
        fail(tried, _show(got), "[]", "an empty pre-token has no tokens: return [] (not [b''])")
    if b"".join(got) != pretoken:
        fail(tried, f"{_show(got)}, which joins to {_show(b''.join(got))}", _show(expected),
             "the tokens must join back to the pre-token, b''.join(tokens) == pretoken: merge occurrences left to "
             "right without overlap (after a merge at i, go on at i + 2)")
    hint = next((h for name, tokens, h in variants if tokens == got and name not in ruled_out), _RANK_RULE)
    fail(tried, _show(got), _show(expected), hint)
    return got


def _encode_cases() -> list[tuple[bytes, list, str]]:
    trained = list(_trained(256 + 120))
    trained_what = f"merges=the {len(trained)} merges train_bpe learns from a small corpus"
    hand = [  # in this order, each case leaves one more mistake to tell apart (see _check_encode's ruled_out)
        (b"", trained, trained_what),
        (b"abc", [(b"a", b"b"), (b"b", b"c")], None),
        (b"abc", [(b"a", b"b"), (b"b", b"c"), (b"a", b"bc")], None),
        (b"abc", [(b"b", b"c"), (b"a", b"b")], None),
        (b"abcd", [(b"c", b"d"), (b"b", b"cd"), (b"a", b"b"), (b"ab", b"cd")], None),
        (b" the", [(b"h", b"e"), (b" ", b"t"), (b" t", b"he")], None),
        (b"the", [(b"t", b"h"), (b"th", b"e")], None),
        (b"abab", [(b"a", b"b")], None),
        (b"xabcab", [(b"a", b"b"), (b"c", b"ab"), (b"x", b"ab")], None),
        (b"aaaa", [(b"a", b"a")], None),
        (b"aaa", [(b"a", b"a"), (b"aa", b"a")], None),
        (b"abc", [(b"ab", b"c"), (b"a", b"b")], None),
        (b"abab", [(b"ab", b"a"), (b"a", b"b")], None),
        ("é".encode(), [], None),
        (" café".encode(), [(b"\xc3", b"\xa9"), (b"f", b"\xc3\xa9"), (b"a", b"f"), (b" ", b"c")], None),
        ("日本".encode(), [(b"\xe6", b"\x97"), (b"\xa5", b"\xe6")], None),
    ]
    cases = [(p, m, w or f"merges={m!r}") for p, m, w in hand]
    from labkit.tokenizer import _PRETOKEN

    seen = sorted(set(_PRETOKEN.findall(_CORPUS)), key=lambda s: (-len(s.encode()), s))[:25]
    unseen = _PRETOKEN.findall(" Lowest newer theses: the tokenizer's résumé, 東京タワー 🙂🙂 and 12345 thousand")
    for piece in [*seen, *unseen]:
        cases.append((piece.encode("utf-8"), trained, trained_what))
    return cases


def bpe_encode(fn) -> None:
    """Grade ``fn(pretoken, merges) -> list[bytes]``: one pre-token (bytes) split by BPE with ``merges`` (a list of
    ``(bytes, bytes)`` pairs in the order they were learned)."""
    ruled_out: set = set()
    for pretoken, merges, what in _encode_cases():
        tried = f"bpe_encode({pretoken!r}, {what})"
        got = _check_encode(fn, pretoken, merges, tried, ruled_out)
        if pretoken == b"abab" and len(merges) == 1:
            again = _call_wired(fn, tried + " (called a second time)", pretoken, list(merges))
            if again != got:
                fail(tried + " (called twice)", f"{_show(again)} the second time", _show(got),
                     "does your function keep state between calls (ranks cached from an earlier call's merges)?")
    passed("bpe_encode", "merges by rank until none applies, on bytes (UTF-8 pre-tokens too), the empty pre-token, "
                         "and train_bpe's merges on seen and unseen text")


# ----------------------------------------------------------------------------- minhash_signature
_P = (1 << 61) - 1
_EMPTY_HINT = ("an empty set has no minimum: its signature is p = 2^61 - 1 in every entry (a value no hash takes), "
               "as labkit.datapipe.minhash_signatures gives: np.full(len(a), 2**61 - 1, dtype=np.uint64)")
_OVERFLOW_HINT = ("a * x needs up to 93 bits (a < 2^61, x < 2^32), and uint64 or int64 arithmetic silently wraps modulo "
                  "2^64, so the `% p` comes too late. Split a into 32-bit halves, a = a_hi * 2^32 + a_lo: a_lo * x < 2^64 "
                  "and t = a_hi * x < 2^61 fit, and t * 2^32 = (t >> 29) + ((t & (2^29 - 1)) << 32) (mod p) since "
                  "2^61 = 1 (mod p) (reduce any uint64 y to (y & p) + (y >> 61), then subtract p once if needed); or "
                  "compute with Python ints (an object array: a.astype(object) * x.astype(object)), exact at any size, "
                  "and convert the minima with .astype(np.uint64)")


def _signature_reference(x: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    from labkit.datapipe import _universal_hash

    if x.size == 0:
        return np.full(len(a), _P, dtype=np.uint64)
    return _universal_hash(x.astype(np.uint64)[:, None], a, b).min(axis=0)


def _exact(x: np.ndarray, a: np.ndarray, b: np.ndarray, reduce=min, modulus=_P, plus_b: bool = True) -> np.ndarray:
    return np.array([reduce((int(ak) * int(xi) + (int(bk) if plus_b else 0)) % modulus for xi in x.tolist())
                     for ak, bk in zip(a.tolist(), b.tolist())], dtype=np.uint64)


def _signature_hint(got: np.ndarray, x: np.ndarray, a: np.ndarray, b: np.ndarray, expected: np.ndarray) -> str:
    if x.size == 0:
        return _EMPTY_HINT
    with np.errstate(all="ignore"):
        xs, col = x.astype(np.uint64)[:, None], x.astype(np.uint64)[:, None]
        wrapped = (a * xs + b) % np.uint64(_P)
        signed = (a.astype(np.int64) * col.astype(np.int64) + b.astype(np.int64)) % np.int64(_P)
        floats = np.mod(a.astype(np.float64) * col.astype(np.float64) + b.astype(np.float64), float(_P))
        variants = [
            (wrapped.min(axis=0), _OVERFLOW_HINT),
            (signed.min(axis=0).astype(np.uint64), _OVERFLOW_HINT),
            (_exact(x, a, b, reduce=max), "MinHash keeps the minimum over the shingles, not the maximum"),
            ((a * xs + b).min(axis=0), "reduce modulo the prime p = 2^61 - 1: (a * x + b) % p, not modulo 2^64 (no % at "
                                       "all) — and compute a * x without overflow. " + _OVERFLOW_HINT),
            (_exact(x, a, b, modulus=1 << 32), "reduce modulo the prime p = 2^61 - 1, not modulo 2^32"),
            (((a * xs + b) & np.uint64(0xFFFFFFFF)).min(axis=0), "reduce modulo the prime p = 2^61 - 1, not modulo 2^32"),
            (_exact(x, a, b, plus_b=False), "the hash is (a * x + b) mod p: add b before reducing"),
            (_exact(x, b, a), "the hash is (a[k] * x + b[k]) mod p: a multiplies, b is added (you swapped them)"),
        ]
    for variant, hint in variants:
        if np.array_equal(got, variant) and not np.array_equal(variant, expected):
            return hint
    if np.array_equal(got, np.minimum.reduce(floats, axis=0).astype(np.uint64)) or (
            np.abs(got.astype(np.float64) - expected.astype(np.float64)) < 2.0**48).all():
        return ("that is close but not exact, as float64 gives: 53 bits of mantissa round a * x (up to 93 bits) by "
                "up to 2^40. " + _OVERFLOW_HINT)
    if np.isin(got, x.astype(np.uint64)).all() and not np.isin(expected, x.astype(np.uint64)).all():
        return "the signature holds the minimum hash value (a * x + b) mod p, not the shingle x that attains it"
    if (got < len(x)).all():
        return "the signature holds the minimum hash value (a * x + b) mod p, not the index of the shingle"
    return ("entry k is min over the shingles x of (a[k] * x + b[k]) mod (2^61 - 1), computed exactly; "
            + _OVERFLOW_HINT)


def _check_signature(fn, x: np.ndarray, a: np.ndarray, b: np.ndarray, tried: str) -> None:
    expected = _signature_reference(x, a, b)
    got = call_on_copies(lambda *args: _call_wired(fn, tried, *args, hint=_EMPTY_HINT if x.size == 0 else
                                                   "run that call yourself and read the traceback"),
                         tried, x, a, b,
                         mutation_hint="leave shingles, a and b unchanged: compute into new arrays "
                                       "(x = shingles.astype(np.uint64), not in-place ops on the inputs)")
    if got is None:
        fail(tried, "None", "a numpy array", "your function returned None: did you forget `return`?")
    if not isinstance(got, np.ndarray):
        kind = type(got).__name__
        fail(tried, f"a {kind}", f"a numpy array of shape ({len(a)},), dtype uint64",
             "return a numpy array: np.array(values, dtype=np.uint64)" if kind in ("list", "tuple")
             else "return a numpy array (np.ndarray), not a " + kind)
    n, k = len(x), len(a)
    if got.shape != (k,):
        if got.shape in ((k, n), (n, k)) and n > 1:
            hint = ("take the minimum over the shingles (.min(axis=...) over the shingles' axis): one value per hash "
                    f"function, shape ({k},)")
        elif got.size == k:
            hint = f"return a 1-D signature of shape ({k},) (one entry per hash function)"
        else:
            hint = f"one entry per hash function: shape (len(a),) = ({k},), the minimum over the shingles"
        fail(tried, f"shape {got.shape}", f"shape ({k},)", hint)
    if got.dtype != np.uint64:
        values_right = got.dtype.kind in "iuO" and all(int(v) == int(e) for v, e in zip(got.tolist(), expected.tolist()))
        fail(tried, f"dtype {got.dtype}", "dtype uint64",
             ("the values are right: convert them with .astype(np.uint64)" if values_right
              else "return uint64 values, and compute them exactly: " + _OVERFLOW_HINT if got.dtype.kind == "f"
              else "return the signature as uint64 (np.uint64), exactly (a * x + b) mod p"))
    if not np.array_equal(got, expected):
        wrong = int(np.flatnonzero(got != expected)[0])
        fail(tried, f"signature[{wrong}] = {int(got[wrong])}", f"{int(expected[wrong])} (a[{wrong}] = {int(a[wrong])}, "
             f"b[{wrong}] = {int(b[wrong])})", _signature_hint(got, x, a, b, expected))


_TEXTS = [
    _CORPUS,
    "Deduplication finds documents that are copies, or nearly copies, of each other: MinHash estimates how many "
    "shingles two documents share, without comparing every pair of documents shingle by shingle. " * 3,
    "MIT License. Permission is hereby granted, free of charge, to any person obtaining a copy of this software and "
    "associated documentation files, to deal in the Software without restriction.",
    "short text",
]


def minhash_signature(fn) -> None:
    """Grade ``fn(shingles, a, b) -> signature``: ``shingles`` a 1-D uint32 array of shingle hashes, ``a`` and ``b``
    uint64 arrays of ``num_perm`` hash parameters (:func:`labkit.datapipe.minhash_permutations`); the signature is
    the uint64 array of ``min over x of (a[k] * x + b[k]) mod (2^61 - 1)``, all ``2^61 - 1`` for no shingles."""
    from labkit.datapipe import minhash_permutations, shingles

    a128, b128 = minhash_permutations(128, seed=0)
    words = len(re.findall(r"\w+", _TEXTS[0]))
    edge_x = np.array([0, 1, 2, 0xFFFFFFFF, 0xFFFFFFFE, 0x80000000, 12345], dtype=np.uint32)
    edge_a = np.array([1, _P - 1, _P - 2, (1 << 60) + 12345, 0xFFFFFFFF, (1 << 32) + 1, 3], dtype=np.uint64)
    edge_b = np.array([0, _P - 1, 1, _P - 2, (1 << 60), 0, _P - 3], dtype=np.uint64)
    cases = [
        (shingles(_TEXTS[0]), a128, b128, f"shingles(a {words}-word text) (word 5-grams)"),
        (shingles(_TEXTS[1], n=3), *minhash_permutations(16, seed=1), "shingles(a repeated paragraph, n=3)"),
        (shingles(_TEXTS[2]), *minhash_permutations(7, seed=2), "shingles(a licence's first sentence)"),
        (shingles(_TEXTS[3]), *minhash_permutations(5, seed=3), "shingles('short text'): one shingle"),
        (edge_x, edge_a, edge_b, "shingles 0, 1, 2^32 - 1, ... with a up to p - 1 and b up to p - 1"),
        (edge_x[::-1].copy(), a128[:1], b128[:1], "unsorted shingles, one hash function"),
        (np.array([0xFFFFFFFF], dtype=np.uint32), np.array([_P - 1], dtype=np.uint64), np.array([_P - 1], dtype=np.uint64),
         "the shingle 2^32 - 1 with a = b = p - 1"),
        (shingles(""), a128[:8], b128[:8], "shingles('') (no words: an empty set)"),
        (np.empty(0, dtype=np.uint32), a128, b128, "an empty uint32 array"),
    ]
    for x, a, b, what in cases:
        tried = f"minhash_signature({what}: {len(x)} shingles, a and b of {len(a)} hash functions)"
        _check_signature(fn, x, a, b, tried)
    tried = f"minhash_signature({cases[0][3]}) called a second time"
    _check_signature(fn, *cases[0][:3], tried)
    passed("minhash_signature", "exact (a * x + b) mod 2^61 - 1 minima (no 64-bit overflow) on real shingles, extreme "
                                "a, b and x, one shingle and the empty set, as uint64")
