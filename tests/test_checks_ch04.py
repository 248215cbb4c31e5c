"""The chapter-04 graders accept labkit's functions and a learner's plain solutions, and reject the
typical wrong answers with a hint that names the mistake."""
import labkit  # noqa: F401

import pytest
import torch

from labkit import experts as X
from labkit.checks import CheckFailed
from labkit.checks import ch04_moe as checks


# ----------------------------------------------------------------------------- top_k_routing
def labkit_routing(logits, top_k, normalize):
    r = X.top_k_gating(logits, top_k, normalize=normalize)
    return r.expert_index, r.gates


def routing(logits, top_k, normalize, *, axis=-1, norm_axis=-1, softmax_after=False, fp32=True, stable=True, sort=True):
    """A learner's solution; the keyword arguments swap in one mistake at a time."""
    z = logits.float() if fp32 else logits
    if softmax_after:  # top-k of the logits, then a softmax over the k kept ones
        values, index = torch.topk(z, top_k, dim=-1)
        return index, torch.softmax(values, dim=-1).float()
    p = torch.softmax(z, dim=axis) if stable else z.exp() / z.exp().sum(axis, keepdim=True)
    values, index = torch.topk(p, top_k, dim=-1, sorted=sort)
    if not sort:
        index, values = index.flip(-1), values.flip(-1)
    if normalize:
        values = values / values.sum(norm_axis, keepdim=True)
    return index, values.float()


def test_top_k_routing_accepts_labkit_and_plain_solutions(capsys):
    checks.top_k_routing(labkit_routing)
    checks.top_k_routing(routing)
    # softmax over the kept logits == renormalised top-k: right when normalize=True, so a solution that
    # does that only when asked to normalise is right
    checks.top_k_routing(lambda l, k, n: routing(l, k, n, softmax_after=n))
    assert capsys.readouterr().out.count("✓ top_k_routing:") == 3


@pytest.mark.parametrize("mistake, hint", [
    (dict(softmax_after=True), "softmax before the top-k"),
    (dict(axis=0), "not over the tokens"),
    (dict(norm_axis=0), "not over the tokens"),
    (dict(fp32=False), "softmax in fp32"),
    (dict(stable=False), "exp(1000) overflows"),
    (dict(sort=False), "best first"),
])
def test_top_k_routing_rejects_typical_mistakes(mistake, hint):
    with pytest.raises(CheckFailed, match=hint.replace("(", r"\(").replace(")", r"\)")):
        checks.top_k_routing(lambda l, k, n: routing(l, k, n, **mistake))


def test_top_k_routing_rejects_no_renormalisation_mutation_and_state():
    with pytest.raises(CheckFailed, match="divide the k gates by their sum"):
        checks.top_k_routing(lambda l, k, n: routing(l, k, False))

    def in_place(logits, k, n):
        logits.sub_(logits.amax(-1, keepdim=True))
        return routing(logits, k, n)

    with pytest.raises(CheckFailed, match="modified"):
        checks.top_k_routing(in_place)
    calls = []

    def stateful(logits, k, n):
        calls.append(1)
        index, gates = routing(logits, k, n)
        return index, gates * (1 + 0.01 * (len(calls) % 2))

    with pytest.raises(CheckFailed, match="called twice"):
        checks.top_k_routing(stateful)
    with pytest.raises(CheckFailed, match="did you forget"):
        checks.top_k_routing(lambda l, k, n: None)
    with pytest.raises(CheckFailed, match="int64"):
        checks.top_k_routing(lambda l, k, n: (routing(l, k, n)[0].int(), routing(l, k, n)[1]))


# ----------------------------------------------------------------------------- load_balancing_loss
def balance(probs, expert_index, alpha, *, f_from_probs=False, per_token=False, times_e=True, p_sum=False, detach=False, fp32=True):
    p = probs.float() if fp32 else probs
    E = p.shape[1]
    P = p.sum(0) if p_sum else p.mean(0)
    if detach:
        P = P.detach()
    if f_from_probs:
        f = P
    else:
        counts = torch.zeros(E).index_add_(0, expert_index.reshape(-1), torch.ones(expert_index.numel()))
        f = counts / (p.shape[0] if per_token else expert_index.numel())
    return alpha * (E if times_e else 1) * (f.to(P.dtype) * P).sum()


def test_load_balancing_loss_accepts_labkit_and_a_plain_solution(capsys):
    checks.load_balancing_loss(X.load_balancing_loss)
    checks.load_balancing_loss(balance)
    assert capsys.readouterr().out.count("✓ load_balancing_loss:") == 2


