"""labkit.hardware: the machine report (canned sysfs/sysctl samples and this machine), timeit, the
sweeps (loose bounds, never exact numbers), arithmetic intensity against hand-computed counts, the
roofline, the profiler wrapper and the staged slow loops."""
import labkit  # noqa: F401

import json
import math
import threading
import time
from pathlib import Path

import pytest
import torch

from labkit import hardware as H

FIXTURES = Path(__file__).parent / "fixtures" / "hardware"


def read_from_dump(name: str):
    """A ``read(path)`` over a ``grep -r .`` dump (``path:content`` per line; repeated paths are lines of one file)."""
    files: dict[str, list[str]] = {}
    for line in (FIXTURES / name).read_text().splitlines():
        if line.startswith("#") or ":" not in line:
            continue
        path, content = line.split(":", 1)
        files.setdefault(path, []).append(content)
    return lambda path: "\n".join(files[path]) + "\n" if path in files else None


# ----------------------------------------------------------------------------- machine report
def test_threadripper_sample_gives_the_seeds_layout():
    cpu = H.linux_cpu_report(read_from_dump("threadripper_7970x.sysfs.txt"))
    assert cpu.model == "AMD Ryzen Threadripper 7970X 32-Cores"
    assert (cpu.logical_cpus, cpu.physical_cores, cpu.threads_per_core, cpu.sockets, cpu.numa_nodes) == (64, 32, 2, 1, 1)
    assert [c.name for c in cpu.caches] == ["L1d", "L1i", "L2", "L3"]
    l1d, l2, l3 = cpu.cache("L1d"), cpu.cache("L2"), cpu.cache("L3")
    assert (l1d.size_bytes, l1d.shared_by, l1d.instances) == (32 * 1024, 2, 32)  # per core (its two threads)
    assert (l2.size_bytes, l2.shared_by, l2.instances) == (1 << 20, 2, 32)
    assert (l3.size_bytes, l3.shared_by, l3.instances) == (32 << 20, 16, 4)  # per 8 cores = 16 threads
    assert cpu.line_bytes == 64 and cpu.memory_bytes == 263612416 * 1024 and cpu.governor == "schedutil"
    rows = {r["what"]: r["value"] for r in H.MachineReport(cpu, ()).rows()}
    assert rows["L1d"] == "32 KiB per core (x32), 64-byte lines"
    assert rows["L2"] == "1 MiB per core (x32), 64-byte lines"
    assert rows["L3"] == "32 MiB per 8 cores (x4), 64-byte lines"
    assert rows["cores"].startswith("32 physical, 64 logical (2 per core)") and rows["GPU"] == "none"


def test_apple_silicon_sysctl_sample():
    cpu = H.macos_cpu_report(H.parse_sysctl((FIXTURES / "apple_m2_sysctl.txt").read_text()))
    assert cpu.model == "Apple M2" and cpu.source == "sysctl"
    assert (cpu.logical_cpus, cpu.physical_cores, cpu.threads_per_core) == (8, 8, 1)
    assert cpu.cache("L1d").size_bytes == 128 * 1024  # the performance cores' L1d
    l2 = cpu.cache("L2")
    assert (l2.size_bytes, l2.shared_by, l2.instances) == (16 << 20, 4, 1)
    assert cpu.cache("L3") is None and cpu.line_bytes == 128 and cpu.memory_bytes == 16 << 30


def test_intel_mac_sharing_comes_from_cacheconfig():
    sysctl = {"hw.logicalcpu": "8", "hw.physicalcpu": "4", "hw.cachelinesize": "64", "hw.l1dcachesize": "32768",
              "hw.l2cachesize": "262144", "hw.l3cachesize": "8388608", "hw.cacheconfig": "8 2 2 8 0 0 0 0 0 0",
              "machdep.cpu.brand_string": "Intel(R) Core(TM) i7"}
    cpu = H.macos_cpu_report(sysctl)
    assert cpu.threads_per_core == 2
    assert (cpu.cache("L2").shared_by, cpu.cache("L2").instances) == (2, 4)
    assert (cpu.cache("L3").shared_by, cpu.cache("L3").instances) == (8, 1)
    assert {r["what"]: r["value"] for r in H.MachineReport(cpu, ()).rows()}["L3"].startswith("8 MiB per 4 cores")


def test_missing_files_give_unknowns_not_errors():
    cpu = H.linux_cpu_report(lambda path: None)
    assert cpu.caches == () and cpu.logical_cpus is None and cpu.line_bytes is None
    assert any(r["value"] == "unknown" for r in H.MachineReport(cpu, ()).rows())


