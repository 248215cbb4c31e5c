"""Graders refuse delegation: while a grader runs the learner's code, labkit's own implementation of the exercise
(and the built-ins it rules out) refuses callers outside labkit and torch."""
from __future__ import annotations

from labkit.checks._errors import CheckFailed

# ----------------------------------------------------------------------------- delegation refused
# Per exercise, labkit's own implementation of it, and the built-ins the exercise rules out: while a grader
# runs (and while the learner's code runs in the learner process under labkit.grade), calling one of these
# from outside labkit and torch raises DelegationRefused, and so does instantiating or subclassing such a
# class. The grader's own reference (labkit code) still runs. tests/test_checks_refusal.py checks that every
# grader with a labkit function of its name is listed.
DELEGATES: dict[str, tuple[str, ...]] = {
    "get_batch": ("labkit.data.get_batch",),
    "cross_entropy": ("labkit.train.cross_entropy", "torch.nn.functional.cross_entropy", "torch.nn.functional.nll_loss",
                      "torch.logsumexp", "torch.Tensor.logsumexp", "torch.special.logsumexp"),
    "adamw_step": ("labkit.train.AdamW", "torch.optim.AdamW", "torch.optim.Adam", "torch.optim.adamw.adamw",
                   "torch.optim.adam.adam", "torch.optim.adam._single_tensor_adam", "torch.optim.adam._multi_tensor_adam",
                   "torch.optim.adam._fused_adam", "torch._fused_adamw_", "torch._fused_adam_"),
    "amax_scale": ("labkit.precision.amax_scale",),
    "update_scale": ("labkit.precision.update_scale",),
    "e8m0_exponent": ("labkit.block_formats.e8m0_exponent", "labkit.block_formats.e8m0_scale", "torch.log2",
                      "torch.Tensor.log2", "torch.log", "torch.Tensor.log", "math.log2", "math.log"),
    "mx_quantize": ("labkit.block_formats.mx_quantize", "labkit.block_formats.quantize_blocks",
                    "labkit.block_formats.e8m0_scale", "labkit.block_formats.e8m0_exponent"),
    "rmsnorm": ("labkit.kernels.rmsnorm.rmsnorm", "torch.nn.functional.rms_norm"),
    "rmsnorm_backward_kernel": ("labkit.kernels.rmsnorm._rmsnorm_backward_kernel",),
    "softmax": ("labkit.nn.softmax", "labkit.kernels.softmax.softmax", "torch.softmax", "torch.Tensor.softmax",
                "torch.nn.functional.softmax", "torch.special.softmax"),
    "causal_mask": ("labkit.nn.causal_mask",),
    "kv_bytes_per_token": ("labkit.attention.kv_bytes_per_token",),
    "online_softmax_update": ("labkit.attention.online_softmax_update",),
    "flash_attention_torch": ("labkit.attention.flash_attention_torch", "torch.nn.functional.scaled_dot_product_attention"),
    "flash_attention_kernel": ("labkit.kernels.flash_attention._flash_attention_forward_kernel",),
    "top_k_routing": ("labkit.experts.top_k_gating", "labkit.experts.switch_gating"),
    "load_balancing_loss": ("labkit.experts.load_balancing_loss",),
    "dispatch_with_capacity": ("labkit.experts.dispatch", "labkit.experts.combine"),
    "sort_dispatch": ("labkit.experts.dispatch", "labkit.experts.combine", "labkit.experts.MoELayer"),
    "LoRALinear": ("labkit.lora.LoRALinear",),
    "lora_parameter_count": ("labkit.lora.lora_parameter_count",),
    "merge_lora": ("labkit.lora.merge_lora",),
    "unmerge_lora": ("labkit.lora.unmerge_lora",),
    "lora_targets": ("labkit.lora.apply_lora", "labkit.lora.target_modules"),
    "nearest_level": ("labkit.quant.nearest_level",),
    "pack_int4": ("labkit.quant.pack_int4",),
    "unpack_int4": ("labkit.quant.unpack_int4",),
    "quantize_symmetric": ("labkit.quant.quantize",),
    "quantize_asymmetric": ("labkit.quant.quantize",),
    "gptq_quantize": ("labkit.quant.gptq_quantize", "labkit.quant.quantize_model"),
    "adamw_mixed_precision_bytes": ("labkit.memory.adamw_mixed_precision_bytes",),
    "ring_allreduce_step": ("labkit.dist.ring_allreduce_step", "labkit.dist.ring_all_reduce"),
    "gradient_collective": ("labkit.dist.gradient_collective",),
    "bucketed_ddp": ("labkit.dist.DDPBucketed",),
    "zero1_optimizer": ("labkit.dist.ShardedOptimizer",),
    "bucket_plan": ("labkit.dist.bucket_plan", "labkit.dist.bucket_parameters", "labkit.dist._greedy_buckets",
                    "torch.distributed._compute_bucket_assignment_by_size"),
    "column_parallel_linear": ("labkit.parallel.ColumnParallelLinear", "labkit.parallel.copy_to_tensor_parallel",
                               "labkit.parallel.reduce_from_tensor_parallel"),
    "row_parallel_linear": ("labkit.parallel.RowParallelLinear", "labkit.parallel.copy_to_tensor_parallel",
                            "labkit.parallel.reduce_from_tensor_parallel"),
    "one_f_one_b_schedule": ("labkit.parallel.one_f_one_b_schedule",),
    "matmul_cost": ("labkit.hardware.matmul_cost",),
    "add_cost": ("labkit.hardware.add_cost",),
    "roofline_time": ("labkit.hardware.roofline_time",),
    "diagnose_step": ("labkit.hardware.diagnose_step",),
    "softmax_rows": ("labkit.hardware.softmax_rows", "torch.softmax", "torch.Tensor.softmax", "torch.nn.functional.softmax",
                     "torch.special.softmax"),
    "sequence_logprobs": ("labkit.preference.sequence_logprobs",),
    "bradley_terry_loss": ("labkit.preference.bradley_terry_loss",),
    "dpo_loss": ("labkit.preference.dpo_loss",),
    "grpo_advantages": ("labkit.preference.grpo_advantages",),
    "k3_kl": ("labkit.preference.kl_estimate", "labkit.preference.grpo_loss"),
    "speculative_accept": ("labkit.serving.speculative.speculative_accept",),
    "block_manager": ("labkit.serving.blocks.BlockManager",),
    "plan_step": ("labkit.serving.scheduler.plan_step",),
    # third-party names (test extras, not dependencies) are skipped where the package is missing; a class is
    # refused through its own Python __init__, so Hugging Face's Rust classes are refused method by method
    "bpe_merge_step": ("labkit.tokenizer.train_bpe", "labkit.tokenizer._merge", "tiktoken._educational.bpe_train",
                       "tokenizers.Tokenizer.train", "tokenizers.Tokenizer.train_from_iterator"),
    "bpe_encode": ("labkit.tokenizer.Tokenizer", "labkit.tokenizer.Tokenizer._bpe", "labkit.tokenizer.Tokenizer.encode",
                   "tiktoken.Encoding", "tiktoken._educational.bpe_encode", "tiktoken._educational.SimpleBytePairEncoding",
                   "tokenizers.Tokenizer.encode", "tokenizers.Tokenizer.encode_batch", "tokenizers.models.Model.tokenize"),
    "minhash_signature": ("labkit.datapipe.minhash_signature", "labkit.datapipe.minhash_signatures",
                          "labkit.datapipe._universal_hash", "datasketch.MinHash"),
}


