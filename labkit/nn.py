"""Transformer building blocks, written out so every line can be read.

Conventions (shared with well-known course code, so weights and tests interoperate):
``Linear.weight`` is ``[d_out, d_in]``; ``SwiGLU(x) = w2(silu(w1 x) * w3 x)``; attention
submodules are ``q_proj, k_proj, v_proj, output_proj``; a boolean attention mask is True
where a query *may* attend; RoPE rotates interleaved pairs ``(2i, 2i+1)``.

Modules built with ``use_triton=True`` route their hot op through ``labkit.kernels``
(Triton; interpreter on CPU) and fall back to the PyTorch code below when Triton is missing.
"""
from __future__ import annotations

import math

import torch
from torch import nn


# ----------------------------------------------------------------------------- activations
def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax that never overflows: subtracting the max leaves the result unchanged
    (it cancels between numerator and denominator) but keeps every exponent <= 0."""
    shifted = x - x.amax(dim=dim, keepdim=True)
    exp = torch.exp(shifted)
    return exp / exp.sum(dim=dim, keepdim=True)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU (swish): ``x * sigmoid(x)``."""
    return x * torch.sigmoid(x)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU: ``x * Phi(x)`` exactly (erf), or the tanh approximation GPT-2 used."""
    if approximate == "none":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    raise ValueError(f"approximate={approximate!r}: expected 'none' or 'tanh'")


def relu(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp_min(x, 0.0)


ACTIVATIONS = {"silu": silu, "gelu": gelu, "sigmoid": torch.sigmoid, "relu": relu}


# ----------------------------------------------------------------------------- layers
class Linear(nn.Module):
    """``y = x W^T`` without bias; ``W`` is ``[d_out, d_in]``.

    Init: truncated normal with variance ``2 / (d_in + d_out)`` (Glorot), cut at 3 sigma,
    so activations neither grow nor shrink through a stack of layers.
    """

    def __init__(self, d_in: int, d_out: int, device=None, dtype=None):
        super().__init__()
        _check_positive(d_in=d_in, d_out=d_out)
        self.d_in, self.d_out = d_in, d_out
        self.weight = nn.Parameter(torch.empty(d_out, d_in, device=device, dtype=dtype))
        std = math.sqrt(2.0 / (d_in + d_out))
        nn.init.trunc_normal_(self.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.d_in:
            raise ValueError(f"x: last dim must be d_in={self.d_in}, got shape {tuple(x.shape)}")
        return x @ self.weight.T

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}"


class Embedding(nn.Module):
    """Lookup table ``[num_embeddings, d_model]``; init N(0, 1) truncated at 3."""

    def __init__(self, num_embeddings: int, d_model: int, device=None, dtype=None):
        super().__init__()
        _check_positive(num_embeddings=num_embeddings, d_model=d_model)
        self.num_embeddings, self.d_model = num_embeddings, d_model
        self.weight = nn.Parameter(torch.empty(num_embeddings, d_model, device=device, dtype=dtype))
        nn.init.trunc_normal_(self.weight, mean=0.0, std=1.0, a=-3.0, b=3.0)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if token_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"token_ids: expected an integer tensor, got {token_ids.dtype}")
        if token_ids.numel():
            low, high = (int(t) for t in torch.aminmax(token_ids))  # one reduction: a decode step pays it per token
            if low < 0 or high >= self.num_embeddings:
                raise ValueError(f"token_ids: values must lie in [0, {self.num_embeddings}), got min {low}, max {high}")
        # F.embedding rather than self.weight[token_ids]: the same rows forward, but its CPU backward
        # adds each position's gradient into its token's row in a fixed order, where the indexing
        # backward (index_put_ with accumulate) lets several threads race with atomic adds, so two
        # identical multi-threaded training runs would drift apart (chapter 00, section 7).
        return nn.functional.embedding(token_ids, self.weight)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, d_model={self.d_model}"


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last (feature) axis, computed in fp32."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None, use_triton: bool = False):
        super().__init__()
        _check_positive(d_model=d_model)
        self.d_model, self.eps, self.use_triton = d_model, eps, use_triton
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last_dim(x, self.d_model)
        if self.use_triton and _kernels_available():
            from labkit import kernels

            return kernels.rmsnorm(x, self.weight, self.eps)
        in_dtype = x.dtype
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * inv_rms * self.weight.float()).to(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"


class LayerNorm(nn.Module):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis (biased variance)."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        _check_positive(d_model=d_model)
        self.d_model, self.eps = d_model, eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last_dim(x, self.d_model)
        in_dtype = x.dtype
        x32 = x.float()
        mean = x32.mean(dim=-1, keepdim=True)
        var = (x32 - mean).pow(2).mean(dim=-1, keepdim=True)
        y = (x32 - mean) * torch.rsqrt(var + self.eps)
        return (y * self.weight.float() + self.bias.float()).to(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"


class BatchNorm(nn.Module):
    """Batch normalization over every axis *except* the last (feature) axis.

    Training mode normalizes with the batch's own mean and biased variance and updates
    running statistics (``momentum`` weights the new batch; the running variance uses the
    unbiased estimate), exactly as ``torch.nn.BatchNorm1d``. Eval mode uses the running
    statistics, so a token's output depends on what else was in the batch only while training.
    Input ``[..., num_features]`` (features last, as in a transformer's ``[batch, seq, d]``).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, device=None, dtype=None):
        super().__init__()
        _check_positive(num_features=num_features)
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum={momentum}: expected a value in [0, 1]")
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.weight = nn.Parameter(torch.ones(num_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(num_features, device=device, dtype=dtype))
        self.register_buffer("running_mean", torch.zeros(num_features, device=device))
        self.register_buffer("running_var", torch.ones(num_features, device=device))
        self.register_buffer("num_batches_tracked", torch.tensor(0, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last_dim(x, self.num_features)
        in_dtype = x.dtype
        flat = x.float().reshape(-1, self.num_features)
        if self.training:
            n = flat.shape[0]
            if n < 2:
                raise ValueError(
                    f"x: BatchNorm in training mode needs more than one value per feature, got shape {tuple(x.shape)}"
                )
            mean = flat.mean(dim=0)
            var = flat.var(dim=0, unbiased=False)
            with torch.no_grad():
                self.running_mean.lerp_(mean, self.momentum)
                self.running_var.lerp_(var * n / (n - 1), self.momentum)
                self.num_batches_tracked += 1
        else:
            mean, var = self.running_mean, self.running_var
        y = (flat - mean) * torch.rsqrt(var + self.eps) * self.weight.float() + self.bias.float()
        return y.reshape(x.shape).to(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"


class GLU(nn.Module):
    """Gated linear unit feed-forward: ``w2(act(w1 x) * w3 x)``; ``w1`` is the gate branch."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "silu", device=None, dtype=None, use_triton: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: expected one of {sorted(ACTIVATIONS)}")
        self.activation, self.use_triton = activation, use_triton
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        if self.activation == "silu" and self.use_triton and _kernels_available():
            from labkit import kernels

            return self.w2(kernels.swiglu(gate, up))
        return self.w2(ACTIVATIONS[self.activation](gate) * up)


class SwiGLU(GLU):
    """The SiLU-gated GLU of LLaMA-style models: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None, use_triton: bool = False):
        super().__init__(d_model, d_ff, activation="silu", device=device, dtype=dtype, use_triton=use_triton)


class RoPE(nn.Module):
    """Rotary position embedding: rotate each interleaved pair ``(x[2i], x[2i+1])`` of a
    query/key by angle ``position * theta^(-2i/d_k)``. The dot product of two rotated vectors
    then depends only on their *relative* position."""

    def __init__(self, theta: float, d_k: int, max_seq_len: int, device=None):
        super().__init__()
        if d_k % 2:
            raise ValueError(f"d_k={d_k}: RoPE rotates pairs, so d_k must be even")
        _check_positive(theta=theta, d_k=d_k, max_seq_len=max_seq_len)
        self.theta, self.d_k, self.max_seq_len = theta, d_k, max_seq_len
        inv_freq = theta ** (-torch.arange(0, d_k, 2, device=device, dtype=torch.float64) / d_k)
        angles = torch.arange(max_seq_len, device=device, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor) -> torch.Tensor:
        if token_positions.numel():
            low, high = (int(t) for t in torch.aminmax(token_positions))
            if low < 0 or high >= self.max_seq_len:
                raise ValueError(f"token_positions: must lie in [0, max_seq_len={self.max_seq_len}), "
                                 f"got min {low}, max {high}")
        return self.rotate(x, self.cos[token_positions], self.sin[token_positions])

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` rotated by the angles whose cosines and sines are ``cos``, ``sin`` (rows of ``self.cos``/``self.sin``,
        ``[..., seq, d_k/2]``, broadcast against ``x``'s ``[..., seq, d_k]``)."""
        _check_last_dim(x, self.d_k)
        x_even, x_odd = x.float()[..., 0::2], x.float()[..., 1::2]
        rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
        return rotated.flatten(-2).to(x.dtype)

    def extra_repr(self) -> str:
        return f"theta={self.theta}, d_k={self.d_k}, max_seq_len={self.max_seq_len}"


def rotate_half_permutation(d_k: int) -> torch.Tensor:
    """The channel order that turns Hugging Face's ``rotate_half`` RoPE into :class:`RoPE`'s interleaved one.

    Llama and Qwen checkpoints rotate the pairs ``(x[i], x[i + d_k/2])``; :class:`RoPE` rotates ``(x[2i], x[2i+1])``
    with the same frequency for pair ``i``. So ``RoPE(x[..., perm])[..., perm.argsort()]`` equals the rotate_half
    result, and loading such a checkpoint means permuting each head's rows of ``q_proj`` and ``k_proj`` by ``perm``."""
    if d_k <= 0 or d_k % 2:
        raise ValueError(f"d_k={d_k}: expected a positive even head dimension")
    half = torch.arange(d_k // 2)
    return torch.stack((half, half + d_k // 2), dim=-1).flatten()


NORMS = ("none", "batchnorm", "layernorm", "rmsnorm")


def make_norm(kind: str, num_features: int, eps: float = 1e-5, device=None, dtype=None, use_triton: bool = False) -> nn.Module:
    """A fresh normalization layer of ``kind`` (one of :data:`NORMS`; ``"none"`` is the identity)."""
    if kind == "none":
        return nn.Identity()
    if kind == "batchnorm":
        return BatchNorm(num_features, eps, device=device, dtype=dtype)
    if kind == "layernorm":
        return LayerNorm(num_features, eps, device=device, dtype=dtype)
    if kind == "rmsnorm":
        return RMSNorm(num_features, eps, device=device, dtype=dtype, use_triton=use_triton)
    raise ValueError(f"kind={kind!r}: expected one of {NORMS}")


# ----------------------------------------------------------------------------- attention
def scaled_dot_product_attention(
    Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``softmax(Q K^T / sqrt(d_k)) V`` with Q ``[..., q, d_k]``, K ``[..., k, d_k]``, V ``[..., k, d_v]``.

    ``mask`` (boolean, broadcastable to ``[..., q, k]``) is True where a query may attend.
    """
    if Q.shape[-1] != K.shape[-1]:
        raise ValueError(f"Q, K: last dims must match (d_k), got {Q.shape[-1]} and {K.shape[-1]}")
    if K.shape[-2] != V.shape[-2]:
        raise ValueError(f"K, V: must have the same number of keys, got {K.shape[-2]} and {V.shape[-2]}")
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"mask: expected a boolean tensor (True = may attend), got {mask.dtype}")
        scores = scores.masked_fill(~mask, float("-inf"))
    return softmax(scores, dim=-1) @ V


def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention where each group of ``Hq / Hkv`` query heads reads one K/V head: q ``[..., Hq, Nq, d]``, k and v
    ``[..., Hkv, Nk, d]``, ``mask`` ``[Nq, Nk]`` (True = may attend). Query head ``h`` reads K/V head ``h // (Hq/Hkv)``.

    The group's queries are stacked along the query axis (``[..., Hkv, group * Nq, d]``), so each K/V head is read
    in place, once per group: repeating K and V for every query head (``repeat_interleave``) would copy the cache
    ``group`` times and read all those copies, giving away the memory traffic GQA and MQA are meant to save."""
    if q.dim() < 3 or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"q, k, v: expected [..., heads, seq, head_dim] of equal rank, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    num_heads, num_kv_heads = q.shape[-3], k.shape[-3]
    if num_heads % num_kv_heads or v.shape[-3] != num_kv_heads:
        raise ValueError(f"q has {num_heads} heads, k {num_kv_heads} and v {v.shape[-3]}: expected k and v to have the "
                         f"same number of heads, dividing q's")
    group = num_heads // num_kv_heads
    if group == 1:
        return scaled_dot_product_attention(q, k, v, mask)
    if mask is not None and mask.dim() != 2:
        raise ValueError(f"mask: expected [num_queries, num_keys] for grouped heads, got shape {tuple(mask.shape)}")
    *lead, _, num_queries, head_dim = q.shape
    stacked = q.reshape(*lead, num_kv_heads, group * num_queries, head_dim)
    out = scaled_dot_product_attention(stacked, k, v, None if mask is None else mask.repeat(group, 1))
    return out.reshape(*lead, num_heads, num_queries, v.shape[-1])


def causal_mask(num_queries: int, num_keys: int, device=None) -> torch.Tensor:
    """Boolean ``[num_queries, num_keys]`` mask, bottom-right aligned: query ``i`` sees keys
    ``j <= i + num_keys - num_queries``. With a KV cache the new queries are the *last*
    positions of the sequence, which is why the alignment is bottom-right."""
    q = torch.arange(num_queries, device=device)[:, None]
    k = torch.arange(num_keys, device=device)[None, :]
    return k <= q + (num_keys - num_queries)


class MultiHeadSelfAttention(nn.Module):
    """Causal multi-head self-attention with grouped K/V heads.

    ``num_kv_heads == num_heads`` is MHA, ``1`` is MQA, in between is GQA: query head ``h``
    reads K/V head ``h // (num_heads // num_kv_heads)``.

    ``forward(x, token_positions=None, kv_cache=None, layer_idx=0)``: with a ``kv_cache``
    (an object with ``update(layer_idx, k, v) -> (k_all, v_all)``, e.g.
    :class:`KVCache` below), the new keys/values are appended and the queries attend
    to everything cached so far.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        rope: RoPE | None = None,
        head_dim: int | None = None,
        qk_norm: bool = False,
        device=None,
        dtype=None,
        use_triton: bool = False,
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        _check_positive(d_model=d_model, num_heads=num_heads, num_kv_heads=num_kv_heads)
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
            head_dim = d_model // num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads}")
        if rope is not None and rope.d_k != head_dim:
            raise ValueError(f"rope: d_k={rope.d_k} must equal the head dim {head_dim}")
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, num_heads, num_kv_heads, head_dim
        self.use_triton = use_triton
        self.q_proj = Linear(d_model, num_heads * head_dim, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, num_kv_heads * head_dim, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, num_kv_heads * head_dim, device=device, dtype=dtype)
        self.output_proj = Linear(num_heads * head_dim, d_model, device=device, dtype=dtype)
        # QK-norm (Qwen3, OLMo 2): RMSNorm each head's q and k before RoPE, keeps logits bounded.
        self.q_norm = RMSNorm(head_dim, device=device, dtype=dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, device=device, dtype=dtype) if qk_norm else None
        self.rope = rope

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None, kv_cache=None, layer_idx: int = 0) -> torch.Tensor:
        q, k, v = self._project(x, token_positions, kv_cache, layer_idx)
        out = self._attend(q, k, v)  # [..., heads, seq, head_dim]
        *lead, seq, _ = x.shape
        return self.output_proj(out.transpose(-3, -2).reshape(*lead, seq, self.num_heads * self.head_dim))

    def attention_weights(self, x: torch.Tensor, token_positions: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
        """The softmax probabilities ``[..., heads, seq, seq]`` this layer computes for input
        ``x`` (``causal=False`` shows what the heads would attend to without the mask)."""
        q, k, _ = self._project(x, token_positions, None, 0)
        k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=-3)  # a picture per query head
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if causal:
            scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], device=q.device), float("-inf"))
        return softmax(scores.float(), dim=-1)

    def _project(self, x: torch.Tensor, token_positions, kv_cache, layer_idx: int):
        """q ``[..., heads, seq, head_dim]`` and k, v ``[..., kv_heads, seq(+cached), head_dim]``,
        after QK-norm and RoPE; new keys/values are appended to ``kv_cache`` if one is given."""
        if x.dim() < 2:
            raise ValueError(f"x: expected [..., seq, d_model], got shape {tuple(x.shape)}")
        _check_last_dim(x, self.d_model)
        *lead, seq, _ = x.shape
        q = self.q_proj(x).view(*lead, seq, self.num_heads, self.head_dim).transpose(-3, -2)
        k = self.k_proj(x).view(*lead, seq, self.num_kv_heads, self.head_dim).transpose(-3, -2)
        v = self.v_proj(x).view(*lead, seq, self.num_kv_heads, self.head_dim).transpose(-3, -2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None and token_positions is None and kv_cache is not None:
            # positions start .. start + seq - 1 after the cached ones: their angles are a slice of the table, shared
            # by q and k (no position tensor, lookup or range reduction per layer: a decode step's cost is mostly such
            # small ops). Without a cache the positions are looked up below, so training saves what it always saved.
            start = kv_cache.length(layer_idx)
            if start + seq > self.rope.max_seq_len:
                raise ValueError(f"token_positions: must lie in [0, max_seq_len={self.rope.max_seq_len}), "
                                 f"got min {start}, max {start + seq - 1}")
            cos, sin = self.rope.cos[start:start + seq], self.rope.sin[start:start + seq]
            q, k = self.rope.rotate(q, cos, sin), self.rope.rotate(k, cos, sin)
        elif self.rope is not None:
            if token_positions is None:
                token_positions = torch.arange(seq, device=x.device)
            positions = token_positions.unsqueeze(-2)  # broadcast over the head axis
            q, k = self.rope(q, positions), self.rope(k, positions)
        if kv_cache is not None:
            k, v = kv_cache.update(layer_idx, k, v)
        return q, k, v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.use_triton and _kernels_available() and q.dim() == 4 and q.dtype in (torch.float32, torch.float16, torch.bfloat16):
            from labkit import kernels

            # the kernel reads grouped K/V heads in place: no repeat, no copy of the transposed views
            return kernels.flash_attention(q, k, v, causal=True)
        # one query (a decode step) is the last position and sees every key: no mask to build or apply
        mask = None if q.shape[-2] == 1 else causal_mask(q.shape[-2], k.shape[-2], device=q.device)
        return grouped_query_attention(q, k, v, mask)


class KVCache:
    """Preallocated K/V buffers, one pair per layer, each ``[batch, num_kv_heads, max_seq_len, head_dim]``.

    ``update(layer_idx, k, v)`` (alias ``append``) writes the new keys/values after the ones already cached and
    returns views of everything cached so far; the length advances once the last layer has
    written (all layers see the same positions in one forward pass).
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_seq_len: int, head_dim: int, dtype=torch.float32, device=None):
        for name, value in dict(num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads, max_seq_len=max_seq_len, head_dim=head_dim).items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        shape = (num_layers, batch_size, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_layers, self.max_seq_len = num_layers, max_seq_len
        self._lengths = [0] * num_layers

    @classmethod
    def for_model(cls, model, batch_size: int, max_seq_len: int | None = None) -> "KVCache":
        """An empty cache shaped for ``model`` (a :class:`labkit.model.TransformerLM`, or anything
        with its ``config`` and ``token_embeddings``), in the dtype and on the device of its weights."""
        cfg = model.config
        weight = model.token_embeddings.weight
        return cls(cfg.num_layers, batch_size, cfg.kv_heads, max_seq_len or cfg.context_length, cfg.dim_per_head, dtype=weight.dtype, device=weight.device)

    def reset(self) -> None:
        """Forget everything cached (the buffers stay allocated for the next sequence)."""
        self._lengths = [0] * self.num_layers

    def length(self, layer_idx: int = 0) -> int:
        """Number of positions cached for ``layer_idx``."""
        return self._lengths[layer_idx]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions of every layer and forget the rest (speculative decoding
        drops the keys/values of draft tokens the target rejected); later updates overwrite them."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= min(self._lengths):
            raise ValueError(f"length={length!r}: expected an integer in [0, {min(self._lengths)}] (the cached length)")
        self._lengths = [length] * self.num_layers

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """Append ``k, v`` ``[batch, num_kv_heads, new, head_dim]`` to layer ``layer_idx``; return
        ``(k_all, v_all)``, views of every position cached so far. Raises ``ValueError`` if the
        cache would overflow ``max_seq_len``."""
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx={layer_idx}: expected 0 <= layer_idx < {self.num_layers}")
        expected = self.k.shape[1:3] + self.k.shape[4:]
        if k.dim() != 4 or (k.shape[0], k.shape[1], k.shape[3]) != tuple(expected) or k.shape != v.shape:
            raise ValueError(
                f"k, v: expected equal shapes [batch={expected[0]}, num_kv_heads={expected[1]}, new, head_dim={expected[2]}], "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        start, new = self._lengths[layer_idx], k.shape[2]
        if start + new > self.max_seq_len:
            raise ValueError(f"KVCache overflow: {start} cached + {new} new > max_seq_len={self.max_seq_len}")
        self.k[layer_idx, :, :, start : start + new] = k
        self.v[layer_idx, :, :, start : start + new] = v
        self._lengths[layer_idx] = start + new
        return self.k[layer_idx, :, :, : start + new], self.v[layer_idx, :, :, : start + new]

    append = update

    @property
    def nbytes(self) -> int:
        """Bytes the cache buffers occupy (allocated up front for ``max_seq_len``)."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


# ----------------------------------------------------------------------------- helpers
def _check_positive(**values) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name}={value}: expected a positive number")


def _check_last_dim(x: torch.Tensor, expected: int) -> None:
    if x.dim() == 0 or x.shape[-1] != expected:
        raise ValueError(f"x: last dim must be {expected}, got shape {tuple(x.shape)}")


def _kernels_available() -> bool:
    from labkit.runtime import triton_installed

    return triton_installed()
