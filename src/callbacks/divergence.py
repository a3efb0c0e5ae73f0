"""Stop a run whose loss became NaN or infinite, naming the step. Each step folds "was this loss finite?" into a
device tensor (no host sync), checked where the host reads the loss anyway and before every checkpoint, so no
diverged state is saved. `detect_anomaly=true`: autograd's anomaly mode, which names the backward op."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from src.common.errors import UsageError
from src.loop.callback import Callback, Run, Step
from src.parallel.distributed import all_reduce_min

_NEVER = 2**62  # "no bad step yet"; larger than any step count


class TrainingDiverged(UsageError):
    """The training loss stopped being finite."""


class NonFiniteLossWatch:
    """Remembers, on the device, the first optimizer step whose loss was NaN or infinite."""

    def __init__(self, device: torch.device) -> None:
        self._first_bad_step = torch.full((), _NEVER, dtype=torch.int64, device=device)

    def observe(self, loss: torch.Tensor, step: int) -> None:
        """Record `loss` (any shape) of optimizer step `step`; no host sync."""
        bad = ~torch.isfinite(loss.detach()).all()
        self._first_bad_step = torch.where(bad, self._first_bad_step.clamp(max=step), self._first_bad_step)

    def check(self, loss: float) -> None:
        """Raise if `loss`, an all-reduced value every rank holds, is not finite (only then a collective)."""
        if not math.isfinite(loss):
            self.check_now()

    def check_now(self) -> None:
        """Raise if any rank saw a bad loss. A collective: call on every rank at the same step."""
        if (first := int(all_reduce_min(self._first_bad_step.clone()).item())) < _NEVER:
            raise TrainingDiverged(diverged_message(first, "the loss became NaN or infinite"))


def diverged_message(step: int, what: str, names_the_op: bool = False) -> str:
    where = "the warning above shows its forward call" if names_the_op else (
        "callbacks.divergence.detect_anomaly=true names the operation")
    return (f"{what} at optimizer step {step}; the run stopped without saving that state. Try a lower "
            f"optimizer.lr or trainer.grad_clip=1.0; {where}")


class DivergenceWatch(Callback):
    def __init__(self, detect_anomaly: bool) -> None:
        self.detect_anomaly = detect_anomaly
        self.watch: NonFiniteLossWatch | None = None
        self._anomaly_mode: Any = None
        self._step = 0  # the last optimizer step taken

    def on_run_start(self, run: Run) -> None:
        self.watch, self._step = NonFiniteLossWatch(run.parts.runtime.device), run.state.step
        if self.detect_anomaly:
            self._anomaly_mode = torch.autograd.set_detect_anomaly(True)  # on until the run ends

    def on_step_end(self, step: Step) -> None:
        self._step = step.number
        self.watch.observe(step.loss, step.number)  # type: ignore[union-attr]
        if self.detect_anomaly:
            self.watch.check_now()  # type: ignore[union-attr]

    def on_log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.watch.check(scalars["train/loss"])  # type: ignore[union-attr]

    def on_epoch_end(self, run: Run, record: Mapping[str, float]) -> None:
        self.watch.check(record["train/loss"])  # type: ignore[union-attr]

    def on_checkpoint(self, run: Run) -> None:
        self.watch.check_now()  # type: ignore[union-attr]  # never checkpoint a diverged model

    def on_run_end(self, run: Run, reason: Any) -> None:
        if self._anomaly_mode is not None:  # leave it
            self._anomaly_mode.__exit__(None, None, None)
            self._anomaly_mode = None

    def on_exception(self, run: Run, error: BaseException) -> None:
        """Anomaly mode names the backward op that made a NaN, in a RuntimeError: one line instead."""
        self.on_run_end(run, error)
        if self.detect_anomaly and isinstance(error, RuntimeError) and "nan values" in str(error):
            what = str(error).splitlines()[0].rstrip(".")
            raise TrainingDiverged(diverged_message(self._step + 1, what, names_the_op=True)) from None
