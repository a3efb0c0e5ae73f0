"""Pruning an Optuna trial that is a DDP group: rank 0 reports, every rank stops on its answer.

The sweeper (src/sweeps/optuna_sweeper.py) tells a trial's job where its trial lives through three
environment variables, set with `hydra.job.env_set` (every launcher applies it, and the workers a job
starts inherit it), so the job's overrides.yaml holds only its task overrides. Only when they are set
does train.py build a judge; the loop asks it after every epoch but the last, before the epoch's
checkpoint, which then records the decision (src/loop/trainer.py). Rank 0 alone talks to the storage;
its answer is broadcast, so all ranks stop after the same epoch.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from src.parallel.launch import quote_override

log = logging.getLogger(__name__)

STORAGE_ENV = "DDP_TEMPLATE_OPTUNA_STORAGE"  # the study's storage URL
STUDY_ENV = "DDP_TEMPLATE_OPTUNA_STUDY"  # its name
TRIAL_ENV = "DDP_TEMPLATE_OPTUNA_TRIAL"  # the trial's id in the storage

EpochJudge = Callable[[list[dict[str, float]]], bool]  # the run's history -> whether to stop it now


def trial_env(storage: str, study_name: str, trial_id: int, pruner: str) -> list[str]:
    """The `hydra.job.env_set` overrides that let a trial's job report to its trial (none: no pruner)."""
    if pruner == "none":
        return []
    values = {STORAGE_ENV: storage, STUDY_ENV: study_name, TRIAL_ENV: str(trial_id)}
    return [f"++hydra.job.env_set.{key}={quote_override(value)}" for key, value in values.items()]


def epoch_judge(is_main_process: bool, monitor: str) -> EpochJudge | None:
    """The judge of this run if it is a pruned trial's (None otherwise): asked after an epoch with the
    run's history, it reports the epochs Optuna has not seen (`monitor`'s value, step = epoch; a resumed
    trial's earlier epochs too) and answers whether the pruner stops the trial, the same on every rank."""
    if TRIAL_ENV not in os.environ:
        return None
    from src.parallel import distributed

    trial = _open_trial() if is_main_process else None

    def judge(history: list[dict[str, float]]) -> bool:
        decision = None
        if trial is not None:
            frozen = next(t for t in trial.study.get_trials(deepcopy=False) if t.number == trial.number)
            reported = set(frozen.intermediate_values)
            for record in history:
                if record["epoch"] not in reported:
                    trial.report(record[monitor], step=int(record["epoch"]))
            decision = trial.should_prune()
        return bool(distributed.broadcast_object(decision))

    return judge


def _open_trial() -> Any:
    """The trial, in the study as the sweeper created it, with the pruner it configured."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage, study_name = os.environ[STORAGE_ENV], os.environ[STUDY_ENV]
    spec = optuna.load_study(study_name=study_name, storage=storage).user_attrs["pruner"]
    study = optuna.load_study(study_name=study_name, storage=storage, pruner=build_pruner(spec))
    return optuna.trial.Trial(study, int(os.environ[TRIAL_ENV]))


def build_pruner(spec: dict[str, Any]) -> Any:
    """`median`: stop a trial whose value after an epoch is worse than the median of the earlier
    trials' values after that epoch, once `startup_trials` trials finished and after `warmup_epochs`
    epochs. `hyperband`: Optuna's HyperbandPruner, from 1 epoch up to the longest trial's."""
    import optuna

    if spec["name"] == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1 + spec["warmup_epochs"])
    return optuna.pruners.MedianPruner(n_startup_trials=spec["startup_trials"], n_warmup_steps=spec["warmup_epochs"])
