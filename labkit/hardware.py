"""The machine under the code: what it has, how fast each part of it is, and how to time code on it.

An operator reads its inputs from memory, computes, and writes its outputs back, so its speed is set
by compute *and* by memory traffic. This module reads the machine's hardware from the operating
system (:func:`machine_report`), measures the memory hierarchy (:func:`bandwidth_sweep`,
:func:`latency_sweep`, :func:`stride_sweep`) and the arithmetic peak (:func:`matmul_flops`), places
operators on a :class:`Roofline` (:func:`arithmetic_intensity`), lays out a GPU's memory hierarchy from
published figures (:func:`gpu_memory_hierarchy`), counts a matmul's tile and wave quantization
(:func:`tile_waves`), times code correctly (:func:`timeit`, built on ``torch.utils.benchmark``; on a GPU
:func:`gpu_time`, with CUDA events and a flushed L2) and
profiles it (:func:`profile_step`, built on ``torch.profiler``). The staged slow loops of the chapter
(:func:`softmax_rows_loop`, :func:`gelu_unfused`, :class:`Prefetcher`) live here too.

Every number measured here belongs to one machine at one moment: shown, never compared digit for digit.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import os
import platform
import re
import statistics
import subprocess
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from labkit.runtime import check_device

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


# ----------------------------------------------------------------------------- the machine report
@dataclasses.dataclass(frozen=True)
class Cache:
    """One cache level as the OS describes it: ``shared_by`` logical CPUs use one instance of it."""

    level: int
    kind: str  # "Data", "Instruction" or "Unified"
    size_bytes: int
    line_bytes: int | None
    shared_by: int
    instances: int

    @property
    def name(self) -> str:
        return f"L{self.level}" + {"Data": "d", "Instruction": "i"}.get(self.kind, "")


@dataclasses.dataclass(frozen=True)
class CPUReport:
    model: str
    logical_cpus: int | None
    physical_cores: int | None
    threads_per_core: int | None
    sockets: int | None
    numa_nodes: int | None
    caches: tuple[Cache, ...]
    memory_bytes: int | None
    governor: str | None
    source: str  # "sysfs", "sysctl" or "unknown"

    def cache(self, name: str) -> Cache | None:
        """The cache called ``name`` ("L1d", "L2", "L3", ...), or None when the OS did not report it."""
        return next((c for c in self.caches if c.name == name), None)

    @property
    def line_bytes(self) -> int | None:
        lines = {c.line_bytes for c in self.caches if c.line_bytes}
        return min(lines) if lines else None


@dataclasses.dataclass(frozen=True)
class GPUPeaks:
    """Datasheet figures of one GPU (dense tensor-core math, no sparsity)."""

    name: str
    tflops: Mapping[str, float]  # dtype name → TFLOP/s
    bandwidth_tb_s: float
    memory_gb: float  # the datasheets' GB are binary (GiB)
    source: str


@dataclasses.dataclass(frozen=True)
class GPUReport:
    name: str
    sms: int
    memory_bytes: int
    capability: tuple[int, int]
    peaks: GPUPeaks | None


@dataclasses.dataclass(frozen=True)
class MachineReport:
    cpu: CPUReport
    gpus: tuple[GPUReport, ...]

    def rows(self) -> list[dict]:
        """The report as table rows (what, value): the cores, each cache level, memory, each GPU."""
        cpu = self.cpu
        rows = [dict(what="CPU", value=cpu.model),
                dict(what="cores", value=f"{_or_unknown(cpu.physical_cores)} physical, {_or_unknown(cpu.logical_cpus)} logical "
                                         f"({_or_unknown(cpu.threads_per_core)} per core), {_or_unknown(cpu.sockets)} socket(s), "
                                         f"{_or_unknown(cpu.numa_nodes)} NUMA node(s)")]
        per_thread = cpu.threads_per_core or 1
        for c in cpu.caches:
            cores = max(1, c.shared_by // per_thread)
            where = "per core" if cores == 1 else f"per {cores} cores"
            line = f", {c.line_bytes}-byte lines" if c.line_bytes else ""
            rows.append(dict(what=c.name, value=f"{format_bytes(c.size_bytes)} {where} (x{c.instances}){line}"))
        rows.append(dict(what="memory", value=format_bytes(cpu.memory_bytes) if cpu.memory_bytes else "unknown"))
        rows.append(dict(what="frequency governor", value=cpu.governor or "not reported"))
        for g in self.gpus:
            peak = ""
            if g.peaks:
                bf16 = g.peaks.tflops.get("bfloat16")
                peak = f"; datasheet: {bf16:g} TFLOP/s bf16, {g.peaks.bandwidth_tb_s:g} TB/s"
            rows.append(dict(what="GPU", value=f"{g.name}: {g.sms} SMs, {format_bytes(g.memory_bytes)}, "
                                               f"compute capability {g.capability[0]}.{g.capability[1]}{peak}"))
        if not self.gpus:
            rows.append(dict(what="GPU", value="none"))
        return rows


def _or_unknown(value) -> str:
    return "?" if value is None else str(value)


def format_bytes(n: int | float) -> str:
    """``32768`` → ``'32 KiB'``, ``1.5 * 2**20`` → ``'1.5 MiB'`` (binary units, as caches are sized)."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{int(n)} B"


