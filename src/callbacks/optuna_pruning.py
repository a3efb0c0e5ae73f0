"""Pruning an Optuna trial that is a DDP group: after every epoch but the last, rank 0 reports the monitored value
to the trial and asks its pruner; every rank stops on rank 0's answer. Inert unless the sweeper set the trial's
environment variables (src/sweeps/jobs.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from src.loop.callback import Callback, EndRun, Run
from src.sweeps.jobs import STORAGE_ENV, STUDY_ENV, TRIAL_ENV


class OptunaPruning(Callback):
    def __init__(self) -> None:
        self.enabled, self.trial = TRIAL_ENV in os.environ, None

    def on_run_start(self, run: Run) -> None:
        """The trial, in the study as the sweeper created it, with the pruner it configured."""
        if not run.parts.runtime.is_main_process:  # rank 0 alone talks to the storage
            return
        import optuna  # an optional package

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage, study_name = os.environ[STORAGE_ENV], os.environ[STUDY_ENV]
        spec = optuna.load_study(study_name=study_name, storage=storage).user_attrs["pruner"]  # hydra.sweeper.pruner*
        if spec["name"] == "hyperband":
            pruner = optuna.pruners.HyperbandPruner(min_resource=1 + spec["warmup_epochs"])
        else:
            pruner = optuna.pruners.MedianPruner(n_startup_trials=spec["startup_trials"],
                                                 n_warmup_steps=spec["warmup_epochs"])
        study = optuna.load_study(study_name=study_name, storage=storage, pruner=pruner)
        self.trial = optuna.trial.Trial(study, int(os.environ[TRIAL_ENV]))

    def on_epoch_end(self, run: Run, record: Mapping[str, float]) -> EndRun | None:
        """Report the epochs Optuna has not seen (a resumed trial's earlier ones too) and ask the pruner."""
        if self.trial is None or run.state.epoch >= run.config.epochs:
            return None
        frozen = next(t for t in self.trial.study.get_trials(deepcopy=False) if t.number == self.trial.number)
        reported = set(frozen.intermediate_values)
        for epoch in run.state.history:
            if epoch["epoch"] not in reported:
                self.trial.report(epoch[run.config.monitor], step=int(epoch["epoch"]))
        if not self.trial.should_prune():
            return None
        return EndRun("pruned", f"pruned after epoch {run.state.epoch}: the sweep's pruner stopped this trial",
                    ended_by="the sweep's pruner had ended this trial")

