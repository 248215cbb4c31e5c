"""labkit.experts and labkit.moe: routers vs torch.topk/softmax, balancing losses vs their formulas, the MoE layer
vs a per-token loop (outputs and gradients, with and without capacity), MoE models training through labkit.train,
published model sizes, expert parallelism over two gloo ranks, the experiment helpers and the widget callback."""
import labkit  # noqa: F401

import dataclasses
import math

import pytest
import torch

from labkit import moe
from labkit.experts import (
    MoEConfig,
    MoELayer,
    active_parameter_count,
    dispatch,
    expert_capacity,
    load_balancing_loss,
    moe_aux_loss,
    moe_layers,
    noisy_top_k_gating,
    router_z_loss,
    softmax_gating,
    switch_gating,
    top_k_gating,
    update_expert_bias,
)
from labkit.model import MOE_PRESETS, PRESETS, ModelConfig, TransformerLM, count_active_parameters, count_parameters, tiny_config

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def logits_of(T=40, E=6, seed=0):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed)) * 2


# ----------------------------------------------------------------------------- routers
@pytest.mark.parametrize("top_k", [1, 2, 6])
@pytest.mark.parametrize("normalize", [True, False])
def test_top_k_gating_matches_topk_of_softmax(top_k, normalize):
    logits = logits_of()
    r = top_k_gating(logits, top_k, normalize=normalize)
    probs = torch.softmax(logits, -1)
    values, indices = torch.topk(probs, top_k, dim=-1)
    assert torch.equal(r.expert_index, indices)
    torch.testing.assert_close(r.scores, probs)
    expected = values / values.sum(-1, keepdim=True) if normalize else values
    torch.testing.assert_close(r.gates, expected)
    if normalize:  # Mixtral's form: softmax over the k chosen logits
        torch.testing.assert_close(r.gates, torch.softmax(torch.topk(logits, top_k, -1).values, -1))
    dense = r.dense_gates()
    assert torch.equal(dense.gather(-1, indices), r.gates) and torch.count_nonzero(dense, dim=-1).max() <= top_k
    assert r.tokens_per_expert().sum() == 40 * top_k


def test_softmax_switch_and_sigmoid_gating():
    logits = logits_of()
    torch.testing.assert_close(softmax_gating(logits), torch.softmax(logits, -1))
    s = switch_gating(logits)
    assert torch.equal(s.expert_index[:, 0], logits.argmax(-1))
    torch.testing.assert_close(s.gates[:, 0], torch.softmax(logits, -1).max(-1).values)
    r = top_k_gating(logits, 2, score="sigmoid")
    sig = torch.sigmoid(logits)
    values, indices = torch.topk(sig, 2, -1)
    assert torch.equal(r.expert_index, indices)
    torch.testing.assert_close(r.gates, values / values.sum(-1, keepdim=True))
    torch.testing.assert_close(r.probs, sig / sig.sum(-1, keepdim=True))


def test_bias_changes_selection_but_not_gate_values():
    logits = logits_of()
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 10.0])  # expert 5 always chosen
    r = top_k_gating(logits, 2, normalize=False, bias=bias)
    assert (r.expert_index == 5).any(-1).all()
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(r.gates, probs.gather(-1, r.expert_index))  # gates from the unbiased scores
    assert torch.equal(top_k_gating(logits, 2, bias=torch.zeros(6)).expert_index, top_k_gating(logits, 2).expert_index)


def test_noisy_top_k_gating_follows_the_paper():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(30, 8, generator=gen)
    w_gate, w_noise = torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen)
    r = noisy_top_k_gating(x, w_gate, w_noise, 2, training=True, generator=torch.Generator().manual_seed(7))
    eps = torch.randn(30, 5, generator=torch.Generator().manual_seed(7))
    H = x @ w_gate.T + eps * torch.nn.functional.softplus(x @ w_noise.T)
    kth = torch.topk(H, 2, -1).values[:, -1:]
    G = torch.softmax(H.masked_fill(H < kth, float("-inf")), -1)  # softmax(KeepTopK(H, k))
    torch.testing.assert_close(r.logits, H)
    torch.testing.assert_close(r.dense_gates(), G)
    clean = noisy_top_k_gating(x, w_gate, w_noise, 2, training=False)
    torch.testing.assert_close(clean.logits, x @ w_gate.T)


# ----------------------------------------------------------------------------- balancing
def test_load_balancing_loss_is_the_switch_formula():
    logits = logits_of(T=50, E=4, seed=1).requires_grad_()
    r = top_k_gating(logits, 2)
    loss = load_balancing_loss(r.probs, r.expert_index, alpha=0.01)
    f = torch.tensor([(r.expert_index == i).sum().item() / (50 * 2) for i in range(4)])
    P = torch.softmax(logits.detach(), -1).mean(0)
    torch.testing.assert_close(loss, 0.01 * 4 * (f * P).sum())
    # f is counts (no gradient); the gradient reaches the probabilities only: dL/dprobs[t, i] = alpha * E * f_i / T
    probs = r.probs.detach().requires_grad_()
    load_balancing_loss(probs, r.expert_index, alpha=0.01).backward()
    torch.testing.assert_close(probs.grad, (0.01 * 4 * f / 50).expand(50, 4))
    # perfectly balanced -> alpha; collapsed onto one expert with certainty -> alpha * E
    uniform = torch.full((8, 4), 0.25)
    assert load_balancing_loss(uniform, torch.arange(8).remainder(4)[:, None], alpha=1.0).item() == pytest.approx(1.0)
    onehot = torch.nn.functional.one_hot(torch.zeros(8, dtype=torch.long), 4).float()
    assert load_balancing_loss(onehot, torch.zeros(8, 1, dtype=torch.long), alpha=1.0).item() == pytest.approx(4.0)