def _parse_size(text: str) -> int:
    """A sysfs cache size: ``'32K'`` → 32768, ``'32768K'``, ``'1M'``, or plain bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", text)
    if not match:
        raise ValueError(f"cannot read a cache size from {text!r}")
    return int(match.group(1)) * {"": 1, "K": KiB, "M": MiB, "G": GiB}[match.group(2)]


def _parse_cpu_list(text: str) -> list[int]:
    """``'0-3,8,10-11'`` → ``[0, 1, 2, 3, 8, 10, 11]``."""
    cpus = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def linux_cpu_report(read: Callable[[str], str | None]) -> CPUReport:
    """The CPU as Linux describes it, through ``read(path)`` (the file's text, or None if absent):
    ``/sys/devices/system/cpu/...`` for topology and caches, ``/proc/cpuinfo`` and ``/proc/meminfo``."""
    cpu_dir = "/sys/devices/system/cpu"
    online = read(f"{cpu_dir}/online")
    cpus = _parse_cpu_list(online) if online else []
    cores, packages, thread_counts = set(), set(), []
    caches: dict[tuple, set] = collections.defaultdict(set)  # (level, kind, size, line) → set of shared cpu lists
    for cpu in cpus:
        top = f"{cpu_dir}/cpu{cpu}/topology"
        package, core, siblings = read(f"{top}/physical_package_id"), read(f"{top}/core_id"), read(f"{top}/thread_siblings_list")
        if package is not None and core is not None:
            cores.add((int(package), int(core)))
            packages.add(int(package))
        if siblings:
            thread_counts.append(len(_parse_cpu_list(siblings)))
        for index in range(16):
            base = f"{cpu_dir}/cpu{cpu}/cache/index{index}"
            level = read(f"{base}/level")
            if level is None:
                break
            size = read(f"{base}/size")
            if not size:
                continue
            line = read(f"{base}/coherency_line_size")
            shared = read(f"{base}/shared_cpu_list") or str(cpu)
            key = (int(level), (read(f"{base}/type") or "Unified").strip(), _parse_size(size), int(line) if line else None)
            caches[key].add(tuple(_parse_cpu_list(shared)))
    cache_list = tuple(sorted(
        (Cache(level, kind, size, line, shared_by=max(len(s) for s in shared), instances=len(shared))
         for (level, kind, size, line), shared in caches.items()),
        key=lambda c: (c.level, c.kind != "Data")))
    nodes = read("/sys/devices/system/node/online")
    info = read("/proc/cpuinfo") or ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                  if line.split(":")[0].strip() in ("model name", "Model", "Hardware")), None)
    mem = re.search(r"MemTotal:\s+(\d+) kB", read("/proc/meminfo") or "")
    governor = read(f"{cpu_dir}/cpu{cpus[0]}/cpufreq/scaling_governor") if cpus else None
    return CPUReport(
        model=model or platform.processor() or "unknown",
        logical_cpus=len(cpus) or None,
        physical_cores=len(cores) or None,
        threads_per_core=max(thread_counts) if thread_counts else None,
        sockets=len(packages) or None,
        numa_nodes=len(_parse_cpu_list(nodes)) if nodes else None,
        caches=cache_list,
        memory_bytes=int(mem.group(1)) * KiB if mem else None,
        governor=governor.strip() if governor else None,
        source="sysfs")


def parse_sysctl(text: str) -> dict[str, str]:
    """``sysctl -a`` (or ``sysctl hw machdep``) output, ``name: value`` per line, as a dict."""
    values = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip():
            values[name.strip()] = value.strip()
    return values


def macos_cpu_report(sysctl: Mapping[str, str]) -> CPUReport:
    """The CPU as macOS's ``sysctl`` describes it. On Apple silicon the performance cores
    (``hw.perflevel0.*``) are reported: their L2 is shared by ``cpusperl2`` cores; there is no L3
    for the CPU (the system-level cache is not reported)."""
    def number(name):
        value = sysctl.get(name)
        return int(value) if value not in (None, "") else None

    logical, physical = number("hw.logicalcpu"), number("hw.physicalcpu")
    line = number("hw.cachelinesize")
    # hw.cacheconfig: how many logical CPUs share memory, L1, L2, L3 (Intel Macs report it per level)
    sharing = [int(v) for v in sysctl.get("hw.cacheconfig", "").split()]
    prefix = "hw.perflevel0." if number("hw.nperflevels") else "hw."
    cpus_in_level = number(prefix + "logicalcpu") or logical or 1
    caches = []
    for level, kind, key, shared_key in ((1, "Data", "l1dcachesize", None), (1, "Instruction", "l1icachesize", None),
                                         (2, "Unified", "l2cachesize", "cpusperl2"), (3, "Unified", "l3cachesize", "cpusperl3")):
        size = number(prefix + key) or number("hw." + key)
        if not size:
            continue
        shared = (number(prefix + shared_key) if shared_key else None) or \
            (sharing[level] if len(sharing) > level and sharing[level] else (1 if level == 1 else cpus_in_level))
        caches.append(Cache(level, kind, size, line, shared_by=shared, instances=max(1, cpus_in_level // shared)))
    threads = logical // physical if logical and physical else None
    return CPUReport(model=sysctl.get("machdep.cpu.brand_string", "unknown"), logical_cpus=logical, physical_cores=physical,
                     threads_per_core=threads, sockets=number("hw.packages"), numa_nodes=1 if logical else None,
                     caches=tuple(caches), memory_bytes=number("hw.memsize"), governor=None, source="sysctl")


def _read_file(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        return None


def cpu_report() -> CPUReport:
    """This machine's CPU: from sysfs on Linux, ``sysctl`` on macOS, what Python knows elsewhere."""
    system = platform.system()
    if system == "Linux" and Path("/sys/devices/system/cpu/online").exists():
        return linux_cpu_report(_read_file)
    if system == "Darwin":
        try:
            out = subprocess.run(["sysctl", "hw", "machdep"], capture_output=True, text=True, timeout=10, check=True).stdout
            return macos_cpu_report(parse_sysctl(out))
        except (OSError, subprocess.SubprocessError):
            pass
    return CPUReport(model=platform.processor() or "unknown", logical_cpus=os.cpu_count(), physical_cores=None,
                     threads_per_core=None, sockets=None, numa_nodes=None, caches=(), memory_bytes=None, governor=None,
                     source="unknown")


# Datasheet peaks, dense (the "with sparsity" figures are twice these). fp32 is the non-tensor-core rate. Memory in
# the datasheets' GB, which are binary: an "80GB" part reports about 79.2 GiB to torch.
_HOPPER_SXM = {"float32": 67, "tf32": 494.5, "bfloat16": 989.5, "float16": 989.5, "float8": 1979}
_HOPPER_NVL = {"float32": 60, "tf32": 417.5, "bfloat16": 835.5, "float16": 835.5, "float8": 1670.5}
_A100 = {"float32": 19.5, "tf32": 156, "bfloat16": 312, "float16": 312}
_HALVED = "tensor figures halved (the datasheet quotes sparsity)"
_H200, _H100, _A100_2021, _A100_2020 = (f"NVIDIA {part} Tensor Core GPU datasheet ({year})" for part, year in
                                        (("H200", 2024), ("H100", 2023), ("A100", 2021), ("A100", 2020)))
GPU_DATASHEETS: dict[str, GPUPeaks] = {
    "H200": GPUPeaks("H200 SXM", _HOPPER_SXM, 4.8, 141, f"{_H200}, H200 SXM column; {_HALVED}"),
    "H200 NVL": GPUPeaks("H200 NVL", _HOPPER_NVL, 4.8, 141, f"{_H200}, H200 NVL column; {_HALVED}"),
    "H100 SXM": GPUPeaks("H100 SXM", _HOPPER_SXM, 3.35, 80, f"{_H100}, H100 SXM column; {_HALVED}"),
    "H100 NVL": GPUPeaks("H100 NVL", _HOPPER_NVL, 3.9, 94, f"{_H100}, H100 NVL column; {_HALVED}"),
    "A100 SXM4 80GB": GPUPeaks("A100 SXM4 80GB", _A100, 2.039, 80, f"{_A100_2021}, A100 80GB SXM column, dense"),
    "A100 PCIe 80GB": GPUPeaks("A100 PCIe 80GB", _A100, 1.935, 80, f"{_A100_2021}, A100 80GB PCIe column, dense"),
    "A100 SXM4 40GB": GPUPeaks("A100 SXM4 40GB", _A100, 1.555, 40, f"{_A100_2020}, A100 for NVLink (40GB) column, dense"),
    "A100 PCIe 40GB": GPUPeaks("A100 PCIe 40GB", _A100, 1.555, 40, f"{_A100_2020}, A100 for PCIe (40GB) column, dense"),
    "RTX 4090": GPUPeaks("RTX 4090", {"float32": 82.6, "tf32": 82.6, "bfloat16": 165.2, "float16": 165.2, "float8": 330.3},
                         1.008, 24, "NVIDIA Ada Lovelace GPU architecture whitepaper (2022), Appendix A: dense, fp32 accumulate"),
}
# The names torch.cuda.get_device_name gives each part, without "NVIDIA ", upper-cased, "-" read as a space. A name
# that matches none (H100 PCIe, GH200, RTX 4090 Laptop GPU, a MIG slice, ...) has no entry here rather than a
# relative's figures: a laptop 4090 is another chip, GH200's HBM is another size and speed.
_DATASHEET_NAMES = ((r"H200( SXM)?( 141GB)?( HBM3E)?", "H200"), (r"H200 NVL", "H200 NVL"),
                    (r"H100( SXM5?)?( 80GB)?( HBM3)?", "H100 SXM"), (r"H100 NVL", "H100 NVL"),
                    (r"A100 SXM4 80GB", "A100 SXM4 80GB"), (r"A100 80GB PCIE", "A100 PCIe 80GB"),
                    (r"A100 SXM4 40GB", "A100 SXM4 40GB"), (r"A100 PCIE 40GB", "A100 PCIe 40GB"),
                    (r"(GEFORCE )?RTX 4090", "RTX 4090"))


def datasheet_for(gpu_name: str, memory_bytes: int | None = None) -> GPUPeaks | None:
    """The datasheet entry of the part called ``gpu_name`` as ``torch.cuda.get_device_name`` gives it, or None when
    the name is not exactly one of the parts in :data:`GPU_DATASHEETS`.

    ``memory_bytes``: the memory the device itself reports (``total_memory``). The entry then carries that size
    (in GiB), and a device whose memory is not the datasheet's (more, or under 90% of it: another variant
    under the same name, or a slice of the GPU) gets None."""
    if not isinstance(gpu_name, str):
        raise TypeError(f"gpu_name: expected the device's name as a str, got {type(gpu_name).__name__}")
    name = re.sub(r"\s+", " ", gpu_name.upper().replace("-", " ")).strip()
    name = name.removeprefix("NVIDIA ")
    key = next((key for pattern, key in _DATASHEET_NAMES if re.fullmatch(pattern, name)), None)
    if key is None:
        return None
    peaks = GPU_DATASHEETS[key]
    if memory_bytes is None:
        return peaks
    if not isinstance(memory_bytes, (int, np.integer)) or isinstance(memory_bytes, bool) or memory_bytes < 1:
        raise ValueError(f"memory_bytes={memory_bytes!r}: expected the device's memory in bytes (a positive int) or None")
    device_gib = memory_bytes / GiB
    if not 0.9 * peaks.memory_gb <= device_gib <= peaks.memory_gb:
        return None
    return dataclasses.replace(peaks, memory_gb=round(device_gib, 2), source=f"{peaks.source}; memory as the device reports it")


def gpu_reports() -> tuple[GPUReport, ...]:
    if not torch.cuda.is_available():
        return ()
    reports = []
    for index in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(index)
        reports.append(GPUReport(p.name, p.multi_processor_count, p.total_memory, (p.major, p.minor),
                                  datasheet_for(p.name, p.total_memory)))
    return tuple(reports)


def machine_report() -> MachineReport:
    """This machine's CPU (model, cores, SMT, NUMA nodes, caches and line size, memory) and GPUs
    (name, SMs, memory, datasheet peaks for the GPUs in :data:`GPU_DATASHEETS`)."""
    return MachineReport(cpu_report(), gpu_reports())


# ----------------------------------------------------------------------------- timing
@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per call of ``repeats`` samples (each the mean of ``number`` back-to-back calls)."""

    samples: tuple[float, ...]
    number: int
    warmup: int
    synchronized: bool
    result: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def iqr(self) -> float:
        """Interquartile range (seconds): the spread of the middle half of the samples."""
        return _iqr(self.samples)

    @property
    def cold(self) -> bool:
        """True when the first call was timed (``warmup=0``): compilation and first-touch costs are in it."""
        return self.warmup == 0

    def __str__(self) -> str:
        text = f"{format_seconds(self.median)} median, IQR {format_seconds(self.iqr)} ({len(self.samples)} x {self.number} calls)"
        return text + (" [includes the first call]" if self.cold else "")


def _iqr(values) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[2] - q[0]


def format_seconds(seconds: float) -> str:
    """``0.0012`` → ``'1.2 ms'``: three significant digits in s, ms, µs or ns."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _default_sync() -> Callable[[], None] | None:
    if torch.cuda.is_available():
        return torch.cuda.synchronize
    if hasattr(torch, "accelerator") and torch.accelerator.is_available():
        return torch.accelerator.synchronize
    return None


def timeit(fn: Callable, *args, warmup: int = 1, repeats: int = 7, number: int | None = None,
           sync: bool | Callable[[], None] = True, setup: Callable[[], Any] | None = None,
           min_sample_s: float = 0.01, cold: bool = False, **kwargs) -> Timing:
    """Time ``fn(*args, **kwargs)``: ``warmup`` untimed calls, then ``repeats`` samples of ``number``
    calls each (chosen so one sample takes about ``min_sample_s`` when ``number`` is None).

    - ``sync=True`` synchronizes the GPU (CUDA or another accelerator, when present) before starting
      and after finishing each sample, so asynchronous kernels are inside the time; a callable is used
      as the synchronize function; ``sync=False`` times only the launches (to show that pitfall).
    - ``setup()`` runs untimed before each sample (e.g. a fresh cache); with it, ``number`` defaults to 1.
    - ``warmup=0`` times the first call, which pays for compilation, lazy initialization and first-touch
      page faults: it is refused unless ``cold=True`` says that is what you want.

    The samples are timed by ``torch.utils.benchmark.Timer`` (its ``timeit`` loop: garbage collection
    off while a sample runs) with this function's clock, at torch's current thread count. Returns a
    :class:`Timing` (median, IQR, min, mean and every sample, in seconds per call; ``result`` holds
    the last call's return value).
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    for name, value, low in (("warmup", warmup, 0), ("repeats", repeats, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r}: expected an int >= {low}")
    if number is not None and (not isinstance(number, int) or isinstance(number, bool) or number < 1):
        raise ValueError(f"number={number!r}: expected an int >= 1 (calls per sample) or None (chosen for you)")
    if warmup == 0 and not cold:
        raise ValueError("warmup=0 would time the first call, which includes one-off costs (torch.compile's "
                         "compilation, lazy initialization, allocation and page faults); give warmup >= 1, or pass "
                         "cold=True to time the first call on purpose")
    run, last, synchronized = _sampler(fn, args, kwargs, sync, setup)
    for _ in range(warmup):
        run(1)
    if number is None:
        number = 1 if setup or cold else _calls_per_sample(run, min_sample_s)
    samples = tuple(max(run(number), 1e-9) / number for _ in range(repeats))
    return Timing(samples, number, warmup, synchronized, last[0])


def _sampler(fn: Callable, args: tuple, kwargs: dict, sync, setup):
    """``(run, last, synchronized)``: ``run(number)`` is the seconds of ``number`` calls of
    ``fn(*args, **kwargs)`` after an untimed ``setup()``, timed by ``torch.utils.benchmark.Timer``'s
    loop with a clock that synchronizes the GPU; ``last[0]`` holds the last call's result."""
    from torch.utils.benchmark import Timer

    synchronize = sync if callable(sync) else (_default_sync() if sync else None)
    last: list = [None]

    def call():
        last[0] = fn(*args, **kwargs)

    def clock() -> float:
        if synchronize is not None:
            synchronize()
        return time.perf_counter()

    timer = Timer(stmt="call()", setup="setup()" if setup else "pass", timer=clock,
                  globals={"call": call, "setup": setup}, num_threads=torch.get_num_threads())
    return timer._timer.timeit, last, synchronize is not None  # the stdlib timeit loop torch's Timer wraps


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Two callables timed in alternation: ``ratios[i]`` = baseline's i-th sample / candidate's i-th sample."""

    baseline: Timing
    candidate: Timing
    ratios: tuple[float, ...]

    @property
    def speedup(self) -> float:
        """How many times faster the candidate is: the median of the paired ratios."""
        return statistics.median(self.ratios)


def compare(baseline: Callable[[], Any], candidate: Callable[[], Any], repeats: int = 7, warmup: int = 1,
            sync: bool | Callable[[], None] = True, min_sample_s: float = 0.01, threads: int | None = None) -> Comparison:
    """Time ``baseline()`` and ``candidate()`` (no arguments: wrap them in lambdas) sample by sample in
    alternation, so that both see the same load from other programs, and return their
    :class:`Timing` s and the per-pair ratios (the robust way to measure a speed-up on a busy machine).

    ``threads``: torch's thread count while timing (e.g. 1: a parallel op on a machine whose other
    cores are busy waits for its slowest thread, which makes its time erratic); default: unchanged."""
    for name, fn in (("baseline", baseline), ("candidate", candidate)):
        if not callable(fn):
            raise TypeError(f"{name}: expected a callable, got {type(fn).__name__}")
    for name, value in (("warmup", warmup), ("repeats", repeats)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an int >= 1")
    samples: tuple[list, list] = ([], [])
    with _threads(threads):
        runs = [_sampler(fn, (), {}, sync, None) for fn in (baseline, candidate)]
        for run, _, _ in runs:
            for _ in range(warmup):
                run(1)
        numbers = [_calls_per_sample(run, min_sample_s) for run, _, _ in runs]
        for _ in range(repeats):
            for (run, _, _), number, out in zip(runs, numbers, samples):
                out.append(max(run(number), 1e-9) / number)
    timings = [Timing(tuple(out), number, warmup, synced, last[0]) for (_, last, synced), number, out in zip(runs, numbers, samples)]
    return Comparison(timings[0], timings[1], tuple(a / b for a, b in zip(*samples)))


class CoreCompetitor:
    """Another program on this program's core, to see what noise does to a measurement.

    ``with CoreCompetitor() as rival:`` pins this process to one of its cores and starts a process
    that spins on the same core, paused; ``rival.resume()`` and ``rival.pause()`` (SIGCONT, SIGSTOP)
    let it compete for the core only while wanted, so that :func:`compare` can alternate quiet and
    noisy samples. On leaving, the rival is killed and this process's cores are restored. Needs
    Linux's ``sched_setaffinity`` (:meth:`available`)."""

    @staticmethod
    def available() -> bool:
        return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")

    def __enter__(self) -> "CoreCompetitor":
        if not self.available():
            raise RuntimeError("CoreCompetitor needs os.sched_setaffinity (Linux): this platform cannot pin processes to cores")
        import signal
        import sys

        self._cores = os.sched_getaffinity(0)
        core = {min(self._cores)}
        os.sched_setaffinity(0, core)
        self._signal = signal
        self._process = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        try:
            os.sched_setaffinity(self._process.pid, core)
            self.pause()
        except BaseException:
            self.__exit__()
            raise
        return self

    def resume(self) -> None:
        os.kill(self._process.pid, self._signal.SIGCONT)

    def pause(self) -> None:
        os.kill(self._process.pid, self._signal.SIGSTOP)

    def __exit__(self, *exc) -> None:
        self._process.kill()
        self._process.wait()
        os.sched_setaffinity(0, self._cores)


