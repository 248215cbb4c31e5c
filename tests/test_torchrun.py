"""The per-rank functions of chapters 07 and 08 under torchrun (``python -m torch.distributed.run
--standalone``), through ``python -m labkit.distrun``: the same code path as labkit.dist.launch."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import labkit  # noqa: F401
from labkit import distrun

ROOT = Path(__file__).resolve().parent.parent


def _torchrun(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
           "OMP_NUM_THREADS": "1", "LABKIT_DEVICE": "cpu", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "labkit.distrun", *args, "--out", str(tmp_path)]
    # start_new_session: if the test times out, the whole process group (torchrun and its ranks) is killed below
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return subprocess.CompletedProcess(command, proc.returncode, out, None)


def test_tensor_parallel_training_under_torchrun(tmp_path):
    done = _torchrun(tmp_path, "run", "tp", "--steps", "2")
    assert done.returncode == 0, done.stdout
    for rank in (0, 1):
        assert f"[rank {rank}/2] tp: losses" in done.stdout
        result = torch.load(tmp_path / f"result_{rank}.pt", weights_only=False)
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5)


def test_any_rank_function_under_torchrun(tmp_path):
    kwargs = '{"demos": {"data_parallel": {"steps": 1}, "zero1": {"steps": 1}}}'
    done = _torchrun(tmp_path, "call", "labkit.dist_demos:several", "--kwargs", kwargs)
    assert done.returncode == 0, done.stdout
    for rank in (0, 1):
        result = torch.load(tmp_path / f"result_{rank}.pt", weights_only=False)
        assert result["data_parallel"]["DDPIndividual"] < 1e-5 and result["zero1"]["max_abs_diff"] < 1e-5


def test_resolve_and_strategies():
    assert distrun.resolve("labkit.dist_demos:hello").__name__ == "hello"
    for module, name in distrun.STRATEGIES.values():
        assert callable(distrun.resolve(f"{module}:{name}"))
    with pytest.raises(ValueError, match="package.module:function"):
        distrun.resolve("labkit.dist_demos")
    with pytest.raises(ValueError, match="no function"):
        distrun.resolve("labkit.dist_demos:nothing")


def test_init_from_environment_says_what_is_missing(monkeypatch):
    from labkit.dist import init_from_environment

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        init_from_environment()
