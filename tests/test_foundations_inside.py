"""Chapter 00's look inside autograd and its resource accounting (labkit.foundations), each function
checked against an independent reference: hand counts, closed forms, torch's FlopCounterMode,
gradcheck, labkit.memory's op-by-op activation prediction."""
import copy
import sys

import pytest
import torch
from torch import nn

import labkit  # noqa: F401  (first: configures Triton before torch.utils.flop_counter imports it)
from labkit.foundations import (
    HookRecord,
    StableSoftplus,
    autograd_graph,
    forward_flops,
    matmul_parameters,
    measured_flops,
    record_aten_ops,
    record_module_shapes,
    saved_tensor_bytes,
    softplus,
    training_state_bytes,
    training_step_ops,
)
from labkit.experts import MoEConfig
from labkit.memory import activation_terms, model_state_bytes
from labkit.model import ModelConfig, TransformerLM
from labkit.nn import Linear
from labkit.train import AdamW, TrainConfig, cross_entropy, make_optimizer


def _config(**overrides) -> ModelConfig:
    fields = dict(vocab_size=15, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48)
    fields.update(overrides)
    return ModelConfig(**fields)


def _batch(config: ModelConfig, batch: int = 2, seq: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    y = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)  # its own storage, as activation_terms counts it
    return x, y


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = _config()
    return TransformerLM(config), *_batch(config)


# ----------------------------------------------------------------------------- the graph
def test_graph_of_a_small_expression_lists_every_node_once():
    x = torch.randn(3, 4)
    w = torch.randn(4, 5, requires_grad=True)
    y = (x @ w).relu().sum()
    assert autograd_graph(y, names={"w": w}) == [
        "SumBackward0",
        "  ReluBackward0",
        "    MmBackward0",  # x needs no gradient: it has no node
        "      AccumulateGrad: w [4, 5]",
    ]
    # what each node keeps, known exactly: relu its output; mm only x (w's gradient is x^T @ grad); sum a shape
    assert autograd_graph(y, saved=True)[1:3] == ["  ReluBackward0  saves result [3, 5] float32", "    MmBackward0  saves self [3, 4] float32"]
    y.backward()
    assert autograd_graph(y, saved=True)[1].endswith("(saved tensors freed by backward)")


def test_graph_marks_a_shared_node_instead_of_expanding_it_again():
    a = torch.randn(3, requires_grad=True)
    h = a.exp()
    lines = autograd_graph(h * h + h, names={"a": a})
    assert lines == [
        "AddBackward0",
        "  MulBackward0",
        "    ExpBackward0",
        "      AccumulateGrad: a [3]",
        "    ExpBackward0 (shared, see above)",
        "  ExpBackward0 (shared, see above)",
    ]


def test_graph_lists_saved_index_tensors():
    a = torch.randn(5, requires_grad=True)
    assert autograd_graph(a.exp()[torch.tensor([0, 2])], saved=True) == [
        "IndexBackward0  saves indices[0] [2] int64",  # t[idx] keeps its list of index tensors
        "  ExpBackward0  saves result [5] float32",
        "    AccumulateGrad: leaf [5]",
    ]


def test_graph_of_linear_relu_cross_entropy():
    layer = Linear(4, 3)
    loss = nn.functional.cross_entropy(layer(torch.randn(5, 4)).relu(), torch.tensor([0, 1, 2, 0, 1]))
    assert autograd_graph(loss, names=dict(layer.named_parameters())) == [
        "NllLossBackward0",
        "  LogSoftmaxBackward0",
        "    ReluBackward0",
        "      MmBackward0",
        "        PermuteBackward0",  # labkit's Linear computes x @ weight.T
        "          AccumulateGrad: weight [3, 4]",
    ]


def test_graph_of_a_deep_chain_needs_no_recursion():
    x = torch.randn(2, requires_grad=True)
    y = x
    for _ in range(sys.getrecursionlimit() + 100):
        y = y * 1.0001
    assert len(autograd_graph(y)) == sys.getrecursionlimit() + 101


def test_graph_rejects_bad_arguments():
    with pytest.raises(TypeError, match="tensor"):
        autograd_graph([1.0])
    with pytest.raises(ValueError, match="no grad_fn"):
        autograd_graph(torch.randn(3, requires_grad=True))
    with pytest.raises(ValueError, match="no grad_fn"):
        autograd_graph(torch.randn(3) * 2)
    with pytest.raises(TypeError, match="names"):
        autograd_graph(torch.randn(3, requires_grad=True) * 2, names=["w"])


