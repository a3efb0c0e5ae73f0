"""Mixed precision: the autocast dtype of each `trainer.precision` and the autocast context.

The allowed values are declared with the setting (src/config/schema.py, `PRECISIONS`) and checked
when the run starts; here each one gets its dtype.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

PRECISIONS: dict[str, torch.dtype | None] = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}


def autocast_dtype(precision: Any) -> torch.dtype | None:
    """The autocast dtype for a checked `trainer.precision` (32 -> None: autocast off)."""
    return PRECISIONS[str(precision)]


def autocast(device: torch.device, dtype: torch.dtype | None) -> ContextManager[Any]:
    """Mixed precision for the block when `dtype` is set, else nothing."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
