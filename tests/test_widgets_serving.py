"""labkit.widgets.serving: the serving explorer's point, plot, summary and callback (matplotlib's Agg backend), and the widget."""
import labkit  # noqa: F401

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from labkit.model import TransformerLM, tiny_config  # noqa: E402
from labkit.widgets import serving as W  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TransformerLM(tiny_config(128, context_length=128, d_model=32, num_layers=2, num_heads=4, d_ff=64)).eval()


def test_a_point_serves_every_request_and_prefix_caching_shares_the_system_prompt(model):
    on = W.serving_point(model, offered_load=500.0, max_batch_tokens=64, block_size=8, prefix_caching=True)
    off = W.serving_point(model, offered_load=500.0, max_batch_tokens=64, block_size=8, prefix_caching=False)
    for data in (on, off):
        assert data["metrics"].num_requests == W.NUM_REQUESTS
        assert data["tables"] and all(len(t) >= 1 for t in data["tables"].values())
        assert all(count >= 1 for count in data["refcounts"].values())
    assert off["cached_tokens"] == 0 and max(off["refcounts"].values()) == 1  # nothing shared without the cache
    assert on["cached_tokens"] > 0 and max(on["refcounts"].values()) > 1
    # the cache saved exactly the tokens it supplied
    assert off["stats"].computed_tokens - on["stats"].computed_tokens == on["cached_tokens"]
    # the system prompt's full blocks sit at the front of every table that holds them
    shared = [b for b, count in on["refcounts"].items() if count > 1]
    assert all(set(t[:len(shared)]) <= set(shared) or len(t) < len(shared) for t in on["tables"].values())


def test_the_block_size_sets_the_pool_and_the_waits_are_skipped(model):
    data = W.serving_point(model, offered_load=10.0, block_size=16)
    assert max(b for t in data["tables"].values() for b in t) < W.POOL_SLOTS // 16
    # 16 arrivals at 10/s span about 1.5 s of the engine's clock, which fast-forwards over the idle time
    assert data["metrics"].seconds > 1.0


def test_bad_settings_are_rejected(model):
    with pytest.raises(ValueError, match="offered_load"):
        W.serving_point(model, offered_load=0.5)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        W.serving_point(model, max_batch_tokens=8)
    with pytest.raises(ValueError, match="block_size"):
        W.serving_point(model, block_size=5)
    with pytest.raises(TypeError, match="prefix_caching"):
        W.serving_point(model, prefix_caching="yes")


def test_the_fast_forward_clock_only_skips_what_it_is_told():
    clock = W.FastForwardClock()
    before = clock()
    clock.sleep(5.0)
    clock.sleep(-1.0)  # a wait already past skips nothing
    assert 5.0 <= clock() - before < 5.5 and clock.skipped == 5.0


def test_plot_draws_the_point_and_the_block_tables(model):
    data = W.serving_point(model, offered_load=500.0)
    fig = W.plot_serving(data, title="t")
    ax_point, ax_table = fig.axes[:2]
    x, y = ax_point.lines[0].get_data()
    assert x[0] == pytest.approx(data["metrics"].tokens_per_s) and y[0] == pytest.approx(data["metrics"].ttft_median * 1e3)
    image = ax_table.images[0].get_array()
    assert image.shape == (len(data["tables"]), max(len(t) for t in data["tables"].values()))
    first = sorted(data["tables"])[0]
    assert [image[0, c] for c in range(len(data["tables"][first]))] == [data["refcounts"][b] for b in data["tables"][first]]
    assert fig._suptitle.get_text() == "t"
    with pytest.raises(ValueError, match="serving_point"):
        W.plot_serving({"metrics": None})


def test_summary_and_callback(model, capsys):
    data = W.show_serving(model, offered_load=300.0, max_batch_tokens=32, block_size=4, prefix_caching=True)
    text = capsys.readouterr().out
    assert f"{data['metrics'].generated_tokens} tokens for {W.NUM_REQUESTS} requests" in text
    assert f"prefix cache supplied {data['cached_tokens']} prompt tokens" in text
    assert W.serving_summary(data) in text


def test_widget_builds(model):
    assert W.serving_explorer_widget(model) is not None