def test_router_z_loss_is_the_st_moe_formula():
    logits = logits_of(seed=2)
    expected = 1e-3 * sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 40
    assert router_z_loss(logits).item() == pytest.approx(expected, rel=1e-5)
    assert router_z_loss(logits, weight=1.0).item() == pytest.approx(expected * 1e3, rel=1e-5)


def test_bias_balancing_evens_out_a_skewed_router():
    # DeepSeek-V3's form: sigmoid affinities, top-k of (affinity + bias), bias moved by +-rate each step
    logits = logits_of(T=512, E=8, seed=3) + torch.linspace(3, -3, 8)  # the router prefers low experts
    bias = torch.zeros(8)

    def imbalance():
        counts = top_k_gating(logits, 2, score="sigmoid", bias=bias).tokens_per_expert().float()
        return (counts.max() / counts.mean()).item()

    before = imbalance()
    for _ in range(200):
        update_expert_bias(bias, top_k_gating(logits, 2, score="sigmoid", bias=bias).tokens_per_expert(), rate=0.01)
    assert before > 2.5 and imbalance() < 1.2
    assert bias[0] < 0 < bias[-1]  # the favourite was pushed down, the starved expert up


def test_bias_rule_moves_by_rate_against_the_load_error():
    bias = torch.zeros(3)
    update_expert_bias(bias, torch.tensor([10, 5, 0]), rate=0.5)
    assert bias.tolist() == [-0.5, 0.0, 0.5]


# ----------------------------------------------------------------------------- dispatch and capacity
def python_dispatch(routing, capacity, priority):
    """Per expert, the assignments it keeps, by a plain sort: [(token, slot j)] sorted by expert, then priority."""
    T, k = routing.expert_index.shape
    per_expert = {}
    for t in range(T):
        for j in range(k):
            e, g = int(routing.expert_index[t, j]), float(routing.gates[t, j])
            key = (-g, t * k + j) if priority == "gate" else (j, t)
            per_expert.setdefault(e, []).append((key, t, j))
    kept = []
    for e in sorted(per_expert):
        chosen = sorted(per_expert[e])
        chosen = chosen if capacity is None else chosen[:capacity]
        kept.extend((t, j) for _, t, j in chosen)
    return kept


@pytest.mark.parametrize("capacity", [None, 0, 3, 9])
@pytest.mark.parametrize("priority", ["gate", "order"])
def test_dispatch_keeps_by_priority(capacity, priority):
    routing = top_k_gating(logits_of(T=30, E=4, seed=4) + torch.tensor([2.0, 0, 0, -1]), 2)
    plan = dispatch(routing, capacity, priority)
    got = list(zip(plan.token.tolist(), (plan.slot % 2).tolist()))
    expected = python_dispatch(routing, capacity, priority)
    if capacity is None:  # dropless: order within an expert is token order, the set is everything
        assert sorted(got) == sorted(expected) and plan.num_dropped == 0
    else:
        assert got == expected
    assert plan.group_sizes.sum().item() == len(expected) == plan.token.numel()
    assert plan.routed_per_expert.tolist() == routing.tokens_per_expert().tolist()
    assert plan.dropped_fraction == pytest.approx(1 - len(expected) / 60)


def test_expert_capacity():
    assert expert_capacity(1024, 8, 2, 1.0) == 256
    assert expert_capacity(1000, 8, 2, 1.25) == math.ceil(1.25 * 2000 / 8)
    assert expert_capacity(7, 8, 1, None) is None
    # exact: 1.1 * 100 * 1 / 10 is 11.000000000000002 in floats, whose ceil is 12
    assert expert_capacity(100, 10, 1, 1.1) == 11
    assert expert_capacity(300, 100, 1, 1.1) == 4 and expert_capacity(30, 10, 1, 0.7) == 3  # 3.3 -> 4; 2.1 -> 3


@pytest.mark.parametrize("args, name", [((100, 10, 1, -1.0), "capacity_factor"), ((100, 10, 1, 0.0), "capacity_factor"),
                                        ((100, 10, 1, float("inf")), "capacity_factor"), ((100, 0, 1, 1.0), "num_experts"),
                                        ((100, 10, 0, 1.0), "top_k"), ((-1, 10, 1, 1.0), "num_tokens")])
def test_expert_capacity_rejects_what_the_layer_rejects(args, name):
    with pytest.raises(ValueError, match=name):
        expert_capacity(*args)
    if name == "capacity_factor":
        with pytest.raises(ValueError, match=name):
            MoELayer(8, 8, 4, 1, capacity_factor=args[3])


