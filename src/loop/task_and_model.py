"""The task and models of a run, built from their configs: the task, checked and bound to the dataset's fields; the
trained models by name, checked against the task's inputs, built, frozen, initialised and prepared (DDP or FSDP,
compiled), with their optimizers and schedules; the frozen auxiliary models (`aux`, e.g. a distillation's teacher: on
the run's device in eval mode, never wrapped, never saved in the run's checkpoints)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from src.checkpoint.states import ModelState
from src.checkpoint.trained import build_saved_model, read_trusted
from src.common.errors import UsageError
from src.config import building
from src.config.schema import TrainerConfig
from src.data.splits import DataSplits
from src.loop import init_from, initial_weights, optim, performance
from src.loop.task import Task
from src.parallel import distributed, fsdp, sync_batchnorm
from src.parallel.distributed import Runtime

log = logging.getLogger(__name__)


def build_task(task_cfg: DictConfig, splits: DataSplits, context: Any, monitor: str | None, callbacks: Any,
               model_cfg: Any = None) -> Task:
    """The task `task_cfg` names, checked and bound (`check_task`), told which `model_cfg` key sets its output width."""
    with building.errors_named("task", task_cfg):
        task = check_task(instantiate(task_cfg), splits, context.choices, monitor, callbacks.metric_splits,
                          callbacks.enable_hints())
    task.output_setting = output_setting(model_cfg, context.overrides)
    return task


def check_task(task: Task, splits: DataSplits, choices: Mapping[str, str], monitor: str | None,
               extra_splits: Sequence[str] = (), hints: Mapping[str, str] | None = None) -> Task:
    """`task`, refused in one line if it does not fit the dataset or compute the `monitor`ed metric (`extra_splits`:
    the callbacks' prefixes; `hints`: what turns on another's), and bound to the dataset."""
    task_name = choices.get("task") or type(task).__name__
    dataset = f"dataset={choices['dataset']}" if choices.get("dataset") else "the dataset"
    check_fit(task, splits.info, f"task={task_name}", dataset)
    bind_to_dataset(task, splits, dataset)
    if monitor is None:  # trainer.monitor=null: no best.pt
        return task
    metrics = [f"{split}/{name}" for split in ("val", *extra_splits, "train") for name in task.metric_names]
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


def check_fit(task: Task, info: Mapping[str, Any], task_named: str, dataset_named: str, advice: str = "") -> None:
    """Refuse a dataset the task cannot learn from, naming both and what to do (`advice`, else: choose another)."""
    if problem := task.check(info):
        provided = ", ".join(f"{key}={value}" for key, value in info.items())
        raise UsageError(f"{task_named} {problem}, but {dataset_named} provides {provided}: " + (advice or "choose a "
                         "task this dataset fits (classification needs num_classes, binary num_classes=2, regression "
                         f"num_targets) or a dataset that {task_named} fits"))


def bind_to_dataset(task: Task, splits: DataSplits, dataset_name: str) -> None:
    """Bind the task to the dataset's fields (or its first sample's structure), and tell it the output width."""
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
    """The model `model_cfg` names; with `task`, refused if its `forward` cannot take the task's inputs."""
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
        call = ", ".join([*map(str, binding.args), *(f"{name}={key}" for name, key in binding.kwargs.items())])
        fields = f"fields {', '.join(binding.positions)}" if binding.positions else "parts"  # what the samples hold
        raise UsageError(f"{type(model).__name__}.forward({parameters}) cannot take the task's inputs "
                         f"model({call}) ({error}) from {binding.dataset}'s {fields} (target: {binding.target}): set "
                         "task.inputs=[FIELD,...] to the fields it takes, in order, or choose a model that takes these "
                         "inputs") from None


def output_setting(model_cfg: Any, overrides: Sequence[str] = ()) -> str:
    """`model.<key>` that takes `${data:num_outputs}`, or the int key an override set; else model.num_outputs."""
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


