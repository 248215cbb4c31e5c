"""A grader in one process, the learner's code in another: how ``labkit.grade`` keeps a grade out of the
submission's reach.

In a chapter, ``labkit.checks.NAME(my_fn)`` runs in the notebook's kernel, next to the learner's code, and
its printed line is feedback. A submission could patch anything there (the grader, ``CheckFailed``,
``torch.allclose``), so ``labkit.grade`` does not trust that line. It runs the same grader in its own
process, the *grading process*, with a :class:`Remote` handle in place of ``my_fn``; the function itself
stays in the kernel, the *learner process*. Calling a handle

- sends the arguments (tensors with their strides and shared storages, arrays, modules, numbers) to the
  kernel, which calls the learner's function there (:func:`serve`);
- brings back the result in a form that cannot run code when it is read (:func:`encode`: tensors, numbers,
  strings and containers, loaded with ``torch.load(weights_only=True)``; any other object comes back as an
  inert stand-in of the same type name);
- writes back what the call changed in its arguments (tensor storages, a module's parameters, buffers, flags
  and plain attributes), so the grader's checks for in-place edits and aliasing see them;
- and, when an input requires grad, returns outputs whose backward asks the kernel for the gradients
  (:class:`_RemoteCall`), so gradient checks run as they do in the notebook.

Graders call handles exactly as they call functions; the few that need more than calls (a Triton kernel
launched by labkit's launcher, a class instantiated and probed) run a labkit *harness* in the kernel with
:func:`apply`. What the kernel returns is only ever data that the grader then checks itself: a submission
can return anything it likes, but whether that is right is decided where it cannot reach.

The transport is pluggable (:class:`Transport`): ``labkit.grade`` sends requests over the kernel's own
channel; the tests use a plain child process.
"""
from __future__ import annotations

import io
import os
import sys
import traceback
import uuid

import torch

MAX_RESPONSE_BYTES = 1 << 30   # a reply larger than this is not read (a submission could fill the disk)
MAX_DEPTH = 32                  # nesting of containers in a reply
MAX_ITEMS = 1_000_000           # items of one container in a reply


class RemoteFailure(BaseException):
    """The learner process could not answer (it died, timed out, or sent something unreadable). A
    BaseException, so that a grader's ``except Exception`` does not take it for a wrong answer."""


class RemoteError(Exception):
    """An exception the learner's code raised in the learner process; :func:`_exception` gives it the
    original's type name."""

    remote_traceback = ""


class Opaque:
    """An object the learner's code returned that is not data (a function, a module, a custom class):
    it comes back as an inert stand-in whose type has the original's name, and whose repr is the original's."""

    def __init__(self, text: str):
        self._text = text

    def __repr__(self) -> str:
        return self._text


_opaque_types: dict[str, type] = {}
_error_types: dict[str, type] = {}


def _named(cache: dict, name: str, base: type) -> type:
    name = name if name.isidentifier() else "object"
    if name not in cache:
        cache[name] = type(name, (base,), {"__module__": "labkit.checks._remote"})
    return cache[name]


def _exception(kind: str, message: str, remote_traceback: str, not_implemented: bool) -> Exception:
    from labkit.checks._errors import CheckFailed

    if not_implemented:
        error = NotImplementedError(message)
    elif kind in ("CheckFailed", "DelegationRefused"):  # a harness's verdict on the learner's code, or the refusal
        error = CheckFailed(message)
    elif kind in ("ValueError", "TypeError", "RuntimeError", "IndexError", "KeyError", "AttributeError",
                  "ZeroDivisionError", "AssertionError", "NameError", "OverflowError"):
        error = getattr(__import__("builtins"), kind)(message)
    else:
        error = _named(_error_types, kind, RemoteError)(message)
    error.remote_traceback = remote_traceback
    return error


