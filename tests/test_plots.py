import matplotlib

matplotlib.use("Agg")

import pytest

from labkit.plots import plot_histories, plot_loss_differences
from labkit.train import History


def test_plot_histories_draws_train_and_validation_per_run():
    runs = {name: History(step=[1, 2, 3], train_loss=[3.0, 2.0, 1.5], lr=[1e-3] * 3, val_step=[3], val_loss=[1.6]) for name in ("a", "b")}
    fig = plot_histories(runs)
    labels = [line.get_label() for line in fig.axes[0].lines]
    assert labels == ["a (train)", "a (val)", "b (train)", "b (val)"]
    assert [line.get_label() for line in plot_histories(runs, val_only=True).axes[0].lines] == ["a (val)", "b (val)"]


def test_plot_loss_differences_keeps_every_run_visible_and_plots_differences():
    runs = {"fp32": History(step=[1, 2, 3], train_loss=[3.0, 2.0, 1.5], lr=[1e-3] * 3, val_step=[3], val_loss=[1.6]),
            "bf16": History(step=[1, 2, 3], train_loss=[3.0, 2.1, 1.25], lr=[1e-3] * 3, val_step=[3], val_loss=[1.7])}
    fig = plot_loss_differences(runs, "fp32")
    losses, diffs = fig.axes
    assert [line.get_label() for line in losses.lines] == ["fp32 (train)", "fp32 (val)", "bf16 (train)", "bf16 (val)"]
    base, other = losses.lines[0], losses.lines[2]
    assert base.get_linewidth() > other.get_linewidth() and base.get_zorder() < other.get_zorder()
    train_diff, val_diff = (line for line in diffs.lines if "bf16" in line.get_label())
    assert list(train_diff.get_ydata()) == pytest.approx([0.0, 0.1, -0.25])
    assert list(val_diff.get_ydata()) == pytest.approx([0.1])
    with pytest.raises(ValueError, match="reference"):
        plot_loss_differences(runs, "fp16")
    runs["short"] = History(step=[1], train_loss=[3.0], lr=[1e-3], val_step=[], val_loss=[])
    with pytest.raises(ValueError, match="steps"):
        plot_loss_differences(runs, "fp32")
