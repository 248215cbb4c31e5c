"""labkit.lora: the LoRA layer against its formula, models with adapters, merging, adapter state
dicts, QLoRA over NF4, the fine-tuning memory model against measured bytes, and Hugging Face PEFT."""
import labkit  # noqa: F401

import copy
import math

import pytest
import torch
from torch import nn

from labkit import lora as L
from labkit import quant as Q
from labkit.data import ArithmeticTask, get_batch
from labkit.memory import model_state_bytes
from labkit.model import PRESETS, TransformerLM, count_parameters, tiny_config
from labkit.nn import Linear

TASK = ArithmeticTask()


def reference(x, weight, lora_A, lora_B, alpha, r, rslora=False):
    """``W0 x + (alpha / r) B A x`` written out in fp64."""
    scaling = alpha / math.sqrt(r) if rslora else alpha / r
    x64 = x.double()
    return x64 @ weight.double().T + scaling * (x64 @ lora_A.double().T) @ lora_B.double().T


def random_adapter(layer: L.LoRALinear, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=gen))
        layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen) * 0.1)


# ----------------------------------------------------------------------------- the layer
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("rslora", [False, True])
def test_lora_linear_is_w0x_plus_scaled_bax(dtype, tol, rslora):
    torch.manual_seed(0)
    base = Linear(20, 12, dtype=dtype)
    layer = L.LoRALinear(base, r=4, alpha=8, use_rslora=rslora)
    random_adapter(layer)
    assert layer.lora_A.shape == (4, 20) and layer.lora_B.shape == (12, 4) and layer.lora_A.dtype == dtype
    assert layer.scaling == (8 / 2 if rslora else 8 / 4)
    x = torch.randn(3, 5, 20).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (3, 5, 12)
    expected = reference(x, base.weight, layer.lora_A, layer.lora_B, 8, 4, rslora)
    assert torch.allclose(y.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_zero_initialised_b_leaves_the_layer_unchanged_and_a_is_kaiming_uniform():
    torch.manual_seed(1)
    base = Linear(256, 32)
    layer = L.LoRALinear(base, r=8, alpha=16)
    x = torch.randn(4, 256)
    assert torch.equal(layer.lora_B, torch.zeros(32, 8))
    assert torch.equal(layer(x), base(x))  # exactly: the update is B A x = 0
    bound = 1 / math.sqrt(256)  # kaiming_uniform_(a=sqrt(5)) on [r, d_in]: U(-1/sqrt(d_in), 1/sqrt(d_in))
    assert layer.lora_A.abs().max() <= bound and layer.lora_A.abs().max() > 0.9 * bound


def test_only_the_adapters_require_grad_and_get_gradients():
    torch.manual_seed(2)
    base = nn.Linear(10, 6)  # torch's Linear, with a bias
    layer = L.LoRALinear(base, r=2, alpha=4)
    assert not base.weight.requires_grad and not base.bias.requires_grad
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["lora_A", "lora_B"]
    layer(torch.randn(7, 10)).square().sum().backward()
    assert base.weight.grad is None and base.bias.grad is None
    assert layer.lora_B.grad.abs().sum() > 0  # B gets a gradient at once; A only once B is non-zero
    assert torch.equal(layer.lora_A.grad, torch.zeros_like(layer.lora_A))


def test_dropout_touches_the_adapter_path_only_and_only_in_training():
    torch.manual_seed(3)
    base = Linear(16, 16)
    layer = L.LoRALinear(base, r=16, alpha=16, dropout=0.5)  # scaling 1
    with torch.no_grad():
        layer.lora_A.copy_(torch.eye(16))
        layer.lora_B.copy_(torch.eye(16))
    x = torch.randn(64, 16)
    layer.eval()
    assert torch.allclose(layer(x), base(x) + x, atol=1e-6)
    layer.train()
    update = layer(x) - base(x)
    kept = update.abs() > 1e-6
    assert torch.allclose(update[kept], 2 * x[kept], atol=1e-5)  # inverted dropout: kept values / (1 - p)
    assert 0.3 < kept.float().mean() < 0.7


@pytest.mark.parametrize("bad, match", [(dict(r=0), "r=0"), (dict(alpha=0), "alpha"), (dict(dropout=1.0), "dropout")])
def test_layer_rejects_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        L.LoRALinear(Linear(4, 4), **{"r": 2, "alpha": 4, **bad})
    with pytest.raises(TypeError, match="already"):
        L.LoRALinear(L.LoRALinear(Linear(4, 4), 2, 4), 2, 4)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_merge_equals_unmerged_and_unmerge_restores_the_weight(dtype, tol):
    torch.manual_seed(4)
    base = Linear(24, 10, dtype=dtype)  # not square: a transposed update would not even fit
    w0 = base.weight.detach().clone()
    layer = L.LoRALinear(base, r=3, alpha=6, dropout=0.1)
    random_adapter(layer)
    layer.eval()
    x = torch.randn(5, 24).to(dtype)
    before = layer(x)
    layer.merge()
    layer.merge()  # a second merge is a no-op
    assert layer.merged
    expected = (w0.float() + 2.0 * layer.lora_B.detach().float() @ layer.lora_A.detach().float()).to(dtype)
    assert torch.equal(base.weight, expected)
    assert torch.allclose(layer(x).float(), before.float(), atol=tol * before.abs().max().item())
    layer.unmerge()
    assert not layer.merged
    assert torch.allclose(base.weight.float(), w0.float(), atol=tol * w0.abs().max().item())
    if dtype == torch.float32:
        assert (base.weight - w0).abs().max() < 1e-6


def test_merged_linear_is_a_plain_layer_computing_the_same():
    torch.manual_seed(5)
    layer = L.LoRALinear(nn.Linear(8, 5), r=2, alpha=2)
    random_adapter(layer)
    plain = layer.merged_linear()
    x = torch.randn(3, 8)
    assert isinstance(plain, nn.Linear) and torch.allclose(plain(x), layer(x), atol=1e-6)
    layer.merge()  # works from a merged layer too
    assert torch.allclose(layer.merged_linear()(x), plain(x), atol=1e-6)


# ----------------------------------------------------------------------------- QLoRA
def test_qlora_layer_matches_the_dequantized_reference_and_saves_no_weight_copy():
    torch.manual_seed(6)
    linear = Linear(128, 48)
    quant = Q.QuantLinear.from_linear(linear, "nf4", group_size=64)
    layer = L.LoRALinear(quant, r=4, alpha=8)
    assert layer.lora_A.dtype == torch.float32 and layer.quantized
    assert [n for n, p in layer.named_parameters()] == ["lora_A", "lora_B"]
    random_adapter(layer)
    x = torch.randn(6, 128, requires_grad=True)
    y = layer(x)
    w = quant.dequantized_weight()
    expected = reference(x.detach(), w, layer.lora_A, layer.lora_B, 8, 4)
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-5)
    # the gradient with respect to the input goes through the dequantized weight
    y.square().sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    y_ref = x_ref @ w.T + 2.0 * (x_ref @ layer.lora_A.detach().T) @ layer.lora_B.detach().T
    y_ref.square().sum().backward()
    assert torch.allclose(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    from labkit.memory import SavedTensorMeter

    with SavedTensorMeter(layer) as meter:
        kept = layer(torch.randn(6, 128, requires_grad=True))  # noqa: F841  (the graph lives as long as its output)
    assert meter.activation_bytes == 6 * 128 * 4 + 6 * 4 * 4  # x for A's gradient, A x for B's: no 128x48 weight
    with pytest.raises(ValueError, match="merge_and_unload"):
        layer.merge()
    plain = layer.merged_linear()
    assert torch.allclose(plain(x.detach()), y.detach(), atol=1e-5)


def test_apply_lora_over_a_quantized_model_trains_adapters_only():
    torch.manual_seed(7)
    model = TransformerLM(tiny_config(TASK.vocab_size, num_layers=1))
    quantized, _ = Q.quantize_model(model, "nf4", group_size=64)
    L.apply_lora(quantized, "all-linear", r=2, alpha=4)
    trainable, total = L.trainable_parameters(quantized)
    assert trainable == L.lora_parameter_count(model.config, 2, "all-linear") and total == model.num_params() + trainable
    # the layers without adapters (here the LM head is not quantized; k_proj etc. carry adapters) keep their buffers
    assert all(isinstance(layer.base, Q.QuantLinear) for layer in L.lora_layers(quantized).values())
    x, y = get_batch(TASK.tokens("train"), 4, 16, "cpu")
    from labkit.train import cross_entropy

    cross_entropy(quantized(x), y).backward()
    assert all(p.grad is not None for n, p in quantized.named_parameters() if "lora_" in n)
    assert L.merge_and_unload(quantized) is quantized and not L.lora_layers(quantized)


def test_frozen_quantized_layers_recompute_their_weight_in_backward():
    torch.manual_seed(8)
    model = TransformerLM(tiny_config(TASK.vocab_size))
    quantized, _ = Q.quantize_model(model, "nf4", group_size=64)
    L.apply_lora(quantized, ("q_proj",), r=2, alpha=4)
    k_proj = quantized.layers[1].attn.k_proj
    assert isinstance(k_proj, L.FrozenQuantLinear) and set(k_proj.state_dict()) == {"qweight", "scales"}
    x = torch.randn(3, 64, requires_grad=True)
    k_proj(x).sum().backward()
    assert torch.allclose(x.grad, k_proj.dequantized_weight().sum(0).expand(3, -1), atol=1e-5)


# ----------------------------------------------------------------------------- models
def small_model(seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(tiny_config(TASK.vocab_size))


def test_target_patterns_select_layers_like_peft():
    model = small_model()
    assert L.target_modules(model) == [f"layers.{i}.attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")]
    everything = L.target_modules(model, "all-linear")
    assert len(everything) == 14 and "lm_head" not in everything
    assert L.target_modules(model, ("layers.1.*",)) == [f"layers.1.{m}" for m in
                                                        ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.output_proj", "ffn.w1", "ffn.w2", "ffn.w3")]
    assert L.target_modules(model, "lm_head") == ["lm_head"]
    with pytest.raises(ValueError, match="no linear layer matches"):
        L.apply_lora(model, ("query",))
    with pytest.raises(TypeError, match="targets"):
        L.target_modules(model, ())


def test_apply_lora_freezes_the_base_and_counts_trainable_parameters():
    model = small_model()
    n = model.num_params()
    targets = ("q_proj", "v_proj")
    L.apply_lora(model, targets, r=4, alpha=8)
    trainable, total = L.trainable_parameters(model)
    assert trainable == 2 * 2 * 4 * (64 + 64) == L.lora_parameter_count(model.config, 4, targets)
    assert total == n + trainable
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"layers.{i}.attn.{p}.lora_{m}" for i in (0, 1) for p in ("q_proj", "v_proj") for m in "AB"}
    with pytest.raises(ValueError, match="already has a LoRA adapter"):
        L.apply_lora(model, ("q_proj",))
    L.apply_lora(model, ("k_proj",), r=2, alpha=2)  # other layers can still get adapters; the wrapped bases are skipped
    assert len(L.lora_layers(model)) == 6


def test_a_fresh_adapter_leaves_the_model_unchanged():
    model = small_model()
    x, _ = get_batch(TASK.tokens("val"), 3, 16, "cpu")
    before = model(x)
    L.apply_lora(model, "all-linear", r=8, alpha=16)
    assert torch.equal(model(x), before)


def test_lora_parameter_count_uses_each_layers_shape():
    # GQA: k_proj and v_proj map 4096 -> 8 * 128 = 1024
    llama3 = PRESETS["llama3-8b"]
    assert L.lora_parameter_count(llama3, 16, ("q_proj", "v_proj")) == 32 * 16 * ((4096 + 4096) + (4096 + 1024))
    per_layer = 16 * (2 * 4096 + 2 * (4096 + 1024) + 2 * 4096 + 2 * (4096 + 14336) + (14336 + 4096))
    assert L.lora_parameter_count(llama3, 16, "all-linear") == 32 * per_layer
    with pytest.raises(ValueError, match="r=0"):
        L.lora_parameter_count(llama3, 0)


def test_merge_lora_and_unmerge_lora_on_a_model():
    model = small_model()
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    L.apply_lora(model, "all-linear", r=4, alpha=8, dropout=0.1)
    for i, layer in enumerate(L.lora_layers(model).values()):
        random_adapter(layer, i)
    model.eval()
    x, _ = get_batch(TASK.tokens("val"), 3, 16, "cpu")
    unmerged = model(x)
    L.merge_lora(model)
    assert all(layer.merged for layer in L.lora_layers(model).values())
    assert torch.allclose(model(x), unmerged, rtol=1e-4, atol=1e-4)
    L.unmerge_lora(model)
    for name, p in model.named_parameters():
        if "lora_" not in name:
            assert (p - w0[name.replace(".base.", ".")]).abs().max() < 1e-6, name
    plain = L.merge_and_unload(model)
    assert not L.lora_layers(plain) and set(plain.state_dict()) == set(w0)
    assert torch.allclose(plain(x), unmerged, rtol=1e-4, atol=1e-4)


def test_adapter_state_dict_saves_only_adapters_and_loads_back(tmp_path):
    model = small_model()
    L.apply_lora(model, ("q_proj", "v_proj"), r=4, alpha=8)
    for i, layer in enumerate(L.lora_layers(model).values()):
        random_adapter(layer, i)
    state = L.lora_state_dict(model)
    assert set(state) == {f"layers.{i}.attn.{p}.lora_{m}" for i in (0, 1) for p in ("q_proj", "v_proj") for m in "AB"}
    assert sum(t.numel() for t in state.values()) == L.trainable_parameters(model)[0]
    path = tmp_path / "adapter.pt"
    torch.save(state, path)
    fresh = L.apply_lora(small_model(), ("q_proj", "v_proj"), r=4, alpha=8)
    x, _ = get_batch(TASK.tokens("val"), 2, 16, "cpu")
    assert not torch.allclose(fresh(x), model(x))
    L.load_lora_state_dict(fresh, torch.load(path))
    assert torch.equal(fresh(x), model(x))
    state["layers.0.attn.q_proj.lora_A"] += 1  # a copy: changing it leaves the model alone
    assert not torch.equal(state["layers.0.attn.q_proj.lora_A"], model.layers[0].attn.q_proj.lora_A)
    with pytest.raises(KeyError, match="missing"):
        L.load_lora_state_dict(fresh, {k: v for k, v in state.items() if "v_proj" not in k})
    with pytest.raises(ValueError, match="shape"):
        L.load_lora_state_dict(fresh, {k: v[:2] if k.endswith("lora_A") else v for k, v in state.items()})
    L.merge_lora(fresh)
    with pytest.raises(ValueError, match="merged"):
        L.load_lora_state_dict(fresh, state)


# ----------------------------------------------------------------------------- memory, predicted vs measured
def test_full_finetuning_bytes_per_parameter():
    n = 1_000_000
    pure = L.finetune_memory(n, "full", weights_dtype="bf16")
    assert (pure.weights, pure.grads, pure.optimizer_states, pure.master_weights) == (2 * n, 2 * n, 4 * n, 0)
    assert pure.total == 8 * n  # 2 + 2 + 4
    mixed = L.finetune_memory(n, "full", weights_dtype="bf16", master_weights=True)
    assert mixed.total == 16 * n == model_state_bytes(n, "bf16", mixed_precision=True).total
    assert L.finetune_memory(n, "full", weights_dtype="bf16", optimizer_dtype="fp32").total == 12 * n  # QLoRA paper's ">780 GB"
    assert L.finetune_memory(n, "full", weights_dtype="fp32").total == 16 * n
    with pytest.raises(ValueError, match="ModelConfig"):
        L.finetune_memory(n, "lora")
    with pytest.raises(ValueError, match="both"):
        L.finetune_memory(tiny_config(15), "full", batch=2)


def test_lora_and_qlora_memory_for_a_65b_model():
    n = count_parameters(L.LLAMA_65B)
    assert abs(n / 65.2e9 - 1) < 0.005
    full = L.finetune_memory(L.LLAMA_65B, "full", weights_dtype="bf16", optimizer_dtype="fp32")
    assert full.total / 1e9 > 780
    qlora = L.finetune_memory(L.LLAMA_65B, "qlora", weights_dtype="bf16", r=64, targets="all-linear", optimizer_dtype="fp32",
                              batch=1, seq=512, activation_checkpointing=True)
    assert qlora.total < 48e9 and qlora.grads == qlora.adapters == 2 * qlora.trainable_params
    quantized = sum(d_in * d_out for _, d_in, d_out in L.quantized_layer_shapes(L.LLAMA_65B))
    bits = 8 * (qlora.weights - (n - quantized) * 2 + qlora.quant_scales) / quantized
    assert abs(bits - Q.bits_per_parameter(4, 64, scale_bits=8, double_quant_block=256)) < 1e-3


def measured_vs_predicted(model, config, method, targets=("q_proj", "v_proj"), r=3, dtype="fp32", **kw):
    x, y = get_batch(TASK.tokens("train"), 4, 24, "cpu")
    measured = L.measure_training_memory(model, x, y)
    predicted = L.finetune_memory(config, method, weights_dtype=dtype, r=r, targets=targets, batch=4, seq=24, **kw).as_dict()
    return {k: measured[k] - predicted[k] for k in L.FinetuneMemory.KINDS if k != "recompute"}


# get_batch returns x and y as views of one [batch, seq + 1] buffer: the meter counts it once
TOKEN_BUFFER = {"full": 4 * 25 * 8 - 2 * 4 * 24 * 8, "lora": 4 * 25 * 8 - 4 * 24 * 8}


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), "all-linear", ("v_proj",), ("layers.1.*",), ("w2",), ("lm_head",)])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_memory_matches_the_measured_step(targets, dropout):
    config = tiny_config(TASK.vocab_size)
    model = L.apply_lora(small_model(), targets, r=3, alpha=6, dropout=dropout)
    diff = measured_vs_predicted(model, config, "lora", targets, dropout=dropout)
    assert diff == {**dict.fromkeys(diff, 0), "activations": TOKEN_BUFFER["lora"]}


