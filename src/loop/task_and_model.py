"""The task and model of a run, built from their configs: the task checked against the dataset and the metric
and bound to the dataset's fields, the model checked against the inputs the task gives it."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from src.common.errors import UsageError
from src.config.building import errors_named
from src.data.splits import DataSplits
from src.loop.task import Task


def build_task(task_cfg: DictConfig, splits: DataSplits, context: Any, monitor: str | None, callbacks: Any,
               model_cfg: Any = None) -> Task:
    """The task `task_cfg` names, bound to the dataset's fields and told which `model_cfg` key sets its output width;
    or one line: a key it does not take, a dataset it does not fit, a `monitor`ed metric it does not compute (the
    `callbacks` add some: val_ema/*)."""
    with errors_named("task", task_cfg):
        task = check_task(instantiate(task_cfg), splits, context.choices, monitor, callbacks.metric_splits,
                          callbacks.enable_hints())
    task.output_setting = output_setting(model_cfg, context.overrides)
    return task


def check_task(task: Task, splits: DataSplits, choices: Mapping[str, str], monitor: str | None,
               extra_splits: Sequence[str] = (), hints: Mapping[str, str] | None = None) -> Task:
    """`task`, checked and bound; `extra_splits`: the metric prefixes the run's callbacks add (val_ema); `hints`:
    what turns on a callback that would add another (its split -> the hint)."""
    task_name = choices.get("task") or type(task).__name__
    dataset_name = f"dataset={choices['dataset']}" if choices.get("dataset") else "the dataset"
    check_fit(task, splits.info, task_name, choices.get("dataset") or "this dataset")
    bind_to_dataset(task, splits, dataset_name)
    if monitor is None:  # trainer.monitor=null: no best.pt
        return task
    metric_splits = ("val", *extra_splits, "train")
    metrics = [f"{split}/{name}" for split in metric_splits for name in task.metric_names]
    split, _, name = monitor.partition("/")
    if split.startswith("test"):
        raise UsageError(f"trainer.monitor={monitor}: every choice (best.pt, early stopping, a sweep's objective and "
                         "ranking) is made on val, and test is evaluated once, when training ends, to report: "
                         f"monitor val/{name}")
    if split in (hints or {}) and f"val/{name}" in metrics:
        raise UsageError(f"trainer.monitor={monitor} needs {hints[split]}, or monitor val/{name}")
    if monitor not in metrics:
        raise UsageError(f"trainer.monitor={monitor} is not a metric of task={task_name}; choose one of "
                         f"{', '.join(metrics)}")
    return task


def check_fit(task: Task, info: Mapping[str, Any], task_name: str, dataset_name: str) -> None:
    """Refuse a dataset the task cannot learn from, naming both and what to choose instead."""
    problem = task.check(info)
    if problem:
        provided = ", ".join(f"{key}={value}" for key, value in info.items())
        raise UsageError(f"task={task_name} {problem}, but dataset={dataset_name} provides {provided}: choose a task "
                         "this dataset fits (classification needs num_classes, binary num_classes=2, regression "
                         f"num_targets) or a dataset that task={task_name} fits")


def bind_to_dataset(task: Task, splits: DataSplits, dataset_name: str) -> None:
    """Bind the task's inputs and target to the dataset's fields (or its first sample's structure) and tell it the
    output width to expect."""
    sample = None
    if splits.fields is None:
        with torch.random.fork_rng(devices=[]):  # a random transform's draws leave the run's RNG as it was
            sample = splits.train[0]
    task.bind(splits.fields, splits.target, sample, dataset_name)
    task.output_width = task.num_outputs(splits.info) if task.check(splits.info) is None else None


def model_fields(task: Task, info: Mapping[str, Any]) -> dict[str, Any]:
    """What `${data:FIELD}` gives a model YAML: the dataset's info and the output width the task needs, if any."""
    try:
        return {**info, "num_outputs": task.num_outputs(info)}
    except NotImplementedError:
        return dict(info)


def build_model(model_cfg: Any, task: Task | None = None) -> nn.Module:
    """The model `model_cfg` names; with the run's `task`, refused in one line if its `forward` cannot take the
    inputs the task binds."""
    model = instantiate(model_cfg)
    if task is not None and task.binding is not None:
        check_inputs(model, task)
    return model


def check_inputs(model: nn.Module, task: Task) -> None:
    """Refuse a model whose `forward` cannot be called with the inputs the task binds."""
    binding = task.binding
    assert binding is not None
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a forward implemented in C: nothing to check
        return
    try:
        signature.bind(*binding.args, **binding.kwargs)
    except TypeError as error:
        parameters = ", ".join(str(p).split(":")[0].split("=")[0].strip() for p in signature.parameters.values())
        raise UsageError(f"{type(model).__name__}.forward({parameters}) cannot take the task's inputs "
                         f"{binding.inputs()} ({error}) from {binding.fields()} (target: {binding.target}): set "
                         "task.inputs=[FIELD,...] to the fields it takes, in order, or choose a model that takes these "
                         "inputs") from None


def output_setting(model_cfg: Any, overrides: Sequence[str] = ()) -> str:
    """`model.<key>`: the key of the model config that takes `${data:num_outputs}` (read before it is filled in),
    or the int key an override (`model.out_features=3`) set; else model.num_outputs."""
    if isinstance(model_cfg, DictConfig):
        config = OmegaConf.to_container(model_cfg, resolve=False)
        for key, value in config.items():
            if value == "${data:num_outputs}":
                return f"model.{key}"
        for override in overrides:
            key = override.split("=", 1)[0].lstrip("+~").removeprefix("model.")
            if override.lstrip("+").startswith("model.") and isinstance(config.get(key), int):
                return f"model.{key}"
    return "model.num_outputs"
