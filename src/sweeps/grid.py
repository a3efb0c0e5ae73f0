"""The default `-m` sweeper: Hydra's grid, resumable (a sweep run again skips finished jobs and resumes the others
in their dirs); under torchrun, where every rank sweeps, Hydra's plain grid."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from src.parallel import ranks
from src.sweeps import jobs

log = logging.getLogger(__name__)


class ResumableGridSweeper(BasicSweeper):
    """Every combination of the swept values, one job each, in Hydra's order; finished jobs skipped."""

    def sweep(self, arguments: list[str]) -> Any:
        if ranks.is_worker():  # `torchrun ... train.py -m`: every rank sweeps; they could judge a job dir apart
            return super().sweep(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        parsed = parser.parse_overrides([*self._parse_config(), *arguments])
        all_jobs = [list(o) for batch in self.split_arguments(parsed, None) for o in batch]
        pending = self.plan(all_jobs)  # refuses another sweep's dir before writing anything
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if not (sweep_dir / "multirun.yaml").exists():
            OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        returns = [self.launcher.launch(batch, initial_job_idx=first) for first, batch in self.batches(pending)]
        for results in returns:
            for result in results:
                _ = result.return_value  # as BasicSweeper: re-raises a job's error once all jobs ran
        return returns

    def plan(self, all_jobs: list[list[str]]) -> dict[int, list[str]]:
        """Job number -> overrides, for the jobs still to run (those of a sweep run again: told to resume)."""
        pending = {}
        for num, overrides in enumerate(all_jobs):
            job_dir = jobs.job_dir(self.hydra_context.config_loader, self.config, overrides, num)
            jobs.check_same_job(job_dir, overrides)
            if (state := jobs.job_state(job_dir)) in jobs.FINISHED:
                log.info("job %d (%s): %s, not run again", num, " ".join(overrides), state)
                continue
            pending[num] = overrides if state is None else jobs.rerun_overrides(job_dir, overrides)
        return pending

    def batches(self, pending: dict[int, list[str]]) -> list[tuple[int, list[Sequence[str]]]]:
        """Runs of consecutive job numbers, at most `max_batch_size` jobs each."""
        runs: list[tuple[int, list[Sequence[str]]]] = []
        for num, overrides in pending.items():
            full = self.max_batch_size is not None and runs and len(runs[-1][1]) >= self.max_batch_size
            if runs and runs[-1][0] + len(runs[-1][1]) == num and not full:
                runs[-1][1].append(overrides)
            else:
                runs.append((num, [overrides]))
        return runs