@pytest.mark.parametrize("config", [tiny_config(TASK.vocab_size, num_heads=4, num_kv_heads=2, head_dim=24, qk_norm=True),
                                    tiny_config(TASK.vocab_size)], ids=["gqa-qknorm", "tiny"])
@pytest.mark.parametrize("dtype, adapter_dtype", [("bf16", None), ("bf16", "fp32"), ("fp32", None)])
def test_lora_memory_matches_in_bf16_with_gqa_and_fp32_adapters(config, dtype, adapter_dtype):
    torch.manual_seed(9)
    model = TransformerLM(config, dtype=L.DTYPES[dtype])
    L.apply_lora(model, ("q_proj", "k_proj", "w1"), r=3, alpha=6, adapter_dtype=L.DTYPES[adapter_dtype] if adapter_dtype else None)
    diff = measured_vs_predicted(model, config, "lora", ("q_proj", "k_proj", "w1"), dtype=dtype, adapter_dtype=adapter_dtype)
    assert diff == {**dict.fromkeys(diff, 0), "activations": TOKEN_BUFFER["lora"]}


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), "all-linear"])
def test_qlora_memory_matches_the_measured_step(targets):
    config = tiny_config(TASK.vocab_size)
    quantized, _ = Q.quantize_model(small_model(), "nf4", group_size=64)
    L.apply_lora(quantized, targets, r=3, alpha=6)
    diff = measured_vs_predicted(quantized, config, "qlora", targets, double_quant=False, scale_bits=16)
    assert diff == {**dict.fromkeys(diff, 0), "activations": TOKEN_BUFFER["lora"]}


