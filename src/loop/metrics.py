"""Metric sums that are exact under DDP.

A task (src/components/tasks.py) names the sums its metrics are made of: every task has `loss` (summed
per-sample losses) and `count` (samples); classification adds `correct`, regression absolute and
squared errors, and so on. Each rank adds its batches' sums on its device, with no host sync per
step. `reduce()` all-reduces every sum in ONE collective (they are slices of one float64
vector), so a metric computed from the result is the exact value over every rank's samples: not a
mean of per-rank means, not rank 0's value. Sums are saved and restored by name, so a checkpoint
taken mid-epoch resumes the epoch's metrics on any world size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from src.common.errors import UsageError
from src.parallel.distributed import all_reduce_sum

BASE_SHAPES: dict[str, tuple[int, ...]] = {"loss": (), "count": ()}


class MetricSums:
    """Running sums, by name, over the batches seen since the last `reset()`.

    float64 keeps sums of thousands of per-sample losses exact enough to compare runs of different
    world sizes to 1e-6, and holds integer counts exactly up to 2**53.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], device: torch.device) -> None:
        self.shapes = {**BASE_SHAPES, **shapes}
        self._offsets: dict[str, slice] = {}
        start = 0
        for name, shape in self.shapes.items():
            size = math.prod(shape)
            self._offsets[name] = slice(start, start + size)
            start += size
        self._vector = torch.zeros(start, dtype=torch.float64, device=device)
        # Views into the one vector: adding to a view adds to the vector.
        self._views = {name: self._vector[where].view(self.shapes[name]) for name, where in self._offsets.items()}

    def reset(self) -> None:
        self._vector.zero_()

    @torch.no_grad()
    def add(self, sums: Mapping[str, torch.Tensor | float]) -> None:
        """Add a batch's sums (device tensors or numbers); names this accumulator does not track are ignored."""
        for name, value in sums.items():
            view = self._views.get(name)
            if view is not None:
                view += value.detach() if isinstance(value, torch.Tensor) else value

    def totals(self) -> torch.Tensor:
        """This rank's sums as one vector (a copy): a window's baseline, or what `reduce` all-reduces."""
        return self._vector.clone()

    def reduce(self, baseline: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Every sum over all ranks (since `baseline`, if given), as float64 CPU tensors by name.

        A collective: call it on every rank.
        """
        vector = self.totals() if baseline is None else self._vector - baseline
        reduced = all_reduce_sum(vector).cpu()
        return {name: reduced[where].view(self.shapes[name]) for name, where in self._offsets.items()}

    def state_dict(self) -> dict[str, list[float]]:
        """All ranks' sums by name (a collective): what a checkpoint keeps of an unfinished epoch."""
        return {name: value.flatten().tolist() for name, value in self.reduce().items()}

    def load_state_dict(self, saved: Mapping[str, list[float]]) -> None:
        """Add sums saved by `state_dict` (on one rank only, or they count twice)."""
        if set(saved) != set(self.shapes):
            raise UsageError(
                f"the checkpoint's metric sums ({', '.join(saved)}) are not this task's ({', '.join(self.shapes)}): "
                "resume with the task it was saved with"
            )
        for name, values in saved.items():
            saved_sum = torch.tensor(values, dtype=torch.float64).view(self.shapes[name])
            self._views[name] += saved_sum.to(self._vector.device)
