"""Chapter 10: learning from preferences — reward models, DPO, and RL with a verifiable reward (GRPO).

Everything runs on the arithmetic task of :mod:`labkit.data` (no download): a prompt is ``"07+35="``,
a response is an answer such as ``"240;"`` (the adder's reversed, zero-padded sum). Because the task is
generated, the **true** reward of any response is known, so preference pairs can be labelled by it
(with label noise, as human raters make) and every learned quantity can be checked against it.

* :func:`token_logprobs`, :func:`sequence_logprobs`: log-probabilities of response tokens given a prompt
  (the shift by one done once; prompt and padding masked out);
* :func:`make_preference_pairs`: ``(prompt, chosen, rejected)`` pairs for two preferences, ``"correct"``
  (the right answer over a near miss) and ``"concise"`` (no zero padding, a format the adder never writes);
* :class:`RewardModel`, :func:`bradley_terry_loss`, :func:`preference_accuracy`;
* :func:`dpo_loss` (with the quantities TRL logs, label smoothing, and IPO);
* :func:`grpo_advantages`, :func:`grpo_loss` (GRPO and Dr. GRPO), :func:`grpo_step`, :func:`kl_estimate`;
* InstructGPT's PPO: :class:`ValueModel`, :func:`ppo_token_rewards` (the KL in every token's reward),
  :func:`gae_advantages`, :func:`ppo_loss` (clipped value loss optional), :func:`ppo_step`; what it costs beside
  GRPO: :class:`PassCounter`, :func:`rl_state_bytes`;
* :func:`expected_grpo_gradient`, :func:`expected_kl_loss_gradient`: exact expected updates on a small
  categorical policy (GRPO's length and difficulty weighting; which KL the k3 term's gradient follows);
* training helpers :func:`train_sft`, :func:`train_reward_model`, :func:`train_dpo`, :func:`train_grpo`, :func:`train_ppo`
  on :mod:`labkit.train`'s AdamW, clipping and cosine schedule, with a progress bar;
* :func:`load_early_adder`: the shipped adder's recipe stopped early (:data:`EARLY_STEPS`), a weak
  starting point for reinforcement learning (``python -m labkit.preference`` re-creates the asset).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from labkit.data import OPS, ArithmeticTask
from labkit.model import TransformerLM, generate
from labkit.nn import Linear
from labkit.pretrained import RECIPE, SEED, adder_task
from labkit.runtime import run_seed
from labkit.train import AdamW, atomic_save, clip_grad_norm, lr_cosine_schedule, train

PREFERENCES = ("correct", "concise")
DPO_LOSS_TYPES = ("sigmoid", "ipo")  # TRL's names: DPO's -log sigmoid(beta h), IPO's (h - 1/(2 beta))^2
GRPO_LOSS_TYPES = ("grpo", "dr_grpo")  # TRL's names: per-response token mean, or a constant divisor
EARLY_ASSET = Path(__file__).parent / "assets" / "early_adder.pt"
EARLY_STEPS = 1000  # of the adder's 3000-step recipe: it adds some problems right, most wrong


# ============================================================================ log-probabilities
def _check_ids(name: str, ids) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        got = f"{type(ids).__name__} {tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"{name}: expected an integer tensor [batch, length], got {got}")


def _response_mask(response_ids: torch.Tensor, response_mask: torch.Tensor | None) -> torch.Tensor:
    if response_mask is None:
        return torch.ones_like(response_ids, dtype=torch.bool)
    if not isinstance(response_mask, torch.Tensor) or response_mask.shape != response_ids.shape:
        raise ValueError(f"response_mask: expected a tensor of response_ids' shape {tuple(response_ids.shape)}, "
                         f"got {tuple(getattr(response_mask, 'shape', ()))}")
    mask = response_mask.bool()
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        raise ValueError("response_mask: expected right padding (True for the response's tokens, then False): "
                         "a real token after padding would be conditioned on the padding")
    return mask


def token_logprobs(model: nn.Module, prompt_ids: torch.Tensor, response_ids: torch.Tensor,
                   response_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``log p(response_t | prompt, response_<t)`` for every response token, ``[batch, response_len]``
    (fp32), 0 where ``response_mask`` is False (right padding).

    One forward pass over ``prompt + response`` (without its last token, which predicts nothing we
    score): the logits at position ``i`` predict token ``i + 1``, so response token ``j`` (at position
    ``P + j``) is scored by the logits at ``P + j - 1``. The prompt's own tokens are never scored.
    """
    _check_ids("prompt_ids", prompt_ids)
    _check_ids("response_ids", response_ids)
    if prompt_ids.shape[0] != response_ids.shape[0] or prompt_ids.shape[1] == 0 or response_ids.shape[1] == 0:
        raise ValueError(f"prompt_ids, response_ids: expected non-empty tensors with one batch size, got "
                         f"{tuple(prompt_ids.shape)} and {tuple(response_ids.shape)}")
    mask = _response_mask(response_ids, response_mask)
    prompt_len = prompt_ids.shape[1]
    full = torch.cat([prompt_ids, response_ids], dim=1).long()
    logits = model(full[:, :-1])[:, prompt_len - 1:].float()  # the positions that predict response tokens
    logps = torch.log_softmax(logits, dim=-1).gather(-1, response_ids.long().unsqueeze(-1)).squeeze(-1)
    return logps.masked_fill(~mask, 0.0)


def sequence_logprobs(model: nn.Module, prompt_ids: torch.Tensor, response_ids: torch.Tensor,
                      response_mask: torch.Tensor | None = None, average: bool = False) -> torch.Tensor:
    """``log p(response | prompt)``, ``[batch]``: the sum of :func:`token_logprobs` over the response's real
    tokens (what DPO and the Bradley-Terry view of a policy use), or with ``average=True`` their mean
    (a per-token score that does not favour short responses; SimPO and length-normalised variants)."""
    logps = token_logprobs(model, prompt_ids, response_ids, response_mask)
    total = logps.sum(dim=1)
    if not average:
        return total
    return total / _response_mask(response_ids, response_mask).sum(dim=1).clamp_min(1)


# ============================================================================ responses and true rewards
def answer_value(task: ArithmeticTask, text: str) -> int | None:
    """The number a response states: the digits before its first ``;`` read in the task's order (reversed
    for the adder), leading zeros allowed; ``None`` if it is not one to ``answer_width`` digits then ``;``."""
    body, sep, _ = text.partition(";")
    if not sep or not body or not body.isdigit() or len(body) > task.answer_width:
        return None
    return int(body[::-1] if task.reverse_answer else body)


def concise_answer(task: ArithmeticTask, a: int, b: int) -> str:
    """The answer without zero padding, e.g. ``"24;"`` where the adder writes ``"240;"`` (for ``42``)."""
    value = task.answer(a, b)
    digits = value[::-1] if task.reverse_answer else value
    digits = digits.lstrip("0") or "0"
    return (digits[::-1] if task.reverse_answer else digits) + ";"


def true_reward(task: ArithmeticTask, a: int, b: int, text: str, preference: str = "correct") -> float:
    """The hidden reward that labels the pairs. ``"correct"``: 1 for the right number (padded or not), else
    0 — a verifiable reward. ``"concise"``: 1 for the right number without padding, 0.5 for the right
    number with it, 0 for a wrong or malformed answer."""
    if preference not in PREFERENCES:
        raise ValueError(f"preference={preference!r}: expected one of {PREFERENCES}")
    value = answer_value(task, text)
    if value is None or value != OPS[task.op](int(a), int(b)):
        return 0.0
    if preference == "correct":
        return 1.0
    return 1.0 if text.partition(";")[0] + ";" == concise_answer(task, a, b) else 0.5


def _near_miss(task: ArithmeticTask, a: int, b: int, rng: np.random.Generator) -> str:
    """The right padded answer with one digit changed: a wrong answer that looks like a right one."""
    answer = list(task.answer(a, b))
    position = int(rng.integers(len(answer)))
    answer[position] = str((int(answer[position]) + int(rng.integers(1, 10))) % 10)
    return "".join(answer) + ";"


