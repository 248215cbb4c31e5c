"""labkit.serving.hf: labkit's model as a Llama checkpoint that Hugging Face loads with equal logits, static
batches through `generate` whose greedy tokens equal labkit's, and the vLLM command."""
import copy
import json
import shlex
import subprocess
import sys

import pytest
import torch

from labkit import lora as L
from labkit.experts import MoEConfig
from labkit.model import TransformerLM, generate, tiny_config
from labkit.serving import hf
from labkit.serving.engine import RequestOutput
from labkit.serving.workload import ServeResult, WorkloadRequest, metrics, mixed_workload

pytest.importorskip("safetensors")

VOCAB = 61


def random_model(seed: int, **overrides) -> TransformerLM:
    """A tiny model with every weight random, the norm gains too (their init, all ones, would hide a mix-up of
    ln1, ln2 and the final norm)."""
    torch.manual_seed(seed)
    model = TransformerLM(tiny_config(VOCAB, **overrides)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")):
                parameter.uniform_(0.5, 1.5)
    return model


CONFIGS = {
    "mha": dict(),
    "gqa": dict(num_kv_heads=2, rope_theta=500.0, norm_eps=1e-3),
    "mqa-tied": dict(num_kv_heads=1, tie_embeddings=True),
    "head-dim": dict(num_heads=4, num_kv_heads=2, head_dim=8, num_layers=3, rope_theta=50.0, norm_eps=1e-6),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_exported_llama_logits_equal_labkits(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = random_model(len(name), **CONFIGS[name])
    cfg = model.config
    hf.export_llama(model, tmp_path)
    llama = hf.load_llama(tmp_path)
    assert isinstance(llama, transformers.LlamaForCausalLM)
    # what Llama's defaults would get wrong if it did not travel
    assert llama.config.rms_norm_eps == cfg.norm_eps
    assert llama.config.rope_parameters["rope_theta"] == cfg.rope_theta
    assert (llama.config.num_key_value_heads, llama.config.head_dim) == (cfg.kv_heads, cfg.dim_per_head)
    assert llama.config.tie_word_embeddings == cfg.tie_embeddings
    # every position of the context, so a wrong RoPE frequency or pairing shows at long range
    tokens = torch.randint(0, VOCAB, (3, cfg.context_length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = model(tokens), llama(tokens).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_tied_embeddings_are_written_once_and_tied_again(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    model = random_model(0, tie_embeddings=True)
    hf.export_llama(model, tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    llama = hf.load_llama(tmp_path)
    assert llama.lm_head.weight.data_ptr() == llama.model.embed_tokens.weight.data_ptr()


def test_rope_permutation_is_what_makes_the_logits_agree(tmp_path):
    """Without reordering q/k rows into rotate_half's layout the export loads but computes another model."""
    pytest.importorskip("transformers")
    from safetensors.torch import save_file

    model = random_model(3)
    hf.export_llama(model, tmp_path)
    weights = hf.llama_state_dict(model)
    for i, layer in enumerate(model.layers):
        weights[f"model.layers.{i}.self_attn.q_proj.weight"] = layer.attn.q_proj.weight.detach().clone()
        weights[f"model.layers.{i}.self_attn.k_proj.weight"] = layer.attn.k_proj.weight.detach().clone()
    save_file(weights, str(tmp_path / "model.safetensors"))
    tokens = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (hf.load_llama(tmp_path)(tokens).logits - model(tokens)).abs().max()
    assert gap > 1e-2


def test_export_keeps_the_weights_dtype(tmp_path):
    model = random_model(0).to(torch.bfloat16)
    hf.export_llama(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLM"]
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(tmp_path / "model.safetensors").values()} == {torch.bfloat16}


def random_adapters(model, seed: int):
    """Non-zero adapters (B starts at zero) and, for DoRA, magnitudes away from ||W0||."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in (p for layer in L.lora_layers(model).values() for p in layer.adapter_parameters().values()):
            parameter.mul_(1 + 0.3 * torch.rand(parameter.shape, generator=gen)).add_(0.1 * torch.randn(parameter.shape, generator=gen))
    return model


@pytest.mark.parametrize("name", ["mha", "head-dim"])
def test_llama_lora_weights_merge_into_the_exported_weights(name):
    """W0 + scaling * B A in Llama's layout is the export of the merged model: right names, q/k rows reordered."""
    base = random_model(5, **CONFIGS[name])
    ours = random_adapters(L.apply_lora(copy.deepcopy(base), "all-linear", r=3, alpha=6), seed=6)
    adapters, before = hf.llama_lora_weights(ours), hf.llama_state_dict(base)
    merged = hf.llama_state_dict(L.merge_and_unload(copy.deepcopy(ours)))
    assert len(adapters) == 2 * len(L.lora_layers(ours)) == 2 * 7 * base.config.num_layers
    for key, weight in merged.items():
        if key.endswith("_proj.weight"):
            prefix = "base_model.model." + key.removesuffix(".weight")
            a, b = adapters[prefix + ".lora_A.weight"], adapters[prefix + ".lora_B.weight"]
            torch.testing.assert_close(weight, before[key] + 2.0 * b @ a, atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(weight, before[key])


def test_llama_lora_weights_are_what_peft_saves_and_loads(tmp_path):
    """The same names and shapes as PEFT's own adapter state dict (DoRA's magnitudes too), and loaded with
    set_peft_model_state_dict the adapted Llama computes labkit's logits."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("transformers")
    base = random_model(7, **CONFIGS["gqa"])
    for use_dora in (False, True):
        ours = random_adapters(L.apply_lora(copy.deepcopy(base), ("q_proj", "k_proj", "w2"), r=2, alpha=4,
                                            use_dora=use_dora), seed=8)
        llama = hf.load_llama(hf.export_llama(base, tmp_path / f"dora-{use_dora}"))
        theirs = peft.get_peft_model(llama, peft.LoraConfig(r=2, lora_alpha=4, use_dora=use_dora,
                                                            target_modules=["q_proj", "k_proj", "down_proj"]))
        weights = hf.llama_lora_weights(ours)
        expected = peft.get_peft_model_state_dict(theirs)
        assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in expected.items()}
        assert not peft.set_peft_model_state_dict(theirs, weights).unexpected_keys
        tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            torch.testing.assert_close(theirs(tokens).logits, ours(tokens), atol=1e-4, rtol=1e-4)


def test_llama_lora_weights_refuses_what_it_cannot_name():
    with pytest.raises(ValueError, match="no LoRA adapters"):
        hf.llama_lora_weights(random_model(0))
    with pytest.raises(ValueError, match="lm_head"):
        hf.llama_lora_weights(L.apply_lora(random_model(0), "lm_head", r=2, alpha=4))
    with pytest.raises(TypeError, match="TransformerLM"):
        hf.llama_lora_weights(L.apply_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), "0", r=2, alpha=4))


@pytest.mark.parametrize("overrides, field", [
    (dict(norm="layernorm"), "norm"),
    (dict(norm="none"), "norm"),
    (dict(activation="gelu"), "activation"),
    (dict(qk_norm=True), "qk_norm"),
    (dict(moe=MoEConfig(num_experts=4, top_k=2)), "moe"),
])
def test_what_llama_cannot_express_is_refused_by_name(overrides, field, tmp_path):
    with pytest.raises(ValueError, match=field):
        hf.export_llama(TransformerLM(tiny_config(VOCAB, **overrides)), tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


def test_export_refuses_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="model"):
        hf.export_llama(torch.nn.Linear(2, 2), tmp_path)
    file = tmp_path / "taken"
    file.write_text("")
    with pytest.raises(ValueError, match="path"):
        hf.export_llama(random_model(0), file)


# ----------------------------------------------------------------------------- static batches through generate
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("transformers")
    model = random_model(7, num_kv_heads=2)
    path = hf.export_llama(model, tmp_path_factory.mktemp("llama"))
    return model, hf.load_llama(path)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_static_batches_decode_what_labkit_decodes_alone(served, batch_size):
    """Left padding in a batch of mixed prompt lengths leaves every greedy token as labkit decodes it alone."""
    model, llama = served
    requests = mixed_workload(8, VOCAB, prompt_len=(1, 20), short_output=(1, 4), long_output=(8, 12), seed=batch_size)
    result = hf.hf_static_generate(llama, requests, batch_size=batch_size)
    assert isinstance(result, ServeResult) and len(result.outputs) == len(requests)
    for request, out in zip(requests, result.outputs):
        prompt = list(request.prompt_ids)
        alone = generate(model, torch.tensor(prompt), request.max_new_tokens)[len(prompt):].tolist()
        assert list(out.output_ids) == alone, f"prompt of {len(prompt)} tokens, left-padded in a batch of {batch_size}"
        assert isinstance(out, RequestOutput) and out.prompt_ids == request.prompt_ids
    batch_starts = sorted({out.first_scheduled_time for out in result.outputs})
    expected_sizes = [min(batch_size, len(requests) - s) for s in range(0, len(requests), batch_size)]
    assert [sum(out.first_scheduled_time == t for out in result.outputs) for t in batch_starts] == expected_sizes
    served_metrics = metrics(result)
    assert served_metrics.generated_tokens == sum(r.max_new_tokens for r in requests)
    assert served_metrics.tokens_per_s > 0


def test_static_batch_timings(served):
    _, llama = served
    requests = [WorkloadRequest((1, 2, 3), 4, 0.0), WorkloadRequest((5,), 1, 0.0), WorkloadRequest((7, 8), 6, 0.0),
                WorkloadRequest((9, 9, 9, 9), 2, 0.05)]
    result = hf.hf_static_generate(llama, requests, batch_size=3)
    first, second = result.outputs[:3], result.outputs[3]
    assert len({out.first_scheduled_time for out in first}) == 1 and second.first_scheduled_time > first[0].finish_time
    assert len({out.first_token_time for out in first}) == 1  # one prefill for the whole batch
    assert len({out.finish_time for out in first}) == 1  # generate returns the whole batch at once
    for out in result.outputs:
        assert out.arrival_time <= out.first_scheduled_time < out.first_token_time <= out.finish_time
    assert first[1].tpot == 0.0
    assert first[0].tpot > first[2].tpot  # 4 tokens wait as long as the batch's 6
    assert second.first_scheduled_time >= second.arrival_time == pytest.approx(first[0].arrival_time + 0.05)
    assert result.seconds == pytest.approx(second.finish_time - first[0].arrival_time)


def test_static_generate_refuses_bad_requests(served):
    _, llama = served
    one = [WorkloadRequest((1,), 1, 0.0)]
    with pytest.raises(ValueError, match="batch_size"):
        hf.hf_static_generate(llama, one, batch_size=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        hf.hf_static_generate(llama, [WorkloadRequest((1,), 0, 0.0)], batch_size=1)
    with pytest.raises(ValueError, match="prompt_ids"):
        hf.hf_static_generate(llama, [WorkloadRequest((), 3, 0.0)], batch_size=1)
    for workload in (["hello"], [], [((1, 2), 3)]):
        with pytest.raises(TypeError, match="workload"):
            hf.hf_static_generate(llama, workload, batch_size=1)
    with pytest.raises(TypeError, match="hf_model"):
        hf.hf_static_generate(torch.nn.Linear(2, 2), one, batch_size=1)


# ----------------------------------------------------------------------------- vLLM
def test_vllm_command_serves_the_exported_directory(tmp_path):
    hf.export_llama(random_model(0), tmp_path)
    words = shlex.split(hf.vllm_serve_command(tmp_path, port=8100, max_num_seqs=16))
    assert words[:3] == ["vllm", "serve", str(tmp_path.resolve())]
    assert "--skip-tokenizer-init" in words
    flags = {"--max-model-len": "64", "--port": "8100", "--dtype": "bfloat16", "--max-num-seqs": "16"}
    for flag, value in flags.items():
        assert words[words.index(flag) + 1] == value
    with pytest.raises(ValueError, match="config.json"):
        hf.vllm_serve_command(tmp_path / "missing")
    with pytest.raises(ValueError, match="dtype"):
        hf.vllm_serve_command(tmp_path, dtype="fp8")


def test_serving_imports_without_transformers_and_safetensors():
    """A learner without the `reference` extra can still import labkit.serving; the functions that need the
    packages say which install brings them."""
    script = """
import sys
sys.modules["transformers"] = sys.modules["safetensors"] = None  # as if not installed
import labkit.serving
from labkit.serving import hf
try:
    hf.load_llama(".")
except ImportError as error:
    assert "labkit[reference]" in str(error), error
else:
    raise AssertionError("load_llama without transformers did not raise ImportError")
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
