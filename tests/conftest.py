"""Shared helpers: run the real command line (`python train.py`, torchrun) and read what it wrote."""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
from process_memory import descendants

pytest_plugins = ["faults"]  # its `launched` fixture: fault-injection tests' processes, killed at teardown

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "train.py")
# Small and quick: 2 epochs of digits take a few seconds.
TINY = ["trainer.epochs=2", "trainer.log_every_steps=5"]


def run(command: list[str], cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `command` as a real process (a fresh interpreter for `python ...`), returning its exit code and
    output; never hangs the suite: past `timeout`, or if the test is interrupted, the process and everything
    it started (a launcher's workers, in sessions of their own) are killed."""
    with subprocess.Popen(command, cwd=cwd, env=launch_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)
            stdout, stderr = process.communicate()
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr) from None
        except BaseException:  # pytest-timeout, ^C
            kill_tree(process.pid)
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it."""
    for each in [*descendants(pid), pid]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(each, signal.SIGKILL)


def launch_env(env: dict | None = None) -> dict[str, str]:
    """The environment of a launched command: this one, unbuffered, with no distributed variables and nothing a run
    agreed on (its start time, its dirs: src/parallel/job.py) but what `env` sets."""
    inherited = {key: value for key, value in os.environ.items() if not key.startswith("DDP_TEMPLATE_")}
    full_env = {**inherited, "PYTHONUNBUFFERED": "1", **(env or {})}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(key, None)
    return full_env


def free_port() -> int:
    """A port of localhost, free now, for a test to hand to the processes it starts (MASTER_PORT, torchrun's
    --rdzv-endpoint of several agents, a server's --port): agreed on before they start, so only a port nothing
    else takes meanwhile will do. Such a port lies outside the kernel's ephemeral range (ip_local_port_range):
    the kernel never gives those to `bind(('', 0))`, an outgoing connection (gloo's pairs, HTTP clients) or
    torchrun --standalone, so no other process gets it without naming it. Each xdist worker (up to 8) draws from
    a slice of its own and hands out each port of it once before any again, so the suite's parallel tests never
    name the same port; where a slice starts is random, so two suites run at once on one machine rarely do."""
    while True:
        port = next(_PORTS)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))  # no SO_REUSEADDR: a port with connections in TIME_WAIT is skipped
            except OSError:
                continue
        return port


def _named_ports() -> Iterator[int]:
    """This process's slice of the ports below the ephemeral range (10000 up; torch's 29400 and 29500 left out),
    cycled from a random start."""
    low, high = 10000, int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [port for port in range(low, high) if not 29400 <= port < 29600]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    slices = 8
    share = ports[int(worker.removeprefix("gw") or 0) % slices::slices]
    start = random.Random().randrange(len(share))
    return itertools.cycle(share[start:] + share[:start])


_PORTS = _named_ports()


# The suite runs every process with one intra-op thread (pytest_configure below), so what a test computes does not
# depend on the machine's core count. A 1-process run's sums, though, differ with its thread count, and tests that
# compare a run which was 1 process for a while with a 2-rank run within 1e-5 hold with 2 threads, the default on
# the 2-core machine their tolerances were measured on: with 1 thread four of them differed by up to 2e-2, with 4 by
# 1.2e-4 (2026-11-26). Those tests give their 1-process runs this environment. Its idle threads sleep
# (OMP_WAIT_POLICY) where OpenMP's default spins: the same sums, bit for bit, and no core burnt while the suite's other
# test runs beside it (a 2000-step run of tiny batches took 31.4 CPU-seconds spinning, 16 sleeping, 9.2 on 1 thread).
TWO_THREADS = {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}


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
    return torch.load(run_dir / "checkpoints" / name, map_location="cpu", weights_only=True)["models"]["model"]


# Tests of the template's own README, docs and benchmarks (benchmarks/): a fork that rewrites those deselects them
# with -m "not template". Marked here by path (test_readme.py is the README's to change); tests of other files
# that check the template's own files carry the marker themselves.
TEMPLATE = {"tests/integration/test_readme.py", "tests/integration/test_chaos.py"}
# The tests of those files that launch the benchmarks: slow (out of `make test-fast`).
BENCHMARK_RUNS = "test_the_*benchmark*"


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op thread per process (as torchrun gives each of its workers) unless a test asks for TWO_THREADS:
    the same sums on any machine, and no more threads than cores while two tests, each launching two or three
    processes, run at a time (-n 2). Set before xdist starts its workers: they and every launched process inherit it."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.relative_to(REPO).as_posix() in TEMPLATE:
            item.add_marker(pytest.mark.template)
            if fnmatch.fnmatch(item.name, BENCHMARK_RUNS):
                item.add_marker(pytest.mark.slow)
    # Files with slow tests first: xdist hands out files in this order (pytest.ini: --no-loadscope-reorder), so the
    # quick ones come last and fill the time until the last slow file ends, where one worker would wait alone.
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


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


@pytest.fixture(scope="session")
def one_epoch_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """The run dir of `python train.py trainer.epochs=1 hydra.run.dir=run`: one epoch of the default digits run,
    trained once per session and shared by xdist's workers (the first to ask trains it, under a lock). Read it,
    or `copy_run` it to change anything."""
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent  # pytest-N/: this session's, for every worker
    with open(shared / "one_epoch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "one_epoch" / "run" / "metrics.json").is_file():
            shutil.rmtree(shared / "one_epoch", ignore_errors=True)  # a worker that failed to train it
            (shared / "one_epoch").mkdir()
            check(train(["trainer.epochs=1", "hydra.run.dir=run"], shared / "one_epoch"))
    return shared / "one_epoch" / "run"


def copy_run(run_dir: Path, to: Path) -> Path:
    """A copy of a run dir at `to`: it resumes and evaluates as the original (its checkpoints and config name no
    absolute path; only train.log and .hydra/hydra.yaml record where it ran)."""
    shutil.copytree(run_dir, to)
    return to
