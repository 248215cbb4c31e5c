"""labkit.widgets.lora: the rank explorer's plots, summary and callback (matplotlib's Agg backend), and the widget."""
import labkit  # noqa: F401

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labkit import lora as L  # noqa: E402
from labkit.model import PRESETS, tiny_config  # noqa: E402
from labkit.widgets import lora as W  # noqa: E402


def row(method, targets, r, new, old=0.0, old_loss=3.0):
    return {"method": method, "targets": targets, "r": r, "new": new, "old": old, "old_loss": old_loss}


ROWS = [row("full", "-", None, 0.99, old_loss=8.0)] + [row("LoRA", "all linear", r, 0.2 * i) for i, r in enumerate((1, 4, 16), 1)] \
    + [row("LoRA", "attention (q, v)", r, 0.05) for r in (1, 4, 16)] + [row("QLoRA", "all linear", 8, 0.9)]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_rank_sweep_draws_one_line_per_target_set_full_ft_and_qlora():
    ax = W.plot_rank_sweep(ROWS, highlight=("all linear", 4))
    labels = [line.get_label() for line in ax.lines]
    assert "LoRA, all linear" in labels and "LoRA, attention (q, v)" in labels and "full fine-tuning" in labels
    assert any(label.startswith("QLoRA") for label in labels)
    all_linear = ax.lines[labels.index("LoRA, all linear")]
    assert list(all_linear.get_xdata()) == [1, 4, 16] and list(all_linear.get_ydata()) == pytest.approx([0.2, 0.4, 0.6])
    assert list(ax.lines[-1].get_xdata()) == [4]  # the highlighted run
    with pytest.raises(ValueError, match="LoRA row"):
        W.plot_rank_sweep([ROWS[0]])


def bar_heights(ax) -> dict[int, float]:
    """Each stacked bar's total height, by its x position."""
    heights = {}
    for patch in ax.patches:
        x = round(patch.get_x() + patch.get_width() / 2)
        heights[x] = heights.get(x, 0) + patch.get_height()
    return heights


def test_explorer_plot_stacks_the_three_breakdowns_and_what_lora_trains():
    data = L.rank_explorer(PRESETS["llama2-7b"], 16, 32, "all linear", W.runs_by_choice(ROWS))
    fig = W.plot_rank_explorer(data, ROWS, title="t")
    bars, zoom, sweep = fig.axes
    heights = bar_heights(bars)
    assert heights[0] == pytest.approx(data["memory"]["full"].total / 1e9)
    assert heights[2] == pytest.approx(data["memory"]["qlora"].total / 1e9)
    lora = data["memory"]["lora"]
    assert bar_heights(zoom)[0] == pytest.approx((lora.total - lora.weights - lora.quant_scales) / 1e9)
    assert "adapters" in [t.get_text() for t in zoom.get_legend().get_texts()]
    assert "weights" not in [t.get_text() for t in zoom.get_legend().get_texts()]
    assert sweep.get_xlabel() == "rank r" and fig._suptitle.get_text() == "t"
    assert len(W.plot_rank_explorer(data).axes) == 2
    with pytest.raises(ValueError, match="rank_explorer"):
        W.plot_rank_explorer({"memory": {}})


def test_summary_names_the_measured_run_or_its_absence():
    runs = W.runs_by_choice(ROWS)
    text = W.explorer_summary(L.rank_explorer(PRESETS["qwen3-8b"], 4, 8, "all linear", runs))
    assert "scaling alpha / r = 2" in text and "≈40.0% on subtraction" in text and "QLoRA" in text
    assert "did not run" in W.explorer_summary(L.rank_explorer(PRESETS["qwen3-8b"], 2, 8, "all linear", runs))


def test_callback_plots_prints_and_returns_the_data(capsys):
    models = W.explorer_models(tiny_config(15))
    assert list(models)[0].startswith("tiny adder")
    data = W.show_rank_explorer("tiny adder (this chapter)", 4, 32, "all linear", ROWS, models)
    assert data["trainable"] == L.lora_parameter_count(tiny_config(15), 4, "all-linear")
    assert "trainable parameters" in capsys.readouterr().out
    with pytest.raises(ValueError, match="model="):
        W.show_rank_explorer("GPT-5", rows=ROWS)


def test_widget_builds():
    assert W.rank_explorer_widget(ROWS, tiny_config(15)) is not None
