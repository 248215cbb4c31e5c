"""Chapter 03 graders accept the reference answers and reject the typical mistakes."""
import labkit  # noqa: F401
import pytest
import torch

from labkit import attention, nn
from labkit.checks import ch03_attention as checks  # the graders unwrapped: delegating to labkit is refused by the package-level ones (test_checks_refusal.py)
from labkit.checks import CheckFailed


# ----------------------------------------------------------------------------- causal_mask
def plain_mask(num_queries, num_keys):
    """An independent right answer: the lower triangle shifted by num_keys - num_queries."""
    return torch.ones(num_queries, num_keys, dtype=torch.bool).tril(diagonal=num_keys - num_queries)


def test_causal_mask_accepts_reference(capsys):
    checks.causal_mask(nn.causal_mask)
    checks.causal_mask(plain_mask)
    assert capsys.readouterr().out.count("✓ causal_mask") == 2


def _clamped_offset(nq, nk):
    return torch.ones(nq, nk, dtype=torch.bool).tril(diagonal=max(nk - nq, 0))


def _square_then_slice(nq, nk):  # the last rows of a square mask: right only when nq <= nk
    return torch.ones(nk, nk, dtype=torch.bool).tril()[-nq:]


@pytest.mark.parametrize(
    "wrong,hint",
    [
        (lambda nq, nk: torch.ones(nq, nk, dtype=torch.bool).tril(), "top-left"),
        (lambda nq, nk: torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq - 1), "itself"),
        (lambda nq, nk: ~nn.causal_mask(nq, nk), "inverted"),
        (lambda nq, nk: nn.causal_mask(nq, nk).float(), "boolean"),
        (lambda nq, nk: nn.causal_mask(nk, nq), "shape"),
        (lambda nq, nk: torch.ones(nq, nk, dtype=torch.bool), "query i may attend"),
        (_clamped_offset, "do not clamp"),
        (_square_then_slice, "shape"),
        (lambda nq, nk: nn.causal_mask(nq, nk)[:, :256] if nk > 256 else nn.causal_mask(nq, nk), "shape"),
    ],
)
def test_causal_mask_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.causal_mask(wrong)


# ----------------------------------------------------------------------------- kv_bytes_per_token
def test_kv_bytes_per_token_accepts_reference(capsys):
    checks.kv_bytes_per_token(attention.kv_bytes_per_token)
    checks.kv_bytes_per_token(lambda c, dt: 2 * c.num_layers * c.kv_heads * c.dim_per_head * torch.empty((), dtype=dt).element_size())
    assert "kv_bytes_per_token" in capsys.readouterr().out


def _size(dt):
    return torch.empty((), dtype=dt).element_size()


