"""Chapter 00 widget: initialization scale vs per-layer activation/gradient statistics."""
from __future__ import annotations

import matplotlib.pyplot as plt

from labkit.foundations import INIT_ACTIVATIONS, init_statistics, recommended_gain
from labkit.plots import plot_init_statistics
from labkit.widgets import drawn

SCALE_RANGE = (0.25, 4.0)


def show_init_statistics(scale: float, activation: str = "tanh", depth: int = 32):
    """The slider's callback: plot the chosen scale against the recommended gain for ``activation``
    (PyTorch's ``calculate_gain`` where it has one, the second-moment gain otherwise)."""
    low, high = SCALE_RANGE
    if not low <= scale <= high:
        raise ValueError(f"scale={scale}: expected a value in [{low}, {high}]")
    if not 1 <= depth <= 128:
        raise ValueError(f"depth={depth}: expected 1..128")
    recommended, _ = recommended_gain(activation)
    stats = [init_statistics(recommended, depth, activation=activation), init_statistics(scale, depth, activation=activation)]
    fig = plot_init_statistics(stats, title=f"{depth} layers of width 256 with {activation}")
    plt.show()
    return fig


def init_scale_explorer():
    """A slider for the init scale and a menu for the activation; the plot redraws live."""
    import ipywidgets as widgets

    return widgets.interact(
        drawn(show_init_statistics),
        scale=widgets.FloatSlider(value=1.0, min=SCALE_RANGE[0], max=SCALE_RANGE[1], step=0.05, continuous_update=False),
        activation=widgets.Dropdown(options=sorted(INIT_ACTIVATIONS), value="tanh"),
        depth=widgets.IntSlider(value=32, min=1, max=128, continuous_update=False),
    )
