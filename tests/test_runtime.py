import concurrent.futures
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


def _threads_seed_and_draw(seed: int) -> tuple[int, str | None, list[float]]:
    """A job for RunPool: its thread count, the LABKIT_SEED it sees, and a draw that depends only on ``seed``."""
    torch.manual_seed(seed)
    return torch.get_num_threads(), os.environ.get("LABKIT_SEED"), torch.randn(3).tolist()


def _fails(message: str):
    raise KeyError(message)


def _first_row(tensor: torch.Tensor) -> list[float]:
    return tensor[0].tolist()


def test_run_pool_jobs_run_as_here_on_one_thread_under_the_seed_of_their_submission(monkeypatch):
    torch.set_num_threads(2)
    monkeypatch.setenv("LABKIT_SEED", "3")
    with labkit.RunPool(workers=2, device="cpu") as pool:
        jobs = [pool.submit(_threads_seed_and_draw, seed) for seed in (0, 1, 2)]
        monkeypatch.setenv("LABKIT_SEED", "5")  # after the submission: the jobs keep 3
        failing = pool.submit(_fails, "from the worker")
        results = [job.result() for job in jobs]
        with pytest.raises(KeyError, match="from the worker"):
            failing.result()
    for seed, (threads, shift, draw) in zip((0, 1, 2), results):
        assert (threads, shift) == (1, "3") and draw == _threads_seed_and_draw(seed)[2]
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(_threads_seed_and_draw, 0)


def test_run_pool_gives_a_training_run_the_result_it_has_here_on_one_thread():
    from labkit import lora as L
    from labkit.model import ModelConfig, TransformerLM

    torch.manual_seed(0)
    base = TransformerLM(ModelConfig(vocab_size=15, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64))
    task = L.subtraction_task()
    call = dict(lr=1e-2, steps=3, batch_size=4)
    with labkit.RunPool(workers=2, device="cpu") as pool:
        job = pool.submit(L.finetune_run, base, task, task, "all-linear", 2, 4, **call)
        model, row = job.result()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        here_model, here_row = L.finetune_run(base, task, task, "all-linear", 2, 4, **call)
    finally:
        torch.set_num_threads(threads)
    assert row["final_loss"] == here_row["final_loss"] and row["new"] == here_row["new"]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), here_model.state_dict().values()))


def test_run_pool_takes_a_snapshot_of_the_arguments_when_a_job_is_submitted():
    for workers in (1, 2):
        with labkit.RunPool(workers=workers, device="cpu") as pool:
            x = torch.zeros(2, 3)
            job = pool.submit(_first_row, x)
            x.fill_(7)  # after the submission: the job still reads zeros
            assert job.result() == [0.0, 0.0, 0.0]


def test_run_pool_with_one_worker_runs_each_job_here_once_when_its_result_is_asked_for():
    pool = labkit.RunPool(workers=1)
    torch.manual_seed(11)
    job = pool.submit(_threads_seed_and_draw, 0)
    assert not job.done()
    state = torch.random.get_rng_state()
    first = job.result()
    assert job.done() and job.result() == first and first[0] == 1
    assert torch.equal(torch.random.get_rng_state(), state)  # the job's manual_seed left this process's state alone
    failing = pool.submit(_fails, "here")
    for _ in range(2):
        with pytest.raises(KeyError, match="here"):
            failing.result()
    never_ran = pool.submit(_fails, "not run")
    pool.shutdown()
    with pytest.raises(concurrent.futures.CancelledError):
        never_ran.result()
    assert "in this process" in repr(pool) and "shut down" in repr(pool)


@pytest.mark.parametrize("bad", [dict(workers=0), dict(workers=1.5), dict(workers=True), dict(max_workers=0)])
def test_run_pool_refuses_bad_worker_counts(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        labkit.RunPool(**bad)


def test_run_pool_refuses_a_preload_that_is_not_module_names():
    for bad in ("labkit.lora", [labkit], None, (name for name in ["labkit.lora"])):
        with pytest.raises(TypeError, match="preload"):
            labkit.RunPool(workers=1, preload=bad)
    with pytest.raises(ValueError, match="preload: no module named 'labkit.lroa'"):
        labkit.RunPool(workers=1, preload=["labkit.lroa"])


def test_run_pool_refuses_what_a_worker_could_not_run():
    pool = labkit.RunPool(workers=1)
    with pytest.raises(TypeError, match="fn"):
        pool.submit("finetune_run")
    with pytest.raises(TypeError, match="fn: .* inside a function"):
        pool.submit(lambda: 1)

    def defined_here():
        return 1

    with pytest.raises(TypeError, match="fn: .*defined_here"):
        pool.submit(defined_here)


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
