"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a cheap draft model proposes ``k`` tokens,
the target model scores all of them in ONE forward pass, and an accept/reject rule keeps a prefix of the
proposal plus one token of the target's own, so that every emitted token is distributed exactly as if the
target had sampled it alone.

* :func:`speculative_accept`: the rule, a pure function of the two models' distributions and the draft tokens.
* :func:`speculative_generate`: the decoding loop on two :class:`labkit.model.TransformerLM`, each with its own
  :class:`labkit.nn.KVCache` (cropped back after a rejection), with counts of forward passes and acceptances.
* :func:`speedup_table`: acceptance, forward passes per generated token (exact counts) and time per token
  against plain cached decoding, per ``k``.
* The chapter's pair of models: a 6-layer target (171k parameters) that learned the Zen of Python by heart
  (trained and validated on the same 856 characters: the point is a target whose output a reader can check,
  not generalisation) and 1-layer drafts (13k parameters) of increasing quality, snapshots of one training
  run, shipped in ``labkit/assets/zen_pair.pt`` (``python -m labkit.serving.speculative`` re-creates it in a
  few CPU minutes).
"""
from __future__ import annotations

import codecs
import contextlib
import dataclasses
import io
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from labkit.data import CharTokenizer
from labkit.model import ModelConfig, TransformerLM, generate
from labkit.nn import KVCache
from labkit.serving.sampling import SamplingParams, next_token_probs
from labkit.train import TrainConfig, atomic_save, train

__all__ = [
    "speculative_accept", "SpeculativeStats", "speculative_generate", "greedy_agreement", "expected_tokens_per_pass",
    "time_per_token", "speedup_table", "zen_text", "zen_tokenizer", "TARGET_CONFIG", "DRAFT_CONFIG", "RECIPE", "DRAFT_SNAPSHOTS",
    "ASSET", "train_zen_pair", "save_zen_pair", "load_zen_pair",
]


# ----------------------------------------------------------------------------- the rule
def speculative_accept(draft_probs: torch.Tensor, target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """The tokens one speculative step emits: the accepted prefix of ``draft_tokens`` and one more token.

    ``draft_probs`` ``[k, V]``: row ``i`` is the distribution the draft sampled ``draft_tokens[i]`` from;
    ``target_probs`` ``[k + 1, V]``: the target's distributions at the same ``k`` positions and one beyond;
    ``draft_tokens`` ``[k]`` int64. Token ``x = draft_tokens[i]`` is accepted with probability
    ``min(1, p_i(x) / q_i(x))`` (one uniform draw per position, in order); at the first rejection the step
    ends with a token drawn from the residual ``max(0, p_i - q_i)`` (normalised); if all ``k`` are accepted,
    a bonus token is drawn from ``p_k``. Returns int64 ``[n + 1]`` (``n`` accepted drafts, then the extra
    token). Randomness comes from ``generator`` only, so equal generator states give equal results.
    """
    k = _check_rule_inputs(draft_probs, target_probs, draft_tokens)
    p, q, tokens = target_probs.float(), draft_probs.float(), draft_tokens.long()
    uniforms = torch.rand(k, generator=generator, device=p.device)
    positions = torch.arange(k, device=p.device)
    # accept x with probability min(1, p(x) / q(x)), i.e. when u * q(x) < p(x) (no division by q)
    rejected = (uniforms * q[positions, tokens] >= p[positions, tokens]).nonzero()
    n = int(rejected[0]) if len(rejected) else k  # tokens accepted: the first rejection ends the step
    if n == k:
        extra = torch.multinomial(p[k], 1, generator=generator)  # all accepted: a bonus token from p_k
    else:
        residual = (p[n] - q[n]).clamp(min=0)
        # p_n == q_n up to rounding makes a rejection (probability 0) land here with a zero residual
        extra = torch.multinomial(residual if residual.sum() > 0 else p[n], 1, generator=generator)
    return torch.cat([tokens[:n], extra])


def _check_rule_inputs(draft_probs, target_probs, draft_tokens) -> int:
    for name, value in (("draft_probs", draft_probs), ("target_probs", target_probs), ("draft_tokens", draft_tokens)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if target_probs.dim() != 2 or target_probs.shape[0] < 1:
        raise ValueError(f"target_probs: expected [k + 1, V], got shape {tuple(target_probs.shape)}")
    k, vocab = target_probs.shape[0] - 1, target_probs.shape[1]
    if tuple(draft_probs.shape) != (k, vocab):
        raise ValueError(f"draft_probs: expected [k, V] = [{k}, {vocab}] (one row fewer than target_probs), "
                         f"got shape {tuple(draft_probs.shape)}")
    if tuple(draft_tokens.shape) != (k,) or draft_tokens.is_floating_point():
        raise ValueError(f"draft_tokens: expected int64 [k] = [{k}], got {draft_tokens.dtype} {tuple(draft_tokens.shape)}")
    if k and (draft_tokens.min() < 0 or draft_tokens.max() >= vocab):
        raise ValueError(f"draft_tokens: ids must lie in [0, {vocab}), got {draft_tokens.tolist()}")
    return k


def expected_tokens_per_pass(acceptance: float, k: int) -> float:
    """Leviathan et al.'s expected tokens per target pass, ``(1 - a^(k+1)) / (1 - a)``, when each draft
    token is accepted independently with probability ``a``."""
    if not 0 <= acceptance <= 1:
        raise ValueError(f"acceptance={acceptance}: expected a probability in [0, 1]")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k={k!r}: expected a non-negative integer")
    return float(k + 1) if acceptance == 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)


# ----------------------------------------------------------------------------- the loop
@dataclass
class SpeculativeStats:
    """What one :func:`speculative_generate` call did (counts, so identical on every machine)."""

    new_tokens: int = 0
    target_passes: int = 0
    draft_passes: int = 0
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # of which the target kept
    accepted_per_step: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        return self.new_tokens / self.target_passes if self.target_passes else 0.0


def speculative_generate(target: TransformerLM, draft: TransformerLM, prompt_ids: torch.Tensor, max_new_tokens: int,
                         k: int = 4, sampling: SamplingParams | None = None,
                         seed: int | None = None) -> tuple[torch.Tensor, SpeculativeStats]:
    """Continue ``prompt_ids`` (``[prompt_len]`` or ``[1, prompt_len]``) by ``max_new_tokens`` tokens with the
    target's distribution (``sampling``: greedy when None), ``k`` draft tokens per target pass.

    Both models keep a KV cache of every token but the newest ("pending") one. Each step: the draft turns
    the pending tokens into ``k`` proposals (``k`` draft passes), the target reads pending + proposals in one
    pass (``k + 1`` distributions), :func:`speculative_accept` keeps ``n`` of them and adds one, and both
    caches are cropped back to the accepted length. Greedy output equals ``labkit.model.generate(target, ...,
    temperature=0)`` token for token. ``seed`` (else ``sampling.seed``; else torch's global generator) drives
    every random draw. Returns the prompt followed by the new tokens, and the counts.
    """
    sampling = sampling if sampling is not None else SamplingParams()
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling: expected a SamplingParams or None, got {type(sampling).__name__}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k={k!r}: expected a positive integer (draft tokens per target pass)")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected a non-negative integer")
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"draft: vocab_size={draft.config.vocab_size} differs from the target's {target.config.vocab_size}")
    squeeze = prompt_ids.dim() == 1
    ids = prompt_ids.reshape(-1).tolist()
    if prompt_ids.dim() not in (1, 2) or (prompt_ids.dim() == 2 and prompt_ids.shape[0] != 1) or not ids:
        raise ValueError(f"prompt_ids: expected a non-empty [prompt_len] or [1, prompt_len] tensor, got shape {tuple(prompt_ids.shape)}")
    total = len(ids) + max_new_tokens
    for name, model in (("target", target), ("draft", draft)):
        if total > model.config.context_length:
            raise ValueError(f"max_new_tokens={max_new_tokens}: prompt ({len(ids)}) + new tokens exceeds the {name}'s "
                             f"context_length={model.config.context_length}")
    seed = seed if seed is not None else sampling.seed
    device = target.lm_head.weight.device
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    stats = SpeculativeStats()
    target_cache, draft_cache = KVCache.for_model(target, 1, total), KVCache.for_model(draft, 1, total)
    modes = target.training, draft.training
    target.eval()
    draft.eval()
    with torch.no_grad():
        while len(ids) < total:
            steps = min(k, total - len(ids) - 1)  # the last step may propose fewer
            proposals, draft_rows = [], []
            for _ in range(steps):
                pending = (ids + proposals)[draft_cache.length():]  # all uncached tokens, then one proposal at a time
                logits = draft(torch.tensor([pending], device=device), kv_cache=draft_cache)[0, -1]
                q = next_token_probs(logits, sampling, _history(ids + proposals, sampling))
                proposals.append(int(q.argmax() if sampling.greedy else torch.multinomial(q, 1, generator=generator)))
                draft_rows.append(q)
            stats.draft_passes += steps
            verify = ids[target_cache.length():] + proposals
            logits = target(torch.tensor([verify], device=device), kv_cache=target_cache)[0, -(steps + 1):]
            stats.target_passes += 1
            if sampling.uses_history:
                target_rows = torch.stack([next_token_probs(logits[i], sampling, ids + proposals[:i]) for i in range(steps + 1)])
            else:
                target_rows = next_token_probs(logits, sampling)
            draft_probs = torch.stack(draft_rows) if draft_rows else target_rows.new_zeros(0, target_rows.shape[-1])
            emitted = speculative_accept(draft_probs, target_rows, torch.tensor(proposals, dtype=torch.long, device=device),
                                         generator).tolist()
            accepted = len(emitted) - 1
            stats.drafted += steps
            stats.accepted += accepted
            stats.accepted_per_step.append(accepted)
            target_cache.crop(len(ids) + accepted)  # keys of the accepted drafts stay; the newest token is pending
            draft_cache.crop(min(draft_cache.length(), len(ids) + accepted))
            ids += emitted
    target.train(modes[0])
    draft.train(modes[1])
    stats.new_tokens = max_new_tokens
    out = torch.tensor(ids, dtype=prompt_ids.dtype, device=prompt_ids.device)
    return (out if squeeze else out[None]), stats


def _history(ids: list[int], sampling: SamplingParams):
    return ids if sampling.uses_history else None


# ----------------------------------------------------------------------------- measuring
def greedy_agreement(target: TransformerLM, draft: TransformerLM, ids: torch.Tensor) -> float:
    """The fraction of positions of ``ids`` (``[seq]``, at most both models' context length) where the draft's
    argmax equals the target's: along the target's own greedy output, greedy speculative decoding's
    acceptance rate."""
    with torch.no_grad():
        t = target(ids[None]).argmax(-1)
        d = draft(ids[None]).argmax(-1)
    return (t == d).float().mean().item()


def time_per_token(fn, new_tokens: int, repeats: int = 3) -> float:
    """Seconds per generated token of ``fn()`` (which generates ``new_tokens``): the best of ``repeats``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best / new_tokens


def speedup_table(target: TransformerLM, draft: TransformerLM, prompt_ids: torch.Tensor, max_new_tokens: int,
                  ks=(1, 2, 4, 6), sampling: SamplingParams | None = None, seed: int = 0, repeats: int = 3) -> list[dict]:
    """Speculative against plain decoding (``labkit.model.generate`` with its KV cache, greedy unless ``sampling``
    says otherwise; both without autograd), one dict per ``k``: the counts (acceptance rate, target and draft
    passes per generated token: exact, the same on every machine) and, with ``repeats > 0``, the times
    (seconds per token, each the best of ``repeats`` runs taken in turns with the other, so that a change in
    the machine's load hits both; ``speedup`` = plain / speculative: machine-dependent)."""
    sampling = sampling if sampling is not None else SamplingParams()
    if sampling.uses_history or sampling.top_p is not None:
        raise ValueError("sampling: labkit.model.generate (the baseline) has temperature and top_k only")
    if not isinstance(repeats, int) or repeats < 0:
        raise ValueError(f"repeats={repeats!r}: expected a non-negative integer")

    def plain():
        generate(target, prompt_ids, max_new_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
                 generator=torch.Generator(device=prompt_ids.device).manual_seed(seed))

    rows = []
    with torch.no_grad():
        for k in ks:
            def speculative():
                return speculative_generate(target, draft, prompt_ids, max_new_tokens, k, sampling, seed)

            stats = speculative()[1]
            row = dict(k=k, acceptance_rate=stats.acceptance_rate, tokens_per_target_pass=stats.tokens_per_target_pass,
                       target_passes_per_token=stats.target_passes / max_new_tokens,
                       draft_passes_per_token=stats.draft_passes / max_new_tokens)
            if repeats:
                plain_s = speculative_s = float("inf")
                for _ in range(repeats):
                    plain_s = min(plain_s, time_per_token(plain, max_new_tokens, 1))
                    speculative_s = min(speculative_s, time_per_token(speculative, max_new_tokens, 1))
                row.update(plain_s_per_token=plain_s, speculative_s_per_token=speculative_s, speedup=plain_s / speculative_s)
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------- the chapter's models
ASSET = Path(__file__).resolve().parent.parent / "assets" / "zen_pair.pt"
# The target recites; a 128-character context holds the last few lines, enough to know which line comes next.
TARGET_CONFIG = ModelConfig(vocab_size=45, context_length=128, d_model=48, num_layers=6, num_heads=4, d_ff=128)
DRAFT_CONFIG = ModelConfig(vocab_size=45, context_length=128, d_model=32, num_layers=1, num_heads=2, d_ff=64)
RECIPE = TrainConfig(steps=600, batch_size=8, context_length=128, max_lr=3e-3, min_lr=3e-4, warmup_iters=30, eval_every=100)
DRAFT_SNAPSHOTS = (30, 100, 300, 1000)  # training steps at which the draft is saved: drafts of rising quality
SEED = 0


def zen_text() -> str:
    """The Zen of Python (``import this``), read without printing it."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def zen_tokenizer() -> CharTokenizer:
    return CharTokenizer("".join(sorted(set(zen_text()))))


def _zen_tokens() -> np.ndarray:
    """The text twice over, so training windows also learn that the last line is followed by the first."""
    text = zen_text()
    return np.array(zen_tokenizer().encode(text + "\n\n" + text + "\n\n"), dtype=np.int64)


def train_zen_pair(device="cpu", progress: bool = False) -> tuple[TransformerLM, dict[int, TransformerLM], dict]:
    """Train the target and the draft on the Zen of Python with :data:`RECIPE` (the draft snapshotted at
    :data:`DRAFT_SNAPSHOTS`); return the target, ``{step: draft}`` and the two training logs."""
    tokens = _zen_tokens()
    torch.manual_seed(SEED)
    target = TransformerLM(TARGET_CONFIG).to(device)
    target_log = train(target, tokens, tokens, RECIPE, device=device, progress=progress).as_dict()
    torch.manual_seed(SEED)
    draft = TransformerLM(DRAFT_CONFIG).to(device)
    snapshots: dict[int, TransformerLM] = {}

    def snapshot(step: int, loss: float) -> None:
        if step in DRAFT_SNAPSHOTS:
            copy = TransformerLM(DRAFT_CONFIG)
            copy.load_state_dict({k: v.detach().cpu().clone() for k, v in draft.state_dict().items()})
            snapshots[step] = copy.eval()

    draft_recipe = dataclasses.replace(RECIPE, steps=max(DRAFT_SNAPSHOTS))
    draft_log = train(draft, tokens, tokens, draft_recipe, device=device, callback=snapshot, progress=progress).as_dict()
    return target.eval(), snapshots, {"target": target_log, "draft": draft_log}


def save_zen_pair(target: TransformerLM, drafts: dict[int, TransformerLM], log: dict, path: os.PathLike = ASSET) -> None:
    payload = {
        "target": {k: v.cpu() for k, v in target.state_dict().items()},
        "drafts": {step: {k: v.cpu() for k, v in d.state_dict().items()} for step, d in drafts.items()},
        "target_config": dataclasses.asdict(TARGET_CONFIG),
        "draft_config": dataclasses.asdict(DRAFT_CONFIG),
        "recipe": dataclasses.asdict(RECIPE),
        "seed": SEED,
        "log": log,
    }
    atomic_save(payload, path)


def load_zen_pair(device="cpu", path: os.PathLike = ASSET) -> tuple[TransformerLM, dict[int, TransformerLM], dict]:
    """The shipped target and ``{training step: draft}`` (eval mode) and their training logs."""
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if (payload["recipe"] != dataclasses.asdict(RECIPE) or payload["target_config"] != dataclasses.asdict(TARGET_CONFIG)
            or payload["draft_config"] != dataclasses.asdict(DRAFT_CONFIG)):
        raise RuntimeError(f"{path} was made with another recipe than labkit.serving.speculative's: "
                           "re-create it with `python -m labkit.serving.speculative`")
    target = TransformerLM(TARGET_CONFIG)
    target.load_state_dict(payload["target"])
    drafts = {}
    for step, state in payload["drafts"].items():
        drafts[step] = TransformerLM(DRAFT_CONFIG)
        drafts[step].load_state_dict(state)
        drafts[step] = drafts[step].to(device).eval()
    return target.to(device).eval(), drafts, payload["log"]


if __name__ == "__main__":
    trained_target, trained_drafts, training_log = train_zen_pair(progress=True)
    save_zen_pair(trained_target, trained_drafts, training_log)
    ids = generate(trained_target, torch.tensor(zen_tokenizer().encode("Beautiful is")), 110, temperature=0.0)
    for draft_step, trained_draft in trained_drafts.items():
        print(f"draft after {draft_step} steps: agrees with the target on {greedy_agreement(trained_target, trained_draft, ids):.1%}")
    print(f"saved {ASSET} ({ASSET.stat().st_size / 1e6:.2f} MB)")
