import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from labkit.foundations import element_address, init_statistics, recommended_gain, second_moment_gain, tensor_layout
from labkit.widgets.foundations import show_init_statistics


def test_tensor_layout_views_and_copies():
    x = torch.arange(12.0).reshape(3, 4)
    assert tensor_layout(x) == {"shape": (3, 4), "stride": (4, 1), "offset": 0, "contiguous": True, "storage_bytes": 48}
    t = tensor_layout(x.T, base=x)
    assert t["stride"] == (1, 4) and not t["contiguous"] and t["shares_storage"]
    assert tensor_layout(x[1:, 2:], base=x)["offset"] == 6
    assert not tensor_layout(x.T.contiguous(), base=x)["shares_storage"]


def test_element_address_matches_storage():
    x = torch.arange(60.0).reshape(3, 4, 5)
    flat = torch.arange(60.0)
    for view in (x, x.transpose(0, 2), x[1:, ::2, 3:]):
        for index in [(0,) * view.dim(), tuple(s - 1 for s in view.shape)]:
            assert flat[element_address(view, index)] == view[index]
    with pytest.raises(ValueError, match="index"):
        element_address(x, (0, 0))
    with pytest.raises(ValueError, match="out of range"):
        element_address(x, (3, 0, 0))


@pytest.mark.parametrize("scale", [0.9, 1.1])
def test_linear_stack_scales_rms_by_scale_per_layer(scale):
    stats = init_statistics(scale, depth=16, width=512, activation="linear")
    ratios = torch.tensor(stats.activation_rms[1:]) / torch.tensor(stats.activation_rms[:-1])
    assert ratios.mean().item() == pytest.approx(scale, rel=0.02)
    assert stats.activation_rms[-1] == pytest.approx(scale**16, rel=0.3)
    # backward: the gradient reaching layer 1 has been scaled by the 15 layers above it
    assert stats.gradient_rms[0] / stats.gradient_rms[-1] == pytest.approx(scale**15, rel=0.3)


def test_he_init_keeps_relu_signal_alive_and_lecun_does_not():
    he = init_statistics(2**0.5, depth=32, activation="relu")
    lecun = init_statistics(1.0, depth=32, activation="relu")
    assert he.activation_rms[-1] > 0.3
    assert lecun.activation_rms[-1] < 1e-3


def test_init_statistics_errors():
    with pytest.raises(ValueError, match="scale"):
        init_statistics(0.0)
    with pytest.raises(ValueError, match="activation"):
        init_statistics(1.0, activation="swish")


def test_widget_callback_plots_and_validates():
    fig = show_init_statistics(1.5, "relu", depth=8)
    assert len(fig.axes) == 2 and len(fig.axes[0].lines) == 2
    with pytest.raises(ValueError, match="scale"):
        show_init_statistics(10.0)
    with pytest.raises(ValueError, match="depth"):
        show_init_statistics(1.0, depth=0)


def test_second_moment_gain_matches_he_and_monte_carlo():
    assert second_moment_gain("relu") == pytest.approx(2**0.5, abs=1e-9)  # He et al.: E[relu(z)^2] = 1/2
    assert second_moment_gain("linear") == pytest.approx(1.0, abs=1e-12)
    z = torch.randn(2_000_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for name, f in [("tanh", torch.tanh), ("silu", torch.nn.functional.silu), ("gelu", torch.nn.functional.gelu)]:
        monte_carlo = 1 / f(z).pow(2).mean().sqrt().item()
        assert second_moment_gain(name) == pytest.approx(monte_carlo, rel=2e-3), name


def test_recommended_gain_is_torchs_where_torch_has_one():
    assert recommended_gain("tanh") == (pytest.approx(5 / 3), "torch.nn.init.calculate_gain")
    assert recommended_gain("relu")[0] == pytest.approx(2**0.5)
    gain, source = recommended_gain("silu")
    assert source == "second-moment gain" and 1.6 < gain < 1.75
    with pytest.raises(ValueError, match="activation"):
        recommended_gain("swish")
