"""Distributed training with ``torch.distributed``, run for real in local processes.

:func:`launch` starts ``world_size`` Python processes that form a process group (gloo on CPU,
NCCL on GPUs: the same code either way) and runs ``fn(rank, world_size, **kwargs)`` in each.
On top of the collectives this module builds, from scratch: a ring all-reduce out of
point-to-point sends (:func:`ring_all_reduce`), data parallelism that all-reduces gradients
one parameter at a time (:class:`DDPIndividual`) or in buckets (:func:`bucket_plan`,
:class:`DDPBucketed`), and
ZeRO-1, which shards optimizer state: the paper's version (:class:`ShardedOptimizer`:
reduce-scatter the gradients, step on this rank's shard, all-gather the parameters) and, for
comparison, a simpler one that needs DDP's all-reduce first and broadcasts each parameter from
the rank that owns it (:class:`ShardedOptimizerBroadcast`). :class:`CommMeter` counts the calls and
bytes each rank hands to ``torch.distributed`` (chapter 08 uses it too). The per-rank functions the notebook
runs live in :mod:`labkit.dist_demos` (a process can only be handed a function it can import,
never one defined in a notebook).
"""
from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

COLLECTIVES = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter")


class RankFailedError(RuntimeError):
    """A rank raised, crashed or did not finish within the launch timeout."""


class RankResults(dict):
    """``{rank: return value}``, plus ``.outputs``: ``{rank: what that rank printed}``."""

    def __init__(self, results: dict, outputs: dict):
        super().__init__(results)
        self.outputs = outputs


# ----------------------------------------------------------------------------- launching
def resolve_backend(backend: str, world_size: int) -> str:
    """'auto' means NCCL when every rank can have its own GPU, else gloo (CPU)."""
    if backend == "auto":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return "nccl" if gpus >= world_size and os.environ.get("LABKIT_DEVICE", "cuda").startswith("cuda") else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: expected 'auto', 'gloo' or 'nccl'")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size}, GPUs={torch.cuda.device_count()}")
    return backend


def rank_device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL (``LOCAL_RANK``, the rank
    within its machine), the CPU under gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", _local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))


# What torchrun (torch.distributed.run) tells each rank; launch() sets the same for its ranks.
RANK_ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def init_from_environment(backend: str = "auto", timeout: float = 600) -> tuple[int, int]:
    """Join the process group described by the environment torchrun sets (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``) and return ``(rank,
    world_size)``. Every rank of :func:`launch` and of ``python -m labkit.distrun`` under torchrun
    starts here: one code path. ``backend="auto"``: NCCL when this machine has a GPU for the rank
    (and ``LABKIT_DEVICE`` does not ask for the CPU), else gloo; under NCCL the rank takes GPU
    ``LOCAL_RANK``."""
    missing = [name for name in RANK_ENVIRONMENT if name not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_environment: {missing} not set; start the ranks with torchrun "
                           "(python -m torch.distributed.run) or labkit.dist.launch")
    rank, world_size, local_rank = (int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if backend == "auto":
        gpu = torch.cuda.is_available() and torch.cuda.device_count() > local_rank
        backend = "nccl" if gpu and os.environ.get("LABKIT_DEVICE", "cuda").startswith("cuda") else "gloo"
    elif backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: expected 'auto', 'gloo' or 'nccl'")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    return rank, world_size


def end_rank(code: int = 0) -> None:
    """Leave this rank's process now, without running C++ static destructors: at interpreter exit
    the gloo/TCPStore threads are sometimes still joinable, and their destructors then abort the
    process ("terminate called without an active exception", seen in ~1 of 8 launches) after the
    rank has finished and saved its result. Flushes Python's output first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch(fn, world_size: int = 2, backend: str = "auto", timeout: float = 120, quiet: bool = False, **kwargs) -> RankResults:
    """Run ``fn(rank, world_size, **kwargs)`` in ``world_size`` fresh processes that form a
    process group; return ``{rank: result}`` (results must be picklable; tensors come back on
    the CPU). On Linux and macOS the ranks are forked from a rank server that has torch imported
    already (started at the first launch, it lives as long as this process): the notebook's own
    state never reaches them, only ``fn``, ``kwargs`` and the environment.

    Each rank's stdout goes to its own file and is printed afterwards, rank by rank, each line
    prefixed ``[rank r]`` (unless ``quiet``), so outputs never interleave. The ranks meet at a
    TCP store this process opens on a free port (port 0: the OS picks one), so launches can run
    side by side. If a rank raises or dies, the others are killed and :class:`RankFailedError`
    shows that rank's traceback; if the ranks are not done within ``timeout`` seconds, they
    are killed and the error says which ranks were still running. No rank outlives the call,
    not even when this process is killed mid-run (e.g. a restarted notebook kernel): the ranks
    notice that their parent is gone and end themselves.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a function, got {type(fn).__name__}")
    module = getattr(fn, "__module__", None)
    if module in (None, "__main__") or "<locals>" in getattr(fn, "__qualname__", "<locals>"):
        raise TypeError(
            f"fn={getattr(fn, '__qualname__', fn)!r} is defined in {module or 'an unknown module'}: the ranks are new processes "
            "that import fn by name, so define it at the top level of an importable module (e.g. labkit.dist_demos), not in a notebook"
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: expected a positive integer")
    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r}: expected a positive number of seconds")
    backend = resolve_backend(backend, world_size)
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout))
    with tempfile.TemporaryDirectory(prefix="labkit-launch-") as run_dir:
        run = Path(run_dir)
        torch.save({"fn": fn, "kwargs": kwargs, "world_size": world_size, "backend": backend, "port": store.port, "timeout": timeout}, run / "spec.pt")
        procs: list[subprocess.Popen] = []
        try:
            _start_ranks(run, world_size, procs)
            _wait(procs, run, time.monotonic() + timeout, timeout)
        finally:
            _kill(procs)
            del store
        outputs = {r: (run / f"stdout_{r}.txt").read_text() for r in range(world_size)}
        results = {r: torch.load(run / f"result_{r}.pt", map_location="cpu", weights_only=False) for r in range(world_size)}
    if not quiet:
        for rank in range(world_size):
            for line in outputs[rank].splitlines():
                print(f"[rank {rank}] {line}")
    return RankResults(results, outputs)


