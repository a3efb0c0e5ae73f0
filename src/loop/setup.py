"""The task and model of a run, built from their configs; the task checked against the dataset and the metric."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from src.common.errors import UsageError
from src.loop.task import Task


def build_task(task_cfg: DictConfig, info: Mapping[str, Any], choices: Mapping[str, str], monitor: str,
               extra_splits: Sequence[str] = (), hints: Mapping[str, str] | None = None) -> Task:
    """The task `task_cfg` names, refusing a dataset it does not fit and a metric it does not compute, with one
    line naming both sides and what to choose instead. `extra_splits`: the metric prefixes the run's callbacks
    add (val_ema); `hints`: what turns on a callback that would add another (its split -> the hint)."""
    task = instantiate(task_cfg)
    task_name = choices.get("task") or type(task).__name__
    check_fit(task, info, task_name, choices.get("dataset") or "this dataset")
    splits = ("val", *extra_splits, "train")
    metrics = [f"{split}/{name}" for split in splits for name in task.metric_names]
    split, _, name = monitor.partition("/")
    if split in (hints or {}) and f"val/{name}" in metrics:
        raise UsageError(f"trainer.monitor={monitor} needs {hints[split]}, or monitor val/{name}")
    if monitor not in metrics:
        raise UsageError(
            f"trainer.monitor={monitor} is not a metric of task={task_name}; choose one of {', '.join(metrics)}"
        )
    return task


def check_fit(task: Task, info: Mapping[str, Any], task_name: str, dataset_name: str) -> None:
    """Refuse a dataset the task cannot learn from, naming both and what to choose instead."""
    problem = task.check(info)
    if problem:
        provided = ", ".join(f"{key}={value}" for key, value in info.items())
        raise UsageError(
            f"task={task_name} {problem}, but dataset={dataset_name} provides {provided}: choose a task this dataset "
            "fits (classification needs num_classes, binary num_classes=2, regression num_targets) or a dataset "
            f"that task={task_name} fits"
        )


def model_fields(task: Task, info: Mapping[str, Any]) -> dict[str, Any]:
    """What `${data:FIELD}` gives a model YAML: the dataset's info, and the output width the task needs."""
    return {**info, "num_outputs": task.num_outputs(info)}


def build_model(model_cfg: Any) -> nn.Module:
    """The model `model_cfg` names (`_target_` and options; `${data:...}` fields resolved from the dataset)."""
    return instantiate(model_cfg)