# ----------------------------------------------------------------------------- the layer vs a per-token loop
def loop_reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Token by token: pick the top-k experts, keep an assignment only if it is among its expert's
    `capacity` highest-gate ones, add gate * SwiGLU_e(token) over the kept ones (fp32 math), plus the shared experts."""
    flat = x.reshape(-1, layer.d_model)
    T, E, k = flat.shape[0], layer.num_experts, layer.top_k
    logits = flat.float() @ layer.router.weight.float().T
    scores = torch.softmax(logits, -1) if layer.score == "softmax" else torch.sigmoid(logits)
    choices = []
    for t in range(T):
        gates, experts = torch.topk(scores[t] + layer.expert_bias, k).values, torch.topk(scores[t] + layer.expert_bias, k).indices
        gates = scores[t, experts]
        if layer.normalize_gates:
            gates = gates / gates.sum()
        choices.append((experts.tolist(), gates))
    capacity = None if layer.capacity_factor is None else math.ceil(layer.capacity_factor * T * k / E)
    keep = set()
    for e in range(E):
        assigned = sorted((-float(g[j].detach()), t * k + j) for t, (ex, g) in enumerate(choices) for j in range(k) if ex[j] == e)
        keep.update(a for _, a in (assigned if capacity is None else assigned[:capacity]))
    w = layer.experts
    rows = []
    for t, (experts, gates) in enumerate(choices):
        xt = flat[t].float()
        out = torch.zeros(layer.d_model)
        for j, e in enumerate(experts):
            if t * k + j in keep:
                h = torch.nn.functional.silu(w.w1[e].float() @ xt) * (w.w3[e].float() @ xt)
                out = out + gates[j] * (w.w2[e].float() @ h)
        if layer.shared_experts is not None:
            s = layer.shared_experts
            out = out + s.w2.weight.float() @ (torch.nn.functional.silu(s.w1.weight.float() @ xt) * (s.w3.weight.float() @ xt))
        rows.append(out)
    return torch.stack(rows).view(x.shape)


LAYERS = [
    dict(num_experts=4, top_k=2),
    dict(num_experts=4, top_k=2, capacity_factor=0.75),
    dict(num_experts=6, top_k=1, capacity_factor=1.0, normalize_gates=False),
    dict(num_experts=5, top_k=3, num_shared_experts=1, score="sigmoid", capacity_factor=1.25),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs", LAYERS)
def test_layer_equals_the_per_token_loop(kwargs, dtype):
    torch.manual_seed(0)
    layer = MoELayer(16, 24, **kwargs, dtype=dtype).eval()
    x = torch.randn(2, 15, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == dtype
    torch.testing.assert_close(y.float(), loop_reference(layer, x), **TOL[dtype])
    if kwargs.get("capacity_factor", 1) < 1:
        assert layer.stats.dropped_fraction > 0


def test_tokens_dropped_from_every_expert_leave_the_layer_unchanged():
    torch.manual_seed(0)
    layer = MoELayer(16, 24, num_experts=4, top_k=1, capacity_factor=0.25).eval()
    x = torch.randn(40, 16)
    y = layer(x)
    plan = layer.last_dispatch
    dropped = torch.ones(40, dtype=torch.bool)
    dropped[plan.token] = False
    assert dropped.sum() == 40 - plan.token.numel() > 0
    assert torch.count_nonzero(y[dropped]) == 0  # the block's residual carries these tokens past the layer
    assert plan.group_sizes.max() <= expert_capacity(40, 4, 1, 0.25)


@pytest.mark.parametrize("kwargs", [dict(num_experts=4, top_k=2), dict(num_experts=4, top_k=2, capacity_factor=0.75, num_shared_experts=1)])
def test_gradients_through_gates_and_experts_match_autograd_of_the_loop(kwargs):
    torch.manual_seed(0)
    layer = MoELayer(16, 24, **kwargs, aux_loss_weight=0.01, z_loss_weight=1e-3)
    reference = MoELayer(16, 24, **kwargs)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(1))
    g = torch.randn(20, 16, generator=torch.Generator().manual_seed(2))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (layer(xa) * g).sum().backward()  # training mode: the aux and z losses ride along the gradient
    logits = xb @ reference.router.weight.T
    probs = torch.softmax(logits, -1)
    index = torch.topk(probs, 2, -1).indices
    f = torch.stack([(index == i).sum() / index.numel() for i in range(4)])
    aux = 0.01 * 4 * (f * probs.mean(0)).sum() + 1e-3 * torch.logsumexp(logits, -1).pow(2).mean()
    ((loop_reference(reference, xb) * g).sum() + aux).backward()
    torch.testing.assert_close(xa.grad, xb.grad, **TOL[torch.float32])
    for (name, p), q in zip(layer.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, **TOL[torch.float32], msg=name)
    torch.testing.assert_close(layer.aux_loss, aux.detach())


def test_attached_aux_loss_gives_the_gradient_of_the_explicit_sum():
    torch.manual_seed(0)
    a = MoELayer(16, 24, 4, 2, z_loss_weight=1e-3)
    b = MoELayer(16, 24, 4, 2, z_loss_weight=1e-3, attach_aux_loss=False)
    b.load_state_dict(a.state_dict())
    x = torch.randn(30, 16)
    a(x).pow(2).mean().backward()
    (b(x).pow(2).mean() + moe_aux_loss(b)).backward()
    torch.testing.assert_close(a.router.weight.grad, b.router.weight.grad)


def test_stats_and_bias_updates_in_training_only():
    torch.manual_seed(0)
    layer = MoELayer(16, 24, 4, 1, bias_update_rate=0.1, aux_loss_weight=0.0)
    with torch.no_grad():
        layer.router.weight[0] += 2.0  # skewed towards expert 0
    x = torch.randn(64, 16)
    layer.eval()
    layer(x)
    assert torch.count_nonzero(layer.expert_bias) == 0 and layer.aux_loss is None
    stats = layer.stats.as_dict()
    assert sum(stats["tokens_per_expert"]) == 64 and stats["dropped_fraction"] == 0.0
    assert 0 < stats["router_entropy"] < math.log(4) and stats["load_imbalance"] >= 1
    layer.train()
    layer(x)
    first = layer.stats.load_imbalance
    for _ in range(30):
        layer(x)
    assert layer.expert_bias[0] < 0 and layer.stats.load_imbalance < first


# ----------------------------------------------------------------------------- in the model
def test_moe_config_every_kth_layer_and_first_dense():
    cfg = tiny_config(15, num_layers=6, moe=MoEConfig(num_experts=4, every=2, first_dense=1))
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]
    model = TransformerLM(cfg)
    assert [type(layer.ffn).__name__ for layer in model.layers] == ["GLU", "GLU", "MoELayer", "GLU", "MoELayer", "GLU"]
    keys = [k for k in model.state_dict() if k.startswith("layers.2.ffn")]
    assert keys == ["layers.2.ffn.expert_bias", "layers.2.ffn.router.weight", "layers.2.ffn.experts.w1",
                    "layers.2.ffn.experts.w2", "layers.2.ffn.experts.w3"]
    assert ModelConfig(**dataclasses.asdict(cfg)) == cfg  # a saved config (asdict) loads back
    assert count_active_parameters(cfg) == model.num_params() - 2 * (4 - 2) * 3 * 64 * 172
    dense = tiny_config(15)
    assert count_active_parameters(dense) == count_parameters(dense) and dense.moe is None


@pytest.mark.parametrize("moe_cfg, error, words", [
    (dict(num_experts=0), ValueError, "num_experts=0"),
    (dict(num_experts=4, top_k=5), ValueError, "top_k=5"),
    (dict(num_experts=4, capacity_factor=0), ValueError, "capacity_factor=0"),
    (dict(num_experts=4, score="relu"), ValueError, "score='relu'"),
    (dict(num_experts=4, priority="random"), ValueError, "priority='random'"),
    (dict(num_experts=4, aux_loss_weight=-1), ValueError, "aux_loss_weight=-1"),
    (dict(num_experts=4, first_dense=-1), ValueError, "first_dense=-1"),
    (dict(num_experts=4, num_shared_experts=-1), ValueError, "num_shared_experts=-1"),
])
def test_bad_moe_configs_are_named(moe_cfg, error, words):
    with pytest.raises(error, match=words):
        MoEConfig(**moe_cfg)


def test_bad_layer_and_model_arguments_are_named():
    with pytest.raises(ValueError, match="top_k=0"):
        MoELayer(16, 24, 4, 0)
    with pytest.raises(ValueError, match="d_ff=0"):
        MoELayer(16, 0, 4, 2)
    with pytest.raises(ValueError, match="x: last dim must be d_model=16"):
        MoELayer(16, 24, 4, 2)(torch.randn(3, 8))
    with pytest.raises(TypeError, match="moe: expected a labkit.experts.MoEConfig"):
        tiny_config(15, moe="mixtral")
    with pytest.raises(ValueError, match="moe: first_dense=2"):
        tiny_config(15, num_layers=2, moe=MoEConfig(num_experts=4, first_dense=2))
    with pytest.raises(ValueError, match="top_k=3: expected an integer from 1"):
        top_k_gating(logits_of(E=2), 3)
    with pytest.raises(TypeError, match="logits: expected a floating-point"):
        top_k_gating(torch.zeros(3, 4, dtype=torch.long), 1)
    with pytest.raises(ValueError, match=r"bias: expected a tensor of shape \(6,\)"):
        top_k_gating(logits_of(), 1, bias=torch.zeros(5))
    with pytest.raises(ValueError, match="capacity=-1"):
        dispatch(top_k_gating(logits_of(), 1), -1)
    with pytest.raises(ValueError, match="w_noise: expected"):
        noisy_top_k_gating(torch.randn(3, 8), torch.randn(4, 8), torch.randn(4, 7), 1)


def test_train_loop_trains_an_moe_model_with_its_aux_loss():
    from labkit.train import TrainConfig, train

    task = moe.experiment_task()
    cfg = moe.experiment_config(task.vocab_size, moe=MoEConfig(num_experts=4, top_k=2, bias_update_rate=1e-2, z_loss_weight=1e-3))
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    seen = []
    history = train(model, task.tokens("train"), None, TrainConfig(steps=6, batch_size=8, context_length=16, warmup_iters=1),
                    progress=False, callback=lambda step, loss: seen.append(moe_aux_loss(model).item()))
    assert len(history.train_loss) == 6 and all(math.isfinite(v) for v in history.train_loss + seen)
    assert all(v > 0 for v in seen)
    assert all(torch.count_nonzero(m.expert_bias) > 0 for m in moe_layers(model))  # nudged every training step


# ----------------------------------------------------------------------------- published sizes
@pytest.mark.parametrize("name, total, active", [("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9)])
def test_moe_presets_match_the_published_sizes(name, total, active):
    cfg = MOE_PRESETS[name]
    assert count_parameters(cfg) == pytest.approx(total, rel=0.005)
    assert count_active_parameters(cfg) == pytest.approx(active, rel=0.02)
    assert name not in PRESETS  # chapter 03 tabulates every dense preset


def test_deepseek_v3_count_and_its_moe_layer_built_on_meta():
    ds = moe.deepseek_v3_counts()
    assert ds["total"] == pytest.approx(671e9, rel=0.005) and ds["active"] == pytest.approx(37e9, rel=0.02)
    assert ds["moe_layer_matches"] and ds["moe_layer_built"] == ds["moe_layer_formula"]
    table = {row["model"]: row for row in moe.moe_parameter_table()}
    assert set(table) == {"mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"}
    for row in table.values():
        assert row["total"] == pytest.approx(row["published_total"], rel=0.005)
        assert row["active"] == pytest.approx(row["published_active"], rel=0.02)


def test_active_parameters_of_a_layer():
    layer = MoELayer(16, 24, num_experts=8, top_k=2, num_shared_experts=1)
    total = sum(p.numel() for p in layer.parameters())
    assert active_parameter_count(layer) == total - 6 * 3 * 16 * 24
    assert moe.ffn_flops_per_token(16, 24, 8, 2) == 2 * 3 * 16 * 24 * 2 + 2 * 16 * 8


# ----------------------------------------------------------------------------- expert parallelism
def test_expert_parallel_layer_equals_the_local_layer():
    from labkit.dist import launch

    cases = [dict(), dict(capacity_factor=0.75, num_shared_experts=1, top_k=1, seed=3)]
    results = launch(moe.expert_parallel_cases, world_size=2, backend="gloo", quiet=True, cases=cases)
    for c in range(len(cases)):
        per_rank = [results[r][c] for r in range(2)]
        for r in per_rank:
            # outputs are sums of a few products; weight gradients sum over every rank's tokens in another order
            for key, tol in (("output_max_diff", 1e-5), ("input_grad_max_diff", 1e-5), ("expert_grad_max_diff", 1e-4),
                             ("router_grad_max_diff", 1e-4)):
                assert r[key] < tol, (cases[c], key, r[key])
        assert per_rank[0]["local_experts"] == [0, 1] and per_rank[1]["local_experts"] == [2, 3]
        ex = [r["exchange"] for r in per_rank]
        # what one rank sends in the dispatch, the other receives; the combine sends it back
        assert ex[0]["dispatch_sent"] == ex[1]["dispatch_received"] == ex[1]["combine_sent"] == ex[0]["combine_received"]
        assert ex[0]["dispatch_sent"] > 0 and ex[0]["counts_sent"] == 2 * 8
        row = 32 * 4  # d_model fp32 values
        assert ex[0]["dispatch_sent"] % row == 0
        assert ex[0]["total_sent"] == ex[0]["counts_sent"] + ex[0]["dispatch_sent"] + ex[0]["combine_sent"]


# ----------------------------------------------------------------------------- experiments and the widget
def test_mixed_task_labels_every_token_with_its_op():
    task = moe.MixedArithmeticTask(num_digits=1)
    tokens, ops = task.tokens_and_ops("train")
    assert len(tokens) == len(ops)
    text = task.tokenizer.decode(tokens[:200])
    examples = text.split(";")[:-1]
    position = 0
    for example in examples:
        op_char = next(c for c in example if c in "+-*")
        assert set(ops[position : position + len(example) + 1].tolist()) == {task.ops.index(op_char)}
        position += len(example) + 1
    assert {len(task.examples(s)) for s in ("train",)} == {3 * len(task.tasks[0].pairs("train"))}


def router_grad_norms_from_lm_loss(normalize_gates: bool) -> list[float]:
    """Each MoE layer's router-weight gradient norm from the cross-entropy alone (no balancing loss), top-1."""
    from labkit.train import cross_entropy

    task = moe.experiment_task()
    torch.manual_seed(0)
    config = moe.experiment_config(task.vocab_size, 32, MoEConfig(num_experts=8, top_k=1, normalize_gates=normalize_gates,
                                                                  aux_loss_weight=0.0))
    model = TransformerLM(config)
    (x, y), = moe.fixed_batches(task.tokens("train"), batches=1, batch_size=8)
    cross_entropy(model(x), y).backward()
    return [float(m.router.weight.grad.norm()) for m in moe_layers(model)]