# ----------------------------------------------------------------------------- the wire format
def encode(value, _depth: int = 0):
    """``value`` as a tree that ``torch.load(weights_only=True)`` reads back without running code: tensors
    (detached: storages shared between them stay shared), None, bools, ints, floats, strings, lists, and
    dicts tagged with ``"@"`` for tuples, dicts, arrays, dtypes, devices and inert stand-ins."""
    import numpy as np

    if _depth > MAX_DEPTH:
        return {"@": "opaque", "type": type(value).__name__, "repr": "<nested too deeply>"}
    if value is None or isinstance(value, (bool, str)) or type(value) in (int, float):
        return value
    if isinstance(value, torch.Tensor):
        return {"@": "tensor", "data": value.detach(), "requires_grad": bool(value.requires_grad),
                "parameter": isinstance(value, torch.nn.Parameter)}
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return {"@": "ndarray", "data": torch.from_numpy(np.ascontiguousarray(value)).clone(), "shape": list(value.shape)}
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return {"@": "npscalar", "dtype": str(value.dtype), "value": value.item()}
    if isinstance(value, (int, float)):  # bool/int/float subclasses (an IntEnum, numpy's bool_ is not one)
        return {"@": "number", "type": type(value).__name__, "value": int(value) if isinstance(value, int) else float(value)}
    if isinstance(value, complex):
        return {"@": "complex", "real": value.real, "imag": value.imag}
    if isinstance(value, torch.dtype):
        return {"@": "dtype", "name": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"@": "device", "name": str(value)}
    if isinstance(value, torch.Size):
        return {"@": "size", "items": [int(v) for v in value]}
    if isinstance(value, (list, tuple)) and len(value) <= MAX_ITEMS:
        items = [encode(v, _depth + 1) for v in value]
        return items if type(value) is list else {"@": "tuple", "items": items, "type": type(value).__name__}
    if isinstance(value, dict) and len(value) <= MAX_ITEMS:
        return {"@": "dict", "keys": [encode(k, _depth + 1) for k in value], "values": [encode(v, _depth + 1) for v in value.values()]}
    try:
        text = repr(value)[:300]
    except Exception:  # noqa: BLE001  (a learner's __repr__ may raise anything)
        text = f"<{type(value).__name__} object>"
    return {"@": "opaque", "type": type(value).__name__, "repr": text}


def decode(tree):
    """The value :func:`encode` made ``tree`` from (stand-ins for what was not data)."""
    if not isinstance(tree, (dict, list)):
        return tree
    if isinstance(tree, list):
        return [decode(v) for v in tree]
    kind = tree.get("@")
    if kind == "tensor":
        data = tree["data"]
        if tree.get("parameter"):
            return torch.nn.Parameter(data, requires_grad=bool(tree["requires_grad"]))
        if tree["requires_grad"] and (data.is_floating_point() or data.is_complex()):
            data.requires_grad_(True)
        return data
    if kind == "ndarray":
        return tree["data"].numpy().reshape(tree["shape"])
    if kind == "npscalar":
        import numpy as np

        return np.dtype(tree["dtype"]).type(tree["value"])
    if kind == "number":
        return tree["value"]
    if kind == "complex":
        return complex(tree["real"], tree["imag"])
    if kind == "dtype":
        return getattr(torch, str(tree["name"]))
    if kind == "device":
        return torch.device(tree["name"])
    if kind == "size":
        return torch.Size(tree["items"])
    if kind == "tuple":
        return tuple(decode(v) for v in tree["items"])
    if kind == "dict":
        return {_hashable(decode(k)): decode(v) for k, v in zip(tree["keys"], tree["values"])}
    if kind == "opaque":
        return _named(_opaque_types, str(tree.get("type", "object")), Opaque)(str(tree.get("repr", "")))
    raise RemoteFailure(f"an unreadable reply (a dict tagged {kind!r})")


def _hashable(key):
    return key if getattr(type(key), "__hash__", None) is not None else repr(key)


def read_reply(data: bytes):
    if len(data) > MAX_RESPONSE_BYTES:
        raise RemoteFailure(f"a reply of {len(data)} bytes (more than {MAX_RESPONSE_BYTES})")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu" if not torch.cuda.is_available() else None, weights_only=True)
    except Exception as err:  # noqa: BLE001  (whatever the learner process wrote, it is not a reply)
        raise RemoteFailure(f"an unreadable reply ({type(err).__name__}: {str(err)[:200]})") from None


# ----------------------------------------------------------------------------- what the call changed in its arguments
def module_state(module: torch.nn.Module, ids: dict | None = None) -> dict:
    """Per submodule: training flag, plain attributes, parameters (and whether each is still the object
    it was when ``ids`` were taken) and buffers; encoded."""
    state = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        attrs = {k: v for k, v in vars(sub).items()
                 if not k.startswith("_") and (v is None or isinstance(v, (bool, int, float, str)))}
        params = {}
        for name, p in sub._parameters.items():
            key = f"{path}.{name}" if path else name
            params[name] = {"value": encode(p), "same": ids is None or ids.get(key) == id(p)}
        state[path] = {"training": sub.training, "attrs": attrs, "params": params,
                       "buffers": {name: encode(b) for name, b in sub._buffers.items()}}
    return state


