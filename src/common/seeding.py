"""Seeding: one seed for the run, derived per rank and step where randomness must differ (dropout)."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    seed_host_generators(seed)
    torch.manual_seed(seed)


def seed_host_generators(seed: int) -> None:
    """Seed torch's CPU generator, Python's and NumPy's from a 64-bit seed; not CUDA's (the trainer's dropout)."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def seed_generators(seed: int, device: torch.device) -> None:
    """Seed Python, NumPy, the CPU and `device`'s generator; torch.manual_seed would also queue a seed (with a stack
    trace) for every uninitialised device type, every step."""
    seed_host_generators(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(seed)


def step_seed(seed: int, rank: int, step: int) -> int:
    """A seed for each (run seed, rank, optimizer step): that step's dropout. Never change it: a resumed run must
    draw what the interrupted one would have."""
    return (seed * 1_000_003 + rank * 10_007 + step) % 2**63
