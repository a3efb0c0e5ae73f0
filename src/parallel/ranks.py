"""Who this process is in its group, read from the launcher's variables: torch-free, and without side effects
except `adopt_cluster_env`, which a job calls once, where it starts.

The environment is the contract: torchrun (and our own `dist.nproc_per_node` launcher) sets RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT; a plain `python train.py` sets none of them and runs as a group of
one. A task of submitit or of `srun` has its job's variables instead (SLURM's, or submitit's local
executor's): `adopt_cluster_env` exports them as the same contract (train.py's and eval.py's `main` call it
first), so everything after reads RANK & co. as under torchrun. `is_main_process` also reads a task's job
variables, so it answers the same before that call (Hydra asks it while it composes the run dir) and after.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, MutableMapping

# Set on a sweep's job run again in its own dir by a sweep run again (src/sweeps/jobs.py).
SWEEP_JOB_RESUMES = "DDP_TEMPLATE_SWEEP_JOB_RESUMES"

@dataclass(frozen=True)
class DistEnv:
    """This process's place in the group, as the launcher described it."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0


def read_env(environ: Mapping[str, str] = os.environ) -> DistEnv:
    """Read the launcher's variables; no variables means a single process."""
    if "WORLD_SIZE" not in environ:
        return DistEnv()
    return DistEnv(
        rank=int(environ["RANK"]),
        local_rank=int(environ.get("LOCAL_RANK", environ["RANK"])),
        world_size=int(environ["WORLD_SIZE"]),
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(environ.get("MASTER_PORT", 29500)),
    )


def is_main_process(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is rank 0 (or the only process), whatever launched it."""
    return DistEnv(rank=_global_rank(environ)).is_main_process


def _global_rank(environ: Mapping[str, str]) -> int:
    """RANK; in a task not yet adopted, its job's global rank as submitit reads it (its local executor's
    variable, else SLURM's); 0 for a process no launcher started."""
    if "RANK" in environ:
        return int(environ["RANK"])
    if not _in_multi_task_job(environ):
        return 0
    key = "SUBMITIT_LOCAL_GLOBALID" if environ.get("SUBMITIT_EXECUTOR") == "local" else "SLURM_PROCID"
    return int(environ.get(key, "0"))


def is_worker(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a launcher (torchrun, our own `launch_workers`, SLURM) started this process as a worker."""
    return "WORLD_SIZE" in environ


def _in_multi_task_job(environ: Mapping[str, str]) -> bool:
    """A task of submitit's executors, or one of several tasks of `srun python train.py`."""
    return "SUBMITIT_EXECUTOR" in environ or (int(environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in environ)


def adopt_cluster_env(environ: MutableMapping[str, str] = os.environ) -> None:
    """Under submitit or `srun` (no torchrun variables), export RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT from the job's environment, so the rest of the run reads
    one contract whatever the launcher. Called once, where a job starts.

    submitit's TorchDistributedEnvironment knows SLURM's variables (node list, task ids)
    and its own local executor's; a plain `srun` task is a SLURM task it can read too.
    """
    if is_worker(environ) or not _in_multi_task_job(environ):
        return
    environ.setdefault("SUBMITIT_EXECUTOR", "slurm")  # a task of `srun python train.py`
    import submitit  # only in such tasks: the launcher presets' dependency, not a run's

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
