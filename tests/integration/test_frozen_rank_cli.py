"""A frozen rank (SIGSTOP mid-run): under every launcher the whole group is gone, with a non-zero exit,
within dist.step_timeout_s + 60 s, and rank 0's log names the collective and the rank that did not
arrive; under `torchrun --max-restarts=1` the run goes on and ends bitwise equal to an uninterrupted one."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TRAIN, check, torchrun
from faults import descendants, is_alive, torchrun_command, wait_for_epoch, wait_until, with_env
from test_fault_tolerance import assert_same_run

pytestmark = pytest.mark.slow

STEP_TIMEOUT_S = 10
ARGS = ["optimizer=sgd", "scheduler=constant", f"dist.step_timeout_s={STEP_TIMEOUT_S}"]
NAMED = re.compile(r"(torch\.distributed\.\w+|DistributedDataParallel\.\w+|DDP's gradient all-reduce in backward\(\))"
                   rf" \(src/[\w/]+\.py:\d+ \w+\) timed out after {STEP_TIMEOUT_S} s \(dist\.step_timeout_s\): "
                   r"rank 1 did not arrive")


def freeze_rank_1(root: int, rank_key: str) -> tuple[list[int], float]:
    """SIGSTOP the rank-1 worker below `root`; every process of the tree then, and the time."""
    tree = [root, *descendants(root)]
    victims = with_env(tree, rank_key, "1")
    assert len(victims) == 1, victims
    os.kill(victims[0], signal.SIGSTOP)
    return tree, time.monotonic()


LAUNCHERS = {
    # name: (command, cwd is the repo (submitit pickles `src` by reference), run dir, env key naming the rank)
    "torchrun": lambda work: (torchrun_command(["trainer.epochs=30", *ARGS, f"hydra.run.dir={work / 'run'}"]),
                              work, work / "run", "RANK"),
    "nproc_per_node": lambda work: ([sys.executable, TRAIN, "dist.nproc_per_node=2", "trainer.epochs=30", *ARGS,
                                     f"hydra.run.dir={work / 'run'}"], work, work / "run", "RANK"),
    "submitit_local": lambda work: ([sys.executable, TRAIN, "-m", "hydra/launcher=local_ddp", "trainer.epochs=30",
                                     *ARGS, f"hydra.sweep.dir={work / 'sweep'}"], REPO, work / "sweep" / "0",
                                    "SUBMITIT_LOCAL_GLOBALID"),
}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_frozen_rank_ends_the_whole_group_and_is_named(launcher: str, workdir: Path, launched):
    command, cwd, run_dir, rank_key = LAUNCHERS[launcher](workdir)
    root = launched.start(command, cwd, logs=workdir)
    wait_for_epoch(run_dir, 1)
    tree, frozen_at = freeze_rank_1(root.pid, rank_key)
    wait_until(lambda: not any(is_alive(pid) for pid in tree), STEP_TIMEOUT_S + 60, "the group's end")
    seconds = time.monotonic() - frozen_at
    print(f"{launcher}: every process gone {seconds:.1f} s after SIGSTOP")
    assert root.wait(timeout=10) != 0
    assert NAMED.search((run_dir / "train.log").read_text())


def test_torchrun_restarts_the_group_after_a_frozen_rank_and_ends_exactly(workdir: Path, launched):
    args = ["trainer.epochs=4", *ARGS]
    check(torchrun(2, [*args, "hydra.run.dir=straight"], workdir))
    agent = launched.start(torchrun_command([*args, "hydra.run.dir=run"], 2, "--max-restarts=1"), workdir)
    wait_for_epoch(workdir / "run", 1)
    freeze_rank_1(agent.pid, "RANK")
    assert agent.wait(timeout=STEP_TIMEOUT_S + 120) == 0, (workdir / "launcher.err").read_text()[-3000:]
    log = (workdir / "run" / "train.log").read_text()
    assert NAMED.search(log) and "resumed from" in log
    assert_same_run(workdir / "run", workdir / "straight")
