"""Dataset builders: each returns the train, val and test splits plus what it provides to models and tasks.

A builder is a plain function named by a YAML file's `_target_` (e.g. `conf/dataset/digits.yaml`
has `_target_: src.components.datasets.digits`), so adding a dataset means one function here and one YAML.
Every builder returns a `DataSplits`: datasets whose items are tuples (or dicts) of tensors, and
`info`, a free-form dict of what the data looks like (`num_classes`, `in_channels`, `image_size`,
`num_features`, `num_targets`, ...). Model YAMLs take the fields they need as `${data:FIELD}`;
tasks check the fields they need (`num_classes` for classification, `num_targets` for regression).

Every builder names its samples' parts (`fields`) and which one is the `target`, so a task binds the
model's inputs and its target by name: image datasets give `(image, label)` items (float32 C x H x W, int64);
`breast_cancer` gives `(features, label)`, `diabetes` `(features, target)`; `two_input_synthetic` gives
`(rgb, mask, target)`; `python_docs` gives `(tokens, next_tokens)` (padded byte sequences).
`digits`, `breast_cancer`, `diabetes` (bundled with scikit-learn), `python_docs` (shipped with Python) and the
synthetic ones need no files, so they run anywhere; they split three ways (`val_size`, `test_size`), the synthetic
ones draw a test split of their own. Datasets with an official test set (mnist, fashion_mnist, cifar10; an image
folder with a test/ folder, an Arrow dataset with a test split) keep it as test and hold out `val_size` samples of
the training set as val, the same share of each class, fixed by `split_seed`. The others read the standard on-disk
formats and fail with a `DatasetNotFoundError` naming the folder and the files to put there. torchvision is
imported by the builders that use it, and scikit-learn's bundled files are read without importing scikit-learn:
a run loads a library when its dataset needs it (a dataset of yours can import its own libraries the same way).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from src.data.image_tensors import ImageTensorDataset
from src.data.splits import IMAGE_FIELDS, DatasetNotFoundError, DataSplits, image_info, read_image

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import numpy as np
    from torchvision.datasets import ImageFolder

    from src.data.arrow_files import ArrowSplit

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


def digits(val_size: int = 180, test_size: int = 180, split_seed: int = 0) -> DataSplits:
    """scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), split into train, val and test.

    Of a permutation drawn from `split_seed`, the first `val_size` samples form the val split, the next
    `test_size` the test split, the rest (1,437 by default) train. Pixels are scaled to [0, 1], then normalised
    with the train split's mean and std.
    """
    table = _bundled_digits_table()
    images = torch.tensor(table[:, :-1], dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(table[:, -1], dtype=torch.int64)
    train_index, val_index, test_index = _split_indices(len(labels), (val_size, test_size), split_seed, "digits")
    train_images = images[train_index]
    mean, std = train_images.mean(), train_images.std()
    split = lambda index: TensorDataset((images[index] - mean) / std, labels[index])  # noqa: E731
    return DataSplits(train=split(train_index), val=split(val_index), test=split(test_index),
                      info=image_info(10, 1, 8, 8), **IMAGE_FIELDS)


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


def breast_cancer(val_size: int = 57, test_size: int = 57, split_seed: int = 0) -> DataSplits:
    """scikit-learn's bundled Wisconsin breast cancer table: 569 samples of 30 features, label 0
    (malignant) or 1 (benign), as in `sklearn.datasets.load_breast_cancer`.

    Items are `(float32 features (30,), int64 label)`; the features are standardised with the train
    split's per-feature mean and std (val and test statistics never leak into training).
    """
    import numpy as np

    table = np.loadtxt(_bundled_file("breast_cancer.csv"), delimiter=",", skiprows=1)  # row 1: counts, names
    features = torch.tensor(table[:, :-1], dtype=torch.float32)
    labels = torch.tensor(table[:, -1], dtype=torch.int64)
    train, val, test = _standardised_split(features, labels, (val_size, test_size), split_seed, "breast_cancer")
    return DataSplits(train=TensorDataset(*train), val=TensorDataset(*val), test=TensorDataset(*test),
                      info={"num_classes": 2, "num_features": features.shape[1]}, fields=("features", "label"),
                      target="label")


def diabetes(val_size: int = 44, test_size: int = 44, split_seed: int = 0) -> DataSplits:
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
    (train_x, train_t), *held = _standardised_split(features, target, (val_size, test_size), split_seed, "diabetes")
    mean, std = train_t.mean(), train_t.std()
    val, test = (TensorDataset(x, (t - mean) / std) for x, t in held)
    return DataSplits(
        train=TensorDataset(train_x, (train_t - mean) / std), val=val, test=test,
        info={"num_features": features.shape[1], "num_targets": 1, "target_mean": mean.item(),
              "target_std": std.item()},
        fields=("features", "target"), target="target",
    )


def _split_indices(count: int, sizes: Sequence[int], split_seed: int, name: str) -> list[torch.Tensor]:
    """[train, val, test] sample indices: of a permutation drawn from `split_seed`, val takes the first sizes[0],
    test the next sizes[1], train the rest (fixed by `split_seed` alone: not by the run's seed or world size)."""
    if any(size < 1 for size in sizes) or sum(sizes) >= count:
        raise ValueError(f"{name}: val_size and test_size must each be at least 1 and leave samples to train on "
                         f"({count} in all), got {', '.join(map(str, sizes))}")
    order = torch.randperm(count, generator=torch.Generator().manual_seed(split_seed))
    bounds = [0, *itertools.accumulate(sizes)]
    return [order[bounds[-1]:], *(order[start:stop] for start, stop in zip(bounds, bounds[1:]))]


def _standardised_split(
    features: torch.Tensor, targets: torch.Tensor, sizes: Sequence[int], split_seed: int, name: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(features, targets) of train, val, test] as `_split_indices` splits them; features standardised per column
    with the train split's mean and std."""
    train_index, *held = _split_indices(len(targets), sizes, split_seed, name)
    mean, std = features[train_index].mean(dim=0), features[train_index].std(dim=0).clamp(min=1e-12)
    return [((features[index] - mean) / std, targets[index]) for index in (train_index, *held)]


def stratified_holdout(labels: torch.Tensor, size: int, split_seed: int,
                       name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept, held out) sample indices, each sorted: `size` samples held out with each class in the share it has
    (largest remainders), chosen at random within each class from `split_seed` alone."""
    count = len(labels)
    if not 0 < size < count:
        raise ValueError(f"{name}: val_size must be between 1 and {count - 1}, got {size}")
    generator = torch.Generator().manual_seed(split_seed)
    classes, counts = labels.unique(return_counts=True)
    shares = counts.double() * size / count
    taken = shares.floor().long()
    taken[(shares - taken).argsort(descending=True, stable=True)[: size - int(taken.sum())]] += 1
    held = torch.cat([members[torch.randperm(len(members), generator=generator)[:number]]
                      for label, number in zip(classes.tolist(), taken.tolist())
                      for members in [(labels == label).nonzero().flatten()]]).sort().values
    kept = torch.ones(count, dtype=torch.bool)
    kept[held] = False
    return kept.nonzero().flatten(), held


def two_input_synthetic(
    num_train: int = 1200, num_val: int = 240, image_size: Sequence[int] = (16, 16), seed: int = 0, num_test: int = 240
) -> DataSplits:
    """RGB images and masks with a real target from a fixed, learnable function: a two-input problem
    that runs anywhere (the shape of `model(rgb_images, masks)` regression).

    Images are smooth random colour fields (4x upsampled noise); a mask is a random rectangle
    covering 1/16 to 1/2 of the image. The target is the mean, over the mask's pixels, of a fixed
    random colour projection of the image, scaled to unit variance on the train split: the model must
    use both inputs. Items are `(float32 rgb (3, H, W), float32 mask (1, H, W), float32 target (1,))`. The test
    split's `num_test` samples are drawn after all the others.
    """
    height, width = (int(x) for x in image_size)
    generator = torch.Generator().manual_seed(seed)
    rgb, masks = _colour_fields(num_train + num_val, height, width, generator)
    colour = torch.randn(3, generator=generator)
    test_rgb, test_masks = _colour_fields(num_test, height, width, generator)

    def target(rgb: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        projected = (rgb * colour.view(1, 3, 1, 1)).sum(dim=1, keepdim=True)
        return ((projected * masks).sum(dim=(1, 2, 3)) / masks.sum(dim=(1, 2, 3))).view(-1, 1)

    values = target(rgb, masks)
    scale = values[:num_train].std()
    values, test_values = values / scale, target(test_rgb, test_masks) / scale
    return DataSplits(train=TensorDataset(rgb[:num_train], masks[:num_train], values[:num_train]),
                      val=TensorDataset(rgb[num_train:], masks[num_train:], values[num_train:]),
                      test=TensorDataset(test_rgb, test_masks, test_values),
                      info={"in_channels": 3, "image_size": [height, width], "num_targets": 1},
                      fields=("rgb", "mask", "target"), target="target")


def _colour_fields(count: int, height: int, width: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` smooth random colour fields (4x upsampled noise) and a random rectangle mask for each."""
    coarse = torch.randn(count, 3, max(1, height // 4), max(1, width // 4), generator=generator)
    rgb = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)
    return rgb, _random_rectangles(count, height, width, generator)


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


SHAPE_CLASSES = ("background", "disc", "square", "ring")


def shapes(num_train: int = 512, num_val: int = 128, num_test: int = 128, image_size: Sequence[int] = (32, 32),
           flip: bool = True, mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
           seed: int = 0) -> DataSplits:
    """Synthetic segmentation that runs anywhere: RGB images of 1 to 3 discs, squares and rings (each a random
    colour and size) on a smooth random background, with masks of their classes (`SHAPE_CLASSES`; a later shape
    covers an earlier one). Items are `(float32 image (3, H, W), int64 mask (H, W))`; training images and their
    masks are flipped left-right together (`flip`), drawn per sample. Images in [0, 1] are normalised with `mean`
    and `std` (None: 0.5 and 0.5; a pretrained backbone's via `${weights:...}`)."""
    height, width = (int(x) for x in image_size)
    generator = torch.Generator().manual_seed(seed)
    images, masks = _draw_shapes(num_train + num_val + num_test, height, width, generator)
    mean, std = normalisation(mean, std, 3)
    log.info("shapes: images normalised with mean %s and std %s", mean, std)
    mean_t, std_t = (torch.tensor(v).view(3, 1, 1) for v in (mean, std))
    images = (images - mean_t) / std_t
    parts = torch.split(torch.arange(len(images)), [num_train, num_val, num_test])
    train, val, test = (PairedFlips(images[index], masks[index], flip and name == "train")
                        for name, index in zip(("train", "val", "test"), parts))
    return DataSplits(train=train, val=val, test=test,
                      info={**image_info(len(SHAPE_CLASSES), 3, height, width), "classes": list(SHAPE_CLASSES)},
                      fields=("image", "mask"), target="mask")


def _draw_shapes(count: int, height: int, width: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` images (count, 3, H, W) in [0, 1] and their int64 masks (count, H, W): up to three shapes each."""
    coarse = torch.rand(count, 3, max(1, height // 8), max(1, width // 8), generator=generator)
    images = 0.5 * torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)
    masks = torch.zeros(count, height, width, dtype=torch.long)
    rows = torch.arange(height, dtype=torch.float32).view(1, height, 1)
    cols = torch.arange(width, dtype=torch.float32).view(1, 1, width)
    shown = torch.randint(1, 4, (count,), generator=generator)
    for slot in range(3):  # every image's slot-th shape at once
        kind = torch.randint(1, len(SHAPE_CLASSES), (count, 1, 1), generator=generator)
        radius = min(height, width) * (0.12 + 0.13 * torch.rand(count, 1, 1, generator=generator))
        centre_r, centre_c = (torch.rand(count, 1, 1, generator=generator) * side for side in (height, width))
        colour = 0.5 + 0.5 * torch.rand(count, 3, 1, 1, generator=generator)
        distance = ((rows - centre_r) ** 2 + (cols - centre_c) ** 2).sqrt()
        square = ((rows - centre_r).abs() <= radius) & ((cols - centre_c).abs() <= radius)
        inside = torch.where(kind == 1, distance <= radius, torch.where(
            kind == 2, square, (distance <= radius) & (distance >= 0.55 * radius)))
        inside &= (slot < shown).view(count, 1, 1)
        images = torch.where(inside.unsqueeze(1), colour, images)
        masks = torch.where(inside, kind, masks)
    return images, masks


class PairedFlips(Dataset):
    """(image, mask) pairs; with `flip`, both flipped left-right together with probability 1/2 (a draw from torch's
    global generator, which the loader seeds per sample: the same flips on any world size and after a resume)."""

    def __init__(self, images: torch.Tensor, masks: torch.Tensor, flip: bool) -> None:
        self.images, self.masks, self.flip = images, masks, flip

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, mask = self.images[index], self.masks[index]
        if self.flip and bool(torch.rand(()) < 0.5):
            image, mask = image.flip(-1), mask.flip(-1)
        return image, mask


PAD_TARGET = -100  # the target of a padding position: task=causal_lm's ignore_index (torch's default)


def python_docs(max_length: int = 64, val_size: int = 128, test_size: int = 128, split_seed: int = 0) -> DataSplits:
    """CPython's own documentation (`pydoc_data.topics`, shipped with Python: no download), one paragraph a
    document, as byte-level token sequences for next-token prediction (task=causal_lm).

    A sample is `(tokens, next_tokens)`, int64 (max_length,) each: the paragraph's first `max_length` bytes of
    UTF-8 and the bytes one position further on. A shorter paragraph is padded at the end: tokens with 0 (NUL,
    which the text never holds), next_tokens with PAD_TARGET, which the task ignores; so a batch holds
    1 to max_length tokens per document, and batches (and ranks) hold different numbers of tokens. Of a
    permutation drawn from `split_seed`, the first `val_size` documents are val, the next `test_size` test.
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
    train, val, test = (TensorDataset(tokens[index], next_tokens[index]) for index in
                        _split_indices(len(documents), (val_size, test_size), split_seed, "python_docs"))
    return DataSplits(train=train, val=val, test=test, info={"vocab_size": 256, "max_length": max_length},
                      fields=("tokens", "next_tokens"), target="next_tokens")


def synthetic(
    num_train: int = 4096,
    num_val: int = 1024,
    num_classes: int = 10,
    channels: int = 1,
    image_size: Sequence[int] = (28, 28),
    seed: int = 0,
    num_test: int = 1024,
) -> DataSplits:
    """Random N(0, 1) images with learnable labels, for benchmarks and smoke tests.

    The label of an image is the argmax of a fixed random linear projection of its pixels,
    so a model can fit it; everything is drawn from `seed`, the test split's `num_test` images last.
    """
    height, width = (int(x) for x in image_size)
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(num_train + num_val, channels, height, width, generator=generator)
    projection = torch.randn(channels * height * width, num_classes, generator=generator)
    test = torch.randn(num_test, channels, height, width, generator=generator)
    label = lambda images: (images.flatten(1) @ projection).argmax(dim=1)  # noqa: E731
    labels = label(images)
    return DataSplits(
        train=TensorDataset(images[:num_train], labels[:num_train]),
        val=TensorDataset(images[num_train:], labels[num_train:]),
        test=TensorDataset(test, label(test)),
        info=image_info(num_classes, channels, height, width),
        **IMAGE_FIELDS,
    )


def mnist(root: str, download: bool = True, in_memory: bool = True, val_size: int = 5000,
          split_seed: int = 0) -> DataSplits:
    """MNIST from `<root>/MNIST/raw/` (idx files, uncompressed): the official test set is test, `val_size` images
    of the official training set (each class in its share, fixed by `split_seed`) are val, the rest train.

    `in_memory`: the splits as uint8 tensors, batched on the training device (`src/data/image_tensors.py`);
    otherwise torchvision datasets that DataLoader workers read sample by sample.
    """
    from torchvision.datasets import MNIST

    return _mnist_format(MNIST, root, download, MNIST_MEAN_STD, in_memory, val_size, split_seed)


def fashion_mnist(root: str, download: bool = True, in_memory: bool = True, val_size: int = 5000,
                  split_seed: int = 0) -> DataSplits:
    """Fashion-MNIST from `<root>/FashionMNIST/raw/` (idx files, uncompressed), split as `mnist` splits."""
    from torchvision.datasets import FashionMNIST

    return _mnist_format(FashionMNIST, root, download, FASHION_MNIST_MEAN_STD, in_memory, val_size, split_seed)


def _mnist_format(
    dataset_class: type,
    root: str,
    download: bool,
    mean_std: tuple[tuple[float, ...], tuple[float, ...]],
    in_memory: bool,
    val_size: int,
    split_seed: int,
) -> DataSplits:
    """MNIST-format 28x28 grayscale splits read by `dataset_class` (MNIST or one of its subclasses)."""
    from torchvision import transforms

    folder = Path(root) / dataset_class.__name__ / "raw"
    _ensure_files(dataset_class.__name__, folder, MNIST_FILES, download, lambda: dataset_class(root, download=True))
    official, test = (dataset_class(root, train=is_train) for is_train in (True, False))
    kept, held = stratified_holdout(official.targets, val_size, split_seed, dataset_class.__name__)
    if in_memory:  # torchvision has already read the idx files into uint8 N x 28 x 28 tensors
        train, val, test = (ImageTensorDataset(data.unsqueeze(1), targets, *mean_std) for data, targets in (
            (official.data[kept], official.targets[kept]), (official.data[held], official.targets[held]),
            (test.data, test.targets)))
    else:
        transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(*mean_std)])
        official, test = (dataset_class(root, train=is_train, transform=transform) for is_train in (True, False))
        train, val = Subset(official, kept.tolist()), Subset(official, held.tolist())
    return DataSplits(train=train, val=val, test=test, info=image_info(10, 1, 28, 28), **IMAGE_FIELDS)


def cifar10(
    root: str, download: bool = True, augment: bool = True, verify_checksums: bool = True, in_memory: bool = True,
    val_size: int = 5000, split_seed: int = 0, image_size: Sequence[int] | None = None,
    mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
) -> DataSplits:
    """CIFAR-10 from the python pickle batches in `<root>/cifar-10-batches-py/`: test_batch is test, `val_size`
    images of the training batches (each class in its share, fixed by `split_seed`) are val, the rest train.

    With `verify_checksums` (the default) every file must match torchvision's md5 sums of the
    official release; set it to false to accept other files in the same format. `augment`: random
    crop of the 4-pixel zero-padded image and random horizontal flip, training images only.
    `in_memory`: the splits as uint8 tensors, batched and augmented on the training device
    (`src/data/image_tensors.py`); otherwise torchvision datasets that DataLoader workers read. Images are
    normalised with `mean` and `std` (None: CIFAR-10's own) and, after any augmentation, resized to `image_size`
    (None: 32x32 as stored; a pretrained model's input size through `${weights:...}`).
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
    official, test = dataset_class(root, train=True), dataset_class(root, train=False)
    kept, held = stratified_holdout(torch.tensor(official.targets), val_size, split_seed, "cifar10")
    mean_std = normalisation(mean, std, 3, CIFAR10_MEAN_STD)
    height, width = (int(x) for x in image_size or (32, 32))
    log.info("cifar10: images normalised with mean %s and std %s, resized to %dx%d", *mean_std, height, width)
    if in_memory:
        train = _cifar10_tensors(official, mean_std, (height, width), augment, kept)
        val = _cifar10_tensors(official, mean_std, (height, width), False, held)
        test = _cifar10_tensors(test, mean_std, (height, width), False)
    else:
        resize = [transforms.Resize((height, width))] if (height, width) != (32, 32) else []
        to_tensor = [transforms.ToTensor(), transforms.Normalize(*mean_std), *resize]
        augmentation = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if augment else []
        train = Subset(dataset_class(root, train=True, transform=transforms.Compose(augmentation + to_tensor)),
                       kept.tolist())
        val = Subset(dataset_class(root, train=True, transform=transforms.Compose(to_tensor)), held.tolist())
        test = dataset_class(root, train=False, transform=transforms.Compose(to_tensor))
    return DataSplits(train=train, val=val, test=test, info=image_info(10, 3, height, width), **IMAGE_FIELDS)


def _cifar10_tensors(split: Dataset, mean_std: tuple[list[float], list[float]], size: tuple[int, int], augment: bool,
                     index: torch.Tensor | None = None) -> ImageTensorDataset:
    """A torchvision CIFAR10 split (its pickles already read into a uint8 N x H x W x C array) as tensors (the
    samples at `index` only, if given)."""
    images, labels = torch.from_numpy(split.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(split.targets)
    if index is not None:
        images, labels = images[index], labels[index]
    return ImageTensorDataset(images, labels, *mean_std, 4 if augment else 0, augment, size)


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
    val_size: int | None = None,
    split_seed: int = 0,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> DataSplits:
    """Images in class folders: `<root>/train/<class>/*.png`, `<root>/val/<class>/...` and `<root>/test/<class>/...`.

    train/ is required. val/ is the val split; with `val_size` set, those images of train/ are instead (each class
    in its share, fixed by `split_seed`). test/, where there is one, is the test split. Any format PIL reads
    (png, jpg, ...) works. Images are resized to `image_size` (H, W) and converted to `channels` (1: grayscale,
    3: RGB) and normalised with `mean` and `std`; training images are augmented as `image_transforms` says. Every
    split must have the same class folders; labels follow their sorted names.
    """
    train_transform, val_transform = image_transforms(image_size, channels, augment, crop_scale, color_jitter, mean,
                                                      std)
    folder = Path(root)
    train = _class_folders(folder / "train", train_transform)
    if val_size is None:
        val = _class_folders(folder / "val", val_transform, "or set dataset.val_size=N to hold out N of train/'s")
    else:
        kept, held = stratified_holdout(torch.tensor(train.targets), val_size, split_seed, "image_folder")
        train, val = (Subset(_class_folders(folder / "train", transform), index.tolist())
                      for transform, index in ((train_transform, kept), (val_transform, held)))
    test = _class_folders(folder / "test", val_transform) if (folder / "test").is_dir() else None
    classes = _same_classes(root, {"train": _classes_of(train), "val": _classes_of(val),
                                   **({"test": test.classes} if test is not None else {})})
    height, width = (int(x) for x in image_size)
    return DataSplits(train=train, val=val, test=test, info=image_info(len(classes), channels, height, width),
                      **IMAGE_FIELDS)


def _classes_of(split: Dataset) -> list[str]:
    return (split.dataset if isinstance(split, Subset) else split).classes


def _same_classes(root: str, classes: dict[str, list[str]]) -> list[str]:
    """The class names every split has, or one line naming the folders that differ."""
    first = classes["train"]
    for name, found in classes.items():
        if found != first:
            raise ValueError(f"image_folder: class folders differ between {root}/train and {root}/{name}: only in "
                             f"train {sorted(set(first) - set(found))}, "
                             f"only in {name} {sorted(set(found) - set(first))}")
    return first


def image_transforms(
    image_size: Sequence[int], channels: int, augment: bool, crop_scale: Sequence[float] | None, color_jitter: float,
    mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
) -> tuple[Callable, Callable]:
    """(training, val) transforms from a decoded RGB PIL image to a C x H x W tensor normalised with `mean` and
    `std` per channel (None: 0.5, 0.5; a pretrained model's through `${weights:...}` in the YAML).

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
    mean, std = normalisation(mean, std, channels)
    log.info("images resized to %dx%d, normalised with mean %s and std %s", height, width, mean, std)
    to_tensor += [transforms.ToTensor(), transforms.Normalize(mean, std)]
    train = transforms.Compose((augmentation or [resize]) + to_tensor)
    return train, transforms.Compose([resize, *to_tensor])


def normalisation(mean: Sequence[float] | None, std: Sequence[float] | None, channels: int,
                  default: tuple[Sequence[float], Sequence[float]] | None = None) -> tuple[list[float], list[float]]:
    """`mean` and `std` per channel (None: `default`'s, else 0.5 and 0.5), or one line if their length is not
    `channels` (an RGB model's weights on greyscale images: set dataset.mean and dataset.std)."""
    fallback = default or ([0.5] * channels, [0.5] * channels)
    values = [list(fallback[i] if given is None else given) for i, given in enumerate((mean, std))]
    if any(len(value) != channels for value in values):
        raise ValueError(f"dataset.mean={values[0]} and dataset.std={values[1]} need {channels} value(s), one per "
                         "channel: set both for these images")
    return values[0], values[1]


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
    test_split: str = "test",
    val_size: int | None = None,
    split_seed: int = 0,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    features: Sequence[str] | str | None = None,
) -> DataSplits:
    """Data larger than RAM: a dataset in the Arrow layout of Hugging Face `datasets`' save_to_disk (what
    `python -m src.data.convert` writes), memory-mapped and read by index (src/data/arrow_files.py).

    A sample is the tuple of `columns` (None: all, in order); image columns are decoded and transformed
    as `image_folder` does (`image_transforms`), so a converted image folder trains the same model.
    `features` (a list of columns of single numbers, or "all": every such column but the target) are stacked, in
    order, into one float32 vector, the sample's first part, `features` (a table's columns: `num_features`).
    `target` is the column the task predicts: a ClassLabel gives `num_classes` (its names), other
    integers max + 1, floats `num_targets` (1). The `test_split`, where the dataset has one, is the test split;
    with `val_size` set, that many rows of the train split are val instead of `val_split` (each class in its share
    where the target is a class, fixed by `split_seed`).
    """
    from src.data.arrow_files import ArrowSamples, check_columns, column, listed_splits, open_splits, target_info

    held_out = val_size is not None
    names_of = [train_split, *([] if held_out else [val_split]),
                *([test_split] if test_split in listed_splits(Path(root)) else [])]
    splits = dict(zip(names_of, open_splits(Path(root), names_of)))
    train = splits[train_split]
    names = list(train.columns if columns is None else columns)
    for split in splits.values():
        check_columns(split, names, "dataset.columns")
        check_columns(split, [target], "dataset.target")
    images = bool(train.image_columns & set(names))
    train_transform, val_transform = image_transforms(image_size, channels, augment, crop_scale, color_jitter, mean,
                                                      std) if images else (None, None)
    info = target_info(list(splits.values()), target)
    if images:
        height, width = (int(x) for x in image_size)
        info.update(in_channels=channels, image_size=[height, width], num_features=channels * height * width)
    inputs = [name for name in names if name != target]
    if not images and len(inputs) == 1 and inputs[0] in train.vector_columns and len(train):  # a feature vector
        info["num_features"] = len(train.values(0, inputs)[0][0])
    stacked = _number_columns(train, names, target, features)
    if stacked:
        info["num_features"] = len(stacked)

    def samples_of(split: ArrowSplit, transform: Callable | None) -> Dataset:
        samples = ArrowSamples(split, names, transform)
        return StackedColumns(samples, names, stacked) if stacked else samples

    samples = {name: samples_of(split, train_transform if name == train_split else val_transform)
               for name, split in splits.items()}
    if held_out:  # val_size rows of the train split, each class in its share where the target is a class
        labels = torch.tensor(column(train, target)) if "num_classes" in info else torch.zeros(len(train))
        indices = stratified_holdout(labels, val_size, split_seed, "arrow")
        samples[train_split], samples[val_split] = (Subset(samples_of(train, transform), index.tolist())
                                                    for transform, index in zip((train_transform, val_transform),
                                                                                indices))
    fields = ("features", *(name for name in names if name not in stacked)) if stacked else tuple(names)
    return DataSplits(train=samples[train_split], val=samples[val_split], test=samples.get(test_split), info=info,
                      fields=fields, target=target)


def _number_columns(split: ArrowSplit, names: Sequence[str], target: str,
                    features: Sequence[str] | str | None) -> list[str]:
    """The columns `dataset.features` stacks: columns of single numbers among the sample's, not the target."""
    import pyarrow as pa

    if features is None:
        return []
    types = {name: split.schema.field(name).type for name in names}
    numbers = [name for name in names if name != target and (pa.types.is_integer(types[name])
                                                              or pa.types.is_floating(types[name]))]
    stacked = numbers if features == "all" else [features] if isinstance(features, str) else list(features)
    if not stacked:
        raise ValueError(f"dataset.features={features} names no column of single numbers (the sample's, but the "
                         f"target: {', '.join(numbers) or 'none'}); list some, or all, or leave it null")
    if others := [name for name in stacked if name not in numbers]:
        raise ValueError(f"dataset.features: {', '.join(map(repr, others))} is the target or not a column of single "
                         f"numbers; the sample's columns of single numbers: {', '.join(numbers) or 'none'}")
    if "features" in names and "features" not in stacked:
        raise ValueError(f"{split.folder} has a column named features: list it in dataset.features, or leave that null")
    return stacked


class StackedColumns(Dataset):
    """Samples (tuples of `columns`' values) whose `stacked` values are one float32 vector, first; the others follow."""

    def __init__(self, samples: Dataset, columns: Sequence[str], stacked: Sequence[str]) -> None:
        self.samples, self.stacked = samples, [list(columns).index(name) for name in stacked]
        self.others = [index for index, name in enumerate(columns) if name not in stacked]

    def __len__(self) -> int:
        return len(self.samples)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple:
        values = self.samples[index]
        return torch.tensor([values[i] for i in self.stacked], dtype=torch.float32), *(values[i] for i in self.others)


def _class_folders(folder: Path, transform: Callable, otherwise: str = "") -> ImageFolder:
    """torchvision ImageFolder on `folder`, with a one-line error if it is missing or empty."""
    from torchvision.datasets import ImageFolder

    if not folder.is_dir():
        raise DatasetNotFoundError(f"image folder {folder} not found: put images in {folder}/<class_name>/"
                                   + (f", {otherwise}" if otherwise else ""))
    try:
        return ImageFolder(str(folder), transform=transform, loader=read_image)
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
