"""Chapter 08's 3-D layout calculator: a model, a cluster and a few training choices -> every
TP × PP × CP × DP layout's (× EP for mixture-of-experts models) memory per GPU (stacked bars, the GPU's memory as a line) and its
communication, fastest fitting layouts first. The widget only wires controls to
:func:`layout_explorer`, a plain function."""
from __future__ import annotations

import matplotlib.pyplot as plt

from labkit.parallel_plan import GPU_MEMORY_GB, INTERCONNECTS, PLAN_PRESETS, parallel_plan
from labkit.show import print_table
from labkit.widgets.memory import plot_breakdowns

GB = 1e9


def layout_explorer(model: str = "llama3-70b", gpus: int = 64, gpu: str = "H100 SXM (80 GB)", interconnect: str = "nvlink+ib",
                    seq_len: int = 8192, tokens_per_step_m: int = 4, checkpointing: bool = True, zero_stage: int = 1,
                    cp: int = 1, shown: int = 6):
    """Plan ``model`` on ``gpus`` GPUs and draw the ``shown`` best layouts' memory per GPU.
    Returns ``(figure, plans)`` (all layouts, fitting ones first, each group by estimated step
    time; see :func:`labkit.parallel_plan.parallel_plan`). ``tokens_per_step_m``: millions
    (2^20) of tokens per optimizer step."""
    if model not in PLAN_PRESETS:
        raise ValueError(f"model={model!r}: expected one of {sorted(PLAN_PRESETS)}")
    if gpu not in GPU_MEMORY_GB:
        raise ValueError(f"gpu={gpu!r}: expected one of {sorted(GPU_MEMORY_GB)}")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1 or gpus & (gpus - 1):
        raise ValueError(f"gpus={gpus!r}: expected a power of two")
    if isinstance(shown, bool) or not isinstance(shown, int) or shown < 1:
        raise ValueError(f"shown={shown!r}: expected a positive integer")
    plans = parallel_plan(model, gpus, GPU_MEMORY_GB[gpu], interconnect, seq_len=seq_len, tokens_per_step=tokens_per_step_m * 2**20,
                          cp=(cp,), activation_checkpointing=checkpointing, zero_stage=zero_stage)
    if not plans:
        raise ValueError(f"no layout of {gpus} GPUs gives a whole number of micro-batches for {tokens_per_step_m}M tokens of "
                         f"{seq_len}-token sequences: change gpus, seq_len or tokens_per_step_m")
    best = plans[:shown]
    ax = plot_breakdowns({f"{p.layout.replace(' x ', chr(10))}": p.memory for p in best}, GPU_MEMORY_GB[gpu],
                         f"{model} on {gpus} x {gpu}: {sum(p.fits for p in plans)} of {len(plans)} layouts fit "
                         f"(best {len(best)} shown, worst stage)")
    ax.tick_params(axis="x", labelsize=7)
    return ax.figure, plans


def layout_calculator():
    """The interactive calculator (ipywidgets): every change re-plans and redraws."""
    import ipywidgets as w
    from IPython.display import display

    def show(**kwargs):
        fig, plans = layout_explorer(**kwargs)
        display(fig)
        plt.close(fig)
        print_table([p.row() for p in plans[:10]])

    return w.interact(
        show,
        model=w.Dropdown(options=sorted(PLAN_PRESETS), value="llama3-70b"),
        gpus=w.Dropdown(options=[2**i for i in range(3, 15)], value=64),
        gpu=w.Dropdown(options=sorted(GPU_MEMORY_GB), value="H100 SXM (80 GB)"),
        interconnect=w.Dropdown(options=sorted(INTERCONNECTS), value="nvlink+ib"),
        seq_len=w.Dropdown(options=[2048, 4096, 8192, 32768, 131072], value=8192),
        tokens_per_step_m=w.Dropdown(options=[1, 2, 4, 8, 16], value=4),
        checkpointing=w.Checkbox(value=True, description="activation checkpointing"),
        zero_stage=w.IntSlider(value=1, min=0, max=3),
        cp=w.Dropdown(options=[1, 2, 4, 8, 16], value=1),
        shown=w.IntSlider(value=6, min=1, max=12),
    )