def test_full_finetuning_memory_matches_the_measured_step():
    diff = measured_vs_predicted(small_model(), tiny_config(TASK.vocab_size), "full")
    assert diff == {**dict.fromkeys(diff, 0), "activations": TOKEN_BUFFER["full"]}


def test_activation_checkpointing_keeps_block_inputs_and_recomputes_one_block():
    config = tiny_config(TASK.vocab_size)
    plain = L.lora_activation_terms(config, 4, 24, "all-linear", 3)
    ckpt = L.lora_activation_terms(config, 4, 24, "all-linear", 3, activation_checkpointing=True)
    assert ckpt["block inputs (checkpointed)"] == 2 * 4 * 24 * 64 * 4
    assert 0 < ckpt["recompute_block"] and sum(ckpt.values()) < sum(plain.values())
    with pytest.raises(ValueError, match="LLaMA-style"):
        L.lora_activation_terms(tiny_config(15, norm="layernorm"), 2, 8)


# ----------------------------------------------------------------------------- experiments
def test_subtraction_task_keeps_only_non_negative_differences():
    task = L.subtraction_task()
    for split in ("train", "val", "test"):
        pairs = task.pairs(split)
        assert len(pairs) and (pairs[:, 0] >= pairs[:, 1]).all()
    assert task.format(35, 7) == "35-07=820;"
    assert sum(len(task.pairs(s)) for s in ("train", "val", "test")) == 5050


