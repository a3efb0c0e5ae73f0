"""Seeding: one seed for the run, derived per rank and epoch where randomness must differ."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (every device) with `seed`."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def epoch_seed(seed: int, rank: int, epoch: int) -> int:
    """A distinct, reproducible seed for each (run seed, rank, epoch)."""
    return (seed * 1_000_003 + rank * 10_007 + epoch) % 2**63