class DelegationRefused(CheckFailed):
    """The learner's answer called (or subclassed) labkit's implementation of the exercise, or a built-in
    the exercise rules out."""


def _resolve_dotted(name: str):
    import importlib

    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:-1]:
            owner = getattr(owner, part)
        return owner, parts[-1], getattr(owner, parts[-1])
    raise ImportError(name)


def _refusal_message(exercise: str, name: str) -> str:
    own = name.startswith("labkit.")
    what = f"`{name}` is labkit's answer to this exercise" if own else f"`{name}` does the exercise for you"
    return (f"\n  tried:    grading {exercise}: your code called {name}\n  got:      a call to {name}\n"
            f"  expected: your own {exercise}, written from the exercise's contract\n"
            f"  hint:     write it yourself: {what}, so an answer that calls (or subclasses) it is not graded")


_refusals: dict[int, tuple] = {}   # key -> (the original callable, message); keys live while a refusal is on


def _delegate(key: int, args: tuple, kwargs: dict):
    """Called instead of a refused function: callers inside labkit and torch get the original, others an error."""
    import sys

    original, message = _refusals[key]
    caller = sys._getframe(2).f_globals.get("__name__", "")
    if caller == "labkit" or caller.startswith(("labkit.", "torch", "triton")) and not caller.startswith("labkit.checks._remote"):
        return original(*args, **kwargs)
    raise DelegationRefused(message)


