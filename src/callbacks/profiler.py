"""A torch.profiler trace of a few training steps (`debug=profile`): `tb/profile/rank<R>.*.pt.trace.json` in the
run dir, one per rank, for Perfetto, chrome://tracing or TensorBoard's torch-tb-profiler plugin."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from src.config.building import check_arguments
from src.config.schema import at_least
from src.loop.callback import Callback, Run, Step


class Profiler(Callback):
    """Skip `wait` optimizer steps (warm-up would dominate), warm up on `warmup`, record `active`."""

    def __init__(self, wait: int, warmup: int, active: int) -> None:
        check_arguments(wait=(wait, at_least(0)), warmup=(warmup, at_least(0)), active=(active, at_least(1)))
        self.wait, self.warmup, self.active = wait, warmup, active
        self.profile: profile | None = None

    def on_run_start(self, run: Run) -> None:
        # Kineto (the profiler's tracer) reports a missing GPU as an ERROR line on CPU machines.
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])]
        trace_dir = run.parts.reporter.run_dir / "tb" / "profile"
        self.profile = profile(
            activities=activities, schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=tensorboard_trace_handler(str(trace_dir), worker_name=f"rank{run.parts.runtime.env.rank}"),
            record_shapes=True, profile_memory=True)
        self.profile.__enter__()

    def on_step_end(self, step: Step) -> None:
        self.profile.step()  # type: ignore[union-attr]

    def on_run_end(self, run: Run, reason: Any) -> None:
        if self.profile is not None:
            self.profile.__exit__(None, None, None)
            self.profile = None

    def on_exception(self, run: Run, error: BaseException) -> None:
        self.on_run_end(run, error)
