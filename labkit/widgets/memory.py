"""Chapter 07's training-memory calculator: a published architecture, a batch, a precision,
an optimizer, checkpointing and a ZeRO stage -> bytes per GPU, as a stacked bar, and whether
it fits. The widget only wires sliders to :func:`memory_figure`, a plain function."""
from __future__ import annotations

import matplotlib.pyplot as plt

from labkit.memory import ATTENTION, MiB, MemoryBreakdown, estimate_training_memory

PRECISIONS = {
    "fp32": ("fp32", False),
    "bf16 (pure)": ("bf16", False),
    "bf16 mixed (fp32 master)": ("bf16", True),
    "fp16 mixed (fp32 master)": ("fp16", True),
}
PARTS = [("params", "parameters"), ("grads", "gradients"), ("master_weights", "fp32 master weights"),
         ("optimizer_states", "optimizer states"), ("activations", "activations"), ("recompute", "recomputed block")]
COLORS = ["#4c72b0", "#dd8452", "#8172b3", "#c44e52", "#55a868", "#a6d8a8"]
GB = 1e9
ATTENTION_LABELS = {"materialized": "scores materialised (labkit)", "selective": "selective recompute",
                    "sdpa": "fused SDPA / FlashAttention"}
assert set(ATTENTION_LABELS) == set(ATTENTION)


def plot_breakdowns(breakdowns: dict[str, MemoryBreakdown], limit_gb: float | None = None, title: str = "", ax=None):
    """Stacked bars, one per entry of ``breakdowns`` (label -> :class:`MemoryBreakdown`), in GB;
    an optional dashed line at ``limit_gb`` (the GPU's memory)."""
    if not breakdowns:
        raise ValueError("breakdowns: expected at least one label -> MemoryBreakdown")
    if ax is None:
        _, ax = plt.subplots(figsize=(1.6 + 1.3 * len(breakdowns), 3.6))
    labels = list(breakdowns)
    bottoms = [0.0] * len(labels)
    for (field, name), color in zip(PARTS, COLORS):
        values = [getattr(breakdowns[label], field) / GB for label in labels]
        if any(values):
            ax.bar(labels, values, bottom=bottoms, color=color, label=name)
            bottoms = [b + v for b, v in zip(bottoms, values)]
    if limit_gb is not None:
        ax.axhline(limit_gb, color="black", linestyle="--", linewidth=1)
        ax.text(len(labels) - 0.5, limit_gb, f" {limit_gb:g} GB", va="bottom", ha="right", fontsize=8)
    ax.set_ylabel("GB per device")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.figure.tight_layout()
    return ax


def memory_figure(model: str = "qwen3-8b", batch_size: int = 1, seq_len: int = 4096, precision: str = "bf16 mixed (fp32 master)",
                  optimizer: str = "adamw", checkpointing: bool = False, zero_stage: int = 0, num_gpus: int = 8,
                  gpu_memory_gb: float = 80.0, attention: str = "materialized"):
    """Estimate per-GPU training memory for ``PRESETS[model]`` and draw it; returns
    ``(figure, breakdown, fits)``. ``batch_size`` is the micro-batch per GPU; ``attention`` is
    how the attention core keeps its activations (:data:`labkit.memory.ATTENTION`)."""
    from labkit.model import PRESETS

    if model not in PRESETS:
        raise ValueError(f"model={model!r}: expected one of {sorted(PRESETS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {list(PRECISIONS)}")
    if not gpu_memory_gb > 0:
        raise ValueError(f"gpu_memory_gb={gpu_memory_gb!r}: expected a positive number")
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}: expected one of {ATTENTION}")
    dtype, mixed = PRECISIONS[precision]
    breakdown = estimate_training_memory(PRESETS[model], batch_size, seq_len, param_dtype=dtype, mixed_precision=mixed,
                                         optimizer=optimizer, activation_checkpointing=checkpointing,
                                         attention=attention, zero_stage=zero_stage, world_size=num_gpus)
    fits = breakdown.total <= gpu_memory_gb * GB
    verdict = "fits" if fits else "does NOT fit"
    ax = plot_breakdowns({model: breakdown}, gpu_memory_gb,
                         f"{breakdown.total / GB:.1f} GB per GPU: {verdict} in {gpu_memory_gb:g} GB\n"
                         f"(ZeRO-{zero_stage} on {num_gpus} GPUs, batch {batch_size} x {seq_len} tokens,\n"
                         f"attention: {ATTENTION_LABELS[attention]})")
    return ax.figure, breakdown, fits


