"""Chapter 09 widget: the roofline explorer.

Pick an operator, its size, a dtype and a machine (this one, as measured in the notebook, or a
GPU's datasheet): :func:`roofline_point` computes the operator's FLOPs, bytes and intensity, which
ceiling bounds it and the time the roofline predicts; :func:`plot_roofline` draws the machine's
roofline with the point on it. :func:`show_roofline_point` is the widget's callback; the tests call
these plain functions directly.
"""
from __future__ import annotations

from typing import Callable, Mapping

import matplotlib.pyplot as plt
import numpy as np
import torch

from labkit import hardware as H
from labkit.widgets import drawn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SIZES = (16, 65536)  # the explorer's range of n
ATTENTION_HEADS, HEAD_DIM = 16, 128


def shapes_for(op: str, n: int) -> tuple[int, ...]:
    """The explorer's shapes for size ``n``: an ``n x n x n`` matmul, an add or RMSNorm or softmax over
    an ``n x n`` tensor, attention over a sequence of ``n`` tokens (batch 1, 16 heads of 128)."""
    if op not in H.OPS:
        raise ValueError(f"op={op!r}: expected one of {', '.join(H.OPS)}")
    if not isinstance(n, int) or isinstance(n, bool) or not SIZES[0] <= n <= SIZES[1]:
        raise ValueError(f"n={n!r}: expected an int from {SIZES[0]} to {SIZES[1]}")
    if op == "matmul":
        return (n, n, n)
    if op.startswith("attention"):
        return (1, ATTENTION_HEADS, n, HEAD_DIM)
    return (n, n)


def _roofline(machine: str, machines: Mapping[str, H.Roofline | Callable], dtype: torch.dtype) -> H.Roofline:
    if machine not in machines:
        raise ValueError(f"machine={machine!r}: expected one of {', '.join(machines)}")
    roof = machines[machine]
    return roof(dtype) if callable(roof) else roof


def default_machines(this_machine: H.Roofline | None = None) -> dict:
    """``{"this machine": this_machine, "H100 SXM": ..., "H200": ...}``: the GPUs from their datasheets
    for the chosen dtype (fp32 at the non-tensor-core rate)."""
    machines = {} if this_machine is None else {"this machine": this_machine}
    for gpu in ("H100 SXM", "H200"):
        machines[gpu] = lambda dtype, gpu=gpu: H.Roofline.datasheet(gpu, dtype)
    return machines


def roofline_point(op: str, n: int, dtype: str, machine: str, machines: Mapping) -> dict:
    """What the roofline says about ``op`` at size ``n`` (:func:`shapes_for`) in ``dtype`` (a name in
    :data:`DTYPES`) on ``machines[machine]``: ``shapes``, ``flops``, ``bytes``, ``intensity``
    (FLOP/byte), ``bound`` ("memory" or "compute"), ``attainable`` (FLOP/s), ``seconds`` (predicted)
    and the ``roofline`` itself."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    shapes = shapes_for(op, n)
    roof = _roofline(machine, machines, DTYPES[dtype])
    cost = H.arithmetic_intensity(op, shapes, DTYPES[dtype])
    return dict(op=op, shapes=shapes, dtype=dtype, flops=cost.flops, bytes=cost.bytes, intensity=cost.intensity,
                bound=roof.bound(cost), attainable=roof.attainable(cost.intensity), seconds=roof.predict_seconds(cost),
                roofline=roof)


def plot_roofline(roof: H.Roofline, points: list[dict], ax=None, title: str | None = None):
    """``roof``'s two ceilings on log-log axes (FLOP/s against FLOP/byte), its ridge marked and labelled with its
    intensity, and ``points`` (dicts with ``label``, ``intensity`` and ``flop_per_s``: a measured or predicted
    rate), each labelled beside its dot. Returns the axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4))
    intensities = [p["intensity"] for p in points] + [roof.ridge]
    low, high = min(intensities) / 4, max(intensities) * 4
    x = np.logspace(np.log10(low), np.log10(high), 200)
    ax.loglog(x, np.minimum(roof.peak_flops, x * roof.bandwidth), color="black", lw=1.5,
              label=f"{roof.name}: {roof.peak_flops / 1e12:.3g} TFLOP/s, {roof.bandwidth / 1e9:.3g} GB/s")
    ax.axvline(roof.ridge, color="grey", ls=":", lw=1)
    ax.annotate(f"ridge {roof.ridge:.3g} FLOP/B", (roof.ridge, roof.peak_flops), xytext=(4, -12),
                textcoords="offset points", fontsize=7, color="grey")
    for point in points:
        (dot,) = ax.loglog(point["intensity"], point["flop_per_s"], "o", ms=6)
        ax.annotate(point["label"], (point["intensity"], point["flop_per_s"]), xytext=(5, 3), textcoords="offset points",
                    fontsize=7, color=dot.get_color())
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title or f"roofline of {roof.name}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    return ax


def point_summary(point: dict) -> str:
    """The explorer's text: the shapes, FLOPs, bytes, intensity, bound and predicted time."""
    return (f"{point['op']} {point['shapes']} in {point['dtype']} on {point['roofline'].name}: "
            f"{point['flops']:,} FLOPs, {point['bytes']:,} bytes, {point['intensity']:.3g} FLOP/byte "
            f"(ridge {point['roofline'].ridge:.3g}) -> {point['bound']}-bound, "
            f"predicted {H.format_seconds(point['seconds'])} at {point['attainable'] / 1e12:.3g} TFLOP/s")


def show_roofline_point(op: str = "matmul", log2_n: int = 10, dtype: str = "bfloat16", machine: str = "H100 SXM",
                        machines: Mapping | None = None) -> dict:
    """Callback of the explorer: size ``n = 2**log2_n``; prints :func:`point_summary`, draws the point
    on its machine's roofline, returns :func:`roofline_point`'s dict."""
    if not isinstance(log2_n, int) or not SIZES[0] <= 2**log2_n <= SIZES[1]:
        raise ValueError(f"log2_n={log2_n!r}: expected an int from {int(np.log2(SIZES[0]))} to {int(np.log2(SIZES[1]))}")
    point = roofline_point(op, 2**log2_n, dtype, machine, machines if machines is not None else default_machines())
    plot_roofline(point["roofline"], [dict(label=f"{op}, n={2**log2_n} (predicted)", intensity=point["intensity"],
                                           flop_per_s=point["attainable"])])
    plt.show()
    print(point_summary(point))
    return point


def roofline_explorer_widget(this_machine: H.Roofline | None = None):
    """Dropdowns for the operator, dtype and machine and a slider for log2(n) over :func:`show_roofline_point`."""
    import ipywidgets as widgets

    machines = default_machines(this_machine)
    return widgets.interact(
        drawn(show_roofline_point),
        op=widgets.Dropdown(options=H.OPS, value="matmul", description="op"),
        log2_n=widgets.IntSlider(10, int(np.log2(SIZES[0])), int(np.log2(SIZES[1])), description="log2(n)"),
        dtype=widgets.Dropdown(options=list(DTYPES), value="bfloat16", description="dtype"),
        machine=widgets.Dropdown(options=list(machines), value="H100 SXM", description="machine"),
        machines=widgets.fixed(machines),
    )
