"""Randomness per sample: a sample's draws depend on (seed, epoch, index) alone, on both data paths."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from src.data.loaders import GlobalBatchSampler, make_loader
from src.data.sample_randomness import VAL_EPOCH, draw, host_seed, mix32, sample_key

CPU = torch.device("cpu")


def lowbias32(x: int) -> int:
    """The published lowbias32, with plain 64-bit products: what mix32 must equal."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_hash_is_lowbias32_and_the_same_on_ints_and_tensors():
    words = torch.randint(0, 2**32, (4096,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    assert mix32(words).tolist() == [lowbias32(w) for w in words.tolist()]
    indices = torch.tensor([0, 1, 7, 2**31, 2**40 + 3, 2**62])
    for seed, epoch in ((0, 0), (123, 5), (-7, VAL_EPOCH)):
        keys = sample_key(seed, epoch, indices)
        assert keys.tolist() == [sample_key(seed, epoch, i) for i in indices.tolist()]
        assert draw(keys, 2).tolist() == [draw(sample_key(seed, epoch, i), 2) for i in indices.tolist()]


def test_host_seeds_differ_by_seed_epoch_and_index():
    seeds = {host_seed(seed, epoch, index) for seed in range(3) for epoch in range(-1, 9) for index in range(500)}
    assert len(seeds) == 3 * 10 * 500
    assert all(0 <= s < 2**64 for s in seeds)


class GlobalDraws(Dataset):
    """Each item draws from torch's, NumPy's and Python's global generators, as transforms do."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int):
        values = [torch.rand(()).item(), float(np.random.rand()), random.random()]
        return torch.tensor(values, dtype=torch.float64), index


def draws_by_sample(num_workers: int, world_size: int, batch: int, epoch: int = 0, seed: int = 0,
                    start_step: int = 0) -> dict[int, torch.Tensor]:
    """Every rank's training loader over GlobalDraws for one epoch: {sample index: its draws}."""
    draws = {}
    for rank in range(world_size):
        sampler = GlobalBatchSampler(24, batch, rank, world_size, seed=seed)
        sampler.set_epoch(epoch, start_step=start_step)
        for values, indices in make_loader(GlobalDraws(), sampler, CPU, num_workers, seed, augment=True):
            draws.update(zip(indices.tolist(), values))
    return draws


def test_a_samples_draws_do_not_depend_on_rank_worker_batch_or_resume():
    reference = draws_by_sample(num_workers=0, world_size=1, batch=8)
    assert len(reference) == 24
    for column in range(3):  # torch, NumPy and Python: each draws anew per sample
        assert len({float(values[column]) for values in reference.values()}) == 24
    for num_workers, world_size, batch in ((2, 1, 8), (0, 2, 8), (2, 2, 12), (1, 3, 6)):
        other = draws_by_sample(num_workers, world_size, batch)
        assert other.keys() == reference.keys()
        assert all(torch.equal(other[i], reference[i]) for i in reference), (num_workers, world_size, batch)
    resumed = draws_by_sample(num_workers=2, world_size=2, batch=8, start_step=2)  # the epoch's last step
    assert len(resumed) == 8 and all(torch.equal(values, reference[i]) for i, values in resumed.items())


def test_another_epoch_or_seed_draws_anew():
    reference = draws_by_sample(num_workers=0, world_size=1, batch=8)
    for other in (draws_by_sample(0, 1, 8, epoch=1), draws_by_sample(0, 1, 8, seed=1)):
        assert all(not torch.equal(other[i][0], reference[i][0]) for i in reference)


def test_fetching_in_the_main_process_leaves_its_generators_as_they_were():
    """num_workers=0 fetches in the trainer's process, between its per-step seeding and dropout."""
    sampler = GlobalBatchSampler(24, 8, 0, 1)
    loader = make_loader(GlobalDraws(), sampler, CPU, num_workers=0, seed=0, augment=True)
    states = []
    for fetch in (False, True):
        torch.manual_seed(5)
        np.random.seed(5)
        random.seed(5)
        if fetch:
            assert len(list(loader)) == 3
        states.append((torch.rand(4), np.random.rand(4), random.random()))
    assert torch.equal(states[0][0], states[1][0])
    assert np.array_equal(states[0][1], states[1][1]) and states[0][2] == states[1][2]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_val_samples_draw_the_same_in_every_pass(num_workers):
    from src.data.loaders import EvalShardSampler

    loader = make_loader(GlobalDraws(), EvalShardSampler(24, 10, 0, 1), CPU, num_workers, seed=0)
    first, second = (torch.cat([values for values, _ in loader]) for _ in range(2))
    assert torch.equal(first, second)
    assert torch.equal(first[3], torch.tensor(draws_at(VAL_EPOCH, 3), dtype=torch.float64))


def draws_at(epoch: int, index: int) -> list[float]:
    """What GlobalDraws()[index] draws under sample (0, epoch, index)'s seed: the documented derivation."""
    from src.data.sample_randomness import seed_host_generators

    seed_host_generators(host_seed(0, epoch, index))
    return GlobalDraws()[index][0].tolist()


class SomeDraws(Dataset):
    """Draws from torch's generator for every sample, and from NumPy's or Python's for a few samples only:
    a fork's transform that uses them now and then."""

    def __init__(self, numpy_at: set[int] = frozenset(), python_at: set[int] = frozenset()) -> None:
        self.numpy_at, self.python_at = numpy_at, python_at

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int):
        values = [torch.rand(()).item(), 0.0, 0.0]
        if index in self.numpy_at:
            values[1] = float(np.random.rand())
        if index in self.python_at:
            values[2] = random.random()
        return torch.tensor(values, dtype=torch.float64), index


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_that_draws_from_some_generators_now_and_then_gets_each_samples_documented_draws(num_workers):
    from src.data.sample_randomness import seed_host_generators

    sampler = GlobalBatchSampler(24, 4, 0, 1, seed=0)
    order = [index for batch in sampler for index in batch]
    dataset = SomeDraws(numpy_at={order[9], order[13]}, python_at={order[18], order[22]})

    def documented(index: int) -> torch.Tensor:
        seed_host_generators(host_seed(0, 0, index))
        return dataset[index][0]

    loader = make_loader(dataset, sampler, CPU, num_workers, seed=0, augment=True)
    draws = {i: values for batch, indices in loader for i, values in zip(indices.tolist(), batch)}
    assert len(draws) == 24 and all(torch.equal(draws[i], documented(i)) for i in range(24))
    assert len({float(draws[i][1]) for i in dataset.numpy_at} | {float(draws[i][2]) for i in dataset.python_at}) == 4


# ---- uint8 images on the device (CIFAR-10's in-memory path) ------------------------------------------------


def cifar10_crops_by_sample(root, world_size: int, batch: int, epoch: int = 0, start_step: int = 0,
                            seed: int = 0) -> dict[int, torch.Tensor]:
    """Every rank's augmented training images of one epoch of 40 CIFAR-10 training images (50 in the files, 10 held
    out as val): {sample index: image}."""
    from src.components.datasets import cifar10

    train = cifar10(str(root), download=False, verify_checksums=False, val_size=10).train
    crops = {}
    for rank in range(world_size):
        sampler = GlobalBatchSampler(40, batch, rank, world_size, seed=seed)
        sampler.set_epoch(epoch, start_step=start_step)
        loader = make_loader(train, sampler, CPU, num_workers=0, seed=seed, augment=True)
        for indices, (images, _) in zip(list(sampler), loader):  # the sampler is deterministic: the same lists
            crops.update(zip(indices, images))
    return crops


def test_device_crops_and_flips_follow_the_sample_not_its_batch_rank_or_step(tmp_path):
    from dataset_files import write_cifar10

    write_cifar10(tmp_path, per_batch=10)
    reference = cifar10_crops_by_sample(tmp_path, world_size=1, batch=40)
    assert len(reference) == 40
    for world_size, batch in ((2, 40), (1, 8), (2, 8), (4, 8)):
        other = cifar10_crops_by_sample(tmp_path, world_size, batch)
        assert all(torch.equal(other[i], reference[i]) for i in reference), (world_size, batch)
    resumed = cifar10_crops_by_sample(tmp_path, world_size=2, batch=8, start_step=3)  # steps 3 and 4 of 5
    assert len(resumed) == 16 and all(torch.equal(image, reference[i]) for i, image in resumed.items())
    # Torch's generators play no part: reseeding them changes nothing.
    torch.manual_seed(12345)
    again = cifar10_crops_by_sample(tmp_path, world_size=1, batch=20)
    assert all(torch.equal(again[i], reference[i]) for i in reference)
    next_epoch = cifar10_crops_by_sample(tmp_path, world_size=1, batch=40, epoch=1)
    assert sum(not torch.equal(next_epoch[i], reference[i]) for i in reference) > 30


def test_a_batchs_seeds_hashed_at_once_are_each_samples_own():
    from src.data.sample_randomness import host_seeds

    keys = [(epoch, index) for epoch in (VAL_EPOCH, 0, 3) for index in (0, 1, 63, 2**31 + 5, 2**40 + 7)]
    for seed in (0, 7, -3, 2**62):
        assert host_seeds(seed, keys) == [host_seed(seed, epoch, index) for epoch, index in keys]