def parameter_ids(module: torch.nn.Module) -> dict:
    return {name: id(p) for name, p in module.named_parameters(remove_duplicate=False)}


def _write_tensor(target: torch.Tensor, source: torch.Tensor) -> None:
    """Make ``target`` hold what ``source`` holds after the call: its whole storage (a write past a view's
    elements shows), or its shape and values if the call replaced them."""
    if target.device.type == "meta" or source.device.type == "meta":
        return
    source = source.to(target.device)
    with torch.no_grad():
        same_layout = (target.shape == source.shape and target.stride() == source.stride() and target.dtype == source.dtype
                       and target.storage_offset() == source.storage_offset()
                       and target.untyped_storage().nbytes() == source.untyped_storage().nbytes())
        if same_layout:
            target.untyped_storage().copy_(source.untyped_storage())
        elif target.is_leaf and not target.requires_grad:
            target.set_(source.untyped_storage(), source.storage_offset(), source.shape, source.stride())


def apply_module_state(module: torch.nn.Module, state: dict) -> None:
    """Write ``state`` (from :func:`module_state` in the learner process) into ``module``, the grader's copy."""
    subs = dict(module.named_modules(remove_duplicate=False))
    for path, sub_state in state.items():
        sub = subs.get(path)
        if sub is None:
            continue
        sub.training = bool(sub_state["training"])
        for key, value in sub_state["attrs"].items():
            if key not in sub._parameters and key not in sub._buffers and key not in sub._modules:
                object.__setattr__(sub, key, value)
        for name, entry in sub_state["params"].items():
            value = decode(entry["value"])
            old = sub._parameters.get(name)
            if value is None or old is None or not entry["same"] or not isinstance(value, torch.nn.Parameter):
                sub._parameters.pop(name, None)
                if isinstance(value, torch.nn.Parameter) or value is None:
                    sub._parameters[name] = value
                else:
                    object.__setattr__(sub, name, value)  # the call put a plain tensor where the parameter was
                continue
            _write_tensor(old, value.data)
            old.requires_grad_(value.requires_grad)
        for name, value in sub_state["buffers"].items():
            value, old = decode(value), sub._buffers.get(name)
            if old is not None and isinstance(value, torch.Tensor):
                _write_tensor(old, value)
            else:
                sub._buffers[name] = value


# ----------------------------------------------------------------------------- the grading side
class Transport:
    """Sends one request (bytes) to the learner process and returns its reply (bytes); raises
    :class:`RemoteFailure` when it cannot. ``labkit.grade`` has one over the kernel's channel."""

    def exchange(self, request: bytes) -> bytes:  # pragma: no cover - interface
        raise NotImplementedError


class Remote:
    """A handle to an object in the learner process, named by the expression that reaches it there
    (``my_get_batch``, ``my_ddp.BucketedDDP``). Calling it calls the object there (see the module docstring);
    :meth:`describe` tells what it is (kind, names, file, base classes)."""

    def __init__(self, transport: Transport, expression: str, exercise: str = ""):
        self._transport, self._expression, self._exercise = transport, expression, exercise
        self._description = None

    def __repr__(self) -> str:
        return self._expression

    def describe(self) -> dict:
        if self._description is None:
            self._description = _request(self._transport, {"op": "describe", "target": self._expression})
        return self._description

    def __getattr__(self, name: str):
        # graders name the learner's function in their messages (a class body cannot define these two)
        if name in ("__name__", "__qualname__"):
            return self.describe().get(name.strip("_")) or self._expression
        raise AttributeError(name)

    def __call__(self, *args, **kwargs):
        return apply(None, self, *args, **kwargs)

    def release(self) -> None:
        """Let the learner process drop the autograd graphs it keeps for this handle's calls."""
        _request(self._transport, {"op": "release"})


def remote_handles(value) -> list[Remote]:
    if isinstance(value, Remote):
        return [value]
    if isinstance(value, (list, tuple)):
        return [h for v in value for h in remote_handles(v)]
    if isinstance(value, dict):
        return [h for v in value.values() for h in remote_handles(v)]
    return []


