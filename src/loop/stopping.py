"""Why a run stops: all its epochs done, `trainer.max_steps` reached, the process asked to terminate
(SIGTERM / SIGUSR2: preemption), or a callback's decision after an epoch (early stopping, an Optuna
pruner's verdict: src/callbacks/), which every rank agrees on (src/loop/callback.py).
Every rank reaches the same answer at the same step."""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch

from src.parallel.preemption import Preemption


class StopReason(Enum):
    COMPLETED = "completed"  # every epoch trained
    MAX_STEPS = "max_steps"  # trainer.max_steps optimizer steps taken, with a checkpoint
    PREEMPTED = "preempted"  # a rank got SIGTERM or SIGUSR2, with a checkpoint
    STOPPED = "stopped"  # a callback ended the run after an epoch, with that epoch's checkpoint (TrainState.stopped
    # says why, and metrics.json's stop_reason); a resumed run sees it in the checkpoint and trains no more

    @property
    def is_final(self) -> bool:
        """Whether the run is over (a stop to continue from with resume=auto is not)."""
        return self in (StopReason.COMPLETED, StopReason.STOPPED)


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
