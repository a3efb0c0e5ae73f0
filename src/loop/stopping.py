"""Why a run stops: all its epochs done, `trainer.max_steps` reached, the process asked to terminate
(SIGTERM / SIGUSR2: preemption), the monitored metric no longer improving (`trainer.early_stopping`), or
an Optuna pruner's verdict on a sweep trial.
Every rank reaches the same answer at the same step: the metrics are all-reduced, so every rank holds
the same history."""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch

from src.parallel.preemption import Preemption


class StopReason(Enum):
    COMPLETED = "completed"  # every epoch trained
    MAX_STEPS = "max_steps"  # trainer.max_steps optimizer steps taken, with a checkpoint
    PREEMPTED = "preempted"  # a rank got SIGTERM or SIGUSR2, with a checkpoint
    EARLY_STOPPED = "early_stopped"  # trainer.early_stopping.patience epochs without improvement, after the
    # epoch's checkpoint; a resumed run sees it in the checkpoint (TrainState.early_stopped_at) and trains no more
    PRUNED = "pruned"  # the Optuna pruner stopped this sweep trial (src/sweeps/pruning.py), after the epoch's
    # checkpoint; a resumed run sees it in the checkpoint (TrainState.pruned_at) and trains no more

    @property
    def is_final(self) -> bool:
        """Whether the run is over (a stop to continue from with resume=auto is not)."""
        return self in (StopReason.COMPLETED, StopReason.EARLY_STOPPED, StopReason.PRUNED)


class StopRule:
    """Asked after every optimizer step; armed (signal handlers installed) while the loop runs."""

    def __init__(self, max_steps: int | None, device: torch.device, log_every_steps: int) -> None:
        self.max_steps = max_steps
        self.preemption = Preemption(device, log_every_steps)

    def __enter__(self) -> "StopRule":
        self.preemption.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.preemption.__exit__(*exc)

    def reason(self, step: int) -> StopReason | None:
        """Why to stop after optimizer step `step`, or None to go on. The preemption check is agreed
        at steps every rank computes alike (src/parallel/preemption.py), so all ranks stop together."""
        if self.max_steps is not None and step >= self.max_steps:
            return StopReason.MAX_STEPS
        if self.preemption.stop_requested(step):
            return StopReason.PREEMPTED
        return None


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
    """Whether `trainer.early_stopping` ends the run after the last of `values` (null patience: never)."""
    return patience is not None and epochs_without_improvement(values, mode, min_delta) >= patience
