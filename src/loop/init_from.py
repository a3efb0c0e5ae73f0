"""Fine-tuning (docs/configuration.md): `init_from=PATH` reads MODEL WEIGHTS ONLY, from a checkpoint of this template
(each model from its namesake, a sharded one gathered whole), or into the output model from a `torch.save`d
state_dict or a `.safetensors` file, wrappers' key prefixes stripped; what does not match is one log line per kind,
or with `init_from_strict=true` one error line before any training. `trainer.freeze=[PREFIX, ...]` freezes the
parameters whose names start with a prefix, before DDP and the optimizer see them."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp

from src import checkpoint
from src.checkpoint.layout import is_directory_checkpoint
from src.common.errors import UsageError, first_few
from src.parallel import distributed, fsdp

log = logging.getLogger(__name__)

PREFIXES = re.compile(r"^(module\.|_orig_mod\.)+")  # DDP's and torch.compile's wrappers' key prefixes


@dataclass
class Match:
    loadable: dict[str, torch.Tensor] = field(default_factory=dict)  # same key, same shape
    missing: list[str] = field(default_factory=list)  # in the model, not in the file
    unexpected: list[str] = field(default_factory=list)  # in the file, not in the model
    mismatched: list[str] = field(default_factory=list)  # `key file[shape] model[shape]`

    @property
    def problems(self) -> str:  # what keeps the file from fitting the model exactly (e.g. `2 missing: a, b`), or ""
        kinds = (("missing", self.missing), ("unexpected", self.unexpected), ("shape differs", self.mismatched))
        return "; ".join(f"{len(keys)} {kind}: {first_few(keys)}" for kind, keys in kinds if keys)


def read_weights(path: Path, names: list[str], output: str) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors of `path` by model name: a checkpoint's models among `names`, or a plain file's for `output`."""
    if is_directory_checkpoint(path):
        return _template_weights(checkpoint.read(path), names)
    if not path.is_file():
        raise UsageError(f"init_from={path} does not exist")
    if path.suffix == ".safetensors":
        return {output: strip_prefixes(_read_safetensors(path))}
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for truncated or foreign files
        raise UsageError(f"init_from={path} cannot be read ({type(error).__name__}): is it a complete .pt file "
                         "saved with torch.save?") from None
    if isinstance(payload, dict) and str(payload.get("format", "")).startswith("ddp-template-checkpoint/"):
        return _template_weights(checkpoint.read(path), names)
    is_state_dict = isinstance(payload, dict) and bool(payload) and all(
        isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in payload.items())
    if not is_state_dict:
        raise UsageError(f"init_from={path} holds no state_dict (a dict of tensors by name, or a checkpoint of this "
                         "template): save one with torch.save(model.state_dict(), PATH)")
    return {output: strip_prefixes(payload)}