def _child_env() -> dict:
    env = dict(os.environ)
    paths = [os.getcwd() if p == "" else p for p in sys.path if p == "" or os.path.isdir(p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # the ranks share this machine's cores
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


def _start_ranks(run: Path, world_size: int, procs: list) -> None:
    """Start the ranks, appending each to ``procs`` the moment it exists: if starting a later
    one fails (e.g. out of memory), the caller's ``finally`` still kills those already running."""
    env = _child_env()
    for rank in range(world_size):
        for name in ("stdout", "stderr"):
            (run / f"{name}_{rank}.txt").touch()  # there even if the rank dies before writing a line
        procs.append(_start_rank(run, rank, env))


def _start_rank(run: Path, rank: int, env: dict):
    """One rank: forked from the rank server where the platform has a fork server (Linux, macOS),
    otherwise a new interpreter. Either way a fresh process in its own process group, with ``env``."""
    if "forkserver" not in multiprocessing.get_all_start_methods():  # Windows
        with open(run / f"stdout_{rank}.txt", "wb") as out, open(run / f"stderr_{rank}.txt", "wb") as err:
            # our pid goes along, so the rank can tell when it has lost its parent (see _die_with_parent)
            return subprocess.Popen(
                [sys.executable, "-c", "import sys; from labkit.dist import _rank_main; _rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))",
                 str(run), str(rank), str(os.getpid())],
                stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,  # its own process group: killing it takes any children along
            )
    context, server = _rank_server()
    process = context.Process(target=_forked_rank_main, args=(str(run), rank, server, env), name=f"labkit-rank-{rank}")
    with _rank_server_lock, _main_module_hidden():
        process.start()
    return _ForkedRank(process)


@contextlib.contextmanager
def _main_module_hidden():
    """Keep multiprocessing from re-running the launcher's main script or module in every rank (as
    ``__mp_main__``, so that functions defined there could be unpickled): launch() only takes importable
    functions, and a script without an ``if __name__ == "__main__":`` guard would launch again from each rank."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved_file, saved_spec = main.__dict__.pop("__file__", None), getattr(main, "__spec__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__spec__ = saved_spec
        if saved_file is not None:
            main.__file__ = saved_file


# What every rank imports before it runs a line of the learner's code: torch (~2 s of CPU), and torch._dynamo,
# which torch.optim loads when the first optimizer is built (~2 s more). A fresh interpreter per rank paid both
# on every launch, N times over on a machine's few cores (4 ranks on 2 cores: ~10 s before the first collective).
RANK_SERVER_PRELOAD = ("labkit.dist", "torch._dynamo")
_rank_server_lock = threading.Lock()


def _rank_server():
    """``(context, pid)`` of this process's rank server: multiprocessing's fork server, started once with
    :data:`RANK_SERVER_PRELOAD` imported, which forks each rank from that state. It is a child of this
    process and exits when this process does (it watches a pipe from us), and its ranks with it (each
    asks the kernel to be signalled when its parent dies)."""
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    with _rank_server_lock:
        context.set_forkserver_preload(list(RANK_SERVER_PRELOAD))
        # The server starts in the ranks' environment: its C++ libraries read some settings (the log level,
        # OpenMP's threads) once, when torch loads in it.
        with _environment(_child_env()), _main_module_hidden():
            forkserver.ensure_running()
        return context, _rank_server_pid()


def start_rank_server() -> None:
    """Start the rank server :func:`launch` forks its ranks from (Linux, macOS; elsewhere nothing to do)
    now, in the background: its imports (seconds of CPU) then overlap with whatever this process does
    next instead of delaying the first launch. Later calls and launches reuse the same server."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        _rank_server()


@contextlib.contextmanager
def _environment(env: dict):
    """``os.environ`` is ``env`` inside the block, and what it was again after it."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _rank_server_pid() -> int | None:
    """The rank server's pid, if this process has started one (tests tell it from a leftover rank)."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


class _ForkedRank:
    """A rank forked by the rank server, with the part of ``subprocess.Popen``'s interface launch() uses."""

    def __init__(self, process: multiprocessing.Process):
        self.process, self.pid = process, process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank {self.process.name}", timeout)
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()


def _forked_rank_main(run: str, rank: int, server: int, env: dict) -> None:
    """Entry point of a rank forked by the rank server: first what a new interpreter would have got
    from launch() (its own session, output files, the launcher's environment), then :func:`_rank_main`."""
    from multiprocessing import forkserver

    os.setsid()  # its own process group, as start_new_session gives a spawned rank
    # Every process the server forks gets the write end of the pipe the server watches to know when its
    # clients are gone. A rank holding it would keep the server alive after the launcher died, and the rank
    # waits for the server (its parent) to die: neither would ever end.
    alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    for fd, name in ((1, "stdout"), (2, "stderr")):
        with open(Path(run) / f"{name}_{rank}.txt", "ab") as out:
            os.dup2(out.fileno(), fd)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    os.environ.clear()  # for good: this process is the rank
    os.environ.update(env)
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # OpenMP read its variable when torch loaded in the server
    _rank_main(run, rank, server)


def _wait(procs: list[subprocess.Popen], run: Path, deadline: float, timeout: float) -> None:
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            raise _failure(procs, run)
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            raise RankFailedError(
                f"timeout={timeout:g} s: rank(s) {running} did not finish (a hang: e.g. a rank waits in a collective "
                f"that another rank never calls); all ranks were killed.\n"
                + "\n".join(f"--- rank {r} stdout (last lines) ---\n{_tail(run / f'stdout_{r}.txt')}" for r in running)
            )
        time.sleep(0.02)


def _failure(procs: list[subprocess.Popen], run: Path) -> RankFailedError:
    """The error for the rank that failed *first*: when one rank dies, its peers fail a moment
    later in their next collective, and their errors ("connection closed by peer") only hide the cause."""
    time.sleep(0.3)
    codes = [p.poll() for p in procs]
    failed = [r for r, c in enumerate(codes) if c not in (None, 0) or (run / f"failed_{r}").exists()]
    rank = min(failed, key=lambda r: (_failure_time(run, r), r))
    if codes[rank] is None:  # it raised but may still be writing its traceback
        try:
            codes[rank] = procs[rank].wait(timeout=3)
        except subprocess.TimeoutExpired:
            pass
    others = [r for r in failed if r != rank]
    consequence = f" (rank(s) {others} failed after it, most likely as a consequence)" if others else ""
    status = f"exit code {codes[rank]}" if codes[rank] is not None else "raised"
    return RankFailedError(
        f"rank {rank} failed ({status}){consequence}; the other ranks were stopped.\n"
        f"--- rank {rank} stderr (last lines) ---\n{_tail(run / f'stderr_{rank}.txt')}\n"
        f"--- rank {rank} stdout (last lines) ---\n{_tail(run / f'stdout_{rank}.txt')}"
    )


def _kill(procs: list[subprocess.Popen]) -> None:
    """Kill every rank together with the processes it started, and reap the ranks."""
    for p in procs:
        try:
            if hasattr(os, "killpg"):
                # Each rank leads its own process group (its pid is the group's id), so this also
                # kills what the rank started (a `sleep`, DataLoader workers, ...), even after the
                # rank itself exited: a group's id is not handed to a new process while any member lives.
                os.killpg(p.pid, signal.SIGKILL)
            elif p.poll() is None:  # Windows: no process groups
                p.kill()
        except (ProcessLookupError, PermissionError):
            # no such group: it is empty (macOS: only zombies left), or a forked rank is not in its own yet
            if p.poll() is None:
                p.kill()
    for p in procs:
        p.wait()  # reap: no zombies left behind (the rank's own children are reaped by init)


def _failure_time(run: Path, rank: int) -> float:
    try:
        return float((run / f"failed_{rank}").read_text())
    except (OSError, ValueError):  # no stamp: it crashed without Python noticing (or is writing it now)
        return float("inf")


def _tail(path: Path, lines: int = 25) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:]) or "(empty)"


