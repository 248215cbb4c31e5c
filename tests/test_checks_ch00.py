"""The chapter-00 graders accept labkit's answers and independent plain solutions, and reject the
realistic wrong ones (with a hint that names the mistake)."""
import numpy as np
import pytest
import torch

import labkit.checks
from labkit.checks import CheckFailed, _remote  # noqa: E402
from labkit.checks import ch00_foundations as checks  # the graders unwrapped: delegating to labkit is refused by the package-level ones (test_checks_refusal.py)
from labkit.data import get_batch
from labkit.train import cross_entropy


def test_reference_answers_pass(capsys):
    checks.get_batch(get_batch)
    checks.cross_entropy(cross_entropy)
    assert capsys.readouterr().out.count("✓") == 2


# ----------------------------------------------------------------------------- get_batch
def plain_get_batch(dataset, batch_size, context_length, device):
    """An independent right answer: one start per row, a slice per window."""
    starts = torch.randint(len(dataset) - context_length, (batch_size,)).tolist()
    rows = [np.asarray(dataset[s : s + context_length + 1], dtype=np.int64) for s in starts]
    windows = torch.tensor(np.stack(rows), device=device)
    return windows[:, :-1], windows[:, 1:]


def test_get_batch_accepts_an_independent_solution(capsys):
    checks.get_batch(plain_get_batch)
    assert "✓ get_batch:" in capsys.readouterr().out


def _windows(dataset, starts, context_length, shift=1, convert=lambda w: torch.from_numpy(w.astype(np.int64))):
    x = torch.stack([convert(np.asarray(dataset[s : s + context_length])) for s in starts])
    y = torch.stack([convert(np.asarray(dataset[s + shift : s + shift + context_length])) for s in starts])
    return x, y


def _starts(dataset, batch_size, context_length):
    return torch.randint(0, len(dataset) - context_length, (batch_size,)).tolist()


def no_shift(dataset, batch_size, context_length, device):
    return _windows(dataset, _starts(dataset, batch_size, context_length), context_length, shift=0)


def misses_last_start(dataset, batch_size, context_length, device):
    starts = torch.randint(0, len(dataset) - context_length - 1, (batch_size,)).tolist()
    return _windows(dataset, starts, context_length)


def float_tokens(dataset, batch_size, context_length, device):
    x, y = get_batch(dataset, batch_size, context_length, device)
    return x.float(), y.float()


def always_first_window(dataset, batch_size, context_length, device):
    return tuple(t.to(device) for t in _windows(dataset, [0] * batch_size, context_length))


def ignores_device(dataset, batch_size, context_length, device):
    return _windows(dataset, _starts(dataset, batch_size, context_length), context_length)


def keeps_dataset_dtype(dataset, batch_size, context_length, device):
    # right for an int64 dataset, but a uint16 token file gives uint16 tokens
    x, y = _windows(dataset, _starts(dataset, batch_size, context_length), context_length,
                    convert=lambda w: torch.from_numpy(w.astype(w.dtype)))
    return x.to(device), y.to(device)


def through_int16(dataset, batch_size, context_length, device):
    x, y = _windows(dataset, _starts(dataset, batch_size, context_length), context_length,
                    convert=lambda w: torch.from_numpy(w.astype(np.int16)).long())
    return x.to(device), y.to(device)


def reseeds(dataset, batch_size, context_length, device):
    torch.manual_seed(0)
    return plain_get_batch(dataset, batch_size, context_length, device)


def shuffles_dataset(dataset, batch_size, context_length, device):
    if dataset.flags.writeable:
        dataset[:] = dataset[::-1].copy()  # "augmentation" in place: the caller's array is changed
    return plain_get_batch(dataset, batch_size, context_length, device)


def returns_list(dataset, batch_size, context_length, device):
    return list(plain_get_batch(dataset, batch_size, context_length, device))


@pytest.mark.parametrize("wrong, hint", [
    (no_shift, "next"),
    (misses_last_start, "last valid start"),
    (float_tokens, "int64"),
    (always_first_window, "new random windows"),
    (ignores_device, "requested device"),
    (keeps_dataset_dtype, "whatever the dataset's dtype"),
    (through_int16, "overflows int16"),
    (reseeds, "do not reseed"),
    (shuffles_dataset, "leave the dataset unchanged"),
    (returns_list, "a tuple"),
])
def test_get_batch_grader_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.get_batch(wrong)