def _truncated(task: ArithmeticTask, a: int, b: int) -> str:
    """The concise answer with its last written digit dropped: short, and wrong."""
    body = concise_answer(task, a, b)[:-1]
    return (body[:-1] or "0") + ";"


@dataclass
class PreferencePairs:
    """Preference pairs on one split: token ids (responses right-padded, ``*_mask`` True on real tokens),
    the operands, the texts, the hidden true rewards, and which labels the noise flipped."""

    prompt_ids: torch.Tensor  # [n, prompt_len]
    chosen_ids: torch.Tensor  # [n, L]
    chosen_mask: torch.Tensor
    rejected_ids: torch.Tensor
    rejected_mask: torch.Tensor
    operands: np.ndarray  # [n, 2]
    chosen_text: list[str]
    rejected_text: list[str]
    chosen_reward: torch.Tensor  # true reward of what is labelled chosen (after noise)
    rejected_reward: torch.Tensor
    flipped: torch.Tensor  # [n] bool: the label disagrees with the true reward
    preference: str

    def __len__(self) -> int:
        return len(self.chosen_text)

    def subset(self, index) -> "PreferencePairs":
        """The pairs at ``index`` (a slice, an index tensor or array)."""
        if isinstance(index, torch.Tensor):
            index = index.cpu().numpy()
        idx = np.arange(len(self))[index]
        pick = lambda t: t[torch.as_tensor(idx, dtype=torch.long, device=t.device)]  # noqa: E731
        return PreferencePairs(pick(self.prompt_ids), pick(self.chosen_ids), pick(self.chosen_mask), pick(self.rejected_ids),
                               pick(self.rejected_mask), self.operands[idx], [self.chosen_text[i] for i in idx],
                               [self.rejected_text[i] for i in idx], pick(self.chosen_reward), pick(self.rejected_reward),
                               pick(self.flipped), self.preference)

    def to(self, device) -> "PreferencePairs":
        tensors = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **tensors)


def encode_responses(task: ArithmeticTask, texts: list[str], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids ``[n, max_len]`` and their mask (padding: the ``;`` token, masked out)."""
    encoded = [task.tokenizer.encode(t) for t in texts]
    width = max(len(e) for e in encoded)
    pad = task.tokenizer.encode(";")[0]
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.bool)
    for i, e in enumerate(encoded):
        ids[i, :len(e)] = torch.tensor(e)
        mask[i, :len(e)] = True
    return ids.to(device), mask.to(device)


def encode_prompts(task: ArithmeticTask, operands, device=None) -> torch.Tensor:
    """``[n, prompt_len]`` prompt ids for operand pairs (every prompt of a task has the same length)."""
    return torch.tensor([task.tokenizer.encode(task.prompt(a, b)) for a, b in operands], dtype=torch.long, device=device)


def make_preference_pairs(task: ArithmeticTask, split: str = "train", preference: str = "correct", noise: float = 0.0,
                          seed: int = 0, max_pairs: int | None = None, device=None) -> PreferencePairs:
    """One preference pair per operand pair of ``task``'s ``split`` (the splits of :class:`ArithmeticTask`
    are disjoint, so held-out pairs are about unseen problems), labelled by :func:`true_reward`.

    ``"correct"``: the right answer vs a near miss (one digit changed). ``"concise"``: where the answer has
    zero padding, the unpadded answer vs the padded one (both right: a *soft* preference); elsewhere the
    full answer vs the same with its last digit dropped (shorter, and wrong), so that the preference is for
    no padding, not for short answers. ``noise``: the probability that a rater swaps a pair's labels
    (seeded with ``seed``; ``flipped`` records which). The pairs are shuffled with ``seed``.
    """
    if preference not in PREFERENCES:
        raise ValueError(f"preference={preference!r}: expected one of {PREFERENCES}")
    if not isinstance(noise, (int, float)) or not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise={noise!r}: expected a probability in [0, 1]")
    rng = np.random.default_rng(run_seed(seed))
    operands = task.pairs(split)
    operands = operands[rng.permutation(len(operands))][:max_pairs]
    if len(operands) == 0:
        raise ValueError(f"max_pairs={max_pairs}: no pairs to build")
    first, second = [], []
    for a, b in operands:
        if preference == "correct":
            first.append(task.answer(a, b) + ";")
            second.append(_near_miss(task, a, b, rng))
        else:
            concise, padded = concise_answer(task, a, b), task.answer(a, b) + ";"
            first.append(concise)
            second.append(padded if padded != concise else _truncated(task, a, b))
    r_first = torch.tensor([true_reward(task, a, b, t, preference) for (a, b), t in zip(operands, first)])
    r_second = torch.tensor([true_reward(task, a, b, t, preference) for (a, b), t in zip(operands, second)])
    if not bool((r_first > r_second).all()):
        raise RuntimeError("make_preference_pairs: a candidate pair is not ordered by the true reward")
    flipped = torch.from_numpy(rng.random(len(operands)) < noise)
    chosen = [s if f else c for c, s, f in zip(first, second, flipped.tolist())]
    rejected = [c if f else s for c, s, f in zip(first, second, flipped.tolist())]
    chosen_ids, chosen_mask = encode_responses(task, chosen, device)
    rejected_ids, rejected_mask = encode_responses(task, rejected, device)
    return PreferencePairs(encode_prompts(task, operands, device), chosen_ids, chosen_mask, rejected_ids, rejected_mask,
                           operands, chosen, rejected, torch.where(flipped, r_second, r_first).to(device),
                           torch.where(flipped, r_first, r_second).to(device), flipped.to(device), preference)


# ============================================================================ sampling and verifiable rewards
def response_mask_from_stop(response_ids: torch.Tensor, stop_id: int) -> torch.Tensor:
    """True up to and including the first ``stop_id`` of each row (everything if there is none)."""
    is_stop = response_ids == stop_id
    before = torch.cumsum(is_stop.long(), dim=1) - is_stop.long()  # stops strictly before each position
    return before == 0


@torch.no_grad()
def sample_responses(model: nn.Module, prompt_ids: torch.Tensor, task: ArithmeticTask, temperature: float = 1.0,
                     generator: torch.Generator | None = None, max_new_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one response per prompt row (``temperature=0``: greedy); returns ids ``[n, max_new_tokens]``
    and the mask of the tokens up to the first ``;`` (the end of an answer)."""
    new = task.answer_width + 1 if max_new_tokens is None else max_new_tokens
    out = generate(model, prompt_ids, new, temperature=temperature, generator=generator)[:, prompt_ids.shape[1]:]
    return out, response_mask_from_stop(out, task.tokenizer.encode(";")[0])


