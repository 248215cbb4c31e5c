"""Attention as a serving system sees it (chapter 03): FlashAttention's online softmax written
with plain torch tiles, the KV cache and what it costs in memory and time, turning a trained MHA
model into GQA/MQA (mean-pooled K/V heads, then uptraining), and the functions behind the
chapter's widgets. The cache itself, :class:`KVCache`, is defined in :mod:`labkit.nn` (the
model's attention writes to it) and re-exported here.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

import torch

from labkit.data import ArithmeticTask
from labkit.hardware import timeit
from labkit.memory import SavedTensorMeter
from labkit.model import PRESETS, ModelConfig, TransformerLM, config_from, count_parameters, generate
# KVCache belongs to the model layer (labkit.nn, next to the attention that writes to it) so
# that labkit.model.generate can use it without importing this chapter; re-exported here
# because the chapter builds and reads it as attention.KVCache.
from labkit.nn import KVCache, causal_mask, scaled_dot_product_attention
from labkit.runtime import run_seed
from labkit.train import TrainConfig, estimate_loss, train


# ----------------------------------------------------------------------------- FlashAttention in torch
def online_softmax_update(running_max, running_sum, acc, scores, values):
    """Fold one block of keys into a running softmax-weighted sum (FlashAttention's inner step).

    ``running_max``/``running_sum`` ``[..., q]``: the max of the scores seen so far and the sum of
    ``exp(score - running_max)`` over them; ``acc`` ``[..., q, d]``: the sum of
    ``exp(score - running_max) * value``. ``scores`` ``[..., q, k]`` (scaled; masked entries
    ``-inf``) and ``values`` ``[..., k, d]`` are the new block. Returns the three updated.
    When the max grows, everything accumulated so far was exponentiated against the old max,
    so it is rescaled by ``exp(old_max - new_max)``; at the end ``acc / running_sum`` is exactly
    ``softmax(all scores) @ all values``.

    A row whose keys so far are all masked keeps the state ``(-inf, 0, 0)``: its exponents are shifted
    by 0 instead of its max, since ``exp(-inf - -inf)`` is NaN. A row masked in every block ends
    with ``running_sum == 0`` and ``acc == 0``; what its output is, the caller decides (FlashAttention
    kernels write 0 and ``lse = -inf``).
    """
    new_max = torch.maximum(running_max, scores.amax(dim=-1))
    shift = torch.where(torch.isneginf(new_max), torch.zeros_like(new_max), new_max)
    correction = torch.exp(running_max - shift)
    p = torch.exp(scores - shift[..., None])
    new_sum = running_sum * correction + p.sum(dim=-1)
    new_acc = acc * correction[..., None] + p @ values
    return new_max, new_sum, new_acc


def flash_attention_torch(q, k, v, causal: bool = False, block_q: int = 64, block_k: int = 64, scale: float | None = None):
    """FlashAttention-2's forward with plain torch tiles: ``(out, lse)``.

    Same contract as :func:`labkit.kernels.flash_attention_with_lse` (q ``[B, Hq, Nq, D]``, k/v
    ``[B, Hkv, Nk, D]``, bottom-right causal mask, ``lse`` fp32 ``[B, Hq, Nq]``), but written
    for reading: for each block of ``block_q`` queries, walk the key blocks, folding each into
    the running max / sum / accumulator with :func:`online_softmax_update`. At most a
    ``block_q x block_k`` tile of scores exists at any time, and K/V are read in place: the query
    heads are grouped as ``[B, Hkv, group, Nq, D]`` and each K/V tile broadcasts over its group.
    Math in fp32 (fp64 for fp64 input).
    """
    _check_qkv(q, k, v)
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r}: expected a positive integer")
    num_q, num_k = q.shape[-2], k.shape[-2]
    if causal and num_q > num_k:
        raise ValueError(f"causal=True with Nq={num_q} > Nk={num_k}: bottom-right alignment leaves the first queries no key")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    # query head h = g * group + i reads K/V head g: a [B, Hkv, group, ...] view, each K/V tile broadcast over i
    grouped_q = q.unflatten(1, (num_kv_heads, num_heads // num_kv_heads))
    out = torch.empty(grouped_q.shape, dtype=compute, device=q.device)
    lse = torch.empty(grouped_q.shape[:-1], dtype=compute, device=q.device)
    offset = num_k - num_q  # bottom-right: query i sees keys j <= i + offset
    for q_start in range(0, num_q, block_q):
        q_end = min(q_start + block_q, num_q)
        q_block = grouped_q[..., q_start:q_end, :].to(compute)
        running_max = torch.full(q_block.shape[:-1], float("-inf"), dtype=compute, device=q.device)
        running_sum = torch.zeros_like(running_max)
        acc = torch.zeros_like(q_block)
        last_key = min(num_k, q_end + offset) if causal else num_k  # later key blocks are fully masked
        for k_start in range(0, last_key, block_k):
            k_end = min(k_start + block_k, num_k)
            k_tile, v_tile = (t[:, :, None, k_start:k_end].to(compute) for t in (k, v))  # [B, Hkv, 1, keys, D]
            scores = q_block @ k_tile.transpose(-2, -1) * scale
            if causal:
                rows = torch.arange(q_start, q_end, device=q.device)[:, None]
                cols = torch.arange(k_start, k_end, device=q.device)[None, :]
                scores = scores.masked_fill(cols > rows + offset, float("-inf"))
            running_max, running_sum, acc = online_softmax_update(running_max, running_sum, acc, scores, v_tile)
        out[..., q_start:q_end, :] = acc / running_sum[..., None]
        lse[..., q_start:q_end] = running_max + torch.log(running_sum)
    return out.view(q.shape).to(q.dtype), lse.view(q.shape[:-1])


def split_k_attention(q, k, v, num_splits: int, scale: float | None = None):
    """Decode-time attention split over the keys (split-K, "Flash-Decoding"): ``(out, lse)`` like
    :func:`flash_attention_torch` without a mask (the few new queries see the whole cache).

    The cache's ``Nk`` keys are cut into ``num_splits`` chunks; each chunk's attention is computed on its own (on a
    GPU: by its own programs, so one query per sequence still fills the machine), giving a partial output
    ``o_i`` (normalised within the chunk) and its log-sum-exp ``lse_i``. They combine exactly:
    ``lse = logsumexp_i(lse_i)`` and ``out = sum_i exp(lse_i - lse) o_i``. K/V are read in place (GQA by
    broadcasting each K/V head over its query heads)."""
    _check_qkv(q, k, v)
    if not isinstance(num_splits, int) or not 1 <= num_splits <= k.shape[-2]:
        raise ValueError(f"num_splits={num_splits!r}: expected an integer from 1 to the number of keys ({k.shape[-2]})")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)
    grouped_q = q.unflatten(1, (k.shape[1], q.shape[1] // k.shape[1])).to(compute)  # [B, Hkv, group, Nq, D]
    partial_out, partial_lse = [], []
    for keys in torch.arange(k.shape[-2], device=q.device).tensor_split(num_splits):
        scores = grouped_q @ k[:, :, None, keys].to(compute).transpose(-2, -1) * scale
        chunk_lse = torch.logsumexp(scores, dim=-1)
        partial_out.append(torch.exp(scores - chunk_lse[..., None]) @ v[:, :, None, keys].to(compute))
        partial_lse.append(chunk_lse)
    lse_parts = torch.stack(partial_lse)
    lse = torch.logsumexp(lse_parts, dim=0)
    out = (torch.exp(lse_parts - lse)[..., None] * torch.stack(partial_out)).sum(0)
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)


def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor [batch, heads, seq, head_dim], got {getattr(t, 'shape', type(t).__name__)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q, k, v: expected q [B, Hq, Nq, D] and k, v [B, Hkv, Nk, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q, k: query heads Hq={q.shape[1]} must be a multiple of K/V heads Hkv={k.shape[1]}")


def plain_attention(q, k, v, causal: bool = False) -> torch.Tensor:
    """Textbook attention on ``[B, H, N, D]`` tensors (GQA by repeating K/V): materialises the
    ``N x N`` scores and probabilities, which autograd keeps for the backward pass."""
    _check_qkv(q, k, v)
    group = q.shape[1] // k.shape[1]
    mask = causal_mask(q.shape[-2], k.shape[-2], device=q.device) if causal else None
    return scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), mask)


def standard_attention_traffic(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int,
                               element_size: int) -> dict[str, int]:
    """Bytes standard attention moves to and from HBM, ``{"loaded", "stored"}`` (the FlashAttention paper's
    Algorithm 0): load Q and K, store ``S = QK^T``; load S, store ``P = softmax(S)``; load P and V, store O.
    The two ``[Nq, Nk]`` matrices cross HBM twice each."""
    scores = batch * heads * seq_q * seq_k
    queries, keys = batch * heads * seq_q * head_dim, batch * heads * seq_k * head_dim
    return dict(loaded=(queries + 2 * keys + 2 * scores) * element_size, stored=(2 * scores + queries) * element_size)


def saved_for_backward_bytes(fn, *inputs) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of ``fn(*inputs)``, measured with
    :class:`labkit.memory.SavedTensorMeter` (each storage once; the inputs, leaf tensors that
    require grad, are not counted)."""
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor) and not (t.is_leaf and t.requires_grad):
            raise ValueError(f"inputs[{i}]: expected a leaf tensor with requires_grad=True (the meter leaves those out)")
    with SavedTensorMeter() as meter:
        output = fn(*inputs)  # keep the graph alive while reading the meter
        held = meter.activation_bytes
    del output
    return held


