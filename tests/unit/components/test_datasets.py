"""Tests for src/components/datasets.py on small files written in the real on-disk formats (no network)."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dataset_files import write_cifar10, write_image_folder, write_mnist
from hydra.utils import instantiate
from omegaconf import OmegaConf

from src.components import datasets
from src.data.image_tensors import ImageTensorDataset
from src.data.loaders import EvalShardSampler, TensorBatchLoader
from src.data.splits import DatasetNotFoundError, image_info

REPO_ROOT = Path(__file__).resolve().parents[3]


# ---- MNIST / Fashion-MNIST -------------------------------------------------------------------


MNIST_CASES = [
    (datasets.mnist, "MNIST", datasets.MNIST_MEAN_STD),
    (datasets.fashion_mnist, "FashionMNIST", datasets.FASHION_MNIST_MEAN_STD),
]


@pytest.mark.parametrize("builder, folder_name, mean_std", MNIST_CASES)
def test_mnist_format_round_trip(tmp_path, builder, folder_name, mean_std):
    """The official test set is test; val is held out of the official training set, each class in its share."""
    write_mnist(tmp_path, folder_name)
    splits = builder(str(tmp_path), download=False, val_size=10)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (20, 10, 12)
    assert splits.info == image_info(10, 1, 28, 28)
    (mean,), (std,) = mean_std
    image, label = splits.test[7]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32
    assert label == 7 * 3 % 10
    assert image[0, 0, 0].item() == pytest.approx((1.0 - mean) / std, abs=1e-5)
    assert image[0, 5, 5].item() == pytest.approx((35 / 255 - mean) / std, abs=1e-5)
    kept, held = datasets.stratified_holdout(torch.tensor([i * 3 % 10 for i in range(30)]), 10, 0, folder_name)
    assert [splits.train[i][1] for i in range(20)] == [i * 3 % 10 for i in kept.tolist()]
    assert sorted(splits.val[i][1] for i in range(10)) == list(range(10))  # 3 of each class: one each held out
    assert splits.val[4][0][0, 5, 5].item() == pytest.approx((5 * held[4].item() / 255 - mean) / std, abs=1e-5)


@pytest.mark.parametrize("builder, folder_name, mean_std", MNIST_CASES)
def test_mnist_missing_files_names_folder_and_files(tmp_path, builder, folder_name, mean_std):
    write_mnist(tmp_path, folder_name)
    (tmp_path / folder_name / "raw" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DatasetNotFoundError) as error:
        builder(str(tmp_path), download=False)
    message = str(error.value)
    assert str(tmp_path / folder_name / "raw") in message
    assert all(name in message for name in datasets.MNIST_FILES)
    assert "\n" not in message


@pytest.mark.parametrize("builder,torchvision_class,folder", [
    (datasets.mnist, "MNIST", ("MNIST", "raw")),
    (datasets.cifar10, "CIFAR10", ("cifar-10-batches-py",)),
])
def test_download_failure_is_one_clear_error(tmp_path, monkeypatch, builder, torchvision_class, folder):
    import torchvision.datasets

    def no_network(self):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(getattr(torchvision.datasets, torchvision_class), "download", no_network)
    with pytest.raises(DatasetNotFoundError, match="download failed .*Network is unreachable") as error:
        builder(str(tmp_path), download=True)
    assert str(tmp_path.joinpath(*folder)) in str(error.value)


# ---- CIFAR-10 --------------------------------------------------------------------------------


def cifar10_normalised(row: np.ndarray) -> torch.Tensor:
    mean, std = (torch.tensor(values).view(3, 1, 1) for values in datasets.CIFAR10_MEAN_STD)
    return (torch.from_numpy(row.reshape(3, 32, 32)).float() / 255 - mean) / std


def official_train(batches: dict) -> tuple[np.ndarray, list[int]]:
    """CIFAR-10's five training batches as one: pixels and labels, in order."""
    return (np.concatenate([batches[f"data_batch_{i}"][0] for i in range(1, 6)]),
            [label for i in range(1, 6) for label in batches[f"data_batch_{i}"][1]])


