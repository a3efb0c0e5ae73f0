"""Shared helpers: run the real command line (`python train.py`, torchrun) and read what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest_plugins = ["faults"]  # its `launched` fixture: fault-injection tests' processes, killed at teardown

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "train.py")
# Small and quick: 2 epochs of digits take a few seconds.
TINY = ["trainer.epochs=2", "trainer.log_every_steps=5"]


def run(command: list[str], cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `command`, returning its exit code and output; never hangs the suite."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(key, None)
    return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def train(args: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    """`python train.py ARGS` in `cwd`."""
    return run([sys.executable, TRAIN, *args], cwd, **kwargs)


def torchrun(nproc: int, args: list[str], cwd: Path, script: str = TRAIN, **kwargs) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=N train.py ARGS` (standalone: a free port every time)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script]
    return run([*command, *args], cwd, **kwargs)


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    output = f"STDOUT\n{result.stdout[-3000:]}\nSTDERR\n{result.stderr[-5000:]}"
    assert result.returncode == 0, f"exit {result.returncode}\n{output}"
    return result


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def weights(run_dir: Path, name: str = "last.pt") -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / name, map_location="cpu", weights_only=True)["model"]


@pytest.fixture
def restore_backend_flags():
    """TF32 and cuDNN flags as they were before the test (they are process-wide)."""
    flags = [(torch.backends.cuda.matmul, "allow_tf32")] + [
        (torch.backends.cudnn, name) for name in ("allow_tf32", "deterministic", "benchmark")
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name in flags]
    yield
    for owner, name, value in saved:
        setattr(owner, name, value)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty directory to launch from: its outputs/ is where default run dirs land."""
    return tmp_path
