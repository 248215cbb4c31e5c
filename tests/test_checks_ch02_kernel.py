"""labkit.checks.rmsnorm_kernel: chapter 02's Triton RMSNorm exercise. The right kernel passes, and each typical
mistake (the right kernel with one edit, written to a file and imported, as a learner's cell is) is rejected with
the hint for it."""
import labkit  # noqa: F401

import pytest  # noqa: E402
import torch  # noqa: E402

from labkit import checks  # noqa: E402
from labkit.checks import CheckFailed  # noqa: E402

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

RIGHT_KERNEL = '''\
import triton
import triton.language as tl


@triton.jit
def kernel(X, W, Y, x_row_stride, y_row_stride, n_cols, eps, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(X + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(Y + row * y_row_stride + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
'''

# name: (a line of RIGHT_KERNEL, what the mistake makes of it, words the grader's message must contain)
MISTAKES = {
    "unmasked loads": ("x = tl.load(X + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)\n"
                       "    w = tl.load(W + cols, mask=mask, other=0.0)",
                       "x = tl.load(X + row * x_row_stride + cols).to(tl.float32)\n    w = tl.load(W + cols)",
                       "mask=cols < n_cols and other=0.0"),
    "unmasked store": (".to(Y.dtype.element_ty), mask=mask)", ".to(Y.dtype.element_ty))", "to tl.store as well"),
    "the width as the row stride": ("X + row * x_row_stride", "X + row * n_cols", "x_row_stride"),
    "16-bit math": ("mask=mask, other=0.0).to(tl.float32)\n    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)",
                    "mask=mask, other=0.0)\n    w = tl.load(W + cols, mask=mask, other=0.0)", "upcast right after loading"),
    "no eps": ("/ n_cols + eps)", "/ n_cols)", "eps inside the square root"),
    "eps outside the root": ("tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)", "(tl.sqrt(tl.sum(x * x, axis=0) / n_cols) + eps)",
                             "eps inside the square root"),
    "no weight": ("(x * rstd * w)", "(x * rstd)", "weight loaded with the same mask"),
    "mean over the block": ("/ n_cols + eps", "/ BLOCK_SIZE + eps", "not BLOCK_SIZE"),
    "int32 offsets": ("tl.program_id(0).to(tl.int64)", "tl.program_id(0)", "overflows int32"),
    "writes into X": ("tl.store(Y + row * y_row_stride + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)",
                      "tl.store(X + row * x_row_stride + cols, (x * rstd * w).to(X.dtype.element_ty), mask=mask)\n"
                      "    tl.store(Y + row * y_row_stride + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)",
                      "must not write to X"),
}
SKELETON = RIGHT_KERNEL[: RIGHT_KERNEL.index("    row =")] + (
    '    raise NotImplementedError("not answered yet: write rmsnorm_kernel (see the hint in Exercise 5 above)")\n')


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """name -> the jitted kernel of RIGHT_KERNEL, of each mistake and of the skeleton, each from a file of its own."""
    folder = tmp_path_factory.mktemp("rmsnorm_kernels")
    sources = {"right": RIGHT_KERNEL, "skeleton": SKELETON}
    for name, (line, wrong, _) in MISTAKES.items():
        assert line in RIGHT_KERNEL, name
        sources[name] = RIGHT_KERNEL.replace(line, wrong)
    found = {}
    for index, (name, source) in enumerate(sources.items()):
        path = folder / f"my_rmsnorm_kernel_{index}.py"
        path.write_text(source)
        found[name] = checks.import_file(path).kernel
    return found


@triton.jit
def _rsqrt_kernel(X, W, Y, x_row_stride, y_row_stride, n_cols, eps, BLOCK_SIZE: tl.constexpr):
    """Another right answer: rsqrt of the mean, the row pointer advanced first, no explicit cast on the store."""
    row = tl.program_id(0)
    x_row = X + row.to(tl.int64) * x_row_stride
    cols = tl.arange(0, BLOCK_SIZE)
    x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / n_cols
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(Y + row.to(tl.int64) * y_row_stride + cols, x * tl.rsqrt(mean_square + eps) * w, mask=cols < n_cols)


def test_rmsnorm_kernel_accepts_right_kernels(kernels, capsys):
    checks.rmsnorm_kernel(kernels["right"])
    checks.rmsnorm_kernel(_rsqrt_kernel)
    out = capsys.readouterr().out
    assert out.count("✓ rmsnorm_kernel") == 2 and "int64 row offsets" in out


