"""``python -m labkit.bench all [--json OUT] [--markdown PATH] [--dry-run]``: every kernel against its baselines,
after the device's measured ceilings, with the course's performance targets marked pass or miss.

On a GPU: the measured copy bandwidth (a 1 GiB device-to-device copy) and dense bf16 / fp8 matmul rates at 8192³
first, then each kernel's time, GB/s or TFLOP/s and share of its ceiling, beside PyTorch eager, ``torch.compile``
and ``F.scaled_dot_product_attention`` where they apply; the JSON holds every row, the Markdown is
``docs/benchmarks.md`` (device, driver, torch, Triton, date). Without a GPU (or with ``--dry-run``) the same code
runs on tiny shapes under Triton's interpreter, checks each kernel against its reference, and writes both files
with every number marked as a dry run: that keeps this path tested in CI, so it works when a GPU is lent.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from labkit.bench import attention as attention_suite
from labkit.bench import moe as moe_suite
from labkit.bench import norms as norms_suite
from labkit.bench import quant as quant_suite


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shapes one run uses: the GPU's, or the dry run's tiny ones (the interpreter costs per program)."""

    copy_bytes: int
    matmul: int
    norm_rows: int
    norm_cols: int
    attention: tuple[int, int, int, int, int]  # batch, heads, kv_heads, seq, head_dim
    decode_keys: int
    gemv: tuple[int, int]  # N, K
    experts: tuple[int, int, int, int]  # tokens, num_experts, N, K
    dtype: torch.dtype


GPU_SIZES = Sizes(1 << 30, 8192, 4096, 8192, (4, 16, 4, 4096, 128), 8192, (4096, 4096), (8192, 8, 4096, 4096),
                  torch.bfloat16)
DRY_SIZES = Sizes(1 << 22, 128, 8, 256, (1, 2, 1, 64, 16), 64, (64, 128), (64, 4, 32, 64), torch.float32)


class Bench:
    """Times callables on the device (``triton.testing.do_bench`` on a GPU; on the CPU a median of a few calls,
    which says nothing about speed and is labelled so) and collects the rows."""

    def __init__(self, device: str, dry_run: bool):
        self.device, self.dry_run = device, dry_run
        self.sizes = DRY_SIZES if dry_run else GPU_SIZES
        self.rows: list[dict] = []
        self.ceilings: dict[str, float | None] = {}
        self.skipped: list[dict] = []

    def ms(self, fn: Callable[[], object]) -> float:
        if self.device == "cuda":
            from labkit.bench import time_ms

            return time_ms(fn)
        fn()
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    def skip(self, what: str, why: str) -> None:
        self.skipped.append({"what": what, "why": why})

    def add(self, suite: str, case: str, impl: str, ms: float, metric: str, amount: float, ceiling: str | None,
            error: float | None = None) -> dict:
        """One row: ``amount`` is bytes (metric GB/s) or FLOPs (TFLOP/s) the op must move or do."""
        value = amount / (ms * 1e-3) / (1e9 if metric == "GB/s" else 1e12)
        top = self.ceilings.get(ceiling) if ceiling else None
        row = {"suite": suite, "case": case, "impl": impl, "ms": ms, "metric": metric, "value": value,
               "share_of_ceiling": value / top if top else None, "ceiling": ceiling, "max_error": error}
        self.rows.append(row)
        return row

    def find(self, suite: str, case: str, impl: str) -> dict | None:
        return next((r for r in self.rows if (r["suite"], r["case"], r["impl"]) == (suite, case, impl)), None)


