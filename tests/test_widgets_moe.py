"""labkit.widgets.moe: the routing visualiser's plot, summary and callback (matplotlib's Agg backend), and the widget."""
import labkit  # noqa: F401

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labkit import moe  # noqa: E402
from labkit.widgets import moe as W  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_plot_draws_loads_capacity_gates_and_the_balancing_curve():
    data = moe.routing_explorer(8, 2, 1.0, 1.0, 2.0)
    fig = W.plot_routing(data, title="t")
    ax_load, ax_gates, ax_aux = fig.axes[:3]
    bars = ax_load.patches
    assert len(bars) == 3 * 8  # kept, dropped, before balancing: one bar each per expert
    assert [b.get_height() for b in bars[:8]] == data["kept_per_expert"]
    assert [b.get_height() for b in bars[8:16]] == data["dropped_per_expert"]
    assert [b.get_height() for b in bars[16:]] == data["tokens_per_expert_before"]
    assert any(list(line.get_ydata()) == [data["capacity"]] * 2 for line in ax_load.lines)
    assert ax_gates.images[0].get_array().shape == tuple(data["gates"].shape)
    assert list(ax_aux.lines[0].get_ydata()) == data["aux_loss_history"]
    assert fig._suptitle.get_text() == "t"


def test_plot_without_capacity_or_balancing():
    data = moe.routing_explorer(4, 1, None, 0.0, 0.0)
    fig = W.plot_routing(data)
    ax_load, ax_gates = fig.axes[:2]
    assert not ax_load.lines  # dropless: no capacity line
    assert len(ax_load.patches) == 2 * 4  # kept and dropped only: no "before balancing" when nothing balanced
    assert "before balancing" not in [t.get_text() for t in ax_load.get_legend().get_texts()]
    assert len(fig.axes) == 3 and ax_gates.images  # loads, gates and the gates' colourbar: no empty third panel
    assert sum(b.get_height() for b in ax_load.patches[4:8]) == 0  # nothing dropped
    assert list(ax_load.get_xticks()) == [0, 1, 2, 3]  # one tick per expert


def test_plot_rejects_other_data():
    with pytest.raises(ValueError, match="routing_explorer"):
        W.plot_routing({"tokens_per_expert": [1, 2]})


def test_summary_reports_drops_and_balance():
    data = moe.routing_explorer(8, 2, 0.5, 0.0, 3.0)
    text = W.routing_summary(data)
    assert f"capacity {data['capacity']} per expert" in text
    assert f"dropped {sum(data['dropped_per_expert'])} assignments" in text and "max / mean load" in text
    assert "dropless" in W.routing_summary(moe.routing_explorer(8, 2, None, 0.0, 0.0))


def test_callback_plots_prints_and_returns_the_data(capsys):
    data = W.show_routing(num_experts=4, top_k=8, capacity_factor=1.0, dropless=False, balance_weight=1.0, skew=2.0)
    assert len(data["tokens_per_expert"]) == 4 and data["capacity"] is not None
    assert sum(data["tokens_per_expert"]) == 512 * 4  # top_k clipped to the number of experts
    assert "routed per expert" in capsys.readouterr().out
    assert W.show_routing(dropless=True)["capacity"] is None


def test_widget_builds():
    assert W.routing_visualiser_widget() is not None


def test_interact_targets_return_nothing_so_nothing_is_displayed_twice():
    from labkit.widgets import drawn

    calls = []

    def callback(a, b=2):
        calls.append((a, b))
        return "data the tests read"

    wrapped = drawn(callback)
    import inspect

    assert wrapped(1) is None and calls == [(1, 2)]
    assert list(inspect.signature(wrapped).parameters) == ["a", "b"]  # what interact builds its controls from


def test_a_widgets_figures_are_shown_as_drawn_and_the_inline_crop_comes_back_after():
    import base64
    import io

    import matplotlib.pyplot as plt
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.core.pylabtools import select_figure_formats
    from matplotlib.figure import Figure
    from PIL import Image

    from labkit.widgets import drawn

    shell = InteractiveShell.instance()
    fig, ax = plt.subplots(figsize=(4, 2), dpi=50)
    try:
        select_figure_formats(shell, {"png"}, bbox_inches="tight")  # what Jupyter's inline backend sets up
        png = shell.display_formatter.formatters["image/png"]
        cropped = png.lookup_by_type(Figure)
        ax.plot([0, 1])
        sizes = []

        def callback():
            sizes.append(Image.open(io.BytesIO(base64.b64decode(png(fig)))).size)

        drawn(callback)()
        assert sizes == [(200, 100)]  # the whole 4 x 2 in figure at 50 dpi: not cropped, drawn once
        assert png.lookup_by_type(Figure) is cropped
        assert Image.open(io.BytesIO(base64.b64decode(png(fig)))).size != (200, 100)  # cropped again outside
    finally:
        plt.close(fig)
        InteractiveShell.clear_instance()
