"""Dataset builders: each returns the train and val splits plus the shape a model needs.

A builder is a plain function named by a YAML file's `_target_` (e.g. `conf/dataset/digits.yaml`
has `_target_: src.datasets.digits`), so adding a dataset means one function here and one YAML.
Every builder returns a `DataSplits` whose items are `(float32 image C x H x W, label)`.

`digits` (bundled with scikit-learn) and `synthetic` need no files, so they run anywhere. The
others read the standard on-disk formats and fail with a `DatasetNotFoundError` naming the folder
and the files to put there. torchvision and scikit-learn are imported inside the builders so that
importing this module (and `python train.py --help`) stays fast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset, TensorDataset

from src.errors import UsageError
from src.image_tensors import ImageTensorDataset

if TYPE_CHECKING:
    import numpy as np
    from torchvision.datasets import ImageFolder

MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
CIFAR10_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch", "batches.meta")
# Per-channel mean and std of the training images. For CIFAR-10 these are the true pixel stds;
# the often-copied (0.2023, 0.1994, 0.2010) are stds of per-image means.
MNIST_MEAN_STD = ((0.1307,), (0.3081,))
FASHION_MNIST_MEAN_STD = ((0.2860,), (0.3530,))
CIFAR10_MEAN_STD = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))


@dataclass(frozen=True)
class DataSplits:
    """A dataset's train and val splits and the input/output shape a model is built for."""

    train: Dataset
    val: Dataset
    num_classes: int
    in_channels: int
    image_size: tuple[int, int]  # (H, W)


class DatasetNotFoundError(UsageError, RuntimeError):
    """The dataset's files are missing, unreadable or could not be downloaded.

    The message is one line naming the folder and the files to put there; as a `UsageError`
    it is shown to the user without a traceback.
    """


def digits(val_size: int = 360, split_seed: int = 0) -> DataSplits:
    """scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), split into train and val.

    The first `val_size` samples of a permutation drawn from `split_seed` form the val split.
    Pixels are scaled to [0, 1], then normalised with the train split's mean and std.
    """
    table = _bundled_digits_table()
    images = torch.tensor(table[:, :-1], dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(table[:, -1], dtype=torch.int64)
    if not 0 < val_size < len(labels):
        raise ValueError(f"digits: val_size must be between 1 and {len(labels) - 1}, got {val_size}")
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(split_seed))
    val_index, train_index = order[:val_size], order[val_size:]
    train_images = images[train_index]
    mean, std = train_images.mean(), train_images.std()
    return DataSplits(
        train=TensorDataset((train_images - mean) / std, labels[train_index]),
        val=TensorDataset((images[val_index] - mean) / std, labels[val_index]),
        num_classes=10,
        in_channels=1,
        image_size=(8, 8),
    )


