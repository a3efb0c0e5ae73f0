"""Where a pruned Optuna trial's job finds its trial (src/callbacks/optuna_pruning.py): environment variables set
with `hydra.job.env_set`, which every launcher applies and a job's workers inherit, so the job's overrides.yaml
holds only its task overrides."""

from __future__ import annotations

from src.parallel.job import quote_override

STORAGE_ENV = "DDP_TEMPLATE_OPTUNA_STORAGE"  # the study's storage URL
STUDY_ENV = "DDP_TEMPLATE_OPTUNA_STUDY"  # its name
TRIAL_ENV = "DDP_TEMPLATE_OPTUNA_TRIAL"  # the trial's id in the storage


def trial_env(storage: str, study_name: str, trial_id: int, pruner: str) -> list[str]:
    """The `hydra.job.env_set` overrides that let a trial's job report to its trial (none: no pruner)."""
    if pruner == "none":
        return []
    values = {STORAGE_ENV: storage, STUDY_ENV: study_name, TRIAL_ENV: str(trial_id)}
    return [f"++hydra.job.env_set.{key}={quote_override(value)}" for key, value in values.items()]
