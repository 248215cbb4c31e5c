"""labkit.widgets.hardware: the roofline explorer's shapes, point, plot and callback (Agg backend), and the widget."""
import labkit  # noqa: F401

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from labkit import hardware as H  # noqa: E402
from labkit.widgets import hardware as W  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_shapes_for_each_op():
    assert W.shapes_for("matmul", 64) == (64, 64, 64)
    assert W.shapes_for("softmax", 64) == (64, 64) and W.shapes_for("add", 16) == (16, 16)
    assert W.shapes_for("attention_flash", 1024) == (1, 16, 1024, 128)
    for op, n in (("conv", 64), ("add", 8), ("add", 1 << 17), ("add", 64.0)):
        with pytest.raises(ValueError):
            W.shapes_for(op, n)


def test_point_matches_the_roofline_and_intensity():
    machines = W.default_machines()
    point = W.roofline_point("matmul", 4096, "bfloat16", "H100 SXM", machines)
    cost = H.arithmetic_intensity("matmul", (4096, 4096, 4096), torch.bfloat16)
    roof = H.Roofline.datasheet("H100 SXM", torch.bfloat16)
    assert (point["flops"], point["bytes"]) == (cost.flops, cost.bytes)
    assert point["bound"] == "compute" and point["seconds"] == cost.flops / roof.peak_flops
    add = W.roofline_point("add", 4096, "float32", "H200", machines)
    assert add["bound"] == "memory" and add["seconds"] == add["bytes"] / 4.8e12
    assert add["roofline"].peak_flops == 67e12  # fp32 without tensor cores


def test_point_rejects_bad_choices():
    machines = W.default_machines()
    with pytest.raises(ValueError, match="dtype"):
        W.roofline_point("add", 64, "int4", "H200", machines)
    with pytest.raises(ValueError, match="machine"):
        W.roofline_point("add", 64, "float32", "TPU", machines)


def test_this_machine_is_offered_when_measured():
    here = H.Roofline("this machine", 50e9, 10e9, "measured")
    machines = W.default_machines(here)
    assert list(machines) == ["this machine", "H100 SXM", "H200"]
    point = W.roofline_point("softmax", 1024, "float32", "this machine", machines)
    assert point["roofline"] is here and point["bound"] == "memory"


def test_plot_draws_the_ceilings_ridge_and_points():
    roof = H.Roofline.datasheet("H200")
    ax = W.plot_roofline(roof, [dict(label="a", intensity=1.0, flop_per_s=1e12), dict(label="b", intensity=500, flop_per_s=5e14)])
    assert len(ax.lines) == 4  # roofline, ridge, two points
    labels = [t.get_text() for t in ax.texts]  # the points and the ridge labelled where they are drawn
    assert labels == [f"ridge {roof.ridge:.3g} FLOP/B", "a", "b"]
    assert [t.xy for t in ax.texts] == [(roof.ridge, roof.peak_flops), (1.0, 1e12), (500, 5e14)]
    assert ax.get_xscale() == "log" and "FLOP per byte" in ax.get_xlabel()
    ceiling = ax.lines[0].get_ydata()
    assert max(ceiling) == roof.peak_flops


def test_callback_prints_and_returns_the_point(capsys):
    point = W.show_roofline_point("attention_naive", 12, "bfloat16", "H200")
    out = capsys.readouterr().out
    assert "attention_naive (1, 16, 4096, 128)" in out and ("memory-bound" in out or "compute-bound" in out)
    assert point["shapes"] == (1, 16, 4096, 128)
    with pytest.raises(ValueError, match="log2_n"):
        W.show_roofline_point("add", 20)


def test_widget_builds():
    assert W.roofline_explorer_widget(H.Roofline("this machine", 50e9, 10e9, "measured")) is not None
