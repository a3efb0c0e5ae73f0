"""Dataset builders: each returns the train and val splits plus what it provides to models and tasks.

A builder is a plain function named by a YAML file's `_target_` (e.g. `conf/dataset/digits.yaml`
has `_target_: src.components.datasets.digits`), so adding a dataset means one function here and one YAML.
Every builder returns a `DataSplits`: two datasets whose items are tuples (or dicts) of tensors, and
`info`, a free-form dict of what the data looks like (`num_classes`, `in_channels`, `image_size`,
`num_features`, `num_targets`, ...). Model YAMLs take the fields they need as `${data:FIELD}`;
tasks check the fields they need (`num_classes` for classification, `num_targets` for regression).

Every builder names its samples' parts (`fields`) and which one is the `target`, so a task binds the
model's inputs and its target by name: image datasets give `(image, label)` items (float32 C x H x W, int64);
`breast_cancer` gives `(features, label)`, `diabetes` `(features, target)`; `two_input_synthetic` gives
`(rgb, mask, target)`; `python_docs` gives `(tokens, next_tokens)` (padded byte sequences).
`digits`, `breast_cancer`, `diabetes` (bundled with scikit-learn), `python_docs` (shipped with Python) and the
synthetic ones need no
files, so they run anywhere. The others read the standard on-disk formats and fail with a
`DatasetNotFoundError` naming the folder and the files to put there. torchvision is imported inside
the builders, and scikit-learn's bundled files are read without importing it, so that importing
this module (and `python train.py --help`) stays fast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset, TensorDataset

from src.data.image_tensors import ImageTensorDataset
from src.data.splits import IMAGE_FIELDS, DatasetNotFoundError, DataSplits, image_info

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


def digits(val_size: int = 360, split_seed: int = 0) -> DataSplits:
    """scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), split into train and val.

    The first `val_size` samples of a permutation drawn from `split_seed` form the val split.
    Pixels are scaled to [0, 1], then normalised with the train split's mean and std.
    """
    table = _bundled_digits_table()
    images = torch.tensor(table[:, :-1], dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(table[:, -1], dtype=torch.int64)
    train_index, val_index = _split_indices(len(labels), val_size, split_seed, "digits")
    train_images = images[train_index]
    mean, std = train_images.mean(), train_images.std()
    return DataSplits(
        train=TensorDataset((train_images - mean) / std, labels[train_index]),
        val=TensorDataset((images[val_index] - mean) / std, labels[val_index]),
        info=image_info(10, 1, 8, 8),
        **IMAGE_FIELDS,
    )


def _bundled_digits_table() -> "np.ndarray":
    """The rows of scikit-learn's bundled digits.csv.gz: 64 pixel values (0..16), then the label.

    This is the file `sklearn.datasets.load_digits` parses; reading it directly spares every
    process the 1-2 s that importing scikit-learn takes.
    """
    import gzip

    import numpy as np

    with gzip.open(_bundled_file("digits.csv.gz"), "rt") as file:
        return np.loadtxt(file, delimiter=",", dtype=np.int64)


def _bundled_file(name: str) -> Path:
    """A data file shipped inside scikit-learn (sklearn/datasets/data/), found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise DatasetNotFoundError("this dataset is read from scikit-learn's bundled files: pip install scikit-learn")
    return Path(spec.submodule_search_locations[0]) / "datasets" / "data" / name


def breast_cancer(val_size: int = 114, split_seed: int = 0) -> DataSplits:
    """scikit-learn's bundled Wisconsin breast cancer table: 569 samples of 30 features, label 0
    (malignant) or 1 (benign), as in `sklearn.datasets.load_breast_cancer`.

    Items are `(float32 features (30,), int64 label)`; the features are standardised with the train
    split's per-feature mean and std (val statistics never leak into training).
    """
    import numpy as np

    table = np.loadtxt(_bundled_file("breast_cancer.csv"), delimiter=",", skiprows=1)  # row 1: counts, names
    features = torch.tensor(table[:, :-1], dtype=torch.float32)
    labels = torch.tensor(table[:, -1], dtype=torch.int64)
    (train_x, train_y), (val_x, val_y) = _standardised_split(features, labels, val_size, split_seed, "breast_cancer")
    return DataSplits(train=TensorDataset(train_x, train_y), val=TensorDataset(val_x, val_y),
                      info={"num_classes": 2, "num_features": features.shape[1]}, fields=("features", "label"),
                      target="label")


