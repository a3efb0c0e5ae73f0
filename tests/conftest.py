"""Shared helpers: run the real command line (`python train.py`, torchrun) and read what it wrote."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

pytest_plugins = ["faults"]  # its `launched` fixture: fault-injection tests' processes, killed at teardown

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "train.py")
# Small and quick: 2 epochs of digits take a few seconds.
TINY = ["trainer.epochs=2", "trainer.log_every_steps=5"]


def run(command: list[str], cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `command`, returning its exit code and output; never hangs the suite. `python SCRIPT ...` and
    `python -m MODULE ...` without environment overrides run in a child of the zygote (torch already imported)."""
    full_env = launch_env(env)
    if zygote_runs(command, cwd, env):
        return _zygote().run(command, cwd, full_env, timeout)
    return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def zygote_runs(command: list[str], cwd: Path, env: dict | None) -> bool:
    """Whether the zygote can run `command`: `python SCRIPT.py ...` or `python -m MODULE ...`, no interpreter
    flags, no environment overrides (TEST_ZYGOTE=0: never)."""
    first = command[1] if command[0] == sys.executable and len(command) > 1 else ""
    return ZYGOTE_ENABLED and not env and (first == "-m" or (first.endswith(".py") and (Path(cwd) / first).is_file()))


def launch_env(env: dict | None = None) -> dict[str, str]:
    """The environment of a launched command: this one, unbuffered, with no distributed variables."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(key, None)
    return full_env


ZYGOTE_ENABLED = os.environ.get("TEST_ZYGOTE", "1") != "0"  # TEST_ZYGOTE=0: a fresh interpreter every time
_zygotes: list[Zygote] = []


def _zygote() -> Zygote:
    """This test process's zygote, started on first use (tests/fixtures/zygote.py)."""
    if not _zygotes or _zygotes[0].server.poll() is not None:
        _zygotes[:] = [Zygote()]
    return _zygotes[0]


class Zygote:
    """The client of tests/fixtures/zygote.py: runs a command in a forked child, as subprocess.run would."""

    def __init__(self) -> None:
        script = str(REPO / "tests" / "fixtures" / "zygote.py")
        # ZYGOTE_ENV_ROOM: room in the environment block exec puts on the zygote's stack, where each forked child
        # writes its own environment for /proc/PID/environ (zygote.set_environment).
        self.server = subprocess.Popen([sys.executable, script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       env={**launch_env(), "ZYGOTE_ENV_ROOM": "." * 65536}, text=True, bufsize=1)

    def start(self, command: list[str], cwd: Path, env: dict, stdout: Path, stderr: Path, session: bool) -> int:
        """The pid of `command` started in a forked child that this process adopts (see ZygoteProcess)."""
        _become_a_subreaper()
        request = {"argv": command[1:], "cwd": str(Path(cwd).resolve()), "env": env, "stdout": str(stdout),
                   "stderr": str(stderr), "detached": True, "launcher": os.getpid(), "session": session}
        self.server.stdin.write(json.dumps(request) + "\n")
        return json.loads(self.server.stdout.readline())["pid"]

    def run(self, command: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="zygote-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"argv": command[1:], "cwd": str(Path(cwd).resolve()), "env": env, "stdout": str(out),
                       "stderr": str(err)}
            self.server.stdin.write(json.dumps(request) + "\n")
            pid = json.loads(self.server.stdout.readline())["pid"]
            timer = threading.Timer(timeout, _kill, (pid,))
            timer.start()
            try:
                status = json.loads(self.server.stdout.readline())["status"]
            except BaseException:  # interrupted (pytest-timeout, ^C): its answer would reach the next request
                _kill(pid)
                self.server.kill()
                self.server.wait()
                raise
            finally:
                timer.cancel()
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if _killed.pop(pid, False):  # the timer killed it
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
        return subprocess.CompletedProcess(command, os.waitstatus_to_exitcode(status), stdout, stderr)


class ZygoteProcess(subprocess.Popen):
    """`command` forked by this process's zygote and adopted by this process, which waits for it, signals it and
    reads its exit status as for any Popen; its stdout and stderr go to files."""

    def __init__(self, command: list[str], cwd: Path, env: dict, stdout: Path, stderr: Path,
                 start_new_session: bool = False) -> None:
        self._start = (cwd, env, stdout, stderr, start_new_session)
        super().__init__(command)

    def _execute_child(self, args, *rest) -> None:  # noqa: ANN001 - Popen's
        cwd, env, stdout, stderr, session = self._start
        self.pid = _zygote().start(list(args), cwd, env, stdout, stderr, session)
        self._child_created = True


PR_SET_CHILD_SUBREAPER = 36  # prctl(2)
_subreaper: list[bool] = []


def _become_a_subreaper() -> None:
    """Orphans below this process come to it (PR_SET_CHILD_SUBREAPER), not to init: so can a zygote's child."""
    if not _subreaper:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        _subreaper.append(True)


_killed: dict[int, bool] = {}


def _kill(pid: int) -> None:
    _killed[pid] = True
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


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
