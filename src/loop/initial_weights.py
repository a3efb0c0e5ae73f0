"""A fresh run's initial weights (`trainer.init_weights`): drawn by the model's constructor, or derived from the
seed and each module's name.

`constructor` (the default, except under dist=fsdp): the model is built whole, its constructor drawing from the
RNG as the run's seeding left it, as every run did before; under dist=fsdp every rank builds it whole, then shards.

`by_name` (the default under dist=fsdp): for each module that owns parameters or buffers, a full-size copy of
that one module's own tensors is initialised on the CPU, with the RNG seeded from (seed, the module's name in
`named_modules()`), and each rank keeps its slice of it (all of it, unless sharded). So the weights depend
neither on the world size nor on the strategy: a sharded run's are bitwise those of a dist=ddp run with
`trainer.init_weights=by_name` and the same seed, by construction. A model built on the meta device has no
order of RNG draws to replay, which is why dist=fsdp needs this scheme; dist=ddp keeps `constructor`, so its
runs start where they always did. A rank's peak memory is its shards plus one module.

A module's initialiser is the model's `init_module(module)` when the model defines one (it is called for
every module that owns tensors: TinyGPT's draws GPT-2's N(0, 0.02), resnet18's torchvision's own scheme),
else the module's `reset_parameters()` (torch's layers: what their constructors draw). An initialiser
touches only that module's own parameters and buffers.

With `by_name`, dist=fsdp builds the model on the meta device (no memory), shards it, allocates only this
rank's shards (`to_empty`, src/parallel/distributed.py) and initialises them. A model that cannot be built
there (its constructor reads data, or makes a tensor on a named device), or one with a module that owns
tensors no initialiser covers (a bare `nn.Parameter`, a buffer computed in `__init__`), is built whole on
every rank and then sharded; the log says so in one line, naming the reason. A module no initialiser covers
keeps the values its constructor gave it, under every strategy alike (with `by_name`, constructors run with
the RNG seeded from the seed, and the run's own RNG left as it was).
"""

from __future__ import annotations

import hashlib
import logging
import sys
from itertools import chain
from typing import Callable, Iterator

import torch
from torch import nn

from src.parallel import fsdp

log = logging.getLogger(__name__)


def by_name(setting: str, strategy: str) -> bool:
    """Whether `trainer.init_weights=setting` initialises by name under `dist.strategy`: `auto` does under fsdp."""
    return setting == "by_name" or (setting == "auto" and strategy == "fsdp")


def build(make: Callable[[], nn.Module], seed: int, named: bool, sharded: bool) -> nn.Module:
    """The model `make()` builds. Not `named` (constructor): as the RNG stands. `named` (by_name): on the meta
    device if `sharded` and it can be (see the module's docstring), else on the CPU, its constructor drawing
    from the RNG seeded with `seed`; `initialise` gives it its weights once prepared."""
    if not named:
        if sharded:
            log.info("dist=fsdp, trainer.init_weights=constructor: the model is built whole on every rank, then "
                     "sharded")
        return make()
    reason = None
    if sharded:
        model, reason = _built_on_meta(make)
        if model is not None:
            log.info("dist=fsdp: the model is built on the meta device; each rank allocates only its shards")
            return model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make()
    if reason is not None:
        log.warning("dist=fsdp: the model is built whole on every rank, then sharded: %s", reason)
    return model


def _built_on_meta(make: Callable[[], nn.Module]) -> tuple[nn.Module | None, str | None]:
    """The model built on the meta device, or None and why it cannot be."""
    try:
        with torch.device("meta"):
            model = make()
    except Exception as error:  # noqa: BLE001 - any failure: the whole build says it again, or works
        return None, f"{type(error).__name__} when built on the meta device ({error})"
    real = [name for name, tensor in _tensors(model) if not tensor.is_meta]
    if real:
        return None, f"its constructor made {real[0]} on the {_tensor(model, real[0]).device} device, not on meta"
    uncovered = _uncovered(model)
    if uncovered is not None:
        where = f"its module {uncovered!r}" if uncovered else "the model itself"
        return None, (f"{where} ({type(model.get_submodule(uncovered)).__name__}) owns tensors but has no "
                      f"reset_parameters(), and {type(model).__name__} defines no init_module(module)")
    return model, None


def initialise(model: nn.Module, seed: int) -> None:
    """Initialise `model`'s weights (plain, or this rank's shards) as the module's docstring says."""
    hook = getattr(model, "init_module", None)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for name, module in owners(model):
            if hook is None and not hasattr(module, "reset_parameters"):
                continue  # the constructor's values (checked on meta: such a model was built whole)
            full = _full_size_copy(module)
            torch.manual_seed(name_seed(seed, name))
            if hook is not None:
                hook(full)
            else:
                full.reset_parameters()
            for key, tensor in _own(module):
                _local(tensor).copy_(_slice(getattr(full, key), tensor))


def name_seed(seed: int, name: str) -> int:
    """The RNG seed of module `name` in a run seeded with `seed` (63 bits of a hash of both)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(), "little") >> 1


def owners(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that own parameters or buffers themselves, by name, in `named_modules()` order."""
    return [(name, module) for name, module in model.named_modules() if any(True for _ in _own(module))]


def _uncovered(model: nn.Module) -> str | None:
    if callable(getattr(model, "init_module", None)):
        return None
    return next((name for name, module in owners(model) if not hasattr(module, "reset_parameters")), None)


def _own(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return ((key, tensor) for key, tensor in chain(module._parameters.items(), module._buffers.items())
            if tensor is not None)


def _tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return chain(model.named_parameters(), model.named_buffers())


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    return dict(_tensors(model))[name]


def _full_size_copy(module: nn.Module) -> nn.Module:
    """`module` (same class and settings) with empty full-size CPU tensors of its own, and no children. A unit
    FSDP sharded is copied as its own class (FSDP's subclass cannot be created without its arguments)."""
    plain = type(module).__mro__[2] if fsdp.is_sharded(module) else type(module)  # (FSDP<Class>, FSDPModule, Class)
    full = object.__new__(plain)
    full.__dict__.update(module.__dict__)
    full.__dict__["_parameters"] = {key: None if p is None else nn.Parameter(_empty(p), p.requires_grad)
                                    for key, p in module._parameters.items()}
    full.__dict__["_buffers"] = {key: None if b is None else _empty(b) for key, b in module._buffers.items()}
    full.__dict__["_modules"] = {}
    return full


def _empty(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype)  # a DTensor's shape is the whole tensor's


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def _slice(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full`, as `target` (a DTensor shard, or a whole tensor) holds it."""
    if not hasattr(target, "device_mesh"):
        return full
    # A DTensor exists, so its module is loaded (importing it costs runs that do not shard ~1 s).
    distribute_tensor = sys.modules["torch.distributed.tensor"].distribute_tensor
    # src_data_rank=None: every rank computed the same `full`, so each keeps its slice without communicating.
    return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
