"""Early stopping: end the run when the monitored metric (`trainer.monitor`, in the direction of
`trainer.monitor_mode`) has stopped improving, after the epoch's checkpoint, which records the decision.

`callbacks.early_stopping.patience` (null: off) and `min_delta` (conf/callbacks/early_stopping.yaml). Every
rank decides alike (the metrics are all-reduced), and the loop agrees on rank 0's decision all the same
(src/loop/callback.py), so every rank stops after the same epoch. A run whose patience runs out at its last
epoch simply completes; a resumed run that early stopping ended trains no more.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from src.common.errors import UsageError
from src.config.building import check_arguments
from src.config.schema import at_least, number_or_null
from src.loop.callback import Callback, EndRun, Run

log = logging.getLogger(__name__)


def epochs_without_improvement(values: list[float], mode: str, min_delta: float) -> int:
    """Epochs since the monitored metric last improved on its best by more than `min_delta`, in the
    direction `mode` (max | min), given its value after each epoch (`values`). As the best only moves
    on such an improvement, a slow drift of small gains still counts as no improvement."""
    best, since = None, 0
    for value in values:
        if best is None or (value > best + min_delta if mode == "max" else value < best - min_delta):
            best, since = value, 0
        else:
            since += 1
    return since


def early_stop_due(values: list[float], mode: str, patience: int | None, min_delta: float) -> bool:
    """Whether early stopping ends the run after the last of `values` (null patience: never)."""
    return patience is not None and epochs_without_improvement(values, mode, min_delta) >= patience


class EarlyStopping(Callback):
    """End the run after `patience` epochs in a row without an improvement beyond `min_delta` (null patience: off)."""

    def __init__(self, patience: int | None, min_delta: float) -> None:
        check_arguments(patience=(patience, at_least(1, or_null=True)),
                        min_delta=(min_delta, number_or_null(zero_allowed=True)))
        self.patience, self.min_delta = patience, min_delta
        self.enabled = patience is not None

    def on_run_start(self, run: Run) -> None:
        if run.config.monitor is None:
            raise UsageError(f"callbacks.{self.name}.patience={self.patience} stops on trainer.monitor, which is null: "
                             f"name the metric to watch (trainer.monitor=val/NAME) or set callbacks.{self.name}."
                             "patience=null")

    def on_epoch_end(self, run: Run, record: Mapping[str, float]) -> EndRun | None:
        monitor, state = run.config.monitor, run.state
        values = [epoch[monitor] for epoch in state.history]
        if state.epoch >= run.config.epochs or not early_stop_due(values, run.config.monitor_mode, self.patience,
                                                                   self.min_delta):
            return None
        return EndRun("early_stopped", f"early stopping after epoch {state.epoch}: {monitor} has not improved by more "
                    f"than {self.min_delta:g} for {self.patience} epochs", ended_by="early stopping had ended this run")
