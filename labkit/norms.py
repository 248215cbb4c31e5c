"""Chapter 02: normalization layers and activations, measured.

Every experiment the notebook shows is a function here: which axis each norm normalizes
(``axis_statistics``), why BatchNorm is awkward for sequences (``batch_dependence``),
vanishing/exploding signals in a deep stack and how a norm fixes them (``deep_stack``),
Pre-LN vs Post-LN gradients at initialization (``block_gradient_norms`` in labkit's LM,
``ffn_gradient_profile`` in Xiong et al.'s encoder stack), the activation
functions and their derivatives (``activation_curves``), SwiGLU's ``d_ff`` (``swiglu_d_ff``,
``ffn_param_counts``), a GELU MLP against SwiGLU at equal parameters over seeds (``train_ffn_variants``), where
the norm sits in training, with and without warmup (``train_placements``), what
QK-norm does to attention (``attention_entropy_under_scaling``), the Triton path
(``use_triton_kernels``) and the bytes an RMSNorm moves (``rmsnorm_bytes``, ``count_op_bytes``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.model import TransformerBlock, TransformerLM, tiny_config
from labkit.model import make_norm as config_norm
from labkit.nn import ACTIVATIONS, GLU, NORMS, LayerNorm, Linear, RMSNorm, gelu, make_norm  # noqa: F401 (NORMS: the chapter lists norms.NORMS)
from labkit.runtime import run_seed
from labkit.train import TrainConfig, cross_entropy, train

DISTRIBUTIONS = ("gaussian", "outlier features", "token scales", "feature offsets")


# ----------------------------------------------------------------------------- which axis
def make_batch(distribution: str = "gaussian", batch: int = 4, seq: int = 8, d_model: int = 16, seed: int = 0) -> torch.Tensor:
    """A ``[batch, seq, d_model]`` activation tensor with a chosen pathology.

    ``"gaussian"``: N(0, 1). ``"outlier features"``: two feature channels 20x larger than the
    rest (the "massive activations" of trained LLMs). ``"token scales"``: every token scaled by
    its own factor between 0.1 and 10. ``"feature offsets"``: every feature shifted by its own
    constant (a mean that BatchNorm and LayerNorm remove, RMSNorm does not).
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution={distribution!r}: expected one of {DISTRIBUTIONS}")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, d_model, generator=gen)
    if distribution == "outlier features":
        x[..., : min(2, d_model)] *= 20.0
    elif distribution == "token scales":
        x *= 10.0 ** (2 * torch.rand(batch, seq, 1, generator=gen) - 1)
    elif distribution == "feature offsets":
        x += 3.0 * torch.randn(d_model, generator=gen)
    return x


def axis_statistics(x: torch.Tensor) -> dict[str, float]:
    """Statistics of ``x`` ``[..., features]`` along each axis a norm could normalize.

    Per token (over the features of one position): the largest |mean|, and the range of the
    std and of the RMS. Per feature (over all positions of the batch): the largest |mean| and
    the range of the std. Stds are biased (divide by n), as the norms use them.
    """
    rows = x.detach().float().reshape(-1, x.shape[-1])
    token_mean, token_std = rows.mean(dim=1), rows.std(dim=1, unbiased=False)
    token_rms = rows.pow(2).mean(dim=1).sqrt()
    feature_mean, feature_std = rows.mean(dim=0), rows.std(dim=0, unbiased=False)
    return {
        "token |mean| max": token_mean.abs().max().item(),
        "token std min": token_std.min().item(),
        "token std max": token_std.max().item(),
        "token rms min": token_rms.min().item(),
        "token rms max": token_rms.max().item(),
        "feature |mean| max": feature_mean.abs().max().item(),
        "feature std min": feature_std.min().item(),
        "feature std max": feature_std.max().item(),
    }


def compare_norms(x: torch.Tensor, norms=("batchnorm", "layernorm", "rmsnorm")) -> dict[str, dict[str, float]]:
    """:func:`axis_statistics` of ``x`` and of each freshly built norm applied to it (training mode)."""
    table = {"input": axis_statistics(x)}
    with torch.no_grad():
        for kind in norms:
            table[kind] = axis_statistics(make_norm(kind, x.shape[-1])(x))
    return table


