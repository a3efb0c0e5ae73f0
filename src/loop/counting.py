"""The divisor of a step's loss: the global count of the task's units, over every rank and micro-step.

A task's loss is a SUM over the units its `count()` counts (src/loop/task.py: samples, tokens, pixels). The
gradient of an optimizer step must be the mean over every unit of the global batch: the sum of `loss_sum[r, m]`
over ranks r and micro-steps m, divided by the global count G, the sum of `count[r, m]`. DDP and FSDP average
gradients over the W ranks, so each rank back-propagates `loss_sum * W / G` of each micro-step.

- Samples (`count()` a host int): every rank's micro-batches hold the same number of samples (the global-batch
  sampler's equal slices), so G / W is this rank's own count summed over its micro-steps. No communication,
  and the arithmetic of runs before counts were named: `loss_sum / (count x grad_accum)`, the same bits.
- A count that depends on the data (a device tensor: tokens that are not padding, labelled pixels): the step's
  local counts are summed on the device and all-reduced asynchronously, launched before the first forward and
  waited for before the first backward, so the collective overlaps the forward and the host never waits on
  the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from src.parallel.distributed import is_initialized


def start_all_reduce(tensor: torch.Tensor) -> dist.Work | None:
    """Launch the sum of `tensor` over all ranks, in place; returns the pending work (None in one process)."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True) if is_initialized() else None


class StepDivisor:
    """Turns each micro-step's summed loss into the share of the step's global mean that it back-propagates.

    Build it from the counts of all the step's micro-batches on this rank, before the first forward; call it
    with each micro-step's loss sum. A collective when the counts are tensors: every rank builds one per step.
    """

    def __init__(self, counts: Sequence[int | torch.Tensor], world_size: int) -> None:
        self.counts = list(counts)
        self.world_size = world_size
        self.local: int | None = None  # samples: this rank's count over the step, the same on every rank
        self.global_count: torch.Tensor | None = None
        self._pending: dist.Work | None = None
        self._scale: torch.Tensor | None = None
        if all(isinstance(count, int) for count in self.counts):
            self.local = sum(self.counts)  # type: ignore[arg-type]
            return
        device = next(count.device for count in self.counts if isinstance(count, torch.Tensor))
        self.global_count = torch.stack([torch.as_tensor(count, device=device, dtype=torch.int64)
                                         for count in self.counts]).sum()
        self._pending = start_all_reduce(self.global_count)

    def __call__(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The loss to back-propagate for one micro-step whose loss, summed over its units, is `loss_sum`."""
        if self.local is not None:
            return loss_sum / self.local
        if self._scale is None:
            if self._pending is not None:
                self._pending.wait()  # queues the wait on the device stream: no host sync on GPUs
            # A step whose micro-batches hold no unit at all (every target padding) adds nothing.
            self._scale = (self.world_size / self.global_count.clamp(min=1).double()).to(loss_sum.dtype)
        return loss_sum * self._scale
