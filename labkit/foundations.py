"""Chapter 00: what a tensor is in memory, and why initialization scale matters."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from labkit.nn import ACTIVATIONS


def tensor_layout(t: torch.Tensor, base: torch.Tensor | None = None) -> dict:
    """How ``t`` sits in memory: shape, strides (elements to skip per index step), storage
    offset, contiguity, bytes of the storage it views, and whether it shares that storage
    with ``base`` (a view) or owns a separate one (a copy)."""
    layout = {
        "shape": tuple(t.shape),
        "stride": t.stride(),
        "offset": t.storage_offset(),
        "contiguous": t.is_contiguous(),
        "storage_bytes": t.untyped_storage().nbytes(),
    }
    if base is not None:
        layout["shares_storage"] = t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    return layout


def element_address(t: torch.Tensor, index: tuple[int, ...]) -> int:
    """Position in the underlying storage of ``t[index]``: ``offset + sum(i * stride)``."""
    if len(index) != t.dim():
        raise ValueError(f"index: expected {t.dim()} indices for a tensor of shape {tuple(t.shape)}, got {len(index)}")
    for i, (k, n) in enumerate(zip(index, t.shape)):
        if not 0 <= k < n:
            raise ValueError(f"index: index[{i}]={k} out of range for size {n}")
    return t.storage_offset() + sum(k * s for k, s in zip(index, t.stride()))


INIT_ACTIVATIONS = {"linear": lambda x: x, "tanh": torch.tanh, **ACTIVATIONS}


def second_moment_gain(activation: str, points: int = 101) -> float:
    """The weight scale ``s`` that keeps a layer's mean square at 1: with unit-Gaussian pre-activations ``z``,
    ``s = 1 / sqrt(E[f(z)^2])`` (He et al.'s argument, which gives sqrt(2) for ReLU), the expectation taken by
    Gauss-Hermite quadrature with ``points`` nodes (exact for polynomials of degree < 2 * points)."""
    if activation not in INIT_ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {sorted(INIT_ACTIVATIONS)}")
    nodes, weights = np.polynomial.hermite_e.hermegauss(points)  # weight exp(-z^2 / 2)
    values = INIT_ACTIVATIONS[activation](torch.from_numpy(nodes)).numpy()
    return float(1 / np.sqrt((weights * values**2).sum() / weights.sum()))


def recommended_gain(activation: str) -> tuple[float, str]:
    """``(gain, source)``: ``torch.nn.init.calculate_gain`` where PyTorch defines a gain for ``activation``
    (linear 1, ReLU sqrt(2), tanh 5/3, sigmoid 1), otherwise the :func:`second_moment_gain` (SiLU, GELU)."""
    if activation not in INIT_ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {sorted(INIT_ACTIVATIONS)}")
    if activation in ("linear", "relu", "tanh", "sigmoid"):
        return torch.nn.init.calculate_gain(activation), "torch.nn.init.calculate_gain"
    return second_moment_gain(activation), "second-moment gain"


@dataclass
class InitStatistics:
    """Per-layer root-mean-square of activations (forward) and of their gradients (backward)."""

    scale: float
    activation: str
    activation_rms: list[float]
    gradient_rms: list[float]


def init_statistics(scale: float, depth: int = 32, width: int = 256, activation: str = "tanh", batch: int = 512, seed: int = 0) -> InitStatistics:
    """Push a random batch through ``depth`` linear layers whose weights are drawn from
    ``N(0, scale^2 / width)`` (``scale = 1`` is LeCun init; ``sqrt(2)`` is He init, made for ReLU),
    each followed by ``activation`` (or none: ``"linear"``), and record the root-mean-square of every
    layer's output and of the gradient that flows back into it.

    For a linear stack each layer multiplies the RMS by ``scale``, so it grows or shrinks
    like ``scale ** depth``: the reason initialization scale matters.
    """
    if not scale > 0:
        raise ValueError(f"scale={scale}: expected a positive number")
    if activation not in INIT_ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {sorted(INIT_ACTIVATIONS)}")
    act = INIT_ACTIVATIONS[activation]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, width, generator=gen, requires_grad=True)
    outputs = []
    h = x
    for _ in range(depth):
        w = torch.randn(width, width, generator=gen) * (scale / math.sqrt(width))
        h = act(h @ w.T)
        h.retain_grad()
        outputs.append(h)
    # a loss whose gradient w.r.t. the last layer is unit-variance noise
    (h * torch.randn(h.shape, generator=gen)).sum().backward()
    return InitStatistics(
        scale=scale,
        activation=activation,
        activation_rms=[o.pow(2).mean().sqrt().item() for o in outputs],
        gradient_rms=[o.grad.pow(2).mean().sqrt().item() for o in outputs],
    )