# ----------------------------------------------------------------------------- what autograd saves
def test_saved_bytes_match_a_hand_count():
    x = torch.randn(64, 32)
    w = torch.randn(32, 16, requires_grad=True)
    # mm keeps x (for w's gradient; w itself is a parameter: not counted), relu its [64, 16] output, sum nothing
    assert saved_tensor_bytes(lambda: (x @ w).relu().sum()) == (64 * 32 + 64 * 16) * 4
    # x a leaf that needs its gradient (left out, like a parameter): now mm also keeps its second operand,
    # here w.double(), a new tensor that is counted; relu's output is 8 bytes a number
    x64 = x.double().requires_grad_()
    assert saved_tensor_bytes(lambda: (x64 @ w.double()).relu().sum()) == (32 * 16 + 64 * 16) * 8


def test_saved_bytes_of_the_tiny_model_match_the_op_by_op_prediction(tiny):
    model, x, y = tiny
    terms = activation_terms(model.config, *x.shape)
    predicted = sum(v for k, v in terms.items() if k != "recompute_block")
    assert saved_tensor_bytes(lambda: cross_entropy(model(x), y), model) == predicted


def test_saved_bytes_reject_bad_arguments():
    with pytest.raises(TypeError, match="fn"):
        saved_tensor_bytes(3)
    with pytest.raises(ValueError, match="returned None"):
        saved_tensor_bytes(lambda: None)
    with pytest.raises(TypeError, match="model"):
        saved_tensor_bytes(lambda: torch.ones(1), model="gpt")


# ----------------------------------------------------------------------------- a custom autograd.Function
def test_softplus_passes_gradcheck_in_float64():
    x = (torch.randn(40, dtype=torch.float64) * 20).requires_grad_()  # both tails and the bend
    assert torch.autograd.gradcheck(StableSoftplus.apply, (x,))
    assert torch.autograd.gradgradcheck(softplus, (x,))  # backward is built of differentiable ops


def test_softplus_matches_torch_and_survives_extremes():
    x = torch.linspace(-30, 30, 301, dtype=torch.float64)
    torch.testing.assert_close(softplus(x), nn.functional.softplus(x, threshold=1e9), rtol=1e-14, atol=1e-300)
    big = torch.tensor([-1000.0, -100.0, 100.0, 1000.0], requires_grad=True)
    out = softplus(big)
    assert torch.isinf(torch.log(1 + torch.exp(big.detach()))).any()  # the naive formula overflows in fp32
    assert out[2:].tolist() == [100.0, 1000.0] and 0 <= out[0].item() <= out[1].item() < 1e-40
    out.sum().backward()
    assert big.grad.tolist() == [0.0, 0.0, 1.0, 1.0]


def test_softplus_saves_one_tensor_where_the_composite_saves_two():
    layer = Linear(16, 32)
    x = torch.randn(8, 16)
    custom = saved_tensor_bytes(lambda: softplus(layer(x)), layer)
    composite = saved_tensor_bytes(lambda: (lambda h: h.clamp_min(0) + torch.log1p(torch.exp(-h.abs())))(layer(x)), layer)
    assert custom == (8 * 16 + 8 * 32) * 4  # the matmul's input and softplus's input
    assert composite == (8 * 16 + 2 * 8 * 32) * 4  # ... and exp's output (h is kept by clamp_min and abs, once)
    assert autograd_graph(softplus(layer(x)), saved=True)[0] == "StableSoftplusBackward  saves ctx[0] [8, 32] float32"


def test_softplus_rejects_non_float():
    with pytest.raises(TypeError, match="x"):
        softplus(torch.arange(3))
    with pytest.raises(TypeError, match="x"):
        softplus([1.0])


# ----------------------------------------------------------------------------- hooks
def test_module_hooks_record_shapes_forward_then_backward_in_reverse():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(5, 4)
    records = record_module_shapes(net, lambda: net(x).sum().backward(), ["0", "2"])
    assert records == [
        HookRecord("0", "forward", ((5, 4),), ((5, 8),)),
        HookRecord("2", "forward", ((5, 8),), ((5, 2),)),
        HookRecord("2", "backward", ((5, 2),), ((5, 8),)),
        HookRecord("0", "backward", ((5, 8),), (None,)),  # x needs no gradient
    ]
    assert all(not m._forward_hooks and not m._backward_hooks for m in net.modules())