def apply(harness, *args, **kwargs):
    """``harness(*args, **kwargs)``, run where the learner's objects are: in the learner process if any
    argument is a :class:`Remote` (each replaced there by the object it names), here otherwise. ``harness``
    is labkit code (a function importable by name), or None to call the first argument itself."""
    handles = remote_handles((args, kwargs))
    if not handles:
        return (args[0](*args[1:], **kwargs) if harness is None else harness(*args, **kwargs))
    transport = handles[0]._transport
    exercise = next((h._exercise for h in handles if h._exercise), "")
    refs: list = []

    def strip(value):
        """The arguments with every tensor, array and module replaced by a reference into ``refs``."""
        import numpy as np

        if isinstance(value, Remote):
            return {"@handle": value._expression}
        if isinstance(value, (torch.Tensor, np.ndarray, torch.nn.Module)):
            refs.append(value)
            return {"@ref": len(refs) - 1}
        if isinstance(value, (list, tuple)):
            items = [strip(v) for v in value]
            return items if type(value) is list else {"@tuple": items}
        if isinstance(value, dict):
            return {"@dict": [(k, strip(v)) for k, v in value.items()]}
        return value

    skeleton = strip((list(args), kwargs))
    grad_inputs = [r for r in refs if isinstance(r, torch.Tensor) and r.requires_grad]
    # a module's trainable parameters are inputs too: a loss computed from a model sends gradients back to them
    module_params = [[n for n, p in r.named_parameters() if p.requires_grad] if isinstance(r, torch.nn.Module) else []
                     for r in refs]
    grad_inputs += [dict(r.named_parameters())[n] for r, names in zip(refs, module_params) for n in names]
    request = {"op": "call", "harness": harness, "args": skeleton, "exercise": exercise,
               "refs": [r.detach() if isinstance(r, torch.Tensor) else r for r in refs],
               "requires_grad": [bool(isinstance(r, torch.Tensor) and r.requires_grad) for r in refs],
               "module_params": module_params, "call": uuid.uuid4().hex}
    if grad_inputs:
        box = {}
        outputs = _RemoteCall.apply(transport, request, box, *grad_inputs)
        reply = box["reply"]
        tensors = iter(outputs)
        result = _rebuild(reply["result"], lambda: next(tensors))
        _write_back(refs, reply["after"], skip_grad=True)
        return result
    reply = _request(transport, request)
    aliases = _write_back(refs, reply["after"])
    return _rebuild(reply["result"], None, aliases)


def _request(transport: Transport, request: dict):
    buffer = io.BytesIO()
    torch.save(request, buffer)
    reply = read_reply(transport.exchange(buffer.getvalue()))
    if not isinstance(reply, dict) or "status" not in reply:
        raise RemoteFailure("an unreadable reply (no status)")
    if reply["status"] == "error":
        raise _exception(str(reply.get("type", "Exception")), str(reply.get("message", "")),
                         str(reply.get("traceback", "")), bool(reply.get("not_implemented")))
    if reply["status"] != "ok":
        raise RemoteFailure(f"an unreadable reply (status {reply['status']!r})")
    return reply.get("value")


def _write_back(refs: list, after: list, skip_grad: bool = False) -> dict:
    """Write what the call left in its arguments into the grader's objects; returns, per storage address in
    the reply, the grader's tensor that holds it (so that a result that aliases an input aliases it here too)."""
    import numpy as np

    aliases = {}
    for ref, changed in zip(refs, after):
        if isinstance(ref, torch.nn.Module):
            apply_module_state(ref, changed)
        elif isinstance(ref, np.ndarray):
            value = decode(changed)
            if ref.flags.writeable and isinstance(value, np.ndarray) and value.shape == ref.shape:
                np.copyto(ref, value, casting="unsafe")
        elif isinstance(ref, torch.Tensor) and isinstance(changed, dict) and isinstance(changed.get("data"), torch.Tensor):
            data = changed["data"]
            if data.device.type != "meta":
                aliases[data.untyped_storage().data_ptr()] = ref
            if not (skip_grad and ref.requires_grad):
                _write_tensor(ref, data)
    return aliases


