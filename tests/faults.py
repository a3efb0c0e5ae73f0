"""Helpers for tests that inject faults (signals, frozen and killed processes) into real launchers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
from conftest import TRAIN

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
_GONE = (ProcessLookupError, FileNotFoundError, PermissionError)  # a process that vanished meanwhile


class Launched:
    """Processes started in their own sessions, so a test can end every process they started."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen] = []

    def start(self, command: list[str], cwd: Path, logs: Path | None = None, env: dict | None = None
              ) -> subprocess.Popen:
        """Start `command` in `cwd`, its output in `launcher.out` and `launcher.err` of `logs` (or `cwd`)."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            full_env.pop(key, None)
        process = subprocess.Popen(command, cwd=cwd, env=full_env, start_new_session=True,
                                   stdout=open((logs or cwd) / "launcher.out", "w"),
                                   stderr=open((logs or cwd) / "launcher.err", "w"))
        self.processes.append(process)
        return process

    def kill_all(self) -> None:
        """SIGKILL every process of the sessions started here (a stopped process dies of it too)."""
        for process in self.processes:
            with contextlib.suppress(*_GONE):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


@pytest.fixture
def launched() -> Iterator[Launched]:
    """Start processes with `launched.start(...)`; whatever still runs at teardown is killed."""
    processes = Launched()
    yield processes
    processes.kill_all()


def torchrun_command(args: list[str], nproc: int = 2, *options: str) -> list[str]:
    """`torchrun --standalone --nproc_per_node=N OPTIONS train.py ARGS`."""
    return [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *options, TRAIN, *args]


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` in the process tree."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parent = _status(int(entry.name)).get("PPid")
            if parent is not None:
                children.setdefault(int(parent), []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def with_env(pids: list[int], key: str, value: str) -> list[int]:
    """The processes among `pids` started with `key=value` in their environment."""
    wanted = f"{key}={value}".encode()
    found = []
    for pid in pids:
        with contextlib.suppress(*_GONE):
            if wanted in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(pid)
    return found


def is_alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    state = _status(pid).get("State", "Z")
    return not state.startswith(("Z", "X"))


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> float:
    """Poll `condition` until it is true; return the seconds it took (or fail the test)."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - started


def wait_for_epoch(run_dir: Path, epoch: int, timeout: float = 180) -> None:
    """Until `run_dir`'s metrics.json reports `epoch`."""
    def reached() -> bool:
        try:
            return json.loads((run_dir / "metrics.json").read_text())["epoch"] >= epoch
        except (OSError, ValueError):
            return False

    wait_until(reached, timeout, f"epoch {epoch} in {run_dir}")


def _status(pid: int) -> dict[str, str]:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)

