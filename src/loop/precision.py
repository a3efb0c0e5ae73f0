"""Mixed precision: the autocast dtype of each `trainer.precision` and the autocast context.

Each allowed value of the setting gets its dtype.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

from src.common.errors import UsageError

PRECISIONS: dict[str, torch.dtype | None] = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}


def autocast_dtype(precision: Any) -> torch.dtype | None:
    """The autocast dtype for `trainer.precision` (32 -> None: autocast off)."""
    key = str(precision)
    if key not in PRECISIONS:
        raise UsageError(f"trainer.precision={precision} is not one of 32, bf16, 16")
    return PRECISIONS[key]


def autocast(device: torch.device, dtype: torch.dtype | None) -> ContextManager[Any]:
    """Mixed precision for the block when `dtype` is set, else nothing."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
