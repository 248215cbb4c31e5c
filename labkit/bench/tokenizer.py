"""``python -m labkit.bench tokenizer`` — labkit's byte-level BPE against Hugging Face ``tokenizers`` and ``tiktoken``.

A CPU benchmark (tokenizing runs on the CPU everywhere): training bytes/s of ``labkit.tokenizer.train_bpe`` and of
``tokenizers``' ``BpeTrainer`` configured the same way (GPT-2's regex, all 256 bytes, no frequency floor) on chapter
11's corpus, and encoding bytes/s of GPT-2's tokenizer in labkit, ``tokenizers`` (GPT-2's vocab and merges) and
``tiktoken`` (GPT-2's ranks) on the same text. Before timing anything, every encoder must give labkit's ids: a
benchmark of encoders that disagree measures nothing. labkit's rate is also given as a fraction of each library's.
Both libraries are in the ``test`` extra; a missing one is reported as such.
"""
from __future__ import annotations

import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path

from labkit.bench import print_table
from labkit.tokenizer import GPT2_EOT, GPT2_PATTERN, bytes_to_unicode, gpt2_tokenizer, read_ranks, train_bpe


def corpus_text(max_chars: int | None = None) -> str:
    """Chapter 11's cleaned, deduplicated corpus, documents joined by ``<|endoftext|>`` (first ``max_chars``)."""
    from labkit.datapipe import corpus_documents, prepare_documents

    kept, _ = prepare_documents(corpus_documents())
    text = GPT2_EOT.join(d.text for d in kept)
    return text if max_chars is None else text[:max_chars]


def best_seconds(fn, repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``fn()``: the run least disturbed by whatever else the machine does."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: expected at least 1")
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _hf_trainer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[GPT2_EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=0)
    return tokenizer, trainer


def hf_bpe_merges(text: str, vocab_size: int) -> list[tuple[bytes, bytes]]:
    """The merges Hugging Face ``tokenizers``' trainer makes on ``text`` (documents joined by ``<|endoftext|>``),
    configured as ``labkit.tokenizer.train_bpe`` is, as pairs of bytes (its own strings are GPT-2's byte-to-unicode
    characters). Chapter 11 compares them with labkit's."""
    tokenizer, trainer = _hf_trainer(vocab_size)
    tokenizer.train_from_iterator(text.split(GPT2_EOT), trainer)  # it does not split on special tokens itself
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [tuple(bytes(to_byte[c] for c in half) for half in (m.split(" ") if isinstance(m, str) else m)) for m in merges]


def _hf_gpt2():
    """GPT-2's tokenizer in Hugging Face ``tokenizers``, built from labkit's vocab and merges (GPT-2's format)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    labkit_gpt2 = gpt2_tokenizer()
    to_unicode = bytes_to_unicode()

    def text_of(token: bytes) -> str:
        return "".join(to_unicode[b] for b in token)

    vocab = {text_of(t): i for i, t in labkit_gpt2.vocab.items() if t != GPT2_EOT.encode()}
    merges = [(text_of(a), text_of(b)) for a, b in labkit_gpt2.merges]
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([GPT2_EOT])
    return tokenizer


def tiktoken_gpt2():
    """tiktoken's GPT-2 encoding, built offline from the ranks labkit ships (``tiktoken.get_encoding("gpt2")``
    would download them)."""
    import tiktoken

    ranks = read_ranks()
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={GPT2_EOT: len(ranks)})


def run(max_chars: int | None = None, vocab_size: int = 4096, repeats: int = 3) -> list[dict]:
    """The benchmark's rows (one per library and task), printed as a table. ``max_chars`` cuts the corpus
    (the tests use a small one)."""
    text = corpus_text(max_chars)
    data = text.encode("utf-8")
    have = {name: importlib.util.find_spec(name) is not None for name in ("tokenizers", "tiktoken")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "corpus.txt"
        path.write_bytes(data)
        seconds = best_seconds(lambda: train_bpe(path, vocab_size, [GPT2_EOT], num_processes=1), repeats)
        rows.append({"task": f"train to {vocab_size} tokens", "library": "labkit", "seconds": seconds})
        if have["tokenizers"]:
            pieces = text.split(GPT2_EOT)  # its trainer does not split on special tokens: feed it the documents

            def hf_train():
                tokenizer, trainer = _hf_trainer(vocab_size)
                tokenizer.train_from_iterator(pieces, trainer)

            rows.append({"task": f"train to {vocab_size} tokens", "library": "tokenizers", "seconds": best_seconds(hf_train, repeats)})
    labkit_gpt2 = gpt2_tokenizer()
    expected = labkit_gpt2.encode(text)
    encoders = {"labkit": lambda: labkit_gpt2.encode(text)}
    if have["tokenizers"]:
        hf = _hf_gpt2()
        encoders["tokenizers"] = lambda: hf.encode(text).ids
    if have["tiktoken"]:
        enc = tiktoken_gpt2()
        encoders["tiktoken"] = lambda: enc.encode(text, allowed_special="all")
    for name, encode in encoders.items():
        if encode() != expected:
            raise RuntimeError(f"{name}'s GPT-2 encoding differs from labkit's on the benchmark text: its timing would mean nothing")
        # labkit caches each pre-token's encoding: its first pass over a text is the honest one, timed on a fresh tokenizer
        seconds = _first_pass_seconds(repeats, text) if name == "labkit" else best_seconds(encode, repeats)
        rows.append({"task": "encode with GPT-2's merges", "library": name, "seconds": seconds})
    for row in rows:
        row["bytes"] = len(data)
        row["MB/s"] = len(data) / row["seconds"] / 1e6
    for row in rows:
        labkit_row = next(r for r in rows if r["task"] == row["task"] and r["library"] == "labkit")
        row["labkit / this"] = labkit_row["MB/s"] / row["MB/s"]
    missing = [name for name, ok in have.items() if not ok]
    threads = os.environ.get("RAYON_NUM_THREADS", "all cores")
    print(f"corpus: {len(data):,} bytes of chapter 11's text; best of {repeats} runs each; labkit on one core, "
          f"tokenizers with RAYON_NUM_THREADS={threads}"
          + (f"; not installed: {', '.join(missing)} (pip install -e '.[test]')" if missing else ""))
    print_table([{**r, "seconds": f"{r['seconds']:.3f}", "MB/s": f"{r['MB/s']:.2f}", "labkit / this": f"{r['labkit / this']:.2f}"}
                 for r in rows])
    return rows


def _first_pass_seconds(repeats: int, text: str) -> float:
    """labkit's encoding time on a tokenizer that has not seen ``text`` (its pre-token cache empty)."""
    best = float("inf")
    for _ in range(repeats):
        tokenizer = gpt2_tokenizer()
        start = time.perf_counter()
        tokenizer.encode(text)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m labkit.bench tokenizer", description=__doc__)
    parser.add_argument("--max-chars", type=int, default=None, help="cut the corpus to this many characters")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this JSON file")
    args, _ = parser.parse_known_args()
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizers' thread pool, read when it starts: one core, as labkit's
    rows = run(args.max_chars, args.vocab_size)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
