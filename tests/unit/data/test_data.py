"""Samplers and loaders: which samples each rank sees, for any world size."""

import dataclasses
import multiprocessing

import pytest
import torch
from dataset_files import write_noise_folder
from omegaconf import OmegaConf
from torch.utils.data import TensorDataset

from src.common.errors import UsageError
from src.config.schema import TrainerConfig
from src.data.loaders import (
    EvalShardSampler,
    GlobalBatchSampler,
    TensorBatchLoader,
    build_data,
    first_samples,
    per_rank_micro_batch_size,
)


def step_batches(num_samples, global_batch, world_size, grad_accum, epoch=0, seed=0):
    """The set of samples each optimizer step covers, gathered over all ranks and micro-steps."""
    samplers = [
        GlobalBatchSampler(num_samples, global_batch, rank, world_size, grad_accum, seed=seed)
        for rank in range(world_size)
    ]
    per_rank = []
    for sampler in samplers:
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    steps = []
    for step in range(samplers[0].steps_per_epoch):
        indices = []
        for batches in per_rank:
            for micro in range(grad_accum):
                indices += batches[step * grad_accum + micro]
        steps.append(sorted(indices))
    return steps, per_rank


@pytest.mark.parametrize("world_size,grad_accum", [(2, 1), (4, 1), (1, 4), (2, 2)])
def test_every_step_covers_the_same_samples_whatever_the_world_size(world_size, grad_accum):
    reference, _ = step_batches(1437, 64, 1, 1, epoch=3)
    steps, per_rank = step_batches(1437, 64, world_size, grad_accum, epoch=3)
    assert steps == reference
    assert len(reference) == 1437 // 64
    micro = 64 // (world_size * grad_accum)
    assert all(len(batch) == micro for batches in per_rank for batch in batches)


def test_an_epoch_sees_distinct_samples_and_drops_only_the_ragged_tail():
    steps, _ = step_batches(1437, 64, 2, 1, epoch=0)
    seen = [i for step in steps for i in step]
    assert len(seen) == len(set(seen)) == 22 * 64


def test_epochs_and_seeds_change_the_order():
    first, _ = step_batches(500, 50, 2, 1, epoch=0)
    second, _ = step_batches(500, 50, 2, 1, epoch=1)
    other_seed, _ = step_batches(500, 50, 2, 1, epoch=0, seed=1)
    again, _ = step_batches(500, 50, 2, 1, epoch=0)
    assert first != second and first != other_seed and first == again


def test_unshuffled_sampler_walks_the_dataset_in_order():
    sampler = GlobalBatchSampler(10, 4, rank=1, world_size=2, shuffle=False)
    assert list(sampler) == [[2, 3], [6, 7]]


@pytest.mark.parametrize(
    "batch,world,accum,message",
    [(0, 1, 1, "dataset.batch_size must be positive, got 0"), (-8, 1, 1, "dataset.batch_size must be positive, got -8"),
     (63, 2, 1, "divisible"), (64, 3, 1, "divisible"), (64, 2, 3, "divisible"), (64, 1, 0, "grad_accum")],
)
def test_batch_size_errors_name_the_key(batch, world, accum, message):
    with pytest.raises(UsageError, match=message):
        per_rank_micro_batch_size(batch, world, accum)


