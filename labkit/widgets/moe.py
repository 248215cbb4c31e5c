"""Chapter 04 widget: the routing visualiser.

A thin ``ipywidgets.interact`` over :func:`show_routing`, which draws what
:func:`labkit.moe.routing_explorer` computes (:func:`plot_routing`) and prints its numbers
(:func:`routing_summary`); the tests call those plain functions directly.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from labkit import moe
from labkit.widgets import drawn

EXPERT_COUNTS = (2, 4, 8, 16, 32)


def plot_routing(data: dict, title: str | None = None):
    """Two panels, three when balancing ran:

    * left, the tokens each expert was routed, split into kept (blue) and dropped (red), with the
      capacity as a dashed line (none when dropless) and, when balancing ran, the loads before it
      (grey outline);
    * middle, the dense gate matrix of the first tokens (rows) over the experts (columns): which
      experts each token goes to, and with what weight;
    * right, only when balancing ran: the Switch balancing loss (``E * sum f_i P_i``, 1 = balanced)
      over the balancing steps.

    ``data``: the dict :func:`labkit.moe.routing_explorer` returns. Returns the figure.
    """
    needed = ("tokens_per_expert_before", "tokens_per_expert", "kept_per_expert", "dropped_per_expert", "gates", "capacity")
    if any(k not in data for k in needed) or len(data["tokens_per_expert"]) != len(data["kept_per_expert"]):
        raise ValueError("data: expected the dict labkit.moe.routing_explorer returns")
    E = len(data["tokens_per_expert"])
    experts = np.arange(E)
    history = data.get("aux_loss_history") or []
    if history:
        fig, (ax_load, ax_gates, ax_aux) = plt.subplots(1, 3, figsize=(12, 3.4), gridspec_kw={"width_ratios": [1.3, 1, 1]})
    else:
        fig, (ax_load, ax_gates) = plt.subplots(1, 2, figsize=(9, 3.4), gridspec_kw={"width_ratios": [1.3, 1]})
    ax_load.bar(experts, data["kept_per_expert"], color="tab:blue", label="kept")
    ax_load.bar(experts, data["dropped_per_expert"], bottom=data["kept_per_expert"], color="tab:red", label="dropped")
    if history:
        ax_load.bar(experts, data["tokens_per_expert_before"], fill=False, edgecolor="grey", lw=1.0, label="before balancing")
    if data["capacity"] is not None:
        ax_load.axhline(data["capacity"], color="black", ls="--", lw=1.0, label=f"capacity {data['capacity']}")
    ax_load.set_xlabel("expert")
    ax_load.set_xticks(experts if E <= 16 else experts[:: E // 8])
    ax_load.set_ylabel("assignments")
    ax_load.set_title("load per expert", fontsize=9)
    ax_load.legend(fontsize=7, loc="upper right")
    gates = np.asarray(data["gates"].detach().cpu() if hasattr(data["gates"], "detach") else data["gates"])
    image = ax_gates.imshow(gates, aspect="auto", cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
    ax_gates.set_xlabel("expert")
    ax_gates.set_xticks(experts if E <= 16 else experts[:: E // 8])
    ax_gates.set_ylabel("token")
    ax_gates.set_title(f"gates of the first {gates.shape[0]} tokens", fontsize=9)
    fig.colorbar(image, ax=ax_gates, fraction=0.05)
    if history:
        ax_aux.plot(range(1, len(history) + 1), history, color="tab:green")
        ax_aux.axhline(1.0, color="grey", ls=":", lw=1.0)
        ax_aux.set_xlabel("balancing step")
        ax_aux.set_ylabel("E * sum f_i P_i")
        ax_aux.set_title("balancing loss (1 = balanced)", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def routing_summary(data: dict) -> str:
    """The numbers the visualiser prints: loads, capacity and drops, imbalance, balancing loss, entropy."""
    capacity = "dropless (no capacity)" if data["capacity"] is None else f"capacity {data['capacity']} per expert"
    return "\n".join([
        f"routed per expert before balancing: {data['tokens_per_expert_before']}",
        f"routed per expert:                  {data['tokens_per_expert']}",
        f"{capacity}: dropped {sum(data['dropped_per_expert'])} assignments ({data['dropped_fraction']:.1%})",
        f"max / mean load {data['load_imbalance']:.2f}, balancing loss E*sum f_i P_i {data['aux_loss']:.3f} (1 = balanced)",
        f"router entropy {data['router_entropy']:.2f} nats of at most {data['max_entropy']:.2f}",
    ])


def show_routing(num_experts: int = 8, top_k: int = 2, capacity_factor: float = 1.25, dropless: bool = False,
                 balance_weight: float = 0.0, skew: float = 1.0, seed: int = 0) -> dict:
    """Callback of the visualiser: route, plot, print; returns the data."""
    top_k = min(top_k, num_experts)
    cf = None if dropless else capacity_factor
    data = moe.routing_explorer(num_experts, top_k, cf, balance_weight, skew, seed=seed)
    where = "dropless" if cf is None else f"capacity factor {cf:g}"
    plot_routing(data, title=f"{num_experts} experts, top-{top_k}, {where}, balance weight {balance_weight:g}, skew {skew:g}")
    plt.show()
    print(routing_summary(data))
    return data


def routing_visualiser_widget():
    """Sliders for the number of experts, top-k, capacity factor, balancing weight and skew over
    :func:`show_routing` (``dropless`` ignores the capacity factor)."""
    import ipywidgets as widgets

    return widgets.interact(
        drawn(show_routing),
        num_experts=widgets.Dropdown(options=EXPERT_COUNTS, value=8, description="experts"),
        top_k=widgets.IntSlider(2, 1, 8, description="top-k"),
        capacity_factor=widgets.FloatSlider(value=1.25, min=0.25, max=3.0, step=0.25, description="capacity f."),
        dropless=widgets.Checkbox(value=False, description="dropless"),
        balance_weight=widgets.FloatSlider(value=0.0, min=0.0, max=5.0, step=0.25, description="balance w."),
        skew=widgets.FloatSlider(value=1.0, min=0.0, max=5.0, step=0.25, description="skew"),
        seed=widgets.fixed(0),
    )