def diabetes(val_size: int = 88, split_seed: int = 0) -> DataSplits:
    """scikit-learn's bundled diabetes table: 442 patients, 10 features (age, sex, BMI, blood
    pressure, six blood serum measurements), target: disease progression one year later.

    Items are `(float32 features (10,), float32 target (1,))`. Features AND the target are
    standardised with train-split statistics, so mae and rmse are in units of the target's std
    (`info["target_std"]`, about 77 in the original units; r2 does not depend on the scale).
    """
    import gzip

    import numpy as np

    with gzip.open(_bundled_file("diabetes_data_raw.csv.gz"), "rt") as file:
        features = torch.tensor(np.loadtxt(file), dtype=torch.float32)
    with gzip.open(_bundled_file("diabetes_target.csv.gz"), "rt") as file:
        target = torch.tensor(np.loadtxt(file), dtype=torch.float32).view(-1, 1)
    (train_x, train_t), (val_x, val_t) = _standardised_split(features, target, val_size, split_seed, "diabetes")
    mean, std = train_t.mean(), train_t.std()
    return DataSplits(
        train=TensorDataset(train_x, (train_t - mean) / std), val=TensorDataset(val_x, (val_t - mean) / std),
        info={"num_features": features.shape[1], "num_targets": 1, "target_mean": mean.item(),
              "target_std": std.item()},
        fields=("features", "target"), target="target",
    )


def _split_indices(count: int, val_size: int, split_seed: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) sample indices: the first `val_size` of a permutation drawn from `split_seed` are val."""
    if not 0 < val_size < count:
        raise ValueError(f"{name}: val_size must be between 1 and {count - 1}, got {val_size}")
    order = torch.randperm(count, generator=torch.Generator().manual_seed(split_seed))
    return order[val_size:], order[:val_size]


def _standardised_split(
    features: torch.Tensor, targets: torch.Tensor, val_size: int, split_seed: int, name: str
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """((train features, targets), (val features, targets)): the first `val_size` samples of a
    permutation drawn from `split_seed` are val; features are standardised per column with the
    train split's mean and std."""
    train_index, val_index = _split_indices(len(targets), val_size, split_seed, name)
    mean, std = features[train_index].mean(dim=0), features[train_index].std(dim=0).clamp(min=1e-12)
    standardise = lambda index: (features[index] - mean) / std  # noqa: E731 - a one-line helper
    return (standardise(train_index), targets[train_index]), (standardise(val_index), targets[val_index])


