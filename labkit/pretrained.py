"""A tiny LM that really learned to add, shipped with labkit so chapters can use a trained model
without spending their CPU budget on training it.

``python -m labkit.pretrained`` re-creates ``labkit/assets/tiny_adder.pt`` with exactly the recipe
below (a few minutes on a laptop CPU, seconds on a GPU); :func:`load_tiny_adder` loads it.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from labkit.data import ArithmeticTask
from labkit.model import TransformerLM, tiny_config
from labkit.train import TrainConfig, atomic_save, train

ASSET = Path(__file__).parent / "assets" / "tiny_adder.pt"
TASK = dict(num_digits=2, op="+", reverse_answer=True)
RECIPE = TrainConfig(steps=3000, batch_size=64, context_length=32, max_lr=3e-3, min_lr=3e-4, warmup_iters=20, eval_every=250)
SEED = 0


def adder_task() -> ArithmeticTask:
    return ArithmeticTask(**TASK)


def train_tiny_adder(device="cpu", progress: bool = True) -> tuple[TransformerLM, dict]:
    """Train the tiny LM on reversed 2-digit addition with :data:`RECIPE`; return it and a log
    of validation loss, exact-match accuracy and per-digit accuracy every ``RECIPE.eval_every`` steps."""
    task = adder_task()
    torch.manual_seed(SEED)
    model = TransformerLM(tiny_config(task.vocab_size)).to(device)
    accuracy_steps, accuracy, digit_accuracy = [], [], []

    def measure(step: int, loss: float) -> None:
        if step % RECIPE.eval_every == 0:
            accuracy_steps.append(step)
            accuracy.append(task.evaluate(model, "val"))
            digit_accuracy.append(task.digit_accuracy(model, "val"))

    history = train(model, task.tokens("train"), task.tokens("val"), RECIPE, device=device, callback=measure, progress=progress)
    log = {**history.as_dict(), "accuracy_step": accuracy_steps, "val_accuracy": accuracy, "val_digit_accuracy": digit_accuracy}
    return model, log


def save_tiny_adder(model: TransformerLM, log: dict, path: os.PathLike = ASSET) -> None:
    payload = {
        "model": {k: v.cpu() for k, v in model.state_dict().items()},
        "config": dataclasses.asdict(model.config),
        "task": TASK,
        "recipe": dataclasses.asdict(RECIPE),
        "seed": SEED,
        "log": log,
    }
    atomic_save(payload, path)


def load_tiny_adder(device="cpu", path: os.PathLike = ASSET) -> tuple[TransformerLM, dict]:
    """The shipped model (in eval mode) and its training log (``step, train_loss, val_step,
    val_loss, accuracy_step, val_accuracy, val_digit_accuracy``)."""
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if payload["task"] != TASK or payload["recipe"] != dataclasses.asdict(RECIPE):
        raise RuntimeError(f"{path} was made with another recipe than labkit.pretrained.RECIPE: "
                           "re-create it with `python -m labkit.pretrained`")
    from labkit.model import ModelConfig

    model = TransformerLM(ModelConfig(**payload["config"]))
    model.load_state_dict(payload["model"])
    return model.to(device).eval(), payload["log"]


if __name__ == "__main__":
    import labkit

    dev = labkit.setup(seed=SEED)
    trained, training_log = train_tiny_adder(dev)
    save_tiny_adder(trained, training_log)
    print(f"saved {ASSET}: val accuracy {training_log['val_accuracy'][-1]:.1%}, "
          f"test accuracy {adder_task().evaluate(trained, 'test'):.1%}")