def _bundled_digits_table() -> "np.ndarray":
    """The rows of scikit-learn's bundled digits.csv.gz: 64 pixel values (0..16), then the label.

    This is the file `sklearn.datasets.load_digits` parses; reading it directly spares every
    process the 1-2 s that importing scikit-learn takes.
    """
    import gzip
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise DatasetNotFoundError("dataset=digits needs scikit-learn: pip install scikit-learn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as file:
        return np.loadtxt(file, delimiter=",", dtype=np.int64)


def synthetic(
    num_train: int = 4096,
    num_val: int = 1024,
    num_classes: int = 10,
    channels: int = 1,
    image_size: Sequence[int] = (28, 28),
    seed: int = 0,
) -> DataSplits:
    """Random N(0, 1) images with learnable labels, for benchmarks and smoke tests.

    The label of an image is the argmax of a fixed random linear projection of its pixels,
    so a model can fit it; everything is drawn from `seed`.
    """
    height, width = (int(x) for x in image_size)
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(num_train + num_val, channels, height, width, generator=generator)
    projection = torch.randn(channels * height * width, num_classes, generator=generator)
    labels = (images.flatten(1) @ projection).argmax(dim=1)
    return DataSplits(
        train=TensorDataset(images[:num_train], labels[:num_train]),
        val=TensorDataset(images[num_train:], labels[num_train:]),
        num_classes=num_classes,
        in_channels=channels,
        image_size=(height, width),
    )


def mnist(root: str, download: bool = True, in_memory: bool = True) -> DataSplits:
    """MNIST from `<root>/MNIST/raw/` (idx files, uncompressed); the official test set is val.

    `in_memory`: the splits as uint8 tensors, batched on the training device (`src/image_tensors.py`);
    otherwise torchvision datasets that DataLoader workers read sample by sample.
    """
    from torchvision.datasets import MNIST

    return _mnist_format(MNIST, root, download, MNIST_MEAN_STD, in_memory)


def fashion_mnist(root: str, download: bool = True, in_memory: bool = True) -> DataSplits:
    """Fashion-MNIST from `<root>/FashionMNIST/raw/` (idx files, uncompressed); test set is val.
    `in_memory` as for `mnist`."""
    from torchvision.datasets import FashionMNIST

    return _mnist_format(FashionMNIST, root, download, FASHION_MNIST_MEAN_STD, in_memory)


def _mnist_format(
    dataset_class: type,
    root: str,
    download: bool,
    mean_std: tuple[tuple[float, ...], tuple[float, ...]],
    in_memory: bool,
) -> DataSplits:
    """MNIST-format 28x28 grayscale splits read by `dataset_class` (MNIST or one of its subclasses)."""
    from torchvision import transforms

    folder = Path(root) / dataset_class.__name__ / "raw"
    _ensure_files(dataset_class.__name__, folder, MNIST_FILES, download, lambda: dataset_class(root, download=True))
    if in_memory:
        train, val = (dataset_class(root, train=is_train) for is_train in (True, False))
        # torchvision has already read the idx files into uint8 N x 28 x 28 tensors.
        train, val = (ImageTensorDataset(split.data.unsqueeze(1), split.targets, *mean_std) for split in (train, val))
    else:
        transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(*mean_std)])
        train, val = (dataset_class(root, train=is_train, transform=transform) for is_train in (True, False))
    return DataSplits(
        train=train,
        val=val,
        num_classes=10,
        in_channels=1,
        image_size=(28, 28),
    )


def cifar10(
    root: str, download: bool = True, augment: bool = True, verify_checksums: bool = True, in_memory: bool = True
) -> DataSplits:
    """CIFAR-10 from the python pickle batches in `<root>/cifar-10-batches-py/`; test_batch is val.

    With `verify_checksums` (the default) every file must match torchvision's md5 sums of the
    official release; set it to false to accept other files in the same format. `augment`: random
    crop of the 4-pixel zero-padded image and random horizontal flip, training images only.
    `in_memory`: the splits as uint8 tensors, batched and augmented on the training device
    (`src/image_tensors.py`); otherwise torchvision datasets that DataLoader workers read.
    """
    from torchvision import transforms
    from torchvision.datasets import CIFAR10

    folder = Path(root) / CIFAR10.base_folder
    _ensure_files("CIFAR-10", folder, CIFAR10_FILES, download, lambda: CIFAR10(root, download=True))
    if verify_checksums:
        _verify_cifar10_checksums(folder)
        dataset_class = CIFAR10
    else:
        from src.cifar10_files import CIFAR10WithoutMD5 as dataset_class
    if in_memory:
        train = _cifar10_tensors(dataset_class(root, train=True), augment)
        val = _cifar10_tensors(dataset_class(root, train=False), augment=False)
    else:
        to_tensor = [transforms.ToTensor(), transforms.Normalize(*CIFAR10_MEAN_STD)]
        augmentation = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if augment else []
        train = dataset_class(root, train=True, transform=transforms.Compose(augmentation + to_tensor))
        val = dataset_class(root, train=False, transform=transforms.Compose(to_tensor))
    return DataSplits(
        train=train,
        val=val,
        num_classes=10,
        in_channels=3,
        image_size=(32, 32),
    )


