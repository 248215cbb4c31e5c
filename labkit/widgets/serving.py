"""Chapter 12 widget: the serving explorer.

A thin ``ipywidgets.interact`` over :func:`show_serving`, which serves a small seeded workload (requests that share
a system prompt) through labkit's :class:`~labkit.serving.Engine` at the chosen offered load, token budget, block
size and prefix caching on or off (:func:`serving_point`), draws the throughput/latency point and the block tables
at the busiest step (:func:`plot_serving`) and prints the numbers (:func:`serving_summary`). The tests call these
plain functions.

The engine runs in real time, but the waits between arrivals are skipped (:class:`FastForwardClock`): a point at
10 requests/s does not take seconds of idling, and each request is still timed from its arrival.
"""
from __future__ import annotations

import time

import matplotlib.pyplot as plt
import numpy as np

from labkit.serving import Engine
from labkit.serving import workload as W
from labkit.widgets import drawn

LOAD_RANGE = (10.0, 2000.0)  # offered load, requests per second
BUDGET_RANGE = (16, 256)  # max_batch_tokens
BLOCK_SIZES = (4, 8, 16)
POOL_SLOTS = 1024  # the KV pool holds this many tokens whatever the block size
MAX_NUM_SEQS = 16
NUM_REQUESTS = 16  # small enough that a point redraws within a browser test's 1.5 s on a busy 2-core machine
SHARED_PREFIX = 24  # tokens of system prompt every request starts with


class FastForwardClock:
    """``time.perf_counter`` that skips idle waits: :meth:`sleep` moves the clock forward instead of sleeping.
    Steps take their real time; only the time the engine would have spent waiting for the next arrival is skipped."""

    def __init__(self):
        self.skipped = 0.0

    def __call__(self) -> float:
        return time.perf_counter() + self.skipped

    def sleep(self, seconds: float) -> None:
        self.skipped += max(0.0, seconds)


