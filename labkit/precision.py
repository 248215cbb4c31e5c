"""Number formats and mixed precision (chapter 01): read any float format off its bits.

A binary float with ``e`` exponent bits, ``m`` mantissa bits and bias ``b`` stores
``sign | exponent field E | mantissa field M`` and means

* ``(-1)^sign * 2^(E - b) * (1 + M / 2^m)`` for ``E > 0`` (normal numbers),
* ``(-1)^sign * 2^(1 - b) * (M / 2^m)`` for ``E == 0`` (subnormals and ±0),

except for the codes a format reserves for inf/NaN. :class:`FloatFormat` describes a format,
:func:`decode` / :func:`encode` convert between codes and values (round-to-nearest-even, like
the hardware and PyTorch's casts); those three live in :mod:`labkit.formats` and are
re-exported here. The rest of the module builds on them: ulps, loss scaling for fp16 training
(:class:`DynamicLossScaler`), and per-tensor FP8 scaling (:func:`amax_scale`,
:class:`DelayedScaling`).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable

import torch

# The format definitions and the bit-level codec live one layer down, in labkit.formats: the
# FP8 kernel needs them too, and a kernel must not import this chapter module (which imports
# the kernels). Re-exported so the chapter keeps reading P.FloatFormat, P.decode, P.encode ...
from labkit.formats import FORMATS, SPECIALS, FloatFormat, decode, encode, get_format  # noqa: F401 (re-exports)
from labkit.formats import _as_values, _binade, _check_code  # input checks shared with the codec


# ----------------------------------------------------------------------------- reading codes and values
def round_to(x, fmt: str | FloatFormat, saturate: bool | None = None) -> torch.Tensor:
    """``x`` rounded to ``fmt`` and read back (float64): ``decode(encode(x, fmt), fmt)``."""
    return decode(encode(x, fmt, saturate), fmt)


def ulp(x, fmt: str | FloatFormat) -> torch.Tensor:
    """Unit in the last place at ``x``: the spacing of ``fmt``'s values in the binade that
    holds ``|x|`` (``min_subnormal`` below the normal range); NaN for inf/NaN inputs."""
    fmt = get_format(fmt)
    x = _as_values(x, "x")
    binade = _binade(torch.where(torch.isfinite(x), x.abs(), 0.0), fmt)
    spacing = torch.ldexp(torch.ones_like(x), (binade - fmt.mantissa_bits).double())
    return torch.where(torch.isfinite(x), spacing, math.nan)


def all_values(fmt: str | FloatFormat) -> torch.Tensor:
    """Every value of a format of at most 16 bits, indexed by code (float64, NaNs included)."""
    fmt = get_format(fmt)
    if fmt.bits > 16:
        raise ValueError(f"fmt={fmt.name!r}: {fmt.bits} bits is too many to list; expected a format of at most 16 bits")
    return decode(torch.arange(1 << fmt.bits), fmt)


def classify(code: int, fmt: str | FloatFormat) -> str:
    """'zero', 'subnormal', 'normal', 'inf' or 'nan'."""
    fmt = get_format(fmt)
    value = decode(code, fmt).item()
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf"
    if value == 0:
        return "zero"
    return "subnormal" if fmt.fields(code)[1] == 0 else "normal"


def neighbours(code: int, fmt: str | FloatFormat) -> tuple[float | None, float | None]:
    """The representable values just below and just above ``code``'s value (None past the
    ends of the format, and for NaN). ±0 both sit between ∓min_subnormal."""
    fmt = get_format(fmt)
    code = _check_code(code, fmt)
    if math.isnan(decode(code, fmt).item()):
        return None, None
    sign_bit = 1 << (fmt.bits - 1)
    magnitude = code & (sign_bit - 1)
    # Order every non-NaN value on one integer line: +k for positive codes, -k for negative.
    position = -magnitude if code & sign_bit else magnitude
    last = fmt.max_code + 1 if fmt.has_inf else fmt.max_code

    def value_at(pos: int) -> float | None:
        if abs(pos) > last:
            return None
        return decode(pos if pos >= 0 else sign_bit | -pos, fmt).item()

    return value_at(position - 1), value_at(position + 1)


def explain_code(code: int, fmt: str | FloatFormat) -> str:
    """A few lines that read one code the way the notebook teaches: bit fields, the formula,
    the value, its class and its neighbours (the bit-explorer widget shows this)."""
    fmt = get_format(fmt)
    code = _check_code(code, fmt)
    sign, exponent, mantissa = fmt.fields(code)
    m = fmt.mantissa_bits
    bits = format(code, f"0{fmt.bits}b")
    kind = classify(code, fmt)
    value = decode(code, fmt).item()
    s = "-" if sign else "+"
    if kind in ("normal",):
        formula = f"{s}2^({exponent} - {fmt.bias}) x (1 + {mantissa}/{1 << m})"
    elif kind in ("subnormal", "zero"):
        formula = f"{s}2^(1 - {fmt.bias}) x ({mantissa}/{1 << m})"
    else:
        formula = "reserved code"
    below, above = neighbours(code, fmt)
    return "\n".join(
        [
            f"{fmt.name}  code 0x{code:0{(fmt.bits + 3) // 4}X}  bits {bits[0]} {bits[1:1 + fmt.exponent_bits]} {bits[1 + fmt.exponent_bits:]}",
            f"sign {sign}  exponent field {exponent}  mantissa field {mantissa}",
            f"value {formula} = {_short(value)}  ({kind})",
            f"neighbours {_short(below)} < value < {_short(above)}",
        ]
    )


def cast_table(value: float, formats: Iterable[str] | None = None) -> list[dict]:
    """``value`` rounded to each format: the stored value, absolute and relative error.
    (The cast widget prints this; NaN is reported for formats that cannot hold a NaN input.)"""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"value={value!r}: expected a Python number")
    rows = []
    for name in formats if formats is not None else FORMATS:
        fmt = get_format(name)
        stored = math.nan if math.isnan(value) and not fmt.has_nan else round_to(float(value), fmt).item()
        error = abs(stored - value) if math.isfinite(stored) and math.isfinite(value) else math.nan
        rel = error / abs(value) if value != 0 and math.isfinite(error) else (0.0 if error == 0 else math.nan)
        rows.append({"format": fmt.name, "stored": stored, "abs_error": error, "rel_error": rel})
    return rows


def format_table(formats: Iterable[str] | None = None) -> list[dict]:
    """One row per format: layout, range and precision (what the notebook's table prints)."""
    rows = []
    for name in formats if formats is not None else FORMATS:
        f = get_format(name)
        rows.append(
            {
                "format": f.name, "bits": f.bits, "exp": f.exponent_bits, "mant": f.mantissa_bits, "bias": f.bias,
                "max": f.max, "min_normal": f.min_normal, "min_subnormal": f.min_subnormal, "eps": f.eps,
                "digits": round(f.decimal_digits, 2), "inf/nan": f.specials,
            }
        )
    return rows


def values_per_binade(fmt: str | FloatFormat) -> dict[int, int]:
    """How many positive finite values ``fmt`` has in each binade ``[2^k, 2^(k+1))``, from the
    bit fields alone (so it works for fp32, whose 2^32 codes are too many to list): ``2^m`` in
    every normal binade (one fewer in E4M3's top binade, whose last code is NaN), and in the
    subnormal range the binade ``1 - bias - m + j`` holds ``2^j`` values (gradual underflow)."""
    fmt = get_format(fmt)
    m = fmt.mantissa_bits
    counts = {1 - fmt.bias - m + j: 1 << j for j in range(m)}
    top_exponent = (1 << fmt.exponent_bits) - (2 if fmt.has_inf else 1)
    for exponent in range(1, top_exponent + 1):
        counts[exponent - fmt.bias] = 1 << m
    if fmt.specials == "nan_only":
        counts[top_exponent - fmt.bias] -= 1
    return counts


@dataclass(frozen=True)
class BlockScaling:
    """A block-scaled storage scheme: ``block_size`` consecutive values of ``element`` share one
    scale of ``scale_bits`` bits, and each tensor may carry one more scale of
    ``tensor_scale_bits`` bits (NVFP4's fp32 per-tensor scale)."""

    name: str
    element: str
    block_size: int
    scale_bits: int
    tensor_scale_bits: int = 0

    @property
    def bits_per_value(self) -> float:
        """Element bits plus the block scale spread over its block (large-tensor limit)."""
        return get_format(self.element).bits + self.scale_bits / self.block_size


BLOCK_SCALINGS: dict[str, BlockScaling] = {
    s.name: s
    for s in (
        BlockScaling("mxfp8", "fp8_e4m3", 32, 8),          # OCP MX v1.0: 32 elements share an E8M0 (8-bit power-of-two) scale
        BlockScaling("mxfp6", "fp6_e2m3", 32, 8),
        BlockScaling("mxfp4", "fp4_e2m1", 32, 8),
        BlockScaling("nvfp4", "fp4_e2m1", 16, 8, 32),      # NVIDIA NVFP4: 16 elements share an FP8 E4M3 scale, plus an fp32 tensor scale
    )
}


def storage_bytes(num_values: int, scheme: str | FloatFormat, num_tensors: int = 1) -> float:
    """Bytes to store ``num_values`` values in ``scheme``: a format name (plain, unscaled) or a
    :data:`BLOCK_SCALINGS` name, whose block scales (one per started block) and the per-tensor
    scales of ``num_tensors`` tensors are counted too. Elements narrower than a byte are packed."""
    if not isinstance(num_values, int) or isinstance(num_values, bool) or num_values < 0:
        raise ValueError(f"num_values={num_values!r}: expected a non-negative integer")
    if not isinstance(num_tensors, int) or isinstance(num_tensors, bool) or num_tensors < 1:
        raise ValueError(f"num_tensors={num_tensors!r}: expected a positive integer")
    if isinstance(scheme, str) and scheme in BLOCK_SCALINGS:
        s = BLOCK_SCALINGS[scheme]
        blocks = -(-num_values // s.block_size)  # one scale per started block
        bits = num_values * get_format(s.element).bits + blocks * s.scale_bits + num_tensors * s.tensor_scale_bits
        return bits / 8
    try:
        return num_values * get_format(scheme).bits / 8
    except ValueError:
        raise ValueError(f"scheme={scheme!r}: expected a format ({sorted(FORMATS)}) or a block scaling ({sorted(BLOCK_SCALINGS)})") from None


# ----------------------------------------------------------------------------- mixed precision
def accumulate(start: float, update: float, steps: int, dtype: torch.dtype, master_dtype: torch.dtype | None = None) -> float:
    """Add ``update`` to a weight ``steps`` times, as an optimizer would, and return the weight
    as stored in ``dtype``. With ``master_dtype`` the sum is kept in that (wider) dtype and only
    cast to ``dtype`` at the end: "fp32 master weights"."""
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps={steps!r}: expected a non-negative integer")
    weight = torch.tensor(start, dtype=master_dtype or dtype)
    step = torch.tensor(update, dtype=master_dtype or dtype)
    for _ in range(steps):
        weight = weight + step
    return weight.to(dtype).item()


def stochastic_round(x, fmt: str | FloatFormat, generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` (finite) rounded to ``fmt`` *stochastically* (float64 values): to one of the two values of
    ``fmt`` around it, the upper one (in magnitude) with probability ``(|x| - lower) / spacing``, so that
    the rounding is unbiased, ``E[stochastic_round(x)] = x``, where round-to-nearest always makes the same
    error. Values of ``fmt`` stay as they are; beyond ``max`` it saturates. Used where many small
    contributions must survive a narrow format: bf16 weights or optimizer states updated without fp32
    master copies, and NVFP4's gradients (NVIDIA, *Pretraining LLMs with NVFP4*, 2025)."""
    fmt = get_format(fmt)
    x = _as_values(x, "x")
    if not torch.isfinite(x).all():
        raise ValueError("x: expected finite values (stochastic rounding has no neighbours for inf or NaN)")
    magnitude = x.abs()
    spacing = ulp(magnitude, fmt)  # a power of two: the divisions and the floor below are exact
    lower = torch.floor(magnitude / spacing) * spacing
    up = torch.rand(x.shape, generator=generator, dtype=torch.float64) < (magnitude - lower) / spacing
    rounded = torch.where(up, lower + spacing, lower).clamp(max=fmt.max)
    return torch.where(torch.signbit(x), -rounded, rounded)


def update_scale(scale: float, growth_tracker: int, found_inf: bool, *, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> tuple[float, int]:
    """One dynamic-loss-scale decision, ``(new_scale, new_growth_tracker)``.

    An overflow (``found_inf``) means the scale is too big: shrink it and start counting
    again. Otherwise count one more good step; after ``growth_interval`` good steps in a row,
    try a bigger scale (so gradients keep as many bits above fp16's underflow as possible).
    """
    if found_inf:
        return scale * backoff_factor, 0
    growth_tracker += 1
    if growth_tracker == growth_interval:
        grown = scale * growth_factor
        return (grown if math.isfinite(grown) else scale), 0
    return scale, growth_tracker


class DynamicLossScaler:
    """Loss scaling for fp16 training, making the same decisions as ``torch.amp.GradScaler``.

    fp16 gradients smaller than 6e-8 become 0. Multiplying the loss by ``scale`` shifts every
    gradient up by the same factor (backprop is linear), so they survive; :meth:`unscale_`
    divides it back out of the fp32 gradients before the optimizer sees them. If a gradient
    overflowed to inf/NaN, :meth:`step` skips the update and :meth:`update` halves the scale.

    Per iteration: ``(loss * scaler.scale).backward(); scaler.unscale_(opt)`` (optional, e.g.
    to clip), ``scaler.step(opt); scaler.update()``.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000):
        if not init_scale > 0 or not math.isfinite(init_scale):
            raise ValueError(f"init_scale={init_scale}: expected a positive finite number")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor={growth_factor}: expected > 1")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor={backoff_factor}: expected a value in (0, 1)")
        if not isinstance(growth_interval, int) or growth_interval <= 0:
            raise ValueError(f"growth_interval={growth_interval!r}: expected a positive integer")
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._scale = _fp32(init_scale)  # GradScaler keeps its scale in an fp32 tensor
        self.growth_tracker = 0
        self.found_inf: bool | None = None  # None until this iteration's gradients were unscaled
        self.skipped_steps = 0

    @property
    def scale(self) -> float:
        return self._scale

    def unscale_(self, optimizer_or_params) -> bool:
        """Divide the gradients by ``scale`` in place; return (and remember) whether any was inf/NaN."""
        if self.found_inf is not None:
            raise RuntimeError("unscale_() was already called since the last update()")
        inv_scale = _fp32(1.0 / self._scale)
        found = False
        with torch.no_grad():
            for p in _parameters(optimizer_or_params):
                if p.grad is None:
                    continue
                found = found or not bool(torch.isfinite(p.grad).all())
                p.grad.mul_(inv_scale)
        self.found_inf = found
        return found

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer.step()`` unless this iteration's gradients overflowed; True if it stepped."""
        if self.found_inf is None:
            self.unscale_(optimizer)
        if self.found_inf:
            self.skipped_steps += 1
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Adjust the scale for the next iteration (see :func:`update_scale`)."""
        if self.found_inf is None:
            raise RuntimeError("update(): call unscale_() or step() first, after backward()")
        scale, self.growth_tracker = update_scale(
            self._scale, self.growth_tracker, self.found_inf, growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor, growth_interval=self.growth_interval,
        )
        scale = _fp32(scale)
        self._scale = scale if math.isfinite(scale) else self._scale  # fp32 overflow: keep the old scale
        self.found_inf = None


def gradient_underflow(values: torch.Tensor, fmt: str | FloatFormat = "fp16", scale: float = 1.0) -> float:
    """Fraction of the non-zero ``values`` that become 0 when ``values * scale`` is stored in ``fmt``."""
    values = _as_values(values, "values")
    nonzero = values != 0
    if not nonzero.any():
        return 0.0
    flushed = round_to(values[nonzero] * scale, fmt, saturate=True) == 0
    return flushed.double().mean().item()


def autocast_gradient_error(model: torch.nn.Module, token_ids: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype = torch.float16,
                            loss_multiplier: float = 1.0, loss_scale: float = 1.0) -> dict:
    """How much of the gradient survives a backward pass under ``torch.autocast(dtype)``.

    Computes the parameter gradients of ``cross_entropy * loss_multiplier`` twice: in fp32
    (the reference) and under autocast with the loss multiplied by ``loss_scale`` and the
    gradients divided by it afterwards (loss scaling). ``loss_multiplier`` shrinks every
    gradient by the same factor, to put them where a bigger model's gradients live. Returns
    ``underflow`` (fraction of the reference's non-zero entries that came back 0) and
    ``rel_error`` (``||g - g_ref|| / ||g_ref||``). Leaves the model's ``.grad`` cleared.
    """
    from labkit.train import cross_entropy

    if not loss_scale > 0 or not loss_multiplier > 0:
        raise ValueError(f"loss_scale={loss_scale}, loss_multiplier={loss_multiplier}: expected positive numbers")
    device_type = token_ids.device.type

    def gradients(autocast_dtype, scale):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            loss = cross_entropy(model(token_ids), targets) * loss_multiplier
        (loss * scale).backward()
        grads = torch.cat([p.grad.flatten().double() / scale for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        return grads

    reference = gradients(None, 1.0)
    grads = gradients(dtype, loss_scale)
    nonzero = reference != 0
    underflow = ((grads == 0) & nonzero).double().sum().item() / max(1, int(nonzero.sum()))
    return {"underflow": underflow, "rel_error": relative_error(grads, reference)}


PRECISION_MODES = ("fp32", "bf16", "fp16", "fp16+scaler")


def train_in_precision(mode: str, model: torch.nn.Module, train_data, val_data, config, scaler: DynamicLossScaler | None = None, **train_kwargs):
    """Train with :func:`labkit.train.train` in one of :data:`PRECISION_MODES`: fp32 weights
    throughout (the master weights), the forward/backward under ``torch.autocast`` for bf16/fp16,
    and for "fp16+scaler" a :class:`DynamicLossScaler` (``scaler``, or a fresh default one).
    Returns ``(history, scaler, scale_trace)`` where ``scale_trace[i]`` is the loss scale after
    step ``i + 1``'s update (empty without a scaler)."""
    from labkit.train import train

    if mode not in PRECISION_MODES:
        raise ValueError(f"mode={mode!r}: expected one of {PRECISION_MODES}")
    autocast_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp16+scaler": torch.float16}[mode]
    if mode == "fp16+scaler":
        scaler = scaler if scaler is not None else DynamicLossScaler()
    elif scaler is not None:
        raise ValueError(f"scaler: only mode='fp16+scaler' uses a loss scaler, got mode={mode!r}")
    trace: list[float] = []
    user_callback = train_kwargs.pop("callback", None)

    def record(step: int, loss: float) -> None:
        if scaler is not None:
            trace.append(scaler.scale)
        if user_callback is not None:
            user_callback(step, loss)

    history = train(model, train_data, val_data, config, autocast_dtype=autocast_dtype, loss_scaler=scaler, callback=record, **train_kwargs)
    return history, scaler, trace


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, fmt: str | FloatFormat = "fp8_e4m3", out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a @ b`` in FP8: quantize each operand with its own per-tensor amax scale (the Triton
    :func:`labkit.kernels.fp8_quantize` kernel, or PyTorch's cast where Triton is missing),
    then ``torch._scaled_mm`` multiplies the FP8 codes, accumulates in fp32 and applies both
    scales on the way out, the way FP8 GEMMs run on Hopper/Blackwell tensor cores."""
    fmt = get_format(fmt)
    if fmt.name not in ("fp8_e4m3", "fp8_e5m2"):
        raise ValueError(f"fmt={fmt.name!r}: expected 'fp8_e4m3' or 'fp8_e5m2'")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"a, b: expected [M, K] and [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    from labkit import kernels

    quantize_fn = kernels.fp8_quantize if kernels.available()[0] else fp8_quantize_torch
    a_codes, a_scale = quantize_fn(a, fmt.name)
    # _scaled_mm wants its second operand column-major: quantize b^T row-major and transpose.
    bt_codes, b_scale = quantize_fn(b.t().contiguous(), fmt.name)
    return torch._scaled_mm(a_codes.view(fmt.torch_dtype), bt_codes.view(fmt.torch_dtype).t(),
                            scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)


def fp8_quantize_torch(x: torch.Tensor, fmt: str = "fp8_e4m3", scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`labkit.kernels.fp8_quantize` computes, in plain PyTorch (for machines
    without Triton): ``(uint8 codes of x / scale, scale as a 0-d fp32 tensor)``, saturating,
    with ``scale = amax / fmt.max`` when none is given."""
    scale = amax_scale(x, fmt) if scale is None else scale
    codes = quantize(x, scale, fmt).to(torch.uint8).reshape(x.shape).to(x.device)
    return codes, torch.tensor(_fp32(scale), dtype=torch.float32, device=x.device)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` in float64."""
    exact = exact.detach().double()
    return (torch.linalg.vector_norm(approx.detach().double() - exact) / torch.linalg.vector_norm(exact)).item()


# ----------------------------------------------------------------------------- FP8 scaling
def amax_scale(x: torch.Tensor, fmt: str | FloatFormat = "fp8_e4m3", margin: int = 0) -> float:
    """Per-tensor scale that maps the largest finite ``|x|`` onto ``fmt.max`` (times ``2^margin``
    of headroom): store ``x / scale`` in the format, read back ``code_value * scale``.
    An all-zero (or empty) tensor gets scale 1."""
    fmt = get_format(fmt)
    if not isinstance(margin, int) or margin < 0:
        raise ValueError(f"margin={margin!r}: expected a non-negative integer (powers of two of headroom)")
    amax = finite_amax(x)
    return amax / fmt.max * 2.0**margin if amax > 0 else 1.0


def finite_amax(x: torch.Tensor) -> float:
    """``max |x|`` over the finite entries (0 for none): NaN/inf must not poison a scale."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got {type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype}")
    magnitudes = x.detach().float().abs()
    magnitudes = magnitudes[torch.isfinite(magnitudes)]
    return magnitudes.max().item() if magnitudes.numel() else 0.0


def quantize(x: torch.Tensor, scale: float, fmt: str | FloatFormat = "fp8_e4m3") -> torch.Tensor:
    """Codes of ``x / scale`` in ``fmt``, saturating at ±max (how FP8 training casts). The
    division happens in fp32, as on the GPU, so the codes equal PyTorch's
    ``(x / scale).to(torch.float8_e4m3fn)`` wherever that does not overflow."""
    if not scale > 0 or not math.isfinite(scale):
        raise ValueError(f"scale={scale}: expected a positive finite number")
    return encode(_as_values(x, "x").float() / _fp32(scale), fmt, saturate=True)


def dequantize(codes: torch.Tensor, scale: float, fmt: str | FloatFormat = "fp8_e4m3") -> torch.Tensor:
    """Values (float64) of ``codes`` times ``scale``: the inverse of :func:`quantize`."""
    return decode(codes, fmt) * scale


def scaling_report(x: torch.Tensor, scale: float, fmt: str | FloatFormat = "fp8_e4m3") -> dict:
    """What storing ``x / scale`` in ``fmt`` does: the fraction of entries clipped to ±max,
    the fraction of non-zero entries flushed to zero, and the relative error
    ``||deq - x|| / ||x||``."""
    fmt = get_format(fmt)
    x = _as_values(x, "x")
    restored = dequantize(quantize(x, scale, fmt), scale, fmt)
    clipped = (x.abs() / scale > fmt.max).double().mean().item()
    nonzero = x != 0
    flushed = ((restored == 0) & nonzero).double().sum().item() / max(1, int(nonzero.sum()))
    return {"scale": scale, "clipped": clipped, "flushed": flushed, "rel_error": relative_error(restored, x)}


def fake_quantize(x: torch.Tensor, fmt: str | FloatFormat = "fp8_e4m3", block: tuple[int, int] | None = None) -> torch.Tensor:
    """``x`` (2-D) stored in ``fmt`` and read back (float64), with one amax scale for the whole
    tensor (``block=None``) or one per ``block = (rows, cols)`` tile: DeepSeek-V3 scales
    activations per ``(1, 128)`` tile and weights per ``(128, 128)`` block. Saturating, like
    :func:`quantize`; an all-zero tile gets scale 1."""
    fmt = get_format(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
        raise ValueError(f"x: expected a 2-D floating-point tensor, got {type(x).__name__ if not isinstance(x, torch.Tensor) else (x.dtype, tuple(x.shape))}")
    if block is None:
        scale = amax_scale(x, fmt)
        return dequantize(quantize(x, scale, fmt), scale, fmt).reshape(x.shape)
    rows, cols = x.shape
    if (not isinstance(block, tuple) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)
            or rows % block[0] or cols % block[1]):
        raise ValueError(f"block={block!r}: expected (rows, cols) of positive integers that divide x's shape {tuple(x.shape)}")
    tiles = x.detach().double().reshape(rows // block[0], block[0], cols // block[1], block[1])
    amax = tiles.abs().nan_to_num(posinf=0.0, neginf=0.0).amax(dim=(1, 3), keepdim=True)
    scales = torch.where(amax > 0, amax / fmt.max, 1.0).float().double()  # fp32 scales, as stored
    codes = encode((tiles / scales).float(), fmt, saturate=True)
    return (decode(codes, fmt) * scales).reshape(rows, cols)


def fp8_matmul_report(a: torch.Tensor, b: torch.Tensor, fmt: str | FloatFormat = "fp8_e4m3", rows: torch.Tensor | None = None,
                      a_block: tuple[int, int] | None = None, b_block: tuple[int, int] | None = None) -> dict:
    """How accurate ``a @ b`` is with both operands stored in ``fmt``, against the float64
    product: ``rel_error`` over the whole output, ``rows_rel_error`` over the output rows
    selected by the boolean mask ``rows`` (e.g. the rows free of outliers; None: all), and the
    fractions of ``a``'s and ``b``'s non-zero entries that were flushed to zero. Each operand
    gets one amax scale (block None) or one per tile (:func:`fake_quantize`): ``a_block`` tiles
    ``a`` ([M, K]), ``b_block`` tiles ``b`` as stored for the GEMM, transposed ([N, K]), so
    ``(1, 128)`` and ``(128, 128)`` are DeepSeek-V3's activation tiles and weight blocks. The
    read-back operands are multiplied in float64: what a GEMM that applies the scales exactly
    computes, without its accumulation error (the fp32 product of per-tensor-scaled operands
    is :func:`fp8_matmul`)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"a, b: expected [M, K] and [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if rows is None:
        rows = torch.ones(a.shape[0], dtype=torch.bool)
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.bool or rows.shape != (a.shape[0],) or not rows.any():
        raise ValueError(f"rows: expected a boolean mask of shape ({a.shape[0]},) selecting at least one row")
    a_read = fake_quantize(a, fmt, a_block)
    b_read = fake_quantize(b.t(), fmt, b_block).t()
    exact = a.detach().double() @ b.detach().double()
    approx = a_read @ b_read
    rows = rows.cpu()

    def flushed(original: torch.Tensor, read: torch.Tensor) -> float:
        nonzero = original.detach().cpu() != 0
        return ((read == 0) & nonzero).double().sum().item() / max(1, int(nonzero.sum()))

    return {"rel_error": relative_error(approx, exact), "rows_rel_error": relative_error(approx[rows], exact[rows]),
            "flushed_a": flushed(a, a_read), "flushed_b": flushed(b, b_read)}


class DelayedScaling:
    """FP8 delayed scaling (Transformer Engine's recipe): this step's tensor is cast with a scale
    computed from the amaxes of the *previous* ``history_len`` steps, and its own amax joins the
    history afterwards. The scale is known before the tensor exists, so the cast fuses into the
    op that produces it; the price is that a sudden spike is clipped for one step.
    """

    def __init__(self, history_len: int = 16, fmt: str | FloatFormat = "fp8_e4m3", margin: int = 0):
        if not isinstance(history_len, int) or history_len <= 0:
            raise ValueError(f"history_len={history_len!r}: expected a positive integer")
        self.fmt = get_format(fmt)
        if not isinstance(margin, int) or margin < 0:
            raise ValueError(f"margin={margin!r}: expected a non-negative integer")
        self.margin = margin
        self.amax_history: deque[float] = deque(maxlen=history_len)

    @property
    def scale(self) -> float:
        """The scale the next tensor gets: ``max(history) / fmt.max * 2^margin`` (1 before any history)."""
        amax = max(self.amax_history, default=0.0)
        return amax / self.fmt.max * 2.0**self.margin if amax > 0 else 1.0

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Quantize ``x`` with the current scale, then record its amax. Returns ``(codes, scale)``."""
        scale = self.scale
        codes = quantize(x, scale, self.fmt)
        self.amax_history.append(finite_amax(x))
        return codes, scale


# ----------------------------------------------------------------------------- FP8 training, simulated
FP8_SCALINGS = ("delayed", "current")


@dataclass(frozen=True)
class Fp8Recipe:
    """How an FP8 linear layer casts its three GEMM operands (Micikevicius et al., *FP8 Formats for
    Deep Learning*, 2022; Transformer Engine's ``DelayedScaling`` recipe): activations and weights in
    ``forward``, the incoming gradient in ``backward``, each with its own per-tensor scale. The
    *hybrid* recipe is E4M3 forward, E5M2 backward; ``backward="fp8_e4m3"`` is E4M3 everywhere.
    ``scaling="current"`` takes each tensor's own amax (one extra pass over it); ``"delayed"`` the
    largest amax of the previous ``history_len`` casts of that operand (scale 1 before any), so a
    tensor that outgrows its history saturates at ±max. ``margin`` adds ``2^margin`` of headroom."""

    forward: str = "fp8_e4m3"
    backward: str = "fp8_e5m2"
    scaling: str = "delayed"
    history_len: int = 16
    margin: int = 0

    def __post_init__(self):
        for field_name in ("forward", "backward"):
            name = getattr(self, field_name)
            if name not in ("fp8_e4m3", "fp8_e5m2"):
                raise ValueError(f"{field_name}={name!r}: expected 'fp8_e4m3' or 'fp8_e5m2'")
        if self.scaling not in FP8_SCALINGS:
            raise ValueError(f"scaling={self.scaling!r}: expected one of {FP8_SCALINGS}")
        if not isinstance(self.history_len, int) or self.history_len <= 0:
            raise ValueError(f"history_len={self.history_len!r}: expected a positive integer")
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin={self.margin!r}: expected a non-negative integer")


def fp8_cast(x: torch.Tensor, scale: float, fmt: str | FloatFormat = "fp8_e4m3") -> torch.Tensor:
    """``x / scale`` stored in an FP8 format and read back, *unscaled* (fp32 values on the FP8 grid):
    the division in fp32, then PyTorch's cast to ``float8_e4m3fn``/``float8_e5m2`` after clamping to
    ±max, so overflow saturates (as Transformer Engine's casts do) in every torch version and format.
    The same values as ``decode(quantize(x, scale, fmt))``, from torch's cast instead of labkit's."""
    fmt = get_format(fmt)
    if fmt.name not in ("fp8_e4m3", "fp8_e5m2"):
        raise ValueError(f"fmt={fmt.name!r}: expected 'fp8_e4m3' or 'fp8_e5m2'")
    if not scale > 0 or not math.isfinite(scale):
        raise ValueError(f"scale={scale}: expected a positive finite number")
    return (x.detach().float() / _fp32(scale)).clamp(-fmt.max, fmt.max).to(fmt.torch_dtype).float()


class Fp8TensorScaling:
    """The per-tensor scale of one GEMM operand (an FP8 layer has three: input, weight, gradient),
    with a record of what each training step's cast did: ``counts[i] = (nonzero, flushed,
    saturated)``, the non-zero entries seen, how many of them became zero, and how many
    overflowed: |x / scale| beyond max by more than half of max's ulp, where rounding to nearest
    would have left max, so that the clamp changed the value."""

    def __init__(self, fmt: str, recipe: Fp8Recipe):
        self.fmt, self.recipe = get_format(fmt), recipe
        self.history = DelayedScaling(recipe.history_len, fmt, recipe.margin) if recipe.scaling == "delayed" else None
        self.counts: list[tuple[int, int, int]] = []
        self._overflow = self.fmt.max + ulp(self.fmt.max, self.fmt).item() / 2

    def cast(self, x: torch.Tensor, record: bool = True) -> tuple[torch.Tensor, float]:
        """``(fp8_cast(x, scale), scale)`` with this step's scale. With ``record`` (training steps),
        the delayed recipe then adds ``x``'s amax to its history and the counts are updated; an
        evaluation pass casts with the same scales but leaves both alone."""
        x = x.detach()
        amax = x.abs().amax().item() if x.numel() else 0.0
        amax = amax if math.isfinite(amax) else finite_amax(x)  # inf/NaN must not poison the scale
        if self.history is not None:
            scale = self.history.scale
            if record:
                self.history.amax_history.append(amax)
        else:
            scale = amax / self.fmt.max * 2.0**self.recipe.margin if amax > 0 else 1.0
        values = fp8_cast(x, scale, self.fmt)
        if record:
            nonzero = x != 0
            counts = torch.stack([nonzero.sum(), ((values == 0) & nonzero).sum(), (x.float().abs() / _fp32(scale) > self._overflow).sum()])
            self.counts.append(tuple(counts.tolist()))
        return values, scale


class _Fp8LinearFunction(torch.autograd.Function):
    """``y = x W^T`` as an FP8 GEMM: both operands cast to FP8 with their per-tensor scales, multiplied
    exactly and accumulated in fp32, the product of the two scales applied to the fp32 result (what
    ``torch._scaled_mm`` does). Backward: the incoming gradient is cast with the ``backward`` format,
    then ``dX = dY W`` and ``dW = dY^T X`` reuse the FP8 copies of W and X saved by the forward."""

    @staticmethod
    def forward(ctx, x, weight, layer, record):
        device_type = x.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        with torch.autocast(device_type, enabled=False):  # the FP8 products must not be re-rounded to bf16
            xq, x_scale = layer.input_scaling.cast(x, record)
            wq, w_scale = layer.weight_scaling.cast(weight, record)
            y = (xq @ wq.T) * _fp32(x_scale * w_scale)
        ctx.save_for_backward(xq, wq)
        ctx.scales, ctx.layer, ctx.dtypes = (x_scale, w_scale), layer, (x.dtype, weight.dtype)
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx, grad_output):
        xq, wq = ctx.saved_tensors
        x_scale, w_scale = ctx.scales
        with torch.autocast(grad_output.device.type, enabled=False):
            gq, g_scale = ctx.layer.grad_scaling.cast(grad_output)
            grad_x = (gq @ wq) * _fp32(g_scale * w_scale)
            grad_w = (gq.reshape(-1, gq.shape[-1]).T @ xq.reshape(-1, xq.shape[-1])) * _fp32(g_scale * x_scale)
        return grad_x.to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), None, None


class Fp8Linear(torch.nn.Module):
    """A :class:`labkit.nn.Linear` whose GEMMs run in simulated FP8 (:class:`Fp8Recipe`): the casts
    are PyTorch's exact float8 casts, the arithmetic is fp32 (the CPU has no FP8 arithmetic), so the
    numbers are those of an FP8 GEMM that accumulates in fp32. It trains the wrapped layer's own
    ``weight`` parameter, so the state dict and the optimizer see the same tensor."""

    def __init__(self, linear: torch.nn.Module, recipe: Fp8Recipe):
        super().__init__()
        weight = getattr(linear, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2:
            raise TypeError(f"linear: expected a Linear layer with a 2-D weight, got {type(linear).__name__}")
        if not isinstance(recipe, Fp8Recipe):
            raise TypeError(f"recipe: expected an Fp8Recipe, got {type(recipe).__name__}")
        self.weight, self.recipe = weight, recipe
        self.d_out, self.d_in = weight.shape
        self.input_scaling = Fp8TensorScaling(recipe.forward, recipe)
        self.weight_scaling = Fp8TensorScaling(recipe.forward, recipe)
        self.grad_scaling = Fp8TensorScaling(recipe.backward, recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.d_in:
            raise ValueError(f"x: last dim must be d_in={self.d_in}, got shape {tuple(x.shape)}")
        # A training step records amaxes and counts, an evaluation does not. Decided here: autograd runs a
        # Function's forward with gradients off, so inside it every pass would look like an evaluation.
        record = self.training and torch.is_grad_enabled()
        return _Fp8LinearFunction.apply(x, self.weight, self, record)

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, {self.recipe}"


def use_fp8(model: torch.nn.Module, recipe: Fp8Recipe, keep: Iterable[str] = ("lm_head",)) -> list[Fp8Linear]:
    """Replace every :class:`labkit.nn.Linear` of ``model`` (in place) by an :class:`Fp8Linear` with
    ``recipe``, except the modules named in ``keep``: the output head stays in higher precision, as
    in DeepSeek-V3 (§3.3.1) and NVIDIA's NVFP4 recipe (embeddings, norms and attention's own matmuls
    are not Linear layers and stay too). Returns the new layers, in module order."""
    from labkit.nn import Linear

    keep = set(keep)
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, Linear) and name not in keep]
    if not targets:
        raise ValueError("model: no Linear layer to convert (all kept, or none there)")
    layers = []
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        layer = Fp8Linear(module, recipe)
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        layers.append(layer)
    return layers


def train_fp8(recipe: Fp8Recipe | None, model: torch.nn.Module, train_data, val_data, config, **train_kwargs):
    """Train with :func:`labkit.train.train` under bf16 autocast, with the model's Linear layers in
    simulated FP8 (:func:`use_fp8` with ``recipe``; ``None`` trains the plain bf16 baseline). fp32
    master weights and optimizer states, as in every FP8 recipe. Returns ``(history, fp8_layers)``."""
    from labkit.train import train

    layers = use_fp8(model, recipe) if recipe is not None else []
    history = train(model, train_data, val_data, config, autocast_dtype=torch.bfloat16, **train_kwargs)
    return history, layers


def fp8_cast_counts(layers: Iterable[Fp8Linear], operand: str = "grad", steps: slice = slice(None)) -> dict:
    """What the casts of one operand (``"input"``, ``"weight"`` or ``"grad"``) did over all ``layers``
    in the training ``steps`` selected (a slice of step indices, 0 = the first step; all by default):
    the fractions of the non-zero entries ``flushed`` to zero and ``saturated`` at ±max."""
    if operand not in ("input", "weight", "grad"):
        raise ValueError(f"operand={operand!r}: expected 'input', 'weight' or 'grad'")
    if not isinstance(steps, slice):
        raise TypeError(f"steps: expected a slice of step indices, got {type(steps).__name__}")
    counts = [c for layer in layers for c in getattr(layer, f"{operand}_scaling").counts[steps]]
    nonzero = sum(c[0] for c in counts)
    return {"flushed": sum(c[1] for c in counts) / max(1, nonzero), "saturated": sum(c[2] for c in counts) / max(1, nonzero)}


# ----------------------------------------------------------------------------- helpers
def _parameters(optimizer_or_params) -> list[torch.Tensor]:
    if isinstance(optimizer_or_params, torch.optim.Optimizer):
        return [p for group in optimizer_or_params.param_groups for p in group["params"]]
    if isinstance(optimizer_or_params, torch.Tensor):
        return [optimizer_or_params]
    try:
        return list(optimizer_or_params)
    except TypeError:
        raise TypeError(f"optimizer_or_params: expected an optimizer or an iterable of parameters, got {type(optimizer_or_params).__name__}") from None


def _fp32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()


def _short(value: float | None) -> str:
    if value is None:
        return "none"
    return f"{value:.6g}"
