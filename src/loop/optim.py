"""The optimizer (its parameter groups: learning rates by name prefix, no weight decay on biases and normalisation
weights), and learning-rate schedules counted in optimizer steps. Each schedule is a function
`(optimizer, total_steps, steps_per_epoch, **options)` returning a scheduler the loop steps once per optimizer step;
`conf/scheduler/*.yaml` names one with `_target_` and `_partial_: true`, so options can be given in epochs."""

from __future__ import annotations

import logging
import math
from typing import Any, Iterable, Mapping

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from src.common.errors import UsageError
from src.config import building
from src.parallel import fsdp, ranks

log = logging.getLogger(__name__)


def build_optimizer(optimizer_cfg: Any, parameters: Iterable[tuple[str, torch.nn.Parameter] | torch.nn.Parameter],
                    sharded: bool = False, key: str = "optimizer") -> Optimizer:
    """The optimizer `optimizer_cfg` names (`_target_`, `_partial_: true`) over `parameters` (named, or unnamed) in
    `parameter_groups`; a setting torch refuses is one `error:` line. `sharded` (FSDP2's DTensor shards) with
    `fused: true`: a fused kernel that does not take shards (SGD's) becomes the foreach kernels, not torch's
    per-parameter loop, which pays a DTensor dispatch per op."""
    options = OmegaConf.to_container(optimizer_cfg, resolve=True) if OmegaConf.is_config(optimizer_cfg) \
        else dict(optimizer_cfg)
    named = [item if isinstance(item, tuple) else (str(index), item) for index, item in enumerate(parameters)]
    groups = parameter_groups(named, options.get("lr"), options.get("weight_decay", 0.0),
                              options.pop("lr_multipliers", None) or {}, options.pop("decay_norm_and_bias", False))

    def make(params: Iterable[Any], **overrides: Any) -> Optimizer:
        return instantiate({**options, **overrides}, _convert_="all")(params=params)  # plain lists: torch's errors

    building.check_types(key, options)
    try:
        if sharded and options.get("fused") and not fsdp.fused_step_takes_shards(make, [p for _, p in named]):
            log.info(f"optimizer.fused=true: {options['_target_']}'s fused kernel does not take sharded "
                     "parameters (dist=fsdp): foreach kernels instead")
            return make(groups, fused=None, foreach=True)
        return make(groups)
    except InstantiationException as error:
        raise building.not_located(key, options, error) or error
    except (ValueError, IndexError) as error:  # IndexError: betas=[0.9]
        raise UsageError(f"{options['_target_']} refused its settings ({error}): change the {key}.* keys") from error
    except TypeError as error:  # a key the class does not take (`fused` in an RMSprop YAML)
        if line := building.argument_mismatch(key, options, (), ("params",)):
            raise UsageError(line) from error
        raise


def parameter_groups(named: list[tuple[str, torch.nn.Parameter]], lr: float | None, weight_decay: float,
                     lr_multipliers: Mapping[str, float], decay_norm_and_bias: bool) -> list[dict[str, Any]]:
    """`named` parameters in groups, in their order: the learning rate `lr` x the multiplier of the longest prefix
    of their name in `lr_multipliers` (`backbone` takes `backbone.*`; `*` every parameter no other prefix takes),
    and no weight decay on biases and other 1-D parameters (normalisation weights) unless `decay_norm_and_bias`, as
    timm's filter_bias_and_bn."""
    prefixes = sorted(lr_multipliers, key=lambda prefix: -1 if prefix == "*" else len(prefix), reverse=True)
    if unmatched := [prefix for prefix in prefixes if not any(_under(name, prefix) for name, _ in named)]:
        tops = sorted({name.split(".")[0] for name, _ in named})
        raise UsageError(f"optimizer.lr_multipliers: {unmatched[0]} is the prefix of no trained parameter's name "
                         f"(they begin with {', '.join(tops[:8])})")
    if prefixes and lr is None:
        raise UsageError("optimizer.lr_multipliers needs optimizer.lr, the learning rate they multiply")
    groups: dict[tuple[str, bool], dict[str, Any]] = {}
    for name, parameter in named:
        prefix = next((prefix for prefix in prefixes if _under(name, prefix)), "")
        decays = decay_norm_and_bias or not weight_decay or (parameter.ndim > 1 and not name.endswith(".bias"))
        group = groups.setdefault((prefix, decays), {"params": [], **({"weight_decay": 0.0} if not decays else {}),
                                                     **({"lr": lr * float(lr_multipliers[prefix])} if prefix else {})})
        group["params"].append(parameter)
    if len(groups) > 1:
        log.info("optimizer: %s", "; ".join(
            f"{len(group['params'])} tensors" + (f" under {prefix}: lr x{lr_multipliers[prefix]}" if prefix else "")
            + ("" if decays else ", no weight decay") for (prefix, decays), group in groups.items()))
    return list(groups.values())


def _under(name: str, prefix: str) -> bool:
    prefix = prefix.rstrip(".")
    return prefix == "*" or name == prefix or name.startswith(prefix + ".")


def cosine_with_warmup(optimizer: Optimizer, total_steps: int, steps_per_epoch: int, warmup_epochs: float = 0.0,
                       min_lr_ratio: float = 0.0) -> LambdaLR:
    """Linear warmup from ~0 to the base LR, then a half cosine down to `min_lr_ratio` x base."""
    if (asked := round(warmup_epochs * steps_per_epoch)) > total_steps and ranks.is_main_process():  # said once
        log.warning("warmup_epochs=%s is %d optimizer steps, more than the run's %d: the warmup spans the whole run",
                    warmup_epochs, asked, total_steps)
    warmup = min(total_steps, asked)

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
    """The base LR throughout, after an optional linear warmup: the cosine schedule with its floor at the base LR."""
    return cosine_with_warmup(optimizer, total_steps, steps_per_epoch, warmup_epochs, min_lr_ratio=1.0)
