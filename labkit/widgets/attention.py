"""Chapter 03 widgets: an attention explorer and a KV-cache calculator.

Each widget is a thin ``ipywidgets.interact`` over a plain function that the tests call
directly (:func:`show_attention`, :func:`kv_calculator_report`).
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import torch

from labkit.attention import DTYPE_BYTES, attention_explorer, kv_calculator
from labkit.model import PRESETS, ModelConfig
from labkit.widgets import drawn

GPU_SIZES_GB = {"24 GB (RTX 4090)": 24, "40 GB (A100 40GB)": 40, "80 GB (H100)": 80, "141 GB (H200)": 141}
ATTENTION_CHOICES = ("as published", "mha", "gqa", "mqa", "mla")
# widget menus of today's cache options (labkit.attention_variants); 0 switches an option off
KV_LATENT_CHOICES = (128, 256, 512, 1024)  # DeepSeek-V2/V3 cache a 512-element latent
WINDOW_CHOICES = {"off": 0, "1024 (Gemma 3 local layers)": 1024, "4096 (Mistral 7B v0.1, Gemma 2 local layers)": 4096, "8192": 8192}
BLOCK_CHOICES = {"contiguous": 0, "16 (vLLM default)": 16, "32": 32, "128": 128}


def plot_attention(weights: torch.Tensor, labels: list[str], ax=None, title: str | None = None):
    """Heatmap of attention probabilities: rows are queries, columns keys, labelled by token."""
    if weights.dim() != 2 or weights.shape != (len(labels), len(labels)):
        raise ValueError(f"weights: expected [{len(labels)}, {len(labels)}] for {len(labels)} labels, got {tuple(weights.shape)}")
    if ax is None:
        _, ax = plt.subplots(figsize=(3.2 + 0.25 * len(labels), 2.8 + 0.25 * len(labels)))
    image = ax.imshow(weights.detach().float().cpu().numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query")
    if title:
        ax.set_title(title)
    ax.figure.colorbar(image, ax=ax, fraction=0.046)
    return ax


def show_attention(model, tokenizer, prompt: str, layer: int = 0, head: int = 0, causal: bool = True):
    """Callback of the explorer: plot one head's attention on ``prompt``; returns the weights."""
    weights, labels = attention_explorer(model, tokenizer, prompt, layer, head, causal)
    plot_attention(weights, labels, title=f"layer {layer}, head {head}" + ("" if causal else " (mask off)"))
    plt.show()
    return weights


def attention_explorer_widget(model, tokenizer, prompt: str):
    """Sliders for layer and head, a causal switch and a prompt box over :func:`show_attention`."""
    import ipywidgets as widgets

    return widgets.interact(
        drawn(lambda prompt, layer, head, causal: show_attention(model, tokenizer, prompt, layer, head, causal)),
        prompt=widgets.Text(value=prompt, description="prompt"),
        layer=widgets.IntSlider(0, 0, len(model.layers) - 1, description="layer"),
        head=widgets.IntSlider(0, 0, model.config.num_heads - 1, description="head"),
        causal=widgets.Checkbox(value=True, description="causal mask"),
    )


def kv_calculator_report(
    preset: str = "qwen3-8b",
    attention: str = "as published",
    batch_size: int = 1,
    seq_len: int = 32768,
    kv_dtype: str = "bf16",
    gpu_gb: float = 80.0,
    num_layers: int = 32,
    d_model: int = 4096,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    d_ff: int = 14336,
    vocab_size: int = 128256,
    kv_latent_dim: int = 512,
    rope_head_dim: int = 64,
    sliding_window: int = 0,
    block_size: int = 0,
) -> str:
    """Callback of the KV-cache calculator: the text it shows. ``preset="custom"`` builds the
    architecture from the remaining fields; an impossible one is reported, not raised.
    ``kv_latent_dim`` and ``rope_head_dim`` apply with ``attention="mla"``; ``sliding_window`` and
    ``block_size`` of 0 mean no window and a contiguous cache."""
    try:
        if preset == "custom":
            config = ModelConfig(vocab_size=vocab_size, context_length=max(seq_len, 1), d_model=d_model, num_layers=num_layers,
                                 num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, d_ff=d_ff)
        else:
            config = preset
        estimate = kv_calculator(config, attention, batch_size, seq_len, kv_dtype, "bf16", gpu_gb,
                                 kv_latent_dim=kv_latent_dim if attention == "mla" else None, rope_head_dim=rope_head_dim,
                                 sliding_window=sliding_window or None, block_size=block_size or None)
    except (ValueError, TypeError) as err:
        return f"cannot size this model: {err}"
    header = f"{preset}, {attention} attention, batch {batch_size} x {seq_len} tokens, KV cache in {kv_dtype}, weights in bf16"
    return header + "\n" + estimate.summary()


def kv_calculator_widget():
    """Dropdowns and sliders over :func:`kv_calculator_report` (the custom fields apply when
    the preset is "custom", the MLA ones when the attention is "mla")."""
    import ipywidgets as widgets

    def show(**kwargs):
        print(kv_calculator_report(**kwargs))

    int_box = dict(style={"description_width": "initial"})
    return widgets.interact(
        show,
        preset=widgets.Dropdown(options=[*PRESETS, "custom"], value="qwen3-8b", description="model"),
        attention=widgets.Dropdown(options=ATTENTION_CHOICES, value="as published", description="attention"),
        batch_size=widgets.IntSlider(1, 1, 256, description="batch"),
        seq_len=widgets.SelectionSlider(options=[2**i for i in range(9, 18)], value=32768, description="context"),
        kv_dtype=widgets.Dropdown(options=list(DTYPE_BYTES), value="bf16", description="KV dtype"),
        gpu_gb=widgets.Dropdown(options=GPU_SIZES_GB, value=80, description="GPU"),
        num_layers=widgets.BoundedIntText(32, min=1, max=200, description="custom layers", **int_box),
        d_model=widgets.BoundedIntText(4096, min=64, max=32768, step=64, description="d_model", **int_box),
        num_heads=widgets.BoundedIntText(32, min=1, max=256, description="query heads", **int_box),
        num_kv_heads=widgets.BoundedIntText(8, min=1, max=256, description="KV heads", **int_box),
        head_dim=widgets.BoundedIntText(128, min=8, max=512, description="head dim", **int_box),
        d_ff=widgets.BoundedIntText(14336, min=64, max=131072, description="d_ff", **int_box),
        vocab_size=widgets.BoundedIntText(128256, min=2, max=1_000_000, description="vocab", **int_box),
        kv_latent_dim=widgets.Dropdown(options=KV_LATENT_CHOICES, value=512, description="MLA latent", **int_box),
        rope_head_dim=widgets.Dropdown(options=(32, 64, 128), value=64, description="MLA RoPE key", **int_box),
        sliding_window=widgets.Dropdown(options=WINDOW_CHOICES, value=0, description="sliding window", **int_box),
        block_size=widgets.Dropdown(options=BLOCK_CHOICES, value=0, description="paged blocks", **int_box),
    )
