"""Triton kernels, one op per module, each with a PyTorch reference beside it.

``labkit.kernels.rmsnorm`` etc. are the ops' launcher functions. On a platform without Triton
``import labkit.kernels`` still works, ``available()`` says why the kernels cannot run, and using
one raises an ImportError that says so (notebooks then use the PyTorch reference).

``from labkit.kernels import triton, tl`` gives the chapters' exercise cells Triton itself
(``triton`` and ``triton.language``); where it is not installed, stand-ins with which a cell can
still define its ``@triton.jit`` function, so that the chapter goes on (the grader then says why it
cannot run the kernel).
"""
from __future__ import annotations

from labkit.runtime import triton_installed, triton_mode

_OPS = {
    "rmsnorm": "rmsnorm",
    "softmax": "softmax",
    "swiglu": "swiglu",
    "block_quantize": "block_scale",
    "fp8_quantize": "fp8",
    "fp8_dequantize": "fp8",
    "flash_attention": "flash_attention",
    "flash_attention_with_lse": "flash_attention",
    "quant_matmul": "quant_matmul",
    "grouped_matmul": "grouped_matmul",
}
__all__ = sorted(_OPS)

_UNAVAILABLE = "Triton is not installed on this platform (it ships Linux wheels only), so cells use the PyTorch reference"


def available() -> tuple[bool, str]:
    """``(True, mode)`` if the Triton kernels can run here, else ``(False, reason)``."""
    if not triton_installed():
        return False, _UNAVAILABLE
    return True, triton_mode()


if triton_installed():
    # Bind the functions explicitly: importing a submodule sets a package attribute of the same
    # name (labkit.kernels.rmsnorm would otherwise be the module, not the function).
    from labkit.kernels.block_scale import block_quantize  # noqa: E402
    from labkit.kernels.flash_attention import flash_attention, flash_attention_with_lse  # noqa: E402
    from labkit.kernels.fp8 import fp8_dequantize, fp8_quantize  # noqa: E402
    from labkit.kernels.grouped_matmul import grouped_matmul  # noqa: E402
    from labkit.kernels.quant_matmul import quant_matmul  # noqa: E402
    from labkit.kernels.rmsnorm import rmsnorm  # noqa: E402
    from labkit.kernels.softmax import softmax  # noqa: E402
    from labkit.kernels.swiglu import swiglu  # noqa: E402

    import triton  # noqa: E402
    import triton.language as tl  # noqa: E402
else:

    class _NoTriton:
        """``triton`` / ``triton.language`` where Triton is not installed: every attribute is another stand-in
        (annotations such as ``tl.constexpr`` resolve), ``triton.jit`` returns the function as it is, and any
        other call raises an ImportError that says why."""

        def __init__(self, name: str):
            self._name = name

        def __getattr__(self, attr: str) -> "_NoTriton":
            return _NoTriton(f"{self._name}.{attr}")

        def __call__(self, *args, **kwargs):
            if self._name == "triton.jit" and len(args) == 1 and callable(args[0]) and not kwargs:
                return args[0]
            raise ImportError(f"{self._name}: {_UNAVAILABLE}")

    triton, tl = _NoTriton("triton"), _NoTriton("triton.language")

    def __getattr__(name: str):
        if name in _OPS:
            raise ImportError(f"labkit.kernels.{name}: {_UNAVAILABLE}")
        raise AttributeError(f"module 'labkit.kernels' has no attribute {name!r}")