def test_cifar10_format_round_trip(tmp_path):
    """test_batch is test; val is held out of the training batches, each class in its share."""
    batches = write_cifar10(tmp_path)
    splits = datasets.cifar10(str(tmp_path), download=False, augment=False, verify_checksums=False, val_size=2)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (8, 2, 2)
    assert splits.info == image_info(10, 3, 32, 32)
    assert (splits.fields, splits.target) == (("image", "label"), "label")
    data, labels = official_train(batches)
    kept, held = datasets.stratified_holdout(torch.tensor(labels), 2, 0, "cifar10")
    image, label = splits.train[3]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    assert label == labels[kept[3]]
    torch.testing.assert_close(image, cifar10_normalised(data[kept[3]]))
    image, label = splits.val[1]
    assert label == labels[held[1]]
    torch.testing.assert_close(image, cifar10_normalised(data[held[1]]))
    image, label = splits.test[1]
    data, labels = batches["test_batch"]
    assert label == labels[1]
    torch.testing.assert_close(image, cifar10_normalised(data[1]))


def test_cifar10_augmented_train_keeps_shape_and_val_is_not_augmented(tmp_path):
    batches = write_cifar10(tmp_path)
    splits = datasets.cifar10(str(tmp_path), download=False, augment=True, verify_checksums=False, val_size=2)
    assert splits.train[0][0].shape == (3, 32, 32)
    torch.testing.assert_close(splits.test[0][0], cifar10_normalised(batches["test_batch"][0][0]))
    data, labels = official_train(batches)
    held = datasets.stratified_holdout(torch.tensor(labels), 2, 0, "cifar10")[1]
    torch.testing.assert_close(splits.val[0][0], cifar10_normalised(data[held[0]]))


def test_cifar10_dataset_pickles_for_spawned_workers(tmp_path):
    write_cifar10(tmp_path)
    splits = datasets.cifar10(str(tmp_path), download=False, augment=False, verify_checksums=False, in_memory=False,
                              val_size=2)
    copy = pickle.loads(pickle.dumps(splits.train))
    torch.testing.assert_close(copy[4][0], splits.train[4][0])


def test_cifar10_checksum_mismatch_is_refused_by_default(tmp_path):
    write_cifar10(tmp_path)
    with pytest.raises(DatasetNotFoundError, match="md5.*dataset.verify_checksums=false") as error:
        datasets.cifar10(str(tmp_path), download=True)
    message = str(error.value)
    assert str(tmp_path / "cifar-10-batches-py") in message
    assert all(name in message for name in datasets.CIFAR10_FILES)


def test_cifar10_missing_files_names_folder_and_files(tmp_path):
    with pytest.raises(DatasetNotFoundError) as error:
        datasets.cifar10(str(tmp_path), download=False)
    message = str(error.value)
    assert str(tmp_path / "cifar-10-batches-py") in message
    assert all(name in message for name in datasets.CIFAR10_FILES)


# ---- the on-device path (in_memory) ------------------------------------------------------------

IN_MEMORY_CASES = [
    (lambda root, **kw: datasets.mnist(root, download=False, val_size=10, **kw), "MNIST"),
    (lambda root, **kw: datasets.fashion_mnist(root, download=False, val_size=10, **kw), "FashionMNIST"),
    (lambda root, **kw: datasets.cifar10(root, download=False, augment=False, verify_checksums=False, val_size=10,
                                         **kw), "CIFAR"),
]


def write_files(root: Path, folder_name: str) -> None:
    if folder_name == "CIFAR":
        write_cifar10(root, per_batch=4)
    else:
        write_mnist(root, folder_name)


