"""Speed knobs set once at run start (how well a run then uses its GPUs: src/callbacks/utilization.py).

- `set_backend_flags`: TF32 matmuls/convolutions (`trainer.tf32`) and cuDNN's algorithm choice
  (`trainer.deterministic`: reproducible algorithms; otherwise cudnn.benchmark picks the fastest).
- `with_memory_format`: `trainer.channels_last` puts the weights and every input batch in NHWC.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def set_backend_flags(device: torch.device, tf32: bool, deterministic: bool) -> None:
    """TF32 for fp32 matmuls and convolutions (Ampere+ GPUs; no effect on the CPU), and cuDNN's
    algorithm choice: deterministic ones, or the fastest found by benchmarking each input shape."""
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = device.type == "cuda" and not deterministic


def with_memory_format(model: nn.Module, channels_last: bool) -> nn.Module:
    """`model` with NHWC (channels_last) weights and inputs if asked, else unchanged.

    The inputs are converted by a forward pre-hook, so every batch that reaches the model is NHWC,
    in training and evaluation and whichever loader produced it. Call before DDP wraps the model.
    """
    if not channels_last:
        return model
    model.register_forward_pre_hook(_channels_last_inputs)
    return model.to(memory_format=torch.channels_last)


def _channels_last_inputs(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Every 4-D (N, C, H, W) positional input in NHWC; other inputs as they are."""
    return tuple(arg.contiguous(memory_format=torch.channels_last) if isinstance(arg, torch.Tensor) and arg.dim() == 4
                 else arg for arg in args)


def compiled(model: nn.Module, enabled: bool) -> nn.Module:
    """`model` wrapped in torch.compile (`trainer.compile`), or itself."""
    return torch.compile(model) if enabled else model
