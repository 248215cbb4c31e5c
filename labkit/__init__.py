"""LLM Systems Lab: the code behind the chapter notebooks.

``import labkit`` first: it switches Triton to its CPU interpreter when there is no GPU,
which must happen before triton itself is imported.
"""
from labkit import runtime as _runtime

_runtime.configure_triton()

from labkit.runtime import device, pick, seed_everything, setup  # noqa: E402
from labkit.show import show_source  # noqa: E402

__version__ = "0.1.0"
__all__ = ["device", "pick", "seed_everything", "setup", "show_source"]
