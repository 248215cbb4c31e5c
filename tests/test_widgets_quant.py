"""labkit.widgets.quant: the explorer's plot, summary and callback (matplotlib's Agg backend), and the widget."""
import labkit  # noqa: F401

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labkit import quant as Q  # noqa: E402
from labkit.widgets import quant as W  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.mark.parametrize("granularity, group_size, groups", [("tensor", None, 1), ("channel", None, 1), ("group", 16, 4)])
def test_plot_draws_values_dequantized_values_and_each_groups_grid(granularity, group_size, groups):
    data = Q.quantization_explorer(3, True, granularity, group_size, outlier_magnitude=10.0)
    fig = W.plot_quantization(data, title="t")
    ax_hist, ax_cols = fig.axes
    # 3-bit symmetric: the 7 levels of column 0's group, and with several groups also those of the last one
    assert len(ax_hist.lines) == 7 * min(groups, 2)
    if groups > 1:
        assert ax_hist.lines[0].get_xdata()[0] != ax_hist.lines[7].get_xdata()[0]  # a clean group's grid differs
    assert [line.get_label() for line in ax_cols.lines[-2:]] == ["value", "dequantized"]
    assert list(ax_cols.lines[-1].get_ydata()) == data["dequantized"]
    segments = [c for c in ax_cols.collections if len(c.get_segments()) == 7]
    assert len(segments) == groups
    assert fig._suptitle.get_text() == "t"


def test_plot_rejects_other_data():
    with pytest.raises(ValueError, match="quantization_explorer"):
        W.plot_quantization({"values": [1.0], "dequantized": [], "levels": []})


def test_summary_reports_both_errors_and_the_storage():
    data = Q.quantization_explorer(4, False, "group", 16, 0.0)
    text = W.explorer_summary(data)
    assert text.count("SQNR") == 2 and "whole matrix" in text and "row 0" in text
    assert f"{Q.bits_per_parameter(4, 16, 16, 8):.3f}" in text  # 4 + (16 + 8) / 16 = 5.5
    lossless = Q.quantization_explorer(8, True, "tensor", None, 0.0)
    lossless["error"] = {"mse": 0.0, "max_abs_error": 0.0, "sqnr_db": float("inf")}
    assert "SQNR inf dB" in W.explorer_summary(lossless)


def test_callback_plots_prints_and_returns_the_data(capsys):
    data = W.show_quantization(bits=4, symmetric=True, granularity="tensor", group_size=16, outlier_magnitude=50.0)
    assert data["values"][0] == 50.0
    assert "whole matrix" in capsys.readouterr().out
    # the group size is ignored unless the granularity is "group"
    assert len(W.show_quantization(granularity="channel", group_size=8)["levels"]) == 1
    assert len(W.show_quantization(granularity="group", group_size=8)["levels"]) == 8


def test_widget_builds():
    assert W.quantization_explorer_widget() is not None
