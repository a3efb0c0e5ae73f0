"""How a run's training ends (`Outcome`): all its epochs done; interrupted, with a checkpoint to continue from
(`trainer.max_steps` reached, or SIGTERM / SIGUSR2: preemption; `Interruptions` asks after every step); or ended by
a callback after an epoch (early stopping, an Optuna pruner: src/loop/callback.py's `EndRun`). Every rank reaches the
same answer at the same step."""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch

from src.parallel.preemption import Preemption


class Outcome(Enum):
    COMPLETED = "completed"  # every epoch trained
    MAX_STEPS = "max_steps"  # trainer.max_steps optimizer steps taken, with a checkpoint
    PREEMPTED = "preempted"  # a rank got SIGTERM or SIGUSR2, with a checkpoint
    ENDED = "ended"  # a callback ended the run after an epoch, with that epoch's checkpoint (TrainState.ended says
    # why, and metrics.json's stop_reason); a resumed run sees it in the checkpoint and trains no more

    @property
    def is_final(self) -> bool:
        """Whether the run is over (an interruption, to continue with resume=auto, is not)."""
        return self in (Outcome.COMPLETED, Outcome.ENDED)


class Interruptions:
    """`trainer.max_steps` and preemption, asked after every optimizer step; armed (signal handlers installed) while
    the loop runs."""

    def __init__(self, max_steps: int | None, device: torch.device, log_every_steps: int) -> None:
        self.max_steps = max_steps
        self.preemption = Preemption(device, log_every_steps)

    def __enter__(self) -> "Interruptions":
        self.preemption.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.preemption.__exit__(*exc)

    def check(self, step: int) -> Outcome | None:
        """Why to interrupt training after optimizer step `step`, or None to go on. The preemption check is agreed
        at steps every rank computes alike (src/parallel/preemption.py), so all ranks stop together."""
        if self.max_steps is not None and step >= self.max_steps:
            return Outcome.MAX_STEPS
        if self.preemption.stop_requested(step):
            return Outcome.PREEMPTED
        return None
