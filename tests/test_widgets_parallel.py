"""labkit.widgets.parallel: the layout calculator's callback (matplotlib's Agg backend) and the widget."""
import labkit  # noqa: F401

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labkit.widgets import parallel as W  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_explorer_draws_the_best_layouts_and_returns_all():
    fig, plans = W.layout_explorer("llama3-70b", 64, "H100 SXM (80 GB)", shown=4)
    assert len(fig.axes[0].get_xticklabels()) == 4
    fitting = [p for p in plans if p.fits]
    assert fitting and plans[:len(fitting)] == fitting  # fitting layouts first
    assert all(p.tp * p.pp * p.cp * p.dp == 64 for p in plans)
    assert "layouts fit" in fig.axes[0].get_title()


def test_explorer_plans_mixture_of_experts_models_with_expert_parallelism():
    fig, plans = W.layout_explorer("mixtral-8x7b", 16, "H100 SXM (80 GB)", seq_len=4096, shown=3)
    assert {p.ep for p in plans} == {1, 2, 4, 8}  # every EP that divides the 8 experts and DP
    assert all("ep" in p.comm_bytes for p in plans)


@pytest.mark.parametrize("kwargs,match", [({"model": "gpt5"}, "model"), ({"gpus": 12}, "power of two"),
                                          ({"gpu": "TPU"}, "gpu"), ({"shown": 0}, "shown")])
def test_explorer_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        W.layout_explorer(**kwargs)


def test_widget_builds():
    assert W.layout_calculator() is not None
