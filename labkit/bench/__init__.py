"""GPU benchmarks: ``python -m labkit.bench {norms,attention}``.

Timings only mean something on a GPU; on a CPU each suite checks correctness and says so.
"""
from __future__ import annotations

import torch

# print_table is a display helper and lives in labkit.show; re-exported because the suites and
# chapter 01 import it from here.
from labkit.show import print_table  # noqa: F401 (re-export)


def gpu_available() -> bool:
    return torch.cuda.is_available()


def run_suite(on_gpu, on_cpu) -> None:
    """A suite's ``main``: the timings on a GPU; on a CPU, say why not and check correctness instead."""
    if gpu_available():
        on_gpu()
    else:
        print("No GPU: timings need a GPU (on CPU the kernels run in Triton's interpreter). Checking correctness only.")
        on_cpu()


def time_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn()`` on the GPU (``triton.testing.do_bench``)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth_gbs(num_bytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth in GB/s (bytes read + bytes written): the
    practical ceiling for memory-bound kernels."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / (ms * 1e-3) / 1e9
