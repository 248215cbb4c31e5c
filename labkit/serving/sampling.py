"""Choosing the next token: greedy, temperature, top-k, top-p and the repetition penalties.

Each request carries a :class:`SamplingParams`. :func:`next_token_probs` turns one step's logits into
the exact distribution the token is drawn from; :func:`sample_next` draws from it (or takes the argmax
when ``temperature=0``). The steps run in Hugging Face's and vLLM's order:

1. penalties on the raw logits, over the tokens seen so far (``previous_ids``):
   repetition penalty (CTRL, Keskar et al. 2019, as Hugging Face applies it: a seen token's logit is
   divided by the penalty when positive and multiplied by it when negative, once per distinct token),
   then frequency and presence penalties (OpenAI's convention:
   ``logit -= count * frequency_penalty + (count > 0) * presence_penalty``);
2. temperature: ``logits / T`` (``T = 0`` is greedy: the argmax of the penalised logits);
3. top-k: keep the ``k`` largest logits (ties with the k-th largest are kept too);
4. top-p (nucleus, Holtzman et al. 2020): keep the smallest set of most likely tokens whose
   probability adds up to at least ``p``;
5. softmax over what is left.

Reproducible per request: ``SamplingParams(seed=...)`` gives the request its own ``torch.Generator``
(:meth:`SamplingParams.make_generator`), so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "SamplingParams", "apply_penalties", "top_k_filter", "top_p_filter", "next_token_probs", "sample_next",
]


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens (validated on construction; ``ValueError`` names the field)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None  # None = no top-k cut
    top_p: float | None = None  # None (or 1.0) = no nucleus cut
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages tokens already seen
    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence
    presence_penalty: float = 0.0  # subtracted once if the token occurred at all
    seed: int | None = None  # None = the caller's generator (or torch's global one)

    def __post_init__(self):
        _check_real("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: expected >= 0 (0 = greedy)")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k={self.top_k!r}: expected a positive integer or None")
        if self.top_p is not None:
            _check_real("top_p", self.top_p)
            if not 0 < self.top_p <= 1:
                raise ValueError(f"top_p={self.top_p}: expected 0 < top_p <= 1 or None")
        _check_real("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty}: expected > 0 (1 = off)")
        _check_real("frequency_penalty", self.frequency_penalty)
        _check_real("presence_penalty", self.presence_penalty)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed={self.seed!r}: expected a non-negative integer below 2**63 or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_history(self) -> bool:
        """Whether the distribution depends on the tokens seen so far (any penalty switched on)."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    def make_generator(self, device=None) -> torch.Generator | None:
        """A fresh generator seeded with ``seed`` (None without a seed). Make it once per request and
        pass it to every :func:`sample_next` call of that request."""
        if self.seed is None:
            return None
        generator = torch.Generator(device=device if device is not None else "cpu")
        generator.manual_seed(self.seed)
        return generator



