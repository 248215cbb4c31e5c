"""``python -m labkit.bench attention``: the Triton FlashAttention kernel against torch's
``F.scaled_dot_product_attention`` (which dispatches to cuDNN/FlashAttention on a GPU).

Reports forward and forward+backward TFLOP/s in bf16 for head dims 64 and 128, sequence lengths
512 to 16k, causal and not, with the kernel's share of the measured bf16 matmul ceiling (and of
the datasheet dense peak when the GPU is known). On a CPU it only checks correctness.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.bench import gpu_available, print_table, time_ms

SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
TOKENS_PER_BATCH = 16384  # batch * seq_len kept constant so every size does similar work
NUM_HEADS = 16

def attention_flops(batch: int, heads: int, num_q: int, num_k: int, head_dim: int, causal: bool, backward: bool = False) -> float:
    """Matmul FLOPs: forward ``Q K^T`` and ``P V`` (2 x 2·Nq·Nk·D each); backward recomputes
    ``Q K^T`` and adds four more (dV, dP, dQ, dK), 2.5x the forward. Causal halves the work."""
    forward = 4.0 * batch * heads * num_q * num_k * head_dim * (0.5 if causal else 1.0)
    return forward * (3.5 if backward else 1.0)

def datasheet_peak(name: str) -> float | None:
    """The dense bf16 tensor-core TFLOP/s of the datasheet for ``name`` (``labkit.hardware.datasheet_for``), or None."""
    from labkit.hardware import datasheet_for

    peaks = datasheet_for(name)
    return peaks.tflops.get("bfloat16") if peaks is not None else None

def matmul_ceiling_tflops(size: int = 8192) -> float:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    return 2 * size**3 / (time_ms(lambda: a @ b) * 1e-3) / 1e12

def check_correctness(device: str, dtype: torch.dtype, shapes) -> list[dict]:
    """Max abs error of output and gradients against SDPA computed in float32."""
    from labkit.kernels.flash_attention import flash_attention

    rows = []
    for batch, heads, kv_heads, num_q, num_k, head_dim, causal in shapes:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(batch, heads, num_q, head_dim, generator=gen).to(device, dtype).requires_grad_()
        k = torch.randn(batch, kv_heads, num_k, head_dim, generator=gen).to(device, dtype).requires_grad_()
        v = torch.randn(batch, kv_heads, num_k, head_dim, generator=gen).to(device, dtype).requires_grad_()
        grad = torch.randn(q.shape, generator=gen).to(device, dtype)
        out = flash_attention(q, k, v, causal=causal)
        out.backward(grad)
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
        group = heads // kv_heads
        mask = torch.ones(num_q, num_k, dtype=torch.bool, device=device).tril(num_k - num_q) if causal else None
        ref = F.scaled_dot_product_attention(leaves[0], leaves[1].repeat_interleave(group, 1), leaves[2].repeat_interleave(group, 1), attn_mask=mask)
        ref.backward(grad.float())
        errors = [(out.float() - ref).abs().max().item()] + [(t.grad.float() - r.grad).abs().max().item() for t, r in zip((q, k, v), leaves)]
        rows.append(dict(shape=f"{batch}x{heads}/{kv_heads}x{num_q}x{num_k}x{head_dim}", causal=causal,
                         err_out=errors[0], err_dq=errors[1], err_dk=errors[2], err_dv=errors[3]))
    return rows

def _bench_row(head_dim: int, seq_len: int, causal: bool) -> dict:
    from labkit.kernels.flash_attention import flash_attention

    batch = max(1, TOKENS_PER_BATCH // seq_len)
    q, k, v = (torch.randn(batch, NUM_HEADS, seq_len, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def flash():
        return flash_attention(q, k, v, causal=causal)

    fwd_flops = attention_flops(batch, NUM_HEADS, seq_len, seq_len, head_dim, causal)
    both_flops = attention_flops(batch, NUM_HEADS, seq_len, seq_len, head_dim, causal, backward=True)
    ms = {}
    for name, fn in (("flash", flash), ("sdpa", sdpa)):
        with torch.no_grad():
            ms[name + "_fwd"] = time_ms(fn)
        ms[name + "_fwdbwd"] = time_ms(lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), grad))
    return dict(
        D=head_dim, N=seq_len, causal=causal, batch=batch,
        fwd_TFs=fwd_flops / ms["flash_fwd"] * 1e-9, sdpa_fwd_TFs=fwd_flops / ms["sdpa_fwd"] * 1e-9,
        fwd_time_vs_sdpa=ms["flash_fwd"] / ms["sdpa_fwd"],
        fwdbwd_TFs=both_flops / ms["flash_fwdbwd"] * 1e-9, sdpa_fwdbwd_TFs=both_flops / ms["sdpa_fwdbwd"] * 1e-9,
        fwdbwd_time_vs_sdpa=ms["flash_fwdbwd"] / ms["sdpa_fwdbwd"],
    )

def main() -> None:
    small_shapes = [(1, 4, 2, 77, 77, 64, True), (1, 4, 1, 1, 130, 128, True), (2, 2, 2, 50, 33, 32, False)]
    if not gpu_available():
        print("No GPU: timings need one. Checking the kernel's correctness under Triton's interpreter instead (fp32).")
        print_table(check_correctness("cpu", torch.float32, small_shapes))
        return
    name = torch.cuda.get_device_name()
    ceiling = matmul_ceiling_tflops()
    peak = datasheet_peak(name)
    print(f"{name}: measured bf16 matmul {ceiling:.0f} TFLOP/s" + (f", datasheet dense bf16 peak {peak:.0f} TFLOP/s" if peak else ""))
    print("correctness in bf16 against SDPA in fp32 (max abs error):")
    print_table(check_correctness("cuda", torch.bfloat16, small_shapes + [(2, 8, 2, 1000, 1000, 128, True)]))
    rows = []
    for head_dim in (64, 128):
        for causal in (False, True):
            for seq_len in SEQ_LENS:
                row = _bench_row(head_dim, seq_len, causal)
                row["fwd_%matmul"] = 100 * row["fwd_TFs"] / ceiling
                if peak:
                    row["fwd_%peak"] = 100 * row["fwd_TFs"] / peak
                rows.append(row)
                torch.cuda.empty_cache()
    print(f"bf16, {NUM_HEADS} heads, batch x N = {TOKENS_PER_BATCH} tokens; TF/s = TFLOP/s; time_vs_sdpa > 1 means slower than SDPA")
    print_table(rows)
    long_rows = [r for r in rows if r["N"] >= 4096]
    if peak and long_rows:
        worst = min(r["fwd_TFs"] for r in long_rows) / peak
        slowest = max(r["fwd_time_vs_sdpa"] for r in long_rows)
        print(f"N >= 4k: forward >= {100 * worst:.0f}% of the dense bf16 peak (target 40%), "
              f"at most {slowest:.2f}x SDPA's time (target 1.5x)")

if __name__ == "__main__":
    main()
