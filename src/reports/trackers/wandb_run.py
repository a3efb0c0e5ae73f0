"""logger=wandb: the run as one Weights & Biases run, its files in `<run dir>/wandb/`; a continued run is
`wandb.init(id=..., resume="allow")`. W&B cannot tell an offline run's last step: the run dir's ledger does."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from typing import Any

from src.common.errors import UsageError
from src.reports.trackers import RunIdentity, Tracker, import_package

MODES = ("online", "offline", "disabled")
EXIT_CODES = {"FINISHED": 0, "KILLED": 0, "FAILED": 1}  # wandb marks a run with a non-zero exit code failed


class WandbTracker(Tracker):
    def __init__(self, project: str = "ddp-hydra-template", mode: str = "online", entity: str | None = None,
                 timeout_s: float = 30.0) -> None:
        if mode not in MODES:
            raise UsageError(f"logger.wandb.mode={mode} is not one of {' | '.join(MODES)}")
        self.wandb = import_package("wandb", "wandb", "wandb==0.31.0")
        self.project, self.mode, self.entity, self.timeout_s = project, mode, entity, timeout_s
        self.run: Any = None

    def open(self, run_id: str | None, identity: RunIdentity, params: Mapping[str, Any]) -> str:
        wandb_dir = identity.run_dir / "wandb"
        made = not wandb_dir.exists()
        wandb_dir.mkdir(exist_ok=True)
        settings = self.wandb.Settings(console="off", silent=True, init_timeout=self.timeout_s,
                                       x_disable_stats=True, x_disable_machine_info=True)
        try:
            self.run = self.wandb.init(project=self.project, entity=self.entity, mode=self.mode, id=run_id,
                                       resume="allow", group=identity.group, name=identity.name,
                                       dir=str(identity.run_dir), config=dict(params) if run_id is None else None,
                                       settings=settings, reinit="create_new")
        except self.wandb.errors.Error as error:  # not logged in, no answer within timeout_s, ...
            if made:  # a refused run leaves no W&B files (and so, as any usage error, no run dir)
                shutil.rmtree(wandb_dir, ignore_errors=True)
            raise UsageError(f"logger.wandb: W&B could not start the run ({error}); logger.wandb.mode=offline "
                             f"logs to the run dir, to sync later") from None
        return self.run.id

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self, status: str, stop_reason: str | None) -> None:
        if self.run is None:
            return
        if stop_reason is not None:
            self.run.summary["stop_reason"] = stop_reason
        self.run.finish(exit_code=EXIT_CODES[status])
        self.run = None