def apply_penalties(logits: torch.Tensor, params: SamplingParams, previous_ids) -> torch.Tensor:
    """Logits (float32, ``[V]`` or ``[B, V]``) after the repetition, frequency and presence penalties over
    ``previous_ids``: the tokens seen so far (the engine passes the prompt and the generated tokens), one
    sequence for ``[V]``, one per row for ``[B, V]``."""
    logits = logits.float()
    if not params.uses_history:
        return logits
    rows = [previous_ids] if logits.dim() == 1 else previous_ids
    counts = _counts(rows, logits.shape[-1], logits.device).reshape(logits.shape)
    seen = counts > 0
    if params.repetition_penalty != 1:
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if params.frequency_penalty != 0 or params.presence_penalty != 0:
        logits = logits - counts * params.frequency_penalty - seen.float() * params.presence_penalty
    return logits


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits`` with everything below the k-th largest set to ``-inf`` (along the last dim)."""
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """``logits`` with ``-inf`` outside the nucleus: the smallest set of most likely tokens whose
    probabilities sum to at least ``p`` (a token is kept when the mass strictly above it is < p)."""
    if p >= 1:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_above = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_above >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def next_token_probs(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams] | None = None,
                     previous_ids=None) -> torch.Tensor:
    """The distribution the next token is drawn from: float32 ``[V]`` for logits ``[V]``, ``[B, V]`` for
    ``[B, V]`` (one-hot at the argmax for greedy; ``params=None`` is greedy). For a batch, ``params`` may be one per row and
    ``previous_ids`` is one sequence per row (or ``None``)."""
    rows, params_rows, history_rows = _rows(logits, params, previous_ids)
    if all(p is params_rows[0] for p in params_rows):  # one request's params: every row at once
        probs = _filtered_probs(apply_penalties(torch.stack(rows), params_rows[0], history_rows), params_rows[0])
    else:
        probs = torch.stack([_filtered_probs(apply_penalties(row, p, h), p) for row, p, h in zip(rows, params_rows, history_rows)])
    return probs[0] if logits.dim() == 1 else probs

def sample_next(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams] | None = None,
                previous_ids=None, generator=None) -> torch.Tensor:
    """Draw the next token: a 0-dim int64 tensor for logits ``[V]``, ``[B]`` for ``[B, V]``.

    ``generator`` is a ``torch.Generator`` (or one per row, or ``None`` for torch's global one); a
    request with a ``seed`` should pass the generator its :meth:`SamplingParams.make_generator` made.
    Greedy rows take the argmax (the first one on ties, as ``labkit.model.generate`` does) and use no
    random numbers."""
    probs = next_token_probs(logits, params, previous_ids)
    rows = probs if probs.dim() == 2 else probs[None]
    params_rows = [params] * len(rows) if params is None or isinstance(params, SamplingParams) else list(params)
    if generator is None or isinstance(generator, torch.Generator):
        if not any(p is None or p.greedy for p in params_rows):  # one draw for the whole batch
            out = torch.multinomial(rows, 1, generator=generator)[:, 0]
            return out[0] if logits.dim() == 1 else out
        generators = [generator] * len(rows)
    else:
        generators = list(generator)
        if len(generators) != len(rows):
            raise ValueError(f"generator: expected one per row ({len(rows)}), got {len(generators)}")
    out = torch.stack([row.argmax() if p is None or p.greedy else torch.multinomial(row, 1, generator=gen)[0]
                       for row, p, gen in zip(rows, params_rows, generators)])
    return out[0] if logits.dim() == 1 else out


# ----------------------------------------------------------------------------- helpers
def _filtered_probs(penalised: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Steps 2-5 (temperature, top-k, top-p, softmax) along the last dim of penalised logits."""
    if params.greedy:
        return torch.zeros_like(penalised).scatter_(-1, penalised.argmax(dim=-1, keepdim=True), 1.0)
    logits = penalised / params.temperature
    if params.top_k is not None:
        logits = top_k_filter(logits, params.top_k)
    if params.top_p is not None:
        logits = top_p_filter(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def _rows(logits, params, previous_ids):
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits: expected a floating-point torch.Tensor, got {type(logits).__name__}"
                        + (f" of dtype {logits.dtype}" if isinstance(logits, torch.Tensor) else ""))
    if logits.dim() not in (1, 2) or logits.shape[-1] == 0 or logits.numel() == 0:
        raise ValueError(f"logits: expected a non-empty [V] or [B, V] tensor, got shape {tuple(logits.shape)}")
    if torch.isnan(logits).any():
        raise ValueError("logits: contains NaN")
    rows = [logits] if logits.dim() == 1 else list(logits)
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        params_rows = [params] * len(rows)
    else:
        params_rows = list(params)
        if len(params_rows) != len(rows) or not all(isinstance(p, SamplingParams) for p in params_rows):
            raise ValueError(f"params: expected a SamplingParams or one per row ({len(rows)})")
    if previous_ids is None:
        history_rows = [None] * len(rows)
    elif logits.dim() == 1:
        history_rows = [previous_ids]
    else:
        history_rows = list(previous_ids)
        if len(history_rows) != len(rows):
            raise ValueError(f"previous_ids: expected one sequence per row ({len(rows)}), got {len(history_rows)}")
    return rows, params_rows, history_rows


def _counts(previous_ids, vocab_size: int, device) -> torch.Tensor:
    """``[len(previous_ids), vocab_size]`` float32: how often each token id occurs in each row's sequence."""
    rows = [torch.as_tensor([] if ids is None else ids, device=device) for ids in previous_ids]
    for ids in rows:
        if ids.dim() != 1 or (ids.numel() and ids.is_floating_point()):
            raise ValueError(f"previous_ids: expected 1-D sequences of token ids, got shape {tuple(ids.shape)}")
    flat = torch.cat([ids.long() for ids in rows])
    if flat.numel() and (flat.min() < 0 or flat.max() >= vocab_size):
        raise ValueError(f"previous_ids: token ids must lie in [0, {vocab_size}), got {flat.min().item()}..{flat.max().item()}")
    row_of = torch.repeat_interleave(torch.arange(len(rows), device=device), torch.tensor([len(ids) for ids in rows], device=device))
    counts = torch.zeros(len(rows), vocab_size, device=device)
    return counts.index_put_((row_of, flat), torch.ones_like(flat, dtype=counts.dtype), accumulate=True)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_real(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: expected a finite number")
