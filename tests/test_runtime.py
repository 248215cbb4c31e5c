import os
import subprocess
import sys
import time

import pytest
import torch

import labkit
from labkit import runtime


def test_setup_seeds_and_returns_device(capsys):
    dev = labkit.setup(seed=3)
    line = capsys.readouterr().out
    assert isinstance(dev, torch.device)
    assert "torch" in line and str(dev) in line
    a = torch.rand(3)
    labkit.setup(seed=3)
    assert torch.equal(a, torch.rand(3))


def test_pick_follows_device(monkeypatch):
    monkeypatch.setattr(runtime, "_device", torch.device("cpu"))
    assert labkit.pick(cpu=1, gpu=2) == 1
    monkeypatch.setattr(runtime, "_device", torch.device("cuda"))
    assert labkit.pick(cpu=1, gpu=2) == 2


def test_env_var_chooses_device(monkeypatch):
    monkeypatch.setenv("LABKIT_DEVICE", "cpu")
    assert runtime.get_device() == torch.device("cpu")


@pytest.mark.parametrize("bad", ["cuda:99", "tpu"])
def test_unavailable_device_raises(bad):
    if bad == "cuda:99" and torch.cuda.device_count() > 99:
        pytest.skip("a machine with 100 GPUs")
    with pytest.raises((ValueError, RuntimeError), match="device|Expected"):
        runtime.get_device(bad)


@pytest.mark.skipif(not runtime.triton_installed(), reason="triton not installed")
def test_interpreter_switched_on_without_gpu():
    if runtime.needs_interpreter():
        assert os.environ["TRITON_INTERPRET"] == "1"
        assert runtime.triton_mode() == "interpreter"


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full_env.update(LABKIT_DEVICE="cpu", **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)


@pytest.mark.skipif(not runtime.triton_installed(), reason="triton not installed")
def test_importing_triton_first_gives_clear_error():
    result = _run("import triton; import labkit")
    assert result.returncode != 0
    assert "TritonImportOrderError" in result.stderr and "import labkit" in result.stderr


@pytest.mark.skipif(not runtime.triton_installed(), reason="triton not installed")
def test_triton_first_is_fine_when_interpreter_already_on():
    result = _run("import triton; import labkit; print('ok')", TRITON_INTERPRET="1")
    assert result.returncode == 0 and "ok" in result.stdout