def cache_flush_bytes(cache_bytes: int, factor: int = 2) -> int:
    """Bytes to write between two timed runs so that a cache of ``cache_bytes`` (a GPU's L2, a CPU's last
    level) no longer holds the inputs of the last run: ``factor`` times its size (caches do not evict in
    perfect least-recently-used order, so writing exactly its size leaves some lines behind), rounded up
    to whole 4-byte words. ``triton.testing.do_bench`` writes a fixed 256 MiB, 5x an H100's 50 MiB L2."""
    _positive_ints(cache_bytes=cache_bytes, factor=factor)
    return -(-factor * cache_bytes // 4) * 4


class CacheFlush:
    """Evicts a cache of ``cache_bytes`` when called, by zeroing a buffer of :func:`cache_flush_bytes` on
    ``device`` (allocated once, here): call it before each timed run to time the run with cold caches, as
    ``triton.testing.do_bench`` does."""

    def __init__(self, cache_bytes: int, device: str | torch.device = "cpu", factor: int = 2):
        try:
            device = check_device(device)
        except RuntimeError as error:  # torch.device's own refusal of a name it does not know
            raise ValueError(f"device={device!r}: expected 'cpu', 'cuda' or 'cuda:N' ({error})") from None
        self.buffer = torch.empty(cache_flush_bytes(cache_bytes, factor) // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self.buffer.zero_()


def time_with_events(call: Callable[[], Any], make_event: Callable[[], Any], synchronize: Callable[[], None],
                     warmup: int = 5, repeats: int = 20, flush: Callable[[], None] | None = None) -> tuple[list[float], Any]:
    """The timing loop of :func:`gpu_time` (and of ``triton.testing.do_bench``): ``warmup`` untimed calls, then
    ``repeats`` runs of ``call()``, each between two events recorded on the device's queue (``make_event()``
    returns an object with ``record()`` and ``elapsed_time(other)`` in milliseconds, as ``torch.cuda.Event``),
    with ``flush()`` (a cache eviction) queued before each start event, so it is outside the time. The host
    synchronizes once, after the last run: the events were stamped by the device as it reached them, so no
    host clock and no per-run synchronization is needed. Returns the milliseconds per run and the last result."""
    if not callable(call):
        raise TypeError(f"call: expected a callable, got {type(call).__name__}")
    for name, value, low in (("warmup", warmup, 0), ("repeats", repeats, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r}: expected an int >= {low}")
    for _ in range(warmup):
        call()
    synchronize()
    pairs = [(make_event(), make_event()) for _ in range(repeats)]
    result = None
    for start, end in pairs:
        if flush is not None:
            flush()
        start.record()
        result = call()
        end.record()
    synchronize()
    return [start.elapsed_time(end) for start, end in pairs], result


GPU_TIMING_NEEDS_CUDA = ("CUDA events are stamped by the GPU as it reaches them in its queue; this machine has no CUDA "
                         "device. On a CPU every op has finished when its call returns, so a host clock (timeit) "
                         "already times the work, and triton.testing.do_bench fails under Triton's interpreter")


def gpu_time(fn: Callable, *args, warmup: int = 5, repeats: int = 20, flush_l2: bool = True,
             device: str | torch.device | None = None, **kwargs) -> Timing:
    """Time ``fn(*args, **kwargs)`` on a CUDA GPU with CUDA events (:func:`time_with_events`): ``warmup`` calls,
    then ``repeats`` single runs, each after the GPU's L2 is flushed (a buffer of twice its size, from
    ``torch.cuda.get_device_properties(device).L2_cache_size``, is zeroed; ``flush_l2=False`` keeps the
    inputs warm in L2, which is what a small op repeated in a loop would see, and not what it sees inside a
    model). Returns a :class:`Timing` of one call per sample. Raises ``RuntimeError`` with the reason
    (:data:`GPU_TIMING_NEEDS_CUDA`) where no CUDA device is present."""
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"gpu_time: {GPU_TIMING_NEEDS_CUDA}")
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda":
        raise ValueError(f"device={device}: expected a CUDA device")
    with torch.cuda.device(device):
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        flush = CacheFlush(l2, device) if flush_l2 else None
        ms, result = time_with_events(lambda: fn(*args, **kwargs), lambda: torch.cuda.Event(enable_timing=True),
                                      torch.cuda.synchronize, warmup, repeats, flush)
    return Timing(tuple(max(m, 1e-6) / 1e3 for m in ms), 1, warmup, True, result)


def _calls_per_sample(run, min_sample_s: float, limit: int = 1 << 20) -> int:
    """Calls per sample so that one sample lasts about ``min_sample_s``: clock overhead and timer
    resolution then stay far below the measured time (these calls are warm-up too)."""
    number, elapsed = 1, run(1)
    while elapsed < min_sample_s / 2 and number < limit:
        number = min(limit, number * max(2, min(100, int(min_sample_s / max(elapsed, 1e-7)))))
        elapsed = run(number)
    return number


# ----------------------------------------------------------------------------- the memory hierarchy
def _sizes(sizes: Iterable[int], name: str = "sizes") -> list[int]:
    sizes = list(sizes)
    if not sizes or any(not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s <= 0 for s in sizes):
        raise ValueError(f"{name}: expected a non-empty list of positive ints (bytes), got {sizes!r}")
    if sorted(sizes) != sizes or len(set(sizes)) != len(sizes):
        raise ValueError(f"{name}: expected increasing sizes, got {sizes!r}")
    return [int(s) for s in sizes]


class _threads:
    """Run the body with ``torch.set_num_threads(n)``, restoring the old count after."""

    def __init__(self, n: int | None):
        self.n, self.old = n, torch.get_num_threads()

    def __enter__(self):
        if self.n:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.old)


def bandwidth_sweep(sizes: Iterable[int], mode: str = "read", traffic_bytes: int = 64 * MiB, repeats: int = 5,
                    threads: int | None = 1, device: str | torch.device = "cpu") -> list[dict]:
    """GB/s streaming through a float32 working set of each size in ``sizes`` (bytes, increasing), held on
    ``device`` (a GPU's memory is measured by the GPU's own kernels, synchronized around each sample).

    ``mode="read"``: one ``sum`` over the buffer seen ``traffic_bytes / size`` times through a
    stride-0 view (``buf.expand(reps, n)``), so a 32 KiB buffer is read over and over from L1 within
    one call, without a Python loop or a kernel launch per pass. ``mode="copy"``: ``dst.copy_(src)``
    of the working set (half source, half destination) repeated in a Python loop; each call's
    dispatch (about a microsecond) caps the small sizes. ``mode="dot"``: ``torch.dot`` of the working
    set's two halves, repeated in a Python loop: the BLAS library's own vector code (two flops per
    8 bytes read), faster than memory on every CPU code path, whereas PyTorch's non-vectorised kernels
    (``ATEN_CPU_CAPABILITY=default``) make ``sum``'s adds the bottleneck; dispatch caps its small sizes.
    The sizes are sampled in rounds (one sample of each per round), so that a burst of load from
    another program hits all of them alike. One thread by default (one core's view of its caches).
    Rows: ``size_bytes``, ``gb_per_s`` (median), ``iqr_gb_per_s``, ``best_gb_per_s`` (the fastest sample),
    ``seconds``, ``device``."""
    sizes = _sizes(sizes)
    device = torch.device(device)
    if mode not in ("read", "copy", "dot"):
        raise ValueError(f"mode={mode!r}: expected 'read', 'copy' or 'dot'")
    runs = []
    with _threads(threads), torch.no_grad():
        for size in sizes:
            reps = max(1, traffic_bytes // size)
            if mode == "read":
                buf = torch.ones(max(1, size // 4), device=device)
                fn = buf.expand(reps, buf.numel()).sum
                moved = reps * buf.numel() * 4
            else:
                src = torch.ones(max(1, size // 8), device=device)
                dst = torch.ones_like(src)

                def fn(src=src, dst=dst, reps=reps, op=torch.dot if mode == "dot" else torch.Tensor.copy_):
                    for _ in range(reps):
                        op(dst, src)

                moved = reps * src.numel() * 4 * 2
            run = _sampler(fn, (), {}, True, None)[0]
            run(1)  # warm-up: first touch of the buffers
            runs.append((size, run, moved))
        samples = [[] for _ in runs]
        for _ in range(repeats):  # one sample of every size per round
            for (_, run, _), out in zip(runs, samples):
                out.append(max(run(1), 1e-9))
    rows = []
    for (size, _, moved), times in zip(runs, samples):
        seconds = statistics.median(times)
        rows.append(dict(size_bytes=size, gb_per_s=moved / seconds / 1e9, iqr_gb_per_s=_iqr([moved / t / 1e9 for t in times]),
                         best_gb_per_s=moved / min(times) / 1e9, seconds=seconds, device=str(device)))
    return rows


def bandwidth_by_level(caches: Iterable[Cache], rows: list[dict]) -> list[dict]:
    """Each data cache of ``caches`` (a :class:`CPUReport`'s) with the bandwidth :func:`bandwidth_sweep` measured there:
    the ``rows`` entry of the largest working set at most half the level's size (the other half is left to the code,
    the stack and the level's own associativity), then ``"memory"`` with the largest working set of all. Rows:
    ``level``, ``size_bytes`` (None for memory), ``working_set``, ``gb_per_s``; a level no row fits is left out."""
    if not rows:
        raise ValueError("rows: expected the rows of bandwidth_sweep")
    by_size = sorted(rows, key=lambda r: r["size_bytes"])
    levels = []
    for cache in sorted((c for c in caches if c.kind != "Instruction"), key=lambda c: c.level):
        fitting = [r for r in by_size if r["size_bytes"] <= cache.size_bytes // 2]
        if fitting:
            levels.append(dict(level=cache.name, size_bytes=cache.size_bytes, working_set=fitting[-1]["size_bytes"],
                               gb_per_s=fitting[-1]["gb_per_s"]))
    levels.append(dict(level="memory", size_bytes=None, working_set=by_size[-1]["size_bytes"], gb_per_s=by_size[-1]["gb_per_s"]))
    return levels


def random_cycle(n: int, seed: int = 0) -> np.ndarray:
    """``next`` (int64, length ``n``) of one random cycle through all ``n`` slots: following
    ``i = next[i]`` from any slot visits every slot once, in an order no prefetcher can guess."""
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n={n!r}: expected a positive int")
    # torch's randperm: about 4x faster than numpy's permutation for the 8M slots of a 64 MiB table, where the
    # shuffle's random writes, not the walk, were most of the latency sweep's time
    order = torch.randperm(int(n), generator=torch.Generator().manual_seed(seed)).numpy()
    nxt = np.empty(n, dtype=np.int64)
    nxt[order[:-1]] = order[1:]  # each slot of the order links to the next one, the last back to the first
    nxt[order[-1]] = order[0]
    return nxt


def chase(table, steps: int, start: int = 0) -> int:
    """Follow ``steps`` links of a pointer-chasing table: each load's address is the value the
    previous load returned, so the CPU cannot start one before the last one finished."""
    i = start
    for _ in range(steps):
        i = table[i]
    return i


def latency_sweep(sizes: Iterable[int], steps: int = 100_000, repeats: int = 7, seed: int = 0) -> list[dict]:
    """Nanoseconds per step of a dependent chain (:func:`chase`) through a random cycle
    (:func:`random_cycle`) of 8-byte slots filling a working set of each size in ``sizes`` (bytes).

    Each sample continues the walk where the last one stopped, so in a cycle larger than all the
    steps taken every load goes to a slot not visited before: its line is in no cache unless the
    whole table fits there. The sizes are sampled in rounds (one sample of each per round), so that
    a burst of load from another program hits all of them alike. The chain is followed by Python,
    whose loop costs tens of nanoseconds per step on its own, more than an L1 or L2 hit: the
    smallest size's time is that overhead plus an L1 hit, and ``extra_ns`` = time - the smallest
    size's time is the latency the larger working sets add. Rows: ``size_bytes``, ``ns_per_step``
    (median), ``iqr_ns``, ``best_ns`` (the fastest sample: other programs only ever slow a sample down),
    ``extra_ns``."""
    sizes = _sizes(sizes)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: expected a positive int")
    runs = []
    for size in sizes:
        table = memoryview(random_cycle(max(2, size // 8), seed))
        position = [0]

        def walk(table=table, position=position):
            position[0] = chase(table, steps, position[0])

        run = _sampler(walk, (), {}, False, None)[0]
        run(1)  # warm-up: the table's first touch, and the start of the walk
        runs.append(run)
    samples = [[] for _ in sizes]
    for _ in range(repeats):  # one sample of every size per round: all sizes see the same load from other programs
        for run, out in zip(runs, samples):
            out.append(run(1) / steps * 1e9)
    rows = [dict(size_bytes=size, ns_per_step=statistics.median(out), iqr_ns=_iqr(out), best_ns=min(out))
            for size, out in zip(sizes, samples)]
    for row in rows:
        row["extra_ns"] = row["ns_per_step"] - rows[0]["ns_per_step"]
    return rows


def stride_sweep(strides: Iterable[int], span_bytes: int = 64 * MiB, repeats: int = 5, threads: int | None = 1,
                 line_bytes: int = 64) -> list[dict]:
    """Sum every ``stride``-th float32 value (``stride`` >= 2) of one buffer of ``span_bytes``, for each stride.

    Every stride reads across the same span, so the same pages and the same cache levels are under it; what
    changes is how many of the values in each line are used. Memory moves whole lines: below the line size a
    stride twice as long uses half as many values of every line, so the lines fetched (the whole span) stay the
    same and the time per element doubles; from the line size on, every element costs one line and the time per
    element levels off. Rows: ``stride``, ``stride_bytes``, ``elements``, ``seconds`` (median), ``ns_per_element``,
    ``bytes_touched`` (the ``line_bytes`` lines under the elements: the whole span below the line size, one line
    per element above)."""
    strides = _sizes(strides, "strides")
    if strides[0] < 2:
        raise ValueError(f"strides={strides!r}: expected strides >= 2 (stride 1 runs a different, vectorized loop)")
    _positive_ints(span_bytes=span_bytes, line_bytes=line_bytes)
    if span_bytes < 4 * strides[-1]:
        raise ValueError(f"span_bytes={span_bytes}: expected at least the largest stride, {4 * strides[-1]} bytes")
    buf = torch.ones(span_bytes // 4)
    rows = []
    with _threads(threads), torch.no_grad():
        for stride in strides:
            view = buf[::stride]
            elements = view.numel()
            timing = timeit(view.sum, repeats=repeats, number=1)
            rows.append(dict(stride=stride, stride_bytes=4 * stride, elements=elements, seconds=timing.median,
                             ns_per_element=timing.median / elements * 1e9,
                             bytes_touched=elements * min(line_bytes, 4 * stride)))
    return rows


def matmul_flops(sizes: Iterable[int], dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 repeats: int = 5, threads: int | None = None) -> list[dict]:
    """GFLOP/s of an ``n x n @ n x n`` matmul for each ``n`` in ``sizes`` (2 n^3 FLOPs per call), at
    torch's current thread count unless ``threads`` is given. Rows: ``n``, ``seconds`` (median), ``gflop_per_s``,
    ``best_gflop_per_s`` (the fastest sample), ``device``."""
    sizes = _sizes(sizes)
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with _threads(threads), torch.no_grad():
        for n in sizes:
            a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
            b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
            timing = timeit(torch.matmul, a, b, repeats=repeats)
            rows.append(dict(n=n, seconds=timing.median, gflop_per_s=2 * n**3 / timing.median / 1e9,
                             best_gflop_per_s=2 * n**3 / timing.min / 1e9, device=str(device)))
    return rows


# ----------------------------------------------------------------------------- roofline
@dataclasses.dataclass(frozen=True)
class OpCost:
    """FLOPs done and bytes moved between memory and the chip by one operator (ideal: each input
    read once, each output written once)."""

    flops: int
    bytes: int

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes


def element_size(dtype: torch.dtype) -> int:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype such as torch.bfloat16, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


def matmul_cost(m: int, k: int, n: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(flops, bytes)`` of ``[m, k] @ [k, n]``: a multiply and an add for each of the ``m n k``
    products, and A, B read and C written once."""
    _positive_ints(m=m, k=k, n=n)
    return 2 * m * k * n, (m * k + k * n + m * n) * element_size(dtype)


def add_cost(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
    """``(flops, bytes)`` of ``x + y`` with ``x``, ``y`` and the output all of ``shape``: one FLOP per
    element, two inputs read and one output written."""
    numel = _numel(shape)
    return numel, 3 * numel * element_size(dtype)


def _positive_ints(**values) -> None:
    for name, v in values.items():
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r}: expected a positive int")


def _numel(shape) -> int:
    if not isinstance(shape, (tuple, list, torch.Size)) or not shape:
        raise ValueError(f"shape={shape!r}: expected a non-empty tuple of positive ints")
    _positive_ints(**{f"shape[{i}]": s for i, s in enumerate(shape)})
    return math.prod(shape)


# FLOPs per element of the row-wise ops, counted as the chapter does: RMSNorm squares, sums, scales by
# 1/rms and by the weight (4) plus mean, +eps and rsqrt once per row (3); softmax takes the max,
# subtracts it, exponentiates, sums and divides (5).
RMSNORM_FLOPS_PER_ELEMENT, RMSNORM_FLOPS_PER_ROW, SOFTMAX_FLOPS_PER_ELEMENT = 4, 3, 5
OPS = ("matmul", "add", "rmsnorm", "softmax", "attention_naive", "attention_flash")


def arithmetic_intensity(op: str, shapes: tuple, dtype: torch.dtype = torch.float32) -> OpCost:
    """FLOPs and bytes of one operator (:class:`OpCost`, ``.intensity`` in FLOP/byte).

    - ``"matmul"``, shapes ``(m, k, n)``: :func:`matmul_cost`;
    - ``"add"``, shapes = the tensor's shape: :func:`add_cost`;
    - ``"rmsnorm"``, ``(rows, d)``: x read, weight read, y written;
    - ``"softmax"``, ``(rows, d)`` along the last dim: x read, y written (one fused pass);
    - ``"attention_naive"``, ``(batch, heads, seq, head_dim)``, no mask: ``S = QK^T`` written to
      memory, read by the softmax, ``P`` written and read again by ``PV``;
    - ``"attention_flash"``: the same FLOPs, but S and P stay on chip: Q, K, V read and O written once.
    """
    size = element_size(dtype)
    if op == "matmul":
        if len(shapes) != 3:
            raise ValueError(f"shapes={shapes!r}: matmul takes (m, k, n)")
        return OpCost(*matmul_cost(*shapes, dtype))
    if op == "add":
        return OpCost(*add_cost(tuple(shapes), dtype))
    if op in ("rmsnorm", "softmax"):
        if len(shapes) != 2:
            raise ValueError(f"shapes={shapes!r}: {op} takes (rows, d)")
        rows, d = shapes
        numel = _numel((rows, d))
        if op == "rmsnorm":
            return OpCost(RMSNORM_FLOPS_PER_ELEMENT * numel + RMSNORM_FLOPS_PER_ROW * rows, (2 * numel + d) * size)
        return OpCost(SOFTMAX_FLOPS_PER_ELEMENT * numel, 2 * numel * size)
    if op in ("attention_naive", "attention_flash"):
        if len(shapes) != 4:
            raise ValueError(f"shapes={shapes!r}: {op} takes (batch, heads, seq, head_dim)")
        b, h, s, d = shapes
        _numel(shapes)
        scores = b * h * s * s
        qkvo = 4 * b * h * s * d
        flops = 2 * 2 * scores * d + SOFTMAX_FLOPS_PER_ELEMENT * scores  # QK^T and PV, softmax
        if op == "attention_naive":
            return OpCost(flops, (qkvo + 4 * scores) * size)  # S written + read, P written + read
        return OpCost(flops, qkvo * size)
    raise ValueError(f"op={op!r}: expected one of {', '.join(OPS)}")


def roofline_time(flops: float, bytes_moved: float, peak_flops: float, bandwidth: float) -> float:
    """Predicted seconds of an operator on a roofline: compute and memory traffic overlap, so the
    slower of the two, ``max(flops / peak_flops, bytes_moved / bandwidth)``, sets the time."""
    for name, value in (("flops", flops), ("bytes_moved", bytes_moved)):
        if not value >= 0:
            raise ValueError(f"{name}={value!r}: expected a number >= 0")
    for name, value in (("peak_flops", peak_flops), ("bandwidth", bandwidth)):
        if not value > 0:
            raise ValueError(f"{name}={value!r}: expected a positive number (FLOP/s, bytes/s)")
    return max(flops / peak_flops, bytes_moved / bandwidth)


@dataclasses.dataclass(frozen=True)
class Roofline:
    """A machine as two ceilings: ``peak_flops`` (FLOP/s) and ``bandwidth`` (bytes/s)."""

    name: str
    peak_flops: float
    bandwidth: float
    source: str

    def __post_init__(self):
        if not (self.peak_flops > 0 and self.bandwidth > 0):
            raise ValueError(f"Roofline {self.name!r}: peak_flops and bandwidth must be positive")

    @property
    def ridge(self) -> float:
        """The intensity (FLOP/byte) where the two ceilings meet: below it an op is memory-bound."""
        return self.peak_flops / self.bandwidth

    def attainable(self, intensity: float) -> float:
        """FLOP/s the roofline allows at ``intensity``: ``min(peak, intensity x bandwidth)``."""
        return min(self.peak_flops, intensity * self.bandwidth)

    def bound(self, cost: OpCost) -> str:
        return "memory" if cost.intensity < self.ridge else "compute"

    def predict_seconds(self, cost: OpCost) -> float:
        return roofline_time(cost.flops, cost.bytes, self.peak_flops, self.bandwidth)

    @classmethod
    def datasheet(cls, gpu: str, dtype: torch.dtype = torch.bfloat16) -> "Roofline":
        """The roofline of a GPU in :data:`GPU_DATASHEETS` for ``dtype``'s tensor-core peak."""
        if gpu not in GPU_DATASHEETS:
            raise ValueError(f"gpu={gpu!r}: expected one of {', '.join(GPU_DATASHEETS)}")
        peaks = GPU_DATASHEETS[gpu]
        key = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.float8_e4m3fn: "float8", torch.float8_e5m2: "float8"}.get(dtype)
        if key not in peaks.tflops:
            raise ValueError(f"dtype={dtype}: the {peaks.name} datasheet lists {', '.join(peaks.tflops)}")
        return cls(f"{peaks.name} ({key})", peaks.tflops[key] * 1e12, peaks.bandwidth_tb_s * 1e12, peaks.source)

    @classmethod
    def measured(cls, name: str, flop_rows: list[dict], bandwidth_rows: list[dict]) -> "Roofline":
        """From :func:`matmul_flops` and :func:`bandwidth_sweep` rows: the best matmul rate and the
        bandwidth of the largest working set (memory, not a cache), each from its fastest sample where the rows
        have one (``best_*``; else the median): a ceiling is what the machine can do, and other programs only
        ever slow a sample down. Both must come from one device (their ``device`` key): a GPU's compute over
        its host's memory bandwidth is no machine's roofline."""
        if not flop_rows or not bandwidth_rows:
            raise ValueError("flop_rows, bandwidth_rows: expected the rows of matmul_flops and bandwidth_sweep")
        devices = {"flop_rows": {r.get("device") for r in flop_rows}, "bandwidth_rows": {r.get("device") for r in bandwidth_rows}}
        if len(devices["flop_rows"] | devices["bandwidth_rows"]) != 1:
            raise ValueError(f"flop_rows measured on {sorted(map(str, devices['flop_rows']))}, bandwidth_rows on "
                             f"{sorted(map(str, devices['bandwidth_rows']))}: expected both ceilings measured on one device "
                             f"(pass the same device to matmul_flops and bandwidth_sweep)")
        peak = max(r.get("best_gflop_per_s", r["gflop_per_s"]) for r in flop_rows) * 1e9
        bandwidth = bandwidth_rows[-1].get("best_gb_per_s", bandwidth_rows[-1]["gb_per_s"]) * 1e9
        where = f" on {flop_rows[0]['device']}" if flop_rows[0].get("device") else ""
        return cls(name, peak, bandwidth, f"measured{where}: best of matmul_flops, bandwidth_sweep at "
                                          f"{format_bytes(bandwidth_rows[-1]['size_bytes'])}")


# ----------------------------------------------------------------------------- inside a GPU
@dataclasses.dataclass(frozen=True)
class SMLayout:
    """What a GPU's streaming multiprocessors (SMs) hold, as its architecture whitepaper gives it."""

    sms: int
    registers_per_sm: int  # 32-bit registers
    shared_memory_per_sm: int  # bytes a kernel can use as shared memory (the rest of the L1/shared array stays L1)
    shared_bytes_per_clock: int  # per SM: 32 banks of 4 bytes
    fp32_lanes_per_sm: int  # FP32 FMA units
    l2_bytes: int
    source: str


# GH100 as the H100 SXM5 and the H200 SXM enable it: the same die and SM count, different HBM.
_HOPPER_LAYOUT = SMLayout(sms=132, registers_per_sm=65536, shared_memory_per_sm=228 * KiB, shared_bytes_per_clock=128,
                          fp32_lanes_per_sm=128, l2_bytes=50 * MiB,
                          source="NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022): 132 SMs (SXM5), "
                                 "64K 32-bit registers and up to 228 KB of shared memory per SM, 128 FP32 units "
                                 "per SM, 50 MB L2; shared memory: 32 banks x 4 bytes per clock")
GPU_SM_LAYOUTS: dict[str, SMLayout] = {"H100 SXM": _HOPPER_LAYOUT, "H200": _HOPPER_LAYOUT}


def sm_clock_hz(gpu: str) -> float:
    """The clock at which ``gpu``'s datasheet fp32 peak is reached: peak / (2 FLOPs x FP32 units per SM x SMs)."""
    layout, peaks = _layout_and_peaks(gpu)
    return peaks.tflops["float32"] * 1e12 / (2 * layout.fp32_lanes_per_sm * layout.sms)


def _layout_and_peaks(gpu: str) -> tuple[SMLayout, GPUPeaks]:
    if gpu not in GPU_SM_LAYOUTS:
        raise ValueError(f"gpu={gpu!r}: expected one of {', '.join(GPU_SM_LAYOUTS)}")
    return GPU_SM_LAYOUTS[gpu], GPU_DATASHEETS[gpu]


def gpu_memory_hierarchy(gpu: str) -> list[dict]:
    """The memory levels of ``gpu`` (a key of :data:`GPU_SM_LAYOUTS`) from the chip outward, from published figures.

    Rows: ``level``, ``bytes`` (the whole chip), ``bytes_per_sm`` (None for chip-wide levels), ``tb_per_s`` (None where
    nothing published gives it: NVIDIA quotes no L2 bandwidth) and ``how`` (where the figures come from). The
    register file's rate is what the FP32 units read (3 operands of 4 bytes per FMA at the fp32 peak), shared
    memory's its banks' bytes per clock over all SMs at :func:`sm_clock_hz`."""
    layout, peaks = _layout_and_peaks(gpu)
    clock = sm_clock_hz(gpu)
    fma_per_s = peaks.tflops["float32"] * 1e12 / 2
    return [
        dict(level="registers", bytes=layout.registers_per_sm * 4 * layout.sms, bytes_per_sm=layout.registers_per_sm * 4,
             tb_per_s=fma_per_s * 3 * 4 / 1e12, how="3 operands x 4 B per FMA at the fp32 peak"),
        dict(level="shared memory", bytes=layout.shared_memory_per_sm * layout.sms, bytes_per_sm=layout.shared_memory_per_sm,
             tb_per_s=layout.shared_bytes_per_clock * layout.sms * clock / 1e12,
             how=f"{layout.shared_bytes_per_clock} B per clock per SM at {clock / 1e9:.2f} GHz"),
        dict(level="L2", bytes=layout.l2_bytes, bytes_per_sm=None, tb_per_s=None, how="size from the whitepaper; no bandwidth published"),
        dict(level="HBM", bytes=int(peaks.memory_gb * GiB), bytes_per_sm=None, tb_per_s=peaks.bandwidth_tb_s, how="datasheet"),
    ]


def tile_intensity(tile_m: int, tile_n: int, dtype: torch.dtype) -> float:
    """FLOPs per byte loaded of a ``tile_m x tile_n`` output tile of a matmul: each step along k loads a
    ``tile_m``-row slab of A and a ``tile_n``-column slab of B (``(tile_m + tile_n) k`` elements) for
    ``2 tile_m tile_n k`` FLOPs, whatever k is."""
    _positive_ints(tile_m=tile_m, tile_n=tile_n)
    return 2 * tile_m * tile_n / ((tile_m + tile_n) * element_size(dtype))


@dataclasses.dataclass(frozen=True)
class TileWaves:
    """An ``m x n`` matmul output cut into ``tile_m x tile_n`` tiles, one tile per SM at a time, on ``sms`` SMs.

    The last row and column of tiles stick out past the output (tile quantization), and the last wave of tiles
    leaves SMs idle unless the tile count is a multiple of ``sms`` (wave quantization). The shares are exact
    fractions."""

    m: int
    n: int
    tile_m: int
    tile_n: int
    sms: int

    @property
    def tiles(self) -> int:
        return -(-self.m // self.tile_m) * -(-self.n // self.tile_n)

    @property
    def waves(self) -> int:
        return -(-self.tiles // self.sms)

    @property
    def tile_efficiency(self) -> Fraction:
        """The share of the tiles' area that lies inside the output."""
        return Fraction(self.m * self.n, self.tiles * self.tile_m * self.tile_n)

    @property
    def wave_efficiency(self) -> Fraction:
        """The share of the waves' SM slots that hold a tile."""
        return Fraction(self.tiles, self.waves * self.sms)

    @property
    def efficiency(self) -> Fraction:
        """Useful output over what the waves could compute: tile efficiency x wave efficiency."""
        return self.tile_efficiency * self.wave_efficiency


def tile_waves(m: int, n: int, tile: tuple[int, int] = (128, 128), sms: int = 132) -> TileWaves:
    """:class:`TileWaves` of an ``m x n`` output in tiles of ``tile`` (rows, columns) on ``sms`` SMs (132: an H100
    SXM's or an H200's). A model of the simplest schedule: real GEMM libraries pick among tile shapes, and
    split-K or stream-K kernels divide the k loop to fill the last wave."""
    if not isinstance(tile, (tuple, list)) or len(tile) != 2:
        raise ValueError(f"tile={tile!r}: expected (tile_m, tile_n)")
    _positive_ints(m=m, n=n, tile_m=tile[0], tile_n=tile[1], sms=sms)
    return TileWaves(int(m), int(n), int(tile[0]), int(tile[1]), int(sms))


# ----------------------------------------------------------------------------- profiling
@dataclasses.dataclass(frozen=True)
class Profile:
    """The top ops of a profiled run (rows: ``name``, ``calls``, ``self_ms``, ``total_ms``,
    ``shapes``), the profiler's own table as text, the numbers of the steps it recorded, how many
    times each op ran in them (``calls``, by name), and the trace file if one was written."""

    rows: list[dict]
    table: str
    steps: tuple[int, ...]
    calls: dict[str, int]
    trace_path: Path | None

    def names(self) -> list[str]:
        return [r["name"] for r in self.rows]


def profile_step(fn: Callable, *args, wait: int = 1, warmup: int = 1, active: int = 3, row_limit: int = 12,
                 trace_path: str | Path | None = None, **kwargs) -> Profile:
    """Run ``fn(*args, **kwargs)`` as ``wait + warmup + active`` steps under ``torch.profiler.profile`` with
    ``schedule(wait=wait, warmup=warmup, active=active, repeat=1)``: the first ``wait`` steps run unprofiled,
    the next ``warmup`` with the profiler on and its results thrown away (its own start-up costs land
    there), and the last ``active`` steps are recorded (CPU ops, and CUDA kernels when a GPU is present,
    with input shapes). Returns the ``row_limit`` ops with the most self time, summed over the recorded
    steps and grouped by name and input shapes, every op's number of calls, and the step numbers recorded. With ``trace_path``,
    ``on_trace_ready`` writes the Chrome/Perfetto trace there when the active steps end (open it at
    https://ui.perfetto.dev or chrome://tracing)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    _positive_ints(active=active, row_limit=row_limit)
    for name, value in (("wait", wait), ("warmup", warmup)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}={value!r}: expected an int >= 0")
    path = None if trace_path is None else Path(trace_path)
    gpu = torch.cuda.is_available()
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else []),
                   schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1), record_shapes=True,
                   on_trace_ready=None if path is None else (lambda done: done.export_chrome_trace(str(path))))
    with _silent_stderr():
        prof.__enter__()
    try:
        for _ in range(wait + warmup + active):
            fn(*args, **kwargs)
            if gpu:
                torch.cuda.synchronize()
            with _silent_stderr():
                prof.step()
    finally:
        with _silent_stderr():
            prof.__exit__(None, None, None)
    steps = tuple(sorted(int(e.trace_name.split("#")[1]) for e in prof.events()  # each step's range, "ProfilerStep#N"
                         if (e.trace_name or "").startswith("ProfilerStep#")))
    averages = prof.key_averages(group_by_input_shape=True)
    ranked = sorted((e for e in averages if not e.key.startswith("ProfilerStep")), key=lambda e: e.self_cpu_time_total,
                    reverse=True)
    rows = [dict(name=e.key, calls=e.count, self_ms=e.self_cpu_time_total / 1e3, total_ms=e.cpu_time_total / 1e3,
                 shapes=str(e.input_shapes)) for e in ranked[:row_limit]]
    table = averages.table(sort_by="self_cpu_time_total", row_limit=row_limit)
    calls = {e.key: e.count for e in prof.key_averages() if not e.key.startswith("ProfilerStep")}
    return Profile(rows, table, steps, calls, path)


class _silent_stderr:
    """Send the process's stderr (file descriptor 2) to /dev/null for the body: the profiler library
    (kineto) prints two timestamped debug lines to it on every start and stop, which no setting turns off."""

    def __enter__(self):
        import sys

        sys.stderr.flush()
        self.saved = os.dup(2)
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)


def trace_events(path: str | Path) -> list[dict]:
    """The complete events (``"ph": "X"``) of a Chrome trace file: ``name``, ``ts`` and ``dur`` (µs)."""
    import json

    data = json.loads(Path(path).read_text())
    return [e for e in data.get("traceEvents", []) if e.get("ph") == "X"]


def profile_to_tempdir(fn: Callable, *args, **kwargs) -> tuple[Profile, list[dict]]:
    """:func:`profile_step` with its trace written to a temporary directory that is deleted again:
    returns the profile and the trace's events, read back before the file is removed."""
    with tempfile.TemporaryDirectory() as tmp:
        result = profile_step(fn, *args, trace_path=Path(tmp) / "trace.json", **kwargs)
        events = trace_events(result.trace_path)
    return dataclasses.replace(result, trace_path=None), events


# ----------------------------------------------------------------------------- the four kinds of slow
def softmax_rows_loop(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, one row at a time in Python: correct, and slow, because each row
    costs several tiny op dispatches (the slow loop of the chapter's last exercise)."""
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        row = x[i]
        e = (row - row.max()).exp()
        out[i] = e / e.sum()
    return out


def softmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of a 2-D tensor, all rows in one pass of vectorized ops."""
    e = (x - x.amax(dim=-1, keepdim=True)).exp()
    return e / e.sum(dim=-1, keepdim=True)


def gelu_unfused(x: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation) written as its formula: nine elementwise ops, each a full pass
    over memory with its own temporary. ``torch.nn.functional.gelu(x, approximate="tanh")`` computes
    the same in one pass."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


class SlowSamples(torch.utils.data.Dataset):
    """A dataset whose every sample costs ``wait_s`` seconds to fetch (a slow disk or network,
    modelled by a sleep, which leaves the CPU free) and returns ``(features, target)``."""

    def __init__(self, count: int, features: int, wait_s: float, seed: int = 0):
        _positive_ints(count=count, features=features)
        if not wait_s >= 0:
            raise ValueError(f"wait_s={wait_s!r}: expected seconds >= 0")
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(count, features, generator=gen)
        self.y = self.x.sum(dim=1, keepdim=True)
        self.wait_s = wait_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        time.sleep(self.wait_s)
        return self.x[index], self.y[index]


class Prefetcher:
    """``fn(item)`` for each of ``items``, computed ahead by ``workers`` background threads (at most
    ``depth`` results waiting) and yielded in order: the consumer's work overlaps the loading of the
    next items, and several slow loads overlap each other. ``DataLoader(num_workers=..., prefetch_factor=...)``
    does this with worker processes, which Python-heavy preprocessing needs (it holds the GIL); threads
    suffice when loading waits on I/O, which releases it."""

    def __init__(self, fn: Callable, items: Iterable, workers: int = 2, depth: int | None = None):
        if not callable(fn):
            raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
        _positive_ints(workers=workers)
        depth = 2 * workers if depth is None else depth
        _positive_ints(depth=depth)
        self.fn, self.items, self.workers, self.depth = fn, items, workers, depth

    def __iter__(self):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.workers) as pool:
            pending: collections.deque = collections.deque()
            for item in self.items:
                pending.append(pool.submit(self.fn, item))
                if len(pending) >= self.depth:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()


def load_batch(dataset, indices) -> tuple[torch.Tensor, torch.Tensor]:
    """Fetch ``dataset[i]`` for each of ``indices`` and stack them into a batch ``(x, y)``."""
    samples = [dataset[i] for i in indices]
    return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])


def train_epoch(model: torch.nn.Module, batches: Iterable, lr: float = 1e-2) -> float:
    """One SGD pass over ``batches`` of ``(x, y)`` with a mean-squared-error loss; returns the last loss
    (read once, at the end: a ``.item()`` per step would synchronize a GPU every step)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss = torch.zeros(())
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return float(loss.detach())


# ----------------------------------------------------------------------------- a slow training step to diagnose
BOTTLENECKS = ("data", "sync", "launch", "shape", "compute")
SYNC_OPS = ("aten::_local_scalar_dense", "aten::item")  # a value read back from the device: a GPU queue drains here
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")
LAUNCH_BOUND_OPS = 1000  # ops per step above which per-op dispatch and launch costs dominate a small model's step
LOW_INTENSITY = 10.0  # FLOP/byte: far below any CPU's or GPU's ridge point (chapter 09, section 3)
FIRST_CALL_REPEATS = 8  # the one-off cost of a TrainingStep's first calls, in multiples of a steady call


class TrainingStep:
    """One training step of an MLP, made slow for one reason (one of :data:`BOTTLENECKS`), to be diagnosed by
    measurement: ``load_batch()`` fetches the batch ``(x, y)``, ``run(batch)`` takes the step (forward, MSE loss,
    backward, SGD update) and returns the loss as a tensor (not read back). The first call of each pays a one-off
    cost, as first calls do (allocation, kernel choice, compilation in a real step): the first ``run`` does its
    forward and backward :data:`FIRST_CALL_REPEATS` more times, the first ``load_batch`` waits as many times its
    usual wait (at least 50 ms), so that timing only the first call is wrong on every machine.

    - ``"data"``: every ``load_batch()`` waits ``30..40 ms`` (a slow disk or network), longer than the step;
    - ``"sync"``: ``run`` reads every gradient's norm back (``.item()``) to decide on clipping;
    - ``"launch"``: a deep stack of tiny layers, thousands of small ops per step;
    - ``"shape"``: ``d -> r -> d`` layers with ``r`` of 2 or 4: matmuls of 1 to 2 FLOP/byte, memory-bound;
    - ``"compute"``: square 256-wide layers on a batch of 256, matmuls of about 43 FLOP/byte: the healthy step.

    ``seed`` picks the sizes within each kind, so that no two variants are alike."""

    def __init__(self, bottleneck: str, seed: int = 0, device=None):
        import random

        if bottleneck not in BOTTLENECKS:
            raise ValueError(f"bottleneck={bottleneck!r}: expected one of {BOTTLENECKS}")
        rng = random.Random(f"{bottleneck}-{seed}")
        if bottleneck == "data":  # a small step, so that the wait dominates even on scalar kernels under load
            widths, batch = [rng.choice((32, 64))] * rng.randint(2, 3), 32
        elif bottleneck == "sync":
            widths, batch = [rng.choice((128, 192, 256))] * rng.randint(3, 5), 64
        elif bottleneck == "launch":
            widths, batch = [rng.choice((8, 16))] * rng.randint(40, 56), 8
        elif bottleneck == "shape":
            d = rng.choice((512, 768))
            widths, batch = [d, rng.choice((2, 4)), d], 512
        else:
            widths, batch = [256] * rng.randint(3, 4), 256
        gen = torch.Generator().manual_seed(seed)
        layers: list[torch.nn.Module] = []
        for fan_in, fan_out in zip(widths[:-1], widths[1:]):
            layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
        self._net = torch.nn.Sequential(*layers[:-1]).to(device)
        self._optimizer = torch.optim.SGD(self._net.parameters(), lr=1e-4)
        self._x = torch.randn(batch, widths[0], generator=gen).to(device)
        self._y = torch.randn(batch, widths[-1], generator=gen).to(device)
        self._wait_s = rng.uniform(0.03, 0.04) if bottleneck == "data" else 0.0
        self._sync = bottleneck == "sync"
        self._loaded = self._ran = False

    def load_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._loaded:
            self._loaded = True
            time.sleep(max(0.05, FIRST_CALL_REPEATS * self._wait_s))
        if self._wait_s:
            time.sleep(self._wait_s)
        return self._x, self._y

    def run(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        for _ in range(1 + (0 if self._ran else FIRST_CALL_REPEATS)):
            loss = torch.nn.functional.mse_loss(self._net(x), y)
            self._optimizer.zero_grad(set_to_none=True)
            loss.backward()
        self._ran = True
        if self._sync:
            for p in self._net.parameters():
                if p.grad.norm().item() > 1e3:  # the hidden sync: a GPU would wait here for every parameter
                    p.grad.mul_(1e3 / p.grad.norm())
        self._optimizer.step()
        return loss.detach()


def _matmul_cost_from_shapes(name: str, shapes: list) -> tuple[int, int]:
    """``(flops, bytes)`` of one recorded matmul event (``aten::mm``, ``addmm``, ``bmm``) from its input shapes,
    counted in fp32 (4 bytes per element)."""
    a, b = (shapes[1], shapes[2]) if name == "aten::addmm" else (shapes[0], shapes[1])  # addmm: (bias, a, b, ...)
    batch = a[0] if name == "aten::bmm" else 1
    flops, moved = matmul_cost(a[-2], a[-1], b[-1], torch.float32)
    return batch * flops, batch * moved


def profiled_ops(fn: Callable, *args, **kwargs) -> list:
    """The ops one call of ``fn(*args, **kwargs)`` runs, as the autograd profiler records them (with input shapes):
    a list of ``FunctionEvent`` with ``.name``, ``.input_shapes``, ``.count`` and ``.self_cpu_time_total`` (µs). The
    profiler library's start/stop lines on stderr are silenced (:func:`profile_step` does the same). It uses
    ``torch.autograd.profiler.profile``, the engine under ``torch.profiler.profile``, whose first use imports
    ``torch._dynamo`` (a second or more): the graders call this on every try."""
    from torch.autograd.profiler import profile

    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    with _silent_stderr(), profile(record_shapes=True) as prof:
        fn(*args, **kwargs)
    return list(prof.function_events)


def traced_graphs(fn: Callable, *args, **kwargs) -> dict:
    """What ``torch.compile`` would capture from one call of ``fn(*args, **kwargs)``, without compiling anything:
    ``torch._dynamo.explain`` traces the Python into FX graphs (seconds, where compiling them takes tens of
    seconds on a CPU). Returns ``graphs`` (how many), ``ops`` (the calls recorded in them: what Inductor would
    then fuse into kernels), ``breaks`` (how many times the trace stopped) and ``reasons``: the distinct
    ``(reason, code)`` pairs behind the breaks, the reason's first line and the line of user code where the
    trace stopped. Dynamo's warnings are kept off stderr, and its caches are reset afterwards."""
    import logging

    import torch._dynamo

    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    logger = logging.getLogger("torch._dynamo")
    level = logger.level
    logger.setLevel(logging.ERROR)  # a graph break is what we ask for here, not something to warn about
    try:
        explained = torch._dynamo.explain(fn)(*args, **kwargs)
    finally:
        logger.setLevel(level)
        torch._dynamo.reset()
    reasons = []
    for b in explained.break_reasons:
        reason = (b.reason.splitlines()[0], (b.user_stack[-1].line or "").strip() if b.user_stack else "")
        if reason not in reasons:
            reasons.append(reason)
    return {"graphs": explained.graph_count, "ops": explained.op_count, "breaks": explained.graph_break_count,
            "reasons": reasons}


def diagnose_step(step, repeats: int = 5) -> dict:
    """Time and profile one :class:`TrainingStep` (or anything with ``load_batch()`` and ``run(batch)``) and name
    its bottleneck from the measurements, in this order: ``"data"`` if loading takes longer than the step;
    ``"sync"`` if the step reads a value back (:data:`SYNC_OPS` in its profile); ``"launch"`` if it runs more
    than :data:`LAUNCH_BOUND_OPS` ops; ``"shape"`` if its matmuls do fewer than :data:`LOW_INTENSITY` FLOPs per
    byte (FLOPs and bytes summed over them, from their recorded shapes); else ``"compute"``.

    Returns ``bottleneck``, ``load_s`` and ``run_s`` (medians of ``repeats`` calls after a warm-up call), and the
    evidence: ``ops`` and ``syncs`` per step and ``matmul_intensity``."""
    batch = step.load_batch()  # warm-up: a first call pays one-off costs
    step.run(batch)
    load = timeit(step.load_batch, warmup=0, cold=True, repeats=repeats, number=1)
    run = timeit(step.run, batch, warmup=0, cold=True, repeats=repeats, number=1)
    events = profiled_ops(step.run, batch)
    syncs = sum(e.name in SYNC_OPS for e in events)
    flops = moved = 0
    for e in events:
        if e.name in MATMUL_OPS:
            f, b = _matmul_cost_from_shapes(e.name, e.input_shapes)
            flops, moved = flops + f, moved + b
    intensity = flops / moved if moved else float("inf")
    if load.median > run.median:
        bottleneck = "data"
    elif syncs:
        bottleneck = "sync"
    elif len(events) > LAUNCH_BOUND_OPS:
        bottleneck = "launch"
    elif intensity < LOW_INTENSITY:
        bottleneck = "shape"
    else:
        bottleneck = "compute"
    return {"bottleneck": bottleneck, "load_s": load.median, "run_s": run.median, "ops": len(events), "syncs": syncs,
            "matmul_intensity": intensity}
