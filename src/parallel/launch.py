"""Hydra meets the launchers: one run dir per run, whatever started the processes.

Hydra resolves `${now:...}` in every process, so torchrun ranks that reach Hydra a
second apart would each create their own timestamped run dir (hydra #2070). Run dirs
are therefore named with `${run_timestamp:FORMAT}`: rank 0's clock, shared with the
other ranks through the launcher's store before Hydra creates any directory. Ranks
other than 0 also skip writing `.hydra/` (`${main_rank_only:}`), so the run dir holds one
copy of the config. Processes started by torchrun, by `launch_workers`, by submitit or by
`srun` all end up with the same RANK / LOCAL_RANK / WORLD_SIZE contract.

Nothing here imports torch unless the run has several processes: `python train.py
--help` and `--cfg job` stay fast.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import functools
import os
import shutil
import signal
import socket
import sys
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence, TypeVar

from omegaconf import OmegaConf

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

_STORE_KEY = "ddp_template/run_started_at"
_ENV_KEY = "DDP_TEMPLATE_RUN_STARTED_AT"
_LAUNCHER_PID = "DDP_TEMPLATE_LAUNCHER_PID"  # set by launch_workers: the process its workers die with
# Set on a sweep's job run again in its own dir by a sweep run again (src/sweeps/jobs.py).
SWEEP_JOB_RESUMES = "DDP_TEMPLATE_SWEEP_JOB_RESUMES"
T = TypeVar("T")
_started_at: datetime.datetime | None = None


def run_started_at() -> datetime.datetime:
    """The run's start time: this process's clock alone, or rank 0's in a group.

    It is also exported to the environment, so processes this one starts (workers of
    `dist.nproc_per_node`, tasks of the submitit launcher) name the same dirs.
    """
    global _started_at
    if _started_at is None:
        inherited = os.environ.get(_ENV_KEY)
        _started_at = datetime.datetime.fromisoformat(inherited) if inherited else _agree_on_start_time()
        os.environ[_ENV_KEY] = _started_at.isoformat()
    return _started_at


def _agree_on_start_time() -> datetime.datetime:
    now = datetime.datetime.now()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return now
    from src.parallel import distributed

    env = distributed.read_env()
    store = distributed.rendezvous_store(env)
    if env.is_main_process:
        # compare_set keeps the first value: a rank 0 restarted in the same store keeps the dir.
        store.compare_set(_STORE_KEY, "", now.isoformat())
    return datetime.datetime.fromisoformat(store.get(_STORE_KEY).decode())


def register_resolvers() -> None:
    """The config's `${run_timestamp:FORMAT}` and `${main_rank_only:VALUE}` (conf/config.yaml), and
    `${data:FIELD}` (src/config/data_fields.py)."""
    OmegaConf.register_new_resolver("run_timestamp", lambda fmt: run_started_at().strftime(fmt), replace=True)
    # Hydra writes `.hydra/` before our code runs, in every process of a group; this
    # makes `hydra.output_subdir` null on the other ranks whichever launcher started them.
    OmegaConf.register_new_resolver("main_rank_only", lambda value: value if is_main_process() else None, replace=True)
    from src.config import data_fields

    data_fields.register_resolver()  # ${data:FIELD} in model YAMLs


def is_main_process() -> bool:
    """Whether this process is rank 0 (or the only process), whatever launched it."""
    adopt_cluster_env()
    return int(os.environ.get("RANK", "0")) == 0


def adopt_cluster_env(environ: os._Environ = os.environ) -> None:  # type: ignore[type-arg]
    """Under submitit or `srun` (no torchrun variables), export RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT from the job's environment, so the rest of the run reads
    one contract whatever the launcher.

    submitit's TorchDistributedEnvironment knows SLURM's variables (node list, task ids)
    and its own local executor's; a plain `srun` task is a SLURM task it can read too.
    """
    if is_worker(environ):
        return
    if "SUBMITIT_EXECUTOR" not in environ:
        if int(environ.get("SLURM_NTASKS", "1")) <= 1 or "SLURM_PROCID" not in environ:
            return
        environ["SUBMITIT_EXECUTOR"] = "slurm"  # a task of `srun python train.py`
    import submitit

    if submitit.JobEnvironment().num_tasks > 1:
        submitit.helpers.TorchDistributedEnvironment().export()
        # As torchrun does: one thread per worker unless the job says how many cores it has.
        environ.setdefault("OMP_NUM_THREADS", environ.get("SLURM_CPUS_PER_TASK", "1"))


def restarted_by_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this run is a restart: torchrun's `--max-restarts` or a requeued SLURM job.

    Such a run continues from its run dir's last checkpoint without being told (the run dir
    is the same: rank 0's start time stays in torchrun's store and in the job's environment).
    """
    return int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 or int(environ.get("SLURM_RESTART_COUNT", "0")) > 0