def _die_with_parent(parent: int) -> None:
    """End this rank when ``parent`` dies: the launcher, or the rank server that forked this rank
    (which exits as soon as the launcher does).

    A killed launcher (SIGKILL, a restarted notebook kernel) never runs the ``finally`` that
    kills the ranks, and the ranks, each in its own session, would live on: one in a loop or a
    sleep forever, one in a collective until the process-group timeout.
    """
    if os.name != "posix":
        return  # Windows: a process is not re-parented, so there is nothing for us to notice
    # However the rank learns it is orphaned, it ends the same way: with everything it started.
    signal.signal(signal.SIGTERM, lambda signum, frame: _end_with_own_children())
    if sys.platform.startswith("linux"):
        # Ask the kernel to send SIGTERM the moment our parent exits (strictly: the parent
        # *thread* that started us: the rank server's only thread, or the launch() call that waits
        # for the ranks in that very thread). The handler
        # above runs as soon as the main thread executes Python again (a sleep is interrupted);
        # if it sits in a long C call (a collective), the watchdog below acts within 0.5 s.
        import ctypes

        PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    # If the parent died before prctl ran (e.g. while this rank was importing torch), no signal
    # will come: we have already been re-parented (to init or a "subreaper"), so our parent's
    # pid is no longer the one launch() passed us.
    if os.getppid() != parent:
        _end_with_own_children()
    # Everywhere (macOS has no prctl): a thread that checks twice a second.
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="labkit-parent-watchdog").start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    _end_with_own_children()


