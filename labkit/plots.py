"""Shared plotting helpers, so every chapter draws the same things the same way."""
from __future__ import annotations

import matplotlib.pyplot as plt


def plot_init_statistics(stats_list, title: str = "Initialization scale vs depth"):
    """Per-layer activation and gradient RMS (log scale) for several :class:`InitStatistics`."""
    fig, (ax_act, ax_grad) = plt.subplots(1, 2, figsize=(10, 3.5), sharex=True)
    for stats in stats_list:
        layers = range(1, len(stats.activation_rms) + 1)
        label = f"{stats.activation}, scale={stats.scale:.3g}"
        ax_act.plot(layers, stats.activation_rms, label=label)
        ax_grad.plot(layers, stats.gradient_rms, label=label)
    for ax, what in ((ax_act, "activation RMS (forward)"), (ax_grad, "gradient RMS (backward)")):
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_title(what)
        ax.grid(True, which="both", alpha=0.3)
    ax_act.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_histories(histories: dict, title: str = "Loss", val_only: bool = False):
    """Train (thin) and validation (markers) loss of several runs, keyed by label."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for label, h in histories.items():
        if not val_only:
            (line,) = ax.plot(h.step, h.train_loss, lw=0.8, alpha=0.6, label=f"{label} (train)")
            color = line.get_color()
        else:
            color = None
        ax.plot(h.val_step, h.val_loss, "o-", color=color, ms=4, label=f"{label} (val)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
