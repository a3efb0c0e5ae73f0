"""`trainer.profile=true`: a torch.profiler trace of a few training steps, in the run dir.

The trace (`tb/profile/rank<R>.*.pt.trace.json`, one per rank) opens in Perfetto or
chrome://tracing, and in TensorBoard with the torch-tb-profiler plugin.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

# Skip the first step (allocator and kernel warm-up would dominate), warm up on one, record three.
WAIT_STEPS, WARMUP_STEPS, ACTIVE_STEPS = 1, 1, 3


def step_profiler(trace_dir: Path, rank: int) -> profile:
    """A profiler to enter around training and `.step()` after every optimizer step."""
    # Kineto (the profiler's tracer) reports a missing GPU as an ERROR line on CPU machines.
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    return profile(
        activities=activities,
        schedule=schedule(wait=WAIT_STEPS, warmup=WARMUP_STEPS, active=ACTIVE_STEPS, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(trace_dir), worker_name=f"rank{rank}"),
        record_shapes=True,
        profile_memory=True,
    )
