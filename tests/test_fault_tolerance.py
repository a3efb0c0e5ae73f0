"""A worker killed mid-run: torchrun restarts the group, the run continues from its last
checkpoint in the same run dir, and ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TRAIN, check, metrics, torchrun, weights

pytestmark = pytest.mark.slow

ARGS = ["trainer.epochs=3", "optimizer=sgd", "scheduler=constant"]
TIMING_KEYS = {"epoch_time_s", "samples_per_s"}


def worker_pid(agent_pid: int, rank: int) -> int | None:
    """The pid of the worker with RANK=rank that torchrun process `agent_pid` started."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if parent == agent_pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def wait_for_epoch(outputs: Path, epoch: int, timeout: float = 120) -> Path:
    """The run dir under `outputs` once its metrics.json reports `epoch`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for path in outputs.glob("*/*/metrics.json"):
            try:
                if json.loads(path.read_text())["epoch"] >= epoch:
                    return path.parent
            except (OSError, ValueError):
                pass
        time.sleep(0.05)
    raise TimeoutError(f"no run under {outputs} reached epoch {epoch}")


def without_timing(summary: dict) -> dict:
    history = [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in summary["history"]]
    return {**{k: v for k, v in summary.items() if k not in TIMING_KEYS}, "history": history}


def test_a_killed_worker_is_restarted_and_the_run_ends_as_if_never_interrupted(workdir: Path):
    check(torchrun(2, [*ARGS, "hydra.run.dir=straight"], workdir))

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "--max-restarts=2", TRAIN, *ARGS]
    agent = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    run_dir = wait_for_epoch(workdir / "outputs", 1)  # epoch 1 is checkpointed; epoch 2 is under way
    victim = worker_pid(agent.pid, rank=1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    out, err = agent.communicate(timeout=300)
    assert agent.returncode == 0, err[-3000:]

    log = (run_dir / "train.log").read_text()
    assert "resumed from" in log and "after epoch" in log  # the restarted group resumed by itself
    assert list((workdir / "outputs").glob("*/*")) == [run_dir]  # the restart kept its run dir
    assert without_timing(metrics(run_dir)) == without_timing(metrics(workdir / "straight"))
    for name, tensor in weights(workdir / "straight").items():
        assert torch.equal(tensor, weights(run_dir)[name]), name