def batch_dependence(kind: str, change: str = "batchmates", training: bool = True, d_model: int = 16, seed: int = 0) -> float:
    """How much one sequence's normalized output moves when the *rest of the batch* changes.

    ``change="batchmates"``: the other sequences are replaced by different data.
    ``change="padding"``: the sequence (5 real tokens) is zero-padded to 8 vs to 32 positions.
    Returns the max abs difference of the real tokens' outputs. It is 0 for a norm that works
    per token (LayerNorm, RMSNorm) and for BatchNorm in eval mode, which uses running statistics.
    """
    if change not in ("batchmates", "padding"):
        raise ValueError(f"change={change!r}: expected 'batchmates' or 'padding'")
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randn(5, d_model, generator=gen)
    if change == "batchmates":
        first = torch.stack([tokens, torch.randn(5, d_model, generator=gen)])
        second = torch.stack([tokens, 5 * torch.randn(5, d_model, generator=gen) + 2])
    else:
        first = torch.cat([tokens, torch.zeros(3, d_model)])[None]
        second = torch.cat([tokens, torch.zeros(27, d_model)])[None]
    norm = make_norm(kind, d_model)
    if kind == "batchnorm" and not training:
        with torch.no_grad():  # running statistics from a few earlier training batches
            for _ in range(20):
                norm(torch.randn(8, 5, d_model, generator=gen))
    norm.train(training)
    with torch.no_grad():
        out_first, out_second = norm(first)[0, :5], norm(second)[0, :5]
    return (out_first - out_second).abs().max().item()


def future_token_leak(kind: str, seq: int = 8, d_model: int = 16, batch: int = 4, seed: int = 0) -> float:
    """How much the outputs at positions ``0 .. seq-2`` move when only the *last* token of every
    sequence changes, with the norm in training mode: the leak from the future that a causal
    language model must not have. BatchNorm pools each feature over batch and sequence, so
    every position sees the future token through the mean and variance; LayerNorm and RMSNorm
    normalize each token on its own (exactly 0)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, d_model, generator=gen)
    changed = x.clone()
    changed[:, -1] = 10 * torch.randn(batch, d_model, generator=gen) + 3  # only the future token differs
    norm = make_norm(kind, d_model).train()
    with torch.no_grad():
        return (norm(x)[:, :-1] - norm(changed)[:, :-1]).abs().max().item()


def truncated_normal_variance(cut: float) -> float:
    """Variance of N(0, 1) truncated to ``[-cut, cut]`` (as ``nn.init.trunc_normal_`` draws it):
    ``1 - 2 cut φ(cut) / (2Φ(cut) - 1)``. labkit's Linear cuts at 3 sigma: 0.9733 of the
    nominal variance, a factor that a stack of layers compounds."""
    if not cut > 0:
        raise ValueError(f"cut={cut}: expected a positive number of standard deviations")
    density = math.exp(-cut * cut / 2) / math.sqrt(2 * math.pi)
    return 1 - 2 * cut * density / math.erf(cut / math.sqrt(2))


def rmsnorm_llama_style(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm as Hugging Face's ``LlamaRMSNorm`` computes it: normalize in fp32, cast the
    normalized value back to the input dtype, *then* multiply by the weight (in the weight's
    dtype). labkit's RMSNorm and its Triton kernel multiply by the weight in fp32 and cast once
    at the end (Liger-Kernel calls these casting modes "llama" and "none"), so in bf16 the two
    round differently and are not bit-identical."""
    x32 = x.float()
    normalized = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normalized.to(x.dtype)


# ----------------------------------------------------------------------------- deep stacks
@dataclass
class StackStatistics:
    """Per-layer std of the activations and L2 norm of the gradient flowing into them."""

    norm: str
    activation_std: list[float]
    gradient_norm: list[float]


def deep_stack(norm: str = "none", num_layers: int = 32, width: int = 64, batch: int = 64, activation: str = "relu",
               gain: float = 1.0, seed: int = 0) -> StackStatistics:
    """Push a random batch through ``num_layers`` blocks ``act(norm(W h))`` (no residuals) and
    record, per layer, the std of its output and the norm of the loss gradient w.r.t. it.

    ``W`` is labkit's ``Linear`` (Glorot init) times ``gain``. Without a norm, ReLU halves the
    variance at every layer, so signals shrink like ``2^(-L/2)`` at ``gain=1`` and grow at
    ``gain=2``; gradients do the same on the way back. A per-token norm (LayerNorm/RMSNorm)
    rescales every layer's output, which makes the stack independent of ``gain``.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {sorted(ACTIVATIONS)}")
    if not gain > 0 or num_layers < 1:
        raise ValueError(f"gain={gain}, num_layers={num_layers}: expected gain > 0 and num_layers >= 1")
    torch.manual_seed(seed)
    layers = []
    for _ in range(num_layers):
        linear = Linear(width, width)
        with torch.no_grad():
            linear.weight.mul_(gain)
        layers.append((linear, make_norm(norm, width)))
    h = torch.randn(batch, width)
    outputs = []
    for linear, norm_layer in layers:
        h = ACTIVATIONS[activation](norm_layer(linear(h)))
        h.retain_grad()
        outputs.append(h)
    # a loss whose gradient w.r.t. the last output is fixed unit-variance noise, whatever h's scale
    (h * torch.randn(batch, width)).sum().div(batch).backward()
    return StackStatistics(norm, [o.std().item() for o in outputs], [o.grad.norm().item() for o in outputs])


class PostNormBlock(TransformerBlock):
    """The original Transformer's Post-LN block: ``x = ln1(x + attn(x)); x = ln2(x + ffn(x))``.
    Same submodules as labkit's Pre-LN :class:`~labkit.model.TransformerBlock`, other order."""

    def forward(self, x, token_positions=None, kv_cache=None, layer_idx: int = 0):
        x = self.ln1(x + self.attn(x, token_positions, kv_cache, layer_idx))
        return self.ln2(x + self.ffn(x))


