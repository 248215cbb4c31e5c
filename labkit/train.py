"""Training: loss, optimizer, clipping, schedule, checkpoints and a readable loop."""
from __future__ import annotations

import math
import os
import random
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch

from labkit.data import get_batch
from labkit.show import progress_bar


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean of ``-log softmax(logits)[target]`` over all leading positions.

    Written as ``logsumexp(logits) - logits[target]`` with the max subtracted first, so huge
    logits never overflow ``exp`` and the softmax itself is never formed.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits, targets: logits must be [..., vocab] with the leading shape of targets, "
            f"got {tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets: expected integer class ids, got {targets.dtype}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    peak = logits.amax(dim=-1, keepdim=True).detach()
    log_norm = (logits - peak).exp().sum(dim=-1).log() + peak.squeeze(-1)
    target_logit = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return (log_norm - target_logit).mean()


class AdamW(torch.optim.Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), same update as ``torch.optim.AdamW``:

    ``m = b1 m + (1-b1) g``;  ``v = b2 v + (1-b2) g^2``;
    ``p -= lr * wd * p``;  ``p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)``.
    State per parameter: ``step``, ``exp_avg`` (m), ``exp_avg_sq`` (v) - two extra copies of the
    model, which is why AdamW's memory is 2x the parameters (chapter 07).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01):
        if lr < 0:
            raise ValueError(f"lr={lr}: expected >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas={betas}: expected two values in [0, 1)")
        if eps <= 0 or weight_decay < 0:
            raise ValueError(f"eps={eps}, weight_decay={weight_decay}: expected eps > 0 and weight_decay >= 0")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                p.mul_(1 - lr * wd)
                denom = (v / (1 - beta2**t)).sqrt_().add_(eps)
                p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
        return loss


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_l2_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale all gradients together so their joint L2 norm is at most ``max_l2_norm``; returns the norm before clipping."""
    if max_l2_norm <= 0:
        raise ValueError(f"max_l2_norm={max_l2_norm}: expected > 0")
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    # torch.where instead of `if total > max_l2_norm`: a Python `if` on a GPU tensor waits for the GPU every step.
    # Multiplying by exactly 1.0 leaves unclipped gradients bit for bit unchanged.
    scale = torch.where(total > max_l2_norm, max_l2_norm / (total + eps), 1.0)
    for g in grads:
        g.mul_(scale)
    return total


def lr_cosine_schedule(it: int, max_learning_rate: float, min_learning_rate: float, warmup_iters: int, cosine_cycle_iters: int) -> float:
    """Linear warmup to ``max_learning_rate`` over ``warmup_iters``, cosine decay to
    ``min_learning_rate`` at ``cosine_cycle_iters``, then constant."""
    if it < warmup_iters:
        return it / warmup_iters * max_learning_rate
    if it <= cosine_cycle_iters:
        progress = (it - warmup_iters) / max(1, cosine_cycle_iters - warmup_iters)
        return min_learning_rate + 0.5 * (1 + math.cos(math.pi * progress)) * (max_learning_rate - min_learning_rate)
    return min_learning_rate


# ----------------------------------------------------------------------------- checkpoints
def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_save(payload, path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename it over ``path``
    (``os.replace`` is atomic): a crash mid-save leaves the old file intact, never a truncated one."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, iteration: int, out) -> None:
    """Save model, optimizer, iteration and every RNG state.

    A path is written with :func:`atomic_save`, so a crash mid-save leaves the previous
    checkpoint intact, never a truncated one. ``out`` may also be an open binary file object.
    """
    payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iteration": int(iteration), "rng": _rng_state()}
    if not isinstance(out, (str, os.PathLike)):
        torch.save(payload, out)
        return
    atomic_save(payload, out)


def load_checkpoint(src, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Restore model, optimizer (if given) and RNG states from ``src``; return the saved iteration."""
    payload = torch.load(src, map_location="cpu", weights_only=False)
    model.load_state_dict(payload["model"])
    if optimizer is not None:
        optimizer.load_state_dict(payload["optimizer"])
    _set_rng_state(payload["rng"])
    return payload["iteration"]


