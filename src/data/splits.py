"""What every dataset builder returns: the train, val and (optional) test splits, what the data provides, and what
its samples hold."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