# ----------------------------------------------------------------------------- cross_entropy
def plain_cross_entropy(logits, targets):
    """An independent right answer: fp32 log-softmax by hand, flattened."""
    z = logits.float().reshape(-1, logits.shape[-1])
    z = z - z.max(dim=-1, keepdim=True).values
    log_probs = z - z.exp().sum(dim=-1, keepdim=True).log()
    return -log_probs[torch.arange(z.shape[0], device=z.device), targets.reshape(-1)].mean()


def test_cross_entropy_accepts_an_independent_solution(capsys):
    checks.cross_entropy(plain_cross_entropy)
    checks.cross_entropy(lambda logits, targets: torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))
    assert capsys.readouterr().out.count("✓ cross_entropy:") == 2


def unstable(logits, targets):
    probs = logits.exp() / logits.exp().sum(-1, keepdim=True)
    return -probs.gather(-1, targets.unsqueeze(-1)).log().mean()


def unstable_only_in_16_bit(logits, targets):  # stable in fp32 thanks to the max, but exp of fp16 overflows
    if logits.dtype == torch.float16:
        return -(logits.exp() / logits.exp().sum(-1, keepdim=True)).gather(-1, targets.unsqueeze(-1)).log().mean()
    return cross_entropy(logits, targets)


def summed(logits, targets):
    return cross_entropy(logits, targets) * targets.numel()


def wrong_axis(logits, targets):
    log_probs = logits - logits.logsumexp(dim=0, keepdim=True)
    return -log_probs.gather(-1, targets.unsqueeze(-1)).mean()


def only_2d(logits, targets):  # written for [N, vocab]: dim=1 is the vocab only for 2-D logits
    log_probs = logits - logits.logsumexp(dim=1, keepdim=True) if logits.dim() > 1 else logits - logits.logsumexp(0)
    return -log_probs.gather(-1, targets.unsqueeze(-1)).mean()


def in_place(logits, targets):
    logits -= logits.max(dim=-1, keepdim=True).values.detach()
    return (logits.exp().sum(-1).log() - logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)).mean()


def detached(logits, targets):
    return torch.tensor(cross_entropy(logits, targets).item())


def on_cpu(logits, targets):
    return cross_entropy(logits.cpu(), targets.cpu())


def raises(logits, targets):
    raise RuntimeError("not implemented")


@pytest.mark.parametrize("wrong, hint", [
    (unstable, "subtract each row's max"),
    (unstable_only_in_16_bit, "fp16|fp32"),
    (summed, "divide the summed loss"),
    (wrong_axis, "LAST dim"),
    (only_2d, "whatever the rank"),
    (in_place, "in place"),
    (detached, "backward"),
    (raises, "not implemented"),
])
def test_cross_entropy_grader_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.cross_entropy(wrong)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: on the CPU there is no other device to end up on")
def test_cross_entropy_grader_rejects_a_loss_left_on_the_cpu():
    with pytest.raises(CheckFailed, match="device"):
        checks.cross_entropy(on_cpu)


# ----------------------------------------------------------------------------- adamw_step
def loop_adamw_step(groups, step):
    """An independent right answer: a loop over groups and parameters, in place under torch.no_grad()."""
    with torch.no_grad():
        for group in groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            bc1, bc2 = 1 - b1**step, 1 - b2**step
            for p, g, m, v in zip(group["params"], group["grads"], group["exp_avg"], group["exp_avg_sq"]):
                p.mul_(1 - lr * wd)
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                p.sub_(lr * (m / bc1) / ((v / bc2).sqrt() + eps))


def foreach_adamw_step(groups, step):
    """Another: torch._foreach_* over each group's lists (what torch's foreach AdamW does), returning the groups."""
    with torch.no_grad():
        for group in groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            ps, gs, ms, vs = group["params"], group["grads"], group["exp_avg"], group["exp_avg_sq"]
            torch._foreach_mul_(ps, 1 - lr * wd)
            torch._foreach_lerp_(ms, gs, 1 - b1)
            torch._foreach_mul_(vs, b2)
            torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
            denom = torch._foreach_div(vs, 1 - b2**step)
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(ps, ms, denom, value=-lr / (1 - b1**step))
    return groups  # ignored by the caller


def labkit_adamw_step(groups, step):
    """labkit.train.AdamW's own math, driven over the grader's tensors: its state is set to the given moments."""
    from labkit.train import AdamW

    optimizer = AdamW([{"params": list(g["params"]), "lr": g["lr"], "betas": g["betas"], "eps": g["eps"],
                        "weight_decay": g["weight_decay"]} for g in groups])
    for group in groups:
        for p, grad, m, v in zip(group["params"], group["grads"], group["exp_avg"], group["exp_avg_sq"]):
            p.grad = grad
            optimizer.state[p] = {"step": step - 1, "exp_avg": m, "exp_avg_sq": v}
    optimizer.step()
    for group in groups:
        for p in group["params"]:
            p.grad = None


