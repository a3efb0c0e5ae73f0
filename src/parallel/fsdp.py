"""Fully sharded data parallel (`dist.strategy=fsdp`, docs/fsdp.md) with PyTorch's FSDP2: each unit's parameters
become DTensors sharded along their first dimension, all-gathered for its forward and backward, its gradients
reduce-scattered. Units: the modules `dist.fsdp.wrap` names by class, else the root's children holding at least
`dist.fsdp.min_unit_params` parameters and none tied to a parameter outside them, then the root. A unit's
all-gather overlaps the previous unit's compute, but each unit costs its own collectives: a small model is one unit."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.nn.modules.batchnorm import _BatchNorm

from src.common.errors import UsageError

ROOT_ONLY = ["root"]  # dist.fsdp.wrap=[root]: the whole model is one unit


def units(module: nn.Module, wrap: Sequence[str], min_unit_params: int = 0) -> list[nn.Module]:
    """The units sharded before the root: those of the classes `wrap` names (outermost), none, or the automatic ones."""
    if list(wrap) == ROOT_ONLY:
        return []
    uses = Counter(id(parameter) for _, parameter in module.named_parameters(remove_duplicate=False))  # counted once
    if wrap:
        found: list[nn.Module] = []
        for name, child in module.named_modules():
            if (child is not module and type(child).__name__ in wrap
                    and not any(child in list(parent.modules()) for parent in found)):
                if tied := _tied_outside(child, module, uses):
                    raise UsageError(f"dist.fsdp.wrap={list(wrap)}: {tied} is tied across the unit {name} and the "
                                     "rest of the model; FSDP2 shards a tied tensor in one unit: wrap a class "
                                     "holding all its uses, or [root]")
                found.append(child)
        if not found:
            classes = ", ".join(sorted({type(child).__name__ for child in module.modules()}))
            raise UsageError(f"dist.fsdp.wrap={list(wrap)} names no module class of the model; its classes: {classes}")
        return found
    return [unit for unit in _candidates(module)
            if _size(unit) >= max(min_unit_params, 1) and not _tied_outside(unit, module, uses)]


def _tied_outside(unit: nn.Module, model: nn.Module, uses: Counter[int]) -> str | None:
    """The name of a parameter `unit` shares with the rest of `model` (tied weights; `uses`: `model`'s), if any."""
    inside = Counter(id(parameter) for _, parameter in unit.named_parameters(remove_duplicate=False))
    return next((name for name, parameter in model.named_parameters()
                 if inside[id(parameter)] not in (0, uses[id(parameter)])), None)


def _candidates(module: nn.Module) -> list[nn.Module]:
    """The children holding parameters (a lone container's, and a ModuleList's or ModuleDict's: no forward)."""
    holders = [child for child in module.children() if _size(child) > 0]
    if len(holders) == 1 and any(True for _ in holders[0].children()):
        return _candidates(holders[0]) or holders
    return [unit for child in holders
            for unit in (_candidates(child) if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else [child])]


def _size(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def shard(module: nn.Module, wrap: Sequence[str], reshard_after_forward: bool, cpu_offload: bool,
          param_dtype: torch.dtype | None, min_unit_params: int = 0) -> nn.Module:
    """`module` sharded in place, unit by unit, then the root. With `param_dtype` the gradients are reduced in fp32
    and BatchNorm layers are units of their own in fp32 (batch_norm refuses a bf16 weight beside fp32 statistics)."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    chosen = units(module, wrap, min_unit_params)
    if param_dtype is not None:
        for norm in [child for child in module.modules() if isinstance(child, _BatchNorm) and child.affine]:
            fully_shard(norm, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    for unit in chosen:
        fully_shard(unit, reshard_after_forward=reshard_after_forward, mp_policy=policy, offload_policy=offload)
    # None: FSDP2's own choice for the root, which keeps its parameters gathered from the forward to the backward
    # (they would be gathered again at once); the same as `true` for a root with units inside.
    root_reshard = None if reshard_after_forward else False
    fully_shard(module, reshard_after_forward=root_reshard, mp_policy=policy, offload_policy=offload)
    return module


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def fused_step_takes_shards(build: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                            parameters: Sequence[nn.Parameter]) -> bool:
    """Whether the fused optimizer `build(params)` makes steps DTensor shards (fused SGD does not): one step on a
    one-element shard tells, without communication."""
    if (like := next((parameter for parameter in parameters if isinstance(parameter, DTensor)), None)) is None:
        return True

    def shard() -> DTensor:
        local = torch.zeros(1, dtype=like.dtype, device=like.to_local().device)
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False)

    probe = nn.Parameter(shard())
    probe.grad = shard()
    try:
        build([probe]).step()
    except NotImplementedError:  # DTensor has no sharding rule for the fused op
        return False
    return True


@contextlib.contextmanager
def no_gradient_sync(model: Any) -> Iterator[None]:
    """Backward passes in the block keep their unsharded gradients and skip the reduce-scatter (DDP's `no_sync`)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def reshard(model: nn.Module) -> None:
    """Free the parameters `model`'s sharded modules hold gathered (after a forward without gradients)."""
    for module in model.modules():
        if is_sharded(module):
            module.reshard()


def to_empty(module: nn.Module, device: torch.device | str) -> nn.Module:
    """`module.to_empty(device=device)` with its tied tensors still tied (torch's gives each module its own copy)."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties = [(owner, key, *first.setdefault(id(tensor), (owner, key))) for owner in module.modules()
            for table in (owner._parameters, owner._buffers) for key, tensor in table.items() if tensor is not None]
    module.to_empty(device=device)
    for owner, key, source, source_key in ties:
        if owner is not source or key != source_key:
            (owner._parameters if key in owner._parameters else owner._buffers)[key] = getattr(source, source_key)
    return module


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: a DTensor's local shard (writing to it writes the DTensor), or the tensor."""
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """`source` into `target`, each whole or sharded: a whole source into a DTensor keeps this rank's slice."""
    if hasattr(target, "device_mesh") and not hasattr(source, "device_mesh"):
        source = _slice_of(source, target)
    if hasattr(source, "device_mesh") and not hasattr(target, "device_mesh"):
        source = source.full_tensor()
    local(target).copy_(local(source))


def _slice_of(whole: torch.Tensor, target: Any) -> torch.Tensor:
    """This rank's slice of `whole` as the DTensor `target` holds it: a view, else `distribute_tensor`'s (no
    communication: every rank holds `whole`)."""
    part, coordinate = whole, target.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(target.placements):
        if isinstance(placement, Shard) and coordinate is not None:
            chunks = torch.chunk(part, target.device_mesh.size(mesh_dim), dim=placement.dim)  # DTensor's split
            index = coordinate[mesh_dim]
            part = chunks[index] if index < len(chunks) else part.narrow(placement.dim, 0, 0)
        elif not isinstance(placement, Replicate):
            part = None
            break
    if part is not None and part.shape == local(target).shape:
        return part
    return distribute_tensor(whole.to(local(target).device), target.device_mesh, target.placements,
                             src_data_rank=None).to_local()
