"""Evaluation: a model's loss and metrics over a split, every sample counted exactly once."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, ContextManager, Iterable

import torch
from torch import nn

from src.common.errors import UsageError
from src.data.batches import to_device
from src.loop.metrics import MetricSums
from src.loop.task import Task

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
    task: Task,
    info: Mapping[str, Any],
    device: torch.device,
    amp_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """The task's metrics of `module` over this rank's batches, summed over all ranks, with `count`
    (samples) and the task's val-only tables (e.g. `confusion`).

    Pass the unwrapped module: evaluation needs no gradient sync, and ranks may run a
    different number of batches, which DDP's per-forward collectives would not allow.
    A collective: every rank must call it.
    """
    sums = MetricSums({**task.sum_shapes(info), **task.val_sum_shapes(info)}, device)
    was_training = module.training
    module.eval()
    for batch in loader:
        args, kwargs, target = task.split(to_device(batch, device))
        with autocast(device, amp_dtype):
            outputs = module(*args, **kwargs)
        loss_sum, count = task.loss(outputs, target)
        sums.add(task.batch_sums(outputs, target, loss_sum, count, val=True))
    module.train(was_training)
    return metrics_of(task, sums.reduce())


def metrics_of(task: Task, sums: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The task's metrics from all-reduced sums, with the sample `count`."""
    return {**task.compute(sums), "count": int(sums["count"])}
