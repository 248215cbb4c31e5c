import numpy as np
import pytest
import torch
from torch import nn

from labkit.data import ArithmeticTask, CharTokenizer, get_batch


def test_tokenizer_round_trip_and_errors():
    tok = CharTokenizer("ab;")
    assert tok.decode(tok.encode("ab;ba")) == "ab;ba"
    assert tok.vocab_size == 3
    with pytest.raises(ValueError, match="not in the alphabet"):
        tok.encode("abc")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([5])
    with pytest.raises(ValueError, match="distinct"):
        CharTokenizer("aa")


@pytest.mark.parametrize("op", ["+", "-", "*"])
@pytest.mark.parametrize("reverse", [False, True])
def test_examples_are_correct_and_fixed_width(op, reverse):
    task = ArithmeticTask(num_digits=2, op=op, reverse_answer=reverse)
    for a, b in task.pairs("val")[:50]:
        text = task.format(a, b)
        assert len(text) == task.example_length
        prompt, answer = text[:-1].split("=")
        assert prompt + "=" == task.prompt(a, b) and len(prompt) + 1 == task.prompt_length
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        digits = answer.lstrip("-")
        assert int(digits[::-1] if reverse else digits) == abs(value)
        assert answer.startswith("-") == (value < 0)


def test_splits_partition_all_pairs_without_overlap():
    task = ArithmeticTask(num_digits=2)
    splits = {name: {tuple(p) for p in task.pairs(name)} for name in ("train", "val", "test")}
    assert sum(map(len, splits.values())) == 100 * 100
    assert not (splits["train"] & splits["val"]) and not (splits["train"] & splits["test"]) and not (splits["val"] & splits["test"])
    assert len(splits["train"]) == 8000
    # same seed, same split; other seed, other split
    assert np.array_equal(ArithmeticTask(seed=0).pairs("val"), task.pairs("val"))
    assert not np.array_equal(ArithmeticTask(seed=1).pairs("val"), task.pairs("val"))


def test_tokens_concatenate_examples():
    task = ArithmeticTask(num_digits=1)
    tokens = task.tokens("test")
    assert tokens.dtype == np.int64
    assert len(tokens) == len(task.pairs("test")) * task.example_length
    assert task.tokenizer.decode(tokens[: task.example_length]) == task.format(*task.pairs("test")[0])


@pytest.mark.parametrize("kwargs, match", [(dict(op="/"), "op"), (dict(num_digits=0), "num_digits"), (dict(fractions=(0.5, 0.5, 0.5)), "fractions")])
def test_bad_task_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticTask(**kwargs)


class _Oracle(nn.Module):
    """Answers prompts of an ArithmeticTask correctly, except (optionally) when a is odd."""

    def __init__(self, task: ArithmeticTask, wrong_when_a_odd: bool):
        super().__init__()
        self.task, self.wrong_when_a_odd = task, wrong_when_a_odd
        self.config = type("Config", (), {"context_length": 64})()
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, token_ids, kv_cache=None):
        tok = self.task.tokenizer
        logits = torch.full((*token_ids.shape, tok.vocab_size), -1e9)
        for row, ids in enumerate(token_ids):
            text = tok.decode(ids)
            a, b = (int(s) for s in text[: self.task.prompt_length - 1].split(self.task.op))
            answer = self.task.answer(a, b)
            if self.wrong_when_a_odd and a % 2:
                answer = answer[:-1] + str((int(answer[-1]) + 1) % 10)
            done = len(text) - self.task.prompt_length
            logits[row, -1, tok.encode(answer[done])[0]] = 0.0
        return logits


def test_evaluate_measures_exact_match():
    task = ArithmeticTask(num_digits=2)
    assert task.evaluate(_Oracle(task, False), "val", max_examples=200, use_cache=False) == 1.0
    pairs = task.pairs("val")[:200]
    expected = float(np.mean(pairs[:, 0] % 2 == 0))
    assert task.evaluate(_Oracle(task, True), "val", max_examples=200, use_cache=False) == pytest.approx(expected)


def test_digit_accuracy_locates_the_wrong_digit():
    task = ArithmeticTask(num_digits=2)
    pairs = task.pairs("val")[:100]
    odd = float(np.mean(pairs[:, 0] % 2 == 1))
    accuracy = task.digit_accuracy(_Oracle(task, True), "val", max_examples=100, use_cache=False)
    assert accuracy[:-1] == [1.0] * (task.answer_width - 1)  # only the last digit is ever wrong
    assert accuracy[-1] == pytest.approx(1 - odd)


def test_get_batch_shapes_shift_and_range():
    data = np.arange(100)
    x, y = get_batch(data, 8, 16, "cpu")
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.long
    assert torch.equal(y, x + 1)
    assert torch.equal(x[:, 1:], x[:, :-1] + 1)
    assert x.min() >= 0 and y.max() <= 99


def test_get_batch_starts_cover_every_valid_position_uniformly():
    torch.manual_seed(0)
    data = np.arange(10)
    x, _ = get_batch(data, 20000, 6, "cpu")
    counts = torch.bincount(x[:, 0], minlength=10)
    assert counts[4:].sum() == 0  # starts 0..3 are the only windows with a next-token target
    assert (counts[:4] - 5000).abs().max() < 300


@pytest.mark.parametrize("device", ["cuda:99", "cuda"] if not torch.cuda.is_available() else ["cuda:99"])
def test_get_batch_unavailable_device_raises(device):
    with pytest.raises(ValueError, match="device"):
        get_batch(np.arange(100), 2, 4, device)
    # PyTorch raises RuntimeError for a missing device, and course code written against it
    # (e.g. Stanford CS336's get_batch test) expects RuntimeError or AssertionError
    with pytest.raises(RuntimeError, match="device="):
        get_batch(np.arange(100), 2, 4, device)
    with pytest.raises((RuntimeError, AssertionError)):  # the convention being matched
        torch.zeros(1, device=device)


def test_get_batch_bad_inputs():
    with pytest.raises(ValueError, match="dataset"):
        get_batch(np.arange(5), 2, 5, "cpu")
    with pytest.raises(ValueError, match="1-D"):
        get_batch(np.zeros((4, 4), dtype=np.int64), 2, 2, "cpu")
    with pytest.raises(TypeError, match="integer"):
        get_batch(np.linspace(0, 1, 50), 2, 2, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_get_batch_on_cuda():
    x, y = get_batch(np.arange(100), 4, 8, "cuda")
    assert x.is_cuda and torch.equal(y.cpu(), x.cpu() + 1)


def test_chance_digit_accuracy_is_the_majority_guess():
    task = ArithmeticTask(num_digits=2, op="+", reverse_answer=True)
    chance = task.chance_digit_accuracy("val")
    pairs = task.pairs("val")
    carries = sum(int(a) + int(b) >= 100 for a, b in pairs)
    assert chance[2] == max(carries, len(pairs) - carries) / len(pairs)  # the hundreds digit is 0 or 1
    assert all(0.09 < c < 0.13 for c in chance[:2])  # units and tens: about one value in ten