class _PeakTablesEngine(Engine):
    """An :class:`~labkit.serving.Engine` that keeps its block tables (and each block's reference count) as they
    were after the step that held the most blocks: what the explorer draws."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.peak_tables, self.peak_refcounts = {}, {}

    def step(self):
        outputs = super().step()
        tables = self.block_tables()
        if sum(map(len, tables.values())) and self.blocks.num_used_blocks >= self.stats.peak_blocks_in_use:
            self.peak_tables = tables
            self.peak_refcounts = {b: self.blocks.refcount(b) for t in tables.values() for b in t}
        return outputs


def serving_point(model, offered_load: float = 200.0, max_batch_tokens: int = 64, block_size: int = 8,
                  prefix_caching: bool = True, num_requests: int = NUM_REQUESTS, seed: int = 0) -> dict:
    """Serve ``num_requests`` seeded requests that share a :data:`SHARED_PREFIX`-token system prompt (Poisson
    arrivals at ``offered_load`` requests/s) through a continuous-batching engine with chunked prefill, a pool of
    :data:`POOL_SLOTS` K/V slots in blocks of ``block_size`` and ``prefix_caching`` on or off. Returns the
    :class:`~labkit.serving.workload.ServeMetrics`, the engine's stats, the block tables and reference counts at
    its busiest step, and the settings."""
    if isinstance(offered_load, bool) or not isinstance(offered_load, (int, float)) or not (
            LOAD_RANGE[0] <= offered_load <= LOAD_RANGE[1]):
        raise ValueError(f"offered_load={offered_load!r}: expected requests per second in {LOAD_RANGE}")
    if isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int) or not (
            BUDGET_RANGE[0] <= max_batch_tokens <= BUDGET_RANGE[1]):
        raise ValueError(f"max_batch_tokens={max_batch_tokens!r}: expected an integer in {BUDGET_RANGE}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size={block_size!r}: expected one of {BLOCK_SIZES}")
    if not isinstance(prefix_caching, bool):
        raise TypeError(f"prefix_caching: expected a bool, got {type(prefix_caching).__name__}")
    workload = W.mixed_workload(num_requests, model.config.vocab_size, rate=float(offered_load), prompt_len=(4, 16),
                                shared_prefix_len=SHARED_PREFIX, seed=seed)
    clock = FastForwardClock()
    engine = _PeakTablesEngine(model, block_size, POOL_SLOTS // block_size, max_batch_tokens,
                               max_num_seqs=MAX_NUM_SEQS, prefix_caching=prefix_caching, clock=clock)
    result = W.serve(engine, workload, sleep=clock.sleep)
    return {"offered_load": float(offered_load), "max_batch_tokens": max_batch_tokens, "block_size": block_size,
            "prefix_caching": prefix_caching, "metrics": W.metrics(result), "stats": engine.stats,
            "cached_tokens": sum(o.num_cached_tokens for o in result.outputs),
            "tables": engine.peak_tables, "refcounts": engine.peak_refcounts}


def plot_serving(data: dict, title: str | None = None):
    """Left: the throughput/latency point (tokens/s against the median time to first token, the p99 as a bar
    above it). Right: the block tables at the busiest step, one row per running request, one square per block,
    coloured by its reference count (blocks of the shared prompt that prefix caching shares are > 1) and labelled
    with its block id. Returns the figure."""
    if not isinstance(data, dict) or any(k not in data for k in ("metrics", "tables", "refcounts")):
        raise ValueError("data: expected the dict serving_point returns")
    m, tables = data["metrics"], data["tables"]
    fig, (ax_point, ax_table) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [1, 1.6]})
    ax_point.errorbar([m.tokens_per_s], [m.ttft_median * 1e3], yerr=[[0], [(m.ttft_p99 - m.ttft_median) * 1e3]],
                      fmt="o", color="tab:blue", capsize=4, label="TTFT median (bar: p99)")
    ax_point.set_xlim(0, max(1.0, m.tokens_per_s) * 1.5)
    ax_point.set_ylim(0, max(1.0, m.ttft_p99 * 1e3) * 1.3)
    ax_point.set_xlabel("throughput (generated tokens/s)")
    ax_point.set_ylabel("time to first token (ms)")
    ax_point.set_title("throughput / latency", fontsize=9)
    ax_point.legend(fontsize=8, loc="upper left")
    ax_point.grid(alpha=0.3)
    rows = sorted(tables)
    width = max((len(t) for t in tables.values()), default=1)
    counts = np.full((max(len(rows), 1), width), np.nan)
    for r, request_id in enumerate(rows):
        for c, block in enumerate(tables[request_id]):
            counts[r, c] = data["refcounts"][block]
    top = max(2, int(np.nanmax(counts)) if rows else 2)
    ax_table.imshow(counts, aspect="auto", cmap="viridis", vmin=1, vmax=top, interpolation="nearest")
    if len(rows) * width <= 400:  # labels stay readable
        for r, request_id in enumerate(rows):
            for c, block in enumerate(tables[request_id]):
                ax_table.text(c, r, str(block), ha="center", va="center", fontsize=6,
                              color="black" if counts[r, c] == top else "white")
    ax_table.set_yticks(range(len(rows)), [f"req {i}" for i in rows], fontsize=7)
    ax_table.set_xlabel("position in the block table")
    ax_table.set_title(f"block tables at the busiest step (colour: reference count 1..{top})", fontsize=9)
    fig.suptitle(title or (f"{data['offered_load']:g} requests/s, budget {data['max_batch_tokens']} tokens, blocks of "
                           f"{data['block_size']}, prefix caching {'on' if data['prefix_caching'] else 'off'}"),
                 fontsize=10)
    # fixed margins instead of tight_layout, which draws every label once more to measure it: a third of a redraw
    fig.subplots_adjust(left=0.065, right=0.99, bottom=0.14, top=0.84, wspace=0.22)
    return fig


def serving_summary(data: dict) -> str:
    """What the explorer prints under the plot."""
    m, s = data["metrics"], data["stats"]
    shared = sum(count > 1 for count in data["refcounts"].values())
    return (f"{m.generated_tokens} tokens for {m.num_requests} requests in {m.seconds * 1e3:.0f} ms: "
            f"{m.tokens_per_s:.0f} tokens/s; TTFT median {m.ttft_median * 1e3:.1f} ms, p99 {m.ttft_p99 * 1e3:.1f} ms; "
            f"TPOT median {m.tpot_median * 1e3:.2f} ms\n"
            f"{s.steps} steps, {s.preemptions} preemptions, prefix cache supplied {data['cached_tokens']} prompt tokens "
            f"(hit rate {s.prefix_hit_rate:.0%}); busiest step: {s.peak_blocks_in_use} of "
            f"{POOL_SLOTS // data['block_size']} blocks in use, {shared} of them shared")


def show_serving(model, offered_load: float = 200.0, max_batch_tokens: int = 64, block_size: int = 8,
                 prefix_caching: bool = True) -> dict:
    """Callback of the explorer: serve, plot, print; returns the data."""
    data = serving_point(model, offered_load, max_batch_tokens, block_size, prefix_caching)
    plot_serving(data)
    plt.show()
    print(serving_summary(data))
    return data


def serving_explorer_widget(model):
    """Sliders for the offered load and the token budget, a menu for the block size and a checkbox for prefix
    caching over :func:`show_serving` on ``model`` (a few hundred ms per point on a CPU)."""
    import ipywidgets as widgets

    return widgets.interact(
        drawn(show_serving),
        model=widgets.fixed(model),
        offered_load=widgets.FloatLogSlider(value=200.0, base=10, min=1, max=np.log10(LOAD_RANGE[1]), step=0.25,
                                            description="requests/s"),
        max_batch_tokens=widgets.IntSlider(value=64, min=BUDGET_RANGE[0], max=BUDGET_RANGE[1], step=16,
                                           description="token budget"),
        block_size=widgets.Dropdown(options=BLOCK_SIZES, value=8, description="block size"),
        prefix_caching=widgets.Checkbox(value=True, description="prefix caching"),
    )
