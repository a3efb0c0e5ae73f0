"""What a task's training step is given: the step's micro-batches and the primitives that keep the guarantees.

A task's `train_step(step)` (src/loop/task.py) is one training step: the built-in supervised one, or a fork's own
(a GAN's two updates, a distillation, a contrastive loss over the global batch). The primitives keep what every step
must keep, whatever the world size, `grad_accum` and strategy:

    step.batches                 this rank's micro-batches of the step (trainer.grad_accum of them), on the device
    step.models / step.modules   the trained models by name, as the step calls them (DDP / FSDP / compiled) and
                                 unwrapped; step.aux: the frozen auxiliary models
    step.divisor(counts)         the step's global count of units (`StepDivisor`), from each micro-batch's count
    step.accumulate(items)       (micro, item) for each micro-batch, the gradient sync held back until the last
    step.autocast()              trainer.precision's mixed precision for the forward
    step.backward(loss, divisor) back-propagate a loss SUMMED over this micro-batch's units as its share of the mean
                                 over every unit of the global batch (fp16-scaled): exact on any world size
    step.optimizer_step(name)    one model's update: unscale, on_before_optimizer_step, clip, step, zero the grads
    step.add_sums(sums)          metric sums (device tensors, by the names the task's sum_shapes gives)
    step.all_gather(tensor)      every rank's `tensor`, in global-batch order, differentiable to each rank's rows
    micro.randn(stream, *shape)  draws per sample, from (seed, step, the sample's place in the global batch, stream):
                                 the same on any world size and after a resume

The trainer counts the step, steps every schedule, updates the fp16 scaler and tells the callbacks."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ContextManager, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from src.common.errors import UsageError, first_few
from src.data.sample_randomness import normal_per_sample, uniform_per_sample
from src.loop.performance import autocast
from src.parallel import fsdp
from src.parallel.distributed import all_reduce_sum, is_initialized

T = TypeVar("T")


@dataclass(frozen=True)
class Update:
    """One optimizer's step, as `on_before_optimizer_step` sees it: change the gradients of `module` in place."""

    number: int  # the training step being taken (1 = the run's first)
    name: str  # the model's name (its optimizer's): `model` in a run of one model
    module: nn.Module  # the model, unwrapped (sharded under dist=fsdp)
    optimizer: torch.optim.Optimizer


class Samples:
    """A batch's samples by their place (`positions`: in a step's global batch, in a split) and `step` (a step's
    number, an evaluation's stream): what their draws are keyed by."""

    def __init__(self, seed: int, step: int, positions: torch.Tensor) -> None:
        self.seed, self.step, self.positions = seed, step, positions

    def randn(self, stream: str, *shape: int) -> torch.Tensor:
        """Standard normal values, `(samples, *shape)`: row i from (seed, step, stream, positions[i]) alone."""
        return normal_per_sample(self.seed, self.step, stream, self.positions, shape)

    def rand(self, stream: str, *shape: int) -> torch.Tensor:
        """Uniform values in (0, 1), `(samples, *shape)`, keyed as `randn`'s."""
        return uniform_per_sample(self.seed, self.step, stream, self.positions, shape)


class MicroStep(Samples):
    """Micro-batch `index` of a step (`last`: the one whose backward synchronises the gradients)."""

    def __init__(self, seed: int, step: int, positions: torch.Tensor, index: int, last: bool) -> None:
        super().__init__(seed, step, positions)
        self.index, self.last = index, last


def start_all_reduce(tensor: torch.Tensor) -> dist.Work | None:
    """Launch the sum of `tensor` over all ranks, in place; returns the pending work (None in one process)."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True) if is_initialized() else None


class StepDivisor:
    """Turns each micro-step's loss SUM into its share of the mean over every unit of the global batch: DDP and FSDP
    average gradients over the W ranks, so each rank back-propagates `loss_sum * W / G`, G the global count. Samples
    (host ints) are alike on every rank, so G / W is this rank's own count; counts that depend on the data (device
    tensors) are all-reduced asynchronously from construction (before the first forward) to the first call (before
    the first backward), with no host sync: then a collective, built by every rank each step."""

    def __init__(self, counts: Sequence[int | torch.Tensor], world_size: int) -> None:
        self.counts, self.world_size = list(counts), world_size
        self.local: int | None = None  # samples: this rank's count over the step, the same on every rank
        self.global_count: torch.Tensor | None = None
        self._pending: dist.Work | None = None
        self._scale: torch.Tensor | None = None
        if all(isinstance(count, int) for count in self.counts):
            self.local = sum(self.counts)  # type: ignore[arg-type]
            return
        device = next(count.device for count in self.counts if isinstance(count, torch.Tensor))
        self.global_count = torch.stack([torch.as_tensor(count, device=device, dtype=torch.int64)
                                         for count in self.counts]).sum()
        self._pending = start_all_reduce(self.global_count)

    def __call__(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The loss to back-propagate for one micro-step whose loss, summed over its units, is `loss_sum`."""
        if self.local is not None:
            return loss_sum / self.local
        if self._scale is None:
            if self._pending is not None:
                self._pending.wait()  # queues the wait on the device stream: no host sync on GPUs
            # A step whose micro-batches hold no unit at all (every target padding) adds nothing.
            self._scale = (self.world_size / self.global_count.clamp(min=1).double()).to(loss_sum.dtype)
        return loss_sum * self._scale


