"""Labkit's model in the Hugging Face ecosystem: exported as a Llama checkpoint, served by ``generate``, and by vLLM.

:func:`export_llama` writes a :class:`labkit.model.TransformerLM` as the two files every Llama loader reads
(``config.json`` and ``model.safetensors``), so ``transformers.LlamaForCausalLM.from_pretrained(path)`` (and vLLM
on a GPU, :func:`vllm_serve_command`) compute the same logits as labkit. :func:`hf_static_generate` serves a
workload (:mod:`labkit.serving.workload`) with Hugging Face ``generate`` in static batches: the other library's
baseline the chapter's engine is measured against.

``transformers`` and ``safetensors`` are optional (the ``reference`` extra): they are imported only inside the
functions that need them, so ``import labkit.serving`` works without them.
"""
from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import torch

from labkit.model import TransformerLM
from labkit.nn import rotate_half_permutation
from labkit.serving.engine import RequestOutput
from labkit.serving.workload import ServeResult, WorkloadRequest

__all__ = [
    "llama_config", "llama_state_dict", "llama_lora_weights", "export_llama", "load_llama",
    "hf_static_generate", "vllm_serve_command",
]

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def llama_config(model: TransformerLM) -> dict:
    """The ``config.json`` of ``model`` as a Llama checkpoint. ``ValueError`` names the first field of
    ``model.config`` that Llama cannot express (Llama is RMSNorm + SwiGLU + RoPE, dense, without QK-norm)."""
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model: expected a labkit.model.TransformerLM, got {type(model).__name__}")
    cfg = model.config
    refusals = [
        (cfg.norm != "rmsnorm", f"norm={cfg.norm!r}: Llama normalizes with RMSNorm only ('rmsnorm')"),
        (cfg.activation != "silu", f"activation={cfg.activation!r}: Llama's feed-forward is SwiGLU ('silu')"),
        (cfg.moe is not None, "moe: Llama has dense feed-forward layers only (export a dense model, moe=None)"),
        (cfg.qk_norm, "qk_norm=True: Llama has no QK-norm (Qwen3's architecture has one)"),
    ]
    for refused, message in refusals:
        if refused:
            raise ValueError(message)
    dtype = model.token_embeddings.weight.dtype
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"model: weights of dtype {dtype}; expected one of {sorted(_DTYPE_NAMES.values())}")
    return {
        "architectures": ["LlamaForCausalLM"],  # the class vLLM and AutoModelForCausalLM build
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dim_per_head,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.norm_eps,  # Llama's default is 1e-6, labkit's 1e-5: it must travel
        # transformers 5 reads `rope_parameters`; 4.x (what an older vLLM install brings) reads `rope_theta`
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        # labkit's tokenizers have no BOS/EOS: without these Llama's defaults (1 and 2) would stop `generate`
        # whenever the model happens to emit token 2
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": _DTYPE_NAMES[dtype],
        "torch_dtype": _DTYPE_NAMES[dtype],  # the same, under transformers 4.x's name
    }


