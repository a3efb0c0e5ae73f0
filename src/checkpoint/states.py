"""The run's models and optimizers as checkpoint parts, so that any checkpoint resumes on any world size and
strategy: `ModelState` (the unwrapped module's state_dict, DTensor shards under dist=fsdp; loads a whole state into a
sharded module and a sharded one into a plain module), `OptimizerState` (keyed by parameter name, not torch's
position, so dist=ddp and dist=fsdp runs read each other's) and `Named` (several parts of one kind by name)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp

from src.common.errors import UsageError, first_few
from src.parallel import fsdp

IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")  # how an optimizer computes a step, not its state


def is_dtensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and hasattr(value, "device_mesh")


class ModelState:
    """A trained model's weights as a checkpoint part; `name` and `source` word its errors."""

    def __init__(self, module: nn.Module, name: str = "model", source: str = "the checkpoint") -> None:
        self.module, self.name, self.source = module, name, source  # source: `checkpoint PATH` once the reader sets it

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dcp.get_model_state_dict(self.module) if fsdp.is_sharded(self.module) else self.module.state_dict()

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Whole or sharded tensors into a plain or a sharded module; keys or shapes that differ are one line."""
        try:
            if fsdp.is_sharded(self.module):
                whole = not any(is_dtensor(tensor) for tensor in state.values())
                dcp.set_model_state_dict(self.module, dict(state), options=dcp.StateDictOptions(full_state_dict=whole))
            else:
                self.module.load_state_dict(state)
        except (RuntimeError, KeyError, ValueError) as error:
            which = "this model" if self.name == "model" else f"model {self.name!r}"
            raise UsageError(f"{self.source} does not fit {which} ({_mismatch(error)}); use the model and dataset "
                             "configs it was saved with") from None


def _mismatch(error: BaseException) -> str:
    """torch's words for the keys and shapes that differ, cut to two kinds and three keys of each
    (`Unexpected key(s) in state_dict: "a", "b", ...`)."""
    lines = [line.strip().rstrip(". ") for line in str(error).strip().splitlines() if line.strip()]
    problems = []
    for line in lines[1:] or lines:
        keys = [part for index, part in enumerate(line.split('"')) if index % 2]
        problems.append(line if len(keys) <= 3 else f"{line.split(':')[0]}: {first_few(keys, 3)}")
    return first_few(problems, 2, "; ")


class OptimizerState:
    """An optimizer over a trained model's parameters as a checkpoint part, keyed by parameter name."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer, self.sharded = module, optimizer, fsdp.is_sharded(module)

    def state_dict(self) -> dict[str, Any]:
        if self.sharded and self.optimizer.state:  # torch's helper would step an optimizer without state
            return dcp.get_optimizer_state_dict(self.module, self.optimizer)
        names = self._names()
        groups = [{**group, "params": [names[id(p)] for p in group["params"]]} for group in self.optimizer.param_groups]
        return {"state": {names[id(p)]: value for p, value in self.optimizer.state.items()}, "param_groups": groups}

    def load_targets(self) -> dict[str, Any]:
        """What the sharded reader reads into: state tensors sharded like their parameters (torch's helper makes them
        by stepping an optimizer that has none; `load_state_dict` drops those the checkpoint lacks)."""
        return dcp.get_optimizer_state_dict(self.module, self.optimizer) if self.sharded else self.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # The saved param_groups with this run's kernel choices (a ddp run's fused=true may not run on shards).
        groups = [{**group, **{key: own[key] for key in IMPLEMENTATION if key in own}}
                  for group, own in zip(state["param_groups"], self.optimizer.param_groups)]
        by_id = self._names()
        if self.sharded:
            whole = not any(is_dtensor(value) for values in state["state"].values() for value in values.values())
            saved_state = {"state": dict(state["state"]), "param_groups": groups}
            dcp.set_optimizer_state_dict(self.module, self.optimizer, saved_state,
                                         options=dcp.StateDictOptions(full_state_dict=whole))
            for parameter in [p for p in self.optimizer.state if by_id[id(p)] not in state["state"]]:
                del self.optimizer.state[parameter]  # made up by torch's helper: this parameter had no state
            return
        live = [[by_id[id(parameter)] for parameter in group["params"]] for group in self.optimizer.param_groups]
        positions = {name: index for index, name in enumerate(name for names in live for name in names)}
        unknown = [name for name in state["state"] if name not in positions]
        if unknown or len(groups) != len(live):
            raise UsageError(f"the checkpoint's optimizer state does not fit this run's optimizer (parameters "
                             f"{', '.join(unknown[:3]) or 'none'} unknown; {len(groups)} parameter groups saved, "
                             f"{len(live)} here): resume with the model and optimizer configs it was saved with")
        self.optimizer.load_state_dict({
            "state": {positions[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [positions[name] for name in names]}
                             for group, names in zip(groups, live)]})

    def _names(self) -> dict[int, str]:
        """Parameter name by id: the module's names, which a plain and a sharded module share."""
        return {id(parameter): name for name, parameter in self.module.named_parameters()}


class Named:
    """Several parts of one kind (`what`) by name; a resumed run must find each of its own in the checkpoint."""

    def __init__(self, parts: Mapping[str, Any], what: str) -> None:
        self.parts, self.what, self.source = dict(parts), what, "the checkpoint"

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, states: Mapping[str, Any]) -> None:
        if missing := [name for name in self.parts if name not in states]:
            raise UsageError(f"{self.source} holds no {self.what} {', '.join(map(repr, missing))} (it holds "
                             f"{', '.join(map(repr, states)) or 'none'}): resume with the models it was saved with")
        for name, part in self.parts.items():
            part.load_state_dict(states[name])
