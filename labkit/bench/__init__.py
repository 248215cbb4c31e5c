"""GPU benchmarks: ``python -m labkit.bench {norms,attention}``.

Timings only mean something on a GPU; on a CPU each suite checks correctness and says so.
"""
from __future__ import annotations

import torch


def gpu_available() -> bool:
    return torch.cuda.is_available()


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


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.rjust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(_fmt(r[c]).rjust(widths[c]) for c in cols))


def _fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