def decode_responses(task: ArithmeticTask, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    return [task.tokenizer.decode(ids[mask]) for ids, mask in zip(response_ids.cpu(), response_mask.cpu())]


def decode_operands(task: ArithmeticTask, prompt_ids: torch.Tensor) -> list[tuple[int, int]]:
    n = task.num_digits
    texts = [task.tokenizer.decode(p) for p in prompt_ids.cpu()]
    return [(int(t[:n]), int(t[n + 1:2 * n + 1])) for t in texts]


def verifiable_reward(task: ArithmeticTask, preference: str = "correct") -> Callable:
    """``reward_fn(prompt_ids, response_ids, response_mask) -> [n]`` float tensor: :func:`true_reward` of
    each decoded response (``"correct"``: is the answer right — a reward checked, not learned)."""
    if preference not in PREFERENCES:
        raise ValueError(f"preference={preference!r}: expected one of {PREFERENCES}")

    def reward_fn(prompt_ids, response_ids, response_mask):
        texts = decode_responses(task, response_ids, response_mask)
        values = [true_reward(task, a, b, t, preference) for (a, b), t in zip(decode_operands(task, prompt_ids), texts)]
        return torch.tensor(values, device=response_ids.device)

    return reward_fn


@torch.no_grad()
def policy_report(model: nn.Module, task: ArithmeticTask, split: str = "val", preference: str = "correct",
                  max_examples: int | None = 256, samples: int = 0, seed: int = 0) -> dict:
    """Greedy answers on ``split``: mean true reward, accuracy (right number), fraction written concisely
    (no padding, right or wrong) and fraction malformed; with ``samples > 0`` also the mean true reward of
    that many sampled answers per prompt (temperature 1)."""
    device = next(model.parameters()).device
    operands = task.pairs(split)[:max_examples]
    prompts = encode_prompts(task, operands, device)
    ids, mask = sample_responses(model, prompts, task, temperature=0.0)
    texts = decode_responses(task, ids, mask)
    rewards = [true_reward(task, a, b, t, preference) for (a, b), t in zip(operands, texts)]
    correct = [true_reward(task, a, b, t, "correct") for (a, b), t in zip(operands, texts)]
    padded_width = task.answer_width + 1
    report = {"reward": float(np.mean(rewards)), "accuracy": float(np.mean(correct)),
              "concise": float(np.mean([len(t) < padded_width and t.endswith(";") for t in texts])),
              "malformed": float(np.mean([answer_value(task, t) is None for t in texts])), "texts": texts[:8]}
    if samples:
        gen = torch.Generator().manual_seed(seed)
        ids, mask = sample_responses(model, prompts.repeat_interleave(samples, 0), task, 1.0, gen)
        reward_fn = verifiable_reward(task, preference)
        report["sampled_reward"] = reward_fn(prompts.repeat_interleave(samples, 0), ids, mask).mean().item()
    return report


# ============================================================================ reward model
class _TrunkWithScalarHead(nn.Module):
    """A copy of a language model's trunk (its LM head removed: it returns the final-norm hidden states) and a
    trainable scalar head; the reward model and PPO's value model differ only in where they read it."""

    def __init__(self, backbone: TransformerLM):
        super().__init__()
        if not isinstance(backbone, TransformerLM):
            raise TypeError(f"backbone: expected a labkit TransformerLM, got {type(backbone).__name__}")
        self.trunk = copy.deepcopy(backbone)
        self.trunk.lm_head = nn.Identity()
        weight = backbone.lm_head.weight
        self.head = Linear(backbone.config.d_model, 1, device=weight.device, dtype=weight.dtype)
        self.trunk.requires_grad_(True)

    def _hidden(self, prompt_ids: torch.Tensor, response_ids: torch.Tensor) -> torch.Tensor:
        _check_ids("prompt_ids", prompt_ids)
        _check_ids("response_ids", response_ids)
        return self.trunk(torch.cat([prompt_ids, response_ids], dim=1).long())


class RewardModel(_TrunkWithScalarHead):
    """A language model's trunk (a copy of ``backbone`` with its LM head removed) and a scalar head read at
    each sequence's last real token: ``r(prompt, response)``. Both responses of a pair go through the same
    network; only the difference of their scores enters the loss (:func:`bradley_terry_loss`)."""

    def forward(self, prompt_ids: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Scores ``[batch]`` of ``prompt + response``, read at the response's last real token."""
        hidden = self._hidden(prompt_ids, response_ids)
        mask = _response_mask(response_ids, response_mask)
        last = prompt_ids.shape[1] + mask.sum(dim=1) - 1
        return self.head(hidden[torch.arange(hidden.shape[0], device=hidden.device), last]).squeeze(-1).float()

    def score_pairs(self, pairs: PreferencePairs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(r_chosen, r_rejected)`` for every pair."""
        return (self(pairs.prompt_ids, pairs.chosen_ids, pairs.chosen_mask),
                self(pairs.prompt_ids, pairs.rejected_ids, pairs.rejected_mask))


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """``-mean log sigmoid(r_chosen - r_rejected)``: the negative log-likelihood of the labels under the
    Bradley-Terry model ``P(chosen > rejected) = sigmoid(r_chosen - r_rejected)``. ``logsigmoid`` is
    computed stably (``-softplus(-d)``), so a large margin never overflows."""
    if not isinstance(r_chosen, torch.Tensor) or not isinstance(r_rejected, torch.Tensor) or r_chosen.shape != r_rejected.shape:
        raise ValueError("r_chosen, r_rejected: expected two tensors of one shape, got "
                         f"{tuple(getattr(r_chosen, 'shape', ()))} and {tuple(getattr(r_rejected, 'shape', ()))}")
    if r_chosen.numel() == 0:
        raise ValueError("r_chosen: expected at least one pair")
    return -torch.nn.functional.logsigmoid(r_chosen - r_rejected).mean()


def bradley_terry_probability(reward_difference) -> torch.Tensor:
    """``P(chosen > rejected) = sigmoid(r_chosen - r_rejected)`` under the Bradley-Terry model."""
    return torch.sigmoid(torch.as_tensor(reward_difference, dtype=torch.float64))


@torch.no_grad()
def preference_accuracy(reward_model: RewardModel, pairs: PreferencePairs, by_true_reward: bool = True) -> float:
    """Fraction of pairs the reward model orders right: by the hidden true reward (default; what the
    model should have learned even from noisy labels) or by the pairs' (possibly flipped) labels."""
    was = reward_model.training
    reward_model.eval()
    r_chosen, r_rejected = reward_model.score_pairs(pairs)
    reward_model.train(was)
    right = r_chosen > r_rejected
    if by_true_reward:
        right = torch.where(pairs.flipped, ~right, right)
    return right.float().mean().item()


# ============================================================================ DPO
class DPOLoss(NamedTuple):
    """What :func:`dpo_loss` returns: the loss and the quantities TRL's DPOTrainer logs (per pair; its
    ``rewards/chosen`` etc. are their means)."""

    loss: torch.Tensor  # scalar
    chosen_rewards: torch.Tensor  # beta * (log pi - log pi_ref) of the chosen responses, detached
    rejected_rewards: torch.Tensor
    margins: torch.Tensor  # chosen_rewards - rejected_rewards
    accuracy: torch.Tensor  # scalar: fraction of pairs with chosen_rewards > rejected_rewards


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, beta: float = 0.1, label_smoothing: float = 0.0,
             loss_type: str = "sigmoid") -> DPOLoss:
    """Direct preference optimisation (Rafailov et al., 2023) on summed response log-probabilities ``[n]``.

    The implicit reward of a response is ``beta * (log pi(y|x) - log pi_ref(y|x))``; the loss is the
    Bradley-Terry loss of the implicit rewards, ``-log sigmoid(beta * h)`` with
    ``h = (log pi_c - log pi_ref_c) - (log pi_r - log pi_ref_r)``. With ``label_smoothing = eps`` the
    labels are taken to be wrong with probability ``eps`` (the conservative DPO of Mitchell, 2023, TRL's
    ``label_smoothing``): ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``. ``loss_type="ipo"``
    is IPO (Azar et al., 2023, Eq. 17; TRL's ``loss_type="ipo"``): ``(h - 1 / (2 beta))^2``, which is
    minimised at a finite gap ``h = 1 / (2 beta)`` where DPO's loss only approaches 0 as ``h`` grows without
    bound. The reference is a constant: its log-probabilities are detached here, so a reference computed with
    gradients is never updated.
    """
    tensors = (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or len({t.shape for t in tensors}) != 1:
        raise ValueError("policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps: "
                         f"expected four tensors of one shape, got {[tuple(getattr(t, 'shape', ())) for t in tensors]}")
    if not isinstance(beta, (int, float)) or not beta > 0:
        raise ValueError(f"beta={beta!r}: expected a positive number")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing={label_smoothing!r}: expected a probability in [0, 0.5)")
    if loss_type not in DPO_LOSS_TYPES or (loss_type == "ipo" and label_smoothing):
        raise ValueError(f"loss_type={loss_type!r}, label_smoothing={label_smoothing!r}: expected a loss_type in "
                         f"{DPO_LOSS_TYPES}, label smoothing only with 'sigmoid'")
    chosen_logratio = policy_chosen_logps - ref_chosen_logps.detach()
    rejected_logratio = policy_rejected_logps - ref_rejected_logps.detach()
    h = chosen_logratio - rejected_logratio
    if loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        logsigmoid = torch.nn.functional.logsigmoid
        losses = -(1 - label_smoothing) * logsigmoid(beta * h) - label_smoothing * logsigmoid(-beta * h)
    chosen_rewards, rejected_rewards = beta * chosen_logratio.detach(), beta * rejected_logratio.detach()
    margins = chosen_rewards - rejected_rewards
    return DPOLoss(losses.mean(), chosen_rewards, rejected_rewards, margins, (chosen_rewards > rejected_rewards).float().mean())


def pair_logprobs(model: nn.Module, pairs: PreferencePairs) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities ``(chosen, rejected)`` of every pair under ``model`` (one batched forward)."""
    n = len(pairs)
    width = max(pairs.chosen_ids.shape[1], pairs.rejected_ids.shape[1])
    ids = torch.cat([_pad_to(pairs.chosen_ids, width), _pad_to(pairs.rejected_ids, width)])
    mask = torch.cat([_pad_to(pairs.chosen_mask, width), _pad_to(pairs.rejected_mask, width)])
    logps = sequence_logprobs(model, pairs.prompt_ids.repeat(2, 1), ids, mask)
    return logps[:n], logps[n:]


def _pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=0)


# ============================================================================ KL and GRPO
def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-sequence estimate of ``KL(pi || pi_ref)`` from tokens sampled from ``pi`` (``[n, T]`` log-probs,
    ``mask`` the real tokens), summed over each sequence's tokens. ``"k1"``: ``log pi - log pi_ref``
    (unbiased, can be negative); ``"k2"``: ``(log pi - log pi_ref)^2 / 2`` (never negative, biased);
    ``"k3"``: ``exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1`` (Schulman's estimator DeepSeekMath's
    GRPO uses: unbiased, and never negative)."""
    if estimator not in ("k1", "k2", "k3"):
        raise ValueError(f"estimator={estimator!r}: expected 'k1', 'k2' or 'k3'")
    log_ratio = ref_logps - logps
    if estimator == "k1":
        per_token = -log_ratio
    elif estimator == "k2":
        per_token = log_ratio ** 2 / 2
    else:
        per_token = torch.exp(log_ratio) - log_ratio - 1
    return (per_token * mask).sum(dim=1)


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4, scale_rewards: bool = True) -> torch.Tensor:
    """Group-normalised advantages: rewards ``[n_prompts * group_size]`` (each prompt's group contiguous),
    ``(r - mean of its group) / (std of its group + eps)`` (sample std, as TRL's GRPOTrainer). A group whose
    responses all got the same reward has advantage 0: it teaches nothing. ``scale_rewards=False`` leaves out
    the division by the std (Dr. GRPO, Liu et al. 2025; TRL's ``scale_rewards=False``): ``r - mean``."""
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size={group_size!r}: expected an integer >= 2 (a group needs a comparison)")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards: expected a 1-D tensor whose length is a multiple of group_size={group_size}, "
                         f"got shape {tuple(rewards.shape)}")
    groups = rewards.float().view(-1, group_size)
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if scale_rewards:
        advantages = advantages / (groups.std(dim=1, keepdim=True) + eps)
    return advantages.reshape(-1)


class GRPOLoss(NamedTuple):
    loss: torch.Tensor  # scalar, minimised
    kl: torch.Tensor  # mean per-token k3 KL to the reference
    clip_fraction: torch.Tensor  # fraction of tokens whose ratio was clipped


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor,
              advantages: torch.Tensor, beta: float = 0.04, clip: float = 0.2, loss_type: str = "grpo") -> GRPOLoss:
    """DeepSeekMath's GRPO objective, negated: per token ``min(rho A, clip(rho, 1 - clip, 1 + clip) A) -
    beta * k3``, with ``rho = pi / pi_old`` and the k3 KL to the reference (:func:`kl_estimate`), averaged
    over each response's tokens, then over responses (``loss_type="grpo"``: a response of ``|o|`` tokens
    weighs each of its tokens by ``1 / |o|``). ``loss_type="dr_grpo"`` (Dr. GRPO, Liu et al. 2025, as
    TRL's): the per-token terms summed and divided by a constant, ``n * T`` (``T``, the padded width, is
    the most tokens a response may have), so every token weighs the same whatever its response's length.
    ``logps`` ``[n, T]`` carries the gradient; ``old_logps`` (the sampling policy) and ``ref_logps`` are constants."""
    if not (logps.shape == old_logps.shape == ref_logps.shape == mask.shape) or advantages.shape != logps.shape[:1]:
        raise ValueError(f"logps, old_logps, ref_logps, mask: expected one shape [n, T] and advantages [n], got "
                         f"{[tuple(t.shape) for t in (logps, old_logps, ref_logps, mask, advantages)]}")
    if not 0 < clip < 1 or beta < 0:
        raise ValueError(f"clip={clip!r}, beta={beta!r}: expected 0 < clip < 1 and beta >= 0")
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: expected one of {GRPO_LOSS_TYPES}")
    mask = mask.float()
    surrogate, clipped = clipped_surrogate(logps, old_logps, advantages[:, None], clip)
    log_ratio_ref = ref_logps.detach() - logps
    k3 = torch.exp(log_ratio_ref) - log_ratio_ref - 1
    per_token = surrogate - beta * k3
    if loss_type == "grpo":
        loss = -((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1)).mean()
    else:
        loss = -(per_token * mask).sum() / mask.numel()
    tokens = mask.sum().clamp_min(1)
    return GRPOLoss(loss, ((k3 * mask).sum() / tokens).detach(), ((clipped * mask).sum() / tokens).detach())


