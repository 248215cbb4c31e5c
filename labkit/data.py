"""Data that needs no download: a character tokenizer, a generated arithmetic task whose
quality is measured by exact-match accuracy (not only loss), and ``get_batch``."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from labkit.runtime import check_device


class CharTokenizer:
    """One token per character of a fixed alphabet."""

    def __init__(self, alphabet: str):
        if len(set(alphabet)) != len(alphabet) or not alphabet:
            raise ValueError(f"alphabet={alphabet!r}: expected a non-empty string of distinct characters")
        self.alphabet = alphabet
        self._index = {ch: i for i, ch in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - self._index.keys())
        if unknown:
            raise ValueError(f"text: characters {unknown} are not in the alphabet {self.alphabet!r}")
        return [self._index[ch] for ch in text]

    def decode(self, ids) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids: {bad[:5]} out of range [0, {self.vocab_size})")
        return "".join(self.alphabet[i] for i in ids)


OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
SPLITS = ("train", "val", "test")


@dataclass
class ArithmeticTask:
    """Fixed-width arithmetic written as text, e.g. ``"07+35=042;"`` for ``num_digits=2``.

    Every operand pair ``(a, b)`` belongs to exactly one split (a seeded shuffle of all
    pairs), so a model is never evaluated on a problem it was trained on. Operands and answer
    are zero-padded to fixed widths, so every prompt (``"07+35="``) has the same length and a
    whole split is evaluated in one batched greedy decode. ``reverse_answer`` writes the
    answer's digits least-significant first, the order in which carries are computed.
    """

    num_digits: int = 2
    op: str = "+"
    reverse_answer: bool = False
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
    seed: int = 0
    tokenizer: CharTokenizer = field(init=False, repr=False)

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"op={self.op!r}: expected one of {sorted(OPS)}")
        if not isinstance(self.num_digits, int) or not 1 <= self.num_digits <= 4:
            raise ValueError(f"num_digits={self.num_digits!r}: expected an integer from 1 to 4")
        if len(self.fractions) != 3 or min(self.fractions) <= 0 or abs(sum(self.fractions) - 1) > 1e-9:
            raise ValueError(f"fractions={self.fractions}: expected three positive numbers (train, val, test) summing to 1")
        self.tokenizer = CharTokenizer("0123456789+-*=;")
        n = 10**self.num_digits
        pairs = np.stack(np.meshgrid(np.arange(n), np.arange(n), indexing="ij"), -1).reshape(-1, 2)
        pairs = pairs[np.random.default_rng(self.seed).permutation(len(pairs))]
        cut1 = int(round(self.fractions[0] * len(pairs)))
        cut2 = cut1 + int(round(self.fractions[1] * len(pairs)))
        self._splits = {"train": pairs[:cut1], "val": pairs[cut1:cut2], "test": pairs[cut2:]}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def answer_width(self) -> int:
        # widest answer: sum has one extra digit, product twice the digits, difference a sign
        return {"+": self.num_digits + 1, "-": self.num_digits + 1, "*": 2 * self.num_digits}[self.op]

    @property
    def prompt_length(self) -> int:
        return 2 * self.num_digits + 2  # "aa+bb="

    @property
    def example_length(self) -> int:
        return self.prompt_length + self.answer_width + 1  # answer + ";"

    def answer(self, a: int, b: int) -> str:
        value = OPS[self.op](int(a), int(b))
        sign = "-" if value < 0 else ""
        digits = str(abs(value)).zfill(self.answer_width - len(sign))
        return sign + (digits[::-1] if self.reverse_answer else digits)

    def prompt(self, a: int, b: int) -> str:
        return f"{int(a):0{self.num_digits}d}{self.op}{int(b):0{self.num_digits}d}="

    def format(self, a: int, b: int) -> str:
        return f"{self.prompt(a, b)}{self.answer(a, b)};"

    def pairs(self, split: str) -> np.ndarray:
        """The ``[n, 2]`` operand pairs of a split."""
        if split not in SPLITS:
            raise ValueError(f"split={split!r}: expected one of {SPLITS}")
        return self._splits[split]

    def tokens(self, split: str) -> np.ndarray:
        """All examples of a split, concatenated into one 1-D array of token ids (for ``get_batch``)."""
        text = "".join(self.format(a, b) for a, b in self.pairs(split))
        return np.asarray(self.tokenizer.encode(text), dtype=np.int64)

    def evaluate(self, model, split: str = "val", max_examples: int | None = None, device=None, use_cache: bool = True) -> float:
        """Exact-match accuracy of greedy answers on ``split`` (first ``max_examples`` pairs)."""
        return self._answer_matches(model, split, max_examples, device, use_cache).all(dim=1).float().mean().item()

    def digit_accuracy(self, model, split: str = "val", max_examples: int | None = None, device=None, use_cache: bool = True) -> list[float]:
        """Accuracy of each answer character separately, in the order they are written."""
        return self._answer_matches(model, split, max_examples, device, use_cache).float().mean(dim=0).tolist()

    def chance_digit_accuracy(self, split: str = "val") -> list[float]:
        """Per answer character, the accuracy of always guessing that character's most common value in ``split``:
        the level a model reaches without computing anything (10% for a uniform digit; about 50% for the
        leading digit of a 2-digit sum, which is 0 or 1)."""
        answers = [self.answer(a, b) for a, b in self.pairs(split)]
        if not answers:
            raise ValueError(f"split={split!r}: no examples")
        return [Counter(column).most_common(1)[0][1] / len(answers) for column in zip(*answers)]

    def _answer_matches(self, model, split, max_examples, device, use_cache) -> torch.Tensor:
        """``[examples, answer_width]`` booleans: greedy answer character == correct character."""
        from labkit.model import generate

        pairs = self.pairs(split)[:max_examples]
        if len(pairs) == 0:
            raise ValueError(f"max_examples={max_examples}: no examples to evaluate")
        device = device if device is not None else next(model.parameters()).device
        prompts = torch.tensor([self.tokenizer.encode(self.prompt(a, b)) for a, b in pairs], device=device)
        out = generate(model, prompts, max_new_tokens=self.answer_width, use_cache=use_cache)
        predicted = out[:, self.prompt_length :].cpu()
        expected = torch.tensor([self.tokenizer.encode(self.answer(a, b)) for a, b in pairs])
        return predicted == expected


def get_batch(dataset: np.ndarray, batch_size: int, context_length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``batch_size`` windows of ``context_length`` tokens uniformly from ``dataset``.

    Returns ``(x, y)``, LongTensors ``[batch_size, context_length]`` on ``device``, where
    ``y`` is ``x`` shifted by one token (the next-token targets). Start positions are uniform
    over every window that fits: ``0 .. len(dataset) - context_length - 1``. On CUDA the batch
    is staged in pinned host memory and copied with ``non_blocking=True``, so the copy can
    overlap with GPU work. Uses torch's global RNG (seed it, and checkpoints restore it).
    """
    dev = check_device(device)
    data = np.asarray(dataset)
    if data.ndim != 1:
        raise ValueError(f"dataset: expected a 1-D array of token ids, got shape {data.shape}")
    if not np.issubdtype(data.dtype, np.integer):
        raise TypeError(f"dataset: expected integer token ids, got dtype {data.dtype}")
    if batch_size <= 0 or context_length <= 0:
        raise ValueError(f"batch_size={batch_size}, context_length={context_length}: expected positive integers")
    if len(data) < context_length + 1:
        raise ValueError(f"dataset: needs at least context_length + 1 = {context_length + 1} tokens, has {len(data)}")
    starts = torch.randint(0, len(data) - context_length, (batch_size,))
    offsets = torch.arange(context_length + 1)
    # gather the windows in numpy first: on a memmapped token file only these tokens are read and converted,
    # not the whole file on every call
    windows = torch.from_numpy(data[(starts[:, None] + offsets).numpy()].astype(np.int64))
    if dev.type == "cuda":
        windows = windows.pin_memory().to(dev, non_blocking=True)
    else:
        windows = windows.to(dev)
    return windows[:, :-1], windows[:, 1:]
