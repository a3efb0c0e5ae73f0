"""From a dataset to batches: which samples each rank takes at each step, and the loaders that fetch them.
A training step's global batch is the same samples whatever the world size and gradient accumulation; evaluation
sees every sample exactly once. So the numbers do not depend on the world size, and a run resumes on any."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from src.common.errors import UsageError
from src.config.building import errors_named
from src.config.schema import TrainerConfig
from src.data.image_tensors import ImageTensorDataset
from src.data.sample_randomness import VAL_EPOCH, EpochKeys, SeededSamples, sample_key
from src.data.splits import DataSplits
from src.parallel.distributed import main_process_first

LOADER_KEYS = ("batch_size", "val_batch_size", "num_workers")  # a `dataset` config's keys that its builder does not get


class GlobalBatchSampler:
    """This rank's micro-batches for one epoch: step s covers samples perm[s*G : (s+1)*G] of a permutation drawn
    from (seed, epoch); with W ranks and k accumulation micro-steps, rank r's micro-batch m is the b = G/(W*k)
    samples from s*G + (m*W + r)*b. The ragged tail is dropped, so every rank takes every step."""

    def __init__(self, num_samples: int, global_batch_size: int, rank: int, world_size: int, grad_accum: int = 1,
                 shuffle: bool = True, seed: int = 0, max_steps_per_epoch: int | None = None) -> None:
        self.micro_batch_size = per_rank_micro_batch_size(global_batch_size, world_size, grad_accum)
        if num_samples < global_batch_size:
            raise UsageError(f"dataset.batch_size={global_batch_size} is larger than the {num_samples} training "
                             "samples; lower dataset.batch_size")
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.rank, self.world_size, self.grad_accum = rank, world_size, grad_accum
        self.steps_per_epoch = num_samples // global_batch_size
        if max_steps_per_epoch is not None:
            self.steps_per_epoch = min(self.steps_per_epoch, max_steps_per_epoch)
        self.shuffle, self.seed, self.epoch, self.start_step = shuffle, seed, 0, 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Pick the epoch's permutation, and the step to start from (a resumed epoch skips the steps it trained)."""
        self.epoch, self.start_step = epoch, start_step

    def permutation(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator) if self.shuffle else torch.arange(self.num_samples)

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.grad_accum

    def __iter__(self) -> Iterator[list[int]]:
        order = self.permutation().tolist()
        b = self.micro_batch_size
        for step in range(self.start_step, self.steps_per_epoch):
            for micro in range(self.grad_accum):
                start = step * self.global_batch_size + (micro * self.world_size + self.rank) * b
                yield order[start : start + b]


class EvalShardSampler:
    """This rank's evaluation batches: a contiguous shard, never padded (unlike DistributedSampler), so metrics
    summed over ranks count each sample once."""

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int,
                 max_batches: int | None = None) -> None:
        self.batch_size = batch_size
        self.start, self.stop = num_samples * rank // world_size, num_samples * (rank + 1) // world_size
        if max_batches is not None:
            self.stop = min(self.stop, self.start + max_batches * batch_size)
        self.num_samples = self.stop - self.start

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        for start in range(self.start, self.stop, self.batch_size):
            yield list(range(start, min(start + self.batch_size, self.stop)))


def per_rank_micro_batch_size(global_batch_size: int, world_size: int, grad_accum: int) -> int:
    """Samples one rank feeds through the model per forward pass."""
    if global_batch_size <= 0:
        raise UsageError(f"dataset.batch_size must be positive, got {global_batch_size}")
    if grad_accum <= 0:
        raise UsageError(f"trainer.grad_accum must be positive, got {grad_accum}")
    shards = world_size * grad_accum
    if global_batch_size % shards:
        raise UsageError(f"dataset.batch_size={global_batch_size} is the global batch and must be divisible by "
                         f"world_size x trainer.grad_accum = {world_size} x {grad_accum} = {shards}")
    return global_batch_size // shards


class TensorBatchLoader:
    """Batches of an in-memory TensorDataset, copied to the device once and gathered there by index (uint8 images
    normalised there, and augmented with `augment`)."""

    def __init__(self, dataset: TensorDataset, batch_sampler: Iterable[list[int]], device: torch.device,
                 seed: int = 0, augment: bool = False) -> None:
        self.images = dataset.to(device) if isinstance(dataset, ImageTensorDataset) else None  # and its constants
        self.tensors = [t.to(device) for t in (dataset if self.images is None else self.images).tensors]
        self.batch_sampler, self.device, self.seed = batch_sampler, device, seed
        self.augments = augment and self.images is not None and self.images.augments

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        epoch = getattr(self.batch_sampler, "epoch", VAL_EPOCH)
        for indices in self.batch_sampler:
            index = torch.tensor(indices, device=self.device)
            first, *rest = (t.index_select(0, index) for t in self.tensors)
            if self.images is not None:
                first = self.images.normalize(first)
                if self.augments:
                    first = self.images.augment(first, sample_key(self.seed, epoch, index))
                first = self.images.resize(first)
            yield (first, *rest)


def make_loader(dataset: Dataset, batch_sampler: Iterable[list[int]], device: torch.device, num_workers: int,
                seed: int, augment: bool = False) -> Iterable[Any]:
    """A loader over `batch_sampler`: TensorDatasets on the device, others through a DataLoader of `SeededSamples`."""
    if isinstance(dataset, TensorDataset):
        return TensorBatchLoader(dataset, batch_sampler, device, seed, augment)
    generator = torch.Generator().manual_seed(seed)  # the workers' base seed, not drawn from torch's global one
    return DataLoader(SeededSamples(dataset, seed), batch_sampler=EpochKeys(batch_sampler), num_workers=num_workers,
                      pin_memory=device.type == "cuda", persistent_workers=num_workers > 0, generator=generator)


