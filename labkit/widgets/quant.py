"""Chapter 06 widget: the quantization explorer.

A thin ``ipywidgets.interact`` over :func:`show_quantization`, which draws what
:func:`labkit.quant.quantization_explorer` computes (:func:`plot_quantization`) and prints its
error numbers (:func:`explorer_summary`); the tests call those plain functions directly.
"""
from __future__ import annotations

import math

import matplotlib.pyplot as plt

from labkit import quant as Q
from labkit.widgets import drawn

GROUP_SIZES = (4, 8, 16, 32)


def plot_quantization(data: dict, title: str | None = None):
    """Two panels for row 0 of the explorer's weight (the row with the outlier, if any):

    * left, a histogram of its values with the grid of the scale group that holds column 0 (every
      value that group's codes can represent, red) and, when the row has several groups, the grid of
      its last group (green): an outlier in column 0 coarsens only its own group's grid;
    * right, each column's value (dots) and what it dequantizes to (crosses), over the grid of the
      scale group covering it (horizontal segments, one set per group).

    ``data``: the dict :func:`labkit.quant.quantization_explorer` returns. Returns the figure.
    """
    values, dequantized, groups = data["values"], data["dequantized"], data["levels"]
    if not groups or len(values) != len(dequantized):
        raise ValueError("data: expected the dict labkit.quant.quantization_explorer returns")
    fig, (ax_hist, ax_cols) = plt.subplots(1, 2, figsize=(10, 3.4), gridspec_kw={"width_ratios": [1, 1.6]})
    first = groups[0]["levels"]
    ax_hist.hist(values, bins=32, color="tab:blue", alpha=0.7)
    for level in first:
        ax_hist.axvline(level, color="tab:red", lw=0.8, alpha=0.7)
    hist_title = f"row 0's values; the {len(first)} levels of column 0's group (red)"
    if len(groups) > 1:
        last = groups[-1]
        for level in last["levels"]:
            ax_hist.axvline(level, color="tab:green", lw=0.8, ls="--", alpha=0.7)
        hist_title += f",\nof columns {last['start']}-{min(last['stop'], len(values)) - 1} (green)"
    ax_hist.set_xlabel("value (row 0)")
    ax_hist.set_ylabel("count")
    ax_hist.set_title(hist_title, fontsize=9)
    columns = range(len(values))
    for group in groups:
        stop = min(group["stop"], len(values))
        ax_cols.hlines(group["levels"], group["start"] - 0.5, stop - 0.5, color="tab:red", lw=0.6, alpha=0.5)
        if group["start"] > 0:
            ax_cols.axvline(group["start"] - 0.5, color="grey", lw=0.8, ls=":")
    ax_cols.plot(columns, values, "o", ms=3, color="tab:blue", label="value")
    ax_cols.plot(columns, dequantized, "x", ms=4, color="black", label="dequantized")
    ax_cols.set_xlabel("column")
    ax_cols.set_title("each value, what it becomes, and its group's grid", fontsize=9)
    ax_cols.legend(fontsize=8, loc="upper right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def explorer_summary(data: dict) -> str:
    """The error numbers the explorer prints: MSE, SQNR and max error of the whole matrix and of row 0."""
    def line(name, error):
        sqnr = error["sqnr_db"]
        sqnr_text = "inf" if math.isinf(sqnr) else f"{sqnr:.1f}"
        return f"{name}: MSE {error['mse']:.3g}, SQNR {sqnr_text} dB, max |error| {error['max_abs_error']:.3g}"

    scales = ", ".join(f"{s:.3g}" for s in data["scales"][:8]) + (" ..." if len(data["scales"]) > 8 else "")
    return "\n".join([line("whole matrix", data["error"]), line("row 0      ", data["row0_error"]),
                      f"row 0's scales: {scales}", f"bits per weight, fp16 scales included: {data['bits_per_parameter']:.3f}"])


def show_quantization(bits: int = 4, symmetric: bool = True, granularity: str = "channel", group_size: int = 16,
                      outlier_magnitude: float = 0.0, seed: int = 0) -> dict:
    """Callback of the explorer: quantize the explorer's weight, plot row 0, print the errors; returns the data."""
    data = Q.quantization_explorer(bits, symmetric, granularity, group_size if granularity == "group" else None,
                                   outlier_magnitude, seed=seed)
    kind = "symmetric" if symmetric else "asymmetric"
    where = {"tensor": "one scale for the tensor", "channel": "one scale per row", "group": f"one scale per {group_size} values"}
    plot_quantization(data, title=f"{bits}-bit {kind}, {where[granularity]}, outlier {outlier_magnitude:g}")
    plt.show()
    print(explorer_summary(data))
    return data


def quantization_explorer_widget():
    """Sliders for bits and outlier magnitude, a symmetric switch, granularity and group size over
    :func:`show_quantization` (the group size applies when granularity is "group")."""
    import ipywidgets as widgets

    return widgets.interact(
        drawn(show_quantization),
        bits=widgets.IntSlider(4, Q.MIN_BITS, Q.MAX_BITS, description="bits"),
        symmetric=widgets.Checkbox(value=True, description="symmetric"),
        granularity=widgets.Dropdown(options=Q.GRANULARITIES, value="channel", description="granularity"),
        group_size=widgets.Dropdown(options=GROUP_SIZES, value=16, description="group size"),
        outlier_magnitude=widgets.FloatSlider(value=0.0, min=0.0, max=50.0, step=1.0, description="outlier"),
        seed=widgets.fixed(0),
    )
