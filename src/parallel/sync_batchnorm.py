"""Synchronised batch normalisation that also works on the CPU (gloo): without it each rank normalises with its own
batch's statistics, so W ranks do not compute what one process does on the global batch. `nn.SyncBatchNorm` does this on
GPUs only (DDP refuses CPU modules holding it); `CPUSyncBatchNorm` does the same math with one all-reduce per layer."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd

log = logging.getLogger(__name__)


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group, the gradient summed too: each rank's sums get gradient from every rank's loss."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad_total.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class CPUSyncBatchNorm(_BatchNorm):
    """BatchNorm over (N, C, *) whose training statistics are summed over `process_group`: outputs, gradients and
    running statistics equal one BatchNorm's on the ranks' concatenated batches, whatever their sizes."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: dist.ProcessGroup | None = None,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized()
                and dist.get_world_size(self.process_group) > 1):
            return super().forward(input)
        self._check_input_dim(input)
        # Sums of squares in half precision lose the variance, so accumulate in float32 at least.
        x = input.to(torch.promote_types(input.dtype, torch.float32))
        mean, var, count = self._global_statistics(x)
        if self.track_running_stats:  # this global batch blended into the running averages exactly as _BatchNorm does
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(var * (count / (count - 1)), alpha=momentum)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        out = (x - mean.view(shape)) * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)

    def _global_statistics(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-channel mean and biased variance over all ranks, and the global element count."""
        channels = x.size(1)
        reduce_dims = [0, *range(2, x.dim())]
        local_count = torch.full((1,), x.numel() / channels, dtype=x.dtype, device=x.device)
        local = torch.cat([x.sum(reduce_dims), (x * x).sum(reduce_dims), local_count])
        total_sum, total_sq, count = _AllReduceSum.apply(local, self.process_group).split([channels, channels, 1])
        if count.item() <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got {int(count.item())}")
        mean = total_sum / count
        # E[x^2] - E[x]^2 can round slightly below zero.
        return mean, (total_sq / count - mean * mean).clamp_min(0), count


class _ThenItsChildren:
    """A sync-BN that runs its submodules after normalising, in their order, as timm's BatchNormAct2d runs its
    dropout and activation (torch's convert_sync_batchnorm drops them: the model would compute another function)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = super().forward(input)  # type: ignore[misc]
        for child in self.children():  # type: ignore[attr-defined]
            output = child(output)
        return output


class SyncBatchNormThen(_ThenItsChildren, nn.SyncBatchNorm): ...


class CPUSyncBatchNormThen(_ThenItsChildren, CPUSyncBatchNorm): ...


def convert_sync_batchnorm(module: nn.Module, device: torch.device) -> nn.Module:
    """`module` with every BatchNorm replaced, in place, by the sync-BN that works on `device` (same keys, tensors):
    nn.SyncBatchNorm on CUDA, else CPUSyncBatchNorm; one with submodules (timm's BatchNormAct2d) keeps them."""
    unsynced = isinstance(module, _BatchNorm) and not isinstance(module, (nn.SyncBatchNorm, CPUSyncBatchNorm))
    converted = _to_sync_batchnorm(module, device) if unsynced else module
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, device))
    return converted


def _to_sync_batchnorm(bn: _BatchNorm, device: torch.device) -> nn.Module:
    """The sync-BN for `device` holding `bn`'s own parameters and buffers (same dtype, device, requires_grad)."""
    then = next(bn.children(), None) is not None
    kind = {(True, False): nn.SyncBatchNorm, (True, True): SyncBatchNormThen, (False, False): CPUSyncBatchNorm,
            (False, True): CPUSyncBatchNormThen}[device.type == "cuda", then]
    sync_bn = kind(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
    if bn.affine:
        sync_bn.weight, sync_bn.bias = bn.weight, bn.bias
    if bn.track_running_stats:
        sync_bn.running_mean, sync_bn.running_var = bn.running_mean, bn.running_var
        sync_bn.num_batches_tracked = bn.num_batches_tracked
    sync_bn.train(bn.training)
    return sync_bn


def warn_of_bias_before_batchnorm(module: nn.Module) -> None:
    """Warn of each trained bias feeding a BatchNorm directly, in `module`'s first forward: its gradient is rounding
    noise that differs with the world size, which Adam turns into lr-sized steps."""
    produced: dict[int, tuple[str, weakref.ref]] = {}  # output tensor id -> (the biased layer's name, the tensor)
    handles: list[Any] = []

    def remember(name: str) -> Any:
        return lambda layer, inputs, output: produced.__setitem__(id(output), (name, weakref.ref(output)))

    def check(name: str) -> Any:
        def hook(layer: nn.Module, inputs: tuple[Any, ...]) -> None:
            source, tensor = produced.get(id(inputs[0]), (None, lambda: None))
            if source is not None and tensor() is inputs[0]:
                log.warning("%s has a bias feeding the BatchNorm %s directly: its gradient is rounding noise that "
                            "differs with the world size (the BatchNorm removes the mean), so 1 and N ranks train "
                            "different weights; give %s bias=False", source, name, source)
        return hook

    for name, layer in module.named_modules():
        if isinstance(layer, (nn.Linear, _ConvNd)) and layer.bias is not None and layer.bias.requires_grad:
            handles.append(layer.register_forward_hook(remember(name)))
        elif isinstance(layer, _BatchNorm):
            handles.append(layer.register_forward_pre_hook(check(name)))

    def done(*_: Any) -> None:
        for handle in handles:
            handle.remove()
        produced.clear()

    handles.append(module.register_forward_hook(done))
