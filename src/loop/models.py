"""The run's models: the trained ones by name, each built, frozen, initialised and prepared (DDP or FSDP, compiled),
with its optimizer and schedule; and the frozen auxiliary ones (the config's `aux`, e.g. a distillation's teacher:
on the run's device in eval mode, never wrapped, never saved in the run's checkpoints).
"""

from __future__ import annotations

import logging
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
from src.loop import init_from, initial_weights, optim, performance, task_and_model
from src.loop.task import Task
from src.parallel import distributed, fsdp, sync_batchnorm
from src.parallel.distributed import Runtime

log = logging.getLogger(__name__)


def build_trained(cfg: DictConfig, trainer: TrainerConfig, task: Task, runtime: Runtime
                  ) -> tuple[dict[str, nn.Module], dict[str, nn.Module]]:
    """The task's models by name: (modules, as evaluated and saved; train_models, as the step calls them), each
    built, its `trainer.freeze` parameters frozen before DDP, FSDP and the optimizer see them, initialised and
    prepared."""
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
        train_models[name] = performance.compiled(train_model, trainer.compile)
        if runtime.world_size > 1 and runtime.is_main_process and not trainer.compile:
            sync_batchnorm.warn_of_bias_before_batchnorm(modules[name])
    return modules, train_models


def _built(name: str, model_cfg: DictConfig, task: Task, trainer: TrainerConfig, seed: int,
           sharded: bool) -> initial_weights.Initial:
    """Model `name`, refused if it cannot take the task's inputs (the model the built-in step feeds batches)."""
    key = "model" if name == "model" else f"model.{name}"
    checked = task if name == task.output_model and task.feeds_batches else None

    def make() -> nn.Module:
        return performance.with_memory_format(task_and_model.build_model(model_cfg, checked), trainer.channels_last)

    with building.errors_named(key, model_cfg):
        return initial_weights.build(make, name, seed, sharded)


def build_optimizers(cfg: DictConfig, modules: dict[str, nn.Module], steps_per_epoch: int, epochs: int
                     ) -> tuple[dict[str, torch.optim.Optimizer], dict[str, Any]]:
    """Each model's optimizer over its trainable parameters (frozen ones get no state), and its schedule."""
    optimizer_cfgs = building.per_model(cfg.optimizer, "optimizer", modules)
    scheduler_cfgs = building.per_model(cfg.scheduler, "scheduler", modules)
    optimizers, schedulers = {}, {}
    for name, module in modules.items():
        optimizers[name] = optim.build_optimizer(optimizer_cfgs[name], [p for p in module.parameters() if p.requires_grad],
                                                 sharded=fsdp.is_sharded(module))
        schedulers[name] = instantiate(scheduler_cfgs[name])(optimizers[name], total_steps=steps_per_epoch * epochs,
                                                             steps_per_epoch=steps_per_epoch)
    return optimizers, schedulers


def build_aux(aux_cfg: DictConfig | None, task: Task, device: torch.device, trusted: set[str]) -> dict[str, nn.Module]:
    """The frozen auxiliary models the config's `aux` names (from a checkpoint of this template, or from a weights
    file with a model `config` of its own; a null `path` is none), on `device`; one the task needs and the config
    lacks is one line."""
    aux_cfg = {name: node for name, node in (aux_cfg or {}).items() if node.get("path") is not None}  # null: none
    missing = [name for name in task.aux_models if name not in aux_cfg]
    if missing:
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
    state = ModelState(module, name)
    state.source = f"aux.{name}.path={path}"
    state.load_state_dict(weights)
    return module