def test_module_hooks_are_removed_when_fn_raises_and_bad_names_are_refused():
    net = nn.Sequential(nn.Linear(4, 8))

    def fails():
        raise KeyError("boom")

    with pytest.raises(KeyError):
        record_module_shapes(net, fails, "0")
    assert not net[0]._forward_hooks and not net[0]._backward_hooks
    with pytest.raises(ValueError, match="'1'"):
        record_module_shapes(net, lambda: None, ["1"])
    with pytest.raises(ValueError, match="names"):
        record_module_shapes(net, lambda: None, [])
    with pytest.raises(TypeError, match="model"):
        record_module_shapes("net", lambda: None, ["0"])
    with pytest.raises(TypeError, match="fn"):
        record_module_shapes(net, None, ["0"])


def test_module_hooks_on_the_tiny_model(tiny):
    model, x, y = tiny
    records = record_module_shapes(model, lambda: cross_entropy(model(x), y).backward(), ["token_embeddings", "lm_head"])
    model.zero_grad(set_to_none=True)
    b, s = x.shape
    assert [(r.module, r.phase) for r in records] == [("token_embeddings", "forward"), ("lm_head", "forward"),
                                                      ("lm_head", "backward"), ("token_embeddings", "backward")]
    assert records[1].outputs == ((b, s, model.config.vocab_size),)
    assert records[3].outputs == (None,)  # token ids have no gradient


# ----------------------------------------------------------------------------- the dispatcher
def test_aten_ops_of_a_small_forward_and_backward():
    x = torch.randn(3, 4)
    w = torch.randn(4, 5, requires_grad=True)
    forward = record_aten_ops(lambda: (x @ w).relu().sum())
    assert forward["aten.mm"] == 1 and forward["aten.relu"] == 1 and forward["aten.sum"] == 1
    y = (x @ w).relu().sum()
    backward = record_aten_ops(y.backward)
    assert backward["aten.mm"] == 1 and backward["aten.threshold_backward"] == 1  # only w's gradient: one matmul
    xg = x.clone().requires_grad_()
    y = (xg @ w).relu().sum()
    assert record_aten_ops(y.backward)["aten.mm"] == 2  # x's gradient too
    with pytest.raises(TypeError, match="fn"):
        record_aten_ops("x @ w")


def test_training_step_ops_by_phase(tiny):
    model, x, y = tiny
    twin = copy.deepcopy(model)
    optimizer = make_optimizer(twin, TrainConfig())
    before = [p.detach().clone() for p in twin.parameters()]
    ops = training_step_ops(twin, optimizer, x, y)
    assert list(ops) == ["forward", "backward", "optimizer"]
    linears = sum(isinstance(m, Linear) for m in twin.modules())
    layers = twin.config.num_layers
    assert ops["forward"]["aten.mm"] == linears and ops["forward"]["aten.bmm"] == 2 * layers  # QK^T and PV per layer
    assert ops["backward"]["aten.mm"] == 2 * linears and ops["backward"]["aten.bmm"] == 4 * layers  # two per matmul
    tensors = len(list(twin.parameters()))
    total = sum(ops["optimizer"].values())
    assert total > 0 and total % tensors == 0  # the same ops, parameter tensor by parameter tensor
    assert ops["optimizer"]["aten.mm"] == 0
    assert all(not torch.equal(a, p) for a, p in zip(before, twin.parameters()))  # a real step
    with pytest.raises(TypeError, match="optimizer"):
        training_step_ops(twin, "adamw", x, y)
    with pytest.raises(ValueError, match="x, y"):
        training_step_ops(twin, optimizer, x, y[:, :-1])
    with pytest.raises(TypeError, match="model"):
        training_step_ops(None, optimizer, x, y)


# ----------------------------------------------------------------------------- FLOPs
FLOP_CONFIGS = [
    dict(),
    dict(num_kv_heads=2),
    dict(num_kv_heads=1, head_dim=16, qk_norm=True),
    dict(tie_embeddings=True, norm="layernorm", activation="gelu", num_layers=3),
]


@pytest.mark.parametrize("overrides", FLOP_CONFIGS)
def test_matmul_parameters_are_the_linear_weights(overrides):
    config = _config(**overrides)
    model = TransformerLM(config, device="meta")
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear))
    assert matmul_parameters(config) == linear
    norms = sum(p.numel() for name, p in model.named_parameters() if "ln" in name or "_norm" in name)
    if not config.tie_embeddings:
        assert matmul_parameters(config) == model.num_params(non_embedding=True) - norms


