"""The task contract: what the loop asks of a task (concrete ones: src/components/tasks.py; a fork's method with its own
step: src/recipes/). A task trains the config's models (`models`; `output_model` is the one eval.py, export and EMA
take) and may read frozen auxiliary ones (`aux_models`, in `self.aux`). Its `train_step(step)` is one training step
(src/loop/step.py), its `evaluate(val)` one evaluation pass (src/loop/evaluation.py); the supervised defaults ask it:

- `split(batch)`: the model's inputs and the target, picked out of a batch of any structure by the binding of the
  task's `inputs` and `target` to the dataset's fields;
- `count(target)`: the batch's units (`unit`: samples, tokens, pixels), before the forward;
- `loss(outputs, target)`: the loss SUMMED over those units (the loop divides by the global count);
- `sums(outputs, target)`: the batch's metric sums by name, all-reduced in one collective;
- `compute(sums)`: the metrics, from the sums over all ranks;
- `check_output`, `check`, `num_outputs`: the model's output checked once, what it needs of a dataset, how wide the
  output must be (`${data:num_outputs}`); `monitor` and `mode`: what decides best.pt by default."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import torch
from torch import nn

from src.common.errors import UsageError

if TYPE_CHECKING:  # annotations only: the loop's modules, which import this one
    from src.loop.evaluation import Evaluation
    from src.loop.step import StepContext

Key = Union[int, str]  # a position in a tuple sample, or a field name (a key of a dict sample)
Shapes = dict[str, tuple[int, ...]]


class Batch(tuple):
    """A batch as the task sees it, `args, kwargs, target = batch`, and as the loader gave it (`fields`)."""

    def __new__(cls, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, fields: Any = None) -> "Batch":
        batch = super().__new__(cls, (args, kwargs, target))
        batch.fields = fields
        return batch

    args = property(lambda self: self[0])  # tuple[Any, ...]
    kwargs = property(lambda self: self[1])  # dict[str, Any]
    target = property(lambda self: self[2])
    inputs = property(lambda self: (self[0], self[1]))  # (args, kwargs)


@dataclass(frozen=True)
class Binding:
    """Where a batch holds the model's `args`, `kwargs` (argument name -> key) and `target`: positions or field names
    (`positions`: a tuple batch's field name -> position)."""

    args: tuple[Key, ...]
    kwargs: dict[str, Key]
    target: Key
    positions: dict[str, int] = field(default_factory=dict)
    dataset: str = "the dataset"  # where the fields come from, for messages: `dataset=two_input_synthetic`

    def split(self, batch: Any) -> Batch:
        if self.positions and not isinstance(batch, Mapping) and len(batch) != len(self.positions):
            raise UsageError(f"{self.dataset} names {len(self.positions)} fields ({', '.join(self.positions)}) but "
                             f"its samples have {len(batch)} parts: name one field per part in DataSplits(fields=...)")
        return Batch(tuple(self._pick(batch, key) for key in self.args),
                     {name: self._pick(batch, key) for name, key in self.kwargs.items()},
                     self._pick(batch, self.target), batch)

    def _pick(self, batch: Any, key: Key) -> Any:
        if isinstance(key, str) and not isinstance(batch, Mapping):
            key = self.positions[key]
        elif isinstance(key, int) and isinstance(batch, Mapping) and self.positions:
            key = list(self.positions)[key]  # a position of a named field, in a dict batch
        return batch[key]


class Task:
    """The base: batch structure, units and monitored metric; subclasses add the loss and metrics. `inputs`: the parts
    passed to the model (None: every field but the target; a position or name, or a list of them; a mapping argument
    -> part); `target`: what the loss compares with (None: the dataset's, else the last part); `monitor`/`mode`: the
    metric (`val/<name>`) that decides best.pt and what sweeps optimise."""

    metric_names: tuple[str, ...] = ("loss",)  # what compute() returns (besides "count")
    models: tuple[str, ...] = ("model",)  # the trained models the task's step uses, by name
    output_model = "model"  # the model eval.py, export, init_from's plain files and EMA take by default
    aux_models: tuple[str, ...] = ()  # the frozen auxiliary models it needs (the config's `aux`), in `self.aux`
    monitor: str | None = "val/loss"  # the default monitored metric and mode, unless the YAML names others
    mode = "min"
    unit = "samples"  # what count() counts: samples | tokens | pixels (log lines, metrics.json, throughput)
    output_width: int | None = None  # what check_output compares with: the output width for the run's dataset
    output_setting = "model.num_outputs"  # and the model setting it names (src/loop/task_and_model.py sets both)

    def __init__(self, inputs: Key | Sequence[Key] | Mapping[str, Key] | None = None, target: Key | None = None,
                 monitor: str | None = None, mode: str | None = None) -> None:
        self.inputs, self.target = [inputs] if isinstance(inputs, (str, int)) else inputs, target  # image: [image]
        self.monitor, self.mode = monitor or type(self).monitor, mode or type(self).mode
        self.binding: Binding | None = None
        self.aux: dict[str, nn.Module] = {}  # the run's frozen auxiliary models, by name (set when the run builds)

    def bind(self, fields: Sequence[str] | None, target: str | None, sample: Any = None,
             dataset: str = "the dataset") -> Binding:
        """Bind `inputs` and `target` to a dataset's `fields` and `target`, or to its `sample`'s structure; a name the
        dataset lacks is one error line."""
        if fields is not None:  # the names of the samples' parts (the dataset's fields, a dict sample's keys), how many
            names, parts = tuple(fields), len(fields)
        elif isinstance(sample, Mapping):
            names, parts = tuple(sample), len(sample)
        else:
            names, parts = None, len(sample) if isinstance(sample, Sequence) else 0
        task_target, inputs = self.target, self.inputs
        if task_target is None:
            task_target = target if target is not None else _default_target(fields, sample, parts, dataset)
        if inputs is None:
            inputs = [key for key in (names if names is not None else range(parts)) if key != task_target]
        positions = {} if names is None else {name: index for index, name in enumerate(names)}
        args, kwargs = ((), dict(inputs)) if isinstance(inputs, Mapping) else (tuple(inputs), {})
        for key in (*args, *kwargs.values()):
            _check_key("task.inputs", key, names, parts, dataset)
        _check_key("task.target", task_target, names, parts, dataset)
        self.binding = Binding(args, kwargs, task_target, positions, dataset)
        return self.binding

    def split(self, batch: Any) -> Batch:
        """The model's inputs and target of `batch` (a task bound to no dataset binds to its first batch)."""
        return (self.binding or self.bind(None, None, batch)).split(batch)

    needs: tuple[str, str] | None = None  # (the info field it learns from, its meaning); its value is the output width

    def check(self, info: Mapping[str, Any]) -> str | None:
        """What makes a dataset with this `info` unfit for the task (None: it fits)."""
        missing = self.needs is not None and self.needs[0] not in info
        return f"needs {self.needs[1]} ({self.needs[0]})" if missing else None

    def num_outputs(self, info: Mapping[str, Any]) -> int:
        """The width of the model output the task expects, for a dataset with this `info`."""
        if self.needs is None:
            raise NotImplementedError(f"{type(self).__name__} names no `needs` field: define num_outputs()")
        return int(info[self.needs[0]])

    def count(self, target: Any) -> int | torch.Tensor:
        """This micro-batch's units, from the target: a host int, or a device tensor (never .item(): no host sync)."""
        return target.shape[0]

    def loss(self, outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss summed over the units `count` counts, in float32. The loop divides by the global count."""
        raise NotImplementedError

    def check_output(self, outputs: torch.Tensor, target: torch.Tensor) -> None:
        """Raise a UsageError (both shapes, the setting to change) if `outputs` cannot fit `target`; once, no sync."""

    def sum_shapes(self, info: Mapping[str, Any]) -> Shapes:
        """Name and shape of every metric sum (besides `loss` and `count`, which every task has)."""
        return {}

    def sums(self, outputs: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        """This batch's metric sums, named as in `sum_shapes` (detached device tensors, no host sync)."""
        return {}

    def batch_sums(self, outputs: torch.Tensor, target: torch.Tensor, loss_sum: torch.Tensor,
                   count: int | torch.Tensor, val: bool = False) -> dict[str, torch.Tensor | int]:
        """Everything a batch adds to the running sums: `loss`, `count`, the task's sums (and val-only ones)."""
        with torch.no_grad():
            extra = self.val_sums(outputs, target) if val else {}
            return {"loss": loss_sum.detach(), "count": count, **self.sums(outputs.detach(), target), **extra}

    def val_sum_shapes(self, info: Mapping[str, Any]) -> Shapes:
        """Sums counted on the val split only (e.g. a confusion matrix), beside `sum_shapes`."""
        return {}

    def val_sums(self, outputs: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    def compute(self, sums: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Metrics (`loss` per unit, `metric_names`, tables as tensors) from the sums over all ranks (float64, CPU)."""
        return {"loss": ratio(sums["loss"], sums["count"])}

    def train_step(self, step: StepContext) -> None:
        """One supervised training step: forward and backward each micro-batch, then the model's update."""
        model = step.models[self.output_model]
        batches = [self.split(batch) for batch in step.batches]
        # Counted from the targets before the first forward: the counts' all-reduce overlaps it.
        divisor = step.divisor([self.count(batch.target) for batch in batches])
        for micro, batch in step.accumulate(batches, [self.output_model]):
            with step.autocast():
                outputs = model(*batch.args, **batch.kwargs)
            if step.first and micro.index == 0:  # a wrong output shape is one line, before any update
                self.check_output(outputs, batch.target)
            loss_sum = self.train_loss(outputs, batch)
            step.backward(loss_sum, divisor)
            step.add_sums(self.batch_sums(outputs, batch.target, loss_sum, divisor.counts[micro.index]))
        step.inputs = batches[0].inputs
        step.optimizer_step(self.output_model)

    @property
    def feeds_batches(self) -> bool:
        """Whether the output model takes each batch's inputs (the built-in step): its `forward` is checked first."""
        return type(self).train_step is Task.train_step

    def train_loss(self, outputs: Any, batch: Batch) -> torch.Tensor:
        """The loss SUM a training micro-step back-propagates: `loss`, or one using the whole batch or `aux` models."""
        return self.loss(outputs, batch.target)

    def evaluate(self, val: Evaluation) -> None:
        """Add every val batch's `val_step` sums; override to evaluate otherwise (a kNN accuracy, generated samples)."""
        for index, (batch, _) in enumerate(val.batches()):
            val.add_sums(self.val_step(batch, val, first=index == 0))

    def val_step(self, batch: Any, val: Evaluation, first: bool = False) -> dict[str, Any]:
        """One val batch's sums: the output model's loss, the task's sums and its val-only sums."""
        split = self.split(batch)
        with val.autocast():
            outputs = val.models[self.output_model](*split.args, **split.kwargs)
        if first:
            self.check_output(outputs, split.target)
        return self.batch_sums(outputs, split.target, self.loss(outputs, split.target), self.count(split.target),
                               val=True)


def ratio(total: torch.Tensor, count: torch.Tensor) -> float:
    """total / count as a float (NaN when nothing was counted)."""
    return float(total) / float(count) if float(count) > 0 else math.nan


def shape(tensor: torch.Tensor) -> str:
    """`(8, 10)`: a shape as people write it, for messages."""
    return f"({', '.join(map(str, tensor.shape))}{',' if tensor.dim() == 1 else ''})"


def _default_target(fields: Sequence[str] | None, sample: Any, parts: int, dataset: str) -> Key:
    """The target of a dataset that names none: its last field, or its tuple samples' last part."""
    if fields is not None:
        return fields[-1]
    if isinstance(sample, Mapping):
        raise UsageError(f"{dataset} gives dict samples ({', '.join(map(str, sample))}) and names no target: set "
                         "task.target=KEY (one of those keys), or name it in the builder's "
                         "DataSplits(fields=..., target=...)")
    if parts < 2:
        raise UsageError(f"{dataset}'s samples have {parts} part(s): none is left for the model once the target is "
                         "taken; give samples of (inputs..., target), or set task.inputs and task.target")
    return parts - 1


def _check_key(setting: str, key: Key, names: tuple[str, ...] | None, parts: int, dataset: str) -> None:
    """Refuse a field name the dataset does not have, or a position past its samples' parts."""
    if isinstance(key, str):
        if names is None:
            raise UsageError(f"{setting} names the field {key!r}, but {dataset} names no fields (its samples are "
                             f"tuples of {parts} parts): use positions, e.g. {setting}=0")
        if key not in names:
            raise UsageError(f"{setting} names the field {key!r}, which {dataset} does not have: its fields are "
                             f"{', '.join(names)}; set {setting} to one of them")
    elif not isinstance(key, int) or isinstance(key, bool) or not 0 <= key < parts:
        what = f"fields {', '.join(names)}" if names is not None else f"{parts} parts"
        raise UsageError(f"{setting}={key} is not a position of {dataset}'s samples, which have {what}; "
                         f"set {setting} to a position from 0 to {parts - 1} or a field name")
