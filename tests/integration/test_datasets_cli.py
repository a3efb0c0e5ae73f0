"""The dataset code paths through the real CLI: MNIST and CIFAR-10 files in their on-disk formats
train the same model on the device (in-memory) path and the DataLoader path, and device augmentation
replays exactly after a resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import check, metrics, train, weights
from dataset_files import write_cifar10, write_mnist

# ---- both paths through train.py -----------------------------------------------------------------

TINY_FILES_RUN = ["dataset.root=data", "dataset.download=false", "dataset.batch_size=8", "dataset.num_workers=0",
                  "dataset.val_size=8", "trainer.epochs=1", "trainer.log_every_steps=2"]


@pytest.mark.slow
def test_mnist_trains_the_same_model_on_the_device_path_and_the_dataloader_path(tmp_path):
    write_mnist(tmp_path / "data", "MNIST", num_train=48, num_test=20)
    for in_memory in ("true", "false"):
        check(train(["dataset=mnist", *TINY_FILES_RUN, f"dataset.in_memory={in_memory}",
                     f"hydra.run.dir=run_{in_memory}"], tmp_path))
    fast, slow = metrics(tmp_path / "run_true"), metrics(tmp_path / "run_false")
    assert fast["step"] == slow["step"] == (48 - 8) // 8 and fast["val/num_samples"] == slow["val/num_samples"] == 8
    assert fast["test/num_samples"] == slow["test/num_samples"] == 20
    for key in ("train/loss", "train/acc", "val/loss", "val/acc", "test/loss", "test/acc"):
        assert fast[key] == pytest.approx(slow[key], abs=1e-5), key
    for name, tensor in weights(tmp_path / "run_true").items():
        torch.testing.assert_close(tensor, weights(tmp_path / "run_false")[name], rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("in_memory", ["true", "false"])
def test_cifar10_trains_on_both_paths(tmp_path, in_memory):
    write_cifar10(tmp_path / "data", per_batch=8)
    check(train(["dataset=cifar10", "dataset.verify_checksums=false", *TINY_FILES_RUN,
                 f"dataset.in_memory={in_memory}", "hydra.run.dir=run"], tmp_path))
    summary = metrics(tmp_path / "run")
    assert summary["step"] == (40 - 8) // 8 and summary["val/num_samples"] == summary["test/num_samples"] == 8
    assert np.isfinite(summary["val/loss"]) and np.isfinite(summary["train/loss"])


@pytest.mark.slow
def test_cifar10_device_augmentation_replays_exactly_after_a_resume(tmp_path):
    write_cifar10(tmp_path / "data", per_batch=8)
    args = ["dataset=cifar10", "dataset.verify_checksums=false", *TINY_FILES_RUN, "optimizer=sgd"]
    check(train([*args, "hydra.run.dir=straight"], tmp_path))
    check(train([*args, "trainer.max_steps=2", "hydra.run.dir=resumed"], tmp_path))
    check(train([*args, "resume=auto", "hydra.run.dir=resumed"], tmp_path))
    assert metrics(tmp_path / "resumed")["step"] == (40 - 8) // 8
    for name, tensor in weights(tmp_path / "straight").items():
        assert torch.equal(tensor, weights(tmp_path / "resumed")[name]), name