def loader_batches(dataset, batch_size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """All of `dataset` through TensorBatchLoader, in order, concatenated."""
    loader = TensorBatchLoader(dataset, EvalShardSampler(len(dataset), batch_size, 0, 1), torch.device("cpu"))
    images, labels = zip(*loader)
    return torch.cat(images), torch.cat(labels)


@pytest.mark.parametrize("builder, folder_name", IN_MEMORY_CASES, ids=["mnist", "fashion_mnist", "cifar10"])
def test_in_memory_batches_equal_torchvisions_to_tensor_and_normalize(tmp_path, builder, folder_name):
    write_files(tmp_path, folder_name)
    fast, slow = builder(str(tmp_path)), builder(str(tmp_path), in_memory=False)
    for split in ("train", "val", "test"):
        tensors, reference = getattr(fast, split), getattr(slow, split)
        assert isinstance(tensors, ImageTensorDataset) and not isinstance(reference, ImageTensorDataset)
        assert tensors.tensors[0].dtype == torch.uint8
        images, labels = loader_batches(tensors)
        expected = torch.stack([reference[i][0] for i in range(len(reference))])
        assert images.dtype == torch.float32 and images.shape == expected.shape
        torch.testing.assert_close(images, expected, rtol=0, atol=1e-6)
        assert labels.tolist() == [reference[i][1] for i in range(len(reference))]
        torch.testing.assert_close(tensors[len(tensors) - 1][0], expected[-1], rtol=0, atol=1e-6)


def cifar10_augmented(root: Path, seed: int = 0) -> tuple[TensorBatchLoader, np.ndarray]:
    """A training loader over CIFAR-10's 30 augmented training images in one batch (10 of the 40 held out as val),
    and their uint8 pixels."""
    batches = write_cifar10(root, per_batch=8)
    splits = datasets.cifar10(str(root), download=False, verify_checksums=False, val_size=10)
    data, labels = official_train(batches)
    kept = datasets.stratified_holdout(torch.tensor(labels), 10, 0, "cifar10")[0]
    pixels = data[kept.numpy()].reshape(-1, 3, 32, 32)
    loader = TensorBatchLoader(splits.train, EvalShardSampler(30, 30, 0, 1), torch.device("cpu"), seed, augment=True)
    return loader, pixels


def crop_and_flip(image: np.ndarray, padded_pixels: np.ndarray) -> tuple[int, int, bool] | None:
    """The (top, left, flipped) under which `image` is a 32x32 crop of `padded_pixels`, if any."""
    for top in range(9):
        for left in range(9):
            crop = padded_pixels[:, top : top + 32, left : left + 32]
            for flipped in (False, True):
                if np.array_equal(image, crop[:, :, ::-1] if flipped else crop):
                    return top, left, flipped
    return None


def test_cifar10_device_augmentation_is_a_crop_of_the_zero_padded_image_and_a_flip(tmp_path):
    loader, pixels = cifar10_augmented(tmp_path)
    ((augmented, labels),) = list(loader)  # the batch's first part: its images
    assert torch.equal(labels, loader.tensors[1])  # labels as they are, in order
    mean, std = (torch.tensor(values).view(1, 3, 1, 1) for values in datasets.CIFAR10_MEAN_STD)
    recovered = ((augmented * std + mean) * 255).round().clamp(0, 255).to(torch.uint8).numpy()
    padded = np.pad(pixels, ((0, 0), (0, 0), (4, 4), (4, 4)))  # zeros: black borders
    draws = [crop_and_flip(recovered[i], padded[i]) for i in range(len(pixels))]
    assert None not in draws
    assert len(set(draws)) > 15  # drawn per sample
    assert {flipped for _, _, flipped in draws} == {False, True}
    assert any(top != 4 or left != 4 for top, left, _ in draws)  # some crops take border pixels


def test_cifar10_device_augmentation_is_reproducible_under_the_same_seed(tmp_path):
    draws = []
    for folder, seed in (("a", 1), ("b", 1), ("c", 2)):
        loader, _ = cifar10_augmented(tmp_path / folder, seed)
        draws.append(next(iter(loader))[0])
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])


def test_cifar10_val_split_and_its_loader_are_never_augmented(tmp_path):
    batches = write_cifar10(tmp_path, per_batch=4)
    splits = datasets.cifar10(str(tmp_path), download=False, verify_checksums=False, val_size=4)
    assert splits.train.augments and not splits.val.augments and not splits.test.augments
    data, labels = official_train(batches)
    held = datasets.stratified_holdout(torch.tensor(labels), 4, 0, "cifar10")[1]
    for split, (rows, expected_labels) in (("val", (data[held.numpy()], [labels[i] for i in held])),
                                          ("test", batches["test_batch"])):
        expected = torch.stack([cifar10_normalised(row) for row in rows])
        for augment in (False, True):  # a loader asked to augment the val or test split has nothing to draw
            loader = TensorBatchLoader(getattr(splits, split), EvalShardSampler(4, 4, 0, 1), torch.device("cpu"),
                                       augment=augment)
            ((images, drawn_labels),) = list(loader)
            torch.testing.assert_close(images, expected, rtol=0, atol=1e-6)
            assert drawn_labels.tolist() == list(expected_labels)


# ---- image folders ---------------------------------------------------------------------------

RED, BLUE = (255, 0, 0), (0, 0, 255)


