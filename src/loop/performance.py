"""Speed settings, applied once at run start: mixed precision (`trainer.precision`), TF32 and cuDNN's algorithm
choice, channels_last (trainer.compile: src/loop/task_and_model.py)."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch
from torch import nn

# Each allowed `trainer.precision` (src/config/schema.py checks the value) and its autocast dtype.
PRECISIONS: dict[str, torch.dtype | None] = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}


def autocast_dtype(precision: Any) -> torch.dtype | None:
    """The autocast dtype for a checked `trainer.precision` (32 -> None: autocast off)."""
    return PRECISIONS[str(precision)]


def autocast(device: torch.device, dtype: torch.dtype | None) -> ContextManager[Any]:
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def set_backend_flags(device: torch.device, tf32: bool, deterministic: bool) -> None:
    """TF32 matmuls and convolutions (`trainer.tf32`); cuDNN's deterministic algorithms, or its benchmarked fastest."""
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = device.type == "cuda" and not deterministic


def with_memory_format(model: nn.Module, channels_last: bool) -> nn.Module:
    """`model` with NHWC weights and 4-D inputs (by a forward pre-hook) if asked. Call before DDP wraps it."""
    if not channels_last:
        return model
    model.register_forward_pre_hook(_channels_last_inputs)
    return model.to(memory_format=torch.channels_last)


def _channels_last_inputs(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(arg.contiguous(memory_format=torch.channels_last) if isinstance(arg, torch.Tensor) and arg.dim() == 4
                 else arg for arg in args)
