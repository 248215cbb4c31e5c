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


def _no_acc_rescale(m, s, acc, scores, values):
    new_m = torch.maximum(m, scores.amax(-1))
    p = torch.exp(scores - new_m[..., None])
    return new_m, s * torch.exp(m - new_m) + p.sum(-1), acc + p @ values


def _no_sum_rescale(m, s, acc, scores, values):
    new_m = torch.maximum(m, scores.amax(-1))
    p = torch.exp(scores - new_m[..., None])
    return new_m, s + p.sum(-1), acc * torch.exp(m - new_m)[..., None] + p @ values


def _block_max_only(m, s, acc, scores, values):
    new_m = scores.amax(-1)
    p = torch.exp(scores - new_m[..., None])
    c = torch.exp(m - new_m)
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
    alpha = (m - new_m).exp()
    weights = (scores - new_m.unsqueeze(-1)).exp()
    return new_m, alpha * s + weights.sum(-1), alpha.unsqueeze(-1) * acc + torch.matmul(weights, values)


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
    p = torch.exp(scores) * torch.exp(-new_m)[..., None]
    c = torch.exp(m - new_m)
    return new_m, s * c + p.sum(-1), acc * c[..., None] + p @ values


def _first_batch_only(m, s, acc, scores, values):  # written for [B, q, k]: amax over dim 2
    new_m = torch.maximum(m, scores.amax(dim=2) if scores.dim() == 3 else scores.amax(dim=2)[..., 0, :])
    c = torch.exp(m - new_m)
    p = torch.exp(scores - new_m[..., None])
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
        (_normalised_each_block, "rescale the old acc"),
        (lambda m, s, acc, scores, values: (m, s), "return new_max"),
        (_updates_state_in_place, "return new tensors"),
        (_overflows, "709.8"),
        (_first_batch_only, "RuntimeError"),
        (_float64_always, "dtype"),
    ],
)
def test_online_softmax_update_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.online_softmax_update(wrong)


# ----------------------------------------------------------------------------- flash_attention_torch
def learner_flash(q, k, v, causal=False, block_q=64, block_k=64, scale=None, *, top_left=False, rescale_acc=True,
                  lse_without_max=False, ignore_scale=False, tile_heads=False, out_fp32=False, full_matrix=False,
                  in_place=False):
    """A learner's FlashAttention-2 forward written from the chapter's description; the keywords inject mistakes."""
    num_q, num_k, dim = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1 / dim**0.5 if scale is None or ignore_scale else scale
    group = q.shape[1] // k.shape[1]
    k, v = ((t.repeat(1, group, 1, 1) if tile_heads else t.repeat_interleave(group, 1)).float() for t in (k, v))
    if in_place:
        q.mul_(1.0001)
    qf = q.float()
    offset = 0 if top_left else num_k - num_q
    if full_matrix:
        scores = qf @ k.transpose(-2, -1) * scale
        if causal:
            scores = scores.masked_fill(~nn.causal_mask(num_q, num_k), float("-inf"))
        return torch.softmax(scores, -1).matmul(v).to(q.dtype), torch.logsumexp(scores, -1)
    out, lse = torch.empty_like(qf), torch.empty(qf.shape[:-1])
    for qs in range(0, num_q, block_q):
        qb = qf[:, :, qs:qs + block_q]
        m = torch.full(qb.shape[:-1], float("-inf"))
        s_run = torch.zeros_like(m)
        acc = torch.zeros_like(qb)
        for ks in range(0, num_k, block_k):
            s = qb @ k[:, :, ks:ks + block_k].transpose(-2, -1) * scale
            if causal:
                rows = torch.arange(qs, qs + qb.shape[-2])[:, None]
                cols = torch.arange(ks, ks + s.shape[-1])[None, :]
                s = s.masked_fill(cols > rows + offset, float("-inf"))
            new_m = torch.maximum(m, s.amax(-1))
            safe = torch.where(torch.isinf(new_m), torch.zeros_like(new_m), new_m)
            p = torch.exp(s - safe[..., None])
            correction = torch.exp(m - safe)
            s_run = s_run * correction + p.sum(-1)
            acc = (acc * correction[..., None] if rescale_acc else acc) + p @ v[:, :, ks:ks + block_k]
            m = new_m
        out[:, :, qs:qs + block_q] = acc / s_run[..., None]
        lse[:, :, qs:qs + block_q] = torch.log(s_run) if lse_without_max else m + torch.log(s_run)
    return (out if out_fp32 else out.to(q.dtype)), lse


def test_flash_attention_torch_accepts_reference_and_an_independent_solution(capsys):
    checks.flash_attention_torch(attention.flash_attention_torch)
    checks.flash_attention_torch(learner_flash)
    assert capsys.readouterr().out.count("✓ flash_attention_torch") == 2


