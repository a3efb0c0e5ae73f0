"""Evaluation: a model's loss and accuracy over a split, every sample counted exactly once."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from src.errors import UsageError
from src.metrics import ClassificationMetrics

PRECISIONS = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}


def autocast_dtype(precision: Any) -> torch.dtype | None:
    """The autocast dtype for `trainer.precision` (32 -> None: autocast off)."""
    key = str(precision)
    if key not in PRECISIONS:
        raise UsageError(f"trainer.precision={precision} is not one of 32, bf16, 16")
    return PRECISIONS[key]


def autocast(device: torch.device, dtype: torch.dtype | None) -> ContextManager[Any]:
    """Mixed precision for the block when `dtype` is set, else nothing."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


@torch.no_grad()
def evaluate(
    module: nn.Module,
    loader: Iterable[Any],
    device: torch.device,
    amp_dtype: torch.dtype | None = None,
    num_classes: int | None = None,
) -> dict[str, Any]:
    """`loss`, `acc` and `count` of `module` over this rank's batches, summed over all ranks;
    with `num_classes`, also `confusion`, the C x C matrix of counts (rows: true class).

    Pass the unwrapped module: evaluation needs no gradient sync, and ranks may run a
    different number of batches, which DDP's per-forward collectives would not allow.
    A collective: every rank must call it.
    """
    metrics = ClassificationMetrics(device, num_classes)
    was_training = module.training
    module.eval()
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with autocast(device, amp_dtype):
            logits = module(images)
        metrics.update(logits, targets, F.cross_entropy(logits.float(), targets, reduction="sum"))
    module.train(was_training)
    return metrics.compute()
