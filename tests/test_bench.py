import pytest
import torch

import labkit
from labkit.bench import print_table
from labkit.bench.attention import attention_flops, check_correctness, datasheet_peak

pytestmark = pytest.mark.skipif(not labkit.kernels.available()[0], reason="needs Triton")


def test_attention_flops_closed_form():
    # non-causal forward: two matmuls of 2*N*N*D FLOPs per head
    assert attention_flops(2, 3, 128, 256, 64, causal=False) == 2 * 3 * 2 * (2 * 128 * 256 * 64)
    assert attention_flops(1, 1, 64, 64, 32, causal=True) == attention_flops(1, 1, 64, 64, 32, causal=False) / 2
    assert attention_flops(1, 1, 64, 64, 32, causal=False, backward=True) == 3.5 * attention_flops(1, 1, 64, 64, 32, causal=False)


def test_datasheet_peak_lookup():
    # the chapter's datasheet table (labkit.hardware.GPU_DATASHEETS): half the sparse 1979 TFLOP/s
    assert datasheet_peak("NVIDIA H200") == datasheet_peak("NVIDIA H100 80GB HBM3") == 989.5
    assert datasheet_peak("some laptop GPU") is None


def test_correctness_checks_report_small_errors():
    from labkit.bench.norms import check_cpu

    device = "cuda" if labkit.runtime.triton_mode() == "compiled" else "cpu"
    rows = check_correctness(device, torch.float32, [(1, 4, 2, 33, 40, 32, True)])
    assert max(v for k, v in rows[0].items() if k.startswith("err")) < 1e-4
    if device == "cpu":
        assert all(r["forward max error"] < 1e-5 and r["backward max error"] < 1e-4 for r in check_cpu())


def test_print_table_aligns_columns(capsys):
    print_table([{"op": "rmsnorm", "GB/s": 1234.5678}, {"op": "softmax", "GB/s": 2.0}])
    assert capsys.readouterr().out.splitlines() == ["     op      GB/s", "rmsnorm  1.23e+03", "softmax         2"]


def test_tokenizer_suite_times_agreeing_encoders(capsys):
    from labkit.bench.tokenizer import run

    rows = run(max_chars=20_000, vocab_size=300, repeats=1)
    assert [(r["task"], r["library"]) for r in rows] == [
        ("train to 300 tokens", "labkit"), ("train to 300 tokens", "tokenizers"),
        ("encode with GPT-2's merges", "labkit"), ("encode with GPT-2's merges", "tokenizers"),
        ("encode with GPT-2's merges", "tiktoken")]  # both libraries are in the test extra
    assert all(r["MB/s"] > 0 and r["bytes"] == rows[0]["bytes"] for r in rows)
    assert [r["labkit / this"] for r in rows if r["library"] == "labkit"] == [1.0, 1.0]
    assert "labkit / this" in capsys.readouterr().out