@pytest.mark.parametrize("mistake, hint", [
    (dict(top_left=True), "bottom-right"),
    (dict(rescale_acc=False), "rescale acc"),
    (dict(lse_without_max=True), "max included"),
    (dict(ignore_scale=True), "scale"),
    (dict(tile_heads=True), "repeat_interleave, not repeat"),
    (dict(out_fp32=True), "q's dtype"),
    (dict(full_matrix=True), "one block_q x block_k tile"),
    (dict(in_place=True), "in-place"),
])
def test_flash_attention_torch_rejects_typical_mistakes(mistake, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.flash_attention_torch(lambda *args: learner_flash(*args, **mistake))


# ----------------------------------------------------------------------------- flash_attention_triton
# A right per-key-block update, independent of labkit's (natural-log max kept alongside, explicit masks), and
# wrong variants made by replacing one line of it; they are written to a module file because @triton.jit reads
# the function's source.
RIGHT_UPDATE = '''
import triton
import triton.language as tl


@triton.jit
def update(acc, m_i, l_i, q, k, v, offs_m, offs_n, seq_k, causal_offset, sm_scale,
           MASKED: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    qk_scale = sm_scale * 1.4426950408889634
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
    if MASKED:
        keep = offs_n[None, :] < seq_k
        if CAUSAL:
            keep = keep & (offs_n[None, :] - causal_offset <= offs_m[:, None])
        s = tl.where(keep, s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    correction = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_new = l_i * correction + tl.sum(p, axis=1)
    acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, m_new, l_new
'''

TRITON_MISTAKES = {  # name: (line of RIGHT_UPDATE, its wrong replacement, words the hint must contain)
    "acc not corrected": ("acc = acc * correction[:, None] +", "acc = acc +", "acc = acc \\* alpha"),
    "sum not corrected": ("l_new = l_i * correction +", "l_new = l_i +", "l_i = l_i \\* alpha"),
    "exp2 without log2(e)": ("qk_scale = sm_scale * 1.4426950408889634", "qk_scale = sm_scale", "log2\\(e\\)"),
    "1/D instead of 1/sqrt(D)": ("qk_scale = sm_scale * 1.4426950408889634",
                                 "qk_scale = sm_scale * sm_scale * 1.4426950408889634", "use sm_scale as it is given"),
    "a scale from the tile width": ("qk_scale = sm_scale * 1.4426950408889634",
                                    "qk_scale = 1.4426950408889634 / tl.sqrt(q.shape[1] * 1.0)", "24 while the tiles"),
    "top-left causal mask": ("offs_n[None, :] - causal_offset <= offs_m[:, None]", "offs_n[None, :] <= offs_m[:, None]",
                             "bottom-right"),
    "ragged tail not masked": ("keep = offs_n[None, :] < seq_k", "keep = offs_n[None, :] >= 0", "padding"),
    "masks only when CAUSAL": ("    if MASKED:", "    if CAUSAL:", "padding"),
    "natural exp (lse off by log2 e)": ("correction = tl.exp2(m_i - m_new)", "correction = tl.exp(m_i - m_new)",
                                        "rescale what was summed"),
    "natural units throughout (lse in the wrong base)": ("qk_scale = sm_scale * 1.4426950408889634\n",
                                                        "qk_scale = sm_scale\n    tl_exp2 = tl.exp\n", "base-2"),
    "returns the old max": ("return acc, m_new, l_new", "return acc, m_i, l_new", "return"),
}


@pytest.fixture(scope="module")
def update_module(tmp_path_factory):
    """Write RIGHT_UPDATE and each mistake as modules and import them: name -> the jitted update."""
    import importlib.util

    pytest.importorskip("triton")
    folder = tmp_path_factory.mktemp("updates")
    sources = {"right": RIGHT_UPDATE}
    for index, (name, (line, wrong, _)) in enumerate(TRITON_MISTAKES.items()):
        assert line in RIGHT_UPDATE, name
        source = RIGHT_UPDATE.replace(line, wrong)
        if name.startswith("natural units"):
            source = source.replace("tl.exp2(", "tl.exp(")
        sources[f"mistake_{index}"] = source
    sources["todo"] = RIGHT_UPDATE[: RIGHT_UPDATE.index("    qk_scale")] + (
        '    raise NotImplementedError("not answered yet: write update (see the hint in Exercise 4 above)")\n')
    updates = {}
    for module_name, source in sources.items():
        path = folder / f"{module_name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"_updates_{module_name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        updates[module_name] = module.update
    return updates


def test_flash_attention_triton_accepts_labkits_update_and_an_independent_one(update_module, capsys):
    from labkit.kernels.flash_attention import _attention_block_update

    checks.flash_attention_triton(_attention_block_update)
    checks.flash_attention_triton(update_module["right"])
    assert capsys.readouterr().out.count("✓ flash_attention_triton") == 2


@pytest.mark.parametrize("index, name", list(enumerate(TRITON_MISTAKES)), ids=list(TRITON_MISTAKES))
def test_flash_attention_triton_rejects_typical_mistakes(update_module, index, name):
    with pytest.raises(CheckFailed, match=TRITON_MISTAKES[name][2]):
        checks.flash_attention_triton(update_module[f"mistake_{index}"])


def test_flash_attention_triton_says_not_answered_and_rejects_a_plain_function(update_module):
    with pytest.raises(CheckFailed, match="not answered yet(.|\n)*write your answer in place"):
        checks.flash_attention_triton(update_module["todo"])
    with pytest.raises(CheckFailed, match="@triton.jit"):
        checks.flash_attention_triton(attention.online_softmax_update)
