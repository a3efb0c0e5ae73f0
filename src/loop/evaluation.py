"""Evaluation: the models' loss and metrics over a split, every sample counted exactly once, on any world size.

A task's `evaluate(val)` (src/loop/task.py) adds sums to an `Evaluation`, summed over every rank in one all-reduce;
the task computes its metrics from them. A method evaluates as it needs with these primitives:

    val.batches(split)        this rank's shard of a split (default `val.split`: val, or test at the end; "train":
                              the training samples without augmentation), each sample once: (batch, samples),
                              `samples` keying per-sample draws
    val.models / val.aux      the trained models (unwrapped, in eval mode) and the auxiliary ones, by name
    val.autocast()            trainer.precision's mixed precision
    val.add_sums(sums)        a batch's sums (device tensors, named as the task's sum_shapes and val_sum_shapes)
    val.generated(count, batch) draws for `count` items the models make (a generator's samples), this rank's
                              share of them in batches: the same items on any world size
    val.gather(tensor)        every rank's rows of `tensor` (their counts may differ), in rank order
    val.image(tag, images)    images (N, C, H, W) shown as a grid in TensorBoard (rank 0's)"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ContextManager, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from src.data.batches import to_device
from src.data.sample_randomness import VAL_EPOCH
from src.loop.performance import autocast
from src.loop.step import MetricSums, Samples
from src.parallel import fsdp
from src.parallel.distributed import all_reduce_max, is_initialized

# The `step` of each split's draws, and of generated items'.
SPLIT_DRAWS = {"val": VAL_EPOCH, "train": VAL_EPOCH - 1, "test": VAL_EPOCH - 2, "generated": VAL_EPOCH - 3}


class Evaluation:
    """One evaluation pass; `loaders(split)` gives this rank's loader of a split and the index of its first sample."""

    def __init__(self, models: Mapping[str, nn.Module], aux: Mapping[str, nn.Module],
                 loaders: Callable[[str], tuple[Iterable[Any], int]], sums: MetricSums, device: torch.device,
                 amp_dtype: torch.dtype | None, seed: int, track: Callable[[Iterable[Any], str], Iterable[Any]],
                 split: str = "val") -> None:
        self.models, self.aux, self.loaders, self.sums, self.split = dict(models), dict(aux), loaders, sums, split
        self.device, self.amp_dtype, self.seed, self.track = device, amp_dtype, seed, track
        self.lockstep = any(fsdp.is_sharded(model) for model in self.models.values())
        self.images: dict[str, torch.Tensor] = {}

    def batches(self, split: str | None = None) -> Iterator[tuple[Any, Samples]]:
        """This rank's batches of `split` on the device, with their samples; under dist=fsdp every rank runs as many."""
        split = split or self.split
        loader, position = self.loaders(split)  # and the index in the split of its first sample
        for batch in self.track(_in_lockstep(loader, self.device) if self.lockstep else loader, split):
            batch = to_device(batch, self.device)
            # Its samples: the first dimension of its first tensor.
            rows = next((t.shape[0] for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim()), 0)
            positions = torch.arange(position, position + rows, device=self.device)
            position += rows
            yield batch, Samples(self.seed, SPLIT_DRAWS.get(split, VAL_EPOCH), positions)

    def generated(self, count: int, batch_size: int) -> Iterator[Samples]:
        """Draws for this rank's share of items 0 to `count` - 1, in as many batches (some empty) on every rank."""
        rank, world = (dist.get_rank(), dist.get_world_size()) if is_initialized() else (0, 1)
        start, stop = count * rank // world, count * (rank + 1) // world
        batches = -(-(count // world + 1) // batch_size)  # enough for the largest share, on every rank alike
        for first in range(start, start + batches * batch_size, batch_size):
            positions = torch.arange(min(first, stop), min(first + batch_size, stop), device=self.device)
            yield Samples(self.seed, SPLIT_DRAWS["generated"], positions)

    def autocast(self) -> ContextManager[Any]:
        return autocast(self.device, self.amp_dtype)

    def add_sums(self, sums: Mapping[str, torch.Tensor | int]) -> None:
        self.sums.add(sums)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of `tensor`, concatenated in rank order (no gradient; the row counts may differ)."""
        if not is_initialized():
            return tensor
        counts = torch.tensor([tensor.shape[0]], device=tensor.device)
        every = [torch.empty_like(counts) for _ in range(dist.get_world_size())]
        dist.all_gather(every, counts)
        rows = [int(count) for count in every]
        padded = torch.zeros((max(rows), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        padded[: tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in rows]
        dist.all_gather(gathered, padded)
        return torch.cat([part[:count] for part, count in zip(gathered, rows)])

    def image(self, tag: str, images: torch.Tensor) -> None:
        self.images[tag] = images.detach().float().cpu()


def _in_lockstep(loader: Iterable[Any], device: torch.device) -> Iterator[Any]:
    """`loader`'s batches, then empty ones (its first cut to 0 samples) up to the count of the rank with the most."""
    most = int(all_reduce_max(torch.tensor(len(loader), device=device)))  # type: ignore[arg-type]
    empty = None
    for batch in loader:
        empty = empty if empty is not None else tree_map(lambda part: part[:0], batch)
        yield batch
        most -= 1
    for _ in range(most):
        if empty is None:
            raise RuntimeError("a rank with no val batch cannot join a sharded evaluation: use a larger val split")
        yield empty