def test_finetune_trains_the_adapters_and_measures_its_first_step():
    model = L.apply_lora(small_model(), "all-linear", r=2, alpha=4)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    result = L.finetune(model, L.subtraction_task(), steps=12, lr=1e-2, batch_size=8)
    assert len(result["loss"]) == 12 and result["seconds_per_step"] > 0 and not model.training
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    memory = result["memory"]
    trainable = L.trainable_parameters(model)[0]
    assert result["trainable"] == trainable and memory["adapters"] == memory["grads"] == 4 * trainable
    assert memory["optimizer_states"] == 8 * trainable and memory["activations"] > 0
    assert memory["total"] == sum(v for k, v in memory.items() if k != "total")
    assert L.answer_loss(model, L.subtraction_task(), max_examples=50) > 0


def test_lr_sweep_is_one_short_finetune_per_learning_rate():
    base, task = small_model(), L.subtraction_task()
    before = copy.deepcopy(base.state_dict())
    losses = L.lr_sweep(base, task, (1e-3, 1e-2), "all-linear", r=2, alpha=4, steps=3, batch_size=8)
    assert list(losses) == [1e-3, 1e-2]
    assert all(torch.equal(v, before[k]) for k, v in base.state_dict().items())
    torch.manual_seed(0)
    by_hand = L.apply_lora(copy.deepcopy(base), "all-linear", r=2, alpha=4)
    L.finetune(by_hand, task, 3, 1e-2, 8)
    assert losses[1e-2] == L.answer_loss(by_hand, task)
    full = L.lr_sweep(base, task, (1e-2,), steps=3, batch_size=8)
    assert full[1e-2] != losses[1e-2]
    for bad in ((), (1e-3, 0.0)):
        with pytest.raises(ValueError, match="lrs"):
            L.lr_sweep(base, task, bad)