def test_top1_router_learns_from_the_lm_loss_only_with_switchs_unnormalised_gate():
    # renormalised, a single gate is p / p = 1 whatever the logits: the LM loss reaches the router only through
    # the gate's value, so it sends (up to rounding) nothing
    switch, renormalised = router_grad_norms_from_lm_loss(False), router_grad_norms_from_lm_loss(True)
    assert min(switch) > 1e-3, switch
    assert max(renormalised) < 1e-6 * min(switch), (renormalised, switch)
    # so the chapter's top-1 experiments keep the gate, its top-k ones renormalise
    assert moe.experiment_moe(8, 1).normalize_gates is False and moe.experiment_moe(8, 2).normalize_gates is True


def test_experiment_helpers_return_what_the_chapter_plots():
    d = moe.dense_vs_moe(steps=3)
    assert d["dense"]["ffn_flops_per_token"] <= d["moe"]["ffn_flops_per_token"] <= 1.1 * d["dense"]["ffn_flops_per_token"]
    assert d["moe"]["params"] > 2 * d["dense"]["params"] > d["moe"]["active_params"]
    assert len(d["moe"]["train_loss"]) == 3
    b = moe.balancing_experiment(steps=3)
    assert set(b) == set(moe.BALANCING)
    for r in b.values():
        assert not any(m.normalize_gates for m in moe_layers(r["model"]))  # top-1: Switch's gate
        assert r["utilisation"].shape == (3, 8)
        torch.testing.assert_close(r["utilisation"].sum(1), torch.ones(3))
    s = moe.specialisation_experiment(steps=3)
    assert not any(m.normalize_gates for m in moe_layers(s["model"]))
    assert s["routing"].shape == (2, 3, 4) and len(s["specialisation"]) == 2
    assert s["routing_by_token"].shape == (2, 15, 4) and len(s["token_specialisation"]) == 2 and len(s["vocab"]) == 15
    torch.testing.assert_close(s["routing_answers"].sum(-1), torch.ones(2, 3))
    rows = moe.capacity_experiment(capacity_factors=(0.25, 1.0, None), model=b["none"]["model"])
    assert [r["capacity_factor"] for r in rows] == [0.25, 1.0, None]
    assert rows[0]["dropped_fraction"] > rows[1]["dropped_fraction"] >= rows[2]["dropped_fraction"] == 0.0
    assert rows[0]["capacity"] == 32  # 1024 tokens, top-1 of 8 experts, factor 0.25


