"""The optimizer, and learning-rate schedules counted in optimizer steps. Each schedule is a function
`(optimizer, total_steps, steps_per_epoch, **options)` returning a scheduler the loop steps once per optimizer step;
`conf/scheduler/*.yaml` names one with `_target_` and `_partial_: true`, so options can be given in epochs.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any, Iterable

import torch
from hydra.utils import instantiate
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from src.common.errors import UsageError
from src.parallel import fsdp

log = logging.getLogger(__name__)


def build_optimizer(optimizer_cfg: Any, parameters: Iterable[torch.nn.Parameter], sharded: bool = False) -> Optimizer:
    """The optimizer `optimizer_cfg` names (`_target_`, `_partial_: true`) over `parameters`; a setting torch
    refuses is one `error:` line. `sharded` (FSDP2's DTensor shards) with `fused: true`: a fused kernel that does
    not take shards (SGD's) becomes the foreach kernels, not torch's per-parameter loop, which pays a DTensor
    dispatch per op."""
    def make(params: Iterable[torch.nn.Parameter], **options: Any) -> Optimizer:
        return instantiate(optimizer_cfg, **options)(params=params)

    try:
        if sharded and optimizer_cfg.get("fused"):
            parameters = list(parameters)
            if not fsdp.fused_step_takes_shards(make, parameters):
                log.info(f"optimizer.fused=true: {optimizer_cfg._target_}'s fused kernel does not take sharded "
                         "parameters (dist=fsdp): foreach kernels instead")
                return make(parameters, fused=None, foreach=True)
        return make(parameters)
    except ValueError as error:
        message = f"{optimizer_cfg._target_} refused its settings ({error}): change the optimizer.* keys"
        raise UsageError(message) from error
    except TypeError as error:  # a key the class does not take, e.g. `fused` copied to an RMSprop YAML
        unknown = re.search(r"unexpected keyword argument '(\w+)'", str(error))
        if unknown is None:
            raise
        key = unknown.group(1)
        raise UsageError(f"{optimizer_cfg._target_} does not take {key}: remove it from the optimizer's YAML, or drop "
                         f"it for this run with ~optimizer.{key}") from error


def _warmup_steps(warmup_epochs: float, steps_per_epoch: int, total_steps: int) -> int:
    return min(total_steps, round(warmup_epochs * steps_per_epoch))


def cosine_with_warmup(optimizer: Optimizer, total_steps: int, steps_per_epoch: int, warmup_epochs: float = 0.0,
                       min_lr_ratio: float = 0.0) -> LambdaLR:
    """Linear warmup from ~0 to the base LR, then a half cosine down to `min_lr_ratio` x base."""
    warmup = _warmup_steps(warmup_epochs, steps_per_epoch, total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return LambdaLR(optimizer, factor)


def step_decay(optimizer: Optimizer, total_steps: int, steps_per_epoch: int, step_epochs: float = 30.0,
               gamma: float = 0.1) -> LambdaLR:
    """Multiply the LR by `gamma` every `step_epochs` epochs."""
    period = max(1, round(step_epochs * steps_per_epoch))
    return LambdaLR(optimizer, lambda step: gamma ** (step // period))


def constant(optimizer: Optimizer, total_steps: int, steps_per_epoch: int, warmup_epochs: float = 0.0) -> LambdaLR:
    """The base LR throughout, after an optional linear warmup."""
    warmup = _warmup_steps(warmup_epochs, steps_per_epoch, total_steps)
    return LambdaLR(optimizer, lambda step: (step + 1) / warmup if step < warmup else 1.0)