def test_first_step_update_rms_is_lr_per_entry_in_full_and_scaled_sign_of_grad_b_times_a_under_lora():
    task = L.subtraction_task()
    full = small_model().requires_grad_(True)
    sizes = L.first_step_update_rms(full, task, lr=1e-3, batch_size=8)
    assert set(sizes) == set(L.target_modules(full, "all-linear"))
    assert all(0.9 < v <= 1 + 1e-4 for v in sizes.values())  # |step| = lr * |g| / (|g| + eps) per entry
    torch.manual_seed(1)
    model = L.apply_lora(small_model(), "all-linear", r=2, alpha=8)
    state = copy.deepcopy(model.state_dict())
    sizes = L.first_step_update_rms(model, task, lr=1e-3, batch_size=8)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    # by hand: the same batch, Adam's first step on B is lr * sign(grad), A does not move
    examples = L._examples(task, "train", "cpu")
    batch = examples[torch.randint(len(examples), (8,), generator=torch.Generator().manual_seed(0))]
    L._answer_loss(model, batch, task.prompt_length).backward()
    for name, layer in L.lora_layers(model).items():
        expected = (layer.scaling * layer.lora_B.grad.sign() @ layer.lora_A.detach()).square().mean().sqrt().item()
        assert sizes[name] == pytest.approx(expected, rel=1e-3)
    with pytest.raises(ValueError, match="lr"):
        L.first_step_update_rms(model, task, lr=0)
    with pytest.raises(ValueError, match="DoRA"):
        L.first_step_update_rms(L.apply_lora(small_model(), "all-linear", r=2, alpha=8, use_dora=True), task)


def test_update_spectrum_of_a_low_rank_update():
    gen = torch.Generator().manual_seed(10)
    w0 = torch.randn(30, 20, generator=gen)
    w1 = w0 + torch.randn(30, 2, generator=gen) @ torch.randn(2, 20, generator=gen)
    spectrum = L.update_spectrum(w0, w1, ranks=(1, 2, 4))
    assert spectrum["singular_values"].shape == (20,)
    assert spectrum["captured"][2] > 1 - 1e-9 and 0 < spectrum["captured"][1] < 1
    with pytest.raises(ValueError, match="same shape"):
        L.update_spectrum(w0, w0.T)


def test_rank_explorer_callback():
    runs = {("all linear", 4): {"new": 0.9}}
    data = L.rank_explorer(PRESETS["llama2-7b"], 4, 8, "all linear", runs)
    assert data["measured"] == {"new": 0.9} and data["scaling"] == 2
    assert data["trainable"] == L.lora_parameter_count(PRESETS["llama2-7b"], 4, "all-linear")
    assert data["memory"]["qlora"].total < data["memory"]["lora"].total < data["memory"]["full"].total
    assert L.rank_explorer(PRESETS["llama2-7b"], 8, 8, "attention (q, v)")["measured"] is None
    with pytest.raises(ValueError, match="targets"):
        L.rank_explorer(PRESETS["llama2-7b"], 8, 8, "everything")


# ----------------------------------------------------------------------------- Hugging Face PEFT
def import_peft():
    """Hugging Face peft, or a skip where it is not installed (the reference extra's comparison)."""
    return pytest.importorskip("peft", reason="Hugging Face peft is not installed (pip install peft); the reference check is skipped")


class TwoProjections(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(12, 8, bias=False)
        self.v_proj = nn.Linear(12, 6)  # with a bias: LoRA leaves it alone
        self.out = nn.Linear(14, 5)

    def forward(self, x):
        return self.out(torch.cat([self.q_proj(x), self.v_proj(x)], dim=-1))


@pytest.mark.parametrize("rslora", [False, True])
def test_same_outputs_gradients_and_merged_weights_as_peft(rslora):
    peft = import_peft()
    torch.manual_seed(11)
    model = TwoProjections()
    theirs = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                       lora_dropout=0.0, use_rslora=rslora))
    ours = L.apply_lora(copy.deepcopy(model), ("q_proj", "v_proj"), r=4, alpha=8, use_rslora=rslora)
    gen = torch.Generator().manual_seed(12)
    for name in ("q_proj", "v_proj"):
        their_layer = getattr(theirs.base_model.model, name)
        with torch.no_grad():  # the same non-zero adapters in both (PEFT starts B at zero too)
            their_layer.lora_A["default"].weight.normal_(generator=gen)
            their_layer.lora_B["default"].weight.normal_(generator=gen)
            getattr(ours, name).lora_A.copy_(their_layer.lora_A["default"].weight)
            getattr(ours, name).lora_B.copy_(their_layer.lora_B["default"].weight)
        assert getattr(ours, name).scaling == their_layer.scaling["default"]
    x = torch.randn(7, 12, generator=gen)
    y_theirs, y_ours = theirs(x), ours(x)
    assert torch.allclose(y_ours, y_theirs, atol=1e-6)
    y_theirs.square().sum().backward()
    y_ours.square().sum().backward()
    for name in ("q_proj", "v_proj"):
        their_layer = getattr(theirs.base_model.model, name)
        assert torch.allclose(getattr(ours, name).lora_A.grad, their_layer.lora_A["default"].weight.grad, atol=1e-5)
        assert torch.allclose(getattr(ours, name).lora_B.grad, their_layer.lora_B["default"].weight.grad, atol=1e-5)
    merged_theirs = theirs.merge_and_unload()
    merged_ours = L.merge_and_unload(ours)
    for name in ("q_proj", "v_proj"):
        assert torch.allclose(getattr(merged_ours, name).weight, getattr(merged_theirs, name).weight, atol=1e-6)
    assert torch.allclose(merged_ours(x), merged_theirs(x), atol=1e-6)