@dataclass
class Data:
    splits: DataSplits
    train_sampler: GlobalBatchSampler
    train_loader: Iterable[Any]
    val_loader: Iterable[Any]
    num_val_samples: int
    val_start: int = 0  # the index in the val split of this rank's first val sample
    eval_loader: Callable[[Dataset], tuple[Iterable[Any], int]] | None = None
    _eval_loaders: dict[str, tuple[Iterable[Any], int]] = field(default_factory=dict, repr=False)

    def loader(self, split: str) -> tuple[Iterable[Any], int]:
        """This rank's evaluation loader of `split` (val, test, train) and the index of its first sample in it."""
        if split == "val":
            return self.val_loader, self.val_start
        if split not in self._eval_loaders:
            if self.eval_loader is None or getattr(self.splits, split) is None:
                raise ValueError(f"this run's data has no evaluation loader of a {split} split")
            self._eval_loaders[split] = self.eval_loader(getattr(self.splits, split))
        return self._eval_loaders[split]

    def close(self) -> None:
        """End the loaders' workers now: freed later by the garbage collector, each would first wait 5 s (#39570)."""
        for loader in (self.train_loader, self.val_loader, *(loader for loader, _ in self._eval_loaders.values())):
            if hasattr(iterator := getattr(loader, "_iterator", None), "_shutdown_workers"):  # persistent_workers
                iterator._shutdown_workers()  # what the iterator does when freed by its last reference
                loader._iterator = None  # a later pass (a callback's evaluation at the run's end) starts new workers


def build_data(dataset_cfg: DictConfig, rank: int, world_size: int, device: torch.device, seed: int,
               trainer: TrainerConfig | None = None) -> Data:
    """The dataset `dataset_cfg` names and this rank's loaders, cut as `trainer`'s limits say."""
    trainer = trainer or TrainerConfig()
    if dataset_cfg.get("batch_size") is None:  # a fork's YAML without it
        raise UsageError("dataset.batch_size is required: add batch_size: N (the global batch) to the dataset's YAML")
    global_batch_size = int(dataset_cfg.batch_size)
    per_rank_micro_batch_size(global_batch_size, world_size, trainer.grad_accum)  # refuse before a download
    splits = build_splits(dataset_cfg)
    if trainer.overfit_batches:
        # The same fixed samples train and validate: a model that can learn at all drives both losses to zero.
        fixed = first_samples(splits.train, trainer.overfit_batches * global_batch_size)
        splits = replace(splits, train=fixed, val=fixed)
    train_sampler = GlobalBatchSampler(len(splits.train), global_batch_size, rank, world_size, trainer.grad_accum,
                                       seed=seed, max_steps_per_epoch=trainer.limit_train_batches)
    num_workers = int(dataset_cfg.get("num_workers") or 0)  # a fork's YAML may leave it out
    global_val_batch = int(dataset_cfg.get("val_batch_size") or global_batch_size)
    eval_loader = functools.partial(make_eval_loader, global_batch_size=global_val_batch, rank=rank,
                                    world_size=world_size, device=device, num_workers=num_workers, seed=seed,
                                    max_batches=trainer.limit_val_batches)
    val_loader, val_start = eval_loader(splits.val)
    train_loader = make_loader(splits.train, train_sampler, device, num_workers, seed, augment=True)
    val_count = num_val_samples(len(splits.val), global_val_batch, world_size, trainer.limit_val_batches)
    return Data(splits, train_sampler, train_loader, val_loader, val_count, val_start, eval_loader)


def make_eval_loader(dataset: Dataset, global_batch_size: int, rank: int, world_size: int, device: torch.device,
                     num_workers: int, seed: int, max_batches: int | None = None) -> tuple[Iterable[Any], int]:
    """This rank's evaluation loader of `dataset` and the index of its first sample."""
    sampler = EvalShardSampler(len(dataset), val_batch_size(global_batch_size, world_size), rank, world_size,
                               max_batches)
    return make_loader(dataset, sampler, device, num_workers, seed), sampler.start


def num_val_samples(num_samples: int, global_batch_size: int, world_size: int, max_batches: int | None) -> int:
    """What the val metrics cover: all of the val split unless `max_batches` per rank cuts it."""
    batch_size = val_batch_size(global_batch_size, world_size)
    return sum(EvalShardSampler(num_samples, batch_size, r, world_size, max_batches).num_samples
               for r in range(world_size))


def first_samples(dataset: Dataset, count: int) -> Dataset:
    """The first `count` samples of `dataset`; a TensorDataset (its subclass too) stays one, for the device path."""
    count = min(count, len(dataset))  # type: ignore[arg-type]
    if isinstance(dataset, TensorDataset):
        head = copy.copy(dataset)
        head.tensors = tuple(tensor[:count] for tensor in dataset.tensors)
        return head
    return Subset(dataset, range(count))


def build_splits(dataset_cfg: DictConfig) -> DataSplits:
    """The splits of the dataset `dataset_cfg` names (its LOADER_KEYS are the loaders'), built by rank 0 first."""
    params = {key: value for key, value in OmegaConf.to_container(dataset_cfg, resolve=True).items()
              if key not in LOADER_KEYS}
    with errors_named("dataset", dataset_cfg, passed_elsewhere=LOADER_KEYS), main_process_first():
        return instantiate(params)


def val_batch_size(global_batch_size: int, world_size: int) -> int:
    """Samples per val batch on each rank: the training batch's share, at least one."""
    return max(1, global_batch_size // world_size)