class MetricSums:
    """Running metric sums by name (every task has `loss` and `count`) since `reset()`, added on the device with no
    host sync. `reduce()` all-reduces them in ONE collective (slices of one float64 vector: counts exact to 2**53), so
    a metric computed from them is exact over every rank's samples, not a mean of per-rank means."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], device: torch.device) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {"loss": (), "count": (), **shapes}
        self._offsets: dict[str, slice] = {}
        start = 0
        for name, shape in self.shapes.items():
            size = math.prod(shape)
            self._offsets[name] = slice(start, start + size)
            start += size
        self._vector = torch.zeros(start, dtype=torch.float64, device=device)
        self._views = {name: self._vector[where].view(self.shapes[name]) for name, where in self._offsets.items()}

    def reset(self) -> None:
        self._vector.zero_()

    @torch.no_grad()
    def add(self, sums: Mapping[str, torch.Tensor | float]) -> None:
        """Add a batch's sums (device tensors or numbers), each under a name these sums track."""
        for name, value in sums.items():
            if name not in self._views:  # a misspelt name would be dropped, and its metric reported as 0
                raise UsageError(f"the sum {name!r} is not one the task declares ({', '.join(self.shapes)}): name it "
                                 "in the task's sum_shapes (val_sum_shapes for a sum counted on val only)")
            self._views[name] += value.detach() if isinstance(value, torch.Tensor) else value

    def totals(self) -> torch.Tensor:
        """This rank's sums as one vector (a copy): a window's baseline."""
        return self._vector.clone()

    def reduce(self, baseline: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Every sum over all ranks (since `baseline`, if given), as float64 CPU tensors by name. A collective."""
        reduced = all_reduce_sum(self.totals() if baseline is None else self._vector - baseline).cpu()
        return {name: reduced[where].view(self.shapes[name]) for name, where in self._offsets.items()}

    def state_dict(self) -> dict[str, list[float]]:
        """All ranks' sums by name (a collective): what a mid-epoch checkpoint keeps, for any world size."""
        return {name: value.flatten().tolist() for name, value in self.reduce().items()}

    def load_state_dict(self, saved: Mapping[str, list[float]]) -> None:
        """Add sums saved by `state_dict` (on one rank only, or they count twice)."""
        if set(saved) != set(self.shapes):
            raise UsageError(f"the checkpoint's metric sums ({', '.join(saved)}) are not this task's "
                             f"({', '.join(self.shapes)}): resume with the task it was saved with")
        for name, values in saved.items():
            saved_sum = torch.tensor(values, dtype=torch.float64).view(self.shapes[name])
            self._views[name] += saved_sum.to(self._vector.device)


class StepContext:
    """One run's training steps: the trainer calls `begin` before each, and clears `first` after the first."""

    def __init__(self, models: Mapping[str, nn.Module], modules: Mapping[str, nn.Module],
                 optimizers: Mapping[str, torch.optim.Optimizer], aux: Mapping[str, nn.Module],
                 scaler: torch.amp.GradScaler, sums: MetricSums, device: torch.device,
                 amp_dtype: torch.dtype | None, rank: int, world_size: int, micro_batch_size: int, seed: int,
                 grad_clip: float | None, before_optimizer_step: Callable[[Update], None]) -> None:
        self.models, self.modules, self.optimizers, self.aux = dict(models), dict(modules), dict(optimizers), dict(aux)
        self.scaler, self.sums, self.device, self.amp_dtype = scaler, sums, device, amp_dtype
        self.rank, self.world_size, self.micro_batch_size, self.seed = rank, world_size, micro_batch_size, seed
        self.grad_clip, self._before_optimizer_step = grad_clip, before_optimizer_step
        self._gradient_syncs = {name: _gradient_sync(model) for name, model in self.models.items()}
        self.batches: list[Any] = []
        self.number = 0  # the step being taken (1 = the run's first)
        self.first = True  # the first step this process takes (a task checks the model's output once)
        self.loss: torch.Tensor | None = None  # every loss back-propagated, summed (the NaN watch's)
        self.inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # the model inputs callbacks may look at
        self.updated: list[str] = []  # the optimizers stepped in this step
        self.stepped: set[str] = set()  # and in any step of this process
        self.counted = False  # whether a step added the sum "count", which every metric divides by

    def begin(self, batches: list[Any], number: int) -> None:
        self.batches, self.number, self.loss, self.inputs, self.updated = batches, number, None, None, []
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)  # a gradient no update took (a GAN's G step reaches D) is dropped

    def divisor(self, counts: Sequence[int | torch.Tensor]) -> StepDivisor:
        """The step's global count of units, from this rank's count of each micro-batch (`Task.count`)."""
        return StepDivisor(counts, self.world_size)

    def accumulate(self, items: Sequence[T], models: Iterable[str] | None = None) -> Iterator[tuple[MicroStep, T]]:
        """`(micro, item)` for each micro-batch's item, the gradient sync of `models` (default: all; one left out syncs
        at every micro-step, as correct and costlier) held back until the last: DDP's `no_sync`, FSDP's."""
        names = list(self.models) if models is None else self._known(models)
        for index, item in enumerate(items):
            last = index == len(items) - 1
            micro = MicroStep(self.seed, self.number, self.positions(index), index, last)
            with contextlib.ExitStack() as held:
                if not last:
                    for name in names:
                        held.enter_context(self._gradient_syncs[name]())
                yield micro, item

    def positions(self, micro: int) -> torch.Tensor:
        """The places in the global batch of micro-batch `micro`'s samples on this rank (GlobalBatchSampler's)."""
        start = (micro * self.world_size + self.rank) * self.micro_batch_size
        return torch.arange(start, start + self.micro_batch_size, device=self.device)

    def autocast(self) -> ContextManager[Any]:
        return autocast(self.device, self.amp_dtype)

    def backward(self, loss_sum: torch.Tensor, divisor: StepDivisor) -> None:
        """Back-propagate `loss_sum` (summed over this micro-batch's units) as its share of the step's global mean."""
        self.scaler.scale(divisor(loss_sum)).backward()
        self.loss = loss_sum.detach() if self.loss is None else self.loss + loss_sum.detach()

    def optimizer_step(self, name: str = "model") -> None:
        """Update model `name` from its gradients, then zero them."""
        optimizer = self.optimizers[self._known([name])[0]]
        if self.first:
            self._check_gradients(name)
        if self.scaler.is_enabled():
            self.scaler.unscale_(optimizer)
        self._before_optimizer_step(Update(self.number, name, self.modules[name], optimizer))
        if self.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.modules[name].parameters(), self.grad_clip)
        self.scaler.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        fsdp.reshard(self.modules[name])  # parameters gathered by a forward without gradients are stale now
        self.updated.append(name)
        self.stepped.add(name)

    def _check_gradients(self, name: str) -> None:
        """Under DDP, parameters no backward reached are one line naming them: DDP all-reduces none of their bucket
        (the other ranks' gradients of its used parameters never arrive either) and fails at the next step."""
        model = getattr(self.models[name], "_orig_mod", self.models[name])
        if not isinstance(model, DistributedDataParallel) or model.find_unused_parameters:
            return
        if missing := [key for key, p in self.modules[name].named_parameters() if p.requires_grad and p.grad is None]:
            raise UsageError(f"the parameters {first_few(missing)} of model {name!r} got no gradient in the first "
                             "training step, so DDP cannot all-reduce them (a layer the forward skips, a loss that "
                             "ignores an output): set dist.find_unused_parameters=true, or freeze them "
                             "(trainer.freeze)")

    def _known(self, names: Iterable[str]) -> list[str]:
        """`names`, each a model this run trains, or one error line."""
        names = list(names)
        if unknown := [name for name in names if name not in self.optimizers]:
            raise UsageError(f"the step names model {unknown[0]!r}, which this run does not train; its models: "
                             f"{', '.join(self.optimizers)}")
        return names

    def add_sums(self, sums: Mapping[str, torch.Tensor | int]) -> None:
        self.sums.add(sums)
        self.counted = self.counted or "count" in sums

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's same-shaped `tensor` along dim 0 in global-batch order; each row's gradient goes to its rank."""
        return _AllGather.apply(tensor) if is_initialized() and self.world_size > 1 else tensor


def _gradient_sync(model: nn.Module) -> Callable[[], ContextManager[Any]]:
    """The context that holds back `model`'s gradient sync: DDP's no_sync, FSDP's, or nothing (one process)."""
    inner = getattr(model, "_orig_mod", model)  # under torch.compile's wrapper
    if isinstance(inner, DistributedDataParallel):
        return inner.no_sync
    return (lambda: fsdp.no_gradient_sync(inner)) if fsdp.is_sharded(inner) else contextlib.nullcontext


class _AllGather(torch.autograd.Function):
    """all_gather whose backward sums each rank's gradient of the gathered rows and hands each rank its own."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:  # noqa: ANN401
        gathered = torch.empty((dist.get_world_size() * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype,
                               device=tensor.device)
        dist.all_gather_into_tensor(gathered, tensor.contiguous())
        return gathered

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN401
        summed = grad.contiguous().clone()
        dist.all_reduce(summed)
        return summed.chunk(dist.get_world_size())[dist.get_rank()]