def peft_adapters_like(theirs, ours, names, gen):
    """Random non-zero adapters (and DoRA magnitudes) in PEFT's layers, copied into labkit's."""
    for name in names:
        their_layer, our_layer = theirs.base_model.model.get_submodule(name), ours.get_submodule(name)
        with torch.no_grad():
            their_layer.lora_A["default"].weight.normal_(generator=gen)
            their_layer.lora_B["default"].weight.normal_(generator=gen)
            our_layer.lora_A.copy_(their_layer.lora_A["default"].weight)
            our_layer.lora_B.copy_(their_layer.lora_B["default"].weight)
            if isinstance(our_layer, L.DoRALinear):
                their_magnitude = their_layer.lora_magnitude_vector["default"].weight
                assert torch.allclose(our_layer.lora_magnitude_vector, their_magnitude, atol=1e-6)  # both ||W0|| per row
                their_magnitude.mul_(1 + 0.3 * torch.rand(their_magnitude.shape, generator=gen))
                our_layer.lora_magnitude_vector.copy_(their_magnitude)


def parameters_by_lr(groups) -> dict[float, int]:
    """How many parameters train at each learning rate (PEFT splits B's group by weight decay)."""
    counts = {}
    for group in groups:
        lr = round(group["lr"], 12)
        counts[lr] = counts.get(lr, 0) + sum(p.numel() for p in group["params"])
    return {lr: n for lr, n in counts.items() if n}


def test_same_trainable_parameters_as_peft_and_the_same_groups_for_loraplus():
    peft = import_peft()
    from peft.optimizers import create_loraplus_optimizer

    for use_dora in (False, True):
        model = TwoProjections()
        theirs = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"],
                                                                           use_dora=use_dora))
        ours = L.apply_lora(copy.deepcopy(model), ("q_proj", "v_proj"), r=3, alpha=6, use_dora=use_dora)
        assert L.trainable_parameters(ours) == tuple(theirs.get_nb_trainable_parameters())
        their_optimizer = create_loraplus_optimizer(theirs, torch.optim.AdamW, lr=1e-3, loraplus_lr_ratio=16)
        assert parameters_by_lr(L.loraplus_param_groups(ours, 1e-3, 16)) == parameters_by_lr(their_optimizer.param_groups)


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_dora_matches_peft_outputs_gradients_and_merged_weights(dropout):
    peft = import_peft()
    torch.manual_seed(13)
    model = TwoProjections()
    theirs = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                       lora_dropout=dropout, use_dora=True))
    ours = L.apply_lora(copy.deepcopy(model), ("q_proj", "v_proj"), r=4, alpha=8, dropout=dropout, use_dora=True)
    gen = torch.Generator().manual_seed(14)
    peft_adapters_like(theirs, ours, ("q_proj", "v_proj"), gen)
    x = torch.randn(7, 12, generator=gen)
    theirs.train(), ours.train()
    torch.manual_seed(15)
    y_theirs = theirs(x)
    torch.manual_seed(15)  # the same dropout masks: both draw one mask per layer, in the same order
    y_ours = ours(x)
    assert torch.allclose(y_ours, y_theirs, atol=1e-5)
    y_theirs.square().sum().backward()
    y_ours.square().sum().backward()
    for name in ("q_proj", "v_proj"):
        their_layer, our_layer = getattr(theirs.base_model.model, name), getattr(ours, name)
        for ours_p, theirs_p in ((our_layer.lora_A, their_layer.lora_A["default"].weight),
                                 (our_layer.lora_B, their_layer.lora_B["default"].weight),
                                 (our_layer.lora_magnitude_vector, their_layer.lora_magnitude_vector["default"].weight)):
            assert torch.allclose(ours_p.grad, theirs_p.grad, rtol=1e-4, atol=1e-5)
    theirs.eval(), ours.eval()
    merged_theirs, merged_ours = theirs.merge_and_unload(), L.merge_and_unload(copy.deepcopy(ours))
    for name in ("q_proj", "v_proj"):
        assert torch.allclose(getattr(merged_ours, name).weight, getattr(merged_theirs, name).weight, atol=1e-5)
    assert torch.allclose(merged_ours(x), ours(x), atol=1e-5)


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), "all-linear"])
def test_exported_llama_with_peft_adapters_computes_labkits_adapted_logits(tmp_path, targets):
    """labkit's model exported as a Llama checkpoint; PEFT's adapters on transformers' model and labkit's on
    labkit's, the same numbers in both (copied by hf.llama_lora_weights): the same logits, trainable counts and
    merged checkpoint."""
    peft = import_peft()
    pytest.importorskip("transformers", reason="transformers is not installed; the reference check is skipped")
    from labkit.serving import hf

    cfg = tiny_config(20, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48)
    torch.manual_seed(16)
    model = TransformerLM(cfg)
    their_model = hf.load_llama(hf.export_llama(model, tmp_path / "llama"))
    their_targets = ["q_proj", "v_proj"] if targets != "all-linear" else "all-linear"
    theirs = peft.get_peft_model(their_model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=their_targets))
    ours = L.apply_lora(copy.deepcopy(model), targets, r=4, alpha=8)
    assert L.trainable_parameters(ours)[0] == theirs.get_nb_trainable_parameters()[0]
    gen = torch.Generator().manual_seed(17)
    with torch.no_grad():
        for layer in L.lora_layers(ours).values():
            layer.lora_A.normal_(generator=gen)
            layer.lora_B.normal_(generator=gen).mul_(0.1)
    assert not peft.set_peft_model_state_dict(theirs, hf.llama_lora_weights(ours)).unexpected_keys
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=gen)
    with torch.no_grad():
        assert torch.allclose(theirs(ids).logits, ours(ids), atol=1e-4)
    merged = hf.llama_state_dict(L.merge_and_unload(ours))
    their_merged = theirs.merge_and_unload().state_dict()
    assert set(merged) <= set(their_merged)
    for key, weight in merged.items():
        assert torch.allclose(weight, their_merged[key], atol=1e-5), key


