"""Evaluation: a model's loss and metrics over a split, every sample counted exactly once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_map

from src.data.batches import to_device
from src.loop.metrics import MetricSums
from src.loop.precision import autocast
from src.loop.task import Task
from src.parallel.distributed import all_reduce_max


@torch.no_grad()
def evaluate(
    module: nn.Module,
    loader: Iterable[Any],
    task: Task,
    info: Mapping[str, Any],
    device: torch.device,
    amp_dtype: torch.dtype | None = None,
    lockstep: bool = False,
) -> dict[str, Any]:
    """The task's metrics of `module` over this rank's batches, summed over all ranks, with `count`
    (the task's units: samples, tokens, ...) and the task's val-only tables (e.g. `confusion`). The model's
    output is checked against the target on the first batch (`Task.check_output`).

    Pass the unwrapped module: evaluation needs no gradient sync, and ranks may run a
    different number of batches, which DDP's per-forward collectives would not allow.
    A sharded module (dist=fsdp, `lockstep`) all-gathers its parameters in every forward, so every rank
    must run as many forwards: a rank whose shard of the val split has fewer batches (shards differ by at
    most one sample) runs the missing ones on an empty batch, which adds nothing to the sums.
    A collective: every rank must call it.
    """
    sums = MetricSums({**task.sum_shapes(info), **task.val_sum_shapes(info)}, device)
    was_training = module.training
    module.eval()
    batches = _in_lockstep(loader, device) if lockstep else loader
    for index, batch in enumerate(batches):
        args, kwargs, target = task.split(to_device(batch, device))
        with autocast(device, amp_dtype):
            outputs = module(*args, **kwargs)
        if index == 0:
            task.check_output(outputs, target)
        sums.add(task.batch_sums(outputs, target, task.loss(outputs, target), task.count(target), val=True))
    module.train(was_training)
    return metrics_of(task, sums.reduce())


def _in_lockstep(loader: Iterable[Any], device: torch.device) -> Iterator[Any]:
    """`loader`'s batches, then empty ones (its first batch cut to 0 samples) until this rank has yielded as
    many as the rank with the most. The count is agreed before the first batch, when no forward is under way."""
    most = int(all_reduce_max(torch.tensor(len(loader), device=device)))  # type: ignore[arg-type]
    empty = None
    for batch in loader:
        empty = empty if empty is not None else tree_map(lambda part: part[:0], batch)
        yield batch
        most -= 1
    for _ in range(most):
        if empty is None:
            raise RuntimeError("a rank with no val batch cannot join a sharded evaluation: use a larger val split")
        yield empty


def metrics_of(task: Task, sums: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The task's metrics from all-reduced sums, with the `count` of the task's units."""
    return {**task.compute(sums), "count": int(sums["count"])}