def test_image_folder_rgb(tmp_path):
    write_image_folder(tmp_path, {"blue": BLUE, "red": RED})
    splits = datasets.image_folder(str(tmp_path), image_size=OmegaConf.create([16, 20]), channels=3)
    assert (len(splits.train), len(splits.val)) == (4, 4)
    assert splits.info == image_info(2, 3, 16, 20)
    assert (splits.fields, splits.target) == (("image", "label"), "label")
    image, label = splits.val[2]  # classes are sorted: blue 0, red 1
    assert image.shape == (3, 16, 20) and label == 1
    torch.testing.assert_close(image[:, 0, 0], torch.tensor([1.0, -1.0, -1.0]))


def test_image_folder_grayscale(tmp_path):
    write_image_folder(tmp_path, {"blue": BLUE, "red": RED})
    splits = datasets.image_folder(str(tmp_path), image_size=(8, 8), channels=1, augment=False)
    image, label = splits.train[3]
    assert image.shape == (1, 8, 8) and label == 1
    red_luma = round(0.299 * 255) / 255  # PIL's ITU-R 601-2 luma transform
    assert image[0, 4, 4].item() == pytest.approx((red_luma - 0.5) / 0.5, abs=1 / 255)


def test_image_folder_missing_train_names_the_path(tmp_path):
    write_image_folder(tmp_path, {"red": RED}, splits=("val",))
    with pytest.raises(DatasetNotFoundError, match="not found") as error:
        datasets.image_folder(str(tmp_path))
    assert str(tmp_path / "train") in str(error.value)


def test_image_folder_without_val_holds_out_part_of_train_and_tests_on_its_test_folder(tmp_path):
    write_image_folder(tmp_path, {"blue": BLUE, "red": RED}, splits=("train", "test"))
    splits = datasets.image_folder(str(tmp_path), image_size=(8, 8), augment=False, val_size=2)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (2, 2, 4)
    assert sorted(label for _, label in (splits.val[i] for i in range(2))) == [0, 1]  # one of each class
    assert [splits.test[i][1] for i in range(4)] == [0, 0, 1, 1]
    with pytest.raises(DatasetNotFoundError, match="val not found: .*or set dataset.val_size=N to hold out N"):
        datasets.image_folder(str(tmp_path))  # neither val/ nor val_size
    write_image_folder(tmp_path / "with_val", {"blue": BLUE, "red": RED}, splits=("train", "val"))
    without_test = datasets.image_folder(str(tmp_path / "with_val"), image_size=(8, 8))
    assert (len(without_test.train), len(without_test.val), without_test.test) == (4, 4, None)


@pytest.mark.parametrize("class_folder", [None, "red"], ids=["no-class-folders", "class-folder-without-images"])
def test_image_folder_empty_split_is_reported(tmp_path, class_folder):
    write_image_folder(tmp_path, {"red": RED}, splits=("val",))
    (tmp_path / "train").mkdir(exist_ok=True)
    if class_folder:
        (tmp_path / "train" / class_folder).mkdir()
    with pytest.raises(DatasetNotFoundError, match="is empty") as error:
        datasets.image_folder(str(tmp_path))
    assert str(tmp_path / "train") in str(error.value)
    assert "\n" not in str(error.value)


def test_image_folder_class_mismatch_is_reported(tmp_path):
    write_image_folder(tmp_path, {"red": RED}, splits=("train",))
    write_image_folder(tmp_path, {"blue": BLUE}, splits=("val",))
    with pytest.raises(ValueError, match=r"only in train \['red'\], only in val \['blue'\]"):
        datasets.image_folder(str(tmp_path))


# ---- digits ----------------------------------------------------------------------------------


def test_digits_splits_normalised_and_labelled():
    splits = datasets.digits(val_size=300)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (1317, 300, 180)
    assert splits.info == image_info(10, 1, 8, 8)
    images, labels = splits.train.tensors
    assert images.shape == (1317, 1, 8, 8) and images.dtype == torch.float32
    assert labels.dtype == torch.int64
    assert images.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert images.std().item() == pytest.approx(1.0, abs=1e-5)
    assert set(labels.tolist()) == set(range(10))
    assert set(splits.val.tensors[1].tolist()) == set(splits.test.tensors[1].tolist()) == set(range(10))


def sample_keys(dataset) -> set[bytes]:
    """Each sample's raw image bytes, to compare splits by content (the digits set has no ids)."""
    return {image.numpy().tobytes() for image in dataset.tensors[0]}


