"""The preemption check schedule: one all-reduce every ~CHECK_EVERY_S, at steps every rank computes alike."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from src.parallel import preemption
from src.parallel.preemption import CHECK_EVERY_S, Preemption

STEP_S = 0.01  # the fake clock's seconds per optimizer step


class FakeRun:
    """Optimizer steps on a fake clock; records the steps at which Preemption all-reduced."""

    def __init__(self) -> None:
        self.now = 0.0
        self.step = 0
        self.checks: list[int] = []

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        self.checks.append(self.step)
        return tensor

    def steps(self, flag: Preemption, first: int, last: int, signal_at: int | None = None) -> int | None:
        """Steps `first..last`; the step after which `flag` agreed to stop, if any."""
        for self.step in range(first, last + 1):
            self.now += STEP_S
            if self.step == signal_at:
                os.kill(os.getpid(), signal.SIGUSR2)
            if flag.stop_requested(self.step):
                return self.step
        return None


@pytest.fixture
def fake(monkeypatch) -> FakeRun:
    run = FakeRun()
    monkeypatch.setattr(preemption.time, "perf_counter", lambda: run.now)
    monkeypatch.setattr(preemption, "all_reduce_max", run.all_reduce_max)
    return run


def test_checks_are_about_check_every_s_apart_and_at_every_log_step(fake: FakeRun):
    with Preemption(torch.device("cpu"), log_every_steps=1000) as flag:
        assert fake.steps(flag, 1, 3000) is None
    gaps = [b - a for a, b in zip(fake.checks, fake.checks[1:])]
    assert fake.checks[:4] == [2, 4, 8, 16]  # a check after the first timed step, then doubling intervals
    steady = int(CHECK_EVERY_S / STEP_S)
    assert max(gaps) == steady and len(fake.checks) < 3000 / steady + 15  # far from one collective per step
    assert {1000, 2000, 3000} <= set(fake.checks)  # log steps are check steps too


def test_a_signal_stops_at_the_next_check_step(fake: FakeRun):
    with Preemption(torch.device("cpu"), log_every_steps=10_000) as flag:
        stopped = fake.steps(flag, 101, 2000, signal_at=700)
        assert flag.received == signal.SIGUSR2
    assert stopped == fake.checks[-1] and 700 <= stopped <= 700 + int(CHECK_EVERY_S / STEP_S)
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # the previous handler is back


def test_the_launchers_own_handler_runs_after_the_agreed_stop(fake: FakeRun):
    calls: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(signum))  # as submitit's requeue
    try:
        with Preemption(torch.device("cpu"), log_every_steps=10_000) as flag:
            assert fake.steps(flag, 1, 500, signal_at=100) is not None
            assert calls == []  # not while the loop still has to write its checkpoint
        assert calls == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, previous)
