"""Graders for chapter 04 (mixture of experts).

* ``top_k_routing(logits, top_k, normalize) -> (expert_index, gates)``: the learner's version of
  :func:`labkit.experts.top_k_gating` (softmax scores; its ``expert_index`` and ``gates``);
* ``load_balancing_loss(probs, expert_index, alpha) -> loss``: :func:`labkit.experts.load_balancing_loss`
  (the Switch Transformer auxiliary loss);
* ``dispatch_with_capacity(x, expert_index, gates, capacity, weight) -> (out, kept)``: an MoE *block*
  with a per-expert capacity, residual included (:func:`labkit.experts.dispatch` with ``priority="gate"``
  and :func:`labkit.experts.combine`, experts reduced to one matrix each, ``x @ weight[e].T``);
* ``sort_dispatch(x, expert_ids, gates, experts) -> out``: the permute -> compute -> unpermute path of
  :class:`labkit.experts.MoELayer` (:func:`labkit.experts.dispatch` and :func:`labkit.experts.combine`)
  for any experts (callables), against a loop over tokens, forward and gradients.

Each grader passes copies of its inputs (and fails if they come back changed), calls the learner's
function twice, checks types, dtypes and shapes, and compares with labkit. Where the right answer
is not unique (experts with exactly equal scores, tokens with exactly equal gates competing for the
last slot of an expert) any of the right answers is accepted.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from labkit import experts as X
from labkit.checks._core import call_on_copies, call_twice, expect_differentiable, fail, passed, results, same_values

__all__ = ["top_k_routing", "load_balancing_loss", "dispatch_with_capacity", "sort_dispatch"]


def _shape_dtype(value: torch.Tensor, name: str, dtype: torch.dtype, shape, tried: str, hint: str) -> None:
    if value.dtype != dtype:
        fail(tried, f"{name} of dtype {value.dtype}", f"{name} of dtype {dtype}", hint)
    if tuple(value.shape) != tuple(shape):
        fail(tried, f"{name} of shape {tuple(value.shape)}", f"{name} of shape {tuple(shape)}", hint)


# ----------------------------------------------------------------------------- top_k_routing
def _routing_cases():
    gen = torch.Generator().manual_seed(4)
    cases = [
        ("logits of shape (16, 8) in float32, top_k=2", torch.randn(16, 8, generator=gen) * 2, 2),
        ("logits of shape (9, 4) in float32, top_k=1", torch.randn(9, 4, generator=gen), 1),
        ("logits of shape (7, 6) in bfloat16, top_k=3", (torch.randn(7, 6, generator=gen) * 3).bfloat16(), 3),
        ("logits of shape (5, 5) in float16, top_k=5 (every expert)", torch.randn(5, 5, generator=gen).half(), 5),
        ("logits of shape (1, 1) in float32, top_k=1 (one expert)", torch.randn(1, 1, generator=gen), 1),
        ("logits of shape (6, 16) in float32, top_k=4, with values up to 1000", torch.randn(6, 16, generator=gen) * 400 + 600, 4),
    ]
    ties = torch.tensor([[1.0, 1.0, 1.0, 0.0], [2.0, 0.5, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0], [3.0, -1.0, 3.0, -1.0]])
    cases.append(("logits of shape (4, 4) in float32 with exactly tied experts, top_k=2", ties, 2))
    return cases


def top_k_routing(fn) -> None:
    """Grade ``fn(logits, top_k, normalize) -> (expert_index, gates)``: the ``top_k`` experts of each
    token by ``softmax(logits)`` (over the experts), best first, as int64 ``[T, top_k]``; ``gates``
    ``[T, top_k]`` fp32: those experts' softmax probabilities, renormalised to sum to 1 per token if
    ``normalize``. With ``normalize=True`` a softmax over the ``top_k`` kept logits is the same thing,
    and is accepted; with ``normalize=False`` it is not (the gates keep the probabilities over all experts)."""
    count = 0
    for tried_case, logits, k in _routing_cases():
        for normalize in (True, False):
            tried = f"top_k_routing({tried_case}, normalize={normalize})"
            ref = X.top_k_gating(logits, k, normalize=normalize)
            T, E = logits.shape
            index, gates = call_twice(fn, tried, (logits, k, normalize), ("expert_index", "gates"))
            _shape_dtype(index, "expert_index", torch.int64, (T, k), tried,
                         "expert_index: one row per token, top_k expert numbers, int64 (what torch.topk(...).indices gives)")
            _shape_dtype(gates, "gates", torch.float32, (T, k), tried,
                         "gates: [tokens, top_k] in float32 whatever the logits' dtype: route in fp32 (logits.float()), "
                         "as every MoE implementation does")
            if torch.isnan(gates).any():
                fail(tried, "NaN in the gates", "finite gates",
                     "exp(1000) overflows: use torch.softmax (it subtracts the row max), not exp(x) / exp(x).sum()")
            if ((index < 0) | (index >= E)).any():
                fail(tried, f"expert numbers from {int(index.min())} to {int(index.max())}", f"numbers in 0..{E - 1}",
                     "expert_index holds expert numbers along the last dim (the experts' axis)")
            if any(len(set(row)) != k for row in index.tolist()):
                fail(tried, f"a token sent twice to the same expert: {index.tolist()}", f"{k} different experts per token",
                     "take the top_k along dim=-1 (the experts), once: torch.topk(scores, top_k, dim=-1)")
            scores = ref.scores.double()
            chosen = scores.gather(-1, index)
            best = torch.topk(scores, k, dim=-1).values
            chosen_sorted = chosen.sort(-1, descending=True).values
            if not torch.allclose(chosen_sorted, best, rtol=1e-6, atol=1e-12):
                bad = int((~torch.isclose(chosen_sorted, best, rtol=1e-6, atol=1e-12)).any(-1).nonzero()[0])
                wrong_axis = torch.softmax(logits.float(), dim=0).double()
                hint = ("take the softmax over the experts (dim=-1), not over the tokens (dim=0)"
                        if torch.equal(index, torch.topk(wrong_axis, k, dim=-1).indices) and not torch.equal(index, ref.expert_index) else
                        "each token's experts are the top_k largest scores of its row: torch.topk(scores, top_k, dim=-1)")
                fail(tried, f"token {bad} sent to experts {index[bad].tolist()}",
                     f"experts {ref.expert_index[bad].tolist()} (the {k} largest scores {[round(v, 4) for v in best[bad].tolist()]})", hint)
            if (chosen[:, 1:] > chosen[:, :-1] + 1e-12).any():
                fail(tried, f"expert_index not ordered best first: {index.tolist()[:4]}...", "each row sorted by score, largest first",
                     "keep torch.topk's order (sorted=True): the first column is every token's first choice, which "
                     "capacity and 'first-choice' statistics rely on")
            expected = chosen.float()
            if normalize:
                expected = expected / expected.sum(-1, keepdim=True)
            if not torch.allclose(gates.double(), expected.double(), rtol=1e-4, atol=1e-6):
                g, p = gates.double(), chosen
                if normalize and torch.allclose(g, p, rtol=1e-4, atol=1e-6) and k > 1:
                    hint = "normalize=True: divide the k gates by their sum (per token), so they add up to 1"
                elif not normalize and torch.allclose(g, p / p.sum(-1, keepdim=True), rtol=1e-4, atol=1e-6):
                    hint = ("normalize=False keeps each chosen expert's probability under the softmax over ALL experts "
                            "(Switch): a softmax over only the top_k logits always sums to 1 — that is normalize=True. "
                            "Take the softmax before the top-k, not after")
                elif normalize and T > 1 and torch.allclose(g, p / p.sum(0, keepdim=True), rtol=1e-4, atol=1e-6):
                    hint = "renormalise each token's gates over its k experts (sum over dim=-1), not over the tokens (dim=0)"
                elif logits.dtype != torch.float32 and torch.allclose(
                        g, torch.softmax(logits, dim=-1).gather(-1, index).double() / (
                            torch.softmax(logits, dim=-1).gather(-1, index).double().sum(-1, keepdim=True) if normalize else 1.0),
                        rtol=3e-2, atol=1e-3):
                    hint = f"take the softmax in fp32 (logits.float()), not in {logits.dtype}: 16-bit probabilities round to 2-3 digits"
                else:
                    hint = ("gates = softmax(logits.float(), dim=-1) at the chosen experts"
                            + (", divided by their sum per token" if normalize else ", as they are"))
                row = int((~torch.isclose(g, expected.double(), rtol=1e-4, atol=1e-6)).any(-1).nonzero()[0])
                fail(tried, f"gates {[round(v, 5) for v in g[row].tolist()]} for token {row}",
                     f"{[round(v, 5) for v in expected[row].tolist()]}", hint)
            count += 1
    passed("top_k_routing", f"experts and gates right on {count} inputs: fp32/fp16/bf16, top-1 to every expert, "
                            "huge logits and exact ties (either tied expert accepted), normalised or not")


# ----------------------------------------------------------------------------- load_balancing_loss
def _balance_cases():
    gen = torch.Generator().manual_seed(5)

    def routed(T, E, k, scale=1.0, dtype=torch.float32):
        logits = torch.randn(T, E, generator=gen) * scale
        r = X.top_k_gating(logits, k)
        return r.probs.to(dtype), r.expert_index

    cases = [("probs of shape (32, 8) in float32, top_k=2, alpha=0.01", *routed(32, 8, 2), 0.01),
             ("probs of shape (20, 4) in float32, top_k=1, alpha=1.0", *routed(20, 4, 1, 3.0), 1.0),
             ("probs of shape (12, 6) in bfloat16, top_k=3, alpha=0.1", *routed(12, 6, 3, dtype=torch.bfloat16), 0.1),
             ("probs of shape (10, 5) in float32, top_k=5 (every expert), alpha=0.5", *routed(10, 5, 5), 0.5)]
    # experts 5..7 never chosen: the counts need minlength=E
    probs, _ = routed(8, 8, 1)
    index = torch.tensor([[0], [1], [2], [3], [4], [0], [1], [2]])
    cases.append(("probs of shape (8, 8) in float32, top_k=1, where experts 5, 6, 7 get no token, alpha=1.0", probs, index, 1.0))
    uniform = torch.full((8, 4), 0.25)
    cases.append(("perfectly balanced: probs all 1/4, expert_index (8, 1) = 0,1,2,3,0,1,2,3, alpha=0.01", uniform,
                  torch.arange(8).remainder(4)[:, None], 0.01))
    collapsed = torch.zeros(6, 4)
    collapsed[:, 2] = 1.0
    cases.append(("collapsed: every token to expert 2 with probability 1, shape (6, 4), alpha=1.0", collapsed,
                  torch.full((6, 1), 2), 1.0))
    return cases


def load_balancing_loss(fn) -> None:
    """Grade ``fn(probs, expert_index, alpha) -> loss``: ``alpha * E * sum_i f_i * P_i`` with ``f_i`` the
    fraction of the ``T * k`` assignments sent to expert ``i`` (counts) and ``P_i`` the mean of
    ``probs[:, i]`` over the tokens; a 0-dim fp32 tensor, differentiable in ``probs``."""
    count = 0
    for tried_case, probs, index, alpha in _balance_cases():
        tried = f"load_balancing_loss({tried_case})"
        T, E = probs.shape
        leaf = probs.detach().clone().requires_grad_()
        (loss,) = call_twice(fn, tried, (leaf, index, alpha), ("loss",))
        if loss.dim() != 0:
            fail(tried, f"a tensor of shape {tuple(loss.shape)}", "a 0-dim tensor (one number)",
                 "sum over the experts: alpha * E * (f * P).sum()")
        if loss.dtype != torch.float32:
            fail(tried, f"a loss of dtype {loss.dtype}", "dtype torch.float32",
                 "compute in fp32 (probs.float()): a bf16 sum of small products loses the digits that matter")
        ref_leaf = probs.detach().clone().requires_grad_()
        ref = X.load_balancing_loss(ref_leaf, index, alpha)
        value, expected = float(loss.detach()), float(ref.detach())
        if not math.isclose(value, expected, rel_tol=1e-3, abs_tol=1e-7):
            p = probs.double()
            P = p.mean(0)
            counts = torch.bincount(index.reshape(-1), minlength=E).double()
            guesses = {
                "f_i must come from token COUNTS (how many assignments each expert got, divided by T * k), not from the "
                "probabilities: with f = P the loss is alpha * E * sum P_i^2": alpha * E * float((P * P).sum()),
                "f_i divides the counts by T * k (all assignments), not by T: with top_k > 1, dividing by T makes "
                "the f_i sum to k": alpha * E * float((counts / T * P).sum()),
                "multiply by the number of experts E (so that perfect balance gives alpha, whatever E)": alpha * float((counts / index.numel() * P).sum()),
                "P_i is the MEAN over the tokens of probs[:, i] (probs.mean(dim=0)), not the sum": alpha * E * float((counts / index.numel() * p.sum(0)).sum()),
            }
            hint = next((h for h, g in guesses.items() if math.isclose(value, g, rel_tol=1e-3, abs_tol=1e-9) and
                         not math.isclose(g, expected, rel_tol=1e-3, abs_tol=1e-9)),
                        "loss = alpha * E * sum_i f_i * P_i, f_i = bincount(expert_index.flatten(), minlength=E) / (T * k), "
                        "P_i = probs.float().mean(dim=0)")
            fail(tried, f"loss {value:.6g}", f"{expected:.6g}", hint)
        expect_differentiable(loss, "loss", tried,
                              "P_i = probs.mean(0) must stay in the autograd graph (no .detach(), .item() or torch.no_grad()): "
                              "the gradient through P is what moves probability away from overloaded experts")
        again, copies = call_on_copies(fn, tried, leaf, index, alpha, return_inputs=True)
        grad = torch.autograd.grad(again, copies[0], allow_unused=True)[0]
        ref_grad = torch.autograd.grad(ref, ref_leaf)[0]
        if grad is None or not torch.allclose(grad.double(), ref_grad.double(), rtol=1e-3, atol=1e-7):
            fail(tried, "a gradient with respect to probs that differs from alpha * E * f_i / T",
                 "d loss / d probs[t, i] = alpha * E * f_i / T",
                 "only P gets a gradient: f_i (from counts) is a constant; do not push the gradient through f_i")
        count += 1
    passed("load_balancing_loss", f"value and gradient right on {count} inputs: top-1 to every expert, bf16, experts "
                                  "without tokens, perfect balance (= alpha) and collapse (= alpha * E)")


# ----------------------------------------------------------------------------- dispatch_with_capacity
def _capacity_reference(x, expert_index, gates, capacity, weight):
    T, k = expert_index.shape
    routing = X.Routing(logits=torch.zeros(T, weight.shape[0]), scores=torch.zeros(T, weight.shape[0]),
                        probs=torch.zeros(T, weight.shape[0]), expert_index=expert_index, gates=gates.float())
    plan = X.dispatch(routing, capacity, priority="gate")
    kept = torch.zeros(T * k, dtype=torch.bool)
    kept[plan.slot] = True
    return kept.view(T, k), plan


def _block_output(x, expert_index, gates, kept, weight):
    """x + sum over the kept slots of gate * (x @ weight[e].T), in fp64."""
    x64, w64 = x.double(), weight.double()
    out = x64.clone()
    for t in range(x.shape[0]):
        for j in range(expert_index.shape[1]):
            if kept[t, j]:
                out[t] += gates[t, j].double() * (x64[t] @ w64[expert_index[t, j]].T)
    return out


def _capacity_cases():
    gen = torch.Generator().manual_seed(6)

    def routed(T, E, k, skew=0.0):
        logits = torch.randn(T, E, generator=gen) + skew * torch.linspace(1, -1, E)
        r = X.top_k_gating(logits, k)
        return r.expert_index, r.gates

    cases = []
    for tried, T, E, k, d, cap, skew in [("x (24, 8), 4 experts, top_k=2, capacity 8", 24, 4, 2, 8, 8, 1.5),
                                        ("x (20, 6), 5 experts, top_k=1, capacity 3", 20, 5, 1, 6, 3, 2.0),
                                        ("x (16, 4), 8 experts, top_k=3, capacity 5", 16, 8, 3, 4, 5, 1.0),
                                        ("x (10, 4), 4 experts, top_k=2, capacity 0 (every slot dropped)", 10, 4, 2, 4, 0, 0.0),
                                        ("x (12, 4), 3 experts, top_k=2, capacity 100 (nothing dropped)", 12, 3, 2, 4, 100, 0.0)]:
        index, gates = routed(T, E, k, skew)
        x = torch.randn(T, d, generator=gen)
        weight = torch.randn(E, d, d, generator=gen) / math.sqrt(d)
        cases.append((tried, x, index, gates, cap, weight))
    # ties: equal gates competing for the last slot of expert 0, and a float64 x
    index = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1], [2, 0]])
    gates = torch.tensor([[0.5, 0.5], [0.7, 0.3], [0.6, 0.4], [0.5, 0.5], [0.8, 0.2]])
    x = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    weight = torch.randn(3, 4, 4, generator=gen, dtype=torch.float64)
    cases.append(("x (5, 4) in float64, 3 experts, top_k=2, capacity 2, with equal gates competing for expert 0",
                  x, index, gates, 2, weight))
    return cases


def dispatch_with_capacity(fn) -> None:
    """Grade ``fn(x, expert_index, gates, capacity, weight) -> (out, kept)``: each expert ``e`` takes at
    most ``capacity`` of the (token, slot) assignments routed to it, those with the largest gates
    (ties: any); ``kept`` ``[T, k]`` bool says which; ``out = x + sum over kept slots of
    gate * (x @ weight[e].T)``, in ``x``'s dtype: a token whose every slot was dropped comes out as ``x``."""
    count = 0
    for tried_case, x, index, gates, capacity, weight in _capacity_cases():
        tried = f"dispatch_with_capacity({tried_case})"
        T, k = index.shape
        E = weight.shape[0]
        out, kept = call_twice(fn, tried, (x, index, gates, capacity, weight), ("out", "kept"))
        _shape_dtype(kept, "kept", torch.bool, (T, k), tried, "kept: a bool tensor shaped like expert_index, True where the slot is computed")
        _shape_dtype(out, "out", x.dtype, x.shape, tried, "out: x's shape and dtype (one row per token)")
        ref_kept, plan = _capacity_reference(x, index, gates, capacity, weight)
        routed = torch.bincount(index.reshape(-1), minlength=E)
        got_per_expert = torch.bincount(index[kept], minlength=E)
        want_per_expert = routed.clamp(max=capacity)
        if not torch.equal(got_per_expert, want_per_expert):
            e = int((got_per_expert != want_per_expert).nonzero()[0])
            over = bool((got_per_expert > capacity).any())
            hint = ("each expert keeps at most `capacity` slots: count per expert (over all k columns together), not "
                    "per column of expert_index or over all experts" if over else
                    "keep min(routed, capacity) slots of every expert: an expert with room keeps all its tokens")
            fail(tried, f"expert {e} keeps {int(got_per_expert[e])} slots (routed {int(routed[e])})",
                 f"{int(want_per_expert[e])} = min(routed, capacity={capacity})", hint)
        g = gates.double()
        for e in range(E):
            mine = index == e
            kept_g, dropped_g = g[mine & kept], g[mine & ~kept]
            if kept_g.numel() and dropped_g.numel() and dropped_g.max() > kept_g.min() + 1e-12:
                first_come = torch.zeros(T * k, dtype=torch.bool)
                first_come[(index.reshape(-1) == e).nonzero().flatten()[:capacity]] = True  # token order
                first_come = first_come.view(T, k)
                by_position = torch.equal(first_come[mine], kept[mine])
                hint = ("that keeps the first tokens in order: capacity goes to the largest gates (priority), so sort the "
                        "expert's assignments by gate, descending (torch.argsort(-gates, stable=True)), then keep the first `capacity`"
                        if by_position else
                        "within each expert keep the `capacity` assignments with the LARGEST gates; drop the smallest")
                fail(tried, f"expert {e} keeps a slot with gate {kept_g.min().item():.3g} and drops one with gate "
                            f"{dropped_g.max().item():.3g}", "the largest gates kept, the smallest dropped", hint)
        expected = _block_output(x, index, gates, kept, weight)
        o = out.double()
        tol = dict(rtol=1e-4, atol=1e-5)
        if not torch.allclose(o, expected, **tol):
            no_residual = expected - x.double()
            all_kept = _block_output(x, index, gates, torch.ones_like(kept), weight)
            if torch.allclose(o, no_residual, **tol):
                hint = ("add the residual: out = x + (the experts' weighted outputs); a token whose every slot was dropped "
                        "must come out as x, not 0 — the residual connection carries it past the layer")
            elif torch.allclose(o, all_kept, **tol):
                hint = "a dropped slot contributes nothing: sum only over the kept slots"
            elif torch.allclose(o, _block_output(x, index, torch.ones_like(gates), kept, weight), **tol):
                hint = "weight each kept expert's output by its gate"
            else:
                hint = "out[t] = x[t] + sum over kept slots j of gates[t, j] * (x[t] @ weight[expert_index[t, j]].T)"
            row = int((~torch.isclose(o, expected, **tol)).any(-1).nonzero()[0])
            fail(tried, f"out[{row}] = {[round(v, 4) for v in o[row].tolist()]}", f"{[round(v, 4) for v in expected[row].tolist()]}", hint)
        count += 1
    passed("dispatch_with_capacity", f"kept slots and block outputs right on {count} inputs: top-1 to top-3, capacity 0 "
                                     "to dropless, largest gates first (ties either way), residual for dropped tokens")


