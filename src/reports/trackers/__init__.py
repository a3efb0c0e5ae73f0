"""Experiment trackers a run reports to besides TensorBoard (the `logger` group): one `Tracker` class each, whose
package (an optional one) is imported only when its logger is configured."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from src.common.errors import UsageError


@dataclass(frozen=True)
class RunIdentity:
    name: str  # the run dir, as the tracker shows the run
    run_dir: Path
    group: str | None = None  # a multirun or Optuna job's sweep dir: every job of the sweep shares it
    job: str | None = None  # the job's number in its sweep


class Tracker:
    """One tracker's run, on rank 0."""

    def open(self, run_id: str | None, identity: RunIdentity, params: Mapping[str, Any]) -> str | None:
        """Start a run with `params`, or continue the run `run_id`; returns its id (None: nothing to keep)."""
        raise NotImplementedError

    def sent_steps(self) -> dict[str, int] | None:
        """The last step the open run holds of each metric key (None: unknown to the tracker)."""
        return None

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self, status: str, stop_reason: str | None) -> None:
        """End the run: `status` FINISHED, KILLED (a checkpoint to resume from) or FAILED; `stop_reason`: why."""


def import_package(package: str, logger: str, install: str) -> ModuleType:
    """`package`, or one line saying how to install it for `logger=<logger>`."""
    try:
        return importlib.import_module(package)
    except ImportError as error:
        raise UsageError(f"logger={logger} needs the {package} package, which is not installed ({error}): "
                         f"pip install {install}") from None
