"""Chapter 02 widgets: thin ipywidgets UIs around the plain (tested) callbacks in labkit.norms."""
from __future__ import annotations

import matplotlib.pyplot as plt

from labkit import norms


def norm_explorer():
    """Pick a norm and an input distribution; see the statistics along each axis before/after."""
    from ipywidgets import Dropdown, IntSlider, interact

    def show(norm, distribution, seed):
        table, _ = norms.norm_explorer_view(norm, distribution, seed)
        print(norms.format_table(table))
        plt.show()

    return interact(show, norm=Dropdown(options=norms.NORMS[1:], value="layernorm"),
                    distribution=Dropdown(options=norms.DISTRIBUTIONS, value="outlier features"),
                    seed=IntSlider(value=0, min=0, max=9))


def activation_explorer():
    """Pick an activation and the GLU's linear branch value b; see f, f' and f(a) * b."""
    from ipywidgets import Dropdown, FloatSlider, interact

    def show(name, b):
        norms.activation_explorer_view(name, b)
        plt.show()

    return interact(show, name=Dropdown(options=list(norms.activation_functions()), value="silu"),
                    b=FloatSlider(value=1.0, min=-2.0, max=2.0, step=0.1))


def deep_stack_explorer():
    """Pick a norm, the weights' gain and the activation of a 32-layer stack; see what reaches the end."""
    from ipywidgets import Dropdown, FloatLogSlider, interact

    def show(norm, gain, activation):
        norms.deep_stack_view(norm, gain, activation)
        plt.show()

    return interact(show, norm=Dropdown(options=norms.NORMS, value="none"),
                    gain=FloatLogSlider(value=1.0, base=2, min=-1, max=1.5, step=0.1),
                    activation=Dropdown(options=["relu", "gelu", "silu"], value="relu"))
