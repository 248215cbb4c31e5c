"""Input checks and layout helpers shared by the kernel launchers."""
from __future__ import annotations

import torch

from labkit.runtime import triton_mode

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_kernel_tensor(name: str, t, dtypes=SUPPORTED_DTYPES) -> None:
    """Raise TypeError/ValueError unless ``t`` is a tensor of a supported dtype on a device
    the kernels can run on (CUDA when compiled, CPU under the interpreter)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    mode = triton_mode()
    if mode == "compiled" and t.device.type != "cuda":
        raise ValueError(f"{name}: Triton compiles for the GPU here, so the tensor must be on cuda, got {t.device}")
    if mode == "interpreter" and t.device.type != "cpu":
        raise ValueError(f"{name}: Triton's interpreter runs on the CPU, so the tensor must be on cpu, got {t.device}")


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D ``[rows, last_dim]`` view whose last dim is contiguous (copying only if needed)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class InterpretedTraffic:
    """Under Triton's interpreter: the bytes that the ``tl.load``/``tl.store`` calls of every kernel launched
    inside ``with InterpretedTraffic() as traffic:`` move, lanes masked off excluded (``traffic.loaded``,
    ``traffic.stored``). What a kernel reads and writes in global memory (HBM on a GPU), counted from its own
    memory operations; raises RuntimeError where kernels are compiled (a GPU runs them, not Python)."""

    def __init__(self):
        self.loaded = self.stored = 0

    def __enter__(self):
        if triton_mode() != "interpreter":
            raise RuntimeError("InterpretedTraffic counts memory operations under Triton's interpreter only "
                               f"(Triton is {triton_mode()} here)")
        from triton.runtime import interpreter

        builder = interpreter.InterpreterBuilder
        self._originals = builder.create_masked_load, builder.create_masked_store

        def _bytes(ptrs, mask) -> int:
            return int(mask.data.sum()) * interpreter._get_np_dtype(ptrs.get_element_ty()).itemsize

        def load(builder_self, ptrs, mask, other, cache_policy, is_volatile):
            self.loaded += _bytes(ptrs, mask)
            return self._originals[0](builder_self, ptrs, mask, other, cache_policy, is_volatile)

        def store(builder_self, ptrs, value, mask, cache_policy):
            self.stored += _bytes(ptrs, mask)
            return self._originals[1](builder_self, ptrs, value, mask, cache_policy)

        builder.create_masked_load, builder.create_masked_store = load, store
        return self

    def __exit__(self, *exc):
        from triton.runtime import interpreter

        interpreter.InterpreterBuilder.create_masked_load, interpreter.InterpreterBuilder.create_masked_store = self._originals
        return False