@pytest.mark.parametrize("overrides", FLOP_CONFIGS)
def test_closed_form_flops_equal_flop_counter(overrides):
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    config = _config(**overrides)
    model = TransformerLM(config)
    b, s = 3, 11
    x, y = _batch(config, b, s)
    closed = forward_flops(config, b, s)
    with FlopCounterMode(display=False) as counter:
        cross_entropy(model(x), y)
    assert counter.get_total_flops() == closed["total"] == closed["weights"] + closed["attention"]
    assert closed["weights"] == 2 * matmul_parameters(config) * b * s
    assert closed["attention"] == counter.get_flop_counts()["Global"][torch.ops.aten.bmm] == 4 * config.num_layers * b * s * s * config.num_heads * config.dim_per_head


def test_measured_flops_step_is_three_forwards(tiny):
    model, x, y = tiny
    flops = measured_flops(model, x, y)
    closed = forward_flops(model.config, *x.shape)
    assert flops["forward"] == closed["total"]
    assert flops["backward"] == 2 * flops["forward"] and flops["step"] == 3 * flops["forward"]
    d = x.numel()
    assert flops["step"] == 6 * matmul_parameters(model.config) * d + 3 * closed["attention"]
    assert all(p.grad is None for p in model.parameters())


def test_flop_functions_reject_bad_arguments(tiny):
    model, x, y = tiny
    config = _config()
    with pytest.raises(TypeError, match="config"):
        forward_flops("tiny", 1, 8)
    with pytest.raises(ValueError, match="batch_size"):
        forward_flops(config, 0, 8)
    with pytest.raises(ValueError, match="seq_len"):
        forward_flops(config, 1, True)
    with pytest.raises(ValueError, match="context_length"):
        forward_flops(config, 1, config.context_length + 1)
    with pytest.raises(ValueError, match="moe"):
        matmul_parameters(_config(moe=MoEConfig(num_experts=4, top_k=2)))
    with pytest.raises(TypeError, match="model"):
        measured_flops(config, x, y)
    with pytest.raises(ValueError, match="x, y"):
        measured_flops(model, x[0], y[0])


# ----------------------------------------------------------------------------- bytes of model state
def test_training_state_bytes_fp32_adamw_is_16_bytes_per_parameter(tiny):
    model, x, y = tiny
    twin = copy.deepcopy(model)
    n = twin.num_params()
    optimizer = make_optimizer(twin, TrainConfig())
    assert training_state_bytes(twin) == {"params": 4 * n, "grads": 0, "optimizer_states": 0, "total": 4 * n}
    assert training_state_bytes(twin)["params"] == sum(p.numel() * p.element_size() for p in twin.parameters())
    cross_entropy(twin(x), y).backward()
    assert training_state_bytes(twin, optimizer)["grads"] == 4 * n
    assert training_state_bytes(twin, optimizer)["optimizer_states"] == 0  # AdamW creates its moments at the first step
    optimizer.step()
    measured = training_state_bytes(twin, optimizer)
    assert measured == {"params": 4 * n, "grads": 4 * n, "optimizer_states": 8 * n, "total": 16 * n}
    predicted = model_state_bytes(n, "fp32").as_dict()
    assert all(measured[k] == predicted[k] for k in ("params", "grads", "optimizer_states"))


def test_training_state_bytes_of_torch_adamw_bf16_and_tied_weights():
    torch.manual_seed(0)
    config = _config(tie_embeddings=True)
    model = TransformerLM(config)
    n = model.num_params()
    assert training_state_bytes(model)["params"] == 4 * n  # the shared matrix once
    x, y = _batch(config)
    optimizer = torch.optim.AdamW(model.parameters())
    cross_entropy(model(x), y).backward()
    optimizer.step()
    tensors = len(list(model.parameters()))
    # torch's AdamW keeps its step count as a 0-dim fp32 tensor per parameter, labkit's as a Python int
    assert training_state_bytes(model, optimizer)["optimizer_states"] == 8 * n + 4 * tensors
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert training_state_bytes(half)["params"] == 2 * n


def test_training_state_bytes_rejects_bad_arguments(tiny):
    model, _, _ = tiny
    with pytest.raises(TypeError, match="model"):
        training_state_bytes([1, 2])
    with pytest.raises(TypeError, match="optimizer"):
        training_state_bytes(model, "adamw")
    assert isinstance(AdamW(model.parameters()), torch.optim.Optimizer)
