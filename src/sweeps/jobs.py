"""What a sweep's job dir says about its job (`completed`, `pruned`, `failed`, `incomplete`), and how a sweep run
again treats it: finished jobs skipped, others resumed in their dirs, another sweep's dir refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from src.common.errors import UsageError
from src.parallel.job import quote_override
from src.parallel.ranks import SWEEP_JOB_RESUMES

FAILED_MARKER = "FAILED"  # written into a job dir by the summary callback when the job raised
FINISHED = ("completed", "pruned")
# Where a pruned Optuna trial's job finds its trial (src/callbacks/optuna_pruning.py), set like SWEEP_JOB_RESUMES.
STORAGE_ENV = "DDP_TEMPLATE_OPTUNA_STORAGE"  # the study's storage URL
STUDY_ENV = "DDP_TEMPLATE_OPTUNA_STUDY"  # its name
TRIAL_ENV = "DDP_TEMPLATE_OPTUNA_TRIAL"  # the trial's id in the storage


def job_state(job_dir: Path) -> str | None:
    """completed | pruned | failed | incomplete, or None where no job has started (no saved config)."""
    config_file = job_dir / ".hydra" / "config.yaml"
    if not config_file.exists():
        return None
    if (job_dir / FAILED_MARKER).exists():
        return "failed"
    metrics = read_metrics(job_dir)
    if "stop_reason" in metrics:  # a callback ended the run for good: the pruner, early stopping, a fork's own
        return "pruned" if metrics["stop_reason"] == "pruned" else "completed"
    return "completed" if metrics.get("epoch") == OmegaConf.load(config_file).trainer.epochs else "incomplete"


def read_metrics(job_dir: Path) -> dict[str, Any]:
    """The job's metrics.json (its last finished epoch), or {} before its first epoch ends."""
    return json.loads(metrics_file.read_text()) if (metrics_file := job_dir / "metrics.json").exists() else {}


def job_dir(config_loader: Any, config: DictConfig, overrides: Sequence[str], job_num: int) -> Path:
    """Where the launcher will run job `job_num` with `overrides`: as Hydra's launchers compose it."""
    sweep_config = config_loader.load_sweep_config(config, list(overrides))
    with open_dict(sweep_config):
        sweep_config.hydra.job.num = job_num
    return Path(sweep_config.hydra.sweep.dir) / str(sweep_config.hydra.sweep.subdir)


def saved_overrides(job_dir: Path) -> list[str] | None:
    """The task overrides a job dir's job ran with (None: no job there yet)."""
    return list(OmegaConf.load(path)) if (path := job_dir / ".hydra" / "overrides.yaml").exists() else None


def check_same_job(job_dir: Path, overrides: Sequence[str]) -> None:
    """Refuse a job dir that holds another job (another sweep's, or this sweep with other values)."""
    saved = saved_overrides(job_dir)
    task = [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]
    if saved is not None and saved != task:
        raise UsageError(f"{job_dir} holds another sweep's job ({' '.join(saved) or 'no overrides'}), not "
                         f"this one ({' '.join(task) or 'no overrides'}); pick a new hydra.sweep.dir")


def rerun_overrides(job_dir: Path, overrides: Sequence[str]) -> list[str]:
    """The overrides to run a job with; a job run again in its dir is told to resume (its FAILED file removed)."""
    if job_state(job_dir) is None:
        return list(overrides)
    (job_dir / FAILED_MARKER).unlink(missing_ok=True)
    # Through `hydra.job.env_set` (every launcher applies it): its overrides.yaml stays as it was.
    return [*overrides, f"++hydra.job.env_set.{SWEEP_JOB_RESUMES}=1"]


def trial_env(storage: str, study_name: str, trial_id: int, pruner: str) -> list[str]:
    """The `hydra.job.env_set` overrides that let a trial's job report to its trial (none: no pruner)."""
    if pruner == "none":
        return []
    values = {STORAGE_ENV: storage, STUDY_ENV: study_name, TRIAL_ENV: str(trial_id)}
    return [f"++hydra.job.env_set.{key}={quote_override(value)}" for key, value in values.items()]
