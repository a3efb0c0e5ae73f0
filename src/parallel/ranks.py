"""Who this process is in its group, read from the launcher's variables (torch-free; side effects only in
`adopt_cluster_env`). torchrun and `dist.nproc_per_node` set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT; a plain `python train.py` sets none and runs as a group of one; a task of submitit or `srun` has its
job's variables, which `adopt_cluster_env` exports as the same contract. `is_main_process` reads a task's job
variables too, so it answers the same before that call (Hydra asks it while composing the run dir) and after."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, MutableMapping

SWEEP_JOB_RESUMES = "DDP_TEMPLATE_SWEEP_JOB_RESUMES"  # set on a sweep's job that a sweep run again restarts
PORT_FILE = "DDP_TEMPLATE_PORT_FILE"  # a submitit job's: where rank 0 writes its store's port (distributed.py)


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
    return DistEnv(int(environ["RANK"]), int(environ.get("LOCAL_RANK", environ["RANK"])), int(environ["WORLD_SIZE"]),
                   environ.get("MASTER_ADDR", "127.0.0.1"), int(environ.get("MASTER_PORT", 29500)))


def is_main_process(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is rank 0, whatever launched it (a task not yet adopted: its job's rank)."""
    if "RANK" in environ:
        return int(environ["RANK"]) == 0
    if not in_multi_task_job(environ):
        return True
    key = "SUBMITIT_LOCAL_GLOBALID" if environ.get("SUBMITIT_EXECUTOR") == "local" else "SLURM_PROCID"
    return int(environ.get(key, "0")) == 0


def is_worker(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a launcher (torchrun, our own `launch_workers`, SLURM) started this process as a worker."""
    return "WORLD_SIZE" in environ


def in_multi_task_job(environ: Mapping[str, str]) -> bool:
    """A task of submitit's executors, or one of several tasks of `srun python train.py`."""
    return "SUBMITIT_EXECUTOR" in environ or (int(environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in environ)


def adopt_cluster_env(environ: MutableMapping[str, str] = os.environ) -> None:
    """Under submitit or `srun`, export RANK & co from the job's environment. Called once, where a job starts."""
    if is_worker(environ) or not in_multi_task_job(environ):
        return
    environ.setdefault("SUBMITIT_EXECUTOR", "slurm")  # a task of `srun python train.py`
    import submitit  # an optional package: the launcher presets' dependency

    job = submitit.JobEnvironment()
    if job.num_tasks > 1:
        submitit.helpers.TorchDistributedEnvironment().export()
        # As torchrun does: one thread per worker unless the job says how many cores it has.
        environ.setdefault("OMP_NUM_THREADS", environ.get("SLURM_CPUS_PER_TASK", "1"))
        if "SUBMITIT_FOLDER" in environ:  # launched by submitit: its job folder is on a file system every node shares
            environ[PORT_FILE] = str(job.paths.folder / f"{job.job_id}_master_port")


def resume_setting(resume: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """What `resume=` means here: None is `auto` in a restart (torchrun's, a requeued SLURM job) or a sweep's rerun."""
    restarts = (int(environ.get(name, "0")) for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
    return "auto" if resume is None and (any(restarts) or environ.get(SWEEP_JOB_RESUMES) == "1") else resume
