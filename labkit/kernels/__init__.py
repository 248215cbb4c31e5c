"""Triton kernels, one op per module, each with a PyTorch reference beside it.

Names are resolved lazily, so ``import labkit.kernels`` works on machines without Triton;
using a kernel there raises an ImportError that says why (notebooks then use the reference).
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "rmsnorm": "rmsnorm",
    "softmax": "softmax",
    "swiglu": "swiglu",
    "fp8_quantize": "fp8",
    "fp8_dequantize": "fp8",
    "flash_attention": "flash_attention",
    "flash_attention_with_lse": "flash_attention",
}
__all__ = sorted(_EXPORTS)


def available() -> tuple[bool, str]:
    """``(True, mode)`` if the Triton kernels can run here, else ``(False, reason)``."""
    from labkit.runtime import triton_installed, triton_mode

    if not triton_installed():
        return False, "Triton is not installed on this platform (it ships Linux wheels only), so cells use the PyTorch reference"
    return True, triton_mode()


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'labkit.kernels' has no attribute {name!r}")
    ok, reason = available()
    if not ok:
        raise ImportError(f"labkit.kernels.{name}: {reason}")
    return getattr(importlib.import_module(f"labkit.kernels.{_EXPORTS[name]}"), name)
