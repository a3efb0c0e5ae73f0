"""A fresh run's initial weights: the ones the model's own code gives, the same under dist=ddp and dist=fsdp and on
any world size. A model declares one hook, or none:

- `init_module(self, module, name)`: initialise one module's own parameters and buffers (not its children's);
  called for every module that owns tensors, in `named_modules()` order, from one RNG stream seeded once for the
  model (`model_seed`). A model whose constructor draws only through its layers' `reset_parameters()`, in the order
  it registers them, gets its constructor's very weights from `module.reset_parameters()`.
- `init_weights(self)`: initialise the whole model, called once, the RNG seeded alike.
- neither: the constructor's values, drawn from the run's RNG as seeded, built whole on every rank.

A model with a hook is built on the meta device, given memory only for what this rank holds, and its hook runs on a
whole-size CPU copy of one module at a time (or of the model), of which each rank keeps its slices (docs/fsdp.md).
One that cannot be built on meta is built whole, then initialised alike. A tensor a hook leaves unset is one error."""

from __future__ import annotations

import copy
import hashlib
import logging
from itertools import chain
from typing import Callable, Iterator

import torch
from torch import nn

from src.common.errors import UsageError
from src.parallel import fsdp

log = logging.getLogger(__name__)

HOOKS = ("init_module", "init_weights")


def hook_of(model: nn.Module) -> str | None:
    return next((hook for hook in HOOKS if callable(getattr(model, hook, None))), None)


class Initial:
    """A model as built, and what `initialise` needs once it is prepared (`hook` None: it has its weights)."""

    def __init__(self, model: nn.Module, name: str, hook: str | None) -> None:
        self.model, self.name, self.hook = model, name, hook
        self.classes = {owner: type(module) for owner, module in owners(model)}
        on_meta = any(tensor.is_meta for _, tensor in _tensors(model))
        self.meta = copy.deepcopy(model) if hook == "init_weights" and on_meta else None


def build(make: Callable[[], nn.Module], name: str, seed: int, sharded: bool) -> Initial:
    """Model `name` as `make()` builds it: on the meta device if it declares a hook and can be, else whole."""
    label = "the model" if name == "model" else f"model {name}"
    model, reason = _built_on_meta(make)
    if model is not None and hook_of(model) is not None:
        log.info("%s is built on the meta device; its %s gives it its weights%s", label, hook_of(model),
                 ", each rank its shards" if sharded else "")
        return Initial(model, name, hook_of(model))
    if model is not None and sharded:  # said before the build, which may be what runs out of memory
        log.info("dist=fsdp: %s (%s) is built whole on every rank, then sharded: it declares no "
                 "init_module(module, name) or init_weights(); give it one to build it on the meta device, each rank "
                 "allocating only its shards", label, type(model).__name__)
    model = make()  # the constructor draws from the run's RNG as seeded
    if (hook := hook_of(model)) is not None:
        log.warning("%s is built whole on every rank, then initialised by its %s: %s", label, hook, reason)
        initialise(Initial(model, name, hook), model, seed)
    return Initial(model, name, None)


def _built_on_meta(make: Callable[[], nn.Module]) -> tuple[nn.Module | None, str | None]:
    """The model built on the meta device, or None and why it cannot be. The run's RNG is left as it was."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = make()
    except Exception as error:  # noqa: BLE001 - any failure: the whole build says it again, or works
        return None, f"{type(error).__name__} when built on the meta device ({error})"
    if (real := next((name for name, tensor in _tensors(model) if not tensor.is_meta), None)) is not None:
        return None, f"its constructor made {real} on the {dict(_tensors(model))[real].device} device, not on meta"
    return model, None


def initialise(initial: Initial, module: nn.Module, seed: int) -> None:
    """Give `module` (`initial.model` once prepared: plain, or sharded) its weights by `initial.hook`, if any."""
    if initial.hook is None:
        return
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(model_seed(seed, initial.name))
        if initial.hook == "init_module":
            for name, owner in owners(module):
                full = _full_size_copy(owner, initial.classes[name])
                _unset(full)
                module.init_module(full, name)
                _check_set(full, f"{type(initial.model).__name__}.init_module", name)
                for key, tensor in _own(owner):
                    fsdp.copy_into(tensor, getattr(full, key))
        else:  # init_weights: on the whole model, or a whole copy of one built on meta (then its slices kept)
            whole = module if initial.meta is None else fsdp.to_empty(initial.meta, "cpu")
            _unset(whole)
            whole.init_weights()
            _check_set(whole, f"{type(whole).__name__}.init_weights", "")
            if whole is not module:
                targets = dict(_tensors(module))
                for key, tensor in _tensors(whole):
                    fsdp.copy_into(targets[key], tensor)
            initial.meta = None


def model_seed(seed: int, model: str) -> int:
    """The run's `seed` for the model named `model` (so a hook replaying its constructor gets its very weights); for
    any other, a 63-bit hash of both."""
    if model == "model":
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}/{model}".encode(), digest_size=8).digest(), "little") >> 1


def owners(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that own parameters or buffers themselves, by name, in `named_modules()` order."""
    return [(name, module) for name, module in model.named_modules() if any(True for _ in _own(module))]


def _own(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return ((key, tensor) for key, tensor in chain(module._parameters.items(), module._buffers.items())
            if tensor is not None)


def _tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return chain(model.named_parameters(), model.named_buffers())


_UNSET_INT = -(2**62)  # what an integer tensor holds until a hook sets it (NaN for floating ones)


def _unset(module: nn.Module) -> None:
    """Fill `module`'s tensors with values no initialiser gives, so `_check_set` finds those left unset."""
    for _, tensor in _tensors(module):
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.fill_(float("nan"))
        elif tensor.dtype != torch.bool:
            tensor.fill_(max(_UNSET_INT, torch.iinfo(tensor.dtype).min))


def _check_set(module: nn.Module, hook: str, where: str) -> None:
    for key, tensor in _tensors(module):
        unset = bool(tensor.isnan().any()) if tensor.is_floating_point() or tensor.is_complex() else (
            tensor.dtype != torch.bool and bool((tensor == max(_UNSET_INT, torch.iinfo(tensor.dtype).min)).any()))
        if tensor.numel() and unset:
            name = f"{where}.{key}" if where else key
            raise UsageError(f"{hook} left {name} unset: the model is built on the meta device, where its "
                             f"constructor's values do not exist; set it there (e.g. module.reset_parameters()), or "
                             f"remove the hook to build the model by its constructor")


def _full_size_copy(module: nn.Module, built_as: type) -> nn.Module:
    """`module` as the class it was built as, with its settings, empty full-size CPU tensors and no children."""
    full = object.__new__(built_as)
    full.__dict__.update(module.__dict__)
    full.__dict__["_parameters"] = {key: None if p is None else nn.Parameter(_empty(p), p.requires_grad)
                                    for key, p in module._parameters.items()}
    full.__dict__["_buffers"] = {key: None if b is None else _empty(b) for key, b in module._buffers.items()}
    full.__dict__["_modules"] = {}
    return full


def _empty(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype)  # a DTensor's shape is the whole tensor's