def test_mutual_information():
    assert moe.mutual_information_bits(torch.eye(3)) == pytest.approx(math.log2(3))
    assert moe.mutual_information_bits(torch.full((3, 4), 0.25)) == pytest.approx(0.0, abs=1e-7)


def test_routing_explorer():
    r = moe.routing_explorer(num_experts=8, top_k=2, capacity_factor=1.0, balance_weight=0.0, skew=2.0)
    assert sum(r["tokens_per_expert"]) == 512 * 2 and r["capacity"] == 128
    assert all(k <= 128 for k in r["kept_per_expert"])
    assert sum(r["dropped_per_expert"]) == pytest.approx(r["dropped_fraction"] * 1024)
    assert r["tokens_per_expert"] == r["tokens_per_expert_before"] and r["load_imbalance"] > 2
    balanced = moe.routing_explorer(8, 2, 1.0, balance_weight=1.0, skew=2.0)
    assert balanced["load_imbalance"] < r["load_imbalance"] and balanced["dropped_fraction"] < r["dropped_fraction"]
    assert balanced["aux_loss_history"][-1] < balanced["aux_loss_history"][0]
    flat = moe.routing_explorer(4, 1, None, 0.0, skew=0.0)
    assert flat["dropped_fraction"] == 0.0 and flat["capacity"] is None and flat["gates"].shape == (32, 4)
    assert 0 < flat["router_entropy"] <= flat["max_entropy"] == pytest.approx(math.log(4))


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_experts=0), "num_experts=0"),
    (dict(top_k=9), "top_k=9"),
    (dict(capacity_factor=-1.0), "capacity_factor=-1.0"),
    (dict(balance_weight=-0.5), "balance_weight=-0.5"),
    (dict(skew=float("nan")), "skew=nan"),
])
def test_routing_explorer_names_bad_arguments(kwargs, words):
    args = dict(num_experts=8, top_k=2, capacity_factor=1.0, balance_weight=0.0, skew=1.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=words):
        moe.routing_explorer(**args)


