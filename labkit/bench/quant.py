"""``python -m labkit.bench quant``: the weight-only quantized matmul kernels (int4, NF4, int8) against
a bf16 ``torch.matmul`` on the decode shapes of an 8B-parameter model.

Decoding multiplies a few activation rows by every weight matrix, so the time goes into reading
the weights: the useful number is the weight bytes read (codes + scales) divided by time, as a
fraction of the device's measured copy bandwidth. A 4-bit weight is a quarter of the bf16 bytes,
so at the same bandwidth it is up to ~4x faster. On a CPU the suite checks the kernels against
their reference on small shapes and says that timings need a GPU.
"""
from __future__ import annotations

import torch

from labkit.bench import copy_bandwidth_gbs, print_table, run_suite, time_ms
from labkit.kernels.quant_matmul import quant_matmul, quant_matmul_reference
from labkit.quant import nf4_codebook

# (N, K) = (output features, input features): Llama-style attention projection, MLP up, MLP down
SHAPES = ((4096, 4096), (12288, 4096), (4096, 12288))
BATCHES = (1, 8, 32)
# the formats as they are usually shipped: GPTQ-style int4 in groups of 128, QLoRA's NF4 in blocks
# of 64, LLM.int8()-style int8 weights with one scale per output row; fp16 scales throughout
GROUP_SIZES = {"int4": 128, "nf4": 64, "int8": None}


def random_weight(fmt: str, N: int, K: int, device) -> dict:
    """Keyword operands of ``quant_matmul`` for a random ``[N, K]`` weight in ``fmt`` (random codes:
    the speed does not depend on their values)."""
    group_size = GROUP_SIZES[fmt] or K
    if fmt == "int8":
        qweight = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=device)
    else:
        qweight = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=device)
    scales = (torch.rand(N, -(-K // group_size), device=device) * 0.02 + 0.005).to(torch.float16)
    return dict(qweight=qweight, scales=scales, fmt=fmt, group_size=group_size,
                codebook=nf4_codebook().to(device) if fmt == "nf4" else None)


def weight_bytes(operands: dict) -> int:
    """Bytes the kernel must read for the weight: codes, scales (and zero points)."""
    tensors = [operands["qweight"], operands["scales"], operands.get("zeros")]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def run_gpu() -> list[dict]:
    ceiling = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: measured copy bandwidth {ceiling:.0f} GB/s; x is [batch, K] bf16; "
          "GB/s = weight bytes read / time; 'x bf16' = speed-up over the bf16 matmul")
    rows = []
    for N, K in SHAPES:
        bf16_weight = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        weights = {fmt: random_weight(fmt, N, K, "cuda") for fmt in GROUP_SIZES}
        for batch in BATCHES:
            x = torch.randn(batch, K, device="cuda", dtype=torch.bfloat16)
            bf16_ms = time_ms(lambda: torch.matmul(x, bf16_weight.T))
            cases = [("bf16 matmul", bf16_ms, bf16_weight.numel() * bf16_weight.element_size(), 0.0)]
            for fmt, operands in weights.items():
                error = relative_error(quant_matmul(x, **operands), quant_matmul_reference(x, **operands))
                cases.append((fmt, time_ms(lambda: quant_matmul(x, **operands)), weight_bytes(operands), error))
            for impl, ms, nbytes, error in cases:
                gbs = nbytes / ms / 1e6
                rows.append({"N x K": f"{N}x{K}", "batch": batch, "impl": impl, "ms": ms, "weight MB": nbytes / 1e6,
                             "GB/s": gbs, "% copy": 100 * gbs / ceiling, "x bf16": bf16_ms / ms, "rel err": error})
    print_table(rows)
    return rows


def relative_error(y: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |y - expected| / max |expected|``: errors in units of the output's scale."""
    return ((y.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def check_correctness(device, N: int = 96, K: int = 256) -> list[dict]:
    """Each format against its reference on a small shape, for one row (GEMV) and five (tiled)."""
    rows = []
    for fmt in GROUP_SIZES:
        operands = random_weight(fmt, N, K, device)
        error = 0.0
        for batch in (1, 5):
            x = torch.randn(batch, K, device=device)
            error = max(error, relative_error(quant_matmul(x, **operands), quant_matmul_reference(x, **operands)))
        rows.append({"format": fmt, "N": N, "K": K, "weight bytes": weight_bytes(operands), "max rel error": error})
    return rows


def main() -> None:
    run_suite(run_gpu, lambda: print_table(check_correctness("cpu")))


if __name__ == "__main__":
    main()
