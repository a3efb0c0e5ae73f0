"""Tasks: what the loss is, over which unit, what the model's output must look like, and which sums the
metrics are made of. Classification, binary and regression count samples; causal_lm counts tokens, segmentation
pixels.

A task is a subclass of `src.loop.task.Task` (the contract the loop relies on, documented there)
named by `conf/task/<name>.yaml`. Adding a task is one subclass (here or in any importable module)
plus one YAML. Which of a batch's fields are the model's inputs and the target is bound from the
dataset's named fields (or the task's `inputs` and `target`) by the base class.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from src.common.errors import UsageError
from src.loop.task import Shapes, Task, ratio, shape


class Classification(Task):
    """Cross-entropy over `num_classes` logits; accuracy, and a confusion matrix on the val split."""

    metric_names = ("loss", "acc")
    monitor, mode = "val/acc", "max"
    needs = ("num_classes", "class labels")

    def __init__(self, label_smoothing: float = 0.0, **options: Any) -> None:
        super().__init__(**options)  # inputs, target, monitor, mode
        self.label_smoothing = label_smoothing

    def loss(self, outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.float(), target, reduction="sum", label_smoothing=self.label_smoothing)

    def check_output(self, outputs: torch.Tensor, target: torch.Tensor) -> None:
        _one_tensor(outputs, "classification", "logits of shape (N, num_classes)")
        rows, classes = target.shape[0] if target.dim() else 0, self.output_width or "num_classes"
        if target.dim() != 1 or target.is_floating_point():
            raise UsageError(
                f"task=classification takes one class index per sample (int64 targets of shape (N,)), but the target "
                f"holds {str(target.dtype).removeprefix('torch.')} of shape {shape(target)} (the model returns "
                f"{shape(outputs)}): for a class per pixel (masks of shape (N, H, W)) use task=segmentation, for a "
                "class per token task=causal_lm, or a dataset whose target is one class label per sample"
            )
        width = self.output_width or (outputs.shape[1] if outputs.dim() == 2 else None)
        if outputs.dim() != 2 or outputs.shape[0] != rows or outputs.shape[1] != width:
            raise UsageError(
                f"task=classification takes logits of shape (N, num_classes) = ({rows}, {classes}) for targets of "
                f"shape {shape(target)}, but the model returns {shape(outputs)}: build it with "
                f"{self.output_setting}={classes} (its YAML's ${{data:num_outputs}})"
            )

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
        result = {**super().compute(sums), "acc": ratio(sums["correct"], sums["count"])}
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

    def loss(self, outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits, labels = _binary(outputs, target)
        if self.pos_weight is None:
            return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        # torch's pos_weight scales the positive term; for 0/1 labels that is a weight of pos_weight on
        # positive samples, made here from the labels with no tensor built from a Python number per step.
        per_sample = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
        return (per_sample * (1 + (self.pos_weight - 1) * labels)).sum()

    def check_output(self, outputs: torch.Tensor, target: torch.Tensor) -> None:
        _one_tensor(outputs, "binary", "one logit per sample")
        rows = target.shape[0] if target.dim() else 0
        if target.dim() == 0 or target.numel() != rows:
            raise UsageError(f"task=binary takes one 0/1 label per sample (a target of shape (N,) or (N, 1)), but the "
                             f"target has shape {shape(target)}: choose a dataset of one label per sample")
        if outputs.dim() == 0 or outputs.shape[0] != rows or outputs.numel() != rows:
            raise UsageError(f"task=binary takes one logit per sample, (N,) or (N, 1) = ({rows}, 1) for targets of "
                             f"shape {shape(target)}, but the model returns {shape(outputs)}: build it with "
                             f"{self.output_setting}=1 (its YAML's ${{data:num_outputs}} gives 1)")

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

    def loss(self, outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        predicted, actual = _as_rows(outputs, target, self.output_setting)
        error = predicted - actual
        per_value = error.abs() if self.loss_name == "l1" else error.square()
        return per_value.mean(dim=1).sum()

    def check_output(self, outputs: torch.Tensor, target: torch.Tensor) -> None:
        _one_tensor(outputs, "regression", "predictions of shape (N, values)")
        if not target.is_floating_point():
            raise UsageError(f"task=regression learns real-valued targets, but the target holds "
                             f"{str(target.dtype).removeprefix('torch.')} (class labels?): use task=classification "
                             "or task=binary, or a dataset of real-valued targets")
        if target.dim() > 2:
            raise UsageError(f"task=regression takes targets of shape (N,) or (N, values), but the target has shape "
                             f"{shape(target)}: flatten each sample's values in the dataset")
        if outputs.dim() == 0 or outputs.shape[0] != target.shape[0] or outputs.dim() > 2:
            values = target.shape[1] if target.dim() == 2 else 1
            raise UsageError(f"task=regression takes outputs of shape (N, values) = ({target.shape[0]}, {values}) for "
                             f"targets of shape {shape(target)}, but the model returns {shape(outputs)}: build it "
                             f"with {self.output_setting}={values} (its YAML's ${{data:num_outputs}})")
        _as_rows(outputs, target, self.output_setting)

    def sum_shapes(self, info: Mapping[str, Any]) -> Shapes:
        width = (int(info["num_targets"]),)
        return {"abs_error": (), "squared_error": width, "target": width, "target_squared": width}

    def sums(self, outputs: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        predicted, actual = _as_rows(outputs.detach(), target, self.output_setting)
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


def _as_rows(outputs: torch.Tensor, target: torch.Tensor, setting: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs and targets as float32 (N, values) matrices: a target of shape (N,) is one value a sample."""
    rows = target.shape[0]
    predicted, actual = outputs.float().reshape(rows, -1), target.float().reshape(rows, -1)
    if predicted.shape != actual.shape:  # (N, 1) against (N, 3) would broadcast into nonsense
        raise UsageError(f"the model gives {predicted.shape[1]} outputs per sample but the target has "
                         f"{actual.shape[1]} values: build the model with {setting}={actual.shape[1]} (its YAML's "
                         "${data:num_outputs})")
    return predicted, actual



