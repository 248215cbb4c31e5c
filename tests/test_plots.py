import matplotlib

matplotlib.use("Agg")

from labkit.plots import plot_histories
from labkit.train import History


def test_plot_histories_draws_train_and_validation_per_run():
    runs = {name: History(step=[1, 2, 3], train_loss=[3.0, 2.0, 1.5], lr=[1e-3] * 3, val_step=[3], val_loss=[1.6]) for name in ("a", "b")}
    fig = plot_histories(runs)
    labels = [line.get_label() for line in fig.axes[0].lines]
    assert labels == ["a (train)", "a (val)", "b (train)", "b (val)"]
    assert [line.get_label() for line in plot_histories(runs, val_only=True).axes[0].lines] == ["a (val)", "b (val)"]
