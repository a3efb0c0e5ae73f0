"""What a task's training step is given: the step's micro-batches and the primitives that keep the guarantees.

A task's `train_step(step)` (src/loop/task.py) is one training step: the built-in supervised one, or a fork's
own (a GAN's two updates, a distillation, a contrastive loss over the global batch). It writes the method's
logic; the primitives here keep what every step must keep, whatever the world size, `grad_accum` and strategy:

    step.batches                 this rank's micro-batches of the step (trainer.grad_accum of them), on the device
    step.models / step.modules   the trained models by name: as the step calls them (DDP / FSDP / compiled
                                 wrappers), and unwrapped; step.aux: the frozen auxiliary models
    step.divisor(counts)         the step's global count of units (samples, tokens, ...) over every rank and
                                 micro-batch, from each micro-batch's count on this rank (src/loop/counting.py)
    step.accumulate(items)       the micro-steps: (micro, item) for each micro-batch, DDP's / FSDP's gradient
                                 sync held back until the last one
    step.autocast()              trainer.precision's mixed precision for the forward
    step.backward(loss, divisor) back-propagate a loss SUMMED over this micro-batch's units, divided by the
                                 step's global count, scaled for fp16: the gradient of the mean over every unit
                                 of the global batch, exact on any world size
    step.optimizer_step(name)    one model's update: unscale, callbacks' on_before_optimizer_step, clip
                                 (trainer.grad_clip), step, zero the gradients
    step.add_sums(sums)          metric sums (device tensors, by the names the task's sum_shapes gives)
    step.all_gather(tensor)      every rank's `tensor` (same shape), concatenated in global-batch order, with
                                 gradients flowing back to each rank's own rows: losses over the global batch
    micro.randn(stream, *shape)  random draws per sample of the micro-batch, from (seed, step, the sample's place
                                 in the global batch, stream): the same on any world size and after a resume

The trainer counts the step, steps every schedule once, updates the fp16 scaler and tells the callbacks; a
task's step never touches the counters a resume relies on. Dropout draws per rank and step (seeded before the
step), as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ContextManager, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from src.data.sample_randomness import normal_per_sample, uniform_per_sample
from src.loop.callback import Update
from src.loop.counting import StepDivisor
from src.loop.metrics import MetricSums
from src.loop.precision import autocast
from src.parallel import fsdp
from src.parallel.distributed import is_initialized

T = TypeVar("T")


class Samples:
    """The samples of one batch by their place (`positions`: in the global batch of a training step, in the split
    of an evaluation): what their random draws are keyed by. `step` keys the draws too (a training step's
    number, or an evaluation's fixed stream)."""

    def __init__(self, seed: int, step: int, positions: torch.Tensor) -> None:
        self.seed = seed
        self.step = step
        self.positions = positions

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
        self.index = index
        self.last = last


class StepContext:
    """One run's training steps: the trainer calls `begin` before each and `end` after it (see the module's
    docstring for what a task's step uses)."""

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

    def begin(self, batches: list[Any], number: int) -> None:
        self.batches, self.number, self.loss, self.inputs, self.updated = batches, number, None, None, []
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)  # a gradient no update took (a GAN's G step reaches D) is dropped

    def end(self) -> None:
        self.first = False

    # -- the primitives ----------------------------------------------------------------------------------------

    def divisor(self, counts: Sequence[int | torch.Tensor]) -> StepDivisor:
        """The step's global count of units, from this rank's count of each micro-batch (`Task.count`): host ints
        (samples) need no communication, device tensors (tokens, pixels) one all-reduce, started now."""
        return StepDivisor(counts, self.world_size)

    def accumulate(self, items: Sequence[T], models: Iterable[str] | None = None) -> Iterator[tuple[MicroStep, T]]:
        """`(micro, item)` for each of the step's micro-batches (`items`: one per micro-batch, e.g. the batches),
        the gradient sync of `models` (default: every trained model) held back until the last: DDP's `no_sync`,
        FSDP's reduce-scatter. Name the models that get a backward in every micro-step; one left out is
        synchronised at each, as correct, and costlier."""
        names = list(self.models) if models is None else list(models)
        for index, item in enumerate(items):
            last = index == len(items) - 1
            micro = MicroStep(self.seed, self.number, self.positions(index), index, last)
            with contextlib.ExitStack() as held:
                if not last:
                    for name in names:
                        held.enter_context(self._gradient_syncs[name]())
                yield micro, item

    def positions(self, micro: int) -> torch.Tensor:
        """The places in the global batch of micro-batch `micro`'s samples on this rank (the sampler's layout:
        src/data/loaders.py GlobalBatchSampler)."""
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
        optimizer = self.optimizers[name]
        if self.scaler.is_enabled():
            self.scaler.unscale_(optimizer)
        self._before_optimizer_step(Update(self.number, name, self.modules[name], optimizer))
        if self.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.modules[name].parameters(), self.grad_clip)
        self.scaler.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        fsdp.reshard(self.modules[name])  # parameters gathered by a forward without gradients are stale now
        self.updated.append(name)

    def add_sums(self, sums: Mapping[str, torch.Tensor | int]) -> None:
        self.sums.add(sums)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (each of the same shape, e.g. this micro-batch's embeddings) concatenated along
        dim 0 in rank order, which for one micro-step is global-batch order. Differentiable: the gradient of each
        row goes back to the rank it came from, summed over the ranks that used it."""
        return _AllGather.apply(tensor) if is_initialized() and self.world_size > 1 else tensor


def _gradient_sync(model: nn.Module) -> Callable[[], ContextManager[Any]]:
    """The context that holds back `model`'s gradient sync: DDP's no_sync, FSDP's, or nothing (one process)."""
    inner = getattr(model, "_orig_mod", model)  # under torch.compile's wrapper
    if isinstance(inner, DistributedDataParallel):
        return inner.no_sync
    if fsdp.is_sharded(inner):
        return lambda: fsdp.no_gradient_sync(inner)
    return contextlib.nullcontext


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
