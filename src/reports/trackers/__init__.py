"""Experiment trackers a run reports to besides TensorBoard: MLflow, Weights & Biases, a CSV file (the `logger`
config group, conf/logger/). Each is one `Tracker` class in this package, built from its YAML on rank 0 alone
(src/reports/tracking.py fans the Reporter's scalars out to them and keeps their run ids across restarts).

A tracker's package is imported by its own module, only when that logger is configured: `import mlflow` takes
seconds, and a user who never asks for MLflow need not install it. Importing this package imports no tracker.
"""

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
    """How a tracker names and groups the run."""

    name: str  # the run dir, as the tracker shows the run
    run_dir: Path
    group: str | None = None  # a multirun or Optuna job's sweep dir: every job of the sweep shares it
    job: str | None = None  # the job's number in its sweep


class Tracker:
    """One tracker's run, on rank 0. `open` starts a run or continues the run of a known id; the loggers send
    each (key, step) once: `sent_steps` tells the last step of each key the tracker already holds (a restart
    redoes the steps after its checkpoint), or None when the tracker cannot tell and the run dir's ledger must
    (src/reports/tracking.py)."""

    def open(self, run_id: str | None, identity: RunIdentity, params: Mapping[str, Any]) -> str | None:
        """Start a run with the hyperparameters `params`, or continue the run `run_id`; returns its id (None:
        nothing to keep)."""
        raise NotImplementedError

    def sent_steps(self) -> dict[str, int] | None:
        """The last step the open run holds of each metric key (None: unknown to the tracker)."""
        return None

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self, status: str, stop_reason: str | None) -> None:
        """End the run: `status` FINISHED (its last epoch done, or a callback's stop), KILLED (stopped with a
        checkpoint to resume from: max_steps, preemption) or FAILED; `stop_reason` says why it stopped."""


def import_package(package: str, logger: str, install: str) -> ModuleType:
    """`package`, or one line saying how to install it for `logger=<logger>`."""
    try:
        return importlib.import_module(package)
    except ImportError as error:
        raise UsageError(f"logger={logger} needs the {package} package, which is not installed ({error}): "
                         f"pip install {install}") from None