# ----------------------------------------------------------------------------- the ceilings
def measure_ceilings(bench: Bench) -> None:
    s, dev = bench.sizes, bench.device
    src = torch.empty(s.copy_bytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    bench.ceilings["copy GB/s"] = 2 * s.copy_bytes / (bench.ms(lambda: dst.copy_(src)) * 1e-3) / 1e9
    a = torch.randn(s.matmul, s.matmul, device=dev, dtype=s.dtype)
    b = torch.randn(s.matmul, s.matmul, device=dev, dtype=s.dtype)
    bench.ceilings["dense TFLOP/s"] = 2 * s.matmul ** 3 / (bench.ms(lambda: a @ b) * 1e-3) / 1e12
    bench.ceilings["fp8 TFLOP/s"] = None
    if dev != "cuda":
        bench.skip("fp8 matmul ceiling", "torch._scaled_mm's fp8 rate is a tensor-core figure: it needs a GPU")
        return
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=dev)
        ms = bench.ms(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        bench.ceilings["fp8 TFLOP/s"] = 2 * s.matmul ** 3 / (ms * 1e-3) / 1e12
    except (RuntimeError, TypeError) as err:  # an older GPU or torch without fp8 matmuls
        bench.skip("fp8 matmul ceiling", str(err).splitlines()[0])


# ----------------------------------------------------------------------------- the kernels
def _max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got.float() - expected.float()).abs().max().item()


def bench_norms(bench: Bench) -> None:
    from labkit.kernels.rmsnorm import rmsnorm, rmsnorm_reference
    from labkit.kernels.softmax import softmax
    from labkit.kernels.swiglu import swiglu, swiglu_reference

    s, dev = bench.sizes, bench.device
    x = torch.randn(s.norm_rows, s.norm_cols, device=dev, dtype=s.dtype)
    weight = torch.rand(s.norm_cols, device=dev, dtype=s.dtype) + 0.5
    gate = torch.randn_like(x)
    tensor = x.numel() * x.element_size()
    eager_softmax = lambda t: torch.softmax(t, -1)  # noqa: E731
    # name: (inputs, kernel, PyTorch eager (timed), fp32 reference (for the error), bytes that must move)
    cases = {"rmsnorm": ((x, weight), rmsnorm, rmsnorm_reference, rmsnorm_reference, 2 * tensor + weight.numel() * weight.element_size()),
             "softmax": ((x,), softmax, eager_softmax, eager_softmax, 2 * tensor),
             "swiglu": ((x, gate), swiglu, norms_suite._eager_swiglu, swiglu_reference, 3 * tensor)}
    shape = f"[{s.norm_rows}, {s.norm_cols}] {str(s.dtype).removeprefix('torch.')}"
    for op, (inputs, kernel, eager, reference, nbytes) in cases.items():
        error = _max_error(kernel(*inputs), reference(*inputs))
        impls = {"triton": kernel, "eager": eager}
        if dev == "cuda":
            impls["torch.compile"] = torch.compile(eager)
        for impl, fn in impls.items():
            bench.add("norms", f"{op} forward {shape}", impl, bench.ms(lambda: fn(*inputs)), "GB/s", nbytes, "copy GB/s",
                      error if impl == "triton" else None)
    if dev != "cuda":
        bench.skip("torch.compile baselines", "compiled on the CPU they measure inductor's C++ code, not what the "
                                              "GPU run compares against")


