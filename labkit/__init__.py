"""LLM Systems Lab: the code behind the chapter notebooks.

``import labkit`` first: it switches Triton to its CPU interpreter when there is no GPU,
which must happen before triton itself is imported.
"""
import os

# Idle OpenMP threads sleep instead of spinning: with two notebooks (or test workers) sharing a
# laptop's cores, spinning threads slow small-model training several-fold. Must precede torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from labkit import runtime as _runtime  # noqa: E402

_runtime.configure_triton()

from labkit.claims import about, expect  # noqa: E402
from labkit.runtime import RunPool, device, pick, seed_everything, setup  # noqa: E402
from labkit.show import show_source  # noqa: E402

__version__ = "0.1.0"
__all__ = ["RunPool", "about", "device", "expect", "pick", "seed_everything", "setup", "show_source"]


def __getattr__(name: str):
    """Import submodules on first use, so ``labkit.checks.get_batch(...)`` works after ``import labkit``."""
    import importlib
    import importlib.util

    if importlib.util.find_spec(f"labkit.{name}") is None:
        raise AttributeError(f"module 'labkit' has no attribute {name!r}")
    return importlib.import_module(f"labkit.{name}")
