"""A lost node: two torchrun agents on localhost (`--nnodes=2`, c10d rendezvous); the agent that does not
host the store is SIGKILLed with its worker, then started again; the run completes bitwise equal to an
uninterrupted one.

Two settings make a replaced agent able to rejoin (torch 2.14): TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (with
the shared store, the surviving agent keeps its first round's MASTER_ADDR and never publishes it again, so
a new agent waits for it in vain), and `resume=auto` with a fixed `hydra.run.dir` (a new agent counts its
restarts from 0, so its worker cannot tell by itself that the run is a restart).
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest
from conftest import TRAIN, check, free_port, torchrun
from faults import TORCHRUN, descendants, wait_for_epoch, wait_until
from test_fault_tolerance import assert_same_run

pytestmark = pytest.mark.slow

ARGS = ["trainer.epochs=8", "optimizer=sgd", "scheduler=constant"]


def accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_lost_node_that_comes_back_ends_the_run_bitwise_equal(workdir: Path, launched):
    check(torchrun(2, [*ARGS, "hydra.run.dir=straight"], workdir))
    port = free_port()
    command = [*TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=node-loss", "--max-restarts=3", TRAIN, *ARGS,
               "resume=auto", f"hydra.run.dir={workdir / 'run'}"]
    # One thread per worker, as torchrun sets for the uninterrupted run (2 workers per node): the same kernels.
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    nodes = {name: workdir / name for name in ("host", "lost", "back")}
    for folder in nodes.values():
        folder.mkdir()
    host = launched.start(command, workdir, logs=nodes["host"], env=env)
    wait_until(lambda: accepts(port), 60, "the rendezvous store")  # started first, this agent hosts it
    lost = launched.start(command, workdir, logs=nodes["lost"], env=env)
    wait_for_epoch(workdir / "run", 1)
    for pid in [lost.pid, *descendants(lost.pid)]:  # torchrun's workers run in sessions of their own
        os.kill(pid, signal.SIGKILL)
    back = launched.start(command, workdir, logs=nodes["back"], env=env)
    assert host.wait(timeout=300) == 0, (nodes["host"] / "launcher.err").read_text()[-3000:]
    assert back.wait(timeout=60) == 0, (nodes["back"] / "launcher.err").read_text()[-3000:]
    assert "resumed from" in (workdir / "run" / "train.log").read_text()
    assert_same_run(workdir / "run", workdir / "straight")
