"""Seeding: one seed for the run, derived per rank and step where randomness must differ (dropout)."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_generators(seed: int, device: torch.device) -> None:
    """Seed Python, NumPy, the CPU and `device`'s generator; torch.manual_seed would also queue a seed (with a stack
    trace) for every uninitialised device type, every step."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(seed)


def step_seed(seed: int, rank: int, step: int) -> int:
    """A seed for each (run seed, rank, optimizer step): that step's dropout. Never change it: a resumed run must
    draw what the interrupted one would have."""
    return (seed * 1_000_003 + rank * 10_007 + step) % 2**63