@pytest.mark.parametrize("mistake, hint", [
    (dict(f_from_probs=True), "token COUNTS"),
    (dict(per_token=True), "not by T"),
    (dict(times_e=False), "number of experts E"),
    (dict(p_sum=True), "MEAN over the tokens"),
    (dict(detach=True), "autograd graph"),
    (dict(fp32=False), "fp32"),
])
def test_load_balancing_loss_rejects_typical_mistakes(mistake, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.load_balancing_loss(lambda p, i, a: balance(p, i, a, **mistake))


def test_load_balancing_loss_rejects_a_missing_minlength_and_a_vector():
    with pytest.raises(CheckFailed):
        checks.load_balancing_loss(lambda p, i, a: a * p.shape[1] * (torch.bincount(i.reshape(-1)).float() / i.numel() * p.float().mean(0)).sum())
    with pytest.raises(CheckFailed, match="0-dim"):
        checks.load_balancing_loss(lambda p, i, a: balance(p, i, a).reshape(1))


# ----------------------------------------------------------------------------- dispatch_with_capacity
def capacity_block(x, expert_index, gates, capacity, weight, *, by_position=False, residual=True, drop_zero=True,
                   use_gates=True, per_column=False):
    """A learner's loop solution; the keyword arguments swap in one mistake at a time."""
    T, k = expert_index.shape
    kept = torch.zeros(T, k, dtype=torch.bool)
    for e in range(weight.shape[0]):
        slots = [(t, j) for t in range(T) for j in range(k) if expert_index[t, j] == e]
        if per_column:
            for j in range(k):
                col = [s for s in slots if s[1] == j]
                if not by_position:
                    col.sort(key=lambda s: -float(gates[s]))
                for s in col[:capacity]:
                    kept[s] = True
            continue
        if not by_position:
            slots.sort(key=lambda s: -float(gates[s]))  # stable: ties in token order
        for s in slots[:capacity]:
            kept[s] = True
    out = x.clone() if residual else torch.zeros_like(x)
    for t in range(T):
        for j in range(k):
            if kept[t, j] or not drop_zero:
                g = gates[t, j].to(x.dtype) if use_gates else 1.0
                out[t] = out[t] + g * (x[t] @ weight[expert_index[t, j]].T)
    return out, kept


def labkit_block(x, expert_index, gates, capacity, weight):
    T, k = expert_index.shape
    E = weight.shape[0]
    routing = X.Routing(torch.zeros(T, E), torch.zeros(T, E), torch.zeros(T, E), expert_index, gates.float())
    plan = X.dispatch(routing, capacity, priority="gate")
    sorted_x = x[plan.token].float()
    y = X.segment_matmul(sorted_x, weight.float(), plan.group_sizes)
    out = x + X.combine(y, plan).to(x.dtype)
    kept = torch.zeros(T * k, dtype=torch.bool)
    kept[plan.slot] = True
    return out, kept.view(T, k)


def test_dispatch_with_capacity_accepts_labkit_and_a_loop(capsys):
    checks.dispatch_with_capacity(capacity_block)
    checks.dispatch_with_capacity(labkit_block)
    assert capsys.readouterr().out.count("✓ dispatch_with_capacity:") == 2


def test_dispatch_with_capacity_accepts_either_token_at_a_tie():
    def reversed_ties(x, expert_index, gates, capacity, weight):
        # sort by gate, ties in *reverse* token order: still a right answer
        T, k = expert_index.shape
        kept = torch.zeros(T, k, dtype=torch.bool)
        for e in range(weight.shape[0]):
            slots = [(t, j) for t in range(T) for j in range(k) if expert_index[t, j] == e][::-1]
            slots.sort(key=lambda s: -float(gates[s]))
            for s in slots[:capacity]:
                kept[s] = True
        out = x.clone()
        for t in range(T):
            for j in range(k):
                if kept[t, j]:
                    out[t] += gates[t, j].to(x.dtype) * (x[t] @ weight[expert_index[t, j]].T)
        return out, kept

    checks.dispatch_with_capacity(reversed_ties)


@pytest.mark.parametrize("mistake, hint", [
    (dict(by_position=True), "first tokens in order"),
    (dict(residual=False), "add the residual"),
    (dict(drop_zero=False), "contributes nothing"),
    (dict(use_gates=False), "by its gate"),
    (dict(per_column=True), "per column"),
])
def test_dispatch_with_capacity_rejects_typical_mistakes(mistake, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.dispatch_with_capacity(lambda *a: capacity_block(*a, **mistake))


def test_dispatch_with_capacity_rejects_mutation_and_wrong_types():
    def in_place(x, expert_index, gates, capacity, weight):
        out, kept = capacity_block(x, expert_index, gates, capacity, weight)
        x.zero_()
        return out, kept

    with pytest.raises(CheckFailed, match="modified"):
        checks.dispatch_with_capacity(in_place)
    with pytest.raises(CheckFailed, match="bool"):
        checks.dispatch_with_capacity(lambda *a: (capacity_block(*a)[0], capacity_block(*a)[1].long()))
    with pytest.raises(CheckFailed, match="dtype"):
        checks.dispatch_with_capacity(lambda *a: (capacity_block(*a)[0].float(), capacity_block(*a)[1]))


# ----------------------------------------------------------------------------- sort_dispatch
def sorted_dispatch(x, expert_ids, gates, experts, *, unpermute="inverse", gate_before=False, first_only=False,
                    token_of="div", stable=True, cast=True, detach_gates=False, gates_sorted=False):
    """A learner's one-sort solution; the keyword arguments swap in one mistake at a time."""
    T, k = expert_ids.shape
    if first_only:  # only each token's first choice
        expert_ids, gates, k = expert_ids[:, :1], gates[:, :1], 1
    if detach_gates:
        gates = gates.detach()
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=stable)
    rows = x[order // k] if token_of == "div" else x.repeat(k, 1)[order]
    if gate_before:
        rows = rows * gates.reshape(-1)[order, None].to(x.dtype)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    ys = torch.cat([expert(part) for expert, part in zip(experts, rows.split(counts))])
    if gates_sorted:
        ys = ys * gates.reshape(-1)[:, None]
    if unpermute == "inverse":
        ys = ys[torch.argsort(order)]
    elif unpermute == "permutation":
        ys = ys[order]
    weighted = ys.view(T, k, -1) if gate_before or gates_sorted else ys.view(T, k, -1) * gates[..., None]
    out = weighted.sum(1)
    return out.to(x.dtype) if cast else out


def scatter_back(x, expert_ids, gates, experts):
    """Right too: write the sorted rows back with out[order] = rows instead of indexing with the inverse."""
    T, k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat)
    ys = torch.cat([e(part) for e, part in zip(experts, x[order // k].split(torch.bincount(flat, minlength=len(experts)).tolist()))])
    back = torch.zeros_like(ys).index_copy(0, order, ys)
    return (back.view(T, k, -1) * gates[..., None]).sum(1).to(x.dtype)


def token_loop(x, expert_ids, gates, experts):
    return torch.stack([sum(gates[t, j] * experts[int(expert_ids[t, j])](x[t : t + 1])[0] for j in range(expert_ids.shape[1]))
                        for t in range(x.shape[0])]).to(x.dtype)


def test_sort_dispatch_accepts_one_sort_unstable_or_not_and_a_scatter_back(capsys):
    checks.sort_dispatch(sorted_dispatch)
    checks.sort_dispatch(lambda *a: sorted_dispatch(*a, stable=False))
    checks.sort_dispatch(scatter_back)
    assert capsys.readouterr().out.count("✓ sort_dispatch:") == 3


@pytest.mark.parametrize("mistake, hint", [
    (dict(unpermute="none"), "unpermute them"),
    (dict(unpermute="permutation"), "its INVERSE"),
    (dict(gate_before=True), "scales the expert's OUTPUT"),
    (dict(first_only=True), "not only the first column"),
    (dict(token_of="mod"), "token a // k"),
    (dict(gates_sorted=True), "gates are in token order"),
    (dict(cast=False), "x's dtype"),
    (dict(detach_gates=True), "gates"),
])
def test_sort_dispatch_rejects_typical_mistakes(mistake, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.sort_dispatch(lambda *a: sorted_dispatch(*a, **mistake))


def test_sort_dispatch_rejects_a_loop_over_tokens_mutation_and_labkit():
    with pytest.raises(CheckFailed, match="a loop over tokens calls every expert once per token"):
        checks.sort_dispatch(token_loop)

    def in_place(x, expert_ids, gates, experts):
        out = sorted_dispatch(x, expert_ids, gates, experts)
        with torch.no_grad():
            gates.mul_(2)
        return out

    with pytest.raises(CheckFailed, match="modified"):
        checks.sort_dispatch(in_place)
    with pytest.raises(CheckFailed, match="return"):
        checks.sort_dispatch(lambda *a: None)

    def via_labkit(x, expert_ids, gates, experts):
        T, k = expert_ids.shape
        zeros = torch.zeros(T, len(experts))
        plan = X.dispatch(X.Routing(zeros, zeros, zeros, expert_ids, gates.float()))
        ys = torch.cat([e(part) for e, part in zip(experts, x[plan.token].split(plan.group_sizes.tolist()))])
        return X.combine(ys, plan).to(x.dtype)

    import labkit.checks

    with pytest.raises(labkit.checks.DelegationRefused, match="labkit.experts.dispatch"):
        labkit.checks.sort_dispatch(via_labkit)