def test_adamw_step_accepts_independent_solutions_and_labkits_adamw(capsys):
    checks.adamw_step(loop_adamw_step)
    checks.adamw_step(foreach_adamw_step)
    checks.adamw_step(labkit_adamw_step)  # unwrapped grader: labkit's AdamW is refused only by labkit.checks.adamw_step
    assert capsys.readouterr().out.count("✓ adamw_step:") == 3


def test_adamw_steps_reference_is_torch_optim_adamw():
    """The grader steps its copies with torch.optim.adamw.adamw (building an optimizer would load torch._dynamo,
    seconds); that is torch.optim.AdamW's own update, bit for bit."""
    from torch.optim.adamw import adamw

    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen, dtype=torch.float64),
              torch.randn((), generator=gen)]
    mine = [p.clone() for p in params]
    moments = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    steps = [torch.tensor(0.0) for _ in params]
    leaves = [p.clone().requires_grad_() for p in params]
    optimizer = torch.optim.AdamW([{"params": leaves[:2], "lr": 0.1, "weight_decay": 0.5, "betas": (0.8, 0.95), "eps": 1e-6},
                                   {"params": leaves[2:], "lr": 0.03, "weight_decay": 0.0, "betas": (0.8, 0.95), "eps": 1e-6}],
                                  foreach=False)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
        for leaf, g in zip(leaves, grads):
            leaf.grad = g.clone()
        optimizer.step()
        for sl, lr, wd in ((slice(0, 2), 0.1, 0.5), (slice(2, 3), 0.03, 0.0)):
            adamw(mine[sl], grads[sl], moments[0][sl], moments[1][sl], [], steps[sl], foreach=False, amsgrad=False,
                  beta1=0.8, beta2=0.95, lr=lr, weight_decay=wd, eps=1e-6, maximize=False)
    for leaf, p, m, v in zip(leaves, mine, *moments):
        state = optimizer.state[leaf]
        assert torch.equal(leaf.detach(), p) and torch.equal(state["exp_avg"], m) and torch.equal(state["exp_avg_sq"], v)


def _per_parameter(update):
    """An answer that loops like loop_adamw_step and runs ``update(p, g, m, v, step, lr, b1, b2, eps, wd)`` per parameter."""
    def adamw_step(groups, step):
        with torch.no_grad():
            for group in groups:
                for p, g, m, v in zip(group["params"], group["grads"], group["exp_avg"], group["exp_avg_sq"]):
                    update(p, g, m, v, step, group["lr"], *group["betas"], group["eps"], group["weight_decay"])
    adamw_step.__name__ = update.__name__
    return adamw_step


@_per_parameter
def l2_regularised(p, g, m, v, t, lr, b1, b2, eps, wd):
    g = g + wd * p  # torch.optim.Adam's weight_decay: the decay goes through the moments
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.sub_(lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps))


@_per_parameter
def l2_into_the_grad(p, g, m, v, t, lr, b1, b2, eps, wd):
    g.add_(p, alpha=wd)  # the same, in place: the model's gradient is changed
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.sub_(lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps))


@_per_parameter
def no_bias_correction(p, g, m, v, t, lr, b1, b2, eps, wd):
    p.mul_(1 - lr * wd)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.sub_(lr * m / (v.sqrt() + eps))


@_per_parameter
def bias_correction_of_the_previous_step(p, g, m, v, t, lr, b1, b2, eps, wd):
    p.mul_(1 - lr * wd)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.sub_(lr * (m / (1 - b1 ** (t - 1))) / ((v / (1 - b2 ** (t - 1))).sqrt() + eps))  # 0 at step 1: NaN


@_per_parameter
def step_size_of_the_previous_step(p, g, m, v, t, lr, b1, b2, eps, wd):
    p.mul_(1 - lr * wd)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    step_size = lr / (1 - b1 ** (t - 1))  # a Python float: ZeroDivisionError at step 1
    p.addcdiv_(m, (v / (1 - b2 ** (t - 1))).sqrt() + eps, value=-step_size)


@_per_parameter
def bias_correction_of_the_next_step(p, g, m, v, t, lr, b1, b2, eps, wd):
    t = t + 1  # "the first step is step 0"
    p.mul_(1 - lr * wd)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.sub_(lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps))


