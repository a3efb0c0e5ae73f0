"""Tasks: what a batch means, what the loss is, and which sums the metrics are made of.

A task is a small object named by `conf/task/<name>.yaml`. The loop asks it four things:
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

Adding a task is one subclass (here or in any importable module) plus one YAML.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Union

import torch
import torch.nn.functional as F

from src.errors import UsageError

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
        return {"loss": _ratio(sums["loss"], sums["count"])}


class Classification(Task):
    """Cross-entropy over `num_classes` logits; accuracy, and a confusion matrix on the val split."""

    metric_names = ("loss", "acc")
    monitor, mode = "val/acc", "max"
    needs = ("num_classes", "class labels")

    def __init__(self, label_smoothing: float = 0.0, **options: Any) -> None:
        super().__init__(**options)  # inputs, target, monitor, mode
        self.label_smoothing = label_smoothing

    def loss(self, outputs: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        loss = F.cross_entropy(outputs.float(), target, reduction="sum", label_smoothing=self.label_smoothing)
        return loss, target.shape[0]

    def sum_shapes(self, info: Mapping[str, Any]) -> Shapes:
        return {"correct": ()}

    def sums(self, outputs: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"correct": (outputs.argmax(dim=1) == target).sum()}

    def val_sum_shapes(self, info: Mapping[str, Any]) -> Shapes:
        classes = int(info["num_classes"])
        return {"confusion": (classes, classes)}

    def val_sums(self, outputs: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        # Cell (true, predicted) is bin true * C + predicted: one bincount per batch, on the device.
        classes = outputs.shape[1]
        cells = torch.bincount(target * classes + outputs.argmax(dim=1), minlength=classes * classes)
        return {"confusion": cells.view(classes, classes)}

    def compute(self, sums: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        result = {**super().compute(sums), "acc": _ratio(sums["correct"], sums["count"])}
        if "confusion" in sums:
            result["confusion"] = sums["confusion"].round().long()  # rows: true class; columns: predicted
        return result


class Binary(Task):
    """One logit per sample, BCE-with-logits (a sigmoid folded into the loss, numerically stable);
    accuracy, precision, recall and F1 of the positive class at probability 0.5 (logit 0)."""

    metric_names = ("loss", "acc", "precision", "recall", "f1")
    monitor, mode = "val/f1", "max"

    def __init__(self, pos_weight: float | None = None, **options: Any) -> None:
        super().__init__(**options)  # inputs, target, monitor, mode
        self.pos_weight = pos_weight

    def check(self, info: Mapping[str, Any]) -> str | None:
        if info.get("num_classes") != 2:
            return "needs two classes (num_classes=2, labels 0/1)"
        return None

    def num_outputs(self, info: Mapping[str, Any]) -> int:
        return 1

    def loss(self, outputs: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        logits, labels = _binary(outputs, target)
        if self.pos_weight is None:
            return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum"), labels.shape[0]
        # torch's pos_weight scales the positive term; for 0/1 labels that is a weight of pos_weight on
        # positive samples, made here from the labels with no tensor built from a Python number per step.
        per_sample = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
        return (per_sample * (1 + (self.pos_weight - 1) * labels)).sum(), labels.shape[0]

    def sum_shapes(self, info: Mapping[str, Any]) -> Shapes:
        return {"tp": (), "fp": (), "fn": ()}

    def sums(self, outputs: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        logits, labels = _binary(outputs, target)
        predicted, actual = logits > 0, labels > 0.5
        return {"tp": (predicted & actual).sum(), "fp": (predicted & ~actual).sum(), "fn": (~predicted & actual).sum()}

    def compute(self, sums: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        tp, fp, fn, count = (float(sums[name]) for name in ("tp", "fp", "fn", "count"))
        tn = count - tp - fp - fn
        # No positive prediction (or no positive sample): precision (recall) is 0, as in scikit-learn.
        return {
            **super().compute(sums),
            "acc": (tp + tn) / count if count else math.nan,
            "precision": tp / (tp + fp) if tp + fp else 0.0,
            "recall": tp / (tp + fn) if tp + fn else 0.0,
            "f1": 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0,
        }


def _binary(outputs: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 logits, float32 0/1 labels), one per sample, from outputs (N,) or (N, 1)."""
    return outputs.float().reshape(target.shape[0]), target.float().reshape(target.shape[0])


class Regression(Task):
    """Real-valued targets of `num_targets` values per sample; `loss`: l1 | mse (per sample: the mean
    over its values). Metrics: mae, rmse and r2 over all values, from sums, so exact on any world size.
    r2 is 1 - SSE / SST with SST taken around each output's own mean (scikit-learn's
    variance-weighted r2; with one output, the usual r2)."""

    metric_names = ("loss", "mae", "rmse", "r2")
    monitor, mode = "val/mae", "min"
    needs = ("num_targets", "real-valued targets")
    LOSSES = ("l1", "mse")

    def __init__(self, loss: str = "mse", **options: Any) -> None:
        super().__init__(**options)  # inputs, target, monitor, mode
        if loss not in self.LOSSES:
            raise UsageError(f"task.loss={loss} is not one of {', '.join(self.LOSSES)}")
        self.loss_name = loss

    def loss(self, outputs: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        predicted, actual = _as_rows(outputs, target)
        error = predicted - actual
        per_value = error.abs() if self.loss_name == "l1" else error.square()
        return per_value.mean(dim=1).sum(), actual.shape[0]

    def sum_shapes(self, info: Mapping[str, Any]) -> Shapes:
        width = (int(info["num_targets"]),)
        return {"abs_error": (), "squared_error": width, "target": width, "target_squared": width}

    def sums(self, outputs: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        predicted, actual = _as_rows(outputs.detach(), target)
        error = predicted - actual
        return {"abs_error": error.abs().sum(), "squared_error": error.square().sum(dim=0),
                "target": actual.sum(dim=0), "target_squared": actual.square().sum(dim=0)}

    def compute(self, sums: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        count = float(sums["count"])
        values = count * sums["target"].numel()
        sse = sums["squared_error"]
        sst = sums["target_squared"] - sums["target"].square() / count if count else sse
        return {
            **super().compute(sums),
            "mae": float(sums["abs_error"]) / values if values else math.nan,
            "rmse": math.sqrt(float(sse.sum()) / values) if values else math.nan,
            "r2": 1 - float(sse.sum()) / float(sst.sum()) if values and float(sst.sum()) > 0 else math.nan,
        }


def _as_rows(outputs: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs and targets as float32 (N, values) matrices: a target of shape (N,) is one value a sample."""
    rows = target.shape[0]
    predicted, actual = outputs.float().reshape(rows, -1), target.float().reshape(rows, -1)
    if predicted.shape != actual.shape:  # (N, 1) against (N, 3) would broadcast into nonsense
        raise UsageError(f"the model gives {predicted.shape[1]} outputs per sample but the target has "
                         f"{actual.shape[1]} values: build the model with ${{data:num_outputs}} outputs")
    return predicted, actual


def _ratio(total: torch.Tensor, count: torch.Tensor) -> float:
    return float(total) / float(count) if float(count) > 0 else math.nan