class OutputNormBlock(TransformerBlock):
    """OLMo 2's order: each sublayer's *output* is normalized inside the residual branch,
    ``x = x + ln1(attn(x)); x = x + ln2(ffn(x))``; the residual path itself has no norm."""

    def forward(self, x, token_positions=None, kv_cache=None, layer_idx: int = 0):
        x = x + self.ln1(self.attn(x, token_positions, kv_cache, layer_idx))
        return x + self.ln2(self.ffn(x))


class SandwichNormBlock(TransformerBlock):
    """Gemma 2/3's order ("sandwich", peri-LN): a norm on both sides of each sublayer,
    ``x = x + ln1_out(attn(ln1(x))); x = x + ln2_out(ffn(ln2(x)))``."""

    def __init__(self, config, rope=None):
        super().__init__(config, rope)
        self.ln1_out, self.ln2_out = config_norm(config), config_norm(config)

    def forward(self, x, token_positions=None, kv_cache=None, layer_idx: int = 0):
        x = x + self.ln1_out(self.attn(self.ln1(x), token_positions, kv_cache, layer_idx))
        return x + self.ln2_out(self.ffn(self.ln2(x)))


PLACEMENTS = {"pre": TransformerBlock, "post": PostNormBlock, "output": OutputNormBlock, "sandwich": SandwichNormBlock}


