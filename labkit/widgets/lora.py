"""Chapter 05 widget: the rank explorer.

A thin ``ipywidgets.interact`` over :func:`show_rank_explorer`, which draws what
:func:`labkit.lora.rank_explorer` computes (:func:`plot_rank_explorer`: the memory of full
fine-tuning, LoRA and QLoRA for the chosen model, rank and targets, what LoRA and QLoRA keep besides
the frozen base, and the accuracy the chapter measured for each rank on the adder) and prints its numbers (:func:`explorer_summary`);
:func:`plot_rank_sweep` is the chapter's own plot of those runs. The tests call these plain functions.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from labkit import lora as L
from labkit.claims import about
from labkit.model import PRESETS
from labkit.widgets import drawn

RANKS = (1, 2, 4, 8, 16, 32, 64)
KIND_COLORS = {"weights": "tab:blue", "quant_scales": "tab:cyan", "adapters": "tab:olive", "grads": "tab:orange",
               "optimizer_states": "tab:red", "master_weights": "tab:purple", "activations": "tab:green", "recompute": "tab:gray"}
TARGET_STYLES = {"attention (q, v)": ("o-", "tab:blue"), "attention (q, k, v, o)": ("s-", "tab:cyan"), "all linear": ("^-", "tab:red")}


def explorer_models(chapter_config=None) -> dict:
    """The models the explorer offers: the chapter's adder (if its config is given) and real presets."""
    models = {"Llama-2-7B": PRESETS["llama2-7b"], "Qwen3-8B": PRESETS["qwen3-8b"], "Llama-2-70B": PRESETS["llama2-70b"],
              "LLaMA-65B": L.LLAMA_65B}
    return {"tiny adder (this chapter)": chapter_config, **models} if chapter_config is not None else models


def runs_by_choice(rows: list[dict]) -> dict:
    """``{(targets, r): row}`` of the LoRA rows of the chapter's runs (what ``rank_explorer`` looks up)."""
    return {(row["targets"], row["r"]): row for row in rows if row["method"] == "LoRA"}