def _refusing_code(function, key: int):
    """A code object with ``function``'s number of free variables that hands its call to :func:`_delegate`."""
    free = function.__code__.co_freevars
    lines = ["def _outer():", *(f"    {v} = None" for v in free), "    def _refused(*args, **kwargs):",
             *([f"        ({', '.join(free)},)"] if free else []),
             f"        return __import__('labkit.checks._refusal', fromlist=['_'])._delegate({key}, args, kwargs)",
             "    return _refused"]
    namespace: dict = {}
    exec("\n".join(lines), namespace)  # noqa: S102  (builds a code object; runs nothing of the learner's)
    return namespace["_outer"]().__code__



def _is_refused(obj, exercise: str) -> str | None:
    """The delegate of ``exercise`` that ``obj`` is (labkit's function handed in as the answer)."""
    for name in DELEGATES.get(exercise, ()):
        try:
            _, _, target = _resolve_dotted(name)
        except (ImportError, AttributeError):
            continue
        if obj is target:
            return name
    return None


def _subclass_of_refused(obj, exercise: str) -> str | None:
    """The refused class that ``obj`` (a class) is, or derives from."""
    if not isinstance(obj, type):
        return None
    for name in DELEGATES.get(exercise, ()):
        try:
            _, _, target = _resolve_dotted(name)
        except (ImportError, AttributeError):
            continue
        if isinstance(target, type) and issubclass(obj, target):
            return name
    return None


class refusing:
    """While active: for ``exercise``, every entry of :data:`DELEGATES` refuses callers outside labkit and
    torch (see :func:`_delegate`). A function's code is swapped, so a reference the learner took earlier
    refuses too; a built-in or a method is replaced on its module or class; a class refuses instantiation
    (its ``__init__`` is swapped)."""

    def __init__(self, exercise: str):
        self.exercise, self.undo = exercise, []

    def __enter__(self):
        import types

        for name in DELEGATES.get(self.exercise, ()):
            try:
                owner, attr, target = _resolve_dotted(name)
            except (ImportError, AttributeError):
                continue
            key = id(self) ^ hash(name)
            message = _refusal_message(self.exercise, name)
            if isinstance(target, type):
                # A class refuses through its own __init__ (its code is swapped like a function's): assigning
                # and deleting __new__ instead would leave CPython's tp_new slot stale, so that after the
                # grader every LoRALinear(...) with arguments raised "object.__new__() takes exactly one argument".
                target = vars(target).get("__init__")
                if not isinstance(target, types.FunctionType):
                    raise TypeError(f"{name}: a refused class must define its own __init__")
            if isinstance(target, types.FunctionType):
                code = target.__code__
                copy = types.FunctionType(code, target.__globals__, target.__name__, target.__defaults__, target.__closure__)
                copy.__kwdefaults__ = target.__kwdefaults__
                _refusals[key] = (copy, message)
                target.__code__ = _refusing_code(target, key)
                self.undo.append(lambda target=target, code=code, key=key: (setattr(target, "__code__", code), _refusals.pop(key, None)))
            elif callable(target):
                _refusals[key] = (target, message)

                def refused(*args, _key=key, **kwargs):
                    return _delegate(_key, args, kwargs)

                setattr(owner, attr, refused)
                self.undo.append(lambda owner=owner, attr=attr, target=target, key=key:
                                 (setattr(owner, attr, target), _refusals.pop(key, None)))
        return self

    def __exit__(self, *exc):
        while self.undo:
            self.undo.pop()()
        return False