def build_trained(cfg: DictConfig, trainer: TrainerConfig, task: Task, runtime: Runtime
                  ) -> tuple[dict[str, nn.Module], dict[str, nn.Module]]:
    """The task's models by name, built, frozen (before DDP, FSDP and the optimizer see them), initialised and
    prepared: (modules, as evaluated and saved; train_models, as the step calls them)."""
    configs = building.named(cfg.model, "model")
    if set(configs) != set(task.models):
        raise UsageError(f"task={type(task).__name__} trains the models {', '.join(task.models)}, but the model config "
                         f"names {', '.join(configs)}: give one model config for each (model.NAME._target_=...)")
    sharded = cfg.dist.strategy == "fsdp"
    built = {name: _built(name, configs[name], task, trainer, cfg.seed, sharded) for name in task.models}
    init_from.freeze({name: initial.model for name, initial in built.items()}, trainer.freeze)
    sharding = OmegaConf.to_object(cfg.dist.fsdp) if sharded else None
    modules, train_models = {}, {}
    for name, initial in built.items():
        modules[name], train_model = distributed.prepare_model(
            initial.model, runtime, cfg.dist.sync_bn, cfg.dist.find_unused_parameters, sharding,
            performance.autocast_dtype(trainer.precision),
            lambda module, initial=initial: initial_weights.initialise(initial, module, cfg.seed))
        train_models[name] = torch.compile(train_model) if trainer.compile else train_model
        if runtime.world_size > 1 and runtime.is_main_process and not trainer.compile:
            sync_batchnorm.warn_of_bias_before_batchnorm(modules[name])
    return modules, train_models


def _built(name: str, model_cfg: DictConfig, task: Task, trainer: TrainerConfig, seed: int,
           sharded: bool) -> initial_weights.Initial:
    """Model `name`, refused if it cannot take the task's inputs (the model the built-in step feeds batches)."""
    checked = task if name == task.output_model and task.feeds_batches else None

    def make() -> nn.Module:
        return performance.with_memory_format(build_model(model_cfg, checked), trainer.channels_last)

    with building.errors_named("model" if name == "model" else f"model.{name}", model_cfg):
        return initial_weights.build(make, name, seed, sharded)


def build_optimizers(cfg: DictConfig, modules: dict[str, nn.Module], steps_per_epoch: int, epochs: int
                     ) -> tuple[dict[str, torch.optim.Optimizer], dict[str, Any]]:
    """Each model's optimizer over its trainable parameters (frozen ones get no state), and its schedule."""
    optimizer_cfgs = building.per_model(cfg.optimizer, "optimizer", modules)
    scheduler_cfgs = building.per_model(cfg.scheduler, "scheduler", modules)
    optimizers, schedulers = {}, {}
    for name, module in modules.items():
        trainable = [(key, p) for key, p in module.named_parameters() if p.requires_grad]
        opt_key, scheduler_key = (group if "_target_" in cfg[group] else f"{group}.{name}"
                                  for group in ("optimizer", "scheduler"))  # what its error lines name
        optimizers[name] = optim.build_optimizer(optimizer_cfgs[name], trainable, fsdp.is_sharded(module), opt_key)
        schedule = scheduler_cfgs[name]  # a partial, given the optimizer and the run's length
        with building.errors_named(scheduler_key, schedule, (), ("optimizer", "total_steps", "steps_per_epoch")):
            schedulers[name] = instantiate(schedule)(optimizers[name], total_steps=steps_per_epoch * epochs,
                                                     steps_per_epoch=steps_per_epoch)
    return optimizers, schedulers


def build_aux(aux_cfg: DictConfig | None, task: Task, device: torch.device, trusted: set[str]) -> dict[str, nn.Module]:
    """The frozen auxiliary models `aux` names (a checkpoint, or weights with a model `config`), on `device`."""
    aux_cfg = {name: node for name, node in (aux_cfg or {}).items() if node.get("path") is not None}  # null: none
    if missing := [name for name in task.aux_models if name not in aux_cfg]:
        raise UsageError(f"task={type(task).__name__} needs the auxiliary model {missing[0]}: set "
                         f"aux.{missing[0]}.path=CHECKPOINT (a checkpoint of this template, e.g. a best.pt)")
    models = {}
    with torch.random.fork_rng(devices=[]):  # their constructors' draws leave the trained models' as they were
        for name, node in aux_cfg.items():
            models[str(name)] = _aux_model(str(name), node, trusted).to(device).eval().requires_grad_(False)
            log.info("aux.%s: %s from %s, frozen", name, type(models[str(name)]).__name__, node.path)
    return models


def _aux_model(name: str, node: DictConfig, trusted: set[str]) -> nn.Module:
    path = Path(node.path)
    if node.get("config") is None:
        saved = read_trusted(path, trusted)
        return build_saved_model(saved, node.get("model") or saved.output_model, node.get("weights") or "model")
    with building.errors_named(f"aux.{name}.config", node.config):
        module = instantiate(node.config)
    weights = init_from.read_weights(path, ["model"], "model")["model"]
    ModelState(module, name, f"aux.{name}.path={path}").load_state_dict(weights)
    return module