def test_live_report_is_sane():
    report = H.machine_report()
    cpu = report.cpu
    assert cpu.model
    if cpu.source == "sysfs":
        assert cpu.logical_cpus >= 1 and 1 <= cpu.physical_cores <= cpu.logical_cpus
        l1d = cpu.cache("L1d")
        if l1d is not None:
            assert 4 * 1024 <= l1d.size_bytes <= 1 << 20 and cpu.line_bytes in (32, 64, 128, 256)
            sizes = [c.size_bytes for c in cpu.caches if c.kind != "Instruction"]
            assert sizes == sorted(sizes)  # each level larger than the one before
    assert len(report.gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert report.rows()[0]["what"] == "CPU"


# each variant's own datasheet: (bandwidth TB/s, memory GB, dense bf16 TFLOP/s); None where labkit has no entry
VARIANTS = {
    "NVIDIA A100-SXM4-40GB": (1.555, 40, 312), "NVIDIA A100-PCIE-40GB": (1.555, 40, 312),
    "NVIDIA A100 80GB PCIe": (1.935, 80, 312), "NVIDIA A100-SXM4-80GB": (2.039, 80, 312),
    "NVIDIA H100 NVL": (3.9, 94, 835.5), "NVIDIA H100 80GB HBM3": (3.35, 80, 989.5),
    "NVIDIA H200 NVL": (4.8, 141, 835.5), "NVIDIA H200": (4.8, 141, 989.5),
    "NVIDIA GeForce RTX 4090": (1.008, 24, 165.2),
    "NVIDIA GeForce RTX 4090 Laptop GPU": None, "NVIDIA GH200 480GB": None, "NVIDIA H100 PCIe": None,
    "NVIDIA H100 80GB HBM3 MIG 1g.10gb": None,
}


@pytest.mark.parametrize("name", VARIANTS)
def test_datasheet_gives_each_variant_its_own_figures(name):
    peaks = H.datasheet_for(name)
    figures = None if peaks is None else (peaks.bandwidth_tb_s, peaks.memory_gb, peaks.tflops["bfloat16"])
    assert figures == VARIANTS[name]


def test_datasheet_takes_memory_from_the_device():
    h200 = H.datasheet_for("NVIDIA H200", 150_000_000_000)  # what an H200 reports: ~139.7 GiB of its 141
    assert h200.name == "H200 SXM" and h200.memory_gb == round(150e9 / 2**30, 2) and "device" in h200.source
    assert H.datasheet_for("NVIDIA H100 80GB HBM3", 64 * 2**30) is None  # not the 80 GB part the datasheet describes
    assert H.datasheet_for("NVIDIA A100-SXM4-40GB", 80 * 2**30) is None
    with pytest.raises(ValueError, match="memory_bytes"):
        H.datasheet_for("NVIDIA H200", -1)
    with pytest.raises(TypeError, match="gpu_name"):
        H.datasheet_for(None)


def test_datasheet_lookup_and_sizes():
    assert H.datasheet_for("NVIDIA H200").name == "H200 SXM"
    assert H.datasheet_for("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert H.datasheet_for("NVIDIA H100 PCIe") is None
    assert H.datasheet_for("NVIDIA A100-SXM4-80GB").name == "A100 SXM4 80GB"
    assert H.datasheet_for("NVIDIA GeForce RTX 4090").name == "RTX 4090"
    assert H.datasheet_for("Quadro P1000") is None
    for peaks in H.GPU_DATASHEETS.values():
        assert peaks.source and peaks.tflops["bfloat16"] >= peaks.tflops["float32"]
    assert H.format_bytes(32768) == "32 KiB" and H.format_bytes(1.5 * 2**20) == "1.5 MiB" and H.format_bytes(12) == "12 B"
    assert H._parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert H._parse_size("32768K") == 32 << 20
    with pytest.raises(ValueError):
        H._parse_size("lots")


# ----------------------------------------------------------------------------- timeit
def test_timeit_returns_median_iqr_and_samples():
    calls = []
    timing = H.timeit(lambda x: calls.append(x) or x * 2, 21, repeats=5, number=3, warmup=2)
    assert len(timing.samples) == 5 and timing.number == 3 and len(calls) == 2 + 5 * 3
    assert timing.result == 42 and timing.min <= timing.median and timing.iqr >= 0 and not timing.cold
    assert "median" in str(timing)


def test_timeit_measures_a_known_duration():
    timing = H.timeit(time.sleep, 0.005, repeats=3, number=1)
    assert 0.004 < timing.median < 0.1


def test_timeit_picks_enough_calls_per_sample():
    timing = H.timeit(lambda: None, repeats=3, min_sample_s=0.005)
    assert timing.number > 100  # a no-op costs well under 50 µs


class FakeAsyncDevice:
    """A CUDA-like device: a launch returns at once and the work runs in the background until synchronize()."""

    def __init__(self, work_s: float):
        self.work_s, self.pending, self.syncs = work_s, [], 0

    def launch(self):
        thread = threading.Thread(target=time.sleep, args=(self.work_s,))
        thread.start()
        self.pending.append(thread)

    def synchronize(self):
        self.syncs += 1
        for thread in self.pending:
            thread.join()
        self.pending.clear()


def test_timeit_synchronizes_asynchronous_work():
    device = FakeAsyncDevice(0.02)
    synced = H.timeit(device.launch, sync=device.synchronize, repeats=3, number=1)
    assert synced.median >= 0.015 and synced.synchronized
    assert device.syncs >= 2 * 3  # before and after every sample
    device.synchronize()
    unsynced = H.timeit(device.launch, sync=False, repeats=3, number=1)
    device.synchronize()
    assert unsynced.median < 0.01 and not unsynced.synchronized  # only the launches were timed


def test_timeit_default_sync_uses_the_accelerator(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: seen.append(1))
    H.timeit(lambda: None, repeats=2, number=1)
    assert len(seen) >= 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_timeit_on_gpu_includes_the_kernels():
    a = torch.randn(4096, 4096, device="cuda")
    synced = H.timeit(torch.matmul, a, a, repeats=3)
    unsynced = H.timeit(torch.matmul, a, a, repeats=3, number=1, sync=False)
    assert synced.median > 2 * 4096**3 / 200e12  # not faster than any GPU can be
    assert unsynced.samples  # (launch time only; may be anything)


def test_timeit_refuses_a_cold_first_call_unless_asked():
    with pytest.raises(ValueError, match="first call"):
        H.timeit(lambda: None, warmup=0)
    calls = []
    timing = H.timeit(lambda: calls.append(1), warmup=0, repeats=1, cold=True)
    assert timing.cold and calls == [1] and timing.number == 1 and "first call" in str(timing)


def test_timeit_setup_runs_before_each_sample_untimed():
    log = []
    timing = H.timeit(lambda: log.append("call"), setup=lambda: (log.append("setup"), time.sleep(0.01)), repeats=3)
    assert log == ["setup", "call"] * 4 and timing.number == 1 and timing.median < 0.01


@pytest.mark.parametrize("kwargs", [dict(repeats=0), dict(warmup=-1), dict(number=0), dict(repeats=2.5)])
def test_timeit_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        H.timeit(lambda: None, **kwargs)
    with pytest.raises(TypeError):
        H.timeit(3)


def test_timeit_keeps_the_thread_count():
    before = torch.get_num_threads()
    H.timeit(torch.ones(100).sum, repeats=2)
    assert torch.get_num_threads() == before


def test_cache_flush_bytes_is_twice_the_cache_in_whole_words():
    assert H.cache_flush_bytes(50 * H.MiB) == 100 * H.MiB  # an H100's L2 -> 100 MiB written between runs
    assert H.cache_flush_bytes(32 * H.MiB, factor=4) == 128 * H.MiB
    assert H.cache_flush_bytes(3) == 8  # 6 bytes rounded up to two 4-byte words
    for bad in (dict(cache_bytes=0), dict(cache_bytes=-1), dict(cache_bytes=1024, factor=0), dict(cache_bytes=1.5)):
        with pytest.raises(ValueError):
            H.cache_flush_bytes(**bad)


def test_cache_flush_zeroes_a_buffer_of_that_size():
    flush = H.CacheFlush(1 * H.MiB)
    with pytest.raises(ValueError, match="device"):
        H.CacheFlush(1 * H.MiB, device="gpu")
    assert flush.buffer.numel() * flush.buffer.element_size() == 2 * H.MiB and flush.buffer.device.type == "cpu"
    flush.buffer.fill_(7)
    flush()
    assert int(flush.buffer.abs().sum()) == 0


class HostEvent:
    """A CUDA-event look-alike stamped by the host clock: lets the event loop run on a CPU."""

    def record(self):
        self.at = time.perf_counter()

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


def test_time_with_events_flushes_before_each_run_outside_the_time():
    log, syncs = [], []

    def call():
        log.append("call")
        time.sleep(0.002)
        return len(log)

    def flush():
        log.append("flush")
        time.sleep(0.02)

    ms, last = H.time_with_events(call, HostEvent, lambda: syncs.append(len(log)), warmup=2, repeats=3, flush=flush)
    assert log == ["call"] * 2 + ["flush", "call"] * 3 and last == len(log)
    assert syncs == [2, 8]  # once after the warm-up, once after the last run: never between runs
    assert len(ms) == 3 and all(2 <= m < 20 for m in ms)  # each run's 2 ms, none of the flush's 20 ms


def test_time_with_events_rejects_bad_arguments():
    for bad in (dict(warmup=-1), dict(repeats=0), dict(repeats=True)):
        with pytest.raises(ValueError):
            H.time_with_events(lambda: None, HostEvent, lambda: None, **bad)
    with pytest.raises(TypeError):
        H.time_with_events(3, HostEvent, lambda: None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_gpu_time_on_a_cpu_says_why_it_cannot_run():
    with pytest.raises(RuntimeError, match="no CUDA device") as err:
        H.gpu_time(torch.ones, 8)
    assert "do_bench" in str(err.value) and "timeit" in str(err.value)
    with pytest.raises(TypeError):
        H.gpu_time(3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_time_times_the_kernel_and_a_cold_l2_costs_time():
    import triton.testing

    a = torch.randn(4096, 4096, device="cuda")
    timing = H.gpu_time(torch.matmul, a, a, repeats=10)
    assert timing.median > 2 * 4096**3 / 2e15 and timing.number == 1 and len(timing.samples) == 10
    bench_ms = triton.testing.do_bench(lambda: torch.matmul(a, a), return_mode="median")
    assert 0.5 < timing.median * 1e3 / bench_ms < 2  # the same loop as do_bench's
    x = torch.randn(8 << 20, device="cuda")  # 32 MiB: fits an H100's 50 MiB L2
    cold, warm = H.gpu_time(x.sum, repeats=20), H.gpu_time(x.sum, repeats=20, flush_l2=False)
    assert cold.median > warm.median


def test_compare_interleaves_and_reports_the_paired_speedup():
    order = []
    slow = lambda: (order.append("slow"), time.sleep(0.004))  # noqa: E731
    fast = lambda: order.append("fast")  # noqa: E731
    pair = H.compare(slow, fast, repeats=4, min_sample_s=0.002)
    assert len(pair.ratios) == 4 and pair.speedup > 5 and pair.baseline.median > 0.003
    assert pair.speedup == sorted(pair.ratios)[1] / 2 + sorted(pair.ratios)[2] / 2
    sampled = order[2:]  # after one warm-up call each
    assert sampled.index("fast") < len(sampled) - 1 - sampled[::-1].index("slow")  # alternated, not one after the other
    assert pair.candidate.number > pair.baseline.number
    threads = []
    before = torch.get_num_threads()
    H.compare(lambda: threads.append(torch.get_num_threads()), lambda: None, repeats=1, threads=1)
    assert set(threads) == {1} and torch.get_num_threads() == before
    with pytest.raises(TypeError):
        H.compare(slow, 3)
    with pytest.raises(ValueError):
        H.compare(slow, fast, repeats=0)


# ----------------------------------------------------------------------------- sweeps
def test_bandwidth_sweep_small_working_sets_stream_faster():
    sizes = [16 << 10, 64 << 20]
    rows = H.bandwidth_sweep(sizes, traffic_bytes=32 << 20, repeats=3)
    assert [r["size_bytes"] for r in rows] == sizes
    assert all(0.1 < r["gb_per_s"] <= r["best_gb_per_s"] < 5000 and r["iqr_gb_per_s"] >= 0 for r in rows)
    assert rows[0]["gb_per_s"] > 1.5 * rows[1]["gb_per_s"]  # L1 against memory
    copy = H.bandwidth_sweep([1 << 20], mode="copy", traffic_bytes=8 << 20, repeats=2)
    assert 0.1 < copy[0]["gb_per_s"] < 5000
    assert torch.get_num_threads() >= 1


def test_bandwidth_sweep_dot_mode_reads_the_working_set_through_blas():
    # BLAS's own vector code: the L2-sized set beats a 64 MiB one (L3 or DRAM) even under PyTorch's scalar kernels (chapter 09's claim)
    # Up to three whole measurements: at load 12 on 2 cores one run read the small set at 0.8 GB/s against 19.5 for
    # the large one (every sample of one size inside a burst); a sweep that does not read the sets fails all three.
    attempts = []
    for _ in range(3):
        rows = H.bandwidth_sweep([256 << 10, 64 << 20], mode="dot", traffic_bytes=16 << 20, repeats=3)
        assert [r["size_bytes"] for r in rows] == [256 << 10, 64 << 20]
        attempts.append(rows)
        if rows[0]["best_gb_per_s"] > 1.5 * rows[1]["best_gb_per_s"]:
            break
    else:
        raise AssertionError(f"256 KiB was never 1.5x faster than 64 MiB in 3 sweeps: {attempts}")


def test_latency_sweep_memory_is_slower_than_l1():
    rows = H.latency_sweep([16 << 10, 64 << 20], steps=30_000, repeats=5)
    assert rows[0]["extra_ns"] == 0 and 1 < rows[0]["ns_per_step"] < 2000
    assert rows[1]["ns_per_step"] > 1.1 * rows[0]["ns_per_step"], rows
    assert all(r["best_ns"] <= r["ns_per_step"] for r in rows) and rows[1]["best_ns"] > 1.1 * rows[0]["best_ns"], rows


def test_random_cycle_visits_every_slot_once():
    nxt = H.random_cycle(1000, seed=3)
    seen, i = set(), 0
    for _ in range(1000):
        seen.add(i)
        i = int(nxt[i])
    assert len(seen) == 1000 and i == 0
    assert H.chase(memoryview(nxt), 1000) == 0 and H.chase([1, 0], 3) == 1
    with pytest.raises(ValueError):
        H.random_cycle(0)


def test_stride_sweep_sees_the_cache_line():
    rows = H.stride_sweep([2, 16, 64], span_bytes=16 << 20, repeats=3)
    assert [r["stride_bytes"] for r in rows] == [8, 64, 256]
    assert [r["elements"] for r in rows] == [2 << 20, 256 << 10, 64 << 10]  # one span, fewer elements at longer strides
    assert [r["bytes_touched"] for r in rows] == [16 << 20, 16 << 20, 4 << 20]  # every line of the span, then one per element
    assert rows[1]["ns_per_element"] > 1.5 * rows[0]["ns_per_element"]
    with pytest.raises(ValueError, match="stride"):
        H.stride_sweep([1, 2])
    with pytest.raises(ValueError, match="span_bytes"):
        H.stride_sweep([2, 64], span_bytes=128)


def test_matmul_flops_grow_with_size():
    rows = H.matmul_flops([16, 256], repeats=3)
    assert [r["n"] for r in rows] == [16, 256] and all(0.01 < r["gflop_per_s"] <= r["best_gflop_per_s"] for r in rows)
    assert rows[1]["gflop_per_s"] > rows[0]["gflop_per_s"]  # a 16 x 16 matmul is all overhead


@pytest.mark.parametrize("bad", [[], [0], [10, 5], [4, 4], [1.5]])
def test_sweeps_reject_bad_sizes(bad):
    with pytest.raises(ValueError):
        H.bandwidth_sweep(bad)
    with pytest.raises(ValueError):
        H.latency_sweep(bad)
    with pytest.raises(ValueError):
        H.bandwidth_sweep([1024], mode="write")  # read, copy or dot


# ----------------------------------------------------------------------------- intensity and the roofline
def test_arithmetic_intensity_matches_hand_counts():
    mm = H.arithmetic_intensity("matmul", (64, 128, 32), torch.bfloat16)
    assert (mm.flops, mm.bytes) == (2 * 64 * 128 * 32, 2 * (64 * 128 + 128 * 32 + 64 * 32))
    add = H.arithmetic_intensity("add", (1000, 3), torch.float32)
    assert (add.flops, add.bytes) == (3000, 36000) and add.intensity == 1 / 12
    norm = H.arithmetic_intensity("rmsnorm", (8, 512), torch.float16)
    assert (norm.flops, norm.bytes) == (4 * 8 * 512 + 3 * 8, 2 * (2 * 8 * 512 + 512))
    soft = H.arithmetic_intensity("softmax", (8, 512), torch.float32)
    assert (soft.flops, soft.bytes) == (5 * 8 * 512, 4 * 2 * 8 * 512)
    b, h, s, d = 2, 4, 256, 64
    naive, flash = (H.arithmetic_intensity(op, (b, h, s, d), torch.bfloat16) for op in ("attention_naive", "attention_flash"))
    assert naive.flops == flash.flops == 4 * b * h * s * s * d + 5 * b * h * s * s
    assert flash.bytes == 2 * 4 * b * h * s * d and naive.bytes == 2 * (4 * b * h * s * d + 4 * b * h * s * s)
    assert flash.intensity > naive.intensity
    assert H.matmul_cost(2, 3, 4, torch.float8_e4m3fn) == (48, 26) and H.add_cost((5,), torch.float64) == (5, 120)


def test_square_matmul_intensity_is_n_over_3_elements():
    for n in (64, 1024, 8192):
        cost = H.arithmetic_intensity("matmul", (n, n, n), torch.float32)
        assert math.isclose(cost.intensity, n / 6)  # 2n^3 / (3 n^2 x 4 bytes)


@pytest.mark.parametrize("op, shapes", [("conv", (3,)), ("matmul", (3, 4)), ("add", ()), ("add", (0, 2)),
                                        ("softmax", (3,)), ("attention_flash", (1, 2, 3)), ("matmul", (2, -1, 3))])
def test_arithmetic_intensity_rejects_bad_input(op, shapes):
    with pytest.raises(ValueError):
        H.arithmetic_intensity(op, shapes)


def test_dtype_must_be_a_torch_dtype():
    with pytest.raises(TypeError, match="dtype"):
        H.matmul_cost(2, 2, 2, "bf16")


def test_roofline_predicts_and_classifies():
    roof = H.Roofline("toy", peak_flops=100e12, bandwidth=2e12, source="made up")
    assert roof.ridge == 50
    assert roof.attainable(10) == 20e12 and roof.attainable(1000) == 100e12
    small = H.arithmetic_intensity("add", (1 << 20,), torch.bfloat16)
    big = H.arithmetic_intensity("matmul", (4096, 4096, 4096), torch.bfloat16)
    assert roof.bound(small) == "memory" and roof.bound(big) == "compute"
    assert roof.predict_seconds(small) == small.bytes / 2e12
    assert roof.predict_seconds(big) == big.flops / 100e12
    assert H.roofline_time(10, 10, 5, 2) == 5.0
    with pytest.raises(ValueError):
        H.roofline_time(-1, 1, 1, 1)
    with pytest.raises(ValueError):
        H.Roofline("bad", 0, 1, "")


def test_datasheet_rooflines():
    h100, h200 = H.Roofline.datasheet("H100 SXM"), H.Roofline.datasheet("H200")
    assert h100.peak_flops == h200.peak_flops == 989.5e12  # the same chip
    assert h200.bandwidth > h100.bandwidth and h200.ridge < h100.ridge
    assert 200 < h100.ridge < 400  # ~295 FLOP/byte: a bf16 op needs ~300 FLOPs per byte to use the tensor cores
    with pytest.raises(ValueError, match="lists"):
        H.Roofline.datasheet("A100 SXM4 80GB", torch.float8_e4m3fn)
    with pytest.raises(ValueError):
        H.Roofline.datasheet("TPU")


def test_measured_roofline_takes_best_flops_and_memory_bandwidth():
    roof = H.Roofline.measured("here", [dict(gflop_per_s=10.0), dict(gflop_per_s=30.0)],
                               [dict(size_bytes=1024, gb_per_s=100.0), dict(size_bytes=1 << 30, gb_per_s=8.0)])
    assert roof.peak_flops == 30e9 and roof.bandwidth == 8e9 and "1 GiB" in roof.source
    # with their fastest samples (other programs only slow a sample down), the ceilings come from those
    best = H.Roofline.measured("here", [dict(gflop_per_s=10.0, best_gflop_per_s=40.0), dict(gflop_per_s=30.0, best_gflop_per_s=35.0)],
                               [dict(size_bytes=1 << 30, gb_per_s=8.0, best_gb_per_s=9.0)])
    assert best.peak_flops == 40e9 and best.bandwidth == 9e9
    with pytest.raises(ValueError):
        H.Roofline.measured("here", [], [])


def test_measured_roofline_needs_both_ceilings_from_one_device():
    # a GPU's rows as matmul_flops and bandwidth_sweep describe them, without a GPU: the device is in every row
    gpu_flops = [dict(n=8192, gflop_per_s=50_000.0, device="cuda:0")]
    gpu_memory = [dict(size_bytes=1 << 30, gb_per_s=4_000.0, device="cuda:0")]
    cpu_memory = [dict(size_bytes=64 << 20, gb_per_s=20.0, device="cpu")]
    with pytest.raises(ValueError, match="one device"):
        H.Roofline.measured("gpu", gpu_flops, cpu_memory)
    roof = H.Roofline.measured("gpu", gpu_flops, gpu_memory)
    assert roof.bandwidth == 4e12 and "cuda:0" in roof.source and roof.ridge == 12.5


def test_sweeps_measure_the_device_they_are_given():
    # "meta" tensors run no kernels: enough to see that the buffers live on the device asked for
    assert {r["device"] for r in H.bandwidth_sweep([4096, 8192], repeats=1, device="meta")} == {"meta"}
    assert {r["device"] for r in H.bandwidth_sweep([8192], mode="copy", repeats=1, device="meta")} == {"meta"}
    assert {r["device"] for r in H.matmul_flops([8], repeats=1)} == {"cpu"}


# ----------------------------------------------------------------------------- profiling
def test_profile_step_records_the_active_steps_of_its_schedule(tmp_path):
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    calls = []

    def step():
        calls.append(1)
        return (a @ b).relu().sum()

    result = H.profile_step(step, wait=1, warmup=1, active=2, trace_path=tmp_path / "trace.json")
    assert len(calls) == 4 and result.steps == (2, 3)  # steps 0 (wait) and 1 (warm-up) are not recorded
    names = result.names()
    assert {"aten::mm", "aten::relu", "aten::sum"} <= set(names) or {"aten::matmul", "aten::relu", "aten::sum"} <= set(names)
    mm = next(r for r in result.rows if r["name"] in ("aten::mm", "aten::matmul"))
    assert mm["calls"] == 2 and "[64, 64]" in mm["shapes"] and mm["self_ms"] >= 0
    assert result.calls["aten::relu"] == 2 and result.calls[mm["name"]] == 2
    assert "Self CPU" in result.table and not any(n.startswith("ProfilerStep") for n in names)
    events = H.trace_events(result.trace_path)  # written by on_trace_ready when the active steps ended
    assert any(e["name"] == "aten::mm" for e in events)
    assert sorted(e["name"] for e in events if e["name"].startswith("ProfilerStep")) == ["ProfilerStep#2", "ProfilerStep#3"]
    json.loads(result.trace_path.read_text())


@pytest.mark.parametrize("kwargs", [dict(active=0), dict(wait=-1), dict(warmup=1.5), dict(row_limit=0)])
def test_profile_step_rejects_bad_schedules(kwargs):
    with pytest.raises(ValueError):
        H.profile_step(lambda: None, **kwargs)
    with pytest.raises(TypeError):
        H.profile_step(3)


def test_profile_to_tempdir_leaves_no_file():
    result, events = H.profile_to_tempdir(lambda: torch.ones(10).add(1), wait=0, warmup=1, active=1)
    assert result.trace_path is None and result.steps == (1,) and any(e["name"] == "aten::add" for e in events)


def test_traced_graphs_counts_graphs_ops_and_breaks(capfd):
    fused = H.traced_graphs(H.gelu_unfused, torch.randn(100))
    assert fused == {"graphs": 1, "ops": 9, "breaks": 0, "reasons": []}  # one graph: the formula's nine ops

    def reads_back(x):
        y = x * 2
        if y.sum().item() > 0:  # a value read back to the host: the trace stops here
            return y + 1
        return y - 1

    broken = H.traced_graphs(reads_back, torch.ones(4))
    assert broken["graphs"] == 2 and broken["breaks"] == 1 and len(broken["reasons"]) == 1
    reason, code = broken["reasons"][0]
    assert "item()" in reason and code == "if y.sum().item() > 0:  # a value read back to the host: the trace stops here"
    assert "Graph break" not in capfd.readouterr().err
    with pytest.raises(TypeError):
        H.traced_graphs(3)


# ----------------------------------------------------------------------------- the slow loops
def test_softmax_rows_loop_and_vectorized_agree_with_torch():
    x = torch.randn(7, 5) * 30
    assert torch.allclose(H.softmax_rows_loop(x), torch.softmax(x, -1), atol=1e-6)
    assert torch.allclose(H.softmax_rows(x), torch.softmax(x, -1), atol=1e-6)


def test_gelu_unfused_is_gelu_tanh():
    x = torch.randn(1000)
    assert torch.allclose(H.gelu_unfused(x), torch.nn.functional.gelu(x, approximate="tanh"), atol=1e-6)


def test_prefetcher_keeps_order_overlaps_waits_and_forwards_errors():
    data = H.SlowSamples(6, 3, wait_s=0.0)
    assert len(data) == 6 and data[2][0].shape == (3,)
    x, y = H.load_batch(data, [0, 2, 4])
    assert torch.equal(x, data.x[[0, 2, 4]]) and torch.equal(y, data.y[[0, 2, 4]])
    assert list(H.Prefetcher(lambda i: i * i, range(7), workers=3, depth=2)) == [i * i for i in range(7)]

    # Overlap is asserted by its cause, loads in flight at once, not by a wall time (a fresh clone's tests under
    # load 16 on 2 cores took 0.14 s for what four overlapping loads do in 0.04 s).
    in_flight, peak, lock = 0, 0, threading.Lock()

    def slow(i):
        nonlocal in_flight, peak
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        time.sleep(0.05)
        with lock:
            in_flight -= 1
        return i

    assert list(H.Prefetcher(slow, range(8), workers=4)) == list(range(8))
    assert 2 <= peak <= 4  # several loads at a time, never more than the workers

    def broken(i):
        if i == 2:
            raise KeyError("lost")
        return i

    with pytest.raises(KeyError):
        list(H.Prefetcher(broken, range(4)))
    with pytest.raises(ValueError):
        H.Prefetcher(slow, [], workers=0)
    with pytest.raises(TypeError):
        H.Prefetcher(3, [])
    with pytest.raises(ValueError):
        H.SlowSamples(4, 2, wait_s=-1)


def test_train_epoch_learns():
    torch.manual_seed(0)
    data = H.SlowSamples(64, 4, wait_s=0.0)
    model = torch.nn.Linear(4, 1)
    batches = [(data.x[i:i + 16], data.y[i:i + 16]) for i in range(0, 64, 16)]
    first = H.train_epoch(model, batches, lr=0.1)
    for _ in range(20):
        last = H.train_epoch(model, batches, lr=0.1)
    assert last < first / 10


@pytest.mark.skipif(not H.CoreCompetitor.available(), reason="needs os.sched_setaffinity (Linux)")
def test_a_competitor_on_the_same_core_slows_a_loop_and_leaves_nothing_behind():
    import os

    cores = os.sched_getaffinity(0)
    sample = torch.randn(200, 64)
    with H.CoreCompetitor() as rival:
        assert len(os.sched_getaffinity(0)) == 1 and os.sched_getaffinity(rival._process.pid) == os.sched_getaffinity(0)

        def beside():
            rival.resume()
            try:
                H.softmax_rows_loop(sample)
            finally:
                rival.pause()

        # Asserted by its cause, not a time (under load 16 on 2 cores the ratio of 5 samples ranged 0.04-26x): the
        # rival takes CPU time on our core while resumed and none while paused. On a quiet machine the loop then
        # runs about 2x slower beside it (H.compare(lambda: H.softmax_rows_loop(sample), beside) shows it).
        before = _cpu_seconds(rival._process.pid)
        deadline = time.monotonic() + 20
        while _cpu_seconds(rival._process.pid) - before < 0.05 and time.monotonic() < deadline:
            beside()
        assert _cpu_seconds(rival._process.pid) - before >= 0.05
        paused = _cpu_seconds(rival._process.pid)
        time.sleep(0.3)
        assert _cpu_seconds(rival._process.pid) - paused < 0.02
    assert os.sched_getaffinity(0) == cores and rival._process.poll() is not None


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux's /proc/PID/stat, in clock ticks)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_gpu_memory_hierarchy_from_published_figures():
    for gpu, hbm_tb_s in (("H100 SXM", 3.35), ("H200", 4.8)):
        levels = {r["level"]: r for r in H.gpu_memory_hierarchy(gpu)}
        assert list(levels) == ["registers", "shared memory", "L2", "HBM"]
        assert H.sm_clock_hz(gpu) == pytest.approx(1.98e9, rel=0.01)  # the H100 SXM5's boost clock, 1980 MHz
        assert levels["registers"]["bytes"] == 132 * 65536 * 4 and levels["registers"]["bytes_per_sm"] == 256 << 10
        assert levels["shared memory"]["bytes"] == 132 * 228 * 1024 and levels["L2"]["bytes"] == 50 << 20
        # 132 SMs x 128 FP32 units x 2 FLOPs x clock = 67 TFLOP/s; shared memory 128 B x 132 x clock; registers 12 B per FMA
        assert levels["shared memory"]["tb_per_s"] == pytest.approx(128 * 132 * 67e12 / (2 * 128 * 132) / 1e12)
        assert levels["registers"]["tb_per_s"] == pytest.approx(67e12 / 2 * 12 / 1e12)
        assert levels["L2"]["tb_per_s"] is None and levels["HBM"]["tb_per_s"] == hbm_tb_s
    with pytest.raises(ValueError, match="gpu"):
        H.gpu_memory_hierarchy("A100 SXM4 80GB")


def test_tile_intensity_counts_the_slabs_a_tile_loads():
    # brute force: the loads and FLOPs of a 2-step k loop, summed
    for tm, tn, dtype in ((128, 128, torch.bfloat16), (128, 256, torch.float16), (64, 32, torch.float32)):
        size, k_step = torch.empty((), dtype=dtype).element_size(), 64
        flops = sum(2 * tm * tn * k_step for _ in range(2))
        loaded = sum((tm * k_step + k_step * tn) * size for _ in range(2))
        assert H.tile_intensity(tm, tn, dtype) == flops / loaded
    with pytest.raises(ValueError, match="tile_m"):
        H.tile_intensity(0, 128, torch.bfloat16)


def _tile_waves_by_counting(m, n, tm, tn, sms):
    """Every output element is put in its tile, the tiles are handed to SMs in waves of ``sms``: the useful share."""
    from fractions import Fraction

    tiles = {}
    for row in range(m):
        for col in range(n):
            tiles[row // tm, col // tn] = tiles.get((row // tm, col // tn), 0) + 1
    waves, handed = 0, 0
    while handed < len(tiles):
        handed, waves = handed + sms, waves + 1
    return len(tiles), waves, Fraction(sum(tiles.values()), waves * sms * tm * tn)


@pytest.mark.parametrize("m, n, tile, sms", [(256, 256, (128, 128), 4), (300, 200, (128, 64), 5), (1, 1, (16, 16), 3),
                                             (128, 1056, (128, 128), 8), (130, 390, (64, 128), 7), (96, 96, (32, 48), 132)])
def test_tile_waves_against_counting(m, n, tile, sms):
    tw = H.tile_waves(m, n, tile, sms)
    assert (tw.tiles, tw.waves, tw.efficiency) == _tile_waves_by_counting(m, n, *tile, sms)
    assert tw.efficiency == tw.tile_efficiency * tw.wave_efficiency <= 1


def test_tile_waves_rejects_bad_input():
    for kwargs in (dict(m=0, n=4), dict(m=4, n=4, tile=(128,)), dict(m=4, n=4, sms=0), dict(m=4.0, n=4)):
        with pytest.raises(ValueError):
            H.tile_waves(**kwargs)


def test_bandwidth_by_level_takes_the_largest_working_set_in_half_of_each_level():
    caches = (H.Cache(1, "Data", 32 << 10, 64, 1, 2), H.Cache(1, "Instruction", 32 << 10, 64, 1, 2),
              H.Cache(2, "Unified", 1 << 20, 64, 1, 2), H.Cache(3, "Unified", 32 << 20, 64, 2, 1))
    rows = [dict(size_bytes=size, gb_per_s=float(i)) for i, size in enumerate([8 << 10, 16 << 10, 64 << 10, 512 << 10, 64 << 20])]
    levels = H.bandwidth_by_level(caches, rows[::-1])  # any order
    assert [(r["level"], r["working_set"], r["gb_per_s"]) for r in levels] == [
        ("L1d", 16 << 10, 1.0), ("L2", 512 << 10, 3.0), ("L3", 512 << 10, 3.0), ("memory", 64 << 20, 4.0)]
    assert [r["level"] for r in H.bandwidth_by_level(caches[3:], rows[:1])] == ["L3", "memory"]
    assert [r["level"] for r in H.bandwidth_by_level((), rows)] == ["memory"]
    with pytest.raises(ValueError, match="rows"):
        H.bandwidth_by_level(caches, [])