def test_digits_split_is_deterministic_disjoint_and_seeded():
    first, again, other = datasets.digits(split_seed=0), datasets.digits(split_seed=0), datasets.digits(split_seed=1)
    torch.testing.assert_close(first.val.tensors[0], again.val.tensors[0])
    torch.testing.assert_close(first.train.tensors[1], again.train.tensors[1])
    assert not torch.equal(first.val.tensors[1], other.val.tensors[1])
    torch.testing.assert_close(first.test.tensors[0], again.test.tensors[0])
    # The 1797 images are all distinct, so disjoint splits covering them share no image.
    train, val, test = (sample_keys(split) for split in (first.train, first.val, first.test))
    assert not (train & val or train & test or val & test)
    assert len(train | val | test) == 1797


@pytest.mark.parametrize("sizes", [(0, 180), (1797, 180), (-5, 180), (180, 0), (900, 897)])
def test_digits_rejects_impossible_val_and_test_sizes(sizes):
    with pytest.raises(ValueError, match="val_size and test_size"):
        datasets.digits(val_size=sizes[0], test_size=sizes[1])


# ---- synthetic -------------------------------------------------------------------------------


def test_synthetic_shapes_labels_and_determinism():
    splits = datasets.synthetic(num_train=256, num_val=64, num_classes=5, channels=3, image_size=[6, 4], seed=3)
    assert splits.info == image_info(5, 3, 6, 4)
    images, labels = splits.train.tensors
    assert images.shape == (256, 3, 6, 4) and images.dtype == torch.float32
    assert len(splits.val) == 64
    assert set(labels.tolist()) == set(range(5))
    again = datasets.synthetic(num_train=256, num_val=64, num_classes=5, channels=3, image_size=[6, 4], seed=3)
    torch.testing.assert_close(again.val.tensors[0], splits.val.tensors[0])
    other = datasets.synthetic(num_train=256, num_val=64, num_classes=5, channels=3, image_size=[6, 4], seed=4)
    assert not torch.equal(other.train.tensors[0], images)


def test_builders_instantiate_from_yaml():
    config = OmegaConf.create(
        "_target_: src.components.datasets.synthetic\nnum_train: 32\nnum_val: 8\nchannels: 1\nimage_size: [5, 7]\n"
    )
    splits = instantiate(config)
    assert splits.info["image_size"] == [5, 7] and splits.train[0][0].shape == (1, 5, 7)


def test_import_does_not_load_torchvision_or_sklearn():
    code = "import sys, src.components.datasets; print(sorted({'torchvision', 'sklearn'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_digits_are_exactly_scikit_learns_load_digits():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    table = datasets._bundled_digits_table()
    assert (table[:, :-1] == bunch.data).all() and (table[:, -1] == bunch.target).all()


@pytest.mark.parametrize("builder,fields,target", [
    (lambda: datasets.digits(), ("image", "label"), "label"),
    (lambda: datasets.synthetic(num_train=8, num_val=4), ("image", "label"), "label"),
    (lambda: datasets.breast_cancer(), ("features", "label"), "label"),
    (lambda: datasets.diabetes(), ("features", "target"), "target"),
    (lambda: datasets.two_input_synthetic(num_train=8, num_val=4), ("rgb", "mask", "target"), "target"),
    (lambda: datasets.python_docs(), ("tokens", "next_tokens"), "next_tokens"),
])
def test_every_in_memory_builder_names_its_fields_and_target(builder, fields, target):
    splits = builder()
    assert (splits.fields, splits.target) == (fields, target)
    assert len(splits.train[0]) == len(fields)  # one field per part of a sample


def test_python_docs_are_padded_byte_sequences_of_different_token_counts():
    splits = datasets.python_docs(max_length=32, val_size=61)
    tokens, next_tokens = splits.train.tensors
    assert len(splits.val) == 61 and len(splits.train) > 2000 and splits.info == {"vocab_size": 256, "max_length": 32}
    assert tokens.shape == next_tokens.shape == (len(splits.train), 32) and tokens.dtype == torch.int64
    real = next_tokens != datasets.PAD_TARGET
    lengths = real.sum(dim=1)
    assert lengths.min() >= 1 and lengths.max() == 32 and len(lengths.unique()) > 20  # documents differ in length
    assert torch.equal(tokens[:, 1:][real[:, 1:]], next_tokens[:, :-1][real[:, 1:]])  # next_tokens: shifted by one
    assert (tokens[~real] == 0).all() and tokens[real].min() > 0 and tokens.max() < 256
    again = datasets.python_docs(max_length=32, val_size=61)
    assert torch.equal(again.val.tensors[1], splits.val.tensors[1])  # deterministic