@pytest.mark.parametrize(
    "wrong,hint",
    [
        (lambda c, dt: c.num_layers * c.kv_heads * c.dim_per_head * _size(dt), "K and V"),
        (lambda c, dt: 2 * c.num_layers * c.num_heads * c.dim_per_head * _size(dt), "num_kv_heads"),
        (lambda c, dt: 2 * c.kv_heads * c.dim_per_head * _size(dt), "num_layers"),
        (lambda c, dt: 2 * c.num_layers * c.kv_heads * (c.d_model // c.num_heads) * _size(dt), "head dim"),
        (lambda c, dt: 16 * c.num_layers * c.kv_heads * c.dim_per_head * _size(dt), "bits"),
        (lambda c, dt: 2 * c.num_layers * c.kv_heads * c.dim_per_head, "bytes per element"),
        (lambda c, dt: "lots", "Python int"),
        (lambda c, dt: 2 * c.num_layers * c.kv_heads * c.dim_per_head * torch.finfo(dt).bits / 8, "int"),  # a float
        (lambda c, dt: 2 * c.num_layers * c.num_kv_heads * c.dim_per_head * _size(dt), "kv_heads"),  # None for MHA
        (lambda c, dt: torch.tensor(attention.kv_bytes_per_token(c, dt)), "int"),
    ],
)
def test_kv_bytes_per_token_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.kv_bytes_per_token(wrong)


# ----------------------------------------------------------------------------- online_softmax_update
def test_online_softmax_update_accepts_reference(capsys):
    checks.online_softmax_update(attention.online_softmax_update)
    assert "online_softmax_update" in capsys.readouterr().out


def _pivot(new_m):
    """The shift the mistakes below use (so that each has one mistake): 0 where a row has seen no key yet."""
    return new_m.nan_to_num(neginf=0.0)


def _no_acc_rescale(m, s, acc, scores, values):
    new_m = torch.maximum(m, scores.amax(-1))
    p = torch.exp(scores - _pivot(new_m)[..., None])
    return new_m, s * torch.exp(m - _pivot(new_m)) + p.sum(-1), acc + p @ values


def _no_sum_rescale(m, s, acc, scores, values):
    new_m = torch.maximum(m, scores.amax(-1))
    p = torch.exp(scores - _pivot(new_m)[..., None])
    return new_m, s + p.sum(-1), acc * torch.exp(m - _pivot(new_m))[..., None] + p @ values


def _block_max_only(m, s, acc, scores, values):
    new_m = scores.amax(-1)
    p = torch.exp(scores - _pivot(new_m)[..., None])
    c = torch.exp(m - _pivot(new_m))
    return new_m, s * c + p.sum(-1), acc * c[..., None] + p @ values


def _unshifted(m, s, acc, scores, values):
    new_m = torch.maximum(m, scores.amax(-1))
    return new_m, s + torch.exp(scores).sum(-1), acc + torch.exp(scores) @ values


def _normalised_each_block(m, s, acc, scores, values):
    new_m, new_s, new_acc = attention.online_softmax_update(m, s, acc, scores, values)
    return new_m, new_s, new_acc / new_s[..., None]


def plain_update(m, s, acc, scores, values):
    """An independent right answer: the new max first, then both rescaled with one factor."""
    block_max = scores.max(dim=-1).values
    new_m = torch.where(block_max > m, block_max, m)
    pivot = new_m.nan_to_num(neginf=0.0)  # rows that have seen no key yet: exp(-inf - 0) = 0
    alpha = (m - pivot).exp()
    weights = (scores - pivot.unsqueeze(-1)).exp()
    return new_m, alpha * s + weights.sum(-1), alpha.unsqueeze(-1) * acc + torch.matmul(weights, values)


def _unguarded(m, s, acc, scores, values):  # the textbook update: NaN from exp(-inf - -inf)
    new_m = torch.maximum(m, scores.amax(-1))
    c = torch.exp(m - new_m)
    p = torch.exp(scores - new_m[..., None])
    return new_m, s * c + p.sum(-1), acc * c[..., None] + p @ values


def _guards_only_the_correction(m, s, acc, scores, values):  # alpha made 0 for an empty state, p left NaN
    new_m = torch.maximum(m, scores.amax(-1))
    c = torch.where(torch.isneginf(m), torch.zeros_like(m), torch.exp(m - new_m))
    p = torch.exp(scores - new_m[..., None])
    return new_m, s * c + p.sum(-1), acc * c[..., None] + p @ values


def test_online_softmax_update_accepts_an_independent_solution(capsys):
    checks.online_softmax_update(plain_update)
    assert "✓ online_softmax_update" in capsys.readouterr().out


def _updates_state_in_place(m, s, acc, scores, values):
    new_m = torch.maximum(m, scores.amax(-1))
    c = torch.exp(m - new_m)
    p = torch.exp(scores - new_m[..., None])
    s.mul_(c).add_(p.sum(-1))
    acc.mul_(c[..., None]).add_(p @ values)
    return new_m, s, acc


def _overflows(m, s, acc, scores, values):  # shifts by the block max only after exponentiating
    new_m = torch.maximum(m, scores.amax(-1))
    p = torch.exp(scores) * torch.exp(-_pivot(new_m))[..., None]
    c = torch.exp(m - _pivot(new_m))
    return new_m, s * c + p.sum(-1), acc * c[..., None] + p @ values


def _first_batch_only(m, s, acc, scores, values):  # written for [B, q, k]: amax over dim 2
    new_m = torch.maximum(m, scores.amax(dim=2) if scores.dim() == 3 else scores.amax(dim=2)[..., 0, :])
    c = torch.exp(m - _pivot(new_m))
    p = torch.exp(scores - _pivot(new_m)[..., None])
    return new_m, s * c + p.sum(-1), acc * c[..., None] + p @ values


def _float64_always(m, s, acc, scores, values):
    return tuple(t.double() for t in attention.online_softmax_update(m, s, acc, scores, values))


@pytest.mark.parametrize(
    "wrong,hint",
    [
        (_no_acc_rescale, "rescale the old acc"),
        (_no_sum_rescale, "rescale the old sum"),
        (_block_max_only, "new max is max"),
        (_unshifted, "overflow|rescale"),
        (_normalised_each_block, "rescale the old acc|divide by the sum only once"),
        (lambda m, s, acc, scores, values: (m, s), "return new_max"),
        (_updates_state_in_place, "return new tensors"),
        (_overflows, "709.8"),
        (_first_batch_only, "RuntimeError"),
        (_float64_always, "dtype"),
        (_unguarded, "only masked keys(.|\n)*shift the exponents by 0"),
        (_guards_only_the_correction, "only masked keys"),
    ],
)
def test_online_softmax_update_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.online_softmax_update(wrong)


# ----------------------------------------------------------------------------- flash_attention_torch
def learner_flash(q, k, v, causal=False, block_q=64, block_k=64, scale=None, *, top_left=False, rescale_acc=True,
                  lse_without_max=False, ignore_scale=False, tile_heads=False, copy_heads=False, out_fp32=False,
                  full_matrix=False, in_place=False):
    """A learner's FlashAttention-2 forward written from the chapter's description; the keywords inject mistakes."""
    num_q, num_k, dim = q.shape[-2], k.shape[-2], q.shape[-1]
    shape, dtype = q.shape, q.dtype
    scale = 1 / dim**0.5 if scale is None or ignore_scale else scale
    group = q.shape[1] // k.shape[1]
    if tile_heads or copy_heads:  # one K/V copy per query head; .repeat pairs the wrong heads
        k, v = ((t.repeat(1, group, 1, 1) if tile_heads else t.repeat_interleave(group, 1)).float() for t in (k, v))
    else:  # read in place: each K/V head broadcast over its group of query heads
        q = q.unflatten(1, (k.shape[1], group))
        k, v = k[:, :, None].float(), v[:, :, None].float()
    if in_place:
        q.mul_(1.0001)
    qf = q.float()
    offset = 0 if top_left else num_k - num_q
    if full_matrix:
        scores = qf @ k.transpose(-2, -1) * scale
        if causal:
            scores = scores.masked_fill(~nn.causal_mask(num_q, num_k), float("-inf"))
        return torch.softmax(scores, -1).matmul(v).to(dtype).reshape(shape), torch.logsumexp(scores, -1).reshape(shape[:-1])
    out, lse = torch.empty_like(qf), torch.empty(qf.shape[:-1])
    for qs in range(0, num_q, block_q):
        qb = qf[..., qs:qs + block_q, :]
        m = torch.full(qb.shape[:-1], float("-inf"))
        s_run = torch.zeros_like(m)
        acc = torch.zeros_like(qb)
        for ks in range(0, num_k, block_k):
            s = qb @ k[..., ks:ks + block_k, :].transpose(-2, -1) * scale
            if causal:
                rows = torch.arange(qs, qs + qb.shape[-2])[:, None]
                cols = torch.arange(ks, ks + s.shape[-1])[None, :]
                s = s.masked_fill(cols > rows + offset, float("-inf"))
            new_m = torch.maximum(m, s.amax(-1))
            safe = torch.where(torch.isinf(new_m), torch.zeros_like(new_m), new_m)
            p = torch.exp(s - safe[..., None])
            correction = torch.exp(m - safe)
            s_run = s_run * correction + p.sum(-1)
            acc = (acc * correction[..., None] if rescale_acc else acc) + p @ v[..., ks:ks + block_k, :]
            m = new_m
        out[..., qs:qs + block_q, :] = acc / s_run[..., None]
        lse[..., qs:qs + block_q] = torch.log(s_run) if lse_without_max else m + torch.log(s_run)
    return (out if out_fp32 else out.to(dtype)).reshape(shape), lse.reshape(shape[:-1])


def test_flash_attention_torch_accepts_reference_and_an_independent_solution(capsys):
    checks.flash_attention_torch(attention.flash_attention_torch)
    checks.flash_attention_torch(learner_flash)
    assert capsys.readouterr().out.count("✓ flash_attention_torch") == 2


@pytest.mark.parametrize("mistake, hint", [
    (dict(top_left=True), "bottom-right"),
    (dict(rescale_acc=False), "rescale acc"),
    (dict(lse_without_max=True), "max included"),
    (dict(ignore_scale=True), "scale"),
    (dict(tile_heads=True), "k.repeat would pair them wrongly"),
    (dict(copy_heads=True), "throws away what GQA saves"),
    (dict(out_fp32=True), "q's dtype"),
    (dict(full_matrix=True), "one block_q x block_k tile"),
    (dict(in_place=True), "in-place"),
])
def test_flash_attention_torch_rejects_typical_mistakes(mistake, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.flash_attention_torch(lambda *args: learner_flash(*args, **mistake))


# ----------------------------------------------------------------------------- flash_attention_kernel
# A right forward kernel written from the exercise's contract (one loop, base-2 scores, masks on every block), and
# realistic wrong variants made by replacing one piece of it; they are written to module files because @triton.jit
# reads the function's source.
RIGHT_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def kernel(Q, K, V, Out, LSE, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
           stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
           num_heads, group_size, seq_q, seq_k, head_dim, sm_scale,
           CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    kvh = h // group_size
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < seq_q) & (offs_d[None, :] < head_dim), other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    shift = seq_k - seq_q
    end = seq_k
    if CAUSAL:
        end = tl.minimum(seq_k, (pid_m + 1) * BLOCK_M + shift)
    for start_n in range(0, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < seq_k) & (offs_d[None, :] < head_dim)
        k = tl.load(K + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * qk_scale
        keep = offs_n[None, :] < seq_k
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + shift)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m[:, None] < seq_q) & (offs_d[None, :] < head_dim))
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    tl.store(LSE + bh * seq_q + offs_m, lse, mask=offs_m < seq_q)
"""

KERNEL_MISTAKES = {  # name: (piece of RIGHT_KERNEL, its wrong replacement, words the grader's message must contain)
    "no causal loop bound": ("        end = tl.minimum(seq_k, (pid_m + 1) * BLOCK_M + shift)\n", "        pass\n",
                             "loop bound"),
    "loop bound without the bottom-right shift": ("(pid_m + 1) * BLOCK_M + shift)", "(pid_m + 1) * BLOCK_M)",
                                                  "bottom-right"),
    "ragged tail not masked in the loads": ("kv_mask = (offs_n[:, None] < seq_k) & (offs_d[None, :] < head_dim)",
                                            "kv_mask = offs_d[None, :] < head_dim", "offs_n < seq_k"),
    "ragged tail's scores not set to -inf": ("        keep = offs_n[None, :] < seq_k\n",
                                             "        keep = offs_n[None, :] >= 0\n", "padding"),
    "head_dim lanes not masked": ("kv_mask = (offs_n[:, None] < seq_k) & (offs_d[None, :] < head_dim)",
                                  "kv_mask = offs_n[:, None] < seq_k", "head_dim"),
    "accumulator not rescaled": ("acc = acc * alpha[:, None] +", "acc = acc +", "acc = acc \\* alpha"),
    "lse without the max": ("lse = (m_i + tl.log2(l_i))", "lse = (tl.log2(l_i))", "max included"),
    "lse in base 2": ("lse = (m_i + tl.log2(l_i)) * 0.6931471805599453", "lse = m_i + tl.log2(l_i)", "ln 2"),
    "o stored without dividing by l": ("out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]", "out = acc",
                                       "out = acc / l"),
    "NaN on a fully masked first block (no safe max)": ("m_safe = tl.where(m_new == float(\"-inf\"), 0.0, m_new)",
                                                        "m_safe = m_new", "m_safe"),
    "0/0 for a row that sees no key": ("out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]", "out = acc / l_i[:, None]",
                                       "sees no key"),
    "top-left causal mask": ("offs_n[None, :] <= offs_m[:, None] + shift", "offs_n[None, :] <= offs_m[:, None]",
                             "bottom-right"),
    "query head used as the K/V head (no GQA)": ("kvh = h // group_size", "kvh = h", "group_size"),
    "batch ignored": ("b = bh // num_heads", "b = bh * 0", "stride_qb"),
    "store without the row mask": ("mask=(offs_m[:, None] < seq_q) & (offs_d[None, :] < head_dim))\n    lse",
                                   "mask=offs_d[None, :] < head_dim)\n    lse", "past the last query row"),
    "scale ignored (1/sqrt(BLOCK_D))": ("qk_scale = sm_scale * 1.4426950408889634",
                                        "qk_scale = 1.4426950408889634 / tl.sqrt(BLOCK_D * 1.0)", "sm_scale"),
}


@pytest.fixture(scope="module")
def kernel_module(tmp_path_factory):
    """Write RIGHT_KERNEL and each mistake as modules and import them: name -> the jitted kernel."""
    import importlib.util

    pytest.importorskip("triton")
    folder = tmp_path_factory.mktemp("kernels")
    sources = {"right": RIGHT_KERNEL}
    for index, (name, (piece, wrong, _)) in enumerate(KERNEL_MISTAKES.items()):
        assert RIGHT_KERNEL.count(piece) == 1, name
        sources[f"mistake_{index}"] = RIGHT_KERNEL.replace(piece, wrong)
    body = RIGHT_KERNEL.index("    pid_m = tl.program_id(0)")
    sources["todo"] = RIGHT_KERNEL[:body] + '    raise NotImplementedError("not answered yet: write kernel")\n'
    kernels = {}
    for module_name, source in sources.items():
        path = folder / f"{module_name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"_attention_kernels_{module_name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        kernels[module_name] = module.kernel
    return kernels


def test_flash_attention_kernel_accepts_an_independent_kernel_and_labkits(kernel_module, capsys):
    from labkit.kernels.flash_attention import _flash_attention_forward_kernel

    checks.flash_attention_kernel(kernel_module["right"])
    checks.flash_attention_kernel(_flash_attention_forward_kernel)
    assert capsys.readouterr().out.count("✓ flash_attention_kernel") == 2


@pytest.mark.parametrize("index, name", list(enumerate(KERNEL_MISTAKES)), ids=list(KERNEL_MISTAKES))
def test_flash_attention_kernel_rejects_typical_mistakes(kernel_module, index, name):
    with pytest.raises(CheckFailed, match=KERNEL_MISTAKES[name][2]):
        checks.flash_attention_kernel(kernel_module[f"mistake_{index}"])


def test_flash_attention_kernel_says_not_answered_and_rejects_a_plain_function(kernel_module):
    with pytest.raises(CheckFailed, match="not answered yet(.|\n)*write your answer in place"):
        checks.flash_attention_kernel(kernel_module["todo"])
    with pytest.raises(CheckFailed, match="@triton.jit"):
        checks.flash_attention_kernel(attention.flash_attention_torch)