def build_lm(config, placement: str = "pre") -> TransformerLM:
    """A :class:`TransformerLM` whose blocks put their norms at ``placement``: ``"pre"`` (labkit's, GPT-2's,
    LLaMA's), ``"post"`` (the original Transformer's; its last block already ends in a norm, so there is no final
    norm), ``"output"`` (OLMo 2's) or ``"sandwich"`` (Gemma 2/3's); see :data:`PLACEMENTS`."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r}: expected one of {tuple(PLACEMENTS)}")
    model = TransformerLM(config)
    if placement != "pre":
        rope = model.layers[0].attn.rope
        model.layers = nn.ModuleList(PLACEMENTS[placement](config, rope) for _ in range(config.num_layers))
    if placement == "post":
        model.ln_final = nn.Identity()
    return model


def block_gradient_norms(placement: str, num_layers: int = 12, norm: str = "layernorm", d_model: int = 64,
                         batch: int = 8, seq: int = 32, vocab_size: int = 64, seed: int = 0) -> list[float]:
    """L2 norm of the gradient of every block's feed-forward weights at initialization, for a
    cross-entropy loss on random tokens. Xiong et al. (2020) show that with Post-LN the last
    blocks get gradients ~sqrt(L) larger than with Pre-LN: the reason Post-LN needs a learning
    rate warmup and Pre-LN (every modern LLM) does not."""
    torch.manual_seed(seed)
    config = tiny_config(vocab_size, context_length=seq, d_model=d_model, num_layers=num_layers, norm=norm)
    model = build_lm(config, placement)
    tokens = torch.randint(0, vocab_size, (batch, seq + 1))
    cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return [torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in block.ffn.parameters()])).item()
            for block in model.layers]


FFN_KINDS = ("relu", "swiglu")
POSITIONS = ("sinusoidal", "none")


class EncoderBlock(nn.Module):
    """The block of Xiong et al.'s (2020) encoder, in Post-LN or Pre-LN order: bidirectional
    multi-head attention and a feed-forward ``w2(relu(w1 x))`` (or SwiGLU ``w2(silu(w1 x) * w3 x)``),
    every weight Xavier-uniform initialized as in fairseq, whose models they measured."""

    def __init__(self, d_model: int, num_heads: int, ffn: str, placement: str):
        super().__init__()
        self.placement, self.num_heads = placement, num_heads
        self.ln1, self.ln2 = LayerNorm(d_model), LayerNorm(d_model)
        self.q, self.k, self.v, self.out = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        d_ff = 4 * d_model if ffn == "relu" else swiglu_d_ff(d_model)  # same parameter count
        self.w1, self.w2 = nn.Linear(d_model, d_ff, bias=False), nn.Linear(d_ff, d_model, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False) if ffn == "swiglu" else None
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = (proj(x).view(batch, seq, self.num_heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        return self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, seq, d_model))

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(torch.relu(self.w1(x)))
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.placement == "post":
            x = self.ln1(x + self.attention(x))
            return self.ln2(x + self.ffn(x))
        x = x + self.attention(self.ln1(x))
        return x + self.ffn(self.ln2(x))


def sinusoidal_positions(seq: int, d_model: int) -> torch.Tensor:
    """The original Transformer's positional encoding ``[seq, d_model]``: ``sin`` on even,
    ``cos`` on odd features, at wavelengths ``2 pi * 10000^(2i/d)``."""
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).reshape(seq, d_model).float()


@dataclass
class GradientProfile:
    """Per layer, averaged over seeds: the norm of the FFN weights' gradient, and the std of
    the residual stream entering the block."""

    placement: str
    ffn: str
    positions: str
    gradient_norm: list[float]
    stream_std: list[float]

    @property
    def last_over_first(self) -> float:
        """The gradient norm of the last layer divided by that of the first."""
        return self.gradient_norm[-1] / self.gradient_norm[0]


def ffn_gradient_profile(placement: str, ffn: str = "relu", positions: str = "sinusoidal", num_layers: int = 6,
                         d_model: int = 64, num_heads: int = 4, batch: int = 8, seq: int = 32, vocab_size: int = 64,
                         seeds=(0, 1, 2, 3)) -> GradientProfile:
    """Xiong et al.'s (2020) Figure-3 measurement on a small encoder stack: at initialization,
    the L2 norm of the gradient of each layer's FFN weights (``w1, w2``, and ``w3`` for SwiGLU)
    for a cross-entropy loss on random tokens, averaged over ``seeds``.

    Like their Transformer: token embeddings of unit scale (fairseq's ``N(0, 1/d)`` times
    ``sqrt(d)``), ``positions="sinusoidal"`` added to them, Xavier init, a final LayerNorm only
    for Pre-LN, and ``ffn="relu"`` (``d_ff = 4 d``). ``ffn="swiglu"`` and ``positions="none"``
    (labkit's LM rotates q and k with RoPE instead, which adds nothing to the stream) change one
    thing each.
    """
    for name, value, allowed in [("placement", placement, ("pre", "post")), ("ffn", ffn, FFN_KINDS), ("positions", positions, POSITIONS)]:
        if value not in allowed:
            raise ValueError(f"{name}={value!r}: expected one of {allowed}")
    if num_layers < 1 or not seeds:
        raise ValueError(f"num_layers={num_layers}, seeds={seeds!r}: expected num_layers >= 1 and at least one seed")
    gradients, stds = torch.zeros(num_layers, dtype=torch.float64), torch.zeros(num_layers, dtype=torch.float64)
    for seed in seeds:
        torch.manual_seed(seed)
        embeddings = torch.randn(vocab_size, d_model)
        blocks = nn.ModuleList(EncoderBlock(d_model, num_heads, ffn, placement) for _ in range(num_layers))
        final_norm = LayerNorm(d_model) if placement == "pre" else nn.Identity()
        head = nn.Linear(d_model, vocab_size, bias=False)
        nn.init.xavier_uniform_(head.weight)
        tokens = torch.randint(0, vocab_size, (batch, seq + 1))
        x = embeddings[tokens[:, :-1]]
        if positions == "sinusoidal":
            x = x + sinusoidal_positions(seq, d_model)
        for layer, block in enumerate(blocks):
            stds[layer] += x.std().item()
            x = block(x)
        cross_entropy(head(final_norm(x)), tokens[:, 1:]).backward()
        for layer, block in enumerate(blocks):
            weights = [w for w in (block.w1, block.w2, block.w3) if w is not None]
            gradients[layer] += torch.linalg.vector_norm(torch.stack([w.weight.grad.norm() for w in weights])).item()
    return GradientProfile(placement, ffn, positions, (gradients / len(seeds)).tolist(), (stds / len(seeds)).tolist())


# ----------------------------------------------------------------------------- activations
def activation_functions() -> dict:
    """Name -> function for the activations the chapter compares."""
    return {"relu": ACTIVATIONS["relu"], "gelu": gelu, "gelu (tanh)": lambda x: gelu(x, "tanh"),
            "silu": ACTIVATIONS["silu"], "sigmoid": torch.sigmoid}


def activation_curves(x: torch.Tensor, names=None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``name -> (f(x), f'(x))`` with the derivative from autograd."""
    functions = activation_functions()
    names = list(functions) if names is None else names
    curves = {}
    for name in names:
        if name not in functions:
            raise ValueError(f"names: {name!r} is not one of {sorted(functions)}")
        xs = x.detach().clone().requires_grad_()
        y = functions[name](xs)
        (grad,) = torch.autograd.grad(y.sum(), xs)
        curves[name] = (y.detach(), grad)
    return curves


def swiglu_d_ff(d_model: int, mlp_ratio: float = 4.0, multiple_of: int = 1) -> int:
    """Hidden size of a SwiGLU feed-forward with the parameters of a plain ``mlp_ratio x`` MLP.

    A plain MLP has 2 matrices ``d x (r d)``; a GLU has 3 matrices ``d x d_ff``, so equal
    parameters need ``d_ff = 2 r d / 3`` (= 8/3 d for r = 4), rounded *up* to a multiple of
    ``multiple_of`` as LLaMA does (d_model 4096, multiple_of 256 -> 11008).
    """
    if d_model <= 0 or multiple_of <= 0 or mlp_ratio <= 0:
        raise ValueError(f"d_model={d_model}, mlp_ratio={mlp_ratio}, multiple_of={multiple_of}: expected positive values")
    d_ff = int(2 * mlp_ratio * d_model / 3)
    return multiple_of * math.ceil(d_ff / multiple_of)


def ffn_param_counts(d_model: int, mlp_ratio: float = 4.0, multiple_of: int = 1) -> dict[str, int]:
    """Parameters of a plain MLP ``W2 relu(W1 x)`` with ``d_ff = mlp_ratio * d_model`` and of a
    SwiGLU with :func:`swiglu_d_ff`, counted from the modules themselves (built on ``meta``)."""
    d_mlp = int(mlp_ratio * d_model)
    d_glu = swiglu_d_ff(d_model, mlp_ratio, multiple_of)
    mlp = nn.Sequential(Linear(d_model, d_mlp, device="meta"), Linear(d_mlp, d_model, device="meta"))
    glu = GLU(d_model, d_glu, device="meta")
    return {"mlp d_ff": d_mlp, "mlp params": sum(p.numel() for p in mlp.parameters()),
            "swiglu d_ff": d_glu, "swiglu params": sum(p.numel() for p in glu.parameters())}


class MLP(nn.Module):
    """The classic feed-forward of GPT-2 and BERT, ``w2(act(w1 x))`` without biases: two matrices ``d_model x d_ff``
    where a GLU (:class:`labkit.nn.GLU`) has three, so at equal parameters its ``d_ff`` is 3/2 of the GLU's."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: expected one of {sorted(ACTIVATIONS)}")
        self.activation = activation
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(ACTIVATIONS[self.activation](self.w1(x)))


FFN_VARIANTS = ("gelu", "swiglu")


def ffn_variant_lm(vocab_size: int, ffn: str, mlp_ratio: float = 4.0, **overrides) -> TransformerLM:
    """labkit's LM (``tiny_config(vocab_size, **overrides)``) whose every feed-forward is ``ffn``: ``"swiglu"``, its
    own SiLU-gated GLU with ``d_ff = swiglu_d_ff(d_model, mlp_ratio)``, or ``"gelu"``, GPT-2's :class:`MLP` with GELU
    and ``d_ff = mlp_ratio * d_model``: the same parameter count when ``2 * mlp_ratio * d_model / 3`` is a whole
    number (``d_model`` a multiple of 3 for the usual 4x). Everything but the feed-forwards is built first, from the
    same random draws for both, so that one seed gives both variants the same attention and embedding weights."""
    if ffn not in FFN_VARIANTS:
        raise ValueError(f"ffn={ffn!r}: expected one of {FFN_VARIANTS}")
    if "d_ff" in overrides:
        raise ValueError("d_ff: set by ffn and mlp_ratio (equal parameters), not given")
    d_model = overrides.get("d_model", tiny_config(vocab_size).d_model)
    model = TransformerLM(tiny_config(vocab_size, d_ff=swiglu_d_ff(d_model, mlp_ratio), **overrides))
    if ffn == "gelu":
        for block in model.layers:
            block.ffn = MLP(d_model, int(mlp_ratio * d_model), "gelu")
    return model


@dataclass
class FFNRun:
    """One training run of :func:`train_ffn_variants`."""

    ffn: str
    seed: int
    num_params: int
    val_loss: float


def train_ffn_variants(task, ffns, seeds, train_config: TrainConfig, device=None, **model_overrides) -> list[FFNRun]:
    """Train :func:`ffn_variant_lm` once per ``ffn`` of ``ffns`` and seed of ``seeds`` on ``task``'s training tokens,
    with ``train_config`` (the same steps, learning rates and batch size for all), and return each run's parameter
    count and final validation loss (over ``train_config.eval_batches`` batches of the validation split).

    Each seed (shifted by ``LABKIT_SEED``, :func:`labkit.runtime.run_seed`) sets the initial weights and, drawn again
    before training, the batches: the variants of one seed share their attention and embedding weights and see the
    same batches, so their difference is the feed-forward's alone."""
    from dataclasses import replace

    config = replace(train_config, eval_every=train_config.steps)  # one validation loss, after the last step
    train_data, val_data, runs = task.tokens("train"), task.tokens("val"), []
    for seed in seeds:
        for ffn in ffns:
            torch.manual_seed(run_seed(seed))
            model = ffn_variant_lm(task.vocab_size, ffn, **model_overrides).to(device)
            torch.manual_seed(run_seed(seed) + 1)  # the batches: the same for every variant of this seed
            history = train(model, train_data, val_data, config, progress=False)
            runs.append(FFNRun(ffn, seed, model.num_params(), history.val_loss[-1]))
    return runs


# ----------------------------------------------------------------------------- training
def train_placements(task, runs, train_config: TrainConfig, seed: int = 0, device=None, **model_overrides) -> dict:
    """Train labkit's LM (``tiny_config(task.vocab_size, **model_overrides)``) on ``task``'s training tokens once
    per ``(placement, warmup_iters)`` in ``runs`` (a placement of :func:`build_lm`), each from the same seed (so the
    same weights, with the same batches) with ``train_config`` but its own warmup; returns
    ``(placement, warmup_iters) -> History`` (training losses only)."""
    from dataclasses import replace

    train_data, histories = task.tokens("train"), {}
    for placement, warmup in runs:
        torch.manual_seed(seed)
        model = build_lm(tiny_config(task.vocab_size, **model_overrides), placement).to(device)
        histories[placement, warmup] = train(model, train_data, None, replace(train_config, warmup_iters=warmup), progress=False)
    return histories


def attention_entropy_under_scaling(scales=(1.0, 4.0, 16.0), qk_norm: bool = False, d_model: int = 64, num_heads: int = 4,
                                    seq: int = 32, seed: int = 0) -> list[float]:
    """Mean entropy (nats) of a causal attention layer's rows (positions 1 onwards) on unit-scale random inputs,
    with its query and key weights multiplied by each of ``scales``: weights grow in training at a large learning
    rate, and the logits grow with the product of the two. With ``qk_norm`` the layer RMS-normalizes each head's q
    and k (OLMo 2, Gemma 3, Qwen3), so the logits no longer depend on that scale."""
    from labkit.nn import MultiHeadSelfAttention

    torch.manual_seed(seed)
    layer = MultiHeadSelfAttention(d_model, num_heads, qk_norm=qk_norm)
    x = torch.randn(2, seq, d_model)
    q_weight, k_weight = layer.q_proj.weight.detach().clone(), layer.k_proj.weight.detach().clone()
    entropies = []
    with torch.no_grad():
        for scale in scales:
            layer.q_proj.weight.copy_(q_weight * scale)
            layer.k_proj.weight.copy_(k_weight * scale)
            probs = layer.attention_weights(x)[..., 1:, :]
            entropies.append(-torch.special.xlogy(probs, probs).sum(dim=-1).mean().item())
    return entropies


def unigram_entropy(tokens) -> float:
    """The entropy (nats) of the token frequencies: the loss of a model that ignores the context."""
    counts = torch.bincount(torch.as_tensor(tokens, dtype=torch.int64)).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def use_triton_kernels(model: nn.Module, enabled: bool = True) -> int:
    """Route ``model``'s RMSNorms and SiLU-gated GLUs through the Triton kernels (or back);
    attention is left alone. Returns how many modules were switched."""
    switched = 0
    for module in model.modules():
        if isinstance(module, RMSNorm) or (isinstance(module, GLU) and module.activation == "silu"):
            module.use_triton = enabled
            switched += 1
    return switched


# ----------------------------------------------------------------------------- bytes
class _ByteCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # a view only relabels memory it shares with its input
            return out
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        self.ops.append((str(func.overloadpacket.__name__), sum(t.numel() * t.element_size() for t in tensors)))
        return out


def count_op_bytes(fn, *args) -> tuple[int, list[tuple[str, int]]]:
    """Run ``fn(*args)`` op by op as PyTorch eager does and add up the bytes of every tensor each
    op reads and writes: ``(total, [(op name, bytes), ...])``. Each eager op is a separate pass
    over memory, so this is the traffic of the unfused computation (views move nothing and are
    skipped)."""
    counter = _ByteCounter()
    with torch.no_grad(), counter:
        fn(*args)
    return sum(b for _, b in counter.ops), counter.ops


def rmsnorm_bytes(n_rows: int, n_cols: int, dtype: torch.dtype = torch.bfloat16, weight_dtype: torch.dtype | None = None,
                  num_programs: int = 132) -> dict[str, int]:
    """Bytes an RMSNorm over ``[n_rows, n_cols]`` must move, and what labkit's kernels move.

    Minimum: read ``x`` and ``weight``, write ``y`` (forward); read ``dy``, ``x``, ``weight``,
    write ``dx``, ``dweight`` (backward). The fused forward also writes the fp32 inverse RMS of
    each row; the backward reads it, and its ``num_programs`` programs (one per SM: 132 on an
    H100/H200) each write one fp32 partial ``dweight`` that a final sum reads back. The weight
    vector, read by every row, stays in cache and is counted once.
    """
    if min(n_rows, n_cols, num_programs) <= 0:
        raise ValueError(f"n_rows={n_rows}, n_cols={n_cols}, num_programs={num_programs}: expected positive integers")
    es = dtype.itemsize
    ws = (weight_dtype or dtype).itemsize
    tensor, weight, rstd = n_rows * n_cols * es, n_cols * ws, n_rows * 4
    partials = min(num_programs, n_rows) * n_cols * 4
    return {
        "forward minimum": 2 * tensor + weight,
        "forward kernel": 2 * tensor + weight + rstd,
        "backward minimum": 3 * tensor + 2 * weight,
        "backward kernel": 3 * tensor + 2 * weight + rstd + 2 * partials,
    }


# ----------------------------------------------------------------------------- plots and widget callbacks
def plot_deep_stacks(results: list[StackStatistics], title: str = ""):
    """Two log-scale panels: activation std and gradient norm per layer, one line per stack."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    for stats in results:
        layers = range(1, len(stats.activation_std) + 1)
        left.plot(layers, stats.activation_std, marker=".", label=stats.norm)
        right.plot(layers, stats.gradient_norm, marker=".", label=stats.norm)
    left.set(yscale="log", xlabel="layer", ylabel="activation std", title="forward: activations")
    right.set(yscale="log", xlabel="layer", ylabel="gradient norm", title="backward: gradients")
    left.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def deep_stack_view(norm: str = "none", gain: float = 1.0, activation: str = "relu", num_layers: int = 32):
    """Widget callback: the deep-stack experiment for one setting -> ``(StackStatistics, figure)``."""
    stats = deep_stack(norm, num_layers=num_layers, gain=gain, activation=activation)
    return stats, plot_deep_stacks([stats], f"{norm}, gain {gain:g}, {activation}")


def norm_explorer_view(norm: str = "layernorm", distribution: str = "outlier features", seed: int = 0):
    """Widget callback: a batch with the chosen pathology before and after ``norm`` ->
    ``({"input": stats, norm: stats}, figure)`` with one sequence shown as a heatmap."""
    x = make_batch(distribution, seed=seed)
    with torch.no_grad():
        y = make_norm(norm, x.shape[-1])(x)
    table = {"input": axis_statistics(x), norm: axis_statistics(y)}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3))
    for ax, data, title in zip(axes, (x[0], y[0]), ("input", f"after {norm}")):
        image = ax.imshow(data.numpy(), aspect="auto", cmap="RdBu_r")
        ax.set(xlabel="feature", ylabel="token", title=f"{title} (sequence 0)")
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    return table, fig


def activation_explorer_view(name: str = "silu", up: float = 1.0):
    """Widget callback: ``f(a)``, ``f'(a)`` and the GLU output ``f(a) * up`` over ``a`` in [-5, 5]
    -> ``(curves, figure)`` where ``curves`` holds the three arrays. The y-limits follow the
    curves (with a margin), so no curve is clipped whatever ``up`` is."""
    a = torch.linspace(-5, 5, 201)
    value, slope = activation_curves(a, [name])[name]
    curves = {"a": a, "f": value, "df": slope, "glu": value * up}
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(a, value, label=f"{name}(a)")
    ax.plot(a, slope, "--", label=f"{name}'(a)")
    ax.plot(a, value * up, ":", label=f"{name}(a) * b,  b = {up:g}")
    ax.axhline(0, color="gray", lw=0.5)
    shown = torch.cat([value, slope, value * up])
    margin = 0.05 * (shown.max() - shown.min()).item() + 0.1
    ax.set(xlabel="a (gate pre-activation)", ylim=(shown.min().item() - margin, shown.max().item() + margin),
           title=f"{name}: value, slope and GLU output")
    ax.legend()
    fig.tight_layout()
    return curves, fig


def format_table(table: dict[str, dict[str, float]], digits: int = 3, tiny: float = 1e-6) -> str:
    """Rows of a ``{row: {column: value}}`` table as aligned text with rounded numbers.

    Magnitudes below ``tiny`` print as ``<tiny``: they are the rounding noise of a quantity that
    is 0 in exact arithmetic (a normalized mean), and their digits depend on the summation order.
    """
    columns = list(next(iter(table.values())))
    width = max(len(r) for r in table)

    def cell(value: float) -> str:
        return f"{'<' + format(tiny, 'g'):>18}" if abs(value) < tiny else f"{value:>18.{digits}g}"

    lines = [" " * width + "  " + "  ".join(f"{c:>18}" for c in columns)]
    for row, values in table.items():
        lines.append(f"{row:>{width}}  " + "  ".join(cell(values[c]) for c in columns))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- a learner's RMSNorm kernel
def launch_rmsnorm_kernel(kernel, x_rows: torch.Tensor, weight: torch.Tensor, y_rows: torch.Tensor, eps: float) -> None:
    """Launch a ``@triton.jit`` RMSNorm forward ``kernel(X, W, Y, x_row_stride, y_row_stride, n_cols, eps,
    BLOCK_SIZE: tl.constexpr)`` the way chapter 02's exercise asks for one: a program per row of the 2-D
    ``x_rows`` (its rows may be strided), ``BLOCK_SIZE`` the next power of two >= the width, into ``y_rows``."""
    import triton

    n_rows, n_cols = x_rows.shape
    kernel[(n_rows,)](x_rows, weight, y_rows, x_rows.stride(0), y_rows.stride(0), n_cols, eps, triton.next_power_of_2(n_cols))


def launch_rmsnorm_backward_kernel(kernel, dy_rows: torch.Tensor, x_rows: torch.Tensor, weight: torch.Tensor,
                                   rstd: torch.Tensor, dx_rows: torch.Tensor, dw_partial: torch.Tensor) -> None:
    """Launch a ``@triton.jit`` RMSNorm backward ``kernel(DY, X, W, RSTD, DX, DW_PARTIAL, dy_row_stride,
    x_row_stride, dx_row_stride, n_rows, n_cols, rows_per_program, BLOCK_SIZE: tl.constexpr)`` the way chapter
    02's exercise asks for one: one program per row of the contiguous fp32 ``dw_partial [programs, n_cols]``,
    program ``p`` taking the rows ``[p * rows_per_program, min((p + 1) * rows_per_program, n_rows))`` of the 2-D
    (possibly strided) ``dy_rows``/``x_rows``, ``BLOCK_SIZE`` the next power of two >= the width."""
    import triton

    n_rows, n_cols = x_rows.shape
    programs = dw_partial.shape[0]
    kernel[(programs,)](dy_rows, x_rows, weight, rstd, dx_rows, dw_partial, dy_rows.stride(0), x_rows.stride(0),
                        dx_rows.stride(0), n_rows, n_cols, triton.cdiv(n_rows, programs), triton.next_power_of_2(n_cols))


def rmsnorm_kernel_bandwidth(kernel, rows: int = 4096, width: int = 4096) -> dict[str, float] | None:
    """On a GPU: GB/s of a learner's ``kernel`` (see :func:`launch_rmsnorm_kernel`) and of labkit's RMSNorm on
    ``x [rows, width]`` bf16, counting the bytes that must move (read x and the weight, write y). ``None`` where
    kernels run in Triton's interpreter (its speed says nothing about a GPU's) or not at all."""
    from labkit.hardware import timeit
    from labkit.kernels import available
    from labkit.runtime import triton_mode

    if not available()[0] or triton_mode() != "compiled":
        return None
    from labkit.kernels.rmsnorm import rmsnorm as labkit_rmsnorm

    x = torch.randn(rows, width, dtype=torch.bfloat16, device="cuda")
    weight = torch.rand(width, dtype=torch.bfloat16, device="cuda") + 0.5
    y = torch.empty_like(x)
    moved = (2 * x.numel() + weight.numel()) * x.element_size()
    return {"yours": moved / timeit(launch_rmsnorm_kernel, kernel, x, weight, y, 1e-5).median / 1e9,
            "labkit": moved / timeit(labkit_rmsnorm, x, weight, 1e-5).median / 1e9}