def bench_attention(bench: Bench) -> None:
    from labkit.kernels.flash_attention import attention_reference, flash_attention

    s, dev = bench.sizes, bench.device
    batch, heads, kv_heads, seq, head_dim = s.attention
    gen = torch.Generator().manual_seed(0)

    def tensors(num_q, num_k, kv):
        q = torch.randn(batch, heads, num_q, head_dim, generator=gen).to(dev, s.dtype)
        k = torch.randn(batch, kv, num_k, head_dim, generator=gen).to(dev, s.dtype)
        v = torch.randn(batch, kv, num_k, head_dim, generator=gen).to(dev, s.dtype)
        return q, k, v

    def sdpa(q, k, v, causal):
        group = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                              is_causal=causal and q.shape[2] == k.shape[2])

    for label, num_q, kv, causal in (("MHA causal", seq, heads, True), ("GQA causal", seq, kv_heads, True),
                                     ("GQA non-causal", seq, kv_heads, False), ("decode GQA", 1, kv_heads, False)):
        num_k = s.decode_keys if num_q == 1 else seq
        q, k, v = tensors(num_q, num_k, kv)
        case = f"{label} b{batch} h{heads}/{kv} q{num_q} k{num_k} d{head_dim}"
        error = _max_error(flash_attention(q, k, v, causal=causal), attention_reference(q, k, v, causal=causal)[0])
        flops = attention_suite.attention_flops(batch, heads, num_q, num_k, head_dim, causal)
        for impl, fn in (("triton", lambda: flash_attention(q, k, v, causal=causal)), ("sdpa", lambda: sdpa(q, k, v, causal))):
            bench.add("attention", f"forward {case}", impl, bench.ms(fn), "TFLOP/s", flops, "dense TFLOP/s",
                      error if impl == "triton" else None)
        if num_q > 1:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            grad = torch.randn_like(q)

            def forward_backward(attend):
                out = attend(*leaves)
                torch.autograd.grad(out, leaves, grad)

            ours = torch.autograd.grad(flash_attention(*leaves, causal=causal), leaves, grad)
            exact = [t.detach().float().requires_grad_() for t in leaves]
            expected = torch.autograd.grad(attention_reference(*exact, causal=causal)[0], exact, grad.float())
            grad_error = max(_max_error(a, b) for a, b in zip(ours, expected))
            both = attention_suite.attention_flops(batch, heads, num_q, num_k, head_dim, causal, backward=True)
            for impl, attend in (("triton", lambda a, b, c: flash_attention(a, b, c, causal=causal)),
                                 ("sdpa", lambda a, b, c: sdpa(a, b, c, causal))):
                bench.add("attention", f"forward+backward {case}", impl, bench.ms(lambda: forward_backward(attend)),
                          "TFLOP/s", both, "dense TFLOP/s", grad_error if impl == "triton" else None)


def bench_quant(bench: Bench) -> None:
    from labkit.kernels.quant_matmul import quant_matmul, quant_matmul_reference

    s, dev = bench.sizes, bench.device
    n, k = s.gemv
    x = torch.randn(1, k, device=dev, dtype=s.dtype)
    dense = torch.randn(n, k, device=dev, dtype=s.dtype) * 0.02
    case = f"GEMV batch 1, [{n}, {k}] weight"
    bench.add("quant", case, "bf16 matmul" if dev == "cuda" else "fp32 matmul", bench.ms(lambda: x @ dense.T), "GB/s",
              dense.numel() * dense.element_size(), "copy GB/s")
    for fmt in quant_suite.GROUP_SIZES:
        operands = quant_suite.random_weight(fmt, n, k, dev)
        error = quant_suite.relative_error(quant_matmul(x, **operands), quant_matmul_reference(x, **operands))
        bench.add("quant", case, fmt, bench.ms(lambda: quant_matmul(x, **operands)), "GB/s",
                  quant_suite.weight_bytes(operands), "copy GB/s", error)


def bench_quantize(bench: Bench) -> None:
    from labkit.block_formats import quantize_blocks
    from labkit.kernels.block_scale import block_quantize
    from labkit.kernels.fp8 import fp8_quantize, fp8_quantize_reference

    s, dev = bench.sizes, bench.device
    x = torch.randn(s.norm_rows, s.norm_cols, device=dev, dtype=s.dtype)
    read, codes = x.numel() * x.element_size(), x.numel()
    shape = f"[{s.norm_rows}, {s.norm_cols}]"
    error = _max_error(fp8_quantize(x)[0].float(), fp8_quantize_reference(x)[0].float())
    bench.add("quantize", f"fp8 e4m3, per tensor {shape}", "triton", bench.ms(lambda: fp8_quantize(x)), "GB/s",
              read + codes, "copy GB/s", error)
    mx, _, _ = block_quantize(x, "fp8_e4m3", (1, 32), "e8m0")
    codes_differing = float((mx.cpu() != quantize_blocks(x.cpu(), "mxfp8_e4m3").codes).sum())  # 0: bit for bit
    bench.add("quantize", f"MXFP8 (1x32 blocks, E8M0 scales) {shape}", "triton",
              bench.ms(lambda: block_quantize(x, "fp8_e4m3", (1, 32), "e8m0")), "GB/s", read + codes + codes // 32,
              "copy GB/s", codes_differing)


