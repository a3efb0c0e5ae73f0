"""Preemption under torchrun and `dist.nproc_per_node`: SIGTERM or SIGUSR2 leads to a step checkpoint within
seconds even when log steps are far apart, every rank stops at the same step, and the resumed run ends bitwise equal
to an uninterrupted one."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import TRAIN, check, torchrun
from faults import descendants, torchrun_command, wait_until, with_env
from test_fault_tolerance import assert_same_run, wait_for_epoch

pytestmark = pytest.mark.slow

# Log steps never come (22 steps per epoch): only the timed checks can notice the signal.
ARGS = ["trainer.epochs=6", "optimizer=sgd", "scheduler=constant", "trainer.log_every_steps=10000"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """Two ranks, never interrupted: what every preempted and resumed run must end as."""
    workdir = tmp_path_factory.mktemp("straight")
    check(torchrun(2, [*ARGS, "hydra.run.dir=run"], workdir))
    return workdir / "run"


def stop_steps(run_dir: Path) -> list[int]:
    """The step each rank's log says it stopped at."""
    logs = [run_dir / "train.log", run_dir / "train.rank1.log"]
    return [int(m) for log in logs for m in re.findall(r"stopped at step (\d+) with a checkpoint", log.read_text())]


@pytest.mark.parametrize("signum, target", [(signal.SIGTERM, "agent"), (signal.SIGUSR2, "rank 1"),
                                            (signal.SIGTERM, "self-launched")],
                         ids=["SIGTERM-to-torchrun", "SIGUSR2-to-rank-1", "SIGTERM-to-dist.nproc_per_node=2"])
def test_a_signal_checkpoints_within_seconds_and_the_run_resumes_exactly(
    signum: signal.Signals, target: str, workdir: Path, straight: Path, launched
):
    self_launched = [sys.executable, TRAIN, *ARGS, "dist.nproc_per_node=2"]  # `python train.py` starts the workers
    agent = launched.start(self_launched if target == "self-launched" else torchrun_command(ARGS), workdir)
    run_dir = wait_for_epoch(workdir / "outputs", 1)  # epoch 2 is under way
    # SLURM signals the launcher (torchrun forwards SIGTERM to every worker); a USR2 may reach one task only.
    victim = agent.pid if target != "rank 1" else with_env(descendants(agent.pid), "RANK", "1")[0]
    signalled = time.monotonic()
    os.kill(victim, signum)
    checkpoints = run_dir / "checkpoints"
    seconds = wait_until(lambda: list(checkpoints.glob("step_*.pt")), 30, "a step checkpoint")
    print(f"{signum.name}: step checkpoint {seconds:.2f} s after the signal")
    agent.wait(timeout=60)
    assert time.monotonic() - signalled < 60
    if target == "self-launched":  # it ends as the signal ends a process, its workers' stop logged, no traceback
        assert agent.returncode == 128 + signum and "Traceback" not in (workdir / "launcher.err").read_text()
    steps = stop_steps(run_dir)
    assert len(steps) == 2 and steps[0] == steps[1], steps  # both ranks, the same step
    assert 22 < steps[0] < 6 * 22
    assert [p.name for p in checkpoints.glob("step_*.pt")] == [f"step_{steps[0]:09d}.pt"]
    check(torchrun(2, [*ARGS, "resume=auto", f"hydra.run.dir={run_dir}"], workdir))
    assert_same_run(run_dir, straight)
