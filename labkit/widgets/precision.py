"""Chapter 01 pictures and widgets: bit layouts, where each format's values lie, a bit explorer
and a cast explorer. Every number they show comes from :mod:`labkit.precision`."""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import torch

from labkit import precision as P
from labkit.show import print_table

FIELD_COLORS = {"sign": "#d62728", "exponent": "#1f77b4", "mantissa": "#2ca02c"}


# ----------------------------------------------------------------------------- figures
def draw_bit_layouts(formats=None):
    """One row of boxes per format: sign, exponent and mantissa bits, to scale."""
    formats = [P.get_format(f) for f in (formats or P.FORMATS)]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(formats) + 0.6))
    for row, fmt in enumerate(formats):
        y = len(formats) - 1 - row
        fields = [("sign", 1), ("exponent", fmt.exponent_bits), ("mantissa", fmt.mantissa_bits)]
        x = 0
        for field, width in fields:
            for _ in range(width):
                ax.add_patch(plt.Rectangle((x, y + 0.1), 0.95, 0.8, color=FIELD_COLORS[field]))
                x += 1
        ax.text(-0.5, y + 0.5, f"{fmt.name}", ha="right", va="center", fontsize=9)
        ax.text(x + 0.5, y + 0.5, f"1+{fmt.exponent_bits}+{fmt.mantissa_bits} bits, max {fmt.max:.4g}, eps {fmt.eps:.3g}",
                va="center", fontsize=8)
    ax.set_xlim(-7, 46)
    ax.set_ylim(0, len(formats))
    ax.axis("off")
    ax.set_title("Bit layouts: the exponent buys range, the mantissa precision", loc="left", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in FIELD_COLORS.values()]
    ax.legend(handles, list(FIELD_COLORS), loc="upper right", ncol=3, fontsize=8, frameon=False, bbox_to_anchor=(1.0, 1.12))
    fig.tight_layout()
    return fig


def plot_value_ranges(formats=None, zoom: tuple[int, int] = (-26, 17)):
    """Where each format's positive values lie, one row per format: a cell per binade
    ``[2^k, 2^(k+1))`` coloured by how many values it holds (:func:`labkit.precision.values_per_binade`:
    ``2^m`` in every normal binade, fewer and fewer through the subnormals, nothing past max).
    Left: the whole range, fp32 and bf16 included; right: ``zoom`` (binades), where the FP8/FP6/FP4
    formats live, wide enough to read."""
    formats = [P.get_format(f) for f in (formats or P.FORMATS)]
    counts = {f.name: P.values_per_binade(f) for f in formats}
    densest = max(math.log2(max(c.values())) for c in counts.values())
    cmap = plt.get_cmap("viridis")
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.42 * len(formats) + 1.4), sharey=True,
                             gridspec_kw={"width_ratios": [3, 2]}, layout="constrained")
    for ax, (lo, hi) in zip(axes, [(None, None), zoom]):
        for row, fmt in enumerate(formats):
            y = len(formats) - 1 - row
            binades, how_many = zip(*sorted(counts[fmt.name].items()))
            ax.barh([y] * len(binades), 1, left=binades, height=0.7, edgecolor="none",
                    color=[cmap(math.log2(count) / densest) for count in how_many])
        ax.set_yticks(range(len(formats)), [f"{f.name} (2^{f.mantissa_bits}/binade)" for f in reversed(formats)], fontsize=8)
        if lo is not None:
            ax.set_xlim(lo, hi)
        ax.set_xlabel("binade k:  values in [2^k, 2^(k+1))")
        ax.grid(True, axis="x", alpha=0.3)
    axes[0].set_title("Every format's range (log2 scale)", fontsize=10)
    axes[1].set_title(f"Zoom on binades {zoom[0]}..{zoom[1]}", fontsize=10)
    mappable = plt.cm.ScalarMappable(norm=plt.Normalize(0, densest), cmap=cmap)
    fig.colorbar(mappable, ax=axes, label="log2(values per binade)", fraction=0.03, pad=0.02)
    fig.suptitle("Where the representable values lie: 2^m per normal binade, thinning through the subnormals", fontsize=10)
    return fig