def _rebuild(tree, next_tensor, aliases: dict | None = None):
    """Decode a reply's result; tensors come from ``next_tensor`` (the autograd path) or alias the grader's
    input when they aliased the learner process's copy of it."""
    if isinstance(tree, list):
        return [_rebuild(v, next_tensor, aliases) for v in tree]
    if isinstance(tree, dict) and tree.get("@") == "tensor":
        if next_tensor is not None:
            return next_tensor()
        data = tree["data"]
        owner = aliases.get(data.untyped_storage().data_ptr()) if aliases and data.device.type != "meta" else None
        if owner is not None:
            view = torch.empty(0, dtype=data.dtype, device=owner.device)
            view.set_(owner.untyped_storage(), data.storage_offset(), data.shape, data.stride())
            return view
        return decode(tree)
    if isinstance(tree, dict) and tree.get("@") in ("tuple", "dict"):
        if tree["@"] == "tuple":
            return tuple(_rebuild(v, next_tensor, aliases) for v in tree["items"])
        return {_hashable(decode(k)): _rebuild(v, next_tensor, aliases) for k, v in zip(tree["keys"], tree["values"])}
    return decode(tree)


def _result_tensors(tree) -> list[dict]:
    if isinstance(tree, list):
        return [t for v in tree for t in _result_tensors(v)]
    if isinstance(tree, dict):
        if tree.get("@") == "tensor":
            return [tree]
        if tree.get("@") == "tuple":
            return _result_tensors(tree["items"])
        if tree.get("@") == "dict":
            return _result_tensors(tree["values"])
    return []


class _RemoteCall(torch.autograd.Function):
    """A call in the learner process as one autograd node here: forward brings the outputs back, backward
    sends the output gradients there and brings back the inputs' gradients."""

    @staticmethod
    def forward(ctx, transport, request, box, *grad_inputs):
        reply = _request(transport, request)
        box["reply"] = reply
        entries = _result_tensors(reply["result"])
        outputs = [e["data"].clone() for e in entries]
        ctx.transport, ctx.call = transport, request["call"]
        ctx.differentiable = [bool(e["requires_grad"]) for e in entries]
        ctx.num_inputs = len(grad_inputs)
        ctx.input_meta = [(t.shape, t.dtype, t.device) for t in grad_inputs]
        ctx.mark_non_differentiable(*(o for o, d in zip(outputs, ctx.differentiable) if not d or not o.is_floating_point()))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        grads = [g if d else None for g, d in zip(grad_outputs, ctx.differentiable)]
        got = _request(ctx.transport, {"op": "backward", "call": ctx.call, "grads": grads})
        got = [decode(g) for g in got]
        if len(got) != ctx.num_inputs:
            raise RemoteFailure("an unreadable reply (a gradient per input expected)")
        checked = []
        for g, (shape, dtype, device) in zip(got, ctx.input_meta):
            if g is not None and (not isinstance(g, torch.Tensor) or g.shape != shape):
                raise RemoteFailure("an unreadable reply (a gradient of the wrong shape)")
            checked.append(None if g is None else g.to(dtype=dtype, device=device))
        return (None, None, None, *checked)


# ----------------------------------------------------------------------------- the learner's side
_graphs: dict[str, tuple[list, list]] = {}   # call id -> (inputs that require grad, outputs that require grad)


def _namespace() -> dict:
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            return shell.user_ns
    except ImportError:
        pass
    return vars(sys.modules["__main__"])


def _resolve(expression: str, namespace: dict | None = None):
    """The object a dotted name reaches in the learner's namespace (the kernel's, unless one is given)."""
    head, *rest = expression.split(".")
    namespace = _namespace() if namespace is None else namespace
    if head not in namespace:
        raise NameError(f"name {head!r} is not defined (did the cell that defines it run without an error?)")
    value = namespace[head]
    for part in rest:
        value = getattr(value, part)
    return value


def _describe(obj) -> dict:
    import inspect

    try:
        from triton.runtime.jit import KernelInterface
        jit = isinstance(obj, KernelInterface)
    except ImportError:
        jit = False
    kind = "jit" if jit else "class" if isinstance(obj, type) else "function" if callable(obj) else "object"
    module = getattr(obj, "__module__", None)
    try:
        path = inspect.getfile(obj) if kind in ("class", "function") else None
    except (TypeError, OSError):
        path = None
    if kind == "class" and module in sys.modules and getattr(sys.modules[module], "__file__", None):
        path = sys.modules[module].__file__
    bases = [f"{c.__module__}.{c.__qualname__}" for c in obj.__mro__] if kind == "class" else []
    return {"kind": kind, "name": getattr(obj, "__name__", None), "qualname": getattr(obj, "__qualname__", None),
            "module": module, "file": path, "bases": bases, "type": type(obj).__name__}