def _template_weights(saved: Any, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Each of the run's models the checkpoint holds, by name (one model from one, whatever their names)."""
    if len(names) == 1 and len(saved.model_names) == 1:
        return {names[0]: strip_prefixes(saved.model_weights(saved.model_names[0]))}
    if found := {name: strip_prefixes(saved.model_weights(name)) for name in names if name in saved.model_names}:
        return found
    raise UsageError(f"init_from={saved.path} holds the models {', '.join(saved.model_names)}, none of this run's "
                     f"({', '.join(names)})")


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:  # an optional package
        from safetensors.torch import load_file
    except ImportError:
        raise UsageError(f"init_from={path} is a safetensors file: install the safetensors package to read it "
                         "(pip install safetensors)") from None
    try:
        return load_file(str(path), device="cpu")
    except Exception as error:  # a truncated or foreign file
        raise UsageError(f"init_from={path} cannot be read as safetensors ({type(error).__name__})") from None


def strip_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`module._orig_mod.layer.weight` -> `layer.weight`: the names of the unwrapped model."""
    return {PREFIXES.sub("", key): value for key, value in state.items()}


def match(module: nn.Module, state: dict[str, torch.Tensor]) -> Match:
    """Which tensors of `state` fit `module`, and which keys do not (in the model's order)."""
    own = module.state_dict()
    found = Match(unexpected=[key for key in state if key not in own])
    for key, tensor in own.items():
        if key not in state:
            found.missing.append(key)
        elif state[key].shape != tensor.shape:
            found.mismatched.append(f"{key} file{list(state[key].shape)} model{list(tensor.shape)}")
        else:
            found.loadable[key] = state[key]
    return found


def load_initial_weights(modules: dict[str, nn.Module], output: str, path: Path, strict: bool) -> dict[str, Match]:
    """Load `path`'s matching weights into the run's `modules`; returns the matches."""
    files = read_weights(path, list(modules), output)
    matches, several = {}, len(modules) > 1
    for name, state in files.items():
        module, label = modules[name], f"init_from={path}" + (f" (model {name})" if several else "")
        found = matches[name] = match(module, state)
        if not found.loadable:
            raise UsageError(f"{label}: none of its {len(found.unexpected)} keys matches a weight of the model "
                             f"({first_few(found.unexpected)}); the model expects e.g. {first_few(found.missing)}")
        if strict and found.problems:
            raise UsageError(f"{label} does not fit the model ({found.problems}); pass init_from_strict=false "
                             "to load the weights that match and keep the rest freshly initialised (e.g. a new head)")
        if fsdp.is_sharded(module):
            whole = dcp.StateDictOptions(full_state_dict=True, strict=False)  # on every rank: each keeps its shards
            dcp.set_model_state_dict(module, dict(found.loadable), options=whole)
        else:
            module.load_state_dict(found.loadable, strict=False)
        log.info("init_from: loaded %d of %s's %d tensors from %s", len(found.loadable),
                 f"model {name}" if several else "the model",
                 len(found.loadable) + len(found.missing) + len(found.mismatched), path)
        for kind, keys in (("missing from the file (fresh initialisation kept)", found.missing),
                           ("unexpected in the file (ignored)", found.unexpected),
                           ("shape differs (fresh initialisation kept)", found.mismatched)):
            if keys:
                log.warning("init_from: %s%d %s: %s", f"{name}: " if several else "", len(keys), kind, ", ".join(keys))
    if untouched := [name for name in modules if name not in files]:
        log.warning("init_from=%s holds no weights for %s: freshly initialised", path, ", ".join(untouched))
    return matches


def load_on_every_rank(modules: dict[str, nn.Module], output: str, path: Path, strict: bool) -> None:
    """`load_initial_weights` on every rank, or every rank stops with the first failing rank's line. A collective."""
    failure = None
    try:
        load_initial_weights(modules, output, path, strict)
    except UsageError as error:
        failure = str(error)
    for rank, reason in enumerate(distributed.gather_objects(failure)):
        if reason is not None:
            raise UsageError(reason if rank == 0 else f"rank {rank}: {reason}")


def freeze(modules: dict[str, nn.Module], prefixes: list[str]) -> int:
    """Freeze the parameters whose names start with one of `prefixes`; returns how many elements that froze. A prefix
    matching nothing, or a model left with nothing to train, is one error line."""
    named = [(f"{model}.{name}" if len(modules) > 1 else name, model, parameter) for model, module in modules.items()
             for name, parameter in module.named_parameters()]
    if unmatched := [prefix for prefix in prefixes if not any(name.startswith(prefix) for name, _, _ in named)]:
        tops = sorted({name.split(".", 1)[0] if len(modules) == 1 else ".".join(name.split(".", 2)[:2])
                       for name, _, _ in named})
        raise UsageError(f"trainer.freeze: no parameter name starts with {', '.join(unmatched)}; the model's "
                         f"parameter names start with {', '.join(tops) or 'nothing (it has none)'}")
    frozen = [(model, parameter) for name, model, parameter in named if name.startswith(tuple(prefixes))]
    for model in modules:
        if frozen and sum(1 for m, _ in frozen if m == model) == sum(1 for _, m, _ in named if m == model):
            what = "the model: nothing would train" if len(modules) == 1 else \
                f"model {model!r}, which would not train: a model used frozen is an aux model (aux.{model}.path)"
            raise UsageError(f"trainer.freeze={list(prefixes)} freezes every parameter of {what}")
    for _, parameter in frozen:
        parameter.requires_grad_(False)
    return sum(parameter.numel() for _, parameter in frozen)


def starting_weights(init_from: str | None, strict: bool, modules: dict[str, nn.Module], output: str,
                     resumed: Any) -> None:
    """`init_from`'s weights over the models' own on a fresh start (a `resumed` run's are read later)."""
    if resumed is not None and init_from is not None:
        log.info("init_from=%s not applied: the run resumes from %s", init_from, resumed.path)
    elif init_from is not None:
        load_on_every_rank(modules, output, Path(init_from), strict)
