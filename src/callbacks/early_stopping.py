"""Early stopping: end the run after the epoch (and its checkpoint, which records the decision) when
`trainer.monitor` has not improved by more than `min_delta` for `patience` epochs (null patience: off).
A run whose patience runs out at its last epoch simply completes."""

from __future__ import annotations

from collections.abc import Mapping

from src.common.errors import UsageError
from src.config.building import check_arguments
from src.config.schema import at_least, number_or_null
from src.loop.callback import Callback, EndRun, Run


def epochs_without_improvement(values: list[float], mode: str, min_delta: float) -> int:
    """Epochs since `values` last beat their best by more than `min_delta` in the direction `mode` (max | min)."""
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
    def __init__(self, patience: int | None, min_delta: float) -> None:
        check_arguments(patience=(patience, at_least(1, or_null=True)),
                        min_delta=(min_delta, number_or_null(zero_allowed=True)))
        self.patience, self.min_delta, self.enabled = patience, min_delta, patience is not None

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
