"""`hydra/sweeper=optuna`: this process asks Optuna for each trial's values and launches the trial as one Hydra job
with them as overrides, so no rank samples; the objective is what train.py returns. The study lives in
`<sweep dir>/optuna.db`: the same command continues it, a trial whose run died asked again with its values."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.core.utils import JobStatus
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf

from src.common.errors import UsageError
from src.parallel import ranks
from src.parallel.job import composing_args
from src.sweeps import jobs, search_space

log = logging.getLogger(__name__)

SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "hyperband", "none")
DIRECTIONS = {"max": "maximize", "min": "minimize"}


class OptunaSweeper(Sweeper):
    """Settings: conf/hydra/sweeper/optuna.yaml, where each is commented."""

    def __init__(self, n_trials: int, sampler: str, seed: int | None, direction: str | None, study_name: str,
                 storage: str, pruner: str, pruner_startup_trials: int, pruner_warmup_epochs: int,
                 params: dict[str, str] | None = None) -> None:
        self.n_trials, self.sampler, self.seed, self.direction = n_trials, sampler, seed, direction
        self.study_name, self.storage, self.params = study_name, storage, dict(params or {})
        self.pruner = {"name": pruner, "startup_trials": pruner_startup_trials, "warmup_epochs": pruner_warmup_epochs}

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(config=config, hydra_context=hydra_context,
                                                                task_function=task_function)

    def sweep(self, arguments: list[str]) -> None:
        """Check everything, then run trials until the study holds `n_trials` finished ones."""
        lines = [*(f"{key}={value}" for key, value in self.params.items()), *arguments]
        space, fixed = search_space.split(OverridesParser.create().parse_overrides(lines))
        study = self.open_study(self.check_settings(space), sorted(lines))  # refuses another sweep's study or dir
        sweep_dir = Path(self.config.hydra.sweep.dir)
        if not (sweep_dir / "multirun.yaml").exists():
            OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        self.settle_unfinished_trials(study)
        while counted_trials(study) < self.n_trials:
            if not self.run_trial(study, space, fixed):
                log.warning("trial stopped before its end with a checkpoint (preempted?): the sweep stops here; "
                            "run the same command again to continue it")
                return
        if not any(t.state.name == "COMPLETE" for t in study.trials):
            log.warning("no trial of study %s completed", self.study_name)
            return
        # The best trial and the command that trains it again (also in summary.md).
        best = study.best_trial
        command = "python train.py " + shlex.join([*composing_args(self.config.hydra), *best.user_attrs["overrides"]])
        log.info("best trial %d (job %d): %s=%s\n  %s", best.number, best.user_attrs["job"],
                 self.config.trainer.monitor, best.value, command)

    def check_settings(self, space: dict[str, Any]) -> str:
        """The study's direction; one error line for a setting that cannot work."""
        monitor, mode = self.config.trainer.monitor, self.config.trainer.monitor_mode
        direction = DIRECTIONS[mode]
        checks = [
            (ranks.is_worker(), "an Optuna sweep under torchrun would sample on every rank: start it as one process "
                                "and give each trial its ranks with dist.nproc_per_node=N (or a launcher)"),
            (self.n_trials < 1, f"hydra.sweeper.n_trials={self.n_trials} must be at least 1"),
            (self.sampler not in SAMPLERS, f"hydra.sweeper.sampler={self.sampler} is not one of {', '.join(SAMPLERS)}"),
            (self.pruner["name"] not in PRUNERS,
             f"hydra.sweeper.pruner={self.pruner['name']} is not one of {', '.join(PRUNERS)}"),
            (not space, f"nothing to search: sweep at least one key, e.g. 'optimizer.lr=tag(log,interval(1e-4,1e-1))' "
                        f"({search_space.GRAMMAR})"),
            (not self.storage, "hydra.sweeper.storage is empty: the study needs a database to live in, e.g. the "
                               "default sqlite:///${hydra.sweep.dir}/optuna.db"),
            (monitor is None, "trainer.monitor=null: the study optimises the monitored metric; name one "
                              "(trainer.monitor=val/NAME)"),
            (self.direction not in (None, *DIRECTIONS.values()),
             f"hydra.sweeper.direction={self.direction} is not one of maximize, minimize (or null)"),
            (self.direction in DIRECTIONS.values() and self.direction != direction,
             f"hydra.sweeper.direction={self.direction} contradicts trainer.monitor={monitor}, whose "
             f"trainer.monitor_mode is {mode}: leave hydra.sweeper.direction=null"),
        ]
        if problems := [problem for failed, problem in checks if failed]:
            raise UsageError("; ".join(problems))
        return direction

    def open_study(self, direction: str, sweep_lines: list[str]) -> Any:
        """This sweep's study: created, or continued if the storage holds it; another sweep's is refused."""
        optuna = _optuna()
        # The studies the storage already holds: none if its SQLite file does not exist (nothing created yet).
        absent = self.storage.startswith("sqlite:///") and not Path(self.storage.removeprefix("sqlite:///")).exists()
        names = [] if absent else sorted(optuna.study.get_all_study_names(storage=self.storage))
        if self.study_name not in names:
            # A SQLite file is the sweep dir's own database: another study there ran in these job dirs.
            if names and self.storage.startswith("sqlite:"):
                raise UsageError(f"{self.storage} holds another sweep's study ({', '.join(names)}), not "
                                 f"{self.study_name}; pick a new hydra.sweep.dir (or hydra.sweeper.storage)")
            first_job = jobs.job_dir(self.hydra_context.config_loader, self.config, [], 0)
            if jobs.job_state(first_job) is not None:
                raise UsageError(f"{first_job.parent} holds another sweep's jobs and no study {self.study_name}; "
                                 "pick a new hydra.sweep.dir")
            Path(self.config.hydra.sweep.dir).mkdir(parents=True, exist_ok=True)
        study = optuna.create_study(storage=self.storage, study_name=self.study_name, direction=direction,
                                    load_if_exists=True)
        # Seeded with seed + trials so far: a continued study draws no first trial's values again.
        sampler = optuna.samplers.RandomSampler if self.sampler == "random" else optuna.samplers.TPESampler
        study.sampler = sampler(seed=None if self.seed is None else self.seed + len(study.trials))
        saved = study.user_attrs.get("sweep")
        if saved is not None and (saved != sweep_lines or study.direction.name.lower() != direction):
            raise UsageError(f"{self.storage} holds another sweep's study ({' '.join(saved)}; "
                             f"{study.direction.name.lower()}); pick a new hydra.sweep.dir")
        study.set_user_attr("sweep", sweep_lines)
        study.set_user_attr("pruner", self.pruner)  # what the trials' jobs build (src/callbacks/optuna_pruning.py)
        return study

    def settle_unfinished_trials(self, study: Any) -> None:
        """Trials a killed sweep left RUNNING: told their job's result if it finished, else failed (`died`) and
        asked again with the same values."""
        Trial, TrialState = _optuna().trial.Trial, _optuna().trial.TrialState
        for frozen in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            job, job_dir = frozen.user_attrs.get("job"), frozen.user_attrs.get("job_dir")
            state = None if job_dir is None else jobs.job_state(Path(job_dir))
            if state == "pruned":
                study.tell(frozen.number, state=TrialState.PRUNED)
            elif state == "completed":
                study.tell(frozen.number, jobs.read_metrics(Path(job_dir))[self.config.trainer.monitor])
            elif state == "failed":
                study.tell(frozen.number, state=TrialState.FAIL)
            else:  # killed, not raised: its values deserve a run
                Trial(study, frozen._trial_id).set_user_attr("died", True)
                study.tell(frozen.number, state=TrialState.FAIL)
                if job is not None:
                    log.info("trial %d (job %d) died: asked again with the same values", frozen.number, job)
                    study.enqueue_trial(frozen.params, user_attrs={"job": job}, skip_if_exists=False)

    def run_trial(self, study: Any, space: dict[str, Any], fixed: list[str]) -> bool:
        """Ask, launch as one Hydra job, tell. Returns False if the job stopped before its end."""
        trial = study.ask(space)
        job = trial.user_attrs.get("job", next_job_number(study))
        overrides = [*(f"{key}={search_space.override_value(trial.params[key])}" for key in space), *fixed]
        job_dir = jobs.job_dir(self.hydra_context.config_loader, self.config, overrides, job)
        jobs.check_same_job(job_dir, overrides)
        for key, value in {"job": job, "job_dir": str(job_dir), "overrides": overrides}.items():
            trial.set_user_attr(key, value)
        env = jobs.trial_env(self.storage, self.study_name, trial._trial_id, self.pruner["name"])
        [result] = self.launcher.launch([jobs.rerun_overrides(job_dir, overrides) + env], initial_job_idx=job)
        state = jobs.job_state(job_dir)
        if result.status == JobStatus.FAILED or state == "failed":
            log.warning("trial %d (job %d) failed: %s", trial.number, job, result._return_value)
            study.tell(trial, state=_optuna().trial.TrialState.FAIL)
        elif state == "pruned":
            study.tell(trial, state=_optuna().trial.TrialState.PRUNED)
        elif state != "incomplete":  # left RUNNING otherwise: the next run of the sweep resumes it
            study.tell(trial, float(result.return_value))  # train.py's: the last trainer.monitor value
        return state != "incomplete"


def _optuna() -> Any:
    """Optuna (an optional package, imported when a study is opened), its logging quiet."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def counted_trials(study: Any) -> int:
    """Trials that count toward n_trials: all finished ones but those that died with a killed sweep."""
    return sum(t.state.name in ("COMPLETE", "PRUNED") or (t.state.name == "FAIL" and not t.user_attrs.get("died"))
               for t in study.get_trials(deepcopy=False))


def next_job_number(study: Any) -> int:
    """One past the highest job number any trial used: job dirs are never shared."""
    return 1 + max((t.user_attrs["job"] for t in study.get_trials(deepcopy=False) if "job" in t.user_attrs), default=-1)