def bench_grouped(bench: Bench) -> None:
    from labkit.kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference

    s, dev = bench.sizes, bench.device
    tokens, experts, n, k = s.experts
    x = torch.randn(tokens, k, device=dev, dtype=s.dtype)
    weight = torch.randn(experts, n, k, device=dev, dtype=s.dtype) * 0.02
    sizes = moe_suite.group_sizes(tokens, experts, "balanced", dev)
    error = _max_error(grouped_matmul(x, weight, sizes), grouped_matmul_reference(x, weight, sizes))
    flops = 2 * tokens * n * k
    case = f"{tokens} tokens, {experts} experts, balanced, [{n}, {k}] each"
    bench.add("moe", case, "triton grouped", bench.ms(lambda: grouped_matmul(x, weight, sizes)), "TFLOP/s", flops,
              "dense TFLOP/s", error)
    dense = weight[0]
    bench.add("moe", case, "dense matmul (same FLOPs)", bench.ms(lambda: x @ dense.T), "TFLOP/s", flops, "dense TFLOP/s")


SUITES = (bench_norms, bench_attention, bench_quant, bench_quantize, bench_grouped)


# ----------------------------------------------------------------------------- the targets
def _target(name: str, measured: float | None, required: float, unit: str, dry_run: bool, detail: str) -> dict:
    status = "dry run" if dry_run else ("not measured" if measured is None else "pass" if measured >= required else "miss")
    return {"target": name, "measured": measured, "required": required, "unit": unit, "status": status, "detail": detail}


def evaluate_targets(bench: Bench) -> list[dict]:
    targets = []
    for op in ("rmsnorm", "softmax"):
        case = next((r["case"] for r in bench.rows if r["suite"] == "norms" and r["case"].startswith(op)), None)
        ours = bench.find("norms", case, "triton") if case else None
        share = ours["share_of_ceiling"] if ours else None
        targets.append(_target(f"{op} forward, share of copy bandwidth", share, 0.85, "fraction", bench.dry_run, case or ""))
        for baseline in ("eager", "torch.compile"):
            other = bench.find("norms", case, baseline) if case else None
            ratio = other["ms"] / ours["ms"] if ours and other else None
            targets.append(_target(f"{op} forward, faster than {baseline}", ratio, 1.0, "x", bench.dry_run, case or ""))
    case = next((r["case"] for r in bench.rows if r["case"].startswith("forward GQA non-causal")), None)
    ours = bench.find("attention", case, "triton") if case else None
    sdpa = bench.find("attention", case, "sdpa") if case else None
    targets.append(_target("FlashAttention forward, share of dense bf16 rate", ours and ours["share_of_ceiling"], 0.40,
                           "fraction", bench.dry_run, case or ""))
    targets.append(_target("FlashAttention forward, SDPA time / ours (>= 1/1.5)", sdpa["ms"] / ours["ms"] if ours and sdpa else None,
                           1 / 1.5, "x", bench.dry_run, case or ""))
    case = next((r["case"] for r in bench.rows if r["suite"] == "quant"), None)
    int4 = bench.find("quant", case, "int4") if case else None
    dense = next((r for r in bench.rows if r["suite"] == "quant" and r["impl"].endswith("matmul")), None)
    targets.append(_target("int4 GEMV batch 1, share of copy bandwidth", int4 and int4["share_of_ceiling"], 0.70,
                           "fraction", bench.dry_run, case or ""))
    targets.append(_target("int4 GEMV batch 1, faster than bf16", dense["ms"] / int4["ms"] if int4 and dense else None,
                           3.0, "x", bench.dry_run, case or ""))
    grouped = next((r for r in bench.rows if r["impl"] == "triton grouped"), None)
    dense = next((r for r in bench.rows if r["suite"] == "moe" and r["impl"].startswith("dense")), None)
    targets.append(_target("grouped GEMM, share of dense throughput (balanced)",
                           grouped["value"] / dense["value"] if grouped and dense else None, 0.60, "fraction",
                           bench.dry_run, grouped["case"] if grouped else ""))
    return targets