def test_dora_layer_starts_as_the_base_merges_and_unmerges():
    base = nn.Linear(10, 6)
    layer = L.DoRALinear(copy.deepcopy(base), r=2, alpha=4)
    x = torch.randn(5, 10)
    assert torch.allclose(layer(x), base(x), atol=1e-6)
    assert torch.allclose(layer.lora_magnitude_vector, base.weight.norm(dim=1))
    assert L.trainable_parameters(layer)[0] == 2 * (10 + 6) + 6
    random_adapter(layer, seed=3)
    with torch.no_grad():
        layer.lora_magnitude_vector.mul_(1.5)
    direction = base.weight + layer.scaling * layer.lora_B @ layer.lora_A
    expected = x @ (1.5 * base.weight.norm(dim=1)[:, None] * direction / direction.norm(dim=1, keepdim=True)).T + base.bias
    assert torch.allclose(layer(x), expected, atol=1e-5)
    layer(x).sum().backward()
    assert all(p.grad is not None for p in layer.adapter_parameters().values()) and base.weight.grad is None
    layer.merge()
    assert torch.allclose(layer(x), expected, atol=1e-5)
    layer.unmerge()
    assert torch.allclose(layer.base.weight, base.weight, atol=1e-6)
    state = L.lora_state_dict(layer)
    assert set(state) == {"lora_A", "lora_B", "lora_magnitude_vector"}


def test_loraplus_groups_and_finetune_with_them():
    model = L.apply_lora(small_model(), ("q_proj", "v_proj"), r=2, alpha=4)
    slow, fast = L.loraplus_param_groups(model, 1e-3, lr_ratio=8)
    layers = L.lora_layers(model).values()
    assert {id(p) for p in slow["params"]} == {id(layer.lora_A) for layer in layers}
    assert {id(p) for p in fast["params"]} == {id(layer.lora_B) for layer in layers}
    assert slow["lr"] == 1e-3 and fast["lr"] == pytest.approx(8e-3)
    with pytest.raises(ValueError, match="lr_ratio"):
        L.loraplus_param_groups(model, 1e-3, lr_ratio=0)
    with pytest.raises(ValueError, match="no LoRA adapter"):
        L.loraplus_param_groups(small_model(), 1e-3)
    task = L.subtraction_task()
    result = L.finetune(model, task, steps=2, lr=1e-3, batch_size=4, loraplus_lr_ratio=8)
    assert len(result["loss"]) == 2
    with pytest.raises(ValueError, match="give targets"):
        L.finetune_run(small_model(), task, task, None, lr=1e-3, steps=1, use_dora=True)


def test_dora_over_a_4bit_base_is_dora_over_its_dequantized_weight():
    torch.manual_seed(18)
    quant = Q.QuantLinear.from_linear(Linear(128, 48), "nf4", group_size=64)
    plain = Linear(128, 48)
    with torch.no_grad():
        plain.weight.copy_(quant.dequantized_weight())
    over_quant, over_plain = L.DoRALinear(quant, r=4, alpha=8), L.DoRALinear(plain, r=4, alpha=8)
    random_adapter(over_quant, seed=4)
    random_adapter(over_plain, seed=4)
    x = torch.randn(6, 128, requires_grad=True)
    assert torch.allclose(over_quant(x), over_plain(x), atol=1e-5)
    merged = over_quant.merged_linear()
    assert torch.allclose(merged(x), over_plain(x), atol=1e-5)