def _end_with_own_children() -> None:
    """Kill this rank's process group, i.e. whatever the rank started and the rank with it;
    but only a group this rank leads (launch() starts each rank in a new session)."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)


def _rank_main(run_dir: str, rank: int, parent: int) -> None:
    """Body of one rank: ``parent`` is the process that started it (the launcher or the rank server)."""
    import faulthandler
    import traceback

    _die_with_parent(parent)  # first of all: the launcher may already be gone

    import labkit  # noqa: F401  (sets up Triton's mode before anything imports it)

    faulthandler.enable()  # a crash in C++ (abort, segfault) still shows the Python stack in the rank's stderr

    run = Path(run_dir)
    spec = torch.load(run / "spec.pt", weights_only=False)
    world_size = spec["world_size"]
    failed_marker = run / f"failed_{rank}"
    # The environment torchrun would set: launch()'s TCP store plays the part of torchrun's agent
    # store, which every rank joins as a client.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), TORCHELASTIC_USE_AGENT_STORE="True")
    try:
        init_from_environment(spec["backend"], spec["timeout"])
        try:
            result = spec["fn"](rank, world_size, **spec["kwargs"])
        except BaseException:
            # stamped before the group is torn down, which makes the peers fail a moment later
            failed_marker.write_text(repr(time.time()))
            raise
        finally:
            dist.destroy_process_group()
        torch.save(_to_cpu(result), run / f"result_{rank}.pt")
    except BaseException:
        if not failed_marker.exists():
            failed_marker.write_text(repr(time.time()))
        traceback.print_exc()
        end_rank(1)
    end_rank(0)


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


# ----------------------------------------------------------------------------- the communication meter
def collective_bytes_sent(op: str, nbytes: float, world_size: int) -> float:
    """Bytes one rank sends when ``op`` runs with the ring algorithms NCCL uses, for a call
    whose tensor argument is ``nbytes`` (all-reduce, broadcast, reduce-scatter: the full tensor;
    all-gather: this rank's contribution; send: the message).

    all-reduce ``2(N-1)/N · nbytes`` (reduce-scatter then all-gather), reduce-scatter
    ``(N-1)/N · nbytes``, all-gather ``(N-1) · nbytes`` (each rank's piece goes to N-1 others),
    send ``nbytes``, recv 0.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: expected a positive integer")
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes!r}: expected >= 0")
    n = world_size
    factors = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": n - 1,
               "broadcast": (n - 1) / n, "all_to_all": (n - 1) / n, "send": 1.0, "recv": 0.0}
    if op not in factors:
        raise ValueError(f"op={op!r}: expected one of {sorted(factors)}")
    return factors[op] * nbytes


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


# op name -> (kind for collective_bytes_sent, position and keyword of the tensor argument that sizes the call)
_METERED = {
    "all_reduce": ("all_reduce", 0, "tensor"),
    "broadcast": ("broadcast", 0, "tensor"),
    "all_gather": ("all_gather", 1, "tensor"),
    "all_gather_into_tensor": ("all_gather", 1, "input_tensor"),
    "all_gather_single": ("all_gather", 1, "input_tensor"),  # all_gather_into_tensor's new name (torch 2.13)
    "reduce_scatter": ("reduce_scatter", 1, "input_list"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),  # reduce_scatter_tensor's new name (torch 2.13)
    "all_to_all_single": ("all_to_all", 1, "input"),
    "send": ("send", 0, "tensor"),
    "isend": ("send", 0, "tensor"),
    "recv": ("recv", 0, "tensor"),
    "irecv": ("recv", 0, "tensor"),
}


class CommMeter:
    """Count what this rank hands to ``torch.distributed`` while the block runs.

    ``with CommMeter() as meter: ...`` replaces ``torch.distributed.all_reduce``, ``all_gather``,
    ``reduce_scatter``, ``broadcast``, ``all_to_all_single``, ``send``/``isend``/``recv``/``irecv``
    (and the ``*_tensor``/``*_single`` variants) by wrappers that log each call, then restores them. Per op
    name (``isend`` counts as ``send``, ``all_gather_into_tensor`` as ``all_gather``, ...):
    ``calls[op]``, ``bytes[op]`` (the size of the tensor argument: see
    :func:`collective_bytes_sent`) and ``sent[op]`` (what the ring algorithm makes this rank send).
    ``events`` lists ``(op, bytes)`` in call order, and ``times[i]`` is ``time.perf_counter()`` when
    ``events[i]`` was called (chapter 07 places DDP's all-reduces on backward's timeline with it). Code that calls the collectives through
    ``torch.distributed`` (labkit's, chapter 04's expert parallelism) is seen; DTensor's functional
    collectives are not (count those with ``torch.distributed.tensor.debug.CommDebugMode``).
    """

    def __init__(self):
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()
        self.sent: Counter = Counter()
        self.events: list[tuple[str, int]] = []
        self.times: list[float] = []
        self._saved: dict = {}

    def _wrap(self, name: str, original):
        kind, position, keyword = _METERED[name]

        def metered(*args, **kwargs):
            tensor = args[position] if len(args) > position else kwargs[keyword]
            nbytes = _nbytes(tensor)
            world = dist.get_world_size(kwargs.get("group"))
            self.calls[kind] += 1
            self.bytes[kind] += nbytes
            splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
            if kind == "all_to_all" and splits:  # uneven rows per destination: all but our own share leave
                own = splits[dist.get_rank(kwargs.get("group"))]
                self.sent[kind] += nbytes - nbytes * own // max(sum(splits), 1)
            else:
                self.sent[kind] += collective_bytes_sent(kind, nbytes, world)
            self.events.append((kind, nbytes))
            self.times.append(time.perf_counter())
            return original(*args, **kwargs)

        metered.__wrapped__ = original
        return metered

    def __enter__(self) -> "CommMeter":
        for name in _METERED:
            original = getattr(dist, name, None)
            if original is None:  # a name this torch does not have yet (e.g. reduce_scatter_single before 2.13)
                continue
            self._saved[name] = original
            setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    def summary(self) -> dict[str, dict]:
        """``{op: {"calls", "bytes", "sent"}}`` for every op that was called."""
        return {op: {"calls": self.calls[op], "bytes": self.bytes[op], "sent": self.sent[op]} for op in self.calls}