class CausalLM(Task):
    """Next-token prediction: logits (N, T, vocab) for targets (N, T) of token ids, `ignore_index` where a
    sequence is padding. The unit is the token: the loss of a step is the sum over every rank's and
    micro-step's non-pad tokens divided by their number (`count` is a device tensor, summed by the loop
    without a host sync). Metrics per token: loss (nats), perplexity (exp of the loss) and accuracy."""

    metric_names = ("loss", "perplexity", "acc")
    monitor, mode = "val/loss", "min"
    unit = "tokens"
    needs = ("vocab_size", "token sequences")

    def __init__(self, ignore_index: int = -100, **options: Any) -> None:
        super().__init__(**options)  # inputs, target, monitor, mode
        self.ignore_index = ignore_index

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return (target != self.ignore_index).sum()

    def loss(self, outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.float().flatten(0, -2), target.flatten(), ignore_index=self.ignore_index,
                               reduction="sum")

    def check_output(self, outputs: torch.Tensor, target: torch.Tensor) -> None:
        _one_tensor(outputs, "causal_lm", "logits of shape (N, T, vocab_size)")
        if target.dim() != 2 or target.is_floating_point():
            raise UsageError(f"task=causal_lm takes token ids (int64 targets of shape (N, T)), but the target holds "
                             f"{str(target.dtype).removeprefix('torch.')} of shape {shape(target)}: choose a "
                             "dataset of token sequences")
        vocab = self.output_width or (outputs.shape[-1] if outputs.dim() == 3 else "vocab_size")
        if outputs.shape != (*target.shape, vocab):
            raise UsageError(f"task=causal_lm takes logits of shape (N, T, vocab_size) = ({target.shape[0]}, "
                             f"{target.shape[1]}, {vocab}) for targets of shape {shape(target)}, but the model "
                             f"returns {shape(outputs)}: build it with {self.output_setting}={vocab} (its YAML's "
                             "${data:num_outputs}) and logits in (batch, position, vocabulary) order")

    def sum_shapes(self, info: Mapping[str, Any]) -> Shapes:
        return {"correct": ()}

    def sums(self, outputs: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"correct": ((outputs.argmax(dim=-1) == target) & (target != self.ignore_index)).sum()}

    def compute(self, sums: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        loss = ratio(sums["loss"], sums["count"])
        perplexity = math.exp(loss) if loss < 700 else math.inf  # nan stays nan
        return {"loss": loss, "perplexity": perplexity, "acc": ratio(sums["correct"], sums["count"])}


class Segmentation(Task):
    """A class per pixel: logits (N, C, H, W) against masks (N, H, W) of class indices, `ignore_index` where a pixel
    is unlabelled. The unit is the labelled pixel: the loss of a step is the cross-entropy summed over every rank's
    and micro-step's labelled pixels divided by their number. Metrics from whole-split sums of each class's
    intersection and union, so exact on any world size: pixel accuracy, the IoU of each class (`iou_<c>`) and their
    mean over the classes that occur in the targets or predictions (`miou`). A model that returns a dict
    (torchvision's segmentation models) is read at `out`."""

    metric_names = ("loss", "acc", "miou")
    monitor, mode = "val/miou", "max"
    unit = "pixels"
    needs = ("num_classes", "class labels")

    def __init__(self, ignore_index: int = 255, **options: Any) -> None:
        super().__init__(**options)  # inputs, target, monitor, mode
        self.ignore_index = ignore_index

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return (target != self.ignore_index).sum()

    def loss(self, outputs: Any, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(_logits(outputs).float(), target, ignore_index=self.ignore_index, reduction="sum")

    def check_output(self, outputs: Any, target: torch.Tensor) -> None:
        if target.dim() != 3 or target.is_floating_point():
            raise UsageError(f"task=segmentation takes a class index per pixel (int64 masks of shape (N, H, W)), but "
                             f"the target holds {str(target.dtype).removeprefix('torch.')} of shape {shape(target)}: "
                             "choose a dataset of masks, or task=classification for one label per image")
        logits, classes = _one_tensor(_logits(outputs), "segmentation", "logits of shape (N, num_classes, H, W), or "
                                      "a dict of them as out"), self.output_width or "num_classes"
        n, height, width = target.shape
        if logits.dim() != 4 or (logits.shape[0], *logits.shape[2:]) != (n, height, width) or \
                logits.shape[1] != (self.output_width or logits.shape[1]):
            raise UsageError(f"task=segmentation takes logits of shape (N, num_classes, H, W) = ({n}, {classes}, "
                             f"{height}, {width}) for masks of shape {shape(target)}, but the model returns "
                             f"{shape(logits)}: build it with {self.output_setting}={classes} (its YAML's "
                             "${data:num_outputs}) and upsample its logits to the mask's size")

    def sum_shapes(self, info: Mapping[str, Any]) -> Shapes:
        classes = (int(info["num_classes"]),)
        return {"correct": (), "intersection": classes, "union": classes}

    def sums(self, outputs: Any, target: torch.Tensor) -> dict[str, torch.Tensor]:
        # Per-class counts by scatter_add into classes + 1 bins (the last: unlabelled pixels): no host sync.
        predicted, classes = _logits(outputs).argmax(dim=1), _logits(outputs).shape[1]
        labelled = target != self.ignore_index
        hit = (predicted == target) & labelled
        intersection = _class_counts(torch.where(hit, target, classes), classes)
        union = (_class_counts(torch.where(labelled, predicted, classes), classes)
                 + _class_counts(torch.where(labelled, target, classes), classes) - intersection)
        return {"correct": hit.sum(), "intersection": intersection, "union": union}

    def compute(self, sums: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        union = sums["union"]
        iou = torch.where(union > 0, sums["intersection"] / union.clamp(min=1), torch.nan)
        occurring = iou[union > 0]
        return {**super().compute(sums), "acc": ratio(sums["correct"], sums["count"]),
                "miou": float(occurring.mean()) if occurring.numel() else math.nan,
                **{f"iou_{index}": float(value) for index, value in enumerate(iou)}}


def _class_counts(index: torch.Tensor, classes: int) -> torch.Tensor:
    """How many of `index`'s entries hold each class 0 .. classes - 1 (the bin `classes` is dropped)."""
    flat = index.flatten()
    return torch.zeros(classes + 1, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))[:classes]


def _one_tensor(outputs: Any, task: str, holding: str) -> torch.Tensor:
    """`outputs` if it is one tensor; a UsageError naming what the model returned if not (a tuple, a dict)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    name = type(outputs).__name__
    returned = f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"
    if isinstance(outputs, Mapping):
        returned += f" of {', '.join(map(str, outputs))}"
    elif isinstance(outputs, (tuple, list)):
        parts = ", ".join(shape(part) if isinstance(part, torch.Tensor) else type(part).__name__ for part in outputs)
        returned += f" of {len(outputs)} ({parts})"
    raise UsageError(f"task={task} takes the model's output as one tensor ({holding}), but the model returns "
                     f"{returned}: return that tensor alone, or write a task whose loss and sums take this output "
                     "(docs/forking.md#add-a-task)")


def _logits(outputs: Any) -> torch.Tensor:
    """A segmentation model's logits: the tensor it returns, or its dict's `out` (torchvision's models)."""
    return outputs["out"] if isinstance(outputs, Mapping) and "out" in outputs else outputs
