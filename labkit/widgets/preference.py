"""Chapter 10 widget: the DPO / beta explorer.

A thin ``ipywidgets.interact`` over :func:`show_dpo_explorer`, which runs a short live DPO (with the NLL
term that keeps it stable) on the shipped adder with the chosen ``beta``, label noise and number of steps
(:func:`dpo_explorer`), draws the implicit-reward margin, the pair accuracy and the policy's log-probabilities
of the chosen and rejected responses (:func:`plot_dpo_run`), and prints what the policy now writes
(:func:`explorer_summary`). The tests call these plain functions.
"""
from __future__ import annotations

import copy

import matplotlib.pyplot as plt

from labkit import preference as P
from labkit.claims import about

BETA_RANGE = (0.01, 2.0)
NOISE_RANGE = (0.0, 0.5)
STEPS_RANGE = (5, 80)


def dpo_explorer(base, task, beta: float = 0.1, noise: float = 0.0, steps: int = 30, *, pairs: int = 512,
                 lr: float = 1e-3, nll_weight: float = 1.0, seed: int = 0, progress: bool = False) -> dict:
    """One short DPO run of a copy of ``base`` (left untouched) against ``base`` on ``pairs`` "concise"
    preference pairs with ``noise`` of their labels flipped; returns the training log, the greedy
    :func:`labkit.preference.policy_report` (true "concise" reward, accuracy, concise and malformed
    fractions) and the KL to ``base`` per response. ``progress``: a progress bar over the DPO steps."""
    if not BETA_RANGE[0] <= beta <= BETA_RANGE[1]:
        raise ValueError(f"beta={beta!r}: expected a value in {BETA_RANGE}")
    if not NOISE_RANGE[0] <= noise <= NOISE_RANGE[1]:
        raise ValueError(f"noise={noise!r}: expected a fraction in {NOISE_RANGE}")
    if not isinstance(steps, int) or not STEPS_RANGE[0] <= steps <= STEPS_RANGE[1]:
        raise ValueError(f"steps={steps!r}: expected an integer in {STEPS_RANGE}")
    data = P.make_preference_pairs(task, "train", "concise", noise=noise, seed=seed, max_pairs=pairs,
                                   device=next(base.parameters()).device)
    policy = copy.deepcopy(base).requires_grad_(True)
    log = P.train_dpo(policy, base, data, steps=steps, lr=lr, beta=beta, nll_weight=nll_weight, seed=seed, progress=progress)
    report = P.policy_report(policy, task, preference="concise", max_examples=128)
    return {"beta": beta, "noise": noise, "steps": steps, "log": log, "report": report,
            "kl": P.kl_to_reference(policy, base, task, max_examples=64, samples=2)}


def plot_dpo_run(data: dict, title: str | None = None):
    """Left: mean implicit-reward margin and pair accuracy per step; right: the policy's mean log-probability
    of the chosen and of the rejected responses. Returns the figure."""
    log = data.get("log") if isinstance(data, dict) else None
    if not log or "margin" not in log:
        raise ValueError("data: expected the dict dpo_explorer returns")
    fig, (ax_m, ax_l) = plt.subplots(1, 2, figsize=(10, 3.4))
    ax_m.plot(log["step"], log["margin"], color="tab:purple", label="margin (beta * h)")
    ax_m.set_xlabel("DPO step")
    ax_m.set_ylabel("implicit reward margin (nats x beta)")
    ax_acc = ax_m.twinx()
    ax_acc.plot(log["step"], log["accuracy"], color="tab:green", ls="--", label="pair accuracy (a tie counts 1/2)")
    ax_acc.set_ylim(0, 1.05)
    ax_acc.set_ylabel("pair accuracy")
    ax_m.legend(loc="upper left", fontsize=8)
    ax_acc.legend(loc="lower right", fontsize=8)
    ax_l.plot(log["step"], log["chosen_logp"], color="tab:blue", label="chosen")
    ax_l.plot(log["step"], log["rejected_logp"], color="tab:red", label="rejected")
    ax_l.set_xlabel("DPO step")
    ax_l.set_ylabel("mean log p(response | prompt) (nats)")
    ax_l.legend(fontsize=8)
    for ax in (ax_m, ax_l):
        ax.grid(alpha=0.3)
    fig.suptitle(title or f"DPO, beta = {data['beta']:g}, label noise {data['noise']:.0%}, {data['steps']} steps", fontsize=10)
    fig.tight_layout()
    return fig


def explorer_summary(data: dict) -> str:
    """What the explorer prints under the plot."""
    r = data["report"]
    return (f"beta {data['beta']:g}, noise {data['noise']:.0%}, {data['steps']} steps: final margin "
            f"{about(data['log']['margin'][-1]):.2f}, pair accuracy {about(data['log']['accuracy'][-1]):.0%}, "
            f"KL to the adder {about(data['kl']):.2f} nats\n"
            f"greedy answers: true reward {about(r['reward']):.2f}, right {about(r['accuracy']):.0%}, "
            f"concise {about(r['concise']):.0%}, malformed {about(r['malformed']):.0%}; e.g. {' '.join(r['texts'][:6])}")


def show_dpo_explorer(base, task, beta: float = 0.1, noise: float = 0.0, steps: int = 30, progress: bool = False) -> dict:
    """Run :func:`dpo_explorer` (with a progress bar if ``progress``), draw it and print its summary; returns the run."""
    data = dpo_explorer(base, task, beta, noise, steps, progress=progress)
    plot_dpo_run(data)
    plt.show()
    print(explorer_summary(data))
    return data


def dpo_explorer_widget(base, task):
    """Sliders for beta, label noise and steps; its button runs a short DPO (a few seconds on a CPU, with a progress bar)."""
    import ipywidgets as widgets

    return widgets.interact_manual(
        # a run takes seconds: the widget shows its progress
        lambda beta, noise, steps: show_dpo_explorer(base, task, beta, noise, steps, progress=True) and None,
        beta=widgets.FloatLogSlider(value=0.1, base=10, min=-2, max=0.3, step=0.1, description="beta"),
        noise=widgets.FloatSlider(value=0.0, min=0.0, max=0.5, step=0.05, description="label noise"),
        steps=widgets.IntSlider(value=30, min=STEPS_RANGE[0], max=STEPS_RANGE[1], step=5, description="steps"),
    )