def _cifar10_tensors(split: Dataset, augment: bool) -> ImageTensorDataset:
    """A torchvision CIFAR10 split (its pickles already read into a uint8 N x H x W x C array) as tensors."""
    images = torch.from_numpy(split.data).permute(0, 3, 1, 2).contiguous()
    return ImageTensorDataset(images, torch.tensor(split.targets), *CIFAR10_MEAN_STD, 4 if augment else 0, augment)


def _verify_cifar10_checksums(folder: Path) -> None:
    """Raise if a CIFAR-10 file differs from the official release, instead of re-downloading over it."""
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import check_integrity

    expected = dict(CIFAR10.train_list + CIFAR10.test_list)
    expected[CIFAR10.meta["filename"]] = CIFAR10.meta["md5"]
    mismatched = [name for name, md5 in expected.items() if not check_integrity(folder / name, md5)]
    if mismatched:
        raise DatasetNotFoundError(
            f"CIFAR-10 files in {folder} do not match the official md5 sums ({', '.join(mismatched)}): replace "
            "them with the contents of cifar-10-python.tar.gz, or set dataset.verify_checksums=false to use them"
        )


def image_folder(
    root: str, image_size: Sequence[int] = (64, 64), channels: int = 3, augment: bool = True
) -> DataSplits:
    """Images in class folders: `<root>/train/<class>/*.png` and `<root>/val/<class>/*.png`.

    Any format PIL reads (png, jpg, ...) works. Images are resized to `image_size` (H, W) and
    converted to `channels` (1: grayscale, 3: RGB); train images are flipped at random if `augment`.
    Both splits must have the same class folders; labels follow their sorted names.
    """
    from torchvision import transforms

    if channels not in (1, 3):
        raise ValueError(f"image_folder: channels must be 1 (grayscale) or 3 (RGB), got {channels}")
    height, width = (int(x) for x in image_size)
    common = [transforms.Resize((height, width))]
    if channels == 1:  # ImageFolder's loader gives RGB, so only grayscale needs a conversion.
        common.append(transforms.Grayscale(num_output_channels=1))
    to_tensor = [transforms.ToTensor(), transforms.Normalize([0.5] * channels, [0.5] * channels)]
    augmentation = [transforms.RandomHorizontalFlip()] if augment else []
    train = _class_folders(Path(root) / "train", transforms.Compose(common + augmentation + to_tensor))
    val = _class_folders(Path(root) / "val", transforms.Compose(common + to_tensor))
    if train.classes != val.classes:
        raise ValueError(
            f"image_folder: class folders differ between {root}/train and {root}/val: "
            f"only in train {sorted(set(train.classes) - set(val.classes))}, "
            f"only in val {sorted(set(val.classes) - set(train.classes))}"
        )
    return DataSplits(
        train=train, val=val, num_classes=len(train.classes), in_channels=channels, image_size=(height, width)
    )


def _class_folders(folder: Path, transform: Callable) -> ImageFolder:
    """torchvision ImageFolder on `folder`, with a one-line error if it is missing or empty."""
    from torchvision.datasets import ImageFolder

    if not folder.is_dir():
        raise DatasetNotFoundError(f"image folder {folder} not found: put images in {folder}/<class_name>/")
    try:
        return ImageFolder(str(folder), transform=transform)
    except FileNotFoundError as error:
        reason = " ".join(str(error).split())
        raise DatasetNotFoundError(
            f"image folder {folder} is empty: put images in {folder}/<class_name>/ ({reason})"
        ) from error


def _ensure_files(
    name: str, folder: Path, files: Sequence[str], download: bool, download_files: Callable[[], object]
) -> None:
    """Return if all `files` are in `folder`; else download them or raise a `DatasetNotFoundError`."""
    if all((folder / file).is_file() for file in files):
        return
    where = f"put {', '.join(files)} in {folder}"
    if not download:
        raise DatasetNotFoundError(f"{name} not found: {where}, or set dataset.download=true")
    try:
        download_files()
    except Exception as error:  # Any failure (no network, bad mirror, disk full) ends the same way.
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        raise DatasetNotFoundError(f"{name} download failed ({reason}); {where}") from error
