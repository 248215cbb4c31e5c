"""Where code runs: device choice, Triton's interpreter switch, seeding, per-device sizes.

Triton decides at ``@triton.jit`` time whether a kernel is compiled for the GPU or run by its
CPU interpreter, and it reads ``TRITON_INTERPRET`` for that. So the switch has to be made
before any kernel module is imported; :func:`configure_triton` does it and ``import labkit``
calls it first thing.
"""
from __future__ import annotations

import importlib.util
import os
import pickle
import platform
import random
import sys

import numpy as np
import torch

DEVICE_ENV = "LABKIT_DEVICE"

_device: torch.device | None = None


class DeviceUnavailableError(ValueError, RuntimeError):
    """The requested device does not exist on this machine.

    Both a ``ValueError`` (a bad argument, labkit's convention) and a ``RuntimeError`` (what
    PyTorch raises for ``torch.zeros(1, device="cuda:99")``, so course code written against
    PyTorch's behaviour, e.g. Stanford CS336's tests, catches it too)."""


class TritonImportOrderError(ImportError):
    """Triton was imported in compiled mode although there is no GPU to compile for."""


def _requested_device() -> str | None:
    value = os.environ.get(DEVICE_ENV, "").strip()
    return value or None


def triton_installed() -> bool:
    if "triton" in sys.modules:  # imported already (None marks an import that is blocked)
        return sys.modules["triton"] is not None
    return importlib.util.find_spec("triton") is not None


def needs_interpreter() -> bool:
    """True when Triton kernels must run on the CPU through the interpreter."""
    requested = _requested_device()
    if requested is not None:
        return torch.device(requested).type != "cuda"
    return not torch.cuda.is_available()


def configure_triton() -> None:
    """Turn on ``TRITON_INTERPRET=1`` when there is no GPU, before Triton is imported.

    Raises :class:`TritonImportOrderError` if Triton was already imported in compiled mode
    on a machine that needs the interpreter: its kernels would then fail with obscure errors.
    """
    if not needs_interpreter():
        return
    if sys.modules.get("triton") is not None and os.environ.get("TRITON_INTERPRET") != "1":
        raise TritonImportOrderError(
            "triton was imported before labkit on a machine without a usable GPU, so its kernels "
            "were set up for compilation instead of Triton's CPU interpreter. Restart the kernel "
            "(or Python) and run `import labkit` before anything that imports triton, or set the "
            "environment variable TRITON_INTERPRET=1 before starting Python."
        )
    os.environ["TRITON_INTERPRET"] = "1"


def triton_mode() -> str:
    """'compiled', 'interpreter', or 'unavailable' (no triton package on this platform)."""
    if not triton_installed():
        return "unavailable"
    return "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled"


def get_device(device: str | torch.device | None = None) -> torch.device:
    """Resolve ``device`` (or ``LABKIT_DEVICE``, else cuda when available, else cpu) and check it exists."""
    chosen = device if device is not None else _requested_device()
    if chosen is None:
        chosen = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(chosen)
    check_device(dev)
    return dev


def check_device(device: str | torch.device) -> torch.device:
    """Raise :class:`DeviceUnavailableError` for a device this machine does not have (e.g. ``cuda:99``)
    and ``ValueError`` for a device type labkit does not run on."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(f"device={str(dev)!r}: CUDA is not available on this machine; use 'cpu'")
        index = dev.index if dev.index is not None else 0
        if index >= torch.cuda.device_count():
            raise DeviceUnavailableError(
                f"device={str(dev)!r}: only {torch.cuda.device_count()} CUDA device(s) exist"
            )
    elif dev.type not in ("cpu", "mps", "meta"):
        raise ValueError(f"device={str(dev)!r}: expected 'cpu', 'cuda' or 'cuda:N'")
    return dev


def device() -> torch.device:
    """The device chosen by :func:`setup` (chosen on first use if setup was not called)."""
    global _device
    if _device is None:
        _device = get_device()
    return _device


SEED_ENV = "LABKIT_SEED"


def run_seed(seed: int = 0) -> int:
    """``seed`` shifted by the ``LABKIT_SEED`` environment variable (an integer, default 0). Every seed a
    chapter's training runs draw (through :func:`seed_everything` and the topic modules) goes through it,
    so ``make spread`` can rerun a chapter's training claims with other seeds; unset, nothing changes."""
    text = os.environ.get(SEED_ENV, "").strip()
    try:
        return seed + int(text or 0)
    except ValueError:
        raise ValueError(f"{SEED_ENV}={text!r}: expected an integer (a shift of every seed), or unset") from None


