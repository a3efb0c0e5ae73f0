"""Small dataset files in the real on-disk formats, written by tests (no network in CI)."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
from PIL import Image


def write_idx(path: Path, array: np.ndarray) -> None:
    """An idx file as in the MNIST release: magic 0x08 0x0N (uint8, N dims), big-endian dims, data."""
    magic = 0x0800 + array.ndim  # 2051 for images, 2049 for labels
    path.write_bytes(struct.pack(f">{1 + array.ndim}i", magic, *array.shape) + array.astype(np.uint8).tobytes())


def mnist_images(count: int) -> np.ndarray:
    """Image i is all i * 5, except a white top-left pixel."""
    images = np.repeat(np.arange(count, dtype=np.uint8) * 5, 28 * 28).reshape(count, 28, 28)
    images[:, 0, 0] = 255
    return images


def write_mnist(root: Path, folder_name: str, num_train: int = 30, num_test: int = 12) -> None:
    raw = root / folder_name / "raw"
    raw.mkdir(parents=True)
    for prefix, count in (("train", num_train), ("t10k", num_test)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", mnist_images(count))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", (np.arange(count) * 3) % 10)



def write_cifar10(root: Path, per_batch: int = 2) -> dict[str, tuple[np.ndarray, list[int]]]:
    """The python-version batches: pickled dicts of uint8 N x 3072 (RGB planes) and labels.

    The official files are Python 2 pickles whose str keys load as str with encoding="latin1"
    (torchvision's choice), so the keys are written as str here.
    """
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=per_batch).tolist()
        (folder / name).write_bytes(pickle.dumps({"data": data, "labels": labels}, protocol=2))
        batches[name] = (data, labels)
    label_names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": label_names}, protocol=2))
    return batches



def write_image_folder(root: Path, classes: dict[str, tuple[int, int, int]], splits=("train", "val")) -> None:
    """Two solid-colour 12x10 PNGs per class and split."""
    for split in splits:
        for name, colour in classes.items():
            folder = root / split / name
            folder.mkdir(parents=True)
            for index in range(2):
                Image.new("RGB", (12, 10), colour).save(folder / f"{index}.png")