def plot_rank_sweep(rows: list[dict], ax=None, key: str = "new", highlight: tuple | None = None, ylabel: str | None = None):
    """Accuracy (``key``: ``"new"``, ``"old"`` or ``"old_loss"``) of the chapter's LoRA runs against the
    rank, one line per target set, full fine-tuning as a dashed line; ``highlight``: ``(targets, r)``
    circled. Returns the axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.4))
    lora = [row for row in rows if row["method"] == "LoRA"]
    if not lora:
        raise ValueError("rows: expected the chapter's runs, with at least one LoRA row")
    for targets in dict.fromkeys(row["targets"] for row in lora):
        points = sorted((row["r"], row[key]) for row in lora if row["targets"] == targets)
        style, color = TARGET_STYLES.get(targets, ("x-", "black"))
        ax.plot([p[0] for p in points], [p[1] for p in points], style, color=color, label=f"LoRA, {targets}")
    for row in rows:
        if row["method"] == "full":
            ax.axhline(row[key], color="black", ls="--", lw=1, label="full fine-tuning")
        if row["method"] == "QLoRA":
            ax.plot([row["r"]], [row[key]], "*", ms=12, color="tab:green", label=f"QLoRA (NF4 base), {row['targets']}")
    if highlight is not None:
        chosen = [row for row in lora if (row["targets"], row["r"]) == tuple(highlight)]
        for row in chosen:
            ax.plot([row["r"]], [row[key]], "o", ms=14, mfc="none", mec="black", mew=1.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({row["r"] for row in lora}))
    ax.set_xticklabels([str(r) for r in sorted({row["r"] for row in lora})])
    ax.set_xlabel("rank r")
    ax.set_ylabel(ylabel or {"new": "accuracy on the new task", "old": "accuracy on the original task",
                             "old_loss": "loss on the original task's answers"}.get(key, key))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return ax


def _stacked_bars(ax, memory: dict, methods: dict, kinds) -> None:
    """Bars of ``methods`` (``{label: key of memory}``), ``kinds`` stacked in :data:`KIND_COLORS`, totals on top."""
    bottoms = [0.0] * len(methods)
    for kind in kinds:
        values = [getattr(memory[key], kind) / 1e9 for key in methods.values()]
        if any(values):
            ax.bar(list(methods), values, bottom=bottoms, color=KIND_COLORS[kind], label=kind.replace("_", " "))
            bottoms = [b + v for b, v in zip(bottoms, values)]
    for x, total in enumerate(bottoms):
        ax.annotate(f"{total:.1f} GB" if total >= 1 else f"{total:.3g} GB", (x, total), ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.5 * max(bottoms))  # room for the legend above the bars
    ax.set_ylabel("GB (1e9 bytes)")
    ax.legend(fontsize=7, ncol=3, loc="upper center")


def plot_rank_explorer(data: dict, rows: list[dict] | None = None, title: str | None = None):
    """Left: stacked bars of the memory breakdown (GB) of full fine-tuning, LoRA and QLoRA from ``data`` (what
    :func:`labkit.lora.rank_explorer` returns). Middle: LoRA's and QLoRA's bars without their frozen base (weights
    and quantization scales) on their own scale, where the adapters, their gradients and optimizer states, too thin
    to see beside the base, show. Right, if ``rows`` (the chapter's runs) are given, :func:`plot_rank_sweep` with the
    chosen targets and rank circled. Returns the figure."""
    memory = data.get("memory") if isinstance(data, dict) else None
    if not memory or set(memory) != {"full", "lora", "qlora"}:
        raise ValueError("data: expected the dict labkit.lora.rank_explorer returns")
    panels = 3 if rows else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.6), squeeze=False)
    ax, zoom = axes[0][0], axes[0][1]
    rank = data["rank"]
    _stacked_bars(ax, memory, {"full FT\n(mixed, 16 B/param)": "full", f"LoRA r={rank}": "lora", f"QLoRA r={rank}": "qlora"},
                  L.FinetuneMemory.KINDS)
    ax.set_title(f"{data['targets']}, {data['trainable']:,} trainable ({data['fraction']:.2%})", fontsize=9)
    trained = [kind for kind in L.FinetuneMemory.KINDS if kind not in ("weights", "quant_scales")]
    _stacked_bars(zoom, memory, {f"LoRA r={rank}": "lora", f"QLoRA r={rank}": "qlora"}, trained)
    zoom.set_title("LoRA and QLoRA without the frozen base", fontsize=9)
    if rows:
        plot_rank_sweep(rows, axes[0][2], highlight=(data["targets"], rank))
        axes[0][2].set_title("measured on the adder (subtraction)", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    # fixed margins instead of tight_layout, which draws every label once more to measure it: the widget
    # redraws on every change of a control
    fig.subplots_adjust(left=0.18 / panels, right=0.99, bottom=0.2, top=0.82 if title else 0.9, wspace=0.28)
    return fig


def explorer_summary(data: dict) -> str:
    """The numbers the explorer prints: scaling, trainable parameters, the three totals, the measured run."""
    memory = data["memory"]
    lines = [f"rank {data['rank']}, alpha {data['alpha']:g}: scaling alpha / r = {data['scaling']:.3g}; "
             f"{data['trainable']:,} trainable parameters of {data['total']:,} ({data['fraction']:.3%})",
             "  ".join(f"{name}: {memory[key].total / 1e9:.2f} GB" for name, key in (("full FT", "full"), ("LoRA", "lora"), ("QLoRA", "qlora")))]
    measured = data.get("measured")
    if measured is None:
        lines.append("the chapter did not run this rank and target set on the adder")
    else:
        lines.append(f"measured on the adder: {about(measured['new']):.1%} on subtraction, {about(measured['old']):.1%} on addition "
                     f"after fine-tuning (answer loss {about(measured['old_loss']):.2f})")
    return "\n".join(lines)


def show_rank_explorer(model: str = "Llama-2-7B", rank: int = 8, alpha: float = 16.0, targets: str = "all linear",
                       rows: list[dict] | None = None, models: dict | None = None, batch: int = 1, seq: int = 512) -> dict:
    """Callback of the explorer: compute, plot and print; returns the data."""
    models = models or explorer_models()
    if model not in models:
        raise ValueError(f"model={model!r}: expected one of {list(models)}")
    config = models[model]
    dtype = "fp32" if config.d_model < 512 else "bf16"
    data = L.rank_explorer(config, rank, alpha, targets, runs_by_choice(rows or []), weights_dtype=dtype, batch=batch, seq=seq)
    plot_rank_explorer(data, rows, title=f"{model}: fine-tuning memory, micro-batch {batch} x {seq} tokens (checkpointed), {dtype}")
    plt.show()
    print(explorer_summary(data))
    return data


def rank_explorer_widget(rows: list[dict] | None = None, chapter_config=None):
    """Model, rank, alpha and target set over :func:`show_rank_explorer`; ``rows``: the chapter's runs."""
    import ipywidgets as widgets

    models = explorer_models(chapter_config)
    return widgets.interact(
        drawn(show_rank_explorer),
        model=widgets.Dropdown(options=list(models), value="Llama-2-7B", description="model"),
        rank=widgets.SelectionSlider(options=RANKS, value=8, description="rank r"),
        alpha=widgets.FloatLogSlider(value=16, base=2, min=0, max=9, step=1, description="alpha"),
        targets=widgets.Dropdown(options=list(L.EXPLORER_TARGETS), value="all linear", description="targets"),
        rows=widgets.fixed(rows), models=widgets.fixed(models), batch=widgets.fixed(1), seq=widgets.fixed(512),
    )
