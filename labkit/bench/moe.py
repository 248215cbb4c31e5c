"""``python -m labkit.bench moe``: the grouped-GEMM kernel on Mixtral-8x7B's expert shapes, with balanced
and skewed routing, against a Python loop of one ``torch.matmul`` per expert (and ``torch._grouped_mm``
where this torch has it for the GPU).

A batch of ``tokens`` routed top-2 over 8 experts gives ``2 * tokens`` rows sorted by expert; the
expert up-projection multiplies them by ``[8, 14336, 4096]`` (``w1`` of every expert), the
down-projection by ``[8, 4096, 14336]``. FLOPs are ``2 * rows * N * K`` whatever the split, so
TFLOP/s compare directly; the ceiling is a dense bf16 ``torch.matmul`` of the same total size.
Balanced routing gives every expert the same rows; skewed routing gives expert ``e`` a share
proportional to ``1 / (e + 1)^1.5`` (of 8 experts, the first gets ~52%), which leaves the loop launching
some small matmuls and the kernel a longer reduction for the busiest expert's weight gradient.
On a CPU the suite checks the kernel against the loop on small ragged shapes and says that timings need a GPU.
"""
from __future__ import annotations

import torch

from labkit.bench import print_table, run_suite, time_ms
from labkit.experts import segment_matmul
from labkit.kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference

D_MODEL, D_FF, NUM_EXPERTS, TOP_K = 4096, 14336, 8, 2  # Mixtral-8x7B
TOKENS = (1024, 4096, 16384)
DTYPE = torch.bfloat16


def group_sizes(rows: int, num_experts: int, routing: str, device=None) -> torch.Tensor:
    """Rows per expert summing to ``rows``: ``"balanced"`` (equal, the remainder spread over the first
    experts) or ``"skewed"`` (proportional to ``1 / (e + 1)^1.5``)."""
    if routing == "balanced":
        weights = torch.ones(num_experts, dtype=torch.float64)
    elif routing == "skewed":
        weights = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.5
    else:
        raise ValueError(f"routing={routing!r}: expected 'balanced' or 'skewed'")
    sizes = torch.floor(weights / weights.sum() * rows).to(torch.int64)
    sizes[: rows - int(sizes.sum())] += 1
    return sizes.to(device)


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor):
    return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)


def _impls(x, weight, sizes_t):
    # the loop, one launch per expert (segment_matmul reads the sizes on the host each call, as a real layer must)
    impls = {"triton grouped": lambda: grouped_matmul(x, weight, sizes_t), "torch loop": lambda: segment_matmul(x, weight, sizes_t)}
    if hasattr(torch, "_grouped_mm"):
        offsets = torch.cumsum(sizes_t, 0).to(torch.int32)
        try:
            _grouped_mm(x, weight, offsets)
            impls["torch._grouped_mm"] = lambda: _grouped_mm(x, weight, offsets)
        except (RuntimeError, NotImplementedError) as e:  # e.g. needs a newer GPU
            print(f"(torch._grouped_mm skipped: {str(e).splitlines()[0]})")
    return impls


def run_gpu() -> list[dict]:
    print(f"{torch.cuda.get_device_name()}: Mixtral-8x7B experts (d_model {D_MODEL}, d_ff {D_FF}, {NUM_EXPERTS} experts, "
          f"top-{TOP_K}), {DTYPE}; TFLOP/s = 2*rows*N*K / time; '% dense' = of a dense matmul of the same size")
    rows_out = []
    for tokens in TOKENS:
        rows = tokens * TOP_K
        for name, (N, K) in {"up (w1)": (D_FF, D_MODEL), "down (w2)": (D_MODEL, D_FF)}.items():
            x = torch.randn(rows, K, device="cuda", dtype=DTYPE)
            weight = torch.randn(NUM_EXPERTS, N, K, device="cuda", dtype=DTYPE) * K**-0.5
            flops = 2 * rows * N * K
            dense_w = torch.randn(N, K, device="cuda", dtype=DTYPE)
            dense = flops / (time_ms(lambda: x @ dense_w.T) * 1e-3) / 1e12
            for routing in ("balanced", "skewed"):
                sizes_t = group_sizes(rows, NUM_EXPERTS, routing, "cuda")
                for impl, fn in _impls(x, weight, sizes_t).items():
                    ms = time_ms(fn)
                    tflops = flops / (ms * 1e-3) / 1e12
                    rows_out.append({"tokens": tokens, "matmul": name, "routing": routing, "impl": impl, "ms": ms,
                                     "TFLOP/s": tflops, "% dense": 100 * tflops / dense})
                xg, wg = x.clone().requires_grad_(), weight.clone().requires_grad_()
                out = grouped_matmul(xg, wg, sizes_t)
                grad = torch.randn_like(out)
                ms = time_ms(lambda: torch.autograd.grad(out, (xg, wg), grad, retain_graph=True))
                rows_out.append({"tokens": tokens, "matmul": name, "routing": routing, "impl": "triton backward (dX+dW)", "ms": ms,
                                 "TFLOP/s": 2 * flops / (ms * 1e-3) / 1e12, "% dense": 100 * 2 * flops / (ms * 1e-3) / 1e12 / dense})
    print_table(rows_out)
    return rows_out


def check_cpu() -> list[dict]:
    """Forward and backward of the kernel against autograd of the per-expert loop, on small ragged
    groups (one empty expert), balanced and skewed; and against ``torch._grouped_mm`` where it runs."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for routing in ("balanced", "skewed"):
        sizes_t = group_sizes(150, 5, routing)
        if routing == "skewed":
            sizes_t = torch.tensor([90, 0, 33, 20, 7])
        x = torch.randn(150, 72, generator=gen)
        weight = torch.randn(5, 40, 72, generator=gen)
        grad = torch.randn(150, 40, generator=gen)
        ours = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
        theirs = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
        out, expected = grouped_matmul(*ours, sizes_t), grouped_matmul_reference(*theirs, sizes_t)
        out.backward(grad)
        expected.backward(grad)
        row = {"routing": routing, "group sizes": str(sizes_t.tolist()), "forward max error": (out - expected).abs().max().item(),
               "dX max error": (ours[0].grad - theirs[0].grad).abs().max().item(),
               "dW max error": (ours[1].grad - theirs[1].grad).abs().max().item()}
        if hasattr(torch, "_grouped_mm"):
            try:
                row["vs torch._grouped_mm"] = (out - _grouped_mm(x, weight, torch.cumsum(sizes_t, 0).to(torch.int32))).abs().max().item()
            except (RuntimeError, NotImplementedError):
                row["vs torch._grouped_mm"] = float("nan")
        rows.append(row)
    print_table(rows)
    return rows


def main() -> None:
    run_suite(run_gpu, check_cpu)


if __name__ == "__main__":
    main()