# ----------------------------------------------------------------------------- the report
def environment(device: str, dry_run: bool) -> dict:
    import platform

    import triton

    info = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "dry_run": dry_run, "device": "cpu (Triton's interpreter)"}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, cuda=torch.version.cuda, multiprocessors=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1))
        try:
            import subprocess

            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = "unknown (nvidia-smi did not answer)"
    return info


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = ["# Benchmarks", ""]
    if env["dry_run"]:
        lines += ["**Dry run**: tiny shapes under Triton's CPU interpreter. The numbers below check that the benchmark "
                  "runs; they measure nothing about speed.", ""]
    lines += ["| | |", "|---|---|"] + [f"| {key} | {_fmt(value)} |" for key, value in env.items()] + [""]
    lines += ["## Ceilings (measured)", "", "| ceiling | value |", "|---|---|"]
    lines += [f"| {name} | {_fmt(value, 4)} |" for name, value in report["ceilings"].items()] + [""]
    lines += ["## Targets", "", "| target | measured | required | status | case |", "|---|---|---|---|---|"]
    lines += [f"| {t['target']} | {_fmt(t['measured'])} | {_fmt(t['required'])} {t['unit']} | {t['status']} | {t['case']} |"
              for t in report["targets"]] + [""]
    lines += ["## Kernels", "", "| suite | case | impl | ms | value | metric | share of ceiling | max error |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['suite']} | {r['case']} | {r['impl']} | {_fmt(r['ms'])} | {_fmt(r['value'])} | {r['metric']} | "
              f"{_fmt(r['share_of_ceiling'])} | {_fmt(r['max_error'])} |" for r in report["rows"]] + [""]
    if report["skipped"]:
        lines += ["## Skipped", ""] + [f"- {s['what']}: {s['why']}" for s in report["skipped"]] + [""]
    return "\n".join(lines)


def run(dry_run: bool | None = None) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dry_run = device != "cuda" if dry_run is None else dry_run
    if device != "cuda" and not dry_run:
        raise ValueError("dry_run=False: timing the kernels needs a GPU; without one only the dry run runs")
    bench = Bench(device, dry_run)
    measure_ceilings(bench)
    for suite in SUITES:
        suite(bench)
    bench.skip("serving engine decode step", "labkit has no serving engine yet (the serving chapter's issue)")
    targets = evaluate_targets(bench)
    for target in targets:
        target["case"] = target.pop("detail")
    return {"environment": environment(device, dry_run), "ceilings": bench.ceilings, "rows": bench.rows,
            "targets": targets, "skipped": bench.skipped}


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = sys.argv[2:] if argv is None else argv  # python -m labkit.bench all [options]
    parser = argparse.ArgumentParser(prog="python -m labkit.bench all", description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every row, ceiling and target to this JSON file")
    parser.add_argument("--markdown", type=Path, help="write the report as Markdown (docs/benchmarks.md on a GPU)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (the default without a GPU)")
    args = parser.parse_args(argv)
    report = run(dry_run=True if args.dry_run else None)
    text = markdown(report)
    print(text)
    for path, content in ((args.json, json.dumps(report, indent=1, default=str)), (args.markdown, text)):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content + "\n", encoding="utf-8")
    return 0