# ----------------------------------------------------------------------------- sort_dispatch
class GradedExpert(nn.Module):
    """The experts :func:`sort_dispatch` hands the learner's function: ``silu(x W1^T + b1) W2^T + b2`` on rows
    ``[n, d] -> [n, d]``. Nonlinear with a bias, so ``f(g x) != g f(x)`` and ``f(0) != 0`` (a gate applied before
    the expert, or a dropped row left at zero, shows). Counts its calls and the rows it was given (plain
    attributes, so they come back from ``labkit.grade``'s learner process too)."""

    def __init__(self, d: int, hidden: int, gen: torch.Generator, dtype: torch.dtype):
        super().__init__()

        def weight(*shape, scale):
            return nn.Parameter((torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype))

        self.w1, self.b1 = weight(hidden, d, scale=d ** -0.5), weight(hidden, scale=0.5)
        self.w2, self.b2 = weight(d, hidden, scale=hidden ** -0.5), weight(d, scale=0.5)
        self.calls = 0
        self.rows = 0

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.rows += int(rows.shape[0])
        return nn.functional.silu(rows @ self.w1.T + self.b1) @ self.w2.T + self.b2


def _sort_dispatch_cases():
    """(what, T, d, E, k, dtype, ids): ``ids`` the expert ids ``[T, k]``, or the experts each token draws its ``k``
    distinct experts from at random."""
    ties = torch.stack([torch.full((10,), 2), torch.tensor([0, 1, 0, 1, 1, 0, 0, 1, 0, 1])], dim=1)  # all first choices to expert 2
    return [
        ("T=12 tokens of d=8, 4 experts, top_k=1, float32", 12, 8, 4, 1, torch.float32, range(4)),
        ("T=16, d=6, 5 experts, top_k=2, float32", 16, 6, 5, 2, torch.float32, range(5)),
        ("T=9, d=4, 6 experts, top_k=3, float64, experts 1 and 4 receive no tokens", 9, 4, 6, 3, torch.float64,
         (0, 2, 3, 5)),
        ("T=10, d=4, 3 experts, top_k=2, float32, every token's first choice is expert 2 (ties in the ids)", 10, 4, 3, 2,
         torch.float32, ties),
        ("T=1, d=5, 4 experts, top_k=2, float32 (one token)", 1, 5, 4, 2, torch.float32, range(4)),
        ("T=7, d=8, 4 experts, top_k=4 (every expert), float64", 7, 8, 4, 4, torch.float64, range(4)),
        ("T=6, d=4, 1 expert, top_k=1, float32", 6, 4, 1, 1, torch.float32, range(1)),
        ("T=13, d=8, 3 experts, top_k=2, bfloat16 x and experts, float32 gates (as a router gives them)", 13, 8, 3, 2,
         torch.bfloat16, range(3)),
    ]


