"""Hydra meets the launchers: one run dir per run, whatever started the processes.

Hydra resolves `${now:...}` in every process, so torchrun ranks that reach Hydra a
second apart would each create their own timestamped run dir (hydra #2070). Run dirs
are therefore named with `${run_timestamp:FORMAT}`: rank 0's clock, shared with the
other ranks through the launcher's store before Hydra creates any directory. Ranks
other than 0 also skip writing `.hydra/` (`${main_rank_only:}`), so the run dir holds one
copy of the config. Processes started by torchrun, by `dist.nproc_per_node` (src/parallel/workers.py),
by submitit or by `srun` all end up with the same RANK / LOCAL_RANK / WORLD_SIZE contract
(src/parallel/ranks.py).

Nothing here imports torch unless the run has several processes: `python train.py
--help` and `--cfg job` stay fast.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, MutableMapping, Sequence

from hydra.types import RunMode
from omegaconf import OmegaConf

from src.common.errors import find_usage_error
from src.config import data_fields
from src.parallel.ranks import is_main_process, is_worker, read_env

_STORE_KEY = "ddp_template/run_started_at"
STARTED_AT = "DDP_TEMPLATE_RUN_STARTED_AT"  # the run's start time: set once per process, inherited by its children
LAUNCHER_PID = "DDP_TEMPLATE_LAUNCHER_PID"  # set by launch_workers: the process its workers die with
# Set on a sweep's job run again in its own dir by a sweep run again (src/sweeps/jobs.py).
SWEEP_JOB_RESUMES = "DDP_TEMPLATE_SWEEP_JOB_RESUMES"


@dataclass(frozen=True)
class RunContext:
    """What a job knows of itself from Hydra, read once where it starts (train.py's and eval.py's `main`) and
    passed down: no module keeps it."""

    run_dir: Path
    created: bool  # the run dir held nothing but Hydra's files when the job started: this run made it
    in_sweep: bool  # a job of a multirun (-m)
    overrides: tuple[str, ...]  # the command line's overrides of the config (not Hydra's own)
    choices: Mapping[str, Any]  # the option Hydra chose in each config group
    # What a worker of this job must be given besides `overrides` to compose the same config: the command line's
    # config folder flags (--config-dir, ...) and `hydra.searchpath` (a fork's own config folders).
    composing: tuple[str, ...] = ()

    @classmethod
    def of(cls, hydra_cfg: Any, argv: Sequence[str] = sys.argv) -> "RunContext":
        """The context of the job `hydra_cfg` (HydraConfig.get()) describes, started with `argv`."""
        run_dir = Path(hydra_cfg.runtime.output_dir)
        searchpath = tuple(o for o in hydra_cfg.overrides.hydra if o.split("=", 1)[0].lstrip("+") == "hydra.searchpath")
        return cls(run_dir, holds_only_hydras_files(run_dir), hydra_cfg.mode == RunMode.MULTIRUN,
                   tuple(hydra_cfg.overrides.task), dict(hydra_cfg.runtime.choices),
                   config_flags(argv) + searchpath)


CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")  # Hydra's


def config_flags(argv: Sequence[str]) -> tuple[str, ...]:
    """Hydra's flags in `argv` that choose the config's folders and file, each with its value."""
    flags: list[str] = []
    for index, arg in enumerate(argv):
        name = arg.split("=", 1)[0]
        if name in CONFIG_FLAGS:
            flags += [arg] if "=" in arg else [arg, *argv[index + 1:index + 2]]
    return tuple(flags)


def run_started_at(environ: MutableMapping[str, str] = os.environ) -> datetime.datetime:
    """The run's start time: this process's clock alone, or rank 0's in a group.

    Agreed once, then kept in the environment (`DDP_TEMPLATE_RUN_STARTED_AT`), where every later
    resolution of the run dir reads it and where processes this one starts (workers of
    `dist.nproc_per_node`, tasks of the submitit launcher) inherit it, so they name the same dirs.
    """
    if STARTED_AT not in environ:
        environ[STARTED_AT] = _agree_on_start_time().isoformat()
    return datetime.datetime.fromisoformat(environ[STARTED_AT])


def _agree_on_start_time() -> datetime.datetime:
    now = datetime.datetime.now()
    env = read_env()
    if not env.is_distributed:
        return now
    # A torchrun worker, before Hydra composes: the group's store is torch's (the only import of torch here).
    from src.parallel import distributed

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
    data_fields.register_resolver()  # ${data:FIELD} in model YAMLs


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


def holds_only_hydras_files(run_dir: Path) -> bool:
    """Whether `run_dir` holds nothing but Hydra's `.hydra/` (or nothing at all). Asked first thing in a
    job, when Hydra has written only that: such a dir was created for this run, or held only a config that
    Hydra has just overwritten; any other dir holds something of an earlier run."""
    return all(path.name == ".hydra" for path in run_dir.iterdir()) if run_dir.is_dir() else True


@contextlib.contextmanager
def discard_unused_run_dir(run_dir: Path, created: bool, in_sweep: bool) -> Iterator[None]:
    """If the block fails with a usage error before the run has written anything of its own, remove
    the run dir this run `created` (Hydra's `.hydra/` copy and the log files are all it holds), so a
    refused run leaves no directory behind: in a single process, and in the process that started
    `dist.nproc_per_node` workers (they have all exited by then). A dir that held anything before, a
    sweep's job dir, a dir with checkpoints, metrics or TensorBoard events, and the dir of a torchrun
    group's workers (one rank may still be writing its log) are never touched."""
    try:
        yield
    except Exception as error:
        # Not in a torchrun group's workers: another rank may still be writing its log there.
        unused = created and all(path.name == ".hydra" or path.suffix == ".log" for path in run_dir.iterdir())
        if find_usage_error(error) is not None and not (in_sweep or is_worker()) and unused:
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


def die_with_launcher(environ: Mapping[str, str] = os.environ) -> None:
    """Make a worker that `launch_workers` started end when that process ends, however it ends.

    torch's launcher starts each worker in a session of its own, so a launcher killed outright (SIGKILL,
    the OOM killer; a sweep's process with the sweep) would leave its workers training on, writing into
    the run dir that a resumed run or sweep continues in. Armed here, the kernel SIGKILLs the worker when
    its parent dies (Linux's PR_SET_PDEATHSIG), as if its node were lost: the next run resumes from the
    last checkpoint. Does nothing for other processes, or where prctl does not exist (macOS).
    """
    launcher = environ.get(LAUNCHER_PID)
    if launcher is None or not sys.platform.startswith("linux") or os.getppid() != int(launcher):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(launcher):  # the launcher died before the kernel watched it
        os.kill(os.getpid(), signal.SIGKILL)


def quote_override(value: str) -> str:
    """Quote a value for Hydra's override grammar (paths may hold characters it parses)."""
    escaped = value.replace("\\", "\\\\").replace("'", "\\'")
    return f"'{escaped}'"
