"""The kernels compiled on CUDA at sizes Triton's interpreter cannot afford: realistic model shapes, and tensors past
2^31 elements, where a 32-bit offset (row * stride) would wrap. `make test-gpu` (tools/gpu_run.sh) runs them on a
GPU; everywhere else they are skipped."""
import labkit  # noqa: F401  (first: sets Triton's mode)

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: make test-gpu runs these on one")

BIG_ROWS, BIG_COLS = (1 << 31) // 4096 + 3, 4096  # 2^31 + 12288 elements: offsets past int32


def test_rmsnorm_past_two_to_the_31_elements():
    from labkit.kernels.rmsnorm import rmsnorm, rmsnorm_reference

    x = torch.randn(BIG_ROWS, BIG_COLS, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(BIG_COLS, device="cuda", dtype=torch.bfloat16) + 0.5
    y = rmsnorm(x, weight)
    for rows in (slice(0, 4), slice(BIG_ROWS - 4, BIG_ROWS)):  # the first rows and the rows past 2^31
        torch.testing.assert_close(y[rows].float(), rmsnorm_reference(x[rows].float(), weight.float()), rtol=2e-2, atol=2e-2)


def test_softmax_past_two_to_the_31_elements():
    from labkit.kernels.softmax import softmax

    x = torch.randn(BIG_ROWS, BIG_COLS, device="cuda", dtype=torch.bfloat16)
    y = softmax(x)
    for rows in (slice(0, 4), slice(BIG_ROWS - 4, BIG_ROWS)):
        torch.testing.assert_close(y[rows].float(), torch.softmax(x[rows].float(), -1), rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attention_at_8k_tokens_with_gqa(causal, dtype):
    from labkit.kernels.flash_attention import flash_attention

    q = torch.randn(1, 16, 8192, 128, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, 4, 8192, 128, device="cuda", dtype=dtype) for _ in range(2))
    out = flash_attention(q, k, v, causal=causal)
    ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1),
                                         is_causal=causal)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fmt", ["int4", "nf4", "int8"])
@pytest.mark.parametrize("batch", [1, 32])
def test_weight_only_matmul_on_an_8b_models_mlp_shape(fmt, batch):
    from labkit.bench.quant import random_weight, relative_error
    from labkit.kernels.quant_matmul import quant_matmul, quant_matmul_reference

    operands = random_weight(fmt, 14336, 4096, "cuda")
    x = torch.randn(batch, 4096, device="cuda", dtype=torch.bfloat16)
    assert relative_error(quant_matmul(x, **operands), quant_matmul_reference(x, **operands)) < 2e-2


def test_grouped_matmul_on_mixtral_expert_shapes():
    from labkit.bench.moe import group_sizes
    from labkit.kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference

    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(8, 4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    for routing in ("balanced", "skewed"):
        sizes = group_sizes(8192, 8, routing, "cuda")
        torch.testing.assert_close(grouped_matmul(x, weight, sizes).float(), grouped_matmul_reference(x, weight, sizes).float(),
                                   rtol=2e-2, atol=2e-2)