def seed_everything(seed: int = 0) -> None:
    seed = run_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def environment_line(dev: torch.device | None = None) -> str:
    dev = dev if dev is not None else device()
    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    if triton_installed():
        import triton

        parts.append(f"triton {triton.__version__} ({triton_mode()})")
    else:
        parts.append("triton not installed (kernels fall back to the PyTorch reference)")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{os.cpu_count()} CPU cores"
    parts.append(f"device {dev} [{name}]")
    return " | ".join(parts)


THREADS_ENV = "OMP_NUM_THREADS"


def _small_model_step(threads: int, steps: int) -> float:
    """Seconds per training step of a small MLP (the size of the chapters' CPU models) with ``threads``."""
    import time

    previous = torch.get_num_threads()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=generator)
    w1 = torch.randn(128, 512, generator=generator, requires_grad=True)
    w2 = torch.randn(512, 128, generator=generator, requires_grad=True)
    try:
        torch.set_num_threads(threads)
        best = float("inf")
        for _ in range(3):  # the best of three bursts: another program's load only ever slows one down
            start = time.perf_counter()
            for _ in range(steps):
                loss = torch.nn.functional.gelu(x @ w1).matmul(w2).square().mean()
                loss.backward()
            best = min(best, (time.perf_counter() - start) / steps)
        return best
    finally:
        torch.set_num_threads(previous)


def choose_threads(candidates=None, steps: int = 20) -> tuple[int, dict[int, float]]:
    """The CPU thread count that runs a small model's training step fastest here, and the seconds per step
    measured for each candidate (default: 1 and every power of two up to the cores torch would use).

    At the chapters' sizes a step takes well under a millisecond, and handing its matmuls to several threads
    can cost more in synchronisation than it gains. A larger count is chosen only when it is at least 10%
    faster, because fewer threads also leave cores to the learner's browser and other programs."""
    if candidates is None:
        most = max(1, torch.get_num_threads())
        candidates = sorted({1, most} | {2 ** k for k in range(1, most.bit_length()) if 2 ** k < most})
    candidates = list(candidates)
    if not candidates or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in candidates):
        raise ValueError(f"candidates={candidates!r}: expected positive integer thread counts")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: expected a positive integer")
    _small_model_step(candidates[0], 2)  # warm-up: allocator, thread pool
    seconds = {n: _small_model_step(n, steps) for n in candidates}
    chosen = candidates[0]
    for n in candidates[1:]:
        if seconds[n] < 0.9 * seconds[chosen]:
            chosen = n
    return chosen, seconds


def _set_threads(threads) -> str:
    """Apply setup's ``threads`` argument; returns how the count was chosen, for the environment line."""
    if threads is None:
        if os.environ.get(THREADS_ENV, "").strip():
            return f"{torch.get_num_threads()} CPU thread(s), as {THREADS_ENV} says"
        if torch.get_num_threads() == 1:
            return "1 CPU thread"
        chosen, seconds = choose_threads()
        torch.set_num_threads(chosen)
        measured = ", ".join(f"{n}: {t * 1e3:.2f} ms" for n, t in seconds.items())
        return f"{chosen} CPU thread(s), measured on a small model's step ({measured})"
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads={threads!r}: expected a positive integer, or None to measure")
    torch.set_num_threads(threads)
    return f"{threads} CPU thread(s), as asked"


def setup(seed: int = 0, device: str | torch.device | None = None, threads: int | None = None) -> torch.device:
    """Seed python/numpy/torch, choose the device, print one environment line, return the device.

    On the CPU it also chooses the number of threads torch uses: ``threads`` if given, what
    ``OMP_NUM_THREADS`` says if it is set, otherwise the count that runs a small model's step fastest
    here (:func:`choose_threads`; torch's default of one thread per core is slower at the chapters' sizes
    on many laptops). The line says which count it chose and why."""
    global _device
    seed_everything(seed)
    _device = get_device(device)
    line = environment_line(_device)
    if _device.type == "cpu":
        line += " | " + _set_threads(threads)
    elif threads is not None:
        line += " | " + _set_threads(threads)
    print(line)
    return _device