@_per_parameter
def decay_without_lr(p, g, m, v, t, lr, b1, b2, eps, wd):
    p.mul_(1 - wd)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.sub_(lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps))


@_per_parameter
def decay_after_the_update(p, g, m, v, t, lr, b1, b2, eps, wd):
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.sub_(lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps))
    p.mul_(1 - lr * wd)


@_per_parameter
def eps_inside_the_sqrt(p, g, m, v, t, lr, b1, b2, eps, wd):
    p.mul_(1 - lr * wd)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.sub_(lr * (m / (1 - b1**t)) / (v / (1 - b2**t) + eps).sqrt())


@_per_parameter
def papers_efficient_form(p, g, m, v, t, lr, b1, b2, eps, wd):
    p.mul_(1 - lr * wd)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.addcdiv_(m, v.sqrt() + eps, value=-lr * (1 - b2**t) ** 0.5 / (1 - b1**t))  # Kingma & Ba's Algorithm 1, last lines


@_per_parameter
def v_not_corrected(p, g, m, v, t, lr, b1, b2, eps, wd):
    p.mul_(1 - lr * wd)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.sub_(lr * (m / (1 - b1**t)) / (v.sqrt() + eps))


@_per_parameter
def betas_swapped(p, g, m, v, t, lr, b2, b1, eps, wd):  # beta2, beta1 = group["betas"]
    p.mul_(1 - lr * wd)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.sub_(lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps))


@_per_parameter
def lerp_weight_swapped(p, g, m, v, t, lr, b1, b2, eps, wd):
    p.mul_(1 - lr * wd)
    m.lerp_(g, b1)  # keeps 1 - beta1 of the old value
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.sub_(lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps))


@_per_parameter
def squares_the_moment(p, g, m, v, t, lr, b1, b2, eps, wd):
    p.mul_(1 - lr * wd)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(m, m, value=1 - b2)
    p.sub_(lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps))


@_per_parameter
def moments_start_over(p, g, m, v, t, lr, b1, b2, eps, wd):
    p.mul_(1 - lr * wd)
    m.copy_((1 - b1) * g)  # the previous steps' moments are dropped: right at step 1 only
    v.copy_((1 - b2) * g * g)
    p.sub_(lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps))


@_per_parameter
def skips_zero_gradients(p, g, m, v, t, lr, b1, b2, eps, wd):
    if not g.any():
        return
    p.mul_(1 - lr * wd)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.sub_(lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps))


@_per_parameter
def swaps_memory(p, g, m, v, t, lr, b1, b2, eps, wd):
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.data = p * (1 - lr * wd) - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)  # new memory


@_per_parameter
def computes_in_fp64(p, g, m, v, t, lr, b1, b2, eps, wd):
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.data = p.double() * (1 - lr * wd) - lr * (m.double() / (1 - b1**t)) / ((v.double() / (1 - b2**t)).sqrt() + eps)


def first_groups_lr(groups, step):
    lr = groups[0]["lr"]  # read once, outside the loop over groups
    with torch.no_grad():
        for group in groups:
            (b1, b2), eps, wd = group["betas"], group["eps"], group["weight_decay"]
            for p, g, m, v in zip(group["params"], group["grads"], group["exp_avg"], group["exp_avg_sq"]):
                p.mul_(1 - lr * wd)
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                p.sub_(lr * (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps))


def _new_state(group, step):
    """(new params, new exp_avg, new exp_avg_sq) of a group, as new tensors."""
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    out = ([], [], [])
    for p, g, m, v in zip(group["params"], group["grads"], group["exp_avg"], group["exp_avg_sq"]):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p.detach() * (1 - lr * wd) - lr * (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)
        for kept, t in zip(out, (p, m, v)):
            kept.append(t)
    return out


def moments_rebound(groups, step):
    for group in groups:
        new_p, new_m, new_v = _new_state(group, step)
        with torch.no_grad():
            for p, q in zip(group["params"], new_p):
                p.copy_(q)
        group["exp_avg"][:], group["exp_avg_sq"][:] = new_m, new_v  # the list entries, not the tensors


def moments_returned(groups, step):
    moments = []
    for group in groups:
        new_p, new_m, new_v = _new_state(group, step)
        with torch.no_grad():
            for p, q in zip(group["params"], new_p):
                p.copy_(q)
        moments.append((new_m, new_v))
    return moments


def params_rebound(groups, step):
    for group in groups:
        new_p, new_m, new_v = _new_state(group, step)
        for m, v, nm, nv in zip(group["exp_avg"], group["exp_avg_sq"], new_m, new_v):
            m.copy_(nm)
            v.copy_(nv)
        for i, p in enumerate(new_p):
            group["params"][i] = p


