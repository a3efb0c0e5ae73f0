"""Stop a run whose loss became NaN or infinite, naming the step, instead of training on garbage.

Checking the loss on the host every step would cost a device sync per step. Instead each
step folds "was this loss finite?" into a device tensor (the first bad step, no sync), and
the host looks at it where it already reads the loss: at log steps, at checkpoints and at
the end of an epoch. A NaN anywhere makes the all-reduced loss sum NaN on every rank, so
all ranks stop together, and no checkpoint of the broken state is ever written.
"""

from __future__ import annotations

import math

import torch

from src.common.errors import UsageError
from src.parallel.distributed import all_reduce_min

_NEVER = 2**62  # "no bad step yet"; larger than any step count


class TrainingDiverged(UsageError):
    """The training loss stopped being finite; the message says at which step and what to try."""


class NonFiniteLossWatch:
    """Remembers, on the device, the first optimizer step whose loss was NaN or infinite."""

    def __init__(self, device: torch.device) -> None:
        self._first_bad_step = torch.full((), _NEVER, dtype=torch.int64, device=device)

    def observe(self, loss: torch.Tensor, step: int) -> None:
        """Record `loss` (any shape) of optimizer step `step`; no host sync."""
        bad = ~torch.isfinite(loss.detach()).all()
        self._first_bad_step = torch.where(bad, self._first_bad_step.clamp(max=step), self._first_bad_step)

    def check(self, loss: float) -> None:
        """Raise if `loss`, an all-reduced value every rank holds, is not finite. Only then is
        there a collective (every rank sees the same value, so every rank takes part)."""
        if not math.isfinite(loss):
            self.check_now()

    def check_now(self) -> None:
        """Raise if any rank saw a bad loss. A collective: call on every rank at the same step."""
        first = int(all_reduce_min(self._first_bad_step.clone()).item())
        if first < _NEVER:
            raise TrainingDiverged(diverged_message(first, "the loss became NaN or infinite"))


def diverged_message(step: int, what: str, names_the_op: bool = False) -> str:
    """One line: what went wrong at which step, and what to try."""
    where = "the warning above shows its forward call" if names_the_op else (
        "trainer.detect_anomaly=true names the operation")
    return (
        f"{what} at optimizer step {step}; the run stopped without saving that state. Try a lower "
        f"optimizer.lr or trainer.grad_clip=1.0; {where}"
    )