def test_batch_larger_than_the_dataset_is_refused():
    with pytest.raises(UsageError, match="larger than the 100 training samples"):
        GlobalBatchSampler(100, 128, 0, 1)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_eval_shards_cover_every_sample_exactly_once(world_size):
    shards = [list(EvalShardSampler(359, 32, rank, world_size)) for rank in range(world_size)]
    seen = [i for shard in shards for batch in shard for i in batch]
    assert sorted(seen) == list(range(359))
    sizes = [sum(len(b) for b in shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1
    lengths = [len(EvalShardSampler(359, 32, rank, world_size)) for rank in range(world_size)]
    assert [len(shard) for shard in shards] == lengths


def test_tensor_loader_gathers_the_sampled_rows():
    images = torch.arange(20, dtype=torch.float32).view(10, 1, 1, 2)
    labels = torch.arange(10)
    loader = TensorBatchLoader(TensorDataset(images, labels), [[3, 1], [7]], torch.device("cpu"))
    batches = list(loader)
    assert len(loader) == 2
    assert batches[0][1].tolist() == [3, 1]
    assert torch.equal(batches[0][0], images[[3, 1]])
    assert batches[1][1].tolist() == [7]


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (2, 4)])
def test_a_resumed_epoch_sees_the_rest_exactly_once_on_a_new_world_size(before, after):
    """Stopped after 7 steps on `before` ranks, resumed on `after`: every sample of the epoch
    (but the dropped tail) is trained on exactly once, in the same global batches."""
    def epoch_steps(world_size, start_step):
        samplers = [GlobalBatchSampler(1437, 64, rank, world_size, seed=3) for rank in range(world_size)]
        for sampler in samplers:
            sampler.set_epoch(5, start_step=start_step)
        per_rank = [list(sampler) for sampler in samplers]
        assert all(len(batches) == len(samplers[0]) for batches in per_rank)
        return [sorted(i for batches in per_rank for i in batches[step]) for step in range(len(per_rank[0]))]

    full = epoch_steps(1, 0)
    first_part = epoch_steps(before, 0)[:7]
    rest = epoch_steps(after, 7)
    assert first_part + rest == full
    seen = [i for step in first_part + rest for i in step]
    assert len(seen) == len(set(seen)) == 22 * 64


def test_limit_train_batches_cuts_each_epoch_but_keeps_the_permutation():
    full = GlobalBatchSampler(100, 10, rank=0, world_size=1, seed=1)
    cut = GlobalBatchSampler(100, 10, rank=0, world_size=1, seed=1, max_steps_per_epoch=3)
    assert (full.steps_per_epoch, cut.steps_per_epoch, len(cut)) == (10, 3, 3)
    assert list(cut) == list(full)[:3]
    # A limit above the epoch's length changes nothing.
    assert GlobalBatchSampler(100, 10, 0, 1, max_steps_per_epoch=50).steps_per_epoch == 10


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_limit_val_batches_keeps_each_shards_first_batches(world_size):
    shards = [EvalShardSampler(359, 32, rank, world_size, max_batches=2) for rank in range(world_size)]
    full = [list(EvalShardSampler(359, 32, rank, world_size)) for rank in range(world_size)]
    for shard, whole in zip(shards, full):
        assert list(shard) == whole[:2] and len(shard) == min(2, len(whole))
        assert shard.num_samples == sum(len(batch) for batch in whole[:2])


def test_first_samples_keeps_tensor_datasets_on_the_fast_path():
    dataset = TensorDataset(torch.arange(10.0).view(10, 1), torch.arange(10))
    head = first_samples(dataset, 4)
    assert isinstance(head, TensorDataset) and head.tensors[1].tolist() == [0, 1, 2, 3]
    assert len(first_samples(dataset, 99)) == 10
    listed = first_samples([(i, i) for i in range(10)], 3)
    assert [listed[i] for i in range(len(listed))] == [(0, 0), (1, 1), (2, 2)]


def test_overfit_batches_trains_and_validates_on_the_same_fixed_samples():
    cfg = OmegaConf.create({"_target_": "src.components.datasets.digits", "batch_size": 64, "num_workers": 0})
    data = build_data(cfg, 0, 1, torch.device("cpu"), seed=0, trainer=TrainerConfig(overfit_batches=2))
    assert data.train_sampler.steps_per_epoch == 2 and data.num_val_samples == 128
    train_images = torch.cat([images for images, _ in data.train_loader])
    val_images = torch.cat([images for images, _ in data.val_loader])
    # The same 128 samples, trained in shuffled order and validated in order.
    assert train_images.shape == val_images.shape == (128, 1, 8, 8)
    assert torch.equal(val_images, data.splits.train.tensors[0])
    assert sorted(map(tuple, train_images.flatten(1).tolist())) == sorted(map(tuple, val_images.flatten(1).tolist()))


