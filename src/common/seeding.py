"""Seeding: one seed for the run, derived per rank and step where randomness must differ (dropout)."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (every device) with `seed`."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_generators(seed: int, device: torch.device) -> None:
    """Seed Python, NumPy, the CPU and `device`'s generator: cheap enough for every step.

    `torch.manual_seed` also queues a seed for every CUDA/XPU/MTIA device, recording a stack
    trace each time when they are not initialised: about 0.3 ms, a tenth of a small step.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(seed)


def step_seed(seed: int, rank: int, step: int) -> int:
    """A distinct, reproducible seed for each (run seed, rank, optimizer step): dropout of that step
    (per rank on purpose), so a run resumed at any step draws the same. Augmentation draws per sample
    instead (src/data/sample_randomness.py)."""
    # Unchanged since checkpoints began to depend on it: a resumed run must draw exactly what the
    # interrupted one would have.
    return (seed * 1_000_003 + rank * 10_007 + step) % 2**63