def deepseek_v3_gate(logits, bias, top_k, groups, top_groups, scale):
    """DeepSeek-V3's MoEGate (modeling_deepseek.py, noaux_tc), transcribed token by token in Python."""
    chosen, weights = [], []
    for row in logits.double().tolist():
        scores = [1 / (1 + math.exp(-v)) for v in row]
        select = [s + b for s, b in zip(scores, bias.tolist())]
        size = len(row) // groups
        group_score = [sum(sorted(select[g * size:(g + 1) * size], reverse=True)[: top_k // top_groups]) for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -group_score[g])[:top_groups]
        allowed = [e for e in range(len(row)) if e // size in best]
        experts = sorted(allowed, key=lambda e: -select[e])[:top_k]
        total = sum(scores[e] for e in experts)
        chosen.append(sorted(experts))
        weights.append({e: scores[e] / total * scale for e in experts})
    return chosen, weights


def test_group_limited_routing_is_deepseek_v3s_gate():
    gen = torch.Generator().manual_seed(3)
    logits, bias = torch.randn(64, 32, generator=gen), torch.randn(32, generator=gen) * 0.1
    r = top_k_gating(logits, 4, score="sigmoid", bias=bias, groups=4, top_groups=2, scale=2.5)
    chosen, weights = deepseek_v3_gate(logits, bias, 4, 4, 2, 2.5)
    assert r.expert_index.sort(-1).values.tolist() == chosen
    for t in range(64):
        for e, g in zip(r.expert_index[t].tolist(), r.gates[t].tolist()):
            assert g == pytest.approx(weights[t][e], rel=1e-5)
    assert all(len(set((row // 8).tolist())) <= 2 for row in r.expert_index)
    # one group and no scale: plain top-k
    assert torch.equal(top_k_gating(logits, 4, groups=1).expert_index, top_k_gating(logits, 4).expert_index)


@pytest.mark.parametrize("kwargs, name", [(dict(groups=5), "groups"), (dict(groups=4, top_groups=5), "top_groups"),
                                          (dict(groups=8, top_groups=1), "top_k"), (dict(scale=0.0), "scale"),
                                          (dict(scale=float("nan")), "scale")])
def test_group_limited_routing_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        top_k_gating(torch.randn(3, 32), 6, **kwargs)


# ----------------------------------------------------------------------------- expert choice, roundoff, decoding
def test_expert_choice_gating_is_each_experts_top_c_tokens():
    logits = logits_of(T=50, E=5, seed=3)
    chosen = moe.expert_choice_gating(logits, 12)
    probs = torch.softmax(logits, -1)
    for e in range(5):  # reference: every expert sorts the tokens by its score, a plain loop
        ranked = sorted(range(50), key=lambda t: -float(probs[t, e]))[:12]
        assert chosen.token_index[e].tolist() == ranked
        torch.testing.assert_close(chosen.gates[e], probs[ranked, e])
    per_token = [sum(t in chosen.token_index[e].tolist() for e in range(5)) for t in range(50)]
    assert chosen.experts_per_token().tolist() == per_token and sum(per_token) == 5 * 12
    sets = chosen.expert_sets()
    assert sets.shape == (50, 5) and sets.sum(0).tolist() == [12] * 5 and sets.sum(1).tolist() == per_token
    for bad in (0, 51, 2.5, True):
        with pytest.raises(ValueError, match="capacity"):
            moe.expert_choice_gating(logits, bad)


def test_router_roundoff_against_hand_rounded_logits():
    # bf16 has 8 significant bits: at 100 its spacing is 0.5, so 100.3 rounds to 100.5; at 200 (scale 2) it is 1,
    # so 200.6 rounds to 201
    logits = torch.tensor([[100.0, 100.3]])
    one, two = moe.router_roundoff(logits, scales=(1, 2))
    for row, exact_gap, rounded_gap, spacing in ((one, 0.3, 0.5, 0.5), (two, 0.6, 1.0, 1.0)):
        exact_p, rounded_p = 1 / (1 + math.exp(-exact_gap)), 1 / (1 + math.exp(-rounded_gap))
        assert row["logit_spacing"] == spacing and row["changed_fraction"] == 0.0
        assert row["gate_relative_error"] == pytest.approx(abs(rounded_p - exact_p) / exact_p, rel=1e-4)
        lse = row["scale"] * 100.3 + math.log1p(math.exp(-exact_gap))
        assert row["logsumexp"] == pytest.approx(lse, rel=1e-6) and row["z_loss"] == pytest.approx(lse**2, rel=1e-5)
    with pytest.raises(ValueError, match="scales"):
        moe.router_roundoff(logits, scales=(1, -2))


def test_expected_distinct_experts_matches_enumeration_and_simulation():
    import itertools

    pairs = list(itertools.combinations(range(4), 2))  # every top-2 choice among 4 experts, equally likely
    exact = sum(len(set(itertools.chain(*steps))) for steps in itertools.product(pairs, repeat=3)) / len(pairs) ** 3
    assert moe.expected_distinct_experts(4, 2, 3) == pytest.approx(exact, rel=1e-12)
    gen = torch.Generator().manual_seed(0)
    picks = torch.rand(20000, 8, 8, generator=gen).topk(2, dim=-1).indices  # 20000 batches of 8 tokens, top-2 of 8
    used = torch.zeros(20000, 8, dtype=torch.bool).scatter_(1, picks.reshape(20000, 16), True).sum(1).float().mean()
    assert moe.expected_distinct_experts(8, 2, 8) == pytest.approx(float(used), abs=0.03)
    assert moe.expected_distinct_experts(8, 2, 1) == 2 and moe.expected_distinct_experts(8, 8, 5) == 8
    for kwargs, name in ((dict(num_experts=0, top_k=1, tokens=1), "num_experts"), (dict(num_experts=4, top_k=5, tokens=1), "top_k"),
                         (dict(num_experts=4, top_k=1, tokens=0), "tokens")):
        with pytest.raises(ValueError, match=name):
            moe.expected_distinct_experts(**kwargs)


def test_decode_weight_reads_counts_every_weight_of_a_small_moe():
    config = ModelConfig(vocab_size=50, context_length=16, d_model=16, num_layers=3, num_heads=2, d_ff=24,
                         moe=MoEConfig(num_experts=6, top_k=2, d_ff=8, every=1, first_dense=1, num_shared_experts=1))
    model = TransformerLM(config, device="meta")
    expert_weights = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    other = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n) + 2 * 6  # + the bias buffers
    total, active = count_parameters(config) + 2 * 6, None
    active = total - 2 * (6 - 2) * 3 * 16 * 8
    table = [dict(model="small", experts=6, top_k=2, total=total, active=active)]
    rows = moe.decode_weight_reads(table, batch_sizes=(1, 3, 1000), bytes_per_param=2)
    assert expert_weights == 2 * 6 * 3 * 16 * 8
    for row in rows:
        assert row["expert_params"] == 2 * 3 * 16 * 8 and row["other_params"] == other
        read = moe.expected_distinct_experts(6, 2, row["batch"])
        assert row["bytes"] == pytest.approx(2 * (other + read * row["expert_params"]))
        assert row["tokens_per_expert"] == pytest.approx(row["batch"] * 2 / read)
        assert row["compute_bound_batch"] == math.ceil(989.5 / 3.35 * 6 / 2)
    assert rows[0]["bytes"] == 2 * active and rows[2]["bytes"] == pytest.approx(2 * total)
    with pytest.raises(ValueError, match="table"):
        moe.decode_weight_reads([dict(table[0], active=active + 1)])
    with pytest.raises(ValueError, match="gpu"):
        moe.decode_weight_reads(table, gpu="TPU")
    with pytest.raises(ValueError, match="batch_sizes"):
        moe.decode_weight_reads(table, batch_sizes=(0,))


def test_decode_distinct_experts_and_fixed_batch_routing_against_a_loop():
    task = moe.experiment_task()
    torch.manual_seed(0)
    model = TransformerLM(moe.experiment_config(task.vocab_size, 32, MoEConfig(num_experts=8, top_k=2, d_ff=16)))
    routings = moe.fixed_batch_routing(model)
    assert len(routings) == 2 and routings[0].expert_index.shape == (1024, 2)
    rows = moe.decode_distinct_experts(model, batch_sizes=(1, 4, 32))
    assert rows[0]["measured"] == 2.0
    for row in rows:
        B = row["batch"]
        counts = [len({int(e) for i in range(B) for e in r.expert_index[((g * B + i) * 32 + p)]})
                  for r in routings for g in range(32 // B) for p in range(32)]
        assert row["measured"] == pytest.approx(sum(counts) / len(counts))
        assert row["uniform"] == moe.expected_distinct_experts(8, 2, B)
    with pytest.raises(ValueError, match="batch_sizes"):
        moe.decode_distinct_experts(model, batch_sizes=(3,))
    with pytest.raises(ValueError, match="MoE"):
        moe.fixed_batch_routing(TransformerLM(moe.experiment_config(task.vocab_size, 32)))


def test_capacity_experiment_drops_by_priority():
    task = moe.experiment_task()
    torch.manual_seed(0)
    model = TransformerLM(moe.experiment_config(task.vocab_size, 32, MoEConfig(num_experts=8, top_k=2, d_ff=16)))
    order, gate = (moe.capacity_experiment(capacity_factors=(0.5,), model=model, priority=p)[0] for p in ("order", "gate"))
    for row in (order, gate):
        assert row["dropped_fraction"] == pytest.approx(sum(row["dropped_by_quarter"]) / 4)
        assert row["dropped_fraction"] == pytest.approx(sum(row["dropped_by_choice"]) / 2)
    # the capacity fixes how many (not exactly: what the first MoE layer drops changes the second one's inputs)
    assert order["dropped_fraction"] == pytest.approx(gate["dropped_fraction"], abs=0.01)
    assert order["dropped_by_choice"][0] < order["dropped_by_choice"][1]
    assert order["dropped_by_quarter"] == sorted(order["dropped_by_quarter"]) and order["dropped_by_quarter"][0] < order["dropped_by_quarter"][3]
    assert all(m.priority == "gate" and m.capacity_factor is None for m in moe_layers(model))  # restored
    with pytest.raises(ValueError, match="priority"):
        moe.capacity_experiment(model=model, priority="first")


def test_seed_band_by_hand():
    band = moe.seed_band([[1, 2, 3, 4], [3, 2, 1, 0]], window=2)
    assert band["step"].tolist() == [1, 2, 3, 4]
    assert band["mean"].tolist() == [2, 2, 2, 2]
    assert band["low"].tolist() == [1, 1.5, 1.5, 0.5] and band["high"].tolist() == [3, 2.5, 2.5, 3.5]
    for bad, name in (([[]], "curves"), ([1, 2], "curves")):
        with pytest.raises(ValueError, match=name):
            moe.seed_band(bad)
    with pytest.raises(ValueError, match="window"):
        moe.seed_band([[1.0]], window=0)


def test_grouped_gemm_plan_counts_tiles_padding_and_the_alternatives():
    plan = moe.grouped_gemm_plan(torch.tensor([37, 0, 5, 64, 1, 21]), 40, 16, 32)
    assert plan["grid"] == (3 + 0 + 1 + 4 + 1 + 2, 2) and len(plan["programs"]) == 22
    assert plan["rows"] == 128 and plan["tile_rows"] == 11 * 16 and plan["padded_rows"] == 48
    assert plan["bmm_rows"] == 6 * 64 and plan["bmm_padded_rows"] == 6 * 64 - 128 and plan["loop_launches"] == 5
    first, last = plan["programs"][0], plan["programs"][-1]
    assert first == dict(program=(0, 0), expert=0, rows=(0, 16), cols=(0, 32), padded_rows=0)
    assert last == dict(program=(10, 1), expert=5, rows=(123, 128), cols=(32, 40), padded_rows=11)
    assert all(p["expert"] != 1 for p in plan["programs"])  # an expert without rows owns no tile
    covered = sorted((r, c) for p in plan["programs"] for r in range(*p["rows"]) for c in range(*p["cols"]))
    assert covered == [(r, c) for r in range(128) for c in range(40)]  # every output cell once
    assert moe.grouped_gemm_plan([0, 0], 8, 4, 4)["grid"] == (0, 2)
    with pytest.raises(ValueError, match="group_sizes"):
        moe.grouped_gemm_plan([3, -1], 8, 4, 4)
    with pytest.raises(ValueError, match="block_m"):
        moe.grouped_gemm_plan([3, 1], 8, 0, 4)


def test_granularity_configs_recut_the_same_expert_units():
    for config in moe.granularity_configs().values():
        m = config.moe
        assert (m.num_experts + m.num_shared_experts) * m.d_ff == 8 * 16  # section 1.1's 8 experts of 16
        assert (m.top_k + m.num_shared_experts) * m.d_ff == 2 * 16  # and its 2 per token
    with pytest.raises(ValueError, match="d_ff"):
        moe.granularity_configs(d_ff=20)


def test_train_variants_in_processes_equal_one_after_the_other():
    configs = moe.granularity_configs()
    side_by_side = moe.train_variants(configs, steps=3)
    in_turn = moe.train_variants(configs, steps=3, parallel=False)
    assert list(side_by_side) == list(configs)
    for name in configs:
        assert side_by_side[name]["train_loss"] == in_turn[name]["train_loss"]
        assert side_by_side[name]["final_loss"] == in_turn[name]["final_loss"]
        assert side_by_side[name]["train_dropped"] == [0.0] * 3
    with pytest.raises(TypeError, match="configs"):
        moe.train_variants({"dense": None})


def test_capacity_training_drops_what_the_capacity_says():
    run = moe.capacity_training_experiment(capacity_factors=(0.5,), steps=3)[0.5]
    assert len(run["train_dropped"]) == 3 and min(run["train_dropped"]) >= 0.5  # top-1: at most half the tokens fit
    assert run["final_loss"] != run["final_loss_dropless"]
    with pytest.raises(ValueError, match="capacity_factors"):
        moe.capacity_training_experiment(capacity_factors=(None,))
    with pytest.raises(ValueError, match="priority"):
        moe.capacity_training_experiment(priority="random")