def test_limits_count_the_val_samples_of_every_rank():
    cfg = OmegaConf.create({"_target_": "src.components.datasets.digits", "batch_size": 64, "num_workers": 0})
    limits = TrainerConfig(limit_train_batches=3, limit_val_batches=2)
    data = build_data(cfg, 1, 2, torch.device("cpu"), seed=0, trainer=limits)
    assert data.train_sampler.steps_per_epoch == 3
    assert data.num_val_samples == 2 * (2 * 32)  # 2 ranks x 2 batches x 32 samples
    assert sum(len(targets) for _, targets in data.val_loader) == 64  # this rank's share


def test_first_samples_keeps_image_tensor_datasets_normalised():
    from src.data.image_tensors import ImageTensorDataset

    images = torch.arange(6 * 4, dtype=torch.uint8).view(6, 1, 2, 2)
    dataset = ImageTensorDataset(images, torch.arange(6), mean=[0.5], std=[0.25], crop_padding=1, flip=True)
    head = first_samples(dataset, 3)
    assert isinstance(head, ImageTensorDataset) and len(head) == 3 and head.augments
    assert torch.equal(head[2][0], dataset[2][0]) and head[2][0].dtype == torch.float32


def test_a_dataset_yaml_without_loader_keys_loads_in_the_main_process(tmp_path):
    """A fork's dataset YAML may name only its builder and batch_size (Hydra's configs are structs: a key read that
    is not there raises): no val_batch_size is the train batch, no num_workers is 0."""
    from dataset_files import write_image_folder

    write_image_folder(tmp_path, {"red": (255, 0, 0), "blue": (0, 0, 255)})
    cfg = OmegaConf.create({"_target_": "src.components.datasets.image_folder", "root": str(tmp_path),
                            "image_size": [8, 8], "batch_size": 2})
    OmegaConf.set_struct(cfg, True)
    data = build_data(cfg, 0, 1, torch.device("cpu"), seed=0)
    assert data.train_loader.num_workers == data.val_loader.num_workers == 0
    assert [len(labels) for _, labels in data.train_loader] == [2, 2] and data.num_val_samples == 4


def test_a_dataset_yaml_without_batch_size_is_one_line():
    cfg = OmegaConf.create({"_target_": "src.components.datasets.digits"})
    OmegaConf.set_struct(cfg, True)
    with pytest.raises(UsageError) as error:
        build_data(cfg, 0, 1, torch.device("cpu"), seed=0)
    assert str(error.value) == ("dataset.batch_size is required: add batch_size: N (the global batch) to the "
                                "dataset's YAML")


def test_close_ends_the_loaders_workers_and_a_later_pass_starts_new_ones(tmp_path):
    """The trainer closes its data as fit() ends. A sweep's jobs run in one process, and persistent workers left to
    the garbage collector each waited out a 5 s timeout in whichever later job freed them: a sweep of 3 two-second
    jobs with 2 workers per loader took 26.7 s, 6.1 s with close() (2026-11-29)."""
    write_noise_folder(tmp_path, {})
    cfg = OmegaConf.create({"_target_": "src.components.datasets.image_folder", "root": str(tmp_path),
                            "image_size": [8, 8], "augment": False, "batch_size": 4, "num_workers": 2})
    data = build_data(cfg, rank=0, world_size=1, device=torch.device("cpu"), seed=0)
    val = [labels.tolist() for _, labels in data.val_loader]
    assert sum(len(labels) for _, labels in data.train_loader) == 8 and sum(map(len, val)) == 8
    assert len(multiprocessing.active_children()) == 4  # persistent workers: 2 per loader, kept for the next epoch
    data.close()
    assert multiprocessing.active_children() == []
    assert [labels.tolist() for _, labels in data.val_loader] == val  # new workers, the same batches
    data.close()
    assert multiprocessing.active_children() == []

    class ForksLoader(list):  # a fork's loader with an attribute of that name, and no workers: left as it is
        _iterator = "its own"

    forks = ForksLoader()
    dataclasses.replace(data, val_loader=forks).close()
    assert forks._iterator == "its own"
