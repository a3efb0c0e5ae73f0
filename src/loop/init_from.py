"""Fine-tuning: a fresh run that starts from another run's (or another library's) model weights, and
parameters frozen out of training.

`init_from=PATH` reads MODEL WEIGHTS ONLY (never an optimizer, schedule or step count) from a
checkpoint of this template (its `model`; a sharded dist=fsdp directory is gathered whole), a
state_dict saved with `torch.save` (loaded with `weights_only=True`, so opening it never runs code),
or a `.safetensors` file when the
`safetensors` package is installed. Keys are matched after stripping DDP's `module.` and
torch.compile's `_orig_mod.` prefixes. What does not match (keys the model lacks, keys the file
lacks, tensors whose shapes differ) is one log line per kind; with `init_from_strict=true` (the
default) any of it is one error line instead, before any training. With `init_from_strict=false`
the model keeps its fresh initialisation there: a new head for another class count.

`trainer.freeze=[PREFIX, ...]` sets requires_grad=False on every parameter whose name starts with a
prefix, before DDP and the optimizer see the model: they get no gradient and no optimizer state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from src import checkpoint
from src.checkpoint.file_store import model_weights_in
from src.checkpoint.layout import is_directory_checkpoint
from src.common.errors import UsageError
from src.parallel import distributed, fsdp

log = logging.getLogger(__name__)

PREFIXES = ("module.", "_orig_mod.")  # DDP's and torch.compile's wrappers' key prefixes
SHOWN = 4  # keys named per kind in a log or error line


@dataclass
class Match:
    """How a file's tensors fit a model's state_dict."""

    loadable: dict[str, torch.Tensor] = field(default_factory=dict)  # same key, same shape
    missing: list[str] = field(default_factory=list)  # in the model, not in the file
    unexpected: list[str] = field(default_factory=list)  # in the file, not in the model
    mismatched: list[str] = field(default_factory=list)  # `key file[shape] model[shape]`

    @property
    def complete(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of `path` by name, prefixes stripped, or one error line saying why not."""
    if is_directory_checkpoint(path):  # dist=fsdp's directory (or last / best): gathered here
        return strip_prefixes(checkpoint.read(path).model_weights())
    if not path.is_file():
        raise UsageError(f"init_from={path} does not exist")
    if path.suffix == ".safetensors":
        return strip_prefixes(_read_safetensors(path))
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for truncated or foreign files
        raise UsageError(f"init_from={path} cannot be read ({type(error).__name__}): is it a complete .pt file "
                         "saved with torch.save?") from None
    template_weights = model_weights_in(payload)  # a checkpoint of this template: its weights only
    payload = payload if template_weights is None else template_weights
    if not _is_state_dict(payload):
        raise UsageError(f"init_from={path} holds no state_dict (a dict of tensors by name, or a checkpoint of this "
                         "template): save one with torch.save(model.state_dict(), PATH)")
    return strip_prefixes(payload)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:  # an optional package: imported only for a .safetensors file
        from safetensors.torch import load_file
    except ImportError:
        raise UsageError(f"init_from={path} is a safetensors file: install the safetensors package to read it "
                         "(pip install safetensors)") from None
    try:
        return load_file(str(path), device="cpu")
    except Exception as error:  # a truncated or foreign file
        raise UsageError(f"init_from={path} cannot be read as safetensors ({type(error).__name__})") from None


def _is_state_dict(payload: Any) -> bool:
    return isinstance(payload, dict) and bool(payload) and all(
        isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in payload.items())


def strip_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`module._orig_mod.layer.weight` -> `layer.weight`: the names of the unwrapped model."""
    stripped = {}
    for key, value in state.items():
        while key.startswith(PREFIXES):
            key = key.split(".", 1)[1]
        stripped[key] = value
    return stripped


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


def load_initial_weights(module: nn.Module, path: Path, strict: bool) -> Match:
    """Load `path`'s matching weights into `module` (see the module's docstring); returns the match."""
    found = match(module, read_weights(path))
    if not found.loadable:
        raise UsageError(f"init_from={path}: none of its {len(found.unexpected)} keys matches a weight of the model "
                         f"({_keys(found.unexpected)}); the model expects e.g. {_keys(found.missing)}")
    if strict and not found.complete:
        raise UsageError(f"init_from={path} does not fit the model ({_problems(found)}); pass init_from_strict=false "
                         "to load the weights that match and keep the rest freshly initialised (e.g. a new head)")
    if fsdp.is_sharded(module):  # each rank keeps its shards of the file's tensors
        fsdp.load_full_model_state(module, found.loadable, strict=False)
    else:
        module.load_state_dict(found.loadable, strict=False)
    log.info("init_from: loaded %d of the model's %d tensors from %s", len(found.loadable),
             len(found.loadable) + len(found.missing) + len(found.mismatched), path)
    for kind, keys in (("missing from the file (fresh initialisation kept)", found.missing),
                       ("unexpected in the file (ignored)", found.unexpected),
                       ("shape differs (fresh initialisation kept)", found.mismatched)):
        if keys:
            log.warning("init_from: %d %s: %s", len(keys), kind, ", ".join(keys))
    return found


def load_on_every_rank(module: nn.Module, path: Path, strict: bool) -> None:
    """`load_initial_weights` on every rank, or every rank stops with the first failing rank's line (rank 0
    prints it), instead of some ranks training from other weights, or waiting for ranks that stopped.
    A collective: every rank calls it."""
    failure = None
    try:
        load_initial_weights(module, path, strict)
    except UsageError as error:
        failure = str(error)
    failures = distributed.gather_objects(failure)
    for rank, reason in enumerate(failures):
        if reason is not None:
            raise UsageError(reason if rank == 0 else f"rank {rank}: {reason}")


def _keys(keys: list[str]) -> str:
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return ", ".join(keys[:SHOWN]) + more


def _problems(found: Match) -> str:
    kinds = (("missing", found.missing), ("unexpected", found.unexpected), ("shape differs", found.mismatched))
    return "; ".join(f"{len(keys)} {kind}: {_keys(keys)}" for kind, keys in kinds if keys)


def freeze(module: nn.Module, prefixes: list[str]) -> int:
    """Set requires_grad=False on the parameters whose names start with one of `prefixes`; returns how
    many parameter elements that froze. A prefix no parameter name starts with is an error line."""
    named = list(module.named_parameters())
    unmatched = [prefix for prefix in prefixes if not any(name.startswith(prefix) for name, _ in named)]
    if unmatched:
        tops = sorted({name.split(".", 1)[0] for name, _ in named})
        raise UsageError(f"trainer.freeze: no parameter name starts with {', '.join(unmatched)}; the model's "
                         f"parameter names start with {', '.join(tops) or 'nothing (it has none)'}")
    frozen = [parameter for name, parameter in named if name.startswith(tuple(prefixes))]
    if frozen and len(frozen) == len(named):
        raise UsageError(f"trainer.freeze={list(prefixes)} freezes every parameter of the model: nothing would train")
    for parameter in frozen:
        parameter.requires_grad_(False)
    return sum(parameter.numel() for parameter in frozen)
