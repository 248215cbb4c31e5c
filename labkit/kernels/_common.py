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
