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


def plot_histories(histories: dict, title: str = "Loss", val_only: bool = False, levels: dict | None = None):
    """Train (thin) and validation (markers) loss of several runs, keyed by label; ``levels`` maps a label to
    a loss drawn as a dashed horizontal line (a uniform guess's ln V, the floor no model can beat)."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for (label, level), style in zip((levels or {}).items(), ("--", ":", "-.") * 4):
        ax.axhline(level, color="gray", ls=style, lw=1, label=label)
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


def plot_loss_differences(histories: dict, reference: str, title: str = "Loss"):
    """Runs whose curves would hide one another, drawn so that each stays visible: left, the
    losses (the ``reference`` run thick and underneath, the others thin and dashed on top);
    right, every other run's train loss (line) and validation loss (markers) minus the
    reference's at the same steps."""
    if reference not in histories:
        raise ValueError(f"reference={reference!r}: expected one of the runs {list(histories)}")
    base = histories[reference]
    for label, h in histories.items():
        if list(h.step) != list(base.step) or list(h.val_step) != list(base.val_step):
            raise ValueError(f"histories[{label!r}]: logged at other steps than {reference!r}; differences need the same steps")
    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(11, 3.6))
    for label, h in histories.items():
        is_base = label == reference
        (line,) = ax_loss.plot(h.step, h.train_loss, lw=3 if is_base else 0.9, ls="-" if is_base else "--",
                               alpha=0.45 if is_base else 0.9, zorder=1 if is_base else 2, label=f"{label} (train)")
        ax_loss.plot(h.val_step, h.val_loss, "o" if is_base else "x", color=line.get_color(), ms=8 if is_base else 5,
                     zorder=1 if is_base else 3, label=f"{label} (val)")
        if not is_base:
            ax_diff.plot(h.step, [a - b for a, b in zip(h.train_loss, base.train_loss)], lw=0.9, color=line.get_color(),
                         label=f"{label} - {reference} (train)")
            ax_diff.plot(h.val_step, [a - b for a, b in zip(h.val_loss, base.val_loss)], "o-", color=line.get_color(),
                         ms=4, label=f"{label} - {reference} (val)")
    ax_diff.axhline(0.0, color="k", lw=0.6)
    ax_loss.set_ylabel("cross-entropy (nats/token)")
    ax_diff.set_ylabel(f"difference from {reference} (nats/token)")
    ax_loss.set_title(title)
    ax_diff.set_title(f"Difference from {reference}, step by step")
    for ax in (ax_loss, ax_diff):
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