def clipped_surrogate(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token (Schulman et al., 2017), ``min(rho A, clip(rho, 1 - clip, 1 + clip) A)``
    with ``rho = exp(logps - old_logps)`` (``old_logps`` and ``advantages`` constants; ``advantages`` broadcast
    against ``logps``: ``[n, 1]`` for one per response as in GRPO, ``[n, T]`` per token as in PPO), and a float
    mask of the tokens whose ratio lies outside the clip range."""
    ratio = torch.exp(logps - old_logps.detach())
    adv = advantages.detach()
    bounded = ratio.clamp(1 - clip, 1 + clip)
    return torch.minimum(ratio * adv, bounded * adv), (ratio != bounded).float()


def _check_updates(updates) -> None:
    if isinstance(updates, bool) or not isinstance(updates, int) or updates < 1:
        raise ValueError(f"updates={updates!r}: expected an int >= 1 (optimizer steps per batch of samples)")


def grpo_step(policy: nn.Module, ref: nn.Module, prompts: torch.Tensor, reward_fn: Callable, group_size: int,
              beta: float = 0.04, clip: float = 0.2, *, optimizer: torch.optim.Optimizer, task: ArithmeticTask,
              updates: int = 1, temperature: float = 1.0, generator: torch.Generator | None = None,
              grad_clip: float = 1.0, loss_type: str = "grpo", scale_rewards: bool = True) -> dict:
    """One GRPO iteration: sample ``group_size`` responses per prompt from ``policy`` (the old policy),
    score them with ``reward_fn(prompt_ids, response_ids, response_mask)``, normalise the rewards within
    each group (:func:`grpo_advantages`), then take ``updates`` optimizer steps on :func:`grpo_loss` (with
    ``updates > 1`` the ratio moves away from 1 and the clip matters; ``loss_type="dr_grpo"`` with
    ``scale_rewards=False`` is Dr. GRPO). Returns the step's mean reward,
    loss, k3 KL per token, clip fraction and the fraction of groups that carried any signal."""
    _check_ids("prompts", prompts)
    _check_updates(updates)
    prompt_ids = prompts.repeat_interleave(group_size, dim=0)
    response_ids, mask = sample_responses(policy, prompt_ids, task, temperature, generator)
    rewards = reward_fn(prompt_ids, response_ids, mask).float()
    advantages = grpo_advantages(rewards, group_size, scale_rewards=scale_rewards)
    with torch.no_grad():
        old_logps = token_logprobs(policy, prompt_ids, response_ids, mask)
        ref_logps = token_logprobs(ref, prompt_ids, response_ids, mask)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    policy.train()
    for _ in range(updates):
        logps = token_logprobs(policy, prompt_ids, response_ids, mask)
        out = grpo_loss(logps, old_logps, ref_logps, mask, advantages, beta, clip, loss_type)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        clip_grad_norm(params, grad_clip)
        optimizer.step()
    policy.eval()
    informative = (rewards.view(-1, group_size).std(dim=1) > 0).float().mean()
    return {"reward": rewards.mean().item(), "loss": out.loss.item(), "kl": out.kl.item(),
            "clip_fraction": out.clip_fraction.item(), "informative_groups": informative.item()}


@torch.no_grad()
def kl_to_reference(policy: nn.Module, ref: nn.Module, task: ArithmeticTask, split: str = "val", max_examples: int = 256,
                    samples: int = 4, seed: int = 0, estimator: str = "k1") -> float:
    """``KL(pi || pi_ref)`` per response in nats, estimated from ``samples`` responses per prompt sampled from
    ``policy`` at temperature 1 (:func:`kl_estimate` of their log-probabilities under both models)."""
    device = next(policy.parameters()).device
    prompts = encode_prompts(task, task.pairs(split)[:max_examples], device).repeat_interleave(samples, 0)
    ids, mask = sample_responses(policy, prompts, task, 1.0, torch.Generator().manual_seed(seed))
    return kl_estimate(token_logprobs(policy, prompts, ids, mask), token_logprobs(ref, prompts, ids, mask), mask, estimator).mean().item()


# ============================================================================ PPO with a value model (InstructGPT)
class ValueModel(_TrunkWithScalarHead):
    """PPO's critic: a copy of ``backbone``'s trunk with a scalar head read at every response position (a
    separate network, as in InstructGPT, where it starts from the reward model; here from ``backbone``).
    ``V[:, t]`` estimates the return from the state before response token ``t`` (prompt + response_<t),
    read at position ``P + t - 1``: the positions whose logits predict the response tokens."""

    def forward(self, prompt_ids: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Values ``[batch, response_len]`` (fp32), 0 where ``response_mask`` is False."""
        mask = _response_mask(response_ids, response_mask)
        hidden = self._hidden(prompt_ids, response_ids[:, :-1])[:, prompt_ids.shape[1] - 1:]
        return self.head(hidden).squeeze(-1).float().masked_fill(~mask, 0.0)


def ppo_token_rewards(logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor, scores: torch.Tensor,
                      beta: float) -> torch.Tensor:
    """The per-token reward of RLHF's PPO (Stiennon et al., 2020; Ouyang et al., 2022):
    ``-beta * (log pi(y_t) - log pi_ref(y_t))`` at every response token (the k1 KL estimate as a penalty), plus
    the sequence's score (a reward model's or a verifier's, ``[n]``) at its last real token; 0 on padding.
    ``[n, T]``, no gradient."""
    if not (logps.shape == ref_logps.shape == mask.shape) or scores.shape != logps.shape[:1]:
        raise ValueError(f"logps, ref_logps, mask: expected one shape [n, T] and scores [n], got "
                         f"{[tuple(t.shape) for t in (logps, ref_logps, mask, scores)]}")
    if beta < 0:
        raise ValueError(f"beta={beta!r}: expected beta >= 0")
    mask = _response_mask(mask, mask)
    rewards = (-beta * (logps - ref_logps).detach()).masked_fill(~mask, 0.0)
    last = mask.sum(dim=1) - 1
    if bool((last < 0).any()):
        raise ValueError("mask: every response needs at least one real token to carry its score")
    rows = torch.arange(len(scores), device=rewards.device)
    rewards[rows, last] += scores.to(rewards.dtype).detach()
    return rewards


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                   lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016): ``A_t = sum_l (gamma lam)^l delta_{t+l}`` with
    the TD residual ``delta_t = r_t + gamma V_{t+1} - V_t``, the value after a response's last real token being 0
    (the episode ends there). ``rewards``, ``values`` ``[n, T]``, ``mask`` right-padded. Returns
    ``(advantages, returns)``, ``returns = advantages + values`` (the value head's target); 0 on padding.
    ``lam = 1`` gives the Monte-Carlo return minus the value, ``lam = 0`` the one-step TD residual."""
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(f"rewards, values, mask: expected one shape [n, T], got "
                         f"{[tuple(t.shape) for t in (rewards, values, mask)]}")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma={gamma!r}, lam={lam!r}: expected both in [0, 1]")
    mask = _response_mask(mask, mask)
    rewards, values = rewards.detach().masked_fill(~mask, 0.0), values.detach().masked_fill(~mask, 0.0)
    next_values = torch.nn.functional.pad(values[:, 1:], (0, 1))  # 0 after the last real token (and on padding)
    deltas = rewards + gamma * next_values - values
    advantages = torch.zeros_like(deltas)
    running = torch.zeros_like(deltas[:, 0])
    for t in reversed(range(deltas.shape[1])):
        running = deltas[:, t] + gamma * lam * running
        advantages[:, t] = running
    advantages = advantages.masked_fill(~mask, 0.0)
    return advantages, (advantages + values).masked_fill(~mask, 0.0)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1)


def _whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``x`` shifted and scaled to mean 0 and std 1 over the real tokens of the batch (TRL's ``masked_whiten``)."""
    mean = _masked_mean(x, mask)
    std = _masked_mean((x - mean) ** 2, mask).sqrt()
    return ((x - mean) / (std + eps)).masked_fill(~mask, 0.0)


class PPOLoss(NamedTuple):
    loss: torch.Tensor  # scalar, minimised: policy_loss + value_weight * value_loss
    policy_loss: torch.Tensor
    value_loss: torch.Tensor
    clip_fraction: torch.Tensor  # fraction of tokens whose ratio was clipped
    value_clip_fraction: torch.Tensor  # fraction of tokens whose clipped value loss was the larger


def ppo_loss(logps: torch.Tensor, old_logps: torch.Tensor, values: torch.Tensor, old_values: torch.Tensor,
             advantages: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float = 0.2,
             value_clip: float | None = 0.2, value_weight: float = 0.1) -> PPOLoss:
    """PPO's loss over per-token advantages ``[n, T]`` (from :func:`gae_advantages`), averaged over the batch's
    real tokens: the policy term ``-min(rho A, clip(rho) A)`` (:func:`clipped_surrogate`) plus ``value_weight``
    times the value term ``(V - R)^2 / 2``; with ``value_clip`` the larger of that and the same for
    ``V_old + clip(V - V_old, -value_clip, value_clip)`` (PPO2's clipped value loss, as in TRL's PPOTrainer).
    ``logps`` and ``values`` carry the gradients; everything else is a constant."""
    shapes = {tuple(t.shape) for t in (logps, old_logps, values, old_values, advantages, returns, mask)}
    if len(shapes) != 1 or logps.dim() != 2:
        raise ValueError(f"logps, old_logps, values, old_values, advantages, returns, mask: expected one shape [n, T], got {shapes}")
    if not 0 < clip < 1 or (value_clip is not None and not value_clip > 0) or value_weight < 0:
        raise ValueError(f"clip={clip!r}, value_clip={value_clip!r}, value_weight={value_weight!r}: expected 0 < clip < 1, "
                         "value_clip > 0 or None, value_weight >= 0")
    mask = mask.float()
    surrogate, clipped = clipped_surrogate(logps, old_logps, advantages, clip)
    policy_loss = -_masked_mean(surrogate, mask)
    value_error = (values - returns.detach()) ** 2
    if value_clip is None:
        value_losses, value_clipped = value_error, torch.zeros_like(value_error)
    else:
        bounded = old_values.detach() + (values - old_values.detach()).clamp(-value_clip, value_clip)
        bounded_error = (bounded - returns.detach()) ** 2
        value_losses, value_clipped = torch.maximum(value_error, bounded_error), (bounded_error > value_error).float()
    value_loss = 0.5 * _masked_mean(value_losses, mask)
    return PPOLoss(policy_loss + value_weight * value_loss, policy_loss.detach(), value_loss.detach(),
                   _masked_mean(clipped, mask).detach(), _masked_mean(value_clipped, mask).detach())


def ppo_step(policy: nn.Module, value_model: ValueModel, ref: nn.Module, prompts: torch.Tensor, reward_fn: Callable,
             samples_per_prompt: int = 1, beta: float = 0.05, clip: float = 0.2, *, optimizer: torch.optim.Optimizer,
             task: ArithmeticTask, updates: int = 1, gamma: float = 1.0, lam: float = 0.95, value_clip: float | None = 0.2,
             value_weight: float = 0.1, whiten: bool = True, temperature: float = 1.0,
             generator: torch.Generator | None = None, grad_clip: float = 1.0) -> dict:
    """One iteration of RLHF's PPO (InstructGPT): sample ``samples_per_prompt`` responses per prompt from
    ``policy``, score them with ``reward_fn``, build the per-token rewards (:func:`ppo_token_rewards`: the KL to
    ``ref`` at every token, the score at the last), the value model's estimates and GAE advantages
    (:func:`gae_advantages`, whitened over the batch with ``whiten``), then take ``updates`` optimizer steps on
    :func:`ppo_loss` (``optimizer`` holds the policy's and the value model's parameters; their gradients are
    clipped to ``grad_clip`` separately). Returns the mean score, the losses, the KL per token (k1), the clip
    fractions and the value model's error before the updates."""
    _check_ids("prompts", prompts)
    _check_updates(updates)
    if not isinstance(samples_per_prompt, int) or samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt={samples_per_prompt!r}: expected a positive integer")
    prompt_ids = prompts.repeat_interleave(samples_per_prompt, dim=0)
    response_ids, mask = sample_responses(policy, prompt_ids, task, temperature, generator)
    scores = reward_fn(prompt_ids, response_ids, mask).float()
    with torch.no_grad():
        old_logps = token_logprobs(policy, prompt_ids, response_ids, mask)
        ref_logps = token_logprobs(ref, prompt_ids, response_ids, mask)
        old_values = value_model(prompt_ids, response_ids, mask)
    rewards = ppo_token_rewards(old_logps, ref_logps, mask, scores, beta)
    advantages, returns = gae_advantages(rewards, old_values, mask, gamma, lam)
    if whiten:
        advantages = _whiten(advantages, mask)
    policy_params, value_params = _trainable(policy), _trainable(value_model)
    policy.train()
    value_model.train()
    for _ in range(updates):
        out = ppo_loss(token_logprobs(policy, prompt_ids, response_ids, mask), old_logps, value_model(prompt_ids, response_ids, mask),
                       old_values, advantages, returns, mask, clip, value_clip, value_weight)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        clip_grad_norm(policy_params, grad_clip)
        clip_grad_norm(value_params, grad_clip)
        optimizer.step()
    policy.eval()
    value_model.eval()
    fmask = mask.float()
    return {"reward": scores.mean().item(), "loss": out.loss.item(), "policy_loss": out.policy_loss.item(),
            "value_loss": out.value_loss.item(), "kl": _masked_mean(old_logps - ref_logps, fmask).item(),
            "clip_fraction": out.clip_fraction.item(), "value_clip_fraction": out.value_clip_fraction.item(),
            "value_error": _masked_mean((old_values - returns) ** 2, fmask).sqrt().item()}


class PassCounter:
    """Counts, per named model, the forward calls that build no autograd graph (sampling, scoring under
    ``torch.no_grad``), those that do, and the backward passes through the latter, with hooks on the models'
    top modules. A context manager: the hooks are removed on exit; ``counts[name]`` holds the three numbers.
    (A decoding step with a KV cache is one forward call, so sampling a response of ``k`` tokens is ``k`` calls.)"""

    def __init__(self, models: dict[str, nn.Module]):
        if not isinstance(models, dict) or not all(isinstance(m, nn.Module) for m in models.values()):
            raise TypeError("models: expected a dict of name -> torch.nn.Module")
        self.models = models
        self.counts = {name: {"forward, no graph": 0, "forward, graph": 0, "backward": 0} for name in models}
        self._handles: list = []

    def _hook(self, name: str):
        count = self.counts[name]

        def on_backward(grad):
            count["backward"] += 1

        def on_forward(module, args, output):
            if isinstance(output, torch.Tensor) and output.requires_grad:
                count["forward, graph"] += 1
                output.register_hook(on_backward)
            else:
                count["forward, no graph"] += 1

        return on_forward

    def __enter__(self) -> "PassCounter":
        self._handles = [model.register_forward_hook(self._hook(name)) for name, model in self.models.items()]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def rl_state_bytes(models: dict[str, nn.Module], optimizer: torch.optim.Optimizer | None) -> dict[str, dict[str, int]]:
    """Bytes each named model holds while it trains, counted on the real tensors (shared storages once):
    its parameters, the gradients that exist now, and ``optimizer``'s state for its parameters (AdamW: two
    moments, created at its first step). A frozen model (a reference) has parameters only."""
    from labkit.memory import tensor_bytes

    state = optimizer.state if optimizer is not None else {}
    out = {}
    for name, model in models.items():
        params = list({id(p): p for p in model.parameters()}.values())
        moments = [v for p in params for v in state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        out[name] = {"parameters": tensor_bytes(params), "gradients": tensor_bytes(p.grad for p in params if p.grad is not None),
                     "optimizer state": tensor_bytes(moments)}
    return out


def _multisets(size: int, kinds: int):
    """Every way to draw ``size`` items of ``kinds`` kinds, as count vectors (order does not matter)."""
    if kinds == 1:
        yield (size,)
        return
    for first in range(size, -1, -1):
        for rest in _multisets(size - first, kinds - 1):
            yield (first, *rest)


def expected_grpo_gradient(logits: torch.Tensor, rewards, lengths, group_size: int, *, loss_type: str = "grpo",
                           scale_rewards: bool = True) -> torch.Tensor:
    """The exact expected gradient, with respect to ``logits`` ``[K]``, of GRPO's objective (``-``
    :func:`grpo_loss` at the sampling policy, ``rho = 1``, ``beta = 0``) for a policy that picks one of ``K``
    whole responses: response ``k`` has reward ``rewards[k]`` and ``lengths[k]`` tokens; its first token
    carries the choice, ``log softmax(logits)[k]``, and the rest follow with probability 1. The expectation
    over groups of ``group_size`` samples is a sum over every multiset of responses, weighted by its
    multinomial probability, so it is exact, not sampled. For comparison, the gradient of the expected reward
    ``J = sum_k pi_k r_k`` is ``pi * (r - J)``."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 1:
        shape = tuple(getattr(logits, "shape", ()))
        raise TypeError(f"logits: expected a 1-D tensor [K], got {type(logits).__name__} {shape}")
    rewards, lengths = torch.as_tensor(rewards, dtype=torch.float64), torch.as_tensor(lengths, dtype=torch.long)
    if rewards.shape != logits.shape or lengths.shape != logits.shape or bool((lengths < 1).any()):
        raise ValueError(f"rewards, lengths: expected one reward and a length >= 1 per response ({logits.numel()}), "
                         f"got {tuple(rewards.shape)} and {lengths.tolist()}")
    theta = logits.detach().double().requires_grad_(True)
    logp = torch.log_softmax(theta, dim=-1)
    counts = torch.tensor(list(_multisets(group_size, logits.numel())), dtype=torch.float64)  # [groups, K]
    probability = torch.exp(math.lgamma(group_size + 1) - torch.lgamma(counts + 1).sum(dim=1)
                            + (counts * logp.detach()).sum(dim=1))  # multinomial
    chosen = torch.repeat_interleave(torch.arange(logits.numel()).repeat(len(counts)), counts.reshape(-1).long())
    width = int(lengths.max())
    token_logps = torch.nn.functional.pad(logp[chosen, None], (0, width - 1))  # the choice, then certain tokens
    mask = torch.arange(width)[None] < lengths[chosen, None]
    advantages = grpo_advantages(rewards[chosen], group_size, scale_rewards=scale_rewards).double()
    # One grpo_loss over all groups averages them uniformly; at rho = 1 and beta = 0 each group's term is
    # linear in its (constant) advantages, so scaling them by the group's probability times the number of
    # groups turns that average into the expectation.
    weighted = advantages * (probability * len(counts)).repeat_interleave(group_size)
    out = grpo_loss(token_logps, token_logps.detach(), token_logps.detach(), mask, weighted, beta=0.0, loss_type=loss_type)
    return torch.autograd.grad(-out.loss, theta)[0]


def expected_kl_loss_gradient(logits: torch.Tensor, ref_logits: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """The exact expected gradient, with respect to ``logits`` ``[..., V]``, of a KL estimator used *as a loss*
    the way GRPO uses k3: ``E_{y ~ pi}[grad kl_estimate(log pi(y), log pi_ref(y))]``, the samples' weights not
    differentiated (they are drawn, not computed). Summed over the vocabulary, float64. Tang & Munos (2025):
    for ``"k3"`` this is the gradient of ``KL(pi_ref || pi)``, not of ``KL(pi || pi_ref)``; for ``"k2"`` it is
    that of ``KL(pi || pi_ref)``; for ``"k1"`` it is 0."""
    if not isinstance(logits, torch.Tensor) or not isinstance(ref_logits, torch.Tensor) or logits.shape != ref_logits.shape:
        raise ValueError(f"logits, ref_logits: expected two tensors of one shape [..., V], got "
                         f"{tuple(getattr(logits, 'shape', ()))} and {tuple(getattr(ref_logits, 'shape', ()))}")
    theta = logits.detach().double().requires_grad_(True)
    logp = torch.log_softmax(theta, dim=-1)
    ref_logp = torch.log_softmax(ref_logits.detach().double(), dim=-1)
    every_token = torch.ones(logp.numel(), 1, dtype=torch.bool)
    per_token = kl_estimate(logp.reshape(-1, 1), ref_logp.reshape(-1, 1), every_token, estimator).view_as(logp)
    return torch.autograd.grad((logp.detach().exp() * per_token).sum(), theta)[0]


# ============================================================================ training helpers
def _fit(params: list, steps: int, lr: float, step_loss: Callable[[int], torch.Tensor], *, desc: str,
         evaluate: Callable[[int], dict] | None = None, eval_every: int = 0, progress: bool = True,
         warmup_iters: int = 5, weight_decay: float = 0.0, grad_clip: float = 1.0) -> dict:
    """The loop the helpers share: AdamW (labkit.train), cosine schedule to lr/10, gradient clipping, a
    progress bar; ``step_loss(step)`` returns the loss (or a tuple whose first item is the loss and whose
    second is a dict logged per step); ``evaluate(step)`` every ``eval_every`` steps (and at 0 and the end)."""
    if not isinstance(steps, int) or steps <= 0:
        raise ValueError(f"steps={steps!r}: expected a positive integer")
    if not params:
        raise ValueError("model: no parameter requires a gradient; there is nothing to train")
    optimizer = AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    log: dict = {"step": [], "loss": [], "eval_step": []}

    def run_eval(step):
        if evaluate is None:
            return
        log["eval_step"].append(step)
        for k, v in evaluate(step).items():
            log.setdefault("eval_" + k, []).append(v)

    run_eval(0)
    for step in tqdm(range(steps), desc=desc, disable=not progress):
        for group in optimizer.param_groups:
            group["lr"] = lr_cosine_schedule(step, lr, lr / 10, warmup_iters, steps)
        out = step_loss(step)
        loss, extra = (out[0], out[1]) if isinstance(out, tuple) else (out, {})
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip_grad_norm(params, grad_clip)
        optimizer.step()
        log["step"].append(step + 1)
        log["loss"].append(loss.item())
        for k, v in extra.items():
            log.setdefault(k, []).append(float(v))
        if eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps) or (not eval_every and step + 1 == steps):
            run_eval(step + 1)
    return log


def _batches(n: int, batch_size: int, seed: int):
    generator = torch.Generator().manual_seed(run_seed(seed))
    return lambda: torch.randint(n, (min(batch_size, n),), generator=generator)


def _trainable(model: nn.Module) -> list:
    return [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]


def train_sft(model: nn.Module, pairs: PreferencePairs, steps: int = 100, lr: float = 1e-3, batch_size: int = 64, *,
              seed: int = 0, progress: bool = True) -> dict:
    """Supervised fine-tuning on the chosen responses: minimise ``-log p(chosen | prompt)`` per token."""
    draw = _batches(len(pairs), batch_size, seed)
    model.train()

    def step_loss(step):
        batch = pairs.subset(draw())
        return -sequence_logprobs(model, batch.prompt_ids, batch.chosen_ids, batch.chosen_mask, average=True).mean()

    log = _fit(_trainable(model), steps, lr, step_loss, desc="SFT", progress=progress)
    model.eval()
    return log


def train_reward_model(reward_model: RewardModel, pairs: PreferencePairs, steps: int = 100, lr: float = 1e-3,
                       batch_size: int = 64, *, heldout: PreferencePairs | None = None, eval_every: int = 25,
                       seed: int = 0, progress: bool = True) -> dict:
    """Fit a reward model with :func:`bradley_terry_loss` on ``pairs``; every ``eval_every`` steps the held-out
    preference accuracy (by the true reward). Returns the log (``loss``, ``eval_accuracy``, ...)."""
    draw = _batches(len(pairs), batch_size, seed)
    reward_model.train()

    def step_loss(step):
        batch = pairs.subset(draw())
        r_chosen, r_rejected = reward_model.score_pairs(batch)
        return bradley_terry_loss(r_chosen, r_rejected), {"train_accuracy": (r_chosen > r_rejected).float().mean().item()}

    evaluate = (lambda step: {"accuracy": preference_accuracy(reward_model, heldout)}) if heldout is not None else None
    log = _fit(_trainable(reward_model), steps, lr, step_loss, desc="reward model", evaluate=evaluate,
               eval_every=eval_every, progress=progress)
    reward_model.eval()
    return log


def train_dpo(policy: nn.Module, ref: nn.Module, pairs: PreferencePairs, steps: int = 100, lr: float = 1e-4,
              beta: float = 0.1, batch_size: int = 64, *, label_smoothing: float = 0.0, loss_type: str = "sigmoid",
              nll_weight: float = 0.0, evaluate: Callable[[int], dict] | None = None, eval_every: int = 0, seed: int = 0,
              progress: bool = True) -> dict:
    """DPO (or with ``loss_type="ipo"`` IPO, :func:`dpo_loss`) of ``policy`` against the frozen ``ref`` on
    ``pairs``. The reference log-probabilities of every pair are computed once, without gradients.
    ``nll_weight > 0`` adds that times the chosen responses' per-token negative log-likelihood (RPO, Pang et
    al. 2024; TRL's ``rpo_alpha``), which keeps DPO from lowering the chosen responses along with the rejected
    ones. Logs per step the loss and TRL's quantities
    (mean chosen and rejected implicit rewards, margin, accuracy) and the policy's mean log-probabilities of
    the chosen and rejected responses. The quantities are those of the batch before the step's update, so
    while the policy still equals the reference (the first step, and the second: the warm-up's first
    learning rate is 0) every margin is 0; the logged accuracy counts such a tie as half a win (a coin
    flip), not as a loss as :func:`dpo_loss`'s strict accuracy does."""
    with torch.no_grad():
        ref_chosen, ref_rejected = pair_logprobs(ref, pairs)
    draw = _batches(len(pairs), batch_size, seed)
    policy.train()

    def step_loss(step):
        index = draw()
        chosen, rejected = pair_logprobs(policy, pairs.subset(index))
        out = dpo_loss(chosen, rejected, ref_chosen[index], ref_rejected[index], beta, label_smoothing, loss_type)
        loss = out.loss
        if nll_weight:
            loss = loss - nll_weight * (chosen / pairs.chosen_mask[index].sum(dim=1)).mean()
        return loss, {"chosen_reward": out.chosen_rewards.mean(), "rejected_reward": out.rejected_rewards.mean(),
                          "margin": out.margins.mean(), "accuracy": _wins_ties_half(out.margins),
                          "chosen_logp": chosen.detach().mean(), "rejected_logp": rejected.detach().mean()}

    name = "IPO" if loss_type == "ipo" else "DPO"
    log = _fit(_trainable(policy), steps, lr, step_loss, desc=f"{name} beta={beta:g}", evaluate=evaluate,
               eval_every=eval_every, progress=progress)
    policy.eval()
    return log


def _wins_ties_half(margins: torch.Tensor) -> torch.Tensor:
    """The fraction of pairs the chosen response wins, a tie (margin exactly 0) counted as half a win."""
    return ((margins > 0).float() + 0.5 * (margins == 0).float()).mean()


def train_grpo(policy: nn.Module, ref: nn.Module, task: ArithmeticTask, reward_fn: Callable, steps: int = 50,
               prompts_per_step: int = 16, group_size: int = 8, lr: float = 1e-4, beta: float = 0.04, clip: float = 0.2,
               *, updates: int = 1, loss_type: str = "grpo", scale_rewards: bool = True,
               evaluate: Callable[[int], dict] | None = None, eval_every: int = 10, seed: int = 0,
               progress: bool = True) -> dict:
    """GRPO: ``steps`` calls of :func:`grpo_step` on prompts drawn from ``task``'s training split (seeded),
    constant learning rate (``loss_type``, ``scale_rewards``: see :func:`grpo_step`). Logs per step the mean
    sampled reward, loss, KL per token, clip fraction and informative-group fraction; ``evaluate(step)`` every
    ``eval_every`` steps (and at 0 and the end)."""
    optimizer = AdamW(_trainable(policy), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    ref.eval()

    def step(prompts, generator):
        return grpo_step(policy, ref, prompts, reward_fn, group_size, beta, clip, optimizer=optimizer, task=task,
                         updates=updates, generator=generator, loss_type=loss_type, scale_rewards=scale_rewards)

    return _rl_loop([policy], task, steps, prompts_per_step, step, f"GRPO beta={beta:g}", evaluate, eval_every, seed, progress)


def train_ppo(policy: nn.Module, value_model: ValueModel, ref: nn.Module, task: ArithmeticTask, reward_fn: Callable,
              steps: int = 50, prompts_per_step: int = 16, samples_per_prompt: int = 8, lr: float = 1e-4,
              value_lr: float = 1e-3, beta: float = 0.05, clip: float = 0.2, *, updates: int = 1, gamma: float = 1.0,
              lam: float = 0.95, value_clip: float | None = 0.2, value_weight: float = 0.1,
              evaluate: Callable[[int], dict] | None = None, eval_every: int = 10, seed: int = 0,
              progress: bool = True) -> dict:
    """RLHF's PPO: ``steps`` calls of :func:`ppo_step` on prompts drawn from ``task``'s training split exactly as
    :func:`train_grpo` draws them (same seed, same prompts, same number of samples per step when
    ``samples_per_prompt`` equals GRPO's ``group_size``), one AdamW over the policy (``lr``) and the value model
    (``value_lr``), constant learning rates. Logs per step what :func:`ppo_step` returns; ``evaluate(step)``
    every ``eval_every`` steps (and at 0 and the end)."""
    if not isinstance(value_model, ValueModel):
        raise TypeError(f"value_model: expected a labkit.preference.ValueModel, got {type(value_model).__name__}")
    optimizer = AdamW([{"params": _trainable(policy), "lr": lr}, {"params": _trainable(value_model), "lr": value_lr}],
                      lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    ref.eval()

    def step(prompts, generator):
        return ppo_step(policy, value_model, ref, prompts, reward_fn, samples_per_prompt, beta, clip, optimizer=optimizer,
                        task=task, updates=updates, gamma=gamma, lam=lam, value_clip=value_clip,
                        value_weight=value_weight, generator=generator)

    return _rl_loop([policy, value_model], task, steps, prompts_per_step, step, f"PPO beta={beta:g}", evaluate,
                    eval_every, seed, progress)


def _rl_loop(models: list, task: ArithmeticTask, steps: int, prompts_per_step: int, step: Callable, desc: str,
             evaluate: Callable[[int], dict] | None, eval_every: int, seed: int, progress: bool) -> dict:
    """The loop GRPO and PPO share: each step draws ``prompts_per_step`` prompts from the training split (seeded
    with ``seed``; the sampling generator with ``seed + 1``) and calls ``step(prompts, generator)``, logging the
    dict it returns; ``evaluate(step)`` every ``eval_every`` steps, at 0 and at the end."""
    if not isinstance(steps, int) or steps <= 0:
        raise ValueError(f"steps={steps!r}: expected a positive integer")
    device = next(models[0].parameters()).device
    operands = task.pairs("train")
    draw = _batches(len(operands), prompts_per_step, seed)
    generator = torch.Generator().manual_seed(run_seed(seed + 1))
    log: dict = {"step": [], "eval_step": []}

    def run_eval(at):
        if evaluate is not None:
            log["eval_step"].append(at)
            for k, v in evaluate(at).items():
                log.setdefault("eval_" + k, []).append(v)

    for model in models:
        model.eval()
    run_eval(0)
    for i in tqdm(range(steps), desc=desc, disable=not progress):
        stats = step(encode_prompts(task, operands[draw().numpy()], device), generator)
        log["step"].append(i + 1)
        for k, v in stats.items():
            log.setdefault(k, []).append(v)
        if (i + 1) % eval_every == 0 or i + 1 == steps:
            run_eval(i + 1)
    return log


def reward_model_reward(reward_model: RewardModel) -> Callable:
    """A learned reward as a ``reward_fn`` for :func:`grpo_step`: the reward model's score of each response."""
    @torch.no_grad()
    def reward_fn(prompt_ids, response_ids, response_mask):
        reward_model.eval()
        return reward_model(prompt_ids, response_ids, response_mask)

    return reward_fn


# ============================================================================ the early adder (shipped)
def train_early_adder(device="cpu", progress: bool = True) -> TransformerLM:
    """The shipped adder's own run (:data:`labkit.pretrained.RECIPE`, seed, task) stopped after
    :data:`EARLY_STEPS` of its steps: the same weights the full run had at that step."""
    task = adder_task()
    torch.manual_seed(SEED)
    from labkit.model import tiny_config

    model = TransformerLM(tiny_config(task.vocab_size)).to(device)
    train(model, task.tokens("train"), task.tokens("val"), RECIPE, device=device, stop_after=EARLY_STEPS, progress=progress)
    return model.eval()


def _early_recipe() -> dict:
    return {"recipe": dataclasses.asdict(RECIPE), "seed": SEED, "stop_after": EARLY_STEPS}


def save_early_adder(model: TransformerLM, path: os.PathLike = EARLY_ASSET) -> None:
    atomic_save({"model": {k: v.cpu() for k, v in model.state_dict().items()},
                 "config": dataclasses.asdict(model.config), **_early_recipe()}, path)


def load_early_adder(device="cpu", path: os.PathLike = EARLY_ASSET) -> TransformerLM:
    """The adder after :data:`EARLY_STEPS` steps of its recipe (in eval mode): it has learned the format
    and some sums, so a verifiable reward has something to reinforce."""
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if {k: payload.get(k) for k in _early_recipe()} != _early_recipe():
        raise RuntimeError(f"{path} was made with another recipe than labkit.preference.train_early_adder: "
                           "re-create it with `python -m labkit.preference`")
    from labkit.model import ModelConfig

    model = TransformerLM(ModelConfig(**payload["config"]))
    model.load_state_dict(payload["model"])
    return model.to(device).eval()


if __name__ == "__main__":
    import labkit

    dev = labkit.setup(seed=SEED)
    early = train_early_adder(dev)
    save_early_adder(early)
    print(f"saved {EARLY_ASSET}: val accuracy {adder_task().evaluate(early, 'val'):.1%} after {EARLY_STEPS} steps")