# ----------------------------------------------------------------------------- KV-cache memory
# Bytes per element of the formats a KV cache (or weights) can be stored in.
DTYPE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


def bytes_per_element(dtype) -> float:
    """Bytes per element of a torch dtype or a format name (``"bf16"``, ``"fp8"``, ``"int4"``, ...)."""
    if isinstance(dtype, torch.dtype):
        return float(dtype.itemsize)
    if dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    raise ValueError(f"dtype={dtype!r}: expected a torch.dtype or one of {sorted(DTYPE_BYTES)}")


def kv_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, seq_len: int, batch_size: int = 1, dtype=torch.bfloat16) -> int:
    """Bytes of a KV cache: one key and one value vector per layer, KV head, position and sequence,
    ``2 * num_layers * num_kv_heads * head_dim * seq_len * batch_size * bytes_per_element``."""
    for name, value in dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, seq_len=seq_len, batch_size=batch_size).items():
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r}: expected a non-negative integer")
    return int(round(2 * num_layers * num_kv_heads * head_dim * seq_len * batch_size * bytes_per_element(dtype)))


def model_kv_cache_bytes(config: ModelConfig, seq_len: int, batch_size: int = 1, dtype=torch.bfloat16) -> int:
    """:func:`kv_cache_bytes` of the architecture ``config`` (e.g. ``PRESETS["qwen3-8b"]``)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected a labkit.model.ModelConfig, got {type(config).__name__}")
    return kv_cache_bytes(config.num_layers, config.kv_heads, config.dim_per_head, seq_len, batch_size, dtype)


def kv_bytes_per_token(config: ModelConfig, dtype=torch.bfloat16, kv_latent_dim: int | None = None, rope_head_dim: int = 64) -> int:
    """KV-cache bytes one more token of context costs (per sequence) for the architecture ``config``.

    With ``kv_latent_dim``, the attention is multi-head latent attention instead
    (:func:`labkit.attention_variants.mla_like`): per layer one latent of ``kv_latent_dim`` and one shared RoPE key
    of ``rope_head_dim``, whatever the number of heads."""
    if kv_latent_dim is None:
        return model_kv_cache_bytes(config, seq_len=1, batch_size=1, dtype=dtype)
    from labkit.attention_variants import mla_like

    mla = mla_like(config, kv_latent_dim, rope_head_dim)
    return int(round(mla.num_layers * mla.cache_elements_per_layer * bytes_per_element(dtype)))


def with_kv_heads(config: ModelConfig, attention: str) -> ModelConfig:
    """``config`` with its K/V heads set for ``attention``: ``"as published"`` (unchanged),
    ``"mha"`` (one K/V head per query head), ``"gqa"`` (8 K/V heads, as Llama 3 and Qwen3),
    or ``"mqa"`` (one K/V head shared by all query heads)."""
    kv_heads = {"as published": config.kv_heads, "mha": config.num_heads, "gqa": min(8, config.num_heads), "mqa": 1}
    if attention not in kv_heads:
        raise ValueError(f"attention={attention!r}: expected one of {list(kv_heads)}")
    if config.num_heads % kv_heads[attention]:
        raise ValueError(f"attention={attention!r}: num_heads={config.num_heads} is not a multiple of {kv_heads[attention]} K/V heads")
    head_dim = config.dim_per_head  # keep the head size when the head count changes
    return replace(config, num_kv_heads=kv_heads[attention], head_dim=head_dim)


@dataclass
class KVCacheEstimate:
    """What a model needs in GPU memory to serve ``batch_size`` sequences of ``seq_len`` tokens."""

    num_params: int
    weight_bytes: int
    kv_bytes: int
    kv_bytes_per_token: int
    gpu_bytes: int
    cached_tokens: int | None = None  # KV slots held per sequence (after a sliding window, rounded up to paged blocks)
    notes: tuple[str, ...] = ()  # the attention options in force, as the summary prints them

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.gpu_bytes

    def summary(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        return (
            f"parameters {self.num_params / 1e9:.3g} B -> weights {self.weight_bytes / 1e9:.3g} GB\n"
            f"KV cache {self.kv_bytes_per_token / 1024:.4g} KiB per token -> {self.kv_bytes / 1e9:.3g} GB\n"
            + "".join(f"  {note}\n" for note in self.notes)
            + f"total {self.total_bytes / 1e9:.3g} GB on a {self.gpu_bytes / 1e9:.3g} GB GPU: {verdict}"
        )


def kv_calculator(
    config="qwen3-8b",
    attention: str = "as published",
    batch_size: int = 1,
    seq_len: int = 32768,
    kv_dtype="bf16",
    weight_dtype="bf16",
    gpu_gb: float = 80.0,
    kv_latent_dim: int | None = None,
    rope_head_dim: int = 64,
    sliding_window: int | None = None,
    block_size: int | None = None,
) -> KVCacheEstimate:
    """The KV-cache calculator behind the chapter's widget: weights + KV cache of a preset name or
    a ``ModelConfig``, with its attention switched to MHA/GQA/MQA if asked (which also changes
    the K/V projection weights), against a GPU of ``gpu_gb`` gigabytes (10^9 bytes).

    Today's options (:mod:`labkit.attention_variants`): ``attention="mla"`` with ``kv_latent_dim`` (and
    ``rope_head_dim``) caches one latent and one RoPE key per layer and token, with MLA's projections in place of
    the K/V ones; ``sliding_window`` keeps only the last that many tokens per sequence (a ring buffer);
    ``block_size`` allocates the cache in pages of that many tokens, rounding each sequence up to whole blocks."""
    config = config_from(config, PRESETS)
    if not gpu_gb > 0:
        raise ValueError(f"gpu_gb={gpu_gb!r}: expected a positive number")
    for name, value in dict(batch_size=batch_size, seq_len=seq_len, sliding_window=sliding_window, block_size=block_size).items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name}={value!r}: expected a positive integer" + ("" if name in ("batch_size", "seq_len") else " or None"))
    notes = []
    if attention == "mla":
        from labkit.attention_variants import dense_attention_parameters, mla_like

        if kv_latent_dim is None:
            raise ValueError("attention='mla': set kv_latent_dim, the size of the cached KV latent (DeepSeek-V3: 512)")
        mla = mla_like(config, kv_latent_dim, rope_head_dim)
        num_params = count_parameters(config) + config.num_layers * (mla.attention_parameters() - dense_attention_parameters(config))
        notes.append(f"MLA: latent {kv_latent_dim} + RoPE key {rope_head_dim} = {mla.cache_elements_per_layer} elements "
                     f"per layer, instead of 2 x {config.kv_heads} K/V heads x {config.dim_per_head}")
    else:
        if kv_latent_dim is not None:
            raise ValueError(f"kv_latent_dim={kv_latent_dim!r}: only used with attention='mla', got attention={attention!r}")
        config = with_kv_heads(config, attention)
        num_params = count_parameters(config)
    per_token = kv_bytes_per_token(config, kv_dtype, kv_latent_dim, rope_head_dim)
    cached_tokens = seq_len if sliding_window is None else min(seq_len, sliding_window)
    if sliding_window is not None:
        notes.append(f"sliding window {sliding_window:,}: {cached_tokens:,} of {seq_len:,} tokens kept per sequence")
    if block_size is not None:
        blocks = -(-cached_tokens // block_size)
        # what a contiguous cache must reserve up front instead: the ring of the window, or the longest allowed sequence
        reserved, reason = (sliding_window, "the window") if sliding_window else (config.context_length, "context_length")
        notes.append(f"paged in blocks of {block_size}: {blocks:,} blocks = {blocks * block_size:,} slots per sequence, "
                     f"{blocks * block_size - cached_tokens} unused (contiguous preallocation to {reason}, "
                     f"{reserved:,} slots: {max(reserved, cached_tokens) - cached_tokens:,} unused)")
        cached_tokens = blocks * block_size
    return KVCacheEstimate(
        num_params=num_params,
        weight_bytes=int(round(num_params * bytes_per_element(weight_dtype))),
        kv_bytes=per_token * cached_tokens * batch_size,
        kv_bytes_per_token=per_token,
        gpu_bytes=int(gpu_gb * 1e9),
        cached_tokens=cached_tokens,
        notes=tuple(notes),
    )


# ----------------------------------------------------------------------------- MHA -> GQA/MQA by uptraining
@torch.no_grad()
def convert_kv_heads(model: TransformerLM, num_kv_heads: int) -> TransformerLM:
    """A copy of ``model`` with ``num_kv_heads`` K/V heads, made the way the GQA paper (Ainslie
    et al., 2023) turns a multi-head checkpoint into GQA/MQA: the key and value projection heads
    of each group are replaced by their mean; every other weight is copied unchanged.

    Query head ``h`` reads K/V head ``h // (num_heads // num_kv_heads)``
    (:class:`labkit.nn.MultiHeadSelfAttention`), so new K/V head ``j`` is the mean of the old
    heads that served query heads ``j * group .. (j + 1) * group - 1``. The source may itself
    be grouped; ``num_kv_heads`` must then divide its K/V head count. The copy is on the same
    device and dtype, in the same train/eval mode, and shares no tensor with ``model``.
    """
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model: expected a labkit.model.TransformerLM, got {type(model).__name__}")
    old_kv_heads = model.config.kv_heads
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads <= 0:
        raise ValueError(f"num_kv_heads={num_kv_heads!r}: expected a positive integer")
    if old_kv_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads={num_kv_heads}: must divide the model's {old_kv_heads} K/V heads "
            f"(each new head is the mean of a whole group of old ones)"
        )
    pooled = old_kv_heads // num_kv_heads
    head_dim = model.config.dim_per_head
    weight = model.token_embeddings.weight
    converted = TransformerLM(replace(model.config, num_kv_heads=num_kv_heads), device=weight.device, dtype=weight.dtype)
    state = model.state_dict()
    for name, tensor in state.items():
        if name.endswith(("attn.k_proj.weight", "attn.v_proj.weight")):
            # rows are [kv_head, head_dim]; average each run of `pooled` consecutive heads
            d_in = tensor.shape[-1]
            state[name] = tensor.reshape(num_kv_heads, pooled, head_dim, d_in).mean(dim=1).reshape(num_kv_heads * head_dim, d_in)
    converted.load_state_dict(state)
    return converted.train(model.training)


@dataclass
class UptrainingResult:
    """One row of :func:`convert_and_uptrain`: a variant right after conversion and after uptraining."""

    name: str
    num_kv_heads: int
    num_params: int
    kv_bytes_per_token: int  # in the model's dtype
    converted_loss: float
    converted_accuracy: float
    uptrained_loss: float
    uptrained_accuracy: float
    model: TransformerLM = field(repr=False)  # the uptrained model


def convert_and_uptrain(model: TransformerLM, task: ArithmeticTask, config: TrainConfig, variants: dict[str, int], seed: int = 0) -> list[UptrainingResult]:
    """The GQA paper's recipe on a trained model: for each ``name -> num_kv_heads`` in ``variants``,
    :func:`convert_kv_heads`, measure, uptrain the converted model with :func:`labkit.train.train` for
    ``config.steps`` steps, and measure again.

    Loss is :func:`labkit.train.estimate_loss` on the task's validation tokens (``config``'s
    ``eval_batches`` batches, always the same windows); accuracy is exact match of greedy
    answers on the validation split. Every variant trains on the same batches (the global RNG is
    seeded with ``seed`` before each), so the rows differ only in their K/V heads. ``model`` is
    not modified.
    """
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model: expected a labkit.model.TransformerLM, got {type(model).__name__}")
    if not isinstance(task, ArithmeticTask):
        raise TypeError(f"task: expected a labkit.data.ArithmeticTask, got {type(task).__name__}")
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config: expected a labkit.train.TrainConfig, got {type(config).__name__}")
    if not isinstance(variants, dict) or not variants:
        raise ValueError(f"variants={variants!r}: expected a non-empty dict of name -> num_kv_heads")
    device = model.token_embeddings.weight.device
    train_tokens, val_tokens = task.tokens("train"), task.tokens("val")

    def measure(m: TransformerLM) -> tuple[float, float]:
        return estimate_loss(m, val_tokens, config, device), task.evaluate(m, "val")

    results = []
    for name, num_kv_heads in variants.items():
        converted = convert_kv_heads(model, num_kv_heads)
        converted_loss, converted_accuracy = measure(converted)
        torch.manual_seed(run_seed(seed))
        train(converted, train_tokens, None, config, progress=False)
        converted.eval()
        uptrained_loss, uptrained_accuracy = measure(converted)
        results.append(UptrainingResult(
            name=name, num_kv_heads=num_kv_heads, num_params=converted.num_params(),
            kv_bytes_per_token=kv_bytes_per_token(converted.config, converted.token_embeddings.weight.dtype),
            converted_loss=converted_loss, converted_accuracy=converted_accuracy,
            uptrained_loss=uptrained_loss, uptrained_accuracy=uptrained_accuracy, model=converted,
        ))
    return results


def uptraining_table(results: list[UptrainingResult]) -> str:
    """:func:`convert_and_uptrain`'s rows as a fixed-width text table (loss to 3 decimals, accuracy to 0.1%)."""
    lines = [f"{'':4} {'KV heads':>8} {'params':>8} {'KV bytes/token':>14} | {'converted: loss':>15} {'accuracy':>8} | {'uptrained: loss':>15} {'accuracy':>8}"]
    for r in results:
        lines.append(f"{r.name:4} {r.num_kv_heads:8d} {r.num_params:8,d} {r.kv_bytes_per_token:14,d} | {r.converted_loss:15.3f} "
                     f"{r.converted_accuracy:8.1%} | {r.uptrained_loss:15.3f} {r.uptrained_accuracy:8.1%}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- decode speed
def random_prompt(model, prompt_len: int, batch_size: int = 1, seed: int = 0) -> torch.Tensor:
    """``[batch_size, prompt_len]`` token ids drawn from a private seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, prompt_len), generator=generator)
    return ids.to(model.token_embeddings.weight.device)


def time_generation(model, prompt_ids: torch.Tensor, max_new_tokens: int, use_cache: bool, repeats: int = 3) -> float:
    """Median wall-clock seconds of greedy :func:`labkit.model.generate` over ``repeats`` runs
    (:func:`labkit.hardware.timeit`, synchronizing the GPU). No warm-up run of its own: the caller
    warms the model up once (as :func:`decode_speed` does) instead of once per length."""
    return timeit(generate, model, prompt_ids, max_new_tokens, use_cache=use_cache, warmup=0, cold=True,
                  repeats=repeats, number=1).median


def decode_speed(model, new_token_counts, prompt_len: int = 8, batch_size: int = 1, repeats: int = 3) -> list[dict]:
    """Generated tokens per second with and without the KV cache, for each generated length, and the token
    positions the model processed (``cached_positions``, ``uncached_positions``: counted by a hook on its forward
    during the timed runs, per run and sequence).

    Without a cache step ``t`` re-runs the model on all ``prompt_len + t`` tokens, so total work
    grows quadratically with the length; with a cache each step runs one token.

    Each length is timed as ``repeats`` pairs of runs, cached then uncached, so that a load from other programs
    falls on both runs of a pair: ``speedups`` holds each pair's ratio, ``speedup`` their median, and the times
    are medians over the pairs."""
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: expected an int >= 1 (pairs of runs per length)")
    prompt = random_prompt(model, prompt_len, batch_size)
    generate(model, prompt, 2)  # warm-up: first calls pay for allocations and lazy initialisation
    processed = [0]

    def count_positions(module, args):
        processed[0] += args[0].shape[-1]

    rows = []
    handle = model.register_forward_pre_hook(count_positions)
    try:
        for count in new_token_counts:
            seconds, positions = {True: [], False: []}, {}
            for _ in range(repeats):
                for use_cache in (True, False):  # in alternation: cached, uncached, cached, ...
                    processed[0] = 0
                    seconds[use_cache].append(time_generation(model, prompt, count, use_cache=use_cache, repeats=1))
                    positions[use_cache] = processed[0]
            speedups = [uncached / cached for cached, uncached in zip(seconds[True], seconds[False])]
            cached, uncached = statistics.median(seconds[True]), statistics.median(seconds[False])
            tokens = count * batch_size
            rows.append(dict(new_tokens=count, cached_positions=positions[True], uncached_positions=positions[False],
                             cached_tok_s=tokens / cached, uncached_tok_s=tokens / uncached,
                             cached_ms_per_token=cached / count * 1e3, uncached_ms_per_token=uncached / count * 1e3,
                             speedup=statistics.median(speedups), speedups=speedups))
    finally:
        handle.remove()
    return rows


# The parts of a decode step, named after the labkit code that issues their ATen ops (the innermost labkit function
# on the Python stack when an op reaches the dispatcher); ops issued anywhere else in the model (the projections'
# reshapes into heads, the residual adds) are "reshapes, residual adds".
DECODE_PARTS = ("matmuls (Linear)", "attention over the cache", "RoPE", "KV-cache write", "RMSNorm", "SwiGLU gate",
                "embedding", "reshapes, residual adds")


def _decode_part_of_code():
    from labkit import nn as layers

    parts = {
        "matmuls (Linear)": [layers.Linear.forward],
        "attention over the cache": [layers.MultiHeadSelfAttention._attend, layers.grouped_query_attention,
                                     layers.scaled_dot_product_attention, layers.softmax],
        "RoPE": [layers.RoPE.forward, layers.RoPE.rotate],
        "KV-cache write": [layers.KVCache.update],
        "RMSNorm": [layers.RMSNorm.forward],
        "SwiGLU gate": [layers.GLU.forward, layers.silu],
        "embedding": [layers.Embedding.forward],
    }
    return {function.__code__: part for part, functions in parts.items() for function in functions}


@dataclass
class DecodeStepProfile:
    """One cached decode step of a :class:`labkit.model.TransformerLM` (one new token, ``cached`` positions already in
    the cache), per part of the model (:data:`DECODE_PARTS`): the ATen ops it ran (``ops``), how many of them compute
    something rather than return a view of their input (``computing_ops``) and their FLOPs (torch's ``flop_counter``
    formulas); ``step_seconds`` is the median time of the whole step, timed without the profiler."""

    cached: int
    ops: dict[str, int]
    computing_ops: dict[str, int]
    flops: dict[str, int]
    step_seconds: float


@torch.no_grad()
def decode_step_profile(model, cached: int, repeats: int = 9) -> DecodeStepProfile:
    """Where one decode step of ``model`` spends its ops and FLOPs, and how long it takes: see
    :class:`DecodeStepProfile`.

    The step feeds one token after ``cached`` prefilled positions (batch 1); the profiled step and every timed one
    start from the same cache (:meth:`KVCache.crop` back to ``cached``). A ``TorchDispatchMode`` sees each ATen op as
    it reaches the dispatcher and attributes it to the innermost labkit function on the Python stack; the step is
    timed (``repeats`` samples, median) without it, since the mode's own Python slows every op down."""
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    if not isinstance(cached, int) or isinstance(cached, bool) or not 1 <= cached < model.config.context_length:
        raise ValueError(f"cached={cached!r}: expected an int in [1, context_length={model.config.context_length})")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: expected an int >= 1")
    part_of_code = _decode_part_of_code()
    ops = dict.fromkeys(DECODE_PARTS, 0)
    computing, flops = dict(ops), dict(ops)

    def part_of_caller() -> str:
        frame = sys._getframe(2)  # above __torch_dispatch__ and this function
        while frame is not None:
            if frame.f_code in part_of_code:
                return part_of_code[frame.f_code]
            frame = frame.f_back
        return DECODE_PARTS[-1]

    def storages(values):
        return {t.untyped_storage().data_ptr() for t in values if isinstance(t, torch.Tensor)}

    class Profiler(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            part = part_of_caller()
            ops[part] += 1
            # an op computes unless it returns a view of an input (in-place ops, named "..._", return their input too)
            outputs = out if isinstance(out, (tuple, list)) else (out,)
            computing[part] += not (storages(outputs) <= storages(args) and not func.overloadpacket.__name__.endswith("_"))
            if func.overloadpacket in flop_registry:
                flops[part] += flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
            return out

    was_training = model.training
    model.eval()
    try:  # the model leaves in the mode it came in, whatever happens on the way
        prompt = random_prompt(model, cached + 1)
        cache = KVCache.for_model(model, batch_size=1, max_seq_len=cached + 1)
        model(prompt[:, :cached], kv_cache=cache)
        token = prompt[:, cached:]

        def step():
            return model(token, kv_cache=cache)

        with Profiler():
            step()
        step_seconds = timeit(step, setup=lambda: cache.crop(cached), warmup=1, repeats=repeats).median
    finally:
        model.train(was_training)
    return DecodeStepProfile(cached, ops, computing, flops, step_seconds)


@torch.no_grad()
def prefill_and_decode_times(model, prompt_len: int, decode_steps: int = 8, batch_size: int = 1, repeats: int = 3) -> dict:
    """Seconds for the prefill (one forward over the whole prompt, filling the cache) and per
    decode step (one token against the cache). Prefill processes ``prompt_len`` tokens per
    weight read; a decode step processes one, which is why it is memory-bound on a GPU."""
    prompt = random_prompt(model, prompt_len, batch_size)
    state = {}

    def new_cache():
        state["cache"] = KVCache.for_model(model, batch_size, prompt_len + decode_steps)

    def prefill():
        state["next_id"] = model(prompt, kv_cache=state["cache"])[:, -1:].argmax(-1)

    def prefilled_cache():
        new_cache()
        prefill()

    def decode():
        next_id = state["next_id"]
        for _ in range(decode_steps):
            next_id = model(next_id, kv_cache=state["cache"])[:, -1:].argmax(-1)

    was_training = model.training
    model.eval()
    # each sample starts from a fresh (or freshly prefilled) cache, built untimed by `setup`
    prefill_s = timeit(prefill, setup=new_cache, warmup=1, repeats=repeats).median
    decode_step_s = timeit(decode, setup=prefilled_cache, warmup=1, repeats=repeats).median / decode_steps
    model.train(was_training)
    return dict(prompt_len=prompt_len, prefill_s=prefill_s, decode_step_s=decode_step_s,
                prefill_tok_s=prompt_len * batch_size / prefill_s, decode_tok_s=batch_size / decode_step_s)


# ----------------------------------------------------------------------------- attention explorer
@torch.no_grad()
def attention_map(model, token_ids: torch.Tensor, layer: int = 0, head: int = 0, causal: bool = True) -> torch.Tensor:
    """Attention probabilities ``[seq, seq]`` of one head of a :class:`labkit.model.TransformerLM`
    on a 1-D prompt: row ``i`` is how query ``i`` spreads its attention over the keys.

    The layer's input is captured with a forward pre-hook during a normal forward pass, then
    the layer recomputes its scores (``causal=False`` drops the mask to show what the head
    would look at without it)."""
    if token_ids.dim() != 1 or token_ids.numel() == 0:
        raise ValueError(f"token_ids: expected a non-empty 1-D tensor of token ids, got shape {tuple(token_ids.shape)}")
    if not 0 <= layer < len(model.layers):
        raise ValueError(f"layer={layer}: expected 0 <= layer < {len(model.layers)}")
    attn = model.layers[layer].attn
    if not 0 <= head < attn.num_heads:
        raise ValueError(f"head={head}: expected 0 <= head < {attn.num_heads}")
    captured = {}
    hook = attn.register_forward_pre_hook(lambda module, args: captured.setdefault("x", args[0]))
    was_training = model.training
    try:
        model.eval()
        model(token_ids[None])
    finally:
        hook.remove()
        model.train(was_training)
    return attn.attention_weights(captured["x"], causal=causal)[0, head]


def attention_explorer(model, tokenizer, prompt: str, layer: int = 0, head: int = 0, causal: bool = True):
    """Callback of the attention-explorer widget: ``(weights [seq, seq], token labels)`` for a
    text prompt (plot them with :func:`labkit.widgets.attention.plot_attention`)."""
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt={prompt!r}: expected a non-empty string")
    device = model.token_embeddings.weight.device
    ids = tokenizer.encode(prompt)
    labels = [tokenizer.decode([i]) for i in ids]
    return attention_map(model, torch.tensor(ids, device=device), layer, head, causal).cpu(), labels