@pytest.mark.parametrize("name", list(MISTAKES))
def test_rmsnorm_kernel_rejects_typical_mistakes(kernels, name):
    with pytest.raises(CheckFailed, match=MISTAKES[name][2]):
        checks.rmsnorm_kernel(kernels[name])


def test_rmsnorm_kernel_rejects_a_plain_function_and_says_not_answered_for_the_skeleton(kernels):
    with pytest.raises(CheckFailed, match="@triton.jit"):
        checks.rmsnorm_kernel(lambda *args: None)
    with pytest.raises(CheckFailed, match="not answered yet(.|\n)*write your answer in place"):
        checks.rmsnorm_kernel(kernels["skeleton"])


def test_bandwidth_is_measured_only_where_triton_compiles(kernels):
    from labkit import norms
    from labkit.runtime import triton_mode

    speed = norms.rmsnorm_kernel_bandwidth(kernels["right"], rows=256, width=512)
    if triton_mode() == "compiled":
        assert speed["yours"] > 0 and speed["labkit"] > 0
    else:
        assert speed is None


def test_kernel_graders_skip_and_say_why_without_triton(kernels, monkeypatch, capsys):
    import labkit.runtime

    monkeypatch.setattr(labkit.runtime, "triton_installed", lambda: False)
    checks.rmsnorm_kernel(kernels["right"])
    checks.flash_attention_kernel(kernels["right"])
    out = capsys.readouterr().out
    assert out.count("not graded here: Triton is not installed") == 2 and "✓" not in out


def test_stand_ins_let_a_cell_define_a_kernel_without_triton():
    import importlib

    import labkit.kernels
    import labkit.runtime

    real = labkit.runtime.triton_installed
    try:
        labkit.runtime.triton_installed = lambda: False
        stand_in = importlib.reload(labkit.kernels)

        @stand_in.triton.jit
        def kernel(X, BLOCK: stand_in.tl.constexpr):
            pass

        assert callable(kernel)
        with pytest.raises(ImportError, match="Linux wheels only"):
            stand_in.tl.arange(0, 4)
    finally:
        labkit.runtime.triton_installed = real
        importlib.reload(labkit.kernels)
    assert labkit.kernels.triton is triton and labkit.kernels.tl is tl


def test_assert_close_names_an_infinity_where_a_finite_value_belongs():
    from labkit.checks._core import assert_close

    with pytest.raises(CheckFailed, match=r"inf at index \(1,\)"):
        assert_close(torch.tensor([1.0, float("inf")]), torch.tensor([1.0, 2.0]), "a case", "a hint")
    assert_close(torch.tensor([1.0, float("-inf")]), torch.tensor([1.0, float("-inf")]), "equal infinities", "a hint")


# ----------------------------------------------------------------------------- the backward kernel
RIGHT_BACKWARD = '''\
import triton
import triton.language as tl


@triton.jit
def kernel(DY, X, W, RSTD, DX, DW_PARTIAL, dy_row_stride, x_row_stride, dx_row_stride, n_rows, n_cols,
           rows_per_program, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        row = tl.cast(row, tl.int64)
        x = tl.load(X + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        x_hat = x * rstd
        g = dy * w
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols))
        tl.store(DX + row * dx_row_stride + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dy * x_hat
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw_acc, mask=mask)
'''

# name: (a line of RIGHT_BACKWARD, what the mistake makes of it, words the grader's message must contain)
BACKWARD_MISTAKES = {
    "no mean term": ("dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols))", "dx = rstd * g", "second term"),
    "16-bit math (no upcast)": (".to(tl.float32)", "", "upcast every load"),  # every load: fp16 * fp16 stays fp16
    "dweight without rstd": ("dw_acc += dy * x_hat", "dw_acc += dy * x", "NORMALIZED row"),
    "only the last row's dweight": ("dw_acc += dy * x_hat", "dw_acc = dy * x_hat", "only the program's last row"),
    "every program into row 0": ("DW_PARTIAL + pid * n_cols + cols", "DW_PARTIAL + cols", "pid \\* n_cols"),
    "unmasked loads": ("x = tl.load(X + row * x_row_stride + cols, mask=mask, other=0.0)", "x = tl.load(X + row * x_row_stride + cols)",
                       "mask=cols < n_cols and other=0.0"),
    "unmasked weight load": ("w = tl.load(W + cols, mask=mask, other=0.0)", "w = tl.load(W + cols)", "mask=cols < n_cols"),
    "unmasked dx store": ("dx.to(DX.dtype.element_ty), mask=mask)", "dx.to(DX.dtype.element_ty))", "every tl.store"),
    "unmasked partial store": ("tl.store(DW_PARTIAL + pid * n_cols + cols, dw_acc, mask=mask)",
                               "tl.store(DW_PARTIAL + pid * n_cols + cols, dw_acc)", "past the end of DW_PARTIAL"),
    "rows past n_rows": ("row_end = tl.minimum(row_start + rows_per_program, n_rows)", "row_end = row_start + rows_per_program",
                         "stop the row loop at n_rows|past the last row"),
    "mean over the block": ("/ n_cols))", "/ BLOCK_SIZE))", "not BLOCK_SIZE"),
    "the width as the row stride": ("X + row * x_row_stride", "X + row * n_cols", "row stride"),
}
BACKWARD_SKELETON = RIGHT_BACKWARD[: RIGHT_BACKWARD.index("    pid =")] + (
    '    raise NotImplementedError("not answered yet: write rmsnorm_backward_kernel")\n')