def resume_setting(resume: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """What `resume=` means for this process: a restart continues its run dir's last checkpoint
    even when the command line (the same on every restart) asked for a fresh run; so does a sweep's
    job that a sweep run again starts in its own dir (src/sweeps/jobs.py sets the variable)."""
    resumes = restarted_by_launcher(environ) or environ.get(SWEEP_JOB_RESUMES) == "1"
    return "auto" if resume is None and resumes else resume


@contextlib.contextmanager
def discard_unused_run_dir(run_dir: Path, in_sweep: bool) -> Iterator[None]:
    """If the block fails with a usage error before the run has written anything of its own, remove
    the run dir this run created (Hydra's `.hydra/` copy and the log files are all it holds), so a
    refused run leaves no directory behind: in a single process, and in the process that started
    `dist.nproc_per_node` workers (they have all exited by then). A dir that held anything before, a
    sweep's job dir, a dir with checkpoints, metrics or TensorBoard events, and the dir of a torchrun
    group's workers (one rank may still be writing its log) are never touched."""
    try:
        yield
    except Exception as error:
        from src.common.errors import find_usage_error

        # Not in a torchrun group's workers: another rank may still be writing its log there.
        if find_usage_error(error) is not None and not (in_sweep or is_worker()) and _holds_nothing_of_a_run(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
            _remove_empty_parents(run_dir)
        raise


def _remove_empty_parents(path: Path) -> None:
    """Remove the folders above `path` (outputs/DATE/...) that are left empty, up to the working directory."""
    stop = Path.cwd().resolve()
    for parent in path.resolve().parents:
        if parent == stop or stop not in parent.parents or any(parent.iterdir()):
            return
        parent.rmdir()


def _holds_nothing_of_a_run(run_dir: Path) -> bool:
    """Whether `run_dir` was created by this run and holds only its config copy and logs."""
    from src.config.schema import created_run_dirs

    if run_dir.resolve() not in created_run_dirs:
        return False
    return all(path.name == ".hydra" or path.suffix == ".log" for path in run_dir.iterdir())


def is_worker(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a launcher (torchrun, our own `launch_workers`, SLURM) started this process as a worker."""
    return "WORLD_SIZE" in environ


def launch_workers(
    script: str,
    nproc: int,
    run_dir: Path,
    task_overrides: Sequence[str],
    master_port: int | None = None,
    device: str = "auto",
    backend: str = "auto",
) -> None:
    """Run `script` as one DDP group of `nproc` local workers writing into `run_dir`.

    This is torchrun's own machinery (torch.distributed.launcher, as `torchrun --standalone`
    uses it): a c10d rendezvous on `master_port`, or by default on a free port chosen by the
    OS, so back-to-back jobs of a sweep never race for a port, and a failed worker stops the
    whole group. The workers get this job's overrides, its run dir, and leave `.hydra/` to
    this process. A port in use, or a device or backend the workers could not get, is refused
    here, before any worker starts.
    """
    from src.common.errors import USAGE_ERROR_EXIT_CODE, WorkersReportedUsageError

    _refuse_a_busy_port(master_port)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from src.parallel import distributed

    # The workers' own checks, made once here rather than after starting them all.
    last_worker = distributed.DistEnv(rank=nproc - 1, local_rank=nproc - 1, world_size=nproc)
    distributed.select_backend(backend, distributed.select_device(device, last_worker))
    os.environ[_LAUNCHER_PID] = str(os.getpid())  # the workers inherit it (die_with_launcher)
    overrides = [o for o in task_overrides if not o.startswith("dist.nproc_per_node=")]
    worker_args = [script, *overrides, f"hydra.run.dir={quote_override(str(run_dir))}", "hydra.output_subdir=null"]
    try:
        elastic_launch(_standalone_config(nproc, master_port), entrypoint=sys.executable)(*worker_args)
    except ChildFailedError as error:
        if all(failure.exitcode == USAGE_ERROR_EXIT_CODE for failure in error.failures.values()):
            raise WorkersReportedUsageError("the workers stopped on the error above") from None
        raise


def die_with_launcher(environ: Mapping[str, str] = os.environ) -> None:
    """Make a worker that `launch_workers` started end when that process ends, however it ends.

    torch's launcher starts each worker in a session of its own, so a launcher killed outright (SIGKILL,
    the OOM killer; a sweep's process with the sweep) would leave its workers training on, writing into
    the run dir that a resumed run or sweep continues in. Armed here, the kernel SIGKILLs the worker when
    its parent dies (Linux's PR_SET_PDEATHSIG), as if its node were lost: the next run resumes from the
    last checkpoint. Does nothing for other processes, or where prctl does not exist (macOS).
    """
    launcher = environ.get(_LAUNCHER_PID)
    if launcher is None or not sys.platform.startswith("linux") or os.getppid() != int(launcher):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(launcher):  # the launcher died before the kernel watched it
        os.kill(os.getpid(), signal.SIGKILL)


def _standalone_config(nproc: int, master_port: int | None) -> LaunchConfig:
    """`torchrun --standalone --nproc_per_node=nproc`: one node, no restarts, a c10d rendezvous on
    `master_port` (None: a free port the OS picks)."""
    from torch.distributed.launcher.api import LaunchConfig

    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun does: no thread oversubscription
    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                        rdzv_backend="c10d", rdzv_endpoint=f"localhost:{master_port or 0}", max_restarts=0,
                        monitor_interval=0.5)


def _refuse_a_busy_port(master_port: int | None) -> None:
    from src.common.errors import UsageError

    if master_port is not None and not port_is_free(master_port):
        raise UsageError(f"dist.master_port={master_port} is in use on localhost; pick another port "
                         "or leave dist.master_port=null for a free one")


def port_is_free(port: int) -> bool:
    """Whether a server could listen on `port` of localhost now (torch's own bind error, raised
    later from inside the rendezvous, is a page of traceback)."""
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


def recording_errors(function: Callable[..., T]) -> Callable[..., T]:
    """`function`, wrapped in torch's @record when this process is a launcher's worker:
    an exception's traceback then goes to the error file torchrun reads, and torchrun
    shows it in its failure summary instead of "To enable traceback see ...".

    A usage error is the exception: its one `error:` line is the whole report, so it passes
    @record unrecorded (a torchrun summary would otherwise show ~40 lines of traceback under it).
    """
    if not is_worker():
        return function
    from torch.distributed.elastic.multiprocessing.errors import record

    from src.common.errors import find_usage_error

    def raising_usage_errors_past_record(*args: Any, **kwargs: Any) -> T:
        try:
            return function(*args, **kwargs)
        except Exception as error:
            if find_usage_error(error) is None:
                _ignore_sigterm()  # until @record has written the error file (see below)
                raise
            raise _UnrecordedError(error) from None  # @record catches Exception, not BaseException

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


def _ignore_sigterm() -> None:
    """A failing worker finishes its error file before SIGTERM can end it. When a peer dies,
    torchrun's agent SIGTERMs the survivors; one cut short while @record writes leaves an empty
    error file, on which the agent itself crashes (JSONDecodeError) instead of restarting the
    group. The agent still SIGKILLs a worker that does not exit in time."""
    if _is_main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class _UnrecordedError(BaseException):
    """Carries a usage error past torch's @record, which records every Exception."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def quote_override(value: str) -> str:
    """Quote a value for Hydra's override grammar (paths may hold characters it parses)."""
    escaped = value.replace("\\", "\\\\").replace("'", "\\'")
    return f"'{escaped}'"
