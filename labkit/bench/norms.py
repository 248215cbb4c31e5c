"""``python -m labkit.bench norms``: GB/s of the RMSNorm, softmax and SwiGLU kernels against
PyTorch eager and ``torch.compile``, as a fraction of the device's measured copy bandwidth.

The ops are memory-bound, so the useful number is bytes that *must* move (inputs read once,
outputs written once) divided by time. On a CPU the suite checks the kernels' correctness and
says that timings need a GPU.
"""
from __future__ import annotations

import torch

from labkit.bench import copy_bandwidth_gbs, print_table, run_suite, time_ms
from labkit.kernels.rmsnorm import rmsnorm, rmsnorm_reference
from labkit.kernels.softmax import softmax
from labkit.kernels.swiglu import swiglu, swiglu_reference

ROWS = 4096
HIDDEN_SIZES = (1024, 2048, 4096, 8192, 16384)
DTYPE = torch.bfloat16


def _eager_swiglu(a, b):
    return torch.nn.functional.silu(a) * b


def _cases(n_cols: int, device):
    """``name -> (inputs, {impl: fn}, minimum forward bytes, minimum backward bytes)``."""
    es = DTYPE.itemsize
    x = torch.randn(ROWS, n_cols, device=device, dtype=DTYPE)
    weight = torch.rand(n_cols, device=device, dtype=DTYPE) + 0.5
    a, b = torch.randn_like(x), torch.randn_like(x)
    tensor = ROWS * n_cols * es
    return {
        "rmsnorm": ((x, weight), {"triton": rmsnorm, "eager": rmsnorm_reference, "compile": torch.compile(rmsnorm_reference)},
                    2 * tensor + n_cols * es, 3 * tensor + 2 * n_cols * es),
        "softmax": ((x,), {"triton": softmax, "eager": lambda t: torch.softmax(t, -1), "compile": torch.compile(lambda t: torch.softmax(t, -1))},
                    2 * tensor, 3 * tensor),
        "swiglu": ((a, b), {"triton": swiglu, "eager": _eager_swiglu, "compile": torch.compile(_eager_swiglu)},
                   3 * tensor, 5 * tensor),
    }


def _forward_backward_ms(fn, inputs) -> tuple[float, float]:
    leaves = [t.detach().requires_grad_() for t in inputs]
    forward = time_ms(lambda: fn(*inputs))
    out = fn(*leaves)
    grad = torch.randn_like(out)
    backward = time_ms(lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True))
    return forward, backward


def run_gpu() -> list[dict]:
    ceiling = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: measured copy bandwidth {ceiling:.0f} GB/s; "
          f"x is [{ROWS}, hidden] {DTYPE}; GB/s = minimum bytes / time")
    rows = []
    for n_cols in HIDDEN_SIZES:
        for op, (inputs, impls, fwd_bytes, bwd_bytes) in _cases(n_cols, "cuda").items():
            for impl, fn in impls.items():
                fwd_ms, bwd_ms = _forward_backward_ms(fn, inputs)
                fwd_gbs, bwd_gbs = fwd_bytes / fwd_ms / 1e6, bwd_bytes / bwd_ms / 1e6
                rows.append({"op": op, "hidden": n_cols, "impl": impl, "fwd ms": fwd_ms, "fwd GB/s": fwd_gbs,
                             "fwd % copy": 100 * fwd_gbs / ceiling, "bwd ms": bwd_ms, "bwd GB/s": bwd_gbs,
                             "bwd % copy": 100 * bwd_gbs / ceiling})
    print_table(rows)
    return rows


def check_cpu() -> list[dict]:
    """Correctness of each kernel against its reference and autograd on a small ragged size."""
    rows = []
    x = torch.randn(3, 1000) * 2 + 0.5
    weight = torch.rand(1000) + 0.5
    b = torch.randn(3, 1000)
    for op, fn, ref, inputs in [("rmsnorm", rmsnorm, rmsnorm_reference, (x, weight)), ("softmax", softmax, lambda t: torch.softmax(t, -1), (x,)),
                                ("swiglu", swiglu, swiglu_reference, (x, b))]:
        ours = [t.clone().requires_grad_() for t in inputs]
        theirs = [t.clone().requires_grad_() for t in inputs]
        out, expected = fn(*ours), ref(*theirs)
        grad = torch.randn_like(out)
        out.backward(grad)
        expected.backward(grad)
        grad_error = max((o.grad - t.grad).abs().max().item() for o, t in zip(ours, theirs))
        rows.append({"op": op, "forward max error": (out - expected).abs().max().item(), "backward max error": grad_error})
    print_table(rows)
    return rows


def main() -> None:
    run_suite(run_gpu, check_cpu)


if __name__ == "__main__":
    main()