def memory_calculator():
    """The interactive calculator (ipywidgets): every change redraws :func:`memory_figure`."""
    import ipywidgets as w
    from IPython.display import display

    from labkit.model import PRESETS

    def show(**kwargs):
        fig, breakdown, _ = memory_figure(**kwargs)
        display(fig)
        plt.close(fig)
        print(breakdown.table("GB"))

    return w.interact(
        show,
        model=w.Dropdown(options=sorted(PRESETS), value="qwen3-8b"),
        batch_size=w.IntSlider(value=1, min=1, max=64),
        seq_len=w.IntSlider(value=4096, min=256, max=4096, step=256),
        precision=w.Dropdown(options=list(PRECISIONS), value="bf16 mixed (fp32 master)"),
        optimizer=w.Dropdown(options=["adamw", "sgd_momentum", "sgd"], value="adamw"),
        checkpointing=w.Checkbox(value=False, description="activation checkpointing"),
        attention=w.Dropdown(options=[(label, key) for key, label in ATTENTION_LABELS.items()], value="materialized"),
        zero_stage=w.IntSlider(value=0, min=0, max=3),
        num_gpus=w.IntSlider(value=8, min=1, max=512),
        gpu_memory_gb=w.Dropdown(options=[24, 40, 48, 80, 141, 192], value=80),
    )


def allocator_diagram(snapshots: dict[str, list[dict]]):
    """Segments and blocks of one or more (real or simulated) ``memory_snapshot`` lists, drawn to
    scale: one row per snapshot (``label -> snapshot``), one bar per segment, allocated blocks
    dark, cached free blocks light, so reserved (the bars) vs allocated (the dark parts) shows."""
    if not snapshots:
        raise ValueError("snapshots: expected at least one label -> memory_snapshot list")
    widest = max(sum(seg["total_size"] for seg in snap) for snap in snapshots.values()) / MiB
    gap = widest / 60
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.75 * len(snapshots)))
    for row, (label, snap) in enumerate(snapshots.items()):
        y, x = -row, 0.0
        for seg in snap:
            start = x
            for block in seg["blocks"]:
                width = block["size"] / MiB
                allocated = block["state"] == "active_allocated"
                ax.add_patch(plt.Rectangle((x, y), width, 0.6, facecolor="#4c72b0" if allocated else "#d9d9d9", edgecolor="white", lw=0.8))
                if width >= widest / 25:
                    ax.text(x + width / 2, y + 0.3, f"{width:g}", ha="center", va="center", fontsize=9,
                            color="white" if allocated else "black")
                x += width
            ax.add_patch(plt.Rectangle((start, y), x - start, 0.6, fill=False, edgecolor="black", lw=1.2))
            x += gap
        reserved = sum(seg["total_size"] for seg in snap) / MiB
        allocated = sum(b["size"] for seg in snap for b in seg["blocks"] if b["state"] == "active_allocated") / MiB
        ax.text(-gap, y + 0.3, label, ha="right", va="center", fontsize=10)
        ax.text(x, y + 0.3, f" reserved {reserved:g} MiB,\n allocated {allocated:g} MiB", ha="left", va="center", fontsize=9)
    ax.set_xlim(-0.45 * widest, 1.3 * widest)
    ax.set_ylim(-len(snapshots) + 0.2, 1.0)
    ax.axis("off")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color="#4c72b0"), plt.Rectangle((0, 0), 1, 1, color="#d9d9d9")],
              labels=["allocated block (MiB)", "cached free block"], loc="upper left", fontsize=9, ncol=2, frameon=False)
    ax.set_title("caching allocator: each framed bar is one segment (one cudaMalloc), drawn to scale", fontsize=11)
    fig.tight_layout()
    return fig
