"""Preemption (docs/fault-tolerance.md): on SIGTERM or SIGUSR2 every rank stops at the same step with a checkpoint.
A handler only raises a flag; the ranks all-reduce (MAX) it at check steps, which every rank computes alike: each
check also all-reduces the seconds per step, so the next check is about `CHECK_EVERY_S` ahead on the slowest rank's
clock (torchrun SIGKILLs 30 s after its SIGTERM), and every log step is a check step too."""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

import torch

from src.parallel.distributed import all_reduce_max

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR2)  # SLURM / torchrun's warning, SLURM's and submitit's early warning
CHECK_EVERY_S = 2.0  # between checks: a signal leads to a checkpoint well within torchrun's 30 s grace


class Preemption:
    """Catches SIGTERM and SIGUSR2 while `with`-entered, and answers "stop after this step?" on every rank."""

    def __init__(self, device: torch.device, log_every_steps: int) -> None:
        self.device, self.log_every_steps = device, log_every_steps
        self.received: signal.Signals | None = None  # the signal this rank got, if any
        self.agreed = False  # all ranks agreed to stop
        self._previous: dict[signal.Signals, Any] = {}
        self._interval = 1  # optimizer steps between timed checks
        self._next_check: int | None = None  # None: the clock starts at the next step
        self._checked_step, self._checked_at = 0, 0.0  # the last timed check's step and clock

    def __enter__(self) -> "Preemption":
        self._next_check = None  # the clock starts at the first step of this fit()
        if threading.current_thread() is threading.main_thread():  # Python allows handlers there only
            self._previous = {signum: signal.signal(signum, self._handle) for signum in SIGNALS}
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            log.warning("%s: checkpointing at the next log step or timed check (every ~%.0f s), whichever "
                        "comes first, then stopping", signal.Signals(signum).name, CHECK_EVERY_S)
        self.received = signal.Signals(signum)

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        previous = self._previous.get(self.received) if self.received is not None else None
        if self.agreed and exc[0] is None and callable(previous):
            # The launcher's own handler runs after our checkpoint: submitit requeues the job on USR2.
            previous(self.received, None)

    def stop_requested(self, step: int) -> bool:
        """Whether any rank was signalled, as agreed after step `step`; call on every rank after every step."""
        now = time.perf_counter()
        if self._next_check is None:  # the first step pays for start-up (compilation, warm caches): time from its end
            self._checked_step, self._checked_at, self._next_check = step, now, step + 1
            return False
        if step < self._next_check:
            return False
        seconds_per_step = (now - self._checked_at) / (step - self._checked_step)
        signalled, slowest = all_reduce_max(
            torch.tensor([float(self.received is not None), seconds_per_step], device=self.device)).tolist()
        # The next check: about CHECK_EVERY_S ahead at the slowest rank's pace, at most double the last interval (one
        # fast window must not put the next check minutes away), or the next log step.
        self._interval = min(max(1, int(CHECK_EVERY_S / max(slowest, 1e-6))), 2 * self._interval)
        self._next_check = min(step + self._interval, (step // self.log_every_steps + 1) * self.log_every_steps)
        self._checked_step, self._checked_at = step, now
        self.agreed = signalled > 0
        return self.agreed
