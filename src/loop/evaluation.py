"""Evaluation: a model's loss and metrics over a split, every sample counted exactly once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterable

import torch
from torch import nn

from src.data.batches import to_device
from src.loop.metrics import MetricSums
from src.loop.precision import autocast
from src.loop.task import Task


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