def on_gpu() -> bool:
    return device().type == "cuda"


def pick(cpu, gpu):
    """The value for the current device: small sizes on a laptop CPU, large ones on a GPU."""
    return gpu if on_gpu() else cpu


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS reports one, as in a container)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def _start_worker(owner: int) -> None:
    """A RunPool worker's set-up. One thread. Ctrl-C ignored: Jupyter's Interrupt signals the kernel's
    whole process group, workers included, and is meant for the kernel (its wait ends; the runs go on).
    And a watch on the process that made the pool (the notebook's kernel): a worker blocked on the
    pool's queue never notices that process die (the workers hold the queue's other end themselves),
    so a killed or restarted kernel would leave them running; the watch ends the worker, mid-job too."""
    import signal
    import threading

    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with, args=(owner,), name="labkit-runpool-owner-watch", daemon=True).start()


def _exit_with(owner: int) -> None:
    """End this process as soon as process ``owner`` has ended."""
    if os.name == "nt":
        import _winapi

        try:
            handle = _winapi.OpenProcess(0x00100000, False, owner)  # SYNCHRONIZE: a handle to wait on
            _winapi.WaitForSingleObject(handle, _winapi.INFINITE)
        finally:
            os._exit(1)
    if hasattr(os, "pidfd_open"):  # Linux: readable once the process has ended (zombie or not), whatever reuses its pid
        import select

        try:
            handle = os.pidfd_open(owner)
        except ProcessLookupError:
            os._exit(1)
        except OSError:  # a kernel without pidfds: ask as below
            pass
        else:
            select.select([handle], [], [])
            os._exit(1)
    import time

    while True:
        time.sleep(0.5)
        try:
            os.kill(owner, 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:  # it exists, under another user
            pass


def _call(payload: bytes) -> bytes:
    """Run a job from the snapshot :meth:`RunPool.submit` took, the way a worker runs it: on one thread, under the
    ``LABKIT_SEED`` it was submitted with, leaving the caller's torch random state as it was; its result pickled."""
    fn, args, kwargs, seed_shift = pickle.loads(payload)
    threads, shift_now = torch.get_num_threads(), os.environ.get(SEED_ENV)
    try:
        torch.set_num_threads(1)
        _set_env(SEED_ENV, seed_shift)
        with torch.random.fork_rng():
            return pickle.dumps(fn(*args, **kwargs))
    finally:
        torch.set_num_threads(threads)
        _set_env(SEED_ENV, shift_now)


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


class RunJob:
    """What :meth:`RunPool.submit` returns: ``result()`` waits for the job and returns what its function returned
    (a copy, made by pickling), or raises what it raised; ``done()`` says whether it has finished."""

    def __init__(self, pool: "RunPool", payload: bytes, future=None):
        self._pool, self._payload, self._future, self._outcome = pool, payload, future, None

    def done(self) -> bool:
        return self._outcome is not None or (self._future is not None and self._future.done())

    def result(self, timeout: float | None = None):
        import concurrent.futures

        if self._outcome is None:
            try:
                if self._future is not None:
                    raw = self._future.result(timeout)
                elif self._pool.closed:
                    raise concurrent.futures.CancelledError("the RunPool was shut down before this job ran")
                else:  # the pool runs its jobs in this process: now, once
                    raw = _call(self._payload)
                self._outcome = (True, pickle.loads(raw))
            except concurrent.futures.TimeoutError:
                raise
            except Exception as error:  # noqa: BLE001 - kept and raised to every caller, as a Future does
                self._outcome = (False, error)
        ok, value = self._outcome
        if not ok:
            raise value
        return value


class RunPool:
    """Independent CPU-bound jobs (a chapter's training runs) spread over worker processes, one per core.

    At the chapters' sizes one run cannot use a second core (:func:`choose_threads`: more threads are
    no faster), but two runs can use two: each worker process runs one job at a time on one thread, so
    ``workers`` jobs run at once (one per usable core, at most ``max_workers``). ``submit(fn, *args,
    **kwargs)`` takes a snapshot of the call (pickled: later changes to the arguments do not reach the
    job) and returns a :class:`RunJob` at once; ``job.result()`` waits for it. The results are the ones
    the same call gives in this process on one thread: each job runs on one thread, under the
    ``LABKIT_SEED`` of its submission, seeding itself (``fn`` must be importable, a labkit function,
    not one defined in the notebook).

    With one worker (one usable core, or ``workers=1``) or on a GPU, which runs one job fast and whose
    memory the jobs would have to share, no process is started: each job runs here, the same way (one
    thread, this process's torch random state left as it was), when its result is first asked for.
    ``preload``: the modules the jobs come from, imported once for all the workers (labkit always is;
    the fork server that imports them is shared by the kernel's pools, and the first pool's list is the
    one it keeps). ``shutdown()`` (or leaving a ``with`` block) ends the workers and cancels the jobs
    not started; the workers also end with the notebook's kernel."""

    def __init__(self, workers: int | None = None, device: str | torch.device | None = None, max_workers: int = 4,
                 preload=()):
        import importlib.util

        if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
            raise ValueError(f"workers={workers!r}: expected a positive integer, or None for one per usable core")
        if not isinstance(max_workers, int) or isinstance(max_workers, bool) or max_workers < 1:
            raise ValueError(f"max_workers={max_workers!r}: expected a positive integer")
        if isinstance(preload, str) or not isinstance(preload, (list, tuple)) or not all(isinstance(n, str) for n in preload):
            raise TypeError(f"preload={preload!r}: expected a list of module names, e.g. ['labkit.lora']")
        for name in preload:
            if importlib.util.find_spec(name) is None:
                raise ValueError(f"preload: no module named {name!r}")
        chosen = get_device(device) if device is not None else _device if _device is not None else get_device()
        on_cuda = chosen.type != "cpu"  # device=None: the one setup chose
        self.workers = 1 if on_cuda else (workers or min(usable_cores(), max_workers))
        self.closed, self._executor = False, None
        if self.workers > 1:
            self._start(["labkit", *preload])

    def _start(self, preload: list[str]) -> None:
        import concurrent.futures
        import multiprocessing

        # Not fork: a forked copy of a kernel that already runs threads can deadlock. A fork server,
        # started now, imports labkit and the modules in ``preload`` (with torch: seconds) once while
        # the notebook goes on, and forks the workers from itself on the first submit; without one
        # (Windows) each worker is spawned and imports them itself.
        if "forkserver" in multiprocessing.get_all_start_methods():
            from multiprocessing import forkserver

            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(list(dict.fromkeys(preload)))
            forkserver.ensure_running()
        else:
            context = multiprocessing.get_context("spawn")
        self._executor = concurrent.futures.ProcessPoolExecutor(
            self.workers, mp_context=context, initializer=_start_worker, initargs=(os.getpid(),))

    def submit(self, fn, /, *args, **kwargs) -> RunJob:
        if not callable(fn):
            raise TypeError(f"fn: expected a function, got {type(fn).__name__}")
        if getattr(fn, "__module__", None) == "__main__" or "<locals>" in getattr(fn, "__qualname__", ""):
            raise TypeError(f"fn: {getattr(fn, '__qualname__', fn)!r} is defined in the notebook (or inside a function): "
                            "a worker cannot import it; submit a function of a module, e.g. labkit.lora.finetune_run")
        if self.closed:
            raise RuntimeError("submit: this RunPool was shut down; make a new one")
        try:
            payload = pickle.dumps((fn, args, kwargs, os.environ.get(SEED_ENV)))
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            raise TypeError(f"fn, args: the call cannot be copied to a worker process ({error})") from None
        future = None if self._executor is None else self._executor.submit(_call, payload)
        return RunJob(self, payload, future)

    def shutdown(self) -> None:
        self.closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __repr__(self) -> str:
        where = f"{self.workers} worker processes, one thread each" if self.workers > 1 else "in this process"
        return f"RunPool({where}{', shut down' if self.closed else ''})"