def _rotate_half_rows(weight: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder each head's output rows of a q/k projection from labkit's RoPE layout to Hugging Face's.

    labkit's RoPE rotates interleaved pairs ``(2i, 2i+1)`` of a head by angle ``pos * theta^(-2i/d)``; Llama's
    ``rotate_half`` rotates the pairs ``(i, i + d/2)`` by the same angle. So Hugging Face's channel ``i`` must hold
    labkit's channel ``2i`` and its channel ``i + d/2`` labkit's ``2i+1``: row order ``[0, 2, 4, ..., 1, 3, 5, ...]``,
    the inverse of :func:`labkit.nn.rotate_half_permutation`. Both q and k are reordered the same way, so every
    ``q . k`` (the only thing attention uses them for) is unchanged; v and the output projection are untouched."""
    to_hugging_face = rotate_half_permutation(head_dim).argsort()
    d_in = weight.shape[1]
    return weight.view(num_heads, head_dim, d_in)[:, to_hugging_face].reshape(num_heads * head_dim, d_in)


# labkit's name of each linear layer inside a block -> Llama's (SwiGLU: w2(silu(w1 x) * w3 x) is down(silu(gate x) * up x))
LLAMA_LAYER_NAMES = {"attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj", "attn.v_proj": "self_attn.v_proj",
                     "attn.output_proj": "self_attn.o_proj", "ffn.w1": "mlp.gate_proj", "ffn.w3": "mlp.up_proj",
                     "ffn.w2": "mlp.down_proj"}


def _block_layer(model: TransformerLM, name: str) -> tuple[str, int | None]:
    """Llama's name of the block layer ``name`` (``layers.{i}.attn.q_proj`` -> ``model.layers.{i}.self_attn.q_proj``)
    and the number of heads whose rows the export reorders (q and k), ``None`` for the other layers."""
    parts = name.split(".")
    inner = ".".join(parts[2:])
    if len(parts) < 4 or parts[0] != "layers" or not parts[1].isdigit() or inner not in LLAMA_LAYER_NAMES:
        raise ValueError(f"{name!r}: not a linear layer of a block (expected layers.<i>.<one of {sorted(LLAMA_LAYER_NAMES)}>)")
    heads = {"attn.q_proj": model.config.num_heads, "attn.k_proj": model.config.kv_heads}.get(inner)
    return f"model.layers.{parts[1]}.{LLAMA_LAYER_NAMES[inner]}", heads


def llama_state_dict(model: TransformerLM) -> dict[str, torch.Tensor]:
    """``model``'s weights under Llama's names (contiguous CPU tensors, q/k rows in ``rotate_half`` order).
    With tied embeddings only ``model.embed_tokens.weight`` is written: Llama re-ties ``lm_head`` on loading."""
    cfg = model.config
    llama_config(model)  # refuses what Llama cannot express
    weights = {"model.embed_tokens.weight": model.token_embeddings.weight, "model.norm.weight": model.ln_final.weight}
    if not cfg.tie_embeddings:
        weights["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        weights[prefix + "input_layernorm.weight"] = layer.ln1.weight
        weights[prefix + "post_attention_layernorm.weight"] = layer.ln2.weight
        for inner in LLAMA_LAYER_NAMES:
            llama_name, heads = _block_layer(model, f"layers.{i}.{inner}")
            weight = layer.get_submodule(inner).weight
            weights[llama_name + ".weight"] = weight if heads is None else _rotate_half_rows(weight, heads, cfg.dim_per_head)
    return {name: tensor.detach().to("cpu").contiguous() for name, tensor in weights.items()}


def llama_lora_weights(model: TransformerLM) -> dict[str, torch.Tensor]:
    """The adapters of ``model`` (a :class:`~labkit.model.TransformerLM` after :func:`labkit.lora.apply_lora`, LoRA
    or DoRA, or :func:`labkit.lora.apply_ia3`) for the Llama checkpoint :func:`export_llama` writes of it, under the
    names of a Hugging Face PEFT adapter file (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``,
    ``...lora_B.weight``, ``...lora_magnitude_vector`` for DoRA, ``...ia3_l`` for IA3):
    ``peft.set_peft_model_state_dict(peft_model, llama_lora_weights(model))`` loads them into
    ``get_peft_model(llama, LoraConfig(...))`` (or ``IA3Config``) with the same rank, alpha and targets.

    ``B``'s rows, DoRA's magnitudes and IA3's output scales are output features, so on q and k they are reordered
    as the export reorders those weights' rows (``rotate_half`` order); ``A``'s columns and IA3's input scales
    are input features and stay as they are. Contiguous CPU tensors. ``ValueError`` if ``model`` has no adapters
    or one on a layer outside the blocks (the LM head); ``model`` must be exportable (:func:`llama_config`)."""
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model: expected a labkit.model.TransformerLM with LoRA adapters, got {type(model).__name__}")
    llama_config(model)
    from labkit import lora as L  # here, not at the top: exporting a plain model needs none of LoRA's imports

    layers = {**L.lora_layers(model), **L.ia3_layers(model)}
    if not layers:
        raise ValueError("model: has no LoRA adapters (wrap its layers with labkit.lora.apply_lora first)")
    weights = {}
    for name, layer in layers.items():
        llama_name, heads = _block_layer(model, name)
        prefix = "base_model.model." + llama_name

        def output_rows(tensor, heads=heads):  # rows are output features: in the export's order on q and k
            return tensor if heads is None else _rotate_half_rows(tensor, heads, model.config.dim_per_head)

        adapter = layer.adapter_parameters()
        if isinstance(layer, L.IA3Linear):  # PEFT keeps the scales as [d_out, 1], or [1, d_in] on the input
            scales = adapter["ia3_l"]
            weights[prefix + ".ia3_l"] = scales[None, :] if layer.feedforward else output_rows(scales[:, None])
            continue
        weights[prefix + ".lora_A.weight"] = adapter["lora_A"]
        weights[prefix + ".lora_B.weight"] = output_rows(adapter["lora_B"])
        if "lora_magnitude_vector" in adapter:  # DoRA
            weights[prefix + ".lora_magnitude_vector"] = output_rows(adapter["lora_magnitude_vector"][:, None])[:, 0]
    return {name: tensor.detach().to("cpu").contiguous() for name, tensor in weights.items()}


def export_llama(model: TransformerLM, path) -> Path:
    """Write ``model`` to the directory ``path`` as a Llama checkpoint (``config.json`` + ``model.safetensors``,
    weights in the model's dtype) and return the directory. Needs ``safetensors`` (not ``transformers``)."""
    config = llama_config(model)
    weights = llama_state_dict(model)
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"path={str(path)!r}: expected a directory (or a path to create one), found a file")
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def load_llama(path, device=None):
    """``transformers.LlamaForCausalLM`` loaded from ``path`` (an :func:`export_llama` directory), in eval mode."""
    try:
        from transformers import LlamaForCausalLM
    except ImportError as error:
        raise ImportError("load_llama needs Hugging Face transformers: pip install 'labkit[reference]'") from error
    from transformers.utils import logging as hf_logging

    # the loading progress bar would put timings into a notebook's stored output
    bar_was_shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = LlamaForCausalLM.from_pretrained(str(path))
    finally:
        if bar_was_shown:
            hf_logging.enable_progress_bar()
    return model.to(device).eval() if device is not None else model.eval()


# ----------------------------------------------------------------------------- static batching through `generate`
class _FirstTokenClock:
    """A ``generate`` streamer that only notes when the first new tokens come out: ``generate`` calls ``put`` with
    the prompt, then once per decoding step with that step's tokens, already copied to the host (so on a GPU too
    the time is taken after the prefill's work is done)."""

    def __init__(self, clock):
        self.clock, self.first_token_time, self._puts = clock, None, 0

    def put(self, value):
        self._puts += 1
        if self._puts == 2:
            self.first_token_time = self.clock()

    def end(self):
        pass


@torch.no_grad()
def hf_static_generate(hf_model, workload: list[WorkloadRequest], batch_size: int, pad_token_id: int = 0,
                       clock=time.perf_counter, sleep=time.sleep) -> ServeResult:
    """Serve ``workload`` (e.g. :func:`labkit.serving.workload.mixed_workload`) with Hugging Face ``generate`` in
    static batches of at most ``batch_size``, in real time: the baseline of ``Engine(batching="static")``, run by
    another library. :func:`labkit.serving.workload.metrics` reads the result as it reads :func:`serve`'s.

    Each batch is formed when the previous one has returned, from the requests that have arrived by then, in
    arrival order (waiting, ``sleep``, for the next arrival when none has); it is left-padded with ``pad_token_id``
    under an attention mask (``generate`` derives positions from the mask, so padding changes neither a token's
    position nor what it attends to) and decoded greedily until its longest request is done; each request keeps its
    first ``max_new_tokens`` tokens. Timings (seconds of ``clock``) of each
    :class:`~labkit.serving.engine.RequestOutput`: ``first_scheduled_time`` when its batch went into ``generate``;
    ``first_token_time`` when ``generate`` handed out the batch's first tokens (prefill and its argmax done), one
    moment for the whole batch; ``finish_time`` when ``generate`` returned, the first moment its tokens are
    anyone's (the batch waits for its longest member). ``trace`` is empty: ``generate`` has no engine steps."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: expected a positive integer")
    if not hasattr(hf_model, "generate"):
        raise TypeError(f"hf_model: expected a transformers model with generate(), got {type(hf_model).__name__}")
    if not workload or not all(isinstance(r, WorkloadRequest) for r in workload):
        raise TypeError("workload: expected a non-empty list of WorkloadRequest (see mixed_workload)")
    for i, request in enumerate(workload):
        if len(request.prompt_ids) == 0:
            raise ValueError(f"workload[{i}]: prompt_ids is empty; expected at least one token id")
        if request.max_new_tokens < 1:
            raise ValueError(f"workload[{i}]: max_new_tokens={request.max_new_tokens}: expected >= 1")
    from transformers import GenerationConfig

    pending = sorted(range(len(workload)), key=lambda i: workload[i].arrival)  # indices, in arrival order
    device = next(hf_model.parameters()).device
    outputs: dict[int, RequestOutput] = {}
    start = clock()
    while pending:
        sleep(max(0.0, workload[pending[0]].arrival - (clock() - start)))
        now = clock() - start
        batch = [i for i in pending[:batch_size] if workload[i].arrival <= now]
        pending = pending[len(batch):]
        longest_prompt = max(len(workload[i].prompt_ids) for i in batch)
        steps = max(workload[i].max_new_tokens for i in batch)
        ids = torch.full((len(batch), longest_prompt), pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):
            prompt = workload[i].prompt_ids
            ids[row, longest_prompt - len(prompt):] = torch.tensor(prompt)
            mask[row, longest_prompt - len(prompt):] = 1
        first_token = _FirstTokenClock(clock)
        generation = GenerationConfig(max_new_tokens=steps, do_sample=False,
                                      pad_token_id=pad_token_id, bos_token_id=None, eos_token_id=None)
        scheduled = clock()
        sequences = hf_model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                      generation_config=generation, streamer=first_token).cpu()
        finished = clock()
        if sequences.shape[1] != longest_prompt + steps:
            raise RuntimeError(f"generate returned {sequences.shape[1] - longest_prompt} new tokens, expected {steps}")
        for row, i in enumerate(batch):
            request = workload[i]
            outputs[i] = RequestOutput(
                request_id=i, prompt_ids=tuple(request.prompt_ids),
                output_ids=tuple(sequences[row, longest_prompt:longest_prompt + request.max_new_tokens].tolist()),
                arrival_time=start + request.arrival, first_scheduled_time=scheduled,
                first_token_time=first_token.first_token_time, finish_time=finished,
                num_cached_tokens=0, num_preemptions=0)  # generate neither shares prompts nor preempts
    last = max(o.finish_time for o in outputs.values())
    return ServeResult(tuple(outputs[i] for i in range(len(workload))), last - start, ())


# ----------------------------------------------------------------------------- vLLM (on a GPU; not run here)
def vllm_serve_command(path, port: int = 8000, dtype: str = "bfloat16", served_model_name: str = "labkit",
                       max_num_seqs: int | None = None) -> str:
    """The shell command that serves an :func:`export_llama` directory with vLLM's OpenAI-compatible server.

    - ``--skip-tokenizer-init``: the checkpoint has no Hugging Face tokenizer (labkit's tokenizers are its own),
      so clients send token ids (``"prompt": [ids]`` to ``/v1/completions``) and get token ids back.
    - ``--dtype bfloat16``: vLLM's FlashAttention kernels have no fp32, and its ``auto`` turns an fp32 checkpoint
      into fp16; bf16 keeps fp32's exponent range (greedy tokens may then differ from labkit's fp32 ones where two
      logits are within bf16's rounding of each other). Its kernels also expect common head sizes (64, 128, ...):
      export a model with such a head_dim to serve it on a GPU.
    - ``--max-model-len``: the checkpoint's context length, read from its ``config.json``.
    """
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"path={str(path)!r}: expected a directory written by export_llama (no config.json there)")
    if dtype not in ("bfloat16", "float16", "float32", "auto"):
        raise ValueError(f"dtype={dtype!r}: expected 'bfloat16', 'float16', 'float32' or 'auto'")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port={port!r}: expected an integer in 1..65535")
    context = json.loads(config_file.read_text())["max_position_embeddings"]
    words = ["vllm", "serve", str(directory.resolve()), "--served-model-name", served_model_name,
             "--skip-tokenizer-init", "--dtype", dtype, "--max-model-len", str(context), "--port", str(port)]
    if max_num_seqs is not None:
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs!r}: expected a positive integer or None")
        words += ["--max-num-seqs", str(max_num_seqs)]
    return shlex.join(words)