@pytest.fixture(scope="module")
def backward_kernels(tmp_path_factory):
    """name -> the jitted backward kernel of RIGHT_BACKWARD, of each mistake and of the skeleton, each from its own file."""
    folder = tmp_path_factory.mktemp("rmsnorm_backward_kernels")
    sources = {"right": RIGHT_BACKWARD, "skeleton": BACKWARD_SKELETON}
    for name, (line, wrong, _) in BACKWARD_MISTAKES.items():
        assert line in RIGHT_BACKWARD, name
        sources[name] = RIGHT_BACKWARD.replace(line, wrong)
    found = {}
    for index, (name, source) in enumerate(sources.items()):
        path = folder / f"my_rmsnorm_backward_kernel_{index}.py"
        path.write_text(source)
        found[name] = checks.import_file(path).kernel
    return found


@triton.jit
def _sum_form_backward(DY, X, W, RSTD, DX, DW_PARTIAL, dy_row_stride, x_row_stride, dx_row_stride, n_rows, n_cols,
                       rows_per_program, BLOCK_SIZE: tl.constexpr):
    """Another right answer: dx written with r³ and Σ g·x (the first form of the derivation), a while loop."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    inside = cols < n_cols
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    for i in range(0, rows_per_program):
        row = tl.cast(pid * rows_per_program + i, tl.int64)
        if row < n_rows:
            x = tl.load(X + row * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * dy_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
            r = tl.load(RSTD + row)
            g = dy * w
            dx = r * g - x * r * r * r * tl.sum(g * x, axis=0) / n_cols
            tl.store(DX + row * dx_row_stride + cols, dx, mask=inside)
            acc += dy * x * r
    tl.store(DW_PARTIAL + pid * n_cols + cols, acc, mask=inside)


def test_rmsnorm_backward_kernel_accepts_right_kernels(backward_kernels, capsys):
    checks.rmsnorm_backward_kernel(backward_kernels["right"])
    checks.rmsnorm_backward_kernel(_sum_form_backward)
    out = capsys.readouterr().out
    assert out.count("✓ rmsnorm_backward_kernel") == 2 and "each program's partial" in out


@pytest.mark.parametrize("name", list(BACKWARD_MISTAKES))
def test_rmsnorm_backward_kernel_rejects_typical_mistakes(backward_kernels, name):
    with pytest.raises(CheckFailed, match=BACKWARD_MISTAKES[name][2]):
        checks.rmsnorm_backward_kernel(backward_kernels[name])


def test_rmsnorm_backward_kernel_refuses_labkits_and_says_not_answered_for_the_skeleton(backward_kernels):
    from labkit.checks import DelegationRefused
    from labkit.kernels.rmsnorm import _rmsnorm_backward_kernel

    with pytest.raises(DelegationRefused, match="_rmsnorm_backward_kernel"):
        checks.rmsnorm_backward_kernel(_rmsnorm_backward_kernel)
    with pytest.raises(CheckFailed, match="@triton.jit"):
        checks.rmsnorm_backward_kernel(lambda *args: None)
    with pytest.raises(CheckFailed, match="not answered yet(.|\n)*write your answer in place"):
        checks.rmsnorm_backward_kernel(backward_kernels["skeleton"])


def test_labkits_backward_launch_matches_the_exercises_contract():
    """labkit's own kernel passes the grader unwrapped (the grader's contract is the kernel labkit ships)."""
    from labkit.checks.ch02_norms import rmsnorm_backward_kernel
    from labkit.kernels.rmsnorm import _rmsnorm_backward_kernel

    rmsnorm_backward_kernel(_rmsnorm_backward_kernel)
