"""Pruning an Optuna trial that is a DDP group, the sweeper's side: where a trial's job finds its trial.

The sweeper (src/sweeps/optuna_sweeper.py) tells a trial's job where its trial lives through three
environment variables, set with `hydra.job.env_set` (every launcher applies it, and the workers a job
starts inherit it), so the job's overrides.yaml holds only its task overrides. Only when they are set
does the job's pruning callback act (src/callbacks/optuna_pruning.py): after every epoch but the last,
before the epoch's checkpoint, which then records the decision. Rank 0 alone talks to the storage; its
answer is agreed by every rank, so all ranks stop after the same epoch.
"""

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