# ----------------------------------------------------------------------------- the loop
@dataclass
class TrainConfig:
    steps: int = 300
    batch_size: int = 32
    context_length: int = 32
    max_lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_iters: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_every: int = 50  # validation loss every N steps (and after the last)
    eval_batches: int = 4
    checkpoint_path: str | None = None  # may contain "{step}", e.g. "run/ckpt-{step}.pt", to keep every one
    checkpoint_every: int = 0  # 0 = never

    def __post_init__(self):
        for name in ("steps", "batch_size", "context_length", "eval_every", "eval_batches"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: expected a positive integer")
        if self.checkpoint_every and not self.checkpoint_path:
            raise ValueError("checkpoint_every: set checkpoint_path too")


@dataclass
class History:
    step: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    val_step: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> AdamW:
    """AdamW that decays matrices only: norms' gains (1-D tensors) are not pulled toward zero."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return AdamW(groups, lr=config.max_lr, betas=config.betas)


@torch.no_grad()
def estimate_loss(model: torch.nn.Module, data: np.ndarray, config: TrainConfig, device, autocast_dtype=None) -> float:
    """Mean loss over ``eval_batches`` batches; draws them from a private generator so that
    evaluating never changes the training batches."""
    was_training = model.training
    model.eval()
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(12345)
        for _ in range(config.eval_batches):
            x, y = get_batch(data, config.batch_size, config.context_length, device)
            with _autocast(device, autocast_dtype):
                losses.append(cross_entropy(model(x), y).item())
    model.train(was_training)
    return float(np.mean(losses))


@torch.no_grad()
def loss_per_position(model: torch.nn.Module, data: np.ndarray, batch_size: int, context_length: int, device=None, seed: int = 0) -> torch.Tensor:
    """Mean next-token loss at each position of the context window, ``[context_length]``.

    Early positions see little context, so their loss is higher: a window that starts in the
    middle of an example does not yet know where in the example it is."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]):  # the caller's random stream is left untouched
        torch.manual_seed(seed)
        x, y = get_batch(data, batch_size, context_length, device)
    logits = model(x).float()
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none")
    model.train(was_training)
    return losses.mean(dim=0).cpu()


def _autocast(device, dtype):
    device_type = torch.device(device).type
    return torch.autocast(device_type=device_type, dtype=dtype, enabled=dtype is not None)


def train(
    model: torch.nn.Module,
    train_data: np.ndarray,
    val_data: np.ndarray | None,
    config: TrainConfig,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    device=None,
    resume_from: str | None = None,
    stop_after: int | None = None,
    autocast_dtype: torch.dtype | None = None,
    loss_scaler=None,
    callback: Callable[[int, float], None] | None = None,
    progress: bool = True,
) -> History:
    """Train ``model`` on random windows of ``train_data``; return the loss history.

    Each step: sample a batch, forward (optionally under ``torch.autocast(autocast_dtype)``),
    cross-entropy, backward (scaled by ``loss_scaler`` if given, e.g. for fp16), clip the
    gradient norm, set the cosine-schedule learning rate, optimizer step. Validation loss every
    ``config.eval_every`` steps. ``resume_from`` continues from a checkpoint (model, optimizer,
    iteration, RNG), reproducing the uninterrupted run exactly; ``stop_after`` ends early at
    that step (to simulate a crash). ``callback(step, loss)`` runs after every step.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    optimizer = optimizer if optimizer is not None else make_optimizer(model, config)
    start = load_checkpoint(resume_from, model, optimizer) if resume_from else 0
    end = config.steps if stop_after is None else min(config.steps, stop_after)
    history = History()
    # Losses stay on the device until an evaluation (which waits for the GPU anyway) or the end: a per-step
    # `loss.item()` would make the CPU wait for every step and leave nothing for pinned, non_blocking copies to overlap.
    unlogged_losses: list[torch.Tensor] = []
    model.train()
    bar = progress_bar(range(start, end), desc="train", disable=not progress, initial=start, total=config.steps)
    for step in bar:
        lr = lr_cosine_schedule(step, config.max_lr, config.min_lr, config.warmup_iters, config.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch(train_data, config.batch_size, config.context_length, device)
        with _autocast(device, autocast_dtype):
            loss = cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        if loss_scaler is not None:
            (loss * loss_scaler.scale).backward()
            loss_scaler.unscale_(optimizer)
            clip_grad_norm(model.parameters(), config.grad_clip)
            loss_scaler.step(optimizer)
            loss_scaler.update()
        else:
            loss.backward()
            clip_grad_norm(model.parameters(), config.grad_clip)
            optimizer.step()
        history.step.append(step + 1)
        unlogged_losses.append(loss.detach())
        history.lr.append(lr)
        done = step + 1
        if val_data is not None and (done % config.eval_every == 0 or done == config.steps):
            _log_losses(history, unlogged_losses)
            history.val_step.append(done)
            history.val_loss.append(estimate_loss(model, val_data, config, device, autocast_dtype))
            bar.set_postfix(train=f"{loss.item():.3f}", val=f"{history.val_loss[-1]:.3f}")
        if config.checkpoint_every and done % config.checkpoint_every == 0:
            save_checkpoint(model, optimizer, done, config.checkpoint_path.format(step=done))
        if callback is not None:
            callback(done, loss.item())
    _log_losses(history, unlogged_losses)
    return history


def _log_losses(history: History, losses: list[torch.Tensor]) -> None:
    if losses:
        history.train_loss.extend(torch.stack(losses).float().tolist())
        losses.clear()