def test_without_triton_everything_but_the_kernels_works(tmp_path):
    # a platform without Triton wheels (macOS, Windows), simulated by blocking the import
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['triton'] = None\n")
    code = (
        "import labkit, torch\n"
        "from labkit.model import TransformerLM, tiny_config\n"
        "ok, reason = labkit.kernels.available()\n"
        "assert not ok and 'PyTorch reference' in reason, reason\n"
        "model = TransformerLM(tiny_config(15, use_triton=True))  # falls back to the PyTorch path\n"
        "assert model(torch.randint(0, 15, (2, 5))).shape == (2, 5, 15)\n"
        "try:\n"
        "    labkit.kernels.rmsnorm\n"
        "except ImportError as err:\n"
        "    print('ImportError:', err)\n"
    )
    result = _run(code, PYTHONPATH=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "ImportError: labkit.kernels.rmsnorm: Triton is not installed" in result.stdout


def test_labkit_seed_shifts_every_seed(monkeypatch):
    from labkit.runtime import run_seed, seed_everything

    monkeypatch.delenv("LABKIT_SEED", raising=False)
    assert run_seed(7) == 7
    seed_everything(0)
    unset = torch.rand(3)
    monkeypatch.setenv("LABKIT_SEED", "2")
    assert run_seed(7) == 9
    seed_everything(0)
    shifted = torch.rand(3)
    torch.manual_seed(2)
    assert torch.equal(shifted, torch.rand(3)) and not torch.equal(shifted, unset)
    monkeypatch.setenv("LABKIT_SEED", "two")
    with pytest.raises(ValueError, match="LABKIT_SEED"):
        run_seed(0)


def test_setup_keeps_the_thread_count_omp_num_threads_asks_for(monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    labkit.setup(device="cpu")
    assert torch.get_num_threads() == before and "as OMP_NUM_THREADS says" in capsys.readouterr().out


def test_setup_uses_the_thread_count_it_is_given_and_says_so(capsys):
    before = torch.get_num_threads()
    try:
        labkit.setup(device="cpu", threads=1)
        assert torch.get_num_threads() == 1 and "1 CPU thread(s), as asked" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)


def test_setup_measures_the_thread_count_when_nothing_says_it(monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        labkit.setup(device="cpu")
        line = capsys.readouterr().out
        assert "measured on a small model's step (1: " in line and "2: " in line
        assert torch.get_num_threads() in (1, 2)
    finally:
        torch.set_num_threads(before)


def test_choose_threads_prefers_fewer_threads_unless_more_are_clearly_faster(monkeypatch):
    times = {1: 1.0, 2: 0.95, 4: 0.5}
    monkeypatch.setattr(runtime, "_small_model_step", lambda threads, steps: times[threads])
    chosen, seconds = runtime.choose_threads([1, 2, 4])
    assert chosen == 4 and seconds == times
    times[4] = 0.93
    assert runtime.choose_threads([1, 2, 4])[0] == 1
    assert torch.get_num_threads() >= 1


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_bad_thread_counts_are_refused(bad):
    with pytest.raises(ValueError, match="threads"):
        labkit.setup(device="cpu", threads=bad)
    with pytest.raises(ValueError, match="candidates"):
        runtime.choose_threads([bad])


def _threads_and_seeded_draw(seed: int) -> tuple[int, list[float]]:
    """A job for RunPool: the thread count its worker runs with, and a draw that depends only on ``seed``."""
    torch.manual_seed(seed)
    return torch.get_num_threads(), torch.randn(3).tolist()


def _fails(message: str):
    raise KeyError(message)


def test_run_pool_returns_what_the_same_calls_return_here_on_one_thread_per_worker():
    with labkit.RunPool(workers=2, device="cpu") as pool:
        jobs = [pool.submit(_threads_and_seeded_draw, seed) for seed in (0, 1, 2)]
        failing = pool.submit(_fails, "from the worker")
        results = [job.result() for job in jobs]
        with pytest.raises(KeyError, match="from the worker"):
            failing.result()
    assert [threads for threads, _ in results] == [1, 1, 1]
    for seed, (_, draw) in zip((0, 1, 2), results):
        assert draw == _threads_and_seeded_draw(seed)[1]
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(_threads_and_seeded_draw, 0)


def test_run_pool_with_one_worker_runs_each_job_here_when_its_result_is_asked_for():
    calls = []
    pool = labkit.RunPool(workers=1)
    job = pool.submit(calls.append, "ran")
    assert calls == [] and not job.done()  # nothing runs before the result is asked for
    assert job.result() is None and job.result() is None and calls == ["ran"]  # and then once
    failing = pool.submit(_fails, "here")
    for _ in range(2):
        with pytest.raises(KeyError, match="here"):
            failing.result()
    assert "in this process" in repr(pool)


@pytest.mark.parametrize("bad", [dict(workers=0), dict(workers=1.5), dict(workers=True), dict(max_workers=0)])
def test_run_pool_refuses_bad_worker_counts(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        labkit.RunPool(**bad)


def test_run_pool_refuses_a_preload_that_is_not_module_names():
    for bad in ("labkit.lora", [labkit]):
        with pytest.raises(TypeError, match="preload"):
            labkit.RunPool(workers=1, preload=bad)


def test_run_pool_refuses_what_it_cannot_call():
    with pytest.raises(TypeError, match="fn"):
        labkit.RunPool(workers=1).submit("finetune_run")


def test_run_pool_workers_end_with_a_killed_notebook(tmp_path):
    """A kernel killed in the middle of a run (a learner's restart) takes its workers with it, mid-job."""
    psutil = pytest.importorskip("psutil")
    script = tmp_path / "killed.py"
    script.write_text(
        "import os, signal, time\n"
        "import labkit\n"
        "if __name__ == '__main__':\n"
        "    pool = labkit.RunPool(workers=2, device='cpu')\n"
        "    jobs = [pool.submit(time.sleep, 60) for _ in range(2)]\n"
        "    time.sleep(3)\n"
        "    print(*(p.pid for p in __import__('psutil').Process().children(recursive=True)), flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")
    output = tmp_path / "pids.txt"
    with output.open("w") as out:  # a file, not a pipe: a leftover process would hold a pipe open
        subprocess.run([sys.executable, str(script)], stdout=out, stderr=subprocess.STDOUT, timeout=120,
                       env=dict(os.environ, LABKIT_DEVICE="cpu"))
    printed = output.read_text()
    pids = [int(pid) for pid in printed.split("\n")[0].split() if pid.isdigit()]
    assert len(pids) >= 3, f"expected the fork server and two workers, got {printed[-500:]!r}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                                               for pid in pids):
        time.sleep(0.1)
    alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes {alive} outlived the killed notebook process"