# ----------------------------------------------------------------------------- merging into a 4-bit base
def test_merge_and_requantize_rounds_the_merged_weight_again():
    torch.manual_seed(19)
    model = nn.Sequential(Q.QuantLinear.from_linear(Linear(128, 48), "nf4", group_size=64))
    L.apply_lora(model, "0", r=4, alpha=8)
    random_adapter(model[0], seed=5)
    w0 = model[0].base.dequantized_weight()
    exact = w0 + model[0].delta_weight()
    x = torch.randn(3, 128)
    with torch.no_grad():
        adapted = model(x)
    merged, report = L.merge_and_requantize(model)
    layer = merged[0]
    assert type(layer) is Q.QuantLinear and (layer.fmt, layer.group_size, layer.scales.dtype) == ("nf4", 64, torch.float16)
    plain = Linear(128, 48)
    with torch.no_grad():
        plain.weight.copy_(exact)
    expected = Q.QuantLinear.from_linear(plain, "nf4", group_size=64)
    assert torch.equal(layer.qweight, expected.qweight) and torch.equal(layer.scales, expected.scales)
    stats = report["0"]
    assert stats["update"] == pytest.approx((exact - w0).norm().item(), rel=1e-5)
    assert stats["error"] == pytest.approx((layer.dequantized_weight() - exact).norm().item(), rel=1e-5)
    assert stats["relative_error"] == pytest.approx(stats["error"] / stats["update"])
    with torch.no_grad():  # the merged layer computes its requantized weight, not the adapted layer's
        assert torch.allclose(merged(x), x @ layer.dequantized_weight().T, atol=1e-5)
        assert not torch.allclose(merged(x), adapted, atol=1e-4)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        L.merge_and_requantize(merged)
    with pytest.raises(ValueError, match="merge_lora"):
        L.merge_and_requantize(L.apply_lora(nn.Sequential(Linear(8, 8)), "0", r=2, alpha=4))


# ----------------------------------------------------------------------------- IA3 and the PEFT map
def test_ia3_scales_outputs_or_feedforward_inputs_and_starts_as_the_base():
    model = small_model()
    x = torch.randint(0, model.config.vocab_size, (2, 8))
    with torch.no_grad():
        before = model(x)
    L.apply_ia3(model)
    layers = L.ia3_layers(model)
    assert sorted({name.rpartition(".")[2] for name in layers}) == ["k_proj", "v_proj", "w2"]
    with torch.no_grad():
        assert torch.equal(model(x), before)
    assert L.trainable_parameters(model)[0] == L.peft_parameter_counts(model.config)["IA3"]
    layer = layers["layers.0.ffn.w2"]
    assert layer.feedforward and layer.ia3_l.shape == (layer.d_in,)
    h = torch.randn(5, layer.d_in)
    with torch.no_grad():
        layer.ia3_l.uniform_(0.5, 1.5)
        assert torch.allclose(layer(h), (h * layer.ia3_l) @ layer.base.weight.T, atol=1e-6)
        k = layers["layers.0.attn.k_proj"]
        k.ia3_l.uniform_(0.5, 1.5)
        e = torch.randn(5, k.d_in)
        assert torch.allclose(k(e), (e @ k.base.weight.T) * k.ia3_l, atol=1e-6)
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="no linear layer"):
        L.apply_ia3(model)


def test_finetune_run_with_use_ia3_is_apply_ia3_then_finetune():
    task = L.subtraction_task()
    base = small_model()
    model, row = L.finetune_run(base, task, task, L.IA3_TARGETS, lr=1e-2, steps=3, batch_size=4, use_ia3=True)
    by_hand = L.apply_ia3(copy.deepcopy(base))
    result = L.finetune(by_hand, task, 3, 1e-2, 4)
    assert row["method"] == "IA3" and row["r"] is None and row["alpha"] is None
    assert row["trainable"] == result["trainable"] == L.trainable_parameters(by_hand)[0]
    assert row["final_loss"] == pytest.approx(sum(result["loss"]) / 3, rel=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), by_hand.state_dict().values()))
    assert not any(isinstance(m, L.IA3Linear) for m in base.modules())  # base left untouched
    with pytest.raises(ValueError, match="use_ia3: give targets"):
        L.finetune_run(base, task, task, None, lr=1e-3, steps=1, use_ia3=True)
    with pytest.raises(ValueError, match="use_dora"):
        L.finetune_run(base, task, task, L.IA3_TARGETS, lr=1e-3, steps=1, use_ia3=True, use_dora=True)


def test_ia3_and_the_parameter_map_match_peft_on_the_exported_llama(tmp_path):
    """IA3 with the same scales in PEFT on the exported checkpoint computes labkit's logits; PEFT's prompt tuning,
    prefix tuning and IA3 train exactly the counts peft_parameter_counts gives."""
    peft = import_peft()
    pytest.importorskip("transformers", reason="transformers is not installed; the reference check is skipped")
    from labkit.serving import hf

    cfg = tiny_config(20, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48)
    torch.manual_seed(20)
    model = TransformerLM(cfg)
    path = hf.export_llama(model, tmp_path / "llama")
    ours = L.apply_ia3(copy.deepcopy(model))
    with torch.no_grad():
        for layer in L.ia3_layers(ours).values():
            layer.ia3_l.uniform_(0.5, 1.5)
    theirs = peft.get_peft_model(hf.load_llama(path), peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                                                     feedforward_modules=["down_proj"]))
    assert not peft.set_peft_model_state_dict(theirs, hf.llama_lora_weights(ours)).unexpected_keys
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(21))
    with torch.no_grad():
        assert torch.allclose(theirs(ids).logits, ours(ids), atol=1e-5)
    counts = L.peft_parameter_counts(cfg, virtual_tokens=6)
    assert counts["IA3"] == theirs.get_nb_trainable_parameters()[0]
    for name, config in (("prompt tuning", peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=6)),
                         ("prefix tuning", peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=6))):
        assert counts[name] == peft.get_peft_model(hf.load_llama(path), config).get_nb_trainable_parameters()[0], name
    assert counts["adapters (Houlsby)"] == 2 * 2 * (2 * 32 * 8 + 8 + 32)
    assert counts["LoRA r=4"] == L.lora_parameter_count(cfg, 4, "all-linear")