def plot_relative_error(formats=("fp16", "bf16", "fp8_e4m3", "fp8_e5m2"), low: float = -30, high: float = 20, bins: int = 400, per_bin: int = 64):
    """Worst relative rounding error ``|round_to(x) - x| / |x|`` in small bins of ``|x|``, with
    each format's own overflow rule (the cast of section 3): flat at eps/2 through the normal
    range, growing through the subnormals to 1 (underflow to 0) on the left; past max E4M3 and
    the MX elements saturate (the error climbs towards 1) while IEEE formats overflow to inf,
    drawn as a flat line above the top of the finite errors, one level per format (fp16 and E5M2
    overflow at nearly the same |x|, 65520 and 61440, so on one level their lines would coincide)."""
    x = torch.exp2(torch.linspace(low, high, bins * per_bin, dtype=torch.float64))
    centers = x.view(bins, per_bin)[:, per_bin // 2]
    inf_levels = iter(2.0 ** (0.5 + 0.5 * k) for k in range(len(formats)))  # where an infinite error is drawn
    top = 2.0**0.5
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for name in formats:
        fmt = P.get_format(name)
        rounded = P.round_to(x, fmt)
        overflows = bool(torch.isinf(rounded).any())
        inf_level = next(inf_levels) if overflows else top
        error = torch.where(torch.isinf(rounded), inf_level, (rounded - x).abs() / x)
        worst = error.view(bins, per_bin).amax(dim=1)
        overflow = "overflows to inf" if fmt.has_inf else "saturates at max"
        (line,) = ax.plot(centers.numpy(), worst.numpy(), lw=1.2, label=f"{name} (eps/2 = 2^{-fmt.mantissa_bits - 1}, {overflow})")
        if overflows:
            top = max(top, inf_level)
            ax.axhline(inf_level, color=line.get_color(), lw=0.6, alpha=0.5)
            ax.text(2.0**low, inf_level, f" {name}: inf (overflow)", va="bottom", fontsize=7, color=line.get_color())
        for edge, style in ((fmt.min_normal, ":"), (fmt.max, "--")):
            if 2.0**low <= edge <= 2.0**high:
                ax.axvline(edge, color=line.get_color(), ls=style, lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_ylim(2**-13, top * 2**0.4)
    ax.set_xlabel("|x|  (dotted: min normal, dashed: max)")
    ax.set_ylabel("worst relative rounding error")
    ax.set_title("Precision is relative; the range has edges")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_gradient_magnitudes(grads: torch.Tensor, fmt: str = "fp16", scales=(1.0, 2.0**16)):
    """Histogram of ``log2 |g|`` for each loss scale, with the format's underflow edges."""
    fmt = P.get_format(fmt)
    g = grads.detach().double().flatten()
    g = g[g != 0]
    fig, ax = plt.subplots(figsize=(9, 3.4))
    for scale in scales:
        ax.hist(torch.log2(g.abs() * scale).numpy(), bins=120, alpha=0.5,
                label=f"scale {scale:g}: {P.gradient_underflow(g, fmt, scale):.1%} underflow in {fmt.name}")
    ax.axvline(math.log2(fmt.min_subnormal), color="k", ls="--", lw=1)
    ax.axvline(math.log2(fmt.min_normal), color="k", ls=":", lw=1)
    ax.axvline(math.log2(fmt.max), color="r", ls="--", lw=1)
    ax.set_xlabel(f"log2 |gradient x scale|  (dashed: {fmt.name} min subnormal / max, dotted: min normal)")
    ax.set_ylabel("count")
    ax.set_title(f"Gradient magnitudes against {fmt.name}'s range, with and without loss scaling")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- widgets
def bits_of(code: int, num_bits: int) -> list[bool]:
    """Bits of ``code``, most significant first (the order the explorer draws them)."""
    return [bool((code >> (num_bits - 1 - i)) & 1) for i in range(num_bits)]


def code_of(bits) -> int:
    """Inverse of :func:`bits_of`."""
    return int("".join("1" if b else "0" for b in bits) or "0", 2)


def bit_explorer(fmt: str = "bf16", value: float = 1.0):
    """Pick a format, click bits on/off or type a value: see the fields, the value, its class
    and its neighbours (:func:`labkit.precision.explain_code`). Changing the format re-encodes
    the typed value, so the rounding of each format shows."""
    import ipywidgets as widgets

    fmt_menu = widgets.Dropdown(options=list(P.FORMATS), value=P.get_format(fmt).name, description="format")
    value_box = widgets.FloatText(value=value, description="value", step=None)
    bit_row = widgets.HBox()
    report = widgets.HTML()
    state = {"updating": False}

    def show(code: int) -> None:
        f = P.get_format(fmt_menu.value)
        state["updating"] = True
        for button, on in zip(bit_row.children, bits_of(code, f.bits)):
            button.value, button.description = on, "1" if on else "0"
        state["updating"] = False
        report.value = f"<pre>{P.explain_code(code, f)}</pre>"

    def build_bits(f: P.FloatFormat) -> None:
        fields = ["sign"] + ["exponent"] * f.exponent_bits + ["mantissa"] * f.mantissa_bits
        buttons = []
        for field in fields:
            b = widgets.ToggleButton(value=False, description="0", tooltip=f"{field} bit (click to flip)",
                                     layout=widgets.Layout(width="22px", height="28px", padding="0"))
            b.style.button_color = FIELD_COLORS[field]
            b.observe(on_bit, names="value")
            buttons.append(b)
        bit_row.children = buttons

    def on_bit(_change) -> None:
        if state["updating"]:
            return
        code = code_of(b.value for b in bit_row.children)
        show(code)
        decoded = P.decode(code, fmt_menu.value).item()
        state["updating"] = True
        value_box.value = decoded if math.isfinite(decoded) else value_box.value
        state["updating"] = False

    def on_value(_change) -> None:
        if not state["updating"]:
            show(int(P.encode(value_box.value, fmt_menu.value).item()))

    def on_format(_change) -> None:
        build_bits(P.get_format(fmt_menu.value))
        on_value(None)

    value_box.observe(on_value, names="value")
    fmt_menu.observe(on_format, names="value")
    on_format(None)
    return widgets.VBox([widgets.HBox([fmt_menu, value_box]), bit_row, report])


def print_cast_table(value: float, formats=None) -> None:
    """``value`` stored in each format (:func:`labkit.precision.cast_table`), stored values
    printed with 9 significant digits so the rounding shows."""
    rows = P.cast_table(value, formats)
    print_table([{**row, "stored": f"{row['stored']:.9g}"} for row in rows])


def cast_explorer(value: float = 0.1):
    """Type a value: see it stored in every format, with absolute and relative error."""
    import ipywidgets as widgets

    box = widgets.FloatText(value=value, description="value", step=None)
    out = widgets.Output()

    def refresh(_change=None) -> None:
        out.clear_output()
        with out:
            print_cast_table(box.value)

    box.observe(refresh, names="value")
    refresh()
    return widgets.VBox([box, out])


__all__ = ["draw_bit_layouts", "plot_value_ranges", "plot_relative_error", "plot_gradient_magnitudes",
           "bit_explorer", "cast_explorer", "print_cast_table", "bits_of", "code_of"]