# ----------------------------------------------------------------------------- ring all-reduce
def ring_chunk(rank: int, step: int, world_size: int) -> int:
    """Index of the chunk ``rank`` sends to ``rank + 1`` at ``step`` of a ring all-reduce.

    Steps ``0 .. N-2`` reduce-scatter: rank ``r`` sends chunk ``(r - step) mod N`` and adds
    the chunk it receives from ``r - 1`` into its own copy; afterwards rank ``r`` holds the
    full sum of chunk ``(r + 1) mod N``. Steps ``N-1 .. 2N-3`` all-gather: each rank passes
    along the finished chunk it got last, and the receiver overwrites its copy.
    """
    if step < world_size - 1:
        return (rank - step) % world_size
    return (rank + 1 - (step - (world_size - 1))) % world_size


def ring_allreduce_step(buffers: list[list[torch.Tensor]], step: int) -> list[list[torch.Tensor]]:
    """One step of the ring all-reduce on every rank at once (no processes, for reading and
    grading): ``buffers[r][c]`` is rank ``r``'s copy of chunk ``c``. Returns new buffers (the
    input is not modified) after every rank ``r`` sent chunk ``ring_chunk(r, step, N)`` to rank
    ``r + 1``: added there during reduce-scatter (``step < N - 1``), copied during all-gather."""
    n = len(buffers)
    if n < 1 or any(len(b) != n for b in buffers):
        raise ValueError(f"buffers: expected N lists of N chunks (one list per rank), got lengths {[len(b) for b in buffers]}")
    if not 0 <= step < 2 * (n - 1):
        raise ValueError(f"step={step}: expected 0 <= step < 2*(N-1) = {2 * (n - 1)}")
    new = [[c.clone() for c in b] for b in buffers]
    for sender in range(n):
        chunk, receiver = ring_chunk(sender, step, n), (sender + 1) % n
        if step < n - 1:
            new[receiver][chunk] = buffers[receiver][chunk] + buffers[sender][chunk]
        else:
            new[receiver][chunk] = buffers[sender][chunk].clone()
    return new


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` across all ranks in place using only point-to-point ``isend``/``irecv``
    to the ring neighbours: ``N-1`` reduce-scatter steps, then ``N-1`` all-gather steps. Each
    rank sends ``2(N-1)/N`` of the tensor in total, whatever ``N`` is: the reason NCCL's ring
    all-reduce is bandwidth-optimal. Equals ``dist.all_reduce(tensor)`` (up to float rounding)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    if n == 1:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    chunks = list(flat.tensor_split(n))  # views into flat: writing a chunk writes the tensor
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(2 * (n - 1)):
        send_idx, recv_idx = ring_chunk(rank, step, n), ring_chunk(left, step, n)
        incoming = torch.empty_like(chunks[recv_idx])
        requests = [dist.isend(chunks[send_idx].contiguous(), right), dist.irecv(incoming, left)]
        for req in requests:
            req.wait()
        if step < n - 1:
            chunks[recv_idx].add_(incoming)
        else:
            chunks[recv_idx].copy_(incoming)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def allreduce_time(nbytes: float, world_size: int, bandwidth: float, latency: float = 0.0, algorithm: str = "ring") -> float:
    """Seconds to all-reduce ``nbytes`` over ``world_size`` ranks with per-link ``bandwidth``
    (bytes/s) and per-message ``latency`` (s), in the alpha-beta model.

    ``ring``: ``2(N-1)`` steps each moving ``nbytes/N`` -> ``2(N-1)·latency + 2(N-1)/N·nbytes/bandwidth``
    (reduce-scatter then all-gather, each ``(N-1)/N·nbytes/bandwidth``): nearly independent of
    ``N``. ``naive``: every rank sends its whole tensor to rank 0, which sends the sum back to
    every rank, all through rank 0's link -> ``2(N-1)·(latency + nbytes/bandwidth)``.
    """
    if nbytes < 0 or bandwidth <= 0 or latency < 0:
        raise ValueError(f"nbytes={nbytes}, bandwidth={bandwidth}, latency={latency}: expected nbytes >= 0, bandwidth > 0, latency >= 0")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: expected a positive integer")
    n = world_size
    if algorithm == "ring":
        return 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bandwidth
    if algorithm == "naive":
        return 2 * (n - 1) * (latency + nbytes / bandwidth)
    raise ValueError(f"algorithm={algorithm!r}: expected 'ring' or 'naive'")


def overlap_timeline(grad_bytes, backward_seconds, bucket_cap_bytes: float, world_size: int, bandwidth: float,
                     latency: float = 0.0) -> dict:
    """How much of DDP's gradient all-reduce a bucketed backward hides, in the alpha-beta model.

    ``grad_bytes[i]`` and ``backward_seconds[i]`` describe the gradients in the order backward produces
    them (reverse registration order): the bytes of gradient ``i`` and the compute time from the previous
    gradient to it. Gradients are cut into buckets of at most ``bucket_cap_bytes`` (a larger one alone,
    as :func:`bucket_plan` does); a bucket's ring all-reduce (:func:`allreduce_time`) starts when its last
    gradient is ready and the previous all-reduce has finished (one communication stream, in order).
    Returns ``{"buckets", "backward", "communication", "exposed", "timeline"}``: seconds of compute, of
    all-reduces in total, and of communication left after backward ends (what the step waits for), and
    ``(start, end)`` of every all-reduce."""
    grad_bytes, backward_seconds = list(grad_bytes), list(backward_seconds)
    if len(grad_bytes) != len(backward_seconds) or not grad_bytes:
        raise ValueError(f"grad_bytes, backward_seconds: expected two lists of one equal, non-zero length, got "
                         f"{len(grad_bytes)} and {len(backward_seconds)}")
    if min(grad_bytes) < 0 or min(backward_seconds) < 0 or not bucket_cap_bytes > 0:
        raise ValueError("grad_bytes, backward_seconds: expected values >= 0; bucket_cap_bytes: expected > 0")
    ready, clock = [], 0.0
    for seconds in backward_seconds:
        clock += seconds
        ready.append(clock)
    buckets = _greedy_buckets([(i, nbytes, None) for i, nbytes in enumerate(grad_bytes)], bucket_cap_bytes)
    timeline, free = [], 0.0
    for bucket in buckets:
        start = max(ready[bucket[-1]], free)
        free = start + allreduce_time(sum(grad_bytes[i] for i in bucket), world_size, bandwidth, latency)
        timeline.append((start, free))
    return {"buckets": len(buckets), "backward": clock, "communication": sum(end - start for start, end in timeline),
            "exposed": max(0.0, free - clock), "timeline": timeline}


def gradient_collective(strategy: str) -> str:
    """The collective that synchronises gradients under a data-parallel ``strategy``: DDP needs
    the full averaged gradient everywhere (``all_reduce``); ZeRO-1 (as in the paper and
    :class:`ShardedOptimizer`), ZeRO-2 and ZeRO-3/FSDP need only the summed shard each rank
    updates (``reduce_scatter``). A ZeRO-1 may also all-reduce and use its shard
    (:class:`ShardedOptimizerBroadcast`), at more traffic."""
    table = {"ddp": "all_reduce", "zero1": "reduce_scatter", "zero2": "reduce_scatter", "zero3": "reduce_scatter", "fsdp": "reduce_scatter"}
    if strategy not in table:
        raise ValueError(f"strategy={strategy!r}: expected one of {sorted(table)}")
    return table[strategy]


# ----------------------------------------------------------------------------- data parallelism
def broadcast_parameters(module: torch.nn.Module, src: int = 0) -> None:
    """Make every rank start from rank ``src``'s parameters and buffers."""
    for tensor in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(tensor.data, src)


class DDPIndividual(torch.nn.Module):
    """Data parallelism, one all-reduce per parameter.

    Each rank runs the same model on its own slice of the batch. As soon as backward has
    accumulated a parameter's gradient, a hook launches an asynchronous all-reduce of it, so
    communication overlaps with the rest of the backward pass. Call
    :meth:`finish_gradient_synchronization` before ``optimizer.step()``: it waits for the
    all-reduces and divides by the world size (the mean over the whole batch).
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self._handles: list = []
        self.world_size = dist.get_world_size()
        broadcast_parameters(module)
        for p in self._unique_params():
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _unique_params(self):
        return list({id(p): p for p in self.module.parameters() if p.requires_grad}.values())

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._handles.append(dist.all_reduce(param.grad, async_op=True))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        for handle in self._handles:
            handle.wait()
        self._handles.clear()
        for p in self._unique_params():
            if p.grad is not None:
                p.grad.div_(self.world_size)


def _greedy_buckets(items, cap: float) -> list[list[int]]:
    """Indices of ``items`` (``(index, nbytes, kind)``, in bucket order) cut into buckets greedily: the next
    item starts a new bucket when adding it would take the current one past ``cap`` bytes, or when its
    ``kind`` differs from the bucket's; an item larger than ``cap`` therefore sits alone."""
    buckets: list[list[int]] = []
    size, kind = 0, None
    for index, nbytes, item_kind in items:
        if not buckets or size + nbytes > cap or item_kind != kind:
            buckets.append([])
            size, kind = 0, item_kind
        buckets[-1].append(index)
        size += nbytes
    return buckets


def _check_bucket_size_mb(bucket_size_mb) -> None:
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)) or not bucket_size_mb > 0:
        raise ValueError(f"bucket_size_mb={bucket_size_mb!r}: expected a positive number")


def bucket_parameters(params, bucket_size_mb: float) -> list[list[torch.Tensor]]:
    """Group ``params`` into buckets of at most ``bucket_size_mb`` MiB (``bucket_size_mb * 2**20``
    bytes), in *reverse* order (the order backward produces their gradients): a new bucket starts
    when the next parameter would take the current one past the limit. A parameter larger than
    the limit gets a bucket of its own; no bucket is empty. (Every parameter, whatever its dtype or
    ``requires_grad``: :func:`bucket_plan` is the plan DDP needs.)"""
    _check_bucket_size_mb(bucket_size_mb)
    params = list(params)
    items = [(i, p.numel() * p.element_size(), None) for i, p in reversed(list(enumerate(params)))]
    return [[params[i] for i in bucket] for bucket in _greedy_buckets(items, bucket_size_mb * 2**20)]


def bucket_plan(params, bucket_cap_bytes: int) -> list[list[int]]:
    """DDP's gradient buckets for ``params`` (a model's parameters in registration order, as
    ``list(model.parameters())`` gives them), as lists of indices into ``params``.

    Only parameters that require grad are bucketed, in *reverse* registration order (backward
    produces gradients roughly last layer first, so the first bucket fills first). A bucket holds
    one dtype (its gradients are flattened into one buffer and all-reduced together) and at most
    ``bucket_cap_bytes`` bytes of gradients, the cap included: the next parameter starts a new
    bucket when adding it would take the bucket past the cap, or when its dtype differs. A
    parameter larger than the cap gets a bucket of its own; no bucket is empty; with no trainable
    parameter the plan is ``[]``.

    ``torch.distributed._compute_bucket_assignment_by_size``, the rule ``DistributedDataParallel``
    buckets with, cuts differently: it keeps one open bucket per dtype and device, adds a tensor first
    and closes the bucket once it holds the cap or more (so its buckets go past the cap by their last
    tensor), takes one cap per bucket (DDP's first is 1 MiB, ``dist._DEFAULT_FIRST_BUCKET_BYTES``, then
    ``bucket_cap_mb``), and lists the buckets by their smallest index. DDP (torch 2.13) starts with all
    gradients in one bucket and, after the first iteration, rebuilds the buckets in the order the
    gradients really arrived.
    """
    if not isinstance(params, (list, tuple)) or any(not isinstance(p, torch.Tensor) for p in params):
        raise TypeError("params: expected a list of tensors (list(model.parameters()))")
    if isinstance(bucket_cap_bytes, bool) or not isinstance(bucket_cap_bytes, int) or bucket_cap_bytes < 1:
        raise ValueError(f"bucket_cap_bytes={bucket_cap_bytes!r}: expected a positive int (bytes)")
    items = [(i, p.numel() * p.element_size(), p.dtype) for i, p in reversed(list(enumerate(params))) if p.requires_grad]
    return _greedy_buckets(items, bucket_cap_bytes)


class DDPBucketed(torch.nn.Module):
    """Data parallelism with gradients all-reduced in buckets of about ``bucket_size_mb``.

    Thousands of tiny all-reduces each pay the per-message latency; one giant all-reduce at
    the end cannot overlap with backward. Buckets are the middle ground (PyTorch's DDP uses
    25 MB): :func:`bucket_plan` groups the trainable parameters in reverse order (the order
    backward produces their gradients), one dtype per bucket, and a bucket's gradients are
    flattened into one buffer and all-reduced asynchronously the moment its last gradient is
    ready. :meth:`no_sync` skips the all-reduces while gradients accumulate over micro-batches.
    """

    def __init__(self, module: torch.nn.Module, bucket_size_mb: float):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        _check_bucket_size_mb(bucket_size_mb)
        broadcast_parameters(module)
        params = list(module.parameters())  # unique, registration order
        cap = max(1, int(bucket_size_mb * 2**20))  # bytes, as torch's DDP turns bucket_cap_mb into bytes
        self.buckets = [[params[i] for i in bucket] for bucket in bucket_plan(params, cap)]
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._ready = [0] * len(self.buckets)
        self._pending: dict[int, tuple] = {}
        self._sync = True
        for bucket in self.buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation without communication, as ``DistributedDataParallel.no_sync``: a backward
        inside only adds this rank's gradients into ``.grad``; the first backward after it all-reduces the
        accumulated sums, so that :meth:`finish_gradient_synchronization` follows that backward only."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync:
            return
        index = self._bucket_of[id(param)]
        self._ready[index] += 1
        if self._ready[index] == len(self.buckets[index]):
            self._launch(index)

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        for p in bucket:  # a parameter that got no gradient this step contributes zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch._utils._flatten_dense_tensors([p.grad for p in bucket])
        self._pending[index] = (dist.all_reduce(flat, async_op=True), flat)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        for index in range(len(self.buckets)):
            if index not in self._pending:
                self._launch(index)
        for index, (handle, flat) in sorted(self._pending.items()):
            handle.wait()
            flat.div_(self.world_size)
            bucket = self.buckets[index]
            for p, synced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, [p.grad for p in bucket])):
                p.grad.copy_(synced)
        self._pending.clear()
        self._ready = [0] * len(self.buckets)


def flat_shard_layout(numel: int, world_size: int) -> tuple[int, int]:
    """``(padded, shard)`` for a flat buffer of ``numel`` elements split over ``world_size`` ranks:
    the buffer is padded with zeros to ``padded``, the next multiple of ``world_size``, so that
    every rank's shard has the same ``shard = padded // world_size`` elements (reduce-scatter and
    all-gather need equal chunks). Rank ``r`` owns elements ``[r * shard, (r + 1) * shard)``."""
    for name, value in (("numel", numel), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "numel" else 1):
            raise ValueError(f"{name}={value!r}: expected an integer >= {0 if name == 'numel' else 1}")
    shard = -(-numel // world_size)
    return shard * world_size, shard


def _reduce_scatter_into():
    """``dist.reduce_scatter_single`` (torch >= 2.13), else its old name ``reduce_scatter_tensor``;
    looked up at each call, so that :class:`CommMeter` sees it."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_into():
    """``dist.all_gather_single`` (torch >= 2.13), else its old name ``all_gather_into_tensor``."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 as in the paper (Rajbhandari et al. 2020, "P_os"): optimizer state sharded
    across ranks, with no more communication than DDP.

    Each rank computes gradients on its own slice of the batch (no DDP wrapper: this optimizer
    synchronises them). :meth:`step` flattens every gradient into one buffer, zero-padded to a
    multiple of the world size (:func:`flat_shard_layout`), **reduce-scatters** it (rank ``r``
    receives the sum of chunk ``r``) and divides by the world size; the wrapped optimizer then
    steps this rank's fp32 master shard of the flattened parameters, whose state (AdamW's m and v)
    is therefore ``1/N`` of the whole, exactly; finally the updated shards are **all-gathered**
    and copied into the parameters. Per step each rank sends ``(N-1)/N`` of the buffer in the
    reduce-scatter and as much in the all-gather: ``2(N-1)/N`` of it, the bytes of DDP's
    all-reduce. Every rank ends with the parameters the unsharded optimizer would produce
    (exactly so for element-wise optimizers such as SGD and Adam(W); one that uses a whole
    tensor's norm, like LAMB, would see only its slice of it).

    All parameters must share one dtype and device (the collectives run in that dtype); one
    parameter group; ``param_groups[0]``'s hyperparameters (e.g. a new learning rate) are passed
    to the shard's optimizer at every step.
    """

    def __init__(self, params, optimizer_cls: type, **kwargs):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls: expected a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        params = list(params)
        if any(not isinstance(p, torch.Tensor) for p in params):
            raise TypeError("params: expected tensors (one flat buffer holds them all: parameter groups are not supported)")
        self.params = list({id(p): p for p in params}.values())
        if not self.params:
            raise ValueError("params: expected at least one parameter")
        if len({(p.dtype, p.device) for p in self.params}) > 1:
            raise ValueError(f"params: expected one dtype and device, got {sorted({f'{p.dtype} on {p.device}' for p in self.params})}")
        super().__init__(self.params, kwargs)
        self.numel = sum(p.numel() for p in self.params)
        self.padded, self.shard_size = flat_shard_layout(self.numel, self.world_size)
        self.shard_start = self.rank * self.shard_size
        flat = self._flat([p.detach() for p in self.params], torch.float32)
        self.master_shard = flat[self.shard_start:self.shard_start + self.shard_size].clone()  # not a view: 1/N of the memory
        self.local_optimizer = optimizer_cls([self.master_shard], **kwargs)

    def add_param_group(self, param_group: dict) -> None:
        if self.param_groups:
            raise ValueError("ShardedOptimizer keeps one parameter group (one flat buffer of all parameters)")
        super().add_param_group(param_group)

    def _flat(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The tensors flattened into one zero-padded buffer of ``self.padded`` elements."""
        flat = torch.zeros(self.padded, dtype=dtype, device=self.params[0].device)
        torch.cat([t.reshape(-1) for t in tensors], out=flat[:self.numel])
        return flat

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        dtype = self.params[0].dtype
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        grad_shard = torch.empty(self.shard_size, dtype=dtype, device=self.master_shard.device)
        _reduce_scatter_into()(grad_shard, self._flat(grads, dtype), op=dist.ReduceOp.SUM)
        self.master_shard.grad = grad_shard.float().div_(self.world_size)  # the sum over ranks -> the mean
        self.local_optimizer.param_groups[0].update({k: v for k, v in self.param_groups[0].items() if k != "params"})
        self.local_optimizer.step()
        gathered = torch.empty(self.padded, dtype=dtype, device=self.master_shard.device)
        _all_gather_into()(gathered, self.master_shard.to(dtype))
        for p, chunk in zip(self.params, gathered[:self.numel].split([p.numel() for p in self.params])):
            p.copy_(chunk.view_as(p))
        return loss


class ShardedOptimizerBroadcast(torch.optim.Optimizer):
    """A simpler ZeRO-1, kept for comparison with the paper's :class:`ShardedOptimizer`.

    Every rank holds all parameters and, after DDP's all-reduce, the full averaged gradient, but
    each parameter is *owned* by one rank, the only one that keeps its optimizer state (AdamW's m
    and v) and updates it. After the local step every owner broadcasts its updated parameters,
    so all ranks end with the same model, exactly as the unsharded optimizer would produce,
    while each holds only about ``1/N`` of the optimizer state. Parameters are assigned
    greedily to the rank with the fewest elements so far, to balance the shards (whole
    parameters: the shares are only close to ``1/N``). It communicates more than the paper's
    version: DDP's all-reduce (``2(N-1)/N`` of the gradients) and then the broadcasts
    (``(N-1)/N`` of the parameters, counted as the ring algorithms send it).
    """

    def __init__(self, params, optimizer_cls: type, **kwargs):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls: expected a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.optimizer_cls, self.optimizer_kwargs = optimizer_cls, kwargs
        self.owner: dict[int, int] = {}
        self._load = [0] * self.world_size
        self.local_optimizer: torch.optim.Optimizer | None = None
        super().__init__(params, kwargs)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        mine = []
        for p in group["params"]:
            if id(p) not in self.owner:
                rank = min(range(self.world_size), key=lambda r: self._load[r])
                self.owner[id(p)] = rank
                self._load[rank] += p.numel()
            if self.owner[id(p)] == self.rank:
                mine.append(p)
        local_group = {**{k: v for k, v in group.items() if k != "params"}, "params": mine}
        if self.local_optimizer is None:
            self.local_optimizer = self.optimizer_cls([local_group], **self.optimizer_kwargs)
        else:
            self.local_optimizer.add_param_group(local_group)

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        for group, local in zip(self.param_groups, self.local_optimizer.param_groups):
            local.update({k: v for k, v in group.items() if k != "params"})  # e.g. a new learning rate
        loss = self.local_optimizer.step(closure, **kwargs)
        handles = [dist.broadcast(p.data, src=self.owner[id(p)], async_op=True) for group in self.param_groups for p in group["params"]]
        for handle in handles:
            handle.wait()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()


# ----------------------------------------------------------------------------- showing what happened
def _fmt(t) -> str:
    if t is None:
        return "(undefined)"
    if t.dim() == 2:
        return " | ".join(_fmt(row) for row in t)
    return "[" + " ".join(f"{v:g}" for v in t.tolist()) + "]"


def collective_table(results: dict, name: str) -> str:
    """Text table of what each rank held before and after collective ``name``, from
    ``launch(labkit.dist_demos.collectives)`` results (``{rank: {name: (before, after)}}``)."""
    if name not in COLLECTIVES:
        raise ValueError(f"name={name!r}: expected one of {COLLECTIVES}")
    lines = [f"{name}:"]
    for rank in sorted(results):
        before, after = results[rank][name]
        lines.append(f"  rank {rank}: {_fmt(before):<34} -> {_fmt(after)}")
    return "\n".join(lines)