def _loop_reference(x, expert_ids, gates, experts):
    """The per-token loop, in fp64: out[t] = sum_j gates[t, j] * experts[expert_ids[t, j]](x[t])."""
    rows = []
    for t in range(x.shape[0]):
        rows.append(sum(gates[t, j] * experts[int(expert_ids[t, j])](x[t : t + 1])[0] for j in range(expert_ids.shape[1])))
    return torch.stack(rows)


def _sort_dispatch_mistake(got, x, expert_ids, gates, experts, expected, tol) -> str | None:
    """The hint for a known mistake that reproduces ``got``, or None."""
    T, k = expert_ids.shape
    d = x.shape[1]
    with torch.no_grad():
        flat = expert_ids.reshape(-1)
        y = torch.stack([experts[int(flat[a])](x[a // k : a // k + 1])[0] for a in range(T * k)])  # per assignment a = t * k + j
        order = torch.argsort(flat, stable=True)
        inverse = torch.argsort(order)
        g = gates.double()
        wrong_token = torch.stack([experts[int(flat[a])](x[a % T : a % T + 1])[0] for a in range(T * k)])
        candidates = [
            ((y[order].view(T, k, d) * g[..., None]).sum(1),
             "the expert outputs come back in sorted order: unpermute them (rows[inverse], inverse = the inverse of the "
             "sorting permutation) before combining, so that row t * k + j is token t's choice j again"),
            ((y[order][order].view(T, k, d) * g[..., None]).sum(1),
             "you unpermuted with the sorting permutation itself: sorted row r came from assignment order[r], so the "
             "way back is its INVERSE, inverse[order] = arange(T * k) (torch.argsort(order), or "
             "torch.empty_like(order).scatter_(0, order, torch.arange(...))), or write the rows back with out[order] = rows"),
            (sum(torch.stack([experts[int(expert_ids[t, j])](g[t, j] * x[t : t + 1])[0] for t in range(T)])
                 for j in range(k)),
             "the gate scales the expert's OUTPUT, not its input: an expert is nonlinear (and has a bias), so "
             "expert(g * x) != g * expert(x); multiply after the experts ran, when combining"),
            (g[:, :1] * y.view(T, k, d)[:, 0],
             "every token has top_k choices: sum gates[t, j] * output over all j, not only the first column"),
            (y.view(T, k, d).sum(1), "weight each expert output by its gate before summing a token's choices"),
            (((y[order] * g.reshape(-1)[:, None])[inverse]).view(T, k, d).sum(1),
             "the gates are in token order: apply gates.reshape(-1) to the rows after unpermuting them (or permute the "
             "gates with the same order as the rows), not to the sorted rows"),
            ((wrong_token[order][inverse].view(T, k, d) * g[..., None]).sum(1) if k > 1 else None,
             "assignment a = t * k + j (expert_ids.reshape(-1) is row-major) belongs to token a // k: take "
             "x[order // k] (or x.repeat_interleave(k, 0)), not x.repeat(k, 1), whose row a is token a % T"),
        ]
    for candidate, hint in candidates:
        if candidate is None or torch.allclose(candidate, expected, **tol):
            continue
        if torch.allclose(got, candidate, **tol):
            return hint
    return None


def sort_dispatch(fn) -> None:
    """Grade ``fn(x, expert_ids, gates, experts) -> out``: ``x`` ``[T, d]``, ``expert_ids`` ``[T, k]`` int64
    (distinct experts per token), ``gates`` ``[T, k]``, ``experts`` a list of ``E`` callables mapping rows
    ``[n, d]`` to ``[n, d]``; ``out[t] = sum_j gates[t, j] * experts[expert_ids[t, j]](x[t])`` ``[T, d]`` in
    ``x``'s dtype, computed by one sort of the assignments by expert, one call per expert on its contiguous
    slice, and the inverse permutation back. Compared with a loop over tokens, forward and gradients (with
    respect to ``x``, ``gates`` and every expert's weights)."""
    import copy

    gen = torch.Generator().manual_seed(7)
    count = 0
    for what, T, d, E, k, dtype, ids in _sort_dispatch_cases():
        tried = f"sort_dispatch({what})"
        if not isinstance(ids, torch.Tensor):
            pool = torch.tensor(list(ids))
            ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(T)])
        x = (torch.randn(T, d, generator=gen, dtype=torch.float64)).to(dtype)
        gates = (torch.rand(T, k, generator=gen, dtype=torch.float64) * 0.9 + 0.1).to(
            torch.float32 if dtype == torch.bfloat16 else dtype)
        experts = [GradedExpert(d, 2 * d, gen, dtype) for _ in range(E)]
        reference = [copy.deepcopy(e).double() for e in experts]
        x64, g64 = x.double().clone().requires_grad_(), gates.double().clone().requires_grad_()
        expected = _loop_reference(x64, ids, g64, reference)
        weight_of_out = torch.randn(T, d, generator=gen, dtype=torch.float64)
        ref_params = [p for e in reference for p in e.parameters()]
        ref_grads = [torch.zeros_like(p) if g is None else g for p, g in zip(
            [x64, g64, *ref_params], torch.autograd.grad((expected * weight_of_out).sum(), [x64, g64, *ref_params],
                                                         allow_unused=True))]  # an expert without tokens: zero
        expected = expected.detach()
        if dtype == torch.bfloat16:
            scale = float(expected.abs().max())
            tol = dict(rtol=3e-2, atol=3e-2 * scale)
        else:
            tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)

        outs = []
        for attempt in (0, 1):
            mine = [copy.deepcopy(e) for e in experts]
            x_in, g_in = x.clone().requires_grad_(), gates.clone().requires_grad_()
            out, copies = call_on_copies(fn, tried + (" (called a second time)" if attempt else ""), x_in, ids, g_in, mine,
                                         return_inputs=True)
            (out,) = results(out, ("out",), tried)
            outs.append((out, copies, mine))
        out, (x_in, _, g_in, _), mine = outs[0]
        if not same_values(out.detach(), outs[1][0].detach()):
            fail(tried + " (called twice)", "a different out on the second call", "the same result for the same input",
                 "does your function keep state between calls, or depend on randomness?")
        _shape_dtype(out, "out", dtype, (T, d), tried,
                     "out: one row per token, [T, d], in x's dtype (gates may be float32 while x is bfloat16: cast the "
                     "combined result back with .to(x.dtype))")
        got = out.detach().double()
        if torch.isnan(got).any():
            fail(tried, "NaN in out", "finite values", "every row of out must be written: a token's row is the sum of its "
                                                       "k weighted expert outputs")
        if not torch.allclose(got, expected, **tol):
            with torch.no_grad():
                hint = _sort_dispatch_mistake(got, x.double(), ids, gates.double(), reference, expected, tol)
            row = int((~torch.isclose(got, expected, **tol)).any(-1).nonzero()[0])
            fail(tried, f"out[{row}] = {[round(v, 4) for v in got[row].tolist()]}",
                 f"{[round(v, 4) for v in expected[row].tolist()]} (the loop over tokens)",
                 hint or "out[t] = sum over j of gates[t, j] * experts[expert_ids[t, j]](x[t]): sort the assignments by "
                         "expert (order = argsort of expert_ids.reshape(-1)), rows = x[order // k], run each expert on its "
                         "slice, put the results back with the inverse permutation, weight by the gates, sum over k")
        routed = torch.bincount(ids.reshape(-1), minlength=E).tolist()
        for e, expert in enumerate(mine):
            if expert.calls > 1:
                fail(tried, f"experts[{e}] called {expert.calls} times ({expert.rows} rows in all)",
                     "each expert called once, on its contiguous slice of the sorted rows (or not at all if it gets none)",
                     "sort the T * k assignments by expert once, cut the sorted rows with .split(counts) (counts = "
                     "torch.bincount(expert_ids.reshape(-1), minlength=len(experts)).tolist()) and call each expert on its "
                     "slice: a loop over tokens calls every expert once per token, T * k small calls instead of E big ones")
            if expert.calls == 1 and expert.rows != routed[e]:
                fail(tried, f"experts[{e}] given {expert.rows} rows", f"{routed[e]} rows: the assignments routed to it",
                     "the slice of expert e is counts[e] consecutive sorted rows (counts from torch.bincount with "
                     "minlength=len(experts), so that experts without tokens get an empty slice and the slices line up)")
        expect_differentiable(out, "out", tried, "build out from x, gates and the experts' outputs with torch operations "
                                                 "(no .detach(), torch.no_grad() or .tolist() of values): training "
                                                 "backpropagates through the dispatch into the router and the experts")
        if dtype == torch.bfloat16:
            count += 1
            continue  # bf16 gradients are too coarse to tell a mistake from rounding; fp32/fp64 cases check them
        params = [p for e in mine for p in e.parameters()]
        grads = torch.autograd.grad(out, [x_in, g_in, *params], grad_outputs=weight_of_out.to(dtype), allow_unused=True)
        names = ["x", "gates"] + [f"experts[{e}].{n}" for e in range(E) for n, _ in mine[e].named_parameters()]
        for name, grad, ref in zip(names, grads, ref_grads):
            if grad is None and ref.abs().max() == 0:
                continue  # an expert without tokens: no gradient is right too
            if grad is None:
                fail(tried, f"no gradient reaches {name}", f"d(out · w)/d {name} of the loop over tokens",
                     "keep every step in autograd: index with tensors (x[order // k], rows[inverse]), no in-place writes "
                     "into a tensor that does not require grad under torch.no_grad(), no .detach()")
            if not torch.allclose(grad.double(), ref, **{k_: v * 10 for k_, v in tol.items()}):
                fail(tried, f"the gradient with respect to {name} differs from the loop's (max |difference| "
                            f"{float((grad.double() - ref).abs().max()):.3g})", "the loop over tokens' gradient",
                     "the forward is right, so something detaches or overwrites part of the graph: gates must multiply the "
                     "expert outputs inside autograd, and the unpermute must be an indexing (or index_copy/scatter out of "
                     "place), not a copy through .data or numpy")
        count += 1
    passed("sort_dispatch", f"equals the loop over tokens, forward and gradients (x, gates, expert weights), on {count} "
                            "inputs: top-1 to every expert, experts without tokens, tied expert ids, one token, bf16; each "
                            "expert called once on its slice")
