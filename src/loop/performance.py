"""Speed knobs set once at run start (how well a run then uses its GPUs: src/callbacks/utilization.py).

- `set_backend_flags`: TF32 matmuls/convolutions (`trainer.tf32`) and cuDNN's algorithm choice
  (`trainer.deterministic`: reproducible algorithms; otherwise cudnn.benchmark picks the fastest).
- `with_memory_format`: `trainer.channels_last` puts the weights and every input batch in NHWC.
- `reuse_host_memory`: `trainer.reuse_host_memory` keeps freed host memory in the process for the next step.
"""

from __future__ import annotations

import ctypes
import sys
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


# glibc's malloc: allocations from this size up get their own mapping, unmapped when freed (32 MB: the largest
# glibc accepts); free memory above this much at the heap's top goes back to the OS.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD, TRIM_THRESHOLD = 32 << 20, 256 << 20


def reuse_host_memory(enabled: bool) -> bool:
    """Keep freed host memory in the process for reuse (`trainer.reuse_host_memory`); returns whether it now is.

    By default glibc often hands freed buffers of a few MB (a batch, an activation, its gradient on the CPU) back
    to the OS, and the kernel must zero fresh pages for the next step's. A CPU run of the CNN on 16x16 images
    took 45-80 page faults per training sample that way, 1-2 with this, and trained 1.10x as many samples/s
    (benchmarks/DATA_PIPELINE.md). With mallopt's fixed thresholds the process keeps up to TRIM_THRESHOLD of
    freed memory and reuses it (torch's CPU launcher, torch.backends.xeon.run_cpu, sets jemalloc up alike).
    Set once per process, inherited by DataLoader workers forked afterwards; a no-op without glibc (macOS,
    Windows, musl), and `false` leaves the allocator as it is."""
    if not enabled or not sys.platform.startswith("linux"):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the process's own symbols: its C library's
    if mallopt is None:
        return False
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1


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
