"""What every dataset builder returns: its train, val and (optional) test splits, what they provide and hold."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image
from torch.utils.data import Dataset

from src.common.errors import UsageError


@dataclass(frozen=True)
class DataSplits:
    """A dataset's splits (`test`: None if it has none), what it provides (`info`) and its samples' parts: `fields`
    (tuple positions or dict keys; None: unnamed) and the `target` field (None: the last)."""

    train: Dataset
    val: Dataset
    info: Mapping[str, Any]
    fields: tuple[str, ...] | None = None
    target: str | None = None
    test: Dataset | None = None

    def __post_init__(self) -> None:
        if self.fields is not None:
            object.__setattr__(self, "fields", tuple(self.fields))  # a list from a fork's builder too
        if self.fields is not None and len(set(self.fields)) != len(self.fields):
            raise ValueError(f"DataSplits.fields must be distinct names, got {self.fields}")
        if self.target is not None and self.fields is not None and self.target not in self.fields:
            raise ValueError(f"DataSplits.target={self.target!r} is not one of its fields {self.fields}")


IMAGE_FIELDS = {"fields": ("image", "label"), "target": "label"}  # (image, class label) samples


def image_info(num_classes: int, channels: int, height: int, width: int) -> dict[str, Any]:
    return {"num_classes": num_classes, "in_channels": channels, "image_size": [height, width],
            "num_features": channels * height * width}


class DatasetNotFoundError(UsageError, RuntimeError):
    """The dataset's files are missing, unreadable or could not be downloaded."""


class UnreadableSampleError(UsageError):
    """A sample that cannot be read (a damaged image file, a corrupt record) in one line naming it; rebuilt from the
    copy a DataLoader re-raises for its worker (its last line). Only the rank whose sampler holds the sample finds it,
    so that rank prints it (`local`)."""

    local = True

    def __init__(self, message: str) -> None:
        if "Original Traceback" in message:
            message = message.rstrip().splitlines()[-1].split(": ", 1)[-1]
        super().__init__(message)


def read_image(path: str) -> Image.Image:
    """An image file decoded in full to RGB, as torchvision's ImageFolder reads it, or one line naming the file."""
    try:
        with open(path, "rb") as file, Image.open(file) as image:
            return image.convert("RGB")
    except (OSError, SyntaxError, ValueError) as error:  # PIL's damaged, truncated and unknown files
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        raise UnreadableSampleError(f"{Path(path).resolve()} is not a readable image ({reason}): replace or remove it "
                                    "(python -m src.data.convert check-images ROOT lists every such file)") from None