def two_input_synthetic(
    num_train: int = 1200, num_val: int = 240, image_size: Sequence[int] = (16, 16), seed: int = 0
) -> DataSplits:
    """RGB images and masks with a real target from a fixed, learnable function: a two-input problem
    that runs anywhere (the shape of `model(rgb_images, masks)` regression).

    Images are smooth random colour fields (4x upsampled noise); a mask is a random rectangle
    covering 1/16 to 1/2 of the image. The target is the mean, over the mask's pixels, of a fixed
    random colour projection of the image, scaled to unit variance on the train split: the model must
    use both inputs. Items are `(float32 rgb (3, H, W), float32 mask (1, H, W), float32 target (1,))`.
    """
    height, width = (int(x) for x in image_size)
    generator = torch.Generator().manual_seed(seed)
    count = num_train + num_val
    coarse = torch.randn(count, 3, max(1, height // 4), max(1, width // 4), generator=generator)
    rgb = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)
    masks = _random_rectangles(count, height, width, generator)
    colour = torch.randn(3, generator=generator)
    projected = (rgb * colour.view(1, 3, 1, 1)).sum(dim=1, keepdim=True)
    target = ((projected * masks).sum(dim=(1, 2, 3)) / masks.sum(dim=(1, 2, 3))).view(-1, 1)
    target = target / target[:num_train].std()
    train = TensorDataset(rgb[:num_train], masks[:num_train], target[:num_train])
    val = TensorDataset(rgb[num_train:], masks[num_train:], target[num_train:])
    return DataSplits(train=train, val=val, info={"in_channels": 3, "image_size": [height, width], "num_targets": 1},
                      fields=("rgb", "mask", "target"), target="target")


def _random_rectangles(count: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """`count` float 0/1 masks (count, 1, H, W), each one rectangle of 1/4 to 1/sqrt(2) of each side."""
    sides = torch.tensor([height, width], dtype=torch.float32)
    size = (sides * (0.25 + (0.5 ** 0.5 - 0.25) * torch.rand(count, 2, generator=generator))).long().clamp(min=1)
    corner = (torch.rand(count, 2, generator=generator) * (sides - size + 1)).long()
    rows = torch.arange(height).view(1, height, 1)
    cols = torch.arange(width).view(1, 1, width)
    inside_rows = (rows >= corner[:, 0, None, None]) & (rows < (corner[:, 0] + size[:, 0])[:, None, None])
    inside_cols = (cols >= corner[:, 1, None, None]) & (cols < (corner[:, 1] + size[:, 1])[:, None, None])
    return (inside_rows & inside_cols).float().unsqueeze(1)


PAD_TARGET = -100  # the target of a padding position: task=causal_lm's ignore_index (torch's default)


def python_docs(max_length: int = 64, val_size: int = 256, split_seed: int = 0) -> DataSplits:
    """CPython's own documentation (`pydoc_data.topics`, shipped with Python: no download), one paragraph a
    document, as byte-level token sequences for next-token prediction (task=causal_lm).

    A sample is `(tokens, next_tokens)`, int64 (max_length,) each: the paragraph's first `max_length` bytes of
    UTF-8 and the bytes one position further on. A shorter paragraph is padded at the end: tokens with 0 (NUL,
    which the text never holds), next_tokens with PAD_TARGET, which the task ignores; so a batch holds
    1 to max_length tokens per document, and batches (and ranks) hold different numbers of tokens. The first
    `val_size` documents of a permutation drawn from `split_seed` are val.
    """
    import re
    from pydoc_data.topics import topics

    texts = [topics[name] for name in sorted(topics)]
    documents = [part.strip().encode()[: max_length + 1] for text in texts for part in re.split(r"\n\s*\n", text)]
    documents = [document for document in documents if len(document) >= 2]  # at least one token to predict
    tokens = torch.zeros(len(documents), max_length, dtype=torch.int64)
    next_tokens = torch.full((len(documents), max_length), PAD_TARGET, dtype=torch.int64)
    for row, document in enumerate(documents):
        ids = torch.frombuffer(bytearray(document), dtype=torch.uint8).long()
        tokens[row, : len(ids) - 1], next_tokens[row, : len(ids) - 1] = ids[:-1], ids[1:]
    train_index, val_index = _split_indices(len(documents), val_size, split_seed, "python_docs")
    return DataSplits(
        train=TensorDataset(tokens[train_index], next_tokens[train_index]),
        val=TensorDataset(tokens[val_index], next_tokens[val_index]),
        info={"vocab_size": 256, "max_length": max_length},
        fields=("tokens", "next_tokens"), target="next_tokens",
    )


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
        info=image_info(num_classes, channels, height, width),
        **IMAGE_FIELDS,
    )


def mnist(root: str, download: bool = True, in_memory: bool = True) -> DataSplits:
    """MNIST from `<root>/MNIST/raw/` (idx files, uncompressed); the official test set is val.

    `in_memory`: the splits as uint8 tensors, batched on the training device (`src/data/image_tensors.py`);
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
        info=image_info(10, 1, 28, 28),
        **IMAGE_FIELDS,
    )


def cifar10(
    root: str, download: bool = True, augment: bool = True, verify_checksums: bool = True, in_memory: bool = True
) -> DataSplits:
    """CIFAR-10 from the python pickle batches in `<root>/cifar-10-batches-py/`; test_batch is val.

    With `verify_checksums` (the default) every file must match torchvision's md5 sums of the
    official release; set it to false to accept other files in the same format. `augment`: random
    crop of the 4-pixel zero-padded image and random horizontal flip, training images only.
    `in_memory`: the splits as uint8 tensors, batched and augmented on the training device
    (`src/data/image_tensors.py`); otherwise torchvision datasets that DataLoader workers read.
    """
    from torchvision import transforms
    from torchvision.datasets import CIFAR10

    folder = Path(root) / CIFAR10.base_folder
    _ensure_files("CIFAR-10", folder, CIFAR10_FILES, download, lambda: CIFAR10(root, download=True))
    if verify_checksums:
        _verify_cifar10_checksums(folder)
        dataset_class = CIFAR10
    else:
        from src.data.cifar10_files import CIFAR10WithoutMD5 as dataset_class
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
        info=image_info(10, 3, 32, 32),
        **IMAGE_FIELDS,
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
    root: str,
    image_size: Sequence[int] = (64, 64),
    channels: int = 3,
    augment: bool = True,
    crop_scale: Sequence[float] | None = None,
    color_jitter: float = 0.0,
) -> DataSplits:
    """Images in class folders: `<root>/train/<class>/*.png` and `<root>/val/<class>/*.png`.

    Any format PIL reads (png, jpg, ...) works. Images are resized to `image_size` (H, W) and
    converted to `channels` (1: grayscale, 3: RGB); training images are augmented as `image_transforms`
    says. Both splits must have the same class folders; labels follow their sorted names.
    """
    train_transform, val_transform = image_transforms(image_size, channels, augment, crop_scale, color_jitter)
    train = _class_folders(Path(root) / "train", train_transform)
    val = _class_folders(Path(root) / "val", val_transform)
    if train.classes != val.classes:
        raise ValueError(
            f"image_folder: class folders differ between {root}/train and {root}/val: "
            f"only in train {sorted(set(train.classes) - set(val.classes))}, "
            f"only in val {sorted(set(val.classes) - set(train.classes))}"
        )
    height, width = (int(x) for x in image_size)
    return DataSplits(train=train, val=val, info=image_info(len(train.classes), channels, height, width),
                      **IMAGE_FIELDS)


def image_transforms(
    image_size: Sequence[int], channels: int, augment: bool, crop_scale: Sequence[float] | None, color_jitter: float
) -> tuple[Callable, Callable]:
    """(training, val) transforms from a decoded RGB PIL image to a normalised C x H x W tensor.

    Val: resize to `image_size`. Training, with `augment`: a random crop of `crop_scale` of the image's
    area (torchvision's RandomResizedCrop; None: the whole image, resized), a random horizontal flip,
    and colour jitter of brightness, contrast and saturation by up to `color_jitter` (0: none). Their
    draws come from the global generators, which the loader seeds per sample (src/data/sample_randomness.py).
    """
    from torchvision import transforms

    if channels not in (1, 3):
        raise ValueError(f"image folder: channels must be 1 (grayscale) or 3 (RGB), got {channels}")
    height, width = (int(x) for x in image_size)
    resize = transforms.Resize((height, width))
    augmentation = []
    if augment:
        crop_scale = None if crop_scale is None else tuple(float(x) for x in crop_scale)
        crop = resize if crop_scale is None else transforms.RandomResizedCrop((height, width), scale=crop_scale)
        jitter = [transforms.ColorJitter(color_jitter, color_jitter, color_jitter)] if color_jitter > 0 else []
        augmentation = [crop, transforms.RandomHorizontalFlip(), *jitter]
    # The decoded image is RGB (as ImageFolder's loader gives it), so only grayscale needs a conversion.
    to_tensor = [transforms.Grayscale(num_output_channels=1)] if channels == 1 else []
    to_tensor += [transforms.ToTensor(), transforms.Normalize([0.5] * channels, [0.5] * channels)]
    train = transforms.Compose((augmentation or [resize]) + to_tensor)
    return train, transforms.Compose([resize, *to_tensor])


def arrow(
    root: str,
    train_split: str = "train",
    val_split: str = "validation",
    columns: Sequence[str] | None = None,
    target: str = "label",
    image_size: Sequence[int] = (64, 64),
    channels: int = 3,
    augment: bool = True,
    crop_scale: Sequence[float] | None = None,
    color_jitter: float = 0.0,
) -> DataSplits:
    """Data larger than RAM: a dataset in the Arrow layout of Hugging Face `datasets`' save_to_disk (what
    `python -m src.data.convert` writes), memory-mapped and read by index (src/data/arrow_files.py).

    A sample is the tuple of `columns` (None: all, in order); image columns are decoded and transformed
    as `image_folder` does (`image_transforms`), so a converted image folder trains the same model.
    `target` is the column the task predicts: a ClassLabel gives `num_classes` (its names), other
    integers max + 1, floats `num_targets` (1).
    """
    from src.data.arrow_files import ArrowSamples, check_columns, open_splits, target_info

    train, val = open_splits(Path(root), [train_split, val_split])
    names = list(train.columns if columns is None else columns)
    for split in (train, val):
        check_columns(split, names, "dataset.columns")
        check_columns(split, [target], "dataset.target")
    train_transform, val_transform = image_transforms(image_size, channels, augment, crop_scale, color_jitter)
    info = target_info((train, val), target)
    if train.image_columns & set(names):
        height, width = (int(x) for x in image_size)
        info.update(in_channels=channels, image_size=[height, width], num_features=channels * height * width)
    return DataSplits(train=ArrowSamples(train, names, train_transform), val=ArrowSamples(val, names, val_transform),
                      info=info, fields=tuple(names), target=target)


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
