"""Batches of any structure: a tensor, or a tuple, list or dict of them (nested as deep as you like)."""

from __future__ import annotations

from typing import Any, Callable

import torch


def tree_map(function: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """`batch` with `function` applied to every tensor in it, the structure kept; other leaves as they are."""
    if isinstance(batch, torch.Tensor):
        return function(batch)
    if isinstance(batch, dict):
        return {key: tree_map(function, value) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple takes its fields as arguments
        return type(batch)(*(tree_map(function, value) for value in batch))
    return type(batch)(tree_map(function, value) for value in batch) if isinstance(batch, (list, tuple)) else batch


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of `batch` on `device` (non-blocking: pinned host memory copies asynchronously)."""
    return tree_map(lambda tensor: tensor.to(device, non_blocking=True), batch)
