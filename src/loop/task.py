"""The task contract: what the loop asks of a task. Concrete tasks live in src/components/tasks.py.

The loop asks a task four things:
- `split(batch)`: the model's inputs (positional and keyword) and the target, picked out of a
  batch of any structure (tuple, list or dict of tensors) by the `inputs` and `target` keys;
- `loss(outputs, target)`: the loss as a SUM over the batch's samples, and their count, so the
  loop can average over the global batch exactly, whatever the world size;
- `sums(...)`: the batch's metric sums by name (device tensors, no host sync), which the loop
  accumulates and all-reduces in one collective and saves by name for a mid-epoch resume;
- `compute(sums)`: the metrics, from the sums over all ranks: exact on any world size.

It also says what it needs of a dataset (`check`), how wide the model's output must be
(`num_outputs`, what `${data:num_outputs}` gives a model YAML), and which metric decides
`best.pt` by default (`monitor`, `mode`, declared in its YAML).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Union

import torch

Key = Union[int, str]  # an index into a tuple/list batch, or a key of a dict batch
Shapes = dict[str, tuple[int, ...]]


class Task:
    """The base: batch structure and monitored metric; subclasses add the loss and metrics.

    `inputs`: the batch parts passed to the model, a list (positional: `model(b[0], b[1])`) or a
    mapping of argument name to part (keywords: `model(rgb=b["rgb"])`). `target`: the part the
    loss compares the model's output with. `monitor`/`mode`: the metric (`val/<name>` or
    `train/<name>`, a name in `metric_names`) that decides best.pt and what sweeps optimise.
    """

    metric_names: tuple[str, ...] = ("loss",)  # what compute() returns (besides "count")
    monitor = "val/loss"  # the default monitored metric and mode, unless the YAML names others
    mode = "min"

    def __init__(
        self, inputs: Sequence[Key] | Mapping[str, Key] = (0,), target: Key = 1, monitor: str | None = None,
        mode: str | None = None,
    ) -> None:
        self.inputs = inputs
        self.target = target
        self.monitor = monitor or type(self).monitor
        self.mode = mode or type(self).mode

    # -- batches --------------------------------------------------------------------------------

    def split(self, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """(positional inputs, keyword inputs, target) of `batch`."""
        if isinstance(self.inputs, Mapping):
            return (), {name: batch[key] for name, key in self.inputs.items()}, batch[self.target]
        return tuple(batch[key] for key in self.inputs), {}, batch[self.target]

    # -- what the task needs of the dataset --------------------------------------------------------

    # The info field the task learns from, and what it means: its value is the model's output width.
    needs: tuple[str, str] | None = None

    def check(self, info: Mapping[str, Any]) -> str | None:
        """What makes a dataset with this `info` unfit for the task (None: it fits)."""
        if self.needs is not None and self.needs[0] not in info:
            return f"needs {self.needs[1]} ({self.needs[0]})"
        return None

    def num_outputs(self, info: Mapping[str, Any]) -> int:
        """The width of the model output the task expects, for a dataset with this `info`."""
        if self.needs is None:
            raise NotImplementedError(f"{type(self).__name__} names no `needs` field: define num_outputs()")
        return int(info[self.needs[0]])

    # -- loss and metrics ------------------------------------------------------------------------

    def loss(self, outputs: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(loss summed over the batch's samples, in float32; the number of samples)."""
        raise NotImplementedError

    def sum_shapes(self, info: Mapping[str, Any]) -> Shapes:
        """Name and shape of every metric sum (besides `loss` and `count`, which every task has)."""
        return {}

    def sums(self, outputs: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        """This batch's metric sums, named as in `sum_shapes` (detached device tensors, no host sync)."""
        return {}

    def batch_sums(self, outputs: torch.Tensor, target: torch.Tensor, loss_sum: torch.Tensor, count: int,
                   val: bool = False) -> dict[str, torch.Tensor | int]:
        """Everything a batch adds to the running sums: `loss` (the `loss()` sum), `count`, the task's sums,
        and with `val` its val-only sums. What the loop and evaluation accumulate, one call each."""
        with torch.no_grad():
            extra = self.val_sums(outputs, target) if val else {}
            return {"loss": loss_sum.detach(), "count": count, **self.sums(outputs.detach(), target), **extra}

    def val_sum_shapes(self, info: Mapping[str, Any]) -> Shapes:
        """Sums counted on the val split only (e.g. a confusion matrix), beside `sum_shapes`."""
        return {}

    def val_sums(self, outputs: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    def compute(self, sums: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Metrics from the sums over all ranks (float64 CPU tensors): `loss` and `metric_names`,
        plus tables (tensors, e.g. `confusion`) the reporter shows as they are."""
        return {"loss": ratio(sums["loss"], sums["count"])}


def ratio(total: torch.Tensor, count: torch.Tensor) -> float:
    """total / count as a float (NaN when nothing was counted)."""
    return float(total) / float(count) if float(count) > 0 else math.nan
