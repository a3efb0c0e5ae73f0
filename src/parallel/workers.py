"""`dist.nproc_per_node=N`: `python train.py` starts its own group of N local workers; and how a worker of any
launcher runs its job: reporting its failure to the launcher, and ending with the launcher that started it."""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from src.common import retries
from src.common.errors import USAGE_ERROR_EXIT_CODE, UsageError, WorkersReportedUsageError, find_usage_error
from src.parallel import distributed
from src.parallel.job import RunContext, quote_override
from src.parallel.ranks import DistEnv, is_worker

LAUNCHER_PID = "DDP_TEMPLATE_LAUNCHER_PID"  # set by launch_workers: the process its workers die with

T = TypeVar("T")


def run_group(script: str, cfg: Any, context: RunContext) -> float:
    """Run the job as `dist.nproc_per_node` workers of `script`; their last monitored value (NaN before one)."""
    launch_workers(script, cfg.dist.nproc_per_node, context.run_dir, context.overrides, cfg.dist.master_port,
                   cfg.trainer.device, cfg.dist.backend, context.composing)
    metrics_file, monitor = context.run_dir / "metrics.json", cfg.trainer.monitor
    if not (metrics_file.exists() and monitor):
        return float("nan")
    return json.loads(metrics_file.read_text()).get(monitor, float("nan"))


def launch_workers(script: str, nproc: int, run_dir: Path, task_overrides: Sequence[str],
                   master_port: int | None = None, device: str = "auto", backend: str = "auto",
                   composing: Sequence[str] = ()) -> None:
    """Run `script` as `nproc` local workers into `run_dir`, as `torchrun --standalone` (a c10d rendezvous on
    `master_port`, or a free port). A busy port or a device the workers lack is refused first; workers that stop on
    a usage error end this process alike."""
    if master_port is not None and not port_is_free(master_port):
        raise UsageError(f"dist.master_port={master_port} is in use on localhost; pick another port "
                         "or leave dist.master_port=null for a free one")
    last_worker = DistEnv(rank=nproc - 1, local_rank=nproc - 1, world_size=nproc)
    distributed.select_backend(backend, distributed.select_device(device, last_worker))  # the workers' checks, once
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the workers inherit it (die_with_launcher)
    worker_args = [script, *composing, *task_overrides, f"hydra.run.dir={quote_override(str(run_dir))}",
                   "hydra.output_subdir=null"]
    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun does: no thread oversubscription
    with tempfile.TemporaryDirectory(prefix="torchelastic_") as log_dir:  # torch's default would stay in /tmp
        standalone = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                                  rdzv_backend="c10d", rdzv_endpoint=f"localhost:{master_port or 0}", max_restarts=0,
                                  monitor_interval=0.5, logs_specs=DefaultLogsSpecs(log_dir=log_dir))
        try:
            elastic_launch(standalone, entrypoint=sys.executable)(*worker_args)
        except ChildFailedError as error:
            if stopped_on_a_usage_error([failure.exitcode for failure in error.failures.values()]):
                recorded = retries.peer_failure(os.getpid(), standalone.run_id)  # the line they printed
                raise WorkersReportedUsageError(recorded or "the workers stopped on the error above") from None
            raise
        except SignalException as error:  # SIGTERM: passed on to the workers, which stopped (with a checkpoint)
            sys.exit(128 + error.sigval)  # as a process the signal ended, with no traceback of the launcher's


def stopped_on_a_usage_error(exit_codes: Sequence[int]) -> bool:
    """Whether failed workers' `exit_codes` are a usage error's (the others SIGTERMed by the launcher)."""
    return USAGE_ERROR_EXIT_CODE in exit_codes and all(code == USAGE_ERROR_EXIT_CODE or code < 0 for code in exit_codes)


def port_is_free(port: int) -> bool:
    """Whether a server could listen on `port` of localhost now (torch's own bind error is a page of traceback)."""
    with socket.socket() as sock:
        # As torch's TCPStore binds: a port merely waiting out TIME_WAIT counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("localhost", port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def worker(function: Callable[..., T]) -> Callable[..., T]:
    """`function`, which in a launcher's worker reports its failure to it and dies with `launch_workers`' process."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> T:
        if not is_worker():
            return function(*args, **kwargs)
        die_with_launcher()
        return recording_errors(function)(*args, **kwargs)

    return run


def die_with_launcher(environ: Mapping[str, str] = os.environ) -> None:
    """A worker `launch_workers` started dies with it (Linux's PR_SET_PDEATHSIG): a launcher killed outright would
    leave it writing into the run dir a resumed run continues in."""
    launcher = environ.get(LAUNCHER_PID)
    if launcher is None or not sys.platform.startswith("linux") or os.getppid() != int(launcher):
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != int(launcher):  # the launcher died before the kernel watched it
        os.kill(os.getpid(), signal.SIGKILL)


def recording_errors(function: Callable[..., T]) -> Callable[..., T]:
    """`function` under torch's @record (its traceback in torchrun's summary), but for a usage error's one line."""

    def raising_usage_errors_past_record(*args: Any, **kwargs: Any) -> T:
        try:
            return function(*args, **kwargs)
        except Exception as error:
            if find_usage_error(error) is not None:
                raise _UnrecordedError(error) from None  # @record catches Exception, not BaseException
            if retries.peer_failure() is not None:
                # A collective broke as a peer exited on a usage error, which it printed: the run's one line.
                raise _UnrecordedError(WorkersReportedUsageError("a peer stopped on the error above")) from None
            # Until @record has written the error file: one cut short by the SIGTERM torchrun's agent sends the
            # survivors of a failure is empty, and the agent crashes on it instead of restarting the group.
            if _is_main_thread():
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            raise

    recorded = record(raising_usage_errors_past_record)

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        handler = signal.getsignal(signal.SIGTERM) if _is_main_thread() else None
        try:
            return recorded(*args, **kwargs)  # type: ignore[return-value]
        except _UnrecordedError as carrier:
            error = carrier.error  # re-raised with its own cause kept: a UsageError Hydra wrapped is found there
            raise error from error.__cause__
        finally:
            if handler is not None:  # a sweep under torchrun goes on to its next job
                signal.signal(signal.SIGTERM, handler)

    return wrapper


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class _UnrecordedError(BaseException):
    """Carries a usage error past torch's @record, which records every Exception."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error
