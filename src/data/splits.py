"""What every dataset builder returns: the train and val splits and what the data provides."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset

from src.common.errors import UsageError


@dataclass(frozen=True)
class DataSplits:
    """A dataset's train and val splits and what it provides (`info`: shapes, class count, ...)."""

    train: Dataset
    val: Dataset
    info: Mapping[str, Any]


def image_info(num_classes: int, channels: int, height: int, width: int) -> dict[str, Any]:
    """What an image classification dataset provides: the image shape, its size flattened (for MLPs)
    and the class count."""
    return {"num_classes": num_classes, "in_channels": channels, "image_size": [height, width],
            "num_features": channels * height * width}


class DatasetNotFoundError(UsageError, RuntimeError):
    """The dataset's files are missing, unreadable or could not be downloaded.

    The message is one line naming the folder and the files to put there; as a `UsageError`
    it is shown to the user without a traceback.
    """