def forgets_no_grad(groups, step):
    for group in groups:
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for p, g, m, v in zip(group["params"], group["grads"], group["exp_avg"], group["exp_avg_sq"]):
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            p -= lr * wd * p
            p -= lr * (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)


_calls = [0]


def counts_steps_itself(groups, step):
    _calls[0] += 1
    return loop_adamw_step(groups, _calls[0])


@pytest.mark.parametrize("wrong, hint", [
    (l2_regularised, "L2 regularisation"),
    (l2_into_the_grad, "leave grads as they are"),
    (no_bias_correction, "divide by the bias corrections"),
    (bias_correction_of_the_previous_step, r"1 - beta\*\*0 = 0"),
    (step_size_of_the_previous_step, r"1 - beta\*\*0 = 0"),
    (bias_correction_of_the_next_step, "do not add 1"),
    (decay_without_lr, "scaled by the learning rate"),
    (decay_after_the_update, "before the Adam update"),
    (eps_inside_the_sqrt, "outside the square root"),
    (v_not_corrected, "correct v as well as m"),
    (papers_efficient_form, "efficient\" form"),
    (betas_swapped, "beta1 and beta2 are swapped"),
    (lerp_weight_swapped, r"not lerp_\(grad, beta1\)"),
    (squares_the_moment, "squared gradient"),
    (moments_start_over, "carry over"),
    (skips_zero_gradients, "gradient is zero still decays"),
    (swaps_memory, "new memory"),
    (computes_in_fp64, "keep each tensor's dtype"),
    (first_groups_lr, "its own hyper-parameters"),
    (moments_rebound, r"group\['exp_avg'\]\[0\] = "),
    (moments_returned, "update exp_avg in place.*the caller ignores what it returns"),
    (params_rebound, r"group\['params'\]\[0\] = "),
    (forgets_no_grad, r"torch.no_grad\(\)"),
    (counts_steps_itself, "use the step argument"),
])
def test_adamw_step_grader_rejects_typical_mistakes(wrong, hint):
    _calls[0] = 0
    checks.adamw_step(loop_adamw_step)  # counts_steps_itself is right until the second optimizer's first step
    with pytest.raises(CheckFailed, match=hint):
        checks.adamw_step(wrong)


# adamw_step through a handle, as labkit.grade runs it: the learner's function in another process (here: the same
# process behind _remote.handle, every request and reply crossing as bytes, as tests/test_remote.py does)
class _LocalTransport(_remote.Transport):
    def __init__(self, **namespace):
        self.namespace = namespace

    def exchange(self, request: bytes) -> bytes:
        return _remote.handle(request, self.namespace)


def _handle(fn):
    return _remote.Remote(_LocalTransport(fn=fn), "fn", "adamw_step")


def test_adamw_step_passes_through_a_handle(capsys):
    # the groups cross as lists of dicts of tensors; params, moments and grads are written back after each call, and
    # params that require grad are set up by a labkit harness on the learner's side (a tensor argument that requires
    # grad would come back without its in-place edits)
    for right in (loop_adamw_step, foreach_adamw_step):
        labkit.checks.adamw_step(_handle(right))
    assert capsys.readouterr().out.count("✓ adamw_step:") == 2


@pytest.mark.parametrize("wrong, hint", [
    (l2_regularised, "L2 regularisation"),
    (l2_into_the_grad, "leave grads as they are"),
    (step_size_of_the_previous_step, r"1 - beta\*\*0 = 0"),
    (decay_after_the_update, "before the Adam update"),
    (skips_zero_gradients, "gradient is zero still decays"),
    (swaps_memory, "new memory"),
    (computes_in_fp64, "keep each tensor's dtype"),
    (moments_rebound, r"group\['exp_avg'\]\[0\] = "),
    (moments_returned, "update exp_avg in place.*the caller ignores what it returns"),
    (params_rebound, r"group\['params'\]\[0\] = "),
    (forgets_no_grad, r"torch.no_grad\(\)"),
])
def test_adamw_step_gives_the_same_verdicts_through_a_handle(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        labkit.checks.adamw_step(_handle(wrong))


def test_adamw_step_refuses_torchs_adamw_through_a_handle():
    def with_torchs_adamw(groups, step):
        torch.optim.AdamW([p for group in groups for p in group["params"]])

    with pytest.raises(CheckFailed, match="write it yourself: `torch.optim.AdamW`"):
        labkit.checks.adamw_step(_handle(with_torchs_adamw))