def _fill(skeleton, refs: list, namespace: dict | None):
    if isinstance(skeleton, dict):
        if "@handle" in skeleton:
            return _resolve(skeleton["@handle"], namespace)
        if "@ref" in skeleton:
            return refs[skeleton["@ref"]]
        if "@tuple" in skeleton:
            return tuple(_fill(v, refs, namespace) for v in skeleton["@tuple"])
        if "@dict" in skeleton:
            return {k: _fill(v, refs, namespace) for k, v in skeleton["@dict"]}
    if isinstance(skeleton, list):
        return [_fill(v, refs, namespace) for v in skeleton]
    return skeleton


def _not_implemented(err: BaseException) -> bool:
    seen = err
    while seen is not None:
        if isinstance(seen, NotImplementedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return "NotImplementedError" in str(err)


def _call(request: dict, namespace: dict | None):
    from labkit.checks._refusal import refusing

    refs = request["refs"]
    for ref, grad in zip(refs, request["requires_grad"]):
        if grad:
            ref.requires_grad_(True)
    modules = [parameter_ids(r) if isinstance(r, torch.nn.Module) else None for r in refs]
    args, kwargs = _fill(request["args"], refs, namespace)
    harness = request["harness"]
    with refusing(request.get("exercise", "")), torch.enable_grad():  # as a direct call in a notebook would run
        result = args[0](*args[1:], **kwargs) if harness is None else harness(*args, **kwargs)
    encoded = encode(result)
    inputs = [r for r, g in zip(refs, request["requires_grad"]) if g]
    inputs += [dict(r.named_parameters())[n] for r, names in zip(refs, request.get("module_params", [])) for n in names]
    if inputs:
        outputs = [e["data"] for e in _result_tensors(encoded)]
        originals = _original_tensors(result)
        _graphs[request["call"]] = (inputs, [o if o.requires_grad else None for o in originals[: len(outputs)]])
    after = [module_state(r, ids) if isinstance(r, torch.nn.Module) else encode(r) for r, ids in zip(refs, modules)]
    return {"result": encoded, "after": after}


def _original_tensors(value) -> list:
    """The tensors of a result in the order :func:`encode` lists them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _original_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _original_tensors(v)]
    return []


def _backward(request: dict):
    inputs, outputs = _graphs[request["call"]]
    pairs = [(o, g) for o, g in zip(outputs, request["grads"]) if o is not None and g is not None]
    if not pairs:
        return [None] * len(inputs)
    with torch.enable_grad():
        grads = torch.autograd.grad([o for o, _ in pairs], inputs, [g.to(o.device) for o, g in pairs],
                                    allow_unused=True, retain_graph=True)
    return [encode(g) for g in grads]


def handle(request_bytes: bytes, namespace: dict | None = None) -> bytes:
    """One request from the grading process, answered (never raises: an exception is the reply); names are
    looked up in ``namespace`` (default: the kernel's)."""
    try:
        request = torch.load(io.BytesIO(request_bytes), weights_only=False)  # from the grader: trusted
        op = request["op"]
        if op == "call":
            value = _call(request, namespace)
        elif op == "backward":
            value = _backward(request)
        elif op == "describe":
            value = _describe(_resolve(request["target"], namespace))
        elif op == "release":
            _graphs.clear()
            value = None
        else:
            raise ValueError(f"unknown request {op!r}")
        reply = {"status": "ok", "value": value}
    except BaseException as err:  # noqa: BLE001  (the learner's code may raise anything, SystemExit too)
        reply = {"status": "error", "type": type(err).__name__, "message": str(err)[:2000],
                 "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__)[-6:])[-4000:],
                 "not_implemented": _not_implemented(err)}
    buffer = io.BytesIO()
    try:
        torch.save(reply, buffer)
    except Exception as err:  # noqa: BLE001  (a reply that cannot be saved)
        buffer = io.BytesIO()
        torch.save({"status": "error", "type": type(err).__name__, "message": f"the result could not be sent: {err}"[:2000],
                    "traceback": "", "not_implemented": False}, buffer)
    return buffer.getvalue()


def serve(request_path: str, reply_path: str) -> None:
    """Answer the request in ``request_path`` into ``reply_path`` (how ``labkit.grade`` calls into a kernel)."""
    with open(request_path, "rb") as f:
        data = f.read()
    reply = handle(data)
    temporary = f"{reply_path}.{os.getpid()}.part"
    with open(temporary, "wb") as f:
        f.write(reply)
    os.replace(temporary, reply_path)
