"""labkit.widgets.preference: the DPO explorer's callback, plot and summary (matplotlib's Agg backend)."""
import labkit  # noqa: F401

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from labkit.pretrained import adder_task, load_tiny_adder  # noqa: E402
from labkit.widgets import preference as W  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def run():
    base, _ = load_tiny_adder()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    data = W.dpo_explorer(base, adder_task(), beta=0.5, noise=0.1, steps=8, pairs=128)
    assert all(torch.equal(before[k], v) for k, v in base.state_dict().items())  # the base is left untouched
    return data


def test_explorer_runs_dpo_and_reports(run):
    assert run["log"]["step"] == list(range(1, 9)) and len(run["log"]["margin"]) == 8
    assert run["log"]["margin"][-1] > run["log"]["margin"][0]  # DPO separates the pairs
    assert set(run["report"]) >= {"reward", "accuracy", "concise", "malformed"} and run["kl"] >= -0.5


def test_plot_and_summary(run):
    fig = W.plot_dpo_run(run)
    left, right, _ = fig.axes
    assert "margin" in left.get_ylabel() and len(right.lines) == 2
    assert "beta = 0.5" in fig._suptitle.get_text()
    text = W.explorer_summary(run)
    assert "beta 0.5, noise 10%, 8 steps" in text and "≈" in text
    with pytest.raises(ValueError, match="dpo_explorer"):
        W.plot_dpo_run({"log": {}})


@pytest.mark.parametrize("kwargs, name", [(dict(beta=5.0), "beta"), (dict(noise=0.7), "noise"), (dict(steps=1000), "steps"),
                                          (dict(steps=2.5), "steps")])
def test_explorer_validates_its_ranges(kwargs, name):
    base, _ = load_tiny_adder()
    with pytest.raises(ValueError, match=name):
        W.dpo_explorer(base, adder_task(), **kwargs)


def test_widget_builds():
    pytest.importorskip("ipywidgets")
    base, _ = load_tiny_adder()
    assert W.dpo_explorer_widget(base, adder_task()) is not None
